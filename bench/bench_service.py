#!/usr/bin/env python3
"""Service benchmark: a batched decode Step through gRPC vs the same work on the in-process
Pool.

Workload per pool: a hybrid model (1 full-attention + 1 sliding-window layer, window 1,024,
block size 16); N running requests with 512-token prompts; every step is one Step carrying,
per request, one decoded token appended + ``allocate(1)`` (one ``allocate`` op with
``append_token_ids``) — the engine loop's steady state. Sides:

* ``service``: a real server subprocess (``python -m cache_service``); the client builds the
  batch in place (``StepBuilder``), sends it, and reads ``ok`` of every allocation. Timed
  per step (round trip, client work included) for N = 8, 64, 256; with the whole block
  table in every result (the default) and with ``block_table=False``; also over StepStream.
* ``core``: the same ops on ``cache_service.core.pool.Pool`` in this process.
* ``servicer, no gRPC``: ``CacheServicer.step`` in this process on serialized requests
  (validation + apply + response), to separate the servicer's cost from the transport's.
* ``8 clients``: 8 concurrent asyncio clients, one pool each, N = 64; aggregate ops/s.

ops/s counts scheduler operations: 2 per request per step (append + allocate), on both sides. The ratio compares service ops/s to the
in-process core's (same N, same run).

    python3 bench/bench_service.py                 # about a minute
    python3 bench/bench_service.py --steps 50      # quicker

Prints a table and writes bench/results/service.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import print_table, ratio, summarize_ns, write_results  # noqa: E402

from cache_service import convert  # noqa: E402
from cache_service.client import (  # noqa: E402
    AsyncCacheClient,
    CacheClient,
    StepBuilder,
    layers,
    register_request,
)
from cache_service.api.kvcache.v1.cache_service_pb2 import StepRequest  # noqa: E402
from cache_service.pools import PoolRegistry, build_pool  # noqa: E402
from cache_service.servicer import CacheServicer  # noqa: E402

PROMPT = 512
MAX_MODEL_LEN = 4096


def model() -> list:
    return [layers.full_attention("full", block_size=16, num_kv_heads=8, head_size=128),
            layers.sliding_window("swa", block_size=16, num_kv_heads=8, head_size=128,
                                  sliding_window=1024)]


def pool_kwargs(n: int, steps: int) -> dict:
    per_request = 2 * ((PROMPT + steps + 64) // 16 + 2)  # both groups, with headroom
    return dict(num_blocks=max(2048, n * per_request + 64), max_model_len=MAX_MODEL_LEN)


def prompt(i: int) -> list[int]:
    return [(i * 7919 + t) % 32000 for t in range(PROMPT)]


def start_server() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "cache_service", "--port", "0",
                             "--metrics-port", "-1", "--log-level", "warning"],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    for line in proc.stdout:
        record = json.loads(line)
        if record.get("event") == "serving":
            return proc, f"127.0.0.1:{record['port']}"
    raise RuntimeError("server exited before serving")


def admit(client: CacheClient, pool_id: str, n: int) -> None:
    for start in range(0, n, 64):
        batch = StepBuilder(pool_id, begin_step=True)
        for i in range(start, min(n, start + 64)):
            batch.add(f"r{i}", prompt(i)).lookup(f"r{i}").allocate(f"r{i}", PROMPT)
        client.step_batch(batch)


def decode_batch(pool_id: str, n: int, step: int, tables: bool) -> StepBuilder:
    batch = StepBuilder(pool_id, begin_step=True)
    token = [step % 32000]
    for i in range(n):
        batch.allocate(f"r{i}", 1, block_table=tables, append_token_ids=token)
    return batch


def all_ok(result) -> bool:
    return all(r.ok for r in result.results)


def bench_service(client: CacheClient, n: int, steps: int, warmup: int, *, tables: bool,
                  tag: str) -> list[int]:
    pool_id = f"bench-{tag}-{n}"
    client.register_pool(pool_id, model(), **pool_kwargs(n, steps + warmup))
    admit(client, pool_id, n)
    samples = []
    for step in range(warmup + steps):
        t0 = time.perf_counter_ns()
        result = client.step_batch(decode_batch(pool_id, n, step, tables))
        ok = all_ok(result)
        if tables:
            result.results[-1].block_ids  # a scheduler reads the tables it sends on
        elapsed = time.perf_counter_ns() - t0
        assert ok, "a decode allocation found no room; enlarge the pool"
        if step >= warmup:
            samples.append(elapsed)
    client.delete_pool(pool_id)
    return samples


def bench_stream(client: CacheClient, n: int, steps: int, warmup: int) -> list[int]:
    pool_id = f"bench-stream-{n}"
    client.register_pool(pool_id, model(), **pool_kwargs(n, steps + warmup))
    admit(client, pool_id, n)
    samples = []
    with client.step_stream() as stream:
        for step in range(warmup + steps):
            t0 = time.perf_counter_ns()
            req = decode_batch(pool_id, n, step, True).request
            result = stream.step(req.pool_id, req.ops, begin_step=True)
            ok = all_ok(result)
            elapsed = time.perf_counter_ns() - t0
            assert ok
            if step >= warmup:
                samples.append(elapsed)
    client.delete_pool(pool_id)
    return samples


def bench_core(n: int, steps: int, warmup: int) -> list[int]:
    pool = build_pool(convert.description_from_proto(
        register_request("core", model(), **pool_kwargs(n, steps + warmup))))
    for i in range(n):
        pool.add_request(f"r{i}", prompt(i))
        pool.lookup(f"r{i}")
        pool.allocate(f"r{i}", PROMPT)
    samples = []
    rids = [f"r{i}" for i in range(n)]
    for step in range(warmup + steps):
        token = [step % 32000]
        t0 = time.perf_counter_ns()
        pool.new_step()
        ok = True
        for rid in rids:
            pool.append_tokens(rid, token)
            ok &= pool.allocate(rid, 1).ok
        elapsed = time.perf_counter_ns() - t0
        pool.take_events()  # the service drains events every step too
        assert ok
        if step >= warmup:
            samples.append(elapsed)
    return samples


def bench_servicer(n: int, steps: int, warmup: int) -> list[int]:
    """The servicer's Step in this process, without gRPC: parse, validate, apply, build and
    serialize the response (block tables included). Separates the servicer's own cost from
    the transport's."""
    registry = PoolRegistry()
    servicer = CacheServicer(registry)
    registry.register("s", convert.description_from_proto(
        register_request("s", model(), **pool_kwargs(n, steps + warmup))))
    admit_batch = StepBuilder("s", begin_step=True)
    for i in range(n):
        admit_batch.add(f"r{i}", prompt(i)).lookup(f"r{i}").allocate(f"r{i}", PROMPT)
    servicer.step(admit_batch.request)
    samples = []
    for step in range(warmup + steps):
        data = decode_batch("s", n, step, True).request.SerializeToString()
        t0 = time.perf_counter_ns()
        servicer.step(StepRequest.FromString(data)).SerializeToString()
        elapsed = time.perf_counter_ns() - t0
        if step >= warmup:
            samples.append(elapsed)
    return samples


async def bench_concurrent(target: str, clients: int, n: int, steps: int) -> float:
    """Aggregate scheduler ops/s of ``clients`` concurrent clients (one pool each)."""
    setup = CacheClient(target)
    for c in range(clients):
        pool_id = f"bench-conc-{c}"
        setup.register_pool(pool_id, model(), **pool_kwargs(n, steps + 5))
        admit(setup, pool_id, n)

    async def run(c: int) -> None:
        async with AsyncCacheClient(target, default_timeout=60) as client:
            for step in range(steps):
                result = await client.step_batch(decode_batch(f"bench-conc-{c}", n, step, True))
                assert all_ok(result)

    t0 = time.perf_counter()
    await asyncio.gather(*[run(c) for c in range(clients)])
    elapsed = time.perf_counter() - t0
    for c in range(clients):
        setup.delete_pool(f"bench-conc-{c}")
    setup.close()
    return clients * steps * 2 * n / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="measured steps per case")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--sizes", default="8,64,256", help="running requests per Step")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, help="JSON path")
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]

    proc, target = start_server()
    rows = []
    results: dict = {"workload": {"prompt_tokens": PROMPT, "ops_per_request_per_step": 2,
                                  "model": "1 full + 1 sliding-window (1024) layer, bs 16"},
                     "cases": []}
    try:
        with CacheClient(target, default_timeout=60) as client:
            for n in sizes:
                core = summarize_ns(bench_core(n, args.steps, args.warmup))
                local = summarize_ns(bench_servicer(n, args.steps, args.warmup))
                full = summarize_ns(bench_service(client, n, args.steps, args.warmup,
                                                  tables=True, tag="t"))
                lean = summarize_ns(bench_service(client, n, args.steps, args.warmup,
                                                  tables=False, tag="n"))
                stream = summarize_ns(bench_stream(client, n, args.steps, args.warmup))
                ops = 2 * n
                case = {"running_requests": n, "core": core, "servicer_in_process": local,
                        "service_tables": full, "service_no_tables": lean,
                        "stream_tables": stream}
                for key in ("core", "servicer_in_process", "service_tables",
                            "service_no_tables", "stream_tables"):
                    case[key]["ops_per_s"] = round(ops / (case[key]["p50_us"] / 1e6))
                results["cases"].append(case)
                core_ops = case["core"]["ops_per_s"]
                for key, label in (("core", "in-process Pool"),
                                   ("servicer_in_process", "servicer, no gRPC (tables)"),
                                   ("service_tables", "Step (block tables)"),
                                   ("service_no_tables", "Step (no tables)"),
                                   ("stream_tables", "StepStream (block tables)")):
                    c = case[key]
                    rows.append([f"{n} req: {label}", c["p50_us"] / 1e3, c["p99_us"] / 1e3,
                                 c["ops_per_s"], ratio(c["ops_per_s"], core_ops)])
        conc_n = 64
        conc = asyncio.run(bench_concurrent(target, args.clients, conc_n, args.steps // 2))
        core64 = next((c["core"]["ops_per_s"] for c in results["cases"]
                       if c["running_requests"] == conc_n), None)
        results["concurrent"] = {"clients": args.clients, "running_requests": conc_n,
                                 "ops_per_s": round(conc), "core_ops_per_s": core64}
        rows.append([f"{args.clients} clients x {conc_n} req: Step (block tables)", None, None,
                     round(conc), ratio(conc, core64)])
    finally:
        proc.terminate()
        proc.wait(30)
    print_table("Batched decode Step (append + allocate per request): service vs in-process "
                "core", ["case", "p50 ms", "p99 ms", "ops/s", "vs core"], rows)
    out = write_results("service", results, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
