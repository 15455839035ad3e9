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

A block has at most one *primary* key (``block.block_hash``) and, while it has one, may
be reachable under further keys of its group (``_extra``): a partial entry registered
on a block that already had a key, or the keys a copy-on-write moved onto it
(docs/semantics.md#partial-hits-and-copy-on-write). Evicting a block drops all of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from mypy_extensions import mypyc_attr

from cache_service.core.block import KVCacheBlock
from cache_service.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from cache_service.core.free_queue import FreeKVCacheBlockQueue
from cache_service.core.hashing import (
    EMPTY_EMBEDS_DIGEST,
    external_block_hash,
    window_extra_keys,
)
from cache_service.core.host_tier import HostTier
from cache_service.core.release_hints import release_to_front

if TYPE_CHECKING:
    from cache_service.core.request import Request


class CacheObserver(Protocol):
    """Told when a (group, hash) key appears in or disappears from the prefix-cache map
    (not per duplicate block): the routing index and the miss-reason log follow the map."""

    def added(self, block_hash: bytes, group_id: int) -> None: ...

    def removed(self, block_hash: bytes, group_id: int) -> None: ...


class CachedBlockLookup(Protocol):
    """What the managers' hit rules (``find_longest_cache_hit``) probe: a :class:`BlockPool`,
    or the routing index's view of its masks, whose keys are block positions
    (prefix_index). Keys are ``Any`` so that the compiled core accepts both kinds."""

    hash_block_size: int
    null_block: KVCacheBlock

    def group_map(self, group_id: int) -> Any: ...

    def get_one_cached_block(self, key: Any, group_id: int) -> KVCacheBlock | None: ...

    def get_cached_block(self, key: Any, group_ids: Sequence[int]
                         ) -> list[KVCacheBlock] | None: ...


@mypyc_attr(allow_interpreted_subclasses=True)  # unpickled without __init__: restore.py
class BlockPool:
    """``num_blocks`` blocks including the null block 0, so ``num_blocks - 1`` usable."""

    #: The host tier (core/host_tier.py) cached blocks are demoted to when they are
    #: evicted for reuse; None = none (a class default: pools pickled before tiers
    #: existed load without one).
    host_tier: HostTier | None = None
    #: vLLM's num_hash_lookahead_tokens (a class default, so that pools pickled before
    #: lookahead hashing existed load with it off).
    hash_lookahead: int = 0

    def __init__(self, num_blocks: int, enable_caching: bool, hash_block_size: int, *,
                 num_groups: int = 1, enable_events: bool = False) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.enable_events = enable_events
        # vLLM's num_hash_lookahead_tokens (set by the manager): a block's hash, and its
        # event's extra keys, cover this many tokens after it.
        self.hash_lookahead = 0
        # Blocks are materialized on first use (see free_queue) and kept by id here, so
        # building a pool costs O(1) whatever num_blocks is: the metadata grows only
        # with the blocks ever handed out.
        self.blocks: dict[int, KVCacheBlock] = {}
        self.free_block_queue = FreeKVCacheBlockQueue(fresh=range(num_blocks),
                                                      materialize=self._materialize)
        self._maps: list[dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]]] = [
            {} for _ in range(max(1, num_groups))]
        # block id -> its non-primary keys (same group as its primary one).
        self._extra: dict[int, set[bytes]] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.events: list[KVEvent] = []
        self.num_evictions = 0  # cached blocks evicted to make room (a statistic)
        #: While set (core/release_hints.py), frees put every released block at the front.
        self.free_to_front = False
        self.observer: CacheObserver | None = None
        self.host_tier = None  # set by KVCacheCoordinator.configure_host_tier

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

    def _remove_key(self, block_hash: bytes, gid: int, block: KVCacheBlock) -> bool:
        """Drop the map entry ``(gid, block_hash) -> block``; False if there was none."""
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
        else:
            return False
        return True

    def _remove_hashes(self, block: KVCacheBlock) -> list[bytes]:
        """Drop every key of ``block`` (primary first) and its hash; the keys dropped."""
        block_hash = block.block_hash
        if block_hash is None:
            return []
        gid = block.group_id
        removed = [block_hash] if self._remove_key(block_hash, gid, block) else []
        extra = self._extra.pop(block.block_id, None) if self._extra else None
        if extra:
            removed += [h for h in extra if self._remove_key(h, gid, block)]
        block.block_hash = None
        block.hash_num_tokens = None
        return removed

    def _announce_removed(self, hashes: list[bytes], gid: int) -> None:
        if self.enable_events:
            self.events.extend(BlockRemoved([external_block_hash(h)], gid) for h in hashes)

    def _evict(self, block: KVCacheBlock) -> bool:
        """Drop ``block``'s own cache entries (duplicates under its keys survive)."""
        if block.block_hash is None:
            return False
        gid = block.group_id
        removed = self._remove_hashes(block)
        self._announce_removed(removed, gid)
        return bool(removed)

    def _insert_key(self, block_hash: bytes, group_id: int, block: KVCacheBlock,
                    num_tokens: int | None) -> None:
        """Make ``block`` reachable under ``(group_id, block_hash)``: its primary key if
        it has none, else one more key (nothing if it already has this one)."""
        if block.block_hash is None:
            block.block_hash = block_hash
            block.hash_num_tokens = num_tokens
            block.group_id = group_id
        elif block.block_hash == block_hash or self._has_key(block_hash, group_id, block):
            return
        else:
            self._extra.setdefault(block.block_id, set()).add(block_hash)
        self._insert(block_hash, group_id, block)

    def _has_key(self, block_hash: bytes, group_id: int, block: KVCacheBlock) -> bool:
        entry = self._maps[group_id].get(block_hash)
        return entry is block or (isinstance(entry, dict) and block.block_id in entry)

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
            tier = self.host_tier
            if tier is not None:
                self._demote_and_evict(blocks, tier)
                return blocks
            evict = self._evict
            for block in blocks:
                if block.block_hash is not None and evict(block):
                    self.num_evictions += 1
                block.ref_cnt = 1
        else:
            for block in blocks:
                block.ref_cnt = 1
        return blocks

    def _demote_and_evict(self, blocks: list[KVCacheBlock], tier: HostTier) -> None:
        """:meth:`get_new_blocks`' eviction with a host tier: each cached block's primary
        key is demoted (its extra keys are dropped), after the device removal is
        announced."""
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is not None:
                gid, num_tokens = block.group_id, block.hash_num_tokens
                if self._evict(block):
                    self.num_evictions += 1
                tier.demote(block.block_id, block_hash, gid, num_tokens, self.events)
            block.ref_cnt = 1

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
        if self.free_to_front:
            release_to_front(self, ordered_blocks)
            return
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
            if block.block_hash is not None:
                # Only a partial entry can precede the full one: the block filled up.
                assert block.hash_num_tokens is not None \
                    and block.hash_num_tokens < (i + 1) * block_size, \
                    f"block {block.block_id} is already cached"
                self._announce_removed(self._remove_hashes(block), group_id)
            block.block_hash = block_hash
            block.hash_num_tokens = (i + 1) * block_size
            block.group_id = group_id
            insert(block_hash, group_id, block)
            stored.append(i)
        if self.enable_events and stored:
            self.events.append(self._stored_event(request, block_hashes, stored,
                                                  num_cached_blocks, num_full_blocks,
                                                  block_size, group_id))

    def _stored_event(self, request: Request, block_hashes: Sequence[bytes], stored: list[int],
                      start: int, end: int, block_size: int, group_id: int) -> BlockStored:
        parent = external_block_hash(block_hashes[start - 1]) if start > 0 else None
        lora, salt = request.lora_name, request.cache_salt
        lookahead = self.hash_lookahead
        extra: list[tuple[Any, ...] | None]
        ahead: list[list[int]] | None = None
        if request.mm_items or request.prompt_embeds or lookahead:
            extra = self._window_event_keys(request, stored, block_size)
            if lookahead:
                tokens = request.all_token_ids
                ahead = [list(tokens[(i + 1) * block_size:(i + 1) * block_size + lookahead])
                         for i in stored]
        elif lora is None and not salt:
            extra = [None] * len(stored)  # the usual request: no extra keys
        else:
            extra = []
            for i in stored:
                keys: list[str] = []
                if lora is not None:
                    keys.append(lora)
                if salt and i == 0:
                    keys.append(salt)
                extra.append(tuple(keys) if keys else None)
        # Positional, in field order (the compiled constructor's cheapest call); the slice
        # of the token list is already a new list.
        return BlockStored(
            [external_block_hash(block_hashes[i]) for i in stored], parent,
            request.all_token_ids[start * block_size:end * block_size], block_size, lora,
            extra or None, group_id, None, None, "GPU",
            [(i + 1) * block_size for i in stored], start * block_size, request.session_id,
            ahead, request.lora_id)

    def _window_event_keys(self, request: Request, stored: list[int], block_size: int
                           ) -> list[tuple[Any, ...] | None]:
        """vLLM's untagged event keys of the stored blocks when multimodal items, prompt
        embeddings or lookahead are in play: each block's keys over its hash window
        (the block plus the lookahead tokens). A prompt-embedding digest is announced only
        when the group's blocks are hash blocks: the pool holds digests per hash block,
        and vLLM's event digest of a coarser block covers other rows."""
        lora_key = None if request.lora_name is None else (
            "lora", request.lora_name, request.lora_path)
        digests = request.prompt_embeds if block_size == self.hash_block_size else ()
        out: list[tuple[Any, ...] | None] = []
        for i in stored:
            digest: bytes | None = None
            if digests:
                digest = digests[i] if i < len(digests) else EMPTY_EMBEDS_DIGEST
            keys = window_extra_keys(i * block_size, (i + 1) * block_size + self.hash_lookahead,
                                     lora_key=lora_key, cache_salt=request.cache_salt,
                                     mm_items=request.mm_items, embeds_digest=digest)
            out.append(None if keys is None else tuple(
                key[1:] if key[0] == "mm" else key[1] for key in keys))
        return out

    def cache_partial_block(self, request: Request, block: KVCacheBlock, num_tokens: int,
                            group_id: int) -> bytes | None:
        """Make ``block`` reachable under the key of the prefix ``[0, num_tokens)`` (a
        multiple of the hash block size that may end inside the block): a partial entry.
        A shorter key the block had is dropped first. Returns the key (None for the null
        block). A new entry is announced as one stored hash block."""
        if block.is_null:
            return None
        hbs = self.hash_block_size
        n = num_tokens // hbs
        assert num_tokens % hbs == 0 and 0 < n <= len(request.block_hashes)
        block_hash = request.block_hashes[n - 1]
        already = ((block.block_hash == block_hash and block.group_id == group_id)
                   or self._has_key(block_hash, group_id, block))
        if (not already and block.block_hash is not None and block.hash_num_tokens is not None
                and block.hash_num_tokens < num_tokens):
            self._announce_removed(self._remove_hashes(block), group_id)
        self._insert_key(block_hash, group_id, block, num_tokens)
        if self.enable_events and not already:
            # Announced as the one hash block that ends at the boundary.
            self.events.append(self._stored_event(
                request, request.block_hashes, [n - 1], n - 1, n, hbs, group_id))
        return block_hash

    def move_block_hashes(self, src: KVCacheBlock, dst: KVCacheBlock) -> None:
        """Re-point every key of ``src`` to ``dst`` (a fresh block about to receive a
        copy of ``src``'s data): the entries stay live, no events."""
        assert dst.block_hash is None and dst.block_id not in self._extra
        num_tokens, gid = src.hash_num_tokens, src.group_id
        for block_hash in self._remove_hashes(src):
            self._insert_key(block_hash, gid, dst, num_tokens)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the cache entries of these blocks; ref counts and queue positions stay."""
        ids = list(block_ids)
        for block_id in ids:
            if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
                raise ValueError(f"block id {block_id!r} out of range [0, {self.num_blocks})")
        tier = self.host_tier
        for block_id in ids:
            block = self.blocks.get(block_id)
            if block is not None:
                if tier is not None and block.block_hash is not None:
                    # Invalidation forgets the key in both tiers (never a demotion).
                    key, gid = block.block_hash, block.group_id
                    self._evict(block)
                    tier.drop(key, gid, self.events)
                else:
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
                for block in entry.values() if isinstance(entry, dict) else (entry,):
                    block.reset_hash()
            m.clear()
        self._extra.clear()
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
                for key in (block.block_hash, *self._extra.get(block.block_id, ())):
                    assert self._has_key(key, block.group_id, block), \
                        f"block {block.block_id} is hashed but not in the map"
            else:
                assert block.block_id not in self._extra, \
                    f"block {block.block_id} has extra keys but no hash"
        if self.host_tier is not None:
            self.host_tier.check_invariants()
        for gid, m in enumerate(self._maps):
            for block_hash, entry in m.items():
                members = list(entry.values()) if isinstance(entry, dict) else [entry]
                assert members, "empty duplicate set left in the map"
                for block in members:
                    assert block.group_id == gid and (
                        block.block_hash == block_hash
                        or block_hash in self._extra.get(block.block_id, ())), \
                        f"map entry for block {block.block_id} does not match its hash"
