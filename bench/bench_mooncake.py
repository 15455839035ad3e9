#!/usr/bin/env python3
"""Mooncake trace replay: block_ops/s and hit rate of our core, the Pool facade, a live server
and vLLM 0.33's manager, on the peers' own axis.

A Mooncake FAST'25 request trace (``--trace PATH``: one JSON object per line with
``timestamp``, ``input_length``, ``output_length`` and ``hash_ids`` of 512-token blocks; the
public ones are in ../shared/data/mooncake-traces/, never committed here) runs through the
simulated engine loop of bench/mooncake_sim.py against:

* ``core``: cache_service.core.KVCacheManager in this process (events on);
* ``pool``: the Pool facade the gRPC service runs, by request id (validation, id lists);
* ``server``: a real ``python -m cache_service`` process on loopback, one Step per engine
  step (frees of the last step, the new step, the running requests' allocations: decode ops
  for those decoding, an allocate op per prefill chunk), plus two Steps per admission (add +
  lookup, then the allocation); a failed running allocation is handled after the batch as the
  loop would (preempt the newest, retry), so its decisions can differ where the pool runs full;
* ``vllm``: vLLM 0.33's KVCacheManager (events on) through the same loop file, run by the
  oracle venv's interpreter (~/.cache/vllm-oracle-venv) when it exists.

What is counted (docs/benchmarks.md, "Mooncake trace"): a *block op* is one KV block the
kv-router side has to touch. ``query`` blocks are each request's ``len(hash_ids)`` once, at its
first admission (the blocks NVIDIA Dynamo's mooncake_bench hands to ``find_matches`` per
request); ``stored`` and ``removed`` blocks are the hashes of the manager's ``BlockStored`` and
``BlockRemoved`` KV events. Dynamo's block throughput counts query + stored blocks (a removal is
an op of zero blocks); llm-d's BenchmarkMooncakeReplay (MixedOverload) counts query + stored +
removed, "over Dynamo's denominators". The time is the time inside the manager's calls
(lookups, allocations, frees, the per-step event drain), as bench_core.py counts manager ops;
request creation (prompt hashing) and appends are reported apart. For the server it is the
client-observed time of its Step calls (hashing, gRPC and the service included).

    python3 bench/bench_mooncake.py --trace ../shared/data/mooncake-traces/conversation_trace.jsonl --max-requests 1000

Prints a table and writes bench/results/mooncake.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import Bars, Panel, PoolCalls, print_table, ratio, summarize_ns, write_results
from cache_service.client import CacheClient, DecodeResult, StepBuilder, layers
from cache_service.core.hashing import get_hash_fn
from cache_service.core.kv_cache_manager import KVCacheManager, resolve_block_sizes
from cache_service.core.pool import Pool, PoolOptions
from cache_service.core.request import Request, RequestStatus
from cache_service.core.specs import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from kvcache_common.launch import start_cache_service
from mooncake_sim import (
    VOCAB,
    ManagerSide,
    TraceRequest,
    load_trace,
    max_model_len,
    run_loop,
)

HERE = Path(__file__).resolve().parent
ORACLE_DIR = Path(os.environ.get("VLLM_ORACLE_DIR", HERE.parents[1] / "shared/tools/vllm-oracle"))
ORACLE_PY = Path(os.environ.get("VLLM_ORACLE_PY",
                                Path.home() / ".cache" / "vllm-oracle-venv" / "bin" / "python"))
CONFIGS = ("full", "full_swa")
SIDES = ("core", "pool", "server", "vllm")


def make_config(kind: str, args: argparse.Namespace) -> KVCacheConfig:
    """The oracle's scenario shapes: one single-layer group per kind, 1 head of size 1."""
    common = dict(block_size=args.block_size, num_kv_heads=1, head_size=1, dtype="float32")
    groups = [KVCacheGroupSpec(("layer0_full",), FullAttentionSpec(**common))]
    if kind == "full_swa":
        groups.append(KVCacheGroupSpec(("layer1_swa",), SlidingWindowSpec(
            sliding_window=args.sliding_window, **common)))
    return KVCacheConfig(num_blocks=args.num_blocks, groups=tuple(groups))


# --- in-process sides -------------------------------------------------------------------------

def core_side(kind: str, args: argparse.Namespace) -> ManagerSide:
    """The core's KV cache manager for config ``kind``, events on, behind a ManagerSide."""
    config = make_config(kind, args)
    sched, hbs = resolve_block_sizes(config, True)
    mgr = KVCacheManager(config, max_model_len=args.max_model_len, scheduler_block_size=sched,
                         hash_block_size=hbs, enable_events=True)
    hash_fn = get_hash_fn("sha256")

    def make(tr: TraceRequest) -> Request:
        return Request(tr.rid, tr.tokens(), hash_fn=hash_fn, hash_block_size=hbs)

    return ManagerSide(mgr, make, RequestStatus.RUNNING, RequestStatus.PREEMPTED,
                       lambda req, tok: req.append_tokens((tok,)))


class PoolSide(PoolCalls):
    """The Pool facade by request id, no tables (the loop never reads them; see
    :class:`_common.PoolCalls`)."""

    def __init__(self, pool: Pool) -> None:
        super().__init__(pool, include_tables=False)

    def add(self, tr: TraceRequest) -> str:
        """Adds the request to the pool; answers its id (the handle the other calls take)."""
        return self.add_prompt(tr.rid, tr.tokens())


def pool_side(kind: str, args: argparse.Namespace) -> PoolSide:
    """A Pool for config ``kind`` (the gRPC servicer's facade), events on."""
    return PoolSide(Pool(make_config(kind, args), PoolOptions(
        max_model_len=args.max_model_len, hash_algo="sha256", enable_events=True)))


# --- the live server --------------------------------------------------------------------------

def server_layers(kind: str, args: argparse.Namespace) -> list[Any]:
    """The LayerSpecs of config ``kind`` for the live server (one head of size 1)."""
    out = [layers.full_attention("layer0_full", block_size=args.block_size, num_kv_heads=1,
                                 head_size=1)]
    if kind == "full_swa":
        out.append(layers.sliding_window("layer1_swa", block_size=args.block_size,
                                         num_kv_heads=1, head_size=1,
                                         sliding_window=args.sliding_window))
    return out


def run_server(kind: str, args: argparse.Namespace, reqs: list[TraceRequest],
               client: CacheClient) -> dict[str, Any]:
    """The loop of mooncake_sim.run_loop with one Step per engine step (see the module
    docstring); the client keeps each request's token and computed counts."""
    import random  # noqa: PLC0415

    pool_id = f"mooncake-{kind}"
    client.register_pool(pool_id, server_layers(kind, args), num_blocks=args.num_blocks,
                         max_model_len=args.max_model_len, enable_events=True)
    rng = random.Random(args.seed)
    lat: dict[str, list[int]] = {"step": [], "admit": [], "fixup": []}
    pc = time.perf_counter_ns
    tokens: dict[str, int] = {}
    computed: dict[str, int] = {}
    pending_token: dict[str, int] = {}
    pending_free: list[str] = []
    waiting = list(reversed(reqs))
    running: list[TraceRequest] = []
    n_alloc_fail = n_preempt = prompt_tokens = hit_tokens = n_steps = finished = 0
    t_wall = time.perf_counter()

    def call(batch: StepBuilder, key: str) -> Any:
        t0 = pc()
        result = client.step_batch(batch)
        lat[key].append(pc() - t0)
        return result

    def preempt_newest() -> TraceRequest:
        nonlocal n_preempt
        victim = running.pop()
        call(StepBuilder(pool_id).preempt(victim.rid), "fixup")
        computed[victim.rid] = 0
        pending_token.pop(victim.rid, None)
        waiting.append(victim)
        n_preempt += 1
        return victim

    while waiting or running:
        n_steps += 1
        budget = args.max_batched_tokens
        batch = StepBuilder(pool_id)
        for rid in pending_free:
            batch.free(rid)
        pending_free = []
        batch.new_step()
        plan: list[tuple[TraceRequest, int, int]] = []  # (request, n, op index)
        run_ids: list[str] = []
        run_toks: list[int] = []

        def flush_decode(batch: StepBuilder, run_ids: list[str], run_toks: list[int]) -> None:
            if run_ids:
                batch.decode(list(run_ids), list(run_toks))
                run_ids.clear()
                run_toks.clear()

        for tr in running:
            if budget <= 0:
                break
            remaining = tokens[tr.rid] + (tr.rid in pending_token) - computed[tr.rid]
            n = min(remaining, budget)
            if tr.rid in pending_token and n == 1:
                run_ids.append(tr.rid)
                run_toks.append(pending_token[tr.rid])
                plan.append((tr, 1, -1))
            else:
                flush_decode(batch, run_ids, run_toks)
                if tr.rid in pending_token:  # cannot happen with chunked decode of 1
                    batch.append(tr.rid, [pending_token[tr.rid]])
                plan.append((tr, n, len(batch)))
                batch.allocate(tr.rid, n, use_lookup=False, block_table=False)
            budget -= n
        flush_decode(batch, run_ids, run_toks)
        result = call(batch, "step")
        # Which planned allocations failed: decode ops answer per request, in order.
        oks: list[bool] = []
        decode_answers = iter([r for r in result.results if isinstance(r, DecodeResult)])
        current: list[bool] = []
        for _, _, index in plan:
            if index >= 0:
                oks.append(result.results[index].ok)
            else:
                if not current:
                    current = list(next(decode_answers).ok)
                oks.append(current.pop(0))
        for tr, _, _ in plan:
            if tr.rid in pending_token:
                tokens[tr.rid] += 1
                del pending_token[tr.rid]
        scheduled: list[TraceRequest] = []
        for (tr, n, _), ok in zip(plan, oks):
            if tr not in running:
                continue  # preempted as a victim of an earlier failure
            while not ok:
                n_alloc_fail += 1
                victim = preempt_newest()
                if victim is tr:
                    break
                ok = call(StepBuilder(pool_id).allocate(tr.rid, n, use_lookup=False,
                                                        block_table=False), "fixup").results[0].ok
            if ok:
                computed[tr.rid] += n
                scheduled.append(tr)
        budget = args.max_batched_tokens - sum(n for tr, n, _ in plan if tr in scheduled)
        while waiting and len(running) < args.max_concurrency and budget > 0:
            tr = waiting[-1]
            first = tr.rid not in tokens
            b = StepBuilder(pool_id)
            if first:
                b.add(tr.rid, tr.tokens())
            res = call(b.lookup(tr.rid), "admit")
            num_hit = res.results[-1].hit_tokens
            if first:
                tokens[tr.rid] = res.results[0].num_tokens
            n = min(tokens[tr.rid] - num_hit, budget)
            ok = call(StepBuilder(pool_id).allocate(tr.rid, n, full_sequence_must_fit=True,
                                                    block_table=False), "admit").results[0].ok
            if not ok:
                n_alloc_fail += 1
                break
            waiting.pop()
            if tr.first_admission:
                tr.first_admission = False
                prompt_tokens += tr.input_length
                hit_tokens += num_hit
            computed[tr.rid] = num_hit + n
            budget -= n
            running.append(tr)
            scheduled.append(tr)
        done = set()
        for tr in scheduled:
            if computed[tr.rid] < tokens[tr.rid]:
                continue
            tr.decoded += 1
            if tr.decoded >= tr.output_length:
                pending_free.append(tr.rid)
                done.add(id(tr))
                finished += 1
            else:
                pending_token[tr.rid] = rng.randrange(VOCAB)
        if done:
            running = [tr for tr in running if id(tr) not in done]
        if not scheduled and waiting:
            raise RuntimeError("a request can never be admitted; raise --num-blocks")
    if pending_free:
        batch = StepBuilder(pool_id)
        for rid in pending_free:
            batch.free(rid)
        call(batch, "step")
    t_wall = time.perf_counter() - t_wall
    client.delete_pool(pool_id)
    calls_ns = sum(sum(v) for v in lat.values())
    return {
        "side": "server",
        "decisions": {"steps": n_steps, "finished": finished, "preemptions": n_preempt,
                      "alloc_failures": n_alloc_fail, "hit_tokens": hit_tokens},
        "prompt_tokens": prompt_tokens,
        "query_blocks": sum(len(r.hash_ids) for r in reqs),
        "manager_ops": None,
        "manager_ns": calls_ns,
        "hashing_ns": 0,
        "calls": {k: len(v) for k, v in lat.items()},
        "wall_s": round(t_wall, 3),
        "latency_ns": {k: sorted(v) for k, v in lat.items()},
    }


# --- vLLM through the oracle venv -------------------------------------------------------------

def run_vllm(kind: str, args: argparse.Namespace) -> dict[str, Any] | str:
    """vLLM's side of the replay, run by the oracle's interpreter; ``not installed`` when it is
    missing."""
    py = Path(args.oracle_python)
    if not py.exists():
        return "not installed"
    argv = [str(py), str(HERE / "mooncake_sim.py"), "--vllm", "--oracle-dir", str(ORACLE_DIR),
            "--trace", str(args.trace), "--config", kind, "--num-blocks", str(args.num_blocks),
            "--block-size", str(args.block_size), "--sliding-window", str(args.sliding_window),
            "--max-model-len", str(args.max_model_len), "--max-concurrency",
            str(args.max_concurrency), "--max-batched-tokens", str(args.max_batched_tokens),
            "--seed", str(args.seed)]
    if args.max_requests is not None:
        argv += ["--max-requests", str(args.max_requests)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "PYTHONPATH")}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=7200)
    if proc.returncode != 0:
        print(f"vLLM side failed ({kind}): {proc.stderr[-2000:]}", file=sys.stderr)
        return "failed (see stderr)"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- reporting --------------------------------------------------------------------------------

def finish(run: dict[str, Any], counts: dict[str, int]) -> dict[str, Any]:
    """Block-op figures of one side's run over the workload's block counts ``counts``."""
    secs = run["manager_ns"] / 1e9
    dynamo = counts["query"] + counts["stored"]
    llmd = dynamo + counts["removed"]
    lat = run.pop("latency_ns")
    run["latency"] = {k: summarize_ns(v) for k, v in lat.items() if v}
    run["manager_s"] = round(secs, 3)
    run["block_ops_dynamo"] = dynamo
    run["block_ops_llmd"] = llmd
    run["block_ops_per_s_dynamo"] = round(dynamo / secs) if secs else None
    run["block_ops_per_s_llmd"] = round(llmd / secs) if secs else None
    run["manager_ops_per_s"] = round(run["manager_ops"] / secs) if run["manager_ops"] else None
    run["hit_rate"] = round(run["decisions"]["hit_tokens"] / max(1, run["prompt_tokens"]), 4)
    return run


def main(argv: list[str] | None = None) -> int:
    """Replays the trace on each side and config, prints the tables and writes the JSON
    results."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, required=True, help="a Mooncake trace (.jsonl)")
    p.add_argument("--max-requests", type=int, default=None,
                   help="replay only the first N requests (default: all)")
    p.add_argument("--configs", default="full,full_swa", help="comma list of full,full_swa")
    p.add_argument("--sides", default=",".join(SIDES), help="comma list of " + ",".join(SIDES))
    p.add_argument("--num-blocks", type=int, default=None,
                   help="pool size in blocks (default: room for the concurrency's longest "
                        "requests, at least 4x the longest one)")
    p.add_argument("--block-size", type=int, default=512,
                   help="KV block size in tokens (default 512: one KV block per trace hash "
                        "id, the peers' unit)")
    p.add_argument("--sliding-window", type=int, default=2048)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--oracle-python", default=str(ORACLE_PY))
    p.add_argument("--out", type=Path, default=None, help="JSON path (default "
                   "bench/results/mooncake.json)")
    args = p.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    sides = [s for s in args.sides.split(",") if s]
    for c in configs:
        if c not in CONFIGS:
            p.error(f"unknown config {c!r}")
    for s in sides:
        if s not in SIDES:
            p.error(f"unknown side {s!r}")
    reqs = load_trace(args.trace, args.max_requests)
    if not reqs:
        p.error(f"{args.trace}: no requests")
    args.max_model_len = max_model_len(reqs, args.block_size)
    if args.num_blocks is None:
        per_req = sorted(-(-(r.input_length + r.output_length) // args.block_size)
                         for r in reqs)
        typical = sum(per_req[-args.max_concurrency:])
        args.num_blocks = max(4 * per_req[-1], typical // 2) * 2 + 1  # two groups at most
    print(f"trace {args.trace}: {len(reqs)} requests, max_model_len {args.max_model_len}, "
          f"{args.num_blocks} blocks of {args.block_size} tokens", file=sys.stderr)
    server = client = None
    runs: dict[str, dict[str, Any]] = {}
    vllm_status: dict[str, str] = {}
    try:
        if "server" in sides:
            server = start_cache_service("--log-level", "warning")
            client = CacheClient(server.target, default_timeout=120)
        for kind in configs:
            found: dict[str, Any] = {}
            for side in sides:
                fresh = load_trace(args.trace, args.max_requests)
                t = time.perf_counter()
                if side == "core":
                    r = run_loop("core", core_side(kind, args), fresh, seed=args.seed,
                                 max_concurrency=args.max_concurrency,
                                 max_batched_tokens=args.max_batched_tokens)
                elif side == "pool":
                    r = run_loop("pool", pool_side(kind, args), fresh, seed=args.seed,
                                 max_concurrency=args.max_concurrency,
                                 max_batched_tokens=args.max_batched_tokens)
                elif side == "server":
                    assert client is not None
                    r = run_server(kind, args, fresh, client)
                else:
                    v = run_vllm(kind, args)
                    if isinstance(v, str):
                        vllm_status[kind] = v
                        continue
                    r = v
                found[side] = r
                print(f"  {kind}/{side}: {time.perf_counter() - t:.1f} s", file=sys.stderr)
            ref = found.get("core") or found.get("pool") or found.get("vllm")
            counts = {"query": sum(len(r.hash_ids) for r in reqs), "stored": 0, "removed": 0}
            if ref is not None and "stored_blocks" in ref["decisions"]:
                counts["stored"] = ref["decisions"]["stored_blocks"]
                counts["removed"] = ref["decisions"]["removed_blocks"]
            for side, r in found.items():
                own = dict(counts)
                if "stored_blocks" in r["decisions"]:
                    own["stored"] = r["decisions"]["stored_blocks"]
                    own["removed"] = r["decisions"]["removed_blocks"]
                runs[f"{kind}/{side}"] = finish(r, own)
    finally:
        if client is not None:
            client.close()
        if server is not None:
            server.stop()
    summary = report(configs, sides, runs, vllm_status)
    path = write_results("mooncake", {
        "trace": str(args.trace), "requests": len(reqs),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "summary": summary, "vllm": vllm_status or "ran", "runs": runs}, args.out,
        plot=plot(summary))
    print(f"wrote {path}")
    return 0


def plot(summary: dict[str, Any]) -> list[Panel]:
    """Each side's block ops/s (Dynamo's count) over vLLM's, or over our core's where the
    oracle did not run, per config."""
    kinds = [k for k in summary if "core" in summary[k]]
    ref = "vllm" if kinds and all("vllm" in summary[k] and isinstance(summary[k]["vllm"], dict)
                                  for k in kinds) else "core"
    sides = sorted({s for k in kinds for s, v in summary[k].items()
                    if isinstance(v, dict) and s != ref})
    if not kinds:
        return []
    rate = "block_ops_per_s_dynamo"
    return [Bars(f"block ops/s / {ref}'s (Mooncake replay)", kinds,
                 {side: [summary[k][side][rate] / summary[k][ref][rate]
                         if side in summary[k] else float("nan") for k in kinds]
                  for side in sides}, f"x {ref}", reference=1.0)]


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    keys = ("steps", "finished", "preemptions", "alloc_failures", "hit_tokens")
    return all(a["decisions"][k] == b["decisions"][k] for k in keys)


def report(configs: list[str], sides: list[str], runs: dict[str, dict[str, Any]],
           vllm_status: dict[str, str]) -> dict[str, Any]:
    """The summary per config: hit rates and times of each side, and whether they match vLLM's."""
    summary: dict[str, Any] = {}
    for kind in configs:
        core = runs.get(f"{kind}/core")
        vllm = runs.get(f"{kind}/vllm")
        rows = []
        for side in sides:
            r = runs.get(f"{kind}/{side}")
            if r is None:
                if side == "vllm":
                    rows.append(["vllm", vllm_status.get(kind, "not installed")] + ["-"] * 10)
                continue
            d = r["decisions"]
            same = "-" if core is None or side == "core" else ("yes" if _same(r, core) else "NO")
            rows.append([side, r["block_ops_per_s_dynamo"], r["block_ops_per_s_llmd"],
                         ratio(core and core["block_ops_per_s_dynamo"],
                               r["block_ops_per_s_dynamo"]) if side != "core" else "1.00x",
                         ratio(r["block_ops_per_s_dynamo"],
                               vllm and vllm["block_ops_per_s_dynamo"]),
                         r["manager_ops_per_s"], r["manager_s"], r["hit_rate"],
                         d["preemptions"], d["steps"], r["wall_s"], same])
        print_table(f"config {kind}: Mooncake replay ({core and core['block_ops_dynamo']:,} "
                    f"block ops, Dynamo's count)" if core else f"config {kind}",
                    ["side", "block ops/s (Dynamo: query + stored)",
                     "block ops/s (llm-d: + removed)", "core / side", "side / vLLM",
                     "manager ops/s", "time in calls s", "hit rate", "preemptions", "steps",
                     "wall s", "same decisions as core"], rows)
        summary[kind] = {side: {"block_ops_per_s_dynamo": r["block_ops_per_s_dynamo"],
                                "block_ops_per_s_llmd": r["block_ops_per_s_llmd"],
                                "hit_rate": r["hit_rate"]}
                         for side in sides if (r := runs.get(f"{kind}/{side}")) is not None}
        if core is not None and vllm is not None:
            summary[kind]["core_vs_vllm"] = round(core["block_ops_per_s_dynamo"]
                                                  / vllm["block_ops_per_s_dynamo"], 3)
            summary[kind]["same_decisions_as_vllm"] = _same(core, vllm)
        elif "vllm" in sides:
            summary[kind]["vllm"] = vllm_status.get(kind, "not installed")
    return summary


if __name__ == "__main__":
    sys.exit(main())
