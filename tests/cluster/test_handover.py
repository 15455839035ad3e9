"""Everyday operations under client load with shared storage (--shared-data-root): a rolling
restart hands every pool over through a sealed log and a hand-over file, and etcd killed
and restarted costs no pool. One rule is checked: every Step a client saw acknowledged is
on the pool's final owner exactly as it was answered, and what it freed is gone."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import aetcd
import grpc
import pytest

from cache_service.client import AllocateResult, AsyncCacheClient, CacheClient, CacheError, ops
from kvcache_common.launch import ServerProcess
from tests.cluster.conftest import LEASE_TTL, Cluster, owner_of, small_layers, wait_until

pytestmark = pytest.mark.cluster

POOLS = [f"p{i}" for i in range(6)]
THREADS = 3  # each drives two pools through a client of its own
SESSION_TTL = 4  # session leases: a session left behind by a move expires within the test


@dataclass
class Load:
    """Client threads stepping ``POOLS``: each Step adds a request and allocates its blocks,
    every third one also frees the request added two Steps before (in the same Step)."""

    targets: str
    acked: dict[tuple[str, str], tuple[list[list[int]], int]] = field(default_factory=dict)
    freed: set[tuple[str, str]] = field(default_factory=set)
    errors: list[BaseException] = field(default_factory=list)
    last_ack: dict[str, float] = field(default_factory=dict)
    stall: dict[str, float] = field(default_factory=dict)  # pool -> longest gap between acks
    stop: threading.Event = field(default_factory=threading.Event)
    checked: threading.Event = field(default_factory=threading.Event)  # check now
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for t in range(THREADS):
            pools = POOLS[t::THREADS]
            self.threads.append(threading.Thread(target=self._run, args=(pools,), daemon=True))
        for thread in self.threads:
            thread.start()

    def _run(self, pools: list[str]) -> None:
        try:
            with CacheClient(self.targets, default_timeout=30, backoff_max=0.1) as client:
                i = 0
                while not self.stop.is_set():
                    pool = pools[i % len(pools)]
                    rid = f"r{i}"
                    step = [ops.add(rid, [i, i + 1, i + 2, i + 3]), ops.allocate(rid, 4)]
                    old = f"r{i - 2 * len(pools)}"
                    if i % 3 == 0 and (pool, old) in self.acked:
                        step.append(ops.free(old))
                    result = client.step(pool, step)
                    now = time.monotonic()
                    self.acked[(pool, rid)] = (result.result(1, AllocateResult).block_ids, 4)
                    if len(step) == 3:
                        self.freed.add((pool, old))
                    if pool in self.last_ack:
                        gap = now - self.last_ack[pool]
                        self.stall[pool] = max(self.stall.get(pool, 0.0), gap)
                    self.last_ack[pool] = now
                    i += 1
                # The client stays open (its sessions own the requests) until checked.
                self.checked.wait(120)
                self.check(client, pools)
        except BaseException as exc:  # noqa: BLE001 - the test asserts there is none
            self.errors.append(exc)

    def acks(self) -> dict[str, int]:
        counts = dict.fromkeys(POOLS, 0)
        for pool, _ in list(self.acked):
            counts[pool] += 1
        return counts

    def wait_progress(self, more: int, timeout: float, what: str) -> None:
        """Waits until every pool has ``more`` acknowledged Steps beyond now (or an error)."""
        base = self.acks()
        wait_until(lambda: self.errors or all(n >= base[p] + more
                                              for p, n in self.acks().items()),
                   timeout, what)
        assert not self.errors, self.errors

    def pause(self) -> None:
        """Stops stepping (the clients stay open, keeping their sessions alive)."""
        self.stop.set()

    def finish(self) -> None:
        """Each client checks its own pools (:meth:`check`), then closes."""
        self.stop.set()
        self.checked.set()
        for thread in self.threads:
            thread.join(120)
        assert not self.errors, self.errors

    def check(self, client: CacheClient, pools: list[str]) -> None:
        """Every acknowledged request as answered (blocks, tokens); freed ones gone."""
        for (pool, rid), (blocks, tokens) in sorted(self.acked.items()):
            if pool not in pools:
                continue
            if (pool, rid) in self.freed:
                with pytest.raises(CacheError) as gone:
                    client.get_request(pool, rid)
                assert gone.value.code == grpc.StatusCode.NOT_FOUND, (pool, rid)
                continue
            try:
                info = client.get_request(pool, rid)
            except CacheError as exc:
                raise AssertionError(f"{pool} {rid} {exc}") from None
            assert (info.block_ids, info.num_tokens) == (blocks, tokens), (pool, rid)
        for pool in pools:
            live = sum(1 for key in self.acked if key[0] == pool and key not in self.freed)
            assert client.stats(pool).num_requests == live, pool


def members_in_etcd(cluster: Cluster) -> set[str]:
    """The member ids registered under the cluster's ``members/`` prefix now."""
    async def listing() -> set[str]:
        host, port = cluster.etcd.endpoint.rsplit(":", 1)
        prefix = f"/kvcache/{cluster.name}/members/".encode()
        async with aetcd.Client(host=host, port=int(port)) as client:
            return {kv.key[len(prefix):].decode() for kv in await client.get_prefix(prefix)}
    return asyncio.run(listing())


def start_member(cluster: Cluster, root: Path, member: str, port: int = 0) -> ServerProcess:
    return cluster.start_replica("--shared-data-root", str(root), "--member-id", member,
                                 "--port", str(port), "--lease-ttl-seconds", str(SESSION_TTL))


def register_all(targets: str) -> None:
    with CacheClient(targets, default_timeout=30) as client:
        for pool in POOLS:
            client.register_pool(pool, small_layers(), num_blocks=4096, max_model_len=256)


def loaded_cluster(cluster: Cluster, root: Path, before: str) -> tuple[list[ServerProcess], Load]:
    """Three members on the shared ``root``, every pool registered, the load running and
    past 10 steps on every pool (``before``: what the wait is for, in its timeout message)."""
    members = [start_member(cluster, root, f"m{i}") for i in range(3)]
    targets = ",".join(r.target for r in members)
    register_all(targets)
    load = Load(targets)
    load.start()
    load.wait_progress(10, 60, f"steps on every pool before {before}")
    return members, load


def finish_after_a_window(load: Load) -> None:
    """Pauses the load for two session lease TTLs, then checks it: sessions a move carried
    to another replica must be kept alive there (their requests outlive the lease)."""
    load.pause()
    window = time.monotonic() + 2 * SESSION_TTL
    wait_until(lambda: time.monotonic() > window, 3 * SESSION_TTL, "the window")
    load.finish()


def test_a_rolling_restart_under_load_hands_every_pool_over_and_loses_nothing(
        cluster: Cluster, tmp_path):
    root = tmp_path / "shared"
    members, load = loaded_cluster(cluster, root, "the restart")
    for i, old in enumerate(list(members)):
        port = old.port
        old.signal(signal.SIGTERM)
        assert old.proc.wait(60) == 0
        handed = old.wait_for(lambda r: r.get("event") == "handed_over", 1)
        members[i] = start_member(cluster, root, f"m{i}", port)
        # Every pool answers again (and keeps doing so) before the next replica goes.
        load.wait_progress(5, 60, f"steps on every pool after restarting m{i}")
        assert handed["seconds"] < LEASE_TTL, handed
    load.wait_progress(5, 60, "steps on every pool after the rolling restart")
    finish_after_a_window(load)
    for pool in POOLS:
        owner_of(cluster, pool)  # one owner, the others redirect to it
    # A pool moves in a few etcd round trips, not after a lease TTL (a loaded 2-core box
    # is the margin; bench/bench_cluster.py measures the stall).
    assert max(load.stall.values()) < LEASE_TTL, load.stall


def test_etcd_killed_for_five_seconds_under_load_loses_no_pool_and_every_replica_rejoins(
        cluster: Cluster, tmp_path):
    members, load = loaded_cluster(cluster, tmp_path / "shared", "etcd dies")
    cluster.etcd.kill()
    for replica in members:
        replica.wait_for(lambda r: r.get("event") == "etcd_unreachable", 30)
    # The outage itself (the fault, not a synchronization): longer than the lease TTL.
    outage = time.monotonic() + 5
    wait_until(lambda: time.monotonic() > outage, 10, "the outage")
    cluster.etcd.start()
    load.wait_progress(10, 90, "steps on every pool after etcd came back")
    finish_after_a_window(load)
    for pool in POOLS:
        owner_of(cluster, pool)
    # Every replica is a member again (renewed its lease, or joined under a new one).
    for replica in members:
        assert replica.returncode is None, replica.output()
    wait_until(lambda: members_in_etcd(cluster) == {"m0", "m1", "m2"}, 30,
               "every replica registered in etcd")
    with CacheClient(",".join(r.target for r in members), default_timeout=30) as client:
        for pool in POOLS:
            client.step(pool, [ops.add("after", [1, 2])])
    for replica in members:
        assert not any(r.get("event") == "pool_not_adopted" for r in replica.records)


def first_member_pool(targets: str, cluster: Cluster, first: ServerProcess) -> str:
    """A pool (registered here) that ``first``, the first seed, owns: the clients' channel
    to it is their first (see below)."""
    with CacheClient(targets, default_timeout=30) as client:
        for i in range(24):
            pool = f"idle{i}"
            client.register_pool(pool, small_layers(), num_blocks=256, max_model_len=256)
            if owner_of(cluster, pool) == first.target:
                return pool
    raise AssertionError("no pool placed on the first member")


def restart_after_handover(cluster: Cluster, root: Path, members: list[ServerProcess],
                           pool: str) -> str:
    """SIGTERMs members[0] (it hands ``pool`` over), restarts it on its address and member
    id, and returns the heir once the restarted member redirects to it."""
    old = members[0]
    old.signal(signal.SIGTERM)
    assert old.proc.wait(60) == 0
    old.wait_for(lambda r: r.get("event") == "handed_over", 1)
    members[0] = start_member(cluster, root, "m0", old.port)
    heir = owner_of(cluster, pool)  # one owner; the restarted member redirects to it
    assert heir != old.target
    return heir


@pytest.mark.parametrize("read_first", [False, True], ids=["step", "read-first"])
def test_a_pool_handed_over_while_idle_keeps_the_requests_of_the_session_it_brought(
        cluster: Cluster, tmp_path, read_first: bool):
    """The owner X hands an idle pool over to Y and restarts on its address; the client's
    next Step goes to X, is redirected and answered at Y under the client's session there
    (``read_first``: a read was redirected first, the Step goes to Y directly). X's session,
    which Y took over with the pool (it owns the requests added at X), is kept alive at Y by
    the client: after more than two session leases of idleness, every request is still
    there with its blocks."""
    root = tmp_path / "shared"
    members = [start_member(cluster, root, f"m{i}") for i in range(3)]
    targets = ",".join(r.target for r in members)
    pool = first_member_pool(targets, cluster, members[0])
    with CacheClient(targets, default_timeout=30, backoff_max=0.2) as client:
        tables = {}
        for i in range(5):
            result = client.step(pool, [ops.add(f"r{i}", [i, 1, 2]), ops.allocate(f"r{i}", 3)])
            tables[f"r{i}"] = result.result(1, AllocateResult).block_ids
        restart_after_handover(cluster, root, members, pool)
        # The client's channel to X (its first: X is the first seed) is connected again, so
        # the Step meets X's redirect (not a refused connection: X given up, its session
        # carried along, a case of its own).
        client.wait_connected(30)
        if read_first:
            assert client.get_request(pool, "r0").block_ids == tables["r0"]
        result = client.step(pool, [ops.add("after", [7, 8]), ops.allocate("after", 2)])
        tables["after"] = result.result(1, AllocateResult).block_ids
        # Idleness is the point: no call for over two session leases.
        idle = time.monotonic() + 2 * SESSION_TTL + 1
        wait_until(lambda: time.monotonic() > idle, 3 * SESSION_TTL, "the idle window")
        for rid, table in tables.items():
            assert client.get_request(pool, rid).block_ids == table, rid


def test_the_async_client_keeps_the_session_of_a_redirecting_replica_alive_too(
        cluster: Cluster, tmp_path):
    """The asyncio client follows the same rule (see the test above)."""
    root = tmp_path / "shared"
    members = [start_member(cluster, root, f"m{i}") for i in range(3)]
    targets = ",".join(r.target for r in members)
    pool = first_member_pool(targets, cluster, members[0])

    async def run() -> None:
        async with AsyncCacheClient(targets, default_timeout=30, backoff_max=0.2) as client:
            tables = {}
            for i in range(5):
                result = await client.step(pool, [ops.add(f"r{i}", [i, 1, 2]),
                                                  ops.allocate(f"r{i}", 3)])
                tables[f"r{i}"] = result.result(1, AllocateResult).block_ids
            await asyncio.to_thread(restart_after_handover, cluster, root, members, pool)
            await client.wait_connected(30)
            result = await client.step(pool, [ops.add("after", [7, 8]),
                                              ops.allocate("after", 2)])
            tables["after"] = result.result(1, AllocateResult).block_ids
            await asyncio.sleep(2 * SESSION_TTL + 1)  # idleness is the point (no call)
            for rid, table in tables.items():
                assert (await client.get_request(pool, rid)).block_ids == table, rid

    asyncio.run(run())
