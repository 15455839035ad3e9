"""GPU check for the Mamba kernels (called by bench/gpu_check.py; also runnable alone).

On CUDA: (1) the Mamba-2 decode state update over ~1 GiB of fp32 state (256 requests x
Nemotron-H-8B-like 128 heads x 64 x 128 state): achieved GB/s vs the 4.3 TB/s measured H200 copy
bandwidth; (2) the Triton SSD prefill (8 x 4,096 tokens, 128 heads x 64, state 128, 8 groups, bf16,
chunk 128): TFLOP/s vs ~790 (measured bf16 matmul). Each also checks the Triton result against the
torch path on a slice (rms error ratio). dry_run=True shrinks everything to seconds on any device
and checks against the slow reference instead; on CPU it times the Triton kernels in the
interpreter when TRITON_INTERPRET=1 is set (bench/gpu_check.py sets it), else the torch path.
It exercises the plumbing, not the hardware.

    python3 bench/gpu_check_mamba.py [--device cuda] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

# Run from a checkout, installed or not: the checks import `kernels` from this tree.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PEAK_BANDWIDTH_GBPS = 4300.0  # measured H200 device-to-device copy (a 2 GiB bf16 copy)
PEAK_BF16_TFLOPS = 790.0      # measured H200 bf16 matmul


def _seconds(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Mean seconds per call after two warm-up calls (CUDA events on GPU, perf_counter on CPU)."""
    fn()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3 / iters
    begin = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - begin) / iters


def _rms_ratio(actual: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (actual.float() - expected.float()).pow(2).mean().sqrt()
    return float(diff / expected.float().pow(2).mean().sqrt().clamp(min=1e-12))


def timed_impl(device: torch.device) -> str:
    """The implementation the timed calls run: Triton on CUDA and under the CPU interpreter
    (TRITON_INTERPRET=1, which bench/gpu_check.py sets on CPU), else the torch path."""
    from kernels._dispatch import triton_interpret_enabled

    return "triton" if device.type == "cuda" or triton_interpret_enabled() else "torch"


def check_state_update(device: torch.device, dry_run: bool) -> dict:
    """ssd_state_update on the device: the Triton kernel against the reference, timed."""
    from kernels import ssd_state_update

    rows, heads, head_dim, state, groups = (4, 4, 16, 16, 2) if dry_run else (256, 128, 64, 128, 8)
    gen = torch.Generator().manual_seed(0)
    states = torch.randn(rows + 1, heads, head_dim, state, generator=gen).to(device)  # slot 0: unused
    x = torch.randn(rows, heads, head_dim, generator=gen).to(device, torch.bfloat16)
    dt = torch.randn(rows, heads, generator=gen).to(device, torch.bfloat16)
    A = -torch.exp(torch.rand(heads, generator=gen)).to(device)
    B = torch.randn(rows, groups, state, generator=gen).to(device, torch.bfloat16)
    C = torch.randn(rows, groups, state, generator=gen).to(device, torch.bfloat16)
    D, dt_bias = torch.randn(heads, generator=gen).to(device), (torch.rand(heads, generator=gen) - 4).to(device)
    slots = torch.randperm(rows, generator=gen).add(1).to(device)

    def call(impl: str | None, st: torch.Tensor) -> torch.Tensor:
        return ssd_state_update(x, dt, A, B, C, st, slots, D=D, dt_bias=dt_bias, impl=impl)

    oracle = "reference" if dry_run else "torch"
    expected_states = states.clone()
    expected = call(oracle, expected_states)
    impl = timed_impl(device)
    got = call(impl, states)
    error = max(_rms_ratio(got, expected), _rms_ratio(states, expected_states))
    seconds = _seconds(lambda: call(impl, states), device, 3 if dry_run else 20)
    state_bytes = rows * heads * head_dim * state * states.element_size()
    moved = 2 * state_bytes + rows * (2 * heads * head_dim + heads + 2 * groups * state) * x.element_size()
    gbps = moved / seconds / 1e9
    return {"check": "mamba2_state_update_bandwidth", "device": str(device), "dry_run": dry_run,
            "shape": f"B={rows} h={heads} p={head_dim} n={state} g={groups} state fp32, x bf16",
            "state_GiB": state_bytes / 2**30, "ms": seconds * 1e3, "GBps": gbps,
            "fraction_of_peak": gbps / PEAK_BANDWIDTH_GBPS, "peak": "4.3 TB/s",
            "impl": impl, "oracle": oracle, "rms_error_vs_oracle": error, "ok": error < 1e-2}


def _ssd_flops(num_chunks: int, heads: int, q: int, head_dim: int, state: int) -> float:
    """FLOPs the chunked scan performs: C.B scores, the masked Q x Q product with x, the chunk end
    state and the carried-state product (2 FLOPs per multiply-add; the full Q x Q square is counted)."""
    return 2.0 * num_chunks * heads * (q * q * state + q * q * head_dim + 2 * q * head_dim * state)


def check_ssd_prefill(device: torch.device, dry_run: bool) -> dict:
    """ssd_scan on the device: the Triton kernel against the reference, timed."""
    from kernels import ssd_scan

    seqs, length, heads, head_dim, state, groups, q = (
        (2, 40, 4, 16, 16, 2, 16) if dry_run else (8, 4096, 128, 64, 128, 8, 128))
    tokens = seqs * length
    gen = torch.Generator().manual_seed(1)
    dtype = torch.bfloat16
    x = torch.randn(tokens, heads, head_dim, generator=gen).to(device, dtype)
    dt = torch.randn(tokens, heads, generator=gen).to(device, dtype)
    A = -torch.exp(torch.rand(heads, generator=gen)).to(device)
    B = torch.randn(tokens, groups, state, generator=gen).to(device, dtype)
    C = torch.randn(tokens, groups, state, generator=gen).to(device, dtype)
    D, dt_bias = torch.randn(heads, generator=gen).to(device), (torch.rand(heads, generator=gen) - 4).to(device)
    states = torch.zeros(seqs, heads, head_dim, state, device=device)
    starts = (torch.arange(seqs + 1) * length).to(torch.int32).to(device)
    slots = torch.arange(seqs, device=device)
    fresh = torch.zeros(seqs, dtype=torch.bool, device=device)

    def call(impl: str | None, n: int = seqs) -> torch.Tensor:
        return ssd_scan(x[: n * length], dt[: n * length], A, B[: n * length], C[: n * length], states,
                        starts[: n + 1], slots[:n], fresh[:n], D=D, dt_bias=dt_bias, chunk_size=q, impl=impl)

    oracle = "reference" if dry_run else "torch"
    few = 1 if not dry_run else seqs  # the oracle on a slice keeps the check's memory small
    impl = timed_impl(device)
    error = _rms_ratio(call(impl, few), call(oracle, few))
    seconds = _seconds(lambda: call(impl), device, 2 if dry_run else 10)
    flops = _ssd_flops(seqs * (length // q + (length % q > 0)), heads, q, head_dim, state)
    tflops = flops / seconds / 1e12
    return {"check": "ssd_prefill_tflops", "device": str(device), "dry_run": dry_run,
            "shape": f"{seqs}x{length} tokens h={heads} p={head_dim} n={state} g={groups} bf16 chunk {q}",
            "ms": seconds * 1e3, "TFLOPs": tflops, "fraction_of_peak": tflops / PEAK_BF16_TFLOPS,
            "peak": "790 TFLOP/s bf16", "impl": impl, "oracle": oracle, "rms_error_vs_oracle": error,
            "ok": error < 2e-2}


def run(device: str, dry_run: bool) -> list[dict]:
    """Run both Mamba checks on ``device``; dry_run uses tiny shapes (any device, seconds)."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device: CUDA requested but torch sees no GPU")
    if dev.type != "cuda" and not dry_run:
        raise ValueError("dry_run: full-size checks need a CUDA device; use dry_run=True on CPU")
    return [check_state_update(dev, dry_run), check_ssd_prefill(dev, dry_run)]


def main(argv: list[str] | None = None) -> None:
    """Prints the Mamba checks' rows as JSON lines."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    for row in run(args.device, args.dry_run or not args.device.startswith("cuda")):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
