"""The chaos tier's scenarios: a fault under seeded client load (``load.py``), then the one
checker (``checker.py``). Shared by the tests (``test_chaos.py``, a short seeded set) and
the benchmark (``bench/bench_chaos.py``, more runs).

Each scenario is ``run(seed, workdir) -> Verdict`` with real processes: cache-service
servers (``python -m cache_service``), a real etcd for cluster mode, real signals, real
files. Cluster scenarios run 3 replicas on one shared data root (``--shared-data-root``,
a successor restores a pool from its owner's files) with a 3 s etcd lease; the
``standby_*`` ones run them each on its own data directory, the pool's standby
(``--replication sync``) taking it over.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import grpc

from cache_service.client import CacheClient
from cache_service.wal import HEADER_SIZE, SEGMENT_HEADER_SIZE
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.api.kvcache.v1 import cache_service_pb2_grpc as pb_grpc
from kvcache_common.etcd_launch import EtcdServer
from kvcache_common.launch import ServerProcess, start_cache_service
from tests.service.tcp_proxy import TcpProxy

from .checker import Verdict, check
from .load import Load

LEASE_TTL = 3  # etcd lease of the replicas (seconds), as the cluster tier
STEPS = 10  # acknowledged Steps before and after each fault (over all pools)


def _check(target: str, load: Load) -> Verdict:
    load.stop()
    try:
        with CacheClient(target, default_timeout=30, session=False) as reader:
            return check(reader, load.histories)
    finally:
        load.close()


# -- one server -----------------------------------------------------------------------------


def _server(data_dir: Path, *flags: str) -> ServerProcess:
    return start_cache_service("--data-dir", str(data_dir), *flags)


def lost_answers(seed: int, workdir: Path) -> Verdict:
    """Answers reset by a proxy right after their HTTP/2 headers, again and again: the
    clients resend under the same stamps and see the original answers."""
    with _server(workdir / "data") as server, TcpProxy(server.target) as proxy:
        load = Load(proxy.target, seed).start()
        load.wait_steps(STEPS)
        for _ in range(5):
            proxy.arm("headers")
            load.wait_steps(3)
        return _check(server.target, load)


def wal_records(path: Path) -> list[int]:
    """The byte offset of every record of a log segment."""
    data = path.read_bytes()
    offsets, at = [], SEGMENT_HEADER_SIZE
    while at + HEADER_SIZE <= len(data):
        offsets.append(at)
        at += HEADER_SIZE + int.from_bytes(data[at:at + 4], "little")
    return offsets


def damaged_log(seed: int, workdir: Path, *, where: str) -> Verdict:
    """SIGKILL after load, one byte of a record in the middle of the log flipped (``where``:
    ``"payload"`` or ``"length"``): the next start must refuse, naming the file and the
    record's offset, never start on what is left. The verdict is the checker's before the
    damage, plus an error if the start was not refused."""
    data_dir = workdir / "data"
    with _server(data_dir, "--snapshot-every", "100000") as server:
        load = Load(server.target, seed).start()
        load.wait_steps(2 * STEPS)
        verdict = _check(server.target, load)
        server.signal(signal.SIGKILL)
        server.stop()
    path = sorted(data_dir.glob("wal-*.log"))[-1]
    offsets = wal_records(path)
    record = offsets[len(offsets) // 2]
    data = bytearray(path.read_bytes())
    data[record + (HEADER_SIZE + 1 if where == "payload" else 1)] ^= 0x40
    path.write_bytes(bytes(data))
    try:
        with _server(data_dir):
            verdict.errors.append(f"started on a log damaged at byte {record} ({where})")
            verdict.mismatched.append("log")
    except RuntimeError as exc:
        if str(path) not in str(exc) or str(record) not in str(exc):
            verdict.errors.append(f"refused without naming {path.name} at {record}: {exc}")
            verdict.mismatched.append("log")
    return verdict


@contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                   check=True, capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def can_mount() -> str | None:
    """None when this process may mount a tmpfs, else why not (one line)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return "disk full needs root to mount a small tmpfs; skipped"
    return None


def disk_full(seed: int, workdir: Path) -> Verdict:
    """The data dir on a 1 MiB tmpfs, all but ~24 KiB of it taken by a ballast file: the
    load runs until the disk is full (a Step is refused), then space comes back (the
    ballast is deleted), a second load runs, and after SIGKILL + restart everything either
    load saw acknowledged is there exactly once."""
    with _tmpfs(workdir / "small", "1m") as mount:
        data_dir = mount / "data"
        server = _server(data_dir, "--snapshot-every", "100000")
        try:
            ballast = mount / "ballast"
            room = os.statvfs(mount)
            ballast.write_bytes(b"\0" * max(room.f_bavail * room.f_frsize - 24 * 1024, 0))
            full = Load(server.target, seed, prefix="full").start()
            deadline = time.monotonic() + 120
            while not full.done():
                if time.monotonic() > deadline:
                    raise TimeoutError("the disk did not fill up in 120 s")
                full.wait_steps(50)
            full.stop()
            ballast.unlink()
            after = Load(server.target, seed + 1, prefix="after").start()
            after.wait_steps(STEPS)
            after.stop()
            server.signal(signal.SIGKILL)
            server.stop()
            server = _server(data_dir)
            with CacheClient(server.target, default_timeout=30, session=False) as reader:
                verdict = check(reader, full.histories + after.histories)
            full.close()
            after.close()
            return verdict
        finally:
            server.stop()


# -- a cluster ------------------------------------------------------------------------------


class Replicas:
    """Three replicas m0..m2 of one cluster on a shared data root; a replica restarted
    comes back on its own port (the clients' seed list stays valid)."""

    def __init__(self, etcd: EtcdServer, root: Path, name: str, *,
                 standby: bool = False) -> None:
        self.etcd, self.root, self.name = etcd, root, name
        self.standby = standby
        self.procs: list[ServerProcess] = [self._start(i) for i in range(3)]
        self.ports = [p.port for p in self.procs]

    def _start(self, i: int, port: int = 0) -> ServerProcess:
        # standby: each replica on its own data directory, no shared storage (a pool's
        # state survives its owner through the owner's standby, --replication sync).
        storage = (["--data-dir", str(self.root / f"m{i}")] if self.standby
                   else ["--shared-data-root", str(self.root)])
        return start_cache_service(
            "--port", str(port), "--etcd-endpoints", self.etcd.endpoint,
            "--cluster-name", self.name, "--etcd-lease-ttl", str(LEASE_TTL),
            "--drain-seconds", "1", *storage,
            "--member-id", f"m{i}", "--lease-ttl-seconds", "30")

    @property
    def target(self) -> str:
        return ",".join(f"127.0.0.1:{port}" for port in self.ports)

    def restart(self, i: int) -> None:
        self.procs[i] = self._start(i, self.ports[i])

    def owner(self, pool_id: str) -> int:
        """The index of the replica that answers for ``pool_id`` itself."""
        for i, proc in enumerate(self.procs):
            if proc.returncode is not None:
                continue
            with grpc.insecure_channel(proc.target) as channel:
                try:
                    pb_grpc.CacheServiceStub(channel).GetPool(
                        pb.GetPoolRequest(pool_id=pool_id), timeout=5)
                    return i
                except grpc.RpcError:
                    continue
        raise LookupError(f"no replica owns {pool_id!r}")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.returncode is None:
                with suppress(ProcessLookupError):
                    os.kill(proc.proc.pid, signal.SIGCONT)
                proc.signal(signal.SIGTERM)
        for proc in self.procs:
            proc.stop()


@contextmanager
def cluster(workdir: Path, seed: int, *, standby: bool = False
            ) -> Iterator[tuple[EtcdServer, Replicas]]:
    etcd = EtcdServer(workdir / "etcd")
    etcd.start()
    replicas = None
    try:
        replicas = Replicas(etcd, workdir / "shared", f"chaos-{seed}-{os.getpid()}",
                            standby=standby)
        yield etcd, replicas
    finally:
        if replicas is not None:
            replicas.stop()
        etcd.stop()


def _cluster_scenario(seed: int, workdir: Path,
                      fault: Callable[[EtcdServer, Replicas, Load], object], *,
                      standby: bool = False) -> Verdict:
    with cluster(workdir, seed, standby=standby) as (etcd, replicas):
        load = Load(replicas.target, seed).start()
        load.wait_steps(STEPS)
        if standby:  # every owner's standby filled before the fault
            for proc in replicas.procs:
                if any(r.get("event") == "standby_chosen" for r in proc.records):
                    proc.wait_for(lambda r: r.get("event") == "standby_live", 30)
        fault(etcd, replicas, load)
        load.wait_steps(STEPS)
        return _check(replicas.target, load)


def sigkill_owner(seed: int, workdir: Path, *, standby: bool = False) -> Verdict:
    """The owner of a loaded pool SIGKILLed, then started again (``standby``: no shared
    storage, the pool's standby takes it over)."""
    def fault(etcd: EtcdServer, replicas: Replicas, load: Load) -> None:
        victim = replicas.owner(load.histories[0].pool_id)
        replicas.procs[victim].signal(signal.SIGKILL)
        replicas.procs[victim].stop()
        load.wait_steps(5, pool=0)  # the pool moved to a successor
        replicas.restart(victim)
    return _cluster_scenario(seed, workdir, fault, standby=standby)


def sigstop_owner(seed: int, workdir: Path, *, standby: bool = False) -> Verdict:
    """The owner of a loaded pool stopped (SIGSTOP) past its etcd lease, then resumed: the
    pool moves, and the stopped replica, once it runs again, must not write to it."""
    def fault(etcd: EtcdServer, replicas: Replicas, load: Load) -> None:
        victim = replicas.procs[replicas.owner(load.histories[0].pool_id)]
        os.kill(victim.proc.pid, signal.SIGSTOP)
        try:
            load.wait_steps(5, timeout=60, pool=0)  # the pool moved to a successor
        finally:
            os.kill(victim.proc.pid, signal.SIGCONT)
    return _cluster_scenario(seed, workdir, fault, standby=standby)


def rolling_restart(seed: int, workdir: Path) -> Verdict:
    """Each replica SIGTERMed in turn (it drains and hands its pools over), then started
    again, under load."""
    def fault(etcd: EtcdServer, replicas: Replicas, load: Load) -> None:
        for i in range(3):
            replicas.procs[i].signal(signal.SIGTERM)
            replicas.procs[i].stop()
            replicas.restart(i)
            load.wait_steps(5)
    return _cluster_scenario(seed, workdir, fault)


def etcd_restart(seed: int, workdir: Path) -> Verdict:
    """etcd SIGKILLed for 5 s and started again on its data, under load."""
    def fault(etcd: EtcdServer, replicas: Replicas, load: Load) -> None:
        etcd.kill()
        time.sleep(5)  # how long etcd stays down: the fault itself, not a synchronization
        etcd.start()
    return _cluster_scenario(seed, workdir, fault)


SCENARIOS: dict[str, Callable[[int, Path], Verdict]] = {
    "lost_answers": lost_answers,
    "damaged_payload": lambda seed, workdir: damaged_log(seed, workdir, where="payload"),
    "damaged_length": lambda seed, workdir: damaged_log(seed, workdir, where="length"),
    "disk_full": disk_full,
    "sigkill_owner": sigkill_owner,
    "sigstop_owner": sigstop_owner,
    "standby_sigkill_owner": lambda seed, workdir: sigkill_owner(seed, workdir, standby=True),
    "standby_sigstop_owner": lambda seed, workdir: sigstop_owner(seed, workdir, standby=True),
    "rolling_restart": rolling_restart,
    "etcd_restart": etcd_restart,
}
