"""Release hints (cache_service/core/release_hints.py): a request freed "evict first"
puts the blocks it releases at the free queue's front; shared blocks are unaffected."""

from __future__ import annotations

import pytest

from cache_service.core.errors import InvalidArgument
from cache_service.core.operations import Free

from builders import full, make_pool


def _free_order(pool) -> list[int]:
    return [b.block_id for b in pool.manager.pool.free_block_queue.get_all_free_blocks()]


def test_a_hinted_free_goes_to_the_front_tail_first() -> None:
    pool = make_pool(17, full(4), max_model_len=32)
    for rid, tokens in (("a", list(range(1, 14))), ("b", list(range(20, 33)))):
        pool.add_request(rid, tokens)
        assert pool.allocate(rid, 13).ok
    b_blocks = pool.block_ids("b")[0]
    pool.free("a")
    plain_order = _free_order(pool)
    pool.apply_batch([Free("b", evict_first=True)])
    assert _free_order(pool) == b_blocks[::-1] + plain_order
    pool.check_invariants()
    # The hinted prefix is the first evicted: one more request of 3 blocks takes it.
    pool.add_request("c", [90] * 13)
    assert pool.allocate("c", 13).ok
    assert pool.peek_prefix(list(range(20, 33))) == 0
    assert pool.peek_prefix(list(range(1, 14))) == 12


def test_a_hint_leaves_blocks_another_request_holds_in_place() -> None:
    pool = make_pool(17, full(4), max_model_len=32)
    shared = list(range(1, 14))
    for rid in ("a", "b"):
        pool.add_request(rid, shared + [40])
        hit = pool.lookup(rid).hit_tokens
        assert pool.allocate(rid, 14 - hit).ok
    a_own = pool.block_ids("a")[0][3]
    pool.apply_batch([Free("a", evict_first=True)])
    b_table = pool.block_ids("b")[0]
    assert _free_order(pool)[0] == a_own  # only a's own block was released
    pool.free("b")  # the shared prefix then enters at the back, as usual (tail first)
    assert _free_order(pool)[-3:] == b_table[:3][::-1]
    pool.check_invariants()


def test_a_hint_must_be_a_boolean() -> None:
    pool = make_pool(17, full(4), max_model_len=32)
    pool.add_request("a", [1, 2, 3])
    with pytest.raises(InvalidArgument) as err:
        pool.apply_batch([Free("a", evict_first=1)])
    assert err.value.field == "ops[0].free.evict_first"
    assert pool.has_request("a")
