"""The block pool shared by every KV-cache group: blocks, free queue, prefix-cache map.

Free order (vLLM 0.33): callers pass blocks in eviction priority (first = evict
first, i.e. a request's tail first). Blocks that reach ``ref_cnt == 0`` *without* a
hash (or any block when caching is off) are prepended to the front of the queue
(scratch blocks are reused first); blocks *with* a hash are appended to the back
(LRU: cached blocks survive longest).

The cached-block map is kept per group: ``_maps[group_id][block_hash]`` is one block,
or a ``{block_id: block}`` dict when several blocks are cached under the same key
(vLLM never de-duplicates: block tables are append-only). A lookup returns the
first-inserted block still present.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from cache_service.core.block import KVCacheBlock
from cache_service.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from cache_service.core.free_queue import FreeKVCacheBlockQueue
from cache_service.core.hashing import external_block_hash

if TYPE_CHECKING:
    from cache_service.core.request import Request


class CacheObserver(Protocol):
    """Told when a (group, hash) key appears in or disappears from the prefix-cache map
    (not per duplicate block): the routing index and the miss-reason log follow the map."""

    def added(self, block_hash: bytes, group_id: int) -> None: ...

    def removed(self, block_hash: bytes, group_id: int) -> None: ...


class BlockPool:
    """``num_blocks`` blocks including the null block 0, so ``num_blocks - 1`` usable."""

    def __init__(self, num_blocks: int, enable_caching: bool, hash_block_size: int, *,
                 num_groups: int = 1, enable_events: bool = False) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.enable_events = enable_events
        # Blocks are materialized on first use (see free_queue) and kept by id here, so
        # building a pool costs O(1) whatever num_blocks is: the metadata grows only
        # with the blocks ever handed out.
        self.blocks: dict[int, KVCacheBlock] = {}
        self.free_block_queue = FreeKVCacheBlockQueue(fresh=range(num_blocks),
                                                      materialize=self._materialize)
        self._maps: list[dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]]] = [
            {} for _ in range(max(1, num_groups))]
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.events: list[KVEvent] = []
        self.num_evictions = 0  # cached blocks evicted to make room (a statistic)
        self.observer: CacheObserver | None = None

    def _materialize(self, block_id: int) -> KVCacheBlock:
        block = self.blocks.get(block_id)
        if block is None:
            block = self.blocks[block_id] = KVCacheBlock(block_id)
        return block

    def get_block(self, block_id: int) -> KVCacheBlock:
        """The block with this id (materializing it if it was never used)."""
        return self._materialize(block_id)

    # -- prefix-cache map ----------------------------------------------------------
    def get_cached_block(self, block_hash: bytes,
                         group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
        """One cached block per group for ``block_hash``, or None if any group misses."""
        out: list[KVCacheBlock] = []
        maps = self._maps
        for gid in group_ids:
            entry = maps[gid].get(block_hash)
            if entry is None:
                return None
            if isinstance(entry, dict):
                entry = next(iter(entry.values()))
            out.append(entry)
        return out

    def group_map(self, group_id: int) -> dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]]:
        """The raw map of one group (read-only use: hot lookup loops probe it directly)."""
        return self._maps[group_id]

    def get_one_cached_block(self, block_hash: bytes, group_id: int) -> KVCacheBlock | None:
        """Single-group lookup (the hot path of one-group spec groups)."""
        entry = self._maps[group_id].get(block_hash)
        if entry is None or not isinstance(entry, dict):
            return entry
        return next(iter(entry.values()))

    def _insert(self, block_hash: bytes, group_id: int, block: KVCacheBlock) -> None:
        m = self._maps[group_id]
        entry = m.get(block_hash)
        if entry is None:
            m[block_hash] = block
            if self.observer is not None:
                self.observer.added(block_hash, group_id)
        elif isinstance(entry, dict):
            entry[block.block_id] = block
        else:
            m[block_hash] = {entry.block_id: entry, block.block_id: block}

    def _evict(self, block: KVCacheBlock) -> bool:
        """Drop ``block``'s own cache entry (duplicates under the key survive)."""
        block_hash = block.block_hash
        if block_hash is None:
            return False
        gid = block.group_id
        m = self._maps[gid]
        entry = m.get(block_hash)
        if entry is block:
            del m[block_hash]
            if self.observer is not None:
                self.observer.removed(block_hash, gid)
        elif isinstance(entry, dict) and block.block_id in entry:
            del entry[block.block_id]
            if not entry:
                del m[block_hash]
                if self.observer is not None:
                    self.observer.removed(block_hash, gid)
        block.block_hash = None
        if self.enable_events:
            self.events.append(BlockRemoved([external_block_hash(block_hash)], gid))
        return True

    @property
    def num_cached_keys(self) -> int:
        """Distinct (group, hash) keys in the map (vLLM's ``len(map)``)."""
        return sum(len(m) for m in self._maps)

    def num_cached_keys_per_group(self) -> list[int]:
        return [len(m) for m in self._maps]

    # -- allocation ------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` blocks from the front, evicting any cached ones; each gets ref 1."""
        if n > self.free_block_queue.num_free_blocks:
            raise ValueError(f"Cannot get {n} free blocks from the pool")
        blocks = self.free_block_queue.popleft_n(n)
        if self.enable_caching:
            evict = self._evict
            for block in blocks:
                if block.block_hash is not None and evict(block):
                    self.num_evictions += 1
                block.ref_cnt = 1
        else:
            for block in blocks:
                block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on hit blocks; free ones leave the queue (still cached)."""
        remove = self.free_block_queue.remove
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, first = evicted first (see module doc)."""
        front: list[KVCacheBlock] = []
        back: list[KVCacheBlock] = []
        caching = self.enable_caching
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None or not caching:
                    front.append(block)
                else:
                    back.append(block)
        queue = self.free_block_queue
        if front:
            queue.prepend_n(front)
        if back:
            queue.append_n(back)

    # -- caching ---------------------------------------------------------------------
    def cache_full_blocks(self, request: Request, blocks: Sequence[KVCacheBlock],
                          block_hashes: Sequence[bytes], num_cached_blocks: int,
                          num_full_blocks: int, block_size: int, group_id: int,
                          block_mask: Sequence[bool] | None = None) -> None:
        """Hash blocks ``[num_cached_blocks, num_full_blocks)`` of a request's table.

        ``block_hashes`` is the request's hash list viewed at ``block_size``. Null and
        masked-out blocks are skipped. One BlockStored event covers the whole range, if
        anything was stored.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        insert = self._insert
        stored: list[int] = []
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null or (block_mask is not None and not block_mask[i - num_cached_blocks]):
                continue
            block_hash = block_hashes[i]
            assert block.block_hash is None, f"block {block.block_id} is already cached"
            block.block_hash = block_hash
            block.group_id = group_id
            insert(block_hash, group_id, block)
            stored.append(i)
        if self.enable_events and stored:
            self.events.append(self._stored_event(request, block_hashes, stored,
                                                  num_cached_blocks, num_full_blocks,
                                                  block_size, group_id))

    @staticmethod
    def _stored_event(request: Request, block_hashes: Sequence[bytes], stored: list[int],
                      start: int, end: int, block_size: int, group_id: int) -> BlockStored:
        parent = external_block_hash(block_hashes[start - 1]) if start > 0 else None
        lora, salt = request.lora_name, request.cache_salt
        extra: list[tuple[str, ...] | None] = []
        for i in stored:
            keys: list[str] = []
            if lora is not None:
                keys.append(lora)
            if salt and i == 0:
                keys.append(salt)
            extra.append(tuple(keys) if keys else None)
        return BlockStored(
            block_hashes=[external_block_hash(block_hashes[i]) for i in stored],
            parent_block_hash=parent,
            token_ids=list(request.all_token_ids[start * block_size:end * block_size]),
            block_size=block_size,
            lora_name=lora,
            extra_keys=extra or None,
            group_idx=group_id,
            prefix_lengths=[(i + 1) * block_size for i in stored],
            start_token=start * block_size,
        )

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the cache entries of these blocks; ref counts and queue positions stay."""
        ids = list(block_ids)
        for block_id in ids:
            if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
                raise ValueError(f"block id {block_id!r} out of range [0, {self.num_blocks})")
        for block_id in ids:
            block = self.blocks.get(block_id)
            if block is not None:
                self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible while no block is in use."""
        if self.num_blocks - self.get_num_free_blocks() != 1:
            return False
        observer = self.observer
        for gid, m in enumerate(self._maps):
            if observer is not None:
                for block_hash in m:
                    observer.removed(block_hash, gid)
            for entry in m.values():
                if isinstance(entry, dict):
                    for block in entry.values():
                        block.block_hash = None
                else:
                    entry.block_hash = None
            m.clear()
        if self.enable_events:
            self.events.append(AllBlocksCleared())
        return True

    def get_usage(self) -> float:
        total = self.num_blocks - 1
        if not total:
            return 0.0
        return 1.0 - self.get_num_free_blocks() / total

    def take_events(self) -> list[KVEvent]:
        events = self.events
        self.events = []
        return events

    # -- invariants (docs/semantics.md#invariants) -------------------------------------
    def check_invariants(self) -> None:
        """Assert the pool-level invariants; O(num_blocks), for tests."""
        queue = self.free_block_queue
        free = queue.get_all_free_blocks()
        assert len(free) == queue.num_free_blocks, \
            f"free queue length {len(free)} != counter {queue.num_free_blocks}"
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free), "a block is twice in the free queue"
        assert self.null_block.block_id == 0 and 0 not in free_ids, "null block is free"
        assert self.null_block.block_hash is None, "null block is hashed"
        for block in self.blocks.values():
            if block.is_null:
                continue
            in_queue = block.block_id in free_ids
            assert (block.ref_cnt == 0) == in_queue, \
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but in_queue={in_queue}"
            assert block.ref_cnt >= 0, f"block {block.block_id}: negative ref_cnt"
            if block.block_hash is not None:
                entry = self._maps[block.group_id].get(block.block_hash)
                assert entry is block or (isinstance(entry, dict)
                                          and entry.get(block.block_id) is block), \
                    f"block {block.block_id} is hashed but not in the map"
        for gid, m in enumerate(self._maps):
            for block_hash, entry in m.items():
                members = list(entry.values()) if isinstance(entry, dict) else [entry]
                assert members, "empty duplicate set left in the map"
                for block in members:
                    assert block.block_hash == block_hash and block.group_id == gid, \
                        f"map entry for block {block.block_id} does not match its hash"
