"""Client side of sessions: the session id, the sequence numbers of mutating calls, and what
an error means for them. Shared by the blocking and the async client (no I/O here).

Rules (see docs/protocol.md, "Sessions and sequence numbers"):

* every mutating call (Step, a StepStream message, RegisterPool, DeletePool,
  ResetPrefixCache) is stamped with the session id and the next sequence number; a
  transport retry resends the SAME stamp, so the server applies it at most once and
  answers a retry of an applied call with the stored response;
* an answer (or a definite rejection: the server checked the call and refused it)
  settles the number: accepted -> the next call takes the next number; rejected -> the
  number is reused;
* a failure that may have happened after the server applied the call (connection lost,
  deadline) leaves the number *in doubt*: the next call reuses it. If the server then
  answers FAILED_PRECONDITION on ``sequence`` ("already used"), the doubtful call was
  applied: the number is skipped and the call resent once with the next one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from cache_service.client._errors import CacheError

#: Codes after which the call may or may not have been applied.
IN_DOUBT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                      grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
                      grpc.StatusCode.INTERNAL})


@dataclass
class SessionStamp:
    """One open session as the client sees it."""

    session_id: str
    lease_ttl_seconds: float
    next_sequence: int = 1
    in_doubt: bool = False

    def stamp(self, request: Any) -> None:
        """Sets ``session_id`` and ``sequence`` on a mutating request."""
        request.session_id = self.session_id
        request.sequence = self.next_sequence

    def accepted(self) -> None:
        self.next_sequence += 1
        self.in_doubt = False

    def failed(self, err: CacheError) -> bool:
        """Settles the number after ``err``; True when the call should be resent once
        with the next number (the doubtful previous call turned out to be applied)."""
        if (err.code == grpc.StatusCode.FAILED_PRECONDITION and err.field == "sequence"
                and self.in_doubt):
            self.accepted()
            return True
        if err.code in IN_DOUBT:
            self.in_doubt = True
        return False


def session_lost(err: CacheError) -> bool:
    """The server no longer knows the session (its lease expired): the client opens a
    new one for its next call; requests of the old one are gone."""
    return err.code == grpc.StatusCode.NOT_FOUND and err.field == "session_id"


def keepalive_interval(ttl: float) -> float:
    """How often an idle client renews its lease: a third of the TTL, so that two lost
    keepalives in a row still leave time."""
    return max(0.05, ttl / 3)
