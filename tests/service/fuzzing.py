"""A seeded fuzzer of the cache service over the wire (used by tests/service/test_fuzz.py and,
for longer runs, bench/bench_fuzz.py).

Every call goes to a real server as raw bytes: a valid-looking message of one of the RPCs
(streams included) with hostile field values set through the message descriptors (negative,
huge, empty, overlong, other pools' and requests' names, unknown enum values, NaN), and for
a share of calls the serialized bytes themselves mutated (bits flipped, truncated, garbage
appended, or random bytes). The oracle after every call:

* the answer's status is one the protocol documents (never UNKNOWN or INTERNAL);
* a rejected call changed nothing: the pool list, the pools' stats, the live request and
  the pool metrics are what they were before it;
* the server is alive and serving (health check) at the end and every few hundred calls.
"""

from __future__ import annotations

import math
import random
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from google.protobuf import descriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cache_service.client import layers, ops, register_request
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from tests.metrics_text import values

SERVICE = "/kvcache.v1.CacheService/"
POOL, CBOR_POOL, LIVE = "fz", "fz-cbor", "live"
VOCAB, MAX_LEN = 1000, 256
#: What the protocol documents for a client's mistake (docs/protocol.md, "Errors").
DOCUMENTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
              grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION,
              grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE}
METRICS_EVERY = 10
_INT_VALUES = [-1, 0, 1, 2, 3, 15, 16, 17, 255, 256, 257, 1000, 4096, 2**31 - 1, 2**31,
               2**40, 2**62, -2**63, 2**63 - 1]
_STRINGS = ["", POOL, CBOR_POOL, LIVE, "ghost", "x" * 300, "a/b", "default/fz", "r0", "é",
            " ", "fz ", "\x00"]


def _requests() -> dict[str, Callable[[], Message]]:
    """A valid-looking request per RPC (the fuzzer mutates them)."""
    def step() -> pb.StepRequest:
        return pb.StepRequest(pool_id=POOL, begin_step=True, ops=[
            ops.add("r0", [1, 2, 3] * 6), ops.allocate("r0", 18), ops.append(LIVE, [5]),
            ops.decode([LIVE], [7]), ops.lookup("r0"), ops.free("r0"), ops.preempt(LIVE),
            ops.new_step()])
    return {
        "RegisterPool": lambda: register_request(
            "fz-new", [layers.full_attention("l", block_size=16, num_kv_heads=1, head_size=8),
                       layers.mamba("m", block_size=MAX_LEN, shapes=[(4, 8)],
                                    dtypes=["float32"])],
            num_blocks=64, max_model_len=MAX_LEN),
        "GetPool": lambda: pb.GetPoolRequest(pool_id=POOL),
        "ListPools": lambda: pb.ListPoolsRequest(),
        "DeletePool": lambda: pb.DeletePoolRequest(pool_id="fz-new"),
        "Step": step,
        "StepStream": step,
        "PeekPrefix": lambda: pb.PeekPrefixRequest(pool_ids=[POOL, CBOR_POOL],
                                                   token_ids=list(range(40))),
        "GetRequest": lambda: pb.GetRequestRequest(pool_id=POOL, request_id=LIVE),
        "GetPoolStats": lambda: pb.GetPoolStatsRequest(pool_id=POOL),
        "ResetPrefixCache": lambda: pb.ResetPrefixCacheRequest(pool_id=CBOR_POOL),
        "SubscribeEvents": lambda: pb.SubscribeEventsRequest(pool_id=POOL, from_sequence=1),
        "OpenSession": lambda: pb.OpenSessionRequest(client_name="fuzz"),
        "KeepAlive": lambda: pb.KeepAliveRequest(session_id="ghost"),
        "CloseSession": lambda: pb.CloseSessionRequest(session_id="ghost"),
    }


REQUESTS = _requests()
MUTATING = {"RegisterPool", "DeletePool", "Step", "StepStream", "ResetPrefixCache",
            "CloseSession"}


def _scalar(f: descriptor.FieldDescriptor, rng: random.Random) -> object:
    t = f.type
    if t == f.TYPE_BOOL:
        return rng.random() < 0.5
    if t in (f.TYPE_DOUBLE, f.TYPE_FLOAT):
        return rng.choice([math.nan, math.inf, -1.0, 0.5, 1.0, 1e300])
    if t == f.TYPE_STRING:
        return rng.choice(_STRINGS)
    if t == f.TYPE_BYTES:
        return bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 31, 32, 33])))
    if t in (f.TYPE_INT32, f.TYPE_ENUM, f.TYPE_SINT32, f.TYPE_SFIXED32):
        return rng.choice([-1, 0, 1, 2, 5, 99, 2**31 - 1, -2**31])
    if t in (f.TYPE_UINT32, f.TYPE_FIXED32):
        return rng.choice([0, 1, 2**32 - 1])
    if t in (f.TYPE_UINT64, f.TYPE_FIXED64):
        return rng.choice([0, 1, 2**64 - 1])
    return rng.choice(_INT_VALUES)


def mutate(msg, rng: random.Random, depth: int = 0) -> None:
    """Sets one field somewhere in ``msg`` (recursively) to a hostile value."""
    fields = msg.DESCRIPTOR.fields
    if not fields:
        return
    f = rng.choice(fields)
    repeated = f.is_repeated
    if f.message_type is not None and not f.message_type.GetOptions().map_entry:
        if repeated:
            items = getattr(msg, f.name)
            if not items or rng.random() < 0.2:
                sub = items.add()
            elif rng.random() < 0.1:
                del items[rng.randrange(len(items))]
                return
            else:
                sub = items[rng.randrange(len(items))]
        else:
            sub = getattr(msg, f.name)
            sub.SetInParent()
        if depth < 4:
            mutate(sub, rng, depth + 1)
        return
    if f.message_type is not None:
        return  # a map field: left alone
    if repeated:
        items = getattr(msg, f.name)
        choice = rng.random()
        if choice < 0.2:
            del items[:]
        elif choice < 0.3 and f.type not in (f.TYPE_STRING, f.TYPE_BYTES):
            items.extend([_scalar(f, rng)] * rng.choice([1, 300, 5000]))
        elif items and choice < 0.7:
            items[rng.randrange(len(items))] = _scalar(f, rng)
        else:
            items.append(_scalar(f, rng))
        return
    setattr(msg, f.name, _scalar(f, rng))


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    """Wire-level damage: flipped bits, truncation, garbage, or random bytes."""
    kind = rng.randrange(4)
    if kind == 0 and data:
        out = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
        return bytes(out)
    if kind == 1 and data:
        return data[:rng.randrange(len(data))]
    if kind == 2:
        return data + bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    return bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))


@dataclass
class FuzzReport:
    calls: int = 0
    raw: int = 0
    by_code: dict[str, int] = field(default_factory=dict)
    by_rpc: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0


class Fuzzer:
    """Drives one server (``target``, metrics at ``metrics_port``)."""

    def __init__(self, target: str, metrics_port: int, seed: int) -> None:
        self.channel = grpc.insecure_channel(target)
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.rng = random.Random(seed)
        self.report = FuzzReport()
        self.rejected = 0
        self.metrics: list[str] = []

    def close(self) -> None:
        self.channel.close()

    # -- the state a rejected call must not change ----------------------------------------

    def _unary(self, rpc: str, request: Message) -> bytes:
        return self.channel.unary_unary(SERVICE + rpc)(request.SerializeToString(),
                                                       timeout=20)

    def pool_metrics(self) -> list[str]:
        body = urllib.request.urlopen(self.metrics_url, timeout=20).read().decode()
        # Explained lookups count their answers (an observation, like the per-RPC
        # counters): an accepted PeekPrefix with explain moves them without changing state.
        return sorted(line for line in body.splitlines()
                      if line.startswith(("kvcache_pool_", "kvcache_tenant_"))
                      and not line.startswith("kvcache_pool_prefix_misses"))

    def snapshot(self) -> tuple:
        """Pool list, both pools' stats and the live request (the pool metrics, which
        mirror them, are compared every ``METRICS_EVERY`` rejected calls)."""
        def read(rpc: str, request: object) -> object:
            try:
                return self._unary(rpc, request)
            except grpc.RpcError as err:
                return err.code()
        return (read("ListPools", pb.ListPoolsRequest()),
                read("GetPoolStats", pb.GetPoolStatsRequest(pool_id=POOL)),
                read("GetPoolStats", pb.GetPoolStatsRequest(pool_id=CBOR_POOL)),
                read("GetRequest", pb.GetRequestRequest(pool_id=POOL, request_id=LIVE)))

    def setup(self) -> None:
        """The pools and the live request the calls aim at (re-created if a valid fuzzed
        call removed them)."""
        pool = register_request(POOL, [layers.full_attention(
            "l", block_size=16, num_kv_heads=1, head_size=8)], num_blocks=64,
            max_model_len=MAX_LEN, vocab_size=VOCAB)
        self._unary("RegisterPool", pool)
        self._unary("RegisterPool", register_request(CBOR_POOL, [layers.full_attention(
            "l", block_size=16, num_kv_heads=1, head_size=8)], num_blocks=64,
            max_model_len=MAX_LEN, hash_algo="sha256_cbor"))
        try:
            self._unary("GetRequest", pb.GetRequestRequest(pool_id=POOL, request_id=LIVE))
        except grpc.RpcError:
            # Start the pool over (it may be full of fuzzed requests) with a running request.
            self._unary("DeletePool", pb.DeletePoolRequest(pool_id=POOL))
            self._unary("RegisterPool", pool)
            self._unary("Step", pb.StepRequest(pool_id=POOL, begin_step=True, ops=[
                ops.add(LIVE, list(range(40))), ops.allocate(LIVE, 40)]))

    # -- one call ---------------------------------------------------------------------------

    def _send(self, rpc: str, payloads: list[bytes]) -> grpc.StatusCode:
        try:
            if rpc == "StepStream":
                for _ in self.channel.stream_stream(SERVICE + rpc)(iter(payloads), timeout=20):
                    pass
            elif rpc == "SubscribeEvents":
                # A valid subscription stays open: DEADLINE_EXCEEDED then means "serving".
                for _ in self.channel.unary_stream(SERVICE + rpc)(payloads[0], timeout=0.1):
                    pass
            else:
                self.channel.unary_unary(SERVICE + rpc)(payloads[0], timeout=20)
        except grpc.RpcError as err:
            return err.code()
        return grpc.StatusCode.OK

    def call(self, before: tuple) -> tuple:
        """One fuzzed call and its oracle; answers the state snapshot after it."""
        rng = self.rng
        rpc = rng.choice(sorted(REQUESTS))
        payloads = []
        raw = False
        for _ in range(rng.randint(1, 3) if rpc == "StepStream" else 1):
            msg = REQUESTS[rpc]()
            for _ in range(rng.randint(1, 3)):
                mutate(msg, rng)
            data = msg.SerializeToString()
            if rng.random() < 0.3:
                data = mutate_bytes(data, rng)
                raw = True
            payloads.append(data)
        code = self._send(rpc, payloads)
        report = self.report
        report.calls += 1
        report.raw += raw
        report.by_rpc[rpc] = report.by_rpc.get(rpc, 0) + 1
        report.by_code[code.name] = report.by_code.get(code.name, 0) + 1
        allowed = DOCUMENTED | ({grpc.StatusCode.DEADLINE_EXCEEDED}
                                if rpc == "SubscribeEvents" else set())
        if code not in allowed:
            report.failures.append(f"call {report.calls}: {rpc} answered {code.name} "
                                   f"(payloads {[p.hex() for p in payloads]})")
        if (code == grpc.StatusCode.OK and rpc in MUTATING) or (
                rpc == "StepStream" and code != grpc.StatusCode.OK):
            # Changed (a stream's messages before the failing one were applied).
            self.setup()
            self.metrics = self.pool_metrics()
            return self.snapshot()
        after = self.snapshot()
        if code != grpc.StatusCode.OK:
            self.rejected += 1
            changed = after != before or (self.rejected % METRICS_EVERY == 0
                                          and self.pool_metrics() != self.metrics)
            if changed:
                report.failures.append(
                    f"call {report.calls}: rejected {rpc} ({code.name}) changed the state "
                    f"(payloads {[p.hex() for p in payloads]})")
        return after

    def alive(self) -> bool:
        reply = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(),
                                                               timeout=20)
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def run(self, calls: int) -> FuzzReport:
        started = time.perf_counter()
        self.setup()
        self.metrics = self.pool_metrics()
        state = self.snapshot()
        for i in range(calls):
            state = self.call(state)
            if i % 250 == 249 and not self.alive():
                self.report.failures.append(f"call {i + 1}: health check not SERVING")
        if not self.alive():
            self.report.failures.append("server not SERVING at the end")
        self.report.seconds = round(time.perf_counter() - started, 2)
        return self.report


def undecodable_total(metrics_body: str) -> float:
    """The sum of ``kvcache_undecodable_messages_total`` over methods."""
    return sum(values(metrics_body, "kvcache_undecodable_messages_total"))
