"""Prefix pins move with their pool in cluster mode (real etcd, real replicas on a shared
data root): after the owner hands the pool over on SIGTERM, or is SIGKILLed and its pools
are taken over from its log, the heir holds the same pins with the same expiries, and a
flood that evicts everything unpinned leaves the pinned prefix cached."""

from __future__ import annotations

import signal

import pytest

from cache_service.client import AllocateResult, CacheClient, StepBuilder
from tests.cluster.conftest import (
    LEASE_TTL,
    Cluster,
    find_owner,
    owner_of,
    small_layers,
    wait_until,
)

pytestmark = pytest.mark.cluster

SYSTEM = list(range(1, 130))  # 129 tokens: 8 blocks of 16 can hit
NUM_BLOCKS = 129  # one 1024-token request cycles half the pool


def _run(client: CacheClient, pool: str, rid: str, tokens: list[int]) -> None:
    step = client.step_batch(StepBuilder(pool).add(rid, tokens).allocate(rid, len(tokens)))
    assert step.result(1, AllocateResult).ok
    client.step_batch(StepBuilder(pool).free(rid))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["handover", "takeover"])
def test_pins_survive_their_pool_moving_to_another_replica(shared: Cluster,
                                                           sig: signal.Signals) -> None:
    targets = ",".join(r.target for r in shared.replicas)
    with CacheClient(targets, default_timeout=60, backoff_max=0.2) as client:
        client.register_pool("pinned", small_layers(), num_blocks=NUM_BLOCKS,
                             max_model_len=1024)
        _run(client, "pinned", "sys", SYSTEM)
        _run(client, "pinned", "other", [7] * 129)  # cached, not pinned
        kept = client.pin_prefix("pinned", "kept", SYSTEM, ttl_seconds=600)
        growing = client.pin_prefix("pinned", "growing", [9] * 65, ttl_seconds=300)
        before = client.stats("pinned")
        assert (before.num_pins, before.num_pinned_blocks) == (2, 8)
        owner = shared.by_target(owner_of(shared, "pinned"))
        owner.signal(sig)
        if sig == signal.SIGTERM:
            assert owner.proc.wait(60) == 0
            owner.wait_for(lambda r: r.get("event") == "handed_over", 1)
        else:
            owner.proc.wait(10)
        heir = wait_until(lambda: (t := find_owner(shared, "pinned")) != owner.target and t,
                          LEASE_TTL + 30, "another replica owning the pool")
        after = client.stats("pinned")
        assert (after.num_pins, after.num_pinned_blocks, after.max_pinned_blocks) == (
            2, 8, before.max_pinned_blocks)
        # The heir's pins grow and hold as the owner's did: cache the growing one's
        # prefix, then cycle the pool twice with one-shot traffic.
        _run(client, "pinned", "nine", [9] * 65)
        for i in range(4):
            _run(client, "pinned", f"flood{i}", [1000 + i] * 1000)
        hits = client.peek_prefix(["pinned"], SYSTEM)
        assert hits["pinned"] == 128
        assert client.peek_prefix(["pinned"], [9] * 65)["pinned"] == 64
        assert client.peek_prefix(["pinned"], [7] * 129)["pinned"] == 0  # evicted
        # Dropping answers each pin with the expiry it was given at the old owner.
        dropped = client.drop_pin("pinned", "kept")
        assert (dropped.expires_at, dropped.num_blocks) == (kept.expires_at, 8)
        assert client.drop_pin("pinned", "growing").expires_at == growing.expires_at
        assert owner_of(shared, "pinned") == heir
