"""Fixtures of the cluster tier: a real etcd server (the ``etcd`` binary, Debian package
``etcd-server``) and cache-service replicas as processes started the way a user starts
them (``python -m cache_service --etcd-endpoints ...``).

- No ``etcd`` binary (or no ``aetcd``) -> every `cluster` test skips with ONE reason line;
  ``scripts/test.sh`` installs the package when it can.
- One etcd per session (its own data dir and free ports); each test gets its own cluster
  name, so tests share the server but no keys.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TypeVar

import grpc
import pytest

from cache_service.client import layers
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.api.kvcache.v1 import cache_service_pb2_grpc as pb_grpc
from kvcache_common.etcd_launch import EtcdServer, etcd_binary
from kvcache_common.launch import ServerProcess, start_cache_service
from tests.tier_skip import fold_skips_at, skip_tier

#: Short, so that failover tests take seconds (a dead owner is replaced within ~TTL), but not
#: the shortest etcd grants (2 s): a replica renews every TTL/3, and on a loaded 2-core machine
#: a renewal a second late must not cost a live replica its pools.
LEASE_TTL = 3
#: Session lease of the ``shared`` fixture's replicas (seconds).
SESSION_TTL = 3


def _no_etcd_reason() -> str | None:
    if etcd_binary() is None:
        return ("cluster tier: no `etcd` binary on PATH (`apt-get install etcd-server`; "
                "scripts/test.sh installs it)")
    if importlib.util.find_spec("aetcd") is None:
        return "cluster tier: the aetcd package is missing (pip install -e '.[cluster]')"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without etcd, mark every `cluster` test skipped (checked once per session)."""
    skip_tier(config, items, "cluster", _no_etcd_reason)


# Report every no-etcd skip at one location, so `-ra` folds them into ONE line.
pytest_runtest_makereport = fold_skips_at(__file__)


T = TypeVar("T")


def wait_until(predicate: Callable[[], T | None], timeout: float, what: str,
               interval: float = 0.05) -> T:
    """Polls ``predicate`` until it returns a truthy value (answered) or ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data")
    server.start()
    yield server
    server.stop()


class Cluster:
    """Replicas of one cluster (a fresh cluster name per test)."""

    def __init__(self, etcd: EtcdServer) -> None:
        self.etcd = etcd
        self.name = f"t-{uuid.uuid4().hex[:8]}"
        self.replicas: list[ServerProcess] = []

    def start_replica(self, *flags: str, ttl: int = LEASE_TTL) -> ServerProcess:
        replica = start_cache_service(
            "--etcd-endpoints", self.etcd.endpoint, "--cluster-name", self.name,
            "--etcd-lease-ttl", str(ttl), "--drain-seconds", "1", *flags)
        self.replicas.append(replica)
        return replica

    def by_target(self, target: str) -> ServerProcess:
        return next(r for r in self.replicas if r.target == target)

    def stop(self) -> None:
        for replica in self.replicas:
            if replica.returncode is None:
                os.kill(replica.proc.pid, signal.SIGCONT)  # a test may have stopped it
                replica.signal(signal.SIGTERM)  # all drain at once; then wait for each
        for replica in self.replicas:
            replica.stop()


@pytest.fixture
def cluster(etcd: EtcdServer) -> Iterator[Cluster]:
    c = Cluster(etcd)
    yield c
    c.stop()


@pytest.fixture
def three(cluster: Cluster) -> Cluster:
    """A cluster of three replicas."""
    for _ in range(3):
        cluster.start_replica()
    return cluster


@pytest.fixture
def shared(cluster: Cluster, tmp_path) -> Cluster:
    """Three replicas m0..m2 on one shared data root (each logs under <root>/<member>), so
    a replica taking a dead one's pools over restores them from its log. Session leases
    of SESSION_TTL seconds: a test sees within seconds whether clients keep the sessions
    a takeover brought along alive."""
    for i in range(3):
        cluster.start_replica("--shared-data-root", str(tmp_path / "shared"),
                              "--member-id", f"m{i}", "--lease-ttl-seconds", str(SESSION_TTL))
    return cluster


def small_layers() -> list[pb.LayerSpec]:
    return [layers.full_attention(f"l{i}", block_size=16, num_kv_heads=2, head_size=8)
            for i in range(2)]


def raw_stub(target: str) -> pb_grpc.CacheServiceStub:
    """The generated stub on one replica: no redirect following."""
    return pb_grpc.CacheServiceStub(grpc.insecure_channel(target))


def find_owner(cluster: Cluster, pool_id: str, *, with_state: bool = True,
               among: list[ServerProcess] | None = None,
               metadata: tuple[tuple[str, str], ...] = ()) -> str | None:
    """The target of the replica owning ``pool_id`` when every live replica (of ``among``)
    agrees: the owner answers GetPool (or NOT_FOUND when ``with_state`` is False, after a
    takeover without shared storage) and every other replica redirects to it; else None.
    ``metadata``: the caller's (a tenant's token)."""
    answers: dict[str, str] = {}
    for replica in cluster.replicas if among is None else among:
        if replica.returncode is not None:
            continue
        try:
            raw_stub(replica.target).GetPool(pb.GetPoolRequest(pool_id=pool_id), timeout=5,
                                             metadata=metadata)
            answers[replica.target] = "ok"
        except grpc.RpcError as exc:
            owner = dict(exc.trailing_metadata() or ()).get("x-kvcache-owner")
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                answers[replica.target] = f"->{owner}" if owner else "unavailable"
            elif exc.code() == grpc.StatusCode.NOT_FOUND:
                answers[replica.target] = "missing"
            else:
                raise
    owners = [t for t, a in answers.items()
              if a == "ok" or (a == "missing" and not with_state)]
    redirects = [a[2:] for a in answers.values() if a.startswith("->")]
    if len(owners) != 1 or set(redirects) - {owners[0]} or len(redirects) + 1 != len(answers):
        return None
    return owners[0]


def owner_of(cluster: Cluster, pool_id: str, *, with_state: bool = True,
             metadata: tuple[tuple[str, str], ...] = ()) -> str:
    """:func:`find_owner` once the replicas agree (each learns of a placement through its
    etcd watch, a few milliseconds after the fact)."""
    return wait_until(lambda: find_owner(cluster, pool_id, with_state=with_state,
                                         metadata=metadata), 10,
                      f"the replicas agreeing on the owner of {pool_id!r}")


class Partition:
    """A TCP proxy in front of etcd for one replica: :meth:`cut` drops every connection
    and refuses new ones (the replica is partitioned from etcd but still reachable by
    clients), :meth:`heal` forwards again."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.open = True
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                if not self.open:
                    conn.close()
                    continue
                try:
                    up = socket.create_connection(self.upstream, timeout=5)
                except OSError:
                    conn.close()
                    continue
                self._sockets += [conn, up]
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        with self._lock:
            self.open = False
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def heal(self) -> None:
        with self._lock:
            self.open = True

    def close(self) -> None:
        self.cut()
        self.listener.close()
