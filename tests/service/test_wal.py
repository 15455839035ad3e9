"""The write-ahead log, snapshots and data-directory recovery, on a small deterministic
stand-in state (a list of payloads): framing, torn tails, corruption, rotation, snapshots
written by the compaction process, recovery = snapshot + replayed tail."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from cache_service.core.errors import InvalidArgument, KVCacheError
from cache_service.durability import open_data_dir
from cache_service.errors import DataDirError
from cache_service.snapshot import SnapshotCorruption, list_snapshots, read_snapshot
from cache_service.wal import (
    HEADER_SIZE,
    SEGMENT_HEADER_SIZE,
    FsyncPolicy,
    WalCorruption,
    WriteAheadLog,
    list_segments,
    scan,
)


class Journal:
    """The stand-in state machine: applying a payload appends it (b"bad" is rejected)."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.items: list[bytes] = []

    def apply(self, payload: bytes) -> None:
        if payload == b"bad":
            raise InvalidArgument("rejected", field="payload")
        self.items.append(payload)


def _apply(state: Journal, payload: bytes) -> None:
    state.apply(payload)


class Record(bytes):
    """A payload with the one method the data directory asks of a record."""

    def SerializeToString(self) -> bytes:  # the protobuf method's name
        return bytes(self)


def _log(data_dir, state: Journal, payload: bytes) -> None:
    """What ServiceState.apply does: log, then mutate."""
    data_dir.append(Record(payload))
    with contextlib.suppress(KVCacheError):
        state.apply(payload)


def _open(directory: Path, **kwargs):
    return open_data_dir(directory, new_state=Journal, apply=_apply, **kwargs)


def _payloads(n: int, start: int = 0) -> list[bytes]:
    return [f"record-{i}".encode() * (1 + i % 3) for i in range(start, start + n)]


def _write(directory: Path, payloads: list[bytes], fsync: FsyncPolicy = "never"
           ) -> WriteAheadLog:
    wal = WriteAheadLog(directory, 1, fsync=fsync)
    for p in payloads:
        wal.append(p)
    return wal


@pytest.mark.parametrize("fsync", ["always", "batch", "never"])
def test_round_trip_across_segments(tmp_path: Path, fsync: FsyncPolicy) -> None:
    wal = _write(tmp_path, _payloads(5), fsync)
    assert wal.rotate() == 5
    for p in _payloads(3, 5):
        wal.append(p)
    wal.close()
    assert [first for first, _ in list_segments(tmp_path)] == [1, 6]
    result = scan(tmp_path)
    assert [i for i, _ in result.records] == list(range(1, 9))
    assert [p for _, p in result.records] == _payloads(8)
    assert [p for _, p in scan(tmp_path, after=6).records] == _payloads(2, 6)


def test_torn_tail_is_dropped_at_every_cut(tmp_path: Path) -> None:
    """A crash mid-write leaves any prefix of the last record: each is dropped, the file
    is truncated to the last whole record, and appending continues from there."""
    payloads = _payloads(4)
    _write(tmp_path, payloads).close()
    path = list_segments(tmp_path)[0][1]
    whole = path.read_bytes()
    last_start = len(whole) - HEADER_SIZE - len(payloads[-1])
    for cut in range(last_start, len(whole)):
        path.write_bytes(whole[:cut])
        result = scan(tmp_path)
        assert [p for _, p in result.records] == payloads[:3]
        assert result.truncated_bytes == cut - last_start
        assert path.stat().st_size == last_start
    wal = WriteAheadLog(tmp_path, 4, fsync="never")
    wal.append(b"after the crash")
    wal.close()
    assert [p for _, p in scan(tmp_path).records] == payloads[:3] + [b"after the crash"]


def test_zero_filled_tail_is_torn(tmp_path: Path) -> None:
    _write(tmp_path, _payloads(3)).close()
    path = list_segments(tmp_path)[0][1]
    with open(path, "ab") as f:
        f.write(b"\0" * 4096)  # blocks the file system allocated but never wrote
    assert len(scan(tmp_path).records) == 3


def test_corrupt_middle_record_names_file_and_offset(tmp_path: Path) -> None:
    payloads = _payloads(5)
    _write(tmp_path, payloads).close()
    path = list_segments(tmp_path)[0][1]
    data = bytearray(path.read_bytes())
    offset = SEGMENT_HEADER_SIZE + HEADER_SIZE + len(payloads[0])  # the second record
    data[offset + HEADER_SIZE + 2] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(WalCorruption) as exc:
        scan(tmp_path)
    assert (exc.value.path, exc.value.offset) == (path, offset)
    assert str(path) in str(exc.value) and f"offset {offset}" in str(exc.value)
    assert path.read_bytes() == bytes(data)  # nothing repaired on corruption


def test_any_damaged_header_byte_before_the_last_record_is_corruption(
        tmp_path: Path) -> None:
    """Every byte of every header but the last record's, flipped in turn (length, checksum
    or index): refused naming the record's offset, never taken for a torn tail (a damaged
    length can make a record seem to run to the end of the file)."""
    payloads = _payloads(6)
    _write(tmp_path, payloads).close()
    path = list_segments(tmp_path)[0][1]
    whole = path.read_bytes()
    # (after the segment's header, whatever its size: the records fill the rest)
    starts = [len(whole) - sum(HEADER_SIZE + len(p) for p in payloads)]
    for p in payloads[:-1]:
        starts.append(starts[-1] + HEADER_SIZE + len(p))
    for start in starts[:-1]:
        for byte in range(HEADER_SIZE):
            for flip in (0x01, 0x80):
                data = bytearray(whole)
                data[start + byte] ^= flip
                path.write_bytes(bytes(data))
                with pytest.raises(WalCorruption) as exc:
                    scan(tmp_path)
                assert exc.value.offset == start, (start, byte, flip)
                assert path.read_bytes() == bytes(data)  # nothing truncated
    # The last record's header damaged: nothing follows it, so it reads as torn.
    data = bytearray(whole)
    data[starts[-1]] ^= 0x80
    path.write_bytes(bytes(data))
    assert [p for _, p in scan(tmp_path).records] == payloads[:-1]


def test_a_failed_append_leaves_no_partial_record(tmp_path: Path) -> None:
    """A write that fails part way (here: the file size limit, RLIMIT_FSIZE, standing in
    for a full disk) is cut back before append raises; later appends follow the last good
    record, and the log reads back whole."""
    import resource
    import signal

    wal = _write(tmp_path, _payloads(3))
    size = wal.path.stat().st_size
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + HEADER_SIZE + 10, old_limit[1]))
    try:
        with pytest.raises(OSError):
            wal.append(b"x" * 100)  # 10 payload bytes fit: a short write, then cut back
        assert wal.path.stat().st_size == size
        assert wal.broken is None and wal.last_index == 3
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    wal.append(b"after")
    wal.close()
    assert [p for _, p in scan(tmp_path).records] == _payloads(3) + [b"after"]


def test_bad_tail_of_an_earlier_segment_is_corruption(tmp_path: Path) -> None:
    wal = _write(tmp_path, _payloads(3))
    wal.rotate()
    wal.append(b"next")
    wal.close()
    first = list_segments(tmp_path)[0][1]
    first.write_bytes(first.read_bytes()[:-2])
    with pytest.raises(WalCorruption, match="wal-0+1.log"):
        scan(tmp_path)


def test_missing_segment_is_corruption(tmp_path: Path) -> None:
    wal = _write(tmp_path, _payloads(2))
    wal.rotate()
    wal.append(b"x")
    wal.rotate()
    wal.append(b"y")
    wal.close()
    list_segments(tmp_path)[1][1].unlink()
    with pytest.raises(WalCorruption, match="a segment is missing"):
        scan(tmp_path)


def test_recovery_replays_the_log_and_continues(tmp_path: Path) -> None:
    data_dir, state = _open(tmp_path, fsync="never")
    assert data_dir.recovery.records_replayed == 0 and state.items == []
    for p in _payloads(4) + [b"bad"]:
        _log(data_dir, state, p)
    data_dir.close()  # no state: no final snapshot, the log alone restores
    data_dir, restored = _open(tmp_path)
    assert restored.items == state.items == _payloads(4)
    assert restored.instance_id == state.instance_id  # the directory keeps its identity
    assert (data_dir.recovery.records_replayed, data_dir.recovery.records_rejected) == (5, 1)
    _log(data_dir, restored, b"more")
    data_dir.close()
    assert _open(tmp_path)[1].items == _payloads(4) + [b"more"]


def test_one_server_per_directory(tmp_path: Path) -> None:
    data_dir, _ = _open(tmp_path)
    with pytest.raises(DataDirError, match="in use by another server"):
        _open(tmp_path)
    data_dir.close()
    _open(tmp_path)[0].close()


def test_background_snapshot_truncates_the_log(tmp_path: Path) -> None:
    data_dir, state = _open(tmp_path, snapshot_every=10, fsync="batch")
    for p in _payloads(25):
        _log(data_dir, state, p)  # forks the snapshot child before records 11 and 21
        assert data_dir.snapshotter.wait(30)
    assert data_dir.snapshotter.completed == 2 and data_dir.snapshotter.failed == 0
    assert [i for i, _ in list_snapshots(tmp_path)] == [20]  # the older one is deleted
    assert [first for first, _ in list_segments(tmp_path)] == [21]  # covered ones too
    data_dir.close()
    data_dir, restored = _open(tmp_path)
    assert restored.items == _payloads(25)
    assert (data_dir.recovery.snapshot_index, data_dir.recovery.records_replayed) == (20, 5)
    data_dir.close(restored)  # clean shutdown: a final snapshot, nothing left to replay
    data_dir, restored = _open(tmp_path)
    assert restored.items == _payloads(25) and data_dir.recovery.records_replayed == 0
    data_dir.close()


def test_corrupt_snapshot_stops_the_start(tmp_path: Path) -> None:
    data_dir, state = _open(tmp_path)
    _log(data_dir, state, b"a")
    data_dir.close(state)
    path = list_snapshots(tmp_path)[-1][1]
    data = bytearray(path.read_bytes())
    data[-3] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotCorruption, match="checksum mismatch"):
        read_snapshot(path)
    with pytest.raises(SnapshotCorruption, match=path.name):
        _open(tmp_path)


def test_fsync_always_syncs_groups_before_answers(tmp_path: Path) -> None:
    import asyncio

    data_dir, state = _open(tmp_path, fsync="always")
    assert data_dir.needs_sync

    async def call(i: int) -> None:
        _log(data_dir, state, b"r%d" % i)
        mine = data_dir.wal.last_index
        await data_dir.sync()
        assert data_dir._synced >= mine  # on disk before the caller answers

    async def main() -> None:
        await asyncio.gather(*(call(i) for i in range(1, 21)))

    asyncio.run(main())
    assert data_dir._synced == data_dir.wal.last_index == 20
    data_dir.close()
    assert _open(tmp_path)[1].items == [b"r%d" % i for i in range(1, 21)]
