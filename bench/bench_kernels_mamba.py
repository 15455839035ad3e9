"""CPU benchmark: the Mamba kernels' torch paths vs their token-by-token references.

Same inputs, same fp32 math, one run side by side: SSD chunked scan (Q=64) vs the recurrence at
1,024 and 4,096 tokens (target >= 5x), conv1d prefill/update, the Mamba-2 and Mamba-1 state
updates, the Mamba-1 scan and the gated RMSNorm. Shapes follow Falcon-H1-0.5B (24 heads x 64,
state 128, conv channels 1,792) and Jamba-like Mamba-1 (2,048 channels, state 16).

    OMP_NUM_THREADS=1 python3 bench/bench_kernels_mamba.py [--threads 1] [--repeat 3] [--quick]

Prints a table and writes bench/results/kernels_mamba.json. --quick shrinks the shapes (a smoke run).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from _common import RESULTS_DIR, print_table, write_results
from kernels import (
    causal_conv1d,
    causal_conv1d_update,
    gated_rms_norm,
    selective_scan,
    selective_state_update,
    ssd_scan,
    ssd_state_update,
)

RESULTS = RESULTS_DIR / "kernels_mamba.json"


def _time(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds per call after one warm-up call."""
    fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _packed(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    starts = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return starts, torch.arange(len(lengths)), torch.zeros(len(lengths), dtype=torch.bool)


def _case(name: str, shape: str, fast: Callable[[], object], ref: Callable[[], object], repeat: int,
          ref_repeat: int, bytes_moved: int | None = None, target: float | None = None) -> dict:
    fast_s = _time(fast, repeat)
    ref_s = _time(ref, ref_repeat)
    row = {"op": name, "shape": shape, "torch_ms": fast_s * 1e3, "reference_ms": ref_s * 1e3,
           "speedup": ref_s / fast_s, "target_speedup": target}
    if bytes_moved is not None:
        row["torch_GBps"] = bytes_moved / fast_s / 1e9
    return row


def bench_ssd(tokens: int, heads: int, head_dim: int, state: int, repeat: int) -> dict:
    """ssd_scan (Mamba-2 prefill): the torch path against the reference, one row."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, heads, head_dim, generator=gen)
    dt = torch.randn(tokens, heads, generator=gen)
    A = -torch.exp(torch.rand(heads, generator=gen))
    B = torch.randn(tokens, 1, state, generator=gen)
    C = torch.randn(tokens, 1, state, generator=gen)
    D, dt_bias = torch.randn(heads, generator=gen), torch.rand(heads, generator=gen) - 4
    states = torch.zeros(1, heads, head_dim, state)
    meta = _packed([tokens])

    def run(impl: str) -> Callable[[], object]:
        return lambda: ssd_scan(x, dt, A, B, C, states, *meta, D=D, dt_bias=dt_bias, chunk_size=64, impl=impl)

    return _case("ssd_scan", f"T={tokens} h={heads} p={head_dim} n={state}", run("torch"), run("reference"),
                 repeat, 1, target=5.0)


def bench_conv(tokens: int, channels: int, repeat: int) -> list[dict]:
    """causal_conv1d prefill and update: the torch path against the reference, one row each."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, channels, generator=gen)
    w, bias = torch.randn(channels, 4, generator=gen), torch.randn(channels, generator=gen)
    states = torch.zeros(64, 3, channels)
    meta = _packed([tokens])
    xd = torch.randn(64, channels, generator=gen)
    slots = torch.arange(64)

    def prefill(impl: str) -> Callable[[], object]:
        return lambda: causal_conv1d(x, w, bias, states, *meta, impl=impl)

    def update(impl: str) -> Callable[[], object]:
        return lambda: causal_conv1d_update(xd, w, bias, states, slots, impl=impl)

    return [_case("causal_conv1d", f"T={tokens} C={channels} W=4", prefill("torch"), prefill("reference"),
                  repeat, 1),
            _case("causal_conv1d_update", f"B=64 C={channels} W=4", update("torch"), update("reference"),
                  repeat, repeat, bytes_moved=64 * channels * (2 * 3 + 2) * 4)]


def bench_ssd_update(rows: int, heads: int, head_dim: int, state: int, repeat: int) -> dict:
    """ssd_state_update (Mamba-2 decode): the torch path against the reference, one row."""
    gen = torch.Generator().manual_seed(2)
    states = torch.randn(rows, heads, head_dim, state, generator=gen)
    x = torch.randn(rows, heads, head_dim, generator=gen)
    dt = torch.randn(rows, heads, generator=gen)
    A = -torch.exp(torch.rand(heads, generator=gen))
    B, C = torch.randn(rows, 1, state, generator=gen), torch.randn(rows, 1, state, generator=gen)
    slots = torch.arange(rows)

    def run(impl: str) -> Callable[[], object]:
        return lambda: ssd_state_update(x, dt, A, B, C, states, slots, D=A, dt_bias=A, impl=impl)

    return _case("ssd_state_update", f"B={rows} h={heads} p={head_dim} n={state}", run("torch"), run("reference"),
                 repeat, repeat, bytes_moved=2 * states.numel() * 4)


def bench_mamba1(tokens: int, rows: int, channels: int, state: int, repeat: int) -> list[dict]:
    """selective_scan and selective_state_update (Mamba-1): the torch path against the
    reference, one row each."""
    gen = torch.Generator().manual_seed(3)
    u = torch.randn(tokens, channels, generator=gen)
    delta, z = torch.randn(tokens, channels, generator=gen), torch.randn(tokens, channels, generator=gen)
    A = -(torch.rand(channels, state, generator=gen) + 1)
    B, C = torch.randn(tokens, 1, state, generator=gen), torch.randn(tokens, 1, state, generator=gen)
    D, bias = torch.randn(channels, generator=gen), torch.rand(channels, generator=gen) - 4
    states = torch.zeros(rows, channels, state)
    meta = _packed([tokens])
    slots = torch.arange(rows)

    def scan(impl: str) -> Callable[[], object]:
        return lambda: selective_scan(u, delta, A, B, C, states, *meta, D=D, z=z, delta_bias=bias, impl=impl)

    def update(impl: str) -> Callable[[], object]:
        return lambda: selective_state_update(u[:rows], delta[:rows], A, B[:rows], C[:rows], states, slots,
                                              D=D, z=z[:rows], dt_bias=bias, impl=impl)

    return [_case("selective_scan", f"T={tokens} Dm={channels} n={state}", scan("torch"), scan("reference"),
                  repeat, 1),
            _case("selective_state_update", f"B={rows} Dm={channels} n={state}", update("torch"),
                  update("reference"), repeat, repeat, bytes_moved=2 * states.numel() * 4)]


def bench_norm(tokens: int, channels: int, repeat: int) -> dict:
    """gated_rms_norm: the torch path against the reference, one row."""
    gen = torch.Generator().manual_seed(4)
    x, z = torch.randn(tokens, channels, generator=gen), torch.randn(tokens, channels, generator=gen)
    w = torch.randn(channels, generator=gen)

    def run(impl: str) -> Callable[[], object]:
        return lambda: gated_rms_norm(x, z, w, group_size=channels, impl=impl)

    return _case("gated_rms_norm", f"T={tokens} Dm={channels}", run("torch"), run("reference"), repeat, 1)


def main(argv: list[str] | None = None) -> list[dict]:
    """Times every Mamba kernel case, prints the table, writes the JSON results and answers the
    rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run, not a measurement")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    small = args.quick
    heads, conv_channels, m1_channels = (4, 64, 64) if small else (24, 1792, 2048)
    rows = []
    for tokens in ((64, 128) if small else (1024, 4096)):
        rows.append(bench_ssd(tokens, heads, 64, 128 if not small else 16, args.repeat))
    rows += bench_conv(64 if small else 1024, conv_channels, args.repeat)
    rows.append(bench_ssd_update(8, heads, 64, 128 if not small else 16, args.repeat))
    rows += bench_mamba1(32 if small else 256, 8, m1_channels, 16, args.repeat)
    rows.append(bench_norm(64 if small else 1024, 1536 if not small else 64, args.repeat))

    print_table("Mamba kernels: torch path vs token-by-token reference (CPU, fp32"
                + (", QUICK: tiny shapes" if small else "") + ")",
                ["op", "shape", "torch ms", "reference ms", "speedup", "target", "torch GB/s"],
                [[r["op"], r["shape"], r["torch_ms"], r["reference_ms"], f"{r['speedup']:.1f}x",
                  f">= {r['target_speedup']:.0f}x" if r["target_speedup"] else None, r.get("torch_GBps")]
                 for r in rows])
    path = write_results("kernels_mamba", {"quick": small, "threads": args.threads, "repeat": args.repeat,
                                           "torch": torch.__version__, "rows": rows}, args.out)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
