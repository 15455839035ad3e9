"""``kvcache.v1.CacheService`` on top of :class:`~cache_service.state.ServiceState`.

Every handler runs on the server's one event loop and calls the state synchronously (no
awaits between reading and writing it), so calls never interleave inside a pool. A
mutating call becomes one ``WalRecord`` applied by ``ServiceState.apply``, the only code
that changes state (it validates the whole call first: a rejected call changes nothing).
Reads go to the state directly. Sessions: every call naming a session renews its lease
(:mod:`cache_service.leases`); the lease reaper expires the others.
"""

from __future__ import annotations

import functools
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from google.protobuf.message import Message

from cache_service import calls, convert
from cache_service.core.batch import check_request_id
from cache_service.core.peek import probe_keys
from cache_service.core.pool import Pool
from cache_service.core.prefix_index import KeySpace
from cache_service.core.residency import Residency
from cache_service.core.slices import run_to_end
from cache_service.errors import (
    Draining,
    FailedPrecondition,
    InvalidArgument,
    KVCacheError,
    NotFound,
    ResourceExhausted,
    qualify,
)
from cache_service.fairness import (
    PEEK_SLICE_BLOCKS,
    SLICE_REQUESTS,
    PoolGate,
    thaw_heap,
)
from cache_service.leases import LeaseKeeper, LeaseReaper
from cache_service.pins import PinReaper, tenant_pinned_blocks
from cache_service.registry import PoolEntry, check_pool_id
from cache_service.state import ServiceState, WalRecord
from cache_service.status import to_status
from cache_service.tenants import ANONYMOUS, Namespace, Tenant, tenant_of
from kvcache_common.api.kvcache.internal.v1 import wal_pb2
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.api.kvcache.v1 import cache_service_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # imported by the server only in cluster mode (etcd client)
    from cache_service.cluster.node import ClusterNode

_log = structlog.get_logger("cache_service.servicer")

#: A session id a client may propose (OpenSessionRequest.session_id): random hex, >= 128 bits.
_PROPOSED_SESSION_ID = re.compile(r"[0-9a-f]{32,128}")


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """Ends the call with the error's status (raises). Pool ids in the message are shown
    as the caller knows them."""
    scrubbed = Namespace(calls.tenant.get()).scrub(str(exc))
    if scrubbed != str(exc):
        exc.args = (scrubbed,)
    await context.abort_with_status(to_status(exc))


def check_incarnation(entry: PoolEntry, request: pb.SubscribeEventsRequest) -> None:
    """A resume must name the incarnation it resumes, if it names one: sequence numbers of
    two incarnations overlap, and splicing them would corrupt the subscriber's index."""
    if request.HasField("incarnation") and request.incarnation != entry.incarnation:
        raise FailedPrecondition(
            f"pool {entry.pool_id!r} is incarnation {entry.incarnation}, not "
            f"{request.incarnation}: its state was not preserved (deleted and registered "
            "again, or a restart without --data-dir), so events of the old incarnation are "
            "gone; resynchronise and subscribe without from_sequence", field="incarnation")


def _inner(ns: Namespace, pool_id: str, field: str = "pool_id") -> str:
    """The internal id of a pool id the caller sent (NOT_FOUND if it cannot be one of
    the caller's pools: another tenant's pools do not exist for it)."""
    internal = ns.inner(pool_id)
    if internal is None:
        raise NotFound(f"unknown pool {pool_id!r}", field=field)
    return internal


@dataclass(frozen=True)
class _PeekPlan:
    """A PeekPrefix's pool list resolved: entries, internal and caller's ids, the pool that
    checks and hashes the prompt for each key space (None: pools without caching), by
    token limit, the first pool without sha256_cbor hashes (or None), and the positions
    of the pools with a host tier (asked themselves, not the routing index)."""

    entries: list[PoolEntry]
    pool_ids: list[str]
    outer_ids: list[str]
    hashers: list[tuple[KeySpace | None, Pool]]
    first_not_cbor: int | None
    tiered: list[int]


@functools.lru_cache(maxsize=1024)
def _tenant_context(tenant: Tenant) -> wal_pb2.TenantContext:
    """Who made a call (name and limits), as records carry it for ``apply``. Shared: never
    mutate the answer (records copy it)."""
    return wal_pb2.TenantContext(name=tenant.name, max_pools=tenant.max_pools or 0,
                                 max_blocks=tenant.max_blocks or 0, admin=tenant.admin,
                                 max_pinned_blocks=tenant.max_pinned_blocks or 0)


class CacheServicer(pb_grpc.CacheServiceServicer):
    """The gRPC handlers. ``draining`` (set on SIGTERM) turns new stream messages away."""

    def __init__(self, state: ServiceState, *, max_peek_tokens: int = 1 << 22,
                 leases: LeaseKeeper | None = None, cluster: ClusterNode | None = None,
                 step_observer: Callable[[str, float], None] | None = None) -> None:
        """``leases``: the server's lease keeper (shared with the cluster node; a new one
        if None). ``cluster``: the node in cluster mode (see :attr:`cluster`).
        ``step_observer`` is called with (internal pool id, seconds) after each applied
        Step (the server's RpcMetrics.observe_step)."""
        self.state = state
        self.registry = state.registry
        self.max_peek_tokens = max_peek_tokens
        self.gate = PoolGate()
        self.draining = False
        self._node = cluster
        self.step_observer = step_observer
        self.leases = leases if leases is not None else LeaseKeeper(state.lease_ttl_seconds)
        for sid, session in state.sessions.items():  # recovered sessions: fresh leases
            if not session.expiring:
                self.leases.start(sid)
        self.reaper = LeaseReaper(state, self.leases, self.submit)
        self.pin_reaper = PinReaper(state.pins, self.submit)
        # pool id -> (its last PeekPrefix answer, the id the caller knows, that entry
        # serialized); see _peek_response.
        self._peek_fragments: dict[str, tuple[Residency, str, bytes]] = {}
        # (tenant prefix, admin, pool ids) -> (registry version, its _PeekPlan)
        self._peek_plans: dict[tuple[str, bool, tuple[str, ...]], tuple[int, _PeekPlan]] = {}

    @property
    def cluster(self) -> ClusterNode | None:
        """Cluster mode, once the node has joined: places pools, deletes their etcd keys,
        fans PeekPrefix out. None when standalone, and before the join (the port is
        open while the node connects; its registry checks nothing yet either)."""
        node = self._node
        return node if node is not None and node.joined else None

    # -- helpers -----------------------------------------------------------------------

    async def submit(self, record: WalRecord) -> Message:
        """Applies one record (the one way the servicer changes state), in slices."""
        return await self.gate.run(self.state.apply_in_slices(record, SLICE_REQUESTS),
                                   self.state.pools_of(record))

    async def _mutate(self, context: grpc.aio.ServicerContext, kind: str,
                      request: Message, session_id: str = "", *,
                      before: Callable[[], object] | None = None) -> Any:
        """Renews the caller's lease, runs ``before`` (checks, and the mapping of the
        caller's pool id: errors answer the call), applies the call as the record
        ``WalRecord(<kind>=request, tenant=<the caller>)`` in slices, waits until it is
        durable (when the durability policy asks for it) and answers the response."""
        if session_id:
            self.leases.renew(session_id)
        try:
            if before is not None:
                before()
            work = self.state.apply_call_in_slices(
                kind, request, _tenant_context(calls.tenant.get()), SLICE_REQUESTS)
            response = await self.gate.run(work, self.state.pools_of_call(kind, request))
            if self.state.durability.needs_sync:
                try:
                    await self.state.durability.sync()  # raises if the log broke meanwhile
                except KVCacheError:
                    self.state.wal_errors += 1  # kvcache_wal_errors_total
                    raise
        except KVCacheError as exc:
            await _abort(context, exc)
        return response

    async def _unary(self, context: grpc.aio.ServicerContext, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except KVCacheError as exc:
            await _abort(context, exc)

    def step(self, request: pb.StepRequest) -> pb.StepResponse:
        """One Step as the handlers apply it, without gRPC (raises a core error and
        changes nothing if the batch is rejected)."""
        return self.state.apply_call("step", request)

    # -- pools -------------------------------------------------------------------------

    # Tenancy: each handler maps the pool ids the caller sent to internal ids (its own
    # namespace, see cache_service.tenants.Namespace) and the ids it answers back.

    async def RegisterPool(self, request: pb.RegisterPoolRequest,
                           context: grpc.aio.ServicerContext) -> pb.RegisterPoolResponse:
        ns = Namespace(calls.tenant.get())

        def own() -> None:
            check_pool_id(request.pool_id)
            request.pool_id = _inner(ns, request.pool_id)
        before: Callable[[], object] | None = own
        if self.cluster is not None:
            try:  # places a new pool; a redirect unless this replica owns it
                own()
                await self.cluster.place(request)
            except KVCacheError as exc:
                await _abort(context, exc)
            before = None  # mapped already
        try:
            answer = await self._mutate(context, "register_pool", request,
                                        request.session_id, before=before)
        except Exception:
            if self.cluster is not None:  # refused here: placed for nothing
                await self.cluster.unplace(request.pool_id)
            raise
        response = pb.RegisterPoolResponse()
        response.CopyFrom(answer)  # the state may keep its answer (session retries)
        response.config.pool_id = ns.outer(response.config.pool_id)
        return response

    def _config(self, ns: Namespace, entry: PoolEntry) -> pb.PoolConfig:
        config = convert.pool_config_to_proto(entry)
        config.pool_id = ns.outer(config.pool_id)
        return config

    async def _settled(self, ns: Namespace, pool_id: str) -> None:
        """Waits until no sliced call is working on the caller's pool ``pool_id``."""
        internal = ns.inner(pool_id)
        if internal is not None:
            await self.gate.wait_idle((internal,))

    async def GetPool(self, request: pb.GetPoolRequest,
                      context: grpc.aio.ServicerContext) -> pb.GetPoolResponse:
        ns = Namespace(calls.tenant.get())
        return await self._unary(context, lambda: pb.GetPoolResponse(config=self._config(
            ns, self.registry.get(_inner(ns, request.pool_id)))))

    async def ListPools(self, request: pb.ListPoolsRequest,
                        context: grpc.aio.ServicerContext) -> pb.ListPoolsResponse:
        ns = Namespace(calls.tenant.get())
        configs = sorted((self._config(ns, e) for e in self.registry if ns.sees(e.pool_id)),
                         key=lambda config: config.pool_id)
        return pb.ListPoolsResponse(pools=configs)

    async def DeletePool(self, request: pb.DeletePoolRequest,
                         context: grpc.aio.ServicerContext) -> pb.DeletePoolResponse:
        mapped = self.cluster is not None
        if self.cluster is not None:
            try:  # its etcd keys go first: nobody takes a deleted pool over
                await self.cluster.delete(self._own(request).pool_id)
            except KVCacheError as exc:
                await _abort(context, exc)
        response = await self._mutate(context, "delete_pool", request, request.session_id,
                                      before=None if mapped else lambda: self._own(request))
        self._peek_fragments.pop(request.pool_id, None)
        thaw_heap()
        return response

    @staticmethod
    def _own(request: Any) -> Any:
        """``request`` with its pool_id mapped to the caller's internal id (in place)."""
        request.pool_id = _inner(Namespace(calls.tenant.get()), request.pool_id)
        return request

    # -- steps -------------------------------------------------------------------------

    async def _step(self, context: grpc.aio.ServicerContext,
                    request: pb.StepRequest) -> pb.StepResponse:
        start = time.perf_counter()
        response = await self._mutate(context, "step", request, request.session_id,
                                      before=functools.partial(self._own, request))
        if self.step_observer is not None:  # request.pool_id is the internal id by now
            self.step_observer(request.pool_id, time.perf_counter() - start)
        return response

    async def Step(self, request: pb.StepRequest,
                   context: grpc.aio.ServicerContext) -> pb.StepResponse:
        return await self._step(context, request)

    async def StepStream(self, request_iterator: AsyncIterator[pb.StepRequest],
                         context: grpc.aio.ServicerContext) -> AsyncIterator[pb.StepResponse]:
        # A broken stream ends nothing but itself: the session (and its lease) lives on,
        # and the client may resend its last message on a new stream (same sequence).
        async for request in request_iterator:
            if self.draining:
                await _abort(context, Draining())
            yield await self._step(context, request)

    # -- sessions ----------------------------------------------------------------------

    async def OpenSession(self, request: pb.OpenSessionRequest,
                          context: grpc.aio.ServicerContext) -> pb.OpenSessionResponse:
        if len(request.client_name) > 256:
            await _abort(context, InvalidArgument("client_name is longer than 256 characters",
                                                  field="client_name"))
        # The id is chosen here (or proposed by the client, so that it can resend a lost
        # OpenSession), outside apply, and carried by the record (apply stays
        # deterministic). 128 random bits: unguessable by other clients.
        if request.session_id and not _PROPOSED_SESSION_ID.fullmatch(request.session_id):
            await _abort(context, InvalidArgument(
                "session_id must be 32-128 lowercase hex characters (random) or empty",
                field="session_id"))
        sid = request.session_id or secrets.token_hex(16)
        response = await self._mutate(context, "open_session", wal_pb2.OpenSession(
            session_id=sid, client_name=request.client_name,
            evict_first_on_end=request.evict_first_on_end))
        self.leases.start(sid)
        _log.info("session_opened", session_id=sid, client=request.client_name)
        return response

    async def KeepAlive(self, request: pb.KeepAliveRequest,
                        context: grpc.aio.ServicerContext) -> pb.KeepAliveResponse:
        def run() -> pb.KeepAliveResponse:
            self.state.live_session(request.session_id, tenant=calls.tenant.get().name)
            self.leases.renew(request.session_id)
            return pb.KeepAliveResponse(lease_ttl_seconds=self.leases.ttl)
        return await self._unary(context, run)

    async def CloseSession(self, request: pb.CloseSessionRequest,
                           context: grpc.aio.ServicerContext) -> pb.CloseSessionResponse:
        response = await self._mutate(context, "close_session", request)
        self.leases.end(request.session_id)
        _log.info("session_closed", session_id=request.session_id,
                  requests_freed=response.num_requests_freed)
        return response

    async def ListSessions(self, request: pb.ListSessionsRequest,
                           context: grpc.aio.ServicerContext) -> pb.ListSessionsResponse:
        tenant = calls.tenant.get()
        ns = Namespace(tenant)
        answer = pb.ListSessionsResponse()
        for sid, session in sorted(self.state.sessions.items()):
            if not (tenant.admin or session.tenant == tenant.name):
                continue
            by_pool: dict[str, list[str]] = {}
            for pool_id, request_id in self.state.ownership.requests_of(sid):
                by_pool.setdefault(pool_id, []).append(request_id)
            info = answer.sessions.add(
                session_id_prefix=sid[:8], client_name=session.client_name,
                lease_remaining_seconds=self.leases.remaining(sid),
                last_sequence=session.last_sequence, expiring=session.expiring)
            for pool_id, request_ids in sorted(by_pool.items()):
                pool = self.registry.entry(pool_id).pool if pool_id in self.registry else None
                stats = pool.stats() if pool is not None else None
                info.pools.add(pool_id=ns.outer(pool_id), num_requests=len(request_ids),
                               request_ids=request_ids[:1000],
                               blocks_held=pool.account_blocks(sid) if pool else 0,
                               block_quota=stats.account_block_quota if stats else 0)
        return answer

    # -- prefix pins (cache_service/pins.py) -------------------------------------------

    async def PinPrefix(self, request: pb.PinPrefixRequest,
                        context: grpc.aio.ServicerContext) -> pb.PinPrefixResponse:
        """Pins a prefix (cache_service/pins.py); the expiry is the record's."""
        # The expiry is computed here, outside apply, and carried by the record.
        record = wal_pb2.PinPrefix(request=request,
                                   expires_at=time.time() + request.ttl_seconds)
        return await self._pin_call(context, "pin_prefix", record, request.session_id)

    async def RenewPin(self, request: pb.RenewPinRequest,
                       context: grpc.aio.ServicerContext) -> pb.RenewPinResponse:
        """Sets a pin's expiry to ttl_seconds from now (carried by the record)."""
        record = wal_pb2.RenewPin(request=request,
                                  expires_at=time.time() + request.ttl_seconds)
        return await self._pin_call(context, "renew_pin", record)

    async def DropPin(self, request: pb.DropPinRequest,
                      context: grpc.aio.ServicerContext) -> pb.DropPinResponse:
        """Drops a pin; answers it as it was."""
        return await self._pin_call(context, "drop_pin", request)

    async def _pin_call(self, context: grpc.aio.ServicerContext, kind: str, record: Any,
                        session_id: str = "") -> Any:
        inner = record.request if kind in ("pin_prefix", "renew_pin") else record
        answer = await self._mutate(context, kind, record, session_id,
                                    before=lambda: self._own(inner))
        response = type(answer)()
        response.CopyFrom(answer)
        return response

    # -- queries -----------------------------------------------------------------------

    async def PeekPrefix(self, request: pb.PeekPrefixRequest,
                         context: grpc.aio.ServicerContext) -> pb.PeekPrefixResponse:
        ns = Namespace(calls.tenant.get())
        try:
            if self.cluster is not None:
                # Pools owned by other replicas are asked there (with the caller's
                # credentials, within this call's deadline); the rest answered here.
                return await self.cluster.peek_prefix(request, ns, context, self._peek_here)
            return await self._peek_here(ns, request)
        except KVCacheError as exc:
            await _abort(context, exc)
            raise  # not reached: _abort raises the status

    async def _peek_here(self, ns: Namespace, request: pb.PeekPrefixRequest
                         ) -> pb.PeekPrefixResponse:
        """PeekPrefix over pools of this replica (the caller's ids, mapped by ``ns``)."""
        plan = self._peek_checked(ns, request)
        # Hashing a long prompt is cut into slices; the pools are read in one.
        response: pb.PeekPrefixResponse = await self.gate.read(
            self._peek(request, plan), plan.pool_ids)
        return response

    def peek_prefix(self, request: pb.PeekPrefixRequest,
                    tenant: Tenant = ANONYMOUS) -> pb.PeekPrefixResponse:
        """One PeekPrefix as the handler answers it, without gRPC (raises a core error)."""
        return run_to_end(self._peek(request, self._peek_checked(Namespace(tenant), request)))

    def _peek(self, request: pb.PeekPrefixRequest, plan: _PeekPlan
              ) -> Generator[None, None, pb.PeekPrefixResponse]:
        keys = probe_keys(request.cache_salt or None, request.lora_name or None,
                          request.lora_path or None, convert.mm_items_from_proto(request.mm_items),
                          request.prompt_embeds_digests)
        tokens = request.token_ids or None
        hashes = list(request.block_hashes) or None
        answers: list[Residency]
        if request.explain:
            # Explaining asks each pool itself (it rehashes and probes its maps).
            answers = []
            for entry in plan.entries:
                answer = yield from entry.pool.prefix_residency_in_slices(
                    tokens, block_hashes=hashes, cache_salt=keys.cache_salt,
                    lora_name=keys.lora_name, lora_path=keys.lora_path, explain_misses=True,
                    slice_blocks=PEEK_SLICE_BLOCKS, mm_items=keys.mm_items,
                    prompt_embeds_digests=keys.prompt_embeds)
                answers.append(answer)
        else:
            # The routing index: the prompt checked and hashed once per key space (by its
            # pool with the smallest token limit, whose check covers the others').
            inputs: dict[KeySpace, tuple[list[bytes], int]] = {}
            for space, pool in plan.hashers:
                hashed, max_len, _ = yield from pool.peek_input_in_slices(
                    tokens, hashes, keys, slice_blocks=PEEK_SLICE_BLOCKS)
                if space is not None:
                    inputs[space] = (hashed or [], max_len)
            answers = self.registry.index.peek(plan.pool_ids, inputs.__getitem__)
            for i in plan.tiered:
                # The index holds device keys only: a pool with a host tier answers its
                # hit across both tiers itself (docs/protocol.md#host-tier).
                answers[i] = yield from plan.entries[i].pool.prefix_residency_in_slices(
                    tokens, block_hashes=hashes, cache_salt=keys.cache_salt,
                    lora_name=keys.lora_name, lora_path=keys.lora_path,
                    slice_blocks=PEEK_SLICE_BLOCKS)
        response = self._peek_response(plan, answers, cache=not request.explain)
        for i, entry in enumerate(plan.entries):
            if entry.pool.num_pinned_blocks:  # pins: PoolHit.pinned_tokens
                hashed, _, _ = yield from entry.pool.peek_input_in_slices(
                    tokens, hashes, keys, slice_blocks=PEEK_SLICE_BLOCKS)
                response.hits[i].pinned_tokens = min(
                    response.hits[i].hit_tokens, entry.pool.pinned_tokens(hashed or []))
        return response

    def _peek_response(self, plan: _PeekPlan, answers: list[Residency], *,
                       cache: bool) -> pb.PeekPrefixResponse:
        """The answer, each pool's entry kept serialized while its answer is the same
        object (the index hands out an unchanged answer again): building ~6 fields per
        pool costs more than the index lookup itself in a many-pool answer."""
        fragments = self._peek_fragments
        parts = []
        for pool_id, outer, answer in zip(plan.pool_ids, plan.outer_ids, answers):
            cached = fragments.get(pool_id)
            if cached is None or cached[0] is not answer or cached[1] != outer:
                one = pb.PeekPrefixResponse()
                hit = one.hits.add(pool_id=outer, hit_tokens=answer.hit_tokens)
                if answer.host_hit is not None:  # pools with a host tier only
                    hit.host_hit_tokens = answer.host_hit
                convert.write_residency(hit.groups, answer.groups)
                cached = (answer, outer, one.SerializeToString())
                if cache:
                    fragments[pool_id] = cached
            parts.append(cached[2])
        return pb.PeekPrefixResponse.FromString(b"".join(parts))

    def _peek_checked(self, ns: Namespace, request: pb.PeekPrefixRequest) -> _PeekPlan:
        """The pools of a PeekPrefix, after the checks that bound its cost."""
        if not request.pool_ids:
            raise InvalidArgument("at least one pool id is required", field="pool_ids")
        has_tokens, has_hashes = bool(request.token_ids), bool(request.block_hashes)
        if not has_tokens and not has_hashes or (has_tokens and has_hashes
                                                 and not request.explain):
            raise InvalidArgument("give token_ids or block_hashes (exactly one; both only "
                                  "with explain)", field="token_ids")
        plan = self._peek_plan(ns, tuple(request.pool_ids))
        # The cost: the prompt is read once per key space (the routing index answers every
        # pool of one from one pass) and once per pool with a host tier (asked itself), or
        # once per pool with explain (each pool is asked).
        if request.explain:
            passes, unit = len(plan.entries), "pools"
        else:
            passes = len(plan.hashers) + len(plan.tiered)
            unit = "hash recipes + pools with a host tier" if plan.tiered else "hash recipes"
        size = len(request.token_ids) or len(request.block_hashes)
        if size * passes > self.max_peek_tokens:
            field = "token_ids" if has_tokens else "block_hashes"
            raise ResourceExhausted(
                f"{size} {field.replace('_', ' ')} x {passes} {unit} exceed the limit of "
                f"{self.max_peek_tokens} per PeekPrefix (--max-peek-tokens)", field=field)
        if has_hashes and plan.first_not_cbor is not None:
            # The protocol's rule: client hashes use the cross-language recipe.
            i = plan.first_not_cbor
            raise InvalidArgument(f"pool {plan.pool_ids[i]!r} does not use sha256_cbor "
                                  "hashes", field=f"pool_ids[{i}]")
        if request.HasField("hash_recipe"):
            # A client that declares how it hashes learns of a mismatch as an error naming
            # the field, not as a silent 0% hit rate.
            try:
                declared = convert.declared_recipe_from_proto(request.hash_recipe)
                for entry in plan.entries:
                    entry.pool.check_hash_recipe(declared)
            except KVCacheError as exc:
                raise qualify(exc, "hash_recipe") from None
        return plan

    def _peek_plan(self, ns: Namespace, pool_ids: tuple[str, ...]) -> _PeekPlan:
        """What a PeekPrefix derives from its pool list alone, kept until a pool is
        registered or deleted (routers ask about the same pools again and again)."""
        key = (ns.prefix, ns.tenant.admin, pool_ids)
        version = self.registry.version
        cached = self._peek_plans.get(key)
        if cached is not None and cached[0] == version:
            return cached[1]
        seen: dict[str, int] = {}
        for i, pid in enumerate(pool_ids):
            if pid in seen:
                raise InvalidArgument(f"pool {pid!r} is named twice (first at pool_ids"
                                      f"[{seen[pid]}])", field=f"pool_ids[{i}]")
            seen[pid] = i
        entries = [self.registry.get(_inner(ns, pid, f"pool_ids[{i}]"), field=f"pool_ids[{i}]")
                   for i, pid in enumerate(pool_ids)]
        index = self.registry.index
        hashers: dict[KeySpace | None, Pool] = {}  # None: pools without caching (checks only)
        for entry in entries:
            pool = entry.pool
            space = index.keyspace(entry.pool_id) if pool.options.enable_caching else None
            other = hashers.get(space)
            if other is None or pool.token_limit < other.token_limit:
                hashers[space] = pool
        plan = _PeekPlan(
            entries, [e.pool_id for e in entries], [ns.outer(e.pool_id) for e in entries],
            sorted(hashers.items(), key=lambda item: item[1].token_limit),
            next((i for i, e in enumerate(entries)
                  if e.pool.options.hash_algo != "sha256_cbor"), None),
            [i for i, e in enumerate(entries) if e.pool.options.host_tier_blocks])
        if len(self._peek_plans) >= 64:
            self._peek_plans.clear()
        self._peek_plans[key] = (version, plan)
        return plan

    async def GetRequest(self, request: pb.GetRequestRequest,
                         context: grpc.aio.ServicerContext) -> pb.GetRequestResponse:
        await self._settled(Namespace(calls.tenant.get()), request.pool_id)

        def run() -> pb.GetRequestResponse:
            pool = self.registry.get(self._own(request).pool_id).pool
            check_request_id(request.request_id)
            info = pool.request_info(request.request_id)
            return pb.GetRequestResponse(
                block_ids=convert.tables(pool.block_ids(request.request_id)),
                num_computed_tokens=info.num_computed_tokens, num_tokens=info.num_tokens,
                num_block_hashes=info.num_block_hashes, status=info.status,
                num_preemptions=info.num_preemptions,
                num_placeholder_tokens=info.num_placeholder_tokens)
        return await self._unary(context, run)

    async def GetPoolStats(self, request: pb.GetPoolStatsRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetPoolStatsResponse:
        await self._settled(Namespace(calls.tenant.get()), request.pool_id)

        def run() -> pb.GetPoolStatsResponse:
            entry = self.registry.get(self._own(request).pool_id)
            stats = convert.stats_to_proto(entry.pool.stats(), entry.feed.next_sequence - 1)
            stats.tenant_pinned_blocks = tenant_pinned_blocks(self.state,
                                                              tenant_of(entry.pool_id))
            return pb.GetPoolStatsResponse(stats=stats)
        return await self._unary(context, run)

    async def ResetPrefixCache(self, request: pb.ResetPrefixCacheRequest,
                               context: grpc.aio.ServicerContext
                               ) -> pb.ResetPrefixCacheResponse:
        return await self._mutate(context, "reset_prefix_cache", request, request.session_id,
                                  before=lambda: self._own(request))

    # -- events ------------------------------------------------------------------------

    async def GetPrefixSnapshot(self, request: pb.GetPrefixSnapshotRequest,
                                context: grpc.aio.ServicerContext
                                ) -> pb.GetPrefixSnapshotResponse:
        # Consistent: once no sliced call works on the pool, nothing runs between reading
        # its map and its feed (one event loop), and every mutation publishes its events
        # before it ends, so the map holds exactly the events up to the sequence.
        await self._settled(Namespace(calls.tenant.get()), request.pool_id)

        def run() -> pb.GetPrefixSnapshotResponse:
            entry = self.registry.get(self._own(request).pool_id)
            return convert.snapshot_to_proto(entry.pool, entry.feed.next_sequence - 1,
                                             entry.incarnation)
        return await self._unary(context, run)

    async def SubscribeEvents(self, request: pb.SubscribeEventsRequest,
                              context: grpc.aio.ServicerContext
                              ) -> AsyncIterator[pb.SubscribeEventsResponse]:
        try:
            entry = self.registry.get(self._own(request).pool_id)
            check_incarnation(entry, request)
            start = request.from_sequence if request.HasField("from_sequence") else None
            subscription = entry.feed.subscribe(start)
            incarnation = entry.incarnation
            async for batch in subscription:
                yield pb.SubscribeEventsResponse(
                    events=[convert.event_to_proto(seq, e, incarnation) for seq, e in batch])
        except KVCacheError as exc:
            await _abort(context, exc)
