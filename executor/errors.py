"""The one exception hierarchy of the executor.

Every error the executor raises on purpose is an :class:`ExecutorError`; the gRPC boundary
(``executor/server.py``, :func:`executor.server.status_code_of`) maps each class to one status
code, so nothing below the servicer imports gRPC for its errors. Anything else that escapes
a handler is a bug and answers INTERNAL.
"""

from __future__ import annotations


class ExecutorError(Exception):
    """Base class. ``field`` names the offending input (``"sequences[2].token_ids"``,
    ``"max_tokens_per_step"``) or is ``""``."""

    def __init__(self, message: str, *, field: str = "") -> None:
        super().__init__(message)
        self.field = field

    def __str__(self) -> str:
        text = super().__str__()
        return f"{self.field}: {text}" if self.field and not text.startswith(self.field) else text


class InvalidArgument(ExecutorError, ValueError):
    """A client's input (or a model/config file) is malformed (-> INVALID_ARGUMENT). A
    ``ValueError`` too, so configuration code that validates with plain ``ValueError``
    handling keeps working."""


class SettingError(InvalidArgument):
    """A setting that cannot work with the model or the pool (``--max-tokens-per-step``
    below the Mamba block size ...). Raised before the server listens: the process exits
    non-zero with one line naming the setting."""


class NotReady(ExecutorError):
    """The executor cannot take work now: not registered with the cache service yet, or
    draining (-> UNAVAILABLE: retry later or elsewhere)."""


class RequestFailed(ExecutorError):
    """The engine dropped a request it had accepted, e.g. the cache service rejected a
    step (-> ABORTED)."""


class CacheUnavailable(ExecutorError):
    """The cache service cannot be reached right now (-> UNAVAILABLE). Raised by the cache
    link; the engine waits and retries, nothing it had sent in the failed call applied."""


class PoolLost(ExecutorError):
    """The cache service no longer knows our pool (it restarted): the engine re-registers
    and recomputes every request."""
