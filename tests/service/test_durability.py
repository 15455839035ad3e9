"""Durable restart with real processes: a server with --data-dir is SIGKILLed in the
middle of a multi-client load and restarted on the same directory.

What must hold: every Step a client saw acknowledged is in the restored state, the one
Step each client had in flight is either entirely applied or not at all, pools keep their
incarnation and event sequence, and clients continue on the restarted server. A second
kill with the load quiesced checks that block tables and pool stats come back exactly.
"""

from __future__ import annotations

import random
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cache_service.client import CacheClient, CacheError, StepBuilder
from cache_service.wal import HEADER_SIZE, MAGIC
from kvcache_common.launch import ServerProcess, start_cache_service
from tests.service.conftest import hybrid_layers

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


@dataclass
class LoadClient:
    """A client thread's workload: adds requests, decodes them one token per Step, frees
    the oldest now and then. ``seen`` is the acknowledged state of its live requests;
    ``in_flight`` the request ids and token deltas of the Step sent but not answered."""

    name: str
    pool_id: str
    seen: dict[str, Seen] = field(default_factory=dict)
    freed: set[str] = field(default_factory=set)
    in_flight: dict[str, int] | None = None  # request id -> tokens it adds (-1 = free)
    in_flight_acked: bool = False  # answered, but the server died before it was read back
    acked: int = 0
    next_id: int = 0
    error: Exception | None = None

    def run(self, target: str, stop: threading.Event, progress: threading.Semaphore,
            seed: int) -> None:
        rng = random.Random(seed)
        try:
            with CacheClient(target, default_timeout=10) as client:
                while not stop.is_set():
                    batch = StepBuilder(self.pool_id)
                    delta: dict[str, int] = {}
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
                    self.in_flight, self.in_flight_acked = delta, False
                    client.step_batch(batch)
                    # Acknowledged; its effect is recorded once read back (the server may
                    # die in between: the checker then requires the Step applied whole).
                    self.in_flight_acked = True
                    now = {rid: _as_seen(client.get_request(self.pool_id, rid))
                           for rid, d in delta.items() if d >= 0}
                    for rid, d in delta.items():
                        if d < 0:
                            del self.seen[rid]
                            self.freed.add(rid)
                    self.seen.update(now)
                    self.in_flight = None
                    self.acked += 1
                    progress.release()
        except CacheError as exc:
            self.error = exc


def _snapshot_of(client: CacheClient, pool_id: str, request_ids: list[str]) -> tuple:
    stats = client.stats(pool_id)
    tables = {rid: client.get_request(pool_id, rid) for rid in request_ids}
    return stats, tables


def _run_load(target: str, clients: list[LoadClient], stop: threading.Event,
              progress: threading.Semaphore, seed: int) -> list[threading.Thread]:
    threads = [threading.Thread(target=c.run, args=(target, stop, progress, seed + i))
               for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    return threads


def test_sigkill_mid_load_loses_no_acknowledged_step(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    server = _start(data_dir, "--fsync", "batch", "--snapshot-every", "150")
    try:
        with CacheClient(server.target) as admin:
            info = admin.register_pool("p", hybrid_layers(), max_model_len=4096,
                                       num_blocks=NUM_BLOCKS)
        clients = [LoadClient(f"c{i}", "p") for i in range(NUM_CLIENTS)]
        stop = threading.Event()
        progress = threading.Semaphore(0)
        threads = _run_load(server.target, clients, stop, progress, seed=1)
        for _ in range(400):  # acknowledged Steps across clients, then kill mid-load
            assert progress.acquire(timeout=60), "the load made no progress"
        server.signal(signal.SIGKILL)
        for t in threads:
            t.join(60)
        assert all(c.error is not None for c in clients)  # each saw the server die
    finally:
        server.stop()
    assert server.returncode == -signal.SIGKILL

    server = _start(data_dir)
    try:
        recovered = server.wait_for(lambda r: r.get("event") == "recovered")
        assert recovered["snapshot_index"] > 0  # some background snapshot was taken
        with CacheClient(server.target) as admin:
            assert admin.get_pool("p").incarnation == info.incarnation
            for c in clients:
                _check_acknowledged(admin, c)
            # Clients continue where they left off.
            stop = threading.Event()
            progress = threading.Semaphore(0)
            for c in clients:
                c.error = None
                c.seen = {rid: _as_seen(admin.get_request("p", rid)) for rid in c.seen
                          if _exists(admin, rid)}
                c.seen.update((rid, _as_seen(admin.get_request("p", rid)))
                              for rid in (c.in_flight or {}) if _exists(admin, rid))
                c.in_flight = None
            threads = _run_load(server.target, clients, stop, progress, seed=100)
            for _ in range(100):
                assert progress.acquire(timeout=60), "no progress after the restart"
            stop.set()
            for t in threads:
                t.join(60)
            assert not any(c.error for c in clients), [c.error for c in clients]
            live = sorted(rid for c in clients for rid in c.seen)
            before = _snapshot_of(admin, "p", live)
        server.signal(signal.SIGKILL)  # quiesced: the restored state must be identical
        server.stop()
    finally:
        server.stop()

    server = _start(data_dir)
    try:
        with CacheClient(server.target) as admin:
            assert _snapshot_of(admin, "p", live) == before
            assert admin.get_pool("p").incarnation == info.incarnation
    finally:
        server.stop()
    assert server.returncode == 0, server.output()


def _exists(client: CacheClient, rid: str) -> bool:
    try:
        client.get_request("p", rid)
        return True
    except CacheError:
        return False


def _as_seen(r) -> Seen:
    return Seen(r.num_tokens, r.num_computed_tokens, r.block_ids)


def _check_acknowledged(admin: CacheClient, c: LoadClient) -> None:
    """Every acknowledged Step is present; the in-flight one is all or nothing."""
    delta = c.in_flight or {}
    applied = []  # per request touched by the in-flight Step: did it take effect?
    for rid, seen in c.seen.items():
        r = admin.get_request("p", rid) if _exists(admin, rid) else None
        d = delta.get(rid)
        if d is None:
            assert r is not None and _as_seen(r) == seen, (c.name, rid)
            continue
        if d < 0:  # freed by the in-flight Step
            applied.append(r is None)
            if r is not None:
                assert _as_seen(r) == seen
            continue
        assert r is not None
        applied.append(r.num_tokens == seen.num_tokens + d)
        if not applied[-1]:
            assert _as_seen(r) == seen, (c.name, rid)
        else:  # the Step extended the table; it never rewrites acknowledged blocks
            assert all(new[:len(old)] == old or 0 in old
                       for new, old in zip(r.block_ids, seen.block_ids))
    new_ids = [rid for rid, d in delta.items() if rid not in c.seen]
    applied.extend(_exists(admin, rid) for rid in new_ids)
    assert len(set(applied)) <= 1, f"{c.name}: in-flight Step half applied: {applied}"
    if c.in_flight_acked:
        assert all(applied), f"{c.name}: an acknowledged Step is missing"
    for rid in c.freed:
        assert not _exists(admin, rid)


def test_a_corrupt_log_stops_the_start_naming_file_and_offset(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with _start(data_dir) as server, CacheClient(server.target) as client:
        client.register_pool("p", hybrid_layers(), max_model_len=1024, num_blocks=256)
        for i in range(3):
            client.step_batch(StepBuilder("p").add(f"r{i}", list(range(40))))
        server.signal(signal.SIGKILL)  # no snapshot at exit: the log holds everything
    path = sorted(data_dir.glob("wal-*.log"))[-1]
    data = bytearray(path.read_bytes())
    data[len(MAGIC) + HEADER_SIZE + 1] ^= 0xFF  # inside the first record, records follow
    path.write_bytes(bytes(data))
    with pytest.raises(RuntimeError) as exc:
        _start(data_dir)
    assert str(path) in str(exc.value) and f"byte offset {len(MAGIC)}" in str(exc.value)


def test_without_a_data_dir_the_server_says_it_is_in_memory() -> None:
    with start_cache_service() as server:
        record = server.wait_for(lambda r: r.get("event") == "in_memory")
        assert "--data-dir" in record["detail"]
