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
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import structlog
from google.protobuf.message import Message

from cache_service import calls, convert
from cache_service.core.batch import check_request_id
from cache_service.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    KVCacheError,
    NotFound,
    qualify,
)
from cache_service.event_feed import SequenceOutOfRange
from cache_service.fairness import (
    PEEK_SLICE_BLOCKS,
    SLICE_REQUESTS,
    PoolGate,
    thaw_heap,
)
from cache_service.leases import LeaseKeeper, LeaseReaper
from cache_service.registry import PoolEntry, check_pool_id
from cache_service.state import ServiceState, WalRecord
from cache_service.status import ResourceExhausted, Unavailable, to_status
from cache_service.tenants import Namespace, Tenant
from kvcache_common.api.kvcache.internal.v1 import wal_pb2
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.api.kvcache.v1 import cache_service_pb2_grpc as pb_grpc

_log = structlog.get_logger("cache_service.servicer")


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


@functools.lru_cache(maxsize=1024)
def _tenant_context(tenant: Tenant) -> wal_pb2.TenantContext:
    """Who made a call (name and limits), as records carry it for ``apply``. Shared: never
    mutate the answer (records copy it)."""
    return wal_pb2.TenantContext(name=tenant.name, max_pools=tenant.max_pools or 0,
                                 max_blocks=tenant.max_blocks or 0, admin=tenant.admin)


class CacheServicer(pb_grpc.CacheServiceServicer):
    """The gRPC handlers. ``draining`` (set on SIGTERM) turns new stream messages away."""

    def __init__(self, state: ServiceState, *, max_peek_tokens: int = 1 << 22) -> None:
        self.state = state
        self.registry = state.registry
        self.max_peek_tokens = max_peek_tokens
        self.gate = PoolGate()
        self.draining = False
        self.leases = LeaseKeeper(state.lease_ttl_seconds)
        for sid, session in state.sessions.items():  # recovered sessions: fresh leases
            if not session.expiring:
                self.leases.start(sid)
        self.reaper = LeaseReaper(state, self.leases, self.submit)

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
        except (KVCacheError, SequenceOutOfRange) as exc:
            await _abort(context, exc)
        if self.state.durability.needs_sync:
            await self.state.durability.sync()
        return response

    async def _unary(self, context: grpc.aio.ServicerContext, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (KVCacheError, SequenceOutOfRange) as exc:
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
        answer = await self._mutate(context, "register_pool", request, request.session_id,
                                    before=own)
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
        response = await self._mutate(context, "delete_pool", request, request.session_id,
                                      before=lambda: self._own(request))
        thaw_heap()
        return response

    @staticmethod
    def _own(request: Any) -> Any:
        """``request`` with its pool_id mapped to the caller's internal id (in place)."""
        request.pool_id = _inner(Namespace(calls.tenant.get()), request.pool_id)
        return request

    # -- steps -------------------------------------------------------------------------

    async def Step(self, request: pb.StepRequest,
                   context: grpc.aio.ServicerContext) -> pb.StepResponse:
        return await self._mutate(context, "step", request, request.session_id,
                                  before=lambda: self._own(request))

    async def StepStream(self, request_iterator: AsyncIterator[pb.StepRequest],
                         context: grpc.aio.ServicerContext) -> AsyncIterator[pb.StepResponse]:
        # A broken stream ends nothing but itself: the session (and its lease) lives on,
        # and the client may resend its last message on a new stream (same sequence).
        async for request in request_iterator:
            if self.draining:
                await _abort(context, Unavailable(
                    "server is draining; reconnect to another instance"))
            yield await self._mutate(context, "step", request, request.session_id,
                                     before=functools.partial(self._own, request))

    # -- sessions ----------------------------------------------------------------------

    async def OpenSession(self, request: pb.OpenSessionRequest,
                          context: grpc.aio.ServicerContext) -> pb.OpenSessionResponse:
        if len(request.client_name) > 256:
            await _abort(context, InvalidArgument("client_name is longer than 256 characters",
                                                  field="client_name"))
        # The id is chosen here, outside apply, and carried by the record (apply stays
        # deterministic). 128 random bits: unguessable by other clients.
        sid = secrets.token_hex(16)
        response = await self._mutate(context, "open_session", wal_pb2.OpenSession(
            session_id=sid, client_name=request.client_name))
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

    # -- queries -----------------------------------------------------------------------

    async def PeekPrefix(self, request: pb.PeekPrefixRequest,
                         context: grpc.aio.ServicerContext) -> pb.PeekPrefixResponse:
        ns = Namespace(calls.tenant.get())
        try:
            entries = self._peek_entries(ns, request)
            cache_salt = request.cache_salt or None
            lora_name = request.lora_name or None
            lora_path = request.lora_path or None
            hits = []
            for entry in entries:
                if request.token_ids:
                    work = entry.pool.peek_prefix_in_slices(
                        request.token_ids, slice_blocks=PEEK_SLICE_BLOCKS,
                        cache_salt=cache_salt, lora_name=lora_name, lora_path=lora_path)
                else:
                    work = entry.pool.peek_prefix_in_slices(
                        block_hashes=list(request.block_hashes), cache_salt=cache_salt,
                        lora_name=lora_name, lora_path=lora_path)
                # Hashing a long prompt is cut into slices; the cache is read in one.
                n = await self.gate.read(work, entry.pool_id)
                hits.append(pb.PoolHit(pool_id=ns.outer(entry.pool_id), hit_tokens=n))
        except (KVCacheError, SequenceOutOfRange) as exc:
            await _abort(context, exc)
        return pb.PeekPrefixResponse(hits=hits)

    def _peek_entries(self, ns: Namespace, request: pb.PeekPrefixRequest) -> list[PoolEntry]:
        """The pools of a PeekPrefix, after the checks that bound its cost."""
        if not request.pool_ids:
            raise InvalidArgument("at least one pool id is required", field="pool_ids")
        has_tokens, has_hashes = bool(request.token_ids), bool(request.block_hashes)
        if has_tokens == has_hashes:
            raise InvalidArgument("give token_ids or block_hashes (exactly one)",
                                  field="token_ids")
        seen: dict[str, int] = {}
        for i, pid in enumerate(request.pool_ids):
            if pid in seen:
                raise InvalidArgument(f"pool {pid!r} is named twice (first at pool_ids"
                                      f"[{seen[pid]}])", field=f"pool_ids[{i}]")
            seen[pid] = i
        size = len(request.token_ids) or len(request.block_hashes)
        if size * len(request.pool_ids) > self.max_peek_tokens:
            field = "token_ids" if has_tokens else "block_hashes"
            raise ResourceExhausted(
                f"{size} {field.replace('_', ' ')} x {len(request.pool_ids)} pools exceed the "
                f"limit of {self.max_peek_tokens} per PeekPrefix (--max-peek-tokens)",
                field=field)
        entries = [self.registry.get(_inner(ns, pid, f"pool_ids[{i}]"), field=f"pool_ids[{i}]")
                   for i, pid in enumerate(request.pool_ids)]
        if has_hashes:
            for i, entry in enumerate(entries):
                # The protocol's rule: client hashes use the cross-language recipe.
                if entry.pool.options.hash_algo != "sha256_cbor":
                    raise InvalidArgument(f"pool {entry.pool_id!r} does not use sha256_cbor "
                                          "hashes", field=f"pool_ids[{i}]")
        if request.HasField("hash_recipe"):
            # A client that declares how it hashes learns of a mismatch as an error naming
            # the field, not as a silent 0% hit rate.
            try:
                declared = convert.declared_recipe_from_proto(request.hash_recipe)
                for entry in entries:
                    entry.pool.check_hash_recipe(declared)
            except KVCacheError as exc:
                raise qualify(exc, "hash_recipe") from None
        return entries

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
                num_placeholder_tokens=info.num_placeholders)
        return await self._unary(context, run)

    async def GetPoolStats(self, request: pb.GetPoolStatsRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetPoolStatsResponse:
        await self._settled(Namespace(calls.tenant.get()), request.pool_id)

        def run() -> pb.GetPoolStatsResponse:
            entry = self.registry.get(self._own(request).pool_id)
            return pb.GetPoolStatsResponse(stats=convert.stats_to_proto(
                entry.pool.stats(), entry.feed.next_sequence - 1))
        return await self._unary(context, run)

    async def ResetPrefixCache(self, request: pb.ResetPrefixCacheRequest,
                               context: grpc.aio.ServicerContext
                               ) -> pb.ResetPrefixCacheResponse:
        return await self._mutate(context, "reset_prefix_cache", request, request.session_id,
                                  before=lambda: self._own(request))

    # -- events ------------------------------------------------------------------------

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
        except (KVCacheError, SequenceOutOfRange) as exc:
            await _abort(context, exc)
