#!/usr/bin/env python3
"""Fairness benchmark: a small client's Step latency while another client sends huge calls.

One server subprocess. The *small* client (this process) owns a pool with 8 running
requests and sends one decode Step (8 requests, one token each) after another; its latency
is measured three ways in ONE run:

* ``idle``: nobody else is calling;
* ``decode 10k``: a *heavy* client (its own process, so it does not share this process's
  GIL) sends decode Steps over 10,000 running requests of its own pool back to back;
* ``lookup 1M``: the heavy client sends PeekPrefix calls of 1,000,000 tokens back to back.

The goal (isolation between tenants): the small client's p99 under load stays below 20 ms;
the table shows it and its ratio to the idle p99. The heavy client's own call latency is reported too
(long work is cut into slices, so it takes longer than alone, but it completes).

    python3 bench/bench_fairness.py                # about a minute
    python3 bench/bench_fairness.py --seconds 3    # quicker

Prints a table and writes bench/results/fairness.json.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import print_table, ratio, summarize_ns, write_results  # noqa: E402
from cache_service.client import CacheClient, StepBuilder, layers  # noqa: E402
from kvcache_common.launch import start_cache_service  # noqa: E402

GOAL_MS = 20.0
SMALL_REQUESTS = 8
PROMPT = 16


def model() -> list:
    """The pools' model: one full-attention layer."""
    return [layers.full_attention("full", block_size=16, num_kv_heads=8, head_size=128)]


def admit(client: CacheClient, pool_id: str, n: int, prefix: str) -> None:
    """Adds and allocates ``n`` requests (ids ``<prefix><i>``) in batches of 500."""
    for start in range(0, n, 500):
        batch = StepBuilder(pool_id, begin_step=True)
        for i in range(start, min(n, start + 500)):
            rid = f"{prefix}{i}"
            batch.add(rid, [(i * 31 + t) % 32000 for t in range(PROMPT)]).allocate(rid, PROMPT)
        client.step_batch(batch)


def heavy(target: str, kind: str, n: int, tokens: int, ready, stop, out) -> None:
    """The heavy client: its own pool and process; sends its big call until ``stop``."""
    with CacheClient(target, default_timeout=120) as client:
        pool_id = f"heavy-{kind}"
        client.register_pool(pool_id, model(), num_blocks=n * 4 + 1024, max_model_len=1 << 20,
                             skip_capacity_check=True)
        rids = [f"h{i}" for i in range(n)]
        if kind == "decode":
            admit(client, pool_id, n, "h")
        prompt = [t % 32000 for t in range(tokens)]
        ready.set()
        samples = []
        step = 0
        while not stop.is_set():
            t0 = time.perf_counter_ns()
            if kind == "decode":
                client.step_batch(StepBuilder(pool_id, begin_step=True).decode(
                    rids, [step % 32000] * n))
                step += 1
            else:
                client.peek_prefix([pool_id], prompt)
            samples.append(time.perf_counter_ns() - t0)
        client.delete_pool(pool_id)
        out.put(samples)


def measure_small(client: CacheClient, pool_id: str, seconds: float) -> list[int]:
    """The small client's decode Step latencies in ns over ``seconds``."""
    rids = [f"s{i}" for i in range(SMALL_REQUESTS)]
    samples = []
    deadline = time.monotonic() + seconds
    step = 0
    while time.monotonic() < deadline:
        batch = StepBuilder(pool_id, begin_step=True).decode(rids, [step % 32000] * len(rids))
        t0 = time.perf_counter_ns()
        client.step_batch(batch)
        samples.append(time.perf_counter_ns() - t0)
        step += 1
    return samples


def run_loaded(target: str, client: CacheClient, pool_id: str, kind: str, args) -> tuple:
    """The small client's latencies while a heavy client process of ``kind`` loads the server;
    answers (small, heavy) samples."""
    ctx = mp.get_context("spawn")
    ready, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=heavy, args=(target, kind, args.decode_requests,
                                           args.lookup_tokens, ready, stop, out))
    proc.start()
    try:
        if not ready.wait(600):
            raise RuntimeError("the heavy client did not get ready")
        time.sleep(0.5)  # let its first call get going
        small = measure_small(client, pool_id, args.seconds)
    finally:
        stop.set()
    heavy_samples = out.get(timeout=600)
    proc.join(60)
    return small, heavy_samples


def main() -> int:
    """Measures the small client idle and under each load; prints the table and the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per phase")
    parser.add_argument("--decode-requests", type=int, default=10_000)
    parser.add_argument("--lookup-tokens", type=int, default=1_000_000)
    parser.add_argument("--out", type=Path, default=None, help="JSON path")
    args = parser.parse_args()

    server = start_cache_service("--log-level", "warning", "--max-message-bytes",
                                 str(64 << 20))
    results: dict = {"goal_p99_ms": GOAL_MS, "phases": {}}
    try:
        with CacheClient(server.target, default_timeout=60) as client:
            # Room for every step of a fast run: 8 requests x 65,536 tokens.
            client.register_pool("small", model(), num_blocks=SMALL_REQUESTS * 4096 + 64,
                                 max_model_len=1 << 16)
            admit(client, "small", SMALL_REQUESTS, "s")
            phases = {"idle": (measure_small(client, "small", args.seconds), None)}
            phases[f"decode {args.decode_requests:,}"] = run_loaded(
                server.target, client, "small", "decode", args)
            phases[f"lookup {args.lookup_tokens:,} tokens"] = run_loaded(
                server.target, client, "small", "lookup", args)
    finally:
        server.stop()
    idle_p99 = summarize_ns(phases["idle"][0])["p99_us"]
    rows = []
    for name, (small, heavy_samples) in phases.items():
        s = summarize_ns(small)
        h = summarize_ns(heavy_samples) if heavy_samples else None
        results["phases"][name] = {"small": s, "heavy": h,
                                   "p99_vs_idle": round(s["p99_us"] / idle_p99, 2),
                                   "meets_goal": s["p99_us"] / 1e3 < GOAL_MS}
        rows.append([name, s["n"], s["p50_us"] / 1e3, s["p99_us"] / 1e3, s["max_us"] / 1e3,
                     ratio(s["p99_us"], idle_p99),
                     "yes" if s["p99_us"] / 1e3 < GOAL_MS else "NO",
                     h and h["n"], h and h["p50_us"] / 1e3])
    print_table(f"Small client's {SMALL_REQUESTS}-request decode Step while a heavy client "
                f"calls (goal: p99 < {GOAL_MS:g} ms)",
                ["heavy load", "steps", "p50 ms", "p99 ms", "max ms", "p99 / idle p99",
                 "goal met", "heavy calls", "heavy p50 ms"], rows)
    out = write_results("fairness", results, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
