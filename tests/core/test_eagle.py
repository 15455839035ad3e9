"""EAGLE (``use_eagle``, docs/semantics.md#eagle) as vLLM 0.33 decides: a hit gives up its
last matched unit so the drafter recomputes it, and caching and checkpoint retention keep
the blocks such hits land on. The bundled ``*_eagle*`` replay samples check the same
against vLLM's own manager; these tests state the rules."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service.core.errors import ConfigError
from cache_service.core.pool import Pool
from cache_service.core.specs import KVCacheSpec
from cache_service.replay import ConfigFileError, load_config

from builders import chunked, full, make_pool, mamba, prefill, swa

PROMPT = [(7 * i + 3) % 1000 for i in range(300)]


def pool(*specs: KVCacheSpec, eagle: bool = True, **options: Any) -> Pool:
    return make_pool(256, *(specs or (full(16),)), max_model_len=1024, use_eagle=eagle,
                     **options)


def cached_positions(p: Pool, rid: str, group: int) -> list[int]:
    """Indexes of ``rid``'s blocks (block size = hash block size) whose key is in the
    prefix cache of ``group`` (a released block stays cached until it is reused)."""
    cached = p.manager.pool.group_map(group)
    return [i for i, h in enumerate(p.block_hashes(rid)) if h in cached]


@settings(max_examples=40, deadline=None)
@given(cached=st.integers(1, 280), query=st.integers(1, 300), tail=st.integers(0, 3))
def test_one_group_hits_drop_their_last_block(cached: int, query: int, tail: int) -> None:
    """Full attention alone: the EAGLE hit is the plain hit less one block (never below
    0), for any cached prefix and any query sharing part of it."""
    plain, eagle = pool(eagle=False), pool()
    for p in (plain, eagle):
        prefill(p, "a", PROMPT[:cached], [cached])
    q = PROMPT[:query] + [999] * tail
    for p in (plain, eagle):
        p.add_request("q", q)
    assert eagle.lookup("q").hit_tokens == max(plain.lookup("q").hit_tokens - 16, 0)


def test_a_hybrid_lookup_reads_one_block_past_the_cap_before_dropping() -> None:
    """vLLM's proof margin: with several groups a group looks one drop unit past the
    candidate, so a block-aligned 192-token resend hits 176 (the whole prompt, less a
    block), while one group alone, capped at 191 first, hits 160."""
    one, two = pool(full(16)), pool(full(16), swa(16))
    for p in (one, two):
        prefill(p, "a", PROMPT[:192], [192])
        p.add_request("b", PROMPT[:192])
    assert one.lookup("b").hit_tokens == 160
    assert two.lookup("b").hit_tokens == 176
    # Without EAGLE both are capped at 191 -> 176.
    plain = pool(full(16), swa(16), eagle=False)
    prefill(plain, "a", PROMPT[:192], [192])
    plain.add_request("b", PROMPT[:192])
    assert plain.lookup("b").hit_tokens == 176


@pytest.mark.parametrize("eagle", [False, True])
def test_sparse_checkpoints_sit_where_an_eagle_hit_lands(eagle: bool) -> None:
    """Retention 0, 200-token prompt, block 16 (docs/semantics.md#eagle): without EAGLE the
    replay boundary is 192 (``199 // 16 * 16``), with it 176 (one block below both the
    resend's and the extension's aligned end); the sliding-window run (window 128: 8
    blocks, 9 with EAGLE) ends on the block above the boundary with EAGLE."""
    p = pool(full(16), swa(16), mamba(16), eagle=eagle, prefix_cache_retention_interval=0)
    prefill(p, "a", PROMPT[:200], [64, 128, 176, 192, 200])
    # Mamba block i holds the state after (i + 1) * 16 tokens.
    if eagle:
        assert cached_positions(p, "a", 1) == list(range(3, 12))
        assert cached_positions(p, "a", 2) == [10]
    else:
        assert cached_positions(p, "a", 1) == list(range(4, 12))
        assert cached_positions(p, "a", 2) == [11]
    # A resend hits where the kept checkpoint is: 192 less the dropped block with EAGLE.
    p.add_request("b", PROMPT[:200])
    assert p.lookup("b").hit_tokens == (176 if eagle else 192)


def test_the_shared_prefix_checkpoint_flag_needs_eagle_and_partial_hits() -> None:
    """vLLM narrows enable_mamba_shared_prefix_checkpoint to EAGLE pools with partial hits
    (a Mamba "align" group coarser than the hash block)."""
    def effective(*specs: KVCacheSpec, eagle: bool) -> bool:
        p = pool(*specs, eagle=eagle, enable_mamba_shared_prefix_checkpoint=True)
        return p.manager.mamba_shared_prefix_checkpoint

    assert effective(full(16), mamba(32), eagle=True)
    assert not effective(full(16), mamba(32), eagle=False)
    assert not effective(full(16), mamba(16), eagle=True)  # no partial hits


def test_options_the_core_refuses() -> None:
    with pytest.raises(ConfigError) as e:
        pool(chunked(16, 64))
    assert e.value.field == "use_eagle"
    # A replay config's value must be a boolean (the protocol's is one by type).
    with pytest.raises(ConfigFileError, match="use_eagle"):
        load_config({"num_blocks": 64, "max_model_len": 256, "use_eagle": 1,
                     "groups": [{"type": "full_attention", "block_size": 16}]})
    # Without caching there are no hits to drop: accepted, as in vLLM.
    pool(chunked(16, 64), enable_caching=False)
