"""Per-layer KV-cache specs (vLLM ``kv_cache_interface``), as frozen value objects.

A spec says how one layer uses the block pool: how many tokens a block holds
(``block_size``), how many bytes one block of this layer takes (``page_size_bytes``)
and the worst-case bytes one request can need (``max_memory_usage_bytes``).
Equality and hashing are by fields, so layers with equal specs can share a group.

Two relations drive grouping (``grouping.py``; docs/semantics.md#specs-and-sizing and
docs/semantics.md#grouping):
``merge`` (layers that can share one block table *and* one spec: equal specs, or full
attention differing only in a promoted window) and ``is_uniform_with`` (layers of one
type that need the same token slots but may have different page sizes; they form one
group with a :class:`UniformTypeKVCacheSpecs`).

Dtypes are named by strings (``"bfloat16"``, ``"float32"``, ...) so that the core
needs no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, Literal

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
    """Bytes per element of ``dtype``; ConfigError naming the known dtypes otherwise."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ConfigError(
            f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}", field="dtype"
        ) from None


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b``."""
    return -(-a // b)


def _check_int(value: object, name: str, *, minimum: int) -> None:
    # bool is an int subclass; True as a block size is a caller bug, not 1.
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}", field=name)


class SpecMergeError(ConfigError):
    """These layer specs cannot share one KV-cache group (vLLM raises AssertionError).
    Grouping treats it as "not mergeable"; other ConfigErrors (conflicting windows) are
    real errors."""


@dataclass(frozen=True)
class SizingLimits:
    """What bounds a request's worst-case memory: the model length, the tokens one request
    may have in flight (chunked prefill budget), and encoder inputs (cross attention)."""

    max_model_len: int
    max_in_flight_tokens: int | None = None  # None -> max_model_len
    max_num_encoder_input_tokens: int = 0

    def __post_init__(self) -> None:
        _check_int(self.max_model_len, "max_model_len", minimum=1)
        if self.max_in_flight_tokens is not None:
            _check_int(self.max_in_flight_tokens, "max_in_flight_tokens", minimum=1)
        _check_int(self.max_num_encoder_input_tokens, "max_num_encoder_input_tokens", minimum=0)

    @property
    def in_flight(self) -> int:
        """The tokens one request may have in flight: ``max_in_flight_tokens``, else
        ``max_model_len``."""
        if self.max_in_flight_tokens is None:
            return self.max_model_len
        return self.max_in_flight_tokens


@dataclass(frozen=True)
class KVCacheSpec:
    """Base of all specs. ``kind`` is the string used in KV events and the protocol."""

    kind: ClassVar[str] = ""
    block_size: int

    def __post_init__(self) -> None:
        _check_int(self.block_size, "block_size", minimum=1)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of this layer (its page)."""
        raise NotImplementedError

    def max_memory_usage_bytes(self, limits: SizingLimits) -> int:
        """Bytes one request may need at most under ``limits`` (what sizes a pool and its
        capacity check)."""
        raise NotImplementedError

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec]) -> KVCacheSpec:
        """The spec of one group holding layers with ``specs``: they must all be equal
        (:class:`SpecMergeError` otherwise)."""
        if not all(spec == specs[0] for spec in specs[1:]):
            raise SpecMergeError("All layers in the same KV cache group must be the same.",
                                 field="layer_specs")
        return specs[0]

    def is_uniform_with(self, specs: Sequence[KVCacheSpec]) -> bool:
        """Whether every spec in ``specs`` is of this spec's type and needs the same token
        slots per request (so they can share one block table with different pages).
        Block sizes are compared by the caller."""
        return all(isinstance(spec, type(self)) for spec in specs)


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
        _check_int(self.num_kv_heads, "num_kv_heads", minimum=1)
        _check_int(self.head_size, "head_size", minimum=1)
        if self.head_size_v is not None:
            _check_int(self.head_size_v, "head_size_v", minimum=0)  # 0: MLA-style K only
        dtype_bytes(self.dtype)
        if self.page_size_padded is not None and self.page_size_padded < self.real_page_size_bytes:
            raise ConfigError("page_size_padded is smaller than the unpadded page",
                              field="page_size_padded")

    @property
    def real_page_size_bytes(self) -> int:
        """The unpadded page: K and V of ``block_size`` tokens over every KV head."""
        hv = self.head_size if self.head_size_v is None else self.head_size_v
        return self.num_kv_heads * self.block_size * (self.head_size + hv) * dtype_bytes(self.dtype)

    @property
    def page_size_bytes(self) -> int:
        """``page_size_padded`` if set, else the unpadded page."""
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Full (global) attention. ``sliding_window`` / ``attention_chunk_size`` are only set
    when local layers were *promoted* to full because the hybrid manager is disabled."""

    kind: ClassVar[str] = "full_attention"
    sliding_window: int | None = None
    attention_chunk_size: int | None = None

    def max_memory_usage_bytes(self, limits: SizingLimits) -> int:
        """Pages for a whole ``max_model_len`` request."""
        return cdiv(limits.max_model_len, self.block_size) * self.page_size_bytes

    def is_uniform_with(self, specs: Sequence[KVCacheSpec]) -> bool:
        """Full-attention specs only (R-SWA layers form groups of their own: a group
        mixing them would have no one manager, as its layers free blocks differently)."""
        return all(type(s) is type(self) for s in specs)

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec]) -> FullAttentionSpec:
        """Full-attention layers merge when they differ at most in a promoted
        ``sliding_window`` / ``attention_chunk_size``; the group keeps the one non-None
        value. Two different windows -> ConfigError; a window and a chunk size, or any
        other difference -> SpecMergeError."""
        full = [spec for spec in specs if type(spec) is FullAttentionSpec]
        if len(full) != len(specs):
            raise SpecMergeError("All attention layers in the same KV cache group must be "
                                 "FullAttentionSpec.", field="layer_specs")
        windows = {s.sliding_window for s in full if s.sliding_window is not None}
        chunks = {s.attention_chunk_size for s in full if s.attention_chunk_size is not None}
        for name, values in (("sliding_window", windows), ("attention_chunk_size", chunks)):
            if len(values) > 1:
                raise ConfigError("All attention layers in the same KV cache group must have "
                                  f"the same window size; got {name} {sorted(values)}",
                                  field=name)
        merged = replace(full[0], sliding_window=next(iter(windows), None),
                         attention_chunk_size=next(iter(chunks), None))
        base = [f.name for f in fields(AttentionSpec)]
        for spec in specs:
            if any(getattr(spec, n) != getattr(merged, n) for n in base):
                raise SpecMergeError("All attention layers in the same KV cache group must "
                                     "have the same attention spec.", field="layer_specs")
        if merged.sliding_window is not None and merged.attention_chunk_size is not None:
            raise SpecMergeError("Model with both sliding window layers and chunked local "
                                 "attention layers is not supported.", field="layer_specs")
        return merged


@dataclass(frozen=True)
class RSWASpec(FullAttentionSpec):
    """Reference sliding-window attention (vLLM 0.33's ``RSWASpec``): the prompt is always
    attended, but of the generated tokens only the last ``rswa_window`` are, so the blocks
    between the prompt's last block and the decode window are freed as decoding goes on
    (docs/semantics.md#rswa). Hits, caching and sizing are full attention's."""

    kind: ClassVar[str] = "rswa"
    rswa_window: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_int(self.rswa_window, "rswa_window", minimum=1)

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec]) -> RSWASpec:
        """R-SWA layers merge when they are equal (same window included)."""
        if not all(type(s) is RSWASpec for s in specs):
            raise SpecMergeError("All attention layers in the same KV cache group must be "
                                 "RSWASpec.", field="layer_specs")
        windows = {s.rswa_window for s in specs if isinstance(s, RSWASpec)}
        if len(windows) > 1:
            raise ConfigError(f"All R-SWA layers must share the same rswa_window, got "
                              f"{sorted(windows)}", field="rswa_window")
        first = specs[0]
        assert isinstance(first, RSWASpec)
        if not all(s == first for s in specs[1:]):
            raise SpecMergeError("All attention layers in the same KV cache group must have "
                                 "the same attention spec.", field="layer_specs")
        return first

    def is_uniform_with(self, specs: Sequence[KVCacheSpec]) -> bool:
        """R-SWA specs with the same window only."""
        return all(isinstance(s, RSWASpec) and s.rswa_window == self.rswa_window
                   for s in specs)


@dataclass(frozen=True)
class CircularBufferSpec(AttentionSpec):
    """A ring buffer of ``block_size`` rows (vLLM 0.33's ``CircularBufferSpec``, the raw
    keys of the token group a compressing layer has not compressed yet): exactly one
    block per request for its whole life, never prefix cached
    (docs/semantics.md#circular-buffer)."""

    kind: ClassVar[str] = "circular_buffer"

    def max_memory_usage_bytes(self, limits: SizingLimits) -> int:
        """One page: the ring is the request's only block."""
        return self.page_size_bytes

    def is_uniform_with(self, specs: Sequence[KVCacheSpec]) -> bool:
        """Circular-buffer specs only."""
        return all(isinstance(s, CircularBufferSpec) for s in specs)


def prefix_cacheable(spec: KVCacheSpec) -> bool:
    """Whether a group of ``spec`` takes part in prefix caching (hit search, hashing, the
    hash block size): every kind but the circular buffer."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = spec.first_spec
    return not isinstance(spec, CircularBufferSpec)


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
        """Blocks a request can hold at once: the window plus its in-flight tokens (at most the
        model length), and one more since the window need not start on a block boundary."""
        # +1: the window need not start on a block boundary.
        tokens = min(self.sliding_window - 1 + limits.in_flight, limits.max_model_len)
        return cdiv(tokens, self.block_size) + 1

    def max_memory_usage_bytes(self, limits: SizingLimits) -> int:
        """Pages of :meth:`max_admission_blocks`."""
        return self.max_admission_blocks(limits) * self.page_size_bytes

    def is_uniform_with(self, specs: Sequence[KVCacheSpec]) -> bool:
        """Sliding-window specs with the same window only."""
        return all(isinstance(s, SlidingWindowSpec) and s.sliding_window == self.sliding_window
                   for s in specs)


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
        """Blocks a request can hold at once: one chunk plus its in-flight tokens (at most the
        model length)."""
        tokens = min(self.attention_chunk_size + limits.in_flight, limits.max_model_len)
        return cdiv(tokens, self.block_size)

    def max_memory_usage_bytes(self, limits: SizingLimits) -> int:
        """Pages of :meth:`max_admission_blocks`."""
        return self.max_admission_blocks(limits) * self.page_size_bytes

    def is_uniform_with(self, specs: Sequence[KVCacheSpec]) -> bool:
        """Chunked local specs with the same chunk size only."""
        return all(isinstance(s, ChunkedLocalAttentionSpec)
                   and s.attention_chunk_size == self.attention_chunk_size for s in specs)


@dataclass(frozen=True)
class CrossAttentionSpec(AttentionSpec):
    """Encoder-decoder cross attention: sized from encoder tokens, never prefix cached."""

    kind: ClassVar[str] = "cross_attention"

    def max_memory_usage_bytes(self, limits: SizingLimits) -> int:
        """Pages for the encoder's input tokens (the decoder's length does not matter)."""
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
        _check_int(self.num_speculative_blocks, "num_speculative_blocks", minimum=0)
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
        """The unpadded page: every state tensor of one request."""
        return sum(math.prod(s) * dtype_bytes(d) for s, d in zip(self.shapes, self.dtypes))

    @property
    def page_size_bytes(self) -> int:
        """``page_size_padded`` if set, else the unpadded page."""
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes

    def max_memory_usage_bytes(self, limits: SizingLimits) -> int:
        """One state page (two in align mode: the running state and a checkpoint), plus the
        speculative ones."""
        blocks = (2 if self.mamba_cache_mode == "align" else 1) + self.num_speculative_blocks
        return self.page_size_bytes * blocks

    def is_uniform_with(self, specs: Sequence[KVCacheSpec]) -> bool:
        """Mamba specs with the same page size and speculative blocks only (a block is one
        whole state)."""
        # A Mamba block is one whole state: pages must match exactly, not just the type.
        return all(isinstance(s, MambaSpec) and s.page_size_bytes == self.page_size_bytes
                   and s.num_speculative_blocks == self.num_speculative_blocks
                   for s in specs)


# Attributes a manager reads from its group spec; a uniform-type group answers them from
# its layers (which agree on them by construction).
_DELEGATED = frozenset({"sliding_window", "attention_chunk_size", "mamba_cache_mode",
                        "num_speculative_blocks", "max_admission_blocks", "rswa_window"})


@dataclass(frozen=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """One group of layers of the same type and block size but different page sizes
    (e.g. different head sizes): one block id stands for a page of *every* layer.

    ``kind``, ``sliding_window``, ``attention_chunk_size``, ``mamba_cache_mode``,
    ``num_speculative_blocks`` and ``max_admission_blocks`` are those of the layers.
    """

    layer_specs: tuple[tuple[str, KVCacheSpec], ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.layer_specs:
            raise ConfigError("a uniform-type spec needs at least one layer", field="layer_specs")
        specs = [spec for _, spec in self.layer_specs]
        if (not self.is_uniform_type(dict(self.layer_specs))
                or specs[0].block_size != self.block_size):
            raise ConfigError("layers of a uniform-type spec must have one type and block size",
                              field="layer_specs")

    @property
    def kind(self) -> str:  # type: ignore[override]
        """The layers' kind."""
        return self.first_spec.kind

    @property
    def first_spec(self) -> KVCacheSpec:
        """The first layer's spec (all agree on type, block size and window)."""
        return self.layer_specs[0][1]

    @property
    def specs_by_layer(self) -> dict[str, KVCacheSpec]:
        """Layer name -> its own spec."""
        return dict(self.layer_specs)

    @property
    def page_size_bytes(self) -> int:
        """One block id's pages over every layer of the group."""
        return sum(spec.page_size_bytes for _, spec in self.layer_specs)

    def max_num_pages(self, limits: SizingLimits) -> int:
        """Blocks one request may need: the most any layer needs."""
        return max(cdiv(spec.max_memory_usage_bytes(limits), spec.page_size_bytes)
                   for _, spec in self.layer_specs)

    def max_memory_usage_bytes(self, limits: SizingLimits) -> int:
        """Pages of :meth:`max_num_pages` over every layer."""
        return self.max_num_pages(limits) * self.page_size_bytes

    def is_uniform_with(self, specs: Sequence[KVCacheSpec]) -> bool:
        """Only with equal specs."""
        return all(spec == self for spec in specs)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails; read layer_specs via __dict__ so that a
        # half-built instance (copy, unpickle) raises AttributeError instead of recursing.
        layer_specs = self.__dict__.get("layer_specs")
        if name not in _DELEGATED or not layer_specs:
            raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")
        if name == "max_admission_blocks":
            # Uniform layers share block size and window, hence the cap in blocks.
            return layer_specs[0][1].max_admission_blocks
        # A value the layers disagree on (promoted full-attention windows) is not the
        # group's: answer None, as for a layer without one.
        values = {getattr(spec, name, None) for _, spec in layer_specs}
        return values.pop() if len(values) == 1 else None

    @staticmethod
    def is_uniform_type(layer_specs: Mapping[str, KVCacheSpec]) -> bool:
        """Whether all layers have one block size and one type needing the same token
        slots (same window for sliding window, same chunk for chunked local, same page and
        speculative blocks for Mamba)."""
        specs = list(layer_specs.values())
        if not specs or len({s.block_size for s in specs}) > 1:
            return False
        return specs[0].is_uniform_with(specs)

    @classmethod
    def from_specs(cls, layer_specs: Mapping[str, KVCacheSpec]) -> UniformTypeKVCacheSpecs | None:
        """The uniform-type spec of these layers (in their order), or None if they are not
        of one uniform type."""
        if not cls.is_uniform_type(layer_specs):
            return None
        first = next(iter(layer_specs.values()))
        return cls(block_size=first.block_size, layer_specs=tuple(layer_specs.items()))


def manager_spec(group_spec: KVCacheSpec) -> KVCacheSpec:
    """The spec a single-type manager runs a group with: for a uniform-type group, its
    first layer's (all its layers agree on type, block size and window), else the group
    spec itself. Page sizes differ between the two; managers do not use them."""
    if isinstance(group_spec, UniformTypeKVCacheSpecs):
        return group_spec.first_spec
    return group_spec


def layer_spec(group_spec: KVCacheSpec, layer_name: str) -> KVCacheSpec:
    """The spec of one layer of a group (its own spec in a uniform-type group)."""
    if isinstance(group_spec, UniformTypeKVCacheSpecs):
        return group_spec.specs_by_layer[layer_name]
    return group_spec


SPEC_KINDS: dict[str, type[KVCacheSpec]] = {
    cls.kind: cls
    for cls in (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec,
                CrossAttentionSpec, MambaSpec, RSWASpec, CircularBufferSpec)
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

    def __post_init__(self) -> None:
        _check_int(self.num_blocks, "num_blocks", minimum=1)

    @property
    def block_sizes(self) -> list[int]:
        """Each group's block size, in group order."""
        return [g.spec.block_size for g in self.groups]
