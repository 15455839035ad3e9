"""The blocking client: :class:`CacheClient` and :class:`StepStream`, the same API as the
async twin without ``await``."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator, Sequence
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


class CacheClient(ClientBase):
    """The blocking twin of :class:`AsyncCacheClient` (same methods, no ``await``; see
    :class:`ClientBase` for the arguments). Use as ``with``. Thread-safe: mutating calls
    of one client take turns (one sequence number at a time)."""

    _grpc = grpc

    def _init_transport(self) -> None:
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
            for address, session in self._take_sessions():
                # unreachable or already expired: the lease frees them anyway
                with contextlib.suppress(grpc.RpcError):
                    self._routes.stub(address).CloseSession(pb.CloseSessionRequest(
                        session_id=session.session_id), timeout=2.0, metadata=self._metadata)
        for channel in self._channels.values():
            channel.close()

    def wait_connected(self, timeout: float, address: str | None = None) -> None:
        """Returns once the channel to ``address`` (default: the first seed) is connected;
        raises :class:`CacheError` (DEADLINE_EXCEEDED) if it is not within ``timeout``."""
        try:
            grpc.channel_ready_future(self._channel(address)).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise CacheError(grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"not connected within {timeout} s") from None

    def _call(self, method: str, request: Any, timeout: float | None,
              pin: str | None = None, *, resend: bool = True) -> Any:
        """``method`` on the pool's replica, following redirects and moving past a replica
        that stays unavailable until the call's timeout (see :class:`CallRoute`); ``pin``:
        on that replica only (a call stamped with its session), raising :class:`Moved`
        when it must go elsewhere; ``resend``: safe to send again (a read, or stamped with
        a session), so each attempt has its own deadline and a lost answer is resent."""
        route = self._route(request, timeout, pin, resend)
        while True:
            address = route.address
            try:
                return getattr(self._routes.stub(address), method)(
                    request, timeout=route.timeout(), metadata=self._metadata)
            except grpc.RpcError as exc:
                delay = self._unary_delay(route, address, exc)
            time.sleep(delay)

    def _ensure_session(self, address: str) -> SessionStamp | None:
        """The session open on ``address``, opened on first use (call with the lock
        held)."""
        session = self._sessions.get(address)
        if session is None and self._use_session:
            session = self._session_opened(address, self._call(
                "OpenSession", self._open_session_request(), None, pin=address))
        return session

    def _start_keepalive(self, session: SessionStamp, address: str, *,
                         now: bool = False) -> None:
        """Keeps ``session`` alive at ``address``; ``now``: the first KeepAlive at once."""
        threading.Thread(target=self._keep_alive, args=(session, address, now),
                         name="kvcache-keepalive", daemon=True).start()

    def _keep_alive(self, session: SessionStamp, address: str, now: bool) -> None:
        """The keep-alive thread's loop: until the client closes or the session is no
        longer its own there (expired, replaced)."""
        interval, request, stub = self._keepalive_plan(session, address)
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
        route, call = self._sequenced_call(request, timeout)
        with self._lock:
            while True:
                address = route.address
                session = None
                try:
                    session = call.carried_stamp(address) or self._ensure_session(address)
                    if session is not None:
                        session.stamp(request)
                    response = send(request, address)
                except (Moved, CacheError) as exc:
                    time.sleep(self._unsent_delay(route, call, address, session, exc))
                    continue
                self._accepted(call, address, session)
                return response

    def _mutate(self, method: str, request: Any, timeout: float | None) -> Any:
        """A mutating unary call, stamped (and restamped per replica) with the session."""
        deadline = Deadline(timeout or self.default_timeout)
        return self._sequenced(lambda r, a: self._call(
            method, r, deadline.left(), pin=a, resend=bool(r.session_id)), request, timeout)

    def register_pool(self, pool_id: str, layer_specs: Sequence[pb.LayerSpec], *,
                      timeout: float | None = None, **kwargs: Any) -> PoolInfo:
        """Create (or re-open, if identical) a pool; kwargs as :func:`register_request`."""
        resp = self._mutate("RegisterPool",
                            register_request(pool_id, layer_specs, **kwargs), timeout)
        return pool_info_from(resp.config, resp.created)

    def get_pool(self, pool_id: str, *, timeout: float | None = None) -> PoolInfo:
        """The pool's configuration and groups (NOT_FOUND if it is not registered)."""
        resp = self._call("GetPool", pb.GetPoolRequest(pool_id=pool_id), timeout)
        return pool_info_from(resp.config)

    def list_pools(self, *, timeout: float | None = None) -> list[PoolInfo]:
        """Every pool of the replica the call goes to (the first seed)."""
        resp = self._call("ListPools", pb.ListPoolsRequest(), timeout)
        return [pool_info_from(c) for c in resp.pools]

    def list_sessions(self, *, timeout: float | None = None) -> pb.ListSessionsResponse:
        """The sessions open on the replica the call goes to (the first seed), with the
        requests each owns: the whole ListSessionsResponse."""
        return self._call("ListSessions", pb.ListSessionsRequest(), timeout)

    def delete_pool(self, pool_id: str, *, timeout: float | None = None) -> int:
        """Drops the pool; answers the number of requests it still had."""
        resp = self._mutate("DeletePool", pb.DeletePoolRequest(pool_id=pool_id), timeout)
        return resp.num_requests_dropped

    def step(self, pool_id: str, step_ops: Sequence[pb.Op], *, begin_step: bool = False,
             timeout: float | None = None) -> StepResult:
        """Apply a batch of ops in order (all or nothing on invalid input)."""
        resp = self._mutate("Step", pb.StepRequest(
            pool_id=pool_id, begin_step=begin_step, ops=step_ops), timeout)
        return step_result(resp)

    def step_batch(self, batch: StepBuilder, *, timeout: float | None = None) -> StepResult:
        """Send a :class:`StepBuilder`'s batch."""
        return step_result(self._mutate("Step", batch.request, timeout))

    def step_raw(self, request: pb.StepRequest, *,
                 timeout: float | None = None) -> pb.StepResponse:
        """Step with protocol messages (no conversion), for hot loops."""
        return self._mutate("Step", request, timeout)

    def decode(self, pool_id: str, request_ids: Sequence[str], token_ids: Sequence[int], *,
               begin_step: bool = False, timeout: float | None = None) -> DecodeResult:
        """A Step of one decode op (see :meth:`ops.decode`): the cheapest decode step."""
        resp = self._mutate("Step", decode_request(
            pool_id, request_ids, token_ids, begin_step), timeout)
        return DecodeResult(resp.results[0].decode, resp)

    def step_stream(self, *, step_timeout: float | None = None,
                    on_retry: OnRetry | None = None) -> StepStream:
        """A bidirectional Step stream (see :class:`StepStream`); ``step_timeout``
        (default ``default_timeout``) is each step's deadline."""
        return StepStream(self, step_timeout or self.default_timeout, on_retry)

    def peek_prefix(self, pool_ids: Sequence[str], token_ids: Sequence[int] = (), *,
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
        resp = self._call("PeekPrefix", peek_request(
            pool_ids, token_ids, block_hashes, cache_salt, lora_name, lora_path,
            mm_items=mm_items, prompt_embeds_digests=prompt_embeds_digests), timeout)
        return hits_from(resp, include_host)

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
        """One request's tokens, block table and state (NOT_FOUND if unknown)."""
        resp = self._call("GetRequest", pb.GetRequestRequest(
            pool_id=pool_id, request_id=request_id), timeout)
        return request_state_from(resp)

    def stats(self, pool_id: str, *, timeout: float | None = None) -> PoolStats:
        """The pool's usage and prefix-cache counters."""
        resp = self._call("GetPoolStats", pb.GetPoolStatsRequest(pool_id=pool_id), timeout)
        return stats_from(resp.stats)

    def pin_prefix(self, pool_id: str, pin_id: str, token_ids: Sequence[int] = (), *,
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
        resp = self._call("PinPrefix", self._pin_request(
            pool_id, pin_id, token_ids, block_hashes, ttl_seconds, session_id,
            outlive_session, cache_salt, lora_name, lora_path, mm_items,
            prompt_embeds_digests), timeout, resend=False)
        return pin_from(resp.pin)

    def renew_pin(self, pool_id: str, pin_id: str, *, ttl_seconds: float,
                timeout: float | None = None) -> PinInfo:
        """Sets the pin's expiry to ``ttl_seconds`` from now (safe to resend)."""
        resp = self._call("RenewPin", pb.RenewPinRequest(
            pool_id=pool_id, pin_id=pin_id, ttl_seconds=ttl_seconds), timeout)
        return pin_from(resp.pin)

    def drop_pin(self, pool_id: str, pin_id: str, *,
               timeout: float | None = None) -> PinInfo:
        """Drops the pin; answers it as it was (NOT_FOUND if dropped or expired)."""
        resp = self._call("DropPin", pb.DropPinRequest(pool_id=pool_id, pin_id=pin_id),
                             timeout, resend=False)
        return pin_from(resp.pin)

    def reset_prefix_cache(self, pool_id: str, *, block_ids: Sequence[int] = (),
                           timeout: float | None = None) -> bool:
        """Drops every cached block of the pool; False (nothing changed) while any
        block is in use by a request. With ``block_ids``: drops only those device blocks'
        cache entries (garbage data, e.g. a failed host-tier promotion), in use or not."""
        resp = self._mutate("ResetPrefixCache",
                            pb.ResetPrefixCacheRequest(pool_id=pool_id,
                                                       block_ids=block_ids), timeout)
        return resp.reset

    def subscribe_events(self, pool_id: str, from_sequence: int | None = None,
                         incarnation: int | None = None,
                         ) -> Iterator[Event]:
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
                for batch in call:
                    delivered = True
                    for e in batch.events:
                        yield event_from(e)
                return
            except grpc.RpcError as exc:
                self._subscribe_failed(pool_id, exc, delivered)
            finally:
                call.cancel()


class StepStream(StepStreamBase):
    """A blocking StepStream: :meth:`step` sends one request and waits for its answer.

    Every step has a deadline (``step_timeout``). When it passes, or the stream breaks
    (UNAVAILABLE), the stream is dropped, a new one opened and the same request resent
    under the same sequence number (so it is applied once), up to the client's
    ``max_retries`` times; ``on_retry(reason, attempt)`` is called before each resend. An
    error status from the server (an invalid batch) ends the stream; the next step opens
    a new one. The stream goes to the replica of the step's pool: a redirect, or that
    replica giving up, reopens it on another one (the request restamped for its session).

    A blocking gRPC stream cannot be read with a deadline, so a reader thread per stream
    puts the answers on a queue that a step waits on."""

    _END = object()

    def __init__(self, client: CacheClient, step_timeout: float,
                 on_retry: OnRetry | None = None) -> None:
        super().__init__(client, step_timeout, on_retry)
        self._requests: queue.SimpleQueue | None = None
        self._responses: queue.SimpleQueue = queue.SimpleQueue()

    def __enter__(self) -> StepStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self, address: str) -> None:
        """Opens the stream to ``address``, with its reader thread."""
        requests: queue.SimpleQueue = queue.SimpleQueue()
        responses: queue.SimpleQueue = queue.SimpleQueue()
        call = self._client._routes.stub(address).StepStream(
            iter(requests.get, self._END), metadata=self._client._metadata)
        self._address = address

        def read() -> None:  # one reader per stream: a step waits with a deadline
            try:
                for response in call:
                    responses.put(response)
                responses.put(NoAnswer.ENDED)
            except grpc.RpcError as exc:
                responses.put(exc)

        threading.Thread(target=read, name="kvcache-step-stream", daemon=True).start()
        self._requests, self._responses, self._call = requests, responses, call

    def _attempt(self, request: pb.StepRequest) -> Any:
        """Sends ``request`` on the open stream: its answer, or why none came (a status
        that ended the stream, or a :class:`NoAnswer`)."""
        assert self._requests is not None
        self._requests.put(request)
        try:
            return self._responses.get(timeout=self.step_timeout)
        except queue.Empty:
            return NoAnswer.TIMED_OUT

    def _exchange(self, request: pb.StepRequest, address: str) -> pb.StepResponse:
        """One request and its answer from ``address``, with the deadline and the
        resends; raises :class:`Moved` when it must go to another replica."""
        resends = self._resends(request.pool_id)
        while True:
            if self._call is not None and self._address != address:
                self.close()
            if self._call is None:
                self._open(address)
            outcome = self._attempt(request)
            if isinstance(outcome, pb.StepResponse):
                return outcome
            self.close()
            time.sleep(resends.after(outcome, address))

    def step_raw(self, request: pb.StepRequest) -> pb.StepResponse:
        """Step with protocol messages (stamped with the client's session here)."""
        return self._client._sequenced(self._exchange, request)

    def step(self, pool_id: str, step_ops: Sequence[pb.Op], *,
             begin_step: bool = False) -> StepResult:
        """One Step on the stream: its ops in order, all or nothing on invalid input."""
        return step_result(self.step_raw(self._request(pool_id, step_ops, begin_step)))

    def close(self) -> None:
        """Drops the open stream, if any (the next step opens a new one)."""
        if self._call is not None:
            assert self._requests is not None
            self._requests.put(self._END)
            self._call.cancel()
        self._requests = self._call = None
