"""Coordinators: one block pool, one manager per group, and the prefix-hit search
(docs/semantics.md#hit-search).

* :class:`NoPrefixCacheCoordinator` — caching off; any number of groups (even 0).
* :class:`UnitaryCoordinator` — exactly one group with caching.
* :class:`HybridCoordinator` — two or more groups with caching: groups with equal
  specs are looked up jointly ("spec groups"), full attention first, and the hit
  length is shrunk until every spec group agrees (a fixed point). Hits are
  multiples of the scheduler block size (lcm of the group block sizes), or of the hash
  block size when partial hits are on (docs/semantics.md#partial-hits-and-copy-on-write).

:func:`make_coordinator` picks one as docs/semantics.md#coordinator-selection says.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict, Unpack

from mypy_extensions import mypyc_attr

from cache_service.core.block import KVCacheBlock
from cache_service.core.block_pool import BlockPool, CachedBlockLookup
from cache_service.core.errors import Checked, ConfigError
from cache_service.core.host_tier import MAX_HOST_TIER_BLOCKS, HostTier, TwoTierView
from cache_service.core.restore import RebuiltFromFields
from cache_service.core.single_type_managers import (
    ChunkedLocalAttentionManager,
    CrossAttentionManager,
    FullAttentionManager,
    HitBlocks,
    MambaManager,
    RSWAManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    manager_class_for,
)
from cache_service.core.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SizingLimits,
    SlidingWindowSpec,
    cdiv,
    manager_spec,
    prefix_cacheable,
)

if TYPE_CHECKING:
    from cache_service.core.request import Request


class CoordinatorOptions(TypedDict):
    """The keyword arguments of every coordinator (see :class:`KVCacheCoordinator`)."""

    max_model_len: int
    max_in_flight_tokens: int | None
    enable_caching: bool
    enable_events: bool
    scheduler_block_size: int
    hash_block_size: int


@mypyc_attr(allow_interpreted_subclasses=True)  # unpickled without __init__: restore.py
class KVCacheCoordinator:
    """Fans group operations out to the managers; subclasses define the hit search."""

    #: What lookups probe when not told otherwise: both tiers with a host tier
    #: (host_tier.TwoTierView), else None = the block pool (a class default: coordinators
    #: pickled before tiers existed load without one).
    host_view: CachedBlockLookup | None = None

    def __init__(self, config: KVCacheConfig, *, max_model_len: int,
                 max_in_flight_tokens: int | None, enable_caching: bool, enable_events: bool,
                 scheduler_block_size: int, hash_block_size: int) -> None:
        if scheduler_block_size % hash_block_size or any(
                scheduler_block_size % g.spec.block_size for g in config.groups):
            raise ConfigError(
                f"scheduler_block_size {scheduler_block_size} must be a multiple of "
                f"hash_block_size {hash_block_size} and of every group block size "
                f"{config.block_sizes}", field="scheduler_block_size")
        self.config = config
        self.enable_caching = enable_caching
        self.scheduler_block_size = scheduler_block_size
        self.hash_block_size = hash_block_size
        self.pool = BlockPool(config.num_blocks, enable_caching, hash_block_size,
                              num_groups=len(config.groups), enable_events=enable_events)
        limits = SizingLimits(max_model_len=max_model_len,
                              max_in_flight_tokens=max_in_flight_tokens)
        managers: list[SingleTypeKVCacheManager] = []
        for gid, group in enumerate(config.groups):
            # A uniform-type group (one layer type, several page sizes) runs with its
            # layers' common spec; page sizes do not matter to a manager.
            spec = manager_spec(group.spec)
            cap = None
            if isinstance(spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec)):
                cap = spec.max_admission_blocks(limits)
            if isinstance(spec, MambaSpec) and enable_caching and spec.mamba_cache_mode != "align":
                raise ConfigError("Mamba prefix caching requires mamba_cache_mode='align'",
                                  field="mamba_cache_mode")
            cls = manager_class_for(spec)
            manager = cls(spec, self.pool, gid, enable_caching=enable_caching, admission_cap=cap)
            manager.cache_hit_alignment_tokens = scheduler_block_size
            managers.append(manager)
        self.managers: tuple[SingleTypeKVCacheManager, ...] = tuple(managers)
        self._skipping = tuple(m for m in managers if m.frees_skipped_blocks)
        # R-SWA groups free the gap between the prompt and the decode window instead.
        self._gaps = tuple(m for m in managers if isinstance(m, RSWAManager))
        self.has_skipping_groups = bool(self._skipping) or bool(self._gaps)
        self._stepping = tuple(m for m in managers if isinstance(m, MambaManager))
        self._has_cross = any(type(m) is CrossAttentionManager for m in managers)
        self._caching_managers = tuple(m for m in managers if m.enable_caching)
        # Whether caching may add a partial entry (at the prompt's last hash-block
        # boundary) without hashing a new full block; set by the hybrid coordinator.
        self._tail_entries = False
        # allocation_is_noop runs for every decode token: the managers that keep the base
        # class's check are checked inline there (a call per group was most of its cost).
        base = SingleTypeKVCacheManager.allocation_is_noop
        self._inline_noop = tuple(m for m in managers if type(m).allocation_is_noop is base)
        self._own_noop = tuple(m for m in managers if type(m).allocation_is_noop is not base)
        # Cacheable token counts are rounded down to this (the hybrid hit alignment).
        self._cache_alignment = 1
        #: Hits may end inside blocks (hybrid pools with a coarse Mamba "align" group).
        self.partial_hits = False
        #: See :meth:`configure_retention`.
        self.retention_interval: int | None = None
        #: See :meth:`configure_eagle`.
        self.use_eagle = False
        # EAGLE in a hybrid pool: each group caches up to one of its blocks past the
        # aligned prefix (the block its hits match and drop); see cache_blocks.
        self._eagle_cache = False
        # Tokens past the prompt at which a partial entry may still be due (EAGLE: the
        # whole prompt's last hash-block boundary, not the resend's).
        self._tail_slack = 0
        self.empty_blocks: HitBlocks = tuple([] for _ in managers)  # shared: never mutated
        self.host_view = None  # see configure_host_tier

    def configure_retention(self, retention_interval: int | None) -> None:
        """Set the checkpoint retention of every group (docs/semantics.md#checkpoint-retention).
        None = dense; 0 = sparse; N > 0 (a multiple of the scheduler block size) = sparse
        plus one checkpoint per N tokens, and only for pools with a sliding-window or
        Mamba group (vLLM 0.33 accepts 0 without one: it changes nothing there)."""
        if retention_interval is not None:
            if type(retention_interval) is not int:
                raise ConfigError("prefix_cache_retention_interval must be an integer or "
                                  f"unset, got {retention_interval!r}",
                                  field="prefix_cache_retention_interval")
            sparse_kinds = any(isinstance(m, (SlidingWindowManager, MambaManager))
                               for m in self.managers)
            if retention_interval and not sparse_kinds:
                raise ConfigError(
                    "prefix_cache_retention_interval is set but the pool has no "
                    "sliding-window or Mamba group, so retention has no effect; set it to 0 "
                    "or leave it unset", field="prefix_cache_retention_interval")
            if sparse_kinds and (retention_interval < 0
                                 or retention_interval % self.scheduler_block_size):
                raise ConfigError(
                    f"prefix_cache_retention_interval ({retention_interval}) must be "
                    "non-negative and a multiple of scheduler_block_size "
                    f"({self.scheduler_block_size})", field="prefix_cache_retention_interval")
        self.retention_interval = retention_interval
        for manager in self.managers:
            manager.retention_interval = retention_interval

    def configure_eagle(self, use_eagle: bool) -> None:
        """vLLM 0.33's ``use_eagle`` (docs/semantics.md#eagle): every group's hits drop
        their last matched block (a hash block with partial hits; Mamba keeps its state,
        as draft models have no Mamba layers), and caching and checkpoint retention
        keep the blocks such hits land on. Call before any request is allocated."""
        if type(use_eagle) is not bool:
            raise ConfigError(f"use_eagle must be true or false, got {use_eagle!r}",
                              field="use_eagle")
        if use_eagle and self.enable_caching and any(
                type(m) is ChunkedLocalAttentionManager for m in self.managers):
            raise ConfigError("EAGLE with prefix caching does not support chunked local "
                              "attention (as in vLLM 0.33)", field="use_eagle")
        self.use_eagle = use_eagle
        self._tail_slack = 1 if use_eagle else 0
        self._eagle_cache = use_eagle and isinstance(self, HybridCoordinator) \
            and not self.partial_hits
        for manager in self.managers:
            manager.use_eagle = use_eagle
            manager.eagle_unit = self.scheduler_block_size

    def configure_host_tier(self, host_tier_blocks: Checked[int]) -> None:
        """A host tier of ``host_tier_blocks`` slots per group (docs/semantics.md#host-tier);
        0 = none. Needs prefix caching. Call before any request is allocated."""
        n = host_tier_blocks
        if type(n) is not int or not 0 <= n <= MAX_HOST_TIER_BLOCKS:
            raise ConfigError(f"host_tier_blocks must be an integer in [0, "
                              f"{MAX_HOST_TIER_BLOCKS}], got {n!r}", field="host_tier_blocks")
        if n and not self.enable_caching:
            raise ConfigError("a host tier needs prefix caching (enable_caching)",
                              field="host_tier_blocks")
        if not n:
            self.pool.host_tier = None
            self.host_view = None
            return
        tier = HostTier(n, [m.block_size for m in self.managers], self.pool.enable_events)
        self.pool.host_tier = tier
        self.host_view = TwoTierView(self.pool, tier)

    # -- hits --------------------------------------------------------------------------
    def find_longest_cache_hit(self, block_hashes: Sequence[bytes],
                               max_cache_hit_length: int,
                               source: CachedBlockLookup | None = None
                               ) -> tuple[HitBlocks, int, int]:
        """(hit blocks per group, hit tokens, uncached common-prefix tokens), probing
        ``source`` (None: both tiers with a host tier, else the block pool; pass the
        block pool for a device-only hit)."""
        raise NotImplementedError

    # -- fan-out -----------------------------------------------------------------------
    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: HitBlocks, num_encoder_tokens: int,
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   num_tokens_main_model: int,
                                   apply_admission_cap: bool = False) -> int:
        if not self._has_cross:
            total = 0
            for manager, hit in zip(self.managers, new_computed_blocks):
                total += manager.get_num_blocks_to_allocate(
                    request_id, num_tokens, hit, total_computed_tokens,
                    num_local_computed_tokens, num_tokens_main_model, apply_admission_cap)
            return total
        total = 0
        for manager, hit in zip(self.managers, new_computed_blocks):
            if type(manager) is CrossAttentionManager:
                total += manager.get_num_blocks_to_allocate(
                    request_id, num_encoder_tokens, (), 0, 0, num_encoder_tokens,
                    apply_admission_cap)
            else:
                total += manager.get_num_blocks_to_allocate(
                    request_id, num_tokens, hit, total_computed_tokens,
                    num_local_computed_tokens, num_tokens_main_model, apply_admission_cap)
        return total

    def allocate_new_computed_blocks(self, request_id: str, new_computed_blocks: HitBlocks,
                                     num_local_computed_tokens: int,
                                     num_external_computed_tokens: int) -> None:
        """Pin hits (all groups first), then allocate external-token blocks
        (docs/semantics.md#adopting-hits)."""
        if any(request_id in m.num_cached_block for m in self.managers):
            assert all(len(b) == 0 for b in new_computed_blocks)
            return
        for manager, hit in zip(self.managers, new_computed_blocks):
            manager.add_local_computed_blocks(request_id, hit, num_local_computed_tokens,
                                              num_external_computed_tokens)
        if num_external_computed_tokens > 0:
            for manager in self.managers:
                manager.allocate_external_computed_blocks(
                    request_id, num_local_computed_tokens, num_external_computed_tokens)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int,
                            num_encoder_tokens: int = 0,
                            num_computed_tokens: int | None = None) -> list[list[KVCacheBlock]]:
        """Grow every group's table. ``num_computed_tokens`` (the tokens before this step)
        lets Mamba groups tell a state checkpoint from a stale state."""
        if num_computed_tokens is not None:
            for manager in self._stepping:
                manager.note_step_start(request_id, num_computed_tokens)
        if not self._has_cross:
            return [m.allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
                    for m in self.managers]
        return [m.allocate_new_blocks(request_id, num_encoder_tokens, num_tokens_main_model)
                if type(m) is CrossAttentionManager
                else m.allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
                for m in self.managers]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        n = num_computed_tokens - num_computed_tokens % self._cache_alignment
        if self._eagle_cache:
            for manager in self._caching_managers:
                manager.cache_blocks(request, self._eagle_cacheable(
                    manager, num_computed_tokens, n))
            return
        for manager in self._caching_managers:
            manager.cache_blocks(request, n)

    @staticmethod
    def _eagle_cacheable(manager: SingleTypeKVCacheManager, num_computed_tokens: int,
                         aligned: int) -> int:
        """An EAGLE group's cacheable prefix: the aligned one plus, once there is one,
        up to one more of its blocks (the block an EAGLE hit at ``aligned`` matches
        before dropping it)."""
        if aligned <= 0:
            return aligned
        limit = aligned + manager.block_size
        return num_computed_tokens if num_computed_tokens < limit else limit

    def allocation_is_noop(self, request: Request, num_tokens: int, num_tokens_main_model: int,
                           num_cache_tokens: int) -> bool:
        """True iff ``get_num_blocks_to_allocate`` (no hits, no encoder tokens) would be
        <= 0 in total, ``allocate_new_blocks`` would change nothing and return empty
        lists, and ``cache_blocks(request, num_cache_tokens)`` would hash nothing (pass 0
        when no caching follows). Pure; see the managers' ``allocation_is_noop``."""
        rid = request.request_id
        if self._tail_entries and num_cache_tokens < request.num_prompt_tokens + self._tail_slack:
            # Still in the prompt: a partial entry may be due (it never is after it).
            return False
        if self._eagle_cache:
            return self._eagle_allocation_is_noop(request, num_tokens, num_tokens_main_model,
                                                  num_cache_tokens)
        n = 0
        if num_cache_tokens > 0 and self._caching_managers:
            # What each manager's cache_blocks caps its full-block count with.
            n = num_cache_tokens - num_cache_tokens % self._cache_alignment
            hashed = len(request.block_hashes) * self.hash_block_size
            if n > hashed:
                n = hashed
        for manager in self._inline_noop:  # SingleTypeKVCacheManager.allocation_is_noop
            table = manager.req_to_blocks.get(rid)
            bs = manager.block_size
            if table is None or -(-num_tokens // bs) > len(table):
                return False
            if manager.num_cached_block.get(rid, 0) < n // bs:
                return False
            if manager.partial_hit_reqs and rid in manager.partial_hit_reqs:
                return False
        for manager in self._own_noop:
            if not manager.allocation_is_noop(rid, num_tokens, num_tokens_main_model, n):
                return False
        return True

    def _eagle_allocation_is_noop(self, request: Request, num_tokens: int,
                                  num_tokens_main_model: int, num_cache_tokens: int) -> bool:
        """:meth:`allocation_is_noop` with each group's own cacheable prefix (EAGLE in a
        hybrid pool, see :meth:`cache_blocks`)."""
        rid = request.request_id
        aligned = num_cache_tokens - num_cache_tokens % self._cache_alignment
        hashed = len(request.block_hashes) * self.hash_block_size
        for manager in self.managers:
            n = 0
            if num_cache_tokens > 0 and manager.enable_caching:
                n = self._eagle_cacheable(manager, num_cache_tokens, aligned)
                if n > hashed:
                    n = hashed
            if not manager.allocation_is_noop(rid, num_tokens, num_tokens_main_model, n):
                return False
        return True

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Release the blocks no group needs any more once ``num_computed_tokens`` are
        processed; R-SWA groups free their gap only when given ``num_prompt_tokens``
        (as in vLLM, whose allocations always pass it)."""
        for manager in self._skipping:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)
        if self._gaps and num_prompt_tokens is not None:
            for gap in self._gaps:
                assert isinstance(gap, RSWAManager)
                gap.remove_gap_blocks(request_id, num_computed_tokens, num_prompt_tokens)

    def free(self, request_id: str) -> None:
        for manager in self.managers:
            manager.free(request_id)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Every group's :meth:`SingleTypeKVCacheManager.pop_blocks_for_free`, concatenated
        in group order (still referenced; released later, last first)."""
        blocks: list[KVCacheBlock] = []
        for manager in self.managers:
            blocks.extend(manager.pop_blocks_for_free(request_id))
        return blocks

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(m.req_to_blocks.get(request_id) or [] for m in self.managers)

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """Copies of the request's tables as ids (null = 0); [] for unknown requests."""
        return [ids.copy() if (ids := m.req_to_ids.get(request_id)) else []
                for m in self.managers]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def new_step_starts(self) -> None:
        for manager in self._stepping:
            manager.new_step_starts()


@mypyc_attr(allow_interpreted_subclasses=True)  # unpickled without __init__: restore.py
class NoPrefixCacheCoordinator(KVCacheCoordinator):
    """Caching disabled: never a hit, nothing hashed; works for 0..n groups."""

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes],
                               max_cache_hit_length: int,
                               source: CachedBlockLookup | None = None
                               ) -> tuple[HitBlocks, int, int]:
        return tuple([] for _ in self.managers), 0, 0


@mypyc_attr(allow_interpreted_subclasses=True)  # unpickled without __init__: restore.py
class UnitaryCoordinator(KVCacheCoordinator):
    """Exactly one group with caching (hash block size == block size)."""

    def __init__(self, config: KVCacheConfig, **kwargs: Unpack[CoordinatorOptions]) -> None:
        # Each option by name: mypyc 2.4 passes a forwarded ``**kwargs`` TypedDict wrongly.
        super().__init__(
            config, max_model_len=kwargs["max_model_len"],
            max_in_flight_tokens=kwargs["max_in_flight_tokens"],
            enable_caching=kwargs["enable_caching"], enable_events=kwargs["enable_events"],
            scheduler_block_size=kwargs["scheduler_block_size"],
            hash_block_size=kwargs["hash_block_size"])
        if len(config.groups) != 1:
            raise ConfigError("the unitary coordinator needs exactly one group", field="groups")
        manager = self.managers[0]
        if self.hash_block_size != manager.block_size:
            raise ConfigError(
                f"with one group, hash_block_size ({self.hash_block_size}) must equal the "
                f"block size ({manager.block_size})", field="hash_block_size")
        self._manager = manager
        self._find = type(manager).find_longest_cache_hit
        self._group_ids = [0]

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes],
                               max_cache_hit_length: int,
                               source: CachedBlockLookup | None = None
                               ) -> tuple[HitBlocks, int, int]:
        manager = self._manager
        if source is None:
            source = self.pool if self.host_view is None else self.host_view
        if self.use_eagle:
            blocks, hit = self._find(block_hashes, max_cache_hit_length, self._group_ids,
                                     source, manager.spec, manager.block_size, True)
            return blocks, hit, 0
        blocks, hit = self._find(block_hashes, max_cache_hit_length, self._group_ids, source,
                                 manager.spec, manager.block_size)
        return blocks, hit, 0


@dataclass
class SpecGroup(RebuiltFromFields):
    """Groups with one equal spec (and manager type), looked up jointly."""

    spec: KVCacheSpec  # what the manager runs with (see specs.manager_spec)
    group_ids: list[int]
    manager_cls: type[SingleTypeKVCacheManager]
    group_spec: KVCacheSpec

    @property
    def is_full(self) -> bool:
        return isinstance(self.spec, FullAttentionSpec)


@mypyc_attr(allow_interpreted_subclasses=True)  # unpickled without __init__: restore.py
class HybridCoordinator(KVCacheCoordinator):
    """Two or more groups with caching: the fixed-point hit search of
    docs/semantics.md#hybrid-fixed-point."""

    def __init__(self, config: KVCacheConfig, **kwargs: Unpack[CoordinatorOptions]) -> None:
        # Each option by name: mypyc 2.4 passes a forwarded ``**kwargs`` TypedDict wrongly.
        super().__init__(
            config, max_model_len=kwargs["max_model_len"],
            max_in_flight_tokens=kwargs["max_in_flight_tokens"],
            enable_caching=kwargs["enable_caching"], enable_events=kwargs["enable_events"],
            scheduler_block_size=kwargs["scheduler_block_size"],
            hash_block_size=kwargs["hash_block_size"])
        for m in self.managers:
            if prefix_cacheable(m.spec) and m.block_size % self.hash_block_size:
                raise ConfigError(
                    f"group block size {m.block_size} is not a multiple of hash_block_size "
                    f"{self.hash_block_size}", field="hash_block_size")
        spec_groups: list[SpecGroup] = []
        for gid, manager in enumerate(self.managers):
            if not prefix_cacheable(manager.spec):
                # Per-request scratch (a circular buffer): never hit, so no part of the
                # search; its slot in the hit stays empty.
                continue
            cls = type(manager)
            group_spec = config.groups[gid].spec  # joint lookup needs equal *group* specs
            for sg in spec_groups:
                if sg.group_spec == group_spec and sg.manager_cls is cls:
                    sg.group_ids.append(gid)
                    break
            else:
                spec_groups.append(SpecGroup(manager.spec, [gid], cls, group_spec))
        if not spec_groups:
            raise ConfigError("prefix caching needs at least one group that can be prefix "
                              "cached (a circular buffer cannot)", field="groups")
        # Full attention first (stable): its hit bounds every later search and,
        # being downward closed, never needs a second lookup.
        spec_groups.sort(key=lambda sg: not sg.is_full)
        self.spec_groups = spec_groups
        self.full_attention_group_id = (spec_groups[0].group_ids[0] if spec_groups[0].is_full
                                        else None)
        self._simple = len(spec_groups) == 2 and spec_groups[0].is_full
        hbs = self.hash_block_size
        # Partial hits: a Mamba "align" group coarser than the hash block size, and every
        # group either able to hit inside its blocks or as fine as the hash block size.
        self.partial_hits = any(
            isinstance(m.spec, MambaSpec) and m.spec.mamba_cache_mode == "align"
            and m.block_size > hbs for m in self.managers) and all(
            m.supports_partial_hits or m.block_size == hbs or not prefix_cacheable(m.spec)
            for m in self.managers)
        if self.partial_hits:
            # Hits land on hash-block boundaries; any computed prefix may be hashed
            # (rounding it down would re-key a state block a copy-on-write privatized).
            self._hit_alignment = hbs
            self._cache_alignment = 1
        else:
            # Only scheduler-block-aligned prefixes can ever be hit, so only those are
            # hashed.
            self._hit_alignment = self._cache_alignment = self.scheduler_block_size
        for m in self.managers:
            m.cache_hit_alignment_tokens = self._hit_alignment
        self._tail_entries = self.partial_hits or any(
            type(m) in (FullAttentionManager, MambaManager, RSWAManager) and m.block_size > hbs
            for m in self.managers)

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes],
                               max_cache_hit_length: int,
                               source: CachedBlockLookup | None = None
                               ) -> tuple[HitBlocks, int, int]:
        if source is None:
            source = self.pool if self.host_view is None else self.host_view
        if self.use_eagle:
            return self._find_eagle(block_hashes, max_cache_hit_length, source)
        num_groups = len(self.managers)
        alignment = self._hit_alignment
        hit_length = max_cache_hit_length
        longest = 0
        blocks_by_group: list[list[KVCacheBlock] | None] = [None] * num_groups
        length_by_group = [0] * num_groups
        while True:
            curr = hit_length
            for sg in self.spec_groups:
                first = sg.group_ids[0]
                if sg.is_full and blocks_by_group[first] is not None:
                    # Downward closed: a shorter candidate is still a hit; just clamp.
                    if length_by_group[first] < curr:
                        curr = length_by_group[first]
                    continue
                found, new_len = sg.manager_cls.find_longest_cache_hit(
                    block_hashes, curr, sg.group_ids, source, sg.spec, alignment)
                curr = new_len
                for gid, blocks in zip(sg.group_ids, found):
                    blocks_by_group[gid] = blocks
                    length_by_group[gid] = new_len
                if curr > longest:
                    longest = curr
            if curr >= hit_length:
                break
            hit_length = curr
            if self._simple:
                break
        for sg in self.spec_groups:
            if not sg.is_full:
                continue
            keep = cdiv(hit_length, sg.spec.block_size)
            for gid in sg.group_ids:
                kept = blocks_by_group[gid]
                if kept is not None:
                    del kept[keep:]
        result = tuple(b if b is not None else [] for b in blocks_by_group)
        return result, hit_length, longest - hit_length


    def _find_eagle(self, block_hashes: Sequence[bytes], max_cache_hit_length: int,
                    source: CachedBlockLookup) -> tuple[HitBlocks, int, int]:
        """The fixed point of :meth:`find_longest_cache_hit` with EAGLE: a spec group
        (Mamba aside) looks one drop unit past the candidate (its block, or a hash
        block when it may hit inside blocks) and drops that unit, at most once per
        candidate length; a shrink by a group that did not drop re-arms the drop."""
        num_groups = len(self.managers)
        alignment = self._hit_alignment
        hbs = self.hash_block_size
        limit = len(block_hashes) * hbs
        hit_length = max_cache_hit_length
        longest = 0
        blocks_by_group: list[list[KVCacheBlock] | None] = [None] * num_groups
        length_by_group = [0] * num_groups
        dropped: set[int] = set()
        while True:
            curr = hit_length
            for idx, sg in enumerate(self.spec_groups):
                first = sg.group_ids[0]
                if sg.is_full and blocks_by_group[first] is not None:
                    if length_by_group[first] < curr:
                        curr = length_by_group[first]
                    continue
                drop = idx not in dropped
                max_length = curr
                if drop and not isinstance(sg.spec, MambaSpec):
                    bs = sg.spec.block_size
                    margin = hbs if (self.partial_hits and sg.manager_cls.supports_partial_hits
                                     and bs > hbs) else bs
                    max_length = min(curr + margin, limit)
                found, new_len = sg.manager_cls.find_longest_cache_hit(
                    block_hashes, max_length, sg.group_ids, source, sg.spec, alignment, drop)
                if drop:
                    dropped.add(idx)
                elif new_len < curr:
                    dropped.clear()
                curr = new_len
                for gid, blocks in zip(sg.group_ids, found):
                    blocks_by_group[gid] = blocks
                    length_by_group[gid] = new_len
                if curr > longest:
                    longest = curr
            if curr >= hit_length:
                break
            hit_length = curr
            if self._simple:
                break
        for sg in self.spec_groups:
            if not sg.is_full:
                continue
            keep = cdiv(hit_length, sg.spec.block_size)
            for gid in sg.group_ids:
                kept = blocks_by_group[gid]
                if kept is not None:
                    del kept[keep:]
        result = tuple(b if b is not None else [] for b in blocks_by_group)
        return result, hit_length, longest - hit_length


def make_coordinator(config: KVCacheConfig, *, max_model_len: int,
                     max_in_flight_tokens: int | None, enable_caching: bool,
                     enable_events: bool, scheduler_block_size: int,
                     hash_block_size: int) -> KVCacheCoordinator:
    """NoPrefixCache when caching is off, Unitary for one group, else Hybrid
    (docs/semantics.md#coordinator-selection)."""
    kwargs = CoordinatorOptions(
        max_model_len=max_model_len, max_in_flight_tokens=max_in_flight_tokens,
        enable_caching=enable_caching, enable_events=enable_events,
        scheduler_block_size=scheduler_block_size, hash_block_size=hash_block_size)
    if not enable_caching:
        return NoPrefixCacheCoordinator(config, **kwargs)
    if not config.groups:
        raise ConfigError("prefix caching needs at least one KV-cache group", field="groups")
    for g in config.groups:
        cls = manager_class_for(manager_spec(g.spec))
        if cls is CrossAttentionManager:
            raise ConfigError("cross attention cannot be prefix cached; disable caching",
                              field="enable_caching")
        if cls is ChunkedLocalAttentionManager and g.spec.block_size != scheduler_block_size:
            raise ConfigError("chunked local attention with prefix caching needs its block "
                              "size to equal the scheduler block size", field="groups")
    if len(config.groups) == 1:
        return UnitaryCoordinator(config, **kwargs)
    return HybridCoordinator(config, **kwargs)
