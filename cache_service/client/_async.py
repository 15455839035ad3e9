"""The asyncio client (grpc.aio): :class:`AsyncCacheClient` and :class:`AsyncStepStream`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from cache_service.client._builders import (
    StepBuilder,
    decode_request,
    peek_request,
    register_request,
    subscribe_request,
)
from cache_service.client._channel import auth_metadata, channel_credentials, channel_options
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
from cache_service.client._retry import OnRetry, resend_delay
from cache_service.client._session import SessionStamp, keepalive_interval, session_lost
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.api.kvcache.v1 import cache_service_pb2_grpc as pb_grpc
from kvcache_common.backoff import Backoff


class AsyncCacheClient:
    """grpc.aio client. ``target`` is ``host:port``; ``token`` adds a bearer token;
    ``tls=True`` (or ``root_certificates``) uses TLS. Use as ``async with``. With
    ``session`` (the default) the first mutating call opens a session that a background
    task keeps alive; mutating calls of one client take turns (one sequence number at a
    time)."""

    def __init__(self, target: str, *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, default_timeout: float = 10.0,
                 max_retries: int = 4, backoff_base: float = 0.05, backoff_max: float = 1.0,
                 ssl_target_name_override: str | None = None, session: bool = True,
                 client_name: str = "") -> None:
        self._backoff = Backoff(backoff_base, backoff_max)
        options = channel_options(max_retries, self._backoff, ssl_target_name_override)
        creds = channel_credentials(tls, root_certificates)
        self._channel = (grpc.aio.secure_channel(target, creds, options=options) if creds
                         else grpc.aio.insecure_channel(target, options=options))
        self._stub = pb_grpc.CacheServiceStub(self._channel)
        self._metadata = auth_metadata(token)
        self.default_timeout = default_timeout
        self._retries = max_retries
        self._use_session = session
        self._client_name = client_name
        self._session: SessionStamp | None = None
        self._lock = asyncio.Lock()  # one mutating call at a time (sequence numbers)
        self._keepalive: asyncio.Task | None = None

    async def __aenter__(self) -> AsyncCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Ends the session (the server frees the requests it added and did not free)
        and closes the channel."""
        if self._keepalive is not None:
            self._keepalive.cancel()
        session, self._session = self._session, None
        if session is not None:
            # unreachable or already expired: the lease frees them anyway
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self._stub.CloseSession(pb.CloseSessionRequest(
                    session_id=session.session_id), timeout=2.0, metadata=self._metadata)
        await self._channel.close()

    @property
    def session_id(self) -> str | None:
        """The open session's id (None before the first mutating call, or without
        sessions)."""
        return self._session.session_id if self._session else None

    async def _call(self, method: Any, request: Any, timeout: float | None) -> Any:
        """One unary call (gRPC retries UNAVAILABLE, see ``_channel.py``)."""
        try:
            return await method(request, timeout=timeout or self.default_timeout,
                                metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise CacheError.from_rpc(exc) from None

    async def _ensure_session(self) -> SessionStamp | None:
        """The open session, opened on first use (call with the lock held)."""
        if self._session is None and self._use_session:
            resp = await self._call(self._stub.OpenSession,
                                    pb.OpenSessionRequest(client_name=self._client_name), None)
            self._session = SessionStamp(resp.session_id, resp.lease_ttl_seconds)
            if self._keepalive is not None:
                self._keepalive.cancel()
            self._keepalive = asyncio.create_task(self._keep_alive(self._session))
        return self._session

    async def _keep_alive(self, session: SessionStamp) -> None:
        interval = keepalive_interval(session.lease_ttl_seconds)
        request = pb.KeepAliveRequest(session_id=session.session_id)
        while self._session is session:
            await asyncio.sleep(interval)
            try:
                await self._stub.KeepAlive(request, timeout=interval, metadata=self._metadata)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    return  # expired: the next mutating call learns it and opens a new one

    async def _sequenced(self, send: Any, request: Any) -> Any:
        """Sends a mutating request stamped with the session (see ``_session``);
        ``await send(request)`` does the transport retries with the same stamp."""
        async with self._lock:
            session = await self._ensure_session()
            while True:
                if session is not None:
                    session.stamp(request)
                try:
                    response = await send(request)
                except CacheError as err:
                    if session is None:
                        raise
                    if session.failed(err):
                        continue
                    if session_lost(err):
                        self._session = None
                    raise
                if session is not None:
                    session.accepted()
                return response

    async def _mutate(self, method: Any, request: Any, timeout: float | None) -> Any:
        return await self._sequenced(lambda r: self._call(method, r, timeout), request)

    async def register_pool(self, pool_id: str, layer_specs: Sequence[pb.LayerSpec], *,
                            timeout: float | None = None, **kwargs: Any) -> PoolInfo:
        """Create (or re-open, if identical) a pool; kwargs as :func:`register_request`."""
        resp = await self._mutate(self._stub.RegisterPool,
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
        resp = await self._mutate(self._stub.DeletePool, pb.DeletePoolRequest(pool_id=pool_id),
                                timeout)
        return resp.num_requests_dropped

    async def step(self, pool_id: str, step_ops: Sequence[pb.Op], *, begin_step: bool = False,
                   timeout: float | None = None) -> StepResult:
        """Apply a batch of ops in order (all or nothing on invalid input)."""
        resp = await self._mutate(self._stub.Step, pb.StepRequest(
            pool_id=pool_id, begin_step=begin_step, ops=step_ops), timeout)
        return step_result(resp)

    async def step_batch(self, batch: StepBuilder, *,
                         timeout: float | None = None) -> StepResult:
        """Send a :class:`StepBuilder`'s batch."""
        return step_result(await self._mutate(self._stub.Step, batch.request, timeout))

    async def step_raw(self, request: pb.StepRequest, *,
                       timeout: float | None = None) -> pb.StepResponse:
        """Step with protocol messages (no conversion), for hot loops."""
        return await self._mutate(self._stub.Step, request, timeout)

    async def decode(self, pool_id: str, request_ids: Sequence[str],
                     token_ids: Sequence[int], *, begin_step: bool = False,
                     timeout: float | None = None) -> DecodeResult:
        """A Step of one decode op (see :meth:`ops.decode`): the cheapest decode step."""
        resp = await self._mutate(self._stub.Step, decode_request(
            pool_id, request_ids, token_ids, begin_step), timeout)
        return DecodeResult(resp.results[0].decode)

    def step_stream(self, *, step_timeout: float | None = None,
                    on_retry: OnRetry | None = None) -> AsyncStepStream:
        """A bidirectional Step stream: ``async with client.step_stream() as s:
        r = await s.step(pool_id, ops)``; ``step_timeout`` (default ``default_timeout``)
        is each step's deadline (see :class:`AsyncStepStream`)."""
        return AsyncStepStream(self, step_timeout or self.default_timeout, on_retry)

    async def peek_prefix(self, pool_ids: Sequence[str], token_ids: Sequence[int] = (), *,
                          block_hashes: Sequence[bytes] = (), cache_salt: str | None = None,
                          lora_name: str | None = None,
                          timeout: float | None = None,
                          lora_path: str | None = None) -> dict[str, int]:
        """Cached prefix length per pool (read-only)."""
        resp = await self._call(self._stub.PeekPrefix, peek_request(
            pool_ids, token_ids, block_hashes, cache_salt, lora_name, lora_path), timeout)
        return hits_from(resp)

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
        r = await self._mutate(self._stub.ResetPrefixCache,
                             pb.ResetPrefixCacheRequest(pool_id=pool_id), timeout)
        return r.reset

    async def subscribe_events(self, pool_id: str, from_sequence: int | None = None,
                               incarnation: int | None = None,
                               ) -> AsyncIterator[Event]:
        """KV events of a pool (from ``from_sequence`` if given, else live only) until the
        pool is deleted or the server stops. ``incarnation`` (when resuming): fail with
        FAILED_PRECONDITION instead of resuming another incarnation's sequence. No
        deadline; raises :class:`CacheError`."""
        call = self._stub.SubscribeEvents(subscribe_request(pool_id, from_sequence, incarnation),
                                          metadata=self._metadata)
        try:
            async for batch in call:
                for e in batch.events:
                    yield event_from(e)
        except grpc.aio.AioRpcError as exc:
            raise CacheError.from_rpc(exc) from None
        finally:
            call.cancel()


class AsyncStepStream:
    """One StepStream: each :meth:`step` sends one request and awaits its answer, within
    ``step_timeout``. When the deadline passes or the stream breaks (UNAVAILABLE), the
    stream is dropped, a new one opened and the same request resent under the same
    sequence number (applied once), up to the client's ``max_retries`` times;
    ``on_retry(reason, attempt)`` is called before each resend. An error status from the
    server (an invalid batch) ends the stream; the next step opens a new one."""

    def __init__(self, client: AsyncCacheClient, step_timeout: float,
                 on_retry: OnRetry | None = None) -> None:
        self._client = client
        self.step_timeout = step_timeout
        self._on_retry = on_retry
        self._call: Any = None

    async def __aenter__(self) -> AsyncStepStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _exchange(self, request: pb.StepRequest) -> pb.StepResponse:
        attempt = 0
        while True:
            if self._call is None:
                self._call = self._client._stub.StepStream(metadata=self._client._metadata)
            call = self._call
            try:
                await asyncio.wait_for(call.write(request), self.step_timeout)
                resp = await asyncio.wait_for(call.read(), self.step_timeout)
                if resp is not grpc.aio.EOF:
                    return resp
                err = CacheError.from_rpc(await self._failed(call))
            except TimeoutError:
                err = CacheError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                 f"no StepStream answer within {self.step_timeout} s")
            except grpc.aio.AioRpcError as exc:
                err = CacheError.from_rpc(exc)
            except asyncio.InvalidStateError:  # written after the call ended
                err = CacheError(grpc.StatusCode.UNAVAILABLE, "StepStream ended")
            await self.close()
            await asyncio.sleep(resend_delay(err, attempt, self._client._retries,
                                             self._client._backoff, self._on_retry))
            attempt += 1

    async def step_raw(self, request: pb.StepRequest) -> pb.StepResponse:
        """Step with protocol messages (stamped with the client's session here)."""
        return await self._client._sequenced(self._exchange, request)

    async def step(self, pool_id: str, step_ops: Sequence[pb.Op], *,
                   begin_step: bool = False) -> StepResult:
        return step_result(await self.step_raw(pb.StepRequest(
            pool_id=pool_id, begin_step=begin_step, ops=step_ops)))

    @staticmethod
    async def _failed(call: Any) -> Any:
        # The server ended the stream (an invalid batch): surface its status.
        code = await call.code()
        details = await call.details()
        trailing = await call.trailing_metadata()
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)

    async def close(self) -> None:
        call, self._call = self._call, None
        if call is None:
            return
        with contextlib.suppress(Exception):  # already finished
            await call.done_writing()
        call.cancel()
