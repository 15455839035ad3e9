"""The free-block queue: a doubly linked list threaded through the blocks themselves.

Front = next block to hand out (and, if it is cached, to evict). All operations are
O(1) per block; ``remove`` unlinks from the middle when a cached free block is hit.

Blocks that were never used are not materialized: the queue holds them as one
*fresh range* of consecutive ids, represented in the list by a marker node. A
fresh block becomes a real :class:`KVCacheBlock` (through ``materialize``) only when
it is popped, so a pool of a million blocks costs almost nothing to build. The
marker keeps its position: blocks prepended later go in front of it, blocks
appended later go behind it, exactly as if the range were linked block by block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from cache_service.core.block import KVCacheBlock


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order.

    ``blocks`` are linked first (in the given order), then the fresh ids
    ``fresh`` (ascending), which are created on demand by ``materialize(id)``.
    ``materialize`` must be idempotent (return the same object for the same id).
    """

    __slots__ = ("num_free_blocks", "_head", "_tail", "_marker", "_fresh_next",
                 "_fresh_end", "_materialize")

    def __init__(self, blocks: Iterable[KVCacheBlock] = (), *, fresh: range = range(0),
                 materialize: Callable[[int], KVCacheBlock] | None = None) -> None:
        if fresh.step != 1:
            raise ValueError("fresh must be a contiguous ascending range")
        if len(fresh) and materialize is None:
            raise ValueError("a fresh range needs a materialize function")
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._marker = KVCacheBlock(-2)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self._fresh_next = fresh.start
        self._fresh_end = fresh.stop
        self._materialize = materialize
        self.append_n(list(blocks))
        if len(fresh):
            self._link_before_tail(self._marker)
            self.num_free_blocks += len(fresh)

    # -- linking helpers ---------------------------------------------------------
    def _link_before_tail(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None

    def _take_fresh(self, n: int) -> list[KVCacheBlock]:
        """Materialize up to ``n`` fresh blocks. The caller unlinks the marker once
        the range is used up (``_fresh_next == _fresh_end``) and adjusts the count."""
        start = self._fresh_next
        stop = min(self._fresh_end, start + n)
        self._fresh_next = stop
        make = self._materialize
        assert make is not None
        return [make(i) for i in range(start, stop)]

    # -- queue operations --------------------------------------------------------
    def popleft(self) -> KVCacheBlock:
        """Pop the front block. Raises ValueError when the queue is empty."""
        first = self._head.next_free_block
        if first is self._tail:
            raise ValueError("No free blocks available")
        if first is self._marker:
            block = self._take_fresh(1)[0]
            if self._fresh_next == self._fresh_end:
                self._unlink(first)
        else:
            assert first is not None
            self._unlink(first)
            block = first
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` blocks from the front, in queue order."""
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks from a queue of {self.num_free_blocks}")
        if n <= 0:
            return []
        out: list[KVCacheBlock] = []
        head, tail, marker = self._head, self._tail, self._marker
        curr = head.next_free_block
        while len(out) < n:
            assert curr is not None and curr is not tail
            if curr is marker:
                out.extend(self._take_fresh(n - len(out)))
                if self._fresh_next == self._fresh_end:
                    # Range used up: drop the marker (its neighbours are relinked
                    # below, when the head is pointed at the new front).
                    curr = marker.next_free_block
                    marker.prev_free_block = marker.next_free_block = None
                continue
            out.append(curr)
            nxt = curr.next_free_block
            curr.prev_free_block = curr.next_free_block = None
            curr = nxt
        assert curr is not None
        head.next_free_block = curr
        curr.prev_free_block = head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue (a cached free block was hit)."""
        self._unlink(block)
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._link_before_tail(block)
        self.num_free_blocks += 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Append ``blocks`` at the back, keeping their order."""
        if not blocks:
            return
        last = self._tail.prev_free_block
        assert last is not None
        for block in blocks:
            last.next_free_block = block
            block.prev_free_block = last
            last = block
        last.next_free_block = self._tail
        self._tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Insert ``blocks`` before the current front, keeping their order."""
        if not blocks:
            return
        first = self._head.next_free_block
        assert first is not None
        prev = self._head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = first
        first.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks front to back (materializes the fresh range; for tests)."""
        out: list[KVCacheBlock] = []
        curr = self._head.next_free_block
        while curr is not self._tail:
            assert curr is not None
            if curr is self._marker:
                make = self._materialize
                assert make is not None
                out.extend(make(i) for i in range(self._fresh_next, self._fresh_end))
            else:
                out.append(curr)
            curr = curr.next_free_block
        return out

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles the queue as its order (the fresh range as ``None``), not as links: a
        snapshot of the pool restores the exact eviction order without deep recursion."""
        order: list[KVCacheBlock | None] = []
        curr = self._head.next_free_block
        while curr is not self._tail:
            assert curr is not None
            order.append(None if curr is self._marker else curr)
            curr = curr.next_free_block
        return (_restore_queue, (order, self._fresh_next, self._fresh_end, self._materialize,
                                 self.num_free_blocks))

    def __len__(self) -> int:
        return self.num_free_blocks


def _restore_queue(order: list[KVCacheBlock | None], fresh_next: int, fresh_end: int,
                   materialize: Callable[[int], KVCacheBlock] | None,
                   num_free_blocks: int) -> FreeKVCacheBlockQueue:
    """The queue :meth:`FreeKVCacheBlockQueue.__reduce__` pickled, relinked in order."""
    queue = FreeKVCacheBlockQueue()
    queue._fresh_next, queue._fresh_end = fresh_next, fresh_end
    queue._materialize = materialize
    prev = queue._head
    for node in order:
        block = queue._marker if node is None else node
        prev.next_free_block = block
        block.prev_free_block = prev
        prev = block
    prev.next_free_block = queue._tail
    queue._tail.prev_free_block = prev
    queue.num_free_blocks = num_free_blocks
    return queue
