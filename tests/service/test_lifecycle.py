"""Server lifecycle against its own subprocesses: SIGTERM under load, auth, TLS, --help."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cache_service.client import AllocateResult, CacheClient, CacheError, ops
from kvcache_common.launch import start_cache_service

from .builders import full_layers


def _watch_health(target: str, seen: list[str], stop: threading.Event) -> None:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            for reply in stub.Watch(health_pb2.HealthCheckRequest(service="")):
                seen.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
                if stop.is_set():
                    return
        except grpc.RpcError:
            return


def _hammer(target: str, pool: str, worker: int, codes: list, stop: threading.Event,
            progress: threading.Condition) -> None:
    with CacheClient(target, max_retries=0, default_timeout=10) as client:
        i = 0
        while not stop.is_set():
            rid = f"w{worker}-{i}"
            i += 1
            try:
                client.step(pool, [ops.add(rid, list(range(40))), ops.allocate(rid, 40),
                                   ops.free(rid)])
                codes.append("OK")
            except CacheError as exc:
                codes.append(exc.code.name)
                if exc.code == grpc.StatusCode.UNAVAILABLE:
                    return
            finally:
                with progress:
                    progress.notify_all()


def test_sigterm_under_load_drains_and_exits_zero() -> None:
    srv = start_cache_service(env={"KVCACHE_DRAIN_SECONDS": "2"})
    try:
        with CacheClient(srv.target) as client:
            client.register_pool("p", full_layers(), num_blocks=512, max_model_len=256)
            events_done = threading.Event()
            event_errors: list = []

            def subscribe() -> None:
                try:
                    for _ in client.subscribe_events("p"):
                        pass
                except CacheError as exc:
                    event_errors.append(exc)
                events_done.set()

            threading.Thread(target=subscribe, daemon=True).start()
            stop = threading.Event()
            health: list[str] = []
            codes: list[list] = [[] for _ in range(6)]
            progress = threading.Condition()
            threads = [threading.Thread(target=_watch_health, args=(srv.target, health, stop))]
            threads += [threading.Thread(target=_hammer, args=(srv.target, "p", w, codes[w],
                                                               stop, progress))
                        for w in range(6)]
            for t in threads:
                t.start()
            with progress:  # SIGTERM while the load is running
                assert progress.wait_for(lambda: sum(map(len, codes)) >= 60, timeout=20), codes
            srv.signal()
            assert srv.proc.wait(20) == 0, srv.output()
            stop.set()
            for t in threads:
                t.join(20)
            assert events_done.wait(10) and not event_errors  # the stream ended with OK
    finally:
        srv.stop()
    flat = [c for per in codes for c in per]
    assert flat.count("OK") >= 60
    assert set(flat) <= {"OK", "UNAVAILABLE"}, set(flat)
    assert health[0] == "SERVING" and "NOT_SERVING" in health, health
    events = [r.get("event") for r in srv.records]
    assert events.index("serving") < events.index("draining") < events.index("stopped")


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture(scope="module")
def secure_server(tmp_path_factory):
    cert, key = _self_signed(tmp_path_factory.mktemp("tls"))
    srv = start_cache_service("--tls-cert", str(cert), "--tls-key", str(key),
                              env={"KVCACHE_AUTH_TOKEN": "s3cret"})
    yield srv, cert.read_bytes()
    assert srv.stop() == 0


@pytest.mark.parametrize("token", [None, "wrong", "s3cret "])
def test_calls_without_the_right_token_are_unauthenticated(secure_server, token) -> None:
    srv, ca = secure_server
    with CacheClient(srv.target, token=token, root_certificates=ca) as client:
        with pytest.raises(CacheError) as err:
            client.register_pool("p", full_layers(), num_blocks=64, max_model_len=128)
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(CacheError) as err:
            client.list_pools()
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    with CacheClient(srv.target, token="s3cret", root_certificates=ca) as client:
        assert "p" not in [p.pool_id for p in client.list_pools()]


def test_tls_with_the_token_works_and_health_stays_open(secure_server) -> None:
    srv, ca = secure_server
    with CacheClient(srv.target, token="s3cret", root_certificates=ca) as client:
        info = client.register_pool("tls-pool", full_layers(), num_blocks=64,
                                    max_model_len=128)
        result = client.step(info.pool_id, [ops.add("r", [1, 2, 3]), ops.allocate("r", 3)])
        assert result.result(1, AllocateResult).ok
    creds = grpc.ssl_channel_credentials(root_certificates=ca)
    with grpc.secure_channel(srv.target, creds) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with CacheClient(srv.target, token="s3cret", max_retries=0, default_timeout=3) as plain:
        with pytest.raises(CacheError) as err:  # plaintext to a TLS port
            plain.list_pools()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_help_lists_every_flag_with_its_environment_variable() -> None:
    out = subprocess.run([sys.executable, "-m", "cache_service", "--help"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    for flag, env in [("--port", "KVCACHE_PORT"), ("--metrics-port", "KVCACHE_METRICS_PORT"),
                      ("--drain-seconds", "KVCACHE_DRAIN_SECONDS"),
                      ("--auth-token", "KVCACHE_AUTH_TOKEN"), ("--host", "KVCACHE_HOST")]:
        assert flag in out and env in out


def test_bad_settings_exit_with_a_usage_error_naming_the_flag() -> None:
    proc = subprocess.run([sys.executable, "-m", "cache_service", "--port", "70000"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "port" in proc.stderr


def test_client_retries_unavailable_until_the_server_is_up_and_calls_are_logged(gate) -> None:
    """The client's first attempt meets no server (the gate hangs up): the call can only
    succeed by retrying, which gRPC's retry policy does (``cache_service/client/_channel.py``);
    without retries the same call fails UNAVAILABLE."""
    outcome: list = []

    def call(max_retries: int) -> None:
        with CacheClient(gate.target, max_retries=max_retries, backoff_base=0.2,
                         backoff_max=1.0) as client:
            try:
                outcome.append(client.list_pools())
            except CacheError as exc:
                outcome.append(exc.code)

    with start_cache_service("--log-level", "debug") as srv:
        call(0)
        assert outcome == [grpc.StatusCode.UNAVAILABLE] and gate.refused == 1, outcome
        outcome.clear()
        thread = threading.Thread(target=call, args=(4,))
        thread.start()
        assert gate.wait_refused(2, timeout=20), "the client never tried to connect"
        gate.open_to(srv.target)  # the next attempt reaches the server
        thread.join(30)
        assert outcome == [[]], outcome
        record = srv.wait_for(lambda r: r.get("event") == "rpc", timeout=10)
    assert record["rpc"] == "kvcache.v1.CacheService/ListPools"
    assert record["code"] == "OK" and len(record["request_id"]) >= 16


def test_max_retries_beyond_grpcs_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="max_retries: 5 is not in 0..4"):
        CacheClient("127.0.0.1:1", max_retries=5)
