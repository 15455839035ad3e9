"""Triton kernels of kernels.conv1d: causal conv1d prefill over packed sequences and the
single-token update.

Imported lazily by kernels.conv1d (kernels._dispatch.load_triton_module); the rules the wrappers
keep are in kernels.triton_common.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.triton_common import pow2, silu


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
        acc = silu(acc)
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
            acc = silu(acc)
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
    """The Triton launch of :func:`kernels.conv1d.causal_conv1d` (prefill; the inputs are
    checked there)."""
    x, weight = x.contiguous(), weight.contiguous()
    channels, width = weight.shape
    batch = state_indices.shape[0]
    out = torch.empty_like(x)
    if batch == 0:
        return out
    block_c = min(pow2(channels, 16), 128)
    grid = (batch, triton.cdiv(channels, block_c))
    _conv1d_kernel[grid](
        x, weight, bias if bias is not None else x, conv_states, query_start_loc.contiguous(),
        state_indices.to(torch.int64).contiguous(), has_initial_state.to(torch.int32).contiguous(), out,
        channels, *conv_states.stride(),
        WIDTH=width, BLOCK_W=pow2(width), BLOCK_T=32, BLOCK_C=block_c,
        HAS_BIAS=bias is not None, SILU=activation == "silu")
    return out


def causal_conv1d_update(x: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor,
                         state_indices: Tensor, *, activation: str | None) -> Tensor:
    """The Triton launch of :func:`kernels.conv1d.causal_conv1d_update` (decode; the inputs are
    checked there)."""
    x, weight = x.contiguous(), weight.contiguous()
    rows, channels = x.shape
    out = torch.empty_like(x)
    if rows == 0:
        return out
    block_c = min(pow2(channels, 16), 256)
    grid = (rows, triton.cdiv(channels, block_c))
    _conv1d_update_kernel[grid](
        x, weight, bias if bias is not None else x, conv_states, state_indices.to(torch.int64).contiguous(),
        out, channels, *conv_states.stride(),
        WIDTH=weight.shape[1], BLOCK_W=pow2(weight.shape[1]), BLOCK_C=block_c,
        HAS_BIAS=bias is not None, SILU=activation == "silu")
    return out
