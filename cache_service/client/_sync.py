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
        self._channel = (grpc.secure_channel(target, creds, options=options) if creds
                         else grpc.insecure_channel(target, options=options))
        self._stub = pb_grpc.CacheServiceStub(self._channel)
        self._metadata = auth_metadata(token)
        self.default_timeout = default_timeout
        self._retries = max_retries
        self._backoff = (backoff_base, backoff_max)

    def __enter__(self) -> "CacheClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: Any, request: Any, timeout: float | None) -> Any:
        attempt = 0
        while True:
            try:
                return method(request, timeout=timeout or self.default_timeout,
                              metadata=self._metadata)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt >= self._retries:
                    raise CacheError.from_rpc(exc) from None
                base, cap = self._backoff
                time.sleep(min(cap, base * 2 ** attempt) * random.uniform(0.5, 1.0))
                attempt += 1

    def register_pool(self, pool_id: str, layer_specs: Sequence[pb.LayerSpec], *,
                      timeout: float | None = None, **kwargs: Any) -> PoolInfo:
        resp = self._call(self._stub.RegisterPool,
                          register_request(pool_id, layer_specs, **kwargs), timeout)
        return pool_info_from(resp.config, resp.created)

    def get_pool(self, pool_id: str, *, timeout: float | None = None) -> PoolInfo:
        return pool_info_from(self._call(self._stub.GetPool, pb.GetPoolRequest(pool_id=pool_id),
                                     timeout).config)

    def list_pools(self, *, timeout: float | None = None) -> list[PoolInfo]:
        return [pool_info_from(c) for c in
                self._call(self._stub.ListPools, pb.ListPoolsRequest(), timeout).pools]

    def delete_pool(self, pool_id: str, *, timeout: float | None = None) -> int:
        return self._call(self._stub.DeletePool, pb.DeletePoolRequest(pool_id=pool_id),
                          timeout).num_requests_dropped

    def step(self, pool_id: str, step_ops: Sequence[pb.Op], *, begin_step: bool = False,
             timeout: float | None = None) -> StepResult:
        return step_result(self._call(self._stub.Step, pb.StepRequest(
            pool_id=pool_id, begin_step=begin_step, ops=step_ops), timeout))

    def step_batch(self, batch: StepBuilder, *, timeout: float | None = None) -> StepResult:
        """Send a :class:`StepBuilder`'s batch."""
        return step_result(self._call(self._stub.Step, batch.request, timeout))

    def step_raw(self, request: pb.StepRequest, *,
                 timeout: float | None = None) -> pb.StepResponse:
        return self._call(self._stub.Step, request, timeout)

    def decode(self, pool_id: str, request_ids: Sequence[str], token_ids: Sequence[int], *,
               begin_step: bool = False, timeout: float | None = None) -> DecodeResult:
        """A Step of one decode op (see :meth:`ops.decode`): the cheapest decode step."""
        resp = self._call(self._stub.Step, decode_request(
            pool_id, request_ids, token_ids, begin_step), timeout)
        return DecodeResult(resp.results[0].decode)

    def step_stream(self) -> "StepStream":
        return StepStream(self._stub.StepStream, self._metadata)

    def peek_prefix(self, pool_ids: Sequence[str], token_ids: Sequence[int] = (), *,
                    block_hashes: Sequence[bytes] = (), cache_salt: str | None = None,
                    lora_name: str | None = None,
                    timeout: float | None = None,
                    lora_path: str | None = None) -> dict[str, int]:
        resp = self._call(self._stub.PeekPrefix, peek_request(
            pool_ids, token_ids, block_hashes, cache_salt, lora_name, lora_path), timeout)
        return hits_from(resp)

    def routing_view(self, pool_ids: Sequence[str], token_ids: Sequence[int] = (), *,
                     block_hashes: Sequence[bytes] = (), cache_salt: str | None = None,
                     lora_name: str | None = None, lora_path: str | None = None,
                     explain: bool = False,
                     timeout: float | None = None) -> pb.PeekPrefixResponse:
        """:meth:`peek_prefix` with every pool's per-group reach (and, with ``explain``,
        miss reasons): the whole PeekPrefixResponse."""
        return self._call(self._stub.PeekPrefix, peek_request(
            pool_ids, token_ids, block_hashes, cache_salt, lora_name, lora_path, explain),
            timeout)

    def prefix_snapshot(self, pool_id: str, *,
                        timeout: float | None = None) -> pb.GetPrefixSnapshotResponse:
        """The pool's cached block hashes per group and the event sequence they match:
        resume :meth:`subscribe_events` at ``sequence + 1``."""
        return self._call(self._stub.GetPrefixSnapshot,
                          pb.GetPrefixSnapshotRequest(pool_id=pool_id), timeout)

    def get_request(self, pool_id: str, request_id: str, *,
                    timeout: float | None = None) -> RequestState:
        r = self._call(self._stub.GetRequest, pb.GetRequestRequest(
            pool_id=pool_id, request_id=request_id), timeout)
        return request_state_from(r)

    def stats(self, pool_id: str, *, timeout: float | None = None) -> PoolStats:
        return stats_from(self._call(self._stub.GetPoolStats,
                                 pb.GetPoolStatsRequest(pool_id=pool_id), timeout).stats)

    def reset_prefix_cache(self, pool_id: str, *, timeout: float | None = None) -> bool:
        return self._call(self._stub.ResetPrefixCache,
                          pb.ResetPrefixCacheRequest(pool_id=pool_id), timeout).reset

    def subscribe_events(self, pool_id: str, from_sequence: int | None = None
                         ) -> Iterator[Event]:
        req = pb.SubscribeEventsRequest(pool_id=pool_id)
        if from_sequence is not None:
            req.from_sequence = from_sequence
        call = self._stub.SubscribeEvents(req, metadata=self._metadata)
        try:
            for batch in call:
                for e in batch.events:
                    yield event_from(e)
        except grpc.RpcError as exc:
            raise CacheError.from_rpc(exc) from None
        finally:
            call.cancel()


class StepStream:
    """A blocking StepStream: :meth:`step` sends one request and waits for its answer."""

    _END = object()

    def __init__(self, method: Any, metadata: tuple) -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._responses = method(iter(self._requests.get, self._END), metadata=metadata)

    def __enter__(self) -> "StepStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def step(self, pool_id: str, step_ops: Sequence[pb.Op], *,
             begin_step: bool = False) -> StepResult:
        self._requests.put(pb.StepRequest(pool_id=pool_id, begin_step=begin_step, ops=step_ops))
        try:
            return step_result(next(self._responses))
        except grpc.RpcError as exc:
            raise CacheError.from_rpc(exc) from None

    def close(self) -> None:
        self._requests.put(self._END)
        self._responses.cancel()
