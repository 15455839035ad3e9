"""Per-type managers: the truth tables and worked examples of
docs/semantics.md#per-group-type-rules."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service.core.block_pool import BlockPool
from cache_service.core.single_type_managers import (
    ChunkedLocalAttentionManager,
    CircularBufferManager,
    CoarseHashView,
    FullAttentionManager,
    MambaManager,
    RSWAManager,
    SlidingWindowManager,
    hash_view,
)
from cache_service.core.specs import CircularBufferSpec, FullAttentionSpec, RSWASpec

from builders import chunked, full, make_pool, mamba, place_cached, swa, table_ids

T, F = True, False


def hit(manager_cls, spec, pattern, max_length=None, alignment=None):
    """(number of hit blocks, which of them are real) for a cache ``pattern``."""
    pool = BlockPool(64, True, spec.block_size)
    hashes = place_cached(pool, pattern, block_size=spec.block_size)
    bs = spec.block_size
    (blocks,), length = manager_cls.find_longest_cache_hit(
        hashes, len(pattern) * bs if max_length is None else max_length, [0], pool, spec,
        bs if alignment is None else alignment)
    assert length == len(blocks) * bs
    return len(blocks), [not b.is_null for b in blocks]


@pytest.mark.parametrize("pattern,expected", [
    ([F] * 10, 0), ([T], 1), ([T, F], 1), ([T, T], 2), ([T, T, F], 2), ([T, T, T], 3),
    ([T, T, T, F], 3), ([T, T, F, T, F, F, T, T, F, T, T, T], 12),
    ([T, T, F, T, F, F, T, T, F, F, F], 8), ([T, T, F, T, F, F, T, T, F, F, F, T], 8),
])
def test_sliding_window_truth_table(pattern, expected) -> None:
    n, real = hit(SlidingWindowManager, swa(bs=2, window=4), pattern)
    assert n == expected
    if expected in (8, 12):
        assert real == [False] * (expected - 2) + [True, True]


@pytest.mark.parametrize("pattern,tail,expected", [
    ([T], 0, 1), ([T], 1, 1), ([T, F], 0, 2), ([T, T], 0, 2), ([T, T, F], 0, 2),
    ([T, T, T], 0, 3), ([T, T, T, F], 0, 4),
    ([F] * 8 + [T], 1, 9), ([T] * 8 + [T], 1, 9), ([T] * 8 + [F], 1, 8),
    ([F] * 8 + [F, F], 0, 10), ([T] * 8 + [T, F], 1, 10),
])
def test_chunked_local_truth_table(pattern, tail, expected) -> None:
    n, _ = hit(ChunkedLocalAttentionManager, chunked(bs=2, chunk=4), pattern,
               max_length=len(pattern) * 2 + tail)
    assert n == expected


@pytest.mark.parametrize("pattern,max_length,expected", [
    ([T, T, T, F, T], None, 3), ([F, T], None, 0), ([T, T, T, T], 12, 3), ([T, T, T], 7, 1),
])
def test_full_attention_stops_at_first_miss(pattern, max_length, expected) -> None:
    n, real = hit(FullAttentionManager, full(4), pattern, max_length=max_length)
    assert n == expected and all(real)


def test_full_attention_rounds_down_to_alignment() -> None:
    n, _ = hit(FullAttentionManager, full(4), [T, T, T], alignment=8)
    assert n == 2


@pytest.mark.parametrize("pattern,alignment,expected", [
    ([T, F, T, F], 4, 3), ([T, T, F, F], 4, 2), ([F, F, F], 4, 0), ([T, T, T, F], 8, 2),
    ([T, F, T, F], 8, 0),
])
def test_mamba_hit_is_the_last_aligned_state(pattern, alignment, expected) -> None:
    n, real = hit(MambaManager, mamba(4), pattern, alignment=alignment)
    assert n == expected
    if n:
        assert real == [False] * (n - 1) + [True]


def test_coarse_hash_view() -> None:
    fine = [b"A", b"B", b"C", b"D", b"E"]
    view = hash_view(fine, 16, 32)
    assert isinstance(view, CoarseHashView) and list(view) == [b"B", b"D"]
    assert view[-1] == b"D" and view[0:2] == [b"B", b"D"]
    assert hash_view(fine, 16, 16) is fine


def _manager_with_table(cls, spec, first_id: int, n: int):
    pool = BlockPool(first_id + n + 8, True, spec.block_size)
    pool.get_new_blocks(first_id - 1)
    blocks = pool.get_new_blocks(n)
    manager = cls(spec, pool, 0, enable_caching=True)
    manager.req_to_blocks["r"] = list(blocks)
    manager.req_to_ids["r"] = table_ids(blocks)
    return manager, pool


def test_sliding_window_remove_skipped_worked_example() -> None:
    manager, pool = _manager_with_table(SlidingWindowManager, swa(bs=2, window=4), 1000, 11)

    def nulled() -> list[int]:
        return [i for i, b in enumerate(manager.req_to_blocks["r"]) if b.is_null]

    for n, expected in [(0, []), (4, []), (5, [0]), (6, [0]), (7, [0, 1]), (11, [0, 1, 2, 3])]:
        manager.remove_skipped_blocks("r", n)
        assert nulled() == expected, n
        assert manager.req_to_ids["r"][:len(expected)] == [0] * len(expected)
    # 1003 was freed before 1002, so 1003 is reused first (prepended in that order).
    assert table_ids(pool.free_block_queue.get_all_free_blocks()[:4]) == [1003, 1002, 1001, 1000]


def test_chunked_local_remove_skipped_worked_example() -> None:
    manager, _ = _manager_with_table(ChunkedLocalAttentionManager, chunked(bs=2, chunk=4), 10, 8)
    for n, expected in [(4, 2), (6, 2), (12, 6)]:
        manager.remove_skipped_blocks("r", n)
        assert sum(b.is_null for b in manager.req_to_blocks["r"]) == expected


@pytest.mark.parametrize("cls,spec", [
    (SlidingWindowManager, swa(bs=2, window=4)),
    (ChunkedLocalAttentionManager, chunked(bs=2, chunk=4)),
])
def test_get_num_blocks_to_allocate_counts_evictable_hits(cls, spec) -> None:
    pool = BlockPool(64, True, 2)
    manager = cls(spec, pool, 0, enable_caching=True)
    cached = pool.get_new_blocks(10)
    pool.free_blocks(cached)  # ref 0: touching them consumes free capacity
    assert manager.get_num_blocks_to_allocate("1", 20 * 2, cached, 0, 20, 40) == 20
    hits = [pool.null_block] * 5 + cached[5:]
    assert manager.get_num_blocks_to_allocate("2", 20 * 2, hits, 0, 20, 40) == 15
    # A pinned hit (ref > 0) costs nothing extra.
    pool.touch(cached)
    assert manager.get_num_blocks_to_allocate("3", 20 * 2, cached, 0, 20, 40) == 10


def test_admission_cap_limits_sliding_window_need() -> None:
    # docs/semantics.md#specs-and-sizing example:
    # bs 16, sw 64, in-flight 128 -> cdiv(191, 16) + 1 = 13 blocks.
    p = make_pool(64, swa(16, 64), max_model_len=4096, max_in_flight_tokens=128,
                  enable_caching=False)
    manager = p.manager.coordinator.managers[0]
    assert manager.max_admission_blocks == 13
    assert manager.get_num_blocks_to_allocate("x", 4096, [], 0, 0, 4096,
                                              apply_admission_cap=True) == 13
    assert manager.get_num_blocks_to_allocate("x", 4096, [], 0, 0, 4096) == 256


def test_lookahead_slots_are_allocated_not_cached() -> None:
    # docs/semantics.md#allocate-slots: bs 4, 3 new + 2 lookahead -> 2 blocks; 3 + 4 -> 2 blocks.
    for lookahead in (2, 4):
        p = make_pool(16, full(4), max_model_len=64)
        p.add_request("r", [1, 2, 3])
        res = p.allocate("r", 3, num_lookahead_tokens=lookahead)
        assert len(res.new_block_ids[0]) == 2
        assert p.stats().num_cached_blocks == 0


def test_design_doc_example_sliding_window_keeps_only_the_window() -> None:
    # 112 tokens, sw 32, bs 16: after computing them, the SWA group needs only 2 blocks.
    p = make_pool(64, full(16), swa(16, 32), enable_caching=False)
    p.add_request("r", list(range(113)))
    p.allocate("r", 112)
    p.allocate("r", 1)  # the next allocation releases what left the window
    full_ids, swa_ids = p.block_ids("r")
    assert len(full_ids) == 8 and 0 not in full_ids
    assert swa_ids[:5] == [0] * 5 and 0 not in swa_ids[5:]


def test_mamba_state_cached_this_step_is_not_adoptable_until_next_step() -> None:
    p = make_pool(64, full(4), mamba(4), max_model_len=256)
    prompt = list(range(20))
    p.add_request("a", prompt)
    p.new_step()
    assert p.allocate("a", 16).ok  # chunk ends on a block boundary: state cached
    p.add_request("b", prompt)
    assert p.lookup("b").hit_tokens == 16
    assert not p.allocate("b", 4).ok  # same step: the state is not written yet
    p.new_step()
    assert p.lookup("b").hit_tokens == 16
    res = p.allocate("b", 4)
    assert res.ok and res.hit_tokens_used == 16
    p.check_invariants()


def test_mamba_align_keeps_only_running_states() -> None:
    p = make_pool(64, full(4), mamba(4), max_model_len=256)
    p.add_request("a", list(range(40)))
    for chunk in (8, 8, 8, 8, 8):
        p.new_step()
        assert p.allocate("a", chunk).ok
        mamba_ids = p.block_ids("a")[1]
        assert sum(1 for i in mamba_ids if i) <= 2  # current state + previous (copy source)
        p.check_invariants()


# -- R-SWA and the circular buffer (docs/semantics.md#rswa, #circular-buffer) --------------

def rswa(bs: int = 16, window: int = 16) -> RSWASpec:
    return RSWASpec(block_size=bs, rswa_window=window, head_size=1)


def ring(rows: int = 8) -> CircularBufferSpec:
    return CircularBufferSpec(block_size=rows, head_size=1)


@settings(max_examples=40, deadline=None)
@given(prompt=st.integers(1, 70), window=st.integers(1, 40), bs=st.sampled_from([2, 4, 8]),
       steps=st.integers(0, 60))
def test_rswa_frees_exactly_the_gap_between_prompt_and_window(prompt: int, window: int,
                                                              bs: int, steps: int) -> None:
    # Every allocation first frees the blocks wholly inside [cdiv(P, bs) * bs,
    # max(P, computed - W)); every other block of the table stays held.
    p = make_pool(256, full(bs), rswa(bs, window), max_model_len=512)
    p.add_request("r", list(range(prompt)))
    assert p.allocate("r", prompt).ok
    for k in range(steps):
        p.append_tokens("r", [1000 + k])
        computed = prompt + k
        assert p.allocate("r", 1).ok
        first = -(-prompt // bs)
        last = max(prompt, computed - window) // bs
        full_table, rswa_table = p.block_ids("r")
        assert 0 not in full_table  # full attention keeps everything
        assert len(rswa_table) == len(full_table) == -(-(computed + 1) // bs)
        assert [i for i, b in enumerate(rswa_table) if b == 0] == list(range(first, last))


def test_rswa_hits_and_caching_are_full_attentions() -> None:
    # The gap blocks were cached before they were freed: a sibling sharing the decoded
    # text hits them as it would in a full-attention group, in both groups alike.
    p = make_pool(128, full(4), rswa(4, 4), max_model_len=256)
    p.add_request("a", list(range(8)))
    assert p.allocate("a", 8).ok
    for k in range(16):
        p.append_tokens("a", [100 + k])
        assert p.allocate("a", 1).ok
    tokens = list(range(8)) + [100 + k for k in range(16)]
    assert 0 in p.block_ids("a")[1]  # a gap was freed
    p.add_request("b", tokens + [7, 7, 7, 7, 7])
    hit = p.lookup("b")
    assert hit.hit_tokens == 24
    assert len(hit.block_ids[0]) == len(hit.block_ids[1]) == 6
    assert 0 not in hit.block_ids[1]


def test_rswa_layers_group_apart_from_full_attention() -> None:
    from cache_service.core.grouping import get_kv_cache_groups

    groups = get_kv_cache_groups({"f0": full(16), "r0": rswa(16, 32), "f1": full(16),
                                  "r1": rswa(16, 32)})
    assert sorted(tuple(g.layer_names) for g in groups) == [("f0", "f1"), ("r0", "r1")]
    assert {type(g.spec) for g in groups} == {FullAttentionSpec, RSWASpec}


@settings(max_examples=30, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "alloc", "free", "preempt"]),
                              st.integers(0, 3), st.integers(1, 40)), max_size=40))
def test_a_ring_is_one_block_for_the_request_life(ops: list[tuple[str, int, int]]) -> None:
    # Whatever the schedule: a request's ring table is empty before its first allocation,
    # then exactly one block that never changes until it is freed or preempted; the ring
    # is never cached and never part of a hit.
    p = make_pool(128, full(16), ring(8), max_model_len=512)
    rings: dict[str, int] = {}
    for kind, i, n in ops:
        rid = f"r{i}"
        if kind == "add" and not p.has_request(rid):
            p.add_request(rid, [i * 7 + j % 5 for j in range(n)])
            hit = p.lookup(rid)
            assert hit.block_ids[1] == []
        elif kind == "alloc" and p.has_request(rid):
            info = p.request_info(rid)
            want = max(1, min(n, info.num_tokens - info.num_computed_tokens))
            if info.num_computed_tokens + want > info.num_tokens:
                p.append_tokens(rid, [9] * want)
            res = p.allocate(rid, want)
            table = p.block_ids(rid)[1]
            if res.ok:
                assert len(table) == 1 and table[0] != 0
                assert rings.setdefault(rid, table[0]) == table[0]
                assert res.new_block_ids[1] in ([], table)
        elif kind in ("free", "preempt") and p.has_request(rid):
            (p.free if kind == "free" else p.preempt)(rid)
            rings.pop(rid, None)
            if kind == "preempt":
                assert p.block_ids(rid)[1] == []
        assert p.stats().num_cached_blocks_per_group[1] == 0
    held = {b for b in rings.values()}
    assert len(held) == len(rings)  # rings are never shared


def test_ring_blocks_are_not_part_of_the_hash_block_size() -> None:
    p = make_pool(64, full(16), ring(8), max_model_len=256)
    assert (p.scheduler_block_size, p.hash_block_size) == (16, 16)
    manager = CircularBufferManager(ring(8), BlockPool(8, True, 8), 0, enable_caching=True)
    assert manager.get_num_blocks_to_allocate("x", 10_000, [], 0, 0, 10_000) == 1
    assert len(manager.allocate_new_blocks("x", 10_000, 10_000)) == 1
    assert manager.get_num_blocks_to_allocate("x", 20_000, [], 0, 0, 20_000) == 0
    assert manager.allocate_new_blocks("x", 20_000, 20_000) == []


def test_rswa_worked_example_of_the_docs() -> None:
    # docs/semantics.md#rswa: bs 16, P 20, W 16.
    manager, _ = _manager_with_table(RSWAManager, rswa(16, 16), 100, 6)
    for n, nulls in [(63, []), (64, [2]), (79, [2]), (80, [2, 3]), (96, [2, 3, 4])]:
        manager.remove_gap_blocks("r", n, 20)
        assert [i for i, b in enumerate(manager.req_to_blocks["r"]) if b.is_null] == nulls, n
