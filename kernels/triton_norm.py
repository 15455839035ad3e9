"""Triton kernel of kernels.norm: gated RMSNorm, one program per (row, channel group).

Imported lazily by kernels.norm (kernels._dispatch.load_triton_module); the rules the wrappers
keep are in kernels.triton_common.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.triton_common import pow2, silu


@triton.jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, channels, group_size, eps,
                           BLOCK: tl.constexpr, HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * group_size + tl.arange(0, BLOCK)
    m = tl.arange(0, BLOCK) < group_size
    v = tl.load(x_ptr + row * channels + cols, mask=m, other=0.0).to(tl.float32)
    gate = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_Z:
        gate = silu(tl.load(z_ptr + row * channels + cols, mask=m, other=0.0).to(tl.float32))
        if not NORM_BEFORE_GATE:
            v = v * gate
    inv = tl.rsqrt(tl.sum(v * v, axis=0) / group_size + eps)
    y = v * inv * tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_Z and NORM_BEFORE_GATE:
        y = y * gate
    tl.store(out_ptr + row * channels + cols, y.to(out_ptr.dtype.element_ty), mask=m)


def gated_rms_norm(x: Tensor, z: Tensor | None, weight: Tensor, *, eps: float, group_size: int | None,
                   norm_before_gate: bool) -> Tensor:
    """The Triton launch of the gated RMS norm of :mod:`kernels.norm` (the inputs are checked
    there)."""
    channels = x.shape[-1]
    size = channels if group_size is None else group_size
    flat = x.reshape(-1, channels).contiguous()
    gate = z.reshape(-1, channels).contiguous() if z is not None else flat
    out = torch.empty_like(flat)
    if flat.shape[0]:
        _gated_rms_norm_kernel[(flat.shape[0], channels // size)](
            flat, gate, weight.contiguous(), out, channels, size, float(eps),
            BLOCK=pow2(size), HAS_Z=z is not None, NORM_BEFORE_GATE=bool(norm_before_gate))
    return out.view(x.shape)
