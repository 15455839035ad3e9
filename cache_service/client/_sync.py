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


class CacheClient:
    """The blocking twin of :class:`AsyncCacheClient` (same methods, no ``await``).
    Thread-safe: mutating calls of one client take turns (one sequence number at a time)."""

    def __init__(self, target: str, *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, default_timeout: float = 10.0,
                 max_retries: int = 4, backoff_base: float = 0.05, backoff_max: float = 1.0,
                 ssl_target_name_override: str | None = None, session: bool = True,
                 client_name: str = "") -> None:
        self._backoff = Backoff(backoff_base, backoff_max)
        options = channel_options(max_retries, self._backoff, ssl_target_name_override)
        creds = channel_credentials(tls, root_certificates)
        self._channel = (grpc.secure_channel(target, creds, options=options) if creds
                         else grpc.insecure_channel(target, options=options))
        self._stub = pb_grpc.CacheServiceStub(self._channel)
        self._metadata = auth_metadata(token)
        self.default_timeout = default_timeout
        self._retries = max_retries
        self._use_session = session
        self._client_name = client_name
        self._session: SessionStamp | None = None
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
            session, self._session = self._session, None
            if session is not None:
                # unreachable or already expired: the lease frees them anyway
                with contextlib.suppress(grpc.RpcError):
                    self._stub.CloseSession(pb.CloseSessionRequest(
                        session_id=session.session_id), timeout=2.0, metadata=self._metadata)
        self._channel.close()

    @property
    def session_id(self) -> str | None:
        """The open session's id (None before the first mutating call, or without
        sessions)."""
        return self._session.session_id if self._session else None

    def _call(self, method: Any, request: Any, timeout: float | None) -> Any:
        """One unary call (gRPC retries UNAVAILABLE, see ``_channel.py``)."""
        try:
            return method(request, timeout=timeout or self.default_timeout,
                          metadata=self._metadata)
        except grpc.RpcError as exc:
            raise CacheError.from_rpc(exc) from None

    def _ensure_session(self) -> SessionStamp | None:
        """The open session, opened on first use (call with the lock held)."""
        if self._session is None and self._use_session:
            resp = self._call(self._stub.OpenSession,
                              pb.OpenSessionRequest(client_name=self._client_name), None)
            self._session = SessionStamp(resp.session_id, resp.lease_ttl_seconds)
            threading.Thread(target=self._keep_alive, args=(self._session,),
                             name="kvcache-keepalive", daemon=True).start()
        return self._session

    def _keep_alive(self, session: SessionStamp) -> None:
        interval = keepalive_interval(session.lease_ttl_seconds)
        request = pb.KeepAliveRequest(session_id=session.session_id)
        while not self._keepalive_stop.wait(interval) and self._session is session:
            try:
                self._stub.KeepAlive(request, timeout=interval, metadata=self._metadata)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    return  # expired: the next mutating call learns it and opens a new one
            except ValueError:
                return  # the channel was closed

    def _sequenced(self, send: Any, request: Any) -> Any:
        """Sends a mutating request stamped with the session (see ``_session``);
        ``send(request)`` does the transport retries with the same stamp."""
        with self._lock:
            session = self._ensure_session()
            while True:
                if session is not None:
                    session.stamp(request)
                try:
                    response = send(request)
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

    def _mutate(self, method: Any, request: Any, timeout: float | None) -> Any:
        return self._sequenced(lambda r: self._call(method, r, timeout), request)

    def register_pool(self, pool_id: str, layer_specs: Sequence[pb.LayerSpec], *,
                      timeout: float | None = None, **kwargs: Any) -> PoolInfo:
        resp = self._mutate(self._stub.RegisterPool,
                          register_request(pool_id, layer_specs, **kwargs), timeout)
        return pool_info_from(resp.config, resp.created)

    def get_pool(self, pool_id: str, *, timeout: float | None = None) -> PoolInfo:
        return pool_info_from(self._call(self._stub.GetPool, pb.GetPoolRequest(pool_id=pool_id),
                                     timeout).config)

    def list_pools(self, *, timeout: float | None = None) -> list[PoolInfo]:
        return [pool_info_from(c) for c in
                self._call(self._stub.ListPools, pb.ListPoolsRequest(), timeout).pools]

    def delete_pool(self, pool_id: str, *, timeout: float | None = None) -> int:
        return self._mutate(self._stub.DeletePool, pb.DeletePoolRequest(pool_id=pool_id),
                          timeout).num_requests_dropped

    def step(self, pool_id: str, step_ops: Sequence[pb.Op], *, begin_step: bool = False,
             timeout: float | None = None) -> StepResult:
        return step_result(self._mutate(self._stub.Step, pb.StepRequest(
            pool_id=pool_id, begin_step=begin_step, ops=step_ops), timeout))

    def step_batch(self, batch: StepBuilder, *, timeout: float | None = None) -> StepResult:
        """Send a :class:`StepBuilder`'s batch."""
        return step_result(self._mutate(self._stub.Step, batch.request, timeout))

    def step_raw(self, request: pb.StepRequest, *,
                 timeout: float | None = None) -> pb.StepResponse:
        return self._mutate(self._stub.Step, request, timeout)

    def decode(self, pool_id: str, request_ids: Sequence[str], token_ids: Sequence[int], *,
               begin_step: bool = False, timeout: float | None = None) -> DecodeResult:
        """A Step of one decode op (see :meth:`ops.decode`): the cheapest decode step."""
        resp = self._mutate(self._stub.Step, decode_request(
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
        resp = self._call(self._stub.PeekPrefix, peek_request(
            pool_ids, token_ids, block_hashes, cache_salt, lora_name, lora_path), timeout)
        return hits_from(resp)

    def get_request(self, pool_id: str, request_id: str, *,
                    timeout: float | None = None) -> RequestState:
        r = self._call(self._stub.GetRequest, pb.GetRequestRequest(
            pool_id=pool_id, request_id=request_id), timeout)
        return request_state_from(r)

    def stats(self, pool_id: str, *, timeout: float | None = None) -> PoolStats:
        return stats_from(self._call(self._stub.GetPoolStats,
                                 pb.GetPoolStatsRequest(pool_id=pool_id), timeout).stats)

    def reset_prefix_cache(self, pool_id: str, *, timeout: float | None = None) -> bool:
        return self._mutate(self._stub.ResetPrefixCache,
                          pb.ResetPrefixCacheRequest(pool_id=pool_id), timeout).reset

    def subscribe_events(self, pool_id: str, from_sequence: int | None = None,
                         incarnation: int | None = None,
                         ) -> Iterator[Event]:
        call = self._stub.SubscribeEvents(subscribe_request(pool_id, from_sequence, incarnation),
                                          metadata=self._metadata)
        try:
            for batch in call:
                for e in batch.events:
                    yield event_from(e)
        except grpc.RpcError as exc:
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
    a new one."""

    _END = object()

    def __init__(self, client: CacheClient, step_timeout: float,
                 on_retry: OnRetry | None = None) -> None:
        self._client = client
        self.step_timeout = step_timeout
        self._on_retry = on_retry
        self._requests: queue.SimpleQueue | None = None
        self._responses: queue.SimpleQueue = queue.SimpleQueue()
        self._call: Any = None

    def __enter__(self) -> StepStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> None:
        requests: queue.SimpleQueue = queue.SimpleQueue()
        responses: queue.SimpleQueue = queue.SimpleQueue()
        call = self._client._stub.StepStream(iter(requests.get, self._END),
                                             metadata=self._client._metadata)

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

    def _exchange(self, request: pb.StepRequest) -> pb.StepResponse:
        """One request and its answer, with the deadline and the resends."""
        attempt = 0
        while True:
            if self._call is None:
                self._open()
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
