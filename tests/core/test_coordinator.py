"""Coordinators: selection, spec groups, and the hybrid fixed-point hit search
(docs/semantics.md#hybrid-fixed-point)."""

from __future__ import annotations

import pytest

from cache_service.core.coordinator import (
    HybridCoordinator,
    NoPrefixCacheCoordinator,
    UnitaryCoordinator,
    make_coordinator,
)
from cache_service.core.errors import ConfigError

from builders import chunked, config, cross_attention, full, make_pool, mamba, place_cached, swa


def coordinator(*specs, caching=True, sched=None, hbs=None, num_blocks=256):
    sizes = [s.block_size for s in specs]
    return make_coordinator(
        config(num_blocks, *specs), max_model_len=4096, max_in_flight_tokens=None,
        enable_caching=caching, enable_events=False,
        scheduler_block_size=sched or (sizes[0] if sizes else 1),
        hash_block_size=hbs or (sizes[0] if sizes else 1))


def test_selection() -> None:
    assert type(coordinator(full(2), swa(2), caching=False)) is NoPrefixCacheCoordinator
    assert type(coordinator(caching=False)) is NoPrefixCacheCoordinator  # zero groups
    assert type(coordinator(full(2))) is UnitaryCoordinator
    assert type(coordinator(full(2), swa(2))) is HybridCoordinator
    assert type(coordinator(swa(2), mamba(2))) is HybridCoordinator  # no full attention


@pytest.mark.parametrize("specs,kwargs", [
    ((full(2), mamba(2, "none")), {}),          # Mamba caching needs "align"
    ((full(4), swa(2)), {"sched": 2}),          # scheduler block not a multiple of 4
    ((), {}),                                   # caching with no group
    ((full(4), chunked(2, 8)), {"sched": 4, "hbs": 2}),
    ((cross_attention(2),), {}),
])
def test_bad_configs_raise_config_error(specs, kwargs) -> None:
    with pytest.raises(ConfigError):
        coordinator(*specs, **kwargs)


def test_spec_groups_join_equal_specs_and_put_full_first() -> None:
    c = coordinator(swa(2, 8), full(2), swa(2, 8), swa(2, 16), mamba(2))
    assert [sg.group_ids for sg in c.spec_groups] == [[1], [0, 2], [3], [4]]
    assert c.full_attention_group_id == 1


def test_simple_hybrid_truncates_full_attention_to_the_window_hit() -> None:
    c = coordinator(full(2), swa(2, 4))
    place_cached(c.pool, [True] * 6, [0], block_size=2)
    hashes = place_cached(c.pool, [True, True, True, False, False, True], [1], block_size=2)
    (full_blocks, swa_blocks), hit, uncached = c.find_longest_cache_hit(hashes, 12)
    assert hit == 6 and len(full_blocks) == 3
    assert [b.is_null for b in swa_blocks] == [True, False, False]
    assert uncached == 6  # full attention had 12 tokens: a shared prefix SWA lacks


def test_fixed_point_reiterates_non_downward_closed_groups() -> None:
    c = coordinator(full(2), swa(2, 4), mamba(2))
    place_cached(c.pool, [True] * 8, [0], block_size=2)
    place_cached(c.pool, [True, False, True, True, True, True, True, True], [1], block_size=2)
    hashes = place_cached(c.pool, [True, False, True, False, False, False, False, False], [2],
                          block_size=2)
    blocks, hit, uncached = c.find_longest_cache_hit(hashes, 16)
    # Pass 1: full 16, SWA 16, Mamba 6. Pass 2 at 6: SWA only has a run touching
    # block 0 -> 2; Mamba at 2 -> 2. Pass 3 confirms 2.
    assert hit == 2 and uncached == 14
    assert [len(b) for b in blocks] == [1, 1, 1]


def test_hybrid_with_no_hit_returns_empty_lists() -> None:
    c = coordinator(full(2), swa(2, 4), mamba(2))
    hashes = place_cached(c.pool, [False] * 4, [0], block_size=2)
    blocks, hit, uncached = c.find_longest_cache_hit(hashes, 8)
    assert (blocks, hit, uncached) == (([], [], []), 0, 0)


def test_hybrid_hits_are_multiples_of_the_lcm() -> None:
    c = coordinator(full(4), swa(2, 3), sched=4, hbs=2)
    # Group 0 sees the fine hashes at 4 tokens: positions 1 and 3 -> a full hit of 8.
    place_cached(c.pool, [True] * 4, [0], block_size=2)
    hashes = place_cached(c.pool, [True, True, True, False], [1], block_size=2)
    blocks, hit, _ = c.find_longest_cache_hit(hashes, 8)
    # SWA (one block per hit) may not end its run at 6 tokens (not aligned), so 4.
    assert hit == 4
    assert len(blocks[0]) == 1 and len(blocks[1]) == 2


def test_two_group_112_token_example_caches_96_tokens() -> None:
    # docs/semantics.md#cacheable-tokens:
    # block sizes 32 and 16 -> a 112-token request caches only 96 tokens.
    p = make_pool(64, full(32), swa(16, 1024))
    assert (p.scheduler_block_size, p.hash_block_size) == (32, 16)
    p.add_request("r", list(range(112)))
    assert p.allocate("r", 112).ok
    assert p.stats().num_cached_blocks_per_group == [3, 6]


def test_swa_cache_mask_under_alignment() -> None:
    # docs/semantics.md#cacheable-tokens:
    # full bs 32, SWA bs 8, window 8 -> only SWA blocks 3, 7, 11 are cached.
    p = make_pool(64, full(32), swa(8, 8))
    p.add_request("r", list(range(100)))
    assert p.allocate("r", 100).ok
    swa_table = p.manager.coordinator.managers[1].req_to_blocks["r"]
    assert [i for i, b in enumerate(swa_table) if b.block_hash is not None] == [3, 7, 11]


def test_uniform_type_group_runs_like_its_layer_type() -> None:
    from cache_service.core.specs import FullAttentionSpec, UniformTypeKVCacheSpecs

    uniform = UniformTypeKVCacheSpecs(block_size=4, layer_specs=(
        ("a", FullAttentionSpec(block_size=4, head_size=64)),
        ("b", FullAttentionSpec(block_size=4, head_size=128))))
    pools = [make_pool(32, uniform, swa(4, 8)), make_pool(32, full(4), swa(4, 8))]
    for p in pools:
        p.add_request("x", list(range(20)))
        p.allocate("x", 20)
        p.add_request("y", list(range(20)) + [1])
    assert pools[0].lookup("y") == pools[1].lookup("y")
    assert pools[0].lookup("y").hit_tokens == 20
    assert pools[0].manager.take_events()[0].spec_kind == "full_attention"
