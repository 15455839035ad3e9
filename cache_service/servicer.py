"""``kvcache.v1.CacheService`` on top of :class:`~cache_service.state.ServiceState`.

Every handler runs on the server's one event loop and calls the state synchronously (no
awaits between reading and writing it), so calls never interleave inside a pool. A
mutating call becomes one ``WalRecord`` applied by ``ServiceState.apply``, the only code
that changes state (it validates the whole call first: a rejected call changes nothing).
Reads go to the state directly. Sessions: every call naming a session renews its lease
(:mod:`cache_service.leases`); the lease reaper expires the others.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import structlog
from google.protobuf.message import Message

from cache_service import convert
from cache_service.core.batch import check_request_id
from cache_service.core.errors import FailedPrecondition, InvalidArgument, KVCacheError
from cache_service.event_feed import SequenceOutOfRange
from cache_service.leases import LeaseKeeper, LeaseReaper
from cache_service.registry import PoolEntry
from cache_service.state import ServiceState, WalRecord
from cache_service.status import Unavailable, to_status
from kvcache_common.api.kvcache.internal.v1 import wal_pb2
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.api.kvcache.v1 import cache_service_pb2_grpc as pb_grpc

_log = structlog.get_logger("cache_service.servicer")


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """Ends the call with the error's status (raises)."""
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


class CacheServicer(pb_grpc.CacheServiceServicer):
    """The gRPC handlers. ``draining`` (set on SIGTERM) turns new stream messages away."""

    def __init__(self, state: ServiceState) -> None:
        self.state = state
        self.registry = state.registry
        self.draining = False
        #: Cluster mode (cache_service.cluster.node.ClusterNode): places pools, deletes
        #: their etcd keys, fans PeekPrefix out. None when standalone.
        self.cluster: Any = None
        self.leases = LeaseKeeper(state.lease_ttl_seconds)
        for sid, session in state.sessions.items():  # recovered sessions: fresh leases
            if not session.expiring:
                self.leases.start(sid)
        self.reaper = LeaseReaper(state, self.leases, self.submit)

    # -- helpers -----------------------------------------------------------------------

    def submit(self, record: WalRecord) -> Message:
        """Applies one record (the one way the servicer changes state)."""
        return self.state.apply(record)

    async def _mutate(self, context: grpc.aio.ServicerContext, kind: str,
                      request: Message, session_id: str = "") -> Any:
        """Renews the caller's lease, applies the call as the record
        ``WalRecord(<kind>=request)``, waits until it is durable (when the durability
        policy asks for it) and answers the response."""
        if session_id:
            self.leases.renew(session_id)
        try:
            response = self.state.apply_call(kind, request)
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
        return self.state.apply_call("step", request)  # type: ignore[return-value]

    # -- pools -------------------------------------------------------------------------

    async def RegisterPool(self, request: pb.RegisterPoolRequest,
                           context: grpc.aio.ServicerContext) -> pb.RegisterPoolResponse:
        if self.cluster is not None:
            try:  # raises a redirect unless this replica owns the pool
                await self.cluster.place(request)
            except KVCacheError as exc:
                await _abort(context, exc)
        return await self._mutate(context, "register_pool", request, request.session_id)

    async def GetPool(self, request: pb.GetPoolRequest,
                      context: grpc.aio.ServicerContext) -> pb.GetPoolResponse:
        return await self._unary(context, lambda: pb.GetPoolResponse(
            config=convert.pool_config_to_proto(self.registry.get(request.pool_id))))

    async def ListPools(self, request: pb.ListPoolsRequest,
                        context: grpc.aio.ServicerContext) -> pb.ListPoolsResponse:
        return pb.ListPoolsResponse(pools=[convert.pool_config_to_proto(e)
                                           for e in self.registry])

    async def DeletePool(self, request: pb.DeletePoolRequest,
                         context: grpc.aio.ServicerContext) -> pb.DeletePoolResponse:
        if self.cluster is not None:
            try:
                await self.cluster.delete(request.pool_id)
            except KVCacheError as exc:
                await _abort(context, exc)
        return await self._mutate(context, "delete_pool", request, request.session_id)

    # -- steps -------------------------------------------------------------------------

    async def Step(self, request: pb.StepRequest,
                   context: grpc.aio.ServicerContext) -> pb.StepResponse:
        return await self._mutate(context, "step", request, request.session_id)

    async def StepStream(self, request_iterator: AsyncIterator[pb.StepRequest],
                         context: grpc.aio.ServicerContext) -> AsyncIterator[pb.StepResponse]:
        # A broken stream ends nothing but itself: the session (and its lease) lives on,
        # and the client may resend its last message on a new stream (same sequence).
        async for request in request_iterator:
            if self.draining:
                await _abort(context, Unavailable(
                    "server is draining; reconnect to another instance"))
            yield await self._mutate(context, "step", request, request.session_id)

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
            self.state.live_session(request.session_id)
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
        def run(request: pb.PeekPrefixRequest = request) -> pb.PeekPrefixResponse:
            if not request.pool_ids:
                raise InvalidArgument("at least one pool id is required", field="pool_ids")
            has_tokens, has_hashes = bool(request.token_ids), bool(request.block_hashes)
            if has_tokens == has_hashes:
                raise InvalidArgument("give token_ids or block_hashes (exactly one)",
                                      field="token_ids")
            entries = [self.registry.get(pid, field=f"pool_ids[{i}]")
                       for i, pid in enumerate(request.pool_ids)]
            extra = dict(cache_salt=request.cache_salt or None,
                         lora_name=request.lora_name or None,
                         lora_path=request.lora_path or None)
            hits = []
            for i, entry in enumerate(entries):
                if has_tokens:
                    n = entry.pool.peek_prefix(request.token_ids, **extra)
                else:
                    # The protocol's rule: client hashes use the cross-language recipe.
                    if entry.pool.options.hash_algo != "sha256_cbor":
                        raise InvalidArgument(
                            f"pool {entry.pool_id!r} does not use sha256_cbor hashes",
                            field=f"pool_ids[{i}]")
                    n = entry.pool.peek_prefix(block_hashes=list(request.block_hashes),
                                               **extra)
                hits.append(pb.PoolHit(pool_id=entry.pool_id, hit_tokens=n))
            return pb.PeekPrefixResponse(hits=hits)
        if self.cluster is not None:
            try:  # pools on other replicas are asked there, within this call's deadline
                return await self.cluster.peek_prefix(request, context, run)
            except KVCacheError as exc:
                await _abort(context, exc)
        return await self._unary(context, run)

    async def GetRequest(self, request: pb.GetRequestRequest,
                         context: grpc.aio.ServicerContext) -> pb.GetRequestResponse:
        def run() -> pb.GetRequestResponse:
            pool = self.registry.get(request.pool_id).pool
            check_request_id(request.request_id)
            info = pool.request_info(request.request_id)
            return pb.GetRequestResponse(
                block_ids=convert.tables(pool.block_ids(request.request_id)),
                num_computed_tokens=info.num_computed_tokens, num_tokens=info.num_tokens,
                num_block_hashes=info.num_block_hashes, status=info.status,
                num_preemptions=info.num_preemptions)
        return await self._unary(context, run)

    async def GetPoolStats(self, request: pb.GetPoolStatsRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetPoolStatsResponse:
        def run() -> pb.GetPoolStatsResponse:
            entry = self.registry.get(request.pool_id)
            return pb.GetPoolStatsResponse(stats=convert.stats_to_proto(
                entry.pool.stats(), entry.feed.next_sequence - 1))
        return await self._unary(context, run)

    async def ResetPrefixCache(self, request: pb.ResetPrefixCacheRequest,
                               context: grpc.aio.ServicerContext
                               ) -> pb.ResetPrefixCacheResponse:
        return await self._mutate(context, "reset_prefix_cache", request, request.session_id)

    # -- events ------------------------------------------------------------------------

    async def SubscribeEvents(self, request: pb.SubscribeEventsRequest,
                              context: grpc.aio.ServicerContext
                              ) -> AsyncIterator[pb.SubscribeEventsResponse]:
        try:
            entry = self.registry.get(request.pool_id)
            check_incarnation(entry, request)
            start = request.from_sequence if request.HasField("from_sequence") else None
            subscription = entry.feed.subscribe(start)
            incarnation = entry.incarnation
            async for batch in subscription:
                yield pb.SubscribeEventsResponse(
                    events=[convert.event_to_proto(seq, e, incarnation) for seq, e in batch])
        except (KVCacheError, SequenceOutOfRange) as exc:
            await _abort(context, exc)
