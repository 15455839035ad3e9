"""The one exception hierarchy of the service shell (``cache_service`` outside ``core/`` and
``client/``).

Two roots:

* errors a call answers extend the core's :class:`~cache_service.core.errors.KVCacheError`
  tree, so :mod:`cache_service.status` maps the core's errors and these with one table.
  Each class below names the status it answers; the core's classes (and ``qualify``) are
  re-exported here so that shell code imports its errors from one module;
* :class:`DataDirError`: data on disk that cannot be used (a data directory locked or not
  a directory, a damaged log or snapshot: ``cache_service.wal.WalCorruption``,
  ``cache_service.snapshot.SnapshotCorruption``, ``cache_service.compact.CompactionError``;
  a damaged hand-over file: ``cache_service.cluster.handoff.HandoffError``). Never a
  call's answer: at start the server exits with one line naming the setting; a bad
  hand-over file is logged and the pool is not installed from it.
"""

from __future__ import annotations

from cache_service.core import errors as _core
from cache_service.core.errors import InvalidArgument, KVCacheError, ResourceExhausted

# The rest of the core's tree, re-exported: shell code imports every error from here.
AlreadyExists = _core.AlreadyExists
FailedPrecondition = _core.FailedPrecondition
NotFound = _core.NotFound
qualify = _core.qualify

__all__ = [
    "AlreadyExists", "DataDirError", "DataDirFull", "DataDirUnwritable", "Draining",
    "FailedPrecondition", "Internal", "InvalidArgument", "KVCacheError", "NotFound",
    "ResourceExhausted", "SequenceOutOfRange", "Unauthenticated", "Unavailable",
    "UndecodableMessage", "qualify",
]


class Unavailable(KVCacheError):
    """Retry later or elsewhere (-> UNAVAILABLE). ``trailing_metadata`` goes with the
    status (e.g. a cluster redirect naming the pool's owner)."""

    trailing_metadata: tuple[tuple[str, str], ...] = ()


class Draining(Unavailable):
    """The server is shutting down: the call (or the next message of a stream) is turned
    away unapplied (-> UNAVAILABLE). The negative pushback keeps the client's gRPC retry
    policy from retrying on this instance, which is leaving; the client moves on."""

    MESSAGE = "server is shutting down; retry on another instance"
    trailing_metadata = (("grpc-retry-pushback-ms", "-1"),)

    def __init__(self) -> None:
        super().__init__(self.MESSAGE)


class Unauthenticated(KVCacheError):
    """No known bearer token (-> UNAUTHENTICATED)."""

    MESSAGE = "missing or invalid bearer token (metadata 'authorization: Bearer <token>')"

    def __init__(self) -> None:
        super().__init__(self.MESSAGE)


class UndecodableMessage(InvalidArgument):
    """Bytes that do not parse as the call's request message (-> INVALID_ARGUMENT)."""

    def __init__(self, rpc: str, error: str) -> None:
        super().__init__(f"the request is not a valid {rpc} message ({error})")


class Internal(KVCacheError):
    """A bug, not the caller's fault (-> INTERNAL): the traceback goes to the log, the
    caller gets the request id to quote."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"internal error; quote the request id {request_id}")


class SequenceOutOfRange(KVCacheError):
    """``from_sequence`` is older than a pool's event buffer or beyond its next sequence
    (-> OUT_OF_RANGE)."""

    def __init__(self, message: str, *, oldest: int, next_sequence: int) -> None:
        super().__init__(message)
        self.oldest = oldest
        self.next_sequence = next_sequence


class DataDirFull(ResourceExhausted):
    """An append found no space in the data directory: the call was not applied (its
    partial record was cut off again) and may be retried once space is freed."""


class DataDirUnwritable(Unavailable):
    """The data directory refused a write for another reason than space (I/O error,
    read-only remount, a log broken by an earlier failure)."""


class DataDirError(Exception):
    """Data on disk cannot be used (a data directory locked by another server or not a
    directory, a damaged log, snapshot or hand-over file); names the path."""
