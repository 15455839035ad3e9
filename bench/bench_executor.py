#!/usr/bin/env python3
"""Executor benchmark, end to end on CPU (real processes on loopback): a shared-prefix workload
(the demo's) against

* one executor with prefix caching and one without (same cache service, separate pools):
  throughput, time to first token p50/p99, prefix hit rate, and the ratio on/off;
* two executors with caching on, loaded at the same time on ONE cache service;

and, for every executor, the share of engine-step time spent in cache-service calls (scraped
from its /metrics: ``kvcache_executor_cache_call_seconds / kvcache_executor_step_seconds``).

    python3 bench/bench_executor.py                       # ~1-2 minutes on 2 cores
    python3 bench/bench_executor.py --requests 32 --preset gemma3-like

Prints a table and writes bench/results/executor.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import urllib.request
from typing import Any

# We start servers after using grpc.aio; gRPC's fork handlers can deadlock that fork().
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from _common import print_table, ratio, write_results
from executor.demo import make_workload, run_workload
from executor.launch import start_cache_service, start_executor
from executor.presets import DEFAULT_PRESET, PRESETS


def scrape(metrics_port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    out = {}
    for m in re.finditer(r"^(kvcache_executor_\w+?)(?:_total)? ([0-9.e+-]+)$", text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def cache_share(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    step = d.get("kvcache_executor_step_seconds", 0.0)
    return {"steps": d.get("kvcache_executor_steps", 0.0),
            "cache_calls": d.get("kvcache_executor_cache_calls", 0.0),
            "cache_call_share": d.get("kvcache_executor_cache_call_seconds", 0.0) / step if step else 0.0,
            "forward_share": d.get("kvcache_executor_forward_seconds", 0.0) / step if step else 0.0,
            "cache_calls_per_step": (d.get("kvcache_executor_cache_calls", 0.0) / d["kvcache_executor_steps"])
            if d.get("kvcache_executor_steps") else 0.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--num-prefixes", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    prompts = make_workload(args.requests, prefix_len=args.prefix_len, suffix_len=args.suffix_len,
                            num_prefixes=args.num_prefixes, vocab=PRESETS[args.preset].vocab_size, seed=0)
    kw = dict(max_tokens=args.max_tokens, concurrency=args.concurrency)
    cache = start_cache_service()
    procs = [cache]
    rows: list[list[Any]] = []
    results: dict[str, dict[str, Any]] = {}
    try:
        def executor(*flags: str):
            p = start_executor(cache.target, "--preset", args.preset, "--metrics-port", "0",
                               "--max-num-seqs", str(args.concurrency), *flags)
            procs.append(p)
            return p

        on, off = executor(), executor("--no-enable-prefix-caching")
        for label, p in (("caching on", on), ("caching off", off)):
            asyncio.run(run_workload(p.target, prompts[:4], label="warm-up", **kw))  # first-call costs
            before = scrape(p.metrics_port)
            run = asyncio.run(run_workload(p.target, prompts, label=label, **kw))
            results[label] = {**run.as_dict(), **cache_share(before, scrape(p.metrics_port))}
        # two executors (caching on) sharing one cache service, loaded at the same time
        a, b = on, executor()
        asyncio.run(run_workload(b.target, prompts[:4], label="warm-up", **kw))
        before_both = [scrape(a.metrics_port), scrape(b.metrics_port)]

        async def both():
            return await asyncio.gather(run_workload(a.target, prompts, label="executor A", **kw),
                                        run_workload(b.target, prompts, label="executor B", **kw))

        ra, rb = asyncio.run(both())
        for label, run, p, bf in (("2 executors: A", ra, a, before_both[0]), ("2 executors: B", rb, b, before_both[1])):
            results[label] = {**run.as_dict(), **cache_share(bf, scrape(p.metrics_port))}
    finally:
        for p in reversed(procs):
            p.stop()
    for label, r in results.items():
        rows.append([label, r["requests"], r["hit_rate"], r["ttft_p50_s"] * 1e3, r["ttft_p99_s"] * 1e3,
                     r["tokens_per_s"], r["wall_s"], r["cache_call_share"], r["cache_calls_per_step"]])
    print_table(f"executor end to end ({args.preset}, {args.requests} requests, prefix {args.prefix_len}, "
                f"concurrency {args.concurrency})",
                ["run", "requests", "hit rate", "TTFT p50 ms", "TTFT p99 ms", "tokens/s", "wall s",
                 "cache-call share", "cache calls/step"], rows)
    on_r, off_r = results["caching on"], results["caching off"]
    summary = {"ttft_p50_speedup": off_r["ttft_p50_s"] / max(on_r["ttft_p50_s"], 1e-9),
               "throughput_ratio": on_r["tokens_per_s"] / max(off_r["tokens_per_s"], 1e-9)}
    print(f"prefix caching: TTFT p50 {ratio(off_r['ttft_p50_s'], on_r['ttft_p50_s'])} faster, "
          f"throughput {ratio(on_r['tokens_per_s'], off_r['tokens_per_s'])}")
    out = write_results("executor", {"preset": args.preset, "args": vars(args), "runs": results, "summary": summary})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
