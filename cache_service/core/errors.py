"""The one exception hierarchy of the allocator core.

Every error the core raises for bad input is a :class:`KVCacheError`. The gRPC
boundary (``cache_service/status.py``) maps each class to one status code, so the
core never imports gRPC. A method that raises leaves the state as it was.

Running out of blocks is *not* an error: allocation answers ``None`` ("no room")
and the caller decides whether to preempt.
"""

from __future__ import annotations

from typing import Any, TypeAlias, TypeVar

_T = TypeVar("_T")

#: A parameter declared ``_T`` whose value the callee checks itself, raising the error that
#: names it (any Python value may arrive: a replay trace, a JSON config, a Python caller).
#: The ``Any`` is for the compiled core: mypyc checks declared types at the call and would
#: raise a bare TypeError before the check could name the field.
Checked: TypeAlias = _T | Any


class KVCacheError(Exception):
    """Base class. ``field`` names the offending input (``"token_ids[3]"``) or is ``""``."""

    def __init__(self, message: str, *, field: str = "") -> None:
        super().__init__(message)
        self.field = field


class InvalidArgument(KVCacheError):
    """The input is malformed: out of range, empty, wrong type (-> INVALID_ARGUMENT)."""


class ConfigError(InvalidArgument):
    """Layer specs or a pool config that cannot be grouped or sized (-> INVALID_ARGUMENT)."""


class NotFound(KVCacheError):
    """An unknown request or pool (-> NOT_FOUND)."""


class AlreadyExists(KVCacheError):
    """A duplicate request id, or a pool id registered with another description
    (-> ALREADY_EXISTS)."""


class FailedPrecondition(KVCacheError):
    """The call is valid but the state does not allow it now, e.g. a lookup on a request
    that already has computed tokens (-> FAILED_PRECONDITION)."""


class ResourceExhausted(KVCacheError):
    """A budget or a per-call limit of the service would be exceeded, e.g. registering a
    pool beyond the server's block budget (-> RESOURCE_EXHAUSTED). Not "no room": that is
    an allocation answer, never an error."""


class UnknownRequest(NotFound):
    """No request with this id is registered in the pool."""


class DuplicateRequest(AlreadyExists):
    """A request with this id is already registered in the pool."""


def qualify(exc: KVCacheError, prefix: str) -> KVCacheError:
    """Prefixes the error's field with the path of the message it sits in
    (``ops[3].allocate`` + ``num_new_tokens``)."""
    if prefix:
        exc.field = f"{prefix}.{exc.field}" if exc.field else prefix
    return exc
