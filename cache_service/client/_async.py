"""The asyncio client (grpc.aio): :class:`AsyncCacheClient` and :class:`AsyncStepStream`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from cache_service.client._base import ClientBase, StepStreamBase
from cache_service.client._builders import (
    StepBuilder,
    decode_request,
    peek_request,
    register_request,
    subscribe_request,
)
from cache_service.client._errors import CacheError
from cache_service.client._results import (
    DecodeResult,
    Event,
    PinInfo,
    PoolInfo,
    PoolStats,
    RequestState,
    StepResult,
    event_from,
    hits_from,
    pin_from,
    pool_info_from,
    request_state_from,
    stats_from,
    step_result,
)
from cache_service.client._retry import NoAnswer, OnRetry
from cache_service.client._routing import MAX_REDIRECTS, Deadline, Moved
from cache_service.client._session import SessionStamp
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb


class AsyncCacheClient(ClientBase):
    """grpc.aio client (see :class:`ClientBase` for the arguments). Use as ``async
    with``. With ``session`` (the default) the first mutating call opens a session that a
    background task keeps alive; mutating calls of one client take turns (one sequence
    number at a time)."""

    _grpc = grpc.aio

    def _init_transport(self) -> None:
        self._lock = asyncio.Lock()  # one mutating call at a time (sequence numbers)
        self._keepalives: dict[str, asyncio.Task] = {}

    async def __aenter__(self) -> AsyncCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Ends the session (the server frees the requests it added and did not free)
        and closes the channel."""
        for task in self._keepalives.values():
            task.cancel()
        for address, session in self._take_sessions():
            # unreachable or already expired: the lease frees them anyway
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self._routes.stub(address).CloseSession(pb.CloseSessionRequest(
                    session_id=session.session_id), timeout=2.0, metadata=self._metadata)
        for channel in self._channels.values():
            await channel.close()

    async def wait_connected(self, timeout: float, address: str | None = None) -> None:
        """Returns once the channel to ``address`` (default: the first seed) is connected;
        raises :class:`CacheError` (DEADLINE_EXCEEDED) if it is not within ``timeout``."""
        try:
            await asyncio.wait_for(self._channel(address).channel_ready(), timeout)
        except TimeoutError:
            raise CacheError(grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"not connected within {timeout} s") from None

    async def _call(self, method: str, request: Any, timeout: float | None,
                    pin: str | None = None, *, resend: bool = True) -> Any:
        """As the blocking client's ``_call`` (see :meth:`ClientBase._unary_delay`)."""
        route = self._route(request, timeout, pin, resend)
        while True:
            address = route.address
            try:
                return await getattr(self._routes.stub(address), method)(
                    request, timeout=route.timeout(), metadata=self._metadata)
            except grpc.aio.AioRpcError as exc:
                delay = self._unary_delay(route, address, exc)
            await asyncio.sleep(delay)

    async def _ensure_session(self, address: str) -> SessionStamp | None:
        """The session open on ``address``, opened on first use (call with the lock
        held)."""
        session = self._sessions.get(address)
        if session is None and self._use_session:
            session = self._session_opened(address, await self._call(
                "OpenSession", self._open_session_request(), None, pin=address))
        return session

    def _start_keepalive(self, session: SessionStamp, address: str, *,
                         now: bool = False) -> None:
        """Keeps ``session`` alive at ``address``; ``now``: the first KeepAlive at once."""
        key = address if self._sessions.get(address) is session else (
            f"{address}/{session.session_id}")
        old = self._keepalives.get(key)
        if old is not None:
            old.cancel()
        self._keepalives[key] = asyncio.create_task(self._keep_alive(session, address, now))

    async def _keep_alive(self, session: SessionStamp, address: str, now: bool) -> None:
        """The keep-alive task's loop: until it is cancelled (close) or the session is no
        longer the client's there (expired, replaced)."""
        interval, request, stub = self._keepalive_plan(session, address)
        wait = 0.0 if now else interval
        while self._carrier.alive(address, session, self._sessions):
            await asyncio.sleep(wait)
            wait = interval
            try:
                await stub.KeepAlive(request, timeout=interval, metadata=self._metadata)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    return  # expired: the next mutating call learns it and opens a new one

    async def _sequenced(self, send: Any, request: Any, timeout: float | None = None) -> Any:
        """As the blocking client's ``_sequenced``, with ``await send(request, address)``."""
        route, call = self._sequenced_call(request, timeout)
        async with self._lock:
            while True:
                address = route.address
                session = None
                try:
                    session = call.carried_stamp(address) or await self._ensure_session(address)
                    if session is not None:
                        session.stamp(request)
                    response = await send(request, address)
                except (Moved, CacheError) as exc:
                    await asyncio.sleep(self._unsent_delay(route, call, address, session, exc))
                    continue
                self._accepted(call, address, session)
                return response

    async def _mutate(self, method: str, request: Any, timeout: float | None) -> Any:
        """A mutating unary call, stamped (and restamped per replica) with the session."""
        deadline = Deadline(timeout or self.default_timeout)
        return await self._sequenced(lambda r, a: self._call(
            method, r, deadline.left(), pin=a, resend=bool(r.session_id)), request, timeout)

    async def register_pool(self, pool_id: str, layer_specs: Sequence[pb.LayerSpec], *,
                            timeout: float | None = None, **kwargs: Any) -> PoolInfo:
        """Create (or re-open, if identical) a pool; kwargs as :func:`register_request`."""
        resp = await self._mutate("RegisterPool",
                                  register_request(pool_id, layer_specs, **kwargs), timeout)
        return pool_info_from(resp.config, resp.created)

    async def get_pool(self, pool_id: str, *, timeout: float | None = None) -> PoolInfo:
        """The pool's configuration and groups (NOT_FOUND if it is not registered)."""
        resp = await self._call("GetPool", pb.GetPoolRequest(pool_id=pool_id), timeout)
        return pool_info_from(resp.config)

    async def list_pools(self, *, timeout: float | None = None) -> list[PoolInfo]:
        """Every pool of the replica the call goes to (the first seed)."""
        resp = await self._call("ListPools", pb.ListPoolsRequest(), timeout)
        return [pool_info_from(c) for c in resp.pools]

    async def list_sessions(self, *, timeout: float | None = None) -> pb.ListSessionsResponse:
        """The sessions open on the replica the call goes to (the first seed), with the
        requests each owns: the whole ListSessionsResponse."""
        return await self._call("ListSessions", pb.ListSessionsRequest(), timeout)

    async def delete_pool(self, pool_id: str, *, timeout: float | None = None) -> int:
        """Drops the pool; answers the number of requests it still had."""
        resp = await self._mutate("DeletePool", pb.DeletePoolRequest(pool_id=pool_id), timeout)
        return resp.num_requests_dropped

    async def step(self, pool_id: str, step_ops: Sequence[pb.Op], *, begin_step: bool = False,
                   timeout: float | None = None) -> StepResult:
        """Apply a batch of ops in order (all or nothing on invalid input)."""
        resp = await self._mutate("Step", pb.StepRequest(
            pool_id=pool_id, begin_step=begin_step, ops=step_ops), timeout)
        return step_result(resp)

    async def step_batch(self, batch: StepBuilder, *, timeout: float | None = None) -> StepResult:
        """Send a :class:`StepBuilder`'s batch."""
        return step_result(await self._mutate("Step", batch.request, timeout))

    async def step_raw(self, request: pb.StepRequest, *,
                       timeout: float | None = None) -> pb.StepResponse:
        """Step with protocol messages (no conversion), for hot loops."""
        return await self._mutate("Step", request, timeout)

    async def decode(self, pool_id: str, request_ids: Sequence[str], token_ids: Sequence[int], *,
                     begin_step: bool = False, timeout: float | None = None) -> DecodeResult:
        """A Step of one decode op (see :meth:`ops.decode`): the cheapest decode step."""
        resp = await self._mutate("Step", decode_request(
            pool_id, request_ids, token_ids, begin_step), timeout)
        return DecodeResult(resp.results[0].decode, resp)

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
                          lora_path: str | None = None,
                          include_host: bool = False,
                          mm_items: Sequence[tuple[str, int, int]] = (),
                          prompt_embeds_digests: Sequence[bytes] = ()) -> dict[str, int]:
        """Cached prefix length in tokens per pool (read-only); ``include_host``: the hit
        across the device and the host tier (``PoolHit.host_hit_tokens``); ``mm_items``
        and ``prompt_embeds_digests`` as on :meth:`StepBuilder.add`."""
        resp = await self._call("PeekPrefix", peek_request(
            pool_ids, token_ids, block_hashes, cache_salt, lora_name, lora_path,
            mm_items=mm_items, prompt_embeds_digests=prompt_embeds_digests), timeout)
        return hits_from(resp, include_host)

    async def routing_view(self, pool_ids: Sequence[str], token_ids: Sequence[int] = (), *,
                           block_hashes: Sequence[bytes] = (), cache_salt: str | None = None,
                           lora_name: str | None = None, lora_path: str | None = None,
                           explain: bool = False,
                           timeout: float | None = None) -> pb.PeekPrefixResponse:
        """:meth:`peek_prefix` with every pool's per-group reach (and, with ``explain``,
        miss reasons): the whole PeekPrefixResponse."""
        return await self._call("PeekPrefix", peek_request(
            pool_ids, token_ids, block_hashes, cache_salt, lora_name, lora_path, explain),
            timeout)

    async def prefix_snapshot(self, pool_id: str, *,
                              timeout: float | None = None) -> pb.GetPrefixSnapshotResponse:
        """The pool's cached block hashes per group and the event sequence they match:
        resume :meth:`subscribe_events` at ``sequence + 1``."""
        return await self._call("GetPrefixSnapshot",
                                pb.GetPrefixSnapshotRequest(pool_id=pool_id), timeout)

    async def get_request(self, pool_id: str, request_id: str, *,
                          timeout: float | None = None) -> RequestState:
        """One request's tokens, block table and state (NOT_FOUND if unknown)."""
        resp = await self._call("GetRequest", pb.GetRequestRequest(
            pool_id=pool_id, request_id=request_id), timeout)
        return request_state_from(resp)

    async def stats(self, pool_id: str, *, timeout: float | None = None) -> PoolStats:
        """The pool's usage and prefix-cache counters."""
        resp = await self._call("GetPoolStats", pb.GetPoolStatsRequest(pool_id=pool_id), timeout)
        return stats_from(resp.stats)

    async def pin_prefix(self, pool_id: str, pin_id: str, token_ids: Sequence[int] = (), *,
                       ttl_seconds: float, block_hashes: Sequence[bytes] = (),
                       session_id: str = "", outlive_session: bool = False,
                       cache_salt: str | None = None, lora_name: str | None = None,
                       lora_path: str | None = None,
                       mm_items: Sequence[tuple[str, int, int]] = (),
                       prompt_embeds_digests: Sequence[bytes] = (),
                       timeout: float | None = None) -> PinInfo:
        """Pins the prefix of ``token_ids`` (or ``block_hashes``) in the pool for
        ``ttl_seconds`` (docs/protocol.md, "Prefix pins"). ``session_id`` (for example
        :attr:`session_id`) owns it: the pin is charged to its tenant's quota and dropped
        when the session ends unless ``outlive_session``. Not resent after a lost answer
        (a resend would meet the pin it took: ALREADY_EXISTS)."""
        resp = await self._call("PinPrefix", self._pin_request(
            pool_id, pin_id, token_ids, block_hashes, ttl_seconds, session_id,
            outlive_session, cache_salt, lora_name, lora_path, mm_items,
            prompt_embeds_digests), timeout, resend=False)
        return pin_from(resp.pin)

    async def renew_pin(self, pool_id: str, pin_id: str, *, ttl_seconds: float,
                      timeout: float | None = None) -> PinInfo:
        """Sets the pin's expiry to ``ttl_seconds`` from now (safe to resend)."""
        resp = await self._call("RenewPin", pb.RenewPinRequest(
            pool_id=pool_id, pin_id=pin_id, ttl_seconds=ttl_seconds), timeout)
        return pin_from(resp.pin)

    async def drop_pin(self, pool_id: str, pin_id: str, *,
                     timeout: float | None = None) -> PinInfo:
        """Drops the pin; answers it as it was (NOT_FOUND if dropped or expired)."""
        resp = await self._call("DropPin", pb.DropPinRequest(pool_id=pool_id, pin_id=pin_id),
                             timeout, resend=False)
        return pin_from(resp.pin)

    async def reset_prefix_cache(self, pool_id: str, *, block_ids: Sequence[int] = (),
                                 timeout: float | None = None) -> bool:
        """Drops every cached block of the pool; False (nothing changed) while any
        block is in use by a request. With ``block_ids``: drops only those device blocks'
        cache entries (garbage data, e.g. a failed host-tier promotion), in use or not."""
        resp = await self._mutate("ResetPrefixCache",
                                  pb.ResetPrefixCacheRequest(pool_id=pool_id,
                                                             block_ids=block_ids), timeout)
        return resp.reset

    async def subscribe_events(self, pool_id: str, from_sequence: int | None = None,
                               incarnation: int | None = None,
                               ) -> AsyncIterator[Event]:
        """An async iterator of the pool's KV events, as the blocking client's
        :meth:`CacheClient.subscribe_events` (resumed at ``from_sequence`` of
        ``incarnation``, else live only; no deadline; a redirect before the first event is
        followed)."""
        req = subscribe_request(pool_id, from_sequence, incarnation)
        for _ in range(MAX_REDIRECTS + 1):
            call = self._routes.stub(self._routes.address(pool_id)).SubscribeEvents(
                req, metadata=self._metadata)
            delivered = False
            try:
                async for batch in call:
                    delivered = True
                    for e in batch.events:
                        yield event_from(e)
                return
            except grpc.aio.AioRpcError as exc:
                self._subscribe_failed(pool_id, exc, delivered)
            finally:
                call.cancel()


class AsyncStepStream(StepStreamBase):
    """One StepStream: each :meth:`step` sends one request and awaits its answer, within
    ``step_timeout``. When the deadline passes or the stream breaks (UNAVAILABLE), the
    stream is dropped, a new one opened and the same request resent under the same
    sequence number (applied once), up to the client's ``max_retries`` times;
    ``on_retry(reason, attempt)`` is called before each resend. An error status from the
    server (an invalid batch) ends the stream; the next step opens a new one. The stream
    goes to the replica of the step's pool: a redirect, or that replica giving up, reopens
    it on another one (the request restamped for its session)."""

    def __init__(self, client: AsyncCacheClient, step_timeout: float,
                 on_retry: OnRetry | None = None) -> None:
        super().__init__(client, step_timeout, on_retry)

    async def __aenter__(self) -> AsyncStepStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _open(self, address: str) -> None:
        """Opens the stream to ``address``."""
        self._call = self._client._routes.stub(address).StepStream(
            metadata=self._client._metadata)
        self._address = address

    async def _attempt(self, request: pb.StepRequest) -> Any:
        """Sends ``request`` on the open stream: its answer, or why none came (a status
        that ended the stream, or a :class:`NoAnswer`)."""
        call = self._call
        try:
            await asyncio.wait_for(call.write(request), self.step_timeout)
            resp = await asyncio.wait_for(call.read(), self.step_timeout)
            if resp is not grpc.aio.EOF:
                return resp
            # The server ended the stream (an invalid batch): its status.
            code = await call.code()
            if code == grpc.StatusCode.OK:
                return NoAnswer.ENDED
            return grpc.aio.AioRpcError(code, grpc.aio.Metadata(),
                                        await call.trailing_metadata(), await call.details())
        except TimeoutError:
            return NoAnswer.TIMED_OUT
        except grpc.aio.AioRpcError as exc:
            return exc
        except asyncio.InvalidStateError:  # written after the call ended
            return NoAnswer.ENDED

    async def _exchange(self, request: pb.StepRequest, address: str) -> pb.StepResponse:
        """One request and its answer from ``address``, with the deadline and the
        resends; raises :class:`Moved` when it must go to another replica."""
        resends = self._resends(request.pool_id)
        while True:
            if self._call is not None and self._address != address:
                await self.close()
            if self._call is None:
                self._open(address)
            outcome = await self._attempt(request)
            if isinstance(outcome, pb.StepResponse):
                return outcome
            await self.close()
            await asyncio.sleep(resends.after(outcome, address))

    async def step_raw(self, request: pb.StepRequest) -> pb.StepResponse:
        """Step with protocol messages (stamped with the client's session here)."""
        return await self._client._sequenced(self._exchange, request)

    async def step(self, pool_id: str, step_ops: Sequence[pb.Op], *,
                   begin_step: bool = False) -> StepResult:
        """One Step on the stream: its ops in order, all or nothing on invalid input."""
        return step_result(await self.step_raw(self._request(pool_id, step_ops, begin_step)))

    async def close(self) -> None:
        """Drops the open stream, if any (the next step opens a new one)."""
        call, self._call = self._call, None
        if call is None:
            return
        with contextlib.suppress(Exception):  # already finished
            await call.done_writing()
        call.cancel()
