"""Layer specs <-> ``LayerSpec`` messages: the one mapping of the core's spec objects to
the protocol and back, used by the server (RegisterPool, and the layers a PoolConfig
echoes), the clients (:meth:`cache_service.client.layers.from_spec`) and the executor
(which sizes its cache with the core's spec arithmetic and registers those specs).

It imports only the core and the generated messages, so a client imports it without the
server. Enum values go through :mod:`kvcache_common.enums` (names as the core spells them).
Errors are core errors whose ``field`` is the protocol path (``layers[2].kind``).
"""

from __future__ import annotations

from typing import Any, cast

from cache_service.core.errors import InvalidArgument, KVCacheError, qualify
from cache_service.core.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaCacheMode,
    MambaSpec,
    RSWASpec,
    SlidingWindowSpec,
)
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.enums import LAYER_KINDS, MAMBA_CACHE_MODES

_ATTENTION_CLASSES: dict[int, type] = {
    pb.LAYER_KIND_FULL_ATTENTION: FullAttentionSpec,
    pb.LAYER_KIND_SLIDING_WINDOW: SlidingWindowSpec,
    pb.LAYER_KIND_CHUNKED_LOCAL_ATTENTION: ChunkedLocalAttentionSpec,
    pb.LAYER_KIND_CROSS_ATTENTION: CrossAttentionSpec,
    pb.LAYER_KIND_RSWA: RSWASpec,
    pb.LAYER_KIND_CIRCULAR_BUFFER: CircularBufferSpec,
}
# Bounds that keep arithmetic sane and memory bounded for hostile input.
MAX_COUNT = 1 << 40
#: The largest page one layer may have (1 TiB per block); every byte count of a pool
#: (summed pages, memory budgets) then stays far inside the int64 fields of PoolConfig.
MAX_PAGE_BYTES = 1 << 40


def non_negative(value: int, field: str, *, positive: bool = False,
                  limit: int = MAX_COUNT) -> int:
    """``value`` if it lies in ``[0 or 1, limit]``; else INVALID_ARGUMENT naming ``field``."""
    if value < (1 if positive else 0) or value > limit:
        what = "positive" if positive else "non-negative"
        raise InvalidArgument(f"must be {what} and at most {limit}, got {value}", field=field)
    return value


def layer_spec_from_proto(layer: pb.LayerSpec, path: str) -> KVCacheSpec:
    """The core spec of one ``LayerSpec`` (errors name ``path.<field>``)."""
    kind = layer.kind
    non_negative(layer.block_size, f"{path}.block_size", positive=True)
    non_negative(layer.page_size_padded, f"{path}.page_size_padded")
    if kind != pb.LAYER_KIND_SLIDING_WINDOW and layer.sliding_window:
        raise InvalidArgument("only sliding_window layers take a window",
                              field=f"{path}.sliding_window")
    if kind != pb.LAYER_KIND_CHUNKED_LOCAL_ATTENTION and layer.attention_chunk_size:
        raise InvalidArgument("only chunked_local_attention layers take a chunk size",
                              field=f"{path}.attention_chunk_size")
    if kind != pb.LAYER_KIND_RSWA and layer.rswa_window:
        raise InvalidArgument("only rswa layers take an rswa_window",
                              field=f"{path}.rswa_window")
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
                elements = 1
                for k, dim in enumerate(state.shape):
                    non_negative(dim, f"mamba_states[{j}].shape[{k}]", positive=True,
                                  limit=1 << 31)
                    # Checked as the product grows: a long shape must not cost big-int
                    # arithmetic before it is rejected.
                    elements *= dim
                    if elements > MAX_PAGE_BYTES:
                        raise InvalidArgument(
                            f"the state has more than {MAX_PAGE_BYTES} elements",
                            field=f"mamba_states[{j}].shape")
                shapes.append(tuple(state.shape))
            if layer.mamba_cache_mode and not MAMBA_CACHE_MODES.name(layer.mamba_cache_mode):
                raise InvalidArgument(f"unknown mamba_cache_mode {layer.mamba_cache_mode}",
                                      field="mamba_cache_mode")
            return _bounded_page(MambaSpec(
                block_size=layer.block_size, shapes=tuple(shapes),
                dtypes=tuple(s.dtype for s in layer.mamba_states), page_size_padded=padded,
                mamba_type=layer.mamba_type or "mamba2",
                # A name of the proto enum (checked above); MambaSpec checks it is one it knows.
                mamba_cache_mode=cast(MambaCacheMode,
                                      MAMBA_CACHE_MODES.name(layer.mamba_cache_mode) or "none")),
                "mamba_states")
        cls = _ATTENTION_CLASSES.get(kind)
        if cls is None:
            raise InvalidArgument(f"kind must be one of {sorted(LAYER_KINDS.names())}, got {kind}",
                                  field="kind")
        if layer.mamba_states:
            raise InvalidArgument("only mamba layers take state tensors", field="mamba_states")
        non_negative(layer.num_kv_heads, "num_kv_heads", positive=True, limit=1 << 20)
        non_negative(layer.head_size, "head_size", positive=True, limit=1 << 20)
        non_negative(layer.head_size_v, "head_size_v", limit=1 << 20)
        kwargs: dict[str, Any] = dict(
            block_size=layer.block_size, num_kv_heads=layer.num_kv_heads,
            head_size=layer.head_size, dtype=layer.dtype or "bfloat16",
            head_size_v=layer.head_size_v or None, page_size_padded=padded)
        if kind == pb.LAYER_KIND_SLIDING_WINDOW:
            kwargs["sliding_window"] = non_negative(layer.sliding_window, "sliding_window",
                                                     positive=True)
        elif kind == pb.LAYER_KIND_CHUNKED_LOCAL_ATTENTION:
            kwargs["attention_chunk_size"] = non_negative(
                layer.attention_chunk_size, "attention_chunk_size", positive=True)
        elif kind == pb.LAYER_KIND_RSWA:
            kwargs["rswa_window"] = non_negative(layer.rswa_window, "rswa_window",
                                                  positive=True)
        return _bounded_page(cls(**kwargs), "block_size")
    except KVCacheError as exc:
        if exc.field.startswith(path):
            raise
        raise qualify(exc, path) from None


def _bounded_page(spec: KVCacheSpec, field: str) -> KVCacheSpec:
    """``spec`` if its page fits :data:`MAX_PAGE_BYTES`; else INVALID_ARGUMENT naming
    ``field`` (the factor of the page product that is not bounded on its own)."""
    if spec.page_size_bytes > MAX_PAGE_BYTES:
        raise InvalidArgument(f"the page of this layer is {spec.page_size_bytes} bytes, more "
                              f"than the limit of {MAX_PAGE_BYTES}", field=field)
    return spec


def layer_spec_to_proto(name: str, spec: KVCacheSpec) -> pb.LayerSpec:
    """The ``LayerSpec`` message of a core layer spec (defaults filled in): how the
    executor describes its layers, and how the service echoes registered layers back.
    :func:`layer_spec_from_proto` of it gives ``spec`` again."""
    out = pb.LayerSpec(name=name, kind=LAYER_KINDS.value(spec.kind),
                       block_size=spec.block_size,
                       page_size_padded=getattr(spec, "page_size_padded", None) or 0)
    if isinstance(spec, MambaSpec):
        out.mamba_states.extend(pb.MambaState(shape=list(s), dtype=d)
                                for s, d in zip(spec.shapes, spec.dtypes))
        out.mamba_cache_mode = MAMBA_CACHE_MODES.value(spec.mamba_cache_mode)
        out.mamba_type = spec.mamba_type
        return out
    assert isinstance(spec, AttentionSpec)
    out.num_kv_heads = spec.num_kv_heads
    out.head_size = spec.head_size
    out.head_size_v = spec.head_size_v or 0
    out.dtype = spec.dtype
    if isinstance(spec, SlidingWindowSpec):
        out.sliding_window = spec.sliding_window
    if isinstance(spec, ChunkedLocalAttentionSpec):
        out.attention_chunk_size = spec.attention_chunk_size
    if isinstance(spec, RSWASpec):
        out.rswa_window = spec.rswa_window
    return out
