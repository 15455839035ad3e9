"""What a pool holds of a prompt, group by group, and why a prefix hit stopped.

Residency of one group is its *standalone reach*: the hit length the group alone would
give (its own lookup rule at its own block size, capped like every lookup at the prompt
length - 1): full attention, the leading run of cached blocks; sliding window, the end of
the rightmost run of window blocks; Mamba, the last cached state boundary (all boundaries
with a state are listed too). The pool's hit (the hybrid rule) is at most every group's
reach.

A miss reason says why one group's reach stopped where it did. It looks at the first block
past the reach (``reach // block_size``) and checks, in this order:

1. ``HASH_RECIPE_MISMATCH``: the caller's block hashes differ from the pool's own hash of
   the same tokens (another algorithm, hash block size or ``PYTHONHASHSEED``).
2. ``EVICTED``: the block's key is in the pool's bounded record of recently removed keys
   (eviction, invalidation or reset), with how many keys were removed since.
3. ``OUTSIDE_SLIDING_WINDOW`` (sliding-window groups) / ``NO_MAMBA_CHECKPOINT`` (Mamba):
   another group of the pool holds the block, so the tokens were computed, but this group
   kept no block there.
4. ``DIFFERENT_SALT_OR_LORA``: the pool holds the block under other extra keys (no salt /
   no LoRA, or a salt / LoRA a recent request of the pool used).
5. ``NEVER_CACHED``: none of the above.

A group that holds every block the lookup could use gets ``NONE``; when every group reaches
past the pool's hit, each gets ``CUT_TO_ALIGNMENT`` (the hit is cut to the hit alignment).
Explaining is opt-in per call: it rehashes and probes, which a plain lookup never does.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from mypy_extensions import mypyc_attr

from cache_service.core.hashing import HashFn, MMItem, hash_request_tokens
from cache_service.core.restore import RebuiltFromFields
from cache_service.core.single_type_managers import (
    CrossAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    hash_view,
)

if TYPE_CHECKING:
    from cache_service.core.block_pool import BlockPool, CachedBlockLookup

#: Recently removed keys remembered per pool (split evenly between its groups).
DEFAULT_EVICTION_RECORD = 4096
#: Distinct (salt, LoRA) combinations of recent requests remembered per pool.
MAX_KEY_COMBOS = 16


class MissReason(enum.Enum):
    """Why a group's reach stopped (see the module doc for the rules)."""

    NONE = "none"
    NEVER_CACHED = "never_cached"
    EVICTED = "evicted"
    DIFFERENT_SALT_OR_LORA = "different_salt_or_lora"
    CUT_TO_ALIGNMENT = "cut_to_alignment"
    OUTSIDE_SLIDING_WINDOW = "outside_sliding_window"
    NO_MAMBA_CHECKPOINT = "no_mamba_checkpoint"
    HASH_RECIPE_MISMATCH = "hash_recipe_mismatch"


@dataclass(slots=True)
class GroupResidency:
    """One group's reach in tokens (a multiple of its block size); ``checkpoints``: Mamba
    state boundaries in tokens, ascending; the reason fields only when explained."""

    group_idx: int
    kind: str
    block_size: int
    tokens: int
    checkpoints: list[int] = field(default_factory=list)
    reason: MissReason | None = None
    evicted_removals_ago: int = 0
    #: With a host tier: the reach counting host slots too (None = ``tokens``).
    host_reach: int | None = None

    @property
    def blocks(self) -> int:
        return self.tokens // self.block_size

    @property
    def host_tokens(self) -> int:
        """The reach across both tiers (>= ``tokens``; ``tokens`` without a host tier)."""
        return self.tokens if self.host_reach is None else self.host_reach


@dataclass(slots=True)
class Residency:
    """A pool's answer for one prompt: the hit (hybrid rule) and every group's reach."""

    hit_tokens: int
    groups: list[GroupResidency]
    #: With a host tier: the hit across both tiers (None = ``hit_tokens``).
    host_hit: int | None = None

    @property
    def host_hit_tokens(self) -> int:
        """The hit across both tiers (>= ``hit_tokens``, which counts device blocks
        only; ``hit_tokens`` without a host tier): what a lookup would answer now."""
        return self.hit_tokens if self.host_hit is None else self.host_hit


@dataclass(frozen=True, slots=True)
class ExtraKeys(RebuiltFromFields):
    """The hash extra keys of a request (multimodal items and prompt-embedding digests
    checked by the caller: hashing.check_mm_items / check_prompt_embeds)."""

    cache_salt: str | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    mm_items: tuple[MMItem, ...] = ()
    prompt_embeds: tuple[bytes, ...] = ()

    def hash_request(self, hash_fn: HashFn, token_ids: Sequence[int], hash_block_size: int,
                     lookahead: int, *, parent: bytes | None = None, start_block: int = 0,
                     stop_block: int | None = None) -> list[bytes]:
        """:func:`hash_request_tokens` of ``token_ids`` under these keys."""
        return hash_request_tokens(
            hash_fn, token_ids, hash_block_size, parent=parent, start_block=start_block,
            stop_block=stop_block, lora_name=self.lora_name, lora_path=self.lora_path,
            cache_salt=self.cache_salt, mm_items=self.mm_items,
            prompt_embeds=self.prompt_embeds, lookahead=lookahead)


@mypyc_attr(allow_interpreted_subclasses=True)  # unpickled without __init__: restore.py
class PrefixLog:
    """A pool's :class:`~cache_service.core.block_pool.CacheObserver`: keeps the bounded
    record of removed keys and the recent extra-key combinations (for miss reasons), and,
    once the routing index attaches it, the pool's bits in the index's hash map.

    Invariant while attached: ``index_map[h] & bits[g]`` is set iff group ``g``'s map
    holds key ``h``."""

    __slots__ = ("_cap", "_combos", "_evicted", "bits", "index_map", "misses", "removals")
    #: What a snapshot keeps: all but the index's map and bits (derived state, rebuilt and
    #: attached again when a snapshot is loaded).
    _STATE: Final = ("_cap", "_combos", "_evicted", "misses", "removals")

    def __init__(self, num_groups: int, capacity: int = DEFAULT_EVICTION_RECORD) -> None:
        self.removals = 0  # keys removed so far: the clock of the eviction record
        self._evicted: list[OrderedDict[bytes, int]] = [OrderedDict()
                                                        for _ in range(max(1, num_groups))]
        self._cap = max(1, capacity // max(1, num_groups))
        self._combos: OrderedDict[ExtraKeys, None] = OrderedDict()
        self.index_map: dict[bytes, int] | None = None
        self.bits: list[int] = []
        # (group index, reason value) -> explained lookups that answered it.
        self.misses: dict[tuple[int, str], int] = {}

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the index's map and bits: the index is derived state, rebuilt
        (and attached again) when a snapshot is loaded."""
        return {name: getattr(self, name) for name in PrefixLog._STATE}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        self.index_map = None
        self.bits = []

    def added(self, block_hash: bytes, group_id: int) -> None:
        m = self.index_map
        if m is not None:
            m[block_hash] = m.get(block_hash, 0) | self.bits[group_id]

    def removed(self, block_hash: bytes, group_id: int) -> None:
        m = self.index_map
        if m is not None:
            left = m[block_hash] & ~self.bits[group_id]
            if left:
                m[block_hash] = left
            else:
                del m[block_hash]
        self.removals += 1
        record = self._evicted[group_id]
        record.pop(block_hash, None)  # re-inserted at the young end
        record[block_hash] = self.removals
        if len(record) > self._cap:
            record.popitem(last=False)

    def evicted_ago(self, block_hash: bytes, group_id: int) -> int | None:
        """Keys removed since this one was (>= 0), or None if it is not in the record."""
        at = self._evicted[group_id].get(block_hash)
        return None if at is None else self.removals - at

    def saw_keys(self, keys: ExtraKeys) -> None:
        """A request with a salt or LoRA was added (others need no record)."""
        combos = self._combos
        if keys in combos:
            combos.move_to_end(keys)
            return
        combos[keys] = None
        if len(combos) > MAX_KEY_COMBOS:
            combos.popitem(last=False)

    def key_combos(self) -> list[ExtraKeys]:
        return list(self._combos)


def standalone_reach(manager: SingleTypeKVCacheManager, hashes: Sequence[Any], max_len: int,
                     pool: CachedBlockLookup) -> int:
    """The hit length ``manager``'s group alone would give (its own block size as the
    alignment). ``pool`` may be any object with the block pool's lookup interface."""
    cls = type(manager)
    if cls is CrossAttentionManager or max_len <= 0:
        return 0
    _, n = cls.find_longest_cache_hit(hashes, max_len, [manager.group_id], pool, manager.spec,
                                      manager.block_size)
    return n


def mamba_checkpoints(manager: SingleTypeKVCacheManager, hashes: Sequence[Any], max_len: int,
                      pool: BlockPool, last: int | None = None) -> list[int]:
    """Token boundaries (<= ``max_len``) at which a Mamba group holds a state; only
    coarse blocks up to ``last`` (inclusive) are probed when given."""
    bs = manager.block_size
    view = hash_view(hashes, pool.hash_block_size, bs)
    n = min(max_len // bs, len(view))
    if last is not None:
        n = min(n, last + 1)
    has = pool.group_map(manager.group_id).__contains__
    return [(i + 1) * bs for i in range(n) if has(view[i])]


def group_residency(managers: Sequence[SingleTypeKVCacheManager], hashes: Sequence[Any],
                    max_len: int, pool: BlockPool,
                    two_tiers: CachedBlockLookup | None = None) -> list[GroupResidency]:
    """Every group's reach, probing the block pool directly (the per-pool answer); with
    ``two_tiers`` (a pool's host-tier view) also its reach across both tiers."""
    out = []
    for m in managers:
        reach = standalone_reach(m, hashes, max_len, pool) if m.enable_caching else 0
        checkpoints = (mamba_checkpoints(m, hashes, max_len, pool)
                       if isinstance(m, MambaManager) and m.enable_caching else [])
        g = GroupResidency(m.group_id, m.spec.kind, m.block_size, reach, checkpoints)
        if two_tiers is not None and m.enable_caching:
            g.host_reach = max(reach, standalone_reach(m, hashes, max_len, two_tiers))
        out.append(g)
    return out


@dataclass(slots=True)
class ExplainContext:
    """What :func:`explain` needs besides the residency."""

    managers: Sequence[SingleTypeKVCacheManager]
    pool: CachedBlockLookup  # the block pool, or both tiers' view with a host tier
    log: PrefixLog
    hash_fn: HashFn
    hashes: Sequence[bytes]  # the request's hashes at the pool's hash block size
    max_len: int
    keys: ExtraKeys
    token_ids: Sequence[int] | None  # None when only client hashes are known
    client_hashes: bool
    lookahead: int = 0  # the pool's num_hash_lookahead_tokens


def _recipe_mismatch(ctx: ExplainContext) -> bool:
    """Client hashes and tokens are both known and the first block's hashes differ."""
    if not ctx.client_hashes or ctx.token_ids is None or not ctx.hashes:
        return False
    hbs = ctx.pool.hash_block_size
    own = _hash(ctx, ctx.token_ids[:hbs], ctx.keys)
    return bool(own) and own[0] != ctx.hashes[0]


def _hash(ctx: ExplainContext, tokens: Sequence[int], keys: ExtraKeys) -> list[bytes]:
    """The pool's block hashes of ``tokens`` under the extra keys ``keys``."""
    return keys.hash_request(ctx.hash_fn, tokens, ctx.pool.hash_block_size, ctx.lookahead)


def _held_under_other_keys(ctx: ExplainContext, manager: SingleTypeKVCacheManager,
                           j: int) -> bool:
    """Whether the group holds coarse block ``j`` hashed with other extra keys."""
    if ctx.token_ids is None:
        return False
    hbs = ctx.pool.hash_block_size
    bs = manager.block_size
    prefix = ctx.token_ids[:(j + 1) * bs]
    combos = [ExtraKeys()] + ctx.log.key_combos()
    held = ctx.pool.group_map(manager.group_id)
    for keys in combos:
        if keys == ctx.keys:
            continue
        fine = _hash(ctx, prefix, keys)
        view = hash_view(fine, hbs, bs)
        if len(view) > j and view[j] in held:
            return True
    return False


def _classify(ctx: ExplainContext, manager: SingleTypeKVCacheManager, reach: int,
              mismatch: bool) -> tuple[MissReason, int]:
    bs = manager.block_size
    j = reach // bs
    view = hash_view(ctx.hashes, ctx.pool.hash_block_size, bs)
    if mismatch:
        return MissReason.HASH_RECIPE_MISMATCH, 0
    if j >= len(view):
        return MissReason.NEVER_CACHED, 0
    h = view[j]
    gid = manager.group_id
    ago = ctx.log.evicted_ago(h, gid)
    if ago is not None:
        return MissReason.EVICTED, ago
    if isinstance(manager, (SlidingWindowManager, MambaManager)):
        # The hash of the block ending at a token boundary is the same in every group
        # (the fine hash there), so one probe per other group tells whether the pool
        # computed and kept these tokens elsewhere.
        for other in ctx.managers:
            if other is not manager and h in ctx.pool.group_map(other.group_id):
                return (MissReason.OUTSIDE_SLIDING_WINDOW
                        if isinstance(manager, SlidingWindowManager)
                        else MissReason.NO_MAMBA_CHECKPOINT), 0
    if _held_under_other_keys(ctx, manager, j):
        return MissReason.DIFFERENT_SALT_OR_LORA, 0
    return MissReason.NEVER_CACHED, 0


def explain(residency: Residency, ctx: ExplainContext) -> Residency:
    """Fills every group's reason in ``residency`` (in place; returned for chaining)."""
    groups = residency.groups
    if not groups:
        return residency
    hit = residency.host_hit_tokens  # = hit_tokens without a host tier
    mismatch = _recipe_mismatch(ctx)
    all_past = all(g.host_tokens > hit for g in groups)
    for g, manager in zip(groups, ctx.managers):
        cap = ctx.max_len // g.block_size * g.block_size
        if type(manager) is CrossAttentionManager or not manager.enable_caching:
            g.reason = MissReason.NEVER_CACHED
        elif all_past and g.host_tokens > hit:
            g.reason = MissReason.CUT_TO_ALIGNMENT
        elif g.host_tokens >= cap:
            g.reason = MissReason.NONE
        else:
            # With a host tier the reach explained is both tiers' (a key held in host
            # memory is no miss): EVICTED then means evicted from both tiers.
            g.reason, g.evicted_removals_ago = _classify(ctx, manager, g.host_tokens,
                                                         mismatch)
        key = (g.group_idx, g.reason.value)
        ctx.log.misses[key] = ctx.log.misses.get(key, 0) + 1
    return residency
