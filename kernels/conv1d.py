"""Causal depthwise conv1d with a cached state: the short convolution in front of every Mamba mixer.

Semantics (docs/kernels.md#causal-conv1d), for packed tokens x [T, C] and weight [C, W]:
    out[t, c] = act(bias[c] + sum_k weight[c, k] * x[t - (W-1) + k, c])
so weight[:, W-1] multiplies the current token. Positions before a sequence come from its cache
slot (has_initial_state True) or are zeros. Afterwards the slot holds the last W-1 RAW inputs of
[start state | x] (token-major [W-1, C]), which is exactly what the next call needs.

Invariants shared by all Mamba ops (this module also holds their argument checks):
- a row whose state index is < 0 is padding: it runs from a zero state and reads/writes no slot;
- has_initial_state False starts from zeros and never reads the slot (NaN garbage is ignored);
- math in fp32; outputs in the input's dtype; states keep their own dtype;
- bad arguments raise ValueError naming the argument before anything is written. Checks that need
  the tensors' values (index ranges, monotone starts) run on CPU only: on CUDA they would force a
  device sync on every call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import reference
from kernels._dispatch import load_triton_module, select_impl

ACTIVATIONS: tuple[str | None, ...] = (None, "silu")


# ---------------------------------------------------------------------------------------------
# Argument checks shared by the Mamba ops (conv1d, ssd, selective_scan)
# ---------------------------------------------------------------------------------------------

def check_tensor(name: str, t: object, shape: tuple[int | None, ...], *, floating: bool = True,
                 optional: bool = False) -> None:
    """Raise ValueError naming ``name`` unless ``t`` is a tensor of ``shape`` (None = any size)."""
    if t is None:
        if optional:
            return
        raise ValueError(f"{name}: a tensor is required, got None")
    if not isinstance(t, Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != len(shape) or any(want is not None and want != got for want, got in zip(shape, t.shape)):
        want_text = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: expected shape {want_text}, got {list(t.shape)}")
    if floating and not t.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point dtype, got {t.dtype}")


def check_state_indices(state_indices: object, rows: int, num_slots: int) -> None:
    """state_indices: integer [rows]; on CPU also every index < num_slots and no slot used twice."""
    check_tensor("state_indices", state_indices, (rows,), floating=False)
    assert isinstance(state_indices, Tensor)
    if state_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"state_indices: expected int32 or int64, got {state_indices.dtype}")
    if state_indices.device.type != "cpu" or rows == 0:
        return
    if int(state_indices.max()) >= num_slots:
        raise ValueError(f"state_indices: index {int(state_indices.max())} out of range for {num_slots} slots")
    real = state_indices[state_indices >= 0]
    if real.unique().numel() != real.numel():
        raise ValueError("state_indices: a slot appears in two rows (padding rows use index < 0)")


def check_batch(query_start_loc: object, state_indices: object, has_initial_state: object,
                num_tokens: int, num_slots: int) -> int:
    """Check the packed-batch metadata and return the number of sequences B."""
    check_tensor("query_start_loc", query_start_loc, (None,), floating=False)
    assert isinstance(query_start_loc, Tensor)
    if query_start_loc.dtype not in (torch.int32, torch.int64) or query_start_loc.numel() < 1:
        raise ValueError(f"query_start_loc: expected int32 [B+1], got {query_start_loc.dtype} "
                         f"{list(query_start_loc.shape)}")
    batch = query_start_loc.numel() - 1
    check_state_indices(state_indices, batch, num_slots)
    check_tensor("has_initial_state", has_initial_state, (batch,), floating=False)
    assert isinstance(has_initial_state, Tensor)
    if has_initial_state.dtype != torch.bool:
        raise ValueError(f"has_initial_state: expected bool, got {has_initial_state.dtype}")
    if query_start_loc.device.type == "cpu":
        starts = query_start_loc.tolist()
        if starts[0] != 0 or starts[-1] != num_tokens:
            raise ValueError(f"query_start_loc: must run from 0 to the token count {num_tokens}, "
                             f"got {starts[0]}..{starts[-1]}")
        if any(b < a for a, b in zip(starts, starts[1:])):
            raise ValueError("query_start_loc: must be non-decreasing")
    return batch


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
    check_batch(query_start_loc, state_indices, has_initial_state, x.shape[0], conv_states.shape[0])
    which = select_impl(impl, x, weight, bias, conv_states, query_start_loc, state_indices,
                        has_initial_state)
    args = (x, weight, bias, conv_states, query_start_loc, state_indices, has_initial_state)
    if which == "reference":
        return reference.causal_conv1d(*args, activation=activation)
    if which == "triton":
        return load_triton_module("triton_mamba").causal_conv1d(*args, activation=activation)
    return _causal_conv1d_torch(*args, activation=activation)


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
    if which == "reference":
        return reference.causal_conv1d_update(*args, activation=activation)
    if which == "triton":
        return load_triton_module("triton_mamba").causal_conv1d_update(*args, activation=activation)
    return _causal_conv1d_update_torch(*args, activation=activation)


# ---------------------------------------------------------------------------------------------
# Vectorized torch implementations
# ---------------------------------------------------------------------------------------------

def start_states(states: Tensor, state_indices: Tensor, use_slot: Tensor) -> Tensor:
    """fp32 copy of states[state_indices] where use_slot, zeros elsewhere (NaN in skipped slots stays out)."""
    gathered = states.index_select(0, state_indices.long().clamp(min=0)).float()
    if bool(use_slot.all()):
        return gathered
    mask = use_slot.view(-1, *([1] * (states.dim() - 1)))
    return torch.where(mask, gathered, torch.zeros((), device=states.device))


def store_states(states: Tensor, state_indices: Tensor, new: Tensor) -> None:
    """Write new[i] into states[state_indices[i]] for the non-padding rows only."""
    real = state_indices >= 0
    if bool(real.all()):
        states.index_copy_(0, state_indices.long(), new.to(states.dtype))
    else:
        states.index_copy_(0, state_indices[real].long(), new[real].to(states.dtype))


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
