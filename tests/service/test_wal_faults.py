"""The log under faults, with real server processes: a damaged record header in the middle
of the log, a data directory that fills up, and concurrent callers under ``--fsync always``.

One rule throughout: what a client saw acknowledged is there exactly once after a SIGKILL
and restart, and nothing it was refused for is.
"""

from __future__ import annotations

import contextlib
import os
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cache_service.client import CacheClient, CacheError, StepBuilder
from cache_service.wal import HEADER_SIZE, SEGMENT_HEADER_SIZE
from kvcache_common.launch import ServerProcess, start_cache_service

from .builders import hybrid_layers


def _start(data_dir: Path, *flags: str) -> ServerProcess:
    return start_cache_service("--data-dir", str(data_dir), *flags)


def _start_fails(data_dir: Path) -> subprocess.CompletedProcess[str]:
    """A server start on ``data_dir`` that must end by itself (a refused start)."""
    return subprocess.run([sys.executable, "-m", "cache_service", "--port", "0",
                           "--metrics-port", "-1", "--data-dir", str(data_dir)],
                          capture_output=True, text=True, timeout=60, check=False)


def _record_offsets(path: Path) -> list[int]:
    """Byte offsets of the records of one segment (walked by their length fields)."""
    data = path.read_bytes()
    offsets, pos = [], SEGMENT_HEADER_SIZE
    while pos < len(data):
        offsets.append(pos)
        pos += HEADER_SIZE + struct.unpack_from("<I", data, pos)[0]
    return offsets


def _healthy(target: str) -> bool:
    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=10)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


# -- a damaged header in the middle of the log ---------------------------------------------


@pytest.mark.parametrize("damage", ["length_larger", "length_huge", "length_smaller",
                                    "index"])
def test_a_damaged_header_in_the_middle_is_corruption_not_a_torn_tail(
        tmp_path: Path, damage: str) -> None:
    """9 acknowledged records (the client's OpenSession, RegisterPool, 7 Steps); record
    5's header damaged: the
    restart refuses with one line naming the file and the record's offset, and truncates
    nothing."""
    data_dir = tmp_path / "data"
    with _start(data_dir) as server, CacheClient(server.target) as client:
        client.register_pool("p", hybrid_layers(), max_model_len=1024, num_blocks=256)
        for i in range(7):
            client.step_batch(StepBuilder("p").add(f"r{i}", list(range(40 + i))))
        server.signal(signal.SIGKILL)  # no final snapshot: the log holds all 9
    path = sorted(data_dir.glob("wal-*.log"))[-1]
    offsets = _record_offsets(path)
    assert len(offsets) == 9
    at = offsets[4]  # record 5
    data = bytearray(path.read_bytes())
    length = struct.unpack_from("<I", data, at)[0]
    if damage == "length_larger":  # runs to the file's end, as a torn record would
        struct.pack_into("<I", data, at, len(data) - at - HEADER_SIZE)
    elif damage == "length_huge":
        struct.pack_into("<I", data, at, 0xFFFF_FFF0)
    elif damage == "length_smaller":
        struct.pack_into("<I", data, at, length - 3)
    else:
        struct.pack_into("<Q", data, at + 8, 5000)
    path.write_bytes(bytes(data))
    size = path.stat().st_size

    done = _start_fails(data_dir)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert str(path) in lines[0] and f"byte offset {at}" in lines[0]
    assert path.stat().st_size == size  # nothing truncated
    assert path.read_bytes() == bytes(data)


def test_a_torn_final_record_is_still_dropped(tmp_path: Path) -> None:
    """The counterpart: the last record cut short (a crash mid-write) is dropped, the rest
    restored."""
    data_dir = tmp_path / "data"
    with _start(data_dir) as server, CacheClient(server.target) as client:
        client.register_pool("p", hybrid_layers(), max_model_len=1024, num_blocks=256)
        for i in range(4):
            client.step_batch(StepBuilder("p").add(f"r{i}", list(range(40))))
        server.signal(signal.SIGKILL)
    path = sorted(data_dir.glob("wal-*.log"))[-1]
    last = _record_offsets(path)[-1]
    with open(path, "r+b") as f:
        f.truncate(last + HEADER_SIZE + 5)
    with _start(data_dir) as server, CacheClient(server.target) as client:
        recovered = server.wait_for(lambda r: r.get("event") == "recovered")
        assert recovered["torn_bytes_dropped"] == HEADER_SIZE + 5
        assert client.stats("p").num_requests == 3


# -- a full disk ---------------------------------------------------------------------------


def _fill(directory: Path) -> Path:
    """Fills the file system of ``directory`` to the last byte; answers the filler file."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for size in (1 << 16, 512, 1):  # unbuffered: a write that fits is on the disk
            with contextlib.suppress(OSError):
                while os.write(fd, b"\xaa" * size) == size:
                    pass
    finally:
        os.close(fd)
    return filler


def _prompt(i: int) -> list[int]:
    return [(i * 7 + j) % 5000 for j in range(800)]  # a record of a few KiB


def test_a_full_disk_refuses_writes_cleanly_and_loses_nothing(
        tmpfs: Callable[[str], Path]) -> None:
    mnt = tmpfs("size=4m")
    data_dir = mnt / "data"
    server = _start(data_dir, "--fsync", "always", "--snapshot-every", "1000000")
    try:
        with CacheClient(server.target, default_timeout=15) as client:
            client.register_pool("p", hybrid_layers(), max_model_len=4096,
                                 num_blocks=1024)
            acked = []
            for i in range(5):
                client.step_batch(StepBuilder("p").add(f"a{i}", _prompt(i)))
                acked.append(f"a{i}")
            log = sorted(data_dir.glob("wal-*.log"))[-1]
            size_before = log.stat().st_size
            filler = _fill(mnt)

            refused = []
            for i in range(3):
                with pytest.raises(CacheError) as exc:
                    client.step_batch(StepBuilder("p").add(f"x{i}", _prompt(100 + i)))
                refused.append(f"x{i}")
                assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.value
                assert str(data_dir) in str(exc.value) and "full" in str(exc.value)
                assert log.stat().st_size == size_before  # undone before the answer
            # The state did not apply the refused calls; reads and health answer.
            assert client.stats("p").num_requests == len(acked)
            with pytest.raises(CacheError, match="unknown request"):
                client.get_request("p", "x0")
            assert _healthy(server.target)

            filler.unlink()  # space is back: writes are accepted again
            for i in range(3):
                client.step_batch(StepBuilder("p").add(f"b{i}", _prompt(200 + i)))
                acked.append(f"b{i}")
            assert client.stats("p").num_requests == len(acked)
            server.signal(signal.SIGKILL)  # before the client closes its session
            server.stop()

        server = _start(data_dir, "--fsync", "always")
        recovered = server.wait_for(lambda r: r.get("event") == "recovered")
        assert recovered["torn_bytes_dropped"] == 0
        with CacheClient(server.target) as client:
            assert client.stats("p").num_requests == len(acked)  # exactly once each
            for rid in acked:
                assert client.get_request("p", rid).num_tokens == 800
            for rid in refused:
                with pytest.raises(CacheError, match="unknown request"):
                    client.get_request("p", rid)
    finally:
        server.stop()


def test_a_snapshot_on_a_full_disk_loses_nothing(tmpfs: Callable[[str], Path]) -> None:
    """Snapshots due while the disk is full (background ones, then the final one at a
    clean stop) fail without a crash; the log keeps everything for the next start."""
    mnt = tmpfs("size=4m")
    data_dir = mnt / "data"
    flags = ("--fsync", "batch", "--snapshot-every", "8")
    server = _start(data_dir, *flags)
    try:
        with CacheClient(server.target, default_timeout=15) as client:
            client.register_pool("p", hybrid_layers(), max_model_len=4096,
                                 num_blocks=1024)
            big = StepBuilder("p")  # ~300 KiB of token ids in every snapshot
            for i in range(100):
                big.add(f"big{i}", _prompt(i))
            client.step_batch(big)
            filler = _fill(mnt)
            with open(filler, "r+b") as f:  # room for a few records, not a snapshot
                f.truncate(f.seek(0, os.SEEK_END) - 32 * 1024)
            acked = [f"big{i}" for i in range(100)]
            for i in range(12):
                try:
                    client.step_batch(StepBuilder("p").add(f"a{i}", list(range(40))))
                except CacheError as exc:
                    assert exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                else:
                    acked.append(f"a{i}")
            assert acked
            assert _healthy(server.target)
            # Before the client closes its session (which would free its requests):
            # the final snapshot finds no space either.
            server.signal(signal.SIGTERM)
            assert server.stop() == 0, server.output()
        assert "snapshot_failed" in server.output()  # in the background
        assert "final_snapshot_failed" in server.output()  # at the stop
        assert not list(data_dir.glob("*.tmp"))  # a failed snapshot leaves no debris
        filler.unlink()
        server = _start(data_dir, *flags)
        with CacheClient(server.target) as client:
            assert client.stats("p").num_requests == len(acked)
            for rid in acked:
                client.get_request("p", rid)
    finally:
        server.stop()


# -- --fsync always under concurrent callers -----------------------------------------------


def test_concurrent_steps_under_fsync_always_are_all_answered(tmp_path: Path) -> None:
    """Sessionless decode Steps released at the same moment from several connections, round
    after round: each is answered and health keeps answering. (The group commit once
    wedged the event loop here: a caller arriving between the fdatasync's end and its
    done-callback spun forever.)"""
    connections, rounds, per = 4, 150, 8
    with _start(tmp_path / "data", "--fsync", "always") as server:
        clients = [CacheClient(server.target, default_timeout=10) for _ in range(connections)]
        try:
            clients[0].register_pool("p", hybrid_layers(), max_model_len=4096,
                                     num_blocks=2048)
            for i, c in enumerate(clients):
                b = StepBuilder("p")
                for j in range(per):
                    b.add(f"c{i}-{j}", list(range(20))).allocate(f"c{i}-{j}", 20)
                c.step_batch(b)
            errors: list[tuple[int, int, Exception]] = []
            for rnd in range(rounds):
                barrier = threading.Barrier(connections)

                def step(i: int, rnd: int = rnd, barrier: threading.Barrier = barrier
                         ) -> None:
                    batch = StepBuilder("p").decode([f"c{i}-{j}" for j in range(per)],
                                                    [rnd % 500] * per)
                    barrier.wait()
                    try:
                        clients[i].step_batch(batch)
                    except CacheError as exc:
                        errors.append((rnd, i, exc))

                threads = [threading.Thread(target=step, args=(i,))
                           for i in range(connections)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                assert not errors, errors[:2]
            assert _healthy(server.target)
            for i in range(connections):  # every decode applied exactly once
                assert clients[0].get_request("p", f"c{i}-0").num_tokens == 20 + rounds
        finally:
            for c in clients:
                c.close()
