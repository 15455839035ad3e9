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
from cache_service.errors import Draining, Internal, Unauthenticated, UndecodableMessage
from cache_service.metrics import RpcMetrics
from cache_service.status import to_status
from cache_service.tenants import ANONYMOUS, Tenant, TenantTable

OPEN_SERVICES = frozenset({
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
})

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
        await _abort(context, UndecodableMessage(f"{service}/{method}", bad.error))

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
        call = _Call(self, kind_of(handler), service, method, request_id, tenant)
        codec = dict(request_deserializer=_unparsed if tenant is None
                     else _lenient(handler.request_deserializer),
                     response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                functools.partial(call.unary, handler.unary_unary, False), **codec)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                functools.partial(call.stream, handler.unary_stream, False), **codec)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                functools.partial(call.stream, handler.stream_stream, True), **codec)
        return grpc.stream_unary_rpc_method_handler(
            functools.partial(call.unary, handler.stream_unary, True), **codec)


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """Ends the call with the status :func:`~cache_service.status.to_status` maps ``exc``
    to (raises), as the servicer's errors end theirs."""
    await context.abort_with_status(to_status(exc))


class _Call:
    """One authenticated call through the interceptor: its checks before the handler
    (tenant, draining, bad bytes), its metrics and log line after, and the wrappers of a
    handler that answers once (:meth:`unary`) or streams (:meth:`stream`)."""

    __slots__ = ("interceptor", "kind", "service", "method", "request_id", "tenant",
                 "started", "received", "sent")

    def __init__(self, interceptor: CallInterceptor, kind: str, service: str, method: str,
                 request_id: str, tenant: Tenant | None) -> None:
        self.interceptor = interceptor
        self.kind = kind
        self.service = service
        self.method = method
        self.request_id = request_id
        self.tenant = tenant  # None: no known token
        self.started, _, self.received, self.sent = interceptor._metrics.of(
            kind, service, method)

    async def unary(self, inner: Any, streaming: bool, request_or_iterator: Any,
                    context: grpc.aio.ServicerContext) -> Any:
        """A handler that returns one response (unary or client-streaming)."""
        async with _Guard(self, context):
            request = await self._admit(request_or_iterator, context, streaming)
            response = await inner(request, context)
            self.sent.inc()
            return response

    async def stream(self, inner: Any, streaming: bool, request_or_iterator: Any,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """A handler that yields responses (server- or bidi-streaming)."""
        async with _Guard(self, context):
            request = await self._admit(request_or_iterator, context, streaming)
            async for response in inner(request, context):
                self.sent.inc()
                yield response

    def _enter(self, context: grpc.aio.ServicerContext) -> float:
        interceptor = self.interceptor
        interceptor.in_flight += 1
        self.started.inc()
        calls.request_id.set(self.request_id)
        tenant = self.tenant
        calls.tenant.set(tenant or ANONYMOUS)
        structlog.contextvars.bind_contextvars(
            request_id=self.request_id, rpc=f"{self.service}/{self.method}",
            tenant=tenant.name if tenant is not None else None)
        context.set_trailing_metadata(((REQUEST_ID_KEY, self.request_id),))
        now = time.perf_counter()
        if interceptor.draining:
            interceptor.last_call = time.monotonic()
        return now

    def _leave(self, context: grpc.aio.ServicerContext, start: float, code: str) -> None:
        self.interceptor.in_flight -= 1
        elapsed = time.perf_counter() - start
        self.interceptor._metrics.observe(self.kind, self.service, self.method, code, elapsed)
        if code != "OK":
            _log.info("rpc_failed", code=code, details=context.details() or "",
                      seconds=round(elapsed, 6))
        else:
            _log.debug("rpc", code=code, seconds=round(elapsed, 6))

    async def _admit(self, request: Any, context: grpc.aio.ServicerContext,
                     streaming: bool) -> Any:
        """The request (stream) to hand on, after the checks that need no handler."""
        if self.interceptor.draining:
            await _abort(context, Draining())
        if self.tenant is None:
            await _abort(context, Unauthenticated())
        if streaming:
            return self._counted(request)
        self.received.inc()
        if type(request) is Undecodable:
            await self._undecodable(context, request)
        return request

    async def _counted(self, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """A request stream that counts each message (a long-lived StepStream would
        otherwise show up in the metrics only when it ends) and raises at the first
        undecodable one (:func:`_checked` and the count in one generator: each layer
        costs every message a resumption)."""
        received = self.received
        async for request in requests:
            received.inc()
            if type(request) is Undecodable:
                raise _UndecodableInStream(request)
            yield request

    async def _undecodable(self, context: grpc.aio.ServicerContext, bad: Undecodable) -> None:
        await self.interceptor._undecodable(context, self.service, self.method, bad)

    async def _internal(self, context: grpc.aio.ServicerContext) -> None:
        # A bug, not the client's fault; the traceback goes to the log, the client gets
        # INTERNAL with the request id to quote.
        _log.exception("rpc_internal_error")
        await _abort(context, Internal(self.request_id))


class _Guard:
    """The span of one call inside the interceptor: counted in flight and timed from
    entry; on the way out, an error becomes its status (bad bytes in a stream:
    INVALID_ARGUMENT; anything unexpected: INTERNAL, logged) and the call is measured and
    logged with its final code. An abort raised by the handler passes unchanged."""

    __slots__ = ("call", "context", "start")

    def __init__(self, call: _Call, context: grpc.aio.ServicerContext) -> None:
        self.call = call
        self.context = context
        self.start = 0.0

    async def __aenter__(self) -> None:
        self.start = self.call._enter(self.context)

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: object) -> None:
        code = None
        try:
            if exc is None or isinstance(exc, grpc.aio.AbortError):
                return
            if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
                code = "CANCELLED"
            elif isinstance(exc, _UndecodableInStream):
                await self.call._undecodable(self.context, exc.bad)
            elif isinstance(exc, Exception):
                await self.call._internal(self.context)
        finally:
            self.call._leave(self.context, self.start,
                             code or _code_name(self.context, "OK"))
