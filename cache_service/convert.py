"""Protocol messages <-> allocator core objects: the ONE mapping place.

Everything that turns a ``kvcache.v1`` message into core arguments (and back) lives here,
including the field-level validation that the core cannot name in protocol terms
(``layers[2].kind``). Errors are core errors whose ``field`` is the protocol path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from cache_service.core import events as ev
from cache_service.core import grouping
from cache_service.core.errors import InvalidArgument, KVCacheError
from cache_service.core.hashing import external_block_hash
from cache_service.core.pool import PoolOptions
from cache_service.core.residency import GroupResidency
from cache_service.core.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    layer_spec,
)
from cache_service.registry import PoolDescription, PoolEntry
from cache_service.status import qualify
from cache_service.client._builders import layers
from kvcache_common.enums import HASH_ALGOS, LAYER_KINDS, MAMBA_CACHE_MODES, MISS_REASONS

_ATTENTION_CLASSES: dict[int, type] = {
    pb.LAYER_KIND_FULL_ATTENTION: FullAttentionSpec,
    pb.LAYER_KIND_SLIDING_WINDOW: SlidingWindowSpec,
    pb.LAYER_KIND_CHUNKED_LOCAL_ATTENTION: ChunkedLocalAttentionSpec,
    pb.LAYER_KIND_CROSS_ATTENTION: CrossAttentionSpec,
}
# Bounds that keep arithmetic sane and memory bounded for hostile input.
MAX_COUNT = 1 << 40


def _non_negative(value: int, field: str, *, positive: bool = False,
                  limit: int = MAX_COUNT) -> int:
    if value < (1 if positive else 0) or value > limit:
        what = "positive" if positive else "non-negative"
        raise InvalidArgument(f"must be {what} and at most {limit}, got {value}", field=field)
    return value


# ---------------------------------------------------------------------------------------
# RegisterPool
# ---------------------------------------------------------------------------------------

def layer_spec_from_proto(layer: pb.LayerSpec, path: str) -> KVCacheSpec:
    """The core spec of one ``LayerSpec`` (errors name ``path.<field>``)."""
    kind = layer.kind
    _non_negative(layer.block_size, f"{path}.block_size", positive=True)
    _non_negative(layer.page_size_padded, f"{path}.page_size_padded")
    if kind != pb.LAYER_KIND_SLIDING_WINDOW and layer.sliding_window:
        raise InvalidArgument("only sliding_window layers take a window",
                              field=f"{path}.sliding_window")
    if kind != pb.LAYER_KIND_CHUNKED_LOCAL_ATTENTION and layer.attention_chunk_size:
        raise InvalidArgument("only chunked_local_attention layers take a chunk size",
                              field=f"{path}.attention_chunk_size")
    padded = layer.page_size_padded or None
    try:
        if kind == pb.LAYER_KIND_MAMBA:
            if not layer.mamba_states:
                raise InvalidArgument("a mamba layer needs at least one state tensor",
                                      field="mamba_states")
            shapes = []
            for j, state in enumerate(layer.mamba_states):
                if not state.shape:
                    raise InvalidArgument("empty shape", field=f"mamba_states[{j}].shape")
                for k, dim in enumerate(state.shape):
                    _non_negative(dim, f"mamba_states[{j}].shape[{k}]", positive=True,
                                  limit=1 << 31)
                shapes.append(tuple(state.shape))
            if layer.mamba_cache_mode and not MAMBA_CACHE_MODES.name(layer.mamba_cache_mode):
                raise InvalidArgument(f"unknown mamba_cache_mode {layer.mamba_cache_mode}",
                                      field="mamba_cache_mode")
            return MambaSpec(
                block_size=layer.block_size, shapes=tuple(shapes),
                dtypes=tuple(s.dtype for s in layer.mamba_states), page_size_padded=padded,
                mamba_type=layer.mamba_type or "mamba2",
                mamba_cache_mode=MAMBA_CACHE_MODES.name(layer.mamba_cache_mode) or "none")
        cls = _ATTENTION_CLASSES.get(kind)
        if cls is None:
            raise InvalidArgument(f"kind must be one of {sorted(LAYER_KINDS.names())}, got {kind}",
                                  field="kind")
        if layer.mamba_states:
            raise InvalidArgument("only mamba layers take state tensors", field="mamba_states")
        _non_negative(layer.num_kv_heads, "num_kv_heads", positive=True, limit=1 << 20)
        _non_negative(layer.head_size, "head_size", positive=True, limit=1 << 20)
        _non_negative(layer.head_size_v, "head_size_v", limit=1 << 20)
        kwargs: dict[str, Any] = dict(
            block_size=layer.block_size, num_kv_heads=layer.num_kv_heads,
            head_size=layer.head_size, dtype=layer.dtype or "bfloat16",
            head_size_v=layer.head_size_v or None, page_size_padded=padded)
        if kind == pb.LAYER_KIND_SLIDING_WINDOW:
            kwargs["sliding_window"] = _non_negative(layer.sliding_window, "sliding_window",
                                                     positive=True)
        elif kind == pb.LAYER_KIND_CHUNKED_LOCAL_ATTENTION:
            kwargs["attention_chunk_size"] = _non_negative(
                layer.attention_chunk_size, "attention_chunk_size", positive=True)
        return cls(**kwargs)
    except KVCacheError as exc:
        if exc.field.startswith(path):
            raise
        raise qualify(exc, path) from None


def options_from_proto(opts: pb.PoolOptions) -> tuple[PoolOptions, bool]:
    """Core pool options and the ``hybrid`` flag from ``PoolOptions`` (the service-only
    ``skip_capacity_check`` is read by :func:`description_from_proto`)."""
    p = "options"
    _non_negative(opts.max_model_len, f"{p}.max_model_len", positive=True, limit=1 << 31)
    for name in ("scheduler_block_size", "hash_block_size", "max_in_flight_tokens"):
        _non_negative(getattr(opts, name), f"{p}.{name}", limit=1 << 31)
    _non_negative(opts.vocab_size, f"{p}.vocab_size", limit=1 << 40)
    if not 0.0 <= opts.watermark < 1.0:  # also rejects NaN
        raise InvalidArgument(f"must be in [0, 1), got {opts.watermark}",
                              field=f"{p}.watermark")
    if opts.hash_algo and not HASH_ALGOS.name(opts.hash_algo):
        raise InvalidArgument(f"unknown hash_algo {opts.hash_algo}", field=f"{p}.hash_algo")
    core = PoolOptions(
        max_model_len=opts.max_model_len,
        enable_caching=opts.enable_caching if opts.HasField("enable_caching") else True,
        hash_algo=HASH_ALGOS.name(opts.hash_algo) or "sha256",
        scheduler_block_size=opts.scheduler_block_size or None,
        hash_block_size=opts.hash_block_size or None,
        watermark=opts.watermark,
        max_in_flight_tokens=opts.max_in_flight_tokens or None,
        enable_events=opts.enable_events if opts.HasField("enable_events") else True,
        vocab_size=opts.vocab_size or None,
    )
    return core, opts.hybrid if opts.HasField("hybrid") else True


def options_to_proto(opts: PoolOptions, hybrid: bool,
                     skip_capacity_check: bool = False) -> pb.PoolOptions:
    return pb.PoolOptions(skip_capacity_check=skip_capacity_check,
        max_model_len=opts.max_model_len, enable_caching=opts.enable_caching,
        hash_algo=HASH_ALGOS.value(opts.hash_algo),
        scheduler_block_size=opts.scheduler_block_size or 0,
        hash_block_size=opts.hash_block_size or 0, watermark=opts.watermark,
        max_in_flight_tokens=opts.max_in_flight_tokens or 0,
        enable_events=opts.enable_events, vocab_size=opts.vocab_size or 0, hybrid=hybrid)


def description_from_proto(req: pb.RegisterPoolRequest) -> PoolDescription:
    """The pool description of a RegisterPool call (validated field by field)."""
    if not req.HasField("options"):
        raise InvalidArgument("options (with max_model_len) is required", field="options")
    if not req.layers:
        raise InvalidArgument("at least one layer is required", field="layers")
    layers = tuple((layer.name, layer_spec_from_proto(layer, f"layers[{i}]"))
                   for i, layer in enumerate(req.layers))
    budget = req.WhichOneof("budget")
    if budget is None:
        raise InvalidArgument("give available_memory_bytes or num_blocks", field="budget")
    options, hybrid = options_from_proto(req.options)
    skip = req.options.skip_capacity_check
    if budget == "num_blocks":
        _non_negative(req.num_blocks, "num_blocks", limit=1 << 31)
        if req.num_blocks < 2:
            raise InvalidArgument("must be >= 2 (block 0 is the null block)",
                                  field="num_blocks")
        return PoolDescription(layers, options, num_blocks=req.num_blocks, hybrid=hybrid,
                               skip_capacity_check=skip)
    _non_negative(req.available_memory_bytes, "available_memory_bytes", positive=True,
                  limit=1 << 60)
    return PoolDescription(layers, options, available_memory_bytes=req.available_memory_bytes,
                           hybrid=hybrid, skip_capacity_check=skip)


def layer_page_size_bytes(group: Any) -> int:
    """Bytes of one block in ONE layer of a group: its layers' largest page (they differ
    only in a uniform-type group, whose spec's page is the sum over its layers)."""
    return max(layer_spec(group.spec, name).page_size_bytes for name in group.layer_names)


def group_to_proto(index: int, group: Any) -> pb.KVCacheGroup:
    spec = group.spec
    out = pb.KVCacheGroup(index=index, layer_names=list(group.layer_names),
                          kind=LAYER_KINDS.value(spec.kind), block_size=spec.block_size,
                          page_size_bytes=layer_page_size_bytes(group))
    window = getattr(spec, "sliding_window", None)
    if window:
        out.sliding_window = window
    chunk = getattr(spec, "attention_chunk_size", None)
    if chunk:
        out.attention_chunk_size = chunk
    if isinstance(spec, MambaSpec):
        out.mamba_cache_mode = MAMBA_CACHE_MODES.value(spec.mamba_cache_mode)
    return out


def pool_config_to_proto(entry: PoolEntry) -> pb.PoolConfig:
    """The ``PoolConfig`` of a registered pool."""
    config: KVCacheConfig = entry.config
    pool = entry.pool
    desc = entry.description
    groups = [group_to_proto(i, g) for i, g in enumerate(config.groups)]
    return pb.PoolConfig(
        pool_id=entry.pool_id, num_blocks=config.num_blocks, groups=groups,
        page_size_bytes=grouping.page_size_bytes(config),
        layer_page_size_bytes=max((g.page_size_bytes for g in groups), default=0),
        scheduler_block_size=pool.scheduler_block_size, hash_block_size=pool.hash_block_size,
        options=options_to_proto(pool.options, desc.hybrid, desc.skip_capacity_check),
        layers=[layers.from_spec(name, spec) for name, spec in desc.layers])


# ---------------------------------------------------------------------------------------
# Results and events
# ---------------------------------------------------------------------------------------

def tables(block_ids: Sequence[Sequence[int]] | None) -> list[pb.BlockTable]:
    """Per-group block tables (none for None)."""
    if not block_ids:
        return []
    return [pb.BlockTable(block_ids=ids) for ids in block_ids]


def stats_to_proto(s: Any, last_sequence: int) -> pb.PoolStats:
    """``PoolStats`` message from the core's stats object."""
    return pb.PoolStats(
        num_blocks=s.num_blocks, num_free_blocks=s.num_free_blocks,
        num_cached_blocks=s.num_cached_blocks, usage=s.usage, num_requests=s.num_requests,
        prefix_cache_queries=s.prefix_queries + s.preempted_prefix_queries,
        prefix_cache_hits=s.prefix_hits + s.preempted_prefix_hits,
        evictions=s.evictions, allocation_failures=s.allocation_failures,
        preemptions=s.preemptions,
        groups=[pb.GroupStats(index=i, num_cached_blocks=n)
                for i, n in enumerate(s.num_cached_blocks_per_group)],
        last_event_sequence=last_sequence)


def write_residency(out: Any, groups: Sequence[GroupResidency]) -> None:
    """Appends ``GroupResidency`` messages to the repeated field ``out``."""
    for g in groups:
        m = out.add()
        m.group_idx = g.group_idx
        m.kind = LAYER_KINDS.value(g.kind)
        m.tokens = g.tokens
        m.blocks = g.blocks
        if g.checkpoints:
            m.checkpoint_tokens.extend(g.checkpoints)
        if g.reason is not None:
            m.miss_reason = MISS_REASONS.value(g.reason.value)
            m.evicted_removals_ago = g.evicted_removals_ago


def snapshot_to_proto(pool: Any, sequence: int) -> pb.GetPrefixSnapshotResponse:
    """A pool's cached hashes per group (64-bit, as in the events) at ``sequence``."""
    out = pb.GetPrefixSnapshotResponse(sequence=sequence)
    for gid, hashes in enumerate(pool.prefix_snapshot()):
        spec = pool.config.groups[gid].spec
        g = out.groups.add(group_idx=gid, kind=LAYER_KINDS.value(spec.kind),
                           block_size=spec.block_size)
        g.block_hashes.extend([external_block_hash(h) for h in hashes])
    return out


def event_to_proto(sequence: int, event: ev.KVEvent) -> pb.KVEvent:
    """One sequenced ``KVEvent``."""
    if isinstance(event, ev.BlockStored):
        stored = pb.BlockStored(
            block_hashes=event.block_hashes, token_ids=event.token_ids,
            block_size=event.block_size, lora_name=event.lora_name or "",
            group_idx=event.group_idx, kind=LAYER_KINDS.value(event.spec_kind) if event.spec_kind else 0,
            sliding_window=event.sliding_window or 0, medium=event.medium)
        if event.parent_block_hash is not None:
            stored.parent_block_hash = event.parent_block_hash
        return pb.KVEvent(sequence=sequence, block_stored=stored)
    if isinstance(event, ev.BlockRemoved):
        return pb.KVEvent(sequence=sequence, block_removed=pb.BlockRemoved(
            block_hashes=event.block_hashes, group_idx=event.group_idx, medium=event.medium))
    return pb.KVEvent(sequence=sequence, all_blocks_cleared=pb.AllBlocksCleared())
