"""The blocking client: :class:`CacheClient` and :class:`StepStream`, the same API as the
async twin without ``await``."""

from __future__ import annotations

import queue
import random
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.api.kvcache.v1 import cache_service_pb2_grpc as pb_grpc
from cache_service.client._builders import StepBuilder, decode_request, peek_request, register_request
from cache_service.client._channel import CHANNEL_OPTIONS, auth_metadata, channel_credentials
from cache_service.client._errors import CacheError
from cache_service.client._routing import MAX_REDIRECTS, Routes
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



class CacheClient:
    """The blocking twin of :class:`AsyncCacheClient` (same methods, no ``await``)."""

    def __init__(self, target: str, *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, default_timeout: float = 10.0,
                 max_retries: int = 4, backoff_base: float = 0.05, backoff_max: float = 1.0,
                 ssl_target_name_override: str | None = None) -> None:
        options = list(CHANNEL_OPTIONS)
        if ssl_target_name_override:
            options.append(("grpc.ssl_target_name_override", ssl_target_name_override))
        creds = channel_credentials(tls, root_certificates)
        self._channels: list[grpc.Channel] = []

        def open_stub(address: str) -> pb_grpc.CacheServiceStub:
            channel = (grpc.secure_channel(address, creds, options=options) if creds
                       else grpc.insecure_channel(address, options=options))
            self._channels.append(channel)
            return pb_grpc.CacheServiceStub(channel)

        self._routes = Routes(target, open_stub)
        self._stub = self._routes.stub(self._routes.seeds[0])
        self._metadata = auth_metadata(token)
        self.default_timeout = default_timeout
        self._retries = max_retries
        self._backoff = (backoff_base, backoff_max)

    def __enter__(self) -> "CacheClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def _call(self, method: str, request: Any, timeout: float | None) -> Any:
        """``method`` of the pool's replica; follows redirects, retries UNAVAILABLE."""
        routes = self._routes
        pool_id = getattr(request, "pool_id", "")
        attempt = hops = 0
        while True:
            address = routes.address(pool_id)
            try:
                return getattr(routes.stub(address), method)(
                    request, timeout=timeout or self.default_timeout, metadata=self._metadata)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    if hops < MAX_REDIRECTS and routes.follow(pool_id, exc.trailing_metadata()):
                        hops += 1
                        continue
                    routes.failed(pool_id, address)
                if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt >= self._retries:
                    raise CacheError.from_rpc(exc) from None
                base, cap = self._backoff
                time.sleep(min(cap, base * 2 ** attempt) * random.uniform(0.5, 1.0))
                attempt += 1

    def register_pool(self, pool_id: str, layer_specs: Sequence[pb.LayerSpec], *,
                      timeout: float | None = None, **kwargs: Any) -> PoolInfo:
        resp = self._call("RegisterPool",
                          register_request(pool_id, layer_specs, **kwargs), timeout)
        return pool_info_from(resp.config, resp.created)

    def get_pool(self, pool_id: str, *, timeout: float | None = None) -> PoolInfo:
        return pool_info_from(self._call("GetPool", pb.GetPoolRequest(pool_id=pool_id),
                                     timeout).config)

    def list_pools(self, *, timeout: float | None = None) -> list[PoolInfo]:
        return [pool_info_from(c) for c in
                self._call("ListPools", pb.ListPoolsRequest(), timeout).pools]

    def delete_pool(self, pool_id: str, *, timeout: float | None = None) -> int:
        return self._call("DeletePool", pb.DeletePoolRequest(pool_id=pool_id),
                          timeout).num_requests_dropped

    def step(self, pool_id: str, step_ops: Sequence[pb.Op], *, begin_step: bool = False,
             timeout: float | None = None) -> StepResult:
        return step_result(self._call("Step", pb.StepRequest(
            pool_id=pool_id, begin_step=begin_step, ops=step_ops), timeout))

    def step_batch(self, batch: StepBuilder, *, timeout: float | None = None) -> StepResult:
        """Send a :class:`StepBuilder`'s batch."""
        return step_result(self._call("Step", batch.request, timeout))

    def step_raw(self, request: pb.StepRequest, *,
                 timeout: float | None = None) -> pb.StepResponse:
        return self._call("Step", request, timeout)

    def decode(self, pool_id: str, request_ids: Sequence[str], token_ids: Sequence[int], *,
               begin_step: bool = False, timeout: float | None = None) -> DecodeResult:
        """A Step of one decode op (see :meth:`ops.decode`): the cheapest decode step."""
        resp = self._call("Step", decode_request(
            pool_id, request_ids, token_ids, begin_step), timeout)
        return DecodeResult(resp.results[0].decode)

    def step_stream(self) -> "StepStream":
        return StepStream(self._routes, self._metadata)

    def peek_prefix(self, pool_ids: Sequence[str], token_ids: Sequence[int] = (), *,
                    block_hashes: Sequence[bytes] = (), cache_salt: str | None = None,
                    lora_name: str | None = None,
                    timeout: float | None = None,
                    lora_path: str | None = None) -> dict[str, int]:
        resp = self._call("PeekPrefix", peek_request(
            pool_ids, token_ids, block_hashes, cache_salt, lora_name, lora_path), timeout)
        return hits_from(resp)

    def get_request(self, pool_id: str, request_id: str, *,
                    timeout: float | None = None) -> RequestState:
        r = self._call("GetRequest", pb.GetRequestRequest(
            pool_id=pool_id, request_id=request_id), timeout)
        return request_state_from(r)

    def stats(self, pool_id: str, *, timeout: float | None = None) -> PoolStats:
        return stats_from(self._call("GetPoolStats",
                                 pb.GetPoolStatsRequest(pool_id=pool_id), timeout).stats)

    def reset_prefix_cache(self, pool_id: str, *, timeout: float | None = None) -> bool:
        return self._call("ResetPrefixCache",
                          pb.ResetPrefixCacheRequest(pool_id=pool_id), timeout).reset

    def subscribe_events(self, pool_id: str, from_sequence: int | None = None
                         ) -> Iterator[Event]:
        req = pb.SubscribeEventsRequest(pool_id=pool_id)
        if from_sequence is not None:
            req.from_sequence = from_sequence
        for hop in range(MAX_REDIRECTS + 1):
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
    """A blocking StepStream: :meth:`step` sends one request and waits for its answer. The
    call is opened to the pool's replica on first use; a redirect (nothing applied) reopens
    it on the owner and resends, any other error ends it (the next step opens a new one)."""

    _END = object()

    def __init__(self, routes: Routes, metadata: tuple) -> None:
        self._routes = routes
        self._metadata = metadata
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._responses: Any = None
        self._address = ""

    def _open(self, address: str) -> None:
        self.close()
        self._requests = queue.SimpleQueue()
        self._responses = self._routes.stub(address).StepStream(
            iter(self._requests.get, self._END), metadata=self._metadata)
        self._address = address

    def __enter__(self) -> "StepStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def step(self, pool_id: str, step_ops: Sequence[pb.Op], *,
             begin_step: bool = False) -> StepResult:
        request = pb.StepRequest(pool_id=pool_id, begin_step=begin_step, ops=step_ops)
        hops = 0
        while True:
            address = self._routes.address(pool_id)
            if self._responses is None or address != self._address:
                self._open(address)
            self._requests.put(request)
            try:
                return step_result(next(self._responses))
            except grpc.RpcError as exc:
                self.close()  # the server ended the call
                if (exc.code() == grpc.StatusCode.UNAVAILABLE and hops < MAX_REDIRECTS
                        and self._routes.follow(pool_id, exc.trailing_metadata())):
                    hops += 1
                    continue
                raise CacheError.from_rpc(exc) from None

    def close(self) -> None:
        responses, self._responses = self._responses, None
        if responses is not None:
            self._requests.put(self._END)
            responses.cancel()
