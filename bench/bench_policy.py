#!/usr/bin/env python3
"""Cache policy benchmark: prefix pins, eviction classes and release hints vs plain LRU
(vLLM's order), side by side in one run, on the same requests.

Workloads (each request is admitted, looked up, computed whole and freed, one at a time,
in a pool of a quarter of the workload's working set):

* ``agentic`` (generated): ``--sessions`` long-lived sessions of ``--turns`` turns each; a
  turn's prompt is the session's context so far (system prompt + every earlier turn) plus a
  new message, so a turn can reuse all of the previous prompt; between two turns of a
  session come bursts of ``--burst`` unrelated one-shot requests.
* ``mooncake`` (``--trace``, e.g. ../shared/data/mooncake-traces/conversation_trace.jsonl,
  never committed): the trace's requests in arrival order; a request's "session prefix"
  is the part of its prompt an earlier request had (its leading hash ids seen before).

Policies: ``lru`` (nothing set: vLLM's decisions); ``pins`` (agentic: each session pins its
context after each turn, replacing its previous pin, refused pins are simply not taken;
mooncake: each request that continues an earlier prompt pins its own for ``--pin-ttl``
seconds of trace time, like "prompt caching with a TTL"); ``classes`` (session requests eviction class 1, one-shot
traffic 0; mooncake: none); ``hints`` (one-shot requests freed evict-first; mooncake: none).

Measured: the session prefix hit rate (hit tokens / tokens an earlier request of the session
had computed, block-rounded) and the prompt tokens recomputed by session turns; and the cost
of the bookkeeping on a decode Step with none of it used: this tree vs ``--baseline-tree``
(e.g. ../main) in a subprocess of the same run (goal <= 1.03x).

    python3 bench/bench_policy.py
    python3 bench/bench_policy.py --trace ../shared/data/mooncake-traces/conversation_trace.jsonl --max-requests 2000
    python3 bench/bench_policy.py --baseline-tree ../main   # or a checkout of the tree before

Prints a table and writes bench/results/policy.json.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import print_table, write_results
from cache_service.core.errors import ResourceExhausted
from cache_service.core.operations import AddRequest, Free
from cache_service.core.pool import Pool, PoolOptions
from cache_service.core.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from mooncake_sim import TRACE_BLOCK, load_trace

POLICIES = ("lru", "pins", "classes", "hints")


@dataclass
class Req:
    """One request of a workload: ``session`` None for one-shot traffic; ``reusable``: the
    tokens of its prompt an earlier request of its session computed."""

    rid: str
    tokens: list[int]
    session: str | None
    reusable: int
    time_s: float = 0.0


@dataclass
class Outcome:
    session_turns: int = 0
    reusable_tokens: int = 0
    session_hit_tokens: int = 0
    session_recomputed: int = 0
    all_hit_tokens: int = 0
    all_prompt_tokens: int = 0
    pins_refused: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def agentic(args: argparse.Namespace) -> tuple[list[Req], int]:
    """The generated workload and its working set in blocks."""
    rng = random.Random(args.seed)
    next_token = iter(range(10, 1 << 30))
    contexts = {f"s{i}": [next(next_token) for _ in range(args.system_tokens)]
                for i in range(args.sessions)}
    reqs: list[Req] = []
    n = 0
    for turn in range(args.turns):
        order = list(contexts)
        rng.shuffle(order)
        for sid in order:
            ctx = contexts[sid]
            reusable = len(ctx) if turn else 0
            ctx += [next(next_token) for _ in range(args.turn_tokens)]
            reqs.append(Req(f"{sid}-t{turn}", list(ctx), sid, reusable))
            for _ in range(rng.randint(0, 2 * args.burst)):
                size = rng.randint(args.oneshot_min, args.oneshot_max)
                reqs.append(Req(f"x{n}", [next(next_token) for _ in range(size)], None, 0))
                n += 1
    # The working set: what the sessions would reuse (their final contexts); the one-shot
    # traffic only passes through.
    working = sum(len(c) for c in contexts.values()) // args.block_size
    return reqs, working


def mooncake(args: argparse.Namespace) -> tuple[list[Req], int]:
    """The trace's requests (at most ``--max-requests``), each with the prompt tokens an
    earlier request shares, and the working set in blocks."""
    trace = load_trace(Path(args.trace), args.max_requests)
    seen: set[int] = set()
    reqs = []
    for t in trace:
        shared = 0
        for h in t.hash_ids:
            if h not in seen:
                break
            shared += 1
        reusable = min(shared * TRACE_BLOCK, t.input_length - 1)
        reqs.append(Req(t.rid, t.tokens(), "trace" if shared > 1 else None, reusable,
                        t.timestamp / 1000))
        seen.update(t.hash_ids)
    working = len(seen) * TRACE_BLOCK // args.block_size
    return reqs, working


def make_pool(num_blocks: int, max_len: int, args: argparse.Namespace) -> Pool:
    """A one-group full-attention pool of ``num_blocks`` blocks (events off)."""
    config = KVCacheConfig(num_blocks=num_blocks, groups=(KVCacheGroupSpec(
        ("l0",), FullAttentionSpec(block_size=args.block_size, head_size=1)),))
    return Pool(config, PoolOptions(max_model_len=max_len, enable_events=False))


def run(policy: str, reqs: list[Req], num_blocks: int, max_len: int,
        args: argparse.Namespace, *, trace: bool) -> Outcome:
    """Runs ``reqs`` one at a time through a fresh pool under ``policy``; answers the outcome
    (hit and recomputed tokens, refused pins, seconds)."""
    pool = make_pool(num_blocks, max_len, args)
    out = Outcome()
    session_pin: dict[str, str] = {}
    expiry: dict[str, float] = {}  # pin id -> trace time it expires (mooncake pins)
    start = time.perf_counter()
    for r in reqs:
        if trace and policy == "pins":
            for pin_id in [p for p, t in expiry.items() if t <= r.time_s]:
                pool.drop_pin(pin_id)
                del expiry[pin_id]
        cls = 1 if policy == "classes" and r.session is not None else 0
        pool.apply_batch([AddRequest(r.rid, r.tokens, eviction_class=cls)])
        hit = pool.lookup(r.rid).hit_tokens
        ok = pool.allocate(r.rid, len(r.tokens) - hit).ok
        assert ok, f"{r.rid} did not fit: the pool is too small for one request"
        out.all_hit_tokens += hit
        out.all_prompt_tokens += len(r.tokens)
        if r.session is not None and r.reusable:
            usable = r.reusable - r.reusable % args.block_size
            out.session_turns += 1
            out.reusable_tokens += usable
            out.session_hit_tokens += min(hit, usable)
            out.session_recomputed += usable - min(hit, usable)
        if policy == "pins" and r.session is not None:
            hashes = pool.block_hashes(r.rid)
            key = r.rid if trace else r.session
            assert key is not None
            old = session_pin.pop(key, None)
            if old is not None:
                pool.drop_pin(old)
            try:
                pool.pin_prefix(r.rid, block_hashes=hashes)
                session_pin[key] = r.rid
                if trace:
                    expiry[r.rid] = r.time_s + args.pin_ttl
                    session_pin.pop(key)
            except ResourceExhausted:
                out.pins_refused += 1
        hint = policy == "hints" and r.session is None
        pool.apply_batch([Free(r.rid, evict_first=hint)])
    out.seconds = time.perf_counter() - start
    out.extra = {"evictions": pool.stats().evictions, "pinned_blocks": pool.num_pinned_blocks}
    return out


# The Step-cost measurement runs in a subprocess per tree (this one and --baseline-tree),
# with only the APIs both trees have: a pool of decoding requests, no pins or classes.
_STEP_COST = r"""
import sys, time
try:
    from cache_service.core.operations import AddRequest, Allocate, Decode
except ImportError:  # a tree from before the rename of core/ops.py
    from cache_service.core.ops import AddRequest, Allocate, Decode
from cache_service.core.pool import Pool, PoolOptions
from cache_service.core.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
n, steps, rounds = (int(x) for x in sys.argv[1:4])
best = None
for _ in range(rounds):
    pool = Pool(KVCacheConfig(num_blocks=n * 40, groups=(KVCacheGroupSpec(
        ("l0",), FullAttentionSpec(block_size=16, head_size=1)),)),
        PoolOptions(max_model_len=4096, enable_events=False))
    ids = [f"r{i}" for i in range(n)]
    pool.apply_batch([op for i, rid in enumerate(ids) for op in (
        AddRequest(rid, [i % 7] * 64 + [i] * 64), Allocate(rid, 128))])
    t = time.perf_counter()
    for s in range(steps):
        pool.apply_batch([Decode(ids, [s % 1000] * n)], begin_step=True)
    dt = (time.perf_counter() - t) / steps
    best = dt if best is None else min(best, dt)
print(best)
"""


def step_cost(tree: Path, args: argparse.Namespace) -> float:
    """Seconds per in-process decode Step of the tree at ``tree``, best of ``--step-rounds``
    (in a child process with that tree on its path)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run([sys.executable, "-c", _STEP_COST, str(args.step_requests),
                           str(args.step_count), str(args.step_rounds)], env=env, cwd=tree,
                          capture_output=True, text=True, check=True)
    return float(done.stdout.strip())


def main(argv: list[str] | None = None) -> int:
    """Runs every policy on each workload side by side, prints the tables and writes the JSON
    results."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=24)
    p.add_argument("--turns", type=int, default=12)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--turn-tokens", type=int, default=256)
    p.add_argument("--burst", type=int, default=3, help="mean one-shot requests between turns")
    p.add_argument("--oneshot-min", type=int, default=512)
    p.add_argument("--oneshot-max", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--pool-fraction", type=float, default=0.25,
                   help="pool size as a fraction of the working set")
    p.add_argument("--trace", type=Path, default=None, help="a Mooncake trace (JSONL)")
    p.add_argument("--max-requests", type=int, default=2000)
    p.add_argument("--pin-ttl", type=float, default=60.0,
                   help="mooncake pins: seconds of trace time a request's prompt stays pinned")
    p.add_argument("--baseline-tree", type=Path, default=None,
                   help="also measure a decode Step's cost in this checkout (e.g. ../main)")
    p.add_argument("--step-requests", type=int, default=256)
    p.add_argument("--step-count", type=int, default=200)
    p.add_argument("--step-rounds", type=int, default=3)
    p.add_argument("--step-pairs", type=int, default=6,
                   help="alternating runs of this tree and the baseline tree")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    workloads = [("agentic", *agentic(args), False)]
    if args.trace is not None:
        workloads.append(("mooncake", *mooncake(args), True))
    rows: list[list[Any]] = []
    results: dict[str, Any] = {}
    for name, reqs, working, trace in workloads:
        longest = max(len(r.tokens) for r in reqs)
        max_len = -(-(longest + 1) // args.block_size) * args.block_size
        need = max_len // args.block_size  # one request must fit
        num_blocks = max(int(working * args.pool_fraction), 2 * need) + 1
        results[name] = {"requests": len(reqs), "working_set_blocks": working,
                         "num_blocks": num_blocks, "policies": {}}
        policies = ("lru", "pins") if trace else POLICIES
        base = None
        for policy in policies:
            o = run(policy, reqs, num_blocks, max_len, args, trace=trace)
            if base is None:
                base = o
            rate = o.session_hit_tokens / o.reusable_tokens if o.reusable_tokens else 0.0
            results[name]["policies"][policy] = {
                "session_hit_rate": round(rate, 4), "session_turns": o.session_turns,
                "session_recomputed_tokens": o.session_recomputed,
                "all_hit_rate": round(o.all_hit_tokens / o.all_prompt_tokens, 4),
                "pins_refused": o.pins_refused, "seconds": round(o.seconds, 3), **o.extra}
            rows.append([f"{name} / {policy}", len(reqs), num_blocks, f"{rate:.1%}",
                         o.session_recomputed,
                         (f"{o.session_recomputed / base.session_recomputed:.2f}x"
                          if base.session_recomputed else "-"),
                         f"{o.all_hit_tokens / o.all_prompt_tokens:.1%}", o.pins_refused,
                         o.extra["evictions"]])
            print(f"  {name}/{policy}: {o.seconds:.1f} s", file=sys.stderr)
    print_table("cache policy vs plain LRU (same requests, pool = "
                f"{args.pool_fraction:g} x working set)",
                ["workload / policy", "requests", "blocks", "session hit rate",
                 "session tokens recomputed", "vs lru", "all hit rate", "pins refused",
                 "evictions"], rows)
    here = Path(__file__).resolve().parents[1]
    # The two trees alternate (the machine's load drifts), each keeping its best run.
    mine: list[float] = []
    theirs: list[float] = []
    for _ in range(args.step_pairs if args.baseline_tree is not None else 1):
        mine.append(step_cost(here, args))
        if args.baseline_tree is not None:
            theirs.append(step_cost(args.baseline_tree.resolve(), args))
    cost: dict[str, Any] = {"this_tree_s": min(mine), "this_tree_runs_s": mine}
    if theirs:
        cost.update(baseline_tree_s=min(theirs), baseline_tree_runs_s=theirs,
                    ratio=round(min(mine) / min(theirs), 4))
    print_table(f"a decode Step of {args.step_requests} requests, no policy used (best of "
                f"{len(mine)} x {args.step_rounds} runs, trees alternating)",
                ["tree", "us per Step", "this / baseline"],
                [["this tree", cost["this_tree_s"] * 1e6, "-"]]
                + ([["baseline tree", cost["baseline_tree_s"] * 1e6, f"{cost['ratio']:.3f}x"]]
                   if "ratio" in cost else []))
    results["step_cost"] = cost
    path = write_results("policy", {"args": {k: str(v) for k, v in vars(args).items()},
                                    **results}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
