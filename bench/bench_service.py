#!/usr/bin/env python3
"""Service benchmark: a batched decode Step through gRPC vs the same work on the in-process
Pool.

Workload per pool: a hybrid model (1 full-attention + 1 sliding-window layer, window 1,024,
block size 16); N running requests with 512-token prompts; every step is one Step carrying,
per request, one decoded token appended + ``allocate(1)`` — the engine loop's steady state.
Two encodings of that Step, side by side:

* generic: one ``allocate`` op with ``append_token_ids`` per request (one sub-message per
  request each way);
* decode: ONE ``decode`` op (request ids + one token each, packed; the answer is packed
  ok flags plus the few new blocks), applied by ``Pool.decode``.

Sides:

* ``service``: a real server subprocess (``python -m cache_service``); the client builds the
  batch in place (``StepBuilder``), sends it, and reads ``ok`` of every allocation. Timed
  per step (round trip, client work included) for N = 8, 64, 256: generic with the whole
  block table in every result (the default) and with ``block_table=False``, and decode;
  also over StepStream.
* ``core``: the same work on ``cache_service.core.pool.Pool`` in this process: the
  ``append_tokens`` + ``allocate`` loop, and ``Pool.decode``.
* ``servicer, no gRPC``: ``CacheServicer.step`` in this process on serialized requests
  (validation + apply + response), to separate the servicer's cost from the transport's.
* ``8 clients``: 8 concurrent asyncio clients, one pool each, N = 64; aggregate ops/s.

ops/s counts scheduler operations: 2 per request per step (append + allocate), on both
sides. The ratios compare ops/s to the in-process core's (same N, same run): to its
append+allocate loop and to ``Pool.decode``.

    python3 bench/bench_service.py                 # about a minute
    python3 bench/bench_service.py --steps 50      # quicker

Prints a table and writes bench/results/service.json.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import print_table, ratio, summarize_ns, write_results  # noqa: E402

from cache_service import convert  # noqa: E402
from kvcache_common.launch import start_cache_service  # noqa: E402
from cache_service.client import (  # noqa: E402
    AsyncCacheClient,
    CacheClient,
    DecodeResult,
    StepBuilder,
    layers,
    register_request,
)
from kvcache_common.api.kvcache.v1.cache_service_pb2 import StepRequest  # noqa: E402
from cache_service.registry import PoolRegistry, build_pool  # noqa: E402
from cache_service.servicer import CacheServicer  # noqa: E402
from cache_service.state import ServiceState  # noqa: E402

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


def admit(client: CacheClient, pool_id: str, n: int) -> None:
    for start in range(0, n, 64):
        batch = StepBuilder(pool_id, begin_step=True)
        for i in range(start, min(n, start + 64)):
            batch.add(f"r{i}", prompt(i)).lookup(f"r{i}").allocate(f"r{i}", PROMPT)
        client.step_batch(batch)


#: Step encodings: generic ops with whole tables, generic without tables, one decode op.
TABLES, NO_TABLES, DECODE = "tables", "no_tables", "decode"


def request_ids(n: int) -> list[str]:
    return [f"r{i}" for i in range(n)]


def decode_batch(pool_id: str, n: int, step: int, mode: str) -> StepBuilder:
    batch = StepBuilder(pool_id, begin_step=True)
    token = [step % 32000]
    if mode == DECODE:
        return batch.decode(request_ids(n), token * n)
    for i in range(n):
        batch.allocate(f"r{i}", 1, block_table=mode == TABLES, append_token_ids=token)
    return batch


def all_ok(result) -> bool:
    return all(r.all_ok if isinstance(r, DecodeResult) else r.ok for r in result.results)


def bench_service(client: CacheClient, n: int, steps: int, warmup: int, *,
                  mode: str) -> list[int]:
    pool_id = f"bench-{mode}-{n}"
    client.register_pool(pool_id, model(), **pool_kwargs(n, steps + warmup))
    admit(client, pool_id, n)
    samples = []
    for step in range(warmup + steps):
        t0 = time.perf_counter_ns()
        result = client.step_batch(decode_batch(pool_id, n, step, mode))
        ok = all_ok(result)
        if mode == TABLES:
            result.results[-1].block_ids  # a scheduler reads the tables it sends on
        elif mode == DECODE:
            result.results[0].new_block_ids  # ... or the new blocks
        elapsed = time.perf_counter_ns() - t0
        assert ok, "a decode allocation found no room; enlarge the pool"
        if step >= warmup:
            samples.append(elapsed)
    client.delete_pool(pool_id)
    return samples


def bench_stream(client: CacheClient, n: int, steps: int, warmup: int, *,
                 mode: str) -> list[int]:
    pool_id = f"bench-stream-{mode}-{n}"
    client.register_pool(pool_id, model(), **pool_kwargs(n, steps + warmup))
    admit(client, pool_id, n)
    samples = []
    with client.step_stream() as stream:
        for step in range(warmup + steps):
            t0 = time.perf_counter_ns()
            req = decode_batch(pool_id, n, step, mode).request
            result = stream.step(req.pool_id, req.ops, begin_step=True)
            ok = all_ok(result)
            elapsed = time.perf_counter_ns() - t0
            assert ok
            if step >= warmup:
                samples.append(elapsed)
    client.delete_pool(pool_id)
    return samples


def bench_core(n: int, steps: int, warmup: int, *, decode: bool = False) -> list[int]:
    pool = build_pool(convert.description_from_proto(
        register_request("core", model(), **pool_kwargs(n, steps + warmup))))
    for i in range(n):
        pool.add_request(f"r{i}", prompt(i))
        pool.lookup(f"r{i}")
        pool.allocate(f"r{i}", PROMPT)
    samples = []
    rids = request_ids(n)
    for step in range(warmup + steps):
        token = [step % 32000]
        t0 = time.perf_counter_ns()
        pool.new_step()
        if decode:
            ok = all(pool.decode(rids, token * n).ok)
        else:
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


def bench_servicer(n: int, steps: int, warmup: int, *, mode: str) -> list[int]:
    """The servicer's Step in this process, without gRPC: parse, validate, apply, build and
    serialize the response. Separates the servicer's own cost from the transport's."""
    registry = PoolRegistry()
    servicer = CacheServicer(ServiceState(registry))
    registry.register("s", convert.description_from_proto(
        register_request("s", model(), **pool_kwargs(n, steps + warmup))))
    admit_batch = StepBuilder("s", begin_step=True)
    for i in range(n):
        admit_batch.add(f"r{i}", prompt(i)).lookup(f"r{i}").allocate(f"r{i}", PROMPT)
    servicer.step(admit_batch.request)
    samples = []
    for step in range(warmup + steps):
        data = decode_batch("s", n, step, mode).request.SerializeToString()
        t0 = time.perf_counter_ns()
        servicer.step(StepRequest.FromString(data)).SerializeToString()
        elapsed = time.perf_counter_ns() - t0
        if step >= warmup:
            samples.append(elapsed)
    return samples


async def bench_concurrent(target: str, clients: int, n: int, steps: int, mode: str) -> float:
    """Aggregate scheduler ops/s of ``clients`` concurrent clients (one pool each)."""
    setup = CacheClient(target)
    for c in range(clients):
        pool_id = f"bench-conc-{c}"
        setup.register_pool(pool_id, model(), **pool_kwargs(n, steps + 5))
        admit(setup, pool_id, n)

    async def run(c: int) -> None:
        async with AsyncCacheClient(target, default_timeout=60) as client:
            for step in range(steps):
                result = await client.step_batch(decode_batch(f"bench-conc-{c}", n, step,
                                                              mode))
                assert all_ok(result)

    t0 = time.perf_counter()
    await asyncio.gather(*[run(c) for c in range(clients)])
    elapsed = time.perf_counter() - t0
    for c in range(clients):
        setup.delete_pool(f"bench-conc-{c}")
    setup.close()
    return clients * steps * 2 * n / elapsed


#: (result key, row label) of every per-size case, in table order.
CASES = (("core", "in-process Pool, append+allocate loop"),
         ("core_decode", "in-process Pool.decode"),
         ("servicer_in_process", "servicer, no gRPC, generic (tables)"),
         ("servicer_decode", "servicer, no gRPC, decode op"),
         ("service_tables", "Step generic (block tables)"),
         ("service_no_tables", "Step generic (no tables)"),
         ("service_decode", "Step decode op"),
         ("stream_tables", "StepStream generic (block tables)"),
         ("stream_decode", "StepStream decode op"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="measured steps per case")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--sizes", default="8,64,256", help="running requests per Step")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, help="JSON path")
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]

    server = start_cache_service("--log-level", "warning")
    target = server.target
    rows = []
    results: dict = {"workload": {"prompt_tokens": PROMPT, "ops_per_request_per_step": 2,
                                  "model": "1 full + 1 sliding-window (1024) layer, bs 16"},
                     "cases": []}
    try:
        with CacheClient(target, default_timeout=60) as client:
            for n in sizes:
                case = {
                    "running_requests": n,
                    "core": bench_core(n, args.steps, args.warmup),
                    "core_decode": bench_core(n, args.steps, args.warmup, decode=True),
                    "servicer_in_process": bench_servicer(n, args.steps, args.warmup,
                                                          mode=TABLES),
                    "servicer_decode": bench_servicer(n, args.steps, args.warmup, mode=DECODE),
                    "service_tables": bench_service(client, n, args.steps, args.warmup,
                                                    mode=TABLES),
                    "service_no_tables": bench_service(client, n, args.steps, args.warmup,
                                                       mode=NO_TABLES),
                    "service_decode": bench_service(client, n, args.steps, args.warmup,
                                                    mode=DECODE),
                    "stream_tables": bench_stream(client, n, args.steps, args.warmup,
                                                  mode=TABLES),
                    "stream_decode": bench_stream(client, n, args.steps, args.warmup,
                                                  mode=DECODE),
                }
                ops = 2 * n
                for key, _ in CASES:
                    case[key] = c = summarize_ns(case[key])
                    c["ops_per_s"] = round(ops / (c["p50_us"] / 1e6))
                for key, label in CASES:
                    c = case[key]
                    rows.append([f"{n} req: {label}", c["p50_us"] / 1e3, c["p99_us"] / 1e3,
                                 c["ops_per_s"], ratio(c["ops_per_s"], case["core"]["ops_per_s"]),
                                 ratio(c["ops_per_s"], case["core_decode"]["ops_per_s"])])
                results["cases"].append(case)
        conc_n = 64
        case64 = next((c for c in results["cases"] if c["running_requests"] == conc_n), None)
        core64 = case64 and case64["core"]["ops_per_s"]
        decode64 = case64 and case64["core_decode"]["ops_per_s"]
        results["concurrent"] = []
        for mode, label in ((TABLES, "generic ops (block tables)"), (DECODE, "decode op")):
            for clients in sorted({1, args.clients}):
                conc = asyncio.run(bench_concurrent(target, clients, conc_n, args.steps // 2,
                                                    mode))
                results["concurrent"].append({"mode": mode, "clients": clients,
                                              "running_requests": conc_n,
                                              "ops_per_s": round(conc),
                                              "core_ops_per_s": core64})
                rows.append([f"{clients} client(s) x {conc_n} req: {label}", None, None,
                             round(conc), ratio(conc, core64), ratio(conc, decode64)])
    finally:
        server.stop()
    print_table("Batched decode Step (append + allocate per request): service vs in-process "
                "core (ops/s at p50 / the in-process loop's, and / Pool.decode's)",
                ["case", "p50 ms", "p99 ms", "ops/s", "vs core loop", "vs Pool.decode"], rows)
    out = write_results("service", results, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
