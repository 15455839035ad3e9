"""Mamba-1 selective scan over packed sequences, and its single-token state update.

Math, per channel d (group g = d // (Dm // G)) and state index j, fp32:
    dt_t = softplus(delta_t + delta_bias)
    s_t[d, j] = exp(dt_t[d] * A[d, j]) * s_{t-1}[d, j] + dt_t[d] * u_t[d] * B_t[g, j]
    out_t[d] = (sum_j s_t[d, j] * C_t[g, j] + D[d] * u_t[d]) * silu(z_t[d])
ssm_states [num_slots, Dm, N] give each sequence's start state and receive its final state (see
kernels.mamba_state for the padding / has_initial_state rules). Unlike SSD the decay differs per state
index, so there is no cheap chunked matmul form: the CPU path walks the tokens, vectorized over
channels and state, and precomputes decays and inputs a block of tokens at a time.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels._dispatch import run_impl, select_impl
from kernels.mamba_state import start_states, store_states
from kernels.ssd import process_dt
from kernels.validation import check_packed_batch, check_state_indices, check_tensor

# Tokens whose decays and inputs are materialised at once ([block, Dm, N] fp32 temporaries).
_TOKEN_BLOCK = 64


def _check_selective(u: object, delta: object, A: object, B: object, C: object, ssm_states: object,
                     D: object, z: object, delta_bias: object, names: tuple[str, str, str]) -> None:
    u_name, delta_name, bias_name = names
    check_tensor(u_name, u, (None, None))
    assert isinstance(u, Tensor)
    rows, channels = u.shape
    check_tensor(delta_name, delta, (rows, channels))
    check_tensor("A", A, (channels, None))
    assert isinstance(A, Tensor)
    state_size = A.shape[1]
    check_tensor("B", B, (rows, None, state_size))
    assert isinstance(B, Tensor)
    groups = B.shape[1]
    if groups == 0 or channels % groups:
        raise ValueError(f"B: group count {groups} must divide the channel count {channels}")
    check_tensor("C", C, (rows, groups, state_size))
    check_tensor("ssm_states", ssm_states, (None, channels, state_size))
    check_tensor("D", D, (channels,), optional=True)
    check_tensor("z", z, (rows, channels), optional=True)
    check_tensor(bias_name, delta_bias, (channels,), optional=True)


def selective_scan(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, ssm_states: Tensor,
                   query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor, *,
                   D: Tensor | None = None, z: Tensor | None = None, delta_bias: Tensor | None = None,
                   delta_softplus: bool = True, impl: str | None = None) -> Tensor:
    """Mamba-1 prefill: u/delta/z [T, Dm], A [Dm, N], B/C [T, G, N] -> [T, Dm]."""
    _check_selective(u, delta, A, B, C, ssm_states, D, z, delta_bias, ("u", "delta", "delta_bias"))
    check_packed_batch(query_start_loc, state_indices, has_initial_state, u.shape[0], ssm_states.shape[0])
    which = select_impl(impl, u, delta, A, B, C, ssm_states, query_start_loc, state_indices,
                        has_initial_state, D, z, delta_bias)
    args = (u, delta, A, B, C, ssm_states, query_start_loc, state_indices, has_initial_state)
    kwargs: dict[str, Any] = dict(D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus)
    return run_impl(which, "selective_scan", "triton_selective_scan", _selective_scan_torch, *args, **kwargs)


def selective_state_update(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                           ssm_states: Tensor, state_indices: Tensor, *, D: Tensor | None = None,
                           z: Tensor | None = None, dt_bias: Tensor | None = None,
                           dt_softplus: bool = True, impl: str | None = None) -> Tensor:
    """Mamba-1 decode: x/dt/z [B, Dm], B/C [B, G, N]; updates ssm_states [slots, Dm, N] in place."""
    _check_selective(x, dt, A, B, C, ssm_states, D, z, dt_bias, ("x", "dt", "dt_bias"))
    check_state_indices(state_indices, x.shape[0], ssm_states.shape[0])
    which = select_impl(impl, x, dt, A, B, C, ssm_states, state_indices, D, z, dt_bias)
    args = (x, dt, A, B, C, ssm_states, state_indices)
    kwargs: dict[str, Any] = dict(D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus)
    return run_impl(which, "selective_state_update", "triton_selective_scan", _selective_state_update_torch,
                    *args, **kwargs)


# ---------------------------------------------------------------------------------------------
# Vectorized torch implementations
# ---------------------------------------------------------------------------------------------

def _finish(y: Tensor, u: Tensor, D: Tensor | None, z: Tensor | None) -> Tensor:
    """(y + D * u) * silu(z), in fp32."""
    if D is not None:
        y = y + D.float() * u.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y


def _selective_scan_torch(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor,
                          ssm_states: Tensor, query_start_loc: Tensor, state_indices: Tensor,
                          has_initial_state: Tensor, *, D: Tensor | None, z: Tensor | None,
                          delta_bias: Tensor | None, delta_softplus: bool) -> Tensor:
    tokens, channels = u.shape
    groups, state_size = B.shape[1:]
    per_group = channels // groups
    a = A.float().view(1, groups, per_group, state_size)
    step = process_dt(delta, delta_bias, delta_softplus)                     # [T, Dm]
    drive = (step * u.float()).view(tokens, groups, per_group, 1)
    state = start_states(ssm_states, state_indices, has_initial_state & (state_indices >= 0))
    y = torch.empty(tokens, channels, device=u.device)
    starts = query_start_loc.tolist()
    for seq in range(len(starts) - 1):
        s = state[seq].view(groups, per_group, state_size)
        for lo in range(starts[seq], starts[seq + 1], _TOKEN_BLOCK):
            hi = min(starts[seq + 1], lo + _TOKEN_BLOCK)
            decay = torch.exp(step[lo:hi].view(hi - lo, groups, per_group, 1) * a)    # [L, G, R, N]
            inputs = drive[lo:hi] * B[lo:hi].float().view(hi - lo, groups, 1, state_size)
            history = torch.empty_like(decay)
            for i in range(hi - lo):
                s = torch.addcmul(inputs[i], decay[i], s)
                history[i] = s
            y[lo:hi] = (history * C[lo:hi].float().view(hi - lo, groups, 1, state_size)).sum(-1).view(hi - lo, channels)
        state[seq] = s.view(channels, state_size)
    store_states(ssm_states, state_indices, state)
    return _finish(y, u, D, z).to(u.dtype)


def _selective_state_update_torch(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                                  ssm_states: Tensor, state_indices: Tensor, *, D: Tensor | None,
                                  z: Tensor | None, dt_bias: Tensor | None,
                                  dt_softplus: bool) -> Tensor:
    rows, channels = x.shape
    groups, state_size = B.shape[1:]
    per_group = channels // groups
    step = process_dt(dt, dt_bias, dt_softplus).view(rows, groups, per_group, 1)
    state = start_states(ssm_states, state_indices, state_indices >= 0).view(rows, groups, per_group, state_size)
    b = B.float().view(rows, groups, 1, state_size)
    state = torch.exp(step * A.float().view(1, groups, per_group, state_size)) * state \
        + step * x.float().view(rows, groups, per_group, 1) * b
    y = (state * C.float().view(rows, groups, 1, state_size)).sum(-1).view(rows, channels)
    store_states(ssm_states, state_indices, state.view(rows, channels, state_size))
    return _finish(y, x, D, z).to(x.dtype)
