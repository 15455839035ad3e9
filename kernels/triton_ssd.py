"""Triton kernels of kernels.ssd: the Mamba-2 chunked prefill scan (four kernels: chunk cumsum,
chunk state, state passing, chunk scan) and the single-token state update.

Imported lazily by kernels.ssd (kernels._dispatch.load_triton_module); the rules the wrappers
keep are in kernels.triton_common. tl.dot operands are kept >= 16 in every dimension.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.ssd import DEFAULT_DT_LIMIT
from kernels.triton_common import pow2, softplus


@triton.jit
def _process_dt(dt, dt_bias_ptr, h, dt_lo, dt_hi,
                HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr):
    # head h's step size in fp32: (+ dt_bias[h]), softplus, clamp, as kernels.ssd.process_dt
    if HAS_BIAS:
        dt += tl.load(dt_bias_ptr + h).to(tl.float32)
    if SOFTPLUS:
        dt = softplus(dt)
    if HAS_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_lo), dt_hi)
    return dt


@triton.jit
def _ssd_update_kernel(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, state_ptr, idx_ptr, out_ptr,
                       heads, head_dim, state_size, heads_per_group, groups, dt_lo, dt_hi,
                       s_slot, s_head, s_p, s_n,
                       BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, HAS_D: tl.constexpr,
                       D_PER_P: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                       HAS_LIMIT: tl.constexpr):
    row = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    pm = p < head_dim
    nm = n < state_size
    g = h // heads_per_group
    slot = tl.load(idx_ptr + row)
    real = slot >= 0
    base = state_ptr + tl.where(real, slot, 0) * s_slot + h * s_head
    dt = tl.load(dt_ptr + row * heads + h).to(tl.float32)
    dt = _process_dt(dt, dt_bias_ptr, h, dt_lo, dt_hi, HAS_BIAS, SOFTPLUS, HAS_LIMIT)
    decay = tl.exp(dt * tl.load(A_ptr + h).to(tl.float32))
    sm = (p < tl.where(real, head_dim, 0))[:, None] & nm[None, :]  # empty on padding rows
    ptrs = base + p[:, None] * s_p + n[None, :] * s_n
    state = tl.load(ptrs, mask=sm, other=0.0).to(tl.float32)
    xv = tl.load(x_ptr + (row * heads + h) * head_dim + p, mask=pm, other=0.0).to(tl.float32)
    bv = tl.load(B_ptr + (row * groups + g) * state_size + n, mask=nm, other=0.0).to(tl.float32)
    cv = tl.load(C_ptr + (row * groups + g) * state_size + n, mask=nm, other=0.0).to(tl.float32)
    state = state * decay + (dt * xv)[:, None] * bv[None, :]
    y = tl.sum(state * cv[None, :], axis=1)
    if HAS_D:
        if D_PER_P:
            y += tl.load(D_ptr + h * head_dim + p, mask=pm, other=0.0).to(tl.float32) * xv
        else:
            y += tl.load(D_ptr + h).to(tl.float32) * xv
    tl.store(out_ptr + (row * heads + h) * head_dim + p, y.to(out_ptr.dtype.element_ty), mask=pm)
    tl.store(ptrs, state.to(state_ptr.dtype.element_ty), mask=sm)


def _dt_flags(dt_bias: Tensor | None, dt_softplus: bool, dt_limit: tuple[float, float]) -> dict[str, bool]:
    has_limit = tuple(dt_limit) != DEFAULT_DT_LIMIT
    return dict(HAS_BIAS=dt_bias is not None, SOFTPLUS=bool(dt_softplus), HAS_LIMIT=has_limit)


def _dt_limit_args(dt_limit: tuple[float, float]) -> tuple[float, float]:
    lo, hi = dt_limit
    return float(lo), float(min(hi, 3.0e38))  # a finite stand-in for inf in a kernel argument


def ssd_state_update(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, ssm_states: Tensor,
                     state_indices: Tensor, *, D: Tensor | None, dt_bias: Tensor | None,
                     dt_softplus: bool, dt_limit: tuple[float, float]) -> Tensor:
    """The Triton launch of :func:`kernels.ssd.ssd_state_update` (Mamba-2 decode; the inputs
    are checked there)."""
    x, dt, B, C = x.contiguous(), dt.contiguous(), B.contiguous(), C.contiguous()
    rows, heads, head_dim = x.shape
    groups, state_size = B.shape[1:]
    out = torch.empty_like(x)
    if rows == 0:
        return out
    block_n = pow2(state_size, 16)
    block_p = min(pow2(head_dim, 16), max(16, 4096 // block_n))
    grid = (rows, heads, triton.cdiv(head_dim, block_p))
    _ssd_update_kernel[grid](
        x, dt, A.contiguous(), B, C, D.contiguous() if D is not None else x,
        dt_bias.contiguous() if dt_bias is not None else x, ssm_states,
        state_indices.to(torch.int64).contiguous(), out,
        heads, head_dim, state_size, heads // groups, groups, *_dt_limit_args(dt_limit),
        *ssm_states.stride(),
        BLOCK_P=block_p, BLOCK_N=block_n, HAS_D=D is not None, D_PER_P=D is not None and D.dim() == 2,
        **_dt_flags(dt_bias, dt_softplus, dt_limit))
    return out


@triton.jit
def _ssd_chunk_cumsum_kernel(dt_ptr, dt_bias_ptr, A_ptr, chunk_start_ptr, chunk_len_ptr, step_ptr, cum_ptr,
                             heads, dt_lo, dt_hi,
                             Q: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                             HAS_LIMIT: tl.constexpr):
    # per (chunk, head): processed dt, zero past the chunk's end, and its running sum of dt * A
    k = tl.program_id(0).to(tl.int64)  # chunk offsets exceed int32 on long prefills
    h = tl.program_id(1)
    s = tl.arange(0, Q)
    start = tl.load(chunk_start_ptr + k).to(tl.int64)
    valid = s < tl.load(chunk_len_ptr + k)
    dt = tl.load(dt_ptr + (start + s) * heads + h, mask=valid, other=0.0).to(tl.float32)
    dt = _process_dt(dt, dt_bias_ptr, h, dt_lo, dt_hi, HAS_BIAS, SOFTPLUS, HAS_LIMIT)
    dt = tl.where(valid, dt, 0.0)
    cum = tl.cumsum(dt * tl.load(A_ptr + h).to(tl.float32), axis=0)
    out = (k * heads + h) * Q + s
    tl.store(step_ptr + out, dt)
    tl.store(cum_ptr + out, cum)


@triton.jit
def _dot(a, b, LOW_PRECISION: tl.constexpr):
    # bf16/fp16 models: bf16 tensor-core operands, fp32 accumulation; fp32 models: exact fp32
    if LOW_PRECISION:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _ssd_chunk_state_kernel(x_ptr, B_ptr, step_ptr, cum_ptr, chunk_start_ptr, chunk_len_ptr, local_ptr,
                            heads, head_dim, state_size, heads_per_group, groups, n_blocks,
                            Q: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                            LOW_PRECISION: tl.constexpr):
    # local[k, h] = sum_s exp(cum_end - cum_s) * dt_s * x_s (outer) B_s   (the chunk's own end state)
    k = tl.program_id(0).to(tl.int64)  # chunk offsets exceed int32 on long prefills
    h = tl.program_id(1)
    p = (tl.program_id(2) // n_blocks) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = (tl.program_id(2) % n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.arange(0, Q)
    g = h // heads_per_group
    start = tl.load(chunk_start_ptr + k).to(tl.int64)
    valid = s < tl.load(chunk_len_ptr + k)
    row = (k * heads + h) * Q
    cum = tl.load(cum_ptr + row + s)
    weight = tl.exp(tl.load(cum_ptr + row + Q - 1) - cum) * tl.load(step_ptr + row + s)
    xv = tl.load(x_ptr + ((start + s)[:, None] * heads + h) * head_dim + p[None, :],
                 mask=valid[:, None] & (p < head_dim)[None, :], other=0.0).to(tl.float32)
    bv = tl.load(B_ptr + ((start + s)[:, None] * groups + g) * state_size + n[None, :],
                 mask=valid[:, None] & (n < state_size)[None, :], other=0.0).to(tl.float32)
    local = _dot(tl.trans(xv * weight[:, None]), bv, LOW_PRECISION)  # [P, N]
    out = local_ptr + ((k * heads + h) * head_dim + p[:, None]) * state_size + n[None, :]
    tl.store(out, local, mask=(p < head_dim)[:, None] & (n < state_size)[None, :])


@triton.jit
def _ssd_state_passing_kernel(local_ptr, cum_ptr, entering_ptr, state_ptr, idx_ptr, init_ptr,
                              first_chunk_ptr, num_chunks_ptr, heads, head_dim, state_size,
                              s_slot, s_head, s_p, s_n,
                              Q: tl.constexpr, BLOCK: tl.constexpr):
    # per (sequence, head, block of the P*N state): walk the sequence's chunks in order
    seq = tl.program_id(0)
    h = tl.program_id(1)
    e = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    em = e < head_dim * state_size
    p = e // state_size
    n = e % state_size
    slot = tl.load(idx_ptr + seq)
    real = slot >= 0
    use_state = real & (tl.load(init_ptr + seq) != 0)
    ptrs = state_ptr + tl.where(real, slot, 0) * s_slot + h * s_head + p * s_p + n * s_n
    state = tl.load(ptrs, mask=e < tl.where(use_state, head_dim * state_size, 0), other=0.0).to(tl.float32)
    first = tl.load(first_chunk_ptr + seq)
    for j in range(0, tl.load(num_chunks_ptr + seq)):
        k = (first + j).to(tl.int64)
        offs = (k * heads + h) * head_dim * state_size + e
        tl.store(entering_ptr + offs, state, mask=em)
        decay = tl.exp(tl.load(cum_ptr + (k * heads + h) * Q + Q - 1))
        state = state * decay + tl.load(local_ptr + offs, mask=em, other=0.0)
    tl.store(ptrs, state.to(state_ptr.dtype.element_ty), mask=e < tl.where(real, head_dim * state_size, 0))


@triton.jit
def _ssd_chunk_scan_kernel(x_ptr, B_ptr, C_ptr, D_ptr, step_ptr, cum_ptr, entering_ptr, chunk_start_ptr,
                           chunk_len_ptr, out_ptr, heads, head_dim, state_size, heads_per_group, groups,
                           Q: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                           HAS_D: tl.constexpr, D_PER_P: tl.constexpr, LOW_PRECISION: tl.constexpr):
    # y_l = sum_{s<=l} (C_l . B_s) exp(cum_l - cum_s) dt_s x_s  +  exp(cum_l) C_l S_entering  (+ D x_l)
    k = tl.program_id(0).to(tl.int64)  # chunk offsets exceed int32 on long prefills
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    pm = p < head_dim
    l = tl.arange(0, Q)
    g = h // heads_per_group
    start = tl.load(chunk_start_ptr + k).to(tl.int64)
    valid = l < tl.load(chunk_len_ptr + k)
    row = (k * heads + h) * Q
    cum = tl.load(cum_ptr + row + l)
    step = tl.load(step_ptr + row + l)
    scores = tl.zeros([Q, Q], dtype=tl.float32)
    carried = tl.zeros([Q, BLOCK_P], dtype=tl.float32)
    for n0 in range(0, state_size, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nm = n < state_size
        bc_offs = ((start + l)[:, None] * groups + g) * state_size + n[None, :]
        cv = tl.load(C_ptr + bc_offs, mask=valid[:, None] & nm[None, :], other=0.0).to(tl.float32)
        bv = tl.load(B_ptr + bc_offs, mask=valid[:, None] & nm[None, :], other=0.0).to(tl.float32)
        scores += _dot(cv, tl.trans(bv), LOW_PRECISION)
        entering = tl.load(entering_ptr + ((k * heads + h) * head_dim + p[None, :]) * state_size + n[:, None],
                           mask=nm[:, None] & pm[None, :], other=0.0)  # [N, P]
        carried += _dot(cv, entering, LOW_PRECISION)
    causal = l[:, None] >= l[None, :]
    decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
    xv = tl.load(x_ptr + ((start + l)[:, None] * heads + h) * head_dim + p[None, :],
                 mask=valid[:, None] & pm[None, :], other=0.0).to(tl.float32)
    y = _dot(scores * decay * step[None, :], xv, LOW_PRECISION) + tl.exp(cum)[:, None] * carried
    if HAS_D:
        if D_PER_P:
            y += tl.load(D_ptr + h * head_dim + p, mask=pm, other=0.0).to(tl.float32)[None, :] * xv
        else:
            y += tl.load(D_ptr + h).to(tl.float32) * xv
    tl.store(out_ptr + ((start + l)[:, None] * heads + h) * head_dim + p[None, :], y.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & pm[None, :])


def triton_chunk_size(chunk_size: int) -> int:
    """The chunk length the Triton SSD uses: chunk_size if a power of two in [16, 128], else 64.

    Results do not depend on it beyond rounding; 128 caps the [Q, Q] register tiles.
    """
    if 16 <= chunk_size <= 128 and chunk_size & (chunk_size - 1) == 0:
        return chunk_size
    return 64


def ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, ssm_states: Tensor,
             query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor, *,
             D: Tensor | None, dt_bias: Tensor | None, dt_softplus: bool,
             dt_limit: tuple[float, float], chunk_size: int) -> Tensor:
    """The Triton launch of :func:`kernels.ssd.ssd_scan` (Mamba-2 chunked prefill; the inputs
    are checked there)."""
    x, dt, B, C = x.contiguous(), dt.contiguous(), B.contiguous(), C.contiguous()
    tokens, heads, head_dim = x.shape
    groups, state_size = B.shape[1:]
    batch = state_indices.shape[0]
    device = x.device
    q = triton_chunk_size(chunk_size)
    out = torch.empty_like(x)
    if batch == 0:
        return out

    # Logical chunks: chunk j of a sequence covers its tokens jQ .. jQ+Q-1 (never two sequences).
    starts = query_start_loc.long()
    lengths = starts[1:] - starts[:-1]
    chunks_per_seq = (lengths + q - 1) // q
    first_chunk = torch.cumsum(chunks_per_seq, 0) - chunks_per_seq
    num_chunks = int(chunks_per_seq.sum())  # one host sync per prefill call
    chunk_seq = torch.repeat_interleave(torch.arange(batch, device=device), chunks_per_seq, output_size=num_chunks)
    chunk_start = starts[chunk_seq] + (torch.arange(num_chunks, device=device) - first_chunk[chunk_seq]) * q
    chunk_len = torch.minimum(starts[chunk_seq + 1] - chunk_start, torch.full_like(chunk_start, q))

    f32: dict[str, Any] = dict(dtype=torch.float32, device=device)
    step = torch.empty(num_chunks, heads, q, **f32)
    cum = torch.empty(num_chunks, heads, q, **f32)
    local = torch.empty(num_chunks, heads, head_dim, state_size, **f32)
    entering = torch.empty(num_chunks, heads, head_dim, state_size, **f32)
    # bf16 tensor-core operands on CUDA only: the CPU interpreter multiplies bf16 bit patterns as ints
    low = x.dtype in (torch.bfloat16, torch.float16) and device.type == "cuda"
    block_p = min(pow2(head_dim, 16), 64)
    block_n = min(pow2(state_size, 16), 64)
    common = (heads, head_dim, state_size, heads // groups, groups)
    if num_chunks:
        _ssd_chunk_cumsum_kernel[(num_chunks, heads)](
            dt, dt_bias.contiguous() if dt_bias is not None else dt, A.contiguous(), chunk_start, chunk_len,
            step, cum, heads, *_dt_limit_args(dt_limit), Q=q, **_dt_flags(dt_bias, dt_softplus, dt_limit))
        n_blocks = triton.cdiv(state_size, block_n)
        _ssd_chunk_state_kernel[(num_chunks, heads, triton.cdiv(head_dim, block_p) * n_blocks)](
            x, B, step, cum, chunk_start, chunk_len, local, *common, n_blocks,
            Q=q, BLOCK_P=block_p, BLOCK_N=block_n, LOW_PRECISION=low)
    block = min(pow2(head_dim * state_size), 1024)
    _ssd_state_passing_kernel[(batch, heads, triton.cdiv(head_dim * state_size, block))](
        local, cum, entering, ssm_states, state_indices.to(torch.int64).contiguous(),
        has_initial_state.to(torch.int32).contiguous(), first_chunk.contiguous(), chunks_per_seq.contiguous(),
        heads, head_dim, state_size, *ssm_states.stride(), Q=q, BLOCK=block)
    if num_chunks:
        _ssd_chunk_scan_kernel[(num_chunks, heads, triton.cdiv(head_dim, block_p))](
            x, B, C, D.contiguous() if D is not None else x, step, cum, entering, chunk_start, chunk_len, out,
            *common, Q=q, BLOCK_P=block_p, BLOCK_N=block_n, HAS_D=D is not None,
            D_PER_P=D is not None and D.dim() == 2, LOW_PRECISION=low, num_warps=8 if q >= 128 else 4)
    return out
