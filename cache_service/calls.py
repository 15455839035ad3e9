"""What the interceptor knows about the call in progress, for the handlers to read.

The interceptor authenticates a call from its metadata and sets these context variables
before the handler runs; gRPC runs every call in its own task, so they never leak between
calls. Handlers read the tenant (whose pools the call may see) and status mapping reads the
request id (echoed in the trailers of failed calls).
"""

from __future__ import annotations

from contextvars import ContextVar

from cache_service.tenants import ANONYMOUS, Tenant

REQUEST_ID_KEY = "x-request-id"

request_id: ContextVar[str | None] = ContextVar("request_id", default=None)
tenant: ContextVar[Tenant] = ContextVar("tenant", default=ANONYMOUS)


def request_id_metadata() -> tuple[tuple[str, str], ...]:
    """``((x-request-id, id),)`` for trailers, or ``()`` outside a call."""
    rid = request_id.get()
    return ((REQUEST_ID_KEY, rid),) if rid else ()
