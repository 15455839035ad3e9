"""Triton kernels for the Mamba ops: conv1d (prefill + update), SSD (chunked scan + update),
selective scan (scan + update) and gated RMSNorm.

Imported lazily by kernels.conv1d / ssd / selective_scan / norm (kernels._dispatch.load_triton_module),
never at package import. Runs compiled on CUDA and, for tests on tiny shapes, on CPU tensors under
TRITON_INTERPRET=1. Uses only Triton APIs present in triton 3.6 (the GPU image); tl.dot operands
are kept >= 16 in every dimension.

The wrappers take the same arguments as the torch implementations (already validated by the public
ops) and keep their invariants: fp32 math, outputs in the input dtype, states in their own dtype,
state index < 0 = padding row (zero start state, no slot read or written), has_initial_state False
= zero start state. State caches may be strided views (e.g. into a shared block pool); the other
inputs are made contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.ssd import DEFAULT_DT_LIMIT


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(max(1, n)))


@triton.jit
def _softplus(v):
    # log(1 + e^v); the large-v branch avoids overflow (torch's threshold is 20 too)
    return tl.where(v <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(v, 20.0))), v)


@triton.jit
def _silu(v):
    return v * tl.sigmoid(v)


# ==================================================================================================
# Causal conv1d
# ==================================================================================================

@triton.jit
def _conv1d_update_kernel(x_ptr, w_ptr, bias_ptr, state_ptr, idx_ptr, out_ptr, channels,
                          s_slot, s_row, s_chan,
                          WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
                          HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < channels
    r = tl.arange(0, BLOCK_W)
    slot = tl.load(idx_ptr + row)
    real = slot >= 0
    base = state_ptr + tl.where(real, slot, 0) * s_slot
    cr = c < tl.where(real, channels, 0)  # channel mask, empty on padding rows
    xv = tl.load(x_ptr + row * channels + c, mask=cm, other=0.0).to(tl.float32)
    # window row k < W-1: state row k; row W-1: the new token
    in_state = (r[:, None] < WIDTH - 1) & cr[None, :]
    win = tl.load(base + r[:, None] * s_row + c[None, :] * s_chan, mask=in_state, other=0.0).to(tl.float32)
    win += tl.where(r[:, None] == WIDTH - 1, xv[None, :], 0.0)
    w = tl.load(w_ptr + c[None, :] * WIDTH + r[:, None], mask=(r[:, None] < WIDTH) & cm[None, :], other=0.0)
    acc = tl.sum(win * w.to(tl.float32), axis=0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=cm, other=0.0).to(tl.float32)
    if SILU:
        acc = _silu(acc)
    tl.store(out_ptr + row * channels + c, acc.to(out_ptr.dtype.element_ty), mask=cm)
    # new state row k = window row k + 1
    nxt = r + 1
    shifted = tl.load(base + nxt[:, None] * s_row + c[None, :] * s_chan,
                      mask=(nxt[:, None] < WIDTH - 1) & cr[None, :], other=0.0).to(tl.float32)
    shifted += tl.where(nxt[:, None] == WIDTH - 1, xv[None, :], 0.0)
    tl.debug_barrier()  # every thread has read the old state before any overwrites it
    tl.store(base + r[:, None] * s_row + c[None, :] * s_chan, shifted.to(state_ptr.dtype.element_ty),
             mask=(r[:, None] < WIDTH - 1) & cr[None, :])


@triton.jit
def _conv1d_kernel(x_ptr, w_ptr, bias_ptr, state_ptr, qsl_ptr, idx_ptr, init_ptr, out_ptr, channels,
                   s_slot, s_row, s_chan,
                   WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    seq = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < channels
    start = tl.load(qsl_ptr + seq).to(tl.int64)
    length = tl.load(qsl_ptr + seq + 1).to(tl.int64) - start
    slot = tl.load(idx_ptr + seq)
    real = slot >= 0
    use_state = real & (tl.load(init_ptr + seq) != 0)
    base = state_ptr + tl.where(real, slot, 0) * s_slot
    # channel masks folded with the per-sequence flags (a scalar flag & a vector mask is avoided:
    # the triton 3.9 interpreter rejects the resulting mask)
    cr = c < tl.where(real, channels, 0)
    cs = c < tl.where(use_state, channels, 0)
    bias = tl.zeros([BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + c, mask=cm, other=0.0).to(tl.float32)
    for t0 in range(0, length, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32) + bias[None, :]
        for k in tl.static_range(WIDTH):
            # input position t - (W-1) + k of the sequence; negative positions live in the state
            pos = t - (WIDTH - 1) + k
            wk = tl.load(w_ptr + c * WIDTH + k, mask=cm, other=0.0).to(tl.float32)
            xm = (pos >= 0) & (pos < length)
            xv = tl.load(x_ptr + (start + pos)[:, None] * channels + c[None, :],
                         mask=xm[:, None] & cm[None, :], other=0.0).to(tl.float32)
            sv = tl.load(base + (WIDTH - 1 + pos)[:, None] * s_row + c[None, :] * s_chan,
                         mask=(pos < 0)[:, None] & cs[None, :], other=0.0).to(tl.float32)
            acc += (xv + sv) * wk[None, :]
        if SILU:
            acc = _silu(acc)
        tl.store(out_ptr + (start + t)[:, None] * channels + c[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(t < length)[:, None] & cm[None, :])
    # final state row j = input position length - (W-1) + j of [start state | x]
    j = tl.arange(0, BLOCK_W)
    pos = length - (WIDTH - 1) + j
    xv = tl.load(x_ptr + (start + pos)[:, None] * channels + c[None, :],
                 mask=((pos >= 0) & (j < WIDTH - 1))[:, None] & cm[None, :], other=0.0).to(tl.float32)
    sv = tl.load(base + (WIDTH - 1 + pos)[:, None] * s_row + c[None, :] * s_chan,
                 mask=((pos < 0) & (j < WIDTH - 1))[:, None] & cs[None, :], other=0.0).to(tl.float32)
    tl.debug_barrier()  # all reads of the old state are done
    tl.store(base + j[:, None] * s_row + c[None, :] * s_chan, (xv + sv).to(state_ptr.dtype.element_ty),
             mask=(j < WIDTH - 1)[:, None] & cr[None, :])


def causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor,
                  query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor, *,
                  activation: str | None) -> Tensor:
    x, weight = x.contiguous(), weight.contiguous()
    channels, width = weight.shape
    batch = state_indices.shape[0]
    out = torch.empty_like(x)
    if batch == 0:
        return out
    block_c = min(_pow2(channels, 16), 128)
    grid = (batch, triton.cdiv(channels, block_c))
    _conv1d_kernel[grid](
        x, weight, bias if bias is not None else x, conv_states, query_start_loc.contiguous(),
        state_indices.to(torch.int64).contiguous(), has_initial_state.to(torch.int32).contiguous(), out,
        channels, *conv_states.stride(),
        WIDTH=width, BLOCK_W=_pow2(width), BLOCK_T=32, BLOCK_C=block_c,
        HAS_BIAS=bias is not None, SILU=activation == "silu")
    return out


def causal_conv1d_update(x: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor,
                         state_indices: Tensor, *, activation: str | None) -> Tensor:
    x, weight = x.contiguous(), weight.contiguous()
    rows, channels = x.shape
    out = torch.empty_like(x)
    if rows == 0:
        return out
    block_c = min(_pow2(channels, 16), 256)
    grid = (rows, triton.cdiv(channels, block_c))
    _conv1d_update_kernel[grid](
        x, weight, bias if bias is not None else x, conv_states, state_indices.to(torch.int64).contiguous(),
        out, channels, *conv_states.stride(),
        WIDTH=weight.shape[1], BLOCK_W=_pow2(weight.shape[1]), BLOCK_C=block_c,
        HAS_BIAS=bias is not None, SILU=activation == "silu")
    return out


# ==================================================================================================
# Mamba-2 SSD
# ==================================================================================================

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
    if HAS_BIAS:
        dt += tl.load(dt_bias_ptr + h).to(tl.float32)
    if SOFTPLUS:
        dt = _softplus(dt)
    if HAS_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_lo), dt_hi)
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


def _dt_flags(dt_bias: Tensor | None, dt_softplus: bool, dt_limit: tuple[float, float]) -> dict:
    has_limit = tuple(dt_limit) != DEFAULT_DT_LIMIT
    return dict(HAS_BIAS=dt_bias is not None, SOFTPLUS=bool(dt_softplus), HAS_LIMIT=has_limit)


def _dt_limit_args(dt_limit: tuple[float, float]) -> tuple[float, float]:
    lo, hi = dt_limit
    return float(lo), float(min(hi, 3.0e38))  # a finite stand-in for inf in a kernel argument


def ssd_state_update(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, ssm_states: Tensor,
                     state_indices: Tensor, *, D: Tensor | None, dt_bias: Tensor | None,
                     dt_softplus: bool, dt_limit: tuple[float, float]) -> Tensor:
    x, dt, B, C = x.contiguous(), dt.contiguous(), B.contiguous(), C.contiguous()
    rows, heads, head_dim = x.shape
    groups, state_size = B.shape[1:]
    out = torch.empty_like(x)
    if rows == 0:
        return out
    block_n = _pow2(state_size, 16)
    block_p = min(_pow2(head_dim, 16), max(16, 4096 // block_n))
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
    if HAS_BIAS:
        dt += tl.load(dt_bias_ptr + h).to(tl.float32)
    if SOFTPLUS:
        dt = _softplus(dt)
    if HAS_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_lo), dt_hi)
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

    f32 = dict(dtype=torch.float32, device=device)
    step = torch.empty(num_chunks, heads, q, **f32)
    cum = torch.empty(num_chunks, heads, q, **f32)
    local = torch.empty(num_chunks, heads, head_dim, state_size, **f32)
    entering = torch.empty(num_chunks, heads, head_dim, state_size, **f32)
    # bf16 tensor-core operands on CUDA only: the CPU interpreter multiplies bf16 bit patterns as ints
    low = x.dtype in (torch.bfloat16, torch.float16) and device.type == "cuda"
    block_p = min(_pow2(head_dim, 16), 64)
    block_n = min(_pow2(state_size, 16), 64)
    common = (heads, head_dim, state_size, heads // groups, groups)
    if num_chunks:
        _ssd_chunk_cumsum_kernel[(num_chunks, heads)](
            dt, dt_bias.contiguous() if dt_bias is not None else dt, A.contiguous(), chunk_start, chunk_len,
            step, cum, heads, *_dt_limit_args(dt_limit), Q=q, **_dt_flags(dt_bias, dt_softplus, dt_limit))
        n_blocks = triton.cdiv(state_size, block_n)
        _ssd_chunk_state_kernel[(num_chunks, heads, triton.cdiv(head_dim, block_p) * n_blocks)](
            x, B, step, cum, chunk_start, chunk_len, local, *common, n_blocks,
            Q=q, BLOCK_P=block_p, BLOCK_N=block_n, LOW_PRECISION=low)
    block = min(_pow2(head_dim * state_size), 1024)
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


# ==================================================================================================
# Mamba-1 selective scan
# ==================================================================================================

@triton.jit
def _selective_step(state, u, dt, a, b, c):
    """One token for a [D, N] block of the state: returns (new state, y before D and the gate)."""
    state = tl.exp(dt[:, None] * a) * state + (dt * u)[:, None] * b
    return state, tl.sum(state * c, axis=1)


@triton.jit
def _selective_scan_kernel(u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, state_ptr,
                           qsl_ptr, idx_ptr, init_ptr, out_ptr, channels, state_size, channels_per_group,
                           groups, s_slot, s_chan, s_n,
                           BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_D: tl.constexpr,
                           HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                           ALL_TOKENS_ONE_ROW: tl.constexpr):
    # per (sequence, block of channels): walk the tokens, state kept in registers.
    # ALL_TOKENS_ONE_ROW: decode form (row = one token, continuing from its slot)
    seq = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    dm = d < channels
    nm = n < state_size
    sm = dm[:, None] & nm[None, :]
    if ALL_TOKENS_ONE_ROW:
        start = seq.to(tl.int64)
        end = start + 1
    else:
        start = tl.load(qsl_ptr + seq).to(tl.int64)
        end = tl.load(qsl_ptr + seq + 1).to(tl.int64)
    slot = tl.load(idx_ptr + seq)
    real = slot >= 0
    use_state = real
    if not ALL_TOKENS_ONE_ROW:
        use_state = real & (tl.load(init_ptr + seq) != 0)
    ptrs = state_ptr + tl.where(real, slot, 0) * s_slot + d[:, None] * s_chan + n[None, :] * s_n
    state = tl.load(ptrs, mask=(d < tl.where(use_state, channels, 0))[:, None] & nm[None, :],
                    other=0.0).to(tl.float32)
    a = tl.load(A_ptr + d[:, None] * state_size + n[None, :], mask=sm, other=0.0).to(tl.float32)
    g = d // channels_per_group
    bias = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + d, mask=dm, other=0.0).to(tl.float32)
    skip = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_D:
        skip = tl.load(D_ptr + d, mask=dm, other=0.0).to(tl.float32)
    for t in range(start, end):
        u = tl.load(u_ptr + t * channels + d, mask=dm, other=0.0).to(tl.float32)
        dt = tl.load(delta_ptr + t * channels + d, mask=dm, other=0.0).to(tl.float32) + bias
        if SOFTPLUS:
            dt = _softplus(dt)
        bc = (t * groups + g[:, None]) * state_size + n[None, :]
        b = tl.load(B_ptr + bc, mask=sm, other=0.0).to(tl.float32)
        c = tl.load(C_ptr + bc, mask=sm, other=0.0).to(tl.float32)
        state, y = _selective_step(state, u, dt, a, b, c)
        y += skip * u
        if HAS_Z:
            y *= _silu(tl.load(z_ptr + t * channels + d, mask=dm, other=0.0).to(tl.float32))
        tl.store(out_ptr + t * channels + d, y.to(out_ptr.dtype.element_ty), mask=dm)
    tl.store(ptrs, state.to(state_ptr.dtype.element_ty), mask=(d < tl.where(real, channels, 0))[:, None] & nm[None, :])


def _selective(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, ssm_states: Tensor,
               query_start_loc: Tensor | None, state_indices: Tensor, has_initial_state: Tensor | None,
               D: Tensor | None, z: Tensor | None, delta_bias: Tensor | None, softplus: bool) -> Tensor:
    u, delta, B, C = u.contiguous(), delta.contiguous(), B.contiguous(), C.contiguous()
    channels = u.shape[1]
    groups, state_size = B.shape[1:]
    batch = state_indices.shape[0]
    out = torch.empty_like(u)
    if batch == 0:
        return out
    block_n = _pow2(state_size, 2)
    block_d = min(_pow2(channels, 16), max(16, 2048 // block_n))
    decode = query_start_loc is None
    _selective_scan_kernel[(batch, triton.cdiv(channels, block_d))](
        u, delta, A.contiguous(), B, C, D.contiguous() if D is not None else u,
        z.contiguous() if z is not None else u, delta_bias.contiguous() if delta_bias is not None else u,
        ssm_states, query_start_loc.contiguous() if not decode else state_indices,
        state_indices.to(torch.int64).contiguous(),
        has_initial_state.to(torch.int32).contiguous() if not decode else state_indices, out,
        channels, state_size, channels // groups, groups, *ssm_states.stride(),
        BLOCK_D=block_d, BLOCK_N=block_n, HAS_D=D is not None, HAS_Z=z is not None,
        HAS_BIAS=delta_bias is not None, SOFTPLUS=bool(softplus), ALL_TOKENS_ONE_ROW=decode)
    return out


def selective_scan(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, ssm_states: Tensor,
                   query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor, *,
                   D: Tensor | None, z: Tensor | None, delta_bias: Tensor | None,
                   delta_softplus: bool) -> Tensor:
    return _selective(u, delta, A, B, C, ssm_states, query_start_loc, state_indices, has_initial_state,
                      D, z, delta_bias, delta_softplus)


def selective_state_update(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, ssm_states: Tensor,
                           state_indices: Tensor, *, D: Tensor | None, z: Tensor | None,
                           dt_bias: Tensor | None, dt_softplus: bool) -> Tensor:
    return _selective(x, dt, A, B, C, ssm_states, None, state_indices, None, D, z, dt_bias, dt_softplus)


# ==================================================================================================
# Gated RMSNorm
# ==================================================================================================

@triton.jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, channels, group_size, eps,
                           BLOCK: tl.constexpr, HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * group_size + tl.arange(0, BLOCK)
    m = tl.arange(0, BLOCK) < group_size
    v = tl.load(x_ptr + row * channels + cols, mask=m, other=0.0).to(tl.float32)
    gate = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_Z:
        gate = _silu(tl.load(z_ptr + row * channels + cols, mask=m, other=0.0).to(tl.float32))
        if not NORM_BEFORE_GATE:
            v = v * gate
    inv = tl.rsqrt(tl.sum(v * v, axis=0) / group_size + eps)
    y = v * inv * tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_Z:
        if NORM_BEFORE_GATE:
            y = y * gate
    tl.store(out_ptr + row * channels + cols, y.to(out_ptr.dtype.element_ty), mask=m)


def gated_rms_norm(x: Tensor, z: Tensor | None, weight: Tensor, *, eps: float, group_size: int | None,
                   norm_before_gate: bool) -> Tensor:
    channels = x.shape[-1]
    size = channels if group_size is None else group_size
    flat = x.reshape(-1, channels).contiguous()
    gate = z.reshape(-1, channels).contiguous() if z is not None else flat
    out = torch.empty_like(flat)
    if flat.shape[0]:
        _gated_rms_norm_kernel[(flat.shape[0], channels // size)](
            flat, gate, weight.contiguous(), out, channels, size, float(eps),
            BLOCK=_pow2(size), HAS_Z=z is not None, NORM_BEFORE_GATE=bool(norm_before_gate))
    return out.view(x.shape)
