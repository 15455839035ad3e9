"""Server bootstrap: ``kvcache-server`` / ``python -m cache_service``.

One asyncio event loop runs the gRPC server (grpc.aio), the /metrics endpoint and owns every
pool, so allocator state needs no locks. Lifecycle:

1. listen (``--port 0`` picks a free port), then log ONE JSON line
   ``{"event": "serving", "port": ..., "metrics_port": ...}`` — supervisors and tests wait
   for it;
2. on SIGTERM/SIGINT: health goes NOT_SERVING, event streams end, new calls get
   UNAVAILABLE ("retry elsewhere"), in-flight calls get ``drain_seconds`` to finish, then the
   server stops (cancelling health watchers and anything still running); exit code 0.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Sequence

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.api.kvcache.v1 import cache_service_pb2_grpc as pb_grpc
from cache_service.interceptors import CallInterceptor
from cache_service.metrics import new_registry
from kvcache_common.logs import configure_logging, lifecycle
from kvcache_common.metrics_http import serve_metrics
from cache_service.registry import PoolRegistry
from cache_service.servicer import CacheServicer
from cache_service.settings import Settings, parse_settings

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CacheService"].full_name

log = structlog.get_logger("cache_service.server")


def grpc_options(settings: Settings) -> list[tuple[str, int]]:
    """Channel arguments set explicitly (message sizes, keepalive, ping policy)."""
    return [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.keepalive_time_ms", settings.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", settings.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        # Clients pinging faster than this without data get GOAWAY(too_many_pings); set
        # explicitly because the default (5 min) surprises clients with keepalive on.
        ("grpc.http2.min_ping_interval_without_data_ms", settings.min_ping_interval_ms),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.max_concurrent_streams", settings.max_concurrent_streams),
        ("grpc.so_reuseport", 0),
    ]


async def serve(settings: Settings) -> int:
    """Runs the server until SIGTERM/SIGINT; returns the exit code."""
    loop = asyncio.get_running_loop()
    node = None
    if settings.etcd_endpoints:  # cluster mode: the registry checks pool ownership
        from cache_service.cluster.node import ClusterNode
        node = ClusterNode(settings)
    registry = node.registry if node is not None else PoolRegistry(settings.event_buffer)
    prom_registry, rpc_metrics = new_registry(registry.stats)
    token = settings.auth_token.get_secret_value() if settings.auth_token else None
    interceptor = CallInterceptor(rpc_metrics, token)
    server = grpc.aio.server(interceptors=[interceptor], options=grpc_options(settings))
    servicer = CacheServicer(registry, max_ops_per_step=settings.max_ops_per_step)
    pb_grpc.add_CacheServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)

    address = f"{settings.host}:{settings.port}"
    if settings.tls_cert is not None and settings.tls_key is not None:
        creds = grpc.ssl_server_credentials(
            [(settings.tls_key.read_bytes(), settings.tls_cert.read_bytes())])
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        log.error("bind_failed", address=address)
        return 1
    await server.start()
    if node is not None:
        try:  # a member before SERVING: readiness implies the replica can own pools
            await node.join(port)
        except (ConnectionError, asyncio.TimeoutError) as exc:
            log.error("etcd_unreachable", endpoints=settings.etcd_endpoints, error=str(exc))
            await server.stop(0)
            return 1
        servicer.cluster = node
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    metrics_server = None
    metrics_port = -1
    if settings.metrics_port >= 0:
        metrics_server = await serve_metrics(prom_registry, settings.host, settings.metrics_port)
        metrics_port = metrics_server.sockets[0].getsockname()[1]

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    lifecycle().info("serving", host=settings.host, port=port, metrics_port=metrics_port,
             tls=settings.tls_cert is not None, auth=token is not None,
             member=node.membership.member_id if node and node.membership else None)

    await stop.wait()
    lifecycle().info("draining", grace_seconds=settings.drain_seconds)
    # NOT_SERVING first (and for good: later set() calls are ignored), so that load
    # balancers stop routing here while in-flight calls finish.
    await health_servicer.enter_graceful_shutdown()
    # New calls now get UNAVAILABLE at once; open Step streams end at their next message;
    # event subscriptions end cleanly. In-flight calls get the grace period to finish.
    interceptor.start_draining()
    servicer.draining = True
    registry.close()
    started = loop.time()
    await interceptor.wait_idle(settings.drain_seconds)
    if node is not None:
        # After the drain, so that no write races the successor's takeover.
        await node.leave()
    # Calls that raced the drain flag are answered UNAVAILABLE within the remaining grace
    # (at least 1 s, so that a starved loop still answers them); health watchers and
    # anything still running at its end are cancelled.
    await server.stop(max(1.0, settings.drain_seconds - (loop.time() - started)))
    if metrics_server is not None:
        metrics_server.close()
    lifecycle().info("stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse flags/env, configure logging, serve."""
    settings = parse_settings(argv)
    configure_logging(settings.log_level)
    return asyncio.run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
