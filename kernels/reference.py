"""Slow, obviously-correct reference implementations: the test oracle for every kernel.

Written for clarity, not speed: explicit loops over sequences and tokens, explicit masks, fp32
math. Each function has the same name and arguments as the public op it checks (minus ``impl``);
the public ops validate their arguments before calling in here, so these functions assume valid
input. The attention references go above the Mamba section.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# ================================================================================================
# Attention references (KV-cache write, paged attention): bottom-right causal, a window of W keys
# including the current one, the null block 0 before the window never read (docs/kernels.md).
# ================================================================================================


def write_kv_cache(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                   slot_mapping: Tensor) -> None:
    """Store token t's key/value at slot ``slot_mapping[t]`` (block * block_size + offset); -1 skips."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        k_cache[block, offset] = key[t].to(k_cache.dtype)
        v_cache[block, offset] = value[t].to(v_cache.dtype)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                    seq_lens: Tensor, query_start_loc: Tensor, *, scale: float,
                    sliding_window: int | None = None, softcap: float | None = None) -> Tensor:
    """Attention of packed queries over paged K/V, one query and one head at a time.

    Query i of request b sits at position ``seq_lens[b] - q_len_b + i`` and sees the keys
    ``max(0, pos - W + 1) .. pos`` (all keys up to pos without a window). Keys are fetched one
    position at a time through the block table, so only in-window table entries are touched.
    Tokens after ``query_start_loc[-1]`` belong to no request and get zeros.
    """
    num_tokens, num_q_heads, _ = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_q_heads, v_cache.shape[-1], dtype=torch.float32,
                      device=q.device)
    starts = query_start_loc.tolist()
    for b, kv_len in enumerate(seq_lens.tolist()):
        q_len = starts[b + 1] - starts[b]
        for i in range(q_len):
            t = starts[b] + i
            pos = kv_len - q_len + i
            first = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            keys, values = [], []
            for j in range(first, pos + 1):
                block = int(block_tables[b, j // block_size])
                keys.append(k_cache[block, j % block_size].float())
                values.append(v_cache[block, j % block_size].float())
            k = torch.stack(keys)  # [n_keys, Hkv, D]
            v = torch.stack(values)
            for h in range(num_q_heads):
                kv_head = h // group
                scores = (k[:, kv_head] @ q[t, h].float()) * scale
                if softcap is not None:
                    scores = softcap * torch.tanh(scores / softcap)
                weights = torch.softmax(scores, dim=0)
                out[t, h] = weights @ v[:, kv_head]
    return out.to(q.dtype)


# ================================================================================================
# Mamba references (conv1d, SSD, selective scan, gated RMSNorm), math in each op's module
# docstring. Padding rows (state index < 0) start from a zero state and write nothing;
# has_initial_state False starts from zeros whatever the slot holds.
# ================================================================================================


def _mamba_activation(v: Tensor, activation: str | None) -> Tensor:
    return F.silu(v) if activation == "silu" else v


def _mamba_dt(dt: Tensor, dt_bias: Tensor | None, softplus: bool,
              dt_limit: tuple[float, float] = (0.0, float("inf"))) -> Tensor:
    """Step size as the Mamba kernels define it: (dt + bias), softplus, then the clamp if not default."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def _mamba_start_state(states: Tensor, slot: int, has_initial: bool) -> Tensor:
    if slot >= 0 and has_initial:
        return states[slot].float().clone()
    return torch.zeros(states.shape[1:], dtype=torch.float32, device=states.device)


def causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor,
                  query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor, *,
                  activation: str | None = "silu") -> Tensor:
    """Token-by-token depthwise causal conv over packed sequences; stores the last W-1 raw inputs."""
    channels, width = weight.shape
    w = weight.float()
    b = bias.float() if bias is not None else torch.zeros(channels, device=x.device)
    out = torch.empty_like(x)
    starts = query_start_loc.tolist()
    for seq in range(len(starts) - 1):
        slot = int(state_indices[seq])
        start_state = _mamba_start_state(conv_states, slot, bool(has_initial_state[seq]))
        history = [start_state[k] for k in range(width - 1)]  # oldest first
        for t in range(starts[seq], starts[seq + 1]):
            history.append(x[t].float())
            window = history[-width:]
            acc = b.clone()
            for k in range(width):
                acc = acc + w[:, k] * window[k]
            out[t] = _mamba_activation(acc, activation).to(x.dtype)
        if slot >= 0:
            conv_states[slot] = torch.stack(history[-(width - 1):]).to(conv_states.dtype)
    return out


def causal_conv1d_update(x: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor,
                         state_indices: Tensor, *, activation: str | None = "silu") -> Tensor:
    """One decode token per row: a length-1 prefill that continues from the slot's state."""
    rows = x.shape[0]
    query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=x.device)
    has_initial = torch.ones(rows, dtype=torch.bool, device=x.device)
    return causal_conv1d(x, weight, bias, conv_states, query_start_loc, state_indices, has_initial,
                         activation=activation)


def ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, ssm_states: Tensor,
             query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor, *,
             D: Tensor | None = None, dt_bias: Tensor | None = None, dt_softplus: bool = True,
             dt_limit: tuple[float, float] = (0.0, float("inf")), chunk_size: int = 64) -> Tensor:
    """Mamba-2 as its token-by-token recurrence (chunk_size is accepted and ignored).

    S_t = exp(dt_t * A_h) * S_{t-1} + dt_t * x_t (outer) B_t;  y_t = S_t C_t + D * x_t.
    """
    del chunk_size  # the recurrence has no chunks; the result must not depend on them
    heads, groups = x.shape[1], B.shape[1]
    group_of_head = torch.arange(heads, device=x.device) // (heads // groups)
    step = _mamba_dt(dt, dt_bias, dt_softplus, dt_limit)  # [T, H]
    a = A.float()
    out = torch.empty_like(x)
    starts = query_start_loc.tolist()
    for seq in range(len(starts) - 1):
        slot = int(state_indices[seq])
        state = _mamba_start_state(ssm_states, slot, bool(has_initial_state[seq]))  # [H, P, N]
        for t in range(starts[seq], starts[seq + 1]):
            xt = x[t].float()                        # [H, P]
            bt = B[t].float()[group_of_head]         # [H, N]
            ct = C[t].float()[group_of_head]         # [H, N]
            decay = torch.exp(step[t] * a)           # [H]
            state = decay[:, None, None] * state + (step[t][:, None] * xt)[:, :, None] * bt[:, None, :]
            yt = (state * ct[:, None, :]).sum(-1)    # [H, P]
            if D is not None:
                yt = yt + (D.float()[:, None] if D.dim() == 1 else D.float()) * xt
            out[t] = yt.to(x.dtype)
        if slot >= 0:
            ssm_states[slot] = state.to(ssm_states.dtype)
    return out


def ssd_state_update(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, ssm_states: Tensor,
                     state_indices: Tensor, *, D: Tensor | None = None, dt_bias: Tensor | None = None,
                     dt_softplus: bool = True,
                     dt_limit: tuple[float, float] = (0.0, float("inf"))) -> Tensor:
    """Mamba-2 decode: a one-token ssd_scan per row that continues from the slot's state."""
    rows = x.shape[0]
    query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=x.device)
    has_initial = torch.ones(rows, dtype=torch.bool, device=x.device)
    return ssd_scan(x, dt, A, B, C, ssm_states, query_start_loc, state_indices, has_initial,
                    D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)


def selective_scan(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, ssm_states: Tensor,
                   query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor, *,
                   D: Tensor | None = None, z: Tensor | None = None, delta_bias: Tensor | None = None,
                   delta_softplus: bool = True) -> Tensor:
    """Mamba-1 as its token-by-token recurrence, per channel d and state index j:

    s_t[d, j] = exp(dt_t[d] * A[d, j]) * s_{t-1}[d, j] + dt_t[d] * B_t[j] * u_t[d];
    out_t = (sum_j s_t[:, j] * C_t[j] + D * u_t) * silu(z_t).
    """
    channels, groups = u.shape[1], B.shape[1]
    group_of_channel = torch.arange(channels, device=u.device) // (channels // groups)
    step = _mamba_dt(delta, delta_bias, delta_softplus)  # [T, Dm]
    a = A.float()
    out = torch.empty_like(u)
    starts = query_start_loc.tolist()
    for seq in range(len(starts) - 1):
        slot = int(state_indices[seq])
        state = _mamba_start_state(ssm_states, slot, bool(has_initial_state[seq]))  # [Dm, N]
        for t in range(starts[seq], starts[seq + 1]):
            ut = u[t].float()
            bt = B[t].float()[group_of_channel]  # [Dm, N]
            ct = C[t].float()[group_of_channel]
            state = torch.exp(step[t][:, None] * a) * state + (step[t] * ut)[:, None] * bt
            yt = (state * ct).sum(-1)
            if D is not None:
                yt = yt + D.float() * ut
            if z is not None:
                yt = yt * F.silu(z[t].float())
            out[t] = yt.to(u.dtype)
        if slot >= 0:
            ssm_states[slot] = state.to(ssm_states.dtype)
    return out


def selective_state_update(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                           ssm_states: Tensor, state_indices: Tensor, *, D: Tensor | None = None,
                           z: Tensor | None = None, dt_bias: Tensor | None = None,
                           dt_softplus: bool = True) -> Tensor:
    """Mamba-1 decode: a one-token selective_scan per row that continues from the slot's state."""
    rows = x.shape[0]
    query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=x.device)
    has_initial = torch.ones(rows, dtype=torch.bool, device=x.device)
    return selective_scan(x, dt, A, B, C, ssm_states, query_start_loc, state_indices, has_initial,
                          D=D, z=z, delta_bias=dt_bias, delta_softplus=dt_softplus)


def gated_rms_norm(x: Tensor, z: Tensor | None, weight: Tensor, *, eps: float = 1e-6,
                   group_size: int | None = None, norm_before_gate: bool = False) -> Tensor:
    """RMSNormGated: gate = silu(z); normalise (x * gate) or x in groups of channels, times weight."""
    channels = x.shape[-1]
    size = channels if group_size is None else group_size
    out = torch.empty_like(x)
    for row in range(x.reshape(-1, channels).shape[0]):
        xr = x.reshape(-1, channels)[row].float()
        gate = F.silu(z.reshape(-1, channels)[row].float()) if z is not None else None
        if gate is not None and not norm_before_gate:
            xr = xr * gate
        yr = torch.empty_like(xr)
        for first in range(0, channels, size):
            part = xr[first:first + size]
            yr[first:first + size] = part / torch.sqrt(part.pow(2).mean() + eps)
        yr = yr * weight.float()
        if gate is not None and norm_before_gate:
            yr = yr * gate
        out.reshape(-1, channels)[row] = yr.to(x.dtype)
    return out
