"""The asyncio client (grpc.aio): :class:`AsyncCacheClient` and :class:`AsyncStepStream`."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
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
from cache_service.client._routing import (
    MAX_REDIRECTS,
    CallRoute,
    Deadline,
    Moved,
    Routes,
    reroute,
)
from cache_service.client._session import (
    Carrier,
    SequencedCall,
    SessionStamp,
    keepalive_interval,
)
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.api.kvcache.v1 import cache_service_pb2_grpc as pb_grpc
from kvcache_common.backoff import Backoff


class AsyncCacheClient:
    """grpc.aio client. ``target`` is ``host:port`` (cluster mode: several, comma-separated;
    calls on a pool follow the replicas' redirects to its owner, with one session per
    replica); ``token`` adds a bearer token;
    ``tls=True`` (or ``root_certificates``) uses TLS. Use as ``async with``. With
    ``session`` (the default) the first mutating call opens a session that a background
    task keeps alive; mutating calls of one client take turns (one sequence number at a
    time)."""

    def __init__(self, target: str, *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, default_timeout: float = 10.0,
                 max_retries: int = 4, backoff_base: float = 0.05, backoff_max: float = 1.0,
                 ssl_target_name_override: str | None = None, session: bool = True,
                 client_name: str = "", attempt_timeout: float = 2.0) -> None:
        self._backoff = Backoff(backoff_base, backoff_max)
        options = channel_options(max_retries, self._backoff, ssl_target_name_override)
        creds = channel_credentials(tls, root_certificates)
        self._channels: list[grpc.aio.Channel] = []

        def open_stub(address: str) -> pb_grpc.CacheServiceStub:
            channel = (grpc.aio.secure_channel(address, creds, options=options) if creds
                       else grpc.aio.insecure_channel(address, options=options))
            self._channels.append(channel)
            return pb_grpc.CacheServiceStub(channel)

        #: Replicas and learned pool owners (cluster mode: several, comma-separated).
        self._routes = Routes(target, open_stub)
        self._stub = self._routes.stub(self._routes.seeds[0])
        self._metadata = auth_metadata(token)
        self.default_timeout = default_timeout
        #: The first attempt's deadline of a call that is safe to resend (doubled on each
        #: resend; see :class:`CallRoute`): a hung replica costs a call about this long.
        self.attempt_timeout = attempt_timeout
        self._retries = max_retries
        self._use_session = session
        self._client_name = client_name
        #: One session per replica (sessions live in a replica's state), by address.
        self._sessions: dict[str, SessionStamp] = {}
        self._carrier = Carrier()  # sessions carried over a failover
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
        sessions = list(self._sessions.items()) + [
            (address, session) for (address, _), session in self._carrier.adopted.items()]
        self._sessions, self._carrier.adopted = {}, {}
        for address, session in sessions:
            # unreachable or already expired: the lease frees them anyway
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self._routes.stub(address).CloseSession(pb.CloseSessionRequest(
                    session_id=session.session_id), timeout=2.0, metadata=self._metadata)
        for channel in self._channels:
            await channel.close()

    @property
    def session_id(self) -> str | None:
        """The id of the session open on the first seed replica (None before the first
        mutating call, or without sessions)."""
        session = self._sessions.get(self._routes.address())
        return session.session_id if session else None

    async def _call(self, method: str, request: Any, timeout: float | None,
                    pin: str | None = None, *, resend: bool = True) -> Any:
        """``method`` on the pool's replica, following redirects and moving past a replica
        that stays unavailable until the call's timeout (see :class:`CallRoute`); ``pin``:
        on that replica only (a call stamped with its session), raising :class:`Moved`
        when it must go elsewhere; ``resend``: safe to send again (a read, or stamped with
        a session), so each attempt has its own deadline and a lost answer is resent."""
        route = CallRoute(self._routes, getattr(request, "pool_id", ""),
                          timeout or self.default_timeout, self._backoff, pin,
                          resend=resend and self._retries > 0,
                          attempt_timeout=self.attempt_timeout)
        while True:
            address = route.address
            try:
                return await getattr(self._routes.stub(address), method)(
                    request, timeout=route.timeout(), metadata=self._metadata)
            except grpc.aio.AioRpcError as exc:
                error, trailers = CacheError.from_rpc(exc), exc.trailing_metadata()
            if error.code == grpc.StatusCode.UNAVAILABLE or (
                    error.code == grpc.StatusCode.CANCELLED and route.resend):
                # (CANCELLED: a server that stopped with the call in flight; this client
                # never cancels a unary call itself)
                delay = route.unavailable(address, error, trailers)
            elif error.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                delay = route.expired(address, error)
            else:
                raise error
            await asyncio.sleep(delay)

    async def _ensure_session(self, address: str) -> SessionStamp | None:
        """The session open on ``address``, opened on first use (call with the lock
        held)."""
        session = self._sessions.get(address)
        if session is None and self._use_session:
            # A proposed id makes OpenSession safe to resend (see the blocking client).
            resp = await self._call("OpenSession", pb.OpenSessionRequest(
                client_name=self._client_name, session_id=secrets.token_hex(16)), None,
                pin=address)
            session = self._sessions[address] = SessionStamp(resp.session_id,
                                                             resp.lease_ttl_seconds)
            self._start_keepalive(session, address)
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
        interval = keepalive_interval(session.lease_ttl_seconds)
        request = pb.KeepAliveRequest(session_id=session.session_id)
        stub = self._routes.stub(address)
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
        """Sends a mutating request stamped with the session of the replica it goes to;
        ``await send(request, address)`` does the transport retries with the same stamp and
        raises :class:`Moved` when the request must go to another replica: it is restamped
        there, after a backoff unless redirected, until ``timeout`` (default
        ``default_timeout``) has passed (see :class:`CallRoute`)."""
        route = CallRoute(self._routes, getattr(request, "pool_id", ""),
                          timeout or self.default_timeout, self._backoff)
        call = SequencedCall(self._sessions, self._carrier, route.pool_id)
        async with self._lock:
            while True:
                address = route.address
                session = None
                try:
                    session = call.carried_stamp(address)
                    if session is None:
                        session = await self._ensure_session(address)
                    if session is not None:
                        session.stamp(request)
                    response = await send(request, address)
                except Moved as moved:
                    call.moved(address, session, moved)
                    await asyncio.sleep(route.moved(moved))
                    continue
                except CacheError as err:
                    if call.failed(address, session, err):
                        continue
                    raise
                for stamp in call.accepted(address, session) if session is not None else ():
                    self._start_keepalive(stamp, address, now=stamp is not session)
                return response

    async def _mutate(self, method: str, request: Any, timeout: float | None) -> Any:
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
        resp = await self._call("GetPool", pb.GetPoolRequest(pool_id=pool_id), timeout)
        return pool_info_from(resp.config)

    async def list_pools(self, *, timeout: float | None = None) -> list[PoolInfo]:
        resp = await self._call("ListPools", pb.ListPoolsRequest(), timeout)
        return [pool_info_from(c) for c in resp.pools]

    async def delete_pool(self, pool_id: str, *, timeout: float | None = None) -> int:
        """Drops the pool; answers the number of requests it still had."""
        resp = await self._mutate("DeletePool", pb.DeletePoolRequest(pool_id=pool_id),
                                timeout)
        return resp.num_requests_dropped

    async def step(self, pool_id: str, step_ops: Sequence[pb.Op], *, begin_step: bool = False,
                   timeout: float | None = None) -> StepResult:
        """Apply a batch of ops in order (all or nothing on invalid input)."""
        resp = await self._mutate("Step", pb.StepRequest(
            pool_id=pool_id, begin_step=begin_step, ops=step_ops), timeout)
        return step_result(resp)

    async def step_batch(self, batch: StepBuilder, *,
                         timeout: float | None = None) -> StepResult:
        """Send a :class:`StepBuilder`'s batch."""
        return step_result(await self._mutate("Step", batch.request, timeout))

    async def step_raw(self, request: pb.StepRequest, *,
                       timeout: float | None = None) -> pb.StepResponse:
        """Step with protocol messages (no conversion), for hot loops."""
        return await self._mutate("Step", request, timeout)

    async def decode(self, pool_id: str, request_ids: Sequence[str],
                     token_ids: Sequence[int], *, begin_step: bool = False,
                     timeout: float | None = None) -> DecodeResult:
        """A Step of one decode op (see :meth:`ops.decode`): the cheapest decode step."""
        resp = await self._mutate("Step", decode_request(
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
        resp = await self._call("PeekPrefix", peek_request(
            pool_ids, token_ids, block_hashes, cache_salt, lora_name, lora_path), timeout)
        return hits_from(resp)

    async def routing_view(self, pool_ids: Sequence[str], token_ids: Sequence[int] = (), *,
                           block_hashes: Sequence[bytes] = (), cache_salt: str | None = None,
                           lora_name: str | None = None, lora_path: str | None = None,
                           explain: bool = False,
                           timeout: float | None = None) -> pb.PeekPrefixResponse:
        """The whole PeekPrefixResponse: per-pool hit, per-group reach, miss reasons."""
        return await self._call("PeekPrefix", peek_request(
            pool_ids, token_ids, block_hashes, cache_salt, lora_name, lora_path, explain),
            timeout)

    async def prefix_snapshot(self, pool_id: str, *,
                              timeout: float | None = None) -> pb.GetPrefixSnapshotResponse:
        """Cached block hashes per group and the event sequence they match."""
        return await self._call("GetPrefixSnapshot",
                                pb.GetPrefixSnapshotRequest(pool_id=pool_id), timeout)

    async def get_request(self, pool_id: str, request_id: str, *,
                          timeout: float | None = None) -> RequestState:
        r = await self._call("GetRequest", pb.GetRequestRequest(
            pool_id=pool_id, request_id=request_id), timeout)
        return request_state_from(r)

    async def stats(self, pool_id: str, *, timeout: float | None = None) -> PoolStats:
        r = await self._call("GetPoolStats", pb.GetPoolStatsRequest(pool_id=pool_id),
                             timeout)
        return stats_from(r.stats)

    async def reset_prefix_cache(self, pool_id: str, *, timeout: float | None = None) -> bool:
        r = await self._mutate("ResetPrefixCache",
                             pb.ResetPrefixCacheRequest(pool_id=pool_id), timeout)
        return r.reset

    async def subscribe_events(self, pool_id: str, from_sequence: int | None = None,
                               incarnation: int | None = None,
                               ) -> AsyncIterator[Event]:
        """KV events of a pool (from ``from_sequence`` if given, else live only) until the
        pool is deleted or the server stops. ``incarnation`` (when resuming): fail with
        FAILED_PRECONDITION instead of resuming another incarnation's sequence. No
        deadline; raises :class:`CacheError`."""
        req = subscribe_request(pool_id, from_sequence, incarnation)
        for _ in range(MAX_REDIRECTS + 1):
            address = self._routes.address(pool_id)
            call = self._routes.stub(address).SubscribeEvents(req, metadata=self._metadata)
            delivered = False
            try:
                async for batch in call:
                    delivered = True
                    for e in batch.events:
                        yield event_from(e)
                return
            except grpc.aio.AioRpcError as exc:
                if (delivered or exc.code() != grpc.StatusCode.UNAVAILABLE
                        or not self._routes.follow(pool_id, exc.trailing_metadata())):
                    raise CacheError.from_rpc(exc) from None
            finally:
                call.cancel()


class AsyncStepStream:
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
        self._client = client
        self.step_timeout = step_timeout
        self._on_retry = on_retry
        self._call: Any = None
        self._address = ""

    async def __aenter__(self) -> AsyncStepStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _exchange(self, request: pb.StepRequest, address: str) -> pb.StepResponse:
        """One request and its answer from ``address``, with the deadline and the
        resends; raises :class:`Moved` when it must go to another replica."""
        attempt = 0
        while True:
            if self._call is not None and self._address != address:
                await self.close()
            if self._call is None:
                self._call = self._client._routes.stub(address).StepStream(
                    metadata=self._client._metadata)
                self._address = address
            call = self._call
            raw = None
            try:
                await asyncio.wait_for(call.write(request), self.step_timeout)
                resp = await asyncio.wait_for(call.read(), self.step_timeout)
                if resp is not grpc.aio.EOF:
                    return resp
                raw = await self._failed(call)
                err = CacheError.from_rpc(raw)
            except TimeoutError:
                err = CacheError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                 f"no StepStream answer within {self.step_timeout} s")
            except grpc.aio.AioRpcError as exc:
                raw, err = exc, CacheError.from_rpc(exc)
            except asyncio.InvalidStateError:  # written after the call ended
                err = CacheError(grpc.StatusCode.UNAVAILABLE, "StepStream ended")
            await self.close()
            if raw is not None and err.code == grpc.StatusCode.UNAVAILABLE:
                moved = reroute(self._client._routes, request.pool_id, address,
                                raw.trailing_metadata())
                if moved is not None:
                    raise Moved(err, moved)
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
