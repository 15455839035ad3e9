"""An executor against a cluster: its pool lives on one replica, reached through redirects;
the owner is SIGKILLed mid-generation and the executor's outputs stay those of an
uninterrupted run (no shared storage: it registers the pool again and recomputes)."""

from __future__ import annotations

import signal

import pytest

from executor.client import ExecutorClient, generate_request
from executor.launch import start_executor
from tests.cluster.conftest import Cluster, owner_of

pytestmark = pytest.mark.cluster

POOL = "exec-pool"


def test_an_executor_survives_the_death_of_its_pools_owner(three: Cluster) -> None:
    seeds = ",".join(r.target for r in three.replicas)
    executor = start_executor(seeds, "--preset", "gemma3-like", "--pool-id", POOL)
    try:
        prompt = list(range(3, 67))
        with ExecutorClient(executor.target) as ex:
            before = ex.generate(prompt, 120)
            owner = three.by_target(owner_of(three, POOL))
            stream = ex.stub.Generate(generate_request(prompt, 120), timeout=120)
            first = next(stream)  # in flight when the owner dies
            owner.signal(signal.SIGKILL)
            rest = list(stream)
            after = ex.generate(prompt, 120)
        got = list(first.token_ids) + [t for m in rest for t in m.token_ids]
        assert got == before.token_ids
        assert after.token_ids == before.token_ids
        executor.wait_for(lambda r: r.get("event") == "pool_lost", timeout=10)
        assert owner_of(three, POOL) != owner.target
    finally:
        executor.stop()
    assert executor.returncode == 0
