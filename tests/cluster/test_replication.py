"""Replication (``--replication sync``, the default): failover without shared storage.

Three replicas, each with its own ``--data-dir`` and no ``--shared-data-root``; real etcd,
real processes, real signals. The chaos tier's load client and checker judge the outcome:
every Step a client saw acknowledged is on the promoted standby exactly once.
"""

from __future__ import annotations

import os
import signal
import socket
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cache_service.client import CacheClient, ops
from cache_service.cluster.replication import standby_of
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.launch import ServerProcess
from tests.chaos.checker import check
from tests.chaos.load import Load
from tests.cluster.conftest import (
    LEASE_TTL,
    Cluster,
    owner_of,
    raw_stub,
    small_layers,
    wait_until,
)

pytestmark = pytest.mark.cluster

MEMBERS = [f"m{i}" for i in range(3)]


@pytest.fixture
def standbys(cluster: Cluster, tmp_path: Path) -> Cluster:
    """Three replicas m0..m2, each on its own data directory (no shared storage)."""
    for member in MEMBERS:
        cluster.start_replica("--data-dir", str(tmp_path / member), "--member-id", member,
                              "--lease-ttl-seconds", "30")
    return cluster


def targets(cluster: Cluster) -> str:
    return ",".join(r.target for r in cluster.replicas)


def member_of(cluster: Cluster, replica: ServerProcess) -> str:
    return MEMBERS[cluster.replicas.index(replica)]


def by_member(cluster: Cluster, member: str) -> ServerProcess:
    return cluster.replicas[MEMBERS.index(member)]


def incarnation(target: str, pool_id: str) -> int:
    return raw_stub(target).GetPool(pb.GetPoolRequest(pool_id=pool_id),
                                    timeout=5).config.incarnation


def live_standby(replica: ServerProcess, standby: str) -> None:
    """Waits until ``replica`` logs its link to ``standby`` caught up."""
    replica.wait_for(lambda r: r.get("event") == "standby_live"
                     and r.get("standby") == standby, 30)


def test_sigkill_of_the_owner_under_load_loses_no_acknowledged_step(standbys: Cluster):
    load = Load(targets(standbys), seed=7, pools=3, prefix="repl").start()
    try:
        pool = load.histories[0].pool_id
        owner = standbys.by_target(owner_of(standbys, pool))
        me = member_of(standbys, owner)
        standby = by_member(standbys, standby_of(pool, me, MEMBERS) or "")
        live_standby(owner, member_of(standbys, standby))
        before = incarnation(owner.target, pool)
        load.wait_steps(20)
        owner.signal(signal.SIGKILL)
        owner.stop()
        load.wait_steps(20, pool=0)  # served again, by the promoted standby
    finally:
        load.stop()
    try:
        survivors = [r for r in standbys.replicas if r is not owner]
        with CacheClient(",".join(r.target for r in survivors), default_timeout=30,
                         session=False) as reader:
            verdict = check(reader, load.histories)
    finally:
        load.close()
    assert verdict.exact, verdict.explain()
    # No re-registration: no worker saw NOT_FOUND (it would have ended, "rejected").
    assert verdict.acknowledged > 40 and not verdict.rejected, verdict.explain()
    assert owner_of(standbys, pool) == standby.target
    assert incarnation(standby.target, pool) == before
    adopted = standby.wait_for(lambda r: r.get("event") == "pool_adopted"
                               and r.get("pool_id") == pool, 5)
    assert adopted["via"] == "standby", adopted


def test_killing_the_standby_leaves_the_owner_serving_and_a_new_standby_is_filled(
        standbys: Cluster):
    with CacheClient(targets(standbys), default_timeout=30) as client:
        client.register_pool("solo", small_layers(),
                             num_blocks=64, max_model_len=256)
        owner = standbys.by_target(owner_of(standbys, "solo"))
        me = member_of(standbys, owner)
        first = standby_of("solo", me, MEMBERS)
        assert first is not None
        live_standby(owner, first)
        client.step("solo", [ops.add("a", [1, 2, 3])])
        victim = by_member(standbys, first)
        victim.signal(signal.SIGKILL)
        victim.stop()
        # The owner keeps answering: at worst after the dead standby's lease ran out (a
        # new standby is chosen) or the replication timeout (degraded).
        client.step("solo", [ops.add("b", [4, 5, 6])])
        second = standby_of("solo", me, [m for m in MEMBERS if m != first])
        assert second is not None and second != first
        live_standby(owner, second)
        client.step("solo", [ops.free("a")])
        assert client.get_request("solo", "b").num_tokens == 3


def test_an_owner_stopped_past_its_lease_cannot_get_a_write_acknowledged(
        standbys: Cluster):
    with CacheClient(targets(standbys), default_timeout=30) as client:
        client.register_pool("paused", small_layers(), num_blocks=64, max_model_len=256)
        owner = standbys.by_target(owner_of(standbys, "paused"))
        me = member_of(standbys, owner)
        standby = by_member(standbys, standby_of("paused", me, MEMBERS) or "")
        live_standby(owner, member_of(standbys, standby))
        client.step("paused", [ops.add("kept", [1, 2, 3])])
        os.kill(owner.proc.pid, signal.SIGSTOP)
        try:
            standby.wait_for(lambda r: r.get("event") == "pool_adopted"
                             and r.get("pool_id") == "paused", LEASE_TTL * 5)
        finally:
            os.kill(owner.proc.pid, signal.SIGCONT)
        # Sent straight to the resumed former owner: refused, and applied nowhere.
        with pytest.raises(grpc.RpcError) as refused:
            raw_stub(owner.target).Step(pb.StepRequest(
                pool_id="paused", ops=[ops.add("late", [4, 5, 6])]), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        wait_until(lambda: owner_of(standbys, "paused") == standby.target, 30,
                   "the replicas agreeing on the promoted standby")
        assert client.get_request("paused", "kept").num_tokens == 3
        with pytest.raises(Exception) as gone:
            client.get_request("paused", "late")
        assert "NOT_FOUND" in str(gone.value) or "not found" in str(gone.value).lower()


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def degraded(replica: ServerProcess) -> float | None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{replica.metrics_port}/metrics",
                                  timeout=5).read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "kvcache_replication_degraded":
            return family.samples[0].value
    return None


def test_a_lost_standby_degrades_the_owner_then_a_new_one_catches_up_under_load(
        cluster: Cluster, tmp_path: Path):
    ports = free_ports(3)

    def start(i: int) -> ServerProcess:
        return cluster.start_replica("--data-dir", str(tmp_path / MEMBERS[i]), "--member-id",
                                     MEMBERS[i], "--port", str(ports[i]),
                                     "--metrics-port", "0", "--lease-ttl-seconds", "30")

    first = [start(0), start(1)]
    seeds = ",".join(f"127.0.0.1:{port}" for port in ports)  # m2 starts later
    load = Load(seeds, seed=11, pools=1, prefix="deg").start()
    try:
        pool = load.histories[0].pool_id
        owner = cluster.by_target(owner_of(cluster, pool))
        (standby,) = [r for r in first if r is not owner]
        live_standby(owner, member_of(cluster, standby))
        assert degraded(owner) == 0.0
        before = incarnation(owner.target, pool)
        load.wait_steps(10)
        standby.signal(signal.SIGKILL)
        standby.stop()
        # The owner keeps serving without a standby once the dead one's lease is gone
        # (no other member is left to be one), and says so.
        load.wait_steps(10)
        wait_until(lambda: degraded(owner) == 1.0, 30, "kvcache_replication_degraded 1")
        newcomer = start(2)
        # The new member is the pool's standby now: filled (snapshot + tail) while the
        # load runs on.
        live_standby(owner, "m2")
        wait_until(lambda: degraded(owner) == 0.0, 30, "kvcache_replication_degraded 0")
        load.wait_steps(10)
        owner.signal(signal.SIGKILL)
        owner.stop()
        load.wait_steps(10, pool=0)
    finally:
        load.stop()
    try:
        with CacheClient(newcomer.target, default_timeout=30, session=False) as reader:
            verdict = check(reader, load.histories)
    finally:
        load.close()
    assert verdict.exact, verdict.explain()
    assert verdict.acknowledged >= 40 and not verdict.rejected, verdict.explain()
    assert incarnation(newcomer.target, pool) == before


def test_owner_and_standby_lost_together_start_the_pool_anew_never_stale(standbys: Cluster):
    with CacheClient(targets(standbys), default_timeout=30, backoff_max=0.2) as client:
        info = client.register_pool("twice", small_layers(), num_blocks=64,
                                    max_model_len=256)
        owner = standbys.by_target(owner_of(standbys, "twice"))
        me = member_of(standbys, owner)
        standby = by_member(standbys, standby_of("twice", me, MEMBERS) or "")
        live_standby(owner, member_of(standbys, standby))
        client.step("twice", [ops.add("x", [1, 2, 3])])
        for victim in (owner, standby):
            victim.signal(signal.SIGKILL)
        for victim in (owner, standby):
            victim.stop()
        (last,) = [r for r in standbys.replicas if r.returncode is None]
        # The third replica has no copy of the owner's state: the pool is absent there
        # (clients register it again), not served from anything stale.
        last.wait_for(lambda r: r.get("event") == "pool_not_adopted"
                      and r.get("pool_id") == "twice", LEASE_TTL * 5)
        with pytest.raises(grpc.RpcError) as missing:
            raw_stub(last.target).GetPool(pb.GetPoolRequest(pool_id="twice"), timeout=5)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        again = client.register_pool("twice", small_layers(), num_blocks=64,
                                     max_model_len=256)
        assert again.created and again.incarnation != info.incarnation


def test_a_standby_stopped_past_the_timeout_never_promotes_its_stale_copy(
        cluster: Cluster, tmp_path: Path):
    """The standby is frozen (SIGSTOP: its stream does not break, it notices nothing) until
    the owner goes on without it; then the owner dies and the standby resumes. Its copy
    lacks a Step the client saw acknowledged: it must not be promoted (etcd no longer
    names it in sync), so the client is told the pool is a new incarnation."""
    replicas = [cluster.start_replica("--data-dir", str(tmp_path / member), "--member-id",
                                      member, "--lease-ttl-seconds", "30")
                for member in MEMBERS[:2]]
    with CacheClient(targets(cluster), default_timeout=30, backoff_max=0.2) as client:
        info = client.register_pool("frozen", small_layers(), num_blocks=64,
                                    max_model_len=256)
        owner = cluster.by_target(owner_of(cluster, "frozen"))
        (standby,) = [r for r in replicas if r is not owner]
        name = member_of(cluster, standby)
        live_standby(owner, name)
        client.step("frozen", [ops.add("early", [1, 2, 3])])
        owner.wait_for(lambda r: r.get("event") == "sync_standby_recorded"
                       and r.get("pool_id") == "frozen" and r.get("standby") == name, 30)
        os.kill(standby.proc.pid, signal.SIGSTOP)
        try:
            # Answered once the frozen standby's lease ran out (the owner has no standby
            # left), and only after etcd records that none is in sync.
            client.step("frozen", [ops.add("late", [4, 5, 6])])
            recorded = owner.wait_for(lambda r: r.get("event")
                                      == "replication_degraded_recorded"
                                      and r.get("pool_id") == "frozen", 5)
            assert recorded["standby"] == name
            owner.signal(signal.SIGKILL)
            owner.stop()
        finally:
            os.kill(standby.proc.pid, signal.SIGCONT)
        standby.wait_for(lambda r: r.get("event") in ("pool_adopted", "pool_not_adopted")
                         and r.get("pool_id") == "frozen", LEASE_TTL * 10)
        # Told: the pool is gone (a new incarnation), never served from a copy without
        # "late" (the owner is dead: the standby could not catch up).
        with pytest.raises(grpc.RpcError) as missing:
            raw_stub(standby.target).GetPool(pb.GetPoolRequest(pool_id="frozen"), timeout=5)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND, missing.value
        unusable = standby.wait_for(lambda r: r.get("event") == "standby_copy_unusable"
                                    and r.get("pool_id") == "frozen", 5)
        assert unusable["named"] is None, unusable
        again = client.register_pool("frozen", small_layers(), num_blocks=64,
                                     max_model_len=256)
        assert again.created and again.incarnation != info.incarnation
