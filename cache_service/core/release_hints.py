"""Release hints: a request freed as "evict first" (e.g. the last request of a session
that ended and will not come back) puts the blocks it releases at the *front* of the free
queue instead of the back, so that they are the next to be handed out (and evicted), ahead
of every other free block. Blocks another request or a pin still holds are unaffected:
when their last holder lets go they enter the queue as usual.

Within the hinted blocks the order is the one vLLM frees in (each group's tail first),
so the hinted request's tail is evicted before its head. A free without the hint is
unchanged: ``BlockPool.free_blocks`` checks one flag, set only inside :func:`evict_first`.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from contextlib import contextmanager
from typing import TYPE_CHECKING

from cache_service.core.block import KVCacheBlock

if TYPE_CHECKING:
    from cache_service.core.block_pool import BlockPool


def release_to_front(block_pool: BlockPool, ordered_blocks: Iterable[KVCacheBlock]) -> None:
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
    """While inside, the pool's frees put the blocks they release at the queue's front."""
    block_pool.free_to_front = True
    try:
        yield
    finally:
        block_pool.free_to_front = False
