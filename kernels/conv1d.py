"""Causal depthwise conv1d with a cached state: the short convolution in front of every Mamba mixer.

Semantics, for packed tokens x [T, C] and weight [C, W]:
    out[t, c] = act(bias[c] + sum_k weight[c, k] * x[t - (W-1) + k, c])
so weight[:, W-1] multiplies the current token. Positions before a sequence come from its cache
slot (has_initial_state True) or are zeros. Afterwards the slot holds the last W-1 RAW inputs of
[start state | x] (token-major [W-1, C]), which is exactly what the next call needs.

The rules every Mamba op shares (padding rows, has_initial_state, dtypes, argument checks) are
in kernels.validation and kernels.mamba_state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels._dispatch import run_impl, select_impl
from kernels.mamba_state import start_states, store_states
from kernels.validation import check_packed_batch, check_state_indices, check_tensor

ACTIVATIONS: tuple[str | None, ...] = (None, "silu")


def _check_activation(activation: object) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")


def _check_conv_weights(x: Tensor, weight: object, bias: object, conv_states: object) -> tuple[int, int]:
    check_tensor("x", x, (None, None))
    check_tensor("weight", weight, (x.shape[1], None))
    assert isinstance(weight, Tensor)
    channels, width = weight.shape
    if width < 2:
        raise ValueError(f"weight: conv width must be >= 2, got {width}")
    check_tensor("bias", bias, (channels,), optional=True)
    check_tensor("conv_states", conv_states, (None, width - 1, channels))
    return channels, width


# ---------------------------------------------------------------------------------------------
# Public ops
# ---------------------------------------------------------------------------------------------

def causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor,
                  query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor, *,
                  activation: str | None = "silu", impl: str | None = None) -> Tensor:
    """Prefill: conv over packed sequences x [T, C]; returns [T, C] and updates the used slots.

    conv_states [num_slots, W-1, C]; query_start_loc int32 [B+1]; state_indices int [B];
    has_initial_state bool [B].
    """
    check_tensor("x", x, (None, None))
    _check_conv_weights(x, weight, bias, conv_states)
    _check_activation(activation)
    check_packed_batch(query_start_loc, state_indices, has_initial_state, x.shape[0], conv_states.shape[0])
    which = select_impl(impl, x, weight, bias, conv_states, query_start_loc, state_indices,
                        has_initial_state)
    args = (x, weight, bias, conv_states, query_start_loc, state_indices, has_initial_state)
    return run_impl(which, "causal_conv1d", "triton_conv1d", _causal_conv1d_torch, *args, activation=activation)


def causal_conv1d_update(x: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor,
                         state_indices: Tensor, *, activation: str | None = "silu",
                         impl: str | None = None) -> Tensor:
    """Decode: one token per row, x [B, C]; rolls each used slot by one token; returns [B, C]."""
    check_tensor("x", x, (None, None))
    _check_conv_weights(x, weight, bias, conv_states)
    _check_activation(activation)
    check_state_indices(state_indices, x.shape[0], conv_states.shape[0])
    which = select_impl(impl, x, weight, bias, conv_states, state_indices)
    args = (x, weight, bias, conv_states, state_indices)
    return run_impl(which, "causal_conv1d_update", "triton_conv1d", _causal_conv1d_update_torch, *args,
                    activation=activation)


# ---------------------------------------------------------------------------------------------
# Vectorized torch implementations
# ---------------------------------------------------------------------------------------------

def _causal_conv1d_torch(x: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor,
                         query_start_loc: Tensor, state_indices: Tensor, has_initial_state: Tensor, *,
                         activation: str | None) -> Tensor:
    # A buffer that lays out, per sequence, [W-1 start rows | tokens]: every window that ends on a
    # token then stays inside its own sequence.
    tokens, channels = x.shape
    hist = weight.shape[1] - 1
    batch = state_indices.shape[0]
    device = x.device
    starts = query_start_loc.long()
    lengths = starts[1:] - starts[:-1]
    seq_ids = torch.arange(batch, device=device)
    seq_of_token = torch.repeat_interleave(seq_ids, lengths, output_size=tokens)
    token_ids = torch.arange(tokens, device=device)
    steps = torch.arange(hist, device=device)

    buf = torch.zeros(tokens + batch * hist, channels, dtype=torch.float32, device=device)
    buf[token_ids + (seq_of_token + 1) * hist] = x.float()
    first = start_states(conv_states, state_indices, has_initial_state & (state_indices >= 0))
    state_rows = ((starts[:-1] + seq_ids * hist)[:, None] + steps).reshape(-1)
    buf[state_rows] = first.reshape(-1, channels)

    out = x.new_empty(x.shape)
    if tokens > 0:
        # W shifted multiply-adds over the token-major buffer (contiguous slices): row i of acc is
        # the window starting at buffer row i; token t's window starts at t + seq * (W-1).
        w = weight.float()
        windows = buf.shape[0] - hist
        acc = buf[:windows] * w[:, 0]
        for k in range(1, hist + 1):
            acc.addcmul_(buf[k:k + windows], w[:, k])
        if bias is not None:
            acc += bias.float()
        y = acc[token_ids + seq_of_token * hist]
        out.copy_(F.silu(y) if activation == "silu" else y)
    final_rows = ((starts[1:] + seq_ids * hist)[:, None] + steps).reshape(-1)
    store_states(conv_states, state_indices, buf[final_rows].view(batch, hist, channels))
    return out


def _causal_conv1d_update_torch(x: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor,
                                state_indices: Tensor, *, activation: str | None) -> Tensor:
    window = torch.cat([start_states(conv_states, state_indices, state_indices >= 0),
                        x.float().unsqueeze(1)], dim=1)            # [B, W, C]
    y = torch.einsum("bwc,cw->bc", window, weight.float())
    if bias is not None:
        y = y + bias.float()
    store_states(conv_states, state_indices, window[:, 1:])
    return (F.silu(y) if activation == "silu" else y).to(x.dtype)
