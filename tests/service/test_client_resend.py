"""The clients' own resends (``cache_service/client/_routing.py``), against real servers.

* a connection reset right after the answer's HTTP/2 headers (a proxy or load balancer
  dropping it mid-answer; gRPC's retry policy never resends such a call): the blocking and
  the async client resend the Step under the same stamp, it is applied once and the caller
  gets the original answer; the same for a lost OpenSession answer (one session, not two)
  and for a read;
* a server stopped (SIGSTOP) past an attempt's deadline: the Step is resent under the same
  stamp, applied once, and answered once the server runs again; a stop past the call's
  deadline ends in an in-doubt error after that bound, and the next call settles it;
* OpenSession with a proposed id: a resend answers the same session.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from cache_service.client import (
    AllocateResult,
    AppendResult,
    AsyncCacheClient,
    CacheClient,
    CacheError,
    ops,
)
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.api.kvcache.v1 import cache_service_pb2_grpc as pb_grpc
from kvcache_common.launch import ServerProcess, start_cache_service

from .builders import full_layers
from .tcp_proxy import TcpProxy
from .test_sessions import metric

ANSWERED = "kvcache_step_retries_answered_total"


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_step_answer_reset_after_its_headers_is_resent_and_applied_once(
        server: ServerProcess, client: CacheClient, new_pool) -> None:
    pool = new_pool().pool_id
    answered = metric(server, ANSWERED)
    with TcpProxy(server.target) as proxy, CacheClient(proxy.target) as behind:
        behind.step(pool, [ops.add("r", list(range(40))), ops.allocate("r", 40)])
        proxy.arm("headers")
        result = behind.step(pool, [ops.append("r", [7]), ops.allocate("r", 1)])
        assert proxy.fired.is_set()
        assert client.get_request(pool, "r").num_tokens == 41  # once: 40 -> 41, not 42
    assert result.result(0, AppendResult).num_tokens == 41
    assert result.result(1, AllocateResult).num_computed_tokens == 41
    assert metric(server, ANSWERED) == answered + 1  # the resend got the stored answer


def test_the_async_client_resends_a_step_reset_after_its_headers(
        server: ServerProcess, client: CacheClient, new_pool) -> None:
    pool = new_pool().pool_id
    answered = metric(server, ANSWERED)

    async def run(target: str, proxy: TcpProxy):
        async with AsyncCacheClient(target) as behind:
            await behind.step(pool, [ops.add("r", list(range(40))), ops.allocate("r", 40)])
            proxy.arm("headers")
            result = await behind.step(pool, [ops.append("r", [7]), ops.allocate("r", 1)])
            # (read before the client closes its session, which frees the request)
            return result, client.get_request(pool, "r").num_tokens

    with TcpProxy(server.target) as proxy:
        result, tokens = asyncio.run(run(proxy.target, proxy))
        assert proxy.fired.is_set()
    assert tokens == 41  # applied once
    assert result.result(0, AppendResult).num_tokens == 41
    assert metric(server, ANSWERED) == answered + 1


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_lost_open_session_answer_opens_one_session_and_the_step_is_sent(
        server: ServerProcess, client: CacheClient, new_pool, kind: str) -> None:
    pool = new_pool().pool_id
    opened = metric(server, "kvcache_sessions_opened_total")
    batch = [ops.add("r", list(range(40))), ops.allocate("r", 40)]
    with TcpProxy(server.target) as proxy:
        proxy.arm("headers")  # the first answer with headers is OpenSession's
        if kind == "sync":
            with CacheClient(proxy.target) as behind:
                result = behind.step(pool, batch)
                sid = behind.session_id
        else:
            async def run():
                async with AsyncCacheClient(proxy.target) as behind:
                    return await behind.step(pool, batch), behind.session_id
            result, sid = asyncio.run(run())
        assert proxy.fired.is_set() and sid
    assert result.result(1, AllocateResult).ok
    assert metric(server, "kvcache_sessions_opened_total") == opened + 1


def test_a_read_answer_reset_after_its_headers_is_retried(
        server: ServerProcess, client: CacheClient, new_pool) -> None:
    pool = new_pool().pool_id
    client.step(pool, [ops.add("r", list(range(40))), ops.allocate("r", 40)])
    with TcpProxy(server.target) as proxy, CacheClient(proxy.target) as behind:
        proxy.arm("headers")
        assert behind.get_request(pool, "r").num_tokens == 40
        assert proxy.fired.is_set()


def test_open_session_with_a_proposed_id_is_safe_to_resend(
        server: ServerProcess, stub: pb_grpc.CacheServiceStub) -> None:
    sid = os.urandom(16).hex()
    opened = metric(server, "kvcache_sessions_opened_total")
    first = stub.OpenSession(pb.OpenSessionRequest(client_name="t", session_id=sid))
    again = stub.OpenSession(pb.OpenSessionRequest(client_name="t", session_id=sid))
    assert first.session_id == again.session_id == sid
    assert metric(server, "kvcache_sessions_opened_total") == opened + 1
    with pytest.raises(grpc.RpcError) as bad:
        stub.OpenSession(pb.OpenSessionRequest(session_id="short"))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "session_id" in (bad.value.details() or "")
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


@pytest.fixture
def own_server() -> Iterator[ServerProcess]:
    """A server of its own: the test stops it with SIGSTOP."""
    with start_cache_service("--metrics-port", "0") as srv:
        yield srv
        os.kill(srv.proc.pid, signal.SIGCONT)


def test_a_step_held_by_a_stopped_server_is_resent_and_answered_once(
        own_server: ServerProcess) -> None:
    with CacheClient(own_server.target) as admin:
        admin.register_pool("p", full_layers(), num_blocks=64, max_model_len=256)
    outcome: list = []
    with TcpProxy(own_server.target) as proxy, CacheClient(
            proxy.target, attempt_timeout=0.3, default_timeout=60) as behind:
        behind.step("p", [ops.add("r", list(range(40))), ops.allocate("r", 40)])
        sent = proxy.calls_sent
        os.kill(own_server.proc.pid, signal.SIGSTOP)
        thread = threading.Thread(target=lambda: outcome.append(
            behind.step("p", [ops.append("r", [7]), ops.allocate("r", 1)])))
        thread.start()
        try:
            # The first attempt's deadline passed and the Step went out again.
            _wait(lambda: proxy.calls_sent >= sent + 2, 30, "the resend")
        finally:
            os.kill(own_server.proc.pid, signal.SIGCONT)
        thread.join(60)
        assert outcome, "the Step was not answered after the server resumed"
        assert behind.get_request("p", "r").num_tokens == 41
    # Applied once, whichever copy the server ran (an attempt past its deadline is
    # cancelled by the client, so the server may run only the resend).
    assert outcome[0].result(0, AppendResult).num_tokens == 41


def test_a_stop_past_the_calls_deadline_is_in_doubt_after_that_bound_and_settles(
        own_server: ServerProcess) -> None:
    with CacheClient(own_server.target) as admin:
        admin.register_pool("p", full_layers(), num_blocks=64, max_model_len=256)
    with TcpProxy(own_server.target) as proxy, CacheClient(
            proxy.target, attempt_timeout=0.3, default_timeout=60) as behind:
        behind.step("p", [ops.add("r", list(range(40))), ops.allocate("r", 40)])
        sent = proxy.calls_sent
        os.kill(own_server.proc.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(CacheError) as err:
                behind.step("p", [ops.append("r", [7])], timeout=1.5)
            elapsed = time.monotonic() - start
        finally:
            os.kill(own_server.proc.pid, signal.SIGCONT)
        assert err.value.in_doubt and err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert proxy.calls_sent >= sent + 2  # resent within the bound
        assert elapsed < 1.5 + 1.0, elapsed  # the bound, not an attempt more
        # The next call reuses the number in doubt. Either the server ran a copy of the
        # stopped Step once it resumed (the number is then skipped and the call sent with
        # the next), or every copy was cancelled in time: never both, never twice.
        after = behind.step("p", [ops.append("r", [8])]).result(0, AppendResult)
        assert after.num_tokens in (41, 42)
        assert behind.get_request("p", "r").num_tokens == after.num_tokens
