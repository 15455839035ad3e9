"""The server's one interceptor: authentication (token -> tenant), a request id per call,
clean rejection of undecodable messages, per-RPC metrics and call logging.

One interceptor rather than a chain because each wrapper layer costs 50-100 us per call on
this class of machine (see docs/dev-environment.md). Health checks and reflection are never
authenticated: orchestrators probe them without credentials.

Order of checks, cheapest first: the tenant comes from the metadata before the body is
parsed (a rejected call's body is never deserialized); bytes that do not parse as the
request message (corrupt wire format, bad UTF-8 in a string) reach the handler as an
:class:`Undecodable` marker instead of an exception inside gRPC (which would answer
UNKNOWN unlogged), and are answered INVALID_ARGUMENT, logged with the request id and
counted. Every failed call carries ``x-request-id`` in its trailers.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog

from cache_service import calls
from cache_service.calls import REQUEST_ID_KEY
from cache_service.metrics import RpcMetrics
from cache_service.tenants import ANONYMOUS, Tenant, TenantTable

OPEN_SERVICES = frozenset({
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
})
#: Replica-to-replica services (cluster mode): passed through as they are. No tenant auth
#: (the standby checks the sender against etcd), no per-call metrics, never counted as a
#: call in flight (a replication stream lives as long as the replica; a drain must not
#: wait for it) and not refused while draining (a leaving replica stays a standby until
#: its lease is gone).
INTERNAL_SERVICES = frozenset({"kvcache.internal.v1.ReplicationService"})

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


class Undecodable:
    """What the lenient deserializer hands on for bytes that are not the request message."""

    __slots__ = ("error", "size")

    def __init__(self, error: str, size: int) -> None:
        self.error = error
        self.size = size


class _UndecodableInStream(Exception):
    def __init__(self, bad: Undecodable) -> None:
        super().__init__(bad.error)
        self.bad = bad


def _lenient(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # DecodeError, and whatever a broken message raises
            return Undecodable(f"{type(exc).__name__}: {exc}", len(data))
    return parse


def _unparsed(data: bytes) -> None:
    """The deserializer of a call rejected from its metadata: the body is never parsed."""
    return None


async def _checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A request stream that raises at the first undecodable message."""
    async for request in requests:
        if type(request) is Undecodable:
            raise _UndecodableInStream(request)
        yield request


def _code_name(context: grpc.aio.ServicerContext, default: str) -> str:
    """The status name the handler set (aborts set it too), or ``default``."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):  # some grpcio versions report the integer value
        return _CODE_NAMES.get(code, default)
    return default


class CallInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler of the authenticated services. With a tenant table, calls
    without a known ``authorization: Bearer`` token get UNAUTHENTICATED; without one,
    every caller is the tenant ``default``."""

    def __init__(self, metrics: RpcMetrics, tenants: TenantTable | None = None, *,
                 unauthenticated: Tenant = ANONYMOUS) -> None:
        self._metrics = metrics
        self._tenants = tenants
        self._unauthenticated = unauthenticated
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
        if service in INTERNAL_SERVICES:
            return handler
        if service in OPEN_SERVICES:
            # Probes need neither auth nor per-call metrics: only bad bytes are handled.
            return self._open(handler, service, method)
        if not isinstance(request_id, str) or not 0 < len(request_id) <= 128:
            request_id = uuid.uuid4().hex
        tenant = self._unauthenticated if self._tenants is None else self._tenants.authenticate(
            authorization if isinstance(authorization, str) else None)
        return self._wrap(handler, service, method, request_id, tenant)

    async def _undecodable(self, context: grpc.aio.ServicerContext, service: str, method: str,
                           bad: Undecodable) -> None:
        """Answers INVALID_ARGUMENT for bytes that are not the request (logged, counted)."""
        self._metrics.undecodable(service, method)
        _log.warning("undecodable_message", bytes=bad.size, error=bad.error,
                     rpc=f"{service}/{method}")
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"the request is not a valid {service}/{method} message "
                            f"({bad.error})", trailing_metadata=calls.request_id_metadata())

    def _open(self, handler: grpc.RpcMethodHandler, service: str,
              method: str) -> grpc.RpcMethodHandler:
        """A handler of health or reflection with the lenient codec: bad bytes answer
        INVALID_ARGUMENT. Health's Watch is a coroutine writing with ``context.write()``
        (awaited, not re-yielded); the others are plain coroutines or generators."""
        reject = self._undecodable

        async def unary(inner, request, context):
            if type(request) is Undecodable:
                await reject(context, service, method, request)
            return await inner(request, context)

        async def streaming(inner, requests, context):
            try:
                async for response in inner(_checked(requests), context):
                    yield response
            except _UndecodableInStream as exc:
                await reject(context, service, method, exc.bad)

        async def unary_to_stream(inner, request, context):
            if type(request) is Undecodable:
                await reject(context, service, method, request)
            async for response in inner(request, context):
                yield response

        codec = dict(request_deserializer=_lenient(handler.request_deserializer),
                     response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                functools.partial(unary, handler.unary_unary), **codec)
        if handler.unary_stream is not None:
            inner = handler.unary_stream
            wrapped = unary_to_stream if inspect.isasyncgenfunction(inner) else unary
            return grpc.unary_stream_rpc_method_handler(functools.partial(wrapped, inner),
                                                        **codec)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                functools.partial(streaming, handler.stream_stream), **codec)
        return handler

    def _wrap(self, handler: grpc.RpcMethodHandler, service: str, method: str,
              request_id: str, tenant: Tenant | None) -> grpc.RpcMethodHandler:
        metrics = self._metrics
        interceptor = self

        async def deny(context: grpc.aio.ServicerContext) -> None:
            trailers = calls.request_id_metadata()
            if interceptor.draining:
                # A negative pushback: the client's gRPC retry policy does not retry on
                # this instance (it is leaving); the client moves on to another one.
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    "server is shutting down; retry on another instance",
                                    trailing_metadata=(*trailers,
                                                       ("grpc-retry-pushback-ms", "-1")))
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or invalid bearer token (metadata 'authorization: "
                                "Bearer <token>')", trailing_metadata=trailers)

        async def undecodable(context: grpc.aio.ServicerContext, bad: Undecodable) -> None:
            await interceptor._undecodable(context, service, method, bad)

        async def internal(context: grpc.aio.ServicerContext) -> None:
            # A bug, not the client's fault; the traceback goes to the log, the client
            # gets INTERNAL with the request id to quote.
            _log.exception("rpc_internal_error")
            await context.abort(grpc.StatusCode.INTERNAL, "internal error; quote the "
                                f"request id {request_id}",
                                trailing_metadata=calls.request_id_metadata())

        started, _, received, sent = metrics.of(kind_of(handler), service, method)

        async def counted(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
            """A request stream that counts each message (a long-lived StepStream would
            otherwise show up in the metrics only when it ends) and raises at the first
            undecodable one (:func:`_checked` and the count in one generator: each layer
            costs every message a resumption)."""
            async for request in requests:
                received.inc()
                if type(request) is Undecodable:
                    raise _UndecodableInStream(request)
                yield request

        def enter(context: grpc.aio.ServicerContext) -> float:
            interceptor.in_flight += 1
            started.inc()
            calls.request_id.set(request_id)
            calls.tenant.set(tenant or ANONYMOUS)
            structlog.contextvars.bind_contextvars(
                request_id=request_id, rpc=f"{service}/{method}",
                tenant=tenant.name if tenant is not None else None)
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

        async def admit(request: Any, context: grpc.aio.ServicerContext,
                        streaming: bool) -> Any:
            """The request (stream) to hand on, after the checks that need no handler."""
            if tenant is None or interceptor.draining:
                await deny(context)
            if streaming:
                return counted(request)
            received.inc()
            if type(request) is Undecodable:
                await undecodable(context, request)
            return request

        def guard_unary(kind: str, inner, streaming: bool):
            """Wrap a handler that returns one response (unary or client-streaming)."""
            async def call(request_or_iterator, context):
                start = enter(context)
                code = None
                try:
                    request = await admit(request_or_iterator, context, streaming)
                    response = await inner(request, context)
                    sent.inc()
                    return response
                except _UndecodableInStream as exc:
                    await undecodable(context, exc.bad)
                except grpc.aio.AbortError:
                    raise
                except asyncio.CancelledError:
                    code = "CANCELLED"
                    raise
                except Exception:
                    await internal(context)
                finally:
                    leave(kind, context, start, code or _code_name(context, "OK"))
            return call

        def guard_stream(kind: str, inner, streaming: bool):
            """Wrap a handler that yields responses (server- or bidi-streaming)."""
            async def call(request_or_iterator, context):
                start = enter(context)
                code = None
                try:
                    request = await admit(request_or_iterator, context, streaming)
                    async for response in inner(request, context):
                        sent.inc()
                        yield response
                except _UndecodableInStream as exc:
                    await undecodable(context, exc.bad)
                except grpc.aio.AbortError:
                    raise
                except (asyncio.CancelledError, GeneratorExit):
                    code = "CANCELLED"
                    raise
                except Exception:
                    await internal(context)
                finally:
                    leave(kind, context, start, code or _code_name(context, "OK"))
            return call

        codec = dict(request_deserializer=_unparsed if tenant is None
                     else _lenient(handler.request_deserializer),
                     response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                guard_unary("unary", handler.unary_unary, False), **codec)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                guard_stream("server_stream", handler.unary_stream, False), **codec)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                guard_stream("bidi_stream", handler.stream_stream, True), **codec)
        return grpc.stream_unary_rpc_method_handler(
            guard_unary("client_stream", handler.stream_unary, True), **codec)
