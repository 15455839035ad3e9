"""The blocking client: :class:`CacheClient` and :class:`StepStream`, the same API as the
async twin without ``await``."""

from __future__ import annotations

import contextlib
import queue
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
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


class CacheClient:
    """The blocking twin of :class:`AsyncCacheClient` (same methods, no ``await``).
    Thread-safe: mutating calls of one client take turns (one sequence number at a time)."""

    def __init__(self, target: str, *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, default_timeout: float = 10.0,
                 max_retries: int = 4, backoff_base: float = 0.05, backoff_max: float = 1.0,
                 ssl_target_name_override: str | None = None, session: bool = True,
                 client_name: str = "", attempt_timeout: float = 2.0) -> None:
        self._backoff = Backoff(backoff_base, backoff_max)
        options = channel_options(max_retries, self._backoff, ssl_target_name_override)
        creds = channel_credentials(tls, root_certificates)
        self._channels: list[grpc.Channel] = []

        def open_stub(address: str) -> pb_grpc.CacheServiceStub:
            channel = (grpc.secure_channel(address, creds, options=options) if creds
                       else grpc.insecure_channel(address, options=options))
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
        self._lock = threading.RLock()  # one mutating call at a time (sequence numbers)
        self._keepalive_stop = threading.Event()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Ends the session (the server frees the requests it added and did not free)
        and closes the channel."""
        self._keepalive_stop.set()
        with self._lock:
            sessions = list(self._sessions.items()) + [
                (address, session) for (address, _), session in self._carrier.adopted.items()]
            self._sessions, self._carrier.adopted = {}, {}
            for address, session in sessions:
                # unreachable or already expired: the lease frees them anyway
                with contextlib.suppress(grpc.RpcError):
                    self._routes.stub(address).CloseSession(pb.CloseSessionRequest(
                        session_id=session.session_id), timeout=2.0, metadata=self._metadata)
        for channel in self._channels:
            channel.close()

    @property
    def session_id(self) -> str | None:
        """The id of the session open on the first seed replica (None before the first
        mutating call, or without sessions)."""
        session = self._sessions.get(self._routes.address())
        return session.session_id if session else None

    def _call(self, method: str, request: Any, timeout: float | None,
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
                return getattr(self._routes.stub(address), method)(
                    request, timeout=route.timeout(), metadata=self._metadata)
            except grpc.RpcError as exc:
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
            time.sleep(delay)

    def _ensure_session(self, address: str) -> SessionStamp | None:
        """The session open on ``address``, opened on first use (call with the lock
        held)."""
        session = self._sessions.get(address)
        if session is None and self._use_session:
            # A proposed id makes OpenSession safe to resend: a resend whose first answer
            # was lost answers the same session (no second one, no lazily failed call).
            resp = self._call("OpenSession", pb.OpenSessionRequest(
                client_name=self._client_name, session_id=secrets.token_hex(16)), None,
                pin=address)
            session = self._sessions[address] = SessionStamp(resp.session_id,
                                                             resp.lease_ttl_seconds)
            self._start_keepalive(session, address)
        return session

    def _start_keepalive(self, session: SessionStamp, address: str, *,
                         now: bool = False) -> None:
        """Keeps ``session`` alive at ``address``; ``now``: the first KeepAlive at once."""
        threading.Thread(target=self._keep_alive, args=(session, address, now),
                         name="kvcache-keepalive", daemon=True).start()

    def _keep_alive(self, session: SessionStamp, address: str, now: bool) -> None:
        interval = keepalive_interval(session.lease_ttl_seconds)
        request = pb.KeepAliveRequest(session_id=session.session_id)
        stub = self._routes.stub(address)
        wait = 0.0 if now else interval
        while (not self._keepalive_stop.wait(wait)
               and self._carrier.alive(address, session, self._sessions)):
            wait = interval
            try:
                stub.KeepAlive(request, timeout=interval, metadata=self._metadata)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    return  # expired: the next mutating call learns it and opens a new one
            except ValueError:
                return  # the channel was closed

    def _sequenced(self, send: Any, request: Any, timeout: float | None = None) -> Any:
        """Sends a mutating request stamped with the session of the replica it goes to;
        ``send(request, address)`` does the transport retries with the same stamp and
        raises :class:`Moved` when the request must go to another replica: it is restamped
        there, after a backoff unless redirected, until ``timeout`` (default
        ``default_timeout``) has passed (see :class:`CallRoute`)."""
        route = CallRoute(self._routes, getattr(request, "pool_id", ""),
                          timeout or self.default_timeout, self._backoff)
        call = SequencedCall(self._sessions, self._carrier, route.pool_id)
        with self._lock:
            while True:
                address = route.address
                session = None
                try:
                    session = call.carried_stamp(address)
                    if session is None:
                        session = self._ensure_session(address)
                    if session is not None:
                        session.stamp(request)
                    response = send(request, address)
                except Moved as moved:
                    call.moved(address, session, moved)
                    time.sleep(route.moved(moved))
                    continue
                except CacheError as err:
                    if call.failed(address, session, err):
                        continue
                    raise
                for stamp in call.accepted(address, session) if session is not None else ():
                    self._start_keepalive(stamp, address, now=stamp is not session)
                return response

    def _mutate(self, method: str, request: Any, timeout: float | None) -> Any:
        deadline = Deadline(timeout or self.default_timeout)
        return self._sequenced(lambda r, a: self._call(
            method, r, deadline.left(), pin=a, resend=bool(r.session_id)), request, timeout)

    def register_pool(self, pool_id: str, layer_specs: Sequence[pb.LayerSpec], *,
                      timeout: float | None = None, **kwargs: Any) -> PoolInfo:
        resp = self._mutate("RegisterPool",
                          register_request(pool_id, layer_specs, **kwargs), timeout)
        return pool_info_from(resp.config, resp.created)

    def get_pool(self, pool_id: str, *, timeout: float | None = None) -> PoolInfo:
        return pool_info_from(self._call("GetPool", pb.GetPoolRequest(pool_id=pool_id),
                                     timeout).config)

    def list_pools(self, *, timeout: float | None = None) -> list[PoolInfo]:
        return [pool_info_from(c) for c in
                self._call("ListPools", pb.ListPoolsRequest(), timeout).pools]

    def delete_pool(self, pool_id: str, *, timeout: float | None = None) -> int:
        return self._mutate("DeletePool", pb.DeletePoolRequest(pool_id=pool_id),
                          timeout).num_requests_dropped

    def step(self, pool_id: str, step_ops: Sequence[pb.Op], *, begin_step: bool = False,
             timeout: float | None = None) -> StepResult:
        return step_result(self._mutate("Step", pb.StepRequest(
            pool_id=pool_id, begin_step=begin_step, ops=step_ops), timeout))

    def step_batch(self, batch: StepBuilder, *, timeout: float | None = None) -> StepResult:
        """Send a :class:`StepBuilder`'s batch."""
        return step_result(self._mutate("Step", batch.request, timeout))

    def step_raw(self, request: pb.StepRequest, *,
                 timeout: float | None = None) -> pb.StepResponse:
        return self._mutate("Step", request, timeout)

    def decode(self, pool_id: str, request_ids: Sequence[str], token_ids: Sequence[int], *,
               begin_step: bool = False, timeout: float | None = None) -> DecodeResult:
        """A Step of one decode op (see :meth:`ops.decode`): the cheapest decode step."""
        resp = self._mutate("Step", decode_request(
            pool_id, request_ids, token_ids, begin_step), timeout)
        return DecodeResult(resp.results[0].decode)

    def step_stream(self, *, step_timeout: float | None = None,
                    on_retry: OnRetry | None = None) -> StepStream:
        """A bidirectional Step stream (see :class:`StepStream`); ``step_timeout``
        (default ``default_timeout``) is each step's deadline."""
        return StepStream(self, step_timeout or self.default_timeout, on_retry)

    def peek_prefix(self, pool_ids: Sequence[str], token_ids: Sequence[int] = (), *,
                    block_hashes: Sequence[bytes] = (), cache_salt: str | None = None,
                    lora_name: str | None = None,
                    timeout: float | None = None,
                    lora_path: str | None = None) -> dict[str, int]:
        resp = self._call("PeekPrefix", peek_request(
            pool_ids, token_ids, block_hashes, cache_salt, lora_name, lora_path), timeout)
        return hits_from(resp)

    def routing_view(self, pool_ids: Sequence[str], token_ids: Sequence[int] = (), *,
                     block_hashes: Sequence[bytes] = (), cache_salt: str | None = None,
                     lora_name: str | None = None, lora_path: str | None = None,
                     explain: bool = False,
                     timeout: float | None = None) -> pb.PeekPrefixResponse:
        """:meth:`peek_prefix` with every pool's per-group reach (and, with ``explain``,
        miss reasons): the whole PeekPrefixResponse."""
        return self._call("PeekPrefix", peek_request(
            pool_ids, token_ids, block_hashes, cache_salt, lora_name, lora_path, explain),
            timeout)

    def prefix_snapshot(self, pool_id: str, *,
                        timeout: float | None = None) -> pb.GetPrefixSnapshotResponse:
        """The pool's cached block hashes per group and the event sequence they match:
        resume :meth:`subscribe_events` at ``sequence + 1``."""
        return self._call("GetPrefixSnapshot",
                          pb.GetPrefixSnapshotRequest(pool_id=pool_id), timeout)

    def get_request(self, pool_id: str, request_id: str, *,
                    timeout: float | None = None) -> RequestState:
        r = self._call("GetRequest", pb.GetRequestRequest(
            pool_id=pool_id, request_id=request_id), timeout)
        return request_state_from(r)

    def stats(self, pool_id: str, *, timeout: float | None = None) -> PoolStats:
        return stats_from(self._call("GetPoolStats",
                                 pb.GetPoolStatsRequest(pool_id=pool_id), timeout).stats)

    def reset_prefix_cache(self, pool_id: str, *, timeout: float | None = None) -> bool:
        return self._mutate("ResetPrefixCache",
                          pb.ResetPrefixCacheRequest(pool_id=pool_id), timeout).reset

    def subscribe_events(self, pool_id: str, from_sequence: int | None = None,
                         incarnation: int | None = None,
                         ) -> Iterator[Event]:
        req = subscribe_request(pool_id, from_sequence, incarnation)
        for _ in range(MAX_REDIRECTS + 1):
            address = self._routes.address(pool_id)
            call = self._routes.stub(address).SubscribeEvents(req, metadata=self._metadata)
            delivered = False
            try:
                for batch in call:
                    delivered = True
                    for e in batch.events:
                        yield event_from(e)
                return
            except grpc.RpcError as exc:
                if (delivered or exc.code() != grpc.StatusCode.UNAVAILABLE
                        or not self._routes.follow(pool_id, exc.trailing_metadata())):
                    raise CacheError.from_rpc(exc) from None
            finally:
                call.cancel()


class StepStream:
    """A blocking StepStream: :meth:`step` sends one request and waits for its answer.

    Every step has a deadline (``step_timeout``). When it passes, or the stream breaks
    (UNAVAILABLE), the stream is dropped, a new one opened and the same request resent
    under the same sequence number (so it is applied once), up to the client's
    ``max_retries`` times; ``on_retry(reason, attempt)`` is called before each resend. An
    error status from the server (an invalid batch) ends the stream; the next step opens
    a new one. The stream goes to the replica of the step's pool: a redirect, or that
    replica giving up, reopens it on another one (the request restamped for its session)."""

    _END = object()

    def __init__(self, client: CacheClient, step_timeout: float,
                 on_retry: OnRetry | None = None) -> None:
        self._client = client
        self.step_timeout = step_timeout
        self._on_retry = on_retry
        self._requests: queue.SimpleQueue | None = None
        self._responses: queue.SimpleQueue = queue.SimpleQueue()
        self._call: Any = None
        self._address = ""

    def __enter__(self) -> StepStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self, address: str) -> None:
        requests: queue.SimpleQueue = queue.SimpleQueue()
        responses: queue.SimpleQueue = queue.SimpleQueue()
        call = self._client._routes.stub(address).StepStream(
            iter(requests.get, self._END), metadata=self._client._metadata)
        self._address = address

        def read() -> None:  # one reader per stream: a step waits with a deadline
            try:
                for response in call:
                    responses.put(response)
                responses.put(self._END)
            except grpc.RpcError as exc:
                responses.put(exc)

        threading.Thread(target=read, name="kvcache-step-stream", daemon=True).start()
        self._requests, self._responses, self._call = requests, responses, call

    def _drop(self) -> None:
        if self._call is not None:
            assert self._requests is not None
            self._requests.put(self._END)
            self._call.cancel()
        self._requests = self._call = None

    def _exchange(self, request: pb.StepRequest, address: str) -> pb.StepResponse:
        """One request and its answer from ``address``, with the deadline and the
        resends; raises :class:`Moved` when it must go to another replica."""
        attempt = 0
        while True:
            if self._call is not None and self._address != address:
                self._drop()
            if self._call is None:
                self._open(address)
            assert self._requests is not None
            self._requests.put(request)
            try:
                item = self._responses.get(timeout=self.step_timeout)
            except queue.Empty:
                item = None
            if isinstance(item, pb.StepResponse):
                return item
            self._drop()
            if isinstance(item, grpc.RpcError):
                err = CacheError.from_rpc(item)
                if item.code() == grpc.StatusCode.UNAVAILABLE:
                    moved = reroute(self._client._routes, request.pool_id, address,
                                    item.trailing_metadata())
                    if moved is not None:
                        raise Moved(err, moved)
            elif item is None:
                err = CacheError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                 f"no StepStream answer within {self.step_timeout} s")
            else:  # the server closed the stream without a status (shutting down)
                err = CacheError(grpc.StatusCode.UNAVAILABLE, "StepStream ended")
            time.sleep(resend_delay(err, attempt, self._client._retries,
                                    self._client._backoff, self._on_retry))
            attempt += 1

    def step_raw(self, request: pb.StepRequest) -> pb.StepResponse:
        """Step with protocol messages (stamped with the client's session here)."""
        return self._client._sequenced(self._exchange, request)

    def step(self, pool_id: str, step_ops: Sequence[pb.Op], *,
             begin_step: bool = False) -> StepResult:
        return step_result(self.step_raw(pb.StepRequest(pool_id=pool_id, begin_step=begin_step,
                                                        ops=step_ops)))

    def close(self) -> None:
        self._drop()
