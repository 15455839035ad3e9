"""The host-memory tier of a pool (docs/semantics.md#host-tier): cached blocks evicted from
the device pool are demoted to host slots instead of dropped, and a hit on a host slot is
promoted back into a fresh device block by the allocation that uses it.

The tier plans copies; executors run them (:class:`TierCopy`). Per KV-cache group it has
``slots`` host slots, its own LRU keyed by the block hash (one hash stands for one prefix
length in a group, as in the device map), a list of free slots, and the slots reserved
since the current batch began. A reserved slot is never reused before the next batch: its
copy (a demotion writing it, a promotion reading it) may not have run yet.

Invariants (``HostTier.check_invariants``):

* every entry's placeholder is a :class:`KVCacheBlock` with ``ref_cnt == 0``,
  ``block_hash`` = its key, ``group_id`` = its group and ``block_id = -(slot + 1)``
  (negative: nothing mistakes it for a device block); it is never in the free queue nor
  in any request's table;
* each group's slots are unique, and used + free = ``slots``;
* reserved slots are slots of the group.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mypy_extensions import mypyc_attr

from cache_service.core.block import KVCacheBlock
from cache_service.core.events import BlockRemoved, BlockStored, KVEvent
from cache_service.core.hashing import external_block_hash
from cache_service.core.restore import RebuiltFromFields

if TYPE_CHECKING:
    from cache_service.core.block_pool import BlockPool

#: The largest ``host_tier_blocks`` a pool accepts (slots per group).
MAX_HOST_TIER_BLOCKS = 16777216


@dataclass(frozen=True, slots=True)
class TierCopy(RebuiltFromFields):
    """One copy between the device pool and the host tier of group ``group``: a demotion
    copies device block ``block_id`` into host slot ``host_slot``; a promotion copies host
    slot ``host_slot`` into device block ``block_id``.

    Ordering rule for executors (docs/semantics.md#host-tier): per answer, run every
    demotion, then every promotion, then the block copies (copy-on-write), then the
    forward pass; answers in the order they were received."""

    group: int
    block_id: int
    host_slot: int


def slot_of(placeholder: KVCacheBlock) -> int:
    """The host slot a placeholder stands for (its block id is ``-(slot + 1)``)."""
    return -placeholder.block_id - 1


@mypyc_attr(allow_interpreted_subclasses=True)  # unpickled without __init__: restore.py
class HostTier:
    """The host tier of one pool: ``slots`` host slots per group (see the module doc)."""

    def __init__(self, slots: int, block_sizes: Sequence[int],
                 enable_events: bool = False) -> None:
        num_groups = max(1, len(block_sizes))
        self.slots = slots
        self.block_sizes = list(block_sizes) or [0]
        self.enable_events = enable_events
        # Per group: key -> placeholder, least recently used first.
        self.lru: list[OrderedDict[bytes, KVCacheBlock]] = [
            OrderedDict() for _ in range(num_groups)]
        # Per group: slots handed out so far count up from 0 (a million-slot tier costs
        # nothing until used); freed slots are reused first, most recently freed first.
        self._next_fresh: list[int] = [0] * num_groups
        self._freed: list[list[int]] = [[] for _ in range(num_groups)]
        # Per group: slots a copy of the current batch reads or writes.
        self.reserved: list[set[int]] = [set() for _ in range(num_groups)]
        self.demotions: list[TierCopy] = []
        self.promotions: list[TierCopy] = []
        self.num_demotions = 0
        self.num_promotions = 0
        self.num_evictions = 0

    # -- batches -----------------------------------------------------------------------
    def begin_batch(self) -> None:
        """A new batch begins: the last batch's copies are the executor's now, their
        slots free to reuse."""
        if self.demotions:
            self.demotions = []
        if self.promotions:
            self.promotions = []
        for reserved in self.reserved:
            if reserved:
                reserved.clear()

    # -- lookups -----------------------------------------------------------------------
    def get(self, key: bytes, group_id: int) -> KVCacheBlock | None:
        """The placeholder of ``key`` in the group's tier, or None."""
        return self.lru[group_id].get(key)

    def used_blocks(self) -> int:
        """Host slots holding a block, summed over groups."""
        return sum(len(m) for m in self.lru)

    # -- demotion ----------------------------------------------------------------------
    def demote(self, block_id: int, block_hash: bytes, group_id: int,
               num_tokens: int | None, events: list[KVEvent]) -> None:
        """Device block ``block_id`` holding ``block_hash`` is being reused: keep its
        content in a host slot. A key already held is only touched (no copy); with every
        slot reserved by this batch the block is dropped as without a tier."""
        lru = self.lru[group_id]
        entry = lru.get(block_hash)
        if entry is not None:
            lru.move_to_end(block_hash)
            return
        slot = self._take_slot(group_id, events)
        if slot < 0:
            return
        placeholder = KVCacheBlock(-(slot + 1))
        placeholder.block_hash = block_hash
        placeholder.hash_num_tokens = num_tokens
        placeholder.group_id = group_id
        lru[block_hash] = placeholder
        self.reserved[group_id].add(slot)
        self.demotions.append(TierCopy(group_id, block_id, slot))
        self.num_demotions += 1
        if self.enable_events:
            events.append(BlockStored(
                block_hashes=[external_block_hash(block_hash)], parent_block_hash=None,
                token_ids=[], block_size=self.block_sizes[group_id], group_idx=group_id,
                medium="CPU", prefix_lengths=[num_tokens or 0]))

    def _take_slot(self, group_id: int, events: list[KVEvent]) -> int:
        """A slot for a new entry: a free one, else the LRU entry's that no copy of this
        batch uses (evicted: BlockRemoved CPU); -1 when every slot is reserved."""
        freed = self._freed[group_id]
        if freed:
            return freed.pop()
        fresh = self._next_fresh[group_id]
        if fresh < self.slots:
            self._next_fresh[group_id] = fresh + 1
            return fresh
        reserved = self.reserved[group_id]
        lru = self.lru[group_id]
        victim: bytes | None = None
        slot = -1
        if len(reserved) < len(lru):
            for key, placeholder in lru.items():
                if slot_of(placeholder) not in reserved:
                    victim, slot = key, slot_of(placeholder)
                    break
        if victim is None:
            return -1
        del lru[victim]
        self.num_evictions += 1
        if self.enable_events:
            events.append(BlockRemoved([external_block_hash(victim)], group_id, medium="CPU"))
        return slot

    # -- promotion -----------------------------------------------------------------------
    def is_live(self, placeholder: KVCacheBlock) -> bool:
        """Whether ``placeholder`` is still its key's entry (not dropped since a lookup)."""
        key = placeholder.block_hash
        return key is not None and self.lru[placeholder.group_id].get(key) is placeholder

    def reserve(self, placeholder: KVCacheBlock) -> None:
        """Keep the placeholder's slot out of reuse until the next batch."""
        self.reserved[placeholder.group_id].add(slot_of(placeholder))

    def promoted(self, placeholder: KVCacheBlock, block: KVCacheBlock) -> None:
        """The placeholder's content goes to device block ``block``: plan the copy and
        touch the entry (MRU). The host copy stays: the tiers are inclusive, so evicting
        ``block`` later needs no copy."""
        gid = placeholder.group_id
        slot = slot_of(placeholder)
        self.reserved[gid].add(slot)
        key = placeholder.block_hash
        assert key is not None
        self.lru[gid].move_to_end(key)
        self.promotions.append(TierCopy(gid, block.block_id, slot))
        self.num_promotions += 1

    def drop(self, key: bytes, group_id: int, events: list[KVEvent]) -> bool:
        """Forget ``key``'s host copy (its device block was invalidated: the copy may be
        what went wrong); its slot is free again. False if the tier does not hold it."""
        placeholder = self.lru[group_id].pop(key, None)
        if placeholder is None:
            return False
        self._freed[group_id].append(slot_of(placeholder))
        self.num_evictions += 1
        if self.enable_events:
            events.append(BlockRemoved([external_block_hash(key)], group_id, medium="CPU"))
        return True

    # -- reset -------------------------------------------------------------------------
    def reset(self, events: list[KVEvent]) -> int:
        """Drop every entry (the executor's host memory is gone): BlockRemoved CPU each;
        answers how many. Reservations and planned copies are dropped too."""
        dropped = 0
        for gid, lru in enumerate(self.lru):
            if self.enable_events:
                events.extend(BlockRemoved([external_block_hash(key)], gid, medium="CPU")
                              for key in lru)
            dropped += len(lru)
            lru.clear()
            self._next_fresh[gid] = 0
            self._freed[gid] = []
            self.reserved[gid].clear()
        self.num_evictions += dropped
        self.demotions = []
        self.promotions = []
        return dropped

    # -- invariants ----------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert the tier's invariants (module doc); O(slots used), for tests."""
        for gid, lru in enumerate(self.lru):
            assert len(lru) <= self.slots, f"group {gid}: {len(lru)} entries > {self.slots}"
            used = set()
            for key, placeholder in lru.items():
                slot = slot_of(placeholder)
                assert 0 <= slot < self._next_fresh[gid], f"group {gid}: bad slot {slot}"
                assert slot not in used, f"group {gid}: slot {slot} held twice"
                used.add(slot)
                assert placeholder.block_hash == key and placeholder.group_id == gid, \
                    f"group {gid}: placeholder of slot {slot} does not match its key"
                assert placeholder.ref_cnt == 0 and not placeholder.is_null, \
                    f"group {gid}: placeholder of slot {slot} is referenced"
                assert placeholder.prev_free_block is None \
                    and placeholder.next_free_block is None, \
                    f"group {gid}: placeholder of slot {slot} is in the free queue"
            freed = self._freed[gid]
            assert len(set(freed)) == len(freed) and used.isdisjoint(freed), \
                f"group {gid}: a free slot is in use or free twice"
            assert len(used) + len(freed) == self._next_fresh[gid], \
                f"group {gid}: used {len(used)} + free {len(freed)} != handed out"
            assert all(0 <= s < self.slots for s in self.reserved[gid]), \
                f"group {gid}: a reserved slot is out of range"


class TwoTierMap:
    """One group's device map and host LRU seen as one map (the ``.get`` /
    ``__contains__`` the hit rules' hot loops bind): the device entry first."""

    __slots__ = ("_device", "_host")

    def __init__(self, device: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]],
                 host: OrderedDict[bytes, KVCacheBlock]) -> None:
        self._device = device
        self._host = host

    def get(self, key: bytes, default: object = None) -> object:
        """The device entry (a block or a dict of duplicates), else the placeholder."""
        entry = self._device.get(key)
        if entry is not None:
            return entry
        placeholder = self._host.get(key)
        return default if placeholder is None else placeholder

    def __contains__(self, key: object) -> bool:
        return key in self._device or key in self._host


class TwoTierView:
    """The :class:`~cache_service.core.block_pool.CachedBlockLookup` of a pool with a host
    tier: a key missing on the device but held in host memory answers its placeholder
    (``ref_cnt == 0``, so admission counts it as one free block to take, exactly like a
    free cached device block)."""

    __slots__ = ("hash_block_size", "null_block", "_pool", "_tier", "_maps")

    def __init__(self, pool: BlockPool, tier: HostTier) -> None:
        self.hash_block_size = pool.hash_block_size
        self.null_block = pool.null_block
        self._pool = pool
        self._tier = tier
        self._maps = [TwoTierMap(pool.group_map(g), tier.lru[g])
                      for g in range(len(tier.lru))]

    def __reduce__(self) -> tuple[Any, ...]:
        return TwoTierView, (self._pool, self._tier)

    def group_map(self, group_id: int) -> Any:
        """Both tiers' keys of one group (read-only)."""
        return self._maps[group_id]

    def get_one_cached_block(self, key: Any, group_id: int) -> KVCacheBlock | None:
        """The device block cached under ``key`` (the first inserted), else the
        placeholder of its host slot, else None."""
        block = self._pool.get_one_cached_block(key, group_id)
        if block is not None:
            return block
        return self._tier.lru[group_id].get(key)

    def get_cached_block(self, key: Any, group_ids: Sequence[int]
                         ) -> list[KVCacheBlock] | None:
        """One block (device first, else placeholder) per group, or None if any misses."""
        out: list[KVCacheBlock] = []
        for gid in group_ids:
            block = self.get_one_cached_block(key, gid)
            if block is None:
                return None
            out.append(block)
        return out
