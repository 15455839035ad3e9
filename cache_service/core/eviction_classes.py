"""Eviction classes: one free queue per class, lower classes evicted first.

A request may carry an eviction class (``AddRequest.eviction_class``, 0 = the default,
up to :data:`MAX_CLASS`). The cached blocks it releases (freed, preempted, or dropped
from a sliding window) enter the free queue *of its class* at that queue's back; the
last release decides a block's class, as it decides its LRU position. Blocks are handed
out (and cached ones evicted) from the lowest non-empty class first, and within a class in
exactly vLLM's order. Uncached blocks and release hints (``release_hints``) go to the
front of class 0: they are reused first whatever the classes.

A pool uses one plain :class:`FreeKVCacheBlockQueue` until a request with a class other
than 0 arrives; only then does :class:`ClassedFreeQueue` replace it, keeping the plain
queue (and its order) as class 0. So a pool that never sees a class decides exactly as
vLLM and pays nothing.
"""

from __future__ import annotations

from typing import Any

from cache_service.core.block import KVCacheBlock
from cache_service.core.free_queue import FreeKVCacheBlockQueue

#: The highest eviction class (classes are 0..MAX_CLASS).
MAX_CLASS = 15


class ClassedFreeQueue(FreeKVCacheBlockQueue):
    """Free blocks in eviction order across classes: class 0's queue first, then class
    1's, ... A :class:`FreeKVCacheBlockQueue` (so the block pool's typed attribute takes
    it, compiled or not) whose own links stay empty: ``append``/``append_n`` go to the
    class in ``release_class`` (set by the pool around a request's release), ``prepend_n``
    to the front of class 0.

    Invariants: a block is in the queue of class ``class_of.get(block_id, 0)``;
    ``num_free_blocks`` is the sum over the classes' queues."""

    def __init__(self, base: FreeKVCacheBlockQueue) -> None:
        # Set before the base's __init__, which calls append_n (ours) on no blocks.
        self.queues: list[FreeKVCacheBlockQueue] = [base] + [
            FreeKVCacheBlockQueue() for _ in range(MAX_CLASS)]
        self.class_of: dict[int, int] = {}  # block id -> its class, for classes > 0
        self.release_class = 0
        super().__init__()
        self.num_free_blocks = base.num_free_blocks

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore_classed, (self.queues, self.class_of, self.release_class))

    def popleft(self) -> KVCacheBlock:
        """The next block to evict: the lowest class's front."""
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` blocks: the lowest classes' fronts first."""
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks from a queue of {self.num_free_blocks}")
        out: list[KVCacheBlock] = []
        class_of = self.class_of
        for cls, queue in enumerate(self.queues):
            if len(out) == n:
                break
            take = min(n - len(out), queue.num_free_blocks)
            if take:
                got = queue.popleft_n(take)
                if cls:
                    for block in got:
                        del class_of[block.block_id]
                out += got
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Takes ``block`` out of its class's queue (a cache hit on a free block)."""
        cls = self.class_of.pop(block.block_id, 0)
        self.queues[cls].remove(block)
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Frees ``block`` to the back of the release class's queue."""
        self.append_n([block])

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Frees ``blocks`` in order to the back of the release class's queue."""
        cls = self.release_class
        if cls:
            for block in blocks:
                self.class_of[block.block_id] = cls
        self.queues[cls].append_n(blocks)
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Frees ``blocks`` to the very front (class 0): first to evict (a release hint)."""
        self.queues[0].prepend_n(blocks)
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block in eviction order (class by class)."""
        out: list[KVCacheBlock] = []
        for queue in self.queues:
            out += queue.get_all_free_blocks()
        return out

    def check_invariants(self) -> None:
        """Assert the class map matches the queues (for tests)."""
        for cls, queue in enumerate(self.queues):
            for block in queue.get_all_free_blocks():
                assert self.class_of.get(block.block_id, 0) == cls, \
                    f"block {block.block_id} is in class {cls}'s queue"
        assert all(self.class_of.values()), "class 0 is never recorded"
        assert self.num_free_blocks == sum(q.num_free_blocks for q in self.queues)


def _restore_classed(queues: list[FreeKVCacheBlockQueue], class_of: dict[int, int],
                     release_class: int) -> ClassedFreeQueue:
    queue = ClassedFreeQueue(queues[0])
    queue.queues = queues
    queue.class_of = class_of
    queue.release_class = release_class
    queue.num_free_blocks = sum(q.num_free_blocks for q in queues)
    return queue
