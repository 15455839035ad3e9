"""Logging for both servers: structlog JSON lines on stdout, one per event.

Two loggers matter to operators:

* ordinary loggers (``structlog.get_logger(name)``) filtered by ``--log-level``;
* :func:`lifecycle`, whose lines (``serving``, ``draining``, ``stopped``) print at *any*
  log level, because supervisors, the process launcher (:mod:`kvcache_common.launch`) and
  tests wait for them. ``{"event": "serving"}`` is printed once, when the server answers
  health checks with SERVING.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_lifecycle: Any = structlog.get_logger("lifecycle")


class _Stdout:
    """Where log lines go: ``sys.stdout`` until its reader is gone (EPIPE, e.g. the launcher
    of a server was SIGKILLed), then nowhere. A log line nobody can read must not fail the
    code that logs it: a shutdown dying on its own 'draining' line leaves the process up."""

    def __init__(self) -> None:
        self._gone = False

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return sys.stdout.write(text)
            except (BrokenPipeError, ValueError):  # ValueError: stdout closed
                self._gone = True
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                sys.stdout.flush()
            except (BrokenPipeError, ValueError):
                self._gone = True


_STDOUT = _Stdout()


def configure_logging(level: str) -> None:
    """structlog JSON lines on stdout, with the call's request id (context variables)."""
    threshold = getattr(logging, level.upper())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        logger_factory=structlog.PrintLoggerFactory(_STDOUT),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )
    global _lifecycle
    _lifecycle = structlog.wrap_logger(
        structlog.PrintLogger(_STDOUT),  # type: ignore[arg-type]
        wrapper_class=structlog.make_filtering_bound_logger(min(logging.INFO, threshold)))


def lifecycle() -> Any:
    """The logger for lifecycle lines (printed whatever ``--log-level`` says)."""
    return _lifecycle
