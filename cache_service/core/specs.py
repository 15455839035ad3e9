"""Per-layer KV-cache specs (vLLM ``kv_cache_interface``), as frozen value objects.

A spec says how one layer uses the block pool: how many tokens a block holds
(``block_size``), how many bytes one block of this layer takes (``page_size_bytes``)
and the worst-case bytes one request can need (``max_memory_usage_bytes``).
Equality and hashing are by fields, so layers with equal specs can share a group.

Dtypes are named by strings (``"bfloat16"``, ``"float32"``, ...) so that the core
needs no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from cache_service.core.errors import ConfigError

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
    "int8": 1,
    "uint8": 1,
}


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ConfigError(
            f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}", field="dtype"
        ) from None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class SizingLimits:
    """What bounds a request's worst-case memory: the model length, the tokens one request
    may have in flight (chunked prefill budget), and encoder inputs (cross attention)."""

    max_model_len: int
    max_in_flight_tokens: int | None = None  # None -> max_model_len
    max_num_encoder_input_tokens: int = 0

    @property
    def in_flight(self) -> int:
        return self.max_model_len if self.max_in_flight_tokens is None else self.max_in_flight_tokens


@dataclass(frozen=True)
class KVCacheSpec:
    """Base of all specs. ``kind`` is the string used in KV events and the protocol."""

    kind: ClassVar[str] = ""
    block_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ConfigError(f"block_size must be a positive integer, got {self.block_size!r}",
                              field="block_size")

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError

    def max_memory_usage_bytes(self, limits: SizingLimits) -> int:
        raise NotImplementedError

    def with_block_size(self, block_size: int) -> "KVCacheSpec":
        from dataclasses import replace

        return replace(self, block_size=block_size)


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    """K and V pages of one attention layer. ``page_size_padded`` overrides the page size
    (it must not be smaller than the unpadded one)."""

    num_kv_heads: int = 1
    head_size: int = 1
    dtype: str = "bfloat16"
    head_size_v: int | None = None
    page_size_padded: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_kv_heads", "head_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive", field=name)
        dtype_bytes(self.dtype)
        if self.page_size_padded is not None and self.page_size_padded < self.real_page_size_bytes:
            raise ConfigError("page_size_padded is smaller than the unpadded page",
                              field="page_size_padded")

    @property
    def real_page_size_bytes(self) -> int:
        hv = self.head_size if self.head_size_v is None else self.head_size_v
        return self.num_kv_heads * self.block_size * (self.head_size + hv) * dtype_bytes(self.dtype)

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded if self.page_size_padded is not None else self.real_page_size_bytes


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Full (global) attention. ``sliding_window`` / ``attention_chunk_size`` are only set
    when local layers were *promoted* to full because the hybrid manager is disabled."""

    kind: ClassVar[str] = "full_attention"
    sliding_window: int | None = None
    attention_chunk_size: int | None = None

    def max_memory_usage_bytes(self, limits: SizingLimits) -> int:
        return cdiv(limits.max_model_len, self.block_size) * self.page_size_bytes


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """A window of W tokens *including* the current one: keys pos-W+1 .. pos."""

    kind: ClassVar[str] = "sliding_window"
    sliding_window: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window <= 0:
            raise ConfigError("sliding_window must be positive", field="sliding_window")

    def max_admission_blocks(self, limits: SizingLimits) -> int:
        # +1: the window need not start on a block boundary.
        tokens = min(self.sliding_window - 1 + limits.in_flight, limits.max_model_len)
        return cdiv(tokens, self.block_size) + 1

    def max_memory_usage_bytes(self, limits: SizingLimits) -> int:
        return self.max_admission_blocks(limits) * self.page_size_bytes


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Attention within fixed chunks of ``attention_chunk_size`` tokens (Llama-4 style)."""

    kind: ClassVar[str] = "chunked_local_attention"
    attention_chunk_size: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.attention_chunk_size <= 0:
            raise ConfigError("attention_chunk_size must be positive", field="attention_chunk_size")

    def max_admission_blocks(self, limits: SizingLimits) -> int:
        tokens = min(self.attention_chunk_size + limits.in_flight, limits.max_model_len)
        return cdiv(tokens, self.block_size)

    def max_memory_usage_bytes(self, limits: SizingLimits) -> int:
        return self.max_admission_blocks(limits) * self.page_size_bytes


@dataclass(frozen=True)
class CrossAttentionSpec(AttentionSpec):
    """Encoder-decoder cross attention: sized from encoder tokens, never prefix cached."""

    kind: ClassVar[str] = "cross_attention"

    def max_memory_usage_bytes(self, limits: SizingLimits) -> int:
        return cdiv(limits.max_num_encoder_input_tokens, self.block_size) * self.page_size_bytes


MambaCacheMode = Literal["none", "align"]


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """Recurrent state (conv + SSM) of one Mamba layer; one block holds one whole state.

    ``"none"``: no prefix caching, one state block per request (block_size is usually
    max_model_len). ``"align"``: a state checkpoint per block of ``block_size`` tokens,
    cached only where a chunk ends on a block boundary.
    """

    kind: ClassVar[str] = "mamba"
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    page_size_padded: int | None = None
    mamba_type: str = "mamba2"
    mamba_cache_mode: MambaCacheMode = "none"
    num_speculative_blocks: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.shapes) != len(self.dtypes):
            raise ConfigError("shapes and dtypes must have the same length", field="dtypes")
        for d in self.dtypes:
            dtype_bytes(d)
        if self.mamba_cache_mode not in ("none", "align"):
            raise ConfigError(f"mamba_cache_mode must be 'none' or 'align', got "
                              f"{self.mamba_cache_mode!r}", field="mamba_cache_mode")
        if self.page_size_padded is not None and self.page_size_padded < self.real_page_size_bytes:
            raise ConfigError("page_size_padded is smaller than the state size",
                              field="page_size_padded")

    @property
    def real_page_size_bytes(self) -> int:
        return sum(math.prod(s) * dtype_bytes(d) for s, d in zip(self.shapes, self.dtypes))

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded if self.page_size_padded is not None else self.real_page_size_bytes

    def max_memory_usage_bytes(self, limits: SizingLimits) -> int:
        blocks = (2 if self.mamba_cache_mode == "align" else 1) + self.num_speculative_blocks
        return self.page_size_bytes * blocks


SPEC_KINDS: dict[str, type[KVCacheSpec]] = {
    cls.kind: cls
    for cls in (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec,
                CrossAttentionSpec, MambaSpec)
}


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table per request, with their merged spec."""

    layer_names: tuple[str, ...]
    spec: KVCacheSpec


@dataclass(frozen=True)
class KVCacheConfig:
    """The pool layout: ``num_blocks`` *includes* the null block 0, so N-1 are usable.
    All groups share one block-id space; every group's page size is the same."""

    num_blocks: int
    groups: tuple[KVCacheGroupSpec, ...] = field(default_factory=tuple)

    @property
    def block_sizes(self) -> list[int]:
        return [g.spec.block_size for g in self.groups]
