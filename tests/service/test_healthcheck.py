"""kvcache_common.healthcheck, the probe both images use as HEALTHCHECK, against a real gRPC
health server on loopback. Needs no Docker engine, so it runs in every environment."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from hypothesis import given
from hypothesis import strategies as st

from kvcache_common import healthcheck


@pytest.fixture
def health_server() -> Iterator[tuple[str, health.HealthServicer]]:
    """A bare gRPC server with only the standard health service, on an ephemeral port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(grace=None)


@pytest.mark.parametrize(("status", "expected_rc"), [
    (health_pb2.HealthCheckResponse.SERVING, 0),
    (health_pb2.HealthCheckResponse.NOT_SERVING, 1),
])
def test_exit_code_follows_the_reported_status(health_server, capsys, status, expected_rc):
    target, servicer = health_server
    servicer.set("", status)
    assert healthcheck.main(["--target", target, "--timeout", "2"]) == expected_rc
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    assert capsys.readouterr().out.strip() == f"healthcheck: {target}: {name}"


def test_named_service_is_asked_for(health_server):
    target, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("kvcache.v1.CacheService", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert healthcheck.check(target) == "SERVING"
    assert healthcheck.check(target, "kvcache.v1.CacheService") == "NOT_SERVING"
    # An unknown service is NOT_FOUND: the probe must fail, not pass.
    assert healthcheck.main(["--target", target, "--service", "no.such.Service"]) == 1


def test_port_comes_from_the_named_environment_variable(health_server, monkeypatch):
    target, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    port = target.rsplit(":", 1)[1]
    monkeypatch.setenv("SOME_PORT_VAR", port)
    assert healthcheck.main(["--port-env", "SOME_PORT_VAR", "--timeout", "2"]) == 0


def test_unreachable_server_fails_with_one_line(capsys):
    with_closed_port = "127.0.0.1:1"
    assert healthcheck.main(["--target", with_closed_port, "--timeout", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"healthcheck: {with_closed_port}: UNAVAILABLE")


@given(port=st.integers(1, 65535))
def test_resolve_target_uses_env_port(port):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVC_TEST_PORT", str(port))
        assert healthcheck.resolve_target(None, "KVC_TEST_PORT", 1) == f"127.0.0.1:{port}"
        # An explicit target always wins over the environment.
        assert healthcheck.resolve_target("h:9", "KVC_TEST_PORT", 1) == "h:9"


_env_text = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"),
                   min_size=1)


@given(bad=st.one_of(st.integers(65536, 10**9).map(str), st.just("0"), st.just("\u00b2"),
                     _env_text.filter(lambda s: s.strip() and not s.strip().isdecimal())))
def test_bad_port_variable_is_named_and_exit_code_is_2(bad):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVC_TEST_PORT", bad)
        with pytest.raises(ValueError, match="KVC_TEST_PORT"):
            healthcheck.resolve_target(None, "KVC_TEST_PORT", 50051)
        assert healthcheck.main(["--port-env", "KVC_TEST_PORT"]) == 2


def test_unset_variable_falls_back_to_default_port(monkeypatch):
    monkeypatch.delenv("KVC_TEST_PORT", raising=False)
    assert healthcheck.resolve_target(None, "KVC_TEST_PORT", 50061) == "127.0.0.1:50061"
