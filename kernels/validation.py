"""Argument checks shared by the Mamba ops (kernels.conv1d, ssd, selective_scan, norm).

Every check raises ValueError naming the bad argument, and the public ops run them before anything
is written, so a bad call changes no state. Checks that need the tensors' values (index ranges,
duplicate slots, monotone starts) run on CPU tensors only: on CUDA they would force a device sync
on every call.
"""

from __future__ import annotations

import torch
from torch import Tensor


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


def check_packed_batch(query_start_loc: object, state_indices: object, has_initial_state: object,
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
