"""The scheduler-facing manager (vLLM ``KVCacheManager``) over :class:`Request` objects
(docs/semantics.md#manager-api).

Call order per scheduler step: ``new_step_starts()``; ``allocate_slots`` for running
requests; for waiting ones ``get_computed_blocks`` immediately followed by
``allocate_slots`` with the hit; the caller then advances ``num_computed_tokens``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mypy_extensions import mypyc_attr

from cache_service.core.block import KVCacheBlock
from cache_service.core.coordinator import KVCacheCoordinator, make_coordinator
from cache_service.core.errors import Checked, ConfigError, InvalidArgument
from cache_service.core.events import BlockStored, KVEvent
from cache_service.core.host_tier import HostTier
from cache_service.core.request import Request, RequestStatus
from cache_service.core.restore import RebuiltFromFields
from cache_service.core.single_type_managers import HitBlocks, MambaManager, hash_view
from cache_service.core.specs import (
    KVCacheConfig,
    MambaSpec,
    SlidingWindowSpec,
    manager_spec,
    prefix_cacheable,
)


def resolve_block_sizes(config: KVCacheConfig, enable_caching: bool,
                        scheduler_block_size: int | None = None,
                        hash_block_size: int | None = None) -> tuple[int, int]:
    """(scheduler, hash) block sizes per docs/semantics.md#block-sizes, unless given explicitly.

    One group: both are its block size. Several: scheduler = lcm of the block sizes;
    hash = gcd with caching on and every Mamba group in "align" mode, else = scheduler.
    """
    for name, value in (("scheduler_block_size", scheduler_block_size),
                        ("hash_block_size", hash_block_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value <= 0):
            raise ConfigError(f"{name} must be a positive integer, got {value!r}", field=name)
    sizes = config.block_sizes
    sched = scheduler_block_size or (math.lcm(*sizes) if sizes else 1)
    non_align_mamba = any(isinstance(s, MambaSpec) and s.mamba_cache_mode != "align"
                          for s in (manager_spec(g.spec) for g in config.groups))
    if len(sizes) == 1:
        default_hash = sizes[0]
    elif len(sizes) > 1 and enable_caching and not non_align_mamba:
        # Only groups that are prefix cached are hashed (not a circular buffer's ring).
        hashed = [g.spec.block_size for g in config.groups if prefix_cacheable(g.spec)]
        default_hash = math.gcd(*(hashed or sizes))
    else:
        default_hash = sched
    return sched, hash_block_size if hash_block_size is not None else default_hash


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy block ``src_block_id``'s data to ``dst_block_id`` in group ``group_id``
    before the forward pass of the step that allocated it (a partial hit's copy-on-write,
    docs/semantics.md#partial-hits-and-copy-on-write)."""

    group_id: int
    src_block_id: int
    dst_block_id: int


@dataclass
class PrefixCacheStats(RebuiltFromFields):
    """Prefix-cache counters recorded at admission; ``preempted_*`` for re-admissions."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    reset: bool = False

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


_ADMISSION_STATES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


@mypyc_attr(allow_interpreted_subclasses=True)  # unpickled without __init__: restore.py
class KVCacheManager:
    """vLLM 0.33's KVCacheManager semantics over one coordinator."""

    #: The block pool's host tier (core/host_tier.py), None = none (a class default:
    #: managers pickled before tiers existed load without one).
    host_tier: HostTier | None = None

    def __init__(self, config: KVCacheConfig, *, max_model_len: int, scheduler_block_size: int,
                 hash_block_size: int, max_in_flight_tokens: int | None = None,
                 enable_caching: bool = True, enable_events: bool = False,
                 watermark: float = 0.0, prefix_cache_retention_interval: int | None = None,
                 enable_mamba_shared_prefix_checkpoint: bool = False,
                 use_eagle: bool = False, host_tier_blocks: Checked[int] = 0,
                 num_hash_lookahead_tokens: int = 0) -> None:
        if watermark < 0:
            raise ConfigError("watermark must be non-negative", field="watermark")
        self.config = config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.coordinator: KVCacheCoordinator = make_coordinator(
            config, max_model_len=max_model_len, max_in_flight_tokens=max_in_flight_tokens,
            enable_caching=enable_caching, enable_events=enable_events,
            scheduler_block_size=scheduler_block_size, hash_block_size=hash_block_size)
        self.coordinator.configure_retention(prefix_cache_retention_interval)
        self.coordinator.configure_eagle(use_eagle)
        self.use_eagle = use_eagle
        self.coordinator.configure_host_tier(host_tier_blocks)
        self.host_tier = self.coordinator.pool.host_tier
        # vLLM narrows the flag to EAGLE pools with partial hits (a junction inside a
        # block is only reachable by a hit that drops back from the block past it);
        # elsewhere it is accepted and has no effect.
        self.enable_mamba_shared_prefix_checkpoint = enable_mamba_shared_prefix_checkpoint
        self.mamba_shared_prefix_checkpoint = (
            enable_mamba_shared_prefix_checkpoint and use_eagle and self.coordinator.partial_hits)
        if self.mamba_shared_prefix_checkpoint:
            for manager in self.coordinator.managers:
                if isinstance(manager, MambaManager):
                    manager.shared_prefix_checkpoint = True
        self.pool = self.coordinator.pool
        # The requests' hashes look this far ahead (they are made by Request); the pool
        # needs it for the events and the Mamba prompt boundary.
        self.pool.hash_lookahead = num_hash_lookahead_tokens
        self.watermark_blocks = int(watermark * config.num_blocks)
        self.empty_blocks: HitBlocks = self.coordinator.empty_blocks
        self.num_groups = len(config.groups)
        self.stats = PrefixCacheStats()
        #: The no-op fast path of allocate_slots; tests turn it off to compare.
        self.fast_path = True
        #: Allocations the fast path answered (tests check that it is taken: a spy on the
        #: no-op check cannot be installed on the compiled core's classes).
        self.fast_path_answers = 0
        #: Set when allocate_slots answered None because of ``max_new_blocks``.
        self.refused_by_quota = False
        #: Whether allocations may queue block copies (partial hits are on).
        self.partial_hits = self.coordinator.partial_hits
        # Both ends of every copy taken by take_block_copies, until the copies have run.
        self._copied_blocks: list[KVCacheBlock] = []
        specs = [manager_spec(g.spec) for g in config.groups]
        self._event_metadata = [
            (s.kind, s.sliding_window if isinstance(s, SlidingWindowSpec) else None) for s in specs]

    # -- lookup ------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request, max_cache_hit_length: int | None = None
                            ) -> tuple[HitBlocks, int, int]:
        """(hit blocks per group, hit tokens, shared-prefix boundary). Takes no
        references. The hit is capped at ``num_tokens - 1``: the last token is always
        recomputed to produce logits."""
        if not self.enable_caching:
            return self.empty_blocks, 0, 0
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1
        blocks, hit, uncached = self.coordinator.find_longest_cache_hit(
            request.block_hashes, max_cache_hit_length)
        boundary = hit + uncached if uncached else 0
        if not any(blocks):
            blocks = self.empty_blocks
        return blocks, hit, boundary

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        if self.enable_caching:
            self.stats.record(request.num_tokens, num_hits, request.num_preemptions > 0)

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The accumulated stats, resetting them."""
        stats, self.stats = self.stats, PrefixCacheStats()
        return stats

    # -- allocation --------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: HitBlocks | None = None,
                       num_lookahead_tokens: int = 0, num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False, num_encoder_tokens: int = 0,
                       full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                       has_scheduled_reqs: bool = True, max_new_blocks: int | None = None
                       ) -> list[list[KVCacheBlock]] | None:
        """Slots for ``num_new_tokens`` (+ lookahead) after the computed and hit tokens.
        Returns the newly allocated blocks per group, or None when they do not fit
        (then nothing was pinned or allocated, though out-of-window blocks may have been
        released). ``max_new_blocks``: a quota; needing more blocks than that is "no room"
        too, and sets ``refused_by_quota``.

        Fast path (a running request's decode step). It applies when there are no
        hits, lookahead, external or encoder tokens, no reserve and no watermark. The
        out-of-window blocks (sliding window, chunked local, Mamba: retired blocks and
        the previous state block) are first released by the unchanged
        ``remove_skipped_blocks`` call, as on the general path. Then, if every group's
        table already covers the slots (Mamba align: ``cdiv(main, bs) + speculative``
        blocks, and the request is in ``allocated_reqs``) and caching would hash no new
        full block, the rest of the general path is provably inert: each group counts
        <= 0 blocks, so the request fits (``needed <= 0 <= free``); no hits are adopted;
        ``allocate_new_blocks`` appends nothing (Mamba align: no state-index or
        speculative-block moves, which only happen when the table grows); and
        ``cache_blocks`` returns before hashing (so no events, no Mamba
        ``cached_this_step`` entries). The only effect left is the result, one empty
        list per group, which the fast path returns (see ``allocation_is_noop``)."""
        if num_new_tokens == 0 and num_external_computed_tokens == 0 \
                and num_new_computed_tokens == 0:
            raise InvalidArgument("num_new_tokens must be greater than 0 when there are no "
                                  "computed tokens to adopt", field="num_new_tokens")
        coordinator = self.coordinator
        hits = self.empty_blocks if new_computed_blocks is None else new_computed_blocks
        rid = request.request_id
        num_local = request.num_computed_tokens + num_new_computed_tokens
        total_computed = num_local + num_external_computed_tokens
        if total_computed > self.max_model_len:
            total_computed = self.max_model_len
        watermark = self.watermark_blocks if (
            has_scheduled_reqs and request.status in _ADMISSION_STATES) else 0
        free = self.pool.free_block_queue
        if full_sequence_must_fit:
            full = min(len(request.all_token_ids), self.max_model_len)
            needed = coordinator.get_num_blocks_to_allocate(
                rid, full, hits, num_encoder_tokens, total_computed, num_local, full,
                apply_admission_cap=True)
            if needed + watermark > free.num_free_blocks:
                return None
            if max_new_blocks is not None and needed > max_new_blocks:
                self.refused_by_quota = True
                return None
        main = total_computed + num_new_tokens
        need_slots = main + num_lookahead_tokens
        if need_slots > self.max_model_len:
            need_slots = self.max_model_len
        if coordinator.has_skipping_groups:
            processed = total_computed - request.num_in_flight_tokens
            coordinator.remove_skipped_blocks(rid, processed if processed > 0 else 0,
                                              request.num_prompt_tokens)
        if (self.fast_path and hits is self.empty_blocks and num_new_computed_tokens == 0
                and num_lookahead_tokens == 0 and num_external_computed_tokens == 0
                and num_encoder_tokens == 0 and reserved_blocks == 0 and watermark == 0):
            n_cache = 0
            if not delay_cache_blocks and self.enable_caching:
                n_cache = min(main, len(request.all_token_ids))
            if coordinator.allocation_is_noop(request, need_slots, main, n_cache):
                self.fast_path_answers += 1
                return [[] for _ in range(self.num_groups)]
        return self._grow(request, num_new_tokens, hits, num_local,
                          num_external_computed_tokens, num_encoder_tokens, need_slots, main,
                          total_computed, watermark + reserved_blocks, max_new_blocks,
                          delay_cache_blocks)

    def decode_slot(self, request: Request) -> Sequence[Sequence[KVCacheBlock]] | None:
        """``allocate_slots(request, 1)`` of a RUNNING request (the decode step's one new
        slot): the same effects and answer, except that the usual no-op answer is ``()``
        rather than one empty list per group (both are falsy to ``any``). Its arguments
        are folded in: a RUNNING request has no watermark, hits, lookahead, external or
        encoder tokens, reserve or quota."""
        coordinator = self.coordinator
        max_len = self.max_model_len
        total_computed = request.num_computed_tokens
        if total_computed > max_len:
            total_computed = max_len
        main = total_computed + 1
        need_slots = main if main <= max_len else max_len
        if coordinator.has_skipping_groups:
            processed = total_computed - request.num_in_flight_tokens
            coordinator.remove_skipped_blocks(request.request_id,
                                              processed if processed > 0 else 0,
                                              request.num_prompt_tokens)
        if self.fast_path:
            n_cache = 0
            if self.enable_caching:
                num_tokens = len(request.all_token_ids)
                n_cache = main if main < num_tokens else num_tokens
            if coordinator.allocation_is_noop(request, need_slots, main, n_cache):
                self.fast_path_answers += 1
                return ()
        return self._grow(request, 1, self.empty_blocks, request.num_computed_tokens, 0, 0,
                          need_slots, main, total_computed, 0, None, False)

    def decode_batch(self, requests: list[Request], token_ids: list[int] | None, lo: int,
                     hi: int, ok: list[bool], grown: dict[int, list[list[int]]],
                     copies: list[BlockCopy]) -> tuple[int, int]:
        """The decode steps of ``requests[lo:hi]`` in order, in one call (the loop of
        ``Pool.decode`` for RUNNING requests): each appends ``token_ids[i]`` (a placeholder
        when ``token_ids`` is None), takes :meth:`decode_slot` and, when that fits, one more
        computed token. Answers go into ``ok[i]`` (set False: no room, nothing allocated),
        ``grown[i]`` (the new block ids per group, only for a request that got some) and
        ``copies`` (partial hits' copies, in order). Stops before the first request that is
        not RUNNING with computed tokens (its token not appended: the caller takes it the
        general way, then calls again after it). Answers (the index it stopped at, ``hi``
        when all were done; the number of requests that got no room)."""
        running = RequestStatus.RUNNING
        partial = self.partial_hits
        failures = 0
        i = lo
        while i < hi:
            req = requests[i]
            if req.status != running or not req.num_computed_tokens:
                break
            if token_ids is None:
                req.num_placeholders += 1
            else:
                req.append_token(token_ids[i])
            new = self.decode_slot(req)
            if new is None:
                failures += 1
                ok[i] = False
            else:
                req.num_computed_tokens += 1
                if new and any(new):
                    grown[i] = [[b.block_id for b in g] for g in new]
                if partial:
                    # A copy may come without a new block in the table (see MambaManager).
                    copies.extend(self.take_block_copies())
            i += 1
        return i, failures

    def _grow(self, request: Request, num_new_tokens: int, hits: HitBlocks, num_local: int,
              num_external_computed_tokens: int, num_encoder_tokens: int, need_slots: int,
              main: int, total_computed: int, keep_free: int, max_new_blocks: int | None,
              delay_cache_blocks: bool) -> list[list[KVCacheBlock]] | None:
        """The general path of :meth:`allocate_slots` once out-of-window blocks are
        released: count, check room (``keep_free``: watermark + reserve), pin hits,
        grow the tables, cache the full blocks."""
        coordinator = self.coordinator
        rid = request.request_id
        needed = coordinator.get_num_blocks_to_allocate(
            rid, need_slots, hits, num_encoder_tokens,
            num_local + num_external_computed_tokens, num_local, main)
        if needed + keep_free > self.pool.free_block_queue.num_free_blocks:
            return None
        if max_new_blocks is not None and needed > max_new_blocks:
            self.refused_by_quota = True
            return None
        if hits is not self.empty_blocks or num_external_computed_tokens > 0:
            if self.host_tier is not None and hits is not self.empty_blocks:
                self._adopt_with_promotions(request, hits, num_local,
                                            num_external_computed_tokens)
            else:
                coordinator.allocate_new_computed_blocks(rid, hits, num_local,
                                                         num_external_computed_tokens)
        new_blocks = coordinator.allocate_new_blocks(rid, need_slots, main, num_encoder_tokens,
                                                     total_computed)
        if delay_cache_blocks or not self.enable_caching:
            return new_blocks
        n_cache = total_computed + num_new_tokens
        num_tokens = len(request.all_token_ids)
        if n_cache > num_tokens:
            n_cache = num_tokens  # draft tokens beyond the sequence are never cached
        coordinator.cache_blocks(request, n_cache)
        return new_blocks

    def _adopt_with_promotions(self, request: Request, hits: HitBlocks, num_local: int,
                               num_external: int) -> None:
        """``allocate_new_computed_blocks`` of hits that may hold host placeholders
        (block id < 0), after the room check passed: each placeholder the request keeps
        is promoted into a fresh device block that takes its key.

        Invariant relied on: the room check counted every kept placeholder and every
        free device hit as one free block to take (``ref_cnt == 0``), so the touches and
        pops below take exactly that many blocks and ``allocate_new_blocks`` still finds
        the rest. Order: the placeholders' slots are reserved (the pops below may demote
        other blocks, never into them), the device hits are touched (popping fresh blocks
        cannot evict a hit that sits in the free queue), then one block per placeholder is
        popped and keyed. ``allocate_new_computed_blocks`` then touches every kept block
        once more, so our own references are dropped afterwards: device hits end with the
        request's reference, promoted blocks with exactly one (the request's)."""
        tier = self.host_tier
        assert tier is not None
        rid = request.request_id
        coordinator = self.coordinator
        pool = self.pool
        total = num_local + num_external
        targets: list[tuple[int, int, KVCacheBlock]] = []
        device: list[KVCacheBlock] = []
        if not any(rid in m.num_cached_block for m in coordinator.managers):
            for gid, (manager, hit) in enumerate(zip(coordinator.managers, hits)):
                # The blocks add_local_computed_blocks keeps (it skips out-of-window ones).
                skipped = manager.get_num_skipped_tokens(total) // manager.block_size
                for idx in range(max(skipped, 0), len(hit)):
                    block = hit[idx]
                    if block.block_id < 0:
                        assert tier.is_live(block), "a stale host placeholder in a hit"
                        targets.append((gid, idx, block))
                    elif not block.is_null:
                        device.append(block)
        if not targets:
            coordinator.allocate_new_computed_blocks(rid, hits, num_local, num_external)
            return
        for _, _, placeholder in targets:
            tier.reserve(placeholder)
        pool.touch(device)
        fresh = pool.get_new_blocks(len(targets))
        adopted = tuple(list(hit) for hit in hits)
        events = pool.enable_events
        for (gid, idx, placeholder), block in zip(targets, fresh):
            key = placeholder.block_hash
            assert key is not None
            pool._insert_key(key, gid, block, placeholder.hash_num_tokens)
            adopted[gid][idx] = block
            tier.promoted(placeholder, block)
            if events:
                # The key is cached on the device again: announced as caching it would.
                pool.events.append(self._promoted_event(request, gid, placeholder))
        coordinator.allocate_new_computed_blocks(rid, adopted, num_local, num_external)
        # Our references: every device hit's touch above and every promoted block's pop.
        pool.free_blocks(device + fresh)

    def _promoted_event(self, request: Request, gid: int,
                        placeholder: KVCacheBlock) -> BlockStored:
        """The BlockStored (medium GPU) of a promoted block: the one block the request's
        caching would have announced for its key (a partial entry: the hash block that
        ends at its boundary, as ``cache_partial_block`` announces it)."""
        pool = self.pool
        bs = self.coordinator.managers[gid].block_size
        hbs = pool.hash_block_size
        num_tokens = placeholder.hash_num_tokens or 0
        if num_tokens % bs == 0:
            i = num_tokens // bs - 1
            view = hash_view(request.block_hashes, hbs, bs)
            return pool._stored_event(request, view, [i], i, i + 1, bs, gid)
        n = num_tokens // hbs
        return pool._stored_event(request, request.block_hashes, [n - 1], n - 1, n, hbs, gid)

    def take_block_copies(self) -> list[BlockCopy]:
        """The copies queued by allocations since the last call, in order. Their source
        and destination blocks stay referenced until ``release_copied_blocks``."""
        copies: list[BlockCopy] = []
        if not self.partial_hits:
            return copies
        for manager in self.coordinator.managers:
            if manager.pending_copies:
                for source, copy in manager.take_pending_copies():
                    copies.append(BlockCopy(manager.group_id, source.block_id, copy.block_id))
                    self._copied_blocks += (source, copy)
        return copies

    def release_copied_blocks(self) -> None:
        """The copies taken so far have run (the caller's step is over): drop the
        references that kept their blocks from being reused."""
        if self._copied_blocks:
            blocks, self._copied_blocks = self._copied_blocks, []
            self.pool.free_blocks(blocks)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Explicit caching (after a delayed allocation's data arrived)."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def free(self, request: Request) -> None:
        """Free every group's blocks, tail first; cached ones stay hittable."""
        self.coordinator.free(request.request_id)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """vLLM's deferred free (docs/semantics.md#manager-surface): forget the request's
        tables now and hand back its blocks, every group's table without its leading nulls,
        concatenated in group order and still referenced. The caller releases them later
        with ``pool.free_blocks(reversed(blocks))``, so the last group's tail is evicted
        first (``free`` releases group by group instead)."""
        return self.coordinator.pop_blocks_for_free(request.request_id)

    def truncate_computed_blocks(self, blocks: HitBlocks, num_computed_tokens: int) -> HitBlocks:
        """A lookup's hit blocks cut at ``num_computed_tokens`` (vLLM's
        ``truncate_computed_blocks``, for when a connector supplies the tokens past that
        point): each group keeps ``num_computed_tokens // block_size`` blocks, which must
        divide evenly and, except for Mamba (whose last state may come from the connector),
        not exceed what it has; groups that are never cached stay empty. Pure: no reference
        is taken or dropped and ``blocks`` is not changed."""
        out: list[list[KVCacheBlock]] = []
        for manager, group in zip(self.coordinator.managers, blocks):
            if not prefix_cacheable(manager.spec):
                if group:
                    raise InvalidArgument("a group that is never cached has no hit blocks",
                                          field="blocks")
                out.append([])
                continue
            bs = manager.block_size
            if num_computed_tokens < 0 or num_computed_tokens % bs:
                raise InvalidArgument(
                    f"num_computed_tokens {num_computed_tokens} is not a multiple of group "
                    f"{manager.group_id}'s block size {bs}", field="num_computed_tokens")
            n = num_computed_tokens // bs
            if isinstance(manager, MambaManager):
                n = min(n, len(group))
            elif n > len(group):
                raise InvalidArgument(
                    f"group {manager.group_id} has {len(group)} hit blocks, fewer than "
                    f"{n}", field="num_computed_tokens")
            out.append(list(group[:n]))
        result = tuple(out)
        return result if any(result) else self.empty_blocks

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        self.coordinator.remove_skipped_blocks(request_id, num_computed_tokens)

    def new_step_starts(self) -> None:
        self.coordinator.new_step_starts()

    # -- queries -----------------------------------------------------------------------
    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return self.coordinator.get_blocks(request_id)

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        return self.coordinator.get_block_ids(request_id)

    @property
    def usage(self) -> float:
        return self.pool.get_usage()

    # -- cache maintenance -------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        if not self.coordinator.reset_prefix_cache():
            return False
        self.stats.reset = True
        return True

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self.pool.evict_blocks(block_ids)

    def take_events(self) -> list[KVEvent]:
        """Queued events, with each BlockStored annotated by its group's spec."""
        events = self.pool.take_events()
        meta = self._event_metadata
        for event in events:
            if type(event) is BlockStored and 0 <= event.group_idx < len(meta):
                event.spec_kind, event.sliding_window = meta[event.group_idx]
        return events
