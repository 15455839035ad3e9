#!/usr/bin/env python3
"""Host-tier benchmark (issue 26), end to end on CPU (real processes on loopback): one cache
service, two executors side by side with the same device pool, one with a host tier of 4x the
device pool (``--host-tier-blocks``) and one without, running the same workload:

* a prefix-sharing workload whose working set is 4x the device pool: ``--num-prefixes``
  prefixes, requested round robin (``--rounds`` times each), so a prefix comes back only after
  the others pushed it out of the device pool;
* with ``--trace PATH``, a Mooncake trace scaled down instead (one JSON line per request:
  ``timestamp``, ``input_length``, ``output_length``, ``hash_ids`` of 512-token blocks; the
  files live in ../shared/data/mooncake-traces/, never committed): each trace block becomes
  ``--trace-block-tokens`` tokens (the same tokens for the same hash id), outputs are capped
  at ``--max-tokens``, requests longer than ``--max-trace-blocks`` blocks (or, scaled, than
  ``--max-model-len``) are left out, and the device pool is a quarter of the working set (the
  distinct blocks the kept requests' prefixes fill).

Per executor: prefix hit rate (prompt tokens served from the cache, device or host), prompt
tokens recomputed, TTFT p50/p99, tokens/s, the host tier's demotions/promotions (the pool's
counters), and whether the greedy outputs are identical with and without the tier (they
must be). Then the executor-side cost of the tier bookkeeping on a step with the tier off
(the per-answer copy plan and ``run_copies``, against main's single ``copy_blocks`` call), in
microseconds and as a share of the tier-off executor's mean engine step.

    python3 bench/bench_tier.py --quick     # ~30 s on 2 cores
    python3 bench/bench_tier.py             # ~2 minutes
    python3 bench/bench_tier.py --trace ../shared/data/mooncake-traces/conversation_trace.jsonl

Prints a table and writes bench/results/tier.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

# We start servers after using grpc.aio; gRPC's fork handlers can deadlock that fork().
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from prometheus_client.parser import text_string_to_metric_families

from _common import print_table, ratio, write_results
from cache_service.client import CacheClient, PoolInfo
from executor.cache import model_layer_specs
from executor.cache_link import PoolPlan
from executor.client import ExecutorClient
from executor.launch import start_cache_service, start_executor
from executor.presets import DEFAULT_PRESET, PRESETS

TRACE_BLOCK = 512


def scrape(metrics_port: int) -> dict[str, float]:
    """The executor's /metrics counters (``kvcache_executor_*``), by name."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            if sample.name.startswith("kvcache_executor_"):
                out[sample.name] = sample.value
    return out


def probe_groups(target: str, preset: str, max_model_len: int) -> PoolInfo:
    """The groups the service makes of the preset's layers (a probe pool, deleted again)."""
    cfg = PRESETS[preset].replace(max_model_len=max_model_len)
    plan = PoolPlan(pool_id=f"tier-probe-{os.getpid()}", specs=model_layer_specs(cfg),
                    max_model_len=max_model_len, num_blocks=100_000)
    with CacheClient(target) as cc:
        info = cc.register_pool(plan.pool_id, plan.layer_protos(), num_blocks=100_000,
                                max_model_len=max_model_len)
        cc.delete_pool(plan.pool_id)
    return info


def working_set_blocks(prompts: list[list[int]], info: PoolInfo) -> int:
    """Distinct full blocks the prompts can leave cached, over every group: the blocks a
    pool holding every prefix it ever computed would keep (the working set)."""
    total = 0
    for g in info.groups:
        seen: set[int] = set()
        for p in prompts:
            h = 0
            for k in range(len(p) // g.block_size):
                h = hash((h, tuple(p[k * g.block_size:(k + 1) * g.block_size])))
                seen.add(h)
        total += len(seen)
    return total


def blocks_for(tokens: int, info: PoolInfo) -> int:
    """Cached blocks a prefix of ``tokens`` takes, over every group (a Mamba group in align
    mode keeps one state per block boundary, as an attention group keeps one block)."""
    return sum(-(-tokens // g.block_size) for g in info.groups)


def prefix_workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """``num_prefixes`` prefixes with unique tails, round robin, ``rounds`` times each."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(vocab) for _ in range(args.prefix_len)]
                for _ in range(args.num_prefixes)]
    return [prefixes[i % args.num_prefixes] + [rng.randrange(vocab) for _ in range(args.suffix_len)]
            for i in range(args.num_prefixes * args.rounds)]


def trace_workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[int], int]:
    """The trace scaled down: prompts, their output lengths, and the distinct trace blocks."""
    prompts: list[list[int]] = []
    outputs: list[int] = []
    distinct: set[tuple[int, ...]] = set()
    rows = []
    with open(args.trace) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    rows.sort(key=lambda r: r.get("timestamp", 0))  # stable: ties keep file order
    per = args.trace_block_tokens
    for r in rows:
        ids = [int(h) for h in r["hash_ids"]]
        if not ids or len(ids) > args.max_trace_blocks or int(r["input_length"]) <= 0:
            continue
        n_in = max(1, -(-int(r["input_length"]) * per // TRACE_BLOCK))
        n_out = min(args.max_tokens, max(1, int(r.get("output_length", 1))))
        if n_in + n_out > args.max_model_len:
            continue
        tokens = [random.Random(h * 7919 + j).randrange(vocab) for h in ids for j in range(per)]
        prompts.append(tokens[:n_in])
        outputs.append(n_out)
        distinct.update(tuple(ids[:k + 1]) for k in range(len(ids)))
        if len(prompts) >= args.max_requests:
            break
    return prompts, outputs, len(distinct)


async def run_trace(target: str, prompts: list[list[int]], outputs: list[int], concurrency: int,
                    label: str) -> Any:
    """The trace's requests in order, each with its own output length."""
    from executor.client import AsyncExecutorClient
    from executor.demo import RunSummary

    client = AsyncExecutorClient(target)
    sem = asyncio.Semaphore(concurrency)

    async def one(p: list[int], n: int) -> Any:
        async with sem:
            return await client.generate(p, n)

    start = time.perf_counter()
    try:
        gens = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, outputs)))
    finally:
        await client.close()
    return RunSummary(label, list(gens), time.perf_counter() - start)


def bookkeeping_us(iters: int) -> dict[str, float]:
    """Executor-side cost per engine step with the tier off: this tree's per-answer copy
    plan (one AnswerCopies per Step answer, read from the StepResult) and ``run_copies``,
    against main's one ``copy_blocks`` call, in microseconds (one answer per step)."""
    from cache_service.client import StepResult
    from executor.host_tier import tier_copies
    from executor.runner import ModelRunner
    from executor.scheduler import AnswerCopies

    runner = ModelRunner.__new__(ModelRunner)  # the copy paths touch no model or cache
    import threading

    runner.lock, runner.tier = threading.Lock(), None
    result = StepResult([], 0)

    def tier_path() -> None:
        answers = [AnswerCopies(tier_copies(result.demotions), tier_copies(result.promotions))]
        runner.run_copies(answers)

    def main_path() -> None:
        runner.copy_blocks([])

    out = {}
    for name, fn in (("this_tree_us", tier_path), ("main_us", main_path)):
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter_ns()
            for _ in range(iters):
                fn()
            best = min(best, (time.perf_counter_ns() - t0) / iters / 1e3)
        out[name] = best
    return out


def main(argv: list[str] | None = None) -> int:
    """Runs the host-tier benchmark and prints the table."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS))
    ap.add_argument("--quick", action="store_true", help="a small run (the test's)")
    ap.add_argument("--device-blocks", type=int, default=0,
                    help="device pool in blocks incl. the null block (0 = from the workload)")
    ap.add_argument("--tier-factor", type=float, default=4.0,
                    help="host tier size as a multiple of the device pool")
    ap.add_argument("--working-set", type=float, default=4.0,
                    help="working set as a multiple of the device pool (sets --num-prefixes)")
    ap.add_argument("--num-prefixes", type=int, default=0, help="0 = from --working-set")
    ap.add_argument("--prefix-len", type=int, default=144)
    ap.add_argument("--suffix-len", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--trace", type=Path, default=None, help="a Mooncake trace (JSON lines)")
    ap.add_argument("--max-requests", type=int, default=400, help="trace requests kept")
    ap.add_argument("--trace-block-tokens", type=int, default=16,
                    help="tokens per 512-token trace block (the scale-down)")
    ap.add_argument("--max-trace-blocks", type=int, default=24,
                    help="leave out trace requests longer than this many blocks")
    ap.add_argument("--repeats", type=int, default=3, help="runs per configuration (fastest kept)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.prefix_len = 2, 96
        args.max_tokens, args.max_requests, args.repeats = 4, 40, 1
        args.max_model_len = min(args.max_model_len, 256)
    vocab = PRESETS[args.preset].vocab_size
    cache = start_cache_service()
    procs = [cache]
    try:
        info = probe_groups(cache.target, args.preset, args.max_model_len)
        floor = blocks_for(args.max_model_len, info) + 2  # one request of max_model_len fits
        if args.trace is not None:
            prompts, outputs, _ = trace_workload(args, vocab)
            working_set = working_set_blocks(prompts, info)
            workload = (f"Mooncake trace {args.trace.name}: {len(prompts)} requests, "
                        f"{args.trace_block_tokens} tokens per trace block")
        else:
            per_prefix = blocks_for(args.prefix_len, info)
            if not args.num_prefixes:
                pool = args.device_blocks or floor
                args.num_prefixes = max(2, round(args.working_set * pool / per_prefix))
            prompts = prefix_workload(args, vocab)
            outputs = [args.max_tokens] * len(prompts)
            working_set = working_set_blocks(prompts, info)
            workload = (f"{args.num_prefixes} prefixes of {args.prefix_len} tokens round robin x "
                        f"{args.rounds}")
        device = args.device_blocks or max(floor, round(working_set / args.working_set))
        host = int(args.tier_factor * device)
        print(f"{args.preset}: groups {[(g.kind, g.block_size) for g in info.groups]}; working set "
              f"{working_set} blocks = {working_set / device:.1f}x the device pool of {device}; "
              f"host tier {host} slots per group", flush=True)

        def executor(*flags: str) -> Any:
            p = start_executor(cache.target, "--preset", args.preset, "--metrics-port", "0",
                               "--max-model-len", str(args.max_model_len),
                               "--num-blocks", str(device),
                               "--max-num-seqs", str(args.concurrency), *flags)
            procs.append(p)
            return p

        runs: dict[str, dict[str, Any]] = {}
        tokens: list[list[list[int]]] = []
        configs = (("no host tier", ()),
                   (f"host tier {args.tier_factor:g}x", ("--host-tier-blocks", str(host))))
        # Alternating fresh executors (a cold pool each time); the fastest run of each is kept
        # (the machine is shared: single runs of a few seconds vary by +-30%).
        for label, flags in [c for _ in range(args.repeats) for c in configs]:
            p = executor(*flags)
            with ExecutorClient(p.target) as ec:
                pool_id = ec.info().pool_id
            # First-call costs of a fresh process (each kernel path once, a hit included):
            # two unrelated prompts, each twice; what they leave in the cache is never hit.
            warm = [[(7 * i + 3) % vocab] * args.prefix_len for i in range(2)]
            asyncio.run(run_trace(p.target, warm + warm, [2] * 4, 1, "warm-up"))
            m0 = scrape(p.metrics_port)
            with CacheClient(cache.target) as cc:
                s0 = cc.stats(pool_id)
            run = asyncio.run(run_trace(p.target, prompts, outputs, args.concurrency, label))
            m1 = scrape(p.metrics_port)
            with CacheClient(cache.target) as cc:
                s1 = cc.stats(pool_id)
            metrics = {k: v - m0.get(k, 0.0) for k, v in m1.items()}
            stats = {k: getattr(s1, k) - getattr(s0, k)
                     for k in ("evictions", "host_demotions", "host_promotions", "host_evictions")}
            steps = max(1.0, metrics.get("kvcache_executor_steps_total", 1.0))
            row = {**run.as_dict(), "device_blocks": device,
                           "host_tier_blocks": host if flags else 0,
                           **stats,
                           "computed_tokens": metrics.get("kvcache_executor_computed_tokens_total"),
                           "mean_step_ms": 1e3 * metrics.get(
                               "kvcache_executor_step_seconds_total", 0.0) / steps,
                           "steps": steps,
                           **{f"{k}_s": metrics.get(f"kvcache_executor_{k}_seconds_total", 0.0)
                              for k in ("forward", "cache_call", "cache_wait", "host_tier_copy")}}
            if label not in runs or row["wall_s"] < runs[label]["wall_s"]:
                runs[label] = row
            tokens.append([g.token_ids for g in run.generations])
            p.stop()
    finally:
        for p in reversed(procs):
            p.stop()
    off_label, on_label = list(runs)
    identical = all(t == tokens[0] for t in tokens)
    cost = bookkeeping_us(2_000 if args.quick else 20_000)
    off, on = runs[off_label], runs[on_label]
    cost["delta_us"] = cost["this_tree_us"] - cost["main_us"]
    cost["share_of_step"] = cost["delta_us"] / 1e3 / max(off["mean_step_ms"], 1e-9)
    rows = [[label, r["requests"], f"{r['hit_rate']:.1%}", r["computed_prompt_tokens"],
             r["ttft_p50_s"] * 1e3, r["ttft_p99_s"] * 1e3, r["tokens_per_s"], r["evictions"],
             r["host_demotions"], r["host_promotions"]] for label, r in runs.items()]
    rows.append(["tier / none", "", ratio(on["hit_rate"], off["hit_rate"]),
                 ratio(on["computed_prompt_tokens"], off["computed_prompt_tokens"]),
                 ratio(on["ttft_p50_s"], off["ttft_p50_s"]),
                 ratio(on["ttft_p99_s"], off["ttft_p99_s"]),
                 ratio(on["tokens_per_s"], off["tokens_per_s"]), "", "", ""])
    print_table(f"host tier end to end ({args.preset}; {workload}; device pool {device} blocks, "
                f"working set {working_set / device:.1f}x)",
                [f"run (fastest of {args.repeats})", "requests", "hit rate", "prompt tokens recomputed", "TTFT p50 ms",
                 "TTFT p99 ms", "tokens/s", "device evictions", "demotions", "promotions"], rows)
    for label, r in runs.items():
        print(f"{label}: {r['steps']:.0f} steps, forward {r['forward_s']:.2f} s, cache calls "
              f"{r['cache_call_s']:.2f} s (exposed {r['cache_wait_s']:.2f} s), host-tier copies "
              f"{r['host_tier_copy_s']:.3f} s")
    print(f"greedy outputs identical with and without the tier (all {len(tokens)} runs): "
          f"{'yes' if identical else 'NO'}")
    print(f"tier bookkeeping on a step with the tier off (executor side): "
          f"{cost['this_tree_us']:.2f} us vs main's {cost['main_us']:.2f} us "
          f"(+{cost['delta_us']:.2f} us = {cost['share_of_step']:.3%} of a "
          f"{off['mean_step_ms']:.2f} ms engine step)")
    out = write_results("tier", {"preset": args.preset, "args": {k: str(v) for k, v in
                                                                 vars(args).items()},
                                 "workload": workload, "working_set_blocks": working_set,
                                 "runs": runs, "outputs_identical": identical,
                                 "bookkeeping": cost}, args.out)
    print(f"wrote {out}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
