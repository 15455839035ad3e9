"""Failover: owners killed, stopped cleanly, partitioned from etcd; etcd itself restarted."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest

from cache_service.client import CacheClient, CacheError, ops
from cache_service.cluster.keys import rendezvous_owner
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from tests.cluster.conftest import (
    LEASE_TTL,
    Cluster,
    Partition,
    find_owner,
    owner_of,
    raw_stub,
    small_layers,
    wait_until,
)

pytestmark = pytest.mark.cluster


def register(client: CacheClient, pool_id: str):
    return client.register_pool(pool_id, small_layers(), num_blocks=64, max_model_len=256)


def all_targets(cluster: Cluster) -> str:
    return ",".join(r.target for r in cluster.replicas)


def test_sigkill_of_an_owner_under_load_moves_its_pool_within_the_lease_ttl(three: Cluster):
    with CacheClient(all_targets(three), default_timeout=20, backoff_max=0.2) as client:
        register(client, "hot")
        victim = three.by_target(owner_of(three, "hot"))
        acked: list[int] = []
        lost_at: list[float] = []
        back_at: list[float] = []
        stop = threading.Event()

        def load() -> None:
            i = 0
            while not stop.is_set():
                try:
                    client.step("hot", [ops.add(f"r{i}", [1, 2, 3]), ops.free(f"r{i}")])
                    acked.append(i)
                    if lost_at and not back_at:
                        back_at.append(time.monotonic())
                except CacheError as exc:
                    # No shared storage: the new owner has no state for the pool and says
                    # NOT_FOUND; the executor's answer is to register again.
                    assert exc.code == grpc.StatusCode.NOT_FOUND and exc.field == "pool_id", exc
                    register(client, "hot")
                i += 1

        worker = threading.Thread(target=load)
        worker.start()
        wait_until(lambda: len(acked) >= 20, 30, "steps before the kill")
        victim.signal(signal.SIGKILL)
        lost_at.append(time.monotonic())
        wait_until(lambda: back_at, 30, "a step served after the kill")
        stop.set()
        worker.join(30)
    failover = back_at[0] - lost_at[0]
    assert owner_of(three, "hot") != victim.target
    # Detection takes at most one lease TTL; claiming, registering again and the client's
    # retries take well under a second unloaded (the margin is for a loaded 2-core box).
    assert failover < LEASE_TTL + 5.0, failover


def test_sigterm_leaves_at_once_and_the_pool_moves_before_the_lease_would_expire(
        cluster: Cluster):
    # A long TTL: moving within it proves the lease was revoked, not left to expire.
    ttl = 20
    for _ in range(3):
        cluster.start_replica(ttl=ttl)
    with CacheClient(all_targets(cluster)) as client:
        register(client, "calm")
    victim = cluster.by_target(owner_of(cluster, "calm"))
    assert victim.stop() == 0
    stopped = time.monotonic()
    new_owner = wait_until(lambda: find_owner(cluster, "calm", with_state=False), ttl,
                           "the pool owned by a remaining replica")
    assert time.monotonic() - stopped < ttl
    assert new_owner != victim.target
    assert any(r.get("event") == "member_left" for r in victim.records)


def test_a_replica_partitioned_from_etcd_stops_accepting_writes(cluster: Cluster):
    proxy = Partition(cluster.etcd.endpoint)
    try:
        # The first replica is the only member when the pool is placed: it owns it.
        lonely = cluster.start_replica("--etcd-endpoints", proxy.endpoint,
                                       "--member-id", "m0")
        # No session: closing the client must not free the request (its state is checked
        # on the new owner below).
        with CacheClient(lonely.target, session=False) as client:
            register(client, "fenced")
            client.step("fenced", [ops.add("before", [1, 2, 3])])
        cluster.start_replica("--member-id", "m1")
        cluster.start_replica("--member-id", "m2")
        others = cluster.replicas[1:]
        # The pool's standby (--replication sync, the default) holds every write, and
        # etcd names it in sync (what lets it promote its copy). Wait for the record that
        # names the standby of the full membership: the one that claims the pool below (an
        # earlier record may name the first replica that joined, before the second did).
        standby = rendezvous_owner("fenced", ["m1", "m2"])
        lonely.wait_for(lambda r: r.get("event") == "sync_standby_recorded"
                        and r.get("pool_id") == "fenced" and r.get("standby") == standby, 30)
        proxy.cut()
        # etcd expires the partitioned replica's lease; a replica that can reach etcd
        # claims the pool. The partitioned one hears nothing about it.
        wait_until(lambda: find_owner(cluster, "fenced", with_state=False, among=others),
                   LEASE_TTL + 10, "another replica claiming the pool")
        # A write sent straight to the former owner is refused, and not applied.
        with pytest.raises(grpc.RpcError) as refused:
            raw_stub(lonely.target).Step(pb.StepRequest(
                pool_id="fenced", ops=[ops.add("after", [4, 5, 6])]), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "cannot confirm its ownership" in refused.value.details()
        proxy.heal()
        # Back in touch, it learns its lease is gone, drops the pool and joins again.
        lonely.wait_for(lambda r: r.get("event") == "lease_lost", 30)
        lonely.wait_for(lambda r: r.get("event") == "ownership_lost"
                        and r.get("pool_id") == "fenced", 30)
        with CacheClient(",".join(r.target for r in others)) as client:
            # The standby took the pool over with its state: same incarnation, the
            # acknowledged write kept, the refused one applied nowhere.
            assert not register(client, "fenced").created
            assert client.get_request("fenced", "before").num_tokens == 3
            with pytest.raises(CacheError) as missing:
                client.get_request("fenced", "after")
            assert missing.value.code == grpc.StatusCode.NOT_FOUND
    finally:
        proxy.close()


def test_etcd_restart_keeps_every_pool_where_it_was(three: Cluster):
    with CacheClient(all_targets(three), default_timeout=30, backoff_max=0.5) as client:
        for i in range(4):
            register(client, f"k{i}")
            client.step(f"k{i}", [ops.add("kept", [1, 2, 3, 4])])
        owners = {f"k{i}": owner_of(three, f"k{i}") for i in range(4)}
        three.etcd.kill()
        for replica in three.replicas:
            replica.wait_for(lambda r: r.get("event") == "etcd_unreachable", 30)
        three.etcd.start()
        for i in range(4):
            # Served again (writes pause while the lease cannot be confirmed), same owner,
            # same state.
            client.step(f"k{i}", [ops.append("kept", [5])])
            assert client.get_request(f"k{i}", "kept").num_tokens == 5
        assert {f"k{i}": owner_of(three, f"k{i}") for i in range(4)} == owners
    for replica in three.replicas:
        assert not any(r.get("event") in ("lease_lost", "ownership_lost")
                       for r in replica.records), replica.output()


def test_an_owner_restarted_on_its_data_dir_gets_its_pools_back_with_their_state(
        cluster: Cluster, tmp_path):
    """With --data-dir and a stable --member-id (a StatefulSet pod and its volume), a killed
    owner that comes back before its old lease expires wins its pools back by rendezvous
    and serves them from its write-ahead log: same incarnation, every acknowledged Step."""
    ttl = "5"  # room for the restart before the old lease expires

    def start(member: str):
        return cluster.start_replica("--data-dir", str(tmp_path / member), "--member-id",
                                     member, "--etcd-lease-ttl", ttl)

    for member in ("m0", "m1", "m2"):
        start(member)
    with CacheClient(all_targets(cluster), default_timeout=30, backoff_max=0.2) as client:
        register(client, "durable")
        before = client.get_pool("durable")
        owner = cluster.by_target(owner_of(cluster, "durable"))
        assert owner.ready_record is not None
        member = owner.ready_record["member"]
        for i in range(20):
            client.step("durable", [ops.add(f"r{i}", list(range(1, 20)))])
        owner.signal(signal.SIGKILL)
        owner.proc.wait(10)
        restarted = start(member)
        restarted.wait_for(lambda r: r.get("event") == "pool_owned"
                           and r.get("pool_id") == "durable", 30)
        after = client.get_pool("durable")
        assert after.incarnation == before.incarnation
        for i in range(20):  # every acknowledged Step is there
            assert client.get_request("durable", f"r{i}").num_tokens == 19
        client.step("durable", [ops.append("r0", [5])])
    assert owner_of(cluster, "durable") == restarted.target
