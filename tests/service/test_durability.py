"""Durable restart with real processes: a server with --data-dir is SIGKILLed in the
middle of a multi-client load and restarted on the same directory and port.

What must hold: every Step a client saw acknowledged is in the restored state and nothing
is half applied; the clients keep their sessions and simply continue (each resends its
in-flight Step under the same sequence number, which the restored session answers from
its stored response if the Step was logged, or applies now if it was not), so at the end
every client's own record of its requests equals the server's exactly. A second kill with
the load quiesced checks that block tables and pool stats come back identical.
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from cache_service.client import CacheClient, CacheError, StepBuilder
from cache_service.wal import HEADER_SIZE, SEGMENT_HEADER_SIZE
from kvcache_common.launch import ServerProcess, start_cache_service

from .builders import hybrid_layers

NUM_CLIENTS = 4
NUM_BLOCKS = 2048


def _start(data_dir: Path, *flags: str) -> ServerProcess:
    return start_cache_service("--data-dir", str(data_dir), *flags)


@dataclass
class Seen:
    """One request as its client last saw it acknowledged."""

    num_tokens: int
    num_computed_tokens: int
    block_ids: list[list[int]]


def _as_seen(r) -> Seen:
    return Seen(r.num_tokens, r.num_computed_tokens, r.block_ids)


@dataclass
class LoadClient:
    """A client thread's workload: adds requests, decodes them one token per Step, frees
    the oldest now and then. ``seen``: the acknowledged state of its live requests, read
    back after each Step (only this client changes them). A call that fails "in doubt"
    (server gone) is resent until the server is back."""

    name: str
    client: CacheClient
    seen: dict[str, Seen] = field(default_factory=dict)
    freed: set[str] = field(default_factory=set)
    acked: int = 0
    in_doubt: int = 0  # calls that failed in doubt and were resent
    next_id: int = 0
    error: Exception | None = None

    def _retry(self, call, stop: threading.Event):
        while True:
            try:
                return call()
            except CacheError as exc:
                if not exc.in_doubt or stop.is_set():
                    raise
                self.in_doubt += 1

    def run(self, stop: threading.Event, progress: threading.Semaphore, seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                batch = StepBuilder("p")
                delta: dict[str, int] = {}  # request id -> tokens added (-1 = freed)
                if len(self.seen) < 3 or rng.random() < 0.2:
                    rid = f"{self.name}-{self.next_id}"
                    self.next_id += 1
                    prompt = [rng.randrange(500) for _ in range(rng.randrange(8, 70))]
                    batch.add(rid, prompt).allocate(rid, len(prompt))
                    delta[rid] = len(prompt)
                live = sorted(self.seen)
                if len(live) > 5:
                    batch.free(live[0])
                    delta[live[0]] = -1
                    live = live[1:]
                if live:
                    batch.decode(live, [rng.randrange(500) for _ in live])
                    delta.update((rid, 1) for rid in live)
                self._retry(lambda b=batch: self.client.step_batch(b), stop)
                for rid, d in delta.items():
                    if d < 0:
                        del self.seen[rid]
                        self.freed.add(rid)
                    else:
                        self.seen[rid] = _as_seen(self._retry(
                            lambda r=rid: self.client.get_request("p", r), stop))
                self.acked += 1
                progress.release()
        except CacheError as exc:
            self.error = exc


def _run_load(clients: list[LoadClient], stop: threading.Event,
              progress: threading.Semaphore, seed: int) -> list[threading.Thread]:
    threads = [threading.Thread(target=c.run, args=(stop, progress, seed + i))
               for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    return threads


def _wait_progress(progress: threading.Semaphore, n: int) -> None:
    for _ in range(n):
        assert progress.acquire(timeout=60), "the load made no progress"


def _reachable(call, timeout: float = 60.0):
    """``call()`` once the restarted server answers (UNAVAILABLE is retried until
    ``timeout``): a deadline-bounded wait, not a fixed sleep."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except CacheError as exc:
            if exc.code != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise


def _state_of(client: CacheClient, request_ids: list[str]) -> tuple:
    return client.stats("p"), {rid: client.get_request("p", rid) for rid in request_ids}


def _check_acknowledged(admin: CacheClient, clients: list[LoadClient]) -> list[str]:
    """Every client's requests are exactly what it saw acknowledged, freed ones gone and
    nothing more in the pool; answers the live request ids."""
    for c in clients:
        for rid, seen in c.seen.items():
            assert _as_seen(admin.get_request("p", rid)) == seen, (c.name, rid)
        for rid in c.freed:
            with pytest.raises(CacheError, match="unknown request"):
                admin.get_request("p", rid)
    live = sorted(rid for c in clients for rid in c.seen)
    assert admin.stats("p").num_requests == len(live)
    return live


def _finish_load(clients: list[LoadClient], threads: list[threading.Thread],
                 stop: threading.Event) -> None:
    stop.set()
    for t in threads:
        t.join(60)
    assert not any(c.error for c in clients), [c.error for c in clients]


def _check_on(server: ServerProcess, clients: list[LoadClient]) -> None:
    """Every Step the clients saw acknowledged is in ``server``'s state (see
    :func:`_check_acknowledged`)."""
    with CacheClient(server.target) as admin:
        _check_acknowledged(admin, clients)


def _close(clients: list[LoadClient], server: ServerProcess) -> None:
    """Closes the load clients, then stops the server (a test's cleanup)."""
    for c in clients:
        c.client.close()
    server.stop()


def test_sigkill_mid_load_loses_no_acknowledged_step(tmp_path: Path, gate) -> None:
    """The load clients talk to the gate: one address across restarts (each restart
    listens on a port of its own, so none is reserved and released)."""
    data_dir = tmp_path / "data"
    flags = ("--fsync", "batch", "--snapshot-every", "150")
    server = _start(data_dir, *flags)
    gate.open_to(server.target)
    clients: list[LoadClient] = []
    try:
        with CacheClient(server.target) as admin:
            info = admin.register_pool("p", hybrid_layers(), max_model_len=4096,
                                       num_blocks=NUM_BLOCKS)
        clients = [LoadClient(f"c{i}", CacheClient(gate.target, default_timeout=10))
                   for i in range(NUM_CLIENTS)]
        stop = threading.Event()
        progress = threading.Semaphore(0)
        threads = _run_load(clients, stop, progress, seed=1)
        _wait_progress(progress, 400)
        server.wait_for(lambda r: r.get("event") == "snapshot_written", timeout=120)
        _wait_progress(progress, 50)  # and a log tail after it
        server.signal(signal.SIGKILL)  # mid-load: every client has a Step in flight
        server.stop()
        assert server.returncode == -signal.SIGKILL

        server = _start(data_dir, *flags)
        gate.open_to(server.target)
        recovered = server.wait_for(lambda r: r.get("event") == "recovered")
        assert recovered["snapshot_index"] > 0  # a background snapshot was taken
        assert recovered["records_replayed"] > 0  # and the log tail after it replayed
        _wait_progress(progress, 200)  # the same clients, sessions and numbers continue
        _finish_load(clients, threads, stop)
        # (The calls the kill hit in flight are resent by the client itself, under the same
        # stamp, within its call deadline: none needs to surface as in doubt.)

        with CacheClient(server.target) as admin:
            assert _reachable(lambda: admin.get_pool("p")).incarnation == info.incarnation
            live = _check_acknowledged(admin, clients)
            before = _state_of(admin, live)
        server.signal(signal.SIGKILL)  # quiesced: the restored state must be identical
        server.stop()

        server = _start(data_dir, *flags)
        with CacheClient(server.target) as admin:
            assert _reachable(lambda: _state_of(admin, live)) == before
            assert admin.get_pool("p").incarnation == info.incarnation
    finally:
        _close(clients, server)
    assert server.returncode == 0, server.output()


def test_a_corrupt_log_stops_the_start_naming_file_and_offset(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with _start(data_dir) as server, CacheClient(server.target) as client:
        client.register_pool("p", hybrid_layers(), max_model_len=1024, num_blocks=256)
        for i in range(3):
            client.step_batch(StepBuilder("p").add(f"r{i}", list(range(40))))
        server.signal(signal.SIGKILL)  # no snapshot at exit: the log holds everything
    path = sorted(data_dir.glob("wal-*.log"))[-1]
    data = bytearray(path.read_bytes())
    data[SEGMENT_HEADER_SIZE + HEADER_SIZE + 1] ^= 0xFF  # inside the first record, records follow
    path.write_bytes(bytes(data))
    with pytest.raises(RuntimeError) as exc:
        _start(data_dir)
    assert str(path) in str(exc.value) and f"byte offset {SEGMENT_HEADER_SIZE}" in str(exc.value)


def test_without_a_data_dir_the_server_says_it_is_in_memory() -> None:
    with start_cache_service() as server:
        record = server.wait_for(lambda r: r.get("event") == "in_memory")
        assert "--data-dir" in record["detail"]


# -- snapshots: the log names the one it continues; compaction in its own process ----------


def _refused_start(data_dir: Path) -> str:
    """Starts a server on ``data_dir`` that must refuse to start (exit 2, one line on
    stderr, see tests/service/test_start_errors.py); answers that line."""
    done = subprocess.run(
        [sys.executable, "-m", "cache_service", "--host", "127.0.0.1", "--port", "0",
         "--metrics-port", "-1", "--data-dir", str(data_dir)],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    (line,) = done.stderr.strip().splitlines()
    return line


def _steps(data_dir: Path, first: int, n: int, *, register: bool = False) -> tuple:
    """A server run that adds requests r<first>..r<first+n-1> (its client's session frees
    them when it closes), then stops cleanly (a final snapshot); answers the pool's
    incarnation and stats at the end."""
    with _start(data_dir) as server:
        with CacheClient(server.target) as client:
            if register:
                client.register_pool("p", hybrid_layers(), max_model_len=1024,
                                     num_blocks=256)
            for i in range(first, first + n):
                client.step_batch(StepBuilder("p").add(f"r{i}", list(range(40 * i, 40 * i + 40)))
                                  .allocate(f"r{i}", 40))
        with CacheClient(server.target) as admin:
            end = admin.get_pool("p").incarnation, admin.stats("p")
    assert server.returncode == 0, server.output()
    return end


def _snapshot(data_dir: Path) -> Path:
    (path,) = data_dir.glob("snapshot-*.snap")  # a clean stop leaves the final one alone
    return path


def test_a_missing_snapshot_stops_the_start_and_no_incarnation_repeats(tmp_path: Path
                                                                       ) -> None:
    data_dir = tmp_path / "data"
    incarnation, stats = _steps(data_dir, 0, 3, register=True)
    assert stats.num_cached_blocks > 0  # the Steps left their mark
    snapshot = _snapshot(data_dir)
    kept = snapshot.read_bytes()
    snapshot.unlink()
    output = _refused_start(data_dir)
    assert f"snapshot {snapshot} is missing" in output, output
    snapshot.write_bytes(kept)  # restored: everything is back
    with _start(data_dir) as server, CacheClient(server.target) as client:
        assert (client.get_pool("p").incarnation, client.stats("p")) == (incarnation, stats)
    # The history given up (every file but the instance id removed): a new one starts,
    # and the pool registered again is told apart from the lost one.
    for path in data_dir.iterdir():
        if path.name.startswith(("snapshot-", "wal-")):
            path.unlink()
    assert _steps(data_dir, 0, 1, register=True)[0] != incarnation


def test_an_older_snapshot_stops_the_start(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    _steps(data_dir, 0, 2, register=True)
    older = _snapshot(data_dir)
    kept = older.read_bytes()
    _steps(data_dir, 2, 2)
    newest = _snapshot(data_dir)
    assert newest != older
    newest.unlink()
    older.write_bytes(kept)  # the previous snapshot, as a backup would bring it back
    assert f"snapshot {newest} is missing" in _refused_start(data_dir)
    older.rename(newest)  # and under the newest one's name
    assert f"snapshot {newest} is unreadable" in _refused_start(data_dir)


def _gone(pid: int, timeout: float = 30.0) -> bool:
    """Whether process ``pid`` (not a child of this one) ends within ``timeout``: a pidfd
    turns readable when it exits."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def _load_until(server: ServerProcess, clients: list[LoadClient],
                predicate, seed: int) -> tuple[list[threading.Thread], threading.Event,
                                               threading.Semaphore, dict]:
    stop, progress = threading.Event(), threading.Semaphore(0)
    threads = _run_load(clients, stop, progress, seed=seed)
    record = server.wait_for(predicate, timeout=120)
    return threads, stop, progress, record


def test_sigkill_during_compaction_loses_no_acknowledged_step(tmp_path: Path, gate) -> None:
    data_dir = tmp_path / "data"
    flags = ("--snapshot-every", "60")
    server = _start(data_dir, *flags)
    gate.open_to(server.target)
    clients: list[LoadClient] = []
    try:
        with CacheClient(server.target) as admin:
            admin.register_pool("p", hybrid_layers(), max_model_len=4096, num_blocks=NUM_BLOCKS)
        clients = [LoadClient(f"c{i}", CacheClient(gate.target, default_timeout=10))
                   for i in range(NUM_CLIENTS)]
        threads, stop, progress, started = _load_until(
            server, clients, lambda r: r.get("event") == "snapshot_started", seed=7)
        server.signal(signal.SIGKILL)  # the compaction process has just started
        server.stop()
        assert not any(r.get("event") == "snapshot_written" for r in server.records)
        assert _gone(started["pid"])  # it died with the server: it commits nothing later

        server = _start(data_dir, *flags)
        gate.open_to(server.target)
        _wait_progress(progress, 100)
        _finish_load(clients, threads, stop)
        _check_on(server, clients)
    finally:
        _close(clients, server)


def test_a_failed_compaction_keeps_the_previous_snapshot_and_log(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    flags = ("--snapshot-every", "40")
    server = _start(data_dir, *flags)
    clients: list[LoadClient] = []
    try:
        with CacheClient(server.target) as admin:
            admin.register_pool("p", hybrid_layers(), max_model_len=4096, num_blocks=NUM_BLOCKS)
        clients = [LoadClient("c0", CacheClient(server.target, default_timeout=10))]
        threads, stop, progress, started = _load_until(
            server, clients, lambda r: r.get("event") == "snapshot_started", seed=3)
        os.kill(started["pid"], signal.SIGKILL)
        failed = server.wait_for(lambda r: r.get("event") == "snapshot_failed")
        assert failed["exit_status"] == -signal.SIGKILL
        assert not list(data_dir.glob("*.tmp"))
        # The server serves on, and a later compaction succeeds.
        server.wait_for(lambda r: r.get("event") == "snapshot_written", timeout=120)
        _finish_load(clients, threads, stop)
        server.signal(signal.SIGKILL)
        server.stop()
        server = _start(data_dir, *flags)
        _check_on(server, clients)
    finally:
        _close(clients, server)


def test_lower_limits_at_restart_drop_no_logged_record(tmp_path: Path) -> None:
    """Replay (recovery, compaction) lifts the per-call and block limits: each logged record
    was accepted under its own run's flags."""
    data_dir = tmp_path / "data"
    with _start(data_dir) as server, CacheClient(server.target) as client:
        client.register_pool("p", hybrid_layers(), max_model_len=1024, num_blocks=256)
        batch = StepBuilder("p")
        for i in range(8):
            batch.add(f"r{i}", list(range(10 * i, 10 * i + 10))).allocate(f"r{i}", 10)
        client.step_batch(batch)  # 16 ops
        server.signal(signal.SIGKILL)  # no final snapshot: the log holds the Step
    with _start(data_dir, "--max-ops-per-step", "4", "--max-total-blocks", "16") as server, \
            CacheClient(server.target) as client:
        assert client.stats("p").num_requests == 8
        with pytest.raises(CacheError, match="exceed the limit of 4"):  # now, they apply
            client.step_batch(StepBuilder("p").decode([f"r{i}" for i in range(8)],
                                                      list(range(8))))
