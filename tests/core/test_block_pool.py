"""BlockPool: null block, 0.33 free order, the duplicate-tolerant map, events."""

from __future__ import annotations

import pytest

from cache_service.core.block_pool import BlockPool
from cache_service.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from cache_service.core.hashing import external_block_hash

from builders import dummy_request, fake_hash, table_ids


def pool(n: int = 10, *, caching: bool = True, events: bool = False, groups: int = 1) -> BlockPool:
    return BlockPool(n, caching, 4, num_groups=groups, enable_events=events)


def cache(p: BlockPool, block, i: int, gid: int = 0) -> None:
    p.cache_full_blocks(dummy_request(), [block], [fake_hash(i)], 0, 1, 4, gid)


def test_null_block_and_initial_order() -> None:
    p = pool(6)
    assert p.null_block.block_id == 0 and p.null_block.is_null
    assert p.get_num_free_blocks() == 5
    assert table_ids(p.free_block_queue.get_all_free_blocks()) == [1, 2, 3, 4, 5]
    blocks = p.get_new_blocks(2)
    assert table_ids(blocks) == [1, 2] and all(b.ref_cnt == 1 for b in blocks)
    assert p.get_usage() == pytest.approx(2 / 5)
    p.check_invariants()


def test_get_new_blocks_beyond_free_raises_without_change() -> None:
    p = pool(4)
    with pytest.raises(ValueError, match="Cannot get 4 free blocks"):
        p.get_new_blocks(4)
    assert p.get_num_free_blocks() == 3


def test_free_order_unhashed_front_hashed_back() -> None:
    p = pool(8)
    a, b, c, d = p.get_new_blocks(4)  # 1..4; queue now 5,6,7
    cache(p, a, 0)
    cache(p, b, 1)
    # Tail first, as managers do: d (unhashed), c (unhashed), b (hashed), a (hashed).
    p.free_blocks([d, c, b, a])
    assert table_ids(p.free_block_queue.get_all_free_blocks()) == [4, 3, 5, 6, 7, 2, 1]
    p.check_invariants()


def test_free_without_caching_puts_everything_in_front() -> None:
    p = pool(6, caching=False)
    a, b = p.get_new_blocks(2)
    a.block_hash = b"x"  # even a hashed block goes to the front when caching is off
    p.free_blocks([b, a])
    assert table_ids(p.free_block_queue.get_all_free_blocks())[:2] == [2, 1]


def test_touch_pins_a_cached_free_block() -> None:
    p = pool(6)
    (a,) = p.get_new_blocks(1)
    cache(p, a, 0)
    p.free_blocks([a])
    assert p.get_cached_block(fake_hash(0), [0]) == [a]
    free_before = p.get_num_free_blocks()
    p.touch([a, p.null_block])
    assert a.ref_cnt == 1 and p.get_num_free_blocks() == free_before - 1
    p.touch([a])
    assert a.ref_cnt == 2
    p.check_invariants()


def test_duplicates_first_inserted_wins_and_pop_keeps_the_other() -> None:
    p = pool(6)
    a, b = p.get_new_blocks(2)
    cache(p, a, 0)
    cache(p, b, 0)  # same key, second block: both cached
    assert p.num_cached_keys == 1
    assert p.get_cached_block(fake_hash(0), [0]) == [a]
    p.evict_blocks([a.block_id])
    assert a.block_hash is None and p.get_cached_block(fake_hash(0), [0]) == [b]
    p.evict_blocks([b.block_id])
    assert p.num_cached_keys == 0
    p.check_invariants()


def test_get_cached_block_needs_every_group() -> None:
    p = pool(8, groups=2)
    a, b = p.get_new_blocks(2)
    cache(p, a, 0, gid=0)
    assert p.get_cached_block(fake_hash(0), [0, 1]) is None
    cache(p, b, 0, gid=1)
    assert p.get_cached_block(fake_hash(0), [0, 1]) == [a, b]
    assert p.num_cached_keys_per_group() == [1, 1]


def test_eviction_on_reuse_emits_events_in_order() -> None:
    p = pool(3, events=True)  # 2 usable blocks
    a, b = p.get_new_blocks(2)
    req = dummy_request(hashes=[fake_hash(0), fake_hash(1)])
    req.all_token_ids = list(range(8))
    p.cache_full_blocks(req, [a, b], req.block_hashes, 0, 2, 4, 0)
    p.free_blocks([b, a])
    (stored,) = p.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [external_block_hash(fake_hash(i)) for i in range(2)]
    assert stored.parent_block_hash is None and stored.token_ids == list(range(8))
    assert stored.block_size == 4 and stored.extra_keys == [None, None]
    got = p.get_new_blocks(2)  # evicts both, in queue order b, a
    assert table_ids(got) == [b.block_id, a.block_id]
    events = p.take_events()
    assert [type(e) for e in events] == [BlockRemoved, BlockRemoved]
    assert isinstance(events[0], BlockRemoved)  # (for the type checker)
    assert events[0].block_hashes == [external_block_hash(fake_hash(1))]
    assert p.num_evictions == 2 and p.num_cached_keys == 0
    assert p.take_events() == []


def test_stored_event_parent_and_extra_keys() -> None:
    p = pool(6, events=True)
    blocks = p.get_new_blocks(3)
    req = dummy_request(hashes=[fake_hash(i) for i in range(3)])
    req.all_token_ids = list(range(12))
    req.lora_name, req.cache_salt = "adapter", "salt"
    p.cache_full_blocks(req, blocks, req.block_hashes, 0, 1, 4, 0)
    p.cache_full_blocks(req, blocks, req.block_hashes, 1, 3, 4, 0)
    first, second = p.take_events()
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.extra_keys == [("adapter", "salt")] and first.lora_name == "adapter"
    assert second.parent_block_hash == external_block_hash(fake_hash(0))
    assert second.token_ids == list(range(4, 12))
    assert second.extra_keys == [("adapter",), ("adapter",)]


def test_cache_full_blocks_skips_null_and_masked() -> None:
    p = pool(6)
    a, b = p.get_new_blocks(2)
    req = dummy_request(hashes=[fake_hash(i) for i in range(3)])
    p.cache_full_blocks(req, [p.null_block, a, b], req.block_hashes, 0, 3, 4, 0,
                        block_mask=[True, False, True])
    assert p.null_block.block_hash is None and a.block_hash is None
    assert b.block_hash == fake_hash(2)


def test_reset_only_when_nothing_is_in_use() -> None:
    p = pool(6, events=True)
    (a,) = p.get_new_blocks(1)
    cache(p, a, 0)
    p.take_events()
    assert p.reset_prefix_cache() is False and p.num_cached_keys == 1
    p.free_blocks([a])
    order = table_ids(p.free_block_queue.get_all_free_blocks())
    assert p.reset_prefix_cache() is True
    assert p.num_cached_keys == 0 and a.block_hash is None
    assert table_ids(p.free_block_queue.get_all_free_blocks()) == order
    assert isinstance(p.take_events()[-1], AllBlocksCleared)


def test_evict_blocks_rejects_bad_ids_without_change() -> None:
    p = pool(6)
    (a,) = p.get_new_blocks(1)
    cache(p, a, 0)
    with pytest.raises(ValueError):
        p.evict_blocks([a.block_id, 99])
    assert a.block_hash is not None


def test_million_block_pool_is_built_lazily() -> None:
    p = BlockPool(1_000_000, True, 16)
    assert p.get_num_free_blocks() == 999_999
    assert list(p.blocks) == [0]  # only the null block exists
    got = p.get_new_blocks(3)
    assert table_ids(got) == [1, 2, 3]
    p.free_blocks(reversed(got))
    assert table_ids(p.get_new_blocks(3)) == [3, 2, 1]  # tail-first free, prepended
