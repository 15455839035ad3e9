"""Cache specs of the presets and the aliased physical layout."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service.core.grouping import get_kv_cache_config
from cache_service.core.specs import AttentionSpec, MambaSpec, SlidingWindowSpec
from executor.cache import CacheGroup, CacheTensors, mamba_state_shapes, model_layer_specs
from executor.forward_meta import GroupLayout
from executor.presets import PRESETS


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_specs_describe_every_layer_with_one_page_size(preset: str) -> None:
    cfg = PRESETS[preset]
    specs = model_layer_specs(cfg, block_size=16, mamba_cache_mode="align")
    assert len(specs) == cfg.num_layers
    pages = {s.page_size_bytes for s in specs.values()}
    assert len(pages) == 1  # unified: attention and Mamba pages share one size
    for i, spec in enumerate(specs.values()):
        kind = cfg.layer_kind(i)
        if isinstance(spec, MambaSpec):
            assert kind.startswith("mamba") and spec.mamba_cache_mode == "align"
            assert spec.shapes == mamba_state_shapes(cfg, kind)
            assert spec.real_page_size_bytes <= spec.page_size_bytes
        else:
            assert isinstance(spec, AttentionSpec) and spec.num_kv_heads == cfg.num_kv_heads
            assert isinstance(spec, SlidingWindowSpec) == (kind == "sliding_window")
    if "M" in cfg.pattern or "m" in cfg.pattern:
        # a page holds one Mamba state; align mode: Mamba blocks = attention blocks
        assert len({s.block_size for s in specs.values()}) == 1
    none = model_layer_specs(cfg, mamba_cache_mode="none")
    assert all(s.block_size == cfg.max_model_len for s in none.values() if isinstance(s, MambaSpec))


def _tensors(preset: str, num_blocks: int = 12) -> CacheTensors:
    cfg = PRESETS[preset]
    specs = model_layer_specs(cfg)
    kv = get_kv_cache_config(specs, num_blocks=num_blocks)
    groups = []
    for g in kv.groups:
        s = g.spec
        layout = (GroupLayout("mamba", s.block_size, s.mamba_cache_mode) if isinstance(s, MambaSpec)
                  else GroupLayout("attention", s.block_size))
        groups.append(CacheGroup(tuple(g.layer_names), layout))
    return CacheTensors(cfg, groups, kv.num_blocks, kv.groups[0].spec.page_size_bytes)


@pytest.mark.parametrize("preset", ["gemma3-like", "plamo2-like"])
def test_memory_is_one_slot_per_layer_of_the_largest_group(preset: str) -> None:
    t = _tensors(preset)
    sizes = [len(g.layer_names) for g in t.groups]
    assert t.num_slots == max(sizes)
    assert t.nbytes == t.num_slots * t.num_blocks * t.page_size_bytes


@settings(max_examples=25, deadline=None)
@given(layer=st.integers(0, 3), block=st.integers(1, 11), which=st.integers(0, 1))
def test_a_block_of_any_layer_lives_inside_its_page(layer: int, block: int, which: int) -> None:
    """Writing block b of a layer touches only bytes [b*page, (b+1)*page) of its slot, so groups
    that own different blocks never overlap."""
    t = _tensors("hybrid-fsm")
    assert t.num_slots == 1  # one layer per group: all four layers alias one buffer
    slot = t.slots[0]
    before = slot.clone()
    t.layer_tensors[layer][which][block].fill_(1.5)
    changed = (slot != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [block]


def test_layers_must_match_their_groups() -> None:
    cfg = PRESETS["hybrid-fsm"]
    t = _tensors("hybrid-fsm")
    swapped = [CacheGroup(g.layer_names,
                         GroupLayout("attention" if g.layout.kind == "mamba" else "mamba",
                                     g.layout.block_size)) for g in t.groups]
    with pytest.raises(ValueError, match="groups"):
        CacheTensors(cfg, swapped, 12, t.page_size_bytes)
    with pytest.raises(ValueError, match="num_blocks"):
        CacheTensors(cfg, t.groups, 1, t.page_size_bytes)
    with pytest.raises(ValueError, match="page_size_bytes"):
        CacheTensors(cfg, t.groups, 12, 64)
    assert torch.count_nonzero(t.slots[0]) == 0  # fresh caches start zeroed


def test_copy_blocks_copies_every_layer_of_the_group_and_nothing_else() -> None:
    t = _tensors("plamo2-like")
    torch.manual_seed(0)
    for slot in t.slots:
        slot.copy_(torch.randint(0, 256, slot.shape, dtype=torch.uint8))
    before = [s.clone() for s in t.slots]
    group = next(g for g, info in enumerate(t.groups) if info.layout.kind == "mamba")
    layers = len(t.groups[group].layer_names)
    t.copy_blocks([(group, 3, 7), (group, 7, 9)])  # in order: 9 gets 3's data too
    for j, (slot, old) in enumerate(zip(t.slots, before)):
        if j < layers:
            assert torch.equal(slot[7], old[3]) and torch.equal(slot[9], old[3])
        else:
            assert torch.equal(slot[7], old[7]) and torch.equal(slot[9], old[9])
        untouched = [b for b in range(t.num_blocks) if b not in (7, 9)]
        assert torch.equal(slot[untouched], old[untouched])
    for bad in [(len(t.groups), 3, 7), (group, 0, 7), (group, 3, t.num_blocks)]:
        with pytest.raises(ValueError, match="block copy"):
            t.copy_blocks([bad])
