"""Release hints: a request freed as "evict first" (e.g. the last request of a session
that ended and will not come back) puts the blocks it releases at the *front* of the free
queue instead of the back, so that they are the next to be handed out (and evicted), ahead
of every other free block. Blocks another request or a pin still holds are unaffected:
when their last holder lets go they enter the queue as usual.

Within the hinted blocks the order is the one vLLM frees in (each group's tail first),
so the hinted request's tail is evicted before its head. Nothing changes for a free
without the hint: the pool's ``free_blocks`` is swapped only for the hinted call.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from contextlib import contextmanager

from cache_service.core.block import KVCacheBlock
from cache_service.core.block_pool import BlockPool


def _free_to_front(block_pool: BlockPool, ordered_blocks: Iterable[KVCacheBlock]) -> None:
    """``BlockPool.free_blocks`` with every block reaching ``ref_cnt == 0`` put before the
    current front, first given = first evicted."""
    front: list[KVCacheBlock] = []
    for block in ordered_blocks:
        if block.is_null:
            continue
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            front.append(block)
    if front:
        block_pool.free_block_queue.prepend_n(front)


@contextmanager
def evict_first(block_pool: BlockPool) -> Generator[None, None, None]:
    """While inside, the pool's frees put released blocks at the queue's front."""
    # An instance attribute shadows the method for this call only (the managers call
    # ``pool.free_blocks`` afresh each time; none keeps the bound method).
    vars(block_pool)["free_blocks"] = lambda blocks: _free_to_front(block_pool, blocks)
    try:
        yield
    finally:
        del vars(block_pool)["free_blocks"]
