#!/usr/bin/env python3
"""The workload and the scheduling loop of bench/bench_core.py, shared by every side.

Standard library only, so that the vLLM oracle's interpreter runs this same file for the vLLM
side (``--vllm``, with ../shared/tools/vllm-oracle on its path): every side runs the same
generator (one seeded random stream: the requests, then the decode tokens), the same op loop
and the same clock (``time.perf_counter_ns`` around each manager call), and reports the
workload's digest, so that a vLLM column is measured on exactly this run's workload. Import
and construction are outside the timed calls.

The loop (vLLM's scheduler, simplified as the oracle's ``--bench``): running requests first
(FCFS), the newest preempted when an allocation fails; waiting requests looked up and
admitted only if the whole sequence fits, at most ``max_concurrency`` running, an
``max_batched_tokens`` budget per step with chunked prefill. With a Mamba ``align`` group,
prefill chunks end on scheduler-block boundaries and stop at the junction the lookup
reported (the oracle's simplification of ``Scheduler._mamba_block_aligned_split``).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mooncake_sim import ManagerSide

VOCAB = 32000
CONFIGS = ("full", "full_swa", "full_mamba")
LAT_KEYS = ("add", "lookup", "allocate_prefill", "allocate_decode", "append", "free")
MANAGER_KEYS = ("lookup", "allocate_prefill", "allocate_decode", "free")
#: The workload knobs (argparse dests) every side must be given alike.
WORKLOAD_FLAGS = ("num_requests", "num_blocks", "block_size", "sliding_window", "max_model_len",
                  "hash_fn", "prompt_min", "prompt_max", "decode_min", "decode_max",
                  "num_prefixes", "prefix_min", "prefix_max", "shared_frac", "max_concurrency",
                  "max_batched_tokens", "seed")


@dataclass
class BenchReq:
    rid: str
    prompt: list[int]
    decode_len: int
    handle: Any = None
    decoded: int = 0


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The :data:`WORKLOAD_FLAGS` options with their defaults (the oracle's)."""
    p.add_argument("--num-requests", type=int, default=10000)
    p.add_argument("--num-blocks", type=int, default=6144)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--sliding-window", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--hash-fn", default="sha256", choices=("sha256", "sha256_cbor"))
    p.add_argument("--prompt-min", type=int, default=256)
    p.add_argument("--prompt-max", type=int, default=4096)
    p.add_argument("--decode-min", type=int, default=32)
    p.add_argument("--decode-max", type=int, default=256)
    p.add_argument("--num-prefixes", type=int, default=64)
    p.add_argument("--prefix-min", type=int, default=512)
    p.add_argument("--prefix-max", type=int, default=3072)
    p.add_argument("--shared-frac", type=float, default=0.75)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)


def workload_argv(args: argparse.Namespace) -> list[str]:
    """``args``' workload knobs as command-line flags (for a subprocess side)."""
    out: list[str] = []
    for flag in WORKLOAD_FLAGS:
        out += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return out


def make_workload(args: argparse.Namespace, rng: random.Random) -> list[BenchReq]:
    """Shared system prompts (block multiples, so they can be hit whole) with Zipf-like
    popularity (Pareto(1.2) rank), then per-request unique suffixes (the oracle's
    generator, draw for draw)."""
    prefixes = []
    for _ in range(args.num_prefixes):
        n = rng.randrange(args.prefix_min, args.prefix_max + 1)
        n -= n % args.block_size
        prefixes.append([rng.randrange(VOCAB) for _ in range(n)])
    reqs = []
    for i in range(args.num_requests):
        total = rng.randrange(args.prompt_min, args.prompt_max + 1)
        pre: list[int] = []
        if rng.random() < args.shared_frac:
            idx = min(int(rng.paretovariate(1.2)) - 1, len(prefixes) - 1)
            pre = prefixes[idx][: min(len(prefixes[idx]), total - args.block_size)]
        suffix = [rng.randrange(VOCAB) for _ in range(total - len(pre))]
        reqs.append(BenchReq(f"r{i}", pre + suffix, rng.randrange(args.decode_min,
                                                                   args.decode_max + 1)))
    return reqs


def summarize_ns(samples_ns: list[int]) -> dict[str, Any]:
    """n, mean, p50, p90, p99 and max of nanosecond samples, in microseconds, nearest-rank
    (``_common.summarize_ns``, here because this file runs without the project's
    dependencies)."""
    xs = sorted(samples_ns)
    if not xs:
        return {"n": 0}

    def pct(p: float) -> float:
        return xs[min(len(xs) - 1, max(0, int(round(p / 100.0 * (len(xs) - 1)))))]

    return {"n": len(xs), "mean_us": round(sum(xs) / len(xs) / 1e3, 2),
            "p50_us": round(pct(50) / 1e3, 2), "p90_us": round(pct(90) / 1e3, 2),
            "p99_us": round(pct(99) / 1e3, 2), "max_us": round(xs[-1] / 1e3, 2)}


def workload_digest(reqs: list[BenchReq]) -> str:
    """SHA-256 of every request's prompt and decode length: equal digests, equal workloads."""
    h = hashlib.sha256()
    for br in reqs:
        h.update(json.dumps([br.rid, br.prompt, br.decode_len]).encode())
    return h.hexdigest()[:16]


def mamba_chunk(start: int, n: int, num_prompt: int, num_tokens: int, junction: int,
                bs: int) -> int:
    """The prefill chunk of ``n`` tokens from ``start`` cut as vLLM's scheduler cuts it for a
    Mamba ``align`` group (the oracle bench's simplification): end on a block boundary
    before the prefill's end, never past the last cacheable boundary, stop at the
    shared-prefix ``junction``."""
    end = start + n
    prefill_end = max(num_prompt, num_tokens - 1)
    if start >= prefill_end:
        return n
    if end < prefill_end:
        aligned = end // bs * bs
        if aligned > start:
            end = aligned
    last_cache_position = (num_tokens - 1) // bs * bs
    j = start + (junction - start) // bs * bs if junction > start else 0
    stops = (bs * (start // bs + 1) if start % bs else 0, last_cache_position, j)
    end = min((s for s in stops if start < s < end), default=end)
    return end - start


class BenchManagerSide(ManagerSide):
    """:class:`mooncake_sim.ManagerSide` that also keeps the junction (shared-prefix
    boundary) of each request's last lookup, which Mamba chunking needs."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.junction: dict[str, int] = {}

    def lookup(self, req: Any) -> tuple[Any, int]:
        """The manager's cached prefix of ``req``: (its blocks, hit tokens)."""
        blocks, hit, boundary = self.mgr.get_computed_blocks(req)
        self.junction[req.request_id] = boundary
        return blocks, hit

    def junction_of(self, req: Any) -> int:
        """The shared-prefix boundary of the request's last lookup (0: none)."""
        return self.junction.get(req.request_id, 0)

    def usage(self) -> float:
        """The share of the pool's blocks in use."""
        return float(self.mgr.usage)

    @staticmethod
    def num_preemptions(req: Any) -> int:
        """How often the request was preempted."""
        return int(req.num_preemptions)


def run_loop(side: str, kind: str, drv: Any, args: argparse.Namespace, *,
             mamba_block_size: int | None = None, profiler: Any = None) -> dict[str, Any]:
    """Runs the workload of ``args`` on one side (``drv``: a :class:`BenchManagerSide`-shaped
    driver) and config: the scheduler's decisions, the manager's time and op rates, per-op
    latencies. ``mamba_block_size``: chunk prefills for a Mamba ``align`` group of that
    scheduler block size."""
    rng = random.Random(args.seed)
    t_gen = time.perf_counter()
    workload = make_workload(args, rng)
    t_gen = time.perf_counter() - t_gen
    digest = workload_digest(workload)
    gc.collect()
    gc.freeze()  # like the oracle (and vLLM's engine): the workload is not GC churn

    lat: dict[str, list[int]] = {k: [] for k in LAT_KEYS}
    pc = time.perf_counter_ns
    waiting = list(reversed(workload))  # pop() from the end
    running: list[BenchReq] = []
    n_alloc_fail = n_preempt = prompt_tokens = hit_tokens = n_steps = finished = 0
    usage_samples: list[float] = []
    preempt = getattr(drv, "preempt", drv.free)
    mbs = mamba_block_size

    def chunk(br: BenchReq, start: int, n: int) -> int:
        if mbs is None:
            return n
        h = br.handle
        return mamba_chunk(start, n, len(br.prompt), drv.num_tokens(h), drv.junction_of(h),
                           mbs)

    if profiler is not None:
        profiler.enable()
    t_wall = time.perf_counter()

    def do_preempt(victim: BenchReq) -> None:
        nonlocal n_preempt
        t0 = pc()
        preempt(victim.handle)
        lat["free"].append(pc() - t0)
        drv.after_preempt(victim.handle)
        waiting.append(victim)
        n_preempt += 1

    def after_compute(br: BenchReq) -> bool:
        nonlocal finished
        h = br.handle
        if drv.computed(h) < drv.num_tokens(h):
            return False  # partial prefill chunk
        br.decoded += 1
        if br.decoded >= br.decode_len:
            t0 = pc()
            drv.free(h)
            lat["free"].append(pc() - t0)
            br.handle = None
            finished += 1
            return True
        tok = rng.randrange(VOCAB)
        t0 = pc()
        drv.append(h, tok)
        lat["append"].append(pc() - t0)
        return False

    while waiting or running:
        n_steps += 1
        drv.new_step()
        budget = args.max_batched_tokens
        scheduled: list[BenchReq] = []
        i = 0
        while i < len(running) and budget > 0:
            br = running[i]
            h = br.handle
            start = drv.computed(h)
            remaining = drv.num_tokens(h) - start
            n = chunk(br, start, min(remaining, budget))
            key = "allocate_decode" if remaining == 1 else "allocate_prefill"
            t0 = pc()
            ok = drv.allocate(h, n)
            lat[key].append(pc() - t0)
            if not ok:
                n_alloc_fail += 1
                victim = running.pop()
                do_preempt(victim)
                if victim is br:
                    break
                continue
            drv.after_allocate(h, n)
            budget -= n
            scheduled.append(br)
            i += 1
        while waiting and len(running) < args.max_concurrency and budget > 0:
            br = waiting[-1]
            if br.handle is None:
                t0 = pc()
                br.handle = drv.add(br)
                lat["add"].append(pc() - t0)
            h = br.handle
            t0 = pc()
            blocks, num_hit = drv.lookup(h)
            lat["lookup"].append(pc() - t0)
            n = chunk(br, num_hit, min(drv.num_tokens(h) - num_hit, budget))
            t0 = pc()
            ok = drv.admit(h, n, blocks, num_hit, bool(running))
            lat["allocate_prefill"].append(pc() - t0)
            if not ok:
                n_alloc_fail += 1
                break
            waiting.pop()
            if drv.num_preemptions(h) == 0:
                prompt_tokens += drv.num_tokens(h)
                hit_tokens += num_hit
            drv.after_admit(h, n, num_hit)
            budget -= n
            running.append(br)
            scheduled.append(br)
        done = {id(br) for br in scheduled if after_compute(br)}
        if done:
            running = [br for br in running if id(br) not in done]
        if n_steps % 256 == 0:
            usage_samples.append(drv.usage())
        if not scheduled and waiting:
            raise RuntimeError("request can never be admitted; raise --num-blocks")
    t_wall = time.perf_counter() - t_wall
    if profiler is not None:
        profiler.disable()
    gc.unfreeze()

    mgr_ns = sum(sum(lat[k]) for k in MANAGER_KEYS)
    mgr_ops = sum(len(lat[k]) for k in MANAGER_KEYS)
    all_ns = sum(sum(v) for v in lat.values())
    all_ops = sum(len(v) for v in lat.values())
    return {
        "side": side,
        "config": kind,
        "workload": {"gen_s": round(t_gen, 2), "digest": digest},
        "results": {
            "finished": finished,
            "steps": n_steps,
            "prefix_hit_rate": round(hit_tokens / max(1, prompt_tokens), 4),
            "hit_tokens_first_admission": hit_tokens,
            "alloc_failures": n_alloc_fail,
            "preemptions": n_preempt,
            "mean_usage": round(sum(usage_samples) / max(1, len(usage_samples)), 3),
            "wall_s": round(t_wall, 2),
            "manager_ops": mgr_ops,
            "manager_s": round(mgr_ns / 1e9, 3),
            "manager_ops_per_s": round(mgr_ops / (mgr_ns / 1e9), 1) if mgr_ns else None,
            "all_ops_incl_hashing": all_ops,
            "all_ops_per_s": round(all_ops / (all_ns / 1e9), 1) if all_ns else None,
        },
        "latency": {k: summarize_ns(v) for k, v in lat.items()},
    }


# --- the vLLM side, run by the oracle venv's interpreter --------------------------------------

def _vllm_side(args: argparse.Namespace) -> tuple[BenchManagerSide, int | None, str]:
    """vLLM 0.33's own KVCacheManager for config ``args.config`` (the oracle's scenario), its
    Mamba chunking block size (None without Mamba) and vLLM's version."""
    sys.path.insert(0, str(args.oracle_dir))
    import vllm_oracle as vo  # noqa: PLC0415

    cfg = vo.OracleConfig(scenario=args.config, num_blocks=args.num_blocks,
                          block_size=args.block_size, sliding_window=args.sliding_window,
                          max_model_len=args.max_model_len, hash_fn=args.hash_fn)
    oracle = vo.Oracle(cfg)
    hasher = oracle.block_hasher

    def make(br: BenchReq) -> Any:
        return vo.Request(request_id=br.rid, prompt_token_ids=br.prompt,
                          sampling_params=vo.SamplingParams(max_tokens=br.decode_len),
                          pooling_params=None, block_hasher=hasher)

    drv = BenchManagerSide(oracle.manager, make, vo.RequestStatus.RUNNING,
                           vo.RequestStatus.PREEMPTED,
                           lambda req, tok: req.append_output_token_ids(tok))
    mamba = "mamba" in args.config
    return drv, (oracle.scheduler_block_size if mamba else None), vo.vllm.__version__


def main(argv: list[str] | None = None) -> int:
    """vLLM's side of bench_core.py (run by the oracle's interpreter): one JSON line."""
    p = argparse.ArgumentParser(description="vLLM side of bench/bench_core.py "
                                            "(run with the vLLM oracle venv's python)")
    p.add_argument("--vllm", action="store_true", required=True)
    p.add_argument("--oracle-dir", type=Path, required=True)
    p.add_argument("--config", default="full", choices=CONFIGS)
    add_workload_args(p)
    args = p.parse_args(argv)
    drv, mbs, version = _vllm_side(args)
    out = run_loop("vllm", args.config, drv, args, mamba_block_size=mbs)
    out["vllm_version"] = version
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
