"""Eviction classes (cache_service/core/eviction_classes.py): the classed free queue hands
blocks out lowest class first and, within a class, in exactly the plain queue's order; a
pool whose requests all use class 0 decides as the plain core; a class-1 prefix survives
class-0 traffic that evicts it in a plain pool."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_service.core.block import KVCacheBlock
from cache_service.core.errors import InvalidArgument
from cache_service.core.eviction_classes import ClassedFreeQueue
from cache_service.core.free_queue import FreeKVCacheBlockQueue
from cache_service.core.operations import AddRequest, Allocate, Free
from cache_service.core.pool import Pool
from cache_service.replay import load_config

from builders import SMALL_MAX_LEN, allocate_some, full, make_pool, small_config

_QUEUE_OP = st.one_of(
    st.tuples(st.just("append"), st.integers(0, 3), st.integers(1, 4)),
    st.tuples(st.just("prepend"), st.just(0), st.integers(1, 3)),
    st.tuples(st.just("remove"), st.integers(0, 100), st.just(0)),
    st.tuples(st.just("pop"), st.just(0), st.integers(1, 5)),
)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(_QUEUE_OP, max_size=60))
def test_the_classed_queue_is_one_plain_queue_per_class_lowest_first(ops) -> None:
    """Against a model: a list per class (class 0 also holds the fresh range)."""
    made: dict[int, KVCacheBlock] = {}

    def make(i: int) -> KVCacheBlock:
        return made.setdefault(i, KVCacheBlock(i))

    queue = ClassedFreeQueue(FreeKVCacheBlockQueue(fresh=range(1, 9), materialize=make))
    model: list[list[int]] = [list(range(1, 9))] + [[] for _ in range(3)]
    out: list[int] = []  # blocks handed out (not in the queue)
    fresh = set(range(1, 9))  # never handed out: not linked yet
    next_id = 100
    for kind, a, b in ops:
        if kind == "append" or kind == "prepend":
            blocks = []
            for _ in range(b):  # handed-out blocks first, then new ones
                if out:
                    blocks.append(make(out.pop()))
                else:
                    blocks.append(make(next_id))
                    next_id += 1
            if kind == "append":
                queue.release_class = a
                queue.append_n(blocks)
                model[a] += [blk.block_id for blk in blocks]
            else:
                queue.prepend_n(blocks)
                model[0][:0] = [blk.block_id for blk in blocks]
        elif kind == "remove":
            free = [i for q in model for i in q if i not in fresh]  # linked blocks
            if free:
                victim = free[a % len(free)]
                queue.remove(made[victim])
                for q in model:
                    if victim in q:
                        q.remove(victim)
                out.append(victim)
        else:
            n = min(b, sum(len(q) for q in model))
            got = [blk.block_id for blk in queue.popleft_n(n)]
            expect = [i for q in model for i in q][:n]
            assert got == expect
            fresh -= set(got)
            for i in got:
                for q in model:
                    if i in q:
                        q.remove(i)
            out += got
        assert [blk.block_id for blk in queue.get_all_free_blocks()] == \
            [i for q in model for i in q]
        assert queue.num_free_blocks == sum(len(q) for q in model)
        queue.check_invariants()


def _run(pool: Pool, rid: str, tokens: list[int], eviction_class: int = 0) -> None:
    pool.apply_batch([AddRequest(rid, tokens, eviction_class=eviction_class),
                      Allocate(rid, len(tokens))])
    pool.apply_batch([Free(rid)])


def test_a_higher_class_prefix_survives_default_traffic() -> None:
    session = list(range(1, 14))
    plain, classed = (make_pool(17, full(4), max_model_len=32) for _ in range(2))
    _run(plain, "s", session)
    _run(classed, "s", session, eviction_class=1)
    for pool in (plain, classed):
        for i in range(6):  # one-shot traffic, class 0, 16 blocks in all each time
            _run(pool, f"x{i}", [100 + i] * 20)
        pool.check_invariants()
    assert plain.peek_prefix(session) == 0
    assert classed.peek_prefix(session) == 12
    # When class 0 cannot cover an allocation, class 1 is evicted (tail first).
    for i in range(2):  # 2 x 7 blocks held at once: 14 > the 13 free blocks of class 0
        classed.add_request(f"big{i}", [7 + i] * 28)
        assert classed.allocate(f"big{i}", 28).ok
    assert classed.peek_prefix(session) == 8  # the session's tail block went first
    classed.check_invariants()


def test_a_class_must_be_in_range() -> None:
    pool = make_pool(17, full(4), max_model_len=32)
    for bad in (-1, 16, True):
        with pytest.raises(InvalidArgument) as err:
            pool.apply_batch([AddRequest("a", [1, 2], eviction_class=bad)])
        assert err.value.field == "ops[0].add_request.eviction_class"
    assert not pool.request_ids()


CONFIGS = ["full", "full_swa", "full_mamba", "full_swa_mamba"]
_OP = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 2), st.integers(1, 30)),
    st.tuples(st.just("alloc"), st.integers(0, 50), st.integers(1, 40)),
    st.tuples(st.just("free"), st.integers(0, 50), st.just(0)),
    st.tuples(st.just("decode"), st.integers(0, 50), st.integers(0, 20)),
    st.tuples(st.just("step"), st.just(0), st.just(0)),
)
PREFIXES = [list(range(1, 25)), [7] * 8 + [9] * 8, list(range(30, 42))]


def _drive(pool: Pool, ops, classes: bool) -> list[object]:
    out: list[object] = []
    n = 0
    for kind, a, b in ops:
        ids = pool.request_ids()
        if kind == "add":
            cls = (n % 3) if classes else 0
            pool.apply_batch([AddRequest(f"r{n}", (PREFIXES[a] + [b] * b)[:SMALL_MAX_LEN - 16],
                                         eviction_class=cls)])
            n += 1
        elif kind == "alloc" and ids:
            out.append(allocate_some(pool, ids[a % len(ids)], b))
        elif kind == "decode" and ids:
            rid = ids[a % len(ids)]
            info = pool.request_info(rid)
            if info.status == "RUNNING" and info.num_tokens < SMALL_MAX_LEN - 1 \
                    and info.num_computed_tokens == info.num_tokens:
                out.append(pool.decode([rid], [b]))
        elif kind == "free" and ids:
            out.append(pool.free(ids[a % len(ids)]))
        elif kind == "step":
            pool.new_step()
        pool.check_invariants()
    out.append([blk.block_id for blk in pool.manager.pool.free_block_queue.get_all_free_blocks()])
    out.append(pool.stats())
    return out


def _pool(name: str) -> Pool:
    config, options = load_config(small_config(name))
    return Pool(config, dataclasses.replace(options))


@pytest.mark.parametrize("name", CONFIGS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_OP, max_size=60))
def test_class_zero_everywhere_decides_as_the_plain_core(name: str, ops) -> None:
    """A pool that switched to classed queues (a class-1 request came and went) but whose
    requests then all use class 0 decides exactly as a pool that never saw a class."""
    plain, classed = _pool(name), _pool(name)
    classed.apply_batch([AddRequest("c", [1], eviction_class=1)])
    classed.apply_batch([Free("c")])
    assert isinstance(classed.manager.pool.free_block_queue, ClassedFreeQueue)
    assert _drive(plain, ops, False) == _drive(classed, ops, False)


@pytest.mark.parametrize("name", CONFIGS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_OP, max_size=60))
def test_random_operations_with_classes_keep_the_invariants(name: str, ops) -> None:
    pool = _pool(name)
    _drive(pool, ops, True)
    for rid in pool.request_ids():
        pool.free(rid)
    pool.check_invariants()
    assert pool.num_free_blocks == pool.stats().num_blocks - 1
