"""A tiny gRPC health probe: ``python -m kvcache_common.healthcheck``.

Asks a server's ``grpc.health.v1.Health/Check`` and exits 0 only when the answer is SERVING
(1 otherwise: not serving, unknown service, unreachable, timeout). Both docker images use it as
their HEALTHCHECK, so readiness means "the gRPC server answers", not "the port is open".

A Dockerfile HEALTHCHECK in exec form cannot expand variables, so the port is read at probe time
from the environment variable named by ``--port-env``: the probe follows whatever port the
container was configured with. It imports only grpcio and grpcio-health-checking (no torch,
nothing of the service), so it costs one short Python start per probe.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(target: str, service: str = "", timeout: float = 3.0) -> str:
    """The health status name (e.g. ``"SERVING"``) that ``target`` reports for ``service``
    (``""`` = the whole server). Raises :class:`grpc.RpcError` when the call fails."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def resolve_target(target: str | None, port_env: str, default_port: int) -> str:
    """``target`` if given, else ``127.0.0.1:$<port_env>`` (``default_port`` when unset).
    Raises ValueError naming the variable when it is not a port number."""
    if target:
        return target
    raw = os.environ.get(port_env, "").strip() or str(default_port)
    # isdecimal() alone would admit non-ASCII digits that int() then rejects.
    if not (raw.isascii() and raw.isdecimal()) or not 0 < int(raw) < 65536:
        raise ValueError(f"{port_env}={raw!r} is not a port number (1-65535)")
    return f"127.0.0.1:{raw}"


def build_parser() -> argparse.ArgumentParser:
    """The probe's command line."""
    parser = argparse.ArgumentParser(
        prog="python -m kvcache_common.healthcheck",
        description="Exit 0 if the gRPC server's health service answers SERVING, else 1.",
    )
    parser.add_argument("--target", default=None,
                        help="HOST:PORT to probe (default: 127.0.0.1 and the port from --port-env)")
    parser.add_argument("--port-env", default="KVCACHE_PORT",
                        help="environment variable holding the port (default KVCACHE_PORT)")
    parser.add_argument("--default-port", type=int, default=50051,
                        help="port when that variable is unset (default 50051)")
    parser.add_argument("--service", default="",
                        help="health service name to ask about (default '' = whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Probe once; print one line; return the exit code (0 = SERVING)."""
    args = build_parser().parse_args(argv)
    try:
        target = resolve_target(args.target, args.port_env, args.default_port)
    except ValueError as exc:
        print(f"healthcheck: {exc}", file=sys.stderr)
        return 2
    try:
        status = check(target, args.service, args.timeout)
    except grpc.RpcError as exc:
        print(f"healthcheck: {target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(f"healthcheck: {target}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
