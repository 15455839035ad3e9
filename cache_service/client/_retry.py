"""When a StepStream step is resent (both clients' streams share this rule).

gRPC's retry policy (``_channel.py``) cannot do it: a bidirectional stream is committed by
its first answer, and each later step is a message on it, not a call. So a step that got no
answer within its deadline, or whose stream broke (UNAVAILABLE), is resent by hand on a new
stream under the same sequence number (the service applies it once), after the common
backoff (:mod:`kvcache_common.backoff`; none after a deadline: the wait already passed).
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from cache_service.client._errors import CacheError
from kvcache_common.backoff import Backoff

RESENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

OnRetry = Callable[[str, int], object]


def resend_delay(err: CacheError, attempt: int, max_retries: int, backoff: Backoff,
                 on_retry: OnRetry | None) -> float:
    """Seconds to wait before resending after ``err`` on resend number ``attempt`` (0 =
    the first); raises ``err`` when the step is not to be resent. Tells ``on_retry(reason,
    attempt + 1)`` first."""
    if err.code not in RESENT or attempt >= max_retries:
        raise err
    if on_retry is not None:
        on_retry(err.code.name.lower(), attempt + 1)
    return backoff.delay(attempt) if err.code == grpc.StatusCode.UNAVAILABLE else 0.0
