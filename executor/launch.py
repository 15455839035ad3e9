"""Start executors as subprocesses on loopback (ephemeral ports) for the demo, the benchmarks
and the tests, on top of :mod:`kvcache_common.launch` (which starts the cache service)."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping

from kvcache_common.launch import ServerProcess, start_cache_service, start_process

__all__ = ["ServerProcess", "start_cache_service", "start_executor", "wait_ready"]


def start_executor(cache_target: str, *flags: str, wait_serving: bool = True,
                   env: Mapping[str, str] | None = None, timeout: float = 60.0) -> ServerProcess:
    """``python -m executor`` on 127.0.0.1 with an ephemeral port against ``cache_target``.
    Returns once its "serving" line is out (health SERVING: it has registered its pool), or
    with ``wait_serving=False`` once its "listening" line is (health NOT_SERVING until then)."""
    event = "serving" if wait_serving else "listening"
    return start_process([sys.executable, "-m", "executor", "--host", "127.0.0.1", "--port", "0",
                          "--cache-service", cache_target, *flags], env=env, timeout=timeout,
                         ready=lambda record: record.get("event") == event)


def wait_ready(target: str, timeout: float = 60.0) -> None:
    """Until the executor's health check says SERVING (it has registered its pool)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"executor {target} did not become SERVING")
            time.sleep(0.1)
