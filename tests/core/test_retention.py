"""Sliding-window and Mamba checkpoint retention (docs/semantics.md#checkpoint-retention):
``prefix_cache_retention_interval`` unset (dense) / 0 (sparse) / N, as vLLM 0.33 decides.

The rule under test: with retention 0, a request's sparse-group checkpoints are exactly the
ones at its reachable boundaries (the replay boundary ``num_prompt_tokens - 1`` and the
junction its lookup reported), rounded down to the hit alignment; with N, also one per
N-token segment; unset, every eligible one.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service.core.errors import ConfigError
from cache_service.core.pool import Pool
from cache_service.core.specs import KVCacheSpec

from builders import full, make_pool, mamba, prefill, prefill_chunks, swa

PROMPT = [(7 * i + 3) % 1000 for i in range(300)]


def hybrid(retention: int | None, *specs: KVCacheSpec, **options: Any) -> Pool:
    return make_pool(256, full(16), *(specs or (mamba(16),)), max_model_len=1024,
                     prefix_cache_retention_interval=retention, **options)


def mamba_checkpoints(p: Pool, rid: str, group: int = 1) -> list[int]:
    """Token positions whose state block of ``rid`` is in the prefix cache."""
    bs = p.config.groups[group].spec.block_size
    table = p.manager.get_blocks(rid)[group]
    return [(i + 1) * bs for i, b in enumerate(table) if b.block_hash is not None]


def test_dense_caches_every_chunk_end_sparse_only_the_replay_boundary() -> None:
    ends = [64, 128, 192, 200]
    dense, sparse, every128 = hybrid(None), hybrid(0), hybrid(128)
    for p in (dense, sparse, every128):
        prefill(p, "a", PROMPT[:200], ends)
    # The state of the running block is kept until the request moves on; look at the
    # cache instead of the table: a request sharing 150 tokens.
    assert dense.peek_prefix(PROMPT[:150] + [999] * 10) == 128
    assert sparse.peek_prefix(PROMPT[:150] + [999] * 10) == 0
    assert every128.peek_prefix(PROMPT[:150] + [999] * 10) == 128
    # 199 // 16 * 16 = 192: the replay boundary is kept by every setting.
    for p in (dense, sparse, every128):
        assert p.peek_prefix(PROMPT[:200]) == 192
    assert dense.peek_prefix(PROMPT[:100] + [999] * 10) == 64
    assert sparse.peek_prefix(PROMPT[:100] + [999] * 10) == 0
    assert every128.peek_prefix(PROMPT[:100] + [999] * 10) == 0


def test_the_junction_a_lookup_reports_is_checkpointed() -> None:
    """The worked example of docs/semantics.md#checkpoint-retention."""
    p = hybrid(0)
    prefill(p, "a", PROMPT[:200], [64, 128, 192, 200])
    b = PROMPT[:100] + [500 + i for i in range(200)]
    p.add_request("b", b)
    hit = p.lookup("b")
    # Full attention holds 96 tokens of b, the Mamba group none: the junction is 96.
    assert (hit.hit_tokens, hit.shared_prefix_boundary) == (0, 96)
    p.new_step()
    assert p.allocate("b", 96).ok  # vLLM's scheduler ends the chunk at the junction
    p.new_step()
    assert p.allocate("b", 300 - 96).ok
    p.new_step()
    assert mamba_checkpoints(p, "b") == [96]
    c = PROMPT[:100] + [900] * 50
    assert p.peek_prefix(c) == 96


def test_a_later_lookup_without_junction_clears_it() -> None:
    p = hybrid(0)
    prefill(p, "a", PROMPT[:200], [64, 128, 192, 200])
    p.add_request("b", PROMPT[:100] + [1] * 100)
    assert p.lookup("b").shared_prefix_boundary == 96
    p.free("a")
    assert p.reset_prefix_cache()
    assert p.lookup("b").shared_prefix_boundary == 0
    p.new_step()
    assert p.allocate("b", 96).ok
    p.new_step()
    assert p.allocate("b", 104).ok
    # Only the replay boundary (199 // 16 * 16 = 192) would be kept; 96 is not.
    assert mamba_checkpoints(p, "b") == []


def test_sliding_window_keeps_only_the_window_before_each_boundary() -> None:
    # Window 33 with block 16: a hit needs the cdiv(32, 16) = 2 blocks before it.
    p = hybrid(0, swa(16, 33))
    prefill(p, "a", PROMPT[:200], [200])
    def cached_swa_blocks(pool: Pool) -> list[int]:
        return [i for i, b in enumerate(pool.manager.get_blocks("a")[1])
                if b.block_hash is not None]

    # 199 // 16 * 16 = 192 = block 12's start: blocks 10 and 11 are kept.
    assert cached_swa_blocks(p) == [10, 11]
    dense = hybrid(None, swa(16, 33))
    prefill(dense, "a", PROMPT[:200], [200])
    assert cached_swa_blocks(dense) == list(range(12))
    assert dense.peek_prefix(PROMPT[:120] + [999] * 10) == 112
    assert p.peek_prefix(PROMPT[:120] + [999] * 10) == 0


def test_interval_keeps_one_tail_per_segment() -> None:
    p = hybrid(64, swa(16, 17))  # need = 1 block
    prefill(p, "a", PROMPT[:200], [200])
    assert p.peek_prefix(PROMPT[:140] + [999] * 10) == 128
    assert p.peek_prefix(PROMPT[:100] + [999] * 10) == 64
    assert p.peek_prefix(PROMPT[:200]) == 192


@pytest.mark.parametrize(("specs", "retention", "message"), [
    ((), 24, "multiple of scheduler_block_size"),
    ((), -16, "non-negative"),
    ((full(16),), 32, "no sliding-window or Mamba group"),
])
def test_invalid_intervals_name_the_option(specs, retention, message) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        if specs:
            make_pool(64, *specs, prefix_cache_retention_interval=retention)
        else:
            hybrid(retention)
    assert e.value.field == "prefix_cache_retention_interval"


def test_zero_is_accepted_without_sparse_groups_and_changes_nothing() -> None:
    a = make_pool(64, full(16), prefix_cache_retention_interval=0)
    b = make_pool(64, full(16))
    for p in (a, b):
        prefill(p, "a", PROMPT[:200], [100, 200])
    assert a.peek_prefix(PROMPT[:150]) == b.peek_prefix(PROMPT[:150]) == 144


def chunk_ends(rng: random.Random, start: int, num_tokens: int, bs: int) -> list[int]:
    """vLLM's align-mode chunking: chunk ends on block boundaries, except the last."""
    ends = []
    pos = start
    while pos < num_tokens:
        step = rng.choice([16, 32, 48, 64, 128])
        end = min(pos + step, num_tokens)
        if end < num_tokens:
            end = end // bs * bs
        ends.append(end)
        pos = end
    return ends


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), retention=st.sampled_from([0, 64]))
def test_retained_checkpoints_are_exactly_the_boundaries_and_junctions(
        seed: int, retention: int) -> None:
    """Property: after each request's prefill, its cached Mamba states are exactly the
    chunk ends (states the schedule wrote at a block boundary) that are a reachable
    boundary of the request -- its replay boundary or its lookup's junction, rounded down to
    the block -- or (with an interval) a segment end."""
    rng = random.Random(seed)
    bs = 16
    p = hybrid(retention)
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice([32, 48, 100]))]
                for _ in range(3)]
    for k in range(6):
        prompt = (rng.choice(prefixes) if rng.random() < 0.8 else []) + [
            rng.randrange(1000) for _ in range(rng.randrange(1, 120))]
        rid = f"r{k}"
        p.add_request(rid, prompt)
        looked = p.lookup(rid)
        hit, junction = looked.hit_tokens, looked.shared_prefix_boundary
        ends = chunk_ends(rng, hit, len(prompt), bs)
        if junction and hit < junction:
            # vLLM's scheduler stops a chunk at the junction (block-floored).
            stop = junction // bs * bs
            ends = sorted({e for e in ends if e != stop} | {stop})
        prefill_chunks(p, rid, hit, ends)
        reachable = {(len(prompt) - 1) // bs * bs, junction // bs * bs}
        written = {e for e in ends if e % bs == 0 and e > hit}
        expected = {e for e in written if e in reachable or (retention and e % retention == 0)}
        # A state at e is in the cache iff a request of e + 1 tokens would hit e.
        cached = {e for e in written if p.peek_prefix(prompt[:e] + [1001]) == e}
        assert cached == expected, (ends, junction)
        p.free(rid)


# -- the static mask (cache_service.core.retention.reachable_block_mask) --------------------

def _as_set(mask: list[bool] | None, start: int, end: int) -> set[int]:
    return set(range(start, end)) if mask is None else {start + i for i, k in enumerate(mask) if k}


@settings(max_examples=300, deadline=None)
@given(bs=st.sampled_from([1, 2, 4, 8]), k=st.integers(1, 4), window=st.integers(1, 40),
       eagle=st.booleans(), start=st.integers(0, 30), length=st.integers(0, 30),
       retention=st.sampled_from([0, 1, 2, 3]),
       boundaries=st.lists(st.integers(0, 300), max_size=3))
def test_a_sparse_mask_keeps_a_subset_of_the_dense_one_and_every_run_a_hit_reads(
        bs: int, k: int, window: int, eagle: bool, start: int, length: int, retention: int,
        boundaries: list[int]) -> None:
    from cache_service.core.retention import reachable_block_mask

    spec = swa(bs, window)
    alignment = k * bs
    interval = retention * alignment  # 0 = only the boundaries
    # A boundary below the alignment rounds to a 0-token hit, whose EAGLE run (block 0)
    # vLLM keeps although no dense boundary does: not a hit worth comparing.
    boundaries = [b for b in boundaries if b >= alignment]
    end = start + length
    dense = reachable_block_mask(spec, start, end, alignment, use_eagle=eagle)
    sparse = reachable_block_mask(spec, start, end, alignment, use_eagle=eagle,
                                  retention_interval=interval, reachable_boundaries=boundaries)
    assert _as_set(sparse, start, end) <= _as_set(dense, start, end)
    # Per block, not per range: a sub-range's mask is the slice of the whole one.
    whole = reachable_block_mask(spec, 0, end, alignment, use_eagle=eagle,
                                 retention_interval=interval, reachable_boundaries=boundaries)
    assert _as_set(sparse, start, end) == _as_set(whole, 0, end) & set(range(start, end))
    # The run a hit at each given boundary reads (its window, plus EAGLE's dropped block).
    need = -(-(window - 1) // bs) + eagle
    for b in boundaries:
        top = b // alignment * alignment // bs + eagle
        assert set(range(max(start, top - need), min(end, top))) <= _as_set(sparse, start, end)


def test_mask_of_other_kinds_and_of_mamba_states() -> None:
    from cache_service.core.retention import reachable_block_mask

    assert reachable_block_mask(full(16), 0, 10, 16, retention_interval=0) is None
    assert reachable_block_mask(mamba(16), 0, 10, 16) is None  # dense
    # Retention 64 with 16-token states: every 4th state (blocks 3, 7), plus the one at
    # the boundary 90 rounded down to 80 (block 4).
    assert reachable_block_mask(mamba(16), 0, 10, 16, retention_interval=64,
                                reachable_boundaries=[90]) == \
        [False, False, False, True, True, False, False, True, False, False]
    # Window 5 in 4-token blocks: a hit reads 1 block. Segments of 4 blocks keep blocks 3
    # and 7; the unfinished last segment (blocks 8-9) keeps the run ending at its end.
    assert reachable_block_mask(swa(4, 5), 0, 10, 4, retention_interval=16,
                                final_segment_end_block=10) == \
        [False, False, False, True, False, False, False, True, False, True]
