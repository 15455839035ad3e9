"""The asyncio client (grpc.aio): :class:`AsyncCacheClient` and :class:`AsyncStepStream`."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.api.kvcache.v1 import cache_service_pb2_grpc as pb_grpc
from cache_service.client._builders import StepBuilder, decode_request, peek_request, register_request
from cache_service.client._channel import CHANNEL_OPTIONS, auth_metadata, channel_credentials
from cache_service.client._errors import CacheError
from cache_service.client._results import (
    DecodeResult,
    Event,
    PoolInfo,
    PoolStats,
    RequestState,
    StepResult,
    event_from,
    hits_from,
    pool_info_from,
    request_state_from,
    stats_from,
    step_result,
)



class AsyncCacheClient:
    """grpc.aio client. ``target`` is ``host:port``; ``token`` adds a bearer token;
    ``tls=True`` (or ``root_certificates``) uses TLS. Use as ``async with``."""

    def __init__(self, target: str, *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, default_timeout: float = 10.0,
                 max_retries: int = 4, backoff_base: float = 0.05, backoff_max: float = 1.0,
                 ssl_target_name_override: str | None = None) -> None:
        options = list(CHANNEL_OPTIONS)
        if ssl_target_name_override:
            options.append(("grpc.ssl_target_name_override", ssl_target_name_override))
        creds = channel_credentials(tls, root_certificates)
        self._channel = (grpc.aio.secure_channel(target, creds, options=options) if creds
                         else grpc.aio.insecure_channel(target, options=options))
        self._stub = pb_grpc.CacheServiceStub(self._channel)
        self._metadata = auth_metadata(token)
        self.default_timeout = default_timeout
        self._retries = max_retries
        self._backoff = (backoff_base, backoff_max)

    async def __aenter__(self) -> "AsyncCacheClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, method: Any, request: Any, timeout: float | None) -> Any:
        attempt = 0
        while True:
            try:
                return await method(request, timeout=timeout or self.default_timeout,
                                    metadata=self._metadata)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt >= self._retries:
                    raise CacheError.from_rpc(exc) from None
                base, cap = self._backoff
                await asyncio.sleep(min(cap, base * 2 ** attempt) * random.uniform(0.5, 1.0))
                attempt += 1

    async def register_pool(self, pool_id: str, layer_specs: Sequence[pb.LayerSpec], *,
                            timeout: float | None = None, **kwargs: Any) -> PoolInfo:
        """Create (or re-open, if identical) a pool; kwargs as :func:`register_request`."""
        resp = await self._call(self._stub.RegisterPool,
                                register_request(pool_id, layer_specs, **kwargs), timeout)
        return pool_info_from(resp.config, resp.created)

    async def get_pool(self, pool_id: str, *, timeout: float | None = None) -> PoolInfo:
        resp = await self._call(self._stub.GetPool, pb.GetPoolRequest(pool_id=pool_id), timeout)
        return pool_info_from(resp.config)

    async def list_pools(self, *, timeout: float | None = None) -> list[PoolInfo]:
        resp = await self._call(self._stub.ListPools, pb.ListPoolsRequest(), timeout)
        return [pool_info_from(c) for c in resp.pools]

    async def delete_pool(self, pool_id: str, *, timeout: float | None = None) -> int:
        """Drops the pool; answers the number of requests it still had."""
        resp = await self._call(self._stub.DeletePool, pb.DeletePoolRequest(pool_id=pool_id),
                                timeout)
        return resp.num_requests_dropped

    async def step(self, pool_id: str, step_ops: Sequence[pb.Op], *, begin_step: bool = False,
                   timeout: float | None = None) -> StepResult:
        """Apply a batch of ops in order (all or nothing on invalid input)."""
        resp = await self._call(self._stub.Step, pb.StepRequest(
            pool_id=pool_id, begin_step=begin_step, ops=step_ops), timeout)
        return step_result(resp)

    async def step_batch(self, batch: StepBuilder, *,
                         timeout: float | None = None) -> StepResult:
        """Send a :class:`StepBuilder`'s batch."""
        return step_result(await self._call(self._stub.Step, batch.request, timeout))

    async def step_raw(self, request: pb.StepRequest, *,
                       timeout: float | None = None) -> pb.StepResponse:
        """Step with protocol messages (no conversion), for hot loops."""
        return await self._call(self._stub.Step, request, timeout)

    async def decode(self, pool_id: str, request_ids: Sequence[str],
                     token_ids: Sequence[int], *, begin_step: bool = False,
                     timeout: float | None = None) -> DecodeResult:
        """A Step of one decode op (see :meth:`ops.decode`): the cheapest decode step."""
        resp = await self._call(self._stub.Step, decode_request(
            pool_id, request_ids, token_ids, begin_step), timeout)
        return DecodeResult(resp.results[0].decode)

    def step_stream(self) -> "AsyncStepStream":
        """A bidirectional Step stream: ``async with client.step_stream() as s:
        r = await s.step(pool_id, ops)``."""
        return AsyncStepStream(self._stub.StepStream(metadata=self._metadata))

    async def peek_prefix(self, pool_ids: Sequence[str], token_ids: Sequence[int] = (), *,
                          block_hashes: Sequence[bytes] = (), cache_salt: str | None = None,
                          lora_name: str | None = None,
                          timeout: float | None = None,
                          lora_path: str | None = None) -> dict[str, int]:
        """Cached prefix length per pool (read-only)."""
        resp = await self._call(self._stub.PeekPrefix, peek_request(
            pool_ids, token_ids, block_hashes, cache_salt, lora_name, lora_path), timeout)
        return hits_from(resp)

    async def routing_view(self, pool_ids: Sequence[str], token_ids: Sequence[int] = (), *,
                           block_hashes: Sequence[bytes] = (), cache_salt: str | None = None,
                           lora_name: str | None = None, lora_path: str | None = None,
                           explain: bool = False,
                           timeout: float | None = None) -> pb.PeekPrefixResponse:
        """The whole PeekPrefixResponse: per-pool hit, per-group reach, miss reasons."""
        return await self._call(self._stub.PeekPrefix, peek_request(
            pool_ids, token_ids, block_hashes, cache_salt, lora_name, lora_path, explain),
            timeout)

    async def prefix_snapshot(self, pool_id: str, *,
                              timeout: float | None = None) -> pb.GetPrefixSnapshotResponse:
        """Cached block hashes per group and the event sequence they match."""
        return await self._call(self._stub.GetPrefixSnapshot,
                                pb.GetPrefixSnapshotRequest(pool_id=pool_id), timeout)

    async def get_request(self, pool_id: str, request_id: str, *,
                          timeout: float | None = None) -> RequestState:
        r = await self._call(self._stub.GetRequest, pb.GetRequestRequest(
            pool_id=pool_id, request_id=request_id), timeout)
        return request_state_from(r)

    async def stats(self, pool_id: str, *, timeout: float | None = None) -> PoolStats:
        r = await self._call(self._stub.GetPoolStats, pb.GetPoolStatsRequest(pool_id=pool_id),
                             timeout)
        return stats_from(r.stats)

    async def reset_prefix_cache(self, pool_id: str, *, timeout: float | None = None) -> bool:
        r = await self._call(self._stub.ResetPrefixCache,
                             pb.ResetPrefixCacheRequest(pool_id=pool_id), timeout)
        return r.reset

    async def subscribe_events(self, pool_id: str, from_sequence: int | None = None
                               ) -> AsyncIterator[Event]:
        """KV events of a pool (from ``from_sequence`` if given, else live only) until the
        pool is deleted or the server stops. No deadline; raises :class:`CacheError`."""
        req = pb.SubscribeEventsRequest(pool_id=pool_id)
        if from_sequence is not None:
            req.from_sequence = from_sequence
        call = self._stub.SubscribeEvents(req, metadata=self._metadata)
        try:
            async for batch in call:
                for e in batch.events:
                    yield event_from(e)
        except grpc.aio.AioRpcError as exc:
            raise CacheError.from_rpc(exc) from None
        finally:
            call.cancel()


class AsyncStepStream:
    """One open StepStream call: each :meth:`step` sends one request and awaits its answer."""

    def __init__(self, call: Any) -> None:
        self._call = call

    async def __aenter__(self) -> "AsyncStepStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def step(self, pool_id: str, step_ops: Sequence[pb.Op], *,
                   begin_step: bool = False) -> StepResult:
        try:
            await self._call.write(pb.StepRequest(pool_id=pool_id, begin_step=begin_step,
                                                  ops=step_ops))
            resp = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise CacheError.from_rpc(exc) from None
        if resp is grpc.aio.EOF:
            raise CacheError.from_rpc(await self._failed())
        return step_result(resp)

    async def _failed(self) -> Any:
        # The server ended the stream (an invalid batch): surface its status.
        code = await self._call.code()
        details = await self._call.details()
        trailing = await self._call.trailingauth_metadata()
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)

    async def close(self) -> None:
        try:
            await self._call.done_writing()
        except Exception:  # already finished
            pass
        self._call.cancel()
