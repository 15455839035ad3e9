"""Gated RMSNorm (Mamba-2's RMSNormGated), applied to the SSD output with the z gate.

norm_before_gate False (what Mamba-2 blocks use): y = x * silu(z), then each group of group_size
channels is divided by its RMS, then multiplied by weight. norm_before_gate True: normalise x,
multiply by weight, then by silu(z). No z: plain (grouped) RMSNorm. fp32 math, output in x's dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels._dispatch import run_impl, select_impl
from kernels.validation import check_tensor


def gated_rms_norm(x: Tensor, z: Tensor | None, weight: Tensor, *, eps: float = 1e-6,
                   group_size: int | None = None, norm_before_gate: bool = False,
                   impl: str | None = None) -> Tensor:
    """x [..., Dm], z like x or None, weight [Dm] -> like x. group_size must divide Dm (None = Dm)."""
    check_tensor("x", x, (None,) * (x.dim() if isinstance(x, Tensor) and x.dim() > 0 else 1))
    channels = x.shape[-1]
    if z is not None:
        check_tensor("z", z, tuple(x.shape))
    check_tensor("weight", weight, (channels,))
    if group_size is not None and (not isinstance(group_size, int) or group_size < 1
                                   or channels % group_size):
        raise ValueError(f"group_size: must be a positive divisor of {channels}, got {group_size!r}")
    if not eps >= 0:
        raise ValueError(f"eps: must be >= 0, got {eps!r}")
    which = select_impl(impl, x, z, weight)
    kwargs: dict[str, Any] = dict(eps=eps, group_size=group_size, norm_before_gate=norm_before_gate)
    return run_impl(which, "gated_rms_norm", "triton_norm", _gated_rms_norm_torch, x, z, weight, **kwargs)


def _gated_rms_norm_torch(x: Tensor, z: Tensor | None, weight: Tensor, *, eps: float,
                          group_size: int | None, norm_before_gate: bool) -> Tensor:
    channels = x.shape[-1]
    size = channels if group_size is None else group_size
    y = x.float()
    gate = None if z is None else F.silu(z.float())
    if gate is not None and not norm_before_gate:
        y = y * gate
    grouped = y.reshape(*y.shape[:-1], channels // size, size)
    y = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)).reshape(y.shape)
    y = y * weight.float()
    if gate is not None and norm_before_gate:
        y = y * gate
    return y.to(x.dtype)
