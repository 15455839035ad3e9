"""Lease expiry benchmark: how long the expiry of a session holding 1,000 requests blocks
the server's event loop for other clients.

Two measurements:

* in-process: ``ServiceState.apply`` of the ExpireSession records that free the session
  (``--chunk`` requests per record, as the lease reaper sends them), against ONE record
  for all of them, in CPU time: the longest single record is the longest the loop is
  blocked;
* through gRPC: a real server with ``--lease-ttl-seconds 1``; a session adds the requests
  over the raw stub and then goes silent; meanwhile another client keeps sending
  64-request decode Steps. Reported: that client's Step latency (p50 / max) before the
  expiry and while it runs (goal: no Step waits more than 20 ms for it).

    python3 bench/bench_leases.py [--requests 1000] [--chunk 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from _common import print_table, summarize_ns, write_results  # noqa: E402
from cache_service.client import CacheClient, StepBuilder, layers, register_request  # noqa: E402
from cache_service.leases import EXPIRY_CHUNK  # noqa: E402
from cache_service.registry import PoolRegistry  # noqa: E402
from cache_service.state import ServiceState, WalRecord  # noqa: E402
from kvcache_common.api.kvcache.internal.v1 import wal_pb2  # noqa: E402
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb  # noqa: E402
from kvcache_common.api.kvcache.v1 import cache_service_pb2_grpc as pb_grpc  # noqa: E402
from kvcache_common.launch import start_cache_service  # noqa: E402

PROMPT = 64  # tokens per held request: 4 blocks of 16
OTHER = 64  # requests of the other client's decode Steps


def model() -> list:
    """The pool's model: two small full-attention layers."""
    return [layers.full_attention(f"l{i}", block_size=16, num_kv_heads=2, head_size=8)
            for i in range(2)]


def held_batches(pool_id: str, n: int, session_id: str = "", first_seq: int = 1
                 ) -> list[pb.StepRequest]:
    """Steps that add and allocate ``n`` requests, 250 per Step, stamped with a session."""
    out: list[pb.StepRequest] = []
    for start in range(0, n, 250):
        batch = StepBuilder(pool_id, begin_step=True)
        for i in range(start, min(n, start + 250)):
            batch.add(f"held-{i}", [i % 97] * (PROMPT - 1) + [i]).allocate(f"held-{i}", PROMPT)
        if session_id:
            batch.request.session_id = session_id
            batch.request.sequence = first_seq + len(out)
        out.append(batch.request)
    return out


def in_process(n: int, chunk: int) -> dict:
    """Per-record apply times of an expiry in chunks, and of one record for all."""
    out = {}
    for label, size in (("chunked", chunk), ("one record", n)):
        state = ServiceState(PoolRegistry(), lease_ttl_seconds=1.0)
        state.apply(WalRecord(register_pool=register_request(
            "p", model(), num_blocks=n * 5 + 100, max_model_len=1024)))
        state.apply(WalRecord(open_session=wal_pb2.OpenSession(session_id="s")))
        for req in held_batches("p", n, "s"):
            state.apply(WalRecord(step=req))
        samples = []
        while True:
            # CPU time of the thread: on a shared machine, wall time also counts the
            # time other processes held the core.
            t0 = time.thread_time_ns()
            res = state.apply(WalRecord(expire_session=wal_pb2.ExpireSession(
                session_id="s", max_requests=size)))
            samples.append(time.thread_time_ns() - t0)
            if not res.num_requests_left:
                break
        assert state.registry.get("p").pool.stats().num_requests == 0
        out[label] = {"records": len(samples), "max_ms": max(samples) / 1e6,
                      "total_ms": sum(samples) / 1e6}
    return out


def through_grpc(n: int) -> dict:
    """The other client's decode Step latency alone, and while a lease expiry runs."""
    server = start_cache_service("--log-level", "warning", "--lease-ttl-seconds", "1")
    try:
        with CacheClient(server.target) as other, CacheClient(server.target) as watcher, \
                grpc.insecure_channel(server.target) as channel:
            other.register_pool("held", model(), num_blocks=n * 5 + 100, max_model_len=1024)
            other.register_pool("busy", model(), num_blocks=OTHER * 8 + 100,
                                max_model_len=4096)
            admit = StepBuilder("busy", begin_step=True)
            for i in range(OTHER):
                admit.add(f"o{i}", [i] * 32).allocate(f"o{i}", 32)
            other.step_batch(admit)
            ids = [f"o{i}" for i in range(OTHER)]
            steps: list[tuple[int, int]] = []  # (start, end) in perf_counter_ns
            stop = threading.Event()

            def decode_loop() -> None:
                k = 0
                while not stop.is_set():
                    t0 = time.perf_counter_ns()
                    other.decode("busy", ids, [k % 50] * OTHER, begin_step=True)
                    steps.append((t0, time.perf_counter_ns()))
                    k += 1

            loop = threading.Thread(target=decode_loop)
            loop.start()
            time.sleep(1.0)  # a baseline of the other client's Steps
            stub = pb_grpc.CacheServiceStub(channel)
            sid = stub.OpenSession(pb.OpenSessionRequest(client_name="doomed")).session_id
            for req in held_batches("held", n, sid):
                stub.Step(req)
            # The doomed session goes silent: its lease runs out within ~1 s.
            held_since = time.perf_counter_ns()
            while (left := watcher.stats("held").num_requests) == n:
                held_since = time.perf_counter_ns()
                time.sleep(0.01)
            while left:
                time.sleep(0.01)
                left = watcher.stats("held").num_requests
            freed_at = time.perf_counter_ns()
            stop.set()
            loop.join()
            record = server.wait_for(lambda r: r.get("event") == "session_expired")
    finally:
        server.stop()
    before = [e - s for s, e in steps if e < held_since - 1_000_000_000]
    during = [e - s for s, e in steps if e > held_since and s < freed_at]
    return {"steps_before": summarize_ns(before), "steps_during": summarize_ns(during),
            "expiry_seconds": record["seconds"], "requests_freed": record["requests_freed"]}


def main() -> int:
    """Measures how long expiring a session's requests holds up other calls, and prints the
    table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--chunk", type=int, default=EXPIRY_CHUNK)
    parser.add_argument("--out", type=Path, default=None, help="JSON path")
    args = parser.parse_args()
    local = in_process(args.requests, args.chunk)
    remote = through_grpc(args.requests)
    rows = [[f"apply: {label} ({v['records']} records)", round(v["max_ms"], 2),
             round(v["total_ms"], 2)] for label, v in local.items()]
    print_table(f"Expiry of a session with {args.requests} requests: longest single "
                "ExpireSession apply (= longest loop block) and total", ["case", "max ms",
                                                                        "total ms"], rows)
    b, d = remote["steps_before"], remote["steps_during"]
    print_table(f"Another client's {OTHER}-request decode Step through gRPC (the expiry "
                f"took {remote['expiry_seconds']} s for {remote['requests_freed']} requests)",
                ["window", "steps", "p50 ms", "max ms"],
                [["before the expiry", b["n"], b["p50_us"] / 1e3, b["max_us"] / 1e3],
                 ["while it runs", d["n"], d["p50_us"] / 1e3, d["max_us"] / 1e3]])
    path = write_results("leases", {"requests": args.requests, "chunk": args.chunk,
                                    "in_process": local, "grpc": remote}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
