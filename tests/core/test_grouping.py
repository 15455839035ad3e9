"""Layer grouping and pool sizing: every worked example of docs/semantics.md#grouping
(vLLM's ``test_get_kv_cache_config_one_worker``, page P per layer), the Mamba hybrid
preparation, and invariants over random layer mixes."""

from __future__ import annotations

from functools import partial

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service.core.errors import ConfigError
from cache_service.core.grouping import (
    PROMOTION_FAILED,
    get_kv_cache_config,
    get_kv_cache_groups,
    max_memory_usage_bytes,
    page_size_bytes,
    unify_mamba_hybrid,
)
from cache_service.core.specs import (
    KVCacheSpec,
    MambaSpec,
    SizingLimits,
    UniformTypeKVCacheSpecs,
    cdiv,
)

import builders

BS = 16
# The worked examples' attention layers: one KV head of 64 dims, 2-byte dtype (page P below).
full = partial(builders.full, bs=BS, head=64)
swa = partial(builders.swa, bs=BS, head=64)
chunked = partial(builders.chunked, bs=BS, chunk=256, head=64)
mamba = partial(builders.mamba, bs=BS, state=1000)


P = full().page_size_bytes  # the page of one layer in the examples


def layers(*specs: KVCacheSpec) -> dict[str, KVCacheSpec]:
    """l1, l2, ... in order, as in the vLLM tests."""
    return {f"l{i + 1}": s for i, s in enumerate(specs)}


def names(groups) -> list[list[str]]:
    return [list(g.layer_names) for g in groups]


# --- docs/semantics.md#grouping worked examples ---

@pytest.mark.parametrize("spec", [full(), swa()])
def test_two_equal_layers_one_group(spec):
    config = get_kv_cache_config(layers(spec, spec), available_memory=64 * P)
    assert names(config.groups) == [["l1", "l2"]]
    assert config.groups[0].spec == spec
    assert config.num_blocks == 32  # two layers share each block id: 2P per block


def test_full_and_swa_with_hybrid_off_is_one_full_group_with_the_window():
    groups = get_kv_cache_groups(layers(full(), swa(window=128)), hybrid=False)
    assert names(groups) == [["l1", "l2"]]
    assert groups[0].spec == full(sliding_window=128)


def test_one_full_one_swa():
    config = get_kv_cache_config(layers(full(), swa()), available_memory=64 * P)
    assert names(config.groups) == [["l1"], ["l2"]]
    assert [g.spec for g in config.groups] == [full(), swa()]
    assert config.num_blocks == 64


def test_two_full_four_swa():
    config = get_kv_cache_config(layers(full(), full(), swa(), swa(), swa(), swa()),
                                 available_memory=64 * P)
    assert names(config.groups) == [["l1", "l2"], ["l3", "l5"], ["l4", "l6"]]
    assert config.num_blocks == 32


def test_three_full_seven_swa_strided_with_padding():
    config = get_kv_cache_config(layers(*[full()] * 3, *[swa()] * 7), available_memory=96 * P)
    assert names(config.groups) == [["l1", "l2", "l3"], ["l4", "l7", "l10"], ["l5", "l8"],
                                    ["l6", "l9"]]
    assert page_size_bytes(config) == 3 * P  # the 2-layer groups pad one layer slot
    assert config.num_blocks == 32


def test_one_and_a_half_rule_uses_the_larger_bucket():
    groups = get_kv_cache_groups(layers(*[full()] * 6, *[swa()] * 5))
    assert names(groups) == [[f"l{i}" for i in range(1, 7)], [f"l{i}" for i in range(7, 12)]]
    # Just past 1.5x the smaller bucket sets the group size.
    groups = get_kv_cache_groups(layers(*[full()] * 2, *[swa()] * 3))
    assert names(groups) == [["l1", "l2"], ["l3", "l5"], ["l4"]]


def test_design_doc_ten_full_twenty_sw():
    groups = get_kv_cache_groups(layers(*[full()] * 10, *[swa(window=32)] * 20))
    assert names(groups) == [[f"l{i}" for i in range(1, 11)],
                             [f"l{i}" for i in range(11, 31, 2)],
                             [f"l{i}" for i in range(12, 31, 2)]]


def test_smaller_divisible_page_gets_a_larger_block_size():
    groups = get_kv_cache_groups(layers(full(head=64), swa(head=32)))
    assert [g.spec for g in groups] == [full(head=64), swa(head=32, bs=32)]
    assert groups[1].spec.page_size_bytes == groups[0].spec.page_size_bytes


def test_not_divisible_page_is_padded():
    groups = get_kv_cache_groups(layers(full(head=64), swa(head=96)))
    assert groups[0].spec == full(head=64, page_size_padded=swa(head=96).page_size_bytes)
    assert groups[1].spec == swa(head=96)


def test_mamba_page_is_padded_in_a_hybrid():
    groups = get_kv_cache_groups(layers(full(), mamba(state=100)))
    assert [g.spec.page_size_bytes for g in groups] == [P, P]
    assert groups[1].spec.page_size_padded == P and groups[1].spec.real_page_size_bytes == 400


def test_same_type_different_pages_is_one_uniform_group():
    config = get_kv_cache_config(layers(full(head=64), full(head=32), full(head=64)),
                                 num_blocks=10)
    (group,) = config.groups
    assert isinstance(group.spec, UniformTypeKVCacheSpecs)
    assert group.layer_names == ("l1", "l2", "l3")
    assert page_size_bytes(config) == 2 * P + P // 2


def test_no_layers_no_groups_only_the_null_block():
    config = get_kv_cache_config({}, available_memory=1 << 30)
    assert config.groups == () and config.num_blocks == 1
    assert page_size_bytes(config) == 0


def test_bucket_order_is_first_appearance():
    groups = get_kv_cache_groups({"a": swa(), "b": full(), "c": swa(), "d": full()})
    assert names(groups) == [["a", "c"], ["b", "d"]]
    assert [g.spec.kind for g in groups] == ["sliding_window", "full_attention"]


# --- hybrid off ---

@pytest.mark.parametrize("specs", [
    layers(full(), mamba()), layers(swa(), mamba()), layers(swa(window=64), swa(window=128)),
    layers(swa(), chunked())])
def test_hybrid_off_failure_uses_vllm_wording(specs):
    with pytest.raises(ConfigError) as e:
        get_kv_cache_groups(specs, hybrid=False)
    assert str(e.value).startswith(PROMOTION_FAILED)
    assert PROMOTION_FAILED == "Failed to promote local KV cache specs to one unified type."
    assert e.value.field == "hybrid"


def test_hybrid_off_conflicting_windows():
    with pytest.raises(ConfigError) as e:
        get_kv_cache_groups(layers(full(), swa(window=64), swa(window=128)), hybrid=False)
    assert e.value.field == "sliding_window"


def test_hybrid_off_promotes_to_the_full_block_size_and_keeps_chunk_sizes():
    groups = get_kv_cache_groups(layers(full(bs=32), swa(head=32), chunked()), hybrid=False)
    (group,) = groups  # window + chunk do not merge: one uniform-type group of full layers
    assert isinstance(group.spec, UniformTypeKVCacheSpecs) and group.spec.block_size == 32
    promoted = group.spec.specs_by_layer
    assert promoted["l2"] == full(head=32, bs=32, sliding_window=128)
    assert promoted["l3"] == full(bs=32, attention_chunk_size=256)


def test_hybrid_off_with_one_type_changes_nothing():
    assert get_kv_cache_groups(layers(swa(), swa()), hybrid=False) == \
        get_kv_cache_groups(layers(swa(), swa()))


# --- sizing and errors ---

def test_num_blocks_mode_keeps_the_number():
    config = get_kv_cache_config(layers(full(), swa()), num_blocks=7)
    assert config.num_blocks == 7


@pytest.mark.parametrize("kwargs, field", [
    (dict(), "available_memory"),
    (dict(available_memory=1 << 20, num_blocks=8), "num_blocks"),
    (dict(available_memory=-1), "available_memory"),
    (dict(num_blocks=1.5), "num_blocks"),
    (dict(available_memory=P), "available_memory"),  # one block = only the null block
    (dict(num_blocks=1), "num_blocks"),
])
def test_budget_errors(kwargs, field):
    with pytest.raises(ConfigError) as e:
        get_kv_cache_config(layers(full()), **kwargs)
    assert e.value.field == field


def test_memory_for_one_request_counts_every_group_and_the_null_block():
    # 2 groups of 2 layers: 2P per block
    specs = layers(full(), full(), swa(window=64), swa(window=64))
    limits = SizingLimits(max_model_len=1024, max_in_flight_tokens=256)
    groups = get_kv_cache_groups(specs)
    need_blocks = cdiv(1024, BS) + (cdiv(64 - 1 + 256, BS) + 1)
    assert max_memory_usage_bytes(groups, limits) == need_blocks * 2 * P
    # Exactly enough: the usable blocks (all but the null block) hold one request.
    ok = get_kv_cache_config(specs, num_blocks=need_blocks + 1, limits=limits)
    assert ok.num_blocks == need_blocks + 1
    ok = get_kv_cache_config(specs, available_memory=(need_blocks + 1) * 2 * P, limits=limits)
    assert ok.num_blocks == need_blocks + 1
    for kwargs, field in ((dict(num_blocks=need_blocks), "num_blocks"),
                          (dict(available_memory=(need_blocks + 1) * 2 * P - 1),
                           "available_memory")):
        with pytest.raises(ConfigError) as e:
            get_kv_cache_config(specs, limits=limits, **kwargs)
        assert e.value.field == field and "max seq len (1024)" in str(e.value)


def test_bad_layer_specs_are_named():
    with pytest.raises(ConfigError) as e:
        get_kv_cache_groups({"l1": full(), "l2": "full"})
    assert e.value.field == "layer_specs['l2']"
    with pytest.raises(ConfigError) as e:
        get_kv_cache_groups({"l1": full(), "m": MambaSpec(block_size=16)})  # no state
    assert e.value.field == "layer_specs['m']"
    with pytest.raises(ConfigError):
        get_kv_cache_groups([("l1", full())])


# --- Mamba hybrid preparation ---

def test_unify_mamba_hybrid_raises_attention_block_size_and_pads_mamba():
    # 256 B per attention token; a 300,000 B state needs cdiv(300000, 16*256) = 74 kernel
    # blocks of 16 -> 1184 tokens per attention block.
    specs = unify_mamba_hybrid(layers(full(), mamba(state=75_000), swa(), mamba(state=75_000)),
                               mamba_cache_mode="align", max_model_len=8192)
    assert list(specs) == ["l1", "l2", "l3", "l4"]
    assert specs["l1"] == full(bs=1184) and specs["l3"] == swa(bs=1184)
    assert specs["l2"] == MambaSpec(block_size=1184, shapes=((75_000,),), dtypes=("float32",),
                                    mamba_cache_mode="align", page_size_padded=1184 * 256)
    # Then grouping sees one page size everywhere.
    groups = get_kv_cache_groups(specs)
    assert {g.spec.page_size_bytes for g in groups} == {1184 * 256}


def test_unify_mamba_hybrid_none_mode_and_exact_fit():
    specs = unify_mamba_hybrid(layers(full(), mamba(state=66_560, mode="align")),
                               mamba_cache_mode="none", max_model_len=4096)
    # 66,560 * 4 B = 1040 tokens * 256 B exactly: no padding.
    assert specs["l1"].block_size == 1040
    assert specs["l2"].block_size == 4096 and specs["l2"].page_size_padded is None
    assert specs["l2"].mamba_cache_mode == "none"


def test_unify_mamba_hybrid_keeps_a_large_enough_block_and_alignment():
    specs = unify_mamba_hybrid(layers(full(bs=2048), mamba(state=100)),
                               mamba_cache_mode="align", max_model_len=8192)
    assert specs["l1"].block_size == 2048 and specs["l2"].page_size_bytes == 2048 * 256
    specs = unify_mamba_hybrid(layers(full(), mamba(state=75_000)), mamba_cache_mode="align",
                               max_model_len=8192, kernel_block_alignment=64)
    assert specs["l1"].block_size == 64 * cdiv(300_000, 64 * 256)


def test_unify_mamba_hybrid_without_mamba_is_identity_and_validates():
    specs = layers(full(), swa())
    assert unify_mamba_hybrid(specs, mamba_cache_mode="align", max_model_len=64) == specs
    for kwargs, field in ((dict(mamba_cache_mode="all", max_model_len=64), "mamba_cache_mode"),
                          (dict(mamba_cache_mode="none", max_model_len=0), "max_model_len")):
        with pytest.raises(ConfigError) as e:
            unify_mamba_hybrid(specs, **kwargs)
        assert e.value.field == field


# --- invariants over random layer mixes ---

spec_st = st.one_of(
    st.builds(full, head=st.sampled_from([32, 64, 96])),
    st.builds(swa, window=st.sampled_from([64, 128]), head=st.sampled_from([32, 64])),
    st.builds(chunked),
    st.builds(mamba, state=st.sampled_from([100, 2048, 5000])),
)


@settings(max_examples=80, deadline=None)
@given(specs=st.lists(spec_st, max_size=14), hybrid=st.booleans())
def test_grouping_invariants(specs, hybrid):
    model = layers(*specs)
    try:
        groups = get_kv_cache_groups(model, hybrid=hybrid)
    except ConfigError as e:
        assert not hybrid and e.field in ("hybrid", "sliding_window")
        return
    assigned = [n for g in groups for n in g.layer_names]
    assert sorted(assigned) == sorted(model)  # every layer in exactly one group
    if not hybrid:
        assert len(groups) <= 1
    if len(groups) > 1:
        # One block id must mean the same bytes in every group.
        assert len({g.spec.page_size_bytes for g in groups}) == 1
        largest = max(len(g.layer_names) for g in groups)
        assert page_size_bytes(groups) == largest * groups[0].spec.page_size_bytes
    memory = 1000 * P
    if groups:
        config = get_kv_cache_config(model, available_memory=memory, hybrid=hybrid)
        assert config.num_blocks == memory // page_size_bytes(groups)
