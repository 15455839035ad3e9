"""Snapshots of the service state: one file per snapshot, written atomically, in the
background.

File ``snapshot-<last WAL index, 20 digits>.snap``::

    8-byte magic | u32 format version | u64 last WAL index | u64 payload length |
    u32 crc32(payload) | payload (pickle of the state)

The state is pickled whole (pools, event feeds, sessions, counters): the core's objects
define compact pickled forms (blocks without free-queue links, the queue as its order,
token ids as packed arrays) so that a million-block pool neither overflows the stack nor
takes long to load.

Writing (:class:`Snapshotter`) works like Redis' BGSAVE: the log is rotated to a new
segment (so the snapshot covers exactly the closed segments), then a forked child pickles
its copy-on-write image of the state and writes ``.tmp``, fsyncs it and renames it into
place, while the parent keeps serving. When the child succeeds, the parent deletes the
segments and snapshots the new one covers. A crash at any point leaves either the old
snapshot with its log or the new one: the rename is the commit.
"""

from __future__ import annotations

import gc
import io
import os
import pickle
import struct
import threading
import time
import traceback
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.message import Message

from cache_service.wal import WriteAheadLog, _fsync_dir

MAGIC = b"KVCSNAP\n"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIQQI")
_PREFIX, _SUFFIX = "snapshot-", ".snap"

_log = structlog.get_logger("cache_service.snapshot")


class SnapshotCorruption(Exception):
    """A snapshot file does not read back as written (names the file)."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"snapshot {path} is unreadable: {reason}; refusing to start "
                         "(restore the file or move the data directory away)")
        self.path = path


def snapshot_name(last_index: int) -> str:
    return f"{_PREFIX}{last_index:020d}{_SUFFIX}"


def list_snapshots(directory: Path) -> list[tuple[int, Path]]:
    """``(last index, path)`` of every complete snapshot, oldest first."""
    out = []
    for p in directory.iterdir():
        digits = p.name[len(_PREFIX):-len(_SUFFIX)]
        if p.name.startswith(_PREFIX) and p.name.endswith(_SUFFIX) and digits.isdigit():
            out.append((int(digits), p))
    return sorted(out)


class _StatePickler(pickle.Pickler):
    """Pickles protobuf messages (sessions keep their last request and answer) by type
    name and wire bytes: the generated classes are not importable under the module name
    protoc gives them, so pickle's default (by class reference) fails on them."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Message):
            return _restore_message, (obj.DESCRIPTOR.full_name, obj.SerializeToString())
        return NotImplemented


def _restore_message(full_name: str, data: bytes) -> Message:
    cls = message_factory.GetMessageClass(
        descriptor_pool.Default().FindMessageTypeByName(full_name))
    return cls.FromString(data)


def dumps_state(state: Any) -> bytes:
    """``state`` (the service state, or part of it) pickled as snapshots pickle it;
    ``pickle.loads`` reads it back."""
    buffer = io.BytesIO()
    gc.disable()  # pickling allocates nothing the collector could free; it only slows down
    try:
        _StatePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(state)
    finally:
        gc.enable()
    return buffer.getvalue()


def write_snapshot(directory: Path, state: Any, last_index: int) -> Path:
    """Pickles ``state`` as the snapshot through WAL index ``last_index`` (atomic)."""
    payload = dumps_state(state)
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, last_index, len(payload), zlib.crc32(payload))
    final = directory / snapshot_name(last_index)
    tmp = final.with_suffix(".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # e.g. a full disk: leave it no fuller
        raise
    os.replace(tmp, final)
    _fsync_dir(directory)
    return final


def read_snapshot(path: Path, *, freeze: bool = True) -> tuple[Any, int]:
    """``(state, last WAL index)`` of one snapshot file; ``freeze``: the state lives as long
    as the server (see below)."""
    data = path.read_bytes()
    if len(data) < _HEADER.size:
        raise SnapshotCorruption(path, "shorter than its header")
    magic, version, last_index, length, crc = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise SnapshotCorruption(path, f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise SnapshotCorruption(path, f"format version {version}, this server reads "
                                 f"{FORMAT_VERSION}")
    payload = memoryview(data)[_HEADER.size:]
    if len(payload) != length:
        raise SnapshotCorruption(path, f"payload is {len(payload)} bytes, header says "
                                 f"{length}")
    if zlib.crc32(payload) != crc:
        raise SnapshotCorruption(path, "checksum mismatch")
    # Unpickling builds hundreds of thousands of objects and no garbage: the cyclic
    # collector would run dozens of times for nothing (it doubled the load time). The
    # loaded state is then frozen out of the collector's generations: it lives as long as
    # the server, and otherwise the first collections after the load traverse all of it
    # again (seconds of pauses in the log replay that follows).
    gc.disable()
    try:
        state = pickle.loads(payload)
        if freeze:
            gc.freeze()
    finally:
        gc.enable()
    return state, last_index


def load_latest(directory: Path, *, read_only: bool = False) -> tuple[Any, int] | None:
    """The newest snapshot's ``(state, last index)``, or None if there is none. Leftover
    ``.tmp`` files (a crash while writing) are deleted, unless ``read_only`` (another
    server's directory): they were never committed. A ``read_only`` load is not frozen
    out of the collector (it is a temporary copy, see :func:`read_snapshot`)."""
    if not read_only:
        for tmp in directory.glob(f"{_PREFIX}*.tmp"):
            tmp.unlink()
    snapshots = list_snapshots(directory)
    if not snapshots:
        return None
    return read_snapshot(snapshots[-1][1], freeze=not read_only)


def delete_before(directory: Path, last_index: int) -> None:
    """Deletes snapshots older than the one through ``last_index``."""
    for index, path in list_snapshots(directory):
        if index < last_index:
            path.unlink()


class Snapshotter:
    """Takes background snapshots of ``get_state()`` every ``every`` WAL records.

    Call :meth:`maybe_start` after appends, on the thread that owns the state (the event
    loop): the fork happens there, between two mutations, so the child's image is a
    consistent state after exactly the records up to the rotation point.
    """

    def __init__(self, directory: Path, wal: WriteAheadLog, get_state: Callable[[], Any], *,
                 every: int) -> None:
        self.directory = directory
        self.wal = wal
        self.get_state = get_state
        self.every = every
        self.last_index = 0  # WAL index the newest snapshot covers
        self.running = False
        self.completed = 0
        self.failed = 0
        self._done = threading.Event()
        self._done.set()

    def due(self) -> bool:
        return not self.running and self.wal.last_index - self.last_index >= self.every

    def maybe_start(self) -> bool:
        """Starts a snapshot if ``every`` records were logged since the last one."""
        if not self.due():
            return False
        self.start()
        return True

    def start(self) -> None:
        """Rotates the log and forks a child that writes the snapshot."""
        through = self.wal.rotate()
        started = time.perf_counter()
        self.running = True
        self._done.clear()
        pid = os.fork()
        if pid == 0:  # the child: write and leave without running any parent cleanup
            code = 1
            try:
                write_snapshot(self.directory, self.get_state(), through)
                code = 0
            except BaseException:
                traceback.print_exc()  # the parent logs only the exit status
            finally:
                os._exit(code)
        threading.Thread(target=self._reap, args=(pid, through, started),
                         name="snapshot-reaper", daemon=True).start()

    def _reap(self, pid: int, through: int, started: float) -> None:
        _, status = os.waitpid(pid, 0)
        try:
            if os.waitstatus_to_exitcode(status) == 0:
                delete_before(self.directory, through)
                self.wal.drop_through(through)
                self.last_index = through
                self.completed += 1
                _log.info("snapshot_written", through_index=through,
                          seconds=round(time.perf_counter() - started, 3))
            else:
                self.failed += 1
                _log.error("snapshot_failed", through_index=through,
                           exit_status=os.waitstatus_to_exitcode(status))
        finally:
            self.running = False
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for a running snapshot to finish (shutdown, tests)."""
        return self._done.wait(timeout)

    def take_now(self, state: Any) -> None:
        """A snapshot written synchronously (clean shutdown: the next start loads it
        instead of replaying the log)."""
        self.wait()
        through = self.wal.rotate()
        write_snapshot(self.directory, state, through)
        delete_before(self.directory, through)
        self.wal.drop_through(through)
        self.last_index = through
