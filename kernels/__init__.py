"""Kernels for the executor: paged attention (full / sliding window, GQA), KV-cache writes, and
Mamba-1 / Mamba-2 ops (causal conv1d, SSD, selective scan, gated RMSNorm).

Each op is one function that dispatches on the tensors' device (CUDA -> Triton, CPU -> vectorized
torch) and accepts ``impl="reference" | "torch" | "triton"`` to force an implementation. The slow
oracle implementations live in `kernels.reference`. This package imports no gRPC and does not
import triton until a Triton implementation is actually used. See docs/kernels.md.
"""

import kvcache_common.quiet_torch  # noqa: F401  (before any torch import)
from kernels._dispatch import IMPLS, select_impl
from kernels.attention import paged_attention, write_kv_cache
from kernels.conv1d import causal_conv1d, causal_conv1d_update
from kernels.norm import gated_rms_norm
from kernels.selective_scan import selective_scan, selective_state_update
from kernels.ssd import ssd_scan, ssd_state_update

__all__ = [
    "IMPLS",
    "select_impl",
    "write_kv_cache",
    "paged_attention",
    "causal_conv1d",
    "causal_conv1d_update",
    "ssd_scan",
    "ssd_state_update",
    "selective_scan",
    "selective_state_update",
    "gated_rms_norm",
]
