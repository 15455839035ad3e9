"""The write-ahead log: every accepted mutation, framed and checksummed, in segment files.

Layout of a data directory's log: segment files ``wal-<first index, 20 digits>.log``, each
starting with a header, then records back to back::

    header: 8-byte magic (format version) | u64 directory tag | u64 first index |
            u32 crc32(tag, first index)
    record: u32 payload length | u32 crc32(length, index, payload) | u64 index | payload

Indexes are 1, 2, 3, ... across segments without gaps; a segment's name (and its header)
says its first index, so a reader can check that nothing is missing between files, and the
oldest segment says which snapshot the log continues: the one through ``first index - 1``
(none for a log starting at 1). The directory tag names the data directory the segment was
written for (a file copied in from elsewhere is refused). Segments of format 1 (an 8-byte
magic and no more) are still read. The payload is opaque here (the service stores
serialized ``WalRecord`` messages).

Reading (:func:`scan`) tells a crash from corruption:

* a *torn tail* -- the last record of the last segment incomplete, or failing its
  checksum with nothing but its own bytes (or zeros) after it, and no intact record
  anywhere after it -- is what a crash in the middle of a write leaves. It is dropped and
  the file truncated to the last good record, as the client was never answered for it
  (answers go out only after the append). The last condition judges the header as strictly
  as the payload: a damaged length in the middle can make a record seem to run to the end
  of the file, but the intact records after it give it away;
* anything else that does not parse (a bad record followed by more data, a bad record in
  an earlier segment, a gap in the indexes) is corruption: :class:`WalCorruption` names the
  file and byte offset, and the service refuses to start rather than run on a state that
  differs from the one its clients saw.

A failed append (a full disk) is undone before it raises: see :class:`WriteAheadLog`.

Durability of an append (``fsync`` policy, the same trade-off as Redis' appendfsync):

* ``always``: ``fdatasync`` after every record, before the caller answers. Loses nothing
  that was answered, even on power loss.
* ``batch``: the record is written (``write(2)``) before the answer; a background thread
  runs ``fdatasync`` every ``sync_interval`` seconds when something was written. A process
  crash (SIGKILL, OOM) loses nothing answered (the kernel holds the bytes); an OS crash or
  power loss loses at most the answers of the last interval plus one fdatasync.
* ``never``: written before the answer, synced when the OS decides (Linux: within ~30 s
  by default). A process crash loses nothing; an OS crash may lose that much.
"""

from __future__ import annotations

import errno
import itertools
import os
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cache_service.errors import DataDirError

FsyncPolicy = Literal["always", "batch", "never"]

MAGIC = b"KVCWAL2\n"
MAGIC_V1 = b"KVCWAL1\n"  # format 1: the magic alone (read, never written)
_SEGMENT = struct.Struct("<8sQQI")  # magic, directory tag, first index, crc32(tag, first)
SEGMENT_HEADER_SIZE = _SEGMENT.size
_HEADER = struct.Struct("<IIQ")  # payload length, crc32, index
HEADER_SIZE = _HEADER.size
MAX_RECORD_BYTES = 1 << 30  # a longer length field can only be garbage
_PREFIX, _SUFFIX = "wal-", ".log"


class WalCorruption(DataDirError):
    """The log cannot be read back as written. ``path`` and ``offset`` locate the bad
    bytes; the service must not start on it."""

    def __init__(self, path: Path, offset: int, reason: str) -> None:
        super().__init__(f"write-ahead log {path} is corrupt at byte offset {offset}: "
                         f"{reason}; refusing to start on a state that may differ from the "
                         "one clients were answered with (restore the file or move the data "
                         "directory away to start empty)")
        self.path = path
        self.offset = offset


def segment_name(first_index: int) -> str:
    """``wal-<first_index, 20 digits>.log``: names sort in index order."""
    return f"{_PREFIX}{first_index:020d}{_SUFFIX}"


def list_segments(directory: Path) -> list[tuple[int, Path]]:
    """``(first index, path)`` of every segment file, in index order."""
    out = []
    for p in directory.iterdir():
        name = p.name
        if name.startswith(_PREFIX) and name.endswith(_SUFFIX):
            digits = name[len(_PREFIX):-len(_SUFFIX)]
            if digits.isdigit():
                out.append((int(digits), p))
    return sorted(out)


def segment_header(first_index: int, tag: int) -> bytes:
    """The header a segment starting at ``first_index`` begins with."""
    return _SEGMENT.pack(MAGIC, tag, first_index,
                         zlib.crc32(struct.pack("<QQ", tag, first_index)))


def _segment_start(path: Path, data: bytes, first: int, *, last: bool
                   ) -> tuple[int, int | None] | None:
    """``(offset of the first record, directory tag or None for format 1)`` of a
    segment's bytes; None for the last segment cut short inside its header (created,
    then a crash before the header was written: it holds no record)."""
    if data.startswith(MAGIC_V1):
        return len(MAGIC_V1), None
    if len(data) < SEGMENT_HEADER_SIZE:
        if last and (MAGIC.startswith(data) or data.startswith(MAGIC)):
            return None
        raise WalCorruption(path, 0, "file too short for the segment header")
    magic, tag, first_index, crc = _SEGMENT.unpack_from(data)
    if magic != MAGIC:
        raise WalCorruption(path, 0, f"bad magic {magic!r} (not a segment of this format "
                            "version)")
    if zlib.crc32(struct.pack("<QQ", tag, first_index)) != crc:
        if last and not data[SEGMENT_HEADER_SIZE:].strip(b"\0"):
            return None  # a torn header write, nothing after it
        raise WalCorruption(path, 0, "segment header checksum mismatch")
    if first_index != first:
        raise WalCorruption(path, 0, f"the header says the segment starts at index "
                            f"{first_index}, its name says {first} (a renamed file)")
    return SEGMENT_HEADER_SIZE, tag


def _crc(length: int, index: int, payload: bytes) -> int:
    return zlib.crc32(payload, zlib.crc32(struct.pack("<IQ", length, index)))


def frame(index: int, payload: bytes) -> bytes:
    """One record's bytes as stored."""
    n = len(payload)
    return _HEADER.pack(n, _crc(n, index, payload), index) + payload


@dataclass
class ScanResult:
    """What :func:`scan` found: the records after ``after`` and where the log ends."""

    records: list[tuple[int, bytes]]
    last_index: int  # the last good index in the log (``after`` if none is later)
    truncated_bytes: int  # torn-tail bytes dropped from the last segment
    first_index: int | None = None  # of the oldest segment (None: no segment)
    log_end: int | None = None  # the last index the segments hold (None: no segment)


def _read_segment(path: Path, expect_first: int, *, last: bool, tag: int | None = None,
                  ) -> tuple[list[tuple[int, bytes]], int, int | None]:
    """Records of one segment, the index after its last, and (last segment only) the
    offset to truncate a torn tail at (None = intact; 0 = a torn header: the file holds
    no record and must be created again). ``tag``: the directory tag it must carry."""
    data = path.read_bytes()
    start = _segment_start(path, data, expect_first, last=last)
    if start is None:
        return [], expect_first, 0
    pos, found = start
    if tag is not None and found is not None and found != tag:
        raise WalCorruption(path, 0, f"the segment belongs to another data directory (tag "
                            f"{found:016x}, this directory's is {tag:016x})")
    records: list[tuple[int, bytes]] = []
    index = expect_first
    end = len(data)
    unpack = _HEADER.unpack_from
    while pos < end:
        reason = None
        if end - pos < HEADER_SIZE:
            reason = "incomplete record header"
            stop = end
        else:
            length, crc, idx = unpack(data, pos)
            stop = pos + HEADER_SIZE + length
            if length > MAX_RECORD_BYTES:
                reason = f"record length {length} is implausible"
                stop = end
            elif stop > end:
                reason = f"record of {length} bytes runs past the end of the file"
                stop = end
            else:
                payload = data[pos + HEADER_SIZE:stop]
                if _crc(length, idx, payload) != crc:
                    reason = "checksum mismatch"
                elif idx != index:
                    reason = f"record index {idx} where {index} was expected"
        if reason is not None:
            # A torn write leaves only its own partial bytes (or zero-filled blocks) after
            # the last good record; anything else after a bad record is corruption. The
            # header is judged as strictly as the payload: a damaged length can make a
            # record in the middle look as if it ran to the end of the file, so a bad
            # record is torn only if no intact record follows it anywhere in the file.
            if last and (stop >= end or not data[stop:].strip(b"\0")):
                later = _intact_record_after(data, pos, index)
                if later is None:
                    return records, index, pos
                raise WalCorruption(path, pos, f"{reason}, yet record {later[0]} follows "
                                    f"intact at byte offset {later[1]} (a damaged record "
                                    "in the middle of the log, not a torn write)")
            raise WalCorruption(path, pos, reason)
        records.append((index, payload))
        index += 1
        pos = stop
    return records, index, None


#: How many of the indexes after a bad record :func:`_intact_record_after` looks for.
_LOOKAHEAD = 64


def _intact_record_after(data: bytes, pos: int, index: int) -> tuple[int, int] | None:
    """``(index, offset)`` of an intact record with one of the ``_LOOKAHEAD`` indexes
    after ``index`` that starts after ``pos``, or None. Each candidate is found by its
    index field (bytes.find, no per-offset loop) and must pass the full checksum, which
    covers its length and index: the chance that a torn write's leftover bytes contain
    one is the chance of a crc32 collision at a spot that already holds the right index."""
    for want in range(index + 1, index + 1 + _LOOKAHEAD):
        needle = struct.pack("<Q", want)
        at = data.find(needle, pos + 1 + 8)
        while at != -1:
            start = at - 8
            length, crc = struct.unpack_from("<II", data, start)
            stop = start + HEADER_SIZE + length
            if length <= MAX_RECORD_BYTES and stop <= len(data) and \
                    _crc(length, want, data[start + HEADER_SIZE:stop]) == crc:
                return want, start
            at = data.find(needle, at + 1)
    return None


def scan(directory: Path, after: int = 0, *, repair: bool = True, tag: int | None = None
         ) -> ScanResult:
    """Reads every segment, returns the records with index > ``after``; drops (and with
    ``repair`` truncates) a torn tail; raises :class:`WalCorruption` on anything else,
    also when the oldest segment starts after ``after + 1`` (the records in between, which
    a snapshot through ``after`` would hold, are missing) or a segment's header names
    another directory than ``tag`` (None: not checked). Segments entirely at or before
    ``after`` must have been deleted or be intact."""
    segments = list_segments(directory)
    records: list[tuple[int, bytes]] = []
    truncated = 0
    last_index = after
    expect: int | None = None
    for n, (first, path) in enumerate(segments):
        if expect is not None and first != expect:
            raise WalCorruption(path, 0, f"segment starts at index {first} but the previous "
                                f"one ended before {expect} (a segment is missing)")
        if expect is None and first > after + 1:
            raise WalCorruption(path, 0, f"the log continues the state after record "
                                f"{first - 1}, but the snapshot ends at {after} (records "
                                f"{after + 1}..{first - 1} are missing)")
        is_last = n == len(segments) - 1
        recs, nxt, torn_at = _read_segment(path, first, last=is_last, tag=tag)
        if torn_at is not None:
            truncated = path.stat().st_size - torn_at
            if repair:
                _cut(path, torn_at)
        records.extend(r for r in recs if r[0] > after)
        if recs:
            last_index = max(last_index, recs[-1][0])
        expect = nxt
    return ScanResult(records, last_index, truncated,
                      segments[0][0] if segments else None,
                      expect - 1 if expect is not None else None)


def _cut(path: Path, torn_at: int) -> None:
    """Drops a torn tail: the file is truncated at ``torn_at``, or deleted if its header
    was torn (it holds no record; the log creates it again)."""
    if torn_at == 0:
        path.unlink()
        _fsync_dir(path.parent)
        return
    with open(path, "r+b") as f:
        f.truncate(torn_at)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class WalBroken(OSError):
    """The log cannot take appends any more (an undo or an fdatasync failed): what is on
    disk may differ from what was written, so nothing more is written until a restart
    reads the log back."""


class WriteAheadLog:
    """Appends records to the newest segment of ``directory`` (open it after :func:`scan`
    so a torn tail is gone). Not thread-safe for appends: the server's event loop owns it;
    only the ``batch`` sync thread (or a group-commit :meth:`sync` in an executor) runs
    beside it.

    A failed append is undone before it raises: the segment is truncated back to the end
    of the last good record (a disk that filled up mid-record leaves no partial record
    that later appends would follow, which a restart would read as corruption). If even
    that fails, or an fdatasync fails, the log is *broken* (``broken`` says why) and every
    further append raises :class:`WalBroken`.

    ``group_commit`` (with ``fsync="always"``): :meth:`append` does not fdatasync itself;
    the caller calls :meth:`sync` (once for many appends) before answering."""

    def __init__(self, directory: Path, next_index: int, *, fsync: FsyncPolicy = "batch",
                 sync_interval: float = 0.05, tag: int = 0, group_commit: bool = False
                 ) -> None:
        if fsync not in ("always", "batch", "never"):
            raise ValueError(f"fsync must be always, batch or never, got {fsync!r}")
        self.directory = directory
        self.fsync = fsync
        self.next_index = next_index
        self.tag = tag  # the directory tag new segments carry
        self.broken: str | None = None
        self._sync_each = fsync == "always" and not group_commit
        self._lock = threading.Lock()  # guards _fd against rotation during a batch sync
        self._dirty = False
        self._closed = threading.Event()
        self._rotated: list[int] = []  # descriptors of segments rotated out, to sync
        segments = list_segments(directory)
        if segments and segments[-1][0] == next_index \
                and segments[-1][1].read_bytes() != segment_header(next_index, tag):
            # Left empty by the previous run, in format 1: written again in this one.
            segments.pop()[1].unlink()
        if segments and segments[-1][0] == next_index:
            self._first, self._path = segments[-1]  # left empty by the previous run
            self._fd = os.open(self._path, os.O_WRONLY | os.O_APPEND)
        else:
            # Each run appends to a segment of its own, named after its first index, so
            # the names alone prove that no record is missing between files.
            self._fd = self._create(next_index)
        self._size = os.fstat(self._fd).st_size  # the end of the last good record
        self._thread = None
        if fsync == "batch":
            self._thread = threading.Thread(target=self._sync_loop, args=(sync_interval,),
                                            name="wal-sync", daemon=True)
            self._thread.start()

    @property
    def last_index(self) -> int:
        """The index of the last record in the log: one before the next append's."""
        return self.next_index - 1

    @property
    def path(self) -> Path:
        """The segment appends go to."""
        return self._path

    def _create(self, first_index: int, *, sync: bool = True) -> int:
        """Creates the segment starting at ``first_index`` (header written and, with
        ``sync``, synced with the directory) and makes it current; on failure nothing is
        left behind and the current segment stays."""
        path = self.directory / segment_name(first_index)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o644)
        header = segment_header(first_index, self.tag)
        try:
            if os.write(fd, header) != len(header):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            if sync:
                os.fsync(fd)
                _fsync_dir(self.directory)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        self._first, self._path = first_index, path
        self._size = len(header)
        return fd

    def append(self, payload: bytes) -> int:
        """Writes one record (and syncs it under ``always`` without group commit);
        returns its index. On an error nothing of the record stays (see the class)."""
        if self.broken is not None:
            raise WalBroken(errno.EIO, f"the write-ahead log {self._path} takes no more "
                            f"appends: {self.broken}")
        index = self.next_index
        data = frame(index, payload)
        try:
            written = os.write(self._fd, data)
            if written != len(data):  # a regular file writes whole, short of ENOSPC
                raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (wrote {written} "
                              f"of {len(data)} bytes)", str(self._path))
            if self._sync_each:
                os.fdatasync(self._fd)
        except OSError:
            self._undo()
            raise
        self._size += len(data)
        self.next_index = index + 1
        if not self._sync_each:
            self._dirty = True
        return index

    def _undo(self) -> None:
        """Cuts the current segment back to its last good record."""
        try:
            os.ftruncate(self._fd, self._size)
        except OSError as exc:
            self.broken = f"a failed append could not be undone ({exc})"

    def rotate(self, *, defer_sync: bool = False) -> int:
        """Starts a new segment at the next index; returns the last index of the old ones
        (what a snapshot taken now covers). ``defer_sync`` (not under ``always``, whose
        answers wait for the disk): the syncs of the old segment, the new one and the
        directory are left to :meth:`finish_rotation`, to be run off the event loop (a
        crash of the machine before it loses no more than the ``batch`` window)."""
        defer = defer_sync and self.fsync != "always"
        with self._lock:
            if self.fsync != "never" and not defer:
                self._fdatasync()
            if self._first != self.next_index:  # else the current segment is still empty
                old = self._fd
                self._fd = self._create(self.next_index, sync=not defer)
                if defer:
                    self._rotated.append(old)
                else:
                    os.close(old)
            self._dirty = defer  # the sync thread then syncs the new segment soon
        return self.next_index - 1

    def finish_rotation(self) -> None:
        """The syncs a :meth:`rotate` with ``defer_sync`` left (any thread); a failure
        breaks the log, as a failed fdatasync does (see :meth:`_fdatasync`)."""
        if not self._rotated:
            return
        try:
            while self._rotated:
                fd = self._rotated.pop()
                try:
                    if self.fsync != "never":
                        os.fdatasync(fd)
                finally:
                    os.close(fd)
            if self.fsync != "never":
                with self._lock:
                    os.fsync(self._fd)
                _fsync_dir(self.directory)
        except OSError as exc:
            self.broken = f"syncing the rotated log in {self.directory} failed ({exc})"
            raise

    def drop_through(self, index: int) -> int:
        """Deletes segments whose records all have index <= ``index`` (a snapshot covers
        them); answers how many. The current segment always stays."""
        segments = list_segments(self.directory)
        removed = 0
        for (_, path), (nxt_first, _) in itertools.pairwise(segments):
            if nxt_first - 1 <= index and path != self._path:
                path.unlink()
                removed += 1
        if removed:
            _fsync_dir(self.directory)
        return removed

    def _fdatasync(self) -> None:
        """fdatasync of the current segment (caller holds ``_lock``). A failure breaks the
        log: after a failed fdatasync the kernel may have dropped the dirty pages, so a
        later success would prove nothing (PostgreSQL's "fsyncgate")."""
        try:
            os.fdatasync(self._fd)
        except OSError as exc:
            self.broken = f"fdatasync of {self._path} failed ({exc})"
            raise

    def sync(self) -> None:
        """Flushes everything appended so far to stable storage."""
        with self._lock:
            self._fdatasync()
            self._dirty = False

    def _sync_loop(self, interval: float) -> None:
        while not self._closed.wait(interval):
            if self._dirty:
                with self._lock:
                    if self._closed.is_set():
                        return
                    self._dirty = False
                    try:
                        self._fdatasync()
                    except OSError:
                        return  # broken: appends now refuse, and say why

    def close(self) -> None:
        """Finishes a rotation in progress, stops the sync thread, syncs what was appended
        (unless ``fsync`` is never or the log is broken) and closes the file."""
        self.finish_rotation()
        self._closed.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            try:
                if self.fsync != "never" and self.broken is None:
                    self._fdatasync()
            finally:
                os.close(self._fd)
