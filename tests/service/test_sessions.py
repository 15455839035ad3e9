"""Sessions, leases and exactly-once Steps against real server processes.

* a client process SIGKILLed while holding blocks: with a 2 s lease its blocks are back
  within TTL + 1 s; another client's requests (with or without a session) are untouched;
* sequence numbers: a retry of the last one answers the stored response without applying
  anything, gaps and old numbers are FAILED_PRECONDITION naming ``sequence``;
* a real client behind a TCP proxy that drops the connection right after the first bytes
  of a Step's answer: the client's retry is applied once and sees the original answer;
* a StepStream step past its deadline (server stopped with SIGSTOP) is resent on a new
  stream under the same sequence number and applied once.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from cache_service.client import (
    AllocateResult,
    AppendResult,
    CacheClient,
    CacheError,
    DecodeResult,
    ops,
)
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.api.kvcache.v1 import cache_service_pb2_grpc as pb_grpc
from kvcache_common.launch import ServerProcess, start_cache_service, start_process
from tests.metrics_text import scrape, value

from .builders import full_layers
from .tcp_proxy import TcpProxy

ROOT = Path(__file__).resolve().parents[2]
TTL = 2.0

# A scheduler that adds and allocates 9 requests, says so, and waits to be killed.
HOLDER = """
import json, sys, threading
from cache_service.client import CacheClient, ops
target, pool = sys.argv[1:3]
client = CacheClient(target, client_name="holder")
batch = []
for i in range(9):
    batch += [ops.add(f"held-{i}", list(range(i, i + 40))), ops.allocate(f"held-{i}", 40)]
assert all(r.ok for r in client.step(pool, batch, begin_step=True).results[1::2])
print(json.dumps({"event": "holding", "session_id": client.session_id}), flush=True)
threading.Event().wait()
"""


def metric(server: ServerProcess, name: str) -> float:
    """Series ``name`` (no labels) on the server's /metrics page."""
    return value(scrape(server.metrics_port), name)


@pytest.fixture(scope="module")
def short_lease_server() -> Iterator[ServerProcess]:
    with start_cache_service("--metrics-port", "0", "--lease-ttl-seconds", str(TTL)) as srv:
        yield srv


def test_a_killed_clients_blocks_come_back_within_the_lease(
        short_lease_server: ServerProcess) -> None:
    srv = short_lease_server
    with CacheClient(srv.target) as other, CacheClient(srv.target, session=False) as foreign:
        pool = other.register_pool("leases", full_layers(), num_blocks=128,
                                   max_model_len=1024).pool_id
        other.step(pool, [ops.add("mine", list(range(50))), ops.allocate("mine", 50)])
        foreign.step(pool, [ops.add("foreign", list(range(60))), ops.allocate("foreign", 60)])
        free_before = other.stats(pool).num_free_blocks
        tables = {rid: other.get_request(pool, rid) for rid in ("mine", "foreign")}

        holder = start_process([sys.executable, "-c", HOLDER, srv.target, pool],
                               ready=lambda r: r.get("event") == "holding",
                               env={"PYTHONPATH": str(ROOT)})
        held = other.stats(pool)
        assert held.num_requests == 11 and held.num_free_blocks < free_before - 9
        holder.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        holder.stop()

        while True:  # wait for the condition, with the deadline the lease promises
            stats = other.stats(pool)
            if stats.num_requests == 2:
                break
            assert time.monotonic() - killed < TTL + 1.0, f"not freed in time: {stats}"
            time.sleep(0.05)
        assert time.monotonic() - killed <= TTL + 1.0
        assert stats.num_free_blocks == free_before
        # The survivors: the other session (kept alive in the background) and the
        # foreign client's request, which belongs to no session and never expires.
        for rid, state in tables.items():
            assert other.get_request(pool, rid) == state
        record = srv.wait_for(lambda r: r.get("event") == "session_expired", timeout=5)
        assert record["requests_freed"] == 9 and record["client"] == "holder"
        assert metric(srv, "kvcache_sessions_expired_total") == 1
        assert metric(srv, "kvcache_session_requests_expired_total") == 9
        # The survivor's session still works; its own Step renews its lease.
        assert other.decode(pool, ["mine"], [1]).ok == [True]


def rpc_error(call) -> CacheError:
    with pytest.raises(grpc.RpcError) as exc:
        call()
    return CacheError.from_rpc(exc.value)


def test_sequence_numbers_make_steps_exactly_once(server: ServerProcess, client: CacheClient,
                                                  new_pool) -> None:
    pool = new_pool().pool_id
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.CacheServiceStub(channel)
        sid = stub.OpenSession(pb.OpenSessionRequest(client_name="raw")).session_id

        def step(seq: int, *step_ops: pb.Op) -> pb.StepRequest:
            return pb.StepRequest(pool_id=pool, session_id=sid, sequence=seq, ops=step_ops)

        admit = step(1, ops.add("r", list(range(40))), ops.allocate("r", 40))
        first = stub.Step(admit)
        assert stub.Step(admit) == first  # a retry: the stored answer, nothing applied
        decode = step(2, ops.decode(["r"], [7]))
        answer = stub.Step(decode)
        assert stub.Step(decode) == answer
        assert client.get_request(pool, "r").num_tokens == 41

        for bad, why in ((step(2, ops.decode(["r"], [8])), "already used"),
                         (step(4, ops.decode(["r"], [8])), "must be 3"),
                         (step(1, ops.decode(["r"], [8])), "must be 3"),
                         (step(0, ops.decode(["r"], [8])), "must be 3")):
            err = rpc_error(lambda bad=bad: stub.Step(bad))
            assert (err.code, err.field) == (grpc.StatusCode.FAILED_PRECONDITION, "sequence")
            assert why in err.message
        # A rejected call does not use up its number.
        err = rpc_error(lambda: stub.Step(step(3, ops.allocate("ghost", 1))))
        assert err.code == grpc.StatusCode.NOT_FOUND
        assert stub.Step(step(3, ops.decode(["r"], [8]))).results[0].decode.ok == [True]
        assert client.get_request(pool, "r").num_tokens == 42
        # Every mutating RPC shares the numbering.
        assert stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(
            pool_id=pool, session_id=sid, sequence=4)).reset is False

        unknown = pb.StepRequest(pool_id=pool, session_id="nope", sequence=1)
        for call in (lambda: stub.Step(unknown),
                     lambda: stub.KeepAlive(pb.KeepAliveRequest(session_id="nope"))):
            err = rpc_error(call)
            assert (err.code, err.field) == (grpc.StatusCode.NOT_FOUND, "session_id")
        # Closing frees what the session still holds, and ends it.
        closed = stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        assert closed.num_requests_freed == 1
        assert client.stats(pool).num_requests == 0
        err = rpc_error(lambda: stub.Step(step(5, ops.new_step())))
        assert (err.code, err.field) == (grpc.StatusCode.NOT_FOUND, "session_id")


def test_a_step_whose_answer_is_lost_is_applied_once(server: ServerProcess,
                                                     client: CacheClient, new_pool) -> None:
    pool = new_pool().pool_id
    answered = metric(server, "kvcache_step_retries_answered_total")
    with TcpProxy(server.target) as proxy, CacheClient(proxy.target) as behind:
        behind.step(pool, [ops.add("r", list(range(40))), ops.allocate("r", 40)])
        proxy.arm("drop")
        result = behind.step(pool, [ops.append("r", [7]), ops.allocate("r", 1)])
        assert proxy.fired.is_set() and proxy.connections >= 2
        # Applied once (40 -> 41 tokens, not 42); the retry got the stored answer.
        assert client.get_request(pool, "r").num_tokens == 41
    allocated = result.result(1, AllocateResult)
    assert allocated.ok and allocated.num_computed_tokens == 41
    assert result.result(0, AppendResult).num_tokens == 41
    assert metric(server, "kvcache_step_retries_answered_total") == answered + 1


def test_a_stream_step_past_its_deadline_is_resent_under_the_same_number(
        server: ServerProcess, client: CacheClient, new_pool) -> None:
    pool = new_pool().pool_id
    retries: list[tuple[str, int]] = []

    def resume(reason: str, attempt: int) -> None:  # the first deadline passed
        retries.append((reason, attempt))
        os.kill(server.proc.pid, signal.SIGCONT)

    with CacheClient(server.target) as c, c.step_stream(step_timeout=1.0,
                                                        on_retry=resume) as stream:
        stream.step(pool, [ops.add("r", list(range(40))), ops.allocate("r", 40)])
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            result = stream.step(pool, [ops.decode(["r"], [3])])
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert retries == [("deadline_exceeded", 1)]
        assert result.result(0, DecodeResult).ok == [True]
        assert client.get_request(pool, "r").num_tokens == 41


def test_idle_clients_keep_their_session_alive_and_close_frees(
        short_lease_server: ServerProcess) -> None:
    """Both clients renew their lease in the background: idle for longer than the TTL (the
    wait is the subject here, not a synchronization), their requests stay; closing a client
    ends its session and frees them."""
    import asyncio

    from cache_service.client import AsyncCacheClient

    srv = short_lease_server
    with CacheClient(srv.target) as reader:
        pool = reader.register_pool("idle", full_layers(), num_blocks=64,
                                    max_model_len=256).pool_id

        async def scenario() -> None:
            sync_client = CacheClient(srv.target)
            async with AsyncCacheClient(srv.target) as a:
                await a.step(pool, [ops.add("async", [1, 2, 3]), ops.allocate("async", 3)])
                sync_client.step(pool, [ops.add("sync", [4, 5]), ops.allocate("sync", 2)])
                await asyncio.sleep(1.5 * TTL)
                assert reader.stats(pool).num_requests == 2
                assert await a.decode(pool, ["async"], [9]) is not None
            assert reader.stats(pool).num_requests == 1  # the async client's close freed it
            sync_client.close()
            assert reader.stats(pool).num_requests == 0

        asyncio.run(scenario())
