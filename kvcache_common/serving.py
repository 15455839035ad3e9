"""The bootstrap both servers share: a grpc.aio server with health (Check, Watch, List) and
reflection (:mod:`kvcache_common.discovery`), bound where the settings say, the optional
``/metrics`` endpoint, SIGTERM/SIGINT handlers, and the drain on shutdown.

Lifecycle, in this order (each server logs its own ``serving`` line, see
:mod:`kvcache_common.logs`):

1. :func:`start_server` binds and starts; health is SERVING or NOT_SERVING as the caller
   says (the executor turns SERVING once registered: :meth:`Listener.mark_serving`);
2. :meth:`Listener.wait` returns on SIGTERM/SIGINT (or :meth:`Listener.request_stop`);
3. :meth:`Listener.shutdown`: log ``draining``, health NOT_SERVING for good (load balancers
   stop routing here), the service refuses new work, in-flight work gets the grace period,
   ``server.stop`` cancels whatever is left, the metrics endpoint closes, the service closes
   its own state, log ``stopped``.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from kvcache_common.discovery import HealthServicer, enable_reflection
from kvcache_common.logs import lifecycle
from kvcache_common.metrics_http import serve_metrics


class ListenError(Exception):
    """gRPC could not bind (the port was taken after the pre-start check): one line naming
    the flag to change."""


class Listener:
    """A started server: its port, the metrics endpoint's port (-1 when off), the health
    servicer and the stop event the signal handlers set."""

    def __init__(self, server: grpc.aio.Server, health_servicer: HealthServicer,
                 service_name: str, port: int) -> None:
        self.server = server
        self.health = health_servicer
        self.service_name = service_name
        self.port = port
        self.metrics_port = -1
        self._metrics: asyncio.Server | None = None
        self._stop = asyncio.Event()

    async def _set_health(self, status: Any) -> None:
        for name in ("", self.service_name):
            await self.health.set(name, status)

    async def mark_serving(self) -> None:
        """Health SERVING (ignored once the drain began)."""
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)

    def request_stop(self) -> None:
        """What SIGTERM does (call on the server's loop)."""
        self._stop.set()

    async def wait(self) -> None:
        """Returns once SIGTERM/SIGINT arrived (or :meth:`request_stop` was called)."""
        await self._stop.wait()

    async def shutdown(self, grace_seconds: float, *, refuse_new: Callable[[], None],
                       wait_idle: Callable[[float], Awaitable[Any]],
                       close: Callable[[], Awaitable[None] | None] = lambda: None,
                       stop_grace_seconds: float | None = None, **stopped: Any) -> None:
        """The drain (module doc, step 3). ``refuse_new()`` makes the service answer new
        work UNAVAILABLE; ``wait_idle(grace)`` returns when in-flight work is done or the
        grace has passed; ``server.stop`` then gives the calls still open
        ``stop_grace_seconds`` (default: what is left of the grace, at least 1 s, so that a
        starved loop still answers them) and cancels the rest, health watchers included;
        ``close()`` releases the service's own state; ``stopped`` are extra fields of the
        ``stopped`` line."""
        loop = asyncio.get_running_loop()
        lifecycle().info("draining", grace_seconds=grace_seconds)
        # NOT_SERVING first (and for good: later set() calls are ignored).
        await self.health.enter_graceful_shutdown()
        refuse_new()
        started = loop.time()
        await wait_idle(grace_seconds)
        if stop_grace_seconds is None:
            stop_grace_seconds = max(1.0, grace_seconds - (loop.time() - started))
        await self.server.stop(stop_grace_seconds)
        if self._metrics is not None:
            self._metrics.close()
        closing = close()
        if closing is not None:
            await closing
        lifecycle().info("stopped", **stopped)


async def start_server(*, service_name: str, add_servicers: Callable[[grpc.aio.Server], None],
                       host: str, port: int, options: Sequence[tuple[str, Any]],
                       interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                       credentials: grpc.ServerCredentials | None = None, serving: bool,
                       metrics: CollectorRegistry | None = None,
                       metrics_port: int = -1) -> Listener:
    """Builds, binds and starts the server (``add_servicers`` adds the service's own),
    sets health to SERVING or NOT_SERVING (``serving``), serves ``metrics`` on
    ``metrics_port`` (-1: off, 0: any free port) and installs the signal handlers.
    Raises :class:`ListenError` when gRPC cannot bind ``host:port``."""
    server = grpc.aio.server(interceptors=list(interceptors), options=list(options))
    add_servicers(server)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection(server, (service_name, health.SERVICE_NAME))
    address = f"{host}:{port}"
    try:
        bound = (server.add_secure_port(address, credentials) if credentials is not None
                 else server.add_insecure_port(address))
    except RuntimeError:  # grpcio raises where older versions answered port 0
        bound = 0
    if bound == 0:
        raise ListenError(f"--port: cannot listen on {address}")
    await server.start()
    listener = Listener(server, health_servicer, service_name, bound)
    await listener._set_health(health_pb2.HealthCheckResponse.SERVING if serving
                               else health_pb2.HealthCheckResponse.NOT_SERVING)
    if metrics is not None and metrics_port >= 0:
        listener._metrics = await serve_metrics(metrics, host, metrics_port)
        listener.metrics_port = listener._metrics.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, listener.request_stop)
    return listener
