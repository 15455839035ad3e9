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

from dataclasses import dataclass, replace
from typing import Any

import grpc

from cache_service.client._errors import CacheError
from cache_service.client._routing import Moved


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
        """The call under the current number was answered: the next call takes the next number."""
        self.next_sequence += 1
        self.in_doubt = False

    def failed(self, err: CacheError) -> bool:
        """Settles the number after ``err``; True when the call should be resent once
        with the next number (the doubtful previous call turned out to be applied)."""
        if (err.code == grpc.StatusCode.FAILED_PRECONDITION and err.field == "sequence"
                and self.in_doubt):
            self.accepted()
            return True
        if err.in_doubt:
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


class Carrier:
    """Sessions carried over a failover (cluster mode), shared by both clients (no I/O).

    A replica that took a dead replica's pool over with its state (a shared data root)
    brought along the dead replica's sessions that held requests in the pool. So when a
    call gives a replica up (it stopped answering: not a redirect), the client carries that
    replica's session, frozen as it was then, to the replicas the call goes next: the call
    is resent under the same stamp there (a call in doubt is answered from the stored
    answer, not applied twice). A replica that does not know the session answers NOT_FOUND
    on ``session_id`` and the call is stamped for its own session instead (state lost).
    Once a replica accepted a carried session, the client keeps it alive there (its
    requests are owned by it) next to that replica's own session.

    A replica that handed its pool over and still answers (it restarted on its address,
    or drained before the pool saw a call) redirects instead, and a read may have learned
    the new owner first: the call is answered there under that replica's own session. So
    every session that had calls on a pool accepted is kept alive wherever the pool is
    answered next (see :meth:`answered`)."""

    def __init__(self) -> None:
        #: address given up -> its session as it was then.
        self.orphans: dict[str, SessionStamp] = {}
        #: (address, session id) -> a carried session accepted there (not its own).
        self.adopted: dict[tuple[str, str], SessionStamp] = {}
        #: pool id -> the sessions calls on it were accepted under, by id (they may own
        #: its requests, wherever the pool is now).
        self.owning: dict[str, dict[str, SessionStamp]] = {}
        #: (address, session id) pairs :meth:`answered` started keeping alive.
        self._tried: set[tuple[str, str]] = set()

    def gave_up(self, address: str, session: SessionStamp) -> SessionStamp:
        """``address`` was given up by a call stamped with its ``session``: the session to
        carry (a copy: the original stays with ``address``, e.g. one that comes back)."""
        self.orphans[address] = replace(session)
        return replace(session)

    def stamp_for(self, address: str, carried: SessionStamp,
                  sessions: dict[str, SessionStamp]) -> SessionStamp:
        """The stamp to send ``carried``'s call with to ``address``: the one kept there if
        the session was accepted there before, else ``carried``."""
        own = sessions.get(address)
        if own is not None and own.session_id == carried.session_id:
            return own
        return self.adopted.get((address, carried.session_id), carried)

    def settled(self, address: str, session: SessionStamp,
                sessions: dict[str, SessionStamp]) -> bool:
        """``address`` accepted a call under the carried ``session``: keep it there (as
        the replica's session if it has none yet). True when it needs a keep-alive."""
        if sessions.get(address) is session:
            return False
        if address not in sessions:
            sessions[address] = session
            return True
        key = (address, session.session_id)
        if self.adopted.get(key) is session:
            return False
        self.adopted[key] = session
        return True

    def answered(self, pool_id: str, address: str, session: SessionStamp,
                 sessions: dict[str, SessionStamp]) -> list[SessionStamp]:
        """A call on ``pool_id`` was accepted at ``address`` under ``session``. The other
        sessions a call on the pool was accepted under (on another replica: the pool moved
        since, and a hand-over brings them along with the requests they own) are kept
        alive at ``address`` too, nothing else renews them there: the stamps (copies;
        KeepAlive has no sequence number) to keep alive from now on, once per (address,
        session). A replica that never adopted one answers NOT_FOUND, which ends it."""
        if not pool_id:
            return []
        seen = self.owning.setdefault(pool_id, {})
        seen[session.session_id] = session
        own = sessions.get(address)
        keep = []
        for sid, other in seen.items():
            key = (address, sid)
            if (other is session or (own is not None and own.session_id == sid)
                    or key in self.adopted or key in self._tried):
                continue
            self._tried.add(key)
            keep.append(self.adopted.setdefault(key, replace(other, in_doubt=False)))
        return keep

    def lost(self, session_id: str) -> None:
        """The session expired: it owns no requests anywhere (nothing to keep alive)."""
        for seen in self.owning.values():
            seen.pop(session_id, None)

    def alive(self, address: str, session: SessionStamp,
              sessions: dict[str, SessionStamp]) -> bool:
        """Whether ``session`` is still the client's at ``address`` (its keep-alive goes on)."""
        return (sessions.get(address) is session
                or self.adopted.get((address, session.session_id)) is session)


class SequencedCall:
    """One mutating call's session bookkeeping while it moves between replicas, shared by
    both clients (no I/O): which stamp it carries where, and what an outcome means for the
    session it was sent under (see :class:`Carrier`)."""

    def __init__(self, sessions: dict[str, SessionStamp], carrier: Carrier,
                 pool_id: str = "") -> None:
        self.sessions = sessions
        self.pool_id = pool_id
        self.carrier = carrier
        self.carried: SessionStamp | None = None  # the session of a replica given up
        self.origin = ""  # that replica

    def carried_stamp(self, address: str) -> SessionStamp | None:
        """The stamp of the carried session for ``address``; None: use its own session."""
        if self.carried is not None and address != self.origin:
            return self.carrier.stamp_for(address, self.carried, self.sessions)
        return None

    def moved(self, address: str, session: SessionStamp | None, moved: Moved) -> None:
        """The call left ``address``; unless redirected (nothing applied) it is in doubt
        there and the replica's session is carried along."""
        if session is not None and not moved.redirect:
            session.failed(moved.error)
            if self.carried is None and session is self.sessions.get(address):
                self.carried, self.origin = self.carrier.gave_up(address, session), address

    def failed(self, address: str, session: SessionStamp | None, err: CacheError) -> bool:
        """True: send the call again (restamped); False: the caller raises ``err``."""
        if session is None:
            return False
        if session.failed(err):
            return True
        if session_lost(err):
            if self.carried is not None and session is not self.sessions.get(address):
                self.carried = None  # the carried session was not taken over here
                return True
            del self.sessions[address]
            self.carrier.lost(session.session_id)
        return False

    def accepted(self, address: str, session: SessionStamp) -> list[SessionStamp]:
        """The call was answered: the stamps that now need a keep-alive at ``address``
        (``session``, carried there; other sessions that own requests of the pool, see
        :meth:`Carrier.answered`, whose first keep-alive is due at once: nothing renewed
        their lease there)."""
        session.accepted()
        keep = [session] if self.carried is not None and self.carrier.settled(
            address, session, self.sessions) else []
        return keep + self.carrier.answered(self.pool_id, address, session, self.sessions)
