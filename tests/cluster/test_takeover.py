"""Failover with shared storage (--shared-data-root): the replica taking a dead owner's pool
over restores it from the dead owner's write-ahead log. Same incarnation, every
acknowledged Step kept, the Step in flight at the kill applied once, and the client goes
on without registering again; the dead owner, restarted, does not serve the pool."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

from cache_service.client import AllocateResult, AsyncCacheClient, CacheClient, ops
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.launch import start_cache_service
from tests.cluster.conftest import (
    LEASE_TTL,
    SESSION_TTL,
    Cluster,
    owner_of,
    raw_stub,
    small_layers,
    wait_until,
)

pytestmark = pytest.mark.cluster


def test_sigkill_of_an_owner_under_load_loses_no_acknowledged_step(shared: Cluster, tmp_path):
    targets = ",".join(r.target for r in shared.replicas)
    with CacheClient(targets, default_timeout=20, backoff_max=0.2) as client:
        before = client.register_pool("hot", small_layers(), num_blocks=1024,
                                      max_model_len=256)
        victim = shared.by_target(owner_of(shared, "hot"))
        acked: dict[str, list[list[int]]] = {}  # request -> block table the Step answered
        errors: list[Exception] = []
        lost_at: list[float] = []
        back_at: list[float] = []
        stop = threading.Event()

        def load() -> None:
            i = 0
            try:
                while not stop.is_set():
                    rid = f"r{i}"
                    result = client.step("hot", [ops.add(rid, [i, i + 1, i + 2]),
                                                 ops.allocate(rid, 3)])
                    acked[rid] = result.result(1, AllocateResult).block_ids
                    if lost_at and not back_at:
                        back_at.append(time.monotonic())
                    i += 1
            except Exception as exc:  # noqa: BLE001 - the test asserts there is none
                errors.append(exc)

        worker = threading.Thread(target=load)
        worker.start()
        wait_until(lambda: len(acked) >= 20 or errors, 30, "steps before the kill")
        # A call acknowledged by the owner right before it dies, as the client sees a
        # call in doubt: resent under its stamp to the heir, it must be answered, not
        # applied again.
        raw = raw_stub(victim.target)
        sid = raw.OpenSession(pb.OpenSessionRequest(client_name="raw"), timeout=5).session_id
        stamped = pb.StepRequest(pool_id="hot", session_id=sid, sequence=1,
                                 ops=[ops.add("raw", [9, 9, 9]), ops.allocate("raw", 3)])
        first = raw.Step(stamped, timeout=5)
        victim.signal(signal.SIGKILL)
        lost_at.append(time.monotonic())
        wait_until(lambda: back_at or errors, LEASE_TTL + 30, "a step served after the kill")
        stop.set()
        worker.join(30)
        assert not errors, errors  # no NOT_FOUND (state lost), no Step applied twice
        failover = back_at[0] - lost_at[0]
        heir = shared.by_target(owner_of(shared, "hot"))
        assert heir is not victim
        adopted = heir.wait_for(lambda r: r.get("event") == "pool_adopted", 10)
        assert victim.ready_record is not None
        member = victim.ready_record["member"]
        assert adopted["holder"] == member
        assert raw_stub(heir.target).Step(stamped, timeout=5) == first
        after = client.get_pool("hot")
        assert after.incarnation == before.incarnation
        # Every acknowledged Step is there, with the blocks it answered; nothing else.
        acked["raw"] = [list(t.block_ids) for t in first.results[1].allocate.block_ids]
        for rid, table in acked.items():
            assert client.get_request("hot", rid).block_ids == table, rid
        # The client keeps the session the takeover brought along (it owns the requests)
        # alive on the heir: they outlive its lease several times over (an observation
        # window, polled). The raw session is not kept alive: its request expires.
        window = time.monotonic() + 3 * SESSION_TTL
        while time.monotonic() < window:
            assert client.stats("hot").num_requests >= len(acked) - 1
            time.sleep(0.2)
        assert client.stats("hot").num_requests == len(acked) - 1
        # Detection takes at most one lease TTL; reading the dead owner's log and the
        # client's retries take under a second unloaded (margin for a loaded 2-core box).
        assert failover < LEASE_TTL + 5.0, failover

        # The dead owner restarted on its own directory recovers the pool from its log,
        # finds it owned elsewhere and drops it (a logged DeletePool): it never serves it.
        back = start_cache_service(
            "--etcd-endpoints", shared.etcd.endpoint, "--cluster-name", shared.name,
            "--etcd-lease-ttl", str(LEASE_TTL), "--drain-seconds", "1",
            "--shared-data-root", str(tmp_path / "shared"), "--member-id", member)
        shared.replicas.append(back)
        back.wait_for(lambda r: r.get("event") == "ownership_lost"
                      and r.get("pool_id") == "hot", 30)
        assert owner_of(shared, "hot") == heir.target
        assert client.get_pool("hot").incarnation == before.incarnation
        client.step("hot", [ops.append("r0", [7])])
        assert client.get_request("hot", "r0").num_tokens == 4


def test_the_async_client_goes_on_after_a_takeover_under_its_carried_session(shared: Cluster):
    """The asyncio client follows the same rules: the Step after the owner's death goes to
    the heir under the dead owner's session, and that session is kept alive there."""
    targets = ",".join(r.target for r in shared.replicas)

    async def run() -> None:
        async with AsyncCacheClient(targets, default_timeout=20, backoff_max=0.2) as client:
            before = await client.register_pool("async", small_layers(), num_blocks=256,
                                                max_model_len=256)
            for i in range(10):
                await client.step("async", [ops.add(f"a{i}", [i, 1, 2]),
                                            ops.allocate(f"a{i}", 3)])
            victim = shared.by_target(owner_of(shared, "async"))
            victim.signal(signal.SIGKILL)
            await client.step("async", [ops.add("after", [5, 6]), ops.allocate("after", 2)])
            assert (await client.get_pool("async")).incarnation == before.incarnation
            window = time.monotonic() + 3 * SESSION_TTL
            while time.monotonic() < window:  # an observation window, polled
                assert (await client.stats("async")).num_requests == 11
                await asyncio.sleep(0.2)

    asyncio.run(run())
