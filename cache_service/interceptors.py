"""The server's one interceptor: bearer-token auth, a request id per call, per-RPC metrics
and call logging.

One interceptor rather than a chain because each wrapper layer costs 50-100 us per call on
this class of machine (see docs/dev-environment.md). Health checks and reflection are never
authenticated: orchestrators probe them without credentials.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import Awaitable, Callable

import grpc
import structlog

from cache_service.metrics import RpcMetrics

OPEN_SERVICES = frozenset({
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
})
REQUEST_ID_KEY = "x-request-id"

_log = structlog.get_logger("cache_service.rpc")


_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


def kind_of(handler: grpc.RpcMethodHandler) -> str:
    """The grpc_type label of a handler."""
    if handler.unary_unary is not None:
        return "unary"
    if handler.unary_stream is not None:
        return "server_stream"
    if handler.stream_stream is not None:
        return "bidi_stream"
    return "client_stream"


def _code_name(context: grpc.aio.ServicerContext, default: str) -> str:
    """The status name the handler set (aborts set it too), or ``default``."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):  # some grpcio versions report the integer value
        return _CODE_NAMES.get(code, default)
    return default


class CallInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler; rejects calls without the right ``authorization: Bearer``
    token (UNAUTHENTICATED) when ``auth_token`` is set."""

    def __init__(self, metrics: RpcMetrics, auth_token: str | None = None) -> None:
        self._metrics = metrics
        self._expected = None if auth_token is None else f"Bearer {auth_token}".encode()
        #: Set on shutdown: new calls get UNAVAILABLE ("retry elsewhere") at once instead
        #: of being queued and cancelled when the grace period ends.
        self.draining = False
        #: Calls currently inside a (wrapped) handler; the drain waits for 0.
        self.in_flight = 0
        #: time.monotonic() of the last call that entered a handler.
        self.last_call = 0.0

    def start_draining(self) -> None:
        """From now on new calls get UNAVAILABLE."""
        self.draining = True
        self.last_call = time.monotonic()

    async def wait_idle(self, timeout: float, quiet: float = 0.5) -> bool:
        """Waits until no wrapped call is in flight and none arrived for ``quiet`` seconds
        (True), or ``timeout`` passes (False). The quiet period matters: calls the
        transport accepted but the loop has not dispatched yet are invisible here, and
        stopping the server would cancel them instead of answering UNAVAILABLE."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.in_flight and time.monotonic() - self.last_call >= quiet:
                return True
            await asyncio.sleep(0.01)
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None:
            return None
        _, service, method = details.method.split("/", 2) if details.method.count("/") == 2 \
            else ("", "unknown", details.method)
        request_id = None
        authorization = None
        for key, value in details.invocation_metadata or ():
            if key == REQUEST_ID_KEY:
                request_id = value
            elif key == "authorization":
                authorization = value
        if service in OPEN_SERVICES:
            # Unwrapped: health's Watch writes with context.write(), which cannot be
            # re-yielded by a wrapper; probes need neither auth nor per-call metrics.
            return handler
        if request_id is None:
            request_id = uuid.uuid4().hex
        reject = self._expected is not None and not (
            isinstance(authorization, str)
            and hmac.compare_digest(authorization.encode(), self._expected))
        return self._wrap(handler, service, method, request_id, reject=reject)

    def _wrap(self, handler: grpc.RpcMethodHandler, service: str, method: str,
              request_id: str, *, reject: bool) -> grpc.RpcMethodHandler:
        metrics = self._metrics

        interceptor = self

        async def deny(context: grpc.aio.ServicerContext) -> None:
            if interceptor.draining:
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    "server is shutting down; retry on another instance")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or invalid bearer token (metadata 'authorization: "
                                "Bearer <token>')")

        started, _, received, sent = metrics.of(kind_of(handler), service, method)

        def enter(context: grpc.aio.ServicerContext) -> float:
            interceptor.in_flight += 1
            started.inc()
            structlog.contextvars.bind_contextvars(request_id=request_id,
                                                   rpc=f"{service}/{method}")
            context.set_trailing_metadata(((REQUEST_ID_KEY, request_id),))
            now = time.perf_counter()
            if interceptor.draining:
                interceptor.last_call = time.monotonic()
            return now

        def leave(kind: str, context: grpc.aio.ServicerContext, start: float,
                  code: str) -> None:
            interceptor.in_flight -= 1
            elapsed = time.perf_counter() - start
            metrics.observe(kind, service, method, code, elapsed)
            if code != "OK":
                _log.info("rpc_failed", code=code, details=context.details() or "",
                          seconds=round(elapsed, 6))
            else:
                _log.debug("rpc", code=code, seconds=round(elapsed, 6))

        async def counted(requests):
            """The request stream of a client-/bidi-streaming call, counting each message."""
            async for request in requests:
                received.inc()
                yield request

        def incoming(kind: str, request_or_iterator):
            if kind in ("unary", "server_stream"):
                received.inc()
                return request_or_iterator
            return counted(request_or_iterator)

        def guard_unary(kind: str, inner, failed_code: str):
            """Wrap a handler that returns one response (unary or client-streaming)."""
            async def call(request_or_iterator, context):
                start = enter(context)
                code = None
                try:
                    if reject or interceptor.draining:
                        await deny(context)
                    response = await inner(incoming(kind, request_or_iterator), context)
                    sent.inc()
                    return response
                except BaseException:
                    code = _code_name(context, failed_code)
                    raise
                finally:
                    leave(kind, context, start, code or _code_name(context, "OK"))
            return call

        def guard_stream(kind: str, inner):
            """Wrap a handler that yields responses (server- or bidi-streaming)."""
            async def call(request_or_iterator, context):
                start = enter(context)
                code = None
                try:
                    if reject or interceptor.draining:
                        await deny(context)
                    async for response in inner(incoming(kind, request_or_iterator), context):
                        sent.inc()
                        yield response
                except BaseException:
                    code = _code_name(context, "CANCELLED")
                    raise
                finally:
                    leave(kind, context, start, code or _code_name(context, "OK"))
            return call

        codec = dict(request_deserializer=handler.request_deserializer,
                     response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                guard_unary("unary", handler.unary_unary, "UNKNOWN"), **codec)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                guard_stream("server_stream", handler.unary_stream), **codec)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                guard_stream("bidi_stream", handler.stream_stream), **codec)
        return grpc.stream_unary_rpc_method_handler(
            guard_unary("client_stream", handler.stream_unary, "UNKNOWN"), **codec)
