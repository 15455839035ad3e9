"""One KV-cache block: a fixed-size page of one group's KV (or one Mamba state).

Invariants (kept by :mod:`block_pool` and :mod:`free_queue`, checked by
``BlockPool.check_invariants``):

* ``ref_cnt == 0`` <=> the block is in the free queue (the null block excepted).
* ``block_hash is not None`` <=> the block is in the cached-block map under
  ``(group_id, block_hash)``. A free block may still be cached: it is an eviction
  candidate that a later request can hit.
* The null block (id 0) is never free, never hashed and its ``ref_cnt`` is not kept.
"""

from __future__ import annotations


class KVCacheBlock:
    """A block of the pool. ``prev_free_block`` / ``next_free_block`` are the
    intrusive links of the free queue and are touched only by it."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "group_id", "prev_free_block",
                 "next_free_block", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Raw block hash (bytes) while cached; the map key is (group_id, block_hash),
        # which is vLLM's BlockHashWithGroupId without the byte concatenation.
        self.block_hash: bytes | None = None
        self.group_id = 0
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    def __reduce__(self) -> tuple:
        # Pickled without the free-queue links: following them would recurse once per
        # free block (a million-block pool overflows the stack). The queue pickles its
        # order and relinks the blocks when it is loaded (FreeKVCacheBlockQueue.__reduce__).
        return (_restore_block, (self.block_id, self.ref_cnt, self.block_hash, self.group_id,
                                 self.is_null))

    def set_block_hash(self, block_hash: bytes, group_id: int) -> None:
        assert self.block_hash is None, f"block {self.block_id} already has a hash"
        self.block_hash = block_hash
        self.group_id = group_id

    def reset_hash(self) -> None:
        self.block_hash = None

    def __repr__(self) -> str:
        h = None if self.block_hash is None else self.block_hash[-4:].hex()
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


def _restore_block(block_id: int, ref_cnt: int, block_hash: bytes | None, group_id: int,
                   is_null: bool) -> KVCacheBlock:
    block = KVCacheBlock(block_id)
    block.ref_cnt = ref_cnt
    block.block_hash = block_hash
    block.group_id = group_id
    block.is_null = is_null
    return block
