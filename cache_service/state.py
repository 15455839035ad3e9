"""The service state and its one mutation entry point, :meth:`ServiceState.apply`.

:class:`ServiceState` owns the pool registry (pools, their requests, their event feeds),
the serialized block tables, the session table (each session's last sequence number and
stored last answer), which session owns which request (:class:`Ownership`) and the lease
counters. Every change to any of it goes through ``apply(record)`` with a
``kvcache.internal.v1.WalRecord``: the servicer turns each mutating call into a record
(``apply_call(kind, request)``: the same path, building the record only when the
durability keeps records), the lease reaper turns each expiry into records, and recovery
replays records (:func:`replay_record`). Reads (GetPool, stats, PeekPrefix, GetRequest)
read the state directly.

``apply`` is deterministic: no clock, no randomness, no I/O inside (session ids are
chosen by the caller and carried in the record; lease timers live outside, in
``cache_service.leases``). So the same records applied in the same order to a fresh
state give the same state, answers and event sequence numbers.

Order inside ``apply``: validate (nothing changes; a rejected record raises a core
error naming the field), then the registry's fence for a pool's record (a cluster member
that does not own the pool now refuses it, see ``cache_service.cluster.registry``), then
``durability.append(record)``, then mutate (which cannot fail once validated). A record
that fails validation (or the fence) is therefore never logged, and a retry answered from
a session's stored response is not logged either (nothing changes). A resent OpenSession of
a session that is open is logged and changes nothing (its replay does the same).
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable, Generator
from dataclasses import dataclass
from types import GeneratorType
from typing import Any, Protocol

from google.protobuf.message import Message

from cache_service import convert
from cache_service.core.operations import Free, op_cost, op_requests, op_tokens
from cache_service.core.slices import run_to_end
from cache_service.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    KVCacheError,
    NotFound,
    ResourceExhausted,
)
from cache_service.ownership import Ownership
from cache_service.pins import MAX_PIN_TTL_SECONDS, PinLease, PinRecords
from cache_service.registry import PoolEntry, PoolRegistry, budget_field, check_pool_id
from cache_service.snapshot import dumps_state
from cache_service.tenants import tenant_of
from kvcache_common.api.kvcache.internal.v1 import wal_pb2
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb

WalRecord = wal_pb2.WalRecord
#: What a handler's prepare step answers: the commit, which answers the response (a Step's
#: commit as a generator, in slices), or a generator validating in slices first.
_Commit = Callable[[], Message | Generator[None, None, Message]]
_Prepared = _Commit | Generator[None, None, _Commit]


class DurabilityHook(Protocol):
    """What the state needs of a durability hook (see :class:`NoDurability`)."""

    needs_sync: bool
    keeps_records: bool

    def append(self, record: WalRecord) -> None: ...

    async def sync(self) -> None: ...


class NoDurability:
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
    """One client session (the requests it owns: :attr:`ServiceState.ownership`).
    ``expiring``: its lease ran out and its requests are being freed; calls naming it are
    refused."""

    session_id: str
    client_name: str = ""
    tenant: str = ""  # the tenant that opened it; other tenants' calls cannot name it
    last_sequence: int = 0
    last_request: Message | None = None
    last_response: Message | None = None
    expiring: bool = False
    #: A release hint: its requests are freed evict-first when it ends.
    evict_first_on_end: bool = False


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
                 max_ops_per_step: int = 65536, max_tokens_per_step: int = 1 << 20,
                 durability: DurabilityHook | None = None) -> None:
        self.registry = registry
        self.lease_ttl_seconds = lease_ttl_seconds
        self.max_ops_per_step = max_ops_per_step
        self.max_tokens_per_step = max_tokens_per_step
        self._slice_cost: int | None = None  # of the record being applied
        self.durability: DurabilityHook = durability or NoDurability()
        self.sessions: dict[str, Session] = {}
        self._tenant = wal_pb2.TenantContext()  # of the record being applied
        self.counters = SessionCounters()
        #: Log appends and syncs that failed with an OSError (disk full, I/O error).
        self.wal_errors = 0
        self.ownership = Ownership()
        self._tables: dict[str, convert.BlockTableCache] = {}  # by pool id
        self._handlers: dict[str, Callable[[Any], _Prepared]] = {
            "step": self._prepare_step,
            "register_pool": self._prepare_register,
            "delete_pool": self._prepare_delete,
            "reset_prefix_cache": self._prepare_reset,
            "open_session": self._prepare_open,
            "close_session": self._prepare_close,
            "expire_session": self._prepare_expire,
            "adopt_pool": self._prepare_adopt,
        }
        #: Prefix pins' leases (cache_service.pins): pool id -> pin id -> lease.
        self.pin_leases: dict[str, dict[str, PinLease]] = {}
        self.max_pin_ttl_seconds = MAX_PIN_TTL_SECONDS
        self.pins = PinRecords(self)
        self._handlers.update(self.pins.handlers())

    def __getstate__(self) -> dict:
        """Everything but the durability hook (open files, threads): what a snapshot of
        the state holds. A restored state starts with the in-memory default hook."""
        state = dict(self.__dict__)
        del state["durability"]
        return state

    def __setstate__(self, state: dict) -> None:
        if "_owners" in state:  # a snapshot written before Ownership: sessions listed theirs
            state.pop("_owners")
            state["ownership"] = ownership = Ownership()
            for sid, session in state["sessions"].items():
                for pool_id, rid in vars(session).pop("requests", {}):
                    ownership.add(pool_id, rid, sid)
        self.__dict__.update(state)
        self.durability = NoDurability()
        if "pins" not in state:  # a snapshot from before pins
            self.pin_leases, self.max_pin_ttl_seconds = {}, MAX_PIN_TTL_SECONDS
            self.pins = PinRecords(self)
            self._handlers.update(self.pins.handlers())

    @property
    def record_tenant_name(self) -> str:
        """The tenant of the record being applied."""
        return self._tenant.name

    @property
    def tenant_limits(self) -> wal_pb2.TenantContext:
        """The tenant context (name and limits) of the record being applied."""
        return self._tenant

    # -- the entry point -------------------------------------------------------------------

    def apply(self, record: WalRecord) -> Message:
        """Validates, logs (``durability.append``) and applies one record; answers the
        call's response message (``ExpireSessionResult`` for an expiry). Raises a core
        error naming the field, with nothing changed and nothing logged, if the record
        is rejected."""
        return run_to_end(self.apply_in_slices(record))

    def apply_in_slices(self, record: WalRecord, slice_cost: int | None = None
                        ) -> Generator[None, None, Message]:
        """:meth:`apply` with a Step's application cut into slices of about
        ``slice_cost`` request-ops (None: one piece), yielding between them; the
        generator returns the response. Validation and ``durability.append`` happen
        before the first yield (errors raise from the first ``next``). The result is
        :meth:`apply`'s, provided the caller lets nothing else touch the record's pools
        (:meth:`pools_of`) until the generator ends."""
        kind = record.WhichOneof("mutation")
        if not kind:
            raise InvalidArgument("a record must set one mutation", field="mutation")
        return (yield from self._apply(kind, getattr(record, kind), record, record.tenant,
                                       slice_cost))

    def apply_call(self, kind: str, request: Message,
                   tenant: wal_pb2.TenantContext | None = None) -> Message:
        """:meth:`apply` of the record ``WalRecord(<kind>=request, tenant=tenant)``, built
        only when the durability keeps records (no copy of the request in memory)."""
        return run_to_end(self.apply_call_in_slices(kind, request, tenant))

    def apply_call_in_slices(self, kind: str, request: Message,
                             tenant: wal_pb2.TenantContext | None = None,
                             slice_cost: int | None = None) -> Generator[None, None, Message]:
        """:meth:`apply_call` in slices (see :meth:`apply_in_slices`): the servicer's entry."""
        return self._apply(kind, request, None, tenant, slice_cost)

    def _apply(self, kind: str, request: Message, record: WalRecord | None,
               tenant: wal_pb2.TenantContext | None, slice_cost: int | None
               ) -> Generator[None, None, Message]:
        """The one mutation path (see :meth:`apply_in_slices`)."""
        prepare = self._handlers.get(kind)
        if prepare is None:
            raise InvalidArgument(f"unknown mutation {kind!r}", field="mutation")
        self._slice_cost = slice_cost
        self._tenant = tenant if tenant is not None else _NO_TENANT
        record_tenant = self._tenant
        session = None
        sid = getattr(request, "session_id", "") if kind in _SEQUENCED else ""
        if sid:
            if sid not in self.sessions:
                # A session of another replica (e.g. a call resent after its replica died):
                # the pool's owner is named first, since that replica may know it (a pool
                # taken over brings its sessions along; see _prepare_adopt).
                self.registry.fence(request.pool_id)
            session = self.live_session(sid, tenant=record_tenant.name)
            seq = request.sequence
            last = session.last_sequence
            if seq == last and seq:
                if request == session.last_request:
                    self.counters.retries_answered += 1
                    return session.last_response
                raise FailedPrecondition(
                    f"sequence {seq} was already used by another call of this session (the "
                    f"next call is {last + 1})", field="sequence")
            if seq != last + 1:
                raise FailedPrecondition(
                    f"sequence must be {last + 1} (the next call) or {last} (a retry of "
                    f"the last call), got {seq}", field="sequence")
        commit = prepare(request)
        if not callable(commit):  # a Step's validation, in slices
            commit = yield from commit
        if kind in _SEQUENCED:
            # Fencing (cluster mode): asked after the validation's last slice with no
            # yield before the record is logged, so no write lands on a pool this
            # replica lost meanwhile.
            self.registry.fence(request.pool_id)
        durability = self.durability
        if durability.keeps_records:
            if record is None:
                record = WalRecord(**{kind: request})
                if tenant is not None:
                    record.tenant.CopyFrom(tenant)
            try:
                durability.append(record)
            except (KVCacheError, OSError):  # DataDirFull / DataDirUnwritable: nothing logged
                self.wal_errors += 1  # metrics (kvcache_wal_errors_total); the call fails
                raise
        response = commit()
        if isinstance(response, GeneratorType):  # a Step's commit, in slices
            response = yield from response
        if session is not None:
            session.last_sequence = request.sequence
            session.last_request = request
            session.last_response = response
        return response

    # -- sessions (reads) -----------------------------------------------------------------------

    def live_session(self, session_id: str, name: str = "session_id", *,
                     tenant: str | None = None) -> Session:
        """The session, or NOT_FOUND naming ``name`` if unknown, closed or expired (or
        opened by another tenant than ``tenant``, when given: answered the same way)."""
        session = self.sessions.get(session_id)
        if session is None or session.expiring or (tenant is not None
                                                   and session.tenant != tenant):
            raise NotFound(f"session {session_id!r:.80} is unknown, closed or expired (its "
                           "lease ran out); open a new one", field=name)
        return session

    def pools_of(self, record: WalRecord) -> list[str]:
        """The pools a record may change (a caller applying records in slices keeps other
        records on them waiting)."""
        kind = record.WhichOneof("mutation")
        return self.pools_of_call(kind, getattr(record, kind)) if kind else []

    def pools_of_call(self, kind: str, request: Message) -> list[str]:
        """:meth:`pools_of` of ``WalRecord(<kind>=request)``."""
        if kind in ("close_session", "expire_session"):
            pools = set(self.ownership.pools_of(request.session_id))
            pools.update(p for p, pins in self.pin_leases.items()
                         if any(lease.session_id == request.session_id for lease in pins.values()))
            return sorted(pools)
        if kind in ("pin_prefix", "renew_pin"):
            return [request.request.pool_id]
        pool_id = getattr(request, "pool_id", None)
        return [pool_id] if pool_id else []

    def expiring_sessions(self) -> list[str]:
        """Sessions whose expiry has begun but not finished (e.g. found on recovery)."""
        return [sid for sid, s in self.sessions.items() if s.expiring]

    # -- pools and steps ----------------------------------------------------------------------

    def _prepare_step(self, request: pb.StepRequest) -> _Prepared:
        entry = self.registry.get(request.pool_id)
        self._check_step_cost(request)
        step_ops = convert.ops_from_proto(request, entry.pool.options.hash_algo)
        if self._slice_cost is not None and self._step_cost(step_ops) > self._slice_cost:
            return self._prepare_step_in_slices(request, entry, step_ops, self._slice_cost)
        batch = entry.pool.prepare_batch(step_ops, begin_step=request.begin_step)
        return self._step_commit(request, entry, step_ops, batch)

    @staticmethod
    def _step_cost(step_ops: list) -> int:
        """The work of a batch in slice units (:func:`ops.op_cost`)."""
        return sum([op_cost(op.KIND, op) for op in step_ops])

    def _prepare_step_in_slices(self, request: pb.StepRequest, entry: PoolEntry,
                                step_ops: list, slice_cost: int
                                ) -> Generator[None, None, _Commit]:
        batch = yield from entry.pool.prepare_batch_in_slices(
            step_ops, begin_step=request.begin_step, slice_cost=slice_cost)
        return self._step_commit(request, entry, step_ops, batch)

    def _step_commit(self, request: pb.StepRequest, entry: PoolEntry, step_ops: list,
                     batch: Any) -> Callable[[], Generator[None, None, pb.StepResponse]]:
        pool_id = request.pool_id
        slice_cost = self._slice_cost

        def commit() -> Generator[None, None, pb.StepResponse]:
            if slice_cost is None:
                outcomes = batch.apply()
            else:
                outcomes = yield from batch.apply_in_slices(slice_cost)
            entry.flush_events()
            self._track(pool_id, step_ops, request.session_id)
            tables = self._tables.get(pool_id)
            if tables is None:
                tables = self._tables[pool_id] = convert.BlockTableCache()
            # The tier's copies of this batch (empty without a tier); stored with the
            # response below, so a session retry answers the same copies.
            return convert.step_response(step_ops, outcomes, tables, entry.pool.num_free_blocks,
                                         entry.pool.tier_copies)
        return commit

    def _check_step_cost(self, request: pb.StepRequest) -> None:
        """RESOURCE_EXHAUSTED for a Step beyond the per-call limits: request-ops (each
        request a decode or fill op names counts as one: :func:`ops.op_requests`) and token
        ids (summed over all ops: :func:`ops.op_tokens`)."""
        if len(request.ops) > self.max_ops_per_step:  # before counting a huge list
            raise ResourceExhausted(f"{len(request.ops)} ops exceed the limit of "
                                    f"{self.max_ops_per_step} per Step", field="ops")
        ops = 0
        tokens = 0
        for op in request.ops:
            kind = op.WhichOneof("op")
            if kind is None:  # no op set: one op (the conversion rejects it)
                ops += 1
                continue
            body = getattr(op, kind)
            ops += op_requests(kind, body)
            tokens += op_tokens(kind, body)
        if ops > self.max_ops_per_step:
            raise ResourceExhausted(f"{ops} ops (a decode op counts one per request) exceed "
                                    f"the limit of {self.max_ops_per_step} per Step",
                                    field="ops")
        if tokens > self.max_tokens_per_step:
            raise ResourceExhausted(f"{tokens} token ids exceed the limit of "
                                    f"{self.max_tokens_per_step} per Step", field="ops")

    def _track(self, pool_id: str, step_ops: list, session_id: str) -> None:
        """Request ownership after a batch: adds join the calling session, frees leave
        whichever session owned them. Decode and allocate ops (the hot path) cost a type
        check each."""
        ownership = self.ownership
        for op in step_ops:
            kind = op.KIND
            if kind == "add_request":
                if session_id:
                    ownership.add(pool_id, op.request_id, session_id)
            elif kind == "free":
                ownership.release(pool_id, op.request_id)

    def _prepare_register(self, request: pb.RegisterPoolRequest
                          ) -> Callable[[], pb.RegisterPoolResponse]:
        check_pool_id(request.pool_id, qualified=True)
        desc = convert.description_from_proto(request)
        entry, created = self.registry.prepare_register(request.pool_id, desc)
        if created:
            self._check_tenant_limits(entry)

        def commit() -> pb.RegisterPoolResponse:
            # The answer first: a pool whose config could not be answered would break
            # every later GetPool / ListPools, so it must not be registered.
            if created:
                entry.incarnation = self.registry.next_incarnation()
            config = convert.pool_config_to_proto(entry)
            if created:
                self.registry.add(entry)
            return pb.RegisterPoolResponse(config=config, created=created)
        return commit

    def _prepare_delete(self, request: pb.DeletePoolRequest
                        ) -> Callable[[], pb.DeletePoolResponse]:
        self.registry.get(request.pool_id)

        def commit() -> pb.DeletePoolResponse:
            dropped = self.registry.delete(request.pool_id)
            self._tables.pop(request.pool_id, None)
            self.pin_leases.pop(request.pool_id, None)
            self.ownership.drop_pool(request.pool_id)
            return pb.DeletePoolResponse(num_requests_dropped=dropped)
        return commit

    def _prepare_reset(self, request: pb.ResetPrefixCacheRequest
                       ) -> Callable[[], pb.ResetPrefixCacheResponse]:
        entry = self.registry.get(request.pool_id)
        block_ids = list(request.block_ids)
        if block_ids:
            num_blocks = entry.pool.config.num_blocks
            for i, b in enumerate(block_ids):
                if not 0 <= b < num_blocks:
                    raise InvalidArgument(f"block id {b} is outside [0, {num_blocks})",
                                          field=f"block_ids[{i}]")

            def evict() -> pb.ResetPrefixCacheResponse:
                entry.pool.evict_blocks(block_ids)
                entry.flush_events()
                return pb.ResetPrefixCacheResponse(reset=True)
            return evict

        def commit() -> pb.ResetPrefixCacheResponse:
            ok = entry.pool.reset_prefix_cache()
            entry.flush_events()
            return pb.ResetPrefixCacheResponse(reset=ok)
        return commit

    def _check_tenant_limits(self, entry: PoolEntry) -> None:
        """RESOURCE_EXHAUSTED if a new pool would take its tenant beyond the limits the
        record carries (pools held; blocks summed over its pools)."""
        limits = self._tenant
        if not (limits.max_pools or limits.max_blocks):
            return
        owner = tenant_of(entry.pool_id)
        held = [e for e in self.registry if tenant_of(e.pool_id) == owner]
        if limits.max_pools and len(held) + 1 > limits.max_pools:
            raise ResourceExhausted(f"tenant {owner!r} holds {len(held)} pools, its limit "
                                    f"(max_pools) is {limits.max_pools}", field="pool_id")
        blocks = sum(e.budget_blocks for e in held)
        need = entry.budget_blocks
        if limits.max_blocks and blocks + need > limits.max_blocks:
            host = need - entry.config.num_blocks
            raise ResourceExhausted(
                f"the pool would have {entry.config.num_blocks} blocks"
                + (f" and {host} host-tier slots" if host else "")
                + f"; tenant {owner!r} holds {blocks} of its limit (max_blocks) of "
                f"{limits.max_blocks}",
                field="options.host_tier_blocks" if host and blocks + entry.config.num_blocks
                <= limits.max_blocks else budget_field(entry.description))

    # -- pools taken over (cluster mode) ---------------------------------------------------

    def export_pool(self, pool_id: str) -> bytes:
        """The state an ``AdoptPool`` record carries for ``pool_id`` (NotFound if absent):
        the pool entry, its block tables, its request owners and the sessions that own
        requests in it or whose last call was on it (their sequence state and stored
        answer, so that a resent in-doubt call is answered, not applied twice). Reads only."""
        entry = self.registry.entry(pool_id) if pool_id in self.registry else None
        if entry is None:
            raise NotFound(f"unknown pool {pool_id!r}", field="pool_id")
        owners = self.ownership.owners_in(pool_id)  # in add order: each session's order here
        sids = set(owners.values())
        sids.update(sid for sid, s in self.sessions.items()
                    if getattr(s.last_request, "pool_id", None) == pool_id)
        sessions = [copy.copy(self.sessions[sid]) for sid in sorted(sids)]
        return dumps_state({"entry": entry, "tables": self._tables.get(pool_id),
                            "owners": owners, "sessions": sessions,
                            "pins": self.pin_leases.get(pool_id)})

    def _prepare_adopt(self, request: wal_pb2.AdoptPool
                       ) -> Callable[[], wal_pb2.AdoptPoolResult]:
        check_pool_id(request.pool_id, qualified=True)
        if request.pool_id in self.registry:
            raise AlreadyExists(f"pool {request.pool_id!r} exists", field="pool_id")
        try:
            # Written by export_pool on another replica of this service (trusted storage,
            # like a snapshot), never by a client.
            data = pickle.loads(request.state)  # noqa: S301
            entry: PoolEntry = data["entry"]
            sessions: list[Session] = data["sessions"]
        except Exception as exc:  # noqa: BLE001 - any undecodable state is the same error
            raise InvalidArgument(f"undecodable pool state: {exc}", field="state") from None
        if entry.pool_id != request.pool_id:
            raise InvalidArgument(f"the state is of pool {entry.pool_id!r}", field="state")

        def commit() -> wal_pb2.AdoptPoolResult:
            self.registry.adopt(entry)
            if data["tables"] is not None:
                self._tables[entry.pool_id] = data["tables"]
            if data.get("pins"):
                self.pin_leases[entry.pool_id] = dict(data["pins"])
            for adopted in sessions:
                # Records written before Ownership listed each session's requests in the
                # pool too: the same facts as "owners", in the same order.
                vars(adopted).pop("requests", None)
                # A session already here came from the same dead replica (through another
                # of its pools) and may have moved on since: its sequence state is newer.
                self.sessions.setdefault(adopted.session_id, adopted)
            self.ownership.adopt(entry.pool_id, data["owners"].items())
            return wal_pb2.AdoptPoolResult(session_ids=[s.session_id for s in sessions])
        return commit

    # -- sessions (changes) ---------------------------------------------------------------------

    def _prepare_open(self, request: wal_pb2.OpenSession
                      ) -> Callable[[], pb.OpenSessionResponse]:
        sid = request.session_id
        if not sid or len(sid) > 128:
            raise InvalidArgument("session id must be 1-128 characters", field="session_id")
        tenant = self._tenant.name
        existing = self.sessions.get(sid)
        if existing is not None:
            if existing.tenant != tenant or existing.expiring:
                raise AlreadyExists(f"session {sid!r} exists", field="session_id")
            # A resent OpenSession (its answer was lost): the same session again, not a
            # second one; nothing changes (replaying the record does the same).
            return lambda: pb.OpenSessionResponse(session_id=sid,
                                                  lease_ttl_seconds=self.lease_ttl_seconds)

        def commit() -> pb.OpenSessionResponse:
            self.sessions[sid] = Session(sid, request.client_name, tenant=tenant,
                                         evict_first_on_end=request.evict_first_on_end)
            self.counters.opened += 1
            return pb.OpenSessionResponse(session_id=sid,
                                          lease_ttl_seconds=self.lease_ttl_seconds)
        return commit

    def _prepare_close(self, request: pb.CloseSessionRequest
                       ) -> Callable[[], pb.CloseSessionResponse]:
        session = self.live_session(request.session_id, tenant=self._tenant.name)

        def commit() -> pb.CloseSessionResponse:
            self.pins.session_ended(session.session_id)
            freed = self._free_owned(session, self.ownership.count(session.session_id),
                                     evict_first=request.evict_first)
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
                self.pins.session_ended(session.session_id)
            freed = self._free_owned(session, request.max_requests)
            self.counters.requests_expired += freed
            left = self.ownership.count(session.session_id)
            if not left:
                del self.sessions[session.session_id]
            return wal_pb2.ExpireSessionResult(num_requests_freed=freed,
                                               num_requests_left=left)
        return commit

    def _free_owned(self, session: Session, limit: int, *, evict_first: bool = False) -> int:
        """Frees up to ``limit`` of the session's requests, oldest first, each exactly as
        a FreeOp would (one batch per pool; events flushed). Ownership is exact (adds
        and frees are tracked, deleted pools drop theirs), so every batch is valid."""
        chosen = self.ownership.oldest(session.session_id, limit)
        by_pool: dict[str, list[str]] = {}
        for pool_id, rid in chosen:
            by_pool.setdefault(pool_id, []).append(rid)
        for pool_id, rids in by_pool.items():
            entry: PoolEntry = self.registry.entry(pool_id)  # a commit: no check may fail
            hint = evict_first or getattr(session, "evict_first_on_end", False)
            entry.pool.apply_batch([Free(rid, hint) for rid in rids])
            entry.flush_events()
            tables = self._tables.get(pool_id)
            for rid in rids:
                self.ownership.release(pool_id, rid)
                if tables is not None:
                    tables.forget(rid)
        return len(chosen)


def replay_record(state: ServiceState, payload: bytes) -> None:
    """Applies one logged record (recovery, the compaction process). It was accepted when
    it was live, under that run's limits, which need not be the ones the state holds now
    (a restart with other --max-ops-per-step / --max-tokens-per-step / --max-total-blocks,
    a snapshot taken before them): the limits are lifted while it is applied, so that
    replay never drops an acknowledged record."""
    registry = state.registry
    limits = state.max_ops_per_step, state.max_tokens_per_step, registry.max_total_blocks
    state.max_ops_per_step = state.max_tokens_per_step = registry.max_total_blocks = _NO_LIMIT
    try:
        state.apply(WalRecord.FromString(payload))
    finally:
        state.max_ops_per_step, state.max_tokens_per_step, registry.max_total_blocks = limits


_NO_LIMIT = 1 << 62
_NO_TENANT = wal_pb2.TenantContext()  # records the server makes itself (expiries)

# Records whose request carries session_id + sequence (deduplicated per session): the calls
# on one pool, which the registry also fences (session records are not: they only free
# requests on this replica's copies, and a pool it lost is dropped from it, with its
# requests, through apply).
_SEQUENCED = frozenset({"step", "register_pool", "delete_pool", "reset_prefix_cache"})
