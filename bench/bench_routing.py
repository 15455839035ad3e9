#!/usr/bin/env python3
"""Routing-view benchmark: PeekPrefix over 1, 16 and 256 pools, and the cost of miss
reasons on the Step hot path.

PeekPrefix. A fleet of N pools (N = 1, 16, 256) of one model, sha256_cbor hashes, block
size 16, 4,096 blocks each, filled like a serving fleet: every pool holds a shared 128-block
system prompt and two of its own 256-block conversations; pool 0 holds the first 1,600
blocks of the asked conversation and every 8th pool its first 600 (a shared document). The
prompt has 2,000 blocks (32,001 tokens). Timed server-side, in this process:
``CacheServicer.peek_prefix`` on the serialized request (parse, validate, answer, serialize
the response), with the client's block hashes (the router's path: no hashing on the server)
and with token ids (the server hashes the prompt once per key space). ``per-pool loop`` is
what PeekPrefix did before the index: each pool's own lookup, one after the other. Two
models: ``full`` (one full-attention group) and ``hybrid`` (full + sliding window 1,024).

Step hot path. One pool (full + sliding window), 64 running requests decoding and 4 new
512-token requests admitted per step (add, lookup, allocate; the 4 oldest freed), small
enough that admissions evict. The same steps three ways, interleaved: ``no observer`` (the
pool's prefix-cache map followed by nobody: no index, no eviction record: the cost before
this feature), ``explain off`` (the default), ``explain on`` (every lookup op explains).

    python3 bench/bench_routing.py            # about a minute
    python3 bench/bench_routing.py --quick    # fewer samples, no hybrid 256

Prints tables and writes bench/results/routing.json (with the ratios).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import print_table, ratio, summarize_ns, write_results
from cache_service import convert
from cache_service.client import StepBuilder, layers, register_request
from cache_service.core.hashing import hash_request_tokens, sha256_cbor
from cache_service.registry import PoolRegistry
from cache_service.servicer import CacheServicer
from cache_service.state import ServiceState
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb

BS = 16
PROMPT_BLOCKS = 2000
SYSTEM_BLOCKS = 128
OWN_BLOCKS = 256
POOL_BLOCKS = 8192
MAX_MODEL_LEN = 33000


def model(kind: str) -> list:
    """The fleet's model: full attention, plus sliding window for ``hybrid``."""
    full = [layers.full_attention("full", block_size=BS, num_kv_heads=8, head_size=128)]
    if kind == "full":
        return full
    return full + [layers.sliding_window("swa", block_size=BS, num_kv_heads=8,
                                         head_size=128, sliding_window=1024)]


def tokens(rng: random.Random, n_blocks: int) -> list[int]:
    """``n_blocks`` blocks of random tokens."""
    return [rng.randrange(32000) for _ in range(n_blocks * BS)]


class Fleet:
    """N pools in one registry, filled through the pools (as admissions would)."""

    def __init__(self, n: int, kind: str, seed: int = 1) -> None:
        rng = random.Random(seed)
        self.registry = PoolRegistry()
        self.servicer = CacheServicer(ServiceState(self.registry))
        system = tokens(rng, SYSTEM_BLOCKS)
        self.prompt = system + tokens(rng, PROMPT_BLOCKS - SYSTEM_BLOCKS) + [1]
        self.hashes = hash_request_tokens(sha256_cbor, self.prompt, BS)
        system_hashes = self.hashes[:SYSTEM_BLOCKS]
        self.pool_ids = [f"{kind}-{i}" for i in range(n)]
        for i, pool_id in enumerate(self.pool_ids):
            entry, _ = self.registry.register(pool_id, convert.description_from_proto(
                register_request(pool_id, model(kind), num_blocks=POOL_BLOCKS,
                                 max_model_len=MAX_MODEL_LEN, hash_algo="sha256_cbor")))
            served = []
            for _ in range(2):
                toks = system + tokens(rng, OWN_BLOCKS) + [2]
                # The system prompt is hashed once; each conversation chains from it.
                served.append((toks, system_hashes + hash_request_tokens(
                    sha256_cbor, toks, BS, parent=system_hashes[-1],
                    start_block=SYSTEM_BLOCKS)))
            if i == 0:
                served.append((self.prompt[:1600 * BS] + [3], self.hashes[:1600]))
            elif i % 8 == 0:
                served.append((self.prompt[:600 * BS] + [3], self.hashes[:600]))
            for j, (t, h) in enumerate(served):
                self._serve(entry.pool, f"c{j}", t, h)

    @staticmethod
    def _serve(pool, rid: str, toks: list[int], hashes: list[bytes]) -> None:
        # Client hashes: the fill hashes each conversation once, not once per pool.
        pool.add_request(rid, toks, block_hashes=hashes)
        hit = pool.lookup(rid).hit_tokens
        assert pool.allocate(rid, len(toks) - hit).ok
        pool.free(rid)

    def request(self, *, by_hashes: bool) -> bytes:
        """The serialized PeekPrefixRequest of the prompt over every pool (by block hashes, or
        by tokens)."""
        if by_hashes:
            req = pb.PeekPrefixRequest(pool_ids=self.pool_ids, block_hashes=self.hashes)
        else:
            req = pb.PeekPrefixRequest(pool_ids=self.pool_ids, token_ids=self.prompt)
        return req.SerializeToString()

    def time_peek(self, data: bytes, samples: int) -> tuple[list[int], list[int]]:
        """(wall, CPU) ns per call."""
        wall, cpu = [], []
        peek = self.servicer.peek_prefix
        for _ in range(samples + 3):
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            peek(pb.PeekPrefixRequest.FromString(data)).SerializeToString()
            wall.append(time.perf_counter_ns() - t0)
            cpu.append(time.thread_time_ns() - c0)
        return wall[3:], cpu[3:]

    def time_loop(self, samples: int) -> list[int]:
        """Each pool's own lookup in turn (the PeekPrefix of before the index)."""
        pools = [self.registry.get(p).pool for p in self.pool_ids]
        out = []
        for _ in range(samples):
            t0 = time.perf_counter_ns()
            for pool in pools:
                pool.peek_prefix(block_hashes=self.hashes)
            out.append(time.perf_counter_ns() - t0)
        return out

    def check(self) -> list[int]:
        """The index's hits equal the per-pool lookups' (and are the designed ones)."""
        resp = self.servicer.peek_prefix(pb.PeekPrefixRequest.FromString(
            self.request(by_hashes=True)))
        hits = [h.hit_tokens for h in resp.hits]
        pools = [self.registry.get(p).pool for p in self.pool_ids]
        assert hits == [p.peek_prefix(block_hashes=self.hashes) for p in pools]
        return hits


def bench_peek(args) -> tuple[list, dict]:
    """PeekPrefix per fleet size and kind (by tokens and by hashes, index and per-pool loop):
    rows and results."""
    rows, results = [], {}
    kinds = [("full", (1, 16, 256)), ("hybrid", (1, 16) if args.quick else (1, 16, 256))]
    for kind, sizes in kinds:
        for n in sizes:
            t0 = time.perf_counter()
            fleet = Fleet(n, kind)
            fill_s = time.perf_counter() - t0
            hits = fleet.check()
            wall, cpu = fleet.time_peek(fleet.request(by_hashes=True), args.samples)
            by_hash, by_hash_cpu = summarize_ns(wall), summarize_ns(cpu)
            wall, cpu = fleet.time_peek(fleet.request(by_hashes=False),
                                        max(5, args.samples // 10))
            by_tok, by_tok_cpu = summarize_ns(wall), summarize_ns(cpu)
            loop = summarize_ns(fleet.time_loop(3 if n > 16 else 10))
            key = f"{kind}_{n}"
            results[key] = {"pools": n, "hits_tokens_max": max(hits),
                            "pools_with_hit": sum(h > 0 for h in hits), "fill_s": round(fill_s, 1),
                            "hashes": by_hash, "hashes_cpu": by_hash_cpu, "tokens": by_tok,
                            "tokens_cpu": by_tok_cpu, "per_pool_loop": loop}
            rows.append([f"{kind}, {n} pools", by_hash_cpu["p50_us"], by_hash_cpu["p99_us"],
                         by_hash["p50_us"], by_hash["p99_us"], by_tok_cpu["p50_us"],
                         loop["p50_us"], ratio(loop["p50_us"], by_hash["p50_us"])])
    for kind in ("full", "hybrid"):
        one, many = results.get(f"{kind}_1"), results.get(f"{kind}_256")
        if one and many:
            results[f"{kind}_ratio_256_over_1"] = {
                f"{mode}_{p}": round(many[mode][f"{p}_us"] / one[mode][f"{p}_us"], 2)
                for mode in ("hashes_cpu", "hashes", "tokens_cpu") for p in ("p50", "p99")}
    return rows, results


# -- Step hot path -----------------------------------------------------------------------

RUNNING = 64
ADMIT = 4
PROMPT = 512


class StepLoad:
    """One pool under steady decode + admissions, its Step requests pre-serialized."""

    def __init__(self, mode: str, steps: int) -> None:
        self.mode = mode
        self.registry = PoolRegistry()
        self.servicer = CacheServicer(ServiceState(self.registry))
        entry, _ = self.registry.register("p", convert.description_from_proto(
            register_request("p", model("hybrid"), num_blocks=6000, max_model_len=4096)))
        if mode == "no observer":
            entry.pool.manager.pool.observer = None
            self.registry.index.detach("p")
        rng = random.Random(3)
        shared = [tokens(rng, 16) for _ in range(4)]  # 4 system prompts of 256 tokens
        self.requests = []
        live: list[str] = []
        first = StepBuilder("p", begin_step=True)
        for i in range(RUNNING):
            rid = f"r{i}"
            first.add(rid, rng.choice(shared) + tokens(rng, 16)).lookup(rid).allocate(rid, PROMPT)
            live.append(rid)
        self.servicer.step(first.request)
        nxt = RUNNING
        for s in range(steps):
            batch = StepBuilder("p", begin_step=True)
            for rid in live[:ADMIT]:
                batch.free(rid)
            live = live[ADMIT:]
            batch.decode(list(live), [s % 32000] * len(live))
            for _ in range(ADMIT):
                rid = f"r{nxt}"
                nxt += 1
                batch.add(rid, rng.choice(shared) + tokens(rng, 16))
                batch.lookup(rid, explain=mode == "explain on").allocate(rid, PROMPT)
                live.append(rid)
            self.requests.append(batch.request.SerializeToString())
        self._next = 0

    def step(self) -> int:
        """CPU ns of one Step (the handler thread's: immune to other processes' load)."""
        data = self.requests[self._next]
        self._next += 1
        t0 = time.thread_time_ns()
        resp = self.servicer.step(pb.StepRequest.FromString(data))
        resp.SerializeToString()
        elapsed = time.thread_time_ns() - t0
        assert all(r.allocate.ok for r in resp.results if r.WhichOneof("result") == "allocate")
        return elapsed


def bench_step(args) -> tuple[list, dict]:
    """Step cost with no observer, with explain off and on, interleaved: rows and results."""
    modes = ["no observer", "explain off", "explain on"]
    steps = args.steps
    loads = {m: StepLoad(m, steps) for m in modes}
    samples: dict[str, list[int]] = {m: [] for m in modes}
    for s in range(steps):  # interleaved, so that machine noise hits every mode alike
        for m in modes:
            t = loads[m].step()
            if s >= 5:
                samples[m].append(t)
    evictions = loads["explain off"].registry.get("p").pool.stats().evictions
    stats = {m: summarize_ns(v) for m, v in samples.items()}
    base = stats["no observer"]["p50_us"]
    rows = [[m, stats[m]["p50_us"], stats[m]["p99_us"], stats[m]["mean_us"],
             ratio(stats[m]["p50_us"], base)] for m in modes]
    results = {"steps": steps, "running": RUNNING, "admitted_per_step": ADMIT,
               "evictions": evictions, **{m.replace(" ", "_"): stats[m] for m in modes},
               "explain_off_over_no_observer_p50": round(stats["explain off"]["p50_us"] / base, 3),
               "explain_on_over_explain_off_p50": round(
                   stats["explain on"]["p50_us"] / stats["explain off"]["p50_us"], 3)}
    return rows, results


def main() -> None:
    """Runs both parts, prints the tables and writes the JSON results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=100, help="PeekPrefix samples per row")
    parser.add_argument("--steps", type=int, default=200, help="Step samples per mode")
    parser.add_argument("--quick", action="store_true", help="fewer samples, no hybrid 256")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.steps = 50, 60
    t0 = time.perf_counter()
    peek_rows, peek = bench_peek(args)
    print_table(f"PeekPrefix, {PROMPT_BLOCKS}-block prompt, server-side (us; CPU = the "
                "handler thread's CPU time, wall = elapsed)",
                ["fleet", "hashes CPU p50", "hashes CPU p99", "hashes wall p50",
                 "hashes wall p99", "tokens CPU p50", "per-pool loop wall p50",
                 "loop / index (wall)"], peek_rows)
    for kind in ("full", "hybrid"):
        r = peek.get(f"{kind}_ratio_256_over_1")
        if r:
            print(f"{kind}: 256 pools / 1 pool: hashes CPU p50 {r['hashes_cpu_p50']}x, "
                  f"p99 {r['hashes_cpu_p99']}x; wall p50 {r['hashes_p50']}x; "
                  f"tokens CPU p50 {r['tokens_cpu_p50']}x")
    print(f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    step_rows, step = bench_step(args)
    print_table(f"Step hot path ({RUNNING} decoding + {ADMIT} admitted per step), "
                "server-side CPU (us)", ["mode", "p50", "p99", "mean", "vs no observer"], step_rows)
    out = write_results("routing", {"peek_prefix": peek, "step": step,
                                    "load_average": os.getloadavg()[0],
                                    "wall_s": round(time.perf_counter() - t0, 1)})
    print(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
