"""Triton kernels for the KV-cache write and paged attention (the CUDA path of kernels.attention).

Imported lazily by `kernels.attention` (never at package import). On CPU these kernels only run
under ``TRITON_INTERPRET=1``, which must be set before this module is imported. Uses only Triton
APIs present in triton 3.6. Arguments are validated by the public functions in kernels.attention.

Paged attention is one "unified" kernel for prefill, chunked prefill and decode:
- a program owns (one tile of BLOCK_Q consecutive queries of one request, one KV head); its
  BLOCK_M = BLOCK_Q * G_PAD rows are (query, query head of that KV head's GQA group) pairs, so K/V
  are loaded once for the whole group and tl.dot always has M >= 16;
- programs find their request by binary search over ``query_start_loc`` (request b owns tile
  indices starting at ``query_start_loc[b] // BLOCK_Q + b``), so the launch needs no host sync;
- keys are visited in tiles of TILE_N positions starting at the tile's first visible key
  (``first_query_pos - W + 1`` with a window), each key gathered through the block table; masked
  lanes do not load, so table entries wholly before the window (the null block) are never read;
- online softmax in fp32 (exp2 domain); rows that see no key yet keep a zero running state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------------------
# KV-cache write
# --------------------------------------------------------------------------------------------------

@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     s_kt, s_kh, s_kd, s_vt, s_vh, s_vd,
                     s_kc0, s_kc1, s_kc2, s_kc3, s_vc0, s_vc1, s_vc2, s_vc3,
                     block_size, num_heads, head_size, head_size_v,
                     H_PAD: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, H_PAD)[:, None]
    # Padding tokens (slot -1) write nothing. The scalar test is broadcast by arithmetic because
    # the CPU interpreter rejects `scalar_bool & block_bool`.
    keep = (heads * 0 + slot) >= 0
    dims = tl.arange(0, D_PAD)[None, :]
    mask = keep & (heads < num_heads) & (dims < head_size)
    k = tl.load(key_ptr + token * s_kt + heads * s_kh + dims * s_kd, mask=mask)
    tl.store(k_cache_ptr + block * s_kc0 + offset * s_kc1 + heads * s_kc2 + dims * s_kc3,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    dims_v = tl.arange(0, DV_PAD)[None, :]
    mask_v = keep & (heads < num_heads) & (dims_v < head_size_v)
    v = tl.load(value_ptr + token * s_vt + heads * s_vh + dims_v * s_vd, mask=mask_v)
    tl.store(v_cache_ptr + block * s_vc0 + offset * s_vc1 + heads * s_vc2 + dims_v * s_vc3,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask_v)


def write_kv_cache(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Triton version of kernels.attention.write_kv_cache (one program per token)."""
    num_tokens, num_heads, head_size = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        k_cache.shape[1], num_heads, head_size, value.shape[2],
        H_PAD=triton.next_power_of_2(num_heads), D_PAD=triton.next_power_of_2(head_size),
        DV_PAD=triton.next_power_of_2(value.shape[2]),
    )


# --------------------------------------------------------------------------------------------------
# Paged attention
# --------------------------------------------------------------------------------------------------

@triton.jit
def _find_request(query_start_loc_ptr, tile, num_requests, BLOCK_Q: tl.constexpr):
    """Largest b with query_start_loc[b] // BLOCK_Q + b <= tile (binary search)."""
    lo = 0
    hi = num_requests
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(q, m_i, l_i, acc, table, k_cache_ptr, v_cache_ptr, tile_start, key_end, kv_head, q_pos, row_ok,
                 dims, dims_v, s_kc0, s_kc1, s_kc2, s_kc3, s_vc0, s_vc1, s_vc2, s_vc3,
                 block_size, head_size, head_size_v, qk_scale, softcap, window,
                 TILE_N: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr,
                 MASKED: tl.constexpr):
    """One online-softmax step over keys tile_start .. tile_start + TILE_N - 1.

    MASKED=False is for tiles that every row may see in full (all keys in range, causal and window
    satisfied): no per-element masks. Rows that are not real (row_ok False) may then accumulate
    finite garbage; they are never stored.
    """
    keys = tile_start + tl.arange(0, TILE_N)
    offset = (keys % block_size).to(tl.int64)
    if MASKED:
        key_ok = keys < key_end
        block = tl.load(table + keys // block_size, mask=key_ok, other=0).to(tl.int64)
        k_mask = key_ok[:, None] & (dims[None, :] < head_size)
        v_mask = key_ok[:, None] & (dims_v[None, :] < head_size_v)
    else:
        block = tl.load(table + keys // block_size).to(tl.int64)
        k_mask = (keys[:, None] >= 0) & (dims[None, :] < head_size)
        v_mask = (keys[:, None] >= 0) & (dims_v[None, :] < head_size_v)
    k = tl.load(k_cache_ptr + block[:, None] * s_kc0 + offset[:, None] * s_kc1 + kv_head * s_kc2
                + dims[None, :] * s_kc3, mask=k_mask, other=0.0)
    if DOT_FP32:
        scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    if SOFTCAP:
        capped = scores * (qk_scale / softcap)  # qk_scale here is the plain softmax scale
        capped = 1.0 - 2.0 / (tl.exp(2.0 * capped) + 1.0)  # tanh, saturating safely
        scores = capped * (softcap * 1.4426950408889634)
    else:
        scores = scores * qk_scale  # qk_scale = scale * log2(e)
    if MASKED:
        visible = row_ok[:, None] & key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
        if SLIDING:
            visible = visible & (keys[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + block[:, None] * s_vc0 + offset[:, None] * s_vc1 + kv_head * s_vc2
                + dims_v[None, :] * s_vc3, mask=v_mask, other=0.0)
    if DOT_FP32:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, partial_ptr, stats_ptr, block_tables_ptr, seq_lens_ptr,
    query_start_loc_ptr, s_qt, s_qh, s_qd, s_ot, s_oh, s_od,
    s_kc0, s_kc1, s_kc2, s_kc3, s_vc0, s_vc1, s_vc2, s_vc3, s_bt,
    num_requests, block_size, head_size, head_size_v, group, qk_scale, softcap, window,
    BLOCK_Q: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    TILE_N: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SKIP_MASKS: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = _find_request(query_start_loc_ptr, tile, num_requests, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    first_q = (tile - (q_start // BLOCK_Q + req)) * BLOCK_Q  # first local query of this tile
    if first_q >= q_len:
        return  # spare tile (the grid is an upper bound on the number of tiles)
    kv_len = tl.load(seq_lens_ptr + req)
    context = kv_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_local = first_q + rows // G_PAD
    head_in_group = rows % G_PAD
    row_ok = (q_local < q_len) & (head_in_group < group)
    q_head = kv_head * group + head_in_group
    q_pos = context + q_local  # absolute position (bottom-right causal)

    dims = tl.arange(0, D_PAD)
    dims_v = tl.arange(0, DV_PAD)
    q = tl.load(q_ptr + (q_start + q_local)[:, None] * s_qt + q_head[:, None] * s_qh + dims[None, :] * s_qd,
                mask=row_ok[:, None] & (dims[None, :] < head_size), other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    first_pos = context + first_q
    last_pos = context + tl.minimum(first_q + BLOCK_Q, q_len) - 1
    key_start = 0
    if SLIDING:
        key_start = tl.maximum(first_pos - window + 1, 0)
    key_end = last_pos + 1
    if NUM_SPLITS > 1:  # this program takes one of NUM_SPLITS TILE_N-aligned slices of the keys
        per_split = tl.cdiv(tl.cdiv(key_end - key_start, NUM_SPLITS), TILE_N) * TILE_N
        key_start = key_start + split * per_split
        key_end = tl.minimum(key_start + per_split, key_end)

    # Tiles [free_lo, free_hi) hold only keys every row sees (>= the last row's window start,
    # <= the first row's position): they skip the per-element masks. The rest are masked.
    num_tiles = tl.cdiv(tl.maximum(key_end - key_start, 0), TILE_N)
    free_lo = num_tiles
    free_hi = num_tiles
    if SKIP_MASKS:
        seen_by_all = key_start
        if SLIDING:
            seen_by_all = tl.maximum(key_start, last_pos - window + 1)
        free_lo = tl.minimum(tl.cdiv(seen_by_all - key_start, TILE_N), num_tiles)
        free_hi = tl.maximum(tl.minimum((tl.minimum(first_pos + 1, key_end) - key_start) // TILE_N, num_tiles),
                             free_lo)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
    table = block_tables_ptr + req.to(tl.int64) * s_bt
    for index in range(0, free_lo):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, table, k_cache_ptr, v_cache_ptr, key_start + index * TILE_N, key_end, kv_head,
            q_pos, row_ok, dims, dims_v, s_kc0, s_kc1, s_kc2, s_kc3, s_vc0, s_vc1, s_vc2, s_vc3, block_size,
            head_size, head_size_v, qk_scale, softcap, window, TILE_N, SLIDING, SOFTCAP, DOT_FP32, True)
    for index in range(free_lo, free_hi):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, table, k_cache_ptr, v_cache_ptr, key_start + index * TILE_N, key_end, kv_head,
            q_pos, row_ok, dims, dims_v, s_kc0, s_kc1, s_kc2, s_kc3, s_vc0, s_vc1, s_vc2, s_vc3, block_size,
            head_size, head_size_v, qk_scale, softcap, window, TILE_N, SLIDING, SOFTCAP, DOT_FP32, False)
    for index in range(free_hi, num_tiles):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, table, k_cache_ptr, v_cache_ptr, key_start + index * TILE_N, key_end, kv_head,
            q_pos, row_ok, dims, dims_v, s_kc0, s_kc1, s_kc2, s_kc3, s_vc0, s_vc1, s_vc2, s_vc3, block_size,
            head_size, head_size_v, qk_scale, softcap, window, TILE_N, SLIDING, SOFTCAP, DOT_FP32, True)

    dv_ok = row_ok[:, None] & (dims_v[None, :] < head_size_v)
    if NUM_SPLITS == 1:
        result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (q_start + q_local)[:, None] * s_ot + q_head[:, None] * s_oh + dims_v[None, :] * s_od,
                 result.to(out_ptr.dtype.element_ty), mask=dv_ok)
    else:
        # Unnormalised partial result and its softmax statistics; _combine_splits_kernel merges them.
        # Layout: partial [T, Hq, NUM_SPLITS, DV_PAD], stats [T, Hq, NUM_SPLITS, 2] (max, sum), fp32.
        row = ((q_start + q_local) * (group * tl.num_programs(1)) + q_head).to(tl.int64) * NUM_SPLITS + split
        tl.store(partial_ptr + row[:, None] * DV_PAD + dims_v[None, :], acc, mask=dv_ok)
        tl.store(stats_ptr + row * 2, m_i, mask=row_ok)
        tl.store(stats_ptr + row * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _combine_splits_kernel(partial_ptr, stats_ptr, out_ptr, s_ot, s_oh, s_od, num_heads, head_size_v,
                           NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, DV_PAD: tl.constexpr):
    """out[t, h] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the key splits."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, S_PAD)
    dims = tl.arange(0, DV_PAD)
    row = (token * num_heads + head).to(tl.int64) * NUM_SPLITS + splits
    split_ok = splits < NUM_SPLITS
    m = tl.load(stats_ptr + row * 2, mask=split_ok, other=float("-inf"))
    l = tl.load(stats_ptr + row * 2 + 1, mask=split_ok, other=0.0)
    m_max = tl.max(m, 0)
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty splits weigh 0
    acc = tl.load(partial_ptr + row[:, None] * DV_PAD + dims[None, :], mask=split_ok[:, None], other=0.0)
    total = tl.sum(weight * l, 0)
    result = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * s_ot + head * s_oh + dims * s_od, result.to(out_ptr.dtype.element_ty),
             mask=dims < head_size_v)


def _tile_config(num_tokens: int, num_requests: int, head_pad: int, interpret: bool) -> tuple[int, int, int, int]:
    """(rows per program BLOCK_M, TILE_N, num_warps, num_stages) from shapes alone (no device sync
    to read query lengths). Untuned guesses for Hopper; bench/gpu_check.py sweeps alternatives."""
    if interpret:
        return 16, 16, 4, 1  # the interpreter's cost grows with element count: keep it tiny
    if num_tokens <= 2 * num_requests:
        return 16, 64, 4, 3  # decode-heavy: one query per request, stream keys in big tiles
    # prefill: large query tiles for tensor-core throughput; halved for wide heads (D 256), whose
    # fp32 accumulator would not fit in registers at 128 rows.
    return (128, 64, 8, 3) if head_pad <= 128 else (64, 32, 4, 3)


def _decode_splits(num_tokens: int, num_requests: int, num_kv_heads: int, max_keys: int,
                   device: torch.device) -> int:
    """How many key slices each decode program gets, so that a few long requests still fill the GPU.

    Only decode-heavy batches split (prefill tiles already give enough programs). The choice uses
    shapes alone (``max_keys`` is the block table's capacity): reading seq_lens would sync.
    """
    if device.type != "cuda" or num_tokens > 2 * num_requests:
        return 1
    programs = num_requests * num_kv_heads
    wanted = -(-2 * torch.cuda.get_device_properties(device).multi_processor_count // programs)
    return max(1, min(wanted, max_keys // 512, 16))


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                    query_start_loc: Tensor, *, scale: float, sliding_window: int | None,
                    softcap: float | None, num_splits: int | None = None,
                    tiles: tuple[int, int, int, int] | None = None, skip_masks: bool = True) -> Tensor:
    """Triton version of kernels.attention.paged_attention.

    Tests and tuning only: ``num_splits`` forces the number of key slices per program (default:
    `_decode_splits`; with more than one, a second kernel merges the partial results), ``tiles``
    forces ``(BLOCK_M, TILE_N, num_warps, num_stages)`` (default: `_tile_config`), ``skip_masks=False``
    masks every key tile (instead of only those some row may not fully see).
    """
    num_tokens, num_q_heads, head_size = q.shape
    num_kv_heads, head_size_v = k_cache.shape[2], v_cache.shape[3]
    out = torch.zeros(num_tokens, num_q_heads, head_size_v, dtype=q.dtype, device=q.device)
    num_requests = block_tables.shape[0]
    if num_tokens == 0 or num_requests == 0:
        return out
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    interpret = q.device.type == "cpu"
    head_pad = max(16, triton.next_power_of_2(max(head_size, head_size_v)))
    block_m, tile_n, num_warps, num_stages = tiles or _tile_config(num_tokens, num_requests, head_pad, interpret)
    block_q = max(1, block_m // group_pad)  # rows are (query, GQA head) pairs; at least one query
    if num_splits is None:
        num_splits = _decode_splits(num_tokens, num_requests, num_kv_heads,
                                    block_tables.shape[1] * k_cache.shape[1], q.device)
    dv_pad = max(16, triton.next_power_of_2(head_size_v))
    if num_splits > 1:
        # Rows no program writes (spare tiles, batch padding) must combine to 0: zeros and -inf.
        partial = torch.zeros(num_tokens, num_q_heads, num_splits, dv_pad, dtype=torch.float32, device=q.device)
        stats = torch.zeros(num_tokens, num_q_heads, num_splits, 2, dtype=torch.float32, device=q.device)
        stats[..., 0] = float("-inf")
    else:
        partial = stats = out  # unused by the kernel when NUM_SPLITS == 1
    # fp32 operands: exact products for fp32 inputs (no tf32) and for mixed q/cache dtypes. The CPU
    # interpreter (triton 3.9) computes bf16 tl.dot wrongly, so it always takes the fp32 route there.
    dot_fp32 = interpret or q.dtype == torch.float32 or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype
    qk_scale = scale if softcap is not None else scale * _LOG2E
    grid = (num_tokens // block_q + num_requests, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, partial, stats, block_tables, seq_lens, query_start_loc,
        *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(), block_tables.stride(0),
        num_requests, k_cache.shape[1], head_size, head_size_v, group, qk_scale,
        float(softcap) if softcap is not None else 1.0, int(sliding_window or 0),
        BLOCK_Q=block_q, G_PAD=group_pad, D_PAD=max(16, triton.next_power_of_2(head_size)),
        DV_PAD=dv_pad, TILE_N=tile_n, SLIDING=sliding_window is not None, SOFTCAP=softcap is not None,
        DOT_FP32=dot_fp32, NUM_SPLITS=num_splits, SKIP_MASKS=skip_masks, num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        _combine_splits_kernel[(num_tokens, num_q_heads)](
            partial, stats, out, *out.stride(), num_q_heads, head_size_v,
            NUM_SPLITS=num_splits, S_PAD=triton.next_power_of_2(num_splits), DV_PAD=dv_pad,
        )
    return out
