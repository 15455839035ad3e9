"""Hand-over files: the state of one pool, written by a replica leaving the cluster (SIGTERM)
for the successor it passes the pool to.

A leaving replica seals its log first (nothing is written to it afterwards), then writes
each pool it owns to ``<its data dir>/handoff/<pool hex>.<token>.pool`` -- written once, to
a temporary name, fsync'ed and renamed -- and only then moves the pool's owner key to the
successor with the file's name in it (:meth:`Placement.hand_over`). So the successor reads
a finished, immutable file: never a log that is still being written, compacted or, after a
quick restart of the leaving replica, appended to again.

File layout: ``MAGIC``, the 32-byte SHA-256 of the payload, the payload (what
:meth:`ServiceState.export_pool` answers: what an ``AdoptPool`` record carries).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from cache_service.errors import DataDirError

MAGIC = b"KVHANDOFF1\n"
DIRECTORY = "handoff"


class HandoffError(DataDirError):
    """A hand-over file is missing, truncated or damaged (names the file)."""


def handoff_name(pool_id: str, token: int) -> str:
    """The file name of ``pool_id``'s hand-over at fencing token ``token`` (pool ids may
    hold ``/``: hex keeps the name one path component)."""
    return f"{pool_id.encode().hex()}.{token}.pool"


def write_handoff(data_dir: Path, pool_id: str, token: int, payload: bytes) -> Path:
    """Writes the hand-over file durably (temporary name, fsync, rename, fsync of the
    directory); answers its path."""
    directory = data_dir / DIRECTORY
    directory.mkdir(exist_ok=True)
    path = directory / handoff_name(pool_id, token)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC + hashlib.sha256(payload).digest() + payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def read_handoff(path: Path) -> bytes:
    """The payload of a hand-over file; raises :class:`HandoffError`."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise HandoffError(f"hand-over file {path} cannot be read: {exc}") from None
    head = len(MAGIC) + 32
    if len(data) < head or not data.startswith(MAGIC):
        raise HandoffError(f"hand-over file {path} is truncated or not a hand-over file")
    payload = data[head:]
    if hashlib.sha256(payload).digest() != data[len(MAGIC):head]:
        raise HandoffError(f"hand-over file {path}: checksum mismatch")
    return payload
