"""The facade the gRPC service and the replay tool use: one KV-cache pool.

A :class:`Pool` is one :class:`KVCacheManager` (one coordinator, one block pool) plus a
registry of requests by id. Requests change only through :meth:`Pool.apply_batch`: a batch
of typed ops (:mod:`ops`) validated whole by :mod:`batch` before any op is applied (the
single-op methods are batches of one). Every method validates its whole input before it
changes anything: bad input raises a :mod:`errors` exception and leaves the pool as it was.
"No room" is a normal answer (``Allocation.ok == False``), never an exception.

Semantics follow vLLM 0.33 (docs/semantics.md). Two pool-level rules:

* ``lookup`` remembers its hit for the request's next ``allocate``. If the pool's
  blocks changed in between (another allocate, free, preempt, reset or eviction), the
  remembered blocks may have been reused, so ``allocate`` looks the prefix up again
  instead of pinning stale blocks.
* On a successful ``allocate`` the request's computed tokens advance by hit + new
  tokens, and its first allocation (after ``add`` or ``preempt``) records
  prefix-cache statistics.

With partial hits (docs/semantics.md#partial-hits-and-copy-on-write) an allocation may
answer block copies the caller must run before the step's forward pass; their blocks
stay referenced until the batch that queued them ends.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

from mypy_extensions import mypyc_attr

from cache_service.core.batch import (
    BatchCheck,
    BatchLimits,
    check_batch,
    check_batch_in_slices,
    check_int,
)
from cache_service.core.errors import (
    Checked,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    UnknownRequest,
)
from cache_service.core.events import KVEvent
from cache_service.core.eviction_classes import ClassedFreeQueue
from cache_service.core.hashing import (
    DeclaredRecipe,
    HashRecipe,
    check_declared_recipe,
    get_hash_fn,
    none_hash,
    none_hash_seed,
)
from cache_service.core.host_tier import TierCopy
from cache_service.core.invariants import check_pool_invariants
from cache_service.core.kv_cache_manager import BlockCopy, KVCacheManager, resolve_block_sizes
from cache_service.core.operations import (
    AddRequest,
    Allocate,
    AppendTokens,
    Decode,
    FillPlaceholders,
    Free,
    Lookup,
    Op,
    OpOutcome,
    Preempt,
    ResetHostTierOp,
    op_cost,
)
from cache_service.core.peek import PeekInput, PrefixPeek, hash_in_slices, probe_keys
from cache_service.core.pins import PinInfo, PinTable, default_cap
from cache_service.core.quota import BlockQuota
from cache_service.core.release_hints import evict_first
from cache_service.core.request import Request, RequestStatus
from cache_service.core.residency import ExtraKeys, GroupResidency, PrefixLog, Residency
from cache_service.core.restore import RebuiltFromFields
from cache_service.core.single_type_managers import HitBlocks
from cache_service.core.slices import run_to_end
from cache_service.core.specs import KVCacheConfig

_TOKEN_LIMIT = 2**31


@dataclass(frozen=True)
class PoolOptions(RebuiltFromFields):
    """Pool-wide settings. ``scheduler_block_size`` / ``hash_block_size`` None = the
    rules of docs/semantics.md#block-sizes. ``vocab_size`` None accepts token ids in [0, 2**31)."""

    max_model_len: int
    enable_caching: bool = True
    hash_algo: str = "sha256"  # "sha256" | "sha256_cbor"
    scheduler_block_size: int | None = None
    hash_block_size: int | None = None
    watermark: float = 0.0
    max_in_flight_tokens: int | None = None
    enable_events: bool = True
    vocab_size: int | None = None
    #: Most blocks the requests of one account may hold (see :mod:`quota`); None = none.
    account_block_quota: int | None = None
    #: Sliding-window / Mamba checkpoint retention (docs/semantics.md#checkpoint-retention):
    #: None = dense (every eligible checkpoint; the default here, see the doc for why),
    #: 0 = sparse (vLLM 0.33's engine default), N = sparse plus one every N tokens.
    prefix_cache_retention_interval: int | None = None
    #: vLLM's ``enable_mamba_shared_prefix_checkpoint`` (effective only with EAGLE and
    #: partial hits).
    enable_mamba_shared_prefix_checkpoint: bool = False
    #: Prefix pins (:mod:`pins`): the most blocks all pins may hold (None = the usable
    #: blocks less one ``max_model_len`` request's worst case) and one account's pins.
    max_pinned_blocks: int | None = None
    pinned_block_quota: int | None = None
    #: vLLM's ``use_eagle`` (docs/semantics.md#eagle): hits drop their last block for
    #: the drafter, checkpoints are kept where such hits land. False = off.
    use_eagle: bool = False
    #: Host-tier slots per KV-cache group (docs/semantics.md#host-tier); 0 = no tier.
    host_tier_blocks: Checked[int] = 0
    #: vLLM's ``num_hash_lookahead_tokens`` (docs/hashing.md#lookahead): each block hash
    #: also covers the L tokens after the block, and exists once they do. 0 = off.
    #: Needs prefix caching; excludes ``use_eagle`` (vLLM's scheduler turns the EAGLE
    #: block drop off when its hashes look ahead).
    num_hash_lookahead_tokens: int = 0


@dataclass(slots=True)
class RequestInfo:
    request_id: str
    num_tokens: int
    num_computed_tokens: int
    num_block_hashes: int
    status: str
    num_preemptions: int
    #: Of ``num_tokens``, the trailing ones whose ids are not known yet.
    num_placeholder_tokens: int = 0

    # Written out, as on the other results built per call (batch.Simulated says why).
    def __init__(self, request_id: str, num_tokens: int, num_computed_tokens: int,
                 num_block_hashes: int, status: str, num_preemptions: int,
                 num_placeholder_tokens: int = 0) -> None:
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.num_computed_tokens = num_computed_tokens
        self.num_block_hashes = num_block_hashes
        self.status = status
        self.num_preemptions = num_preemptions
        self.num_placeholder_tokens = num_placeholder_tokens


@dataclass(slots=True)
class PrefixHit:
    """The longest usable prefix hit; ``block_ids`` per group (null block = 0)."""

    hit_tokens: int
    block_ids: list[list[int]]
    shared_prefix_boundary: int = 0
    #: Per-group reach and miss reason; only when the lookup was asked to explain.
    groups: list[GroupResidency] | None = None
    #: The hit across both tiers (docs/semantics.md#host-tier): a lookup's hit already
    #: counts host slots (block id -1 in ``block_ids``), so this equals ``hit_tokens``.
    host_hit_tokens: int = 0

    def __init__(self, hit_tokens: int, block_ids: list[list[int]],
                 shared_prefix_boundary: int = 0,
                 groups: list[GroupResidency] | None = None,
                 host_hit_tokens: int = 0) -> None:
        self.hit_tokens = hit_tokens
        self.block_ids = block_ids
        self.shared_prefix_boundary = shared_prefix_boundary
        self.groups = groups
        self.host_hit_tokens = host_hit_tokens


@dataclass(slots=True)
class Allocation:
    """``new_block_ids`` (None when not ok): blocks added by this call, per group;
    ``block_ids``: the request's whole table per group after the call (None when the
    caller asked for no tables: copying long tables dominates the cost of a decode step)."""

    ok: bool
    new_block_ids: list[list[int]] | None
    block_ids: list[list[int]] | None
    num_computed_tokens: int
    hit_tokens_used: int = 0
    #: Copies to run before this step's forward pass (partial hits), in order.
    block_copies: list[BlockCopy] = field(default_factory=list)

    def __init__(self, ok: bool, new_block_ids: list[list[int]] | None,
                 block_ids: list[list[int]] | None, num_computed_tokens: int,
                 hit_tokens_used: int = 0, block_copies: list[BlockCopy] | None = None
                 ) -> None:
        self.ok = ok
        self.new_block_ids = new_block_ids
        self.block_ids = block_ids
        self.num_computed_tokens = num_computed_tokens
        self.hit_tokens_used = hit_tokens_used
        self.block_copies = [] if block_copies is None else block_copies


@dataclass(slots=True)
class DecodeOutcome:
    """Outcome of :meth:`Pool.decode`. ``ok[i]`` answers ``request_ids[i]`` (False = no
    room: nothing allocated for it). ``new_block_ids`` maps the index of every request that
    got at least one new block to its new blocks per group; most decode steps add none,
    so it is usually small (no per-request objects are built for the others)."""

    ok: list[bool]
    new_block_ids: dict[int, list[list[int]]]
    #: Copies to run before this step's forward pass (partial hits), in order.
    block_copies: list[BlockCopy] = field(default_factory=list)

    def __init__(self, ok: list[bool], new_block_ids: dict[int, list[list[int]]],
                 block_copies: list[BlockCopy] | None = None) -> None:
        self.ok = ok
        self.new_block_ids = new_block_ids
        self.block_copies = [] if block_copies is None else block_copies


@dataclass(slots=True)
class PoolCounters:
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    usage: float
    prefix_queries: int
    prefix_hits: int
    prefix_requests: int
    preempted_prefix_queries: int
    preempted_prefix_hits: int
    preempted_prefix_requests: int
    evictions: int
    allocation_failures: int
    preemptions: int
    num_requests: int
    num_cached_blocks_per_group: list[int] = field(default_factory=list)
    #: The account block quota (0 = none), allocations it refused, the largest usage.
    account_block_quota: int = 0
    quota_refusals: int = 0
    max_account_blocks: int = 0
    #: (group index, miss reason) -> explained lookups that answered it.
    miss_reasons: dict[tuple[int, str], int] = field(default_factory=dict)
    #: Prefix pins (:mod:`pins`): distinct pinned blocks, their bound, live pins, pins
    #: refused by a bound, and the blocks charged per account.
    num_pinned_blocks: int = 0
    max_pinned_blocks: int = 0
    num_pins: int = 0
    pin_refusals: int = 0
    pinned_blocks_by_account: dict[str, int] = field(default_factory=dict)
    #: The host tier (core/host_tier.py): slots per group (0 = none), slots in use
    #: (summed over groups), demotions and promotions planned, entries dropped.
    host_tier_blocks: int = 0
    host_tier_used_blocks: int = 0
    host_demotions: int = 0
    host_promotions: int = 0
    host_evictions: int = 0


class PreparedBatch:
    """A validated batch (:meth:`Pool.prepare_batch`) waiting to be applied once."""

    __slots__ = ("_pool", "_ops", "_plan", "_begin_step")

    def __init__(self, pool: Pool, ops: Sequence[Op], plan: list[Any],
                 begin_step: bool) -> None:
        self._pool, self._ops, self._plan, self._begin_step = pool, ops, plan, begin_step

    def apply(self) -> list[OpOutcome]:
        """Applies the batch (cannot fail); one outcome per op."""
        pool = self._pool
        if pool._manager.host_tier is not None:
            pool._manager.host_tier.begin_batch()
        if self._begin_step:
            pool._manager.new_step_starts()
        apply = pool._apply
        outcomes = [apply(op, prepared) for op, prepared in zip(self._ops, self._plan)]
        pool._manager.release_copied_blocks()
        if pool._pins is not None:
            pool._pins_after_batch()
        return outcomes

    def apply_in_slices(self, slice_cost: int) -> Generator[None, None, list[OpOutcome]]:
        """:meth:`apply` cut into slices of about ``slice_cost`` units of work
        (:func:`ops.op_cost`; a decode op naming more requests is cut too), yielding
        between them; the generator returns the outcomes. The end state and outcomes are
        exactly :meth:`apply`'s, provided nothing else touches this pool between the slices
        (the caller's duty)."""
        pool = self._pool
        if pool._manager.host_tier is not None:
            pool._manager.host_tier.begin_batch()
        if self._begin_step:
            pool._manager.new_step_starts()
        apply = pool._apply
        outcomes: list[OpOutcome] = []
        spent = 0
        for op, prepared in zip(self._ops, self._plan):
            if type(op) is Decode and len(op.request_ids) > slice_cost:
                outcome = yield from pool._decode_in_slices(op, prepared, slice_cost)
                outcomes.append(outcome)
                spent = 0
                continue
            outcomes.append(apply(op, prepared))
            spent += op_cost(op.KIND, op)
            if spent >= slice_cost:
                spent = 0
                yield
        pool._manager.release_copied_blocks()
        if pool._pins is not None:
            pool._pins_after_batch()
        return outcomes


@mypyc_attr(allow_interpreted_subclasses=True)  # unpickled without __init__: restore.py
class Pool:
    """One KV-cache pool: a coordinator and a registry of requests by id."""

    #: The pin table, made on the first pin (a class default, so that pools pickled before
    #: pins existed load without one).
    _pins: PinTable | None = None
    #: Request id -> eviction class (classes > 0), from the first request with one on
    #: (core/eviction_classes.py); None while the pool has seen none.
    _classes: dict[str, int] | None = None

    def __init__(self, config: KVCacheConfig, options: PoolOptions) -> None:
        check_int(options.max_model_len, "max_model_len", minimum=1)
        check_int(config.num_blocks, "num_blocks", minimum=1)
        if options.vocab_size is not None:
            check_int(options.vocab_size, "vocab_size", minimum=1)
        if options.max_in_flight_tokens is not None:
            check_int(options.max_in_flight_tokens, "max_in_flight_tokens", minimum=1)
        if not 0.0 <= options.watermark < 1.0:
            raise InvalidArgument(f"watermark must be in [0, 1), got {options.watermark!r}",
                                  field="watermark")
        hash_fn = get_hash_fn(options.hash_algo)
        lookahead = check_int(options.num_hash_lookahead_tokens, "num_hash_lookahead_tokens",
                              minimum=0, maximum=options.max_model_len)
        if lookahead and not options.enable_caching:
            raise InvalidArgument("num_hash_lookahead_tokens needs prefix caching (vLLM "
                                  "hashes nothing without it)",
                                  field="num_hash_lookahead_tokens")
        if lookahead and options.use_eagle:
            raise InvalidArgument("num_hash_lookahead_tokens excludes use_eagle: vLLM's "
                                  "lookahead hashes replace the EAGLE block drop",
                                  field="num_hash_lookahead_tokens")
        self._lookahead = lookahead
        sched, hbs = resolve_block_sizes(config, options.enable_caching,
                                         options.scheduler_block_size, options.hash_block_size)
        self._config = config
        self._options = options
        self._sched = sched
        self._hbs = hbs
        self._hash_fn = hash_fn if options.enable_caching else None
        # Tokens one allocate may compute (the chunked-prefill budget the sliding-window and
        # chunked-local admission caps were sized with).
        self._max_new_tokens = min(options.max_in_flight_tokens or options.max_model_len,
                                   options.max_model_len)
        self._recipe = HashRecipe(options.hash_algo, none_hash_seed(), none_hash(hash_fn), hbs,
                                  lookahead)
        self._limits = BatchLimits(
            max_model_len=options.max_model_len,
            token_limit=options.vocab_size if options.vocab_size is not None else _TOKEN_LIMIT,
            hash_block_size=hbs, digest_size=len(hash_fn(b"")),
            enable_caching=options.enable_caching, max_new_tokens=self._max_new_tokens,
            recipe=self._recipe)
        self._manager = KVCacheManager(
            config, max_model_len=options.max_model_len, scheduler_block_size=sched,
            hash_block_size=hbs, max_in_flight_tokens=options.max_in_flight_tokens,
            enable_caching=options.enable_caching, enable_events=options.enable_events,
            watermark=options.watermark,
            prefix_cache_retention_interval=options.prefix_cache_retention_interval,
            enable_mamba_shared_prefix_checkpoint=options.enable_mamba_shared_prefix_checkpoint,
            use_eagle=options.use_eagle, host_tier_blocks=options.host_tier_blocks,
            num_hash_lookahead_tokens=lookahead)
        self._requests: dict[str, Request] = {}
        if options.account_block_quota is not None:
            check_int(options.account_block_quota, "account_block_quota", minimum=1)
        if options.max_pinned_blocks is not None:
            check_int(options.max_pinned_blocks, "max_pinned_blocks", minimum=0)
        if options.pinned_block_quota is not None:
            check_int(options.pinned_block_quota, "pinned_block_quota", minimum=1)
        self._quota = (BlockQuota(options.account_block_quota)
                       if options.account_block_quota is not None else None)
        self._table_ids = self._manager.coordinator.get_block_ids
        # request id -> (hit blocks, hit tokens, epoch of the lookup)
        self._pending: dict[str, tuple[HitBlocks, int, int]] = {}
        self._epoch = 0  # bumped by every operation that may reuse or unpin blocks
        self._allocation_failures = 0
        self._preemptions = 0
        # Follows the prefix-cache map: recently removed keys and extra-key combinations
        # for miss reasons; the routing index attaches its bits here.
        self._log = PrefixLog(len(config.groups))
        if options.enable_caching:
            self._manager.pool.observer = self._log
        self._peek = PrefixPeek(self._manager, self._limits, self._hash_fn, self._log)
        # Made on the first pin: a pool without pins pays one None check per batch.
        self._pins: PinTable | None = None

    # -- properties ----------------------------------------------------------------------
    @property
    def config(self) -> KVCacheConfig:
        return self._config

    @property
    def options(self) -> PoolOptions:
        return self._options

    @property
    def scheduler_block_size(self) -> int:
        return self._sched

    @property
    def hash_block_size(self) -> int:
        return self._hbs

    @property
    def token_limit(self) -> int:
        """Token ids must be below this (``vocab_size``, else 2**31)."""
        return self._limits.token_limit

    @property
    def num_groups(self) -> int:
        return len(self._config.groups)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free + evictable cached ones)."""
        return self._manager.pool.get_num_free_blocks()

    @property
    def prefix_log(self) -> PrefixLog:
        """The observer of this pool's prefix-cache map (see :mod:`residency`)."""
        return self._log

    @property
    def manager(self) -> KVCacheManager:
        """The underlying vLLM-equivalent manager (for tests and tools)."""
        return self._manager

    # -- helpers ---------------------------------------------------------------------------
    def _get(self, request_id: str) -> Request:
        req = self._requests.get(request_id)
        if req is None:
            raise UnknownRequest(f"unknown request {request_id!r}", field="request_id")
        return req

    def _info(self, req: Request) -> RequestInfo:
        return RequestInfo(req.request_id, len(req.all_token_ids) + req.num_placeholders,
                           req.num_computed_tokens, len(req.block_hashes), req.status,
                           req.num_preemptions, req.num_placeholders)

    # -- the one entry point for changes ---------------------------------------------------
    def apply_batch(self, ops: Sequence[Op], *, begin_step: bool = False) -> list[OpOutcome]:
        """Validate the whole batch, then apply it op by op (after a new scheduler step
        when ``begin_step``); one outcome per op (see :mod:`ops`).

        All or nothing: an invalid op raises a :class:`KVCacheError` whose field is
        ``ops[i].<kind>.<field>`` and nothing changes. Once validated, no op can fail
        (see :mod:`batch`), so a batch is never half applied."""
        return self.prepare_batch(ops, begin_step=begin_step).apply()

    def prepare_batch(self, ops: Sequence[Op], *,
                      begin_step: bool = False) -> PreparedBatch:
        """The validation half of :meth:`apply_batch` (raises as it does, changes
        nothing). Apply the answer before anything else changes the pool: the service
        logs a batch between its validation and its application."""
        return PreparedBatch(self, ops, check_batch(self._checker(), ops), begin_step)

    def prepare_batch_in_slices(self, ops: Sequence[Op], *, begin_step: bool = False,
                                slice_cost: int) -> Generator[None, None, PreparedBatch]:
        """:meth:`prepare_batch` yielding after about ``slice_cost`` units of work
        (:func:`ops.op_cost`); the caller lets nothing touch the pool until the batch is
        applied."""
        plan = yield from check_batch_in_slices(self._checker(), ops, slice_cost)
        if self._hash_fn is not None:
            # Long prompts are hashed here, a slice at a time, rather than in one piece
            # when the request is created (the hashes are the same). A unit is one hash
            # block here (TOKENS_PER_COST tokens at the usual block size of 16).
            for i, op in enumerate(ops):
                if type(op) is AddRequest and plan[i][1] is None \
                        and len(plan[i][0]) > slice_cost * self._hbs:
                    tokens, _, mm, embeds = plan[i]
                    hashes = yield from hash_in_slices(
                        self._hash_fn, tokens, self._hbs, self._limits.token_limit,
                        slice_cost, ExtraKeys(op.cache_salt, op.lora_name, op.lora_path,
                                              mm, embeds), self._lookahead)
                    plan[i] = (tokens, hashes, mm, embeds)
        return PreparedBatch(self, ops, plan, begin_step)

    # The outcome of each kind of op (see ops.OpOutcome), for the single-op methods.
    @overload
    def _apply_one(self, op: AddRequest | AppendTokens) -> RequestInfo: ...
    @overload
    def _apply_one(self, op: Lookup) -> PrefixHit: ...
    @overload
    def _apply_one(self, op: Allocate) -> Allocation: ...
    @overload
    def _apply_one(self, op: Decode) -> DecodeOutcome: ...
    @overload
    def _apply_one(self, op: Free | Preempt | FillPlaceholders | ResetHostTierOp) -> int: ...

    def _apply_one(self, op: Op) -> OpOutcome:
        """One op as a batch of one, errors naming fields relative to the op."""
        check = self._checker()
        check.last = True  # nothing reads the simulation after the only op
        prepared = check.check(op)
        if self._manager.host_tier is not None:
            self._manager.host_tier.begin_batch()
        outcome = self._apply(op, prepared)
        self._manager.release_copied_blocks()
        if self._pins is not None:
            self._pins_after_batch()
        return outcome

    def _checker(self) -> BatchCheck:
        return BatchCheck(self._requests, self._limits, self._fresh_hit)

    def _fresh_hit(self, request_id: str) -> int | None:
        pending = self._pending.get(request_id)
        return pending[1] if pending is not None and pending[2] == self._epoch else None

    def _apply(self, op: Op, prepared: Any) -> OpOutcome:
        """Applies one validated op; ``prepared`` is what :class:`BatchCheck` answered."""
        if isinstance(op, Decode):
            return self._decode(op, prepared)
        if isinstance(op, Allocate):
            req = self._requests[op.request_id]
            if prepared:
                req.append_tokens(prepared)
            if op.num_placeholder_tokens:
                req.num_placeholders += op.num_placeholder_tokens
            return self._allocate(req, op.num_new_tokens, op.num_lookahead_tokens,
                                  op.full_sequence_must_fit, op.use_lookup,
                                  op.delay_cache_blocks, op.num_encoder_tokens,
                                  op.include_table)
        if isinstance(op, AppendTokens):
            req = self._requests[op.request_id]
            req.append_tokens(prepared)
            return self._info(req)
        if isinstance(op, FillPlaceholders):
            return self._fill(op.request_ids, prepared)
        if isinstance(op, AddRequest):
            tokens, hashes, mm, embeds = prepared
            req = Request(op.request_id, tokens, hash_fn=self._hash_fn,
                          hash_block_size=self._hbs, cache_salt=op.cache_salt,
                          lora_name=op.lora_name, lora_path=op.lora_path, block_hashes=hashes,
                          mm_items=mm, prompt_embeds=embeds, hash_lookahead=self._lookahead)
            # Long prompts arrive hashed by the batch check: only the client's own hashes
            # may have another recipe (a miss reason checks them).
            req.client_hashes = op.block_hashes is not None
            # The session that added it: named by the BlockStored events it triggers.
            req.session_id = op.account or None
            req.lora_id = op.lora_id
            self._requests[op.request_id] = req
            if op.cache_salt or op.lora_name is not None:
                self._log.saw_keys(ExtraKeys(op.cache_salt, op.lora_name, op.lora_path))
            if self._quota is not None:
                self._quota.join(op.request_id, op.account or "")
            if op.eviction_class:
                self._class_table()[op.request_id] = op.eviction_class
            return self._info(req)
        if isinstance(op, Lookup):
            req = self._requests[op.request_id]
            blocks, hit, boundary = self._manager.get_computed_blocks(req)
            # As vLLM's scheduler does: the junction's checkpoint is then retained.
            req.shared_prefix_boundary = boundary
            self._pending[op.request_id] = (blocks, hit, self._epoch)
            if self._manager.host_tier is None:
                result = PrefixHit(hit, [[b.block_id for b in g] for g in blocks], boundary,
                                   None, hit)
            else:
                # A block held only in host memory (a placeholder) answers -1.
                result = PrefixHit(hit, [[b.block_id if b.block_id >= 0 else -1 for b in g]
                                         for g in blocks], boundary, None, hit)
            if op.explain:
                result.groups = self._peek.residency(
                    req.block_hashes, req.num_tokens - 1, hit, req.all_token_ids,
                    ExtraKeys(req.cache_salt, req.lora_name, req.lora_path, req.mm_items,
                              req.prompt_embeds),
                    client_hashes=req.client_hashes, explain_misses=True).groups
            return result
        if isinstance(op, Free):
            req = self._requests.pop(op.request_id)
            self._epoch += 1
            if self._pins is not None:
                self._pins_after_batch()  # growing pins take their blocks first
            if self._classes is not None:
                self._release_as(self._classes.pop(op.request_id, 0))
            if op.tail_first_across_groups:
                self._free_deferred_order(req, op.evict_first)
            elif op.evict_first:
                with evict_first(self._manager.pool):
                    self._manager.free(req)
            else:
                self._manager.free(req)
            if self._classes is not None:
                self._release_as(0)
            if self._quota is not None:
                self._quota.leave(op.request_id)
            self._pending.pop(op.request_id, None)
            return self.num_free_blocks
        if isinstance(op, Preempt):
            req = self._requests[op.request_id]
            self._epoch += 1
            if self._pins is not None:
                self._pins_after_batch()
            if self._classes is not None:
                self._release_as(self._classes.get(op.request_id, 0))
            self._manager.free(req)
            if self._classes is not None:
                self._release_as(0)
            if self._quota is not None:
                self._quota.update(op.request_id, 0)
            req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = 0
            req.num_preemptions += 1
            self._preemptions += 1
            self._pending.pop(op.request_id, None)
            return self.num_free_blocks
        if isinstance(op, ResetHostTierOp):
            return self._reset_host_tier()
        self._manager.new_step_starts()  # NewStep: the checker let no other kind through
        return None

    def _reset_host_tier(self) -> int:
        """Drops every host slot (a pending hit naming one is looked up again)."""
        tier = self._manager.host_tier
        if tier is None:
            return 0
        self._epoch += 1
        return tier.reset(self._manager.pool.events)

    # -- host tier (core/host_tier.py) ----------------------------------------------------
    @property
    def tier_copies(self) -> tuple[list[TierCopy], list[TierCopy]]:
        """(demotions, promotions) the last batch planned, in order (empty without a
        host tier): a batch is :meth:`apply_batch`, a prepared batch's ``apply`` /
        ``apply_in_slices``, or a single-op method (a batch of one); each clears the last
        batch's copies and releases their host slots first (the other methods plan none and
        keep them). Run every demotion, then every promotion, before the batch's block
        copies and forward pass (docs/semantics.md#host-tier)."""
        tier = self._manager.host_tier
        if tier is None:
            return [], []
        return list(tier.demotions), list(tier.promotions)

    def reset_host_tier(self) -> int:
        """:class:`ResetHostTierOp` as a batch of one: host slots dropped."""
        return self._apply_one(ResetHostTierOp())

    # -- requests -------------------------------------------------------------------------
    # The single-op methods below are batches of one (same checks, same outcome); the
    # values the batch checks are ``Checked`` (the compiled core lets them reach the check).
    def add_request(self, request_id: Checked[str], token_ids: Sequence[int], *,
                    cache_salt: Checked[str | None] = None,
                    lora_name: Checked[str | None] = None,
                    block_hashes: Sequence[bytes] | None = None,
                    lora_path: Checked[str | None] = None,
                    mm_items: Sequence[Any] = (),
                    prompt_embeds_digests: Sequence[bytes] = ()) -> RequestInfo:
        """Register a request and hash its full blocks (or adopt the client's hashes,
        one per ``hash_block_size`` full block). A LoRA request's blocks hash
        ``("lora", lora_name, lora_path)``: pass the path to match vLLM's hashes.
        ``mm_items`` / ``prompt_embeds_digests``: docs/hashing.md section 2."""
        return self._apply_one(AddRequest(request_id, token_ids, block_hashes, cache_salt,
                                          lora_name, lora_path, mm_items=mm_items,
                                          prompt_embeds_digests=prompt_embeds_digests))

    def append_tokens(self, request_id: Checked[str], token_ids: Sequence[int]) -> RequestInfo:
        """Append decoded tokens; newly completed blocks are hashed."""
        return self._apply_one(AppendTokens(request_id, token_ids))

    def request_info(self, request_id: str) -> RequestInfo:
        return self._info(self._get(request_id))

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is registered (O(1), builds nothing)."""
        return request_id in self._requests

    def num_tokens(self, request_id: str) -> int:
        """Tokens the request holds (prompt + appended); UnknownRequest if unknown."""
        return len(self._get(request_id).all_token_ids)

    def block_hashes(self, request_id: str) -> list[bytes]:
        """The request's block hashes (one per full ``hash_block_size`` block)."""
        return list(self._get(request_id).block_hashes)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def block_ids(self, request_id: str) -> list[list[int]]:
        self._get(request_id)
        return self._manager.get_block_ids(request_id)

    # -- lookup / allocate ----------------------------------------------------------------
    def lookup(self, request_id: Checked[str], *,
               explain_misses: Checked[bool] = False) -> PrefixHit:
        """Longest usable prefix hit of a request with nothing computed. Takes no
        references; remembered for the request's next ``allocate``. ``explain_misses``
        adds every group's reach and miss reason (costs probes and rehashing)."""
        return self._apply_one(Lookup(request_id, explain_misses))

    @property
    def max_new_tokens(self) -> int:
        """The most tokens one allocate may compute: ``max_in_flight_tokens`` (default
        ``max_model_len``)."""
        return self._max_new_tokens

    @property
    def hash_recipe(self) -> HashRecipe:
        return self._recipe

    def check_hash_recipe(self, declared: DeclaredRecipe) -> None:
        """InvalidArgument naming the first declared value that differs from the pool's
        recipe (:func:`check_declared_recipe`)."""
        check_declared_recipe(self._recipe, declared)

    def allocate(self, request_id: Checked[str], num_new_tokens: Checked[int], *,
                 num_lookahead_tokens: Checked[int] = 0,
                 full_sequence_must_fit: Checked[bool] = False,
                 use_lookup: Checked[bool] = True, delay_cache_blocks: Checked[bool] = False,
                 num_encoder_tokens: Checked[int] = 0, include_tables: Checked[bool] = True,
                 num_placeholder_tokens: Checked[int] = 0) -> Allocation:
        """Slots for ``num_new_tokens`` more tokens (after the pending lookup's hit when
        ``use_lookup``). ``ok=False`` when they do not fit. ``include_tables=False`` leaves
        ``block_ids`` None (callers that track tables from ``new_block_ids``)."""
        return self._apply_one(Allocate(
            request_id, num_new_tokens, num_lookahead_tokens, full_sequence_must_fit,
            use_lookup, delay_cache_blocks, include_tables, (), num_encoder_tokens,
            num_placeholder_tokens))

    def _allocate(self, req: Request, num_new_tokens: int, num_lookahead_tokens: int = 0,
                  full_sequence_must_fit: bool = False, use_lookup: bool = True,
                  delay_cache_blocks: bool = False, num_encoder_tokens: int = 0,
                  include_tables: bool = True) -> Allocation:
        """:meth:`allocate` of a registered request with checked counts."""
        request_id = req.request_id
        manager = self._manager
        pending = self._pending.get(request_id) if use_lookup else None
        if pending is not None:
            blocks, hit, epoch = pending
            if epoch != self._epoch:
                # Blocks may have been reused since the lookup: look the prefix up again.
                blocks, hit, req.shared_prefix_boundary = manager.get_computed_blocks(req)
        else:
            blocks, hit = None, 0
        # The batch check admits 0 new tokens only with a fresh hit to adopt.
        assert num_new_tokens or hit, "allocate of 0 tokens without a hit passed the checks"
        if pending is not None or request_id in self._pending:
            del self._pending[request_id]
        self._epoch += 1
        quota = self._quota
        if self._classes is not None:  # out-of-window blocks are released by allocation
            self._release_as(self._classes.get(request_id, 0))
        new = manager.allocate_slots(
            req, num_new_tokens, hit, blocks, num_lookahead_tokens,
            delay_cache_blocks=delay_cache_blocks, num_encoder_tokens=num_encoder_tokens,
            full_sequence_must_fit=full_sequence_must_fit,
            max_new_blocks=None if quota is None else quota.room(request_id))
        if self._classes is not None:
            self._release_as(0)
        if quota is not None:
            self._count_quota(request_id, new is None)
        if new is None:
            self._allocation_failures += 1
            return Allocation(False, None,
                                  self._table_ids(request_id) if include_tables else None,
                                  req.num_computed_tokens, 0)
        if req.status != RequestStatus.RUNNING:
            # Admission (first allocation after add or preempt): prefix-cache stats.
            manager.record_prefix_cache_stats(req, hit)
            req.status = RequestStatus.RUNNING
        req.num_computed_tokens += hit + num_new_tokens
        return Allocation(True, [[b.block_id for b in g] for g in new],
                              self._table_ids(request_id) if include_tables else None,
                              req.num_computed_tokens, hit, manager.take_block_copies())

    def _count_quota(self, request_id: str, refused: bool) -> None:
        """After an allocation in a pool with a quota: the request's blocks (it may also
        have released out-of-window ones), and a refusal the quota caused."""
        manager = self._manager
        if refused and manager.refused_by_quota:
            self._quota.refusals += 1  # type: ignore[union-attr]
        manager.refused_by_quota = False
        holds = sum(1 for ids in self._table_ids(request_id) for b in ids if b)
        self._quota.update(request_id, holds)  # type: ignore[union-attr]

    def decode(self, request_ids: Sequence[str], token_ids: Sequence[int], *,
               placeholders: bool = False) -> DecodeOutcome:
        """The decode step of many requests: for each ``i`` in order, the same as
        ``append_tokens(request_ids[i], [token_ids[i]])`` then
        ``allocate(request_ids[i], 1, include_tables=False)`` (same outcome, statistics and
        events), without building per-request result objects.

        Validated whole before anything changes: one token per request, distinct
        registered ids, token ids in range, no request beyond ``max_model_len``."""
        return self._apply_one(Decode(request_ids, token_ids, placeholders))

    def fill_placeholders(self, request_ids: Sequence[str], token_ids: Sequence[int]) -> int:
        """For each ``i`` in order, ``token_ids[i]`` fills the oldest placeholder token of
        ``request_ids[i]``; newly known full blocks within the computed tokens are cached.
        Answers the number of placeholders filled."""
        return self._apply_one(FillPlaceholders(request_ids, token_ids))

    def _fill(self, request_ids: Sequence[str], token_ids: list[int]) -> int:
        """:meth:`fill_placeholders` of a validated op. Only blocks within the computed
        tokens are cached: a preempted request (nothing computed) holds no blocks."""
        requests = self._requests
        touched: dict[str, Request] = {}
        for rid, tok in zip(request_ids, token_ids):
            req = touched.get(rid) or requests[rid]
            req.fill_placeholder(tok)
            touched[rid] = req
        if self._hash_fn is not None:
            cache_blocks = self._manager.cache_blocks
            for req in touched.values():
                computed = req.num_computed_tokens
                if computed:
                    known = len(req.all_token_ids)
                    cache_blocks(req, computed if computed < known else known)
        return len(token_ids)

    def _decode(self, op: Decode, reqs: list[Request] | None) -> DecodeOutcome:
        """:meth:`decode` of a validated op. The usual request is RUNNING (computed tokens
        > 0, hence no pending lookup), so it goes straight to the manager; any other takes
        the general allocation path."""
        if reqs is None:
            reqs = [self._requests[rid] for rid in op.request_ids]
        self._epoch += 1  # as the first allocate of the equivalent op list would
        outcome = DecodeOutcome([True] * len(reqs), {})
        self._decode_range(reqs, _decode_tokens(op), 0, len(reqs), outcome)
        return outcome

    def _decode_in_slices(self, op: Decode, reqs: list[Request] | None, slice_cost: int
                          ) -> Generator[None, None, DecodeOutcome]:
        """:meth:`_decode` yielding after every ``slice_cost`` requests (same result)."""
        if reqs is None:
            reqs = [self._requests[rid] for rid in op.request_ids]
        self._epoch += 1
        outcome = DecodeOutcome([True] * len(reqs), {})
        tokens = _decode_tokens(op)
        for lo in range(0, len(reqs), slice_cost):
            self._decode_range(reqs, tokens, lo, min(len(reqs), lo + slice_cost), outcome)
            yield
        return outcome

    def _decode_range(self, reqs: list[Request], tokens: list[int] | None, lo: int, hi: int,
                      outcome: DecodeOutcome) -> None:
        """Requests ``[lo, hi)`` of a validated decode op, their answers into ``outcome``
        (``tokens`` None: each appends a placeholder instead of ``tokens[i]``)."""
        manager = self._manager
        ok = outcome.ok
        grown = outcome.new_block_ids
        copies = outcome.block_copies
        # With a quota every request takes the general path (which checks and counts it),
        # and with eviction classes (which sets the class of what it releases).
        fast = self._quota is None and self._classes is None
        i = lo
        while i < hi:
            if fast:
                # The RUNNING requests from i on, in one call into the manager.
                i, failures = manager.decode_batch(reqs, tokens, i, hi, ok, grown, copies)
                self._allocation_failures += failures
                if i >= hi:
                    break
            req = reqs[i]
            if tokens is None:
                req.num_placeholders += 1
            else:
                req.append_token(tokens[i])
            r = self._allocate(req, 1, include_tables=False)
            ok[i] = r.ok
            new_ids = r.new_block_ids
            if r.ok and new_ids is not None and any(new_ids):
                grown[i] = new_ids
            copies.extend(r.block_copies)
            i += 1

    # -- release ----------------------------------------------------------------------------
    def _free_deferred_order(self, req: Request, to_front: bool) -> None:
        """Release a request's blocks in the order of vLLM's deferred free (every group's
        table concatenated, last block first); ``to_front``: as an evict-first hint."""
        manager = self._manager
        blocks = manager.pop_blocks_for_free(req)
        if to_front:
            with evict_first(manager.pool):
                manager.pool.free_blocks(reversed(blocks))
        else:
            manager.pool.free_blocks(reversed(blocks))

    def free(self, request_id: Checked[str]) -> int:
        """Free the request's blocks (tail first) and forget it; returns free blocks."""
        return self._apply_one(Free(request_id))

    def preempt(self, request_id: Checked[str]) -> int:
        """Free the blocks but keep the request: computed tokens back to 0, PREEMPTED."""
        return self._apply_one(Preempt(request_id))

    def new_step(self) -> None:
        """A scheduler step begins (Mamba states cached last step become hittable)."""
        self._manager.new_step_starts()
        if self._pins is not None:
            self._pins_after_batch()

    # -- router / stats -----------------------------------------------------------------------
    def peek_prefix(self, token_ids: Sequence[int] | None = None, *,
                    block_hashes: Sequence[bytes] | None = None, cache_salt: str | None = None,
                    lora_name: str | None = None, lora_path: str | None = None,
                    mm_items: Sequence[Any] = (),
                    prompt_embeds_digests: Sequence[bytes] = ()) -> int:
        """Hit length in tokens a request with this prompt would get now from device
        blocks (with a host tier, :meth:`prefix_residency`'s ``host_hit_tokens`` is the hit
        across both tiers, what a lookup answers). Read-only: registers nothing, takes no
        references, changes no statistics. With only ``block_hashes``, the cap is the
        hashed length (the token count is unknown)."""
        peek = self.peek_prefix_in_slices(token_ids, block_hashes=block_hashes,
                                          cache_salt=cache_salt, lora_name=lora_name,
                                          lora_path=lora_path, mm_items=mm_items,
                                          prompt_embeds_digests=prompt_embeds_digests)
        hit: int = run_to_end(peek)
        return hit

    def peek_prefix_in_slices(self, token_ids: Sequence[int] | None = None, *,
                              block_hashes: Sequence[bytes] | None = None,
                              cache_salt: str | None = None, lora_name: str | None = None,
                              lora_path: str | None = None, slice_blocks: int = 1 << 62,
                              mm_items: Sequence[Any] = (),
                              prompt_embeds_digests: Sequence[bytes] = ()
                              ) -> Generator[None, None, int]:
        """:meth:`peek_prefix` hashing ``slice_blocks`` blocks at a time and yielding in
        between (hashing is the cost of a long prompt); the generator returns the hit. The
        input is checked before the first yield; the cache is read after the last one, in
        one piece, so the answer is the hit at that moment."""
        residency = yield from self.prefix_residency_in_slices(
            token_ids, block_hashes=block_hashes, cache_salt=cache_salt, lora_name=lora_name,
            lora_path=lora_path, groups=False, slice_blocks=slice_blocks, mm_items=mm_items,
            prompt_embeds_digests=prompt_embeds_digests)
        return residency.hit_tokens

    def peek_input_in_slices(self, token_ids: Sequence[int] | None,
                             block_hashes: Sequence[bytes] | None, keys: ExtraKeys, *,
                             slice_blocks: int = 1 << 62
                             ) -> Generator[None, None, PeekInput]:
        """The checked input of a peek (:meth:`PrefixPeek.input_in_slices`)."""
        return self._peek.input_in_slices(token_ids, block_hashes, keys,
                                          slice_blocks=slice_blocks)

    def prefix_residency(self, token_ids: Sequence[int] | None = None, *,
                         block_hashes: Sequence[bytes] | None = None,
                         cache_salt: str | None = None, lora_name: str | None = None,
                         lora_path: str | None = None, groups: bool = True,
                         explain_misses: bool = False, mm_items: Sequence[Any] = (),
                         prompt_embeds_digests: Sequence[bytes] = ()) -> Residency:
        """:meth:`peek_prefix` with every group's reach (``groups``) and miss reason
        (``explain_misses``), probing this pool. Tokens and client hashes may be given
        together: then the hashes are looked up and checked against the pool's recipe."""
        residency: Residency = run_to_end(self.prefix_residency_in_slices(
            token_ids, block_hashes=block_hashes, cache_salt=cache_salt, lora_name=lora_name,
            lora_path=lora_path, groups=groups, explain_misses=explain_misses,
            mm_items=mm_items, prompt_embeds_digests=prompt_embeds_digests))
        return residency

    def prefix_residency_in_slices(self, token_ids: Sequence[int] | None = None, *,
                                   block_hashes: Sequence[bytes] | None = None,
                                   cache_salt: str | None = None,
                                   lora_name: str | None = None,
                                   lora_path: str | None = None, groups: bool = True,
                                   explain_misses: bool = False,
                                   slice_blocks: int = 1 << 62,
                                   mm_items: Sequence[Any] = (),
                                   prompt_embeds_digests: Sequence[bytes] = ()
                                   ) -> Generator[None, None, Residency]:
        """:meth:`prefix_residency` hashing in slices (as :meth:`peek_prefix_in_slices`:
        the cache is read after the last yield, in one piece)."""
        return self._peek.residency_in_slices(
            token_ids, block_hashes,
            probe_keys(cache_salt, lora_name, lora_path, mm_items, prompt_embeds_digests),
            groups=groups, explain_misses=explain_misses, slice_blocks=slice_blocks)

    def stats(self) -> PoolCounters:
        pool = self._manager.pool
        s = self._manager.stats  # cumulative: the pool never takes (resets) them
        return PoolCounters(
            num_blocks=pool.num_blocks, num_free_blocks=pool.get_num_free_blocks(),
            num_cached_blocks=pool.num_cached_keys, usage=pool.get_usage(),
            prefix_queries=s.queries, prefix_hits=s.hits, prefix_requests=s.requests,
            preempted_prefix_queries=s.preempted_queries, preempted_prefix_hits=s.preempted_hits,
            preempted_prefix_requests=s.preempted_requests, evictions=pool.num_evictions,
            allocation_failures=self._allocation_failures, preemptions=self._preemptions,
            num_requests=len(self._requests),
            num_cached_blocks_per_group=pool.num_cached_keys_per_group(),
            miss_reasons=dict(self._log.misses), **self._quota_counters(),
            **self._pin_counters(), **self._tier_counters())

    def _tier_counters(self) -> dict[str, Any]:
        tier = self._manager.host_tier
        if tier is None:
            return {}
        return dict(host_tier_blocks=tier.slots, host_tier_used_blocks=tier.used_blocks(),
                    host_demotions=tier.num_demotions, host_promotions=tier.num_promotions,
                    host_evictions=tier.num_evictions)

    def _pin_counters(self) -> dict[str, Any]:
        pins = self._pins
        if pins is None:
            return {}
        return dict(num_pinned_blocks=pins.num_pinned_blocks, max_pinned_blocks=pins.cap,
                    num_pins=len(pins.pins), pin_refusals=pins.refusals,
                    pinned_blocks_by_account={a: c for a, c in pins.charged.items() if c})

    def _quota_counters(self) -> dict[str, Any]:
        quota = self._quota
        if quota is None:
            return {}
        return dict(account_block_quota=quota.limit, quota_refusals=quota.refusals,
                    max_account_blocks=quota.max_used)

    def account_blocks(self, account: str) -> int:
        """Blocks the requests of ``account`` hold (0 without a quota or requests)."""
        return self._quota.used.get(account, 0) if self._quota is not None else 0

    def take_events(self) -> list[KVEvent]:
        return self._manager.take_events()

    def prefix_snapshot(self) -> list[list[bytes]]:
        """Every cached block's hash, per group: a hash appears once per block cached
        under it (what the BlockStored / BlockRemoved events add up to)."""
        block_pool = self._manager.pool
        out = []
        for gid in range(self.num_groups):
            hashes = []
            for h, entry in block_pool.group_map(gid).items():
                if type(entry) is dict:
                    hashes.extend([h] * len(entry))
                else:
                    hashes.append(h)
            out.append(hashes)
        return out

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; False (nothing changes) while blocks are in use."""
        ok = self._manager.reset_prefix_cache()
        if ok:
            self._epoch += 1
        return ok

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the cache entries of these block ids (e.g. corrupt data)."""
        ids = list(block_ids)
        for i, b in enumerate(ids):
            if type(b) is not int or not 0 <= b < self._config.num_blocks:
                raise InvalidArgument(f"block_ids[{i}] = {b!r} is out of range "
                                      f"[0, {self._config.num_blocks})", field=f"block_ids[{i}]")
        self._epoch += 1
        self._manager.evict_blocks(ids)
        if self._pins is not None:
            self._pins.refresh(force=True)  # pins re-resolve what is still hittable

    # -- eviction classes (core/eviction_classes.py) ---------------------------------------------
    def _class_table(self) -> dict[str, int]:
        classes = self._classes
        if classes is None:
            block_pool = self._manager.pool
            block_pool.free_block_queue = ClassedFreeQueue(
                block_pool.free_block_queue)
            classes = self._classes = {}
        return classes

    def _release_as(self, eviction_class: int) -> None:
        queue = self._manager.pool.free_block_queue
        assert isinstance(queue, ClassedFreeQueue)
        queue.release_class = eviction_class

    # -- pins (core/pins.py) ----------------------------------------------------------------------
    def _pin_table(self) -> PinTable:
        pins = self._pins
        if pins is None:
            opts = self._options
            cap = opts.max_pinned_blocks
            if cap is None:
                cap = default_cap(self._config, opts.max_model_len, opts.max_in_flight_tokens)
            pins = self._pins = PinTable(self._manager.pool, self._manager.coordinator,
                                         cap=cap, account_quota=opts.pinned_block_quota,
                                         hash_block_size=self._hbs)
        return pins

    def _pins_after_batch(self) -> None:
        pins = self._pins
        if pins is not None and pins.any_growing:
            pins.refresh()

    def check_pin(self, pin_id: str, token_ids: Sequence[int] | None = None, *,
                  block_hashes: Sequence[bytes] | None = None, cache_salt: str | None = None,
                  lora_name: str | None = None, lora_path: str | None = None,
                  account: str = "", mm_items: Sequence[Any] = (),
                  prompt_embeds_digests: Sequence[bytes] = ()) -> Any:
        """The checked pin :meth:`add_pin` takes; raises (changing nothing) if the input
        is bad or a bound refuses it."""
        if self._hash_fn is None:
            raise FailedPrecondition("prefix caching is off in this pool: nothing to pin",
                                     field="pool_id")
        if type(account) is not str:
            raise InvalidArgument("account must be a string", field="account")
        hashes, max_len, _ = run_to_end(self.peek_input_in_slices(
            token_ids, block_hashes,
            probe_keys(cache_salt, lora_name, lora_path, mm_items, prompt_embeds_digests)))
        assert hashes is not None
        return self._pin_table().check_new(
            pin_id, account, hashes, max_len,
            "token_ids" if token_ids is not None else "block_hashes")

    def refuse_pin(self) -> None:
        """Counts a pin refused by a bound outside the pool (a tenant's quota): the
        ``pin_refusals`` statistic, nothing else."""
        self._pin_table().refusals += 1

    def add_pin(self, checked: Any) -> PinInfo:
        """Takes a pin :meth:`check_pin` answered (nothing may change the pool between)."""
        pins = self._pin_table()
        pins.add(checked)
        return pins.info(checked)

    def pin_prefix(self, pin_id: str, token_ids: Sequence[int] | None = None, *,
                   block_hashes: Sequence[bytes] | None = None, cache_salt: str | None = None,
                   lora_name: str | None = None, lora_path: str | None = None,
                   account: str = "") -> PinInfo:
        """Pins the prefix (see :mod:`pins`): its cached blocks a hit needs are held out
        of eviction until :meth:`drop_pin`; what is not cached yet is held once cached."""
        return self.add_pin(self.check_pin(pin_id, token_ids, block_hashes=block_hashes,
                                           cache_salt=cache_salt, lora_name=lora_name,
                                           lora_path=lora_path, account=account))

    def pin_info(self, pin_id: str) -> PinInfo:
        """The pin (NotFound naming ``pin_id`` if there is none)."""
        if self._pins is None:
            raise NotFound(f"unknown pin {pin_id!r:.80}", field="pin_id")
        return self._pins.info(self._pins.get(pin_id))

    def drop_pin(self, pin_id: str) -> PinInfo:
        """Releases a pin's blocks (tail first; those nothing else holds re-enter the free
        queue at its back) and forgets it; answers the pin as it was."""
        info = self.pin_info(pin_id)
        assert self._pins is not None
        self._epoch += 1
        self._pins.drop(pin_id)
        return info

    def pins(self) -> list[PinInfo]:
        """Every pin of the pool, oldest first."""
        pins = self._pins
        return [pins.info(p) for p in pins.pins.values()] if pins is not None else []

    def pinned_blocks_by_account(self) -> dict[str, int]:
        """Account -> pinned blocks charged to it (see :mod:`pins`)."""
        return dict(self._pins.charged) if self._pins is not None else {}

    def pinned_tokens(self, hashes: Sequence[bytes]) -> int:
        """Of a prompt with these block hashes, the leading tokens some live pin holds."""
        pins = self._pins
        if pins is None:
            return 0
        best = 0
        for pin in pins.pins.values():
            n = 0
            for a, b in zip(pin.hashes, hashes):
                if a != b:
                    break
                n += 1
            best = max(best, min(n * self._hbs, pin.hit_tokens))
        return best

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct blocks held by pins."""
        return self._pins.num_pinned_blocks if self._pins is not None else 0

    @property
    def max_pinned_blocks(self) -> int:
        """The pool's bound on pinned blocks (options.max_pinned_blocks or its default)."""
        opts = self._options
        if opts.max_pinned_blocks is not None:
            return opts.max_pinned_blocks
        return self._pins.cap if self._pins is not None else default_cap(
            self._config, opts.max_model_len, opts.max_in_flight_tokens)

    # -- invariants ------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError naming the broken invariant. O(pool).
        (docs/semantics.md#invariants)"""
        pins = self._pins
        check_pool_invariants(self._manager, self._requests,
                              pins.refs if pins is not None else None)
        if pins is not None:
            pins.check_invariants()
        queue = self._manager.pool.free_block_queue
        if isinstance(queue, ClassedFreeQueue):
            queue.check_invariants()
            assert set(self._classes or ()) <= set(self._requests), "class of a gone request"


def _decode_tokens(op: Decode) -> list[int] | None:
    """A validated decode op's token ids as a list (None: it appends placeholders)."""
    if op.placeholders:
        return None
    tokens = op.token_ids
    return tokens if isinstance(tokens, list) else list(tokens)
