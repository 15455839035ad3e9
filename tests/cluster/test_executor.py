"""An executor against a cluster: its pool lives on one replica, reached through redirects;
the owner is SIGKILLed mid-generation and the executor's outputs stay those of an
uninterrupted run. Without a standby or shared storage it registers the pool again and
recomputes; with a standby (replication) or on a shared data root the new owner restores the
pool and the executor goes on after a retry."""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest

from executor.client import ExecutorClient, generate_request
from executor.launch import start_executor
from kvcache_common.launch import ServerProcess
from tests.cluster.conftest import Cluster, owner_of

pytestmark = pytest.mark.cluster

POOL = "exec-pool"


def generate_across_a_kill(cluster: Cluster,
                           ready: Callable[[ServerProcess], object] = lambda owner: None
                           ) -> tuple[ServerProcess, ServerProcess]:
    """Generates with the pool's owner SIGKILLed mid-way; asserts the outputs equal an
    uninterrupted run's. Answers the (stopped) executor and the dead owner."""
    seeds = ",".join(r.target for r in cluster.replicas)
    executor = start_executor(seeds, "--preset", "gemma3-like", "--pool-id", POOL)
    try:
        prompt = list(range(3, 67))
        with ExecutorClient(executor.target) as ex:
            before = ex.generate(prompt, 120)
            owner = cluster.by_target(owner_of(cluster, POOL))
            ready(owner)
            stream = ex.stub.Generate(generate_request(prompt, 120), timeout=120)
            first = next(stream)  # in flight when the owner dies
            owner.signal(signal.SIGKILL)
            rest = list(stream)
            after = ex.generate(prompt, 120)
        got = list(first.token_ids) + [t for m in rest for t in m.token_ids]
        assert got == before.token_ids
        assert after.token_ids == before.token_ids
        assert owner_of(cluster, POOL) != owner.target
    finally:
        executor.stop()
    assert executor.returncode == 0
    return executor, owner


def test_an_executor_survives_the_death_of_its_pools_owner(cluster: Cluster) -> None:
    for _ in range(3):  # no standby, no shared storage: the pool's state dies with it
        cluster.start_replica("--replication", "none")
    executor, _ = generate_across_a_kill(cluster)
    assert any(r.get("event") == "pool_lost" for r in executor.records)


def test_with_a_standby_an_executor_goes_on_without_registering_again(
        three: Cluster) -> None:
    """--replication sync (the default), no shared storage: the pool's standby takes it
    over with its state; the executor's outputs are those of an uninterrupted run and it
    never registers again."""
    def standby_live(owner: ServerProcess) -> None:
        owner.wait_for(lambda r: r.get("event") == "standby_live", 30)

    executor, owner = generate_across_a_kill(three, standby_live)
    assert not any(r.get("event") == "pool_lost" for r in executor.records), executor.output()
    heir = three.by_target(owner_of(three, POOL))
    adopted = heir.wait_for(lambda r: r.get("event") == "pool_adopted", 10)
    assert adopted["via"] == "standby", adopted


def test_on_shared_storage_an_executor_goes_on_without_registering_again(
        shared: Cluster) -> None:
    executor, owner = generate_across_a_kill(shared)
    assert not any(r.get("event") == "pool_lost" for r in executor.records), executor.output()
    heir = shared.by_target(owner_of(shared, POOL))
    adopted = heir.wait_for(lambda r: r.get("event") == "pool_adopted", 10)
    assert owner.ready_record is not None
    assert adopted["holder"] == owner.ready_record["member"]
