"""``bench_core.py --retention``: what sparse checkpoint retention buys and costs on a
Mamba-heavy workload (docs/semantics.md#checkpoint-retention), side by side in one run.

One workload (full attention + Mamba ``align``, block size 16, shared system prompts,
chunked prefill split as vLLM's scheduler splits it in ``align`` mode: chunk ends on block
boundaries and at the junction a lookup reports) runs on a Pool per setting of
``prefix_cache_retention_interval``: unset (dense), 0 (sparse, vLLM 0.33's engine default)
and N. Reported: blocks held by cached Mamba states (mean and peak over steps, and as a
share of the pool), all cached blocks, the prefix hit rate of first admissions,
preemptions, and manager time.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from _common import print_table, ratio
from cache_service.core.pool import Pool, PoolOptions
from cache_service.core.specs import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)

VOCAB = 32000


def _pool(args: argparse.Namespace, retention: int | None) -> Pool:
    bs = args.block_size
    groups = (
        KVCacheGroupSpec(("attn",), FullAttentionSpec(block_size=bs, num_kv_heads=1,
                                                      head_size=1, dtype="float32")),
        KVCacheGroupSpec(("ssm",), MambaSpec(block_size=bs, shapes=((2,),),
                                             dtypes=("float32",), mamba_cache_mode="align")))
    return Pool(KVCacheConfig(num_blocks=args.num_blocks, groups=groups),
                PoolOptions(max_model_len=args.max_model_len, hash_algo=args.hash_fn,
                            enable_events=False, prefix_cache_retention_interval=retention))


def _workload(args: argparse.Namespace, n: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(args.prefix_min,
                                                                  args.prefix_max))]
                for _ in range(args.num_prefixes)]
    out = []
    for _ in range(n):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(args.prompt_min,
                                                                   args.prompt_max))]
        if rng.random() < args.shared_frac:
            prompt = rng.choice(prefixes) + prompt
        out.append((prompt[:args.max_model_len - args.decode_max - 1],
                    rng.randint(args.decode_min, args.decode_max)))
    return out


def _chunk(start: int, n: int, num_tokens: int, junction: int, bs: int) -> int:
    """vLLM's align-mode split (the oracle bench's simplification): end on a block
    boundary before the prompt's end, never past the last cacheable boundary, stop at
    the junction."""
    end = start + n
    if start >= num_tokens - 1:
        return n
    if end < num_tokens - 1 and end // bs * bs > start:
        end = end // bs * bs
    last = (num_tokens - 1) // bs * bs
    j = start + (junction - start) // bs * bs if junction > start else 0
    stops = (bs * (start // bs + 1) if start % bs else 0, last, j)
    end = min((s for s in stops if start < s < end), default=end)
    return end - start


def run_one(args: argparse.Namespace, retention: int | None,
            workload: list[tuple[list[int], int]]) -> dict[str, Any]:
    """Runs ``workload`` through one pool with Mamba checkpoint retention ``retention`` (None:
    dense) and answers its row: hit rate, cached Mamba blocks (mean, peak, share),
    preemptions, manager time."""
    pool = _pool(args, retention)
    rng = random.Random(args.seed + 1)
    bs = args.block_size
    mamba_gid = 1
    waiting = list(reversed(range(len(workload))))
    running: list[int] = []
    decoded = [0] * len(workload)
    junction = [0] * len(workload)
    prompt_tokens = hit_tokens = preemptions = steps = 0
    mamba_samples: list[int] = []
    cached_samples: list[int] = []
    t_mgr = 0.0
    pc = time.perf_counter
    while waiting or running:
        steps += 1
        pool.new_step()
        budget = args.max_batched_tokens
        scheduled: list[int] = []
        i = 0
        while i < len(running) and budget > 0:
            k = running[i]
            rid = f"r{k}"
            info = pool.request_info(rid)
            n = _chunk(info.num_computed_tokens, min(info.num_tokens - info.num_computed_tokens,
                                                     budget), info.num_tokens, junction[k], bs)
            t0 = pc()
            ok = pool.allocate(rid, n, include_tables=False).ok
            t_mgr += pc() - t0
            if not ok:
                victim = running.pop()
                pool.preempt(f"r{victim}")
                waiting.append(victim)
                preemptions += 1
                if victim == k:
                    break
                continue
            budget -= n
            scheduled.append(k)
            i += 1
        while waiting and len(running) < args.max_concurrency and budget > 0:
            k = waiting[-1]
            rid = f"r{k}"
            if not pool.has_request(rid):
                pool.add_request(rid, workload[k][0])
            t0 = pc()
            hit = pool.lookup(rid)
            info = pool.request_info(rid)
            junction[k] = hit.shared_prefix_boundary
            n = _chunk(hit.hit_tokens, min(info.num_tokens - hit.hit_tokens, budget),
                       info.num_tokens, junction[k], bs)
            ok = pool.allocate(rid, n, full_sequence_must_fit=True, include_tables=False).ok
            t_mgr += pc() - t0
            if not ok:
                break
            waiting.pop()
            if decoded[k] == 0 and info.num_tokens == len(workload[k][0]):
                prompt_tokens += info.num_tokens
                hit_tokens += hit.hit_tokens
            budget -= n
            running.append(k)
            scheduled.append(k)
        done = set()
        for k in scheduled:
            rid = f"r{k}"
            info = pool.request_info(rid)
            if info.num_computed_tokens < info.num_tokens:
                continue
            decoded[k] += 1
            if decoded[k] >= workload[k][1]:
                t0 = pc()
                pool.free(rid)
                t_mgr += pc() - t0
                done.add(k)
            else:
                pool.append_tokens(rid, [rng.randrange(VOCAB)])
        if done:
            running = [k for k in running if k not in done]
        stats = pool.stats()
        mamba_samples.append(stats.num_cached_blocks_per_group[mamba_gid])
        cached_samples.append(stats.num_cached_blocks)
        if not scheduled and waiting:
            raise RuntimeError("request can never be admitted; raise --num-blocks")
    usable = args.num_blocks - 1
    mean_mamba = sum(mamba_samples) / len(mamba_samples)
    return {
        "retention": "unset (dense)" if retention is None else retention,
        "steps": steps,
        "preemptions": preemptions,
        "prefix_hit_rate": round(hit_tokens / max(1, prompt_tokens), 4),
        "mamba_cached_blocks_mean": round(mean_mamba, 1),
        "mamba_cached_blocks_peak": max(mamba_samples),
        "mamba_share_of_pool_mean": round(mean_mamba / usable, 4),
        "cached_blocks_mean": round(sum(cached_samples) / len(cached_samples), 1),
        "manager_s": round(t_mgr, 3),
    }


def retention_report(args: argparse.Namespace) -> dict[str, Any]:
    """The retention comparison: dense, 0 and ``--retention-interval`` over one workload, as
    rows and a printed table."""
    workload = _workload(args, args.num_requests)
    settings: list[int | None] = [None, 0, args.retention_interval]
    runs = [run_one(args, r, workload) for r in settings]
    dense = runs[0]
    rows = [[str(r["retention"]), r["prefix_hit_rate"], r["mamba_cached_blocks_mean"],
             r["mamba_cached_blocks_peak"], f"{100 * r['mamba_share_of_pool_mean']:.1f}%",
             r["cached_blocks_mean"], r["preemptions"], r["manager_s"],
             ratio(r["mamba_cached_blocks_mean"], dense["mamba_cached_blocks_mean"])]
            for r in runs]
    print_table(f"Checkpoint retention, full + Mamba align (bs {args.block_size}, "
                f"{args.num_blocks} blocks, {args.num_requests} requests)",
                ["retention", "hit rate", "Mamba cached (mean)", "(peak)", "of pool",
                 "all cached (mean)", "preempt", "manager s", "Mamba vs dense"], rows)
    return {"workload": {k: getattr(args, k) for k in (
        "num_requests", "num_blocks", "block_size", "prompt_min", "prompt_max",
        "num_prefixes", "prefix_min", "prefix_max", "shared_frac", "max_concurrency",
        "max_batched_tokens", "seed")}, "runs": runs}
