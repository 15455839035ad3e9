"""What the client returns: dataclasses and lazy views over response messages (never
protobuf messages), and the functions that build them from responses."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.enums import LAYER_KINDS, MAMBA_CACHE_MODES

R = TypeVar("R")


@dataclass(frozen=True)
class AddResult:
    num_tokens: int
    num_block_hashes: int


@dataclass(frozen=True)
class AppendResult:
    num_tokens: int
    num_block_hashes: int


@dataclass(frozen=True)
class BlockCopy:
    """Copy block ``src_block_id`` into ``dst_block_id`` in group ``group`` (every layer)
    before the step's forward pass: a partial prefix hit's copy-on-write."""

    group: int
    src_block_id: int
    dst_block_id: int


@dataclass(frozen=True)
class TierCopy:
    """One copy between the device pool and the host tier (docs/protocol.md#host-tier), in
    every layer of group ``group``: a demotion copies device block ``block_id`` into host
    slot ``host_slot``, a promotion host slot ``host_slot`` into device block ``block_id``."""

    group: int
    block_id: int
    host_slot: int


class _MessageView:
    """A read-only view over one result message; subclasses convert fields on access, so a
    scheduler pays only for what it reads."""

    __slots__ = ("_m",)

    def __init__(self, message: Any) -> None:
        self._m = message


class LookupResult(_MessageView):
    """A lookup's hit. A view over the response message: tables convert on access."""

    __slots__ = ()

    @property
    def hit_tokens(self) -> int:
        """Cached prefix length in tokens (0: no hit)."""
        return self._m.hit_tokens

    @property
    def block_ids(self) -> list[list[int]]:
        """The hit's blocks per group, in order; -1 where a position is held only in the
        host tier (the allocate that uses the hit promotes it into a fresh block)."""
        return tables_from(self._m.block_ids)

    @property
    def shared_prefix_boundary(self) -> int:
        """Where a prefix shared with cached data, but not wholly cached, ends (Marconi
        style; 0: none)."""
        return self._m.shared_prefix_boundary

    def __repr__(self) -> str:
        return (f"LookupResult(hit_tokens={self.hit_tokens}, block_ids={self.block_ids}, "
                f"shared_prefix_boundary={self.shared_prefix_boundary})")


class AllocateResult(_MessageView):
    """``ok=False`` is "no room" (``new_block_ids`` None): preempt someone and retry.
    ``block_ids`` is the whole table per group (empty if the op set ``block_table=False``).
    A view over the response message: tables convert on access, so a scheduler that reads
    only what it needs pays only for that."""

    __slots__ = ()

    @property
    def ok(self) -> bool:
        """False: no room (nothing allocated); preempt someone and retry."""
        return self._m.ok

    @property
    def new_block_ids(self) -> list[list[int]] | None:
        """Per group; ``[]`` when no group got a block; None when not ok."""
        return tables_from(self._m.new_block_ids) if self._m.ok else None

    @property
    def block_ids(self) -> list[list[int]]:
        """The request's whole block table per group (empty with ``block_table=False``)."""
        return tables_from(self._m.block_ids)

    @property
    def num_computed_tokens(self) -> int:
        """The request's computed tokens after this op (the hit included)."""
        return self._m.num_computed_tokens

    @property
    def hit_tokens_used(self) -> int:
        """Tokens of the lookup's hit this allocation took over (0 without a hit)."""
        return self._m.hit_tokens_used

    @property
    def block_copies(self) -> list[BlockCopy]:
        """Copies to run, in order, before this step's forward pass (partial hits)."""
        return copies_from(self._m.block_copies)

    def __repr__(self) -> str:
        return (f"AllocateResult(ok={self.ok}, new_block_ids={self.new_block_ids}, "
                f"block_ids={self.block_ids}, num_computed_tokens={self.num_computed_tokens}, "
                f"hit_tokens_used={self.hit_tokens_used})")


class DecodeResult(_MessageView):
    """A decode op's outcome, a view over the packed response. ``ok[i]`` answers
    ``request_ids[i]`` (False = no room; nothing was allocated for it, its token stays
    appended); a successful request's computed tokens grew by one. ``new_block_ids`` maps
    the index of each request that got blocks to its new blocks per group (usually few).
    ``demotions`` / ``promotions``: the host tier's copies of the Step when this is the
    answer of ``client.decode()`` (a Step of this one op); in a :class:`StepResult` they
    are the StepResult's."""

    __slots__ = ("_step",)

    def __init__(self, message: Any, step: pb.StepResponse | None = None) -> None:
        super().__init__(message)
        self._step = step

    @property
    def demotions(self) -> list[TierCopy]:
        """Device -> host copies of ``client.decode()``'s Step, to run first (see
        :class:`StepResult`); empty without a host tier or inside a StepResult."""
        return tier_copies_from(self._step.demotions) if self._step is not None else []

    @property
    def promotions(self) -> list[TierCopy]:
        """Host -> device copies of ``client.decode()``'s Step, after the demotions."""
        return tier_copies_from(self._step.promotions) if self._step is not None else []

    @property
    def ok(self) -> list[bool]:
        """``ok[i]``: ``request_ids[i]`` got its slot (False: no room; its token stays
        appended)."""
        return list(self._m.ok)

    @property
    def all_ok(self) -> bool:
        """Every request got its slot (cheap: no list is built)."""
        return all(self._m.ok)

    @property
    def failed(self) -> list[int]:
        """Indices of the requests that found no room."""
        return [i for i, ok in enumerate(self._m.ok) if not ok]

    @property
    def new_block_ids(self) -> dict[int, list[list[int]]]:
        """Index of each request that got new blocks -> its new blocks per group (most decode
        steps grow few requests)."""
        m = self._m
        grown = m.grown
        if not grown:
            return {}
        counts = m.new_block_counts
        ids = m.new_block_ids
        groups = len(counts) // len(grown)
        out: dict[int, list[list[int]]] = {}
        pos = k = 0
        for index in grown:
            tables = out[index] = []
            for count in counts[k: k + groups]:
                tables.append(list(ids[pos: pos + count]))
                pos += count
            k += groups
        return out

    @property
    def block_copies(self) -> list[BlockCopy]:
        """Copies to run, in order, before this step's forward pass (partial hits)."""
        return copies_from(self._m.block_copies)

    def __repr__(self) -> str:
        return f"DecodeResult(ok={self.ok}, new_block_ids={self.new_block_ids})"


@dataclass(frozen=True)
class FreeResult:
    num_free_blocks: int


@dataclass(frozen=True)
class PreemptResult:
    num_free_blocks: int


@dataclass(frozen=True)
class NewStepResult:
    pass


@dataclass(frozen=True)
class FillResult:
    num_filled: int


@dataclass(frozen=True)
class ResetHostTierResult:
    """Host slots that held a block and were dropped (0 on a pool without a tier)."""

    num_dropped: int


OpResult = (AddResult | LookupResult | AllocateResult | AppendResult | FreeResult
            | PreemptResult | NewStepResult | DecodeResult | FillResult | ResetHostTierResult)


@dataclass(frozen=True)
class StepResult:
    """``results[i]`` answers ``ops[i]``. With a host tier, ``demotions`` then
    ``promotions`` are the copies to run, in order, before this step's block copies and
    forward pass (docs/protocol.md#host-tier); both empty without a tier."""

    results: list[OpResult]
    num_free_blocks: int
    demotions: list[TierCopy] = dataclasses.field(default_factory=list)
    promotions: list[TierCopy] = dataclasses.field(default_factory=list)

    def result(self, index: int, kind: type[R]) -> R:
        """``results[index]`` as the answer kind the caller expects (typed); TypeError
        naming both kinds when op ``index`` got another kind of answer."""
        answer = self.results[index]
        if not isinstance(answer, kind):
            raise TypeError(f"results[{index}] is a {type(answer).__name__}, "
                            f"not a {kind.__name__}")
        return answer


@dataclass(frozen=True)
class GroupInfo:
    index: int
    layer_names: list[str]
    kind: str
    block_size: int
    sliding_window: int
    attention_chunk_size: int
    page_size_bytes: int
    #: Mamba groups: ``"none"`` or ``"align"`` (docs/semantics.md); ``""`` for the others.
    mamba_cache_mode: str = ""


@dataclass(frozen=True)
class PoolInfo:
    """A pool's configuration (``raw`` is the PoolConfig message)."""

    pool_id: str
    num_blocks: int
    groups: list[GroupInfo]
    page_size_bytes: int
    scheduler_block_size: int
    hash_block_size: int
    created: bool
    raw: pb.PoolConfig
    #: Bytes of one block in ONE layer (``page_size_bytes`` is per block id, all layers).
    layer_page_size_bytes: int = 0
    #: The life of the pool's state: changes only when the state was not preserved.
    incarnation: int = 0


@dataclass(frozen=True)
class RequestState:
    block_ids: list[list[int]]
    num_computed_tokens: int
    num_tokens: int
    num_block_hashes: int
    status: str
    num_preemptions: int
    #: Of ``num_tokens``, the trailing placeholders not filled yet.
    num_placeholder_tokens: int = 0


@dataclass(frozen=True)
class PoolStats:
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    usage: float
    num_requests: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    evictions: int
    allocation_failures: int
    preemptions: int
    num_cached_blocks_per_group: list[int]
    last_event_sequence: int
    #: Distinct blocks held by prefix pins, the pool's bound on them, live pins,
    #: PinPrefix calls refused by a bound or quota, and the pinned blocks charged to the
    #: pool's tenant over all its pools (what its pinned-block quota bounds).
    num_pinned_blocks: int = 0
    max_pinned_blocks: int = 0
    num_pins: int = 0
    pin_refusals: int = 0
    tenant_pinned_blocks: int = 0
    #: The host tier (docs/protocol.md#host-tier): its slots per group (0 = none), the
    #: slots holding a block (all groups), and blocks demoted, promoted and dropped from it.
    host_tier_blocks: int = 0
    host_tier_used_blocks: int = 0
    host_demotions: int = 0
    host_promotions: int = 0
    host_evictions: int = 0


@dataclass(frozen=True)
class PinInfo:
    """One prefix pin (answer of ``pin_prefix`` / ``renew_pin`` / ``drop_pin``):
    ``prefix_tokens`` is the pinned prefix's length (the hit cap of its lookup),
    ``hit_tokens`` of it cached and held now, ``num_blocks`` held over all groups;
    ``growing``: part of the prefix is not cached yet and is taken as it gets cached;
    ``expires_at`` is Unix time in seconds."""

    pin_id: str
    prefix_tokens: int
    hit_tokens: int
    num_blocks: int
    growing: bool
    expires_at: float


@dataclass(frozen=True)
class Event:
    """One KV event. ``kind`` is "block_stored", "block_removed" or "all_blocks_cleared";
    hashes are the documented 64-bit integers."""

    sequence: int
    kind: str
    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: list[int] | None = None
    block_size: int = 0
    group_idx: int = 0
    spec_kind: str = ""
    sliding_window: int = 0
    lora_name: str = ""
    prefix_lengths: list[int] | None = None
    start_token: int = 0
    #: The pool incarnation the sequence number belongs to.
    incarnation: int = 0
    #: block_stored: the session whose Step added the storing request ("" = none).
    session_id: str = ""
    #: Where the block is: "GPU" (the device pool) or "CPU" (the host tier); "" for
    #: all_blocks_cleared.
    medium: str = ""
    #: block_stored with lookahead hashing: per stored block, the tokens after it that
    #: its hash covers (None without lookahead).
    lookahead_token_ids: list[list[int]] | None = None
    #: block_stored: the storing request's LoRA int id (None = none).
    lora_id: int | None = None


def tables_from(tables: Iterable[pb.BlockTable]) -> list[list[int]]:
    """Block tables as plain lists, one per group."""
    return [list(t.block_ids) for t in tables]


def copies_from(copies: Iterable[pb.BlockCopy]) -> list[BlockCopy]:
    """The block copies of an answer, in the order to run them."""
    return [BlockCopy(c.group, c.src_block_id, c.dst_block_id) for c in copies]


def tier_copies_from(copies: Iterable[pb.TierCopy]) -> list[TierCopy]:
    """The demotions or promotions of a StepResponse, in the order to run them."""
    return [TierCopy(c.group, c.block_id, c.host_slot) for c in copies]


def op_result_from(r: pb.OpResult) -> OpResult:
    """The typed result of one op's answer (by the op kind it answers)."""
    kind = r.WhichOneof("result")
    if kind == "allocate":
        return AllocateResult(r.allocate)
    if kind == "decode":
        return DecodeResult(r.decode)
    if kind == "add_request":
        return AddResult(r.add_request.num_tokens, r.add_request.num_block_hashes)
    if kind == "append_tokens":
        return AppendResult(r.append_tokens.num_tokens, r.append_tokens.num_block_hashes)
    if kind == "lookup":
        return LookupResult(r.lookup)
    if kind == "free":
        return FreeResult(r.free.num_free_blocks)
    if kind == "preempt":
        return PreemptResult(r.preempt.num_free_blocks)
    if kind == "fill_placeholders":
        return FillResult(r.fill_placeholders.num_filled)
    if kind == "reset_host_tier":
        return ResetHostTierResult(r.reset_host_tier.num_dropped)
    return NewStepResult()


def step_result(resp: pb.StepResponse) -> StepResult:
    """The typed results of a StepResponse, one per op in order, the free block count and
    the host tier's copies."""
    return StepResult([op_result_from(r) for r in resp.results], resp.num_free_blocks,
                      tier_copies_from(resp.demotions), tier_copies_from(resp.promotions))


def _mamba_cache_mode(group: pb.KVCacheGroup) -> str:
    if LAYER_KINDS.name(group.kind) != "mamba":
        return ""
    return MAMBA_CACHE_MODES.name(group.mamba_cache_mode) or "none"  # UNSPECIFIED = none


def pool_info_from(cfg: pb.PoolConfig, created: bool = False) -> PoolInfo:
    """A PoolInfo of a PoolConfig (``created``: RegisterPool made it just now)."""
    return PoolInfo(
        cfg.pool_id, cfg.num_blocks,
        [GroupInfo(g.index, list(g.layer_names), LAYER_KINDS.name(g.kind), g.block_size,
                   g.sliding_window, g.attention_chunk_size, g.page_size_bytes,
                   _mamba_cache_mode(g))
         for g in cfg.groups],
        cfg.page_size_bytes, cfg.scheduler_block_size, cfg.hash_block_size, created, cfg,
        cfg.layer_page_size_bytes, cfg.incarnation)


def stats_from(s: pb.PoolStats) -> PoolStats:
    """PoolStats of the protocol message."""
    return PoolStats(s.num_blocks, s.num_free_blocks, s.num_cached_blocks, s.usage,
                     s.num_requests, s.prefix_cache_queries, s.prefix_cache_hits, s.evictions,
                     s.allocation_failures, s.preemptions,
                     [g.num_cached_blocks for g in s.groups], s.last_event_sequence,
                     s.num_pinned_blocks, s.max_pinned_blocks, s.num_pins, s.pin_refusals,
                     s.tenant_pinned_blocks, s.host_tier_blocks, s.host_tier_used_blocks,
                     s.host_demotions, s.host_promotions, s.host_evictions)


def pin_from(p: pb.PinInfo) -> PinInfo:
    """PinInfo of the protocol message."""
    return PinInfo(p.pin_id, p.prefix_tokens, p.hit_tokens, p.num_blocks, p.growing,
                   p.expires_at_unix_seconds)


def event_from(e: pb.KVEvent) -> Event:
    """The Event of one KVEvent, with its pool incarnation."""
    return dataclasses.replace(_event_from(e), incarnation=e.incarnation)


def _event_from(e: pb.KVEvent) -> Event:
    kind = e.WhichOneof("event")
    if kind == "block_stored":
        s = e.block_stored
        return Event(e.sequence, kind, list(s.block_hashes),
                     s.parent_block_hash if s.HasField("parent_block_hash") else None,
                     list(s.token_ids), s.block_size, s.group_idx,
                     LAYER_KINDS.name(s.kind), s.sliding_window, s.lora_name,
                     list(s.prefix_lengths), s.start_token, session_id=s.session_id,
                     medium=s.medium,
                     lookahead_token_ids=[list(t.token_ids) for t in s.lookahead_token_ids]
                     or None, lora_id=s.lora_id if s.HasField("lora_id") else None)
    if kind == "block_removed":
        return Event(e.sequence, kind, list(e.block_removed.block_hashes),
                     group_idx=e.block_removed.group_idx, medium=e.block_removed.medium)
    return Event(e.sequence, "all_blocks_cleared", [])


def request_state_from(r: pb.GetRequestResponse) -> RequestState:
    """The RequestState of a GetRequest answer."""
    return RequestState(tables_from(r.block_ids), r.num_computed_tokens, r.num_tokens,
                        r.num_block_hashes, r.status, r.num_preemptions,
                        r.num_placeholder_tokens)


def hits_from(resp: pb.PeekPrefixResponse, include_host: bool = False) -> dict[str, int]:
    """Pool id -> cached prefix length in tokens, for every pool asked; ``include_host``:
    the hit across both tiers (``host_hit_tokens``; a pool without a host tier answers
    its device hit)."""
    if include_host:
        return {h.pool_id: max(h.hit_tokens, h.host_hit_tokens) for h in resp.hits}
    return {h.pool_id: h.hit_tokens for h in resp.hits}
