"""FreeKVCacheBlockQueue: order, O(1) ops, and the lazily materialized fresh range."""

from __future__ import annotations

import pytest
from builders import table_ids
from hypothesis import given
from hypothesis import strategies as st

from cache_service.core.block import KVCacheBlock
from cache_service.core.free_queue import FreeKVCacheBlockQueue


def eager(n: int) -> tuple[FreeKVCacheBlockQueue, list[KVCacheBlock]]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return FreeKVCacheBlockQueue(blocks), blocks


def lazy(n: int) -> tuple[FreeKVCacheBlockQueue, dict[int, KVCacheBlock]]:
    made: dict[int, KVCacheBlock] = {}

    def materialize(i: int) -> KVCacheBlock:
        return made.setdefault(i, KVCacheBlock(i))

    return FreeKVCacheBlockQueue(fresh=range(n), materialize=materialize), made


def test_prepend_example_from_the_spec() -> None:
    # §2.1: prepend [4,5] to [0] -> [4,5,0]; then prepend [1,2] -> [1,2,4,5,0].
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue([blocks[0]])
    q.prepend_n([blocks[4], blocks[5]])
    assert table_ids(q.get_all_free_blocks()) == [4, 5, 0]
    q.prepend_n([blocks[1], blocks[2]])
    assert table_ids(q.get_all_free_blocks()) == [1, 2, 4, 5, 0]
    assert q.num_free_blocks == 5


def test_popleft_remove_append() -> None:
    q, blocks = eager(5)
    assert q.popleft().block_id == 0
    q.remove(blocks[2])
    q.append(blocks[0])
    assert table_ids(q.get_all_free_blocks()) == [1, 3, 4, 0]
    assert table_ids(q.popleft_n(3)) == [1, 3, 4]
    assert q.num_free_blocks == 1
    with pytest.raises(ValueError):
        q.popleft_n(2)


def test_popleft_on_empty_raises() -> None:
    q, _ = eager(0)
    with pytest.raises(ValueError, match="No free blocks"):
        q.popleft()


def test_fresh_range_keeps_its_position() -> None:
    q, made = lazy(6)
    first = q.popleft_n(2)  # materializes 0, 1
    assert table_ids(first) == [0, 1] and set(made) == {0, 1}
    q.prepend_n([first[1]])
    q.append(first[0])
    # front: 1, then the fresh 2..5, then 0 at the back
    assert table_ids(q.popleft_n(3)) == [1, 2, 3]
    assert set(made) == {0, 1, 2, 3}
    assert table_ids(q.get_all_free_blocks()) == [4, 5, 0]
    assert table_ids(q.popleft_n(3)) == [4, 5, 0]
    assert q.num_free_blocks == 0


ops = st.lists(st.tuples(st.sampled_from(["pop", "popn", "append", "prepend", "remove"]),
                         st.integers(0, 5)), max_size=60)


@given(ops)
def test_lazy_queue_equals_eager_queue(script: list[tuple[str, int]]) -> None:
    """The fresh-range queue behaves exactly like one linked block by block."""
    n = 12
    eq, eblocks = eager(n)
    lq, made = lazy(n)
    model = list(range(n))
    out_e: list[int] = []
    out_l: list[int] = []
    taken: list[int] = []
    for op, k in script:
        if op in ("pop", "popn"):
            k = 1 if op == "pop" else min(k, len(model))
            if not model:
                continue
            got_e = table_ids(eq.popleft_n(k))
            got_l = table_ids(lq.popleft_n(k))
            out_e += got_e
            out_l += got_l
            taken += model[:k]
            model = model[k:]
        elif taken and op in ("append", "prepend"):
            ids = taken[:max(1, k)]
            taken = taken[len(ids):]
            if op == "append":
                eq.append_n([eblocks[i] for i in ids])
                lq.append_n([made[i] for i in ids])
                model = model + ids
            else:
                eq.prepend_n([eblocks[i] for i in ids])
                lq.prepend_n([made[i] for i in ids])
                model = ids + model
        elif op == "remove" and model:
            i = model[k % len(model)]
            if i in made:  # only materialized blocks can be removed (they are cached)
                eq.remove(eblocks[i])
                lq.remove(made[i])
                model.remove(i)
                taken.append(i)
        assert out_e == out_l
        assert eq.num_free_blocks == lq.num_free_blocks == len(model)
    assert table_ids(eq.get_all_free_blocks()) == table_ids(lq.get_all_free_blocks()) == model


class _Materialize:
    """A picklable materialize function (the block pool's bound method in the service)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.blocks = blocks

    def __call__(self, block_id: int) -> KVCacheBlock:
        return self.blocks[block_id]


def test_pickles_as_its_order_without_deep_recursion() -> None:
    """Snapshots pickle the queue: 50,000 linked blocks must not recurse per link, and the
    restored queue keeps the exact order (fresh range included) with blocks shared with
    whatever else the pickle holds."""
    import pickle

    blocks = [KVCacheBlock(i) for i in range(60_000)]
    queue = FreeKVCacheBlockQueue(blocks[10:50_010][::-1], fresh=range(50_010, 60_000),
                                  materialize=_Materialize(blocks))
    queue.remove(blocks[500])
    taken = blocks[3]
    restored, restored_taken = pickle.loads(pickle.dumps((queue, blocks[20])))
    assert len(restored) == len(queue)
    order = [b.block_id for b in queue.get_all_free_blocks()]
    assert [b.block_id for b in restored.get_all_free_blocks()] == order
    assert restored_taken is next(b for b in restored.get_all_free_blocks() if b.block_id == 20)
    assert taken.prev_free_block is None  # the original is untouched
