"""Snapshots of the service state: one file per snapshot, written atomically, by a
separate process.

File ``snapshot-<last WAL index, 20 digits>.snap``::

    8-byte magic | u32 format version (2) | u64 last WAL index | u64 directory tag |
    u64 payload length | u32 crc32(payload) | payload (pickle of the state)

(format 1, still read, has no directory tag). The state is pickled whole (pools, event
feeds, sessions, counters): the core's objects define compact pickled forms (blocks
without free-queue links, the queue as its order, token ids as packed arrays) so that a
million-block pool neither overflows the stack nor takes long to load.

Writing in the background (:class:`Snapshotter`) is a compaction: the log is rotated to a
new segment (so the snapshot covers exactly the closed segments), then a separately
started process (``cache_service.compact``) loads the previous snapshot, replays the
closed segments into it and writes ``.tmp``, fsyncs it and renames it into place, while
the server keeps serving. The serving process is never forked: a fork of a process with
gRPC's threads may crash the child. When the child succeeds, the server deletes the
segments and snapshots the new one covers. A crash at any point (of either process)
leaves either the old snapshot with its log or the new one: the rename is the commit.
"""

from __future__ import annotations

import gc
import importlib
import io
import os
import pickle
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.message import Message

from cache_service.errors import DataDirError
from cache_service.wal import WriteAheadLog, _fsync_dir

MAGIC = b"KVCSNAP\n"
FORMAT_VERSION = 2
_HEADER_V1 = struct.Struct("<8sIQQI")  # magic, version, last index, length, crc32
_HEADER = struct.Struct("<8sIQQQI")  # magic, version, last index, tag, length, crc32
_PREFIX, _SUFFIX = "snapshot-", ".snap"

_log = structlog.get_logger("cache_service.snapshot")


class SnapshotCorruption(DataDirError):
    """A snapshot file does not read back as written, or the log needs one that is not
    there (names the file)."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"snapshot {path} is unreadable: {reason}; refusing to start "
                         "(restore the file or move the data directory away)")
        self.path = path


class SnapshotMissing(SnapshotCorruption):
    """The log continues a snapshot that is not in the data directory (deleted, or
    replaced by an older one): starting would lose every record it held."""

    def __init__(self, path: Path, reason: str) -> None:
        Exception.__init__(self, f"snapshot {path} is missing: {reason}; refusing to start "
                           "on a state without it (restore the file, or move the data "
                           "directory away to start empty)")
        self.path = path


def snapshot_name(last_index: int) -> str:
    """``snapshot-<last_index, 20 digits>.snap``: names sort in index order."""
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


def write_snapshot(directory: Path, state: Any, last_index: int, tag: int = 0) -> Path:
    """Pickles ``state`` as the snapshot through WAL index ``last_index`` of the directory
    tagged ``tag`` (atomic: nothing is left behind if it fails)."""
    payload = dumps_state(state)
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, last_index, tag, len(payload),
                          zlib.crc32(payload))
    final = directory / snapshot_name(last_index)
    tmp = final.with_suffix(".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk gets its space back
        raise
    _fsync_dir(directory)
    return final


def read_snapshot(path: Path, *, freeze: bool = True, tag: int | None = None
                  ) -> tuple[Any, int]:
    """``(state, last WAL index)`` of one snapshot file; ``freeze``: the state lives as long
    as the server (see below); ``tag``: the directory tag it must carry (None: any)."""
    data = path.read_bytes()
    if len(data) < _HEADER_V1.size:
        raise SnapshotCorruption(path, "shorter than its header")
    magic, version = struct.unpack_from("<8sI", data)
    if magic != MAGIC:
        raise SnapshotCorruption(path, f"bad magic {magic!r}")
    found: int | None = None
    if version == 1:
        _, _, last_index, length, crc = _HEADER_V1.unpack_from(data)
        offset = _HEADER_V1.size
    elif version == FORMAT_VERSION and len(data) >= _HEADER.size:
        _, _, last_index, found, length, crc = _HEADER.unpack_from(data)
        offset = _HEADER.size
    else:
        raise SnapshotCorruption(path, f"format version {version}, this server reads 1 and "
                                 f"{FORMAT_VERSION}")
    if tag is not None and found is not None and found != tag:
        raise SnapshotCorruption(path, f"it belongs to another data directory (tag "
                                 f"{found:016x}, this directory's is {tag:016x})")
    if path.name.endswith(_SUFFIX) and path.name != snapshot_name(last_index):
        raise SnapshotCorruption(path, f"its header says it ends at record {last_index} (a "
                                 "renamed file)")
    payload = memoryview(data)[offset:]
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


def load_latest(directory: Path, *, read_only: bool = False, tag: int | None = None
                ) -> tuple[Any, int] | None:
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
    return read_snapshot(snapshots[-1][1], freeze=not read_only, tag=tag)


def delete_before(directory: Path, last_index: int) -> None:
    """Deletes snapshots older than the one through ``last_index``."""
    for index, path in list_snapshots(directory):
        if index < last_index:
            path.unlink()


def import_path(function: Callable[..., Any]) -> str:
    """``module:name`` of a module-level function, checked to import back as the same
    object (the compaction process finds the replay function by it)."""
    path = f"{function.__module__}:{function.__qualname__}"
    if resolve(path) is not function:
        raise ValueError(f"{function!r} is not a module-level function: the compaction "
                         "process could not import it")
    return path


def resolve(path: str) -> Callable[..., Any]:
    """The function an :func:`import_path` names."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class Snapshotter:
    """Takes a snapshot every ``every`` WAL records, without stopping the server for more
    than the log's rotation: a separately started process (``python -m
    cache_service.compact``, spawned, never forked from the serving process) loads the
    newest snapshot, replays the closed segments into it through the function ``replay``
    names (``module:name``, see :func:`import_path`), and writes the next snapshot.
    Replay is deterministic, so that snapshot is the state the server had at the rotation.

    Call :meth:`maybe_start` (or :meth:`start` when :meth:`due`) between two mutations on
    the thread that owns the state (the event loop): the rotation must fall between two
    records. The rest runs on a thread of its own, which also deletes what the new
    snapshot covers once it is committed. A child that fails (a full disk, killed) leaves
    the previous snapshot and every segment in place; the next try comes ``every``
    records later.
    """

    def __init__(self, directory: Path, wal: WriteAheadLog, *, every: int, replay: str,
                 tag: int = 0) -> None:
        self.directory = directory
        self.wal = wal
        self.every = every
        self.replay = replay
        self.tag = tag
        self.last_index = 0  # WAL index the newest snapshot covers
        self.running = False
        self.completed = 0
        self.failed = 0
        #: True: the compaction runs on its thread in this process instead (the same
        #: code, :func:`cache_service.compact.compact`; for tests taking many snapshots,
        #: where starting an interpreter each time would dominate).
        self.in_process = False
        self._retry_at = 0  # after a failure: no new try before this WAL index
        self._child: subprocess.Popen[bytes] | None = None
        self._stopping = False
        self._done = threading.Event()
        self._done.set()

    def due(self) -> bool:
        """Whether a snapshot should start now: none running, ``every`` records logged since
        the last one, and past the retry point of a failed one."""
        return not self.running and self.wal.last_index >= max(
            self.last_index + self.every, self._retry_at)

    def maybe_start(self) -> bool:
        """Starts a snapshot if ``every`` records were logged since the last one."""
        if not self.due():
            return False
        self.start()
        return True

    def start(self) -> None:
        """Rotates the log and starts the compaction process on a thread (all the
        serving loop waits for is the rotation)."""
        through = self.wal.rotate(defer_sync=True)
        self.running = True
        self._done.clear()
        threading.Thread(target=self._compact, args=(self.last_index, through),
                         name="snapshot-compaction", daemon=True).start()

    def command(self, base: int, through: int) -> list[str]:
        """The compaction process's command line."""
        return [sys.executable, "-m", "cache_service.compact", str(self.directory),
                "--base", str(base), "--through", str(through), "--tag", str(self.tag),
                "--replay", self.replay, "--parent", str(os.getpid())]

    def _compact(self, base: int, through: int) -> None:
        started = time.perf_counter()
        error = ""
        try:
            self.wal.finish_rotation()
        except OSError as exc:
            self._finish(-1, f"syncing the rotated log: {exc}", through, started)
            return
        if self.in_process:
            from cache_service.compact import compact  # imports this module

            try:
                compact(self.directory, base, through, self.tag, self.replay)
                code = 0
            except Exception as exc:  # noqa: BLE001 - reported as a failed child would be
                code, error = 1, f"{type(exc).__name__}: {exc}"
            self._finish(code, error, through, started)
            return
        try:
            # The child imports what this process imports (tests' stand-in states too).
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                p or os.getcwd() for p in sys.path))
            # No preexec_fn: Popen then uses vfork + exec, which runs no fork
            # handlers (gRPC's) and copy nothing; this thread stays until the child
            # ends, which its parent-death signal is tied to (see compact.py).
            child = subprocess.Popen(self.command(base, through), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     env=env, close_fds=True)
            self._child = child
            if self._stopping:
                child.kill()
            _log.info("snapshot_started", through_index=through, base_index=base,
                      pid=child.pid)
            _, err = child.communicate()
            code = child.returncode
            lines = err.decode(errors="replace").strip().splitlines()
            error = lines[-1] if lines else ""
        except OSError as exc:  # could not start it
            code, error = -1, str(exc)
        self._finish(code, error, through, started)

    def _finish(self, code: int, error: str, through: int, started: float) -> None:
        """After the compaction: the cleanup its snapshot allows, or the failure logged."""
        try:
            if code == 0:
                delete_before(self.directory, through)
                self.wal.drop_through(through)
                self.last_index = through
                self.completed += 1
                _log.info("snapshot_written", through_index=through,
                          seconds=round(time.perf_counter() - started, 3))
            elif self._stopping:
                self._drop_tmp(through)
                _log.info("snapshot_stopped", through_index=through,
                          detail="the server is stopping; its final snapshot replaces it")
            else:
                self._drop_tmp(through)
                self.failed += 1
                self._retry_at = self.wal.last_index + self.every
                _log.error("snapshot_failed", through_index=through, exit_status=code,
                           error=error, detail="the previous snapshot and the log stay; "
                           f"the next try comes after {self.every} more records")
        finally:
            self._child = None
            self.running = False
            self._done.set()

    def _drop_tmp(self, through: int) -> None:
        """Deletes what a failed child left (a killed one cannot clean up itself)."""
        (self.directory / snapshot_name(through)).with_suffix(".tmp").unlink(missing_ok=True)

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for a running snapshot to finish (shutdown, tests)."""
        return self._done.wait(timeout)

    def stop(self) -> None:
        """Ends a running compaction process (its snapshot is not needed: the server is
        stopping) and waits for its thread."""
        self._stopping = True
        child = self._child
        if child is not None:
            child.kill()
        self.wait()

    def take_now(self, state: Any) -> None:
        """A snapshot written synchronously (clean shutdown: the next start loads it
        instead of replaying the log)."""
        self.wait()
        through = self.wal.rotate()
        write_snapshot(self.directory, state, through, self.tag)
        delete_before(self.directory, through)
        self.wal.drop_through(through)
        self.last_index = through
