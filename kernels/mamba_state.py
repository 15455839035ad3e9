"""Reading and writing the per-sequence state slots of the Mamba ops (conv and SSM state caches).

Rules every Mamba op keeps:
- a row whose state index is < 0 is padding: it runs from a zero state and reads/writes no slot;
- has_initial_state False starts from zeros and never reads the slot (NaN garbage is ignored);
- math in fp32; outputs in the input's dtype; states keep their own dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor


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
