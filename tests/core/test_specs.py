"""Layer specs: page sizes and per-request worst cases (docs/semantics.md#specs-and-sizing), merge
rules and uniform-type detection."""

from __future__ import annotations

import math
import pickle
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service.core.errors import ConfigError
from cache_service.core.specs import (
    DTYPE_BYTES,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    SizingLimits,
    SlidingWindowSpec,
    SpecMergeError,
    UniformTypeKVCacheSpecs,
    cdiv,
    layer_spec,
)

ATTENTION_KINDS = (FullAttentionSpec, CrossAttentionSpec)


@settings(max_examples=60, deadline=None)
@given(bs=st.integers(1, 512), heads=st.integers(1, 16), head=st.integers(1, 256),
       head_v=st.one_of(st.none(), st.integers(0, 256)),
       dtype=st.sampled_from(sorted(DTYPE_BYTES)),
       cls=st.sampled_from(ATTENTION_KINDS))
def test_attention_page_size(bs, heads, head, head_v, dtype, cls):
    spec = cls(block_size=bs, num_kv_heads=heads, head_size=head, head_size_v=head_v, dtype=dtype)
    v = head if head_v is None else head_v
    assert spec.page_size_bytes == heads * bs * (head + v) * DTYPE_BYTES[dtype]
    padded = cls(block_size=bs, num_kv_heads=heads, head_size=head, head_size_v=head_v,
                 dtype=dtype, page_size_padded=spec.page_size_bytes + 7)
    assert padded.page_size_bytes == spec.page_size_bytes + 7
    assert padded.real_page_size_bytes == spec.page_size_bytes


def test_classic_formula_agrees_when_v_equals_k():
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
    assert spec.page_size_bytes == 2 * 16 * 8 * 128 * 2


@settings(max_examples=60, deadline=None)
@given(bs=st.integers(1, 64), mml=st.integers(1, 10_000),
       in_flight=st.one_of(st.none(), st.integers(1, 10_000)), w=st.integers(1, 4096),
       enc=st.integers(0, 4096))
def test_max_memory_usage_formulas(bs, mml, in_flight, w, enc):
    limits = SizingLimits(max_model_len=mml, max_in_flight_tokens=in_flight,
                          max_num_encoder_input_tokens=enc)
    flight = mml if in_flight is None else in_flight
    kw = dict(block_size=bs, num_kv_heads=2, head_size=8, dtype="float16")
    full = FullAttentionSpec(**kw)
    page = full.page_size_bytes
    assert full.max_memory_usage_bytes(limits) == math.ceil(mml / bs) * page
    swa = SlidingWindowSpec(sliding_window=w, **kw)
    assert swa.max_admission_blocks(limits) == math.ceil(min(w - 1 + flight, mml) / bs) + 1
    assert swa.max_memory_usage_bytes(limits) == swa.max_admission_blocks(limits) * page
    chunked = ChunkedLocalAttentionSpec(attention_chunk_size=w, **kw)
    assert chunked.max_admission_blocks(limits) == math.ceil(min(w + flight, mml) / bs)
    assert chunked.max_memory_usage_bytes(limits) == chunked.max_admission_blocks(limits) * page
    cross = CrossAttentionSpec(**kw)
    assert cross.max_memory_usage_bytes(limits) == math.ceil(enc / bs) * page


def test_sliding_window_admission_cap_vllm_example():
    # vLLM test: bs 16, sw 64, in-flight 128 -> cdiv(191, 16) + 1 = 13.
    spec = SlidingWindowSpec(block_size=16, sliding_window=64)
    assert spec.max_admission_blocks(SizingLimits(max_model_len=8192,
                                                  max_in_flight_tokens=128)) == 13


@pytest.mark.parametrize("mode, spec_blocks, expected_blocks", [
    ("align", 0, 2), ("align", 2, 4), ("none", 0, 1), ("none", 3, 4)])
def test_mamba_page_and_max_memory(mode, spec_blocks, expected_blocks):
    spec = MambaSpec(block_size=16, shapes=((3, 4), (2, 5, 7)), dtypes=("float16", "float32"),
                     mamba_cache_mode=mode, num_speculative_blocks=spec_blocks)
    page = 3 * 4 * 2 + 2 * 5 * 7 * 4
    assert spec.page_size_bytes == page
    limits = SizingLimits(max_model_len=100_000)
    assert spec.max_memory_usage_bytes(limits) == expected_blocks * page
    padded = MambaSpec(block_size=16, shapes=((3, 4), (2, 5, 7)),
                       dtypes=("float16", "float32"), mamba_cache_mode=mode,
                       num_speculative_blocks=spec_blocks, page_size_padded=4096)
    assert padded.page_size_bytes == 4096
    assert padded.max_memory_usage_bytes(limits) == expected_blocks * 4096


# --- merge rules ---

def _full(**kw) -> FullAttentionSpec:
    return FullAttentionSpec(**{"block_size": 16, "num_kv_heads": 2, "head_size": 64, **kw})


def test_equal_specs_merge_and_different_ones_do_not():
    swa = SlidingWindowSpec(block_size=16, sliding_window=8)
    assert SlidingWindowSpec.merge([swa, swa]) == swa
    other = SlidingWindowSpec(block_size=16, sliding_window=16)
    with pytest.raises(SpecMergeError):
        SlidingWindowSpec.merge([swa, other])


def test_full_attention_merges_promoted_windows():
    merged = FullAttentionSpec.merge([_full(), _full(sliding_window=128), _full()])
    assert merged == _full(sliding_window=128)
    merged = FullAttentionSpec.merge([_full(attention_chunk_size=64), _full()])
    assert merged.attention_chunk_size == 64 and merged.sliding_window is None


def test_full_attention_conflicting_windows_is_a_config_error():
    with pytest.raises(ConfigError) as e:
        FullAttentionSpec.merge([_full(sliding_window=64), _full(sliding_window=128)])
    assert not isinstance(e.value, SpecMergeError)
    assert e.value.field == "sliding_window"
    with pytest.raises(ConfigError) as e:
        FullAttentionSpec.merge([_full(attention_chunk_size=64), _full(attention_chunk_size=32)])
    assert e.value.field == "attention_chunk_size"


@pytest.mark.parametrize("other", [
    _full(head_size=32), _full(num_kv_heads=4), _full(dtype="float32"), _full(block_size=32),
    _full(page_size_padded=1 << 20), SlidingWindowSpec(block_size=16, num_kv_heads=2,
                                                       head_size=64, sliding_window=8)])
def test_full_attention_does_not_merge_other_geometry(other):
    with pytest.raises(SpecMergeError):
        FullAttentionSpec.merge([_full(), other])


def test_window_and_chunk_together_do_not_merge():
    with pytest.raises(SpecMergeError):
        FullAttentionSpec.merge([_full(sliding_window=64), _full(attention_chunk_size=64)])


# --- uniform type ---

def test_uniform_type_full_attention_with_different_heads():
    layers = {"a": _full(head_size=64), "b": _full(head_size=32), "c": _full(head_size=64)}
    spec = UniformTypeKVCacheSpecs.from_specs(layers)
    assert spec is not None
    assert spec.kind == "full_attention" and spec.block_size == 16
    assert spec.page_size_bytes == sum(s.page_size_bytes for s in layers.values())
    assert layer_spec(spec, "b") == layers["b"]
    limits = SizingLimits(max_model_len=1000)
    assert spec.max_memory_usage_bytes(limits) == cdiv(1000, 16) * spec.page_size_bytes


def test_uniform_type_max_memory_takes_the_largest_layer_need():
    small = SlidingWindowSpec(block_size=16, head_size=8, sliding_window=64)
    big = SlidingWindowSpec(block_size=16, head_size=32, sliding_window=64)
    spec = UniformTypeKVCacheSpecs.from_specs({"s": small, "b": big})
    limits = SizingLimits(max_model_len=4096, max_in_flight_tokens=256)
    pages = max(cdiv(s.max_memory_usage_bytes(limits), s.page_size_bytes) for s in (small, big))
    assert spec.max_memory_usage_bytes(limits) == pages * (small.page_size_bytes
                                                           + big.page_size_bytes)
    # The manager reads the window and admission cap from the group spec.
    assert spec.sliding_window == 64
    assert spec.max_admission_blocks(limits) == small.max_admission_blocks(limits)
    assert not hasattr(spec, "mamba_cache_mode_typo")


@pytest.mark.parametrize("layers", [
    {"a": _full(), "b": _full(block_size=32)},  # block sizes differ
    {"a": SlidingWindowSpec(block_size=16, sliding_window=8),
     "b": SlidingWindowSpec(block_size=16, sliding_window=16, head_size=4)},  # windows differ
    {"a": _full(), "b": SlidingWindowSpec(block_size=16, sliding_window=8)},  # types differ
    {"a": MambaSpec(block_size=16, shapes=((4,),), dtypes=("float32",)),
     "b": MambaSpec(block_size=16, shapes=((8,),), dtypes=("float32",))},  # state pages differ
    {},
])
def test_not_uniform_type(layers):
    assert UniformTypeKVCacheSpecs.from_specs(layers) is None


def test_uniform_type_spec_is_a_value_object():
    spec = UniformTypeKVCacheSpecs.from_specs({"a": _full(head_size=64), "b": _full(head_size=32)})
    again = UniformTypeKVCacheSpecs.from_specs({"a": _full(head_size=64),
                                                "b": _full(head_size=32)})
    assert spec == again and hash(spec) == hash(again)
    assert pickle.loads(pickle.dumps(spec)) == spec
    with pytest.raises(ConfigError):
        UniformTypeKVCacheSpecs(block_size=16, layer_specs=())


# --- validation ---

@pytest.mark.parametrize("make, field", [
    (lambda: FullAttentionSpec(block_size=0), "block_size"),
    (lambda: FullAttentionSpec(block_size=True), "block_size"),
    (lambda: FullAttentionSpec(block_size=16, num_kv_heads=0), "num_kv_heads"),
    (lambda: FullAttentionSpec(block_size=16, head_size=-1), "head_size"),
    (lambda: FullAttentionSpec(block_size=16, dtype="float64x"), "dtype"),
    (lambda: FullAttentionSpec(block_size=16, page_size_padded=1), "page_size_padded"),
    (lambda: SlidingWindowSpec(block_size=16, sliding_window=0), "sliding_window"),
    (lambda: ChunkedLocalAttentionSpec(block_size=16), "attention_chunk_size"),
    (lambda: MambaSpec(block_size=16, mamba_cache_mode=cast(Any, "all")), "mamba_cache_mode"),
    (lambda: MambaSpec(block_size=16, num_speculative_blocks=-1), "num_speculative_blocks"),
    (lambda: MambaSpec(block_size=16, shapes=((4,),), dtypes=()), "dtypes"),
    (lambda: SizingLimits(max_model_len=0), "max_model_len"),
    (lambda: SizingLimits(max_model_len=16, max_in_flight_tokens=0), "max_in_flight_tokens"),
    (lambda: KVCacheConfig(num_blocks=0), "num_blocks"),
])
def test_bad_spec_fields_are_named(make, field):
    with pytest.raises(ConfigError) as e:
        make()
    assert e.value.field == field
