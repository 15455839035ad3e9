"""When a StepStream step is resent (both clients' streams share this rule).

gRPC's retry policy (``_channel.py``) cannot do it: a bidirectional stream is committed by
its first answer, and each later step is a message on it, not a call. So a step that got no
answer within its deadline, or whose stream broke (UNAVAILABLE), is resent by hand on a new
stream under the same sequence number (the service applies it once), after the common
backoff (:mod:`kvcache_common.backoff`; none after a deadline: the wait already passed).
:class:`StepResends` is the one place that says what a step that got no answer means, for
both clients' streams.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from cache_service.client._errors import CacheError
from cache_service.client._routing import Moved, Routes, reroute
from kvcache_common.backoff import Backoff

RESENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

OnRetry = Callable[[str, int], object]


class NoAnswer(enum.Enum):
    """Why a stream step got no answer, other than a status."""

    #: Its deadline passed (``step_timeout``).
    TIMED_OUT = "timed out"
    #: The server closed the stream without an error status (shutting down).
    ENDED = "ended"


@dataclass
class StepResends:
    """The resends of one step on ``pool_id``'s stream, at most ``max_retries``."""

    routes: Routes
    pool_id: str
    step_timeout: float
    max_retries: int
    backoff: Backoff
    on_retry: OnRetry | None
    #: Resends so far.
    attempt: int = 0

    def after(self, outcome: grpc.RpcError | NoAnswer, address: str) -> float:
        """An attempt at ``address`` got ``outcome`` (a status that ended the stream, or
        no answer) and its stream was dropped: seconds to wait before resending the step
        on a new stream. Raises :class:`Moved` when the step must go to another replica
        (restamped for its session), or the step's :class:`CacheError` when it is not to
        be resent (an error status, or the resends are spent); tells ``on_retry(reason,
        resend number)`` before each resend."""
        if isinstance(outcome, NoAnswer):
            err = (CacheError(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"no StepStream answer within {self.step_timeout} s")
                   if outcome is NoAnswer.TIMED_OUT
                   else CacheError(grpc.StatusCode.UNAVAILABLE, "StepStream ended"))
        else:
            err = CacheError.from_rpc(outcome)
            if err.code == grpc.StatusCode.UNAVAILABLE:
                moved = reroute(self.routes, self.pool_id, address,
                                outcome.trailing_metadata())
                if moved is not None:
                    raise Moved(err, moved)
        if err.code not in RESENT or self.attempt >= self.max_retries:
            raise err
        self.attempt += 1
        if self.on_retry is not None:
            self.on_retry(err.code.name.lower(), self.attempt)
        if err.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return 0.0  # the wait already passed
        return self.backoff.delay(self.attempt - 1)
