#!/usr/bin/env python3
"""Where the server's time goes in one N-request decode Step, section by section.

In this process, on the server's own objects (``ServiceState``, ``CacheServicer``, the
``CallInterceptor``), without a network:

Times are CPU time of this thread (``time.thread_time_ns``), not wall time: on a shared
machine the wall time of the same work varies several-fold with the load, its CPU time much
less.

* ``sections``: the pieces of one Step's server path called one after the other by hand,
  each timed (median over the steps, in CPU microseconds): parsing the request bytes, the
  tenancy mapping, the session and sequence check, the per-call limits, proto -> ops,
  batch validation, applying the batch (the allocator), event feed, session bookkeeping,
  building the response and serializing it. The sum is the synchronous work a Step needs.
* ``handler``: the same Step through the real StepStream handler as gRPC calls it (the
  interceptor's wrapped handler, one stream kept open, a request queued and its response
  awaited on an asyncio loop), parse and serialization included; ``handler - sections``
  is what the async layers add (stream generators, the fairness gate and its slicing,
  metrics, the call context).

Needs no server process; the transport's own cost is the echo floor of
``bench/bench_service.py``.

    python3 bench/profile_step.py                  # 256 requests, 300 steps, seconds
    python3 bench/profile_step.py --requests 64
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from _common import print_table, write_results
from bench_service import PROMPT, decode_batch, model, pool_kwargs, prompt
from cache_service import convert
from cache_service.client import StepBuilder, register_request
from cache_service.interceptors import CallInterceptor, _lenient
from cache_service.metrics import new_registry
from cache_service.registry import PoolRegistry
from cache_service.servicer import CacheServicer, _tenant_context
from cache_service.state import ServiceState
from cache_service.tenants import ANONYMOUS
from kvcache_common.api.kvcache.internal.v1 import wal_pb2
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.api.kvcache.v1 import cache_service_pb2_grpc as pb_grpc


class _Context:
    """The parts of a grpc.aio ServicerContext the handlers touch on success."""

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass

    def code(self) -> None:
        return None

    def details(self) -> str:
        return ""


def _setup(n: int, steps: int) -> tuple[ServiceState, CacheServicer, Any, str]:
    registry = PoolRegistry()
    state = ServiceState(registry)
    servicer = CacheServicer(state)
    tenant = _tenant_context(ANONYMOUS)  # as the interceptor sets it without auth
    state.apply_call("open_session", wal_pb2.OpenSession(session_id="s"), tenant)
    request = register_request("p", model(), **pool_kwargs(n, steps))
    request.session_id, request.sequence = "s", 1
    state.apply_call("register_pool", request, tenant)
    admit = StepBuilder("p", begin_step=True)
    for i in range(n):
        admit.add(f"r{i}", prompt(i)).lookup(f"r{i}").allocate(f"r{i}", PROMPT)
    admit.request.session_id, admit.request.sequence = "s", 2
    state.apply_call("step", admit.request, tenant)
    _, rpc = new_registry(registry.stats, lambda: state.counters)
    interceptor = CallInterceptor(rpc)
    return state, servicer, interceptor, "p"


def _request_bytes(n: int, step: int, sequence: int) -> bytes:
    req = decode_batch("p", n, step, "decode").request
    req.session_id, req.sequence = "s", sequence
    return req.SerializeToString()


SECTIONS = ("parse (lenient deserializer)", "tenancy: pool id -> internal id",
            "session lease renew + sequence check", "per-call limits (_check_step_cost)",
            "proto -> ops (convert.ops_from_proto)", "batch validation (prepare_batch)",
            "apply (Pool: decode allocations)", "event feed (flush_events)",
            "session ownership (_track) + stored answer", "response (convert.step_response)",
            "serialize response")


class _Sections:
    """Each section of the Step path, by hand, in the order the server runs them."""

    def __init__(self, n: int, total_steps: int) -> None:
        self.n = n
        self.state, self.servicer, _, pool_id = _setup(n, total_steps)
        self.pool_id = pool_id
        self.parse = _lenient(pb.StepRequest.FromString)
        self.entry = self.state.registry.get(pool_id)
        self.tables = convert.BlockTableCache()

    def step(self, step: int) -> list[int]:
        """One Step; the nanoseconds of each of :data:`SECTIONS`."""
        state, servicer, entry = self.state, self.servicer, self.entry
        data = _request_bytes(self.n, step, state.sessions["s"].last_sequence + 1)
        clock = time.thread_time_ns
        t = [clock()]
        request = self.parse(data)
        t.append(clock())
        servicer._own(request)
        t.append(clock())
        servicer.leases.renew("s")
        live = state.live_session("s", tenant=ANONYMOUS.name)
        assert request.sequence == live.last_sequence + 1
        t.append(clock())
        state._check_step_cost(request)
        t.append(clock())
        step_ops = convert.ops_from_proto(request, entry.pool.options.hash_algo)
        t.append(clock())
        batch = entry.pool.prepare_batch(step_ops, begin_step=request.begin_step)
        t.append(clock())
        outcomes = batch.apply()
        t.append(clock())
        entry.flush_events()
        t.append(clock())
        state._track(self.pool_id, step_ops, "s")
        t.append(clock())
        response = convert.step_response(step_ops, outcomes, self.tables,
                                         entry.pool.num_free_blocks)
        live.last_sequence, live.last_request, live.last_response = (
            request.sequence, request, response)
        t.append(clock())
        response.SerializeToString()
        t.append(clock())
        return [t[i + 1] - t[i] for i in range(len(SECTIONS))]


class _Handler:
    """The StepStream handler as gRPC runs it (wrapped by the interceptor), one stream
    kept open; :meth:`step` queues a request and awaits its serialized answer."""

    def __init__(self, n: int, total_steps: int) -> None:
        self.n = n
        self.state, servicer, self.interceptor, _ = _setup(n, total_steps)
        self.servicer = servicer
        handlers: dict[str, Any] = {}

        class _Server:
            def add_generic_rpc_handlers(self, generic: Any) -> None:
                handlers.update(generic[0]._method_handlers)

            def add_registered_method_handlers(self, name: str, methods: Any) -> None:
                handlers.update({f"/{name}/{k}": v for k, v in methods.items()})

        pb_grpc.add_CacheServiceServicer_to_server(servicer, _Server())
        service = pb.DESCRIPTOR.services_by_name["CacheService"].full_name
        self.method = f"/{service}/StepStream"
        self.handler = handlers[self.method]

    async def open(self) -> None:
        method = self.method

        class _Details:
            def __init__(self) -> None:
                self.method = method
                self.invocation_metadata = ()

        async def continuation(details: Any) -> Any:
            return self.handler

        handler = await self.interceptor.intercept_service(continuation, _Details())
        parse: Callable[[bytes], Any] = handler.request_deserializer
        self.serialize: Callable[[Any], bytes] = handler.response_serializer
        self.inbox: asyncio.Queue = asyncio.Queue()

        async def requests() -> AsyncIterator[Any]:
            while True:
                yield parse(await self.inbox.get())

        self.responses = handler.stream_stream(requests(), _Context())

    async def step(self, step: int) -> int:
        data = _request_bytes(self.n, step, self.state.sessions["s"].last_sequence + 1)
        t0 = time.thread_time_ns()
        self.inbox.put_nowait(data)
        self.serialize(await self.responses.__anext__())
        return time.thread_time_ns() - t0

    async def close(self) -> None:
        self.interceptor.in_flight = 0
        await self.responses.aclose()


async def profile(n: int, steps: int, warmup: int) -> tuple[dict[str, list[int]], list[int]]:
    """Sections and handler, one step of each in turn (machine noise hits both alike)."""
    sections = _Sections(n, steps + warmup)
    handler = _Handler(n, steps + warmup)
    await handler.open()
    out: dict[str, list[int]] = {name: [] for name in SECTIONS}
    whole = []
    for step in range(warmup + steps):
        times = sections.step(step)
        elapsed = await handler.step(step)
        if step >= warmup:
            for name, ns in zip(SECTIONS, times):
                out[name].append(ns)
            whole.append(elapsed)
    await handler.close()
    return out, whole


def main() -> int:
    """Times the sections of the server's path of one decode Step in process (CPU time), prints
    the table and writes the JSON results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None, help="JSON path")
    args = parser.parse_args()
    n = args.requests
    sections, handler = asyncio.run(profile(n, args.steps, args.warmup))
    med = {name: statistics.median(xs) / 1e3 for name, xs in sections.items()}
    total = sum(med.values())
    handler_us = statistics.median(handler) / 1e3
    rows: list[list[Any]] = [[name, round(us, 1), f"{100 * us / handler_us:.0f}%"]
                             for name, us in med.items()]
    rows.append(["sum of the sections", round(total, 1), f"{100 * total / handler_us:.0f}%"])
    rows.append(["async layers (handler - sections)", round(handler_us - total, 1),
                 f"{100 * (handler_us - total) / handler_us:.0f}%"])
    rows.append(["StepStream handler, parse to serialized answer", round(handler_us, 1),
                 "100%"])
    print_table(f"One {n}-request decode Step on the server, without the transport "
                "(median CPU us per step)", ["section", "us", "share"], rows)
    out = write_results("profile_step", {"running_requests": n, "sections_us": med,
                                         "handler_us": handler_us}, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
