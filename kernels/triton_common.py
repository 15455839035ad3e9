"""Triton building blocks shared by the Mamba kernels (kernels.triton_conv1d, triton_ssd,
triton_selective_scan, triton_norm): launch-size rounding and the jitted activations.

Like every ``kernels.triton_*`` module it is imported lazily, never at package import: Triton
decides at decoration time whether the kernels run in its CPU interpreter (TRITON_INTERPRET=1).

The Mamba wrappers (``causal_conv1d``, ``ssd_scan``, ... in each ``kernels.triton_<op>``) take the
same arguments as the torch implementations, already validated by the public op in ``kernels.<op>``,
and keep their invariants: fp32 math, outputs in the input dtype, states in their own dtype, state
index < 0 = padding row (zero start state, no slot read or written), has_initial_state False = zero
start state. State caches may be strided views (e.g. into a shared block pool); the other inputs
are made contiguous. Every module runs compiled on CUDA and, for tests on tiny shapes, on CPU
tensors under TRITON_INTERPRET=1, and uses only Triton APIs present in triton 3.6 (the GPU image).
"""

from __future__ import annotations

import triton
import triton.language as tl


def pow2(n: int, least: int = 1) -> int:
    """The next power of two >= n (and >= least): Triton block sizes must be powers of two."""
    return max(least, triton.next_power_of_2(max(1, n)))


@triton.jit
def softplus(v):
    """log(1 + e^v), exact for large v (no overflow past 20, as torch)."""
    # log(1 + e^v); the large-v branch avoids overflow (torch's threshold is 20 too)
    return tl.where(v <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(v, 20.0))), v)


@triton.jit
def silu(v):
    """v * sigmoid(v)."""
    return v * tl.sigmoid(v)
