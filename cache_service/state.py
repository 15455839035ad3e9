"""The service state and its one mutation entry point, :meth:`ServiceState.apply`.

:class:`ServiceState` owns the pool registry (pools, their requests, their event feeds),
the serialized block tables, the session table (each session's last sequence number and
stored last answer, and the requests it owns) and the lease counters. Every change to any
of it goes through ``apply(record)`` with a ``kvcache.internal.v1.WalRecord``: the
servicer turns each mutating call into a record (``apply_call(kind, request)``: the same
path, building the record only when the durability keeps records), the lease reaper turns
each expiry into records, and recovery replays records. Reads (GetPool, stats, PeekPrefix, GetRequest)
read the state directly.

``apply`` is deterministic: no clock, no randomness, no I/O inside (session ids are
chosen by the caller and carried in the record; lease timers live outside, in
``cache_service.leases``). So the same records applied in the same order to a fresh
state give the same state, answers and event sequence numbers.

Order inside ``apply``: validate (nothing changes; a rejected record raises a core
error naming the field), then ``durability.append(record)``, then mutate (which cannot
fail once validated). A record that fails validation is therefore never logged, and a
retry answered from a session's stored response is not logged either (nothing changes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from google.protobuf.message import Message

from cache_service import convert
from cache_service.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from cache_service.core.ops import Free
from cache_service.registry import PoolEntry, PoolRegistry, check_pool_id
from cache_service.status import ResourceExhausted
from kvcache_common.api.kvcache.internal.v1 import wal_pb2
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb

WalRecord = wal_pb2.WalRecord


class Durability:
    """Where accepted records go before they change the state. This default keeps
    nothing (the service is in-memory). ``append`` runs after validation and before the
    mutation; if it raises, nothing changes and the caller gets the error. ``sync`` is
    awaited before the answer is sent (e.g. a group-commit fsync); ``needs_sync`` False
    lets the servicer skip that await. ``keeps_records`` False (this default) tells
    :meth:`ServiceState.apply_call` that no record needs to be built: copying a big
    StepRequest into a WalRecord costs ~5% of a 256-request decode Step."""

    needs_sync = False
    keeps_records = False

    def append(self, record: WalRecord) -> None:
        """Keeps ``record`` (called once per accepted record, in apply order)."""

    async def sync(self) -> None:
        """Returns once every appended record is as durable as the policy promises."""


@dataclass
class Session:
    """One client session. ``requests``: (pool id, request id) of every request it added
    and that is still registered, oldest first. ``expiring``: its lease ran out and its
    requests are being freed; calls naming it are refused."""

    session_id: str
    client_name: str = ""
    last_sequence: int = 0
    last_request: Message | None = None
    last_response: Message | None = None
    requests: dict[tuple[str, str], None] = field(default_factory=dict)
    expiring: bool = False


@dataclass
class SessionCounters:
    """Cumulative counts for metrics (derived from applied records only)."""

    opened: int = 0
    closed: int = 0
    expired: int = 0
    requests_expired: int = 0
    retries_answered: int = 0


class ServiceState:
    """Pools, sessions and event feeds; changed only by :meth:`apply`."""

    def __init__(self, registry: PoolRegistry, *, lease_ttl_seconds: float = 30.0,
                 max_ops_per_step: int = 65536, durability: Durability | None = None) -> None:
        self.registry = registry
        self.lease_ttl_seconds = lease_ttl_seconds
        self.max_ops_per_step = max_ops_per_step
        self.durability = durability or Durability()
        self.sessions: dict[str, Session] = {}
        self.counters = SessionCounters()
        # pool id -> request id -> owning session id (requests added without a session
        # are not listed: nothing expires them)
        self._owners: dict[str, dict[str, str]] = {}
        self._tables: dict[str, convert.BlockTableCache] = {}  # by pool id
        self._handlers: dict[str, Callable[[Any], Callable[[], Message]]] = {
            "step": self._prepare_step,
            "register_pool": self._prepare_register,
            "delete_pool": self._prepare_delete,
            "reset_prefix_cache": self._prepare_reset,
            "open_session": self._prepare_open,
            "close_session": self._prepare_close,
            "expire_session": self._prepare_expire,
        }

    def __getstate__(self) -> dict:
        """Everything but the durability hook (open files, threads): what a snapshot of
        the state holds. A restored state starts with the in-memory default hook."""
        state = dict(self.__dict__)
        del state["durability"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.durability = Durability()

    # -- the entry point -------------------------------------------------------------------

    def apply(self, record: WalRecord) -> Message:
        """Validates, logs (``durability.append``) and applies one record; answers the
        call's response message (``ExpireSessionResult`` for an expiry). Raises a core
        error naming the field, with nothing changed and nothing logged, if the record
        is rejected."""
        kind = record.WhichOneof("mutation")
        if not kind:
            raise InvalidArgument("a record must set one mutation", field="mutation")
        return self._apply(kind, getattr(record, kind), record)

    def apply_call(self, kind: str, request: Message) -> Message:
        """:meth:`apply` of the record ``WalRecord(<kind>=request)``, built only when the
        durability keeps records (the servicer's entry: no copy of the request in memory)."""
        return self._apply(kind, request, None)

    def _apply(self, kind: str, request: Message, record: WalRecord | None) -> Message:
        """The one mutation path (see :meth:`apply`)."""
        prepare = self._handlers.get(kind)
        if prepare is None:
            raise InvalidArgument(f"unknown mutation {kind!r}", field="mutation")
        session = None
        sid = getattr(request, "session_id", "") if kind in _SEQUENCED else ""
        if sid:
            session = self.live_session(sid)
            seq = request.sequence
            last = session.last_sequence
            if seq == last and seq:
                if request == session.last_request:
                    self.counters.retries_answered += 1
                    return session.last_response  # type: ignore[return-value]
                raise FailedPrecondition(
                    f"sequence {seq} was already used by another call of this session (the "
                    f"next call is {last + 1})", field="sequence")
            if seq != last + 1:
                raise FailedPrecondition(
                    f"sequence must be {last + 1} (the next call) or {last} (a retry of "
                    f"the last call), got {seq}", field="sequence")
        commit = prepare(request)
        durability = self.durability
        if durability.keeps_records:
            durability.append(record if record is not None else WalRecord(**{kind: request}))
        response = commit()
        if session is not None:
            session.last_sequence = request.sequence
            session.last_request = request
            session.last_response = response
        return response

    # -- sessions (reads) -----------------------------------------------------------------------

    def live_session(self, session_id: str, name: str = "session_id") -> Session:
        """The session, or NOT_FOUND naming ``name`` if unknown, closed or expired."""
        session = self.sessions.get(session_id)
        if session is None or session.expiring:
            raise NotFound(f"session {session_id!r:.80} is unknown, closed or expired (its "
                           "lease ran out); open a new one", field=name)
        return session

    def expiring_sessions(self) -> list[str]:
        """Sessions whose expiry has begun but not finished (e.g. found on recovery)."""
        return [sid for sid, s in self.sessions.items() if s.expiring]

    def session_requests(self, session_id: str) -> list[tuple[str, str]]:
        """(pool id, request id) of the requests the session owns, oldest first."""
        return list(self.sessions[session_id].requests)

    def owner_of(self, pool_id: str, request_id: str) -> str | None:
        """The session owning a request, or None (no session, or unknown)."""
        return self._owners.get(pool_id, {}).get(request_id)

    # -- pools and steps ----------------------------------------------------------------------

    def _prepare_step(self, request: pb.StepRequest) -> Callable[[], pb.StepResponse]:
        entry = self.registry.get(request.pool_id)
        if len(request.ops) > self.max_ops_per_step:
            raise ResourceExhausted(f"{len(request.ops)} ops exceed the limit of "
                                    f"{self.max_ops_per_step} per Step", field="ops")
        step_ops = convert.ops_from_proto(request, entry.pool.options.hash_algo)
        batch = entry.pool.prepare_batch(step_ops, begin_step=request.begin_step)
        pool_id = request.pool_id

        def commit() -> pb.StepResponse:
            outcomes = batch.apply()
            entry.flush_events()
            self._track(pool_id, step_ops, request.session_id)
            tables = self._tables.get(pool_id)
            if tables is None:
                tables = self._tables[pool_id] = convert.BlockTableCache()
            return convert.step_response(step_ops, outcomes, tables, entry.pool.num_free_blocks)
        return commit

    def _track(self, pool_id: str, step_ops: list, session_id: str) -> None:
        """Request ownership after a batch: adds join the calling session, frees leave
        whichever session owned them. Decode and allocate ops (the hot path) cost a type
        check each."""
        owners = self._owners.get(pool_id)
        for op in step_ops:
            kind = op.KIND
            if kind == "add_request":
                if session_id:
                    if owners is None:
                        owners = self._owners[pool_id] = {}
                    owners[op.request_id] = session_id
                    self.sessions[session_id].requests[(pool_id, op.request_id)] = None
            elif kind == "free" and owners:
                sid = owners.pop(op.request_id, None)
                if sid is not None:
                    self.sessions[sid].requests.pop((pool_id, op.request_id), None)

    def _prepare_register(self, request: pb.RegisterPoolRequest
                          ) -> Callable[[], pb.RegisterPoolResponse]:
        check_pool_id(request.pool_id)
        entry, created = self.registry.prepare_register(
            request.pool_id, convert.description_from_proto(request))

        def commit() -> pb.RegisterPoolResponse:
            if created:
                self.registry.add(entry)
            return pb.RegisterPoolResponse(config=convert.pool_config_to_proto(entry),
                                           created=created)
        return commit

    def _prepare_delete(self, request: pb.DeletePoolRequest
                        ) -> Callable[[], pb.DeletePoolResponse]:
        self.registry.get(request.pool_id)

        def commit() -> pb.DeletePoolResponse:
            dropped = self.registry.delete(request.pool_id)
            self._tables.pop(request.pool_id, None)
            for rid, sid in self._owners.pop(request.pool_id, {}).items():
                self.sessions[sid].requests.pop((request.pool_id, rid), None)
            return pb.DeletePoolResponse(num_requests_dropped=dropped)
        return commit

    def _prepare_reset(self, request: pb.ResetPrefixCacheRequest
                       ) -> Callable[[], pb.ResetPrefixCacheResponse]:
        entry = self.registry.get(request.pool_id)

        def commit() -> pb.ResetPrefixCacheResponse:
            ok = entry.pool.reset_prefix_cache()
            entry.flush_events()
            return pb.ResetPrefixCacheResponse(reset=ok)
        return commit

    # -- sessions (changes) ---------------------------------------------------------------------

    def _prepare_open(self, request: wal_pb2.OpenSession
                      ) -> Callable[[], pb.OpenSessionResponse]:
        sid = request.session_id
        if not sid or len(sid) > 128:
            raise InvalidArgument("session id must be 1-128 characters", field="session_id")
        if sid in self.sessions:
            raise AlreadyExists(f"session {sid!r} exists", field="session_id")

        def commit() -> pb.OpenSessionResponse:
            self.sessions[sid] = Session(sid, request.client_name)
            self.counters.opened += 1
            return pb.OpenSessionResponse(session_id=sid,
                                          lease_ttl_seconds=self.lease_ttl_seconds)
        return commit

    def _prepare_close(self, request: pb.CloseSessionRequest
                       ) -> Callable[[], pb.CloseSessionResponse]:
        session = self.live_session(request.session_id)

        def commit() -> pb.CloseSessionResponse:
            freed = self._free_owned(session, len(session.requests))
            del self.sessions[session.session_id]
            self.counters.closed += 1
            return pb.CloseSessionResponse(num_requests_freed=freed)
        return commit

    def _prepare_expire(self, request: wal_pb2.ExpireSession
                        ) -> Callable[[], wal_pb2.ExpireSessionResult]:
        session = self.sessions.get(request.session_id)
        if session is None:
            raise NotFound(f"unknown session {request.session_id!r}", field="session_id")
        if request.max_requests < 1:
            raise InvalidArgument("max_requests must be >= 1", field="max_requests")

        def commit() -> wal_pb2.ExpireSessionResult:
            if not session.expiring:
                session.expiring = True
                self.counters.expired += 1
            freed = self._free_owned(session, request.max_requests)
            self.counters.requests_expired += freed
            left = len(session.requests)
            if not left:
                del self.sessions[session.session_id]
            return wal_pb2.ExpireSessionResult(num_requests_freed=freed,
                                               num_requests_left=left)
        return commit

    def _free_owned(self, session: Session, limit: int) -> int:
        """Frees up to ``limit`` of the session's requests, oldest first, each exactly as
        a FreeOp would (one batch per pool; events flushed). Ownership is exact (adds
        and frees are tracked, deleted pools drop theirs), so every batch is valid."""
        chosen = list(islice(session.requests, limit))
        by_pool: dict[str, list[str]] = {}
        for pool_id, rid in chosen:
            by_pool.setdefault(pool_id, []).append(rid)
        for pool_id, rids in by_pool.items():
            entry: PoolEntry = self.registry.get(pool_id)
            entry.pool.apply_batch([Free(rid) for rid in rids])
            entry.flush_events()
            owners = self._owners[pool_id]
            tables = self._tables.get(pool_id)
            for rid in rids:
                del owners[rid]
                del session.requests[(pool_id, rid)]
                if tables is not None:
                    tables.forget(rid)
        return len(chosen)


# Records whose request carries session_id + sequence (deduplicated per session).
_SEQUENCED = frozenset({"step", "register_pool", "delete_pool", "reset_prefix_cache"})
