"""Triton kernel of kernels.selective_scan: the Mamba-1 selective scan, prefill and decode in one
kernel (the state stays in registers while the tokens are walked in order).

Imported lazily by kernels.selective_scan (kernels._dispatch.load_triton_module); the rules the wrappers
keep are in kernels.triton_common.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.triton_common import pow2, silu, softplus


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
            dt = softplus(dt)
        bc = (t * groups + g[:, None]) * state_size + n[None, :]
        b = tl.load(B_ptr + bc, mask=sm, other=0.0).to(tl.float32)
        c = tl.load(C_ptr + bc, mask=sm, other=0.0).to(tl.float32)
        state, y = _selective_step(state, u, dt, a, b, c)
        y += skip * u
        if HAS_Z:
            y *= silu(tl.load(z_ptr + t * channels + d, mask=dm, other=0.0).to(tl.float32))
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
    block_n = pow2(state_size, 2)
    block_d = min(pow2(channels, 16), max(16, 2048 // block_n))
    decode = query_start_loc is None or has_initial_state is None
    # decode (one token per row, continuing from its slot) reads neither: any tensor will do
    starts = state_indices if query_start_loc is None else query_start_loc.contiguous()
    initial = state_indices if has_initial_state is None else has_initial_state.to(torch.int32).contiguous()
    _selective_scan_kernel[(batch, triton.cdiv(channels, block_d))](
        u, delta, A.contiguous(), B, C, D.contiguous() if D is not None else u,
        z.contiguous() if z is not None else u, delta_bias.contiguous() if delta_bias is not None else u,
        ssm_states, starts, state_indices.to(torch.int64).contiguous(), initial, out,
        channels, state_size, channels // groups, groups, *ssm_states.stride(),
        BLOCK_D=block_d, BLOCK_N=block_n, HAS_D=D is not None, HAS_Z=z is not None,
        HAS_BIAS=delta_bias is not None, SOFTPLUS=bool(softplus), ALL_TOKENS_ONE_ROW=decode)
    return out


def selective_scan(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, ssm_states: Tensor,
                   query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor, *,
                   D: Tensor | None, z: Tensor | None, delta_bias: Tensor | None,
                   delta_softplus: bool) -> Tensor:
    """The Triton launch of :func:`kernels.selective_scan.selective_scan` (Mamba-1 prefill; the
    inputs are checked there)."""
    return _selective(u, delta, A, B, C, ssm_states, query_start_loc, state_indices, has_initial_state,
                      D, z, delta_bias, delta_softplus)


def selective_state_update(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, ssm_states: Tensor,
                           state_indices: Tensor, *, D: Tensor | None, z: Tensor | None,
                           dt_bias: Tensor | None, dt_softplus: bool) -> Tensor:
    """The Triton launch of :func:`kernels.selective_scan.selective_state_update` (Mamba-1
    decode; the inputs are checked there)."""
    return _selective(x, dt, A, B, C, ssm_states, None, state_indices, None, D, z, dt_bias, dt_softplus)
