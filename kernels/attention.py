"""Paged attention over a block-table KV cache (full or sliding window, GQA) and the KV-cache write.

Cache layout per layer: ``k_cache [num_blocks, block_size, Hkv, D]``, ``v_cache [num_blocks,
block_size, Hkv, Dv]``; token position ``p`` of request ``b`` lives in block
``block_tables[b, p // block_size]`` at offset ``p % block_size``. Block 0 is the null block: table
entries wholly before a sliding window may point at it, so no implementation reads them.

The public functions validate their arguments (a ValueError names the bad field and nothing is
written) and dispatch: CUDA -> `kernels.triton_attention`, CPU -> the vectorized torch code below,
``impl="reference"`` -> `kernels.reference`. All math is fp32; outputs take the query's dtype.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import reference
from kernels._dispatch import load_triton_module, select_impl

# Query rows per prefill tile in the torch path: bounds the fp32 score matrix per step
# (Hq * rows * keys * 4 bytes) and lets a sliding window gather only the keys a tile can see.
_PREFILL_TILE = 256


def write_kv_cache(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, *,
                   impl: str | None = None) -> None:
    """Write ``key [T, Hkv, D]`` / ``value [T, Hkv, Dv]`` into the paged caches in place.

    ``slot_mapping`` (int [T]) holds ``block_id * block_size + offset`` per token; a negative slot
    marks a padding token that is skipped. Values are cast to the cache dtype.
    """
    _check_write_args(key, value, k_cache, v_cache, slot_mapping)
    chosen = select_impl(impl, key, value, k_cache, v_cache, slot_mapping)
    if chosen == "reference":
        reference.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    elif chosen == "torch":
        _write_kv_cache_torch(key, value, k_cache, v_cache, slot_mapping)
    else:
        load_triton_module("triton_attention").write_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                    query_start_loc: Tensor, *, scale: float, sliding_window: int | None = None,
                    softcap: float | None = None, impl: str | None = None) -> Tensor:
    """Causal attention of packed queries ``q [T, Hq, D]`` over the paged K/V of B requests.

    Request b owns query rows ``query_start_loc[b] : query_start_loc[b+1]`` and has
    ``seq_lens[b]`` keys in the cache, this step's included (write them first with
    `write_kv_cache`). Query i of the request is at position ``seq_lens[b] - q_len + i``
    (bottom-right causal) and sees keys ``pos - W + 1 .. pos`` with ``sliding_window=W``, else
    ``0 .. pos``. Query head h uses KV head ``h // (Hq // Hkv)``. ``softcap`` applies
    ``softcap * tanh(s / softcap)`` to the scaled scores. Requests with no queries read nothing;
    rows after ``query_start_loc[-1]`` (batch padding) come back as zeros. Returns ``[T, Hq, Dv]``.
    """
    _check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                          sliding_window, softcap)
    chosen = select_impl(impl, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    kwargs: dict[str, Any] = dict(scale=float(scale), sliding_window=sliding_window, softcap=softcap)
    if chosen == "reference":
        return reference.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, **kwargs)
    if chosen == "torch":
        return _paged_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, **kwargs)
    module = load_triton_module("triton_attention")
    return module.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, **kwargs)


# --------------------------------------------------------------------------------------------------
# Validation. Shape and dtype checks always; checks that read tensor values only on CPU, where
# they cost no device synchronisation.
# --------------------------------------------------------------------------------------------------

def _require(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise ValueError(f"{field}: {message}")


def _check_cache_pair(k_cache: Tensor, v_cache: Tensor) -> None:
    _require(k_cache.dim() == 4, "k_cache",
             f"expected [num_blocks, block_size, Hkv, D], got shape {tuple(k_cache.shape)}")
    _require(v_cache.dim() == 4, "v_cache",
             f"expected [num_blocks, block_size, Hkv, Dv], got shape {tuple(v_cache.shape)}")
    _require(k_cache.shape[:3] == v_cache.shape[:3], "v_cache",
             f"blocks, block size and heads must match k_cache {tuple(k_cache.shape[:3])}, "
             f"got {tuple(v_cache.shape[:3])}")
    _require(k_cache.is_floating_point() and v_cache.is_floating_point(), "k_cache", "caches must be floating point")


def _check_write_args(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    _check_cache_pair(k_cache, v_cache)
    num_blocks, block_size, num_kv_heads, head_size = k_cache.shape
    _require(key.dim() == 3 and tuple(key.shape[1:]) == (num_kv_heads, head_size), "key",
             f"expected [T, {num_kv_heads}, {head_size}] to match k_cache, got {tuple(key.shape)}")
    _require(value.dim() == 3 and tuple(value.shape) == (key.shape[0], num_kv_heads, v_cache.shape[3]), "value",
             f"expected [{key.shape[0]}, {num_kv_heads}, {v_cache.shape[3]}], got {tuple(value.shape)}")
    _require(slot_mapping.dim() == 1 and slot_mapping.shape[0] == key.shape[0], "slot_mapping",
             f"expected shape [{key.shape[0]}] (one slot per token), got {tuple(slot_mapping.shape)}")
    _require(not slot_mapping.is_floating_point() and slot_mapping.dtype != torch.bool, "slot_mapping",
             f"expected an integer tensor, got {slot_mapping.dtype}")
    if slot_mapping.device.type == "cpu" and slot_mapping.numel():
        largest = int(slot_mapping.max())
        _require(largest < num_blocks * block_size, "slot_mapping",
                 f"slot {largest} is past the cache ({num_blocks} blocks x {block_size})")


def _check_attention_args(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                          query_start_loc: Tensor, scale: float, sliding_window: int | None,
                          softcap: float | None) -> None:
    _check_cache_pair(k_cache, v_cache)
    num_blocks, block_size, num_kv_heads, head_size = k_cache.shape
    _require(q.dim() == 3 and q.shape[2] == head_size, "q", f"expected [T, Hq, {head_size}], got {tuple(q.shape)}")
    _require(q.is_floating_point(), "q", f"expected a floating-point tensor, got {q.dtype}")
    _require(q.shape[1] % num_kv_heads == 0, "q",
             f"query heads {q.shape[1]} must be a multiple of the KV heads {num_kv_heads}")
    _require(block_tables.dim() == 2 and block_tables.dtype in (torch.int32, torch.int64), "block_tables",
             f"expected int32 [B, max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}")
    batch = block_tables.shape[0]
    _require(seq_lens.dim() == 1 and seq_lens.shape[0] == batch and not seq_lens.is_floating_point(), "seq_lens",
             f"expected int32 [{batch}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    _require(query_start_loc.dim() == 1 and query_start_loc.shape[0] == batch + 1
             and not query_start_loc.is_floating_point(), "query_start_loc",
             f"expected int32 [{batch + 1}], got {query_start_loc.dtype} {tuple(query_start_loc.shape)}")
    _require(math.isfinite(scale) and scale > 0, "scale", f"expected a positive finite number, got {scale}")
    _require(sliding_window is None or (isinstance(sliding_window, int) and sliding_window >= 1), "sliding_window",
             f"expected None or an int >= 1, got {sliding_window!r}")
    _require(softcap is None or (math.isfinite(softcap) and softcap > 0), "softcap",
             f"expected None or a positive number, got {softcap!r}")
    if query_start_loc.device.type != "cpu":
        return
    starts = query_start_loc.tolist()
    q_lens = [starts[b + 1] - starts[b] for b in range(batch)]
    _require(starts[0] == 0 and min(q_lens, default=0) >= 0 and starts[-1] <= q.shape[0], "query_start_loc",
             f"must start at 0, never decrease and end at most at T={q.shape[0]}, got {starts}")
    kv_lens = seq_lens.tolist()
    for b in range(batch):
        if q_lens[b] == 0:
            continue
        _require(kv_lens[b] >= q_lens[b], "seq_lens",
                 f"request {b} has {q_lens[b]} queries but only {kv_lens[b]} keys (seq_lens counts this step's tokens)")
        _require(kv_lens[b] <= block_tables.shape[1] * block_size, "seq_lens",
                 f"request {b} needs {kv_lens[b]} keys but block_tables has room for "
                 f"{block_tables.shape[1] * block_size}")
    if batch:
        used = _needed_table_entries(kv_lens, q_lens, block_size, sliding_window, block_tables.shape[1])
        entries = block_tables[used]
        if entries.numel():
            _require(int(entries.min()) >= 0 and int(entries.max()) < num_blocks, "block_tables",
                     f"entries the queries read must lie in [0, {num_blocks}), "
                     f"got {int(entries.min())}..{int(entries.max())}")


def _needed_table_entries(kv_lens: list[int], q_lens: list[int], block_size: int, sliding_window: int | None,
                          max_blocks: int) -> Tensor:
    """Bool [B, max_blocks]: the block-table entries some query can see (the only ones ever read)."""
    kv = torch.tensor(kv_lens, dtype=torch.int64)
    ql = torch.tensor(q_lens, dtype=torch.int64)
    first_key = torch.zeros_like(kv) if sliding_window is None else (kv - ql - sliding_window + 1).clamp(min=0)
    index = torch.arange(max_blocks)
    return ((index >= (first_key // block_size)[:, None]) & (index * block_size < kv[:, None])
            & (ql > 0)[:, None])


# --------------------------------------------------------------------------------------------------
# Vectorized torch implementations (the CPU path).
# --------------------------------------------------------------------------------------------------

def _write_kv_cache_torch(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    # Indexing (block, offset) as two dims writes in place whatever the caches' strides are.
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


def _paged_attention_torch(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                           query_start_loc: Tensor, *, scale: float, sliding_window: int | None,
                           softcap: float | None) -> Tensor:
    """Decode requests (one query) in batched groups; longer requests one query tile at a time.

    Only the table entries some query can see are gathered (never the null blocks before a
    window). Gathered positions no query may see (before the window, past seq_len, padding) are
    zeroed first, so whatever they hold (NaN in a recycled block) cannot leak into a masked score
    or through 0 * NaN. Gathers land in reused per-thread buffers: on CPU a fresh multi-MB
    allocation costs more in page faults than the copy itself.
    """
    num_tokens, num_q_heads, _ = q.shape
    out = q.new_zeros(num_tokens, num_q_heads, v_cache.shape[-1])
    starts = query_start_loc.tolist()
    kv_lens = seq_lens.tolist()
    attend: dict[str, Any] = dict(scale=scale, sliding_window=sliding_window, softcap=softcap)
    decode = [b for b in range(len(kv_lens)) if starts[b + 1] - starts[b] == 1]
    for group in _decode_groups(decode, kv_lens, k_cache, v_cache, sliding_window):
        rows = torch.tensor([starts[b] for b in group], dtype=torch.long, device=q.device)
        out[rows] = _decode_group(q[rows], k_cache, v_cache, block_tables[group], [kv_lens[b] for b in group],
                                  **attend)
    for b in range(len(kv_lens)):
        q_len = starts[b + 1] - starts[b]
        if q_len <= 1:
            continue
        for first in range(0, q_len, _PREFILL_TILE):
            tile = slice(starts[b] + first, starts[b] + min(q_len, first + _PREFILL_TILE))
            out[tile] = _prefill_tile(q[tile], k_cache, v_cache, block_tables[b], kv_lens[b] - q_len + first,
                                      **attend)
    return out


# Gathered K+V bytes per decode group: small enough to stay in cache between the gather and the
# attention that reads it back (measured: whole-batch gathers ran at half the speed).
_DECODE_GROUP_BYTES = 8 << 20
# Largest gather buffer kept per thread between calls; bigger gathers allocate afresh.
_WORKSPACE_CAP_BYTES = 256 << 20
_workspace = threading.local()


def _decode_groups(decode: list[int], kv_lens: list[int], k_cache: Tensor, v_cache: Tensor,
                   sliding_window: int | None) -> list[list[int]]:
    """Split decode requests (in order) into groups whose padded gather fits _DECODE_GROUP_BYTES."""
    block_size = k_cache.shape[1]
    block_bytes = block_size * k_cache.shape[2] * (k_cache.shape[3] + v_cache.shape[3]) * 4
    groups: list[list[int]] = []
    widest = 0
    for b in decode:
        first_key = 0 if sliding_window is None else max(0, kv_lens[b] - sliding_window)
        span = (kv_lens[b] - 1) // block_size - first_key // block_size + 1
        if groups and (len(groups[-1]) + 1) * max(widest, span) * block_bytes <= _DECODE_GROUP_BYTES:
            groups[-1].append(b)
            widest = max(widest, span)
        else:
            groups.append([b])
            widest = span
    return groups


def _buffer(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A per-thread scratch tensor of ``shape``; its contents are garbage and die at the next call.

    Buffers are kept apart by inference mode: a tensor made under ``torch.inference_mode()``
    cannot be written outside it, and a normal one would be tracked by autograd inside it."""
    numel = math.prod(shape)
    if numel * torch.empty((), dtype=dtype).element_size() > _WORKSPACE_CAP_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    buffers = _workspace.__dict__.setdefault("buffers", {})
    key = (name, dtype, device, torch.is_inference_mode_enabled())
    if key not in buffers or buffers[key].numel() < numel:
        buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffers[key][:numel].view(shape)


def _gather_blocks(cache: Tensor, blocks: Tensor, name: str) -> Tensor:
    """fp32 copy of ``cache[blocks]`` ([n, block_size, H, D]) in a scratch buffer."""
    raw = _buffer(name, (blocks.numel(), *cache.shape[1:]), cache.dtype, cache.device)
    torch.index_select(cache, 0, blocks, out=raw)
    if raw.dtype == torch.float32:
        return raw
    wide = _buffer(name + "32", tuple(raw.shape), torch.float32, cache.device)
    return wide.copy_(raw)


def _attend(query: Tensor, keys: Tensor, values: Tensor, visible: Tensor, *, scale: float,
            softcap: float | None) -> Tensor:
    """softmax(mask(cap(scale * q k^T))) v over [..., rows, D] x [..., keys, D]; all fp32."""
    if softcap is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=scale)
    scores = torch.matmul(query, keys.contiguous().transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), values.contiguous())


def _decode_group(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, kv_lens: list[int], *,
                  scale: float, sliding_window: int | None, softcap: float | None) -> Tensor:
    """q [B, Hq, D], one query per request at position kv_len - 1 -> [B, Hq, Dv] (q dtype)."""
    batch, num_q_heads, head_size = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    device = q.device
    kv_len = torch.tensor(kv_lens, dtype=torch.long, device=device)
    first_key = torch.zeros_like(kv_len) if sliding_window is None else (kv_len - sliding_window).clamp(min=0)
    first_block = first_key // block_size
    last_block = (kv_len - 1) // block_size
    span = int((last_block - first_block).max()) + 1
    column = first_block[:, None] + torch.arange(span, device=device)
    # Requests needing fewer blocks than the widest re-read their first (in-window) block; masked.
    column = torch.where(column <= last_block[:, None], column, first_block[:, None])
    blocks = block_tables.long().gather(1, column).flatten()
    key_pos = first_block[:, None] * block_size + torch.arange(span * block_size, device=device)
    visible = (key_pos >= first_key[:, None]) & (key_pos < kv_len[:, None])

    keys = _gather_blocks(k_cache, blocks, "k").view(batch, span * block_size, num_kv_heads, -1)
    values = _gather_blocks(v_cache, blocks, "v").view(batch, span * block_size, num_kv_heads, -1)
    hidden = (~visible).nonzero(as_tuple=True)
    keys[hidden] = 0.0
    values[hidden] = 0.0

    # GQA: the G query heads of a KV head are G query rows against that head's keys.
    group = num_q_heads // num_kv_heads
    query = q.float().view(batch, num_kv_heads, group, head_size)
    result = _attend(query, keys.transpose(1, 2), values.transpose(1, 2), visible[:, None, None, :],
                     scale=scale, softcap=softcap)
    return result.reshape(batch, num_q_heads, -1).to(q.dtype)


def _prefill_tile(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, first_pos: int, *,
                  scale: float, sliding_window: int | None, softcap: float | None) -> Tensor:
    """q [n, Hq, D]: consecutive queries of one request at positions first_pos.. -> [n, Hq, Dv]."""
    num_queries, num_q_heads, head_size = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    device = q.device
    last_pos = first_pos + num_queries - 1
    first_key = 0 if sliding_window is None else max(0, first_pos - sliding_window + 1)
    first_block, last_block = first_key // block_size, last_pos // block_size
    blocks = block_table[first_block:last_block + 1].long()
    length = blocks.numel() * block_size
    keys = _gather_blocks(k_cache, blocks, "k").view(length, num_kv_heads, -1)
    values = _gather_blocks(v_cache, blocks, "v").view(length, num_kv_heads, -1)
    # Only the first and last gathered blocks can hold positions no query of the tile sees.
    head, tail = first_key - first_block * block_size, last_pos + 1 - first_block * block_size
    for cache_part in (keys, values):
        cache_part[:head] = 0.0
        cache_part[tail:] = 0.0

    key_pos = first_block * block_size + torch.arange(length, device=device)
    query_pos = first_pos + torch.arange(num_queries, device=device)
    visible = key_pos[None, :] <= query_pos[:, None]
    if sliding_window is not None:
        visible &= key_pos[None, :] > query_pos[:, None] - sliding_window

    # GQA without copying K/V: the G query heads sharing a KV head become extra query rows.
    group = num_q_heads // num_kv_heads
    query = q.float().view(num_queries, num_kv_heads, group, head_size).permute(1, 2, 0, 3)
    query = query.reshape(num_kv_heads, group * num_queries, head_size)
    # 4-D inputs: with 3-D ones SDPA on CPU takes a slower path (measured ~1.7x).
    result = _attend(query[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                     visible.repeat(group, 1), scale=scale, softcap=softcap)
    result = result.view(num_kv_heads, group, num_queries, -1).permute(2, 0, 1, 3)
    return result.reshape(num_queries, num_q_heads, -1).to(q.dtype)
