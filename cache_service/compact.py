"""The compaction process: writes the snapshot through WAL index ``--through`` of a data
directory from the snapshot through ``--base`` and the closed log segments after it.

Started by :class:`cache_service.snapshot.Snapshotter` as ``python -m
cache_service.compact DIR --base B --through N --tag T --replay MODULE:NAME --parent PID``
(a separate process, never a fork of the server), while the server keeps appending to the
segment after ``N``. It reads only: snapshot ``B`` and the segments whose records are
``B+1..N`` (all closed: every record in them was answered before the rotation), which it
replays in order through the replay function (the server's ``apply`` of one logged
record, deterministic), then writes ``snapshot-N`` atomically (``.tmp``, fsync, rename).
Anything unexpected (a record missing, a damaged one, no space) ends it with exit status
1 and one line on stderr, having committed nothing: the server keeps the previous snapshot
and its log. It dies with the server (parent-death signal), so a server killed while it
runs leaves no process behind that could commit a snapshot later.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from cache_service.errors import DataDirError, KVCacheError
from cache_service.snapshot import (
    read_snapshot,
    resolve,
    snapshot_name,
    write_snapshot,
)
from cache_service.wal import _read_segment, list_segments


class CompactionError(DataDirError):
    """The closed log does not hold exactly the records the snapshot needs."""


def closed_records(directory: Path, after: int, through: int, tag: int | None
                   ) -> Iterator[tuple[int, bytes]]:
    """The records ``after+1..through`` of the log, one segment in memory at a time;
    raises :class:`CompactionError` or :class:`WalCorruption` unless they are all there,
    intact and in order."""
    segments = list_segments(directory)
    expect = after + 1
    for n, (first, path) in enumerate(segments):
        if first > through:
            break
        following = segments[n + 1][0] if n + 1 < len(segments) else None
        if following is not None and following <= expect:
            continue  # entirely covered by the base snapshot (not deleted yet)
        if first > expect:
            raise CompactionError(f"{path}: records {expect}..{first - 1} are missing")
        records, _, _ = _read_segment(path, first, last=False, tag=tag)
        for index, payload in records:
            if index < expect or index > through:
                continue
            yield index, payload
            expect = index + 1
    if expect != through + 1:
        raise CompactionError(f"the log in {directory} ends at record {expect - 1}, the "
                              f"snapshot was asked through {through}")


def compact(directory: Path, base: int, through: int, tag: int, replay: str) -> Path:
    """Writes ``snapshot-<through>`` (see the module docstring); returns its path."""
    apply = resolve(replay)
    state, last = read_snapshot(directory / snapshot_name(base), freeze=False, tag=tag)
    if last != base:
        raise CompactionError(f"snapshot {base} says it ends at {last}")
    for _, payload in closed_records(directory, base, through, tag):
        with contextlib.suppress(KVCacheError):  # rejected live too (see durability.py)
            apply(state, payload)
    return write_snapshot(directory, state, through, tag)


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when the server dies (Linux), and stop now if it already has:
    a snapshot committed after a new server started on the directory would race it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        sys.exit("compaction: the server that started it is gone")


def main(argv: Sequence[str] | None = None) -> int:
    """The compaction process's entry point: writes ``snapshot-<through>`` from snapshot
    ``--base`` and the records after it (dying with the server that started it); answers 1
    on a failure it names."""
    parser = argparse.ArgumentParser(prog="python -m cache_service.compact",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--base", type=int, required=True)
    parser.add_argument("--through", type=int, required=True)
    parser.add_argument("--tag", type=int, required=True)
    parser.add_argument("--replay", required=True, help="MODULE:NAME of the replay function")
    parser.add_argument("--parent", type=int, default=None, help="the server's pid")
    args = parser.parse_args(argv)
    if args.parent is not None:
        _die_with_parent(args.parent)
    # The server's event loop comes first on a busy machine: a snapshot may take longer.
    os.nice(10)
    gc.disable()  # loading and replaying make no garbage worth collecting; it only costs
    try:
        compact(args.directory, args.base, args.through, args.tag, args.replay)
    except (DataDirError, OSError, ValueError) as exc:  # e.g. CompactionError, WalCorruption
        print(f"compaction: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
