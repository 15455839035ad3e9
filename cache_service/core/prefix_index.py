"""The routing index: one block-hash -> pools map across every pool of a namespace.

Each (pool, group) owns one bit ("slot") of its namespace. ``map[h]`` is the bitmask of
the slots whose group holds key ``h``; the pools keep it exact themselves (their
:class:`~cache_service.core.residency.PrefixLog` is told of every key added to or removed
from their prefix-cache map). A namespace is ``(tenant, hash algorithm, hash block size)``:
pools of one namespace hash a prompt identically, so a lookup hashes it once per
namespace and reads one mask per block, whatever the number of pools.

A lookup over many pools:

1. ``masks[i] = map.get(h_i, 0)`` for the prompt's hashes (one dict probe per block).
2. Full-attention groups: one sweep of ``alive &= masks[i]`` over the blocks gives every
   full group's leading run at once (a bit leaves ``alive`` once; the sweep stops when no
   bit is left), so its cost is the longest run, not pools x blocks.
3. Other groups (sliding window, Mamba, chunked local) run their own lookup rule against
   the masks, starting at the last block their slot holds (found by one backward sweep):
   their cost is bounded by the span of the prompt the pool holds.
4. The pool's hit is the hybrid rule of the pool's coordinator, over those answers.

The answer for each pool equals the pool's own lookup (property-tested).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cache_service.core.block import KVCacheBlock
from cache_service.core.coordinator import HybridCoordinator, UnitaryCoordinator
from cache_service.core.errors import AlreadyExists, NotFound
from cache_service.core.residency import GroupResidency, Residency
from cache_service.core.single_type_managers import (
    ChunkedLocalAttentionManager,
    CrossAttentionManager,
    FullAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
)
from cache_service.core.specs import cdiv

if TYPE_CHECKING:
    from cache_service.core.pool import Pool

#: (tenant, hash algorithm, hash block size). Pools share hashes only within one.
Namespace = tuple[str, str, int]


def namespace_of(pool: Pool, tenant: str = "") -> Namespace:
    """The namespace of a pool (the one place that decides which pools share keys)."""
    return (tenant, pool.options.hash_algo, pool.hash_block_size)


_PRESENT = KVCacheBlock(-1)  # what the mask view answers for a held key
_NULL = KVCacheBlock(0)
_NULL.is_null = True


class _SlotProbe:
    """One slot's column of the masks, with the dict interface managers probe."""

    __slots__ = ("_masks", "_bit")

    def __init__(self, masks: Sequence[int], bit: int) -> None:
        self._masks = masks
        self._bit = bit

    def get(self, pos: int, default: None = None) -> KVCacheBlock | None:
        return _PRESENT if self._masks[pos] >> self._bit & 1 else default

    def __contains__(self, pos: int) -> bool:
        return self._masks[pos] >> self._bit & 1 == 1


class _MaskView:
    """The block-pool lookup interface over the masks of one lookup, for one pool: the
    "hashes" handed to the managers are block positions."""

    def __init__(self, masks: Sequence[int], slots: Sequence[int], hash_block_size: int) -> None:
        self._probes = [_SlotProbe(masks, s) for s in slots]
        self.hash_block_size = hash_block_size
        self.null_block = _NULL

    def group_map(self, group_id: int) -> _SlotProbe:
        return self._probes[group_id]

    def get_one_cached_block(self, pos: int, group_id: int) -> KVCacheBlock | None:
        return self._probes[group_id].get(pos)

    def get_cached_block(self, pos: int, group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
        probes = self._probes
        for gid in group_ids:
            if pos not in probes[gid]:
                return None
        return [_PRESENT] * len(group_ids)


@dataclass
class _Member:
    """One attached pool: its namespace, slots (one per group) and lookup structure."""

    pool: Pool
    namespace: Namespace
    slots: list[int]
    managers: tuple[SingleTypeKVCacheManager, ...]
    mask: int = 0  # all its slots

    @property
    def caching(self) -> bool:
        return self.pool.options.enable_caching


@dataclass
class _Space:
    """One namespace: the hash map and slot allocation."""

    map: dict[bytes, int] = field(default_factory=dict)
    free: list[int] = field(default_factory=list)
    next_slot: int = 0

    def take(self) -> int:
        if self.free:
            return self.free.pop()
        self.next_slot += 1
        return self.next_slot - 1


class PrefixIndex:
    """Pools by key (e.g. pool id), their namespaces and the shared hash maps."""

    def __init__(self) -> None:
        self._spaces: dict[Namespace, _Space] = {}
        self._members: dict[str, _Member] = {}

    def attach(self, key: str, pool: Pool, namespace: Namespace) -> None:
        """Adds a pool, indexing every key it already holds."""
        if key in self._members:
            raise AlreadyExists(f"pool {key!r} is already indexed", field="pool_id")
        managers = pool.manager.coordinator.managers
        member = _Member(pool, namespace, [], managers)
        self._members[key] = member
        if not member.caching:
            return
        space = self._spaces.setdefault(namespace, _Space())
        member.slots = [space.take() for _ in managers]
        bits = [1 << s for s in member.slots]
        for b in bits:
            member.mask |= b
        log = pool.prefix_log
        log.bits = bits
        log.index_map = space.map
        block_pool = pool.manager.pool
        for gid in range(len(managers)):
            for h in block_pool.group_map(gid):
                log.added(h, gid)

    def detach(self, key: str) -> None:
        """Removes a pool and all its bits (its keys stay in its own map)."""
        member = self._members.pop(key, None)
        if member is None:
            raise NotFound(f"pool {key!r} is not indexed", field="pool_id")
        if not member.caching:
            return
        space = self._spaces[member.namespace]
        log = member.pool.prefix_log
        block_pool = member.pool.manager.pool
        m = space.map
        keep = ~member.mask
        for gid in range(len(member.managers)):
            for h in block_pool.group_map(gid):
                held = m.get(h)
                if held is None:  # another group of this pool held it too: gone already
                    continue
                left = held & keep
                if left:
                    m[h] = left
                else:
                    del m[h]
        log.index_map = None
        log.bits = []
        space.free.extend(member.slots)
        if len(space.free) == space.next_slot:
            del self._spaces[member.namespace]

    def __contains__(self, key: str) -> bool:
        return key in self._members

    def namespace(self, key: str) -> Namespace:
        return self._members[key].namespace

    def num_keys(self, namespace: Namespace) -> int:
        """Distinct hashes held by any pool of the namespace."""
        space = self._spaces.get(namespace)
        return 0 if space is None else len(space.map)

    # -- lookup ------------------------------------------------------------------------

    def peek(self, keys: Sequence[str],
             query: Callable[[Namespace], tuple[Sequence[bytes], int]]) -> list[Residency]:
        """Every pool's hit and group reaches for one prompt. ``query(namespace)`` gives
        the prompt's hashes at that namespace's recipe and the hit cap in tokens (called
        once per namespace). Unknown keys raise NotFound naming ``pool_ids[i]``."""
        members = []
        for i, key in enumerate(keys):
            member = self._members.get(key)
            if member is None:
                raise NotFound(f"pool {key!r} is not indexed", field=f"pool_ids[{i}]")
            members.append(member)
        by_space: dict[Namespace, list[int]] = {}
        for i, member in enumerate(members):
            if member.caching:
                by_space.setdefault(member.namespace, []).append(i)
        out: list[Residency | None] = [None] * len(members)
        for namespace, idx in by_space.items():
            hashes, max_len = query(namespace)
            for i, res in zip(idx, self._peek_space(namespace, [members[i] for i in idx],
                                                    hashes, max_len)):
                out[i] = res
        for i, member in enumerate(members):
            if out[i] is None:  # caching off: nothing is ever held
                out[i] = Residency(0, [GroupResidency(m.group_id, m.spec.kind, m.block_size, 0)
                                       for m in member.managers])
        return out  # type: ignore[return-value]

    def _peek_space(self, namespace: Namespace, members: list[_Member],
                    hashes: Sequence[bytes], max_len: int) -> list[Residency]:
        space = self._spaces[namespace]
        get = space.map.get
        masks = [get(h, 0) for h in hashes]
        hbs = namespace[2]
        runs = _full_runs(masks, members, hbs)
        last = _last_positions(masks, members)
        return [_answer(member, masks, hbs, max_len, runs, last) for member in members]


def _full_runs(masks: list[int], members: list[_Member], hbs: int) -> dict[int, int]:
    """Leading run (in the group's blocks) of every full-attention slot of ``members``:
    one sweep per distinct block size, ending when no slot is left."""
    by_k: dict[int, int] = {}
    for member in members:
        for m, slot in zip(member.managers, member.slots):
            if type(m) is FullAttentionManager:
                k = m.block_size // hbs
                by_k[k] = by_k.get(k, 0) | (1 << slot)
    runs: dict[int, int] = {}
    for k, alive in by_k.items():
        n = len(masks) // k
        j = 0
        while alive and j < n:
            a = alive & masks[(j + 1) * k - 1]
            if a != alive:
                gone = alive ^ a
                while gone:
                    low = gone & -gone
                    runs[low.bit_length() - 1] = j
                    gone ^= low
                alive = a
            j += 1
        while alive:
            low = alive & -alive
            runs[low.bit_length() - 1] = n
            alive ^= low
    return runs


def _last_positions(masks: list[int], members: list[_Member]) -> dict[int, int]:
    """The last block position (fine) each non-full slot holds; absent = none."""
    want = 0
    for member in members:
        for m, slot in zip(member.managers, member.slots):
            if type(m) is not FullAttentionManager:
                want |= 1 << slot
    last: dict[int, int] = {}
    if not want:
        return last
    present = 0
    for mk in masks:
        present |= mk
    want &= present
    seen = 0
    i = len(masks) - 1
    while seen != want:
        new = masks[i] & want & ~seen
        if new:
            seen |= new
            while new:
                low = new & -new
                last[low.bit_length() - 1] = i
                new ^= low
        i -= 1
    return last


def _answer(member: _Member, masks: list[int], hbs: int, max_len: int, runs: dict[int, int],
            last: dict[int, int]) -> Residency:
    """One pool's hit and group reaches from the masks (the pool's own rules)."""
    managers = member.managers
    slots = member.slots
    view = _MaskView(masks, slots, hbs)
    positions = range(len(masks))

    def capped(gid: int, cap: int) -> int:
        """``cap`` lowered to the end of the last block the slot holds: nothing above it
        can change a right-to-left search (not for chunked local: its start depends on
        the cap)."""
        m = managers[gid]
        if type(m) is ChunkedLocalAttentionManager:
            return cap
        pos = last.get(slots[gid])
        end = 0 if pos is None else (pos + 1) // (m.block_size // hbs) * m.block_size
        return min(cap, end)

    def find(gids: Sequence[int], cap: int, alignment: int) -> int:
        m = managers[gids[0]]
        if type(m) is FullAttentionManager:
            bs = m.block_size
            n = min(cap // bs, len(masks) // (bs // hbs))
            run = min(min(runs[slots[g]] for g in gids), n) * bs
            return run - run % alignment
        if type(m) is CrossAttentionManager or cap <= 0:
            return 0
        cap = min(capped(g, cap) for g in gids)
        if cap <= 0 and type(m) is not ChunkedLocalAttentionManager:
            return 0
        _, n = type(m).find_longest_cache_hit(positions, cap, gids, view, m.spec, alignment)
        return n

    groups = []
    for gid, m in enumerate(managers):
        reach = find([gid], max_len, m.block_size) if max_len > 0 else 0
        checkpoints: list[int] = []
        if type(m) is MambaManager and slots[gid] in last:
            bs = m.block_size
            k = bs // hbs
            top = min(max_len // bs, len(masks) // k, cdiv(last[slots[gid]] + 1, k))
            bit = slots[gid]
            checkpoints = [(i + 1) * bs for i in range(top) if masks[(i + 1) * k - 1] >> bit & 1]
        groups.append(GroupResidency(gid, m.spec.kind, m.block_size, reach, checkpoints))
    coordinator = member.pool.manager.coordinator
    if max_len <= 0:
        hit = 0
    elif isinstance(coordinator, UnitaryCoordinator):
        hit = groups[0].tokens  # one group: its alignment is its block size
    elif isinstance(coordinator, HybridCoordinator):
        hit = _hybrid_hit(coordinator, find, max_len)
    else:
        hit = 0
    return Residency(hit, groups)


def _hybrid_hit(coordinator: HybridCoordinator, find: Callable[[Sequence[int], int, int], int],
                max_len: int) -> int:
    """``HybridCoordinator.find_longest_cache_hit``'s fixed point over ``find``."""
    alignment = coordinator.scheduler_block_size
    hit_length = max_len
    full_len: dict[int, int] = {}
    while True:
        curr = hit_length
        for sg in coordinator.spec_groups:
            first = sg.group_ids[0]
            if sg.is_full and first in full_len:
                if full_len[first] < curr:
                    curr = full_len[first]
                continue
            curr = find(sg.group_ids, curr, alignment)
            if sg.is_full:
                full_len[first] = curr
        if curr >= hit_length:
            break
        hit_length = curr
        if coordinator._simple:
            break
    return hit_length
