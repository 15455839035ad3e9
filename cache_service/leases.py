"""Session leases: the clock side of sessions (the session table itself is state).

A :class:`LeaseKeeper` knows when each live session's lease runs out. Any call naming a
session renews it. :class:`LeaseReaper` wakes a few times per TTL and turns every lease
that ran out into ``ExpireSession`` records applied through ``ServiceState.apply`` (so a
write-ahead log replays expiries like any other change), at most ``chunk`` requests per
record with a yield to the event loop between records, so that the expiry of a big session
never holds other clients' calls for long. Timers are not state: on recovery every
session starts a fresh lease.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog

from cache_service.errors import ResourceExhausted, Unavailable
from cache_service.state import ServiceState, WalRecord
from kvcache_common.api.kvcache.internal.v1 import wal_pb2

_log = structlog.get_logger("cache_service.leases")

#: Requests freed per ExpireSession record: ~2-4 ms of loop time on this class of machine
#: (bench/bench_leases.py measures it).
EXPIRY_CHUNK = 64
#: Pause between two records of one expiry (see :meth:`LeaseReaper.expire`).
CHUNK_PAUSE = 0.002


class LeaseKeeper:
    """Lease deadlines by session id (monotonic clock)."""

    def __init__(self, ttl_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl_seconds
        self._clock = clock
        self._deadlines: dict[str, float] = {}

    def start(self, session_id: str) -> None:
        """Starts (or restarts) the session's lease: its deadline is now + TTL."""
        self._deadlines[session_id] = self._clock() + self.ttl

    def renew(self, session_id: str) -> None:
        """Pushes a live session's deadline to now + TTL (unknown ids: nothing)."""
        if session_id in self._deadlines:
            self._deadlines[session_id] = self._clock() + self.ttl

    def remaining(self, session_id: str) -> float:
        """Seconds until the session's lease runs out (0 when unknown or past)."""
        deadline = self._deadlines.get(session_id)
        return max(0.0, deadline - self._clock()) if deadline is not None else 0.0

    def end(self, session_id: str) -> None:
        """Forgets the session's lease (closed or expired); unknown ids: nothing."""
        self._deadlines.pop(session_id, None)

    def take_expired(self) -> list[str]:
        """Sessions whose lease ran out, removed from the keeper."""
        now = self._clock()
        expired = [sid for sid, deadline in self._deadlines.items() if deadline <= now]
        for sid in expired:
            del self._deadlines[sid]
        return expired


Submit = Callable[[WalRecord], Awaitable[object]]


class LeaseReaper:
    """Expires sessions whose lease ran out (see the module docstring). ``submit``
    applies a record the way the servicer does (validate, log, apply, events);
    ``on_expired(session_id, num_requests)`` counts it in metrics."""

    def __init__(self, state: ServiceState, keeper: LeaseKeeper, submit: Submit, *,
                 chunk: int = EXPIRY_CHUNK) -> None:
        self.state = state
        self.keeper = keeper
        self.submit = submit
        self.chunk = chunk

    async def run(self) -> None:
        """Runs until cancelled."""
        interval = min(0.25, self.keeper.ttl / 4)
        # Expiries a previous run began (recovered state) are finished first.
        pending = self.state.expiring_sessions()
        while True:
            deferred = []
            for sid in pending + self.keeper.take_expired():
                try:
                    await self.expire(sid)
                except (ResourceExhausted, Unavailable) as exc:
                    # The data directory refused the record (e.g. full): nothing changed;
                    # the expiry is tried again next round, not forgotten.
                    deferred.append(sid)
                    _log.error("session_expiry_deferred", session_id=sid, error=str(exc))
            pending = deferred
            await asyncio.sleep(interval)

    async def expire(self, session_id: str) -> int:
        """Frees every request of the session, one chunk per record; answers how many."""
        session = self.state.sessions.get(session_id)
        if session is None:
            return 0
        started = time.perf_counter()
        total = 0
        while True:
            result = await self.submit(WalRecord(expire_session=wal_pb2.ExpireSession(
                session_id=session_id, max_requests=self.chunk)))
            assert isinstance(result, wal_pb2.ExpireSessionResult)  # what an expiry answers
            total += result.num_requests_freed
            if not result.num_requests_left:
                break
            # Let other clients' calls in between chunks. A call needs a few loop
            # iterations (accept, read, handle, write), so one bare yield is not enough:
            # a short pause lets the calls already waiting finish.
            await asyncio.sleep(CHUNK_PAUSE)
        _log.warning("session_expired", session_id=session_id, client=session.client_name,
                     requests_freed=total, ttl_seconds=self.keeper.ttl,
                     seconds=round(time.perf_counter() - started, 4))
        return total
