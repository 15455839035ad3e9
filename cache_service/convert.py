"""Protocol messages <-> allocator core objects, for the server.

Everything the server turns from a ``kvcache.v1`` message into core arguments (and back)
lives here: pool descriptions, Step ops (:func:`ops_from_proto`) and their outcomes
(:func:`step_response`), stats and events. Layer specs, which the clients map too, are
:mod:`cache_service.specs_proto`'s (used here, never mapped twice). Field-level checks
live here only where the core cannot name the field in protocol terms
(``layers[2].kind``) or the rule is the protocol's own; the rules of a batch are the
pool's (``Pool.apply_batch``). Errors are core errors whose ``field`` is the protocol
path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cache_service.core import events as ev
from cache_service.core import grouping, operations
from cache_service.core.hashing import DeclaredRecipe, external_block_hash
from cache_service.core.host_tier import MAX_HOST_TIER_BLOCKS, TierCopy
from cache_service.core.kv_cache_manager import BlockCopy
from cache_service.core.pool import DecodeOutcome, PoolOptions
from cache_service.core.residency import GroupResidency
from cache_service.core.specs import (
    KVCacheConfig,
    MambaSpec,
    layer_spec,
)
from cache_service.errors import InvalidArgument, KVCacheError, qualify
from cache_service.registry import PoolDescription, PoolEntry
from cache_service.specs_proto import layer_spec_from_proto, layer_spec_to_proto, non_negative
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.enums import HASH_ALGOS, LAYER_KINDS, MAMBA_CACHE_MODES, MISS_REASONS

# ---------------------------------------------------------------------------------------
# RegisterPool
# ---------------------------------------------------------------------------------------

def options_from_proto(opts: pb.PoolOptions) -> tuple[PoolOptions, bool]:
    """Core pool options and the ``hybrid`` flag from ``PoolOptions`` (the service-only
    ``skip_capacity_check`` is read by :func:`description_from_proto`)."""
    p = "options"
    non_negative(opts.max_model_len, f"{p}.max_model_len", positive=True, limit=1 << 31)
    for name in ("scheduler_block_size", "hash_block_size", "max_in_flight_tokens"):
        non_negative(getattr(opts, name), f"{p}.{name}", limit=1 << 31)
    non_negative(opts.vocab_size, f"{p}.vocab_size", limit=1 << 40)
    non_negative(opts.session_block_quota, f"{p}.session_block_quota", limit=1 << 40)
    non_negative(opts.session_pinned_block_quota, f"{p}.session_pinned_block_quota",
                 limit=1 << 40)
    max_pinned = None
    if opts.HasField("max_pinned_blocks"):
        max_pinned = non_negative(opts.max_pinned_blocks, f"{p}.max_pinned_blocks",
                                  limit=1 << 40)
    if not 0.0 <= opts.watermark < 1.0:  # also rejects NaN
        raise InvalidArgument(f"must be in [0, 1), got {opts.watermark}",
                              field=f"{p}.watermark")
    if opts.hash_algo and not HASH_ALGOS.name(opts.hash_algo):
        raise InvalidArgument(f"unknown hash_algo {opts.hash_algo}", field=f"{p}.hash_algo")
    # Whether a host tier fits the pool (it needs prefix caching) is checked when the pool
    # is built.
    host_tier = non_negative(opts.host_tier_blocks, f"{p}.host_tier_blocks",
                             limit=MAX_HOST_TIER_BLOCKS)
    # Absent = dense (docs/semantics.md#checkpoint-retention); whether a value fits the
    # pool's groups and scheduler block size is checked when the pool is built.
    retention = None
    if opts.HasField("prefix_cache_retention_interval"):
        retention = non_negative(opts.prefix_cache_retention_interval,
                                  f"{p}.prefix_cache_retention_interval", limit=1 << 31)
    core = PoolOptions(
        max_model_len=opts.max_model_len,
        enable_caching=opts.enable_caching if opts.HasField("enable_caching") else True,
        hash_algo=HASH_ALGOS.name(opts.hash_algo) or "sha256",
        scheduler_block_size=opts.scheduler_block_size or None,
        hash_block_size=opts.hash_block_size or None,
        watermark=opts.watermark,
        max_in_flight_tokens=opts.max_in_flight_tokens or None,
        enable_events=opts.enable_events if opts.HasField("enable_events") else True,
        vocab_size=opts.vocab_size or None,
        account_block_quota=opts.session_block_quota or None,
        prefix_cache_retention_interval=retention,
        enable_mamba_shared_prefix_checkpoint=opts.enable_mamba_shared_prefix_checkpoint,
        max_pinned_blocks=max_pinned,
        pinned_block_quota=opts.session_pinned_block_quota or None,
        use_eagle=opts.use_eagle,
        host_tier_blocks=host_tier,
        num_hash_lookahead_tokens=non_negative(opts.num_hash_lookahead_tokens,
                                               f"{p}.num_hash_lookahead_tokens",
                                               limit=1 << 31),
    )
    return core, opts.hybrid if opts.HasField("hybrid") else True


def options_to_proto(opts: PoolOptions, hybrid: bool,
                     skip_capacity_check: bool = False) -> pb.PoolOptions:
    return pb.PoolOptions(skip_capacity_check=skip_capacity_check,
        max_model_len=opts.max_model_len, enable_caching=opts.enable_caching,
        hash_algo=HASH_ALGOS.value(opts.hash_algo),
        scheduler_block_size=opts.scheduler_block_size or 0,
        hash_block_size=opts.hash_block_size or 0, watermark=opts.watermark,
        max_in_flight_tokens=opts.max_in_flight_tokens or 0,
        enable_events=opts.enable_events, vocab_size=opts.vocab_size or 0, hybrid=hybrid,
        session_block_quota=opts.account_block_quota or 0,
        prefix_cache_retention_interval=opts.prefix_cache_retention_interval,
        enable_mamba_shared_prefix_checkpoint=opts.enable_mamba_shared_prefix_checkpoint,
        max_pinned_blocks=opts.max_pinned_blocks,
        session_pinned_block_quota=opts.pinned_block_quota or 0,
        use_eagle=opts.use_eagle, host_tier_blocks=opts.host_tier_blocks,
        num_hash_lookahead_tokens=opts.num_hash_lookahead_tokens)


def description_from_proto(req: pb.RegisterPoolRequest) -> PoolDescription:
    """The pool description of a RegisterPool call (validated field by field)."""
    if not req.HasField("options"):
        raise InvalidArgument("options (with max_model_len) is required", field="options")
    if not req.layers:
        raise InvalidArgument("at least one layer is required", field="layers")
    layers = tuple((layer.name, layer_spec_from_proto(layer, f"layers[{i}]"))
                   for i, layer in enumerate(req.layers))
    budget = req.WhichOneof("budget")
    if budget is None:
        raise InvalidArgument("give available_memory_bytes or num_blocks", field="budget")
    options, hybrid = options_from_proto(req.options)
    skip = req.options.skip_capacity_check
    if budget == "num_blocks":
        non_negative(req.num_blocks, "num_blocks", limit=1 << 31)
        if req.num_blocks < 2:
            raise InvalidArgument("must be >= 2 (block 0 is the null block)",
                                  field="num_blocks")
        return PoolDescription(layers, options, num_blocks=req.num_blocks, hybrid=hybrid,
                               skip_capacity_check=skip)
    non_negative(req.available_memory_bytes, "available_memory_bytes", positive=True,
                  limit=1 << 60)
    return PoolDescription(layers, options, available_memory_bytes=req.available_memory_bytes,
                           hybrid=hybrid, skip_capacity_check=skip)


def layer_page_size_bytes(group: Any) -> int:
    """Bytes of one block in ONE layer of a group: its layers' largest page (they differ
    only in a uniform-type group, whose spec's page is the sum over its layers)."""
    return max(layer_spec(group.spec, name).page_size_bytes for name in group.layer_names)


def group_to_proto(index: int, group: Any) -> pb.KVCacheGroup:
    spec = group.spec
    out = pb.KVCacheGroup(index=index, layer_names=list(group.layer_names),
                          kind=LAYER_KINDS.value(spec.kind), block_size=spec.block_size,
                          page_size_bytes=layer_page_size_bytes(group))
    window = getattr(spec, "sliding_window", None)
    if window:
        out.sliding_window = window
    chunk = getattr(spec, "attention_chunk_size", None)
    if chunk:
        out.attention_chunk_size = chunk
    if isinstance(spec, MambaSpec):
        out.mamba_cache_mode = MAMBA_CACHE_MODES.value(spec.mamba_cache_mode)
    rswa_window = getattr(spec, "rswa_window", None)
    if rswa_window:
        out.rswa_window = rswa_window
    return out


def pool_config_to_proto(entry: PoolEntry) -> pb.PoolConfig:
    """The ``PoolConfig`` of a registered pool."""
    config: KVCacheConfig = entry.config
    pool = entry.pool
    desc = entry.description
    groups = [group_to_proto(i, g) for i, g in enumerate(config.groups)]
    options = options_to_proto(pool.options, desc.hybrid, desc.skip_capacity_check)
    # Defaults filled in: the values the pool resolved and runs with.
    options.scheduler_block_size = pool.scheduler_block_size
    options.hash_block_size = pool.hash_block_size
    options.max_in_flight_tokens = pool.max_new_tokens
    recipe = pool.hash_recipe
    return pb.PoolConfig(
        pool_id=entry.pool_id, num_blocks=config.num_blocks, groups=groups,
        page_size_bytes=grouping.page_size_bytes(config),
        layer_page_size_bytes=max((g.page_size_bytes for g in groups), default=0),
        scheduler_block_size=pool.scheduler_block_size, hash_block_size=pool.hash_block_size,
        options=options,
        layers=[layer_spec_to_proto(name, spec) for name, spec in desc.layers],
        hash_recipe=pb.HashRecipe(hash_algo=HASH_ALGOS.value(recipe.hash_algo),
                                  none_hash_seed=recipe.none_hash_seed,
                                  none_hash=recipe.none_hash,
                                  hash_block_size=recipe.hash_block_size,
                                  num_hash_lookahead_tokens=recipe.num_hash_lookahead_tokens),
        incarnation=entry.incarnation)


def declared_recipe_from_proto(recipe: pb.HashRecipe) -> DeclaredRecipe:
    """The fields a client set in its ``HashRecipe`` (unset = not declared); errors name
    the recipe's field."""
    if recipe.hash_algo and not HASH_ALGOS.name(recipe.hash_algo):
        raise InvalidArgument(f"unknown hash_algo {recipe.hash_algo}", field="hash_algo")
    return DeclaredRecipe(
        hash_algo=HASH_ALGOS.name(recipe.hash_algo) if recipe.hash_algo else None,
        none_hash_seed=recipe.none_hash_seed or None,
        none_hash=recipe.none_hash or None,
        hash_block_size=recipe.hash_block_size or None,
        num_hash_lookahead_tokens=(recipe.num_hash_lookahead_tokens
                                   if recipe.HasField("num_hash_lookahead_tokens") else None))


# ---------------------------------------------------------------------------------------
# Results and events
# ---------------------------------------------------------------------------------------

def tables(block_ids: Sequence[Sequence[int]] | None) -> list[pb.BlockTable]:
    """Per-group block tables (none for None)."""
    if not block_ids:
        return []
    return [pb.BlockTable(block_ids=ids) for ids in block_ids]


def stats_to_proto(s: Any, last_sequence: int) -> pb.PoolStats:
    """``PoolStats`` message from the core's stats object."""
    return pb.PoolStats(
        num_blocks=s.num_blocks, num_free_blocks=s.num_free_blocks,
        num_cached_blocks=s.num_cached_blocks, usage=s.usage, num_requests=s.num_requests,
        prefix_cache_queries=s.prefix_queries + s.preempted_prefix_queries,
        prefix_cache_hits=s.prefix_hits + s.preempted_prefix_hits,
        evictions=s.evictions, allocation_failures=s.allocation_failures,
        preemptions=s.preemptions,
        groups=[pb.GroupStats(index=i, num_cached_blocks=n)
                for i, n in enumerate(s.num_cached_blocks_per_group)],
        last_event_sequence=last_sequence,
        num_pinned_blocks=s.num_pinned_blocks, max_pinned_blocks=s.max_pinned_blocks,
        num_pins=s.num_pins, pin_refusals=s.pin_refusals,
        pinned_blocks=[pb.PinnedBlocks(session_id_prefix=a[:8], blocks=n)
                       for a, n in sorted(s.pinned_blocks_by_account.items())],
        host_tier_blocks=s.host_tier_blocks, host_tier_used_blocks=s.host_tier_used_blocks,
        host_demotions=s.host_demotions, host_promotions=s.host_promotions,
        host_evictions=s.host_evictions)


def write_residency(out: Any, groups: Sequence[GroupResidency]) -> None:
    """Appends ``GroupResidency`` messages to the repeated field ``out``."""
    for g in groups:
        m = out.add()
        m.group_idx = g.group_idx
        m.kind = LAYER_KINDS.value(g.kind)
        m.tokens = g.tokens
        m.blocks = g.blocks
        if g.host_reach is not None:  # pools with a host tier only (the proto's rule)
            m.host_tokens = g.host_reach
        if g.checkpoints:
            m.checkpoint_tokens.extend(g.checkpoints)
        if g.reason is not None:
            m.miss_reason = MISS_REASONS.value(g.reason.value)
            m.evicted_removals_ago = g.evicted_removals_ago


def snapshot_to_proto(pool: Any, sequence: int,
                      incarnation: int) -> pb.GetPrefixSnapshotResponse:
    """A pool's cached hashes per group (64-bit, as in the events) at ``sequence`` of
    the pool incarnation ``incarnation``."""
    out = pb.GetPrefixSnapshotResponse(sequence=sequence, incarnation=incarnation)
    for gid, hashes in enumerate(pool.prefix_snapshot()):
        spec = pool.config.groups[gid].spec
        g = out.groups.add(group_idx=gid, kind=LAYER_KINDS.value(spec.kind),
                           block_size=spec.block_size)
        g.block_hashes.extend([external_block_hash(h) for h in hashes])
    return out


def event_to_proto(sequence: int, event: ev.KVEvent, incarnation: int = 0) -> pb.KVEvent:
    """One sequenced ``KVEvent`` of a pool incarnation."""
    out = _event_to_proto(sequence, event)
    out.incarnation = incarnation
    return out


def _event_to_proto(sequence: int, event: ev.KVEvent) -> pb.KVEvent:
    if isinstance(event, ev.BlockStored):
        stored = pb.BlockStored(
            block_hashes=event.block_hashes, token_ids=event.token_ids,
            block_size=event.block_size, lora_name=event.lora_name or "",
            group_idx=event.group_idx,
            kind=(LAYER_KINDS.value(event.spec_kind) if event.spec_kind
                  else pb.LAYER_KIND_UNSPECIFIED),
            sliding_window=event.sliding_window or 0, medium=event.medium,
            prefix_lengths=event.prefix_lengths, start_token=event.start_token,
            session_id=event.session_id or "")
        if event.lora_id is not None:
            stored.lora_id = event.lora_id
        if event.lookahead_token_ids:
            stored.lookahead_token_ids.extend(pb.LookaheadTokens(token_ids=t)
                                              for t in event.lookahead_token_ids)
        if event.parent_block_hash is not None:
            stored.parent_block_hash = event.parent_block_hash
        return pb.KVEvent(sequence=sequence, block_stored=stored)
    if isinstance(event, ev.BlockRemoved):
        return pb.KVEvent(sequence=sequence, block_removed=pb.BlockRemoved(
            block_hashes=event.block_hashes, group_idx=event.group_idx, medium=event.medium))
    return pb.KVEvent(sequence=sequence, all_blocks_cleared=pb.AllBlocksCleared())


# ---------------------------------------------------------------------------------------
# Step: ops in, outcomes out
# ---------------------------------------------------------------------------------------

_OP_KINDS = ", ".join(pb.Op.DESCRIPTOR.oneofs_by_name["op"].fields[i].name
                      for i in range(len(pb.Op.DESCRIPTOR.oneofs_by_name["op"].fields)))


def op_from_proto(op: pb.Op, hash_algo: str, account: str = "") -> operations.Op:
    """The core op of one ``Op`` message. Checks only the protocol's own rules (an op
    kind is set; client block hashes need the cross-language recipe): every other rule
    is the pool's, applied by ``Pool.apply_batch``. Errors name fields relative to the op."""
    kind = op.WhichOneof("op")
    if kind == "decode":
        m = op.decode
        # Each read of a repeated string field builds new str objects, whose hashes every
        # dict lookup would compute again: convert once.
        return operations.Decode(list(m.request_ids), list(m.token_ids), m.placeholders)
    if kind == "allocate":
        m = op.allocate
        return operations.Allocate(m.request_id, m.num_new_tokens, m.num_lookahead_tokens,
                            m.full_sequence_must_fit, not m.skip_lookup,
                            m.delay_cache_blocks, not m.skip_block_table, m.append_token_ids,
                            0, m.num_placeholder_tokens)
    if kind == "fill_placeholders":
        m = op.fill_placeholders
        return operations.FillPlaceholders(list(m.request_ids), list(m.token_ids))
    if kind == "append_tokens":
        return operations.AppendTokens(op.append_tokens.request_id, op.append_tokens.token_ids)
    if kind == "add_request":
        m = op.add_request
        hashes = None
        if m.block_hashes:
            if hash_algo != "sha256_cbor":
                raise InvalidArgument("client block hashes need a pool with hash_algo "
                                      "HASH_ALGO_SHA256_CBOR (the cross-language recipe)",
                                      field="add_request.block_hashes")
            hashes = list(m.block_hashes)
        declared = None
        if m.HasField("hash_recipe"):
            try:
                declared = declared_recipe_from_proto(m.hash_recipe)
            except KVCacheError as exc:
                raise qualify(exc, "add_request.hash_recipe") from None
        return operations.AddRequest(m.request_id, m.token_ids, hashes, m.cache_salt or None,
                              m.lora_name or None, m.lora_path or None, declared,
                              account, m.eviction_class, mm_items_from_proto(m.mm_items),
                              list(m.prompt_embeds_digests),
                              m.lora_id if m.lora_id else None)
    if kind == "lookup":
        return operations.Lookup(op.lookup.request_id, op.lookup.explain)
    if kind == "free":
        return operations.Free(op.free.request_id, op.free.evict_first,
                               op.free.tail_first_across_groups)
    if kind == "preempt":
        return operations.Preempt(op.preempt.request_id)
    if kind == "new_step":
        return operations.NewStep()
    if kind == "reset_host_tier":
        return operations.ResetHostTierOp()
    raise InvalidArgument(f"an op must set one of {_OP_KINDS}", field="")


def mm_items_from_proto(items: Sequence[pb.MultiModalItem]) -> list[tuple[str, int, int]]:
    """``MultiModalItem`` messages as the core's ``(identifier, offset, length)``
    (checked by the pool, errors naming ``mm_items[i].<field>``)."""
    return [(m.identifier, m.offset, m.length) for m in items]


def ops_from_proto(request: pb.StepRequest, hash_algo: str) -> list[operations.Op]:
    """The core ops of a Step (errors name ``ops[i]...``). Requests it adds count against
    the quota of its session (or of the session-less account "")."""
    out = []
    account = request.session_id
    for i, op in enumerate(request.ops):
        try:
            out.append(op_from_proto(op, hash_algo, account))
        except KVCacheError as exc:
            raise qualify(exc, f"ops[{i}]") from None
    return out


def write_copies(out: Any, copies: Sequence[BlockCopy]) -> None:
    """Appends ``copies`` to a result's ``block_copies``."""
    for c in copies:
        m = out.block_copies.add()
        m.group, m.src_block_id, m.dst_block_id = c.group_id, c.src_block_id, c.dst_block_id


def write_tier_copies(out: Any, copies: Sequence[TierCopy]) -> None:
    """Appends ``copies`` to a repeated ``TierCopy`` field (demotions or promotions)."""
    for c in copies:
        m = out.add()
        m.group, m.block_id, m.host_slot = c.group, c.block_id, c.host_slot


def write_decode(out: pb.DecodeResult, result: DecodeOutcome) -> None:
    """Fills a DecodeResult's packed arrays (the layout documented in the proto)."""
    out.ok.extend(result.ok)
    if result.block_copies:
        write_copies(out, result.block_copies)
    grown = result.new_block_ids
    if grown:
        out.grown.extend(grown)
        counts = out.new_block_counts
        ids = out.new_block_ids
        for tables in grown.values():
            for table in tables:
                counts.append(len(table))
                ids.extend(table)


class BlockTableCache:
    """Whole block tables of one pool's requests, kept serialized while unchanged.

    Copying ~70 Python ints into protobuf fields costs ~3 us per request and step, the
    largest service cost of a big decode Step; but a decode step changes a request's table
    only when it crosses a block boundary. So each request's last ``block_ids`` fragment is
    kept as bytes and merged in again while the table is equal.
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[list[list[int]], bytes]] = {}

    def write(self, out: pb.AllocateResult, request_id: str, tables: list[list[int]]) -> None:
        """Appends ``tables`` to ``out.block_ids``."""
        entry = self._entries.get(request_id)
        if entry is None or entry[0] != tables:
            fragment = pb.AllocateResult()
            for ids in tables:
                fragment.block_ids.add().block_ids.extend(ids)
            # Keep our own copy: the comparison must not see later changes to ``tables``.
            entry = ([list(ids) for ids in tables], fragment.SerializeToString())
            self._entries[request_id] = entry
        out.MergeFromString(entry[1])

    def forget(self, request_id: str) -> None:
        self._entries.pop(request_id, None)


def step_response(step_ops: Sequence[operations.Op], outcomes: Sequence[Any],
                  table_cache: BlockTableCache, num_free_blocks: int,
                  tier_copies: tuple[Sequence[TierCopy], Sequence[TierCopy]] = ((), ())
                  ) -> pb.StepResponse:
    """The StepResponse of an applied batch: ``results[i]`` answers ``step_ops[i]``;
    ``tier_copies`` are the (demotions, promotions) the batch planned
    (``Pool.tier_copies``), answered in the order the executor must run them."""
    # Results are filled in place (add() + field writes): building submessages with
    # constructors copies them and costs ~2x on a 256-request decode step.
    response = pb.StepResponse(num_free_blocks=num_free_blocks)
    demotions, promotions = tier_copies
    if demotions:
        write_tier_copies(response.demotions, demotions)
    if promotions:
        write_tier_copies(response.promotions, promotions)
    add_result = response.results.add
    for op, r in zip(step_ops, outcomes):
        if isinstance(op, operations.Decode):
            write_decode(add_result().decode, r)
        elif isinstance(op, operations.Allocate):
            out = add_result().allocate
            out.num_computed_tokens = r.num_computed_tokens
            if r.ok:
                out.ok = True
                out.hit_tokens_used = r.hit_tokens_used
                new_ids = r.new_block_ids
                if any(new_ids):  # most decode steps allocate nothing: send no tables
                    tables = out.new_block_ids
                    for ids in new_ids:
                        tables.add().block_ids.extend(ids)
                if r.block_copies:
                    write_copies(out, r.block_copies)
            if op.include_table:
                table_cache.write(out, op.request_id, r.block_ids)
        elif isinstance(op, (operations.AppendTokens, operations.AddRequest)):
            out = add_result().append_tokens if isinstance(op, operations.AppendTokens) \
                else add_result().add_request
            out.num_tokens = r.num_tokens
            out.num_block_hashes = r.num_block_hashes
        elif isinstance(op, operations.Lookup):
            out = add_result().lookup
            out.hit_tokens = r.hit_tokens
            out.shared_prefix_boundary = r.shared_prefix_boundary
            tables = out.block_ids
            for ids in r.block_ids:
                tables.add().block_ids.extend(ids)
            if r.groups is not None:
                write_residency(out.groups, r.groups)
        elif isinstance(op, operations.Free):
            add_result().free.num_free_blocks = r
            table_cache.forget(op.request_id)
        elif isinstance(op, operations.Preempt):
            add_result().preempt.num_free_blocks = r
        elif isinstance(op, operations.FillPlaceholders):
            add_result().fill_placeholders.num_filled = r
        elif isinstance(op, operations.ResetHostTierOp):
            add_result().reset_host_tier.num_dropped = r
        else:
            add_result().new_step.SetInParent()
    return response
