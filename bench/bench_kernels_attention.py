"""CPU benchmark: paged attention (kernels.paged_attention, torch path) vs SDPA over contiguous K/V.

Both sides compute the same attention in fp32 on the same numbers; the paged side gathers K/V
through a shuffled block table (as the executor does), the SDPA side reads K/V stored contiguously
per request (no paging overhead: the best case). Decode target: paged >= 0.5x SDPA throughput.

    OMP_NUM_THREADS=1 python3 bench/bench_kernels_attention.py [--threads 1] [--repeat 5] [--quick]

Prints a table and writes bench/results/kernels_attention.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from _common import print_table, write_results
from kernels import paged_attention


def _time_pair(first, second, repeat: int) -> tuple[float, float]:
    """Median seconds per call of two functions, timed alternately after a warm-up call each, so that
    load from other processes on a shared machine hits both sides alike."""
    first(), second()
    samples: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeat):
        for fn, out in ((first, samples[0]), (second, samples[1])):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(samples[0]), statistics.median(samples[1])


def _paged_copy(keys: torch.Tensor, values: torch.Tensor, block_size: int, gen: torch.Generator):
    """Scatter contiguous K/V [B, L, Hkv, D] into a paged cache with a random block table."""
    batch, length, kv_heads, head_size = keys.shape
    per_req = length // block_size
    num_blocks = 1 + batch * per_req
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = order.reshape(batch, per_req).to(torch.int32)
    k_cache = torch.empty(num_blocks, block_size, kv_heads, head_size)
    v_cache = torch.empty_like(k_cache)
    k_cache[tables.long()] = keys.reshape(batch, per_req, block_size, kv_heads, head_size)
    v_cache[tables.long()] = values.reshape(batch, per_req, block_size, kv_heads, head_size)
    return k_cache, v_cache, tables


def bench_case(name: str, batch: int, q_len: int, kv_len: int, q_heads: int, kv_heads: int, head_size: int,
               block_size: int, window: int | None, repeat: int) -> dict:
    """One attention shape: the paged kernel against dense SDPA on the same data, timed, with
    the largest difference."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(batch, kv_len, kv_heads, head_size, generator=gen)
    values = torch.randn(batch, kv_len, kv_heads, head_size, generator=gen)
    q = torch.randn(batch * q_len, q_heads, head_size, generator=gen)
    k_cache, v_cache, tables = _paged_copy(keys, values, block_size, gen)
    seq_lens = torch.full((batch,), kv_len, dtype=torch.int32)
    starts = torch.arange(batch + 1, dtype=torch.int32) * q_len
    scale = head_size ** -0.5

    def paged():
        return paged_attention(q, k_cache, v_cache, tables, seq_lens, starts, scale=scale, sliding_window=window)

    # SDPA baseline: [B, H, L, D] contiguous, GQA by the kernel, bottom-right causal (+ window) mask.
    q_sdpa = q.reshape(batch, q_len, q_heads, head_size).transpose(1, 2)
    k_sdpa = keys.transpose(1, 2).contiguous()
    v_sdpa = values.transpose(1, 2).contiguous()
    q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
    k_pos = torch.arange(kv_len)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window

    def sdpa():
        return F.scaled_dot_product_attention(q_sdpa, k_sdpa, v_sdpa, attn_mask=mask, scale=scale, enable_gqa=True)

    expected = sdpa().transpose(1, 2).reshape_as(q)
    error = float((paged() - expected).abs().max())
    t_paged, t_sdpa = _time_pair(paged, sdpa, repeat)
    visible = sum(min(kv_len - q_len + i + 1, window or kv_len + 1) for i in range(q_len))  # keys per query, summed
    flops = 2 * batch * q_heads * visible * (2 * head_size)
    kv_bytes = 2 * batch * kv_len * kv_heads * head_size * 4
    return dict(
        case=name, batch=batch, q_len=q_len, kv_len=kv_len, q_heads=q_heads, kv_heads=kv_heads,
        head_size=head_size, block_size=block_size, window=window, dtype="float32",
        paged_ms=t_paged * 1e3, sdpa_ms=t_sdpa * 1e3, ratio=t_sdpa / t_paged,
        paged_tokens_per_s=batch * q_len / t_paged, sdpa_tokens_per_s=batch * q_len / t_sdpa,
        paged_gflops=flops / t_paged / 1e9, paged_kv_gb_per_s=kv_bytes / t_paged / 1e9,
        max_abs_diff=error,
    )


def main() -> None:
    """Times every attention case, prints the table and writes the JSON results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: stable)")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="small shapes (plumbing check, ~1 s)")
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/kernels_attention.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    scale = 8 if args.quick else 1
    cases = [  # (name, batch, q_len, kv_len, Hq, Hkv, D, block, window)
        ("decode", 8, 1, 1024 // scale, 32, 8, 128, 16, None),
        ("decode-window", 8, 1, 1024 // scale, 32, 8, 128, 16, 256 // scale),
        ("prefill", 4, 512 // scale, 512 // scale, 32, 8, 128, 16, None),
        ("prefill-window", 4, 512 // scale, 512 // scale, 32, 8, 128, 16, 128 // scale),
    ]
    rows = [bench_case(*case, repeat=args.repeat) for case in cases]

    print_table(
        f"paged attention (torch CPU path) vs SDPA on contiguous K/V; fp32, {args.threads} thread(s)",
        ["case", "B x q / kv", "window", "paged ms", "SDPA ms", "ratio (SDPA/paged)", "paged tok/s",
         "paged GFLOP/s", "paged KV GB/s", "max |diff|"],
        [[r["case"], f"{r['batch']} x {r['q_len']} / {r['kv_len']}", r["window"], r["paged_ms"], r["sdpa_ms"],
          f"{r['ratio']:.2f}x", r["paged_tokens_per_s"], r["paged_gflops"], r["paged_kv_gb_per_s"],
          r["max_abs_diff"]] for r in rows],
    )
    print("ratio = SDPA time / paged time, i.e. paged throughput relative to SDPA; decode target >= 0.5x")
    path = write_results("kernels_attention", dict(torch=torch.__version__, threads=args.threads, quick=args.quick,
                                                   results=rows), args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
