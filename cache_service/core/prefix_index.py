"""The routing index: one block-hash -> pools map across every pool of a key space.

Each (pool, group) owns one bit ("slot") of its key space. ``map[h]`` is the bitmask of
the slots whose group holds key ``h``; the pools keep it exact themselves (their
:class:`~cache_service.core.residency.PrefixLog` is told of every key added to or removed
from their prefix-cache map). A key space is a tenant and a hash identity (algorithm, chain
seed, hash block size): pools of one key space hash a prompt identically, so a lookup
hashes it once per key space and reads one mask per block, whatever the number of pools;
pools of two tenants never share a map.

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
from typing import TYPE_CHECKING, Any, NamedTuple

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
from cache_service.core.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec, cdiv

if TYPE_CHECKING:
    from cache_service.core.pool import Pool

#: (tenant, hash algorithm, hash block size). Pools share hashes only within one.
class KeySpace(NamedTuple):
    """Pools share index keys only within one key space."""

    tenant: str
    hash_algo: str
    none_hash: bytes  # the parent of every chain's first block (the hash seed)
    hash_block_size: int
    num_hash_lookahead_tokens: int = 0  # lookahead hashes differ from plain ones


def keyspace_of(pool: Pool, tenant: str = "") -> KeySpace:
    """The key space of a pool (the one place that decides which pools share keys)."""
    recipe = pool.hash_recipe
    return KeySpace(tenant, recipe.hash_algo, recipe.none_hash, recipe.hash_block_size,
                    recipe.num_hash_lookahead_tokens)


_FULL = FullAttentionSpec.kind
_PRESENT = KVCacheBlock(-1)  # what the mask view answers for a held key
_NULL = KVCacheBlock(0)
_NULL.is_null = True


class _SlotProbe:
    """One slot's column of the masks, with the dict interface managers probe."""

    __slots__ = ("_bit", "_masks")

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
    """One attached pool: its key space, slots (one per group) and lookup structure."""

    pool: Pool
    keyspace: KeySpace
    slots: list[int]
    managers: tuple[SingleTypeKVCacheManager, ...]
    caching: bool
    mask: int = 0  # all its slots
    #: The block size when the pool is one full-attention group (the common, fast case).
    full_only: int = 0
    #: Its last answer, handed out again while equal (callers may cache by identity).
    last: Residency | None = None
    #: Its compiled lookup structure and the signature of its last answer.
    program: _Program | None = None
    signature: tuple[Any, ...] | None = None


@dataclass
class _Space:
    """One key space: the hash map and slot allocation."""

    map: dict[bytes, int] = field(default_factory=dict)
    free: list[int] = field(default_factory=list)
    next_slot: int = 0

    def take(self) -> int:
        if self.free:
            return self.free.pop()
        self.next_slot += 1
        return self.next_slot - 1


#: Per key space of a pool list: (key space, (position, slot, block size, member) of the
#: one-full-group pools, (position, member) of the others, full-attention slot masks by
#: block-size ratio, mask of the non-full slots).
_PlanItem = tuple[KeySpace, list[tuple[int, int, int, "_Member"]], list[tuple[int, "_Member"]],
                  dict[int, int], int]


class PrefixIndex:
    """Pools by key (e.g. pool id), their key spaces and the shared hash maps."""

    def __init__(self) -> None:
        self._spaces: dict[KeySpace, _Space] = {}
        self._members: dict[str, _Member] = {}
        self._plans: dict[tuple[str, ...], list[_PlanItem]] = {}

    def attach(self, key: str, pool: Pool, keyspace: KeySpace) -> None:
        """Adds a pool, indexing every key it already holds."""
        if key in self._members:
            raise AlreadyExists(f"pool {key!r} is already indexed", field="pool_id")
        managers = pool.manager.coordinator.managers
        self._plans.clear()
        member = _Member(pool, keyspace, [], managers, pool.options.enable_caching)
        if isinstance(pool.manager.coordinator, UnitaryCoordinator) and \
                type(managers[0]) is FullAttentionManager:
            member.full_only = managers[0].block_size
        self._members[key] = member
        if not member.caching:
            return
        space = self._spaces.setdefault(keyspace, _Space())
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
        self._plans.clear()
        if not member.caching:
            return
        space = self._spaces[member.keyspace]
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
            del self._spaces[member.keyspace]

    def __contains__(self, key: str) -> bool:
        return key in self._members

    def keyspace(self, key: str) -> KeySpace:
        return self._members[key].keyspace

    def num_keys(self, keyspace: KeySpace) -> int:
        """Distinct hashes held by any pool of the key space."""
        space = self._spaces.get(keyspace)
        return 0 if space is None else len(space.map)

    # -- lookup ------------------------------------------------------------------------

    def peek(self, keys: Sequence[str],
             query: Callable[[KeySpace], tuple[Sequence[bytes], int]]) -> list[Residency]:
        """Every pool's hit and group reaches for one prompt (do not modify them: an equal
        answer may be the same object as last time). ``query(keyspace)`` gives
        the prompt's hashes at that key space's recipe and the hit cap in tokens (called
        once per keyspace). Unknown keys raise NotFound naming ``pool_ids[i]``."""
        out: list[Residency | None] = [None] * len(keys)
        for keyspace, full_only, others, full_masks, other_mask in self._plan(keys):
            hashes, max_len = query(keyspace)
            get = self._spaces[keyspace].map.get
            masks = [get(h, 0) for h in hashes]
            lookup = _Lookup(masks, keyspace.hash_block_size, max_len, full_masks, other_mask)
            runs = lookup.runs
            caps: dict[int, int] = {}
            for i, slot, bs, member in full_only:  # the hot loop of a many-pool answer
                cap = caps.get(bs)
                if cap is None:
                    cap = caps[bs] = max_len // bs if max_len > 0 else 0
                run = runs[slot]
                reach = (min(cap, run)) * bs
                res = member.last
                if res is None or res.hit_tokens != reach:
                    res = member.last = Residency(reach, [GroupResidency(0, _FULL, bs, reach)])
                out[i] = res
            for i, member in others:
                out[i] = lookup.answer(member)
        for i, res in enumerate(out):
            if res is None:  # caching off: nothing is ever held
                out[i] = Residency(0, [GroupResidency(m.group_id, m.spec.kind, m.block_size, 0)
                                       for m in self._members[keys[i]].managers])
        return out  # type: ignore[return-value]

    def _plan(self, keys: Sequence[str]) -> list[_PlanItem]:
        """Per keyspace: (keyspace, (position in ``keys``, slot, block size, member) of
        the one-full-group pools, (position, member) of the others, full-attention slot
        masks by block-size ratio, mask of the non-full slots). Kept per key list until a
        pool is attached or detached: routers ask about the same pools again and again."""
        cache_key = tuple(keys)
        plan = self._plans.get(cache_key)
        if plan is not None:
            return plan
        by_space: dict[KeySpace, list[int]] = {}
        for i, key in enumerate(keys):
            member = self._members.get(key)
            if member is None:
                raise NotFound(f"pool {key!r} is not indexed", field=f"pool_ids[{i}]")
            if member.caching:
                by_space.setdefault(member.keyspace, []).append(i)
        plan = []
        for keyspace, idx in by_space.items():
            full_only, others = [], []
            full_masks: dict[int, int] = {}
            other = 0
            for i in idx:
                member = self._members[keys[i]]
                if member.full_only:
                    full_only.append((i, member.slots[0], member.full_only, member))
                else:
                    others.append((i, member))
                for m, slot in zip(member.managers, member.slots):
                    if type(m) is FullAttentionManager:
                        k = m.block_size // keyspace.hash_block_size
                        full_masks[k] = full_masks.get(k, 0) | (1 << slot)
                    else:
                        other |= 1 << slot
            plan.append((keyspace, full_only, others, full_masks, other))
        if len(self._plans) >= 64:
            self._plans.clear()
        self._plans[cache_key] = plan
        return plan


def _record(out: dict[int, int], bits: int, value: int) -> None:
    """``out[slot] = value`` for every set bit of ``bits``."""
    while bits:
        low = bits & -bits
        out[low.bit_length() - 1] = value
        bits ^= low


def _full_runs(masks: list[int], by_k: dict[int, int]) -> dict[int, int]:
    """Leading run (in the group's blocks) of every full-attention slot in ``by_k``
    (block-size ratio -> slot mask): one sweep per ratio, ending when no slot is left."""
    runs: dict[int, int] = {}
    for k, alive in by_k.items():
        # k == 1 (the usual case) walks the masks themselves: no index arithmetic.
        view = masks if k == 1 else masks[k - 1::k]
        for j, mk in enumerate(view):
            a = alive & mk
            if a != alive:
                _record(runs, alive ^ a, j)
                alive = a
                if not alive:
                    break
        _record(runs, alive, len(view))
    return runs


def _last_positions(masks: list[int], want: int) -> dict[int, int]:
    """The last block position (fine) each slot of ``want`` holds; absent = none."""
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
            _record(last, new, i)
        i -= 1
    return last


class _Entry(NamedTuple):
    """One group (or spec group) of a pool, as :meth:`_Lookup.find` reads it."""

    cls: type[SingleTypeKVCacheManager]
    block_size: int
    ratio: int  # block size / hash block size
    slots: list[int]
    bits: int  # the slots' bit mask
    need: int  # window blocks needed (sliding window, else 0)
    group_ids: list[int]
    spec: KVCacheSpec
    slot_view: list[int]  # slot of every group of the pool


class _Program:
    """A pool's lookup structure, read once: one entry per group (standalone reach) and per
    spec group of its coordinator (the hybrid fixed point), in search order."""

    def __init__(self, member: _Member) -> None:
        managers, slots = member.managers, member.slots
        hbs = member.keyspace.hash_block_size

        def entry(gids: list[int], spec: KVCacheSpec) -> _Entry:
            m = managers[gids[0]]
            cls = type(m)
            bits = 0
            for g in gids:
                bits |= 1 << slots[g]
            window = m.spec
            need = (cdiv(window.sliding_window - 1, m.block_size)
                    if isinstance(window, SlidingWindowSpec) else 0)
            return _Entry(cls, m.block_size, m.block_size // hbs, [slots[g] for g in gids],
                          bits, need, gids, spec, slots)

        self.groups = [entry([g], m.spec) for g, m in enumerate(managers)]
        self.kinds = [m.spec.kind for m in managers]
        self.mamba = [g for g, m in enumerate(managers) if type(m) is MambaManager]
        coordinator = member.pool.manager.coordinator
        self.mode: str | None = None
        self.spec_groups: list[_Entry] = []
        self.full: list[bool] = []
        self.simple = False
        self.alignment = 1
        if isinstance(coordinator, UnitaryCoordinator):
            self.mode = "unitary"
        elif isinstance(coordinator, HybridCoordinator):
            self.mode = "hybrid"
            self.spec_groups = [entry(sg.group_ids, sg.spec) for sg in coordinator.spec_groups]
            self.full = [sg.is_full for sg in coordinator.spec_groups]
            self.simple = coordinator._simple
            self.alignment = coordinator.scheduler_block_size


class _Lookup:
    """The masks of one prompt in one keyspace, and what is derived from them once for
    every pool: full-attention runs, the last block each other slot holds, window ANDs."""

    def __init__(self, masks: list[int], hbs: int, max_len: int, full_masks: dict[int, int],
                 other_mask: int) -> None:
        self.masks = masks
        self.hbs = hbs
        self.max_len = max_len
        self.runs = _full_runs(masks, full_masks)
        self.last = _last_positions(masks, other_mask)
        self._ands: dict[tuple[int, int, int], int] = {}
        self._positions = range(len(masks))

    def _and(self, k: int, lo: int, hi: int) -> int:
        """AND of the masks of coarse blocks [lo, hi) at ratio k (memoized: pools that
        hold the same prefix ask for the same window)."""
        key = (k, lo, hi)
        v = self._ands.get(key)
        if v is None:
            masks = self.masks
            v = -1
            for j in range(lo, hi):
                v &= masks[(j + 1) * k - 1]
            self._ands[key] = v
        return v

    def find(self, entry: _Entry, cap: int, alignment: int) -> int:
        """The joint hit of one spec's groups with this cap and alignment: what their
        manager's ``find_longest_cache_hit`` answers on the pool itself."""
        cls, bs, k, slots, bits, need, gids, spec, slot_view = entry
        if cls is FullAttentionManager:
            n = cap // bs
            top = len(self.masks) // k
            n = min(n, top)
            runs = self.runs
            run = runs[slots[0]] if len(slots) == 1 else min(runs[s] for s in slots)
            run = (min(n, run)) * bs
            return run - run % alignment
        if cls is CrossAttentionManager or cap <= 0:
            return 0
        if cls is not ChunkedLocalAttentionManager:
            last = self.last
            for s in slots:  # lower the cap to the end of the last block the slots hold
                pos = last.get(s)
                end = 0 if pos is None else (pos + 1) // k * bs
                cap = min(cap, end)
            if cap <= 0:
                return 0
        n = cap // bs
        if n > 0 and (bs == alignment or (n * bs) % alignment == 0):
            # Fast paths: the blocks right below the cap are held (the common case), so
            # the right-to-left search stops at once.
            if cls is MambaManager and self.masks[n * k - 1] & bits == bits:
                return n * bs
            if need and self._and(k, max(0, n - need), n) & bits == bits:
                return n * bs
        # Duck-typed: block positions stand in for the hashes, the mask view for the
        # block pool (the manager's rule only probes them).
        positions: Any = self._positions
        view: Any = _MaskView(self.masks, slot_view, self.hbs)
        _, hit = cls.find_longest_cache_hit(positions, cap, gids, view, spec, alignment)
        return hit

    def answer(self, member: _Member) -> Residency:
        """One pool's hit and group reaches (the pool's own rules)."""
        prog = member.program
        if prog is None:
            prog = member.program = _Program(member)
        max_len = self.max_len
        reaches = [self.find(e, max_len, e[1]) if max_len > 0 else 0 for e in prog.groups]
        checkpoints: list[list[int]] = []
        for gid in prog.mamba:
            slot = member.slots[gid]
            found: list[int] = []
            if slot in self.last:
                bs = prog.groups[gid][1]
                k = bs // self.hbs
                top = min(max_len // bs, len(self.masks) // k, cdiv(self.last[slot] + 1, k))
                masks = self.masks
                found = [(i + 1) * bs for i in range(top) if masks[(i + 1) * k - 1] >> slot & 1]
            checkpoints.append(found)
        if max_len <= 0 or prog.mode is None:
            hit = 0
        elif prog.mode == "unitary":
            hit = reaches[0]  # one group: its alignment is its block size
        else:
            hit = self._hybrid_hit(prog)
        signature = (hit, reaches, checkpoints)
        if signature != member.signature:
            member.signature = signature
            it = iter(checkpoints)
            member.last = Residency(hit, [
                GroupResidency(gid, kind, e[1], reach, next(it) if gid in prog.mamba else [])
                for gid, (e, kind, reach) in enumerate(zip(prog.groups, prog.kinds, reaches))])
        return member.last  # type: ignore[return-value]

    def _hybrid_hit(self, prog: _Program) -> int:
        """``HybridCoordinator.find_longest_cache_hit``'s fixed point over :meth:`find`."""
        alignment = prog.alignment
        hit_length = self.max_len
        full_len: dict[int, int] = {}
        while True:
            curr = hit_length
            for i, entry in enumerate(prog.spec_groups):
                if prog.full[i] and i in full_len:
                    curr = min(curr, full_len[i])
                    continue
                curr = self.find(entry, curr, alignment)
                if prog.full[i]:
                    full_len[i] = curr
            if curr >= hit_length:
                break
            hit_length = curr
            if prog.simple:
                break
        return hit_length
