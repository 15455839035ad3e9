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
* ``echo floor``: what the transport alone costs. A bare grpc.aio server (its own process,
  one generic handler, no interceptor, no parsing) answers every call with a payload of
  the serialized size of the decode Step's response; the client sends a payload of the
  request's size, over a blocking channel set up as the cache client's, unary and over a
  stream driven as the client's ``StepStream`` (a queue and a reader thread). The decode
  Step and StepStream and the two echoes run in interleaved rounds (machine noise hits
  them alike), and the table adds each one's p50 over its echo's (``vs echo``) and the
  CPU time the server process spent per call (all its threads; load inflates it much
  less than wall time).
  ``--baseline-tree DIR`` adds a second server started from another checkout (e.g. main)
  to the same rounds: before/after in one run. ``--vs-pure``: that second server is this
  checkout with ``KVCACHE_CORE=pure``, against this side's build of the core (compiled
  when built: ``python -m cache_service.core.build``).

ops/s counts scheduler operations: 2 per request per step (append + allocate), on both
sides. The ratios compare ops/s to the in-process core's (same N, same run): to its
append+allocate loop and to ``Pool.decode``.

    python3 bench/bench_service.py                 # about a minute
    python3 bench/bench_service.py --steps 50      # quicker
    python3 bench/bench_service.py --sizes 256 --clients 1 --baseline-tree ../main
    python3 bench/bench_service.py --sizes 256 --clients 1 --vs-pure  # compiled vs pure core

Prints a table and writes bench/results/service.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc

from _common import Bars, Cdf, Panel, print_table, ratio, summarize_ns, write_results
from cache_service import convert
from cache_service.client import (
    AllocateResult,
    AsyncCacheClient,
    CacheClient,
    DecodeResult,
    StepBuilder,
    layers,
    register_request,
)
from cache_service.client._channel import CHANNEL_OPTIONS
from cache_service.registry import PoolRegistry, build_pool
from cache_service.servicer import CacheServicer
from cache_service.state import ServiceState
from kvcache_common.api.kvcache.v1.cache_service_pb2 import StepRequest
from kvcache_common.launch import ServerProcess, start_cache_service, start_process

PROMPT = 512
MAX_MODEL_LEN = 4096


def model() -> list:
    """The benchmark's model: full attention and a 1,024-token sliding window."""
    return [layers.full_attention("full", block_size=16, num_kv_heads=8, head_size=128),
            layers.sliding_window("swa", block_size=16, num_kv_heads=8, head_size=128,
                                  sliding_window=1024)]


def pool_kwargs(n: int, steps: int) -> dict:
    """RegisterPool options with room for ``n`` requests over ``steps`` decode steps."""
    per_request = 2 * ((PROMPT + steps + 64) // 16 + 2)  # both groups, with headroom
    return dict(num_blocks=max(2048, n * per_request + 64), max_model_len=MAX_MODEL_LEN)


def prompt(i: int) -> list[int]:
    """Request ``i``'s prompt (``PROMPT`` tokens, distinct per request)."""
    return [(i * 7919 + t) % 32000 for t in range(PROMPT)]


def admit(client: CacheClient, pool_id: str, n: int) -> None:
    """Adds, looks up and allocates ``n`` requests in batches of 64."""
    for start in range(0, n, 64):
        batch = StepBuilder(pool_id, begin_step=True)
        for i in range(start, min(n, start + 64)):
            batch.add(f"r{i}", prompt(i)).lookup(f"r{i}").allocate(f"r{i}", PROMPT)
        client.step_batch(batch)


#: Step encodings: generic ops with whole tables, generic without tables, one decode op.
TABLES, NO_TABLES, DECODE = "tables", "no_tables", "decode"


def request_ids(n: int) -> list[str]:
    """The ids of the ``n`` admitted requests."""
    return [f"r{i}" for i in range(n)]


def decode_batch(pool_id: str, n: int, step: int, mode: str) -> StepBuilder:
    """One decode step of ``n`` requests: one decode op, or one allocate per request (with or
    without tables, by ``mode``)."""
    batch = StepBuilder(pool_id, begin_step=True)
    token = [step % 32000]
    if mode == DECODE:
        return batch.decode(request_ids(n), token * n)
    for i in range(n):
        batch.allocate(f"r{i}", 1, block_table=mode == TABLES, append_token_ids=token)
    return batch


def all_ok(result) -> bool:
    """Whether every op of the step found room."""
    return all(r.all_ok if isinstance(r, DecodeResult) else r.ok for r in result.results)


def bench_service(client: CacheClient, n: int, steps: int, warmup: int, *,
                  mode: str) -> list[int]:
    """Unary decode Step latencies in ns over a fresh pool of ``n`` requests."""
    pool_id = f"bench-{mode}-{n}"
    client.register_pool(pool_id, model(), **pool_kwargs(n, steps + warmup))
    admit(client, pool_id, n)
    samples = []
    for step in range(warmup + steps):
        t0 = time.perf_counter_ns()
        result = client.step_batch(decode_batch(pool_id, n, step, mode))
        ok = all_ok(result)
        if mode == TABLES:
            tables = result.results[-1]
            assert isinstance(tables, AllocateResult)
            _ = tables.block_ids  # a scheduler reads the tables it sends on (decoded here)
        elif mode == DECODE:
            decoded = result.results[0]
            assert isinstance(decoded, DecodeResult)
            _ = decoded.new_block_ids  # ... or the new blocks
        elapsed = time.perf_counter_ns() - t0
        assert ok, "a decode allocation found no room; enlarge the pool"
        if step >= warmup:
            samples.append(elapsed)
    client.delete_pool(pool_id)
    return samples


def bench_stream(client: CacheClient, n: int, steps: int, warmup: int, *,
                 mode: str) -> list[int]:
    """StepStream decode step latencies in ns over a fresh pool of ``n`` requests."""
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
    """The same decode steps on an in-process Pool (no gRPC): latencies in ns."""
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


# -- the interleaved decode rounds: service vs the echo floor (vs a baseline server) --------

class DecodeSteps:
    """N-request decode Steps (one decode op) on a pool of its own on one server, unary
    or over one StepStream, run a chunk at a time (interleaved with other cases)."""

    def __init__(self, client: CacheClient, n: int, total_steps: int, *, stream: bool,
                 tag: str) -> None:
        self.client, self.n, self.stream = client, n, stream
        self.pool_id = f"bench-{tag}-{'stream' if stream else 'unary'}-{n}"
        client.register_pool(self.pool_id, model(), **pool_kwargs(n, total_steps))
        admit(client, self.pool_id, n)
        self.step = 0
        self._stream = client.step_stream() if stream else None

    def probe(self) -> tuple[bytes, bytes]:
        """One Step sent raw: the request as sent (session-stamped) and the response,
        serialized (the payloads the echo reproduces). Call it after the warm-up: all
        requests cross a block boundary together every 16 steps (step 0 is one), and the
        probe should be a typical step."""
        request = decode_batch(self.pool_id, self.n, self.step, DECODE).request
        response = (self._stream.step_raw(request) if self._stream is not None
                    else self.client.step_raw(request))
        self.step += 1
        return request.SerializeToString(), response.SerializeToString()

    def run(self, steps: int) -> list[int]:
        """``steps`` decode steps; answers their latencies in ns."""
        samples = []
        for _ in range(steps):
            t0 = time.perf_counter_ns()
            batch = decode_batch(self.pool_id, self.n, self.step, DECODE)
            if self._stream is not None:
                req = batch.request
                result = self._stream.step(req.pool_id, req.ops, begin_step=True)
            else:
                result = self.client.step_batch(batch)
            decoded = result.results[0]
            assert isinstance(decoded, DecodeResult)
            ok = decoded.all_ok
            _ = decoded.new_block_ids  # a scheduler reads the new blocks
            samples.append(time.perf_counter_ns() - t0)
            assert ok, "a decode allocation found no room; enlarge the pool"
            self.step += 1
        return samples

    def close(self) -> None:
        """Closes the stream and deletes the pool."""
        if self._stream is not None:
            self._stream.close()
        self.client.delete_pool(self.pool_id)


ECHO_SERVICE = "bench.Echo"


async def _serve_echo() -> None:
    """The echo server's process: a bare grpc.aio server (no interceptor, no parsing)
    answering every Unary call and Stream message with the bytes last given to SetReply."""
    reply = [b""]

    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return reply[0]

    async def stream(requests: AsyncIterator[bytes],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for _ in requests:
            yield reply[0]

    async def set_reply(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        reply[0] = request
        return b""

    handler = grpc.method_handlers_generic_handler(ECHO_SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.stream_stream_rpc_method_handler(stream),
        "SetReply": grpc.unary_unary_rpc_method_handler(set_reply)})
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.max_send_message_length", 64 << 20)])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(json.dumps({"event": "serving", "port": port}), flush=True)
    await server.wait_for_termination()


def start_echo_server() -> ServerProcess:
    """This script as an echo server process (the floor of a gRPC round trip)."""
    return start_process([sys.executable, str(Path(__file__).resolve()), "--echo-server"])


class EchoCalls:
    """Echo calls of a fixed payload, unary or over one stream driven as the blocking
    client's StepStream drives its own (a request queue, a reader thread, a response
    queue): the same client-side machinery, without messages to build or parse."""

    _END = object()

    def __init__(self, target: str, request: bytes, response: bytes, *,
                 stream: bool) -> None:
        self.channel = grpc.insecure_channel(target, options=list(CHANNEL_OPTIONS))
        self.channel.unary_unary(f"/{ECHO_SERVICE}/SetReply")(response, timeout=60)
        self.payload = request
        self.response_size = len(response)
        self._unary = self.channel.unary_unary(f"/{ECHO_SERVICE}/Unary")
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._responses: queue.SimpleQueue = queue.SimpleQueue()
        self._call: Any = None
        if stream:
            self._call = self.channel.stream_stream(f"/{ECHO_SERVICE}/Stream")(
                iter(self._requests.get, self._END))
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        responses: Iterator[bytes] = self._call
        # close() cancels the call; any other end shows as a step's timeout.
        with contextlib.suppress(grpc.RpcError):
            for response in responses:
                self._responses.put(response)

    def run(self, steps: int) -> list[int]:
        """``steps`` echo calls; answers their latencies in ns."""
        samples = []
        for _ in range(steps):
            t0 = time.perf_counter_ns()
            if self._call is not None:
                self._requests.put(self.payload)
                answer = self._responses.get(timeout=60)
            else:
                answer = self._unary(self.payload, timeout=60)
            samples.append(time.perf_counter_ns() - t0)
            assert len(answer) == self.response_size
        return samples

    def close(self) -> None:
        """Ends the stream and closes the channel."""
        if self._call is not None:
            self._requests.put(self._END)
            self._call.cancel()
        self.channel.close()


#: The interleaved cases: (result key, row label, the key of the echo it is compared to).
FLOOR_CASES = (("service_decode", "Step decode op", "echo_unary"),
               ("stream_decode", "StepStream decode op", "echo_stream"),
               ("echo_unary", "echo floor, unary", None),
               ("echo_stream", "echo floor, stream", None),
               ("baseline_service_decode", "baseline tree: Step decode op", "echo_unary"),
               ("baseline_stream_decode", "baseline tree: StepStream decode op",
                "echo_stream"))


def process_cpu_ns(pid: int) -> int:
    """CPU time a process has run so far, all its threads (Linux schedstat), in ns."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread ended
            total += int((task / "schedstat").read_text().split()[0])
    return total


def bench_floor(client: CacheClient, echo: ServerProcess, n: int, steps: int, warmup: int,
                rounds: int, baseline: CacheClient | None,
                pids: dict[str, int]) -> dict[str, Any]:
    """Samples of the decode Step and StepStream (and the baseline server's) and of
    the echoes of the same payload sizes, in ``rounds`` interleaved rounds; and the CPU
    time each case's server process spent per call (``server_cpu_us``, from the pids of
    ``pids``: "service", "echo", "baseline"), which the load of a shared machine
    inflates much less than wall time."""
    echo_target = echo.target
    total = steps + warmup + 2
    runners: dict[str, Any] = {
        "service_decode": DecodeSteps(client, n, total, stream=False, tag="floor"),
        "stream_decode": DecodeSteps(client, n, total, stream=True, tag="floor"),
    }
    if baseline is not None:
        runners["baseline_service_decode"] = DecodeSteps(baseline, n, total, stream=False,
                                                         tag="baseline")
        runners["baseline_stream_decode"] = DecodeSteps(baseline, n, total, stream=True,
                                                        tag="baseline")
    samples: dict[str, list[int]] = {}
    try:
        for runner in runners.values():
            runner.run(warmup)
        request, response = runners["service_decode"].probe()
        sizes = {"request_bytes": len(request), "response_bytes": len(response)}
        for key, stream in (("echo_unary", False), ("echo_stream", True)):
            runners[key] = calls = EchoCalls(echo_target, request, response, stream=stream)
            calls.run(warmup)
        samples = {key: [] for key in runners}
        cpu = dict.fromkeys(runners, 0)
        per_round = max(1, steps // rounds)
        for _ in range(rounds):
            for key, runner in runners.items():
                pid = pids["echo" if key.startswith("echo") else
                           "baseline" if key.startswith("baseline") else "service"]
                before = process_cpu_ns(pid)
                samples[key] += runner.run(per_round)
                cpu[key] += process_cpu_ns(pid) - before
    finally:
        for runner in runners.values():
            runner.close()
    server_cpu_us = {key: round(ns / len(samples[key]) / 1e3, 1) for key, ns in cpu.items()}
    return {"payload": sizes, "server_cpu_us": server_cpu_us, **samples}


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


#: (result key, row label) of the per-size cases run one after the other, in table order
#: (then the interleaved FLOOR_CASES).
CASES = (("core", "in-process Pool, append+allocate loop"),
         ("core_decode", "in-process Pool.decode"),
         ("servicer_in_process", "servicer, no gRPC, generic (tables)"),
         ("servicer_decode", "servicer, no gRPC, decode op"),
         ("service_tables", "Step generic (block tables)"),
         ("service_no_tables", "Step generic (no tables)"),
         ("stream_tables", "StepStream generic (block tables)"))


# What the picture compares: the decode Step, unary and streamed, and their echo floors.
PLOTTED = ("service_decode", "stream_decode", "echo_unary", "echo_stream",
           "baseline_service_decode")


def plot(cases: list[dict[str, Any]], raw: dict[str, list[int]]) -> list[Panel]:
    """The latency distribution of the largest size's Step against the echo floor, and each
    size's Step p50 / echo p50 (how close to a bare gRPC round trip the Step is)."""
    labels = dict((key, label) for key, label, _ in FLOOR_CASES)
    n = cases[-1]["running_requests"]
    floor = {key: [c[key]["p50_vs_echo"] for c in cases] for key in ("service_decode",
                                                                      "stream_decode")}
    return [Cdf(f"latency per call, {n} running requests",
                {labels[key]: [x / 1e6 for x in xs] for key, xs in raw.items()}, "ms"),
            Bars("Step p50 / echo floor p50", [f"{c['running_requests']} req" for c in cases],
                 {labels[key]: values for key, values in floor.items()}, "x the echo floor",
                 reference=1.0)]


def start_baseline(tree: Path, core: str | None = None) -> ServerProcess:
    """A cache server started from another checkout (its own code, this run's flags), or
    with ``core``, from this one with ``KVCACHE_CORE=core``."""
    tree = tree.resolve()
    env = {"PYTHONPATH": str(tree)} | ({"KVCACHE_CORE": core} if core else {})
    return start_process([sys.executable, "-m", "cache_service", "--host", "127.0.0.1",
                          "--port", "0", "--metrics-port", "-1", "--log-level", "warning"],
                         env=env, cwd=str(tree))


def main() -> int:
    """Runs the decode cases and the echo floor, interleaved in rounds; prints the tables and
    writes the JSON results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="measured steps per case")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--sizes", default="8,64,256", help="running requests per Step")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10,
                        help="interleaved rounds of the decode cases and the echo floor")
    parser.add_argument("--baseline-tree", type=Path, default=None,
                        help="also run the decode cases against a server started from "
                             "this checkout (e.g. main), in the same rounds")
    parser.add_argument("--vs-pure", action="store_true",
                        help="instead of another tree, the baseline server is this one with "
                             "KVCACHE_CORE=pure (the pure-Python core; run this side with "
                             "the compiled one)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path")
    parser.add_argument("--echo-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.echo_server:
        asyncio.run(_serve_echo())
        return 0
    sizes = [int(x) for x in args.sizes.split(",")]

    server = start_cache_service("--log-level", "warning")
    echo = start_echo_server()
    if args.vs_pure:
        args.baseline_tree = Path(__file__).resolve().parents[1]
    base_server = (start_baseline(args.baseline_tree, "pure" if args.vs_pure else None)
                   if args.baseline_tree else None)
    baseline_name = "the pure core's" if args.vs_pure else "baseline tree's"
    target = server.target
    pids = {"service": server.proc.pid, "echo": echo.proc.pid}
    if base_server is not None:
        pids["baseline"] = base_server.proc.pid
    rows = []
    results: dict = {"workload": {"prompt_tokens": PROMPT, "ops_per_request_per_step": 2,
                                  "model": "1 full + 1 sliding-window (1024) layer, bs 16"},
                     "baseline_tree": str(args.baseline_tree) if args.baseline_tree else None,
                     "baseline_core": "pure" if args.vs_pure else None,
                     "cases": []}
    try:
        with CacheClient(target, default_timeout=60) as client:
            base_client = (CacheClient(base_server.target, default_timeout=60)
                           if base_server is not None else None)
            for n in sizes:
                case: dict[str, Any] = {
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
                    "stream_tables": bench_stream(client, n, args.steps, args.warmup,
                                                  mode=TABLES),
                    **bench_floor(client, echo, n, args.steps, args.warmup,
                                  args.rounds, base_client, pids),
                }
                ops = 2 * n
                keys = [key for key, _ in CASES] + [key for key, _, _ in FLOOR_CASES
                                                     if key in case]
                # The largest size's raw samples, for the latency picture.
                raw = {key: case[key] for key in PLOTTED if key in case}
                for key in keys:
                    case[key] = c = summarize_ns(case[key])
                    c["ops_per_s"] = round(ops / (c["p50_us"] / 1e6))
                for key, _, floor in FLOOR_CASES:
                    if floor is not None and key in case:
                        case[key]["p50_vs_echo"] = round(
                            case[key]["p50_us"] / case[floor]["p50_us"], 3)
                for key in ("service_decode", "stream_decode"):
                    if f"baseline_{key}" in case:
                        case[key]["p50_vs_baseline"] = round(
                            case[key]["p50_us"] / case[f"baseline_{key}"]["p50_us"], 3)
                size = case["payload"]
                labels = dict((key, label) for key, label in CASES)
                labels.update((key, label) for key, label, _ in FLOOR_CASES)
                labels["echo_unary"] += f" ({size['request_bytes']} B in, " \
                    f"{size['response_bytes']} B out)"
                labels["echo_stream"] += " (same payloads)"
                for key in keys:
                    c = case[key]
                    cpu = case["server_cpu_us"].get(key)
                    if cpu is not None:
                        c["server_cpu_us"] = cpu
                    rows.append([f"{n} req: {labels[key]}", c["p50_us"] / 1e3,
                                 c["p99_us"] / 1e3, c["ops_per_s"],
                                 ratio(c["ops_per_s"], case["core"]["ops_per_s"]),
                                 ratio(c["ops_per_s"], case["core_decode"]["ops_per_s"]),
                                 f"{c['p50_vs_echo']:.2f}x" if "p50_vs_echo" in c else "-",
                                 cpu])
                results["cases"].append(case)
            if base_client is not None:
                base_client.close()
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
                             round(conc), ratio(conc, core64), ratio(conc, decode64), None,
                             None])
    finally:
        server.stop()
        echo.stop()
        if base_server is not None:
            base_server.stop()
    print_table("Batched decode Step (append + allocate per request): service vs in-process "
                "core (ops/s at p50 / the in-process loop's, and / Pool.decode's) and vs the "
                "echo floor (p50 / the echo's of the same payload sizes)",
                ["case", "p50 ms", "p99 ms", "ops/s", "vs core loop", "vs Pool.decode",
                 "vs echo", "server CPU us/call"], rows)
    for case in results["cases"]:
        for key in ("service_decode", "stream_decode"):
            if "p50_vs_baseline" in case[key]:
                base = case[f"baseline_{key}"]
                print(f"{case['running_requests']} req: {key} p50 / {baseline_name}: "
                      f"{case[key]['p50_vs_baseline']:.2f}x; server CPU per call "
                      f"{case[key]['server_cpu_us']} vs {base['server_cpu_us']} us "
                      f"({case[key]['server_cpu_us'] / base['server_cpu_us']:.2f}x)")
    out = write_results("service", results, args.out, plot=plot(results["cases"], raw))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
