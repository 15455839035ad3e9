"""Which replica a call goes to: seed addresses plus the pool owners learned from
redirects (cluster mode), shared by the async and the blocking client.

A replica that does not own a pool answers UNAVAILABLE with the owner's address in
trailing metadata (nothing was applied); the client remembers that owner for the pool and
sends the same call there. When a replica stops answering, its learned pools are forgotten
and the next seed is tried (a seed that is not the owner redirects again). A standalone
server is the one-seed, no-redirect case of the same logic.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvcache_common.backoff import Backoff
from kvcache_common.redirect import owner_from_metadata

#: Redirects followed for one call before its UNAVAILABLE is treated like any other.
MAX_REDIRECTS = 4


class Routes:
    """Seeds (``target``: ``host:port`` or several, comma-separated) and learned owners;
    ``open_stub(address)`` makes the stub for an address (called once per address)."""

    def __init__(self, target: str, open_stub: Callable[[str], Any]) -> None:
        self.seeds = [t.strip() for t in target.split(",") if t.strip()]
        if not self.seeds:
            raise ValueError(f"no server address in target {target!r}")
        self._open = open_stub
        self._stubs: dict[str, Any] = {}
        self._seed = 0
        #: pool id -> owner address (from redirects).
        self.owners: dict[str, str] = {}

    def address(self, pool_id: str = "") -> str:
        """Where a call on ``pool_id`` goes: its known owner, else the current seed."""
        return self.owners.get(pool_id) or self.seeds[self._seed]

    def stub(self, address: str) -> Any:
        """The stub for ``address``, opened on first use (one channel per address)."""
        stub = self._stubs.get(address)
        if stub is None:
            stub = self._stubs[address] = self._open(address)
        return stub

    def follow(self, pool_id: str, trailing_metadata: Any) -> bool:
        """Learns the owner named by a redirect; False if the status was no redirect."""
        owner = owner_from_metadata(trailing_metadata)
        if not owner or not pool_id:
            return False
        self.owners[pool_id] = owner
        return True

    def failed(self, pool_id: str, address: str) -> None:
        """``address`` answered UNAVAILABLE without a redirect (draining, dead, failing
        over): forget it as the pool's owner and move to the next seed."""
        if self.owners.get(pool_id) == address:
            del self.owners[pool_id]
        if self.seeds[self._seed] == address:
            self._seed = (self._seed + 1) % len(self.seeds)


class Deadline:
    """A point in time ``seconds`` from now: one call's bound over all its attempts."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left (at least 1 ms: an attempt that starts late fails at once)."""
        return max(self.at - time.monotonic(), 0.001)


class Moved(Exception):
    """A stamped call must go to another replica (a redirect, or its replica stopped
    answering): the caller stamps it for that replica's session and sends it again.
    Nothing was applied when ``redirect`` is True."""

    def __init__(self, error: Any, redirect: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.redirect = redirect


def reroute(routes: Routes, pool_id: str, address: str, trailing_metadata: Any) -> bool | None:
    """After UNAVAILABLE from ``address``: True = redirected to the owner it named, False =
    ``address`` was given up and another replica is next, None = retry ``address``."""
    if routes.follow(pool_id, trailing_metadata):
        return True
    routes.failed(pool_id, address)
    return False if routes.address(pool_id) != address else None


class CallRoute:
    """The budget of one call over the replicas, until ``timeout`` seconds from now.

    gRPC retries UNAVAILABLE on one replica (``_channel.py``; a redirect carries a pushback
    that stops it) as long as no answer has begun. Here a redirect is followed at once (up
    to :data:`MAX_REDIRECTS` in a row), and a replica that stays unavailable is left for
    the next one after a backoff. ``resend``: the call is safe to send again (a read, or a
    call stamped with a session: the service answers a resend from the stored answer), so

    * an UNAVAILABLE with no replica to move to (one replica: a connection lost after the
      answer's headers, which gRPC never retries), or a CANCELLED (a server that stopped
      with the call in flight), sends it again to the same replica after a backoff, until
      the call's deadline;
    * each attempt has its own deadline, ``attempt_timeout`` (doubled on every attempt, so
      a slow but live answer still comes; always within the call's): a replica that hangs
      (SIGSTOP) costs one attempt, then the call goes to the next replica or is resent.

    Without ``resend`` (a sessionless mutating call, or ``max_retries=0``) an attempt has
    the whole deadline, and the call gives up at once with no replica to move to. ``pin``:
    the call is stamped for that replica's session; it raises :class:`Moved` instead of
    moving to another replica.
    """

    def __init__(self, routes: Routes, pool_id: str, timeout: float, backoff: Backoff,
                 pin: str | None = None, *, resend: bool = False,
                 attempt_timeout: float | None = None) -> None:
        self.routes = routes
        self.pool_id = pool_id
        self.deadline = Deadline(timeout).at
        self.backoff = backoff
        self.pin = pin
        self.resend = resend
        self.attempt_timeout = attempt_timeout if resend else None
        self._hops = self._rounds = self._attempts = 0

    @property
    def address(self) -> str:
        """Where the next attempt goes: the pinned replica, else the pool's known owner or the
        current seed."""
        return self.pin or self.routes.address(self.pool_id)

    def timeout(self) -> float:
        """The deadline of the next attempt, in seconds from now (counts the attempt)."""
        left = max(self.deadline - time.monotonic(), 0.001)
        if self.attempt_timeout is None:
            return left
        self._attempts += 1
        return min(left, self.attempt_timeout * 2 ** min(self._attempts - 1, 16))

    def unavailable(self, address: str, error: Exception, trailing_metadata: Any) -> float:
        """After UNAVAILABLE (``error``) from ``address``: seconds to wait before the next
        attempt; raises :class:`Moved` (a pinned call) or ``error`` (giving up)."""
        moved = reroute(self.routes, self.pool_id, address, trailing_metadata)
        if moved is not None and self.pin is not None:
            raise Moved(error, moved)
        if moved is None and not self.resend:
            raise error
        return self._wait(error, redirect=bool(moved))

    def expired(self, address: str, error: Exception) -> float:
        """After DEADLINE_EXCEEDED (``error``) from ``address``: like :meth:`unavailable`
        while the call's own deadline has not passed (only an attempt's did), without the
        backoff (the wait already passed); else raises ``error``."""
        if self.attempt_timeout is None or time.monotonic() >= self.deadline:
            raise error
        moved = reroute(self.routes, self.pool_id, address, None)
        if moved is not None and self.pin is not None:
            raise Moved(error, moved)
        return 0.0

    def moved(self, moved: Moved) -> float:
        """After a pinned attempt raised ``moved``: seconds to wait before restamping the
        call for the next replica; raises its error past the deadline."""
        return self._wait(moved.error, redirect=moved.redirect)

    def _wait(self, error: Exception, *, redirect: bool) -> float:
        if redirect and self._hops < MAX_REDIRECTS:
            self._hops += 1
            return 0.0
        delay = self.backoff.delay(self._rounds)
        if time.monotonic() + delay >= self.deadline:
            raise error
        self._rounds += 1
        return delay
