"""Start the cache service and executors as subprocesses on loopback (ephemeral ports) and
stop them again: what the demo and the benchmark do. Each server prints one JSON "serving"
line with its port; we wait for it. (The test tier has the same in tests/helpers/procs.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Sequence


class Proc:
    """A server subprocess; ``port`` comes from its "serving" line."""

    def __init__(self, argv: Sequence[str], *, env: dict[str, str] | None = None,
                 timeout: float = 60.0) -> None:
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        full_env.update(env or {})
        self.proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=full_env, bufsize=1, start_new_session=True)
        self.lines: list[str] = []
        self.port = -1
        self.metrics_port = -1
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(timeout) or self.port < 0:
            self.stop()
            raise RuntimeError(f"{argv[2:3]} did not start; output:\n" + "\n".join(self.lines[-40:]))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if self.port < 0 and line.startswith("{"):
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("event") == "serving":
                    self.port = int(rec["port"])
                    self.metrics_port = int(rec.get("metrics_port", -1))
                    self._ready.set()
        self._ready.set()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def start_cache_service(*flags: str) -> Proc:
    return Proc([sys.executable, "-m", "cache_service", "--host", "127.0.0.1", "--port", "0",
                 "--metrics-port", "-1", *flags])


def start_executor(cache_target: str, *flags: str) -> Proc:
    return Proc([sys.executable, "-m", "executor", "--host", "127.0.0.1", "--port", "0",
                 "--cache-service", cache_target, *flags])


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
