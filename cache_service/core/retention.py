"""Which blocks of a request's table are worth a cache entry: vLLM 0.33's static
``reachable_block_mask`` (docs/semantics.md#checkpoint-retention), as one pure function.

A block is *reachable* when some later lookup could use it. Full attention hits any
prefix, so every full block is (no mask). A sliding-window hit only reads the ``need``
blocks that end on its boundary (``cdiv(window - 1, block_size)``, one more with EAGLE,
whose hit matches one block past the boundary and drops it), and a Mamba hit only the one
state block ending there; boundaries are multiples of the hit alignment (dense: every
one), of ``retention_interval`` (sparse with an interval), and the reachable boundaries
given (the replay boundary and shared-prefix junctions).

The managers hash through it (``SlidingWindowManager.block_mask``,
``MambaManager.retained_states``), and anything outside a pool can ask it the same
question without one: an offloading connector that keeps only what the allocator would
keep, or a client predicting which blocks a pool will report as stored. It depends on
nothing but the spec.
"""

from __future__ import annotations

from collections.abc import Sequence

from cache_service.core.specs import (
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)


def reachable_block_mask(spec: KVCacheSpec, start_block: int, end_block: int,
                         alignment_tokens: int | None, *, use_eagle: bool = False,
                         retention_interval: int | None = None,
                         reachable_boundaries: Sequence[int] = (),
                         final_segment_end_block: int | None = None) -> list[bool] | None:
    """Per block of ``[start_block, end_block)`` of one table, whether caching keeps it;
    None = every block. ``retention_interval``: None = dense, 0 = only the
    ``reachable_boundaries``, N = also one boundary per N tokens. ``final_segment_end_block``
    (sliding window without EAGLE): the exclusive end of the request's last, possibly
    unfinished, segment, whose tail is then kept too (vLLM's connectors pass it; the
    allocator's own caching does not). Kinds other than sliding window and Mamba keep
    every block."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = spec.first_spec
    if alignment_tokens is None:
        return None
    if isinstance(spec, SlidingWindowSpec):
        return window_mask(spec.block_size, spec.sliding_window, start_block, end_block,
                           alignment_tokens, use_eagle, retention_interval,
                           reachable_boundaries, final_segment_end_block)
    if isinstance(spec, MambaSpec):
        return state_mask(spec.block_size, start_block, end_block, alignment_tokens,
                          retention_interval, reachable_boundaries)
    return None


def window_mask(bs: int, window: int, start_block: int, end_block: int, alignment: int,
                use_eagle: bool, retention: int | None, boundaries: Sequence[int],
                final_end: int | None = None) -> list[bool] | None:
    """:func:`reachable_block_mask` of a sliding window of ``window`` tokens in blocks of
    ``bs`` (the managers call it with their own attributes, on every block they cache)."""
    if alignment % bs:
        # Boundaries inside blocks cannot be told apart block by block: keep everything
        # rather than drop a block some hit could read.
        return None
    need = -(-(window - 1) // bs)
    # EAGLE: one more block, and each run ends one block later (the block its hit drops).
    shift = 0
    if use_eagle:
        need += 1
        shift = 1
    segment = alignment if retention is None else retention
    mask = [False] * (end_block - start_block)
    if segment:
        per_segment = segment // bs
        if need >= per_segment:
            return None  # the runs of neighbouring boundaries overlap: all are kept
        low = per_segment - need
        if shift:
            for i in range(max(start_block, shift), end_block):
                if (i - shift) % per_segment >= low:
                    mask[i - start_block] = True
        else:  # the common case, built in one pass (caching calls it on every new block)
            mask = [i % per_segment >= low for i in range(start_block, end_block)]
        if final_end is not None and not use_eagle and final_end % per_segment:
            # The unfinished last segment: keep the run that ends where it ends.
            tail_start = max(final_end - final_end % per_segment, final_end - need)
            for i in range(max(start_block, tail_start), min(end_block, final_end)):
                mask[i - start_block] = True
    if retention is not None:
        for boundary in boundaries:
            end = boundary // alignment * alignment // bs + shift
            for j in range(max(start_block, end - need), min(end_block, end)):
                mask[j - start_block] = True
    return mask


def state_mask(bs: int, start_block: int, end_block: int, alignment: int,
               retention: int | None, boundaries: Sequence[int]) -> list[bool] | None:
    """:func:`reachable_block_mask` of Mamba states in blocks of ``bs`` tokens: block ``i``
    holds the state after ``(i + 1) * bs`` tokens; keep one per
    ``retention`` segment (none for 0) and the one at each boundary rounded down to the
    alignment. None: dense, or a segment of at most one block (every state is kept)."""
    if retention is None:
        return None
    mask = [False] * (end_block - start_block)
    if retention:
        per_segment = retention // bs
        if per_segment <= 1:
            return None
        first = (start_block + per_segment) // per_segment * per_segment - 1
        for i in range(first - start_block, len(mask), per_segment):
            mask[i] = True
    for boundary in boundaries:
        idx = boundary // alignment * alignment // bs - 1
        if start_block <= idx < end_block:
            mask[idx - start_block] = True
    return mask
