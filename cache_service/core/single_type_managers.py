"""One manager per layer type: the block table of every request in one KV-cache group.

Each manager keeps, per request, the table of blocks (``req_to_blocks``) and, in
parallel, their ids (``req_to_ids``, null = 0) so whole tables can be returned
without a per-block walk. ``num_cached_block[req]`` counts the leading table entries
already hashed; *its presence marks a request that has been allocated before*
(vLLM's "running" fast path in ``get_num_blocks_to_allocate``).

``find_longest_cache_hit`` is a classmethod: it is stateless and runs jointly for all
groups sharing one spec (a position only counts as a hit if every group has it).
``block_hashes`` passed to it are the request's hashes at the pool's hash block
size; each manager views them at its own block size (the coarse hash of block ``i`` is
the fine hash at ``(i+1)*k - 1``: docs/semantics.md#coarse-hash-views).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, ClassVar, TypeVar, overload

from mypy_extensions import mypyc_attr

from cache_service.core.block import KVCacheBlock
from cache_service.core.block_pool import BlockPool, CachedBlockLookup
from cache_service.core.retention import state_mask, window_mask
from cache_service.core.specs import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    RSWASpec,
    SlidingWindowSpec,
    cdiv,
)

if TYPE_CHECKING:
    from cache_service.core.request import Request

HitBlocks = tuple[list[KVCacheBlock], ...]
#: A block's key in a hit search: its hash, or its position in the routing index's view.
_K = TypeVar("_K", bound=Hashable)


class CoarseHashView(Sequence[_K]):
    """The fine hash list seen at ``k`` times the hash block size (no copying)."""

    __slots__ = ("_fine", "_k")

    def __init__(self, fine: Sequence[_K], k: int) -> None:
        self._fine = fine
        self._k = k

    def __len__(self) -> int:
        return len(self._fine) // self._k

    @overload
    def __getitem__(self, i: int) -> _K: ...

    @overload
    def __getitem__(self, i: slice) -> list[_K]: ...

    def __getitem__(self, i: int | slice) -> _K | list[_K]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        return self._fine[(i + 1) * self._k - 1]


def hash_view(fine: Sequence[_K], hash_block_size: int, block_size: int) -> Sequence[_K]:
    """``fine`` hashes as seen at ``block_size``: themselves when it is the hash block size,
    else a view that joins each run of ``block_size // hash_block_size`` of them into one."""
    k = block_size // hash_block_size
    return fine if k == 1 else CoarseHashView(fine, k)


def _lookup(pool: CachedBlockLookup, block_hash: Hashable,
            group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
    if len(group_ids) == 1:
        block = pool.get_one_cached_block(block_hash, group_ids[0])
        return None if block is None else [block]
    return pool.get_cached_block(block_hash, group_ids)


@mypyc_attr(allow_interpreted_subclasses=True)  # unpickled without __init__: restore.py
class SingleTypeKVCacheManager:
    """Base behaviour (docs/semantics.md#per-group-type-rules); subclasses change skipping,
    hits and allocation."""

    #: False when ``get_num_skipped_tokens`` is always 0 (lets callers skip the call).
    frees_skipped_blocks: ClassVar[bool] = False
    #: Whether hits may end inside a block (at a hash-block boundary) when the pool
    #: enables partial hits (docs/semantics.md#partial-hits-and-copy-on-write).
    supports_partial_hits: ClassVar[bool] = False

    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group_id: int, *,
                 enable_caching: bool, admission_cap: int | None = None) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.pool = pool
        self.group_id = group_id
        self.enable_caching = enable_caching
        self.null_block = pool.null_block
        self.max_admission_blocks = admission_cap
        # Set by the coordinator: hit lengths must be multiples of this.
        self.cache_hit_alignment_tokens = spec.block_size
        # Set by the coordinator (docs/semantics.md#checkpoint-retention): None = dense;
        # 0 = only the replay boundary and shared-prefix junctions; N = also one
        # checkpoint per N-token segment. Only sliding-window and Mamba groups act on it.
        self.retention_interval: int | None = None
        # Set by the coordinator (docs/semantics.md#eagle): hits of this group drop
        # their last block (the drafter recomputes it), and checkpoints are kept where
        # such a hit lands. ``eagle_unit``: the scheduler block size, the step of the
        # replay boundaries of an EAGLE pool.
        self.use_eagle = False
        self.eagle_unit = spec.block_size
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_ids: dict[str, list[int]] = {}
        self.num_cached_block: dict[str, int] = {}
        # Copy-on-write: request -> (table index, shared block) of a hit that ends inside
        # that block, redirected to a private copy by its next allocation; and the
        # (source, copy) pairs queued since the caller last took them.
        self.partial_hit_reqs: dict[str, tuple[int, KVCacheBlock]] = {}
        self.pending_copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []

    def _has_partial_hit(self, new_computed_blocks: Sequence[KVCacheBlock],
                         num_local_computed_tokens: int) -> bool:
        """The adopted hit ends inside one of this group's blocks: that block is shared
        and the request must write into a copy of it."""
        return bool(new_computed_blocks) and num_local_computed_tokens % self.block_size != 0

    def _apply_cow(self, request_id: str, block_idx: int, source: KVCacheBlock,
                   copy: KVCacheBlock) -> None:
        """Put the private ``copy`` in place of the shared ``source`` in the request's
        table and queue the copy. Both stay referenced until the copy has run: the
        source keeps the reference the hit took, the copy gets one more than the table's
        (released by ``KVCacheManager.release_copied_blocks``)."""
        table = self.req_to_blocks[request_id]
        assert table[block_idx] is source and not source.is_null and source.ref_cnt > 0
        table[block_idx] = copy
        self.req_to_ids[request_id][block_idx] = copy.block_id
        self.pending_copies.append((source, copy))
        copy.ref_cnt += 1

    def take_pending_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """The (source, destination) block copies queued since the last call; the caller runs
        them."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # -- skipping ----------------------------------------------------------------------
    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens whose KV is no longer needed once ``num_computed_tokens`` are done."""
        return 0

    # -- capacity prediction (pure) ----------------------------------------------------
    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock],
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   num_tokens_main_model: int,
                                   apply_admission_cap: bool = False) -> int:
        """Free-pool blocks the next allocation would consume. No mutation.
        (docs/semantics.md#capacity-prediction)"""
        required = -(-num_tokens // self.block_size)
        if apply_admission_cap:
            cap = self.max_admission_blocks
            if cap is not None and required > cap:
                required = cap
        table = self.req_to_blocks.get(request_id)
        have = 0 if table is None else len(table)
        if request_id in self.num_cached_block:
            assert not new_computed_blocks, "a running request cannot adopt new hits"
            return required - have if required > have else 0
        skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        local_blocks = len(new_computed_blocks) + have
        new = max(required - max(skipped_blocks, local_blocks), 0)
        evictable = 0
        for block in new_computed_blocks[max(0, skipped_blocks - have):]:
            if block.ref_cnt == 0 and not block.is_null:
                evictable += 1
        if self._has_partial_hit(new_computed_blocks, num_local_computed_tokens):
            new += 1  # the private copy of the shared last block
        return new + evictable

    def allocation_is_noop(self, request_id: str, num_tokens: int, num_tokens_main_model: int,
                           num_cacheable_tokens: int) -> bool:
        """True iff, for a request with a table and no new hits, external or encoder
        tokens, ``get_num_blocks_to_allocate`` would return <= 0, ``allocate_new_blocks``
        would return [] and change nothing, and ``cache_blocks`` with
        ``num_cacheable_tokens`` (already capped at the hashed length; 0 = no caching)
        would hash nothing. Pure. (Out-of-window blocks are not its concern: the caller
        has already removed them, as the general path does first.) The coordinator
        runs this check inline for managers that do not override it: keep both in step."""
        table = self.req_to_blocks.get(request_id)
        # A missing table would be created by allocate_new_blocks: not a no-op.
        if table is None or -(-num_tokens // self.block_size) > len(table) \
                or request_id in self.partial_hit_reqs:
            return False
        return self.num_cached_block.get(request_id, 0) >= num_cacheable_tokens // self.block_size

    # -- adopting hits -----------------------------------------------------------------
    def add_local_computed_blocks(self, request_id: str,
                                  new_computed_blocks: Sequence[KVCacheBlock],
                                  num_local_computed_tokens: int,
                                  num_external_computed_tokens: int) -> None:
        """First allocation with a prefix hit: pin the hit blocks
        (docs/semantics.md#adopting-hits)."""
        table = self.req_to_blocks.get(request_id)
        assert not table, "hits are only adopted by a request without blocks"
        skipped = self.get_num_skipped_tokens(
            num_local_computed_tokens + num_external_computed_tokens) // self.block_size
        kept = list(new_computed_blocks[skipped:]) if skipped > 0 else list(new_computed_blocks)
        if self.enable_caching:
            self.pool.touch(kept)
        else:
            assert not kept, "no hits can exist with prefix caching disabled"
        blocks = [self.null_block] * skipped + kept
        self.req_to_blocks[request_id] = blocks
        self.req_to_ids[request_id] = [0] * skipped + [b.block_id for b in kept]
        self.num_cached_block[request_id] = len(blocks)
        if self._has_partial_hit(kept, num_local_computed_tokens):
            # The last block is shared and only partly ours: the next allocation swaps in
            # a private copy, which caching then hashes once it is full.
            block_idx = num_local_computed_tokens // self.block_size
            self.partial_hit_reqs[request_id] = (block_idx, kept[-1])
            self.num_cached_block[request_id] = block_idx

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int) -> None:
        """Fresh blocks for connector-provided tokens inside the window
        (docs/semantics.md#adopting-hits)."""
        total = num_local_computed_tokens + num_external_computed_tokens
        skipped = self.get_num_skipped_tokens(total)
        if skipped > 0:
            num_external_computed_tokens = min(total - skipped, num_external_computed_tokens)
        if num_external_computed_tokens <= 0:
            return
        self._append_new(request_id, max(0, cdiv(total, self.block_size)
                                         - len(self.req_to_blocks.get(request_id, ()))))

    # -- allocation --------------------------------------------------------------------
    def _append_new(self, request_id: str, n: int) -> list[KVCacheBlock]:
        new = self.pool.get_new_blocks(n)
        table = self.req_to_blocks.get(request_id)
        if table is None:
            self.req_to_blocks[request_id] = list(new)
            self.req_to_ids[request_id] = [b.block_id for b in new]
        else:
            table.extend(new)
            self.req_to_ids[request_id].extend([b.block_id for b in new])
        return new

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> list[KVCacheBlock]:
        """Grow the table to cover ``num_tokens`` slots; returns the new blocks (first
        the private copy of a partial hit's shared block, if there is one)."""
        cow: list[KVCacheBlock] = []
        if self.partial_hit_reqs:
            partial = self.partial_hit_reqs.pop(request_id, None)
            if partial is not None:
                cow = self.pool.get_new_blocks(1)
                self._apply_cow(request_id, partial[0], partial[1], cow[0])
        table = self.req_to_blocks.get(request_id)
        n = -(-num_tokens // self.block_size) - (0 if table is None else len(table))
        if n <= 0:
            if table is None:
                self.req_to_blocks[request_id] = []
                self.req_to_ids[request_id] = []
            return cow
        new = self._append_new(request_id, n)
        return cow + new if cow else new

    # -- caching -----------------------------------------------------------------------
    def block_mask(self, request: Request, start_block: int,
                   end_block: int) -> list[bool] | None:
        """Which blocks of ``[start, end)`` of the request's table may be hashed; None =
        all (docs/semantics.md#cacheable-tokens)."""
        return None

    def reachable_boundaries(self, request: Request) -> tuple[int, ...]:
        """Token positions a later request can resume at, whose checkpoint sparse
        retention keeps: the replay boundary (a resend's hit is capped at
        ``num_prompt_tokens - 1``) and the shared-prefix junction its lookup reported.
        EAGLE (docs/semantics.md#eagle): a hit drops back one scheduler block from where
        it matched, so the boundaries are one block below the resend's and the
        extension's aligned ends, and a junction also keeps the block below it."""
        junction = request.shared_prefix_boundary
        if self.use_eagle:
            unit = self.eagle_unit
            prompt = request.num_prompt_tokens
            resend = (prompt - 1) // unit * unit - unit
            extension = prompt // unit * unit - unit
            boundaries = tuple(sorted({resend if resend > 0 else 0,
                                       extension if extension > 0 else 0}))
            if junction:
                return boundaries + (junction, junction - self.block_size)
            return boundaries
        if junction:
            return (request.num_prompt_tokens - 1, junction)
        return (request.num_prompt_tokens - 1,)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Hash the table's full blocks among the first ``num_tokens`` tokens
        (docs/semantics.md#caching-full-blocks)."""
        hashes = request.block_hashes
        hbs = self.pool.hash_block_size
        num_hashed = len(hashes) * hbs
        num_full = (num_tokens if num_tokens < num_hashed else num_hashed) // self.block_size
        rid = request.request_id
        cached = self.num_cached_block.get(rid, 0)
        if cached >= num_full:
            return
        self.pool.cache_full_blocks(request, self.req_to_blocks[rid],
                                    hash_view(hashes, hbs, self.block_size), cached, num_full,
                                    self.block_size, self.group_id,
                                    self.block_mask(request, cached, num_full))
        self.num_cached_block[rid] = num_full

    # -- freeing -----------------------------------------------------------------------
    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request here and hand back its table without the leading null blocks,
        in table order and still referenced (vLLM's ``pop_blocks_for_free``): the caller
        releases them later, last first. ``free`` is this followed by that release."""
        blocks = self.req_to_blocks.pop(request_id, None) or []
        self.req_to_ids.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if self.partial_hit_reqs:
            self.partial_hit_reqs.pop(request_id, None)
        first = 0
        while first < len(blocks) and blocks[first].is_null:
            first += 1
        return blocks[first:]

    def free(self, request_id: str) -> None:
        """Return the request's blocks, tail first; unknown requests are a no-op."""
        blocks = self.req_to_blocks.pop(request_id, None)
        ids = self.req_to_ids.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if self.partial_hit_reqs:
            self.partial_hit_reqs.pop(request_id, None)
        if blocks:
            assert ids is not None  # the two tables of a request come and go together
            if ids[0]:
                self.pool.free_blocks(reversed(blocks))
                return
            # Skip the leading nulls at C speed: the first non-zero id, then its index
            # (real ids are unique within a table).
            first = next(filter(None, ids), 0)
            if first:
                self.pool.free_blocks(reversed(blocks[ids.index(first):]))

    def _null_out_range(self, request_id: str, first: int, last: int, *,
                        stop_at_null: bool) -> None:
        """Replace blocks ``[first, last)`` by the null block, freeing them last-first.
        ``stop_at_null``: stop at the first entry already null (everything before it
        was released earlier)."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return
        ids = self.req_to_ids[request_id]
        last = min(last, len(blocks))
        null = self.null_block
        freed: list[KVCacheBlock] = []
        for i in range(last - 1, first - 1, -1):
            block = blocks[i]
            if block.is_null:
                if stop_at_null:
                    break
                continue
            freed.append(block)
            blocks[i] = null
            ids[i] = 0
        if freed:
            self.pool.free_blocks(freed)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Release blocks that left the attention window
        (docs/semantics.md#releasing-out-of-window-blocks)."""
        skipped = self.get_num_skipped_tokens(num_computed_tokens)
        if skipped <= 0:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        n = min(skipped // self.block_size, len(blocks))
        if n > 0:
            self._null_out_range(request_id, 0, n, stop_at_null=True)

    def new_step_starts(self) -> None:
        """A new scheduler step starts (no per-step state here; Mamba keeps some)."""
        return None

    # -- hits ----------------------------------------------------------------------------
    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[Hashable], max_length: int,
                               group_ids: Sequence[int], pool: CachedBlockLookup,
                               spec: KVCacheSpec,
                               alignment_tokens: int, drop_eagle_block: bool = False
                               ) -> tuple[HitBlocks, int]:
        """The longest cached prefix of ``block_hashes`` for the groups ``group_ids`` of this
        type, at most ``max_length`` tokens and a multiple of ``alignment_tokens``: the
        hit's blocks per group and its length in tokens (``drop_eagle_block``: less the unit an
        EAGLE hit gives up)."""
        raise NotImplementedError


@mypyc_attr(allow_interpreted_subclasses=True)  # unpickled without __init__: restore.py
class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: a hit is the longest run of cached blocks from the start (with
    partial hits, plus a partial entry inside the next block)."""

    supports_partial_hits = True

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[Hashable], max_length: int,
                               group_ids: Sequence[int], pool: CachedBlockLookup,
                               spec: KVCacheSpec,
                               alignment_tokens: int, drop_eagle_block: bool = False
                               ) -> tuple[HitBlocks, int]:
        """The longest cached prefix of ``block_hashes`` for the groups ``group_ids`` of this
        type, at most ``max_length`` tokens and a multiple of ``alignment_tokens``: the
        hit's blocks per group and its length in tokens (``drop_eagle_block``: less the unit an
        EAGLE hit gives up). Under a finer alignment, the hit
        may end inside the first block not cached whole."""
        bs = spec.block_size
        hashes = hash_view(block_hashes, pool.hash_block_size, bs)
        n = min(max_length // bs, len(hashes))
        if len(group_ids) == 1:
            # Hot path: one group, the map probed directly.
            get = pool.group_map(group_ids[0]).get
            hit: list[KVCacheBlock] = []
            for i in range(n):
                block = get(hashes[i])
                if block is None:
                    break
                if isinstance(block, dict):
                    block = next(iter(block.values()))
                hit.append(block)
            result: HitBlocks = (hit,)
        else:
            result = tuple([] for _ in group_ids)
            for i in range(n):
                cached = pool.get_cached_block(hashes[i], group_ids)
                if cached is None:
                    break
                for lst, block in zip(result, cached):
                    lst.append(block)
        hit_length = len(result[0]) * bs
        if alignment_tokens < bs and bs % alignment_tokens == 0:
            # Partial hits: the hit may go on into the first block not cached whole, up
            # to the longest of its interior boundaries that is cached (a partial entry).
            unit = alignment_tokens
            first = len(result[0]) * (bs // unit)
            last = min(first + bs // unit - 1, max_length // unit, len(block_hashes))
            for fine_idx in range(last - 1, first - 1, -1):
                cached = pool.get_cached_block(block_hashes[fine_idx], group_ids)
                if cached is not None:
                    for lst, block in zip(result, cached):
                        lst.append(block)
                    if not drop_eagle_block:
                        return result, (fine_idx + 1) * unit
                    hit_length = (fine_idx + 1) * unit
                    break
        if drop_eagle_block and hit_length > 0:
            # EAGLE: the drafter needs the hidden states of the tokens before the
            # generation point, so one hit unit (a block, or a hash block when hits
            # may end inside blocks) is given up and recomputed.
            hit_length -= alignment_tokens if alignment_tokens < bs else bs
            hit_length -= hit_length % alignment_tokens
            keep = cdiv(hit_length, bs)
            for lst in result:
                del lst[keep:]
            return result, hit_length
        if hit_length % alignment_tokens:
            hit_length -= hit_length % alignment_tokens
            keep = cdiv(hit_length, bs)
            for lst in result:
                del lst[keep:]
        return result, hit_length

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        super().cache_blocks(request, num_tokens)
        hbs = self.pool.hash_block_size
        if self.block_size == hbs:
            return
        # The prompt's last hash-block boundary (a resend's hit is capped one token
        # short of the prompt; an EAGLE lookup reads the whole prompt, then drops a unit)
        # gets a partial entry when it ends inside a block.
        limit = request.num_prompt_tokens if self.use_eagle else request.num_prompt_tokens - 1
        boundary = min(limit // hbs, len(request.block_hashes)) * hbs
        if boundary == 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        table = self.req_to_blocks[request.request_id]
        idx = boundary // self.block_size
        if idx < len(table):
            self.pool.cache_partial_block(request, table[idx], boundary, self.group_id)


@mypyc_attr(allow_interpreted_subclasses=True)  # unpickled without __init__: restore.py
class RSWAManager(FullAttentionManager):
    """Reference sliding-window attention (docs/semantics.md#rswa): full attention's hits
    and caching; as decoding goes on, the blocks wholly between the prompt's last block
    and the decode window (the last ``rswa_window`` tokens) are freed and left null."""

    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group_id: int, *,
                 enable_caching: bool, admission_cap: int | None = None) -> None:
        super().__init__(spec, pool, group_id, enable_caching=enable_caching,
                         admission_cap=admission_cap)
        assert isinstance(spec, RSWASpec)
        self.rswa_window = spec.rswa_window

    def remove_gap_blocks(self, request_id: str, num_computed_tokens: int,
                          num_prompt_tokens: int) -> None:
        """Free the blocks wholly inside ``[prompt end rounded up to a block, window
        start)``, where the window starts ``rswa_window`` tokens before
        ``num_computed_tokens`` (never inside the prompt); last first, stopping at the
        first one already null (the gap only ever grows upwards)."""
        bs = self.block_size
        first = -(-num_prompt_tokens // bs)
        start = num_computed_tokens - self.rswa_window
        if start < num_prompt_tokens:
            start = num_prompt_tokens
        last = start // bs
        if first < last:
            self._null_out_range(request_id, first, last, stop_at_null=True)


@mypyc_attr(allow_interpreted_subclasses=True)  # unpickled without __init__: restore.py
class CircularBufferManager(SingleTypeKVCacheManager):
    """A ring buffer (docs/semantics.md#circular-buffer): a request's first allocation
    claims exactly one block, which it keeps until it is freed; no hits, no hashing, no
    skipped blocks."""

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock],
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   num_tokens_main_model: int,
                                   apply_admission_cap: bool = False) -> int:
        """1 until the request holds its ring block, then 0."""
        return 0 if self.req_to_blocks.get(request_id) else 1

    def _claim(self, request_id: str) -> list[KVCacheBlock]:
        if self.req_to_blocks.get(request_id):
            return []
        return self._append_new(request_id, 1)

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> list[KVCacheBlock]:
        """The ring block on the first call; nothing afterwards."""
        return self._claim(request_id)

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int) -> None:
        """The ring block, as for any first allocation."""
        self._claim(request_id)

    def add_local_computed_blocks(self, request_id: str,
                                  new_computed_blocks: Sequence[KVCacheBlock],
                                  num_local_computed_tokens: int,
                                  num_external_computed_tokens: int) -> None:
        """Nothing: a ring is never hit (and the request is not marked as allocated)."""
        return None

    def allocation_is_noop(self, request_id: str, num_tokens: int, num_tokens_main_model: int,
                           num_cacheable_tokens: int) -> bool:
        """Once the ring block is held, every allocation leaves this group unchanged."""
        return bool(self.req_to_blocks.get(request_id))

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Nothing: ring blocks are scratch, never hashed."""
        return None

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[Hashable], max_length: int,
                               group_ids: Sequence[int], pool: CachedBlockLookup,
                               spec: KVCacheSpec,
                               alignment_tokens: int, drop_eagle_block: bool = False
                               ) -> tuple[HitBlocks, int]:
        """Never a hit."""
        return tuple([] for _ in group_ids), 0


@mypyc_attr(allow_interpreted_subclasses=True)  # unpickled without __init__: restore.py
class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding window W: only the last ``cdiv(W-1, bs)`` blocks before a hit matter."""

    frees_skipped_blocks = True

    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group_id: int, *,
                 enable_caching: bool, admission_cap: int | None = None) -> None:
        super().__init__(spec, pool, group_id, enable_caching=enable_caching,
                         admission_cap=admission_cap)
        assert isinstance(spec, SlidingWindowSpec)
        self.sliding_window = spec.sliding_window

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens that left the window once ``num_computed_tokens`` are computed."""
        n = num_computed_tokens - self.sliding_window + 1
        return n if n > 0 else 0

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Frees the request's blocks that left the window (replaced by the null block)."""
        # Called on every allocation: return early when the last block that left the
        # window is already null (the common decode case).
        n = (num_computed_tokens - self.sliding_window + 1) // self.block_size
        if n <= 0:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        if n > len(blocks):
            n = len(blocks)
        if not blocks[n - 1].is_null:
            self._null_out_range(request_id, 0, n, stop_at_null=True)

    def block_mask(self, request: Request, start_block: int,
                   end_block: int) -> list[bool] | None:
        # Only the last `need` blocks before a hit boundary are ever looked up. Dense:
        # a boundary at every aligned segment (under hybrid alignment, the others are
        # not worth a cache entry); sparse: see docs/semantics.md#checkpoint-retention.
        retention = self.retention_interval
        return window_mask(self.block_size, self.sliding_window, start_block, end_block,
                           self.cache_hit_alignment_tokens, self.use_eagle, retention,
                           () if retention is None else self.reachable_boundaries(request))

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[Hashable], max_length: int,
                               group_ids: Sequence[int], pool: CachedBlockLookup,
                               spec: KVCacheSpec,
                               alignment_tokens: int, drop_eagle_block: bool = False
                               ) -> tuple[HitBlocks, int]:
        """The longest cached prefix of ``block_hashes`` for the groups ``group_ids`` of this
        type, at most ``max_length`` tokens and a multiple of ``alignment_tokens``: the
        hit's blocks per group and its length in tokens (``drop_eagle_block``: less the unit an
        EAGLE hit gives up). Only the window's blocks before the
        hit's end need to be cached."""
        assert isinstance(spec, SlidingWindowSpec)
        bs = spec.block_size
        hashes = hash_view(block_hashes, pool.hash_block_size, bs)
        need = cdiv(spec.sliding_window - 1, bs)
        # EAGLE: match one block more than the window needs, then drop it.
        if drop_eagle_block:
            need += 1
        end_shift = 0 if drop_eagle_block else 1
        n = max_length // bs
        null = pool.null_block
        result: HitBlocks = tuple([null] * n for _ in group_ids)
        run = 0
        found = False
        # Right to left: the first run of `need` cached blocks (ending on an aligned
        # boundary) is the longest usable hit.
        probe = pool.group_map(group_ids[0]).__contains__
        for i in range(n - 1, -1, -1):
            if not probe(hashes[i]):
                run = 0
                continue
            cached = _lookup(pool, hashes[i], group_ids)
            if cached is None:
                run = 0
                continue
            if run == 0 and bs != alignment_tokens and ((i + end_shift) * bs) % alignment_tokens:
                continue
            for lst, block in zip(result, cached):
                lst[i] = block
            run += 1
            if run >= need:
                for lst in result:
                    del lst[i + run:]
                found = True
                break
        if not found:
            # A run touching block 0 is a hit even if shorter than the window.
            for lst in result:
                del lst[run:]
            while bs != alignment_tokens and (len(result[0]) * bs) % alignment_tokens:
                for lst in result:
                    lst.pop()
        if drop_eagle_block and result[0]:
            for lst in result:
                lst.pop()
            while bs != alignment_tokens and (len(result[0]) * bs) % alignment_tokens:
                for lst in result:
                    lst.pop()
        return result, len(result[0]) * bs


@mypyc_attr(allow_interpreted_subclasses=True)  # unpickled without __init__: restore.py
class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """Chunked local attention: tokens of earlier chunks are never attended again."""

    frees_skipped_blocks = True

    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group_id: int, *,
                 enable_caching: bool, admission_cap: int | None = None) -> None:
        super().__init__(spec, pool, group_id, enable_caching=enable_caching,
                         admission_cap=admission_cap)
        assert isinstance(spec, ChunkedLocalAttentionSpec)
        self.attention_chunk_size = spec.attention_chunk_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens of the chunks before the current one."""
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[Hashable], max_length: int,
                               group_ids: Sequence[int], pool: CachedBlockLookup,
                               spec: KVCacheSpec,
                               alignment_tokens: int, drop_eagle_block: bool = False
                               ) -> tuple[HitBlocks, int]:
        """The longest cached prefix of ``block_hashes`` for the groups ``group_ids`` of this
        type, at most ``max_length`` tokens and a multiple of ``alignment_tokens``: the
        hit's blocks per group and its length in tokens (``drop_eagle_block``: less the unit an
        EAGLE hit gives up). Blocks of earlier chunks are null
        in the hit."""
        assert isinstance(spec, ChunkedLocalAttentionSpec)
        bs = spec.block_size
        if bs != alignment_tokens:
            raise ValueError("chunked local attention needs every group to have its block size")
        hashes = hash_view(block_hashes, pool.hash_block_size, bs)
        chunk = spec.attention_chunk_size
        start_block = (max_length // chunk * chunk if max_length > 0 else 0) // bs
        null = pool.null_block
        # Blocks before the current chunk count as computed without a lookup (null).
        result: HitBlocks = tuple([null] * start_block for _ in group_ids)
        for i in range(start_block, max_length // bs):
            cached = _lookup(pool, hashes[i], group_ids)
            if cached is None:
                break
            for lst, block in zip(result, cached):
                lst.append(block)
        return result, len(result[0]) * bs


@mypyc_attr(allow_interpreted_subclasses=True)  # unpickled without __init__: restore.py
class MambaManager(SingleTypeKVCacheManager):
    """Mamba state. ``"none"``: one state block per request (block size is the model
    length). ``"align"``: positions on the block grid, only the running state is real;
    a state is cached where a chunk ends on a block boundary, and a state cached in
    the current step cannot be adopted until ``new_step_starts``.

    A block that holds the state of a step that ended *inside* it, once a later step
    runs past it, holds a state that is not the state at its boundary: it is recorded
    in ``stale_states`` and never cached. The step's start comes from
    ``note_step_start``. Why: docs/semantics.md#mamba-checkpoints-from-untrusted-schedulers"""

    frees_skipped_blocks = True
    supports_partial_hits = True

    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group_id: int, *,
                 enable_caching: bool, admission_cap: int | None = None) -> None:
        super().__init__(spec, pool, group_id, enable_caching=enable_caching,
                         admission_cap=admission_cap)
        assert isinstance(spec, MambaSpec)
        self.align = spec.mamba_cache_mode == "align"
        self.num_speculative_blocks = spec.num_speculative_blocks
        self.cached_this_step: set[bytes] = set()
        self.last_state_block_idx: dict[str, int] = {}
        self.num_retired_blocks: dict[str, int] = {}
        self.allocated_reqs: set[str] = set()
        self.step_start: dict[str, int] = {}
        self.stale_states: dict[str, set[int]] = {}
        #: vLLM's ``enable_mamba_shared_prefix_checkpoint`` as the manager narrows it
        #: (EAGLE with partial hits): also keep the state at a lookup's junction when a
        #: prompt chunk ends there.
        self.shared_prefix_checkpoint = False

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Every token but the last: only the latest state is needed."""
        return num_computed_tokens - 1

    def note_step_start(self, request_id: str, num_computed_tokens: int) -> None:
        """The tokens computed before the allocation that follows (its state's position)."""
        self.step_start[request_id] = num_computed_tokens

    def _cached_this_step(self, block: KVCacheBlock) -> bool:
        return (block.block_hash is not None and block.group_id == self.group_id
                and block.block_hash in self.cached_this_step)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock],
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   num_tokens_main_model: int,
                                   apply_admission_cap: bool = False) -> int:
        if new_computed_blocks and self._cached_this_step(new_computed_blocks[-1]):
            # Forces "does not fit" so the request waits for the next step.
            return self.pool.num_blocks + 1
        if not self.align:
            return super().get_num_blocks_to_allocate(
                request_id, num_tokens + self.block_size * self.num_speculative_blocks,
                new_computed_blocks, total_computed_tokens, num_local_computed_tokens,
                num_tokens_main_model, apply_admission_cap)
        # Lookahead tokens are ignored: draft models have no Mamba layers.
        required = cdiv(num_tokens_main_model, self.block_size) + self.num_speculative_blocks
        table = self.req_to_blocks.get(request_id)
        new = required - len(new_computed_blocks) - (0 if table is None else len(table))
        partial = (self._has_partial_hit(new_computed_blocks, num_local_computed_tokens)
                   or request_id in self.partial_hit_reqs)
        if partial:
            new = max(new, 0) + 1  # the copy of the state at the partial boundary
        if new > 0:
            cap = 1 if request_id in self.allocated_reqs else 1 + self.num_speculative_blocks
            new = min(new, cap + partial)
        evictable = 0
        for block in new_computed_blocks:
            if block.ref_cnt == 0 and not block.is_null:
                evictable += 1
        # `new` may be negative (an over-allocated table); vLLM sums it as is.
        return new + evictable

    def allocation_is_noop(self, request_id: str, num_tokens: int, num_tokens_main_model: int,
                           num_cacheable_tokens: int) -> bool:
        if not self.align:
            return super().allocation_is_noop(
                request_id, num_tokens + self.block_size * self.num_speculative_blocks,
                num_tokens_main_model, num_cacheable_tokens)
        table = self.req_to_blocks.get(request_id)
        # allocate_new_blocks adds the request to allocated_reqs even when it allocates
        # nothing, so a request not yet there is not a no-op; nor is one whose partial
        # entry is to move to a copy.
        if table is None or request_id not in self.allocated_reqs \
                or request_id in self.partial_hit_reqs:
            return False
        required = cdiv(num_tokens_main_model, self.block_size) + self.num_speculative_blocks
        if required > len(table):
            return False
        # cache_blocks records states only when the base class hashed something.
        return self.num_cached_block.get(request_id, 0) >= num_cacheable_tokens // self.block_size

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> list[KVCacheBlock]:
        if not self.align:
            return super().allocate_new_blocks(
                request_id, num_tokens + self.block_size * self.num_speculative_blocks,
                num_tokens_main_model)
        table = self.req_to_blocks.get(request_id)
        if table is None:
            table = self.req_to_blocks[request_id] = []
            self.req_to_ids[request_id] = []
        ids = self.req_to_ids[request_id]
        spec_blocks = self.num_speculative_blocks
        required = cdiv(num_tokens_main_model, self.block_size) + spec_blocks
        partial = self.partial_hit_reqs.pop(request_id, None) if self.partial_hit_reqs else None
        if required <= len(table) and partial is None:
            self.allocated_reqs.add(request_id)
            return []
        prev_len = len(table)
        was_allocated = request_id in self.allocated_reqs
        start = self.step_start.pop(request_id, None)
        if was_allocated:
            state_idx = self.last_state_block_idx[request_id] = prev_len - 1 - spec_blocks
            if (required > prev_len and start is not None and state_idx >= 0
                    and start != (state_idx + 1) * self.block_size
                    and not table[state_idx].is_null):
                # The table grows past the block holding the state at `start`, which is
                # not its boundary: a foreign scheduler's chunk ran past it.
                self.stale_states.setdefault(request_id, set()).add(state_idx)
        elif prev_len > 0:
            # A new request that hit the cache: its last block holds the hit state.
            self.last_state_block_idx[request_id] = prev_len - 1
        num_skipped = required - spec_blocks - 1
        if prev_len < num_skipped:
            pad = num_skipped - prev_len
            table.extend([self.null_block] * pad)
            ids.extend([0] * pad)
        if was_allocated:
            for idx in range(prev_len - spec_blocks, prev_len):
                if idx >= num_skipped:
                    break
                # Move a speculative scratch block to the end, leaving a null behind.
                block = table[idx]
                table.append(block)
                ids.append(block.block_id)
                table[idx] = self.null_block
                ids[idx] = 0
        n = max(required - len(table), 0)
        new = self.pool.get_new_blocks(n + (partial is not None))
        returned = table[prev_len:]
        if partial is not None:
            idx, source = partial
            copy, new = new[0], new[1:]
            if was_allocated:
                # The request registered this partial entry itself and goes on writing
                # its state block (tables only grow), so the entry moves to the copy,
                # which nothing may hit before the copy has run (next step).
                assert table[idx] is source
                self.pool.move_block_hashes(source, copy)
                self.pending_copies.append((source, copy))
                source.ref_cnt += 1
                if copy.block_hash is not None:
                    self.cached_this_step.add(copy.block_hash)
            else:
                self._apply_cow(request_id, idx, source, copy)
                returned.insert(0, copy)
        table.extend(new)
        ids.extend([b.block_id for b in new])
        self.allocated_reqs.add(request_id)
        returned.extend(new)
        return returned

    def block_mask(self, request: Request, start_block: int,
                   end_block: int) -> list[bool] | None:
        stale = self.stale_states.get(request.request_id)
        mask = None if self.retention_interval is None \
            else self.retained_states(request, start_block, end_block)
        if not stale or not any(start_block <= i < end_block for i in stale):
            return mask
        if mask is None:
            return [i not in stale for i in range(start_block, end_block)]
        return [keep and i not in stale for i, keep in zip(range(start_block, end_block), mask)]

    def retained_states(self, request: Request, start_block: int,
                        end_block: int) -> list[bool] | None:
        """Sparse retention of state checkpoints (docs/semantics.md#checkpoint-retention):
        block ``i`` holds the state after ``(i + 1) * block_size`` tokens; keep one per
        ``retention_interval`` segment (none for 0) plus the state at each reachable
        boundary rounded down to the hit alignment. None = keep all."""
        return state_mask(self.block_size, start_block, end_block,
                          self.cache_hit_alignment_tokens, self.retention_interval,
                          self.reachable_boundaries(request))

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        rid = request.request_id
        before = self.num_cached_block.get(rid, 0)
        super().cache_blocks(request, num_tokens)
        after = self.num_cached_block.get(rid, 0)
        if self.align:
            # As vLLM: every "align" group looks for the prompt's tail entry (it only
            # adds one where the block there is not keyed at that boundary yet).
            tail = self._cache_partial_tail(request, num_tokens)
            if tail is not None:
                self.cached_this_step.add(tail)
        if after > before:
            table = self.req_to_blocks[rid]
            for idx in range(before, after):
                block = table[idx]
                if not block.is_null and block.block_hash is not None:
                    self.cached_this_step.add(block.block_hash)

    def _cache_partial_tail(self, request: Request, num_tokens: int) -> bytes | None:
        """When the computed prefix ends exactly at the prompt's last hash-block boundary
        (``num_prompt_tokens - max(1, lookahead)`` rounded down), inside a block: a partial
        entry for the state there. The request goes on writing that block, so its next
        allocation moves the entry to a copy (``partial_hit_reqs``)."""
        hbs = self.pool.hash_block_size
        if num_tokens <= 0 or num_tokens % hbs:
            return None
        if self.use_eagle:
            # EAGLE's hit drops a hash block from the whole prompt (none is kept for
            # logits): the boundary is one hash block below the prompt's last one.
            boundary = request.num_prompt_tokens // hbs * hbs - hbs
        else:
            # The last token is kept for logits; with lookahead hashing the last L
            # tokens' block has no hash yet, so the boundary is the last hashed one.
            keep = max(1, self.pool.hash_lookahead)
            boundary = (request.num_prompt_tokens - keep) // hbs * hbs
        if num_tokens != boundary and not (
                self.shared_prefix_checkpoint and num_tokens == request.shared_prefix_boundary
                and request.num_computed_tokens < num_tokens <= request.num_prompt_tokens):
            return None
        rid = request.request_id
        table = self.req_to_blocks[rid]
        idx = cdiv(num_tokens, self.block_size) - 1
        if idx >= len(table):
            return None
        source = table[idx]
        if source.is_null or source.hash_num_tokens == num_tokens:
            return None
        key = self.pool.cache_partial_block(request, source, num_tokens, self.group_id)
        if key is not None and num_tokens % self.block_size:
            self.partial_hit_reqs[rid] = (idx, source)
            self.num_cached_block[rid] = idx
        return key

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        if not self.align:
            super().remove_skipped_blocks(request_id, num_computed_tokens)
            return
        skipped = num_computed_tokens - 1
        blocks = self.req_to_blocks.get(request_id)
        if skipped > 0 and blocks:
            last = min(skipped // self.block_size, len(blocks))
            first = self.num_retired_blocks.get(request_id, 0)
            if first < last:
                # Prefill leaves null gaps between states: skip nulls, do not stop.
                self._null_out_range(request_id, first, last, stop_at_null=False)
                self.num_retired_blocks[request_id] = last
        # The state block of two allocations ago was only needed as the copy source
        # of the previous step's state; release it.
        idx = self.last_state_block_idx.get(request_id)
        if idx is not None and idx < cdiv(num_computed_tokens, self.block_size) - 1:
            blocks = self.req_to_blocks[request_id]
            block = blocks[idx]
            if not block.is_null:
                self.pool.free_blocks([block])
                blocks[idx] = self.null_block
                self.req_to_ids[request_id][idx] = 0

    def _forget(self, request_id: str) -> None:
        self.allocated_reqs.discard(request_id)
        self.last_state_block_idx.pop(request_id, None)
        self.num_retired_blocks.pop(request_id, None)
        self.step_start.pop(request_id, None)
        self.stale_states.pop(request_id, None)

    def free(self, request_id: str) -> None:
        """Forgets the request's per-request state here, then frees its blocks."""
        self._forget(request_id)
        super().free(request_id)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forgets the request's per-request state here, then hands back its blocks."""
        self._forget(request_id)
        return super().pop_blocks_for_free(request_id)

    def new_step_starts(self) -> None:
        """A new scheduler step starts: states cached during the last one may serve hits now (a
        hit on a state cached in the same step waits for the next)."""
        self.cached_this_step.clear()

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[Hashable], max_length: int,
                               group_ids: Sequence[int], pool: CachedBlockLookup,
                               spec: KVCacheSpec,
                               alignment_tokens: int, drop_eagle_block: bool = False
                               ) -> tuple[HitBlocks, int]:
        """The longest cached prefix of ``block_hashes`` for the groups ``group_ids`` of this
        type, at most ``max_length`` tokens and a multiple of ``alignment_tokens``: the
        hit's blocks per group and its length in tokens (``drop_eagle_block``: less the unit an
        EAGLE hit gives up). The hit is the last cached state
        checkpoint."""
        assert isinstance(spec, MambaSpec)
        bs = spec.block_size
        null = pool.null_block
        if alignment_tokens < bs and bs % alignment_tokens == 0:
            # Partial hits: any hash-block boundary may hold a cached state (a full
            # block's key is the fine hash at its end, so those are found too).
            unit, k = alignment_tokens, bs // alignment_tokens
            for fine_idx in range(min(max_length // unit, len(block_hashes)) - 1, -1, -1):
                cached = _lookup(pool, block_hashes[fine_idx], group_ids)
                if cached is not None:
                    pad = fine_idx // k
                    return tuple([null] * pad + [block] for block in cached), \
                        (fine_idx + 1) * unit
            return tuple([] for _ in group_ids), 0
        hashes = hash_view(block_hashes, pool.hash_block_size, bs)
        # Right to left: only the state at the hit boundary is needed.
        n = min(max_length // bs, len(hashes))
        probe = pool.group_map(group_ids[0]).__contains__
        for i in range(n - 1, -1, -1):
            if not probe(hashes[i]):
                continue  # a miss in the first group is a miss
            cached = _lookup(pool, hashes[i], group_ids)
            if cached is None:
                continue
            if bs != alignment_tokens and ((i + 1) * bs) % alignment_tokens:
                continue
            return tuple([null] * i + [block] for block in cached), (i + 1) * bs
        return tuple([] for _ in group_ids), 0


@mypyc_attr(allow_interpreted_subclasses=True)  # unpickled without __init__: restore.py
class CrossAttentionManager(SingleTypeKVCacheManager):
    """Encoder-decoder cross attention: a static allocation sized by encoder tokens;
    never prefix cached (encoder-decoder models run with caching off)."""

    def add_local_computed_blocks(self, request_id: str,
                                  new_computed_blocks: Sequence[KVCacheBlock],
                                  num_local_computed_tokens: int,
                                  num_external_computed_tokens: int) -> None:
        """Nothing to add: cross attention has no prefix hits."""
        assert not new_computed_blocks, "cross attention has no prefix hits"

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int) -> None:
        """Nothing to allocate: cross attention has no external hits."""
        return None

    def allocation_is_noop(self, request_id: str, num_tokens: int, num_tokens_main_model: int,
                           num_cacheable_tokens: int) -> bool:
        """Never: the blocks are sized by encoder tokens, so every allocation takes the general
        path."""
        # Sized by encoder tokens, not by num_tokens: always take the general path.
        return False

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Raises ValueError: cross-attention blocks are never cached."""
        raise ValueError("cross-attention blocks are never cached")

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[Hashable], max_length: int,
                               group_ids: Sequence[int], pool: CachedBlockLookup,
                               spec: KVCacheSpec,
                               alignment_tokens: int, drop_eagle_block: bool = False
                               ) -> tuple[HitBlocks, int]:
        """Raises NotImplementedError: cross attention is never prefix cached."""
        raise NotImplementedError("cross attention does not support prefix caching")


def manager_class_for(spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    """The manager type of a group spec (vLLM's registry, docs/semantics.md#managers-per-type)."""
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return ChunkedLocalAttentionManager
    if isinstance(spec, MambaSpec):
        return MambaManager
    if isinstance(spec, CrossAttentionSpec):
        return CrossAttentionManager
    if isinstance(spec, CircularBufferSpec):
        return CircularBufferManager
    if isinstance(spec, RSWASpec):  # before its base, full attention
        return RSWAManager
    if isinstance(spec, FullAttentionSpec):
        return FullAttentionManager
    raise TypeError(f"no manager for spec type {type(spec).__name__}")
