"""Which session owns which request: the facts a lease expiry, CloseSession, DeletePool and
a pool's move to another replica act on.

A request added by a call that carries a session is owned by that session until it is
freed (by a FreeOp, by its session's close or expiry, or with its pool). Requests added
without a session are never listed: nothing expires them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice

#: (pool id, request id): one request of the service.
Key = tuple[str, str]


class Ownership:
    """Owned requests, looked up both ways: by request (who owns it) and by session (what
    it owns, oldest first).

    Invariant: ``owner_of(pool, request) == sid`` iff ``(pool, request)`` is in
    ``requests_of(sid)``; a session is listed iff it owns at least one request; a session's
    requests are in the order they were added (re-adding a freed id puts it last). Only the
    methods below change the two maps, each keeping both in step.
    """

    __slots__ = ("_by_pool", "_by_session")

    def __init__(self) -> None:
        self._by_pool: dict[str, dict[str, str]] = {}  # pool id -> request id -> session
        self._by_session: dict[str, dict[Key, None]] = {}  # session -> its keys, in order

    # -- reads ------------------------------------------------------------------------
    def owner_of(self, pool_id: str, request_id: str) -> str | None:
        """The session owning a request, or None (added without a session, or unknown)."""
        return self._by_pool.get(pool_id, {}).get(request_id)

    def requests_of(self, session_id: str) -> list[Key]:
        """The requests a session owns, oldest first."""
        return list(self._by_session.get(session_id, ()))

    def oldest(self, session_id: str, limit: int) -> list[Key]:
        """The first ``limit`` of :meth:`requests_of` (without copying the rest)."""
        return list(islice(self._by_session.get(session_id, ()), limit))

    def count(self, session_id: str) -> int:
        """How many requests a session owns."""
        return len(self._by_session.get(session_id, ()))

    def pools_of(self, session_id: str) -> list[str]:
        """The pools a session owns requests in, sorted."""
        return sorted({pool for pool, _ in self._by_session.get(session_id, ())})

    def owners_in(self, pool_id: str) -> dict[str, str]:
        """Request id -> owning session of one pool (a copy), in the order of the adds."""
        return dict(self._by_pool.get(pool_id, {}))

    def sessions(self) -> Iterator[str]:
        """Every session owning at least one request."""
        return iter(self._by_session)

    # -- changes ------------------------------------------------------------------------
    def add(self, pool_id: str, request_id: str, session_id: str) -> None:
        """``session_id`` now owns the request (an earlier owner, if any, no longer does)."""
        self.release(pool_id, request_id)
        self._by_pool.setdefault(pool_id, {})[request_id] = session_id
        self._by_session.setdefault(session_id, {})[(pool_id, request_id)] = None

    def release(self, pool_id: str, request_id: str) -> str | None:
        """The request is no longer owned (it was freed); answers its owner, if any."""
        owners = self._by_pool.get(pool_id)
        if not owners:
            return None
        sid = owners.pop(request_id, None)
        if sid is not None:
            if not owners:
                del self._by_pool[pool_id]
            self._drop_key(sid, (pool_id, request_id))
        return sid

    def drop_pool(self, pool_id: str) -> None:
        """Every request of a deleted pool is no longer owned."""
        for rid, sid in self._by_pool.pop(pool_id, {}).items():
            self._drop_key(sid, (pool_id, rid))

    def adopt(self, pool_id: str, owners: Iterable[tuple[str, str]]) -> None:
        """Owners of a pool taken over from another replica, as (request id, session) in
        the order of the adds there (:meth:`owners_in` of that replica): each joins the end
        of its session's requests here."""
        for rid, sid in owners:
            self.add(pool_id, rid, sid)

    def _drop_key(self, session_id: str, key: Key) -> None:
        keys = self._by_session[session_id]
        del keys[key]
        if not keys:
            del self._by_session[session_id]

    # -- checks -----------------------------------------------------------------------
    def check(self) -> None:
        """Raises AssertionError if the invariant does not hold (tests)."""
        pairs = {(pool, rid): sid for pool, owners in self._by_pool.items()
                 for rid, sid in owners.items()}
        listed = {key: sid for sid, keys in self._by_session.items() for key in keys}
        assert pairs == listed, (pairs, listed)
        assert all(self._by_pool.values()) and all(self._by_session.values())
