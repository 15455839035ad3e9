"""Where accepted mutations go before they are answered: nowhere (in-memory) or a data
directory (write-ahead log + snapshots), and how a data directory is recovered at start.

Data directory layout::

    LOCK                     flock'ed by the running server (one server per directory)
    instance                 the instance id of this directory's history (pool incarnations
                             derive from it); a new one whenever a history starts
    snapshot-<index>.snap    the newest snapshot (state through WAL record <index>)
    wal-<index>.log          log segments (records from <index> on)

Recovery (:func:`open_data_dir`): load the newest snapshot (or build an empty state), check
that it is the one the log continues (the oldest segment starts right after it, or
earlier: a snapshot that is missing or older than that is corruption, never an empty
start), then replay every logged record after it, in order, through the same ``apply``
function the live server uses. ``apply`` is deterministic (no clock, no randomness:
lease expiries and generated ids are records themselves), so the replayed state equals
the state the server had after its last logged record: block tables, free-queue order,
prefix-cache map, stats, event sequence numbers, sessions. A record that apply rejects
was rejected identically when it was live (same state, same input), so replay skips it
the same way.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import gc
import hashlib
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import structlog
from google.protobuf.message import Message

from cache_service.errors import (
    DataDirError,
    DataDirFull,
    DataDirUnwritable,
    KVCacheError,
    Unavailable,
)
from cache_service.snapshot import (
    SnapshotCorruption,
    SnapshotMissing,
    Snapshotter,
    import_path,
    list_snapshots,
    load_latest,
    snapshot_name,
    write_snapshot,
)
from cache_service.wal import (
    FsyncPolicy,
    ScanResult,
    WalBroken,
    WriteAheadLog,
    list_segments,
    scan,
)

S = TypeVar("S")

_log = structlog.get_logger("cache_service.durability")


#: errno values that mean "no space" (a full file system, a quota).
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
#: After a snapshot could not start (e.g. no space for its new segment), how many records
#: go by before the next try (each try costs a file create).
_SNAPSHOT_RETRY_RECORDS = 100


@dataclass
class Recovery:
    """What :func:`open_data_dir` restored (logged at start, reported by benches)."""

    snapshot_index: int  # 0 = no snapshot
    records_replayed: int
    records_rejected: int
    torn_bytes_dropped: int
    snapshot_seconds: float
    replay_seconds: float
    cpu_seconds: float  # process CPU time of both (wall time suffers on a busy machine)

    @property
    def replay_rate(self) -> float:
        """Replayed records per second."""
        return self.records_replayed / self.replay_seconds if self.replay_seconds else 0.0


class DataDir(Generic[S]):
    """A data directory in use, as the state's durability hook: ``append`` logs each
    accepted record before the state changes and the caller answers; ``sync`` (awaited
    before the answer when ``needs_sync``) makes ``--fsync always`` durable with one
    fdatasync per group of concurrent calls. Created by :func:`open_data_dir`."""

    def __init__(self, directory: Path, lock_fd: int, instance_id: str, wal: WriteAheadLog,
                 snapshotter: Snapshotter, recovery: Recovery) -> None:
        self.directory = directory
        self.instance_id = instance_id
        self.wal = wal
        self.snapshotter = snapshotter
        self.recovery = recovery
        self.needs_sync = wal.fsync == "always"
        self.keeps_records = True
        self._lock_fd = lock_fd
        self._synced = wal.last_index
        self._syncing: asyncio.Future[int] | None = None
        self._snapshot_retry_at = 0
        #: Set by :meth:`seal`: the log takes no record any more.
        self.sealed = False

    def append(self, record: Message) -> None:
        """Logs one accepted record. Called between validation and mutation, so the state
        is exactly the one after the previous record: the moment to start a snapshot
        (through the previous record) when one is due. Raises :class:`DataDirFull` or
        :class:`DataDirUnwritable` with nothing logged (the caller then changes nothing);
        after :meth:`seal`, :class:`~cache_service.errors.Unavailable` (retry elsewhere)."""
        if self.sealed:
            raise Unavailable(f"the log in {self.directory} is sealed (this replica is "
                              "handing its pools over); retry on another replica")
        if self.snapshotter.due() and self.wal.last_index >= self._snapshot_retry_at:
            try:
                self.snapshotter.start()
            except OSError as exc:  # nothing is lost: the log keeps growing meanwhile
                self._snapshot_retry_at = self.wal.last_index + _SNAPSHOT_RETRY_RECORDS
                _log.error("snapshot_not_started", data_dir=str(self.directory),
                           error=str(exc))
        try:
            self.wal.append(record.SerializeToString())
        except OSError as exc:
            raise self._refused(exc) from exc

    def _refused(self, exc: OSError) -> DataDirFull | DataDirUnwritable:
        """The answer to a call whose record could not be logged (nothing was applied)."""
        if exc.errno in _NO_SPACE and not isinstance(exc, WalBroken):
            return DataDirFull(f"data directory {self.directory} is full "
                               f"({os.strerror(exc.errno)}): the call was not applied; "
                               "retry once space is freed there (reads still work)")
        if self.wal.broken is not None:
            _log.error("wal_broken", data_dir=str(self.directory), reason=self.wal.broken)
        return DataDirUnwritable(f"data directory {self.directory} cannot be written "
                                 f"({exc.strerror or exc}): the call was not applied; "
                                 + ("restart the server once the disk is healthy (reads "
                                    "still work)" if self.wal.broken is not None else
                                    "retry later or on another replica"))

    def _unsynced(self, exc: OSError) -> DataDirUnwritable:
        """The answer to calls waiting for an fdatasync that failed: applied here, but
        maybe not on disk; the log takes no more appends (see WriteAheadLog)."""
        _log.error("wal_broken", data_dir=str(self.directory), reason=self.wal.broken)
        return DataDirUnwritable(f"data directory {self.directory}: fdatasync failed "
                                 f"({exc.strerror or exc}); this call's outcome is in "
                                 "doubt (it may be lost at the next restart) and the "
                                 "server takes no more writes until it is restarted on a "
                                 "healthy disk")

    async def sync(self) -> None:
        """Returns once every record appended so far is on stable storage. Concurrent
        callers share one fdatasync (group commit), run off the event loop.

        Each waiter takes the result of the fdatasync it awaited itself, in its own task:
        progress never depends on a done-callback having run. (It once did: a caller that
        arrived between the fdatasync's end and its callback found the finished future,
        awaited it without yielding, and looped forever on the event loop -- two
        concurrent Steps under ``--fsync always`` wedged the server.)"""
        target = self.wal.last_index
        while self._synced < target:
            syncing = self._syncing
            if syncing is None:
                syncing = self._syncing = asyncio.get_running_loop().run_in_executor(
                    None, self._sync_now)
            try:
                through = await asyncio.shield(syncing)
            except asyncio.CancelledError:
                raise  # the fdatasync goes on for the other waiters
            except OSError as exc:
                raise self._unsynced(exc) from exc
            finally:
                if self._syncing is syncing and syncing.done():
                    self._syncing = None  # the next waiter starts a new fdatasync
            self._synced = max(self._synced, through)

    def _sync_now(self) -> int:
        through = self.wal.last_index  # appends happen on the loop; what is written now
        self.wal.sync()
        return through

    def seal(self) -> None:
        """Ends the log for good (cluster hand-over on SIGTERM): every later append is
        refused, everything appended so far is on stable storage when this returns, and
        :meth:`close` writes no final snapshot. A successor may then read what this
        replica handed over without racing a writer (a running compaction is ended too:
        it would delete segments a reader of this directory may be reading)."""
        self.sealed = True
        self.snapshotter.stop()
        try:
            self.wal.sync()
        except OSError as exc:  # the hand-over files still carry every applied record
            _log.error("seal_sync_failed", data_dir=str(self.directory), error=str(exc))

    def close(self, state: Any = None) -> None:
        """Flushes the log; with ``state`` (clean shutdown) writes a final snapshot so the
        next start replays nothing (a compaction still running is ended first) -- unless
        the log was sealed (nothing is written after a seal). A snapshot that cannot be
        written (a full disk) is logged and skipped: the log still holds everything, the
        next start replays it."""
        self.snapshotter.stop()
        try:
            if state is not None and self.wal.last_index > self.snapshotter.last_index \
                    and self.wal.broken is None and not self.sealed:
                try:
                    self.snapshotter.take_now(state)
                except OSError as exc:
                    _log.error("final_snapshot_failed", data_dir=str(self.directory),
                               error=str(exc), detail="the log holds every record; the "
                               "next start replays it")
            try:
                self.wal.close()
            except OSError as exc:
                _log.error("wal_close_failed", data_dir=str(self.directory),
                           error=str(exc))
        finally:
            os.close(self._lock_fd)


def _lock(directory: Path) -> int:
    fd = os.open(directory / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DataDirError(f"data directory {directory} is in use by another server "
                           "(its LOCK file is held)") from None
    return fd


def _instance_id(directory: Path, *, new_history: bool) -> str:
    """The id of the directory's history: a fresh one (written atomically) when a history
    starts (no snapshot, no log: a new directory, or one whose files were removed), so
    that pools registered in it never get the incarnations of a lost one."""
    path = directory / "instance"
    if not new_history:
        if not path.is_file():
            raise DataDirError(f"data directory {directory} holds a log or snapshot but no "
                               "instance file (restore it, or move the directory away to "
                               "start empty)")
        return path.read_text().strip()
    new_id = secrets.token_hex(8)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(new_id + "\n")
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return new_id


def directory_tag(instance_id: str) -> int:
    """The tag snapshots and log segments carry to name the directory (history) they were
    written for: a file copied in from another one is refused."""
    return int.from_bytes(hashlib.blake2b(instance_id.encode(), digest_size=8).digest(),
                          "big")


def _check_link(directory: Path, snapshot_index: int) -> None:
    """The newest snapshot must be the one the log continues: it must reach the record
    before the oldest segment, else that snapshot was deleted or replaced by an older one
    (and the records it held are gone)."""
    segments = list_segments(directory)
    if segments and segments[0][0] - 1 > snapshot_index:
        first, path = segments[0]
        found = (f"the newest snapshot here ends at record {snapshot_index}"
                 if snapshot_index else "there is no snapshot")
        raise SnapshotMissing(directory / snapshot_name(first - 1),
                              f"the log ({path}) continues the state after record "
                              f"{first - 1}, which only that snapshot holds, and {found}")


def _check_end(directory: Path, snapshot_index: int, log: ScanResult) -> None:
    """...and must not pass the log's end (a snapshot of a later state than the log's)."""
    if log.log_end is not None and snapshot_index > log.log_end:
        raise SnapshotCorruption(directory / snapshot_name(snapshot_index),
                                 f"it holds records through {snapshot_index}, the log ends "
                                 f"at {log.log_end} (a snapshot of a later state, or an "
                                 "older log)")


def new_instance_id() -> str:
    """An instance id for a server without a data directory (a fresh one each start)."""
    return secrets.token_hex(8)


def _replay(state: S, records: list[tuple[int, bytes]], apply: Callable[[S, bytes], Any]
            ) -> int:
    """Applies logged records in order; answers how many apply rejected (they were
    rejected identically when they were live, see the module docstring)."""
    rejected = 0
    for _, payload in records:
        try:
            apply(state, payload)
        except KVCacheError:
            rejected += 1
    return rejected


def read_data_dir(directory: Path, *, new_state: Callable[[str], S],
                  apply: Callable[[S, bytes], Any]) -> S:
    """The state another server's data directory holds (snapshot + log replay), read
    without writing anything there: no lock, no repair of a torn tail (a torn last record
    was never answered), no cleanup. How a cluster replica reads a dead replica's
    directory on shared storage. Raises :class:`DataDirError` (missing),
    :class:`~cache_service.wal.WalCorruption` or
    :class:`~cache_service.snapshot.SnapshotCorruption`."""
    instance = directory / "instance"
    if not instance.is_file():
        raise DataDirError(f"{directory} holds no data directory (no instance file)")
    instance_id = instance.read_text().strip()
    tag = directory_tag(instance_id)
    loaded = load_latest(directory, read_only=True, tag=tag)
    if loaded is None:
        state, snapshot_index = new_state(instance_id), 0
    else:
        state, snapshot_index = loaded
    _check_link(directory, snapshot_index)
    log = scan(directory, snapshot_index, repair=False, tag=tag)
    _check_end(directory, snapshot_index, log)
    _replay(state, log.records, apply)
    return state


def open_data_dir(directory: Path, *, new_state: Callable[[str], S],
                  apply: Callable[[S, bytes], Any], fsync: FsyncPolicy = "batch",
                  fsync_interval: float = 0.05, snapshot_every: int = 5000,
                  ) -> tuple[DataDir[S], S]:
    """Locks ``directory`` (created if missing), restores its state (snapshot + log
    replay through ``apply``) and opens its log for appends. ``new_state(instance_id)``
    builds the empty state of a new history. ``apply`` must be a module-level function:
    the compaction process that writes background snapshots imports it (see
    :class:`~cache_service.snapshot.Snapshotter`). Raises :class:`DataDirError`,
    :class:`~cache_service.wal.WalCorruption` or
    :class:`~cache_service.snapshot.SnapshotCorruption` (also
    :class:`~cache_service.snapshot.SnapshotMissing`: the snapshot the log continues is
    not there)."""
    replay = import_path(apply)
    try:
        return _open_data_dir(directory, new_state=new_state, apply=apply, replay=replay,
                              fsync=fsync, fsync_interval=fsync_interval,
                              snapshot_every=snapshot_every)
    except OSError as exc:  # a file in the way, read-only, not permitted, ...
        raise DataDirError(_unusable(directory, exc)) from exc


def _unusable(directory: Path, exc: OSError) -> str:
    """Why ``directory`` cannot be used, in one line."""
    why = exc.strerror or str(exc)
    if isinstance(exc, FileExistsError) or (os.path.lexists(directory)
                                            and not os.path.isdir(directory)):
        return f"data directory {directory} is not a directory (a file is in the way)"
    if isinstance(exc, NotADirectoryError):
        return (f"data directory {directory} cannot be created: a part of its path is a "
                "file, not a directory")
    where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(directory) \
        else ""
    if exc.errno == errno.EROFS:
        return (f"data directory {directory} is on a read-only file system{where}: the "
                "server writes its log there")
    if isinstance(exc, PermissionError):
        return (f"data directory {directory} may not be written by this process{where}: "
                f"{why} (the server writes its log there)")
    return f"data directory {directory} cannot be used{where}: {why}"


def _open_data_dir(directory: Path, *, new_state: Callable[[str], S],
                   apply: Callable[[S, bytes], Any], replay: str, fsync: FsyncPolicy,
                   fsync_interval: float, snapshot_every: int,
                   ) -> tuple[DataDir[S], S]:
    directory.mkdir(parents=True, exist_ok=True)
    if not directory.is_dir():
        raise DataDirError(f"data directory {directory} is not a directory")
    lock_fd = _lock(directory)
    try:
        new_history = not list_snapshots(directory) and not list_segments(directory)
        instance_id = _instance_id(directory, new_history=new_history)
        tag = directory_tag(instance_id)
        started, cpu_started = time.perf_counter(), time.process_time()
        loaded = load_latest(directory, tag=tag)
        if loaded is None:
            state, snapshot_index = new_state(instance_id), 0
        else:
            state, snapshot_index = loaded
        loaded_at = time.perf_counter()
        _check_link(directory, snapshot_index)
        result = scan(directory, snapshot_index, tag=tag)
        _check_end(directory, snapshot_index, result)
        rejected = _replay(state, result.records, apply)
        # The recovered state lives as long as the server: keep the cyclic collector from
        # traversing it again and again (a full collection over a million-block pool
        # stalls the loop for a noticeable time).
        gc.freeze()
        replayed_at = time.perf_counter()
        recovery = Recovery(snapshot_index, len(result.records), rejected,
                            result.truncated_bytes, loaded_at - started,
                            replayed_at - loaded_at, time.process_time() - cpu_started)
        if loaded is None:
            # The base the first compaction replays the log into (the empty state).
            write_snapshot(directory, new_state(instance_id), 0, tag)
        wal = WriteAheadLog(directory, result.last_index + 1, fsync=fsync,
                            sync_interval=fsync_interval, tag=tag, group_commit=True)
    except BaseException:
        os.close(lock_fd)
        raise
    snapshotter = Snapshotter(directory, wal, every=snapshot_every, replay=replay, tag=tag)
    snapshotter.last_index = snapshot_index
    return DataDir(directory, lock_fd, instance_id, wal, snapshotter, recovery), state
