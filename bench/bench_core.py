#!/usr/bin/env python3
"""Core allocator benchmark: our KV-cache manager (pure and compiled), the Pool facade, vLLM
0.33's own manager and a naive baseline, side by side in one run on one workload.

Every side runs bench/core_loop.py's generator and scheduling loop (the vLLM oracle's
``run_bench``, ../shared/tools/vllm-oracle/vllm_oracle.py, call for call, with the same
random stream), so all see identical requests and decode tokens (each run reports the
workload's digest) and, if our core is vLLM-exact, make identical decisions (steps, hits,
preemptions are compared). Workload: 10,000 requests (seed 0); 64 shared system prompts of
512-3,072 tokens, Zipf-like popularity, used by 75% of requests; prompts 256-4,096 tokens;
decode 32-256 tokens; at most 64 running; an 8,192-token step budget with chunked prefill;
block size 16; 6,144 blocks; the newest running request is preempted when an allocation
fails; admission requires the full sequence to fit.

Accounting (as the oracle): manager ops = lookups + allocations + frees (preemptions are
frees); ops/s = manager ops / time spent inside those calls (``perf_counter_ns`` around each
call; imports and construction are outside). ``add`` (request creation with prompt hashing)
and ``append`` (decode token + incremental hashing) are reported separately. Configs:
``full`` (one full-attention group), ``full_swa`` (+ one sliding-window group, window 128)
and ``full_mamba`` (+ one Mamba ``align`` group; prefill chunks cut at block boundaries and
lookup junctions as vLLM's scheduler cuts them).

Sides: ``core`` = cache_service.core.KVCacheManager (the vLLM-shaped manager) of the build
this process loaded; ``pure`` = the same with ``KVCACHE_CORE=pure`` in a subprocess (when
``core`` is the compiled build); ``pool`` = the Pool facade the gRPC service runs
(validation, id lists); ``naive`` = a deliberately simple manager in this file (Python-list
free queue with O(n) removal, sliding window and Mamba treated as full attention); ``vllm``
= core_loop.py run by the oracle venv's interpreter over vLLM's KVCacheManager when the venv
exists (else the column says "absent"; never a dependency). Plus: construction time and
tracemalloc peak of a 1,000,000-block pool.

    python3 bench/bench_core.py                          # the full run (minutes)
    python3 bench/bench_core.py --num-requests 500       # a quick run
    python3 bench/bench_core.py --profile                # + cProfile hot spots of our core
    python3 bench/bench_core.py --baseline-tree ../main  # + the same sides from another tree
    python3 bench/bench_core.py --vs-pure                # + the pure-Python core (compiled run)
    python3 bench/bench_core.py --retention --num-requests 300   # Mamba checkpoints dense vs sparse

Prints tables and writes bench/results/core.json.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import Bars, Panel, PoolCalls, print_table, ratio, write_results
from _retention import retention_report
from cache_service.core._variant import build_info
from cache_service.core.hashing import get_hash_fn
from cache_service.core.kv_cache_manager import KVCacheManager, resolve_block_sizes
from cache_service.core.pool import Pool, PoolOptions
from cache_service.core.request import Request, RequestStatus
from cache_service.core.specs import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
    cdiv,
)
from core_loop import (
    CONFIGS,
    LAT_KEYS,
    BenchManagerSide,
    BenchReq,
    add_workload_args,
    run_loop,
    workload_argv,
)

# The vLLM oracle is a dev tool beside the checkout (../shared/tools/vllm-oracle), never a
# dependency: without it the vLLM column is left out.
HERE = Path(__file__).resolve().parent
ORACLE_DIR = Path(os.environ.get("VLLM_ORACLE_DIR", HERE.parents[1] / "shared/tools/vllm-oracle"))
ORACLE_PY = Path(os.environ.get("VLLM_ORACLE_PY",
                                Path.home() / ".cache" / "vllm-oracle-venv" / "bin" / "python"))
#: The sides of one run, in table order: ``core`` is the build this process loaded,
#: ``pure`` the pure-Python core in a subprocess (only when ``core`` is the compiled one).
SIDES = ("pure", "core", "pool", "naive", "vllm")


def make_config(kind: str, args: argparse.Namespace,
                num_blocks: int | None = None) -> KVCacheConfig:
    """The oracle's scenario: one single-layer group per kind, 1 head of size 1, fp32 (the
    Mamba group in ``align`` mode, one state of one element, the attention block size)."""
    common = dict(block_size=args.block_size, num_kv_heads=1, head_size=1, dtype="float32")
    groups = [KVCacheGroupSpec(("layer0_full",), FullAttentionSpec(**common))]
    if kind == "full_swa":
        groups.append(KVCacheGroupSpec(("layer1_swa",), SlidingWindowSpec(
            sliding_window=args.sliding_window, **common)))
    elif kind == "full_mamba":
        groups.append(KVCacheGroupSpec(("layer1_mamba",), MambaSpec(
            block_size=args.block_size, shapes=((1,),), dtypes=("float32",),
            mamba_cache_mode="align")))
    return KVCacheConfig(num_blocks=num_blocks or args.num_blocks, groups=tuple(groups))


# --- sides ----------------------------------------------------------------------------------

class ManagerDriver(BenchManagerSide):
    """Drives a vLLM-shaped manager (ours or the naive one) over core Request objects,
    exactly as core_loop.py drives vLLM's.

    The calls are mooncake_sim's :class:`ManagerSide` (one copy of the vLLM scheduler's use of
    a manager), over :class:`BenchReq` prompts hashed as the manager expects."""

    def __init__(self, manager: Any, hash_fn: Callable[[object], bytes] | None,
                 hash_block_size: int) -> None:
        def make(br: BenchReq) -> Request:
            return Request(br.rid, br.prompt, hash_fn=hash_fn, hash_block_size=hash_block_size)

        super().__init__(manager, make, RequestStatus.RUNNING, RequestStatus.PREEMPTED,
                         lambda req, tok: req.append_tokens((tok,)))


class PoolDriver(PoolCalls):
    """Drives the Pool facade (what the gRPC servicer calls) by request id, tables included
    (see :class:`_common.PoolCalls`)."""

    def __init__(self, pool: Pool) -> None:
        super().__init__(pool)
        self.junction: dict[str, int] = {}

    def add(self, br: BenchReq) -> str:
        """Adds the request to the pool; answers its id (the handle the other calls take)."""
        return self.add_prompt(br.rid, br.prompt)

    def lookup(self, rid: str) -> tuple[None, int]:
        """The pool's cached prefix of the request: (None, hit tokens); the hit stays pending
        for its allocate, its junction is kept for Mamba chunking."""
        hit = self.pool.lookup(rid)
        self.junction[rid] = hit.shared_prefix_boundary
        return None, hit.hit_tokens

    def junction_of(self, rid: str) -> int:
        """The shared-prefix boundary of the request's last lookup (0: none)."""
        return self.junction.get(rid, 0)


class NaiveManager:
    """A deliberately simple manager for a ratio without vLLM: every group is managed as
    full attention (a sliding window is never released), free blocks are a Python list
    (O(n) ``pop(0)``, ``remove`` and ``insert(0)``), one dict maps hashes to blocks and
    keeps only the first block cached under a hash. Same API shape as KVCacheManager."""

    def __init__(self, num_blocks: int, block_size: int, num_groups: int,
                 max_model_len: int) -> None:
        self.num_blocks = num_blocks
        self.bs = block_size
        self.groups = range(num_groups)
        self.max_model_len = max_model_len
        self.ref = [0] * num_blocks
        self.key: list[bytes | None] = [None] * num_blocks
        self.free_list = list(range(1, num_blocks))  # block 0 is the null block
        self.cached: dict[bytes, int] = {}
        self.tables: dict[str, list[list[int]]] = {}
        self.num_cached: dict[str, int] = {}

    def get_computed_blocks(self, req: Request) -> tuple[list[list[int]], int, int]:
        """The cached prefix of ``req``: (blocks per group, hit tokens, 0); a block counts only
        when every group has it cached."""
        hits: list[list[int]] = [[] for _ in self.groups]
        for h in req.block_hashes[: (req.num_tokens - 1) // self.bs]:
            found = [b for g in self.groups if (b := self.cached.get(h + bytes((g,)))) is not None]
            if len(found) < len(self.groups):
                break
            for g, b in enumerate(found):
                hits[g].append(b)
        return hits, len(hits[0]) * self.bs, 0

    def _needed(self, tables: list[list[int]], hits: list[list[int]] | None, tokens: int) -> int:
        n = 0
        for g in self.groups:
            have = len(tables[g]) + (len(hits[g]) if hits else 0)
            n += max(0, cdiv(tokens, self.bs) - have)
            if hits:
                n += sum(1 for b in hits[g] if self.ref[b] == 0)  # evictable hits are "free"
        return n

    def allocate_slots(self, req: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[list[int]] | None = None,
                       full_sequence_must_fit: bool = False,
                       has_scheduled_reqs: bool = True) -> list[list[int]] | None:
        """Blocks for ``num_new_tokens`` more tokens (after the hit's ``new_computed_blocks``),
        per group, newly cached full blocks recorded; None: no room."""
        rid = req.request_id
        tables = self.tables.get(rid) or [[] for _ in self.groups]
        computed = req.num_computed_tokens + num_new_computed_tokens
        free = self.free_list
        if full_sequence_must_fit and self._needed(
                tables, new_computed_blocks, min(req.num_tokens, self.max_model_len)) > len(free):
            return None
        slots = min(computed + num_new_tokens, self.max_model_len)
        if self._needed(tables, new_computed_blocks, slots) > len(free):
            return None
        self.tables[rid] = tables
        new: list[list[int]] = []
        for g in self.groups:
            table = tables[g]
            for b in (new_computed_blocks[g] if new_computed_blocks else ()):
                if self.ref[b] == 0:
                    free.remove(b)
                self.ref[b] += 1
                table.append(b)
            added = []
            for _ in range(cdiv(slots, self.bs) - len(table)):
                b = free.pop(0)
                k = self.key[b]
                if k is not None:  # evict the cached block we are reusing
                    if self.cached.get(k) == b:
                        del self.cached[k]
                    self.key[b] = None
                self.ref[b] = 1
                table.append(b)
                added.append(b)
            new.append(added)
        full = min(computed + num_new_tokens, req.num_tokens) // self.bs
        start = self.num_cached.get(rid, 0)
        for i in range(start, full):
            for g in self.groups:
                b = tables[g][i]
                if self.key[b] is None:
                    k = req.block_hashes[i] + bytes((g,))
                    self.key[b] = k
                    self.cached.setdefault(k, b)
        self.num_cached[rid] = max(start, full)
        return new

    def free(self, req: Request) -> None:
        """Frees the request's blocks: uncached ones to the front of the free list, cached ones
        to its end (evicted last)."""
        for table in self.tables.pop(req.request_id, []):
            for b in reversed(table):
                self.ref[b] -= 1
                if self.ref[b] == 0:
                    if self.key[b] is None:
                        self.free_list.insert(0, b)
                    else:
                        self.free_list.append(b)
        self.num_cached.pop(req.request_id, None)

    def new_step_starts(self) -> None:
        """Nothing to do: the naive manager has no per-step state."""
        pass

    @property
    def usage(self) -> float:
        """The share of the usable blocks (block 0 aside) in use."""
        return 1.0 - len(self.free_list) / (self.num_blocks - 1)


def make_side(side: str, kind: str, args: argparse.Namespace) -> tuple[Any, int | None]:
    """The driver of one side (core, pool, naive) over a fresh manager for config ``kind``,
    and the scheduler block size that Mamba chunking uses (None without a Mamba group)."""
    config = make_config(kind, args)
    hash_fn = get_hash_fn(args.hash_fn)
    sched, hbs = resolve_block_sizes(config, True)
    mamba = sched if kind == "full_mamba" else None
    if side == "core":
        mgr = KVCacheManager(config, max_model_len=args.max_model_len,
                             scheduler_block_size=sched, hash_block_size=hbs)
        return ManagerDriver(mgr, hash_fn, hbs), mamba
    if side == "pool":
        return PoolDriver(Pool(config, PoolOptions(max_model_len=args.max_model_len,
                                                   hash_algo=args.hash_fn,
                                                   enable_events=False))), mamba
    if side == "naive":
        return ManagerDriver(NaiveManager(args.num_blocks, args.block_size, len(config.groups),
                                          args.max_model_len), hash_fn, hbs), mamba
    raise ValueError(side)


def run_bench(side: str, kind: str, args: argparse.Namespace,
              profiler: cProfile.Profile | None = None) -> dict[str, Any]:
    """Runs the workload on one side and config (core_loop.run_loop): the scheduler's
    decisions, the manager's time and op rates, and per-op latencies."""
    drv, mamba = make_side(side, kind, args)
    return run_loop(side, kind, drv, args, mamba_block_size=mamba, profiler=profiler)


# --- vLLM through the oracle ----------------------------------------------------------------

def run_oracle(args: argparse.Namespace, kind: str) -> dict[str, Any] | None:
    """The vLLM side: core_loop.py run by the oracle's interpreter on this run's workload
    (None when it is not installed or not asked for, or failed)."""
    py = Path(args.oracle_python)
    if args.no_oracle or not py.exists():
        return None
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "PYTHONPATH")}
    argv = [str(py), str(HERE / "core_loop.py"), "--vllm", "--oracle-dir", str(ORACLE_DIR),
            "--config", kind, *workload_argv(args)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        print(f"oracle failed ({kind}): {proc.stderr[-2000:]}", file=sys.stderr)
        return None
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


_VLLM_CONSTRUCT = """
import gc, json, sys, time, tracemalloc
sys.path.insert(0, {dir!r})
import vllm_oracle as vo
cfg = vo.OracleConfig(scenario="full", num_blocks={n}, block_size={bs}, max_model_len={mml})
kv, sbs, hbs = vo.build_kv_cache_config(cfg)
make = lambda: vo.KVCacheManager(kv_cache_config=kv, max_model_len={mml},
                                 scheduler_block_size=sbs, hash_block_size=hbs,
                                 enable_caching=True)
t = time.perf_counter(); m = make(); t = time.perf_counter() - t
del m; gc.collect()
tracemalloc.start(); m = make(); peak = tracemalloc.get_traced_memory()[1]; tracemalloc.stop()
print(json.dumps({{"construct_s": t, "tracemalloc_peak_bytes": peak}}))
"""


def measure_construction(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Time (untraced) and tracemalloc peak of building a pool of ``--pool-blocks`` blocks."""
    n = args.pool_blocks
    config = make_config("full", args, num_blocks=n)
    options = PoolOptions(max_model_len=args.max_model_len, enable_events=False)
    builders: dict[str, Callable[[], Any]] = {
        "pool": lambda: Pool(config, options),
        "naive": lambda: NaiveManager(n, args.block_size, 1, args.max_model_len),
    }
    rows = []
    for side, build in builders.items():
        gc.collect()
        t = time.perf_counter()
        obj = build()
        t = time.perf_counter() - t
        del obj
        gc.collect()
        tracemalloc.start()
        obj = build()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        del obj
        rows.append({"side": side, "num_blocks": n, "construct_s": round(t, 4),
                     "tracemalloc_peak_bytes": peak})
    py = Path(args.oracle_python)
    if not args.no_oracle and py.exists() and (ORACLE_DIR / "vllm_oracle.py").exists():
        code = _VLLM_CONSTRUCT.format(dir=str(ORACLE_DIR), n=n, bs=args.block_size,
                                      mml=args.max_model_len)
        proc = subprocess.run([str(py), "-c", code], capture_output=True, text=True,
                              timeout=1200)
        if proc.returncode == 0:
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append({"side": "vllm", "num_blocks": n,
                         "construct_s": round(res["construct_s"], 4),
                         "tracemalloc_peak_bytes": res["tracemalloc_peak_bytes"]})
        else:
            print(f"vLLM construction failed: {proc.stderr[-2000:]}", file=sys.stderr)
    return rows


# --- reporting ------------------------------------------------------------------------------

def decisions(r: dict[str, Any]) -> tuple:
    """What every side must agree on: steps, first-admission hits, allocation failures,
    preemptions, finished requests."""
    res = r["results"]
    return (res["steps"], res["hit_tokens_first_admission"], res["alloc_failures"],
            res["preemptions"], res["finished"])


def side_label(side: str, variant: str) -> str:
    """The table name of a side (``core`` is the build this process loaded)."""
    return {"pure": "pure core", "core": f"{variant} core", "pool": "Pool facade",
            "naive": "naive", "vllm": "vLLM 0.33"}[side]


def report(runs: list[dict[str, Any]], construction: list[dict[str, Any]],
           variant: str, vllm_note: str) -> dict[str, Any]:
    """The summary per config: each side's numbers against the core's and vLLM's, whether
    their decisions and workloads match; then every config's sides in one table
    (``vllm_note`` where the vLLM column is absent)."""
    summary: dict[str, Any] = {}
    side_by_side = []
    for kind in CONFIGS:
        by_side = {r["side"]: r for r in runs if r["config"] == kind}
        if not by_side:
            continue
        core, vllm = by_side.get("core"), by_side.get("vllm")
        rows, lat_rows = [], []
        for side in SIDES:
            r = by_side.get(side)
            if r is None:
                continue
            res, lat = r["results"], r["latency"]
            same = "-" if core is None or side == "core" else (
                "yes" if decisions(r) == decisions(core) else "NO")
            rows.append([side_label(side, variant), res["manager_ops_per_s"],
                         ratio(core and core["results"]["manager_ops_per_s"],
                               res["manager_ops_per_s"]) if side != "core" else "1.00x",
                         ratio(res["manager_ops_per_s"],
                               vllm and vllm["results"]["manager_ops_per_s"]),
                         res["manager_ops"], res["manager_s"], res["all_ops_per_s"],
                         res["prefix_hit_rate"], res["preemptions"], res["alloc_failures"],
                         res["steps"], same])
            lat_rows.append([side_label(side, variant)] + [lat[k].get(q) for k in LAT_KEYS
                                                           for q in ("p50_us", "p99_us")])
        print_table(f"config {kind}: manager ops (lookups + allocations + frees)",
                    ["side", "mgr ops/s", "core / side", "side / vLLM", "mgr ops", "mgr s",
                     "ops/s incl. hashing", "hit rate", "preemptions", "alloc failures", "steps",
                     "same decisions"], rows)
        print_table(f"config {kind}: per-op latency p50 / p99 (us)",
                    ["side"] + [f"{k} {q}" for k in LAT_KEYS for q in ("p50", "p99")], lat_rows)
        summary[kind] = {side: r["results"]["manager_ops_per_s"] for side, r in by_side.items()}
        digests = {r["workload"].get("digest") for r in by_side.values()}
        summary[kind]["same_workload"] = len(digests) == 1
        ops = {side: r["results"]["manager_ops_per_s"] for side, r in by_side.items()}
        v = ops.get("vllm")
        if vllm is not None:
            for side in ("core", "pure", "pool"):
                if side in ops and ops[side]:
                    summary[kind][f"{side}_vs_vllm"] = round(ops[side] / v, 3)
            if core is not None:
                summary[kind]["same_decisions_as_vllm"] = decisions(core) == decisions(vllm)
        pure = ops.get("pure") if variant == "compiled" else ops.get("core")
        compiled = ops.get("core") if variant == "compiled" else None
        absent = "absent" if v is None else None
        side_by_side.append([
            kind, pure if pure else "-", compiled if compiled else "absent (no build)",
            ops.get("pool", "-"), v or "absent",
            absent or ratio(pure, v), absent or ratio(compiled, v),
            absent or ratio(ops.get("pool"), v),
            absent or ("yes" if core is not None and vllm is not None
                       and decisions(core) == decisions(vllm) else "NO"),
            "yes" if summary[kind]["same_workload"] else "NO"])
    if side_by_side:
        print_table("manager ops/s side by side (one run, one workload per config)"
                    + (f"; vLLM: {vllm_note}" if vllm_note else ""),
                    ["config", "pure core", "compiled core", "Pool facade", "vLLM 0.33",
                     "pure / vLLM", "compiled / vLLM", "Pool / vLLM",
                     "same decisions as vLLM", "same workload"], side_by_side)
    if construction:
        print_table(f"construction of a {construction[0]['num_blocks']:,}-block pool",
                    ["side", "seconds", "tracemalloc peak MiB"],
                    [[c["side"], c["construct_s"], round(c["tracemalloc_peak_bytes"] / 2**20, 1)]
                     for c in construction])
    return summary


def plot(summary: dict[str, Any]) -> list[Panel]:
    """Each side's manager ops/s over vLLM's (over the naive baseline's without the oracle),
    per config: the ratio bars of the tables above."""
    kinds = [k for k in CONFIGS if k in summary]
    ref = "vllm" if all("vllm" in summary[k] for k in kinds) else "naive"
    sides = [s for s in SIDES if s != ref and any(s in summary[k] for k in kinds)]
    if not kinds or not all(ref in summary[k] for k in kinds):
        return []
    return [Bars(f"manager ops/s / {ref}'s (higher is faster)", kinds,
                 {side: [summary[k].get(side, float("nan")) / summary[k][ref] for k in kinds]
                  for side in sides}, f"x {ref}", reference=1.0)]


def run_other(args: argparse.Namespace, script: Path, env: dict[str, str],
              cwd: Path | None, sides: str = "core,pool",
              configs: list[str] | None = None) -> list[dict[str, Any]]:
    """The ``sides`` of this run's workload, run by ``script`` in a subprocess with ``env``
    added (another checkout, or the pure-Python core), one config per call (a config that
    script does not know is skipped); its runs."""
    import tempfile  # noqa: PLC0415

    runs: list[dict[str, Any]] = []
    for kind in configs or [c for c in args.configs.split(",") if c]:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "core.json"
            argv = [sys.executable, str(script), "--sides", sides, "--configs", kind,
                    "--no-oracle", "--pool-blocks", "0", "--out", str(out), *workload_argv(args)]
            done = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=3600,
                                  env={**os.environ, **env})
            if done.returncode != 0:
                why = (f"{script} has no config {kind!r}" if "unknown config" in done.stderr
                       else done.stderr[-2000:])
                print(f"the comparison run failed ({kind}): {why}", file=sys.stderr)
                continue
            runs += json.loads(out.read_text())["runs"]
    return runs


def compare(runs: list[dict[str, Any]],
            others: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Manager ops/s of this run's core and pool sides next to the other runs', as ratios."""
    rows, out = [], []
    for label, other in others.items():
        by_key = {(r["config"], r["side"]): r for r in other}
        for r in runs:
            o = by_key.get((r["config"], r["side"]))
            if o is None:
                continue
            mine, theirs = (x["results"]["manager_ops_per_s"] for x in (r, o))
            same = "yes" if decisions(r) == decisions(o) else "NO"
            rows.append([f"{r['config']} / {r['side']}", label, mine, theirs,
                         ratio(mine, theirs), same])
            out.append({"config": r["config"], "side": r["side"], "against": label,
                        "ops_per_s": mine, "other_ops_per_s": theirs,
                        "ratio": round(mine / theirs, 3) if mine and theirs else None,
                        "same_decisions": same == "yes"})
    print_table("this run vs the comparison runs (manager ops/s, same workload)",
                ["config / side", "against", "this run", "other", "this / other",
                 "same decisions"], rows)
    return out


def run_pure(args: argparse.Namespace, kind: str) -> dict[str, Any] | None:
    """The ``pure`` side: this file's core side with ``KVCACHE_CORE=pure`` in a subprocess."""
    runs = run_other(args, HERE / "bench_core.py", {"KVCACHE_CORE": "pure"}, None,
                     sides="core", configs=[kind])
    if not runs:
        return None
    runs[0]["side"] = "pure"
    return runs[0]


def main(argv: list[str] | None = None) -> int:
    """Runs the chosen configs and sides, prints the tables and writes the JSON results."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma list of " + ",".join(CONFIGS))
    p.add_argument("--sides", default=",".join(SIDES),
                   help="comma list of " + ",".join(SIDES) + " (pure: only when this run "
                        "loads the compiled core)")
    add_workload_args(p)
    p.add_argument("--pool-blocks", type=int, default=1_000_000,
                   help="blocks of the construction measurement (0 = skip)")
    p.add_argument("--no-oracle", action="store_true", help="do not run vLLM")
    p.add_argument("--oracle-python", default=str(ORACLE_PY))
    p.add_argument("--profile", action="store_true",
                   help="also run our core under cProfile and print the hot spots")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default bench/results/core.json)")
    p.add_argument("--baseline-tree", type=Path, default=None,
                   help="also run the core and pool sides from this checkout (e.g. ../main) "
                        "in a subprocess of the same run, and print the ratios")
    p.add_argument("--vs-pure", action="store_true",
                   help="also run the core and pool sides with KVCACHE_CORE=pure (the "
                        "pure-Python core) in a subprocess, and print compiled / pure")
    p.add_argument("--retention", action="store_true",
                   help="instead: Mamba checkpoint retention dense vs sparse vs "
                        "--retention-interval on a full + Mamba workload (bench/_retention.py)")
    p.add_argument("--retention-interval", type=int, default=512,
                   help="the interval N of the --retention run (default 512)")
    args = p.parse_args(argv)
    argd = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    if args.retention:
        out = write_results("core_retention", {"args": argd,
                                               **retention_report(args)}, args.out)
        print(f"wrote {out}")
        return 0
    configs = [c for c in args.configs.split(",") if c]
    sides = [s for s in args.sides.split(",") if s]
    for c in configs:
        if c not in CONFIGS:
            p.error(f"unknown config {c!r}")
    variant = str(build_info()["variant"])
    vllm_note = ""
    if "vllm" not in sides:
        vllm_note = "not asked for"
    elif args.no_oracle:
        vllm_note = "--no-oracle"
    elif not Path(args.oracle_python).exists():
        vllm_note = f"no oracle venv at {args.oracle_python}"
    elif not (ORACLE_DIR / "vllm_oracle.py").exists():
        vllm_note = f"no vllm_oracle.py in {ORACLE_DIR} (VLLM_ORACLE_DIR)"
    if vllm_note and "vllm" in sides:
        sides.remove("vllm")
        print(f"vLLM column absent ({vllm_note})", file=sys.stderr)
    if variant != "compiled" and "pure" in sides:
        sides.remove("pure")  # the core side is the pure one
    runs = []
    for kind in configs:
        for side in sides:
            t = time.perf_counter()
            if side == "vllm":
                r = run_oracle(args, kind)
            elif side == "pure":
                r = run_pure(args, kind)
            else:
                r = run_bench(side, kind, args)
            if r is not None:
                runs.append(r)
                print(f"  {kind}/{side}: {r['results']['manager_ops_per_s']:,.0f} manager ops/s "
                      f"({time.perf_counter() - t:.1f} s)", file=sys.stderr)
    profile = {}
    if args.profile:
        for kind in configs:
            prof = cProfile.Profile()
            run_bench("core", kind, args, profiler=prof)
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
            profile[kind] = buf.getvalue()
            print(f"\ncProfile of our core, config {kind} (top 25 by own time):")
            print("\n".join(buf.getvalue().splitlines()[:45]))
    construction = measure_construction(args) if args.pool_blocks else []
    summary = report(runs, construction, variant, vllm_note)
    others = {}
    if args.baseline_tree is not None:
        tree = args.baseline_tree.resolve()
        others["baseline tree"] = run_other(args, tree / "bench" / "bench_core.py",
                                            {"PYTHONPATH": str(tree)}, tree)
    if args.vs_pure:
        others["pure Python"] = run_other(args, HERE / "bench_core.py",
                                          {"KVCACHE_CORE": "pure"}, None)
    if others:
        summary["compared"] = compare(runs, others)
    path = write_results("core", {"args": argd,
                                  "summary": summary, "runs": runs,
                                  "construction": construction, "profile": profile},
                         args.out, plot=plot(summary))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
