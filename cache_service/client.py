"""Typed Python client of ``kvcache.v1.CacheService``.

    from cache_service.client import AsyncCacheClient, CacheClient, StepBuilder, layers, ops

    async with AsyncCacheClient("127.0.0.1:50051") as client:
        pool = await client.register_pool(
            "llama", [layers.full_attention(f"l{i}", block_size=16, num_kv_heads=8,
                                            head_size=128) for i in range(32)],
            num_blocks=1024, max_model_len=8192)
        step = await client.step("llama", [ops.add("r1", prompt), ops.lookup("r1"),
                                           ops.allocate("r1", len(prompt))], begin_step=True)
        table = step.results[2].block_ids     # one list of block ids per group

One :meth:`~AsyncCacheClient.step` per scheduler step carries every op of the step (a batch
with an invalid op is rejected whole, nothing applied); for big batches build them in place
with :class:`StepBuilder` and send them with ``step_batch``. The running requests' decode
step is cheapest as ONE ``ops.decode(request_ids, token_ids)`` op (or ``client.decode(...)``
when the step has nothing else), answered by a :class:`DecodeResult`. Results are
dataclasses or views, not protos.
Errors raise :class:`CacheError` (status code, message, offending field). Every call has a
deadline (``timeout``, default ``default_timeout``); calls are retried only on UNAVAILABLE
(server draining or not reachable yet), with bounded exponential backoff — a Step that
failed with UNAVAILABLE was not applied by this server. :class:`CacheClient` is the same
API, blocking.
"""

from __future__ import annotations

import asyncio
import queue
import random
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Union

import grpc
from grpc_status import rpc_status

from cache_service.api.kvcache.v1 import cache_service_pb2 as pb
from cache_service.api.kvcache.v1 import cache_service_pb2_grpc as pb_grpc

_KIND_NAMES = {v: k for k, v in {
    "full_attention": pb.LAYER_KIND_FULL_ATTENTION,
    "sliding_window": pb.LAYER_KIND_SLIDING_WINDOW,
    "chunked_local_attention": pb.LAYER_KIND_CHUNKED_LOCAL_ATTENTION,
    "mamba": pb.LAYER_KIND_MAMBA,
    "cross_attention": pb.LAYER_KIND_CROSS_ATTENTION,
}.items()}
_HASH_ALGOS = {"sha256": pb.HASH_ALGO_SHA256, "sha256_cbor": pb.HASH_ALGO_SHA256_CBOR}
_MAMBA_MODES = {"none": pb.MAMBA_CACHE_MODE_NONE, "align": pb.MAMBA_CACHE_MODE_ALIGN}


# ---------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------

class layers:  # noqa: N801 - a namespace of builders, used as layers.full_attention(...)
    """Builders of ``LayerSpec`` messages for :meth:`AsyncCacheClient.register_pool`."""

    @staticmethod
    def full_attention(name: str, *, block_size: int, num_kv_heads: int, head_size: int,
                       dtype: str = "bfloat16", head_size_v: int = 0) -> pb.LayerSpec:
        return pb.LayerSpec(name=name, kind=pb.LAYER_KIND_FULL_ATTENTION,
                            block_size=block_size, num_kv_heads=num_kv_heads,
                            head_size=head_size, dtype=dtype, head_size_v=head_size_v)

    @staticmethod
    def sliding_window(name: str, *, block_size: int, num_kv_heads: int, head_size: int,
                       sliding_window: int, dtype: str = "bfloat16") -> pb.LayerSpec:
        return pb.LayerSpec(name=name, kind=pb.LAYER_KIND_SLIDING_WINDOW,
                            block_size=block_size, num_kv_heads=num_kv_heads,
                            head_size=head_size, dtype=dtype, sliding_window=sliding_window)

    @staticmethod
    def chunked_local(name: str, *, block_size: int, num_kv_heads: int, head_size: int,
                      attention_chunk_size: int, dtype: str = "bfloat16") -> pb.LayerSpec:
        return pb.LayerSpec(name=name, kind=pb.LAYER_KIND_CHUNKED_LOCAL_ATTENTION,
                            block_size=block_size, num_kv_heads=num_kv_heads,
                            head_size=head_size, dtype=dtype,
                            attention_chunk_size=attention_chunk_size)

    @staticmethod
    def mamba(name: str, *, block_size: int, shapes: Sequence[Sequence[int]],
              dtypes: Sequence[str], mamba_cache_mode: str = "none",
              mamba_type: str = "mamba2") -> pb.LayerSpec:
        return pb.LayerSpec(
            name=name, kind=pb.LAYER_KIND_MAMBA, block_size=block_size,
            mamba_states=[pb.MambaState(shape=list(s), dtype=d) for s, d in zip(shapes, dtypes)],
            mamba_cache_mode=_MAMBA_MODES[mamba_cache_mode], mamba_type=mamba_type)


class ops:  # noqa: N801 - a namespace of builders, used as ops.allocate(...)
    """Builders of Step operations (``kvcache.v1.Op``)."""

    @staticmethod
    def add(request_id: str, token_ids: Sequence[int], *,
            block_hashes: Sequence[bytes] | None = None, cache_salt: str | None = None,
            lora_name: str | None = None, lora_path: str | None = None) -> pb.Op:
        """Register a request (its prompt tokens; optionally client-computed hashes). A
        LoRA request hashes ``("lora", lora_name, lora_path)`` as vLLM does."""
        return pb.Op(add_request=pb.AddRequestOp(
            request_id=request_id, token_ids=token_ids, block_hashes=block_hashes or (),
            cache_salt=cache_salt or "", lora_name=lora_name or "",
            lora_path=lora_path or ""))

    @staticmethod
    def lookup(request_id: str) -> pb.Op:
        """Find the request's prefix-cache hit (used by its next allocate)."""
        return pb.Op(lookup=pb.LookupOp(request_id=request_id))

    @staticmethod
    def allocate(request_id: str, num_new_tokens: int, *, num_lookahead_tokens: int = 0,
                 full_sequence_must_fit: bool = False, use_lookup: bool = True,
                 delay_cache_blocks: bool = False, block_table: bool = True,
                 append_token_ids: Sequence[int] = ()) -> pb.Op:
        """Allocate slots for ``num_new_tokens``; ``block_table=False`` omits the whole
        table from the result (only the new blocks come back); ``append_token_ids`` are
        appended first (a decode step in one op)."""
        return pb.Op(allocate=pb.AllocateOp(
            request_id=request_id, num_new_tokens=num_new_tokens,
            num_lookahead_tokens=num_lookahead_tokens,
            full_sequence_must_fit=full_sequence_must_fit, skip_lookup=not use_lookup,
            delay_cache_blocks=delay_cache_blocks, skip_block_table=not block_table,
            append_token_ids=append_token_ids))

    @staticmethod
    def append(request_id: str, token_ids: Sequence[int]) -> pb.Op:
        """Append decoded output tokens."""
        return pb.Op(append_tokens=pb.AppendTokensOp(request_id=request_id,
                                                     token_ids=token_ids))

    @staticmethod
    def free(request_id: str) -> pb.Op:
        """Free and forget a finished request."""
        return pb.Op(free=pb.FreeOp(request_id=request_id))

    @staticmethod
    def preempt(request_id: str) -> pb.Op:
        """Free a request's blocks but keep it for re-admission."""
        return pb.Op(preempt=pb.PreemptOp(request_id=request_id))

    @staticmethod
    def new_step() -> pb.Op:
        """Begin a scheduler step."""
        return pb.Op(new_step=pb.NewStepOp())

    @staticmethod
    def decode(request_ids: Sequence[str], token_ids: Sequence[int]) -> pb.Op:
        """The decode step of many running requests: ``token_ids[i]`` is appended to
        ``request_ids[i]`` and one slot allocated (as ``allocate(rid, 1, block_table=False,
        append_token_ids=[token])`` each), in one compact op. Answered by a
        :class:`DecodeResult`."""
        return pb.Op(decode=pb.DecodeOp(request_ids=request_ids, token_ids=token_ids))


class StepBuilder:
    """Builds one StepRequest in place — about 4x cheaper than a list of ``ops.*``
    messages, which matters for a 256-request decode step. Send it with
    ``client.step_batch(builder)``. Methods mirror :class:`ops` and return the builder::

        batch = StepBuilder("llama", begin_step=True)
        for rid in running:  # decode: append the last token and allocate its slot
            batch.allocate(rid, 1, append_token_ids=[last_token[rid]])
        result = client.step_batch(batch)
    """

    __slots__ = ("request", "_add")

    def __init__(self, pool_id: str, *, begin_step: bool = False) -> None:
        self.request = pb.StepRequest(pool_id=pool_id, begin_step=begin_step)
        self._add = self.request.ops.add

    def __len__(self) -> int:
        return len(self.request.ops)

    def add(self, request_id: str, token_ids: Sequence[int], *,
            block_hashes: Sequence[bytes] | None = None, cache_salt: str | None = None,
            lora_name: str | None = None, lora_path: str | None = None) -> "StepBuilder":
        m = self._add().add_request
        m.request_id = request_id
        m.token_ids.extend(token_ids)
        if block_hashes:
            m.block_hashes.extend(block_hashes)
        if cache_salt:
            m.cache_salt = cache_salt
        if lora_name:
            m.lora_name = lora_name
        if lora_path:
            m.lora_path = lora_path
        return self

    def lookup(self, request_id: str) -> "StepBuilder":
        self._add().lookup.request_id = request_id
        return self

    def allocate(self, request_id: str, num_new_tokens: int, *, num_lookahead_tokens: int = 0,
                 full_sequence_must_fit: bool = False, use_lookup: bool = True,
                 delay_cache_blocks: bool = False, block_table: bool = True,
                 append_token_ids: Sequence[int] = ()) -> "StepBuilder":
        m = self._add().allocate
        m.request_id = request_id
        m.num_new_tokens = num_new_tokens
        if append_token_ids:
            m.append_token_ids.extend(append_token_ids)
        if num_lookahead_tokens:
            m.num_lookahead_tokens = num_lookahead_tokens
        if full_sequence_must_fit:
            m.full_sequence_must_fit = True
        if not use_lookup:
            m.skip_lookup = True
        if delay_cache_blocks:
            m.delay_cache_blocks = True
        if not block_table:
            m.skip_block_table = True
        return self

    def append(self, request_id: str, token_ids: Sequence[int]) -> "StepBuilder":
        m = self._add().append_tokens
        m.request_id = request_id
        m.token_ids.extend(token_ids)
        return self

    def free(self, request_id: str) -> "StepBuilder":
        self._add().free.request_id = request_id
        return self

    def preempt(self, request_id: str) -> "StepBuilder":
        self._add().preempt.request_id = request_id
        return self

    def new_step(self) -> "StepBuilder":
        self._add().new_step.SetInParent()
        return self

    def decode(self, request_ids: Sequence[str], token_ids: Sequence[int]) -> "StepBuilder":
        """See :meth:`ops.decode`."""
        m = self._add().decode
        m.request_ids.extend(request_ids)
        m.token_ids.extend(token_ids)
        return self


# ---------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AddResult:
    num_tokens: int
    num_block_hashes: int


@dataclass(frozen=True)
class AppendResult:
    num_tokens: int
    num_block_hashes: int


class _MessageView:
    """A read-only view over one result message; subclasses convert fields on access, so a
    scheduler pays only for what it reads."""

    __slots__ = ("_m",)

    def __init__(self, message: Any) -> None:
        self._m = message


class LookupResult(_MessageView):
    """A lookup's hit. A view over the response message: tables convert on access."""

    __slots__ = ()

    @property
    def hit_tokens(self) -> int:
        return self._m.hit_tokens

    @property
    def block_ids(self) -> list[list[int]]:
        return _tables(self._m.block_ids)

    @property
    def shared_prefix_boundary(self) -> int:
        return self._m.shared_prefix_boundary

    def __repr__(self) -> str:
        return (f"LookupResult(hit_tokens={self.hit_tokens}, block_ids={self.block_ids}, "
                f"shared_prefix_boundary={self.shared_prefix_boundary})")


class AllocateResult(_MessageView):
    """``ok=False`` is "no room" (``new_block_ids`` None): preempt someone and retry.
    ``block_ids`` is the whole table per group (empty if the op set ``block_table=False``).
    A view over the response message: tables convert on access, so a scheduler that reads
    only what it needs pays only for that."""

    __slots__ = ()

    @property
    def ok(self) -> bool:
        return self._m.ok

    @property
    def new_block_ids(self) -> list[list[int]] | None:
        """Per group; ``[]`` when no group got a block; None when not ok."""
        return _tables(self._m.new_block_ids) if self._m.ok else None

    @property
    def block_ids(self) -> list[list[int]]:
        return _tables(self._m.block_ids)

    @property
    def num_computed_tokens(self) -> int:
        return self._m.num_computed_tokens

    @property
    def hit_tokens_used(self) -> int:
        return self._m.hit_tokens_used

    def __repr__(self) -> str:
        return (f"AllocateResult(ok={self.ok}, new_block_ids={self.new_block_ids}, "
                f"block_ids={self.block_ids}, num_computed_tokens={self.num_computed_tokens}, "
                f"hit_tokens_used={self.hit_tokens_used})")


class DecodeResult(_MessageView):
    """A decode op's outcome, a view over the packed response. ``ok[i]`` answers
    ``request_ids[i]`` (False = no room; nothing was allocated for it, its token stays
    appended); a successful request's computed tokens grew by one. ``new_block_ids`` maps
    the index of each request that got blocks to its new blocks per group (usually few)."""

    __slots__ = ()

    @property
    def ok(self) -> list[bool]:
        return list(self._m.ok)

    @property
    def all_ok(self) -> bool:
        """Every request got its slot (cheap: no list is built)."""
        return all(self._m.ok)

    @property
    def failed(self) -> list[int]:
        """Indices of the requests that found no room."""
        return [i for i, ok in enumerate(self._m.ok) if not ok]

    @property
    def new_block_ids(self) -> dict[int, list[list[int]]]:
        m = self._m
        grown = m.grown
        if not grown:
            return {}
        counts = m.new_block_counts
        ids = m.new_block_ids
        groups = len(counts) // len(grown)
        out: dict[int, list[list[int]]] = {}
        pos = k = 0
        for index in grown:
            tables = out[index] = []
            for count in counts[k: k + groups]:
                tables.append(list(ids[pos: pos + count]))
                pos += count
            k += groups
        return out

    def __repr__(self) -> str:
        return f"DecodeResult(ok={self.ok}, new_block_ids={self.new_block_ids})"


@dataclass(frozen=True)
class FreeResult:
    num_free_blocks: int


@dataclass(frozen=True)
class PreemptResult:
    num_free_blocks: int


@dataclass(frozen=True)
class NewStepResult:
    pass


OpResult = Union[AddResult, LookupResult, AllocateResult, AppendResult, FreeResult,
                 PreemptResult, NewStepResult, DecodeResult]


@dataclass(frozen=True)
class StepResult:
    """``results[i]`` answers ``ops[i]``."""

    results: list[OpResult]
    num_free_blocks: int


@dataclass(frozen=True)
class GroupInfo:
    index: int
    layer_names: list[str]
    kind: str
    block_size: int
    sliding_window: int
    attention_chunk_size: int
    page_size_bytes: int


@dataclass(frozen=True)
class PoolInfo:
    """A pool's configuration (``raw`` is the PoolConfig message)."""

    pool_id: str
    num_blocks: int
    groups: list[GroupInfo]
    page_size_bytes: int
    scheduler_block_size: int
    hash_block_size: int
    created: bool
    raw: pb.PoolConfig
    #: Bytes of one block in ONE layer (``page_size_bytes`` is per block id, all layers).
    layer_page_size_bytes: int = 0


@dataclass(frozen=True)
class RequestState:
    block_ids: list[list[int]]
    num_computed_tokens: int
    num_tokens: int
    num_block_hashes: int
    status: str
    num_preemptions: int


@dataclass(frozen=True)
class PoolStats:
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    usage: float
    num_requests: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    evictions: int
    allocation_failures: int
    preemptions: int
    num_cached_blocks_per_group: list[int]
    last_event_sequence: int


@dataclass(frozen=True)
class Event:
    """One KV event. ``kind`` is "block_stored", "block_removed" or "all_blocks_cleared";
    hashes are the documented 64-bit integers."""

    sequence: int
    kind: str
    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: list[int] | None = None
    block_size: int = 0
    group_idx: int = 0
    spec_kind: str = ""
    sliding_window: int = 0
    lora_name: str = ""


class CacheError(Exception):
    """A failed call: ``code`` (grpc.StatusCode), ``message``, and ``field`` — the first
    field named by the server's BadRequest detail ("" if none)."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str = "") -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.field = field

    @classmethod
    def from_rpc(cls, exc: grpc.RpcError) -> "CacheError":
        field = ""
        try:
            status = rpc_status.from_call(exc)  # type: ignore[arg-type]
        except Exception:  # aio errors may not carry trailers in every state
            status = None
        if status is not None:
            from cache_service._errors import field_violations
            violations = field_violations(status)
            if violations:
                field = violations[0][0]
        return cls(exc.code(), exc.details() or "", field)


def _tables(tables: Iterable[pb.BlockTable]) -> list[list[int]]:
    return [list(t.block_ids) for t in tables]


def _op_result(r: pb.OpResult) -> OpResult:
    kind = r.WhichOneof("result")
    if kind == "allocate":
        return AllocateResult(r.allocate)
    if kind == "decode":
        return DecodeResult(r.decode)
    if kind == "add_request":
        return AddResult(r.add_request.num_tokens, r.add_request.num_block_hashes)
    if kind == "append_tokens":
        return AppendResult(r.append_tokens.num_tokens, r.append_tokens.num_block_hashes)
    if kind == "lookup":
        return LookupResult(r.lookup)
    if kind == "free":
        return FreeResult(r.free.num_free_blocks)
    if kind == "preempt":
        return PreemptResult(r.preempt.num_free_blocks)
    return NewStepResult()


def step_result(resp: pb.StepResponse) -> StepResult:
    return StepResult([_op_result(r) for r in resp.results], resp.num_free_blocks)


def _pool_info(cfg: pb.PoolConfig, created: bool = False) -> PoolInfo:
    return PoolInfo(
        cfg.pool_id, cfg.num_blocks,
        [GroupInfo(g.index, list(g.layer_names), _KIND_NAMES.get(g.kind, ""), g.block_size,
                   g.sliding_window, g.attention_chunk_size, g.page_size_bytes)
         for g in cfg.groups],
        cfg.page_size_bytes, cfg.scheduler_block_size, cfg.hash_block_size, created, cfg,
        cfg.layer_page_size_bytes)


def _stats(s: pb.PoolStats) -> PoolStats:
    return PoolStats(s.num_blocks, s.num_free_blocks, s.num_cached_blocks, s.usage,
                     s.num_requests, s.prefix_cache_queries, s.prefix_cache_hits, s.evictions,
                     s.allocation_failures, s.preemptions,
                     [g.num_cached_blocks for g in s.groups], s.last_event_sequence)


def _event(e: pb.KVEvent) -> Event:
    kind = e.WhichOneof("event")
    if kind == "block_stored":
        s = e.block_stored
        return Event(e.sequence, kind, list(s.block_hashes),
                     s.parent_block_hash if s.HasField("parent_block_hash") else None,
                     list(s.token_ids), s.block_size, s.group_idx,
                     _KIND_NAMES.get(s.kind, ""), s.sliding_window, s.lora_name)
    if kind == "block_removed":
        return Event(e.sequence, kind, list(e.block_removed.block_hashes),
                     group_idx=e.block_removed.group_idx)
    return Event(e.sequence, "all_blocks_cleared", [])


def register_request(pool_id: str, layer_specs: Sequence[pb.LayerSpec], *,
                     num_blocks: int | None = None,
                     available_memory_bytes: int | None = None, max_model_len: int,
                     enable_caching: bool = True, hash_algo: str = "sha256",
                     watermark: float = 0.0, vocab_size: int | None = None,
                     scheduler_block_size: int | None = None,
                     hash_block_size: int | None = None,
                     max_in_flight_tokens: int | None = None, enable_events: bool = True,
                     hybrid: bool = True,
                     skip_capacity_check: bool = False) -> pb.RegisterPoolRequest:
    """The RegisterPool message for the keyword arguments of ``register_pool``."""
    if (num_blocks is None) == (available_memory_bytes is None):
        raise ValueError("give exactly one of num_blocks and available_memory_bytes")
    options = pb.PoolOptions(
        max_model_len=max_model_len, enable_caching=enable_caching,
        hash_algo=_HASH_ALGOS[hash_algo], watermark=watermark, vocab_size=vocab_size or 0,
        scheduler_block_size=scheduler_block_size or 0, hash_block_size=hash_block_size or 0,
        max_in_flight_tokens=max_in_flight_tokens or 0, enable_events=enable_events,
        hybrid=hybrid, skip_capacity_check=skip_capacity_check)
    req = pb.RegisterPoolRequest(pool_id=pool_id, layers=layer_specs, options=options)
    if num_blocks is not None:
        req.num_blocks = num_blocks
    else:
        req.available_memory_bytes = available_memory_bytes  # type: ignore[assignment]
    return req


def _peek_request(pool_ids: Sequence[str], token_ids: Sequence[int],
                  block_hashes: Sequence[bytes], cache_salt: str | None,
                  lora_name: str | None, lora_path: str | None) -> pb.PeekPrefixRequest:
    return pb.PeekPrefixRequest(pool_ids=pool_ids, token_ids=token_ids,
                                block_hashes=block_hashes, cache_salt=cache_salt or "",
                                lora_name=lora_name or "", lora_path=lora_path or "")


def _decode_request(pool_id: str, request_ids: Sequence[str], token_ids: Sequence[int],
                    begin_step: bool) -> pb.StepRequest:
    req = pb.StepRequest(pool_id=pool_id, begin_step=begin_step)
    m = req.ops.add().decode
    m.request_ids.extend(request_ids)
    m.token_ids.extend(token_ids)
    return req


def _metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def _credentials(tls: bool, root_certificates: bytes | None) -> grpc.ChannelCredentials | None:
    if not tls and root_certificates is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=root_certificates)


_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30000),
    ("grpc.keepalive_timeout_ms", 10000),
    # Reconnect within 2 s once a restarted server is back (gRPC's default backoff grows
    # to 2 minutes, longer than any retry budget here).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


# ---------------------------------------------------------------------------------------
# Async client
# ---------------------------------------------------------------------------------------

class AsyncCacheClient:
    """grpc.aio client. ``target`` is ``host:port``; ``token`` adds a bearer token;
    ``tls=True`` (or ``root_certificates``) uses TLS. Use as ``async with``."""

    def __init__(self, target: str, *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, default_timeout: float = 10.0,
                 max_retries: int = 4, backoff_base: float = 0.05, backoff_max: float = 1.0,
                 ssl_target_name_override: str | None = None) -> None:
        options = list(_CHANNEL_OPTIONS)
        if ssl_target_name_override:
            options.append(("grpc.ssl_target_name_override", ssl_target_name_override))
        creds = _credentials(tls, root_certificates)
        self._channel = (grpc.aio.secure_channel(target, creds, options=options) if creds
                         else grpc.aio.insecure_channel(target, options=options))
        self._stub = pb_grpc.CacheServiceStub(self._channel)
        self._metadata = _metadata(token)
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
        return _pool_info(resp.config, resp.created)

    async def get_pool(self, pool_id: str, *, timeout: float | None = None) -> PoolInfo:
        resp = await self._call(self._stub.GetPool, pb.GetPoolRequest(pool_id=pool_id), timeout)
        return _pool_info(resp.config)

    async def list_pools(self, *, timeout: float | None = None) -> list[PoolInfo]:
        resp = await self._call(self._stub.ListPools, pb.ListPoolsRequest(), timeout)
        return [_pool_info(c) for c in resp.pools]

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
        resp = await self._call(self._stub.Step, _decode_request(
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
        resp = await self._call(self._stub.PeekPrefix, _peek_request(
            pool_ids, token_ids, block_hashes, cache_salt, lora_name, lora_path), timeout)
        return {h.pool_id: h.hit_tokens for h in resp.hits}

    async def get_request(self, pool_id: str, request_id: str, *,
                          timeout: float | None = None) -> RequestState:
        r = await self._call(self._stub.GetRequest, pb.GetRequestRequest(
            pool_id=pool_id, request_id=request_id), timeout)
        return RequestState(_tables(r.block_ids), r.num_computed_tokens, r.num_tokens,
                            r.num_block_hashes, r.status, r.num_preemptions)

    async def stats(self, pool_id: str, *, timeout: float | None = None) -> PoolStats:
        r = await self._call(self._stub.GetPoolStats, pb.GetPoolStatsRequest(pool_id=pool_id),
                             timeout)
        return _stats(r.stats)

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
                    yield _event(e)
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
        trailing = await self._call.trailing_metadata()
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)

    async def close(self) -> None:
        try:
            await self._call.done_writing()
        except Exception:  # already finished
            pass
        self._call.cancel()


# ---------------------------------------------------------------------------------------
# Blocking client
# ---------------------------------------------------------------------------------------

class CacheClient:
    """The blocking twin of :class:`AsyncCacheClient` (same methods, no ``await``)."""

    def __init__(self, target: str, *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, default_timeout: float = 10.0,
                 max_retries: int = 4, backoff_base: float = 0.05, backoff_max: float = 1.0,
                 ssl_target_name_override: str | None = None) -> None:
        options = list(_CHANNEL_OPTIONS)
        if ssl_target_name_override:
            options.append(("grpc.ssl_target_name_override", ssl_target_name_override))
        creds = _credentials(tls, root_certificates)
        self._channel = (grpc.secure_channel(target, creds, options=options) if creds
                         else grpc.insecure_channel(target, options=options))
        self._stub = pb_grpc.CacheServiceStub(self._channel)
        self._metadata = _metadata(token)
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
        return _pool_info(resp.config, resp.created)

    def get_pool(self, pool_id: str, *, timeout: float | None = None) -> PoolInfo:
        return _pool_info(self._call(self._stub.GetPool, pb.GetPoolRequest(pool_id=pool_id),
                                     timeout).config)

    def list_pools(self, *, timeout: float | None = None) -> list[PoolInfo]:
        return [_pool_info(c) for c in
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
        resp = self._call(self._stub.Step, _decode_request(
            pool_id, request_ids, token_ids, begin_step), timeout)
        return DecodeResult(resp.results[0].decode)

    def step_stream(self) -> "StepStream":
        return StepStream(self._stub.StepStream, self._metadata)

    def peek_prefix(self, pool_ids: Sequence[str], token_ids: Sequence[int] = (), *,
                    block_hashes: Sequence[bytes] = (), cache_salt: str | None = None,
                    lora_name: str | None = None,
                    timeout: float | None = None,
                    lora_path: str | None = None) -> dict[str, int]:
        resp = self._call(self._stub.PeekPrefix, _peek_request(
            pool_ids, token_ids, block_hashes, cache_salt, lora_name, lora_path), timeout)
        return {h.pool_id: h.hit_tokens for h in resp.hits}

    def get_request(self, pool_id: str, request_id: str, *,
                    timeout: float | None = None) -> RequestState:
        r = self._call(self._stub.GetRequest, pb.GetRequestRequest(
            pool_id=pool_id, request_id=request_id), timeout)
        return RequestState(_tables(r.block_ids), r.num_computed_tokens, r.num_tokens,
                            r.num_block_hashes, r.status, r.num_preemptions)

    def stats(self, pool_id: str, *, timeout: float | None = None) -> PoolStats:
        return _stats(self._call(self._stub.GetPoolStats,
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
                    yield _event(e)
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
