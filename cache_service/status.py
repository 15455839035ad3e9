"""The one place where errors become gRPC statuses.

Errors (:mod:`cache_service.errors`, which extends :mod:`cache_service.core.errors`)
carry a ``field``; the servicer adds the path of the message they came from
(``ops[3].allocate.``), and :func:`to_status` turns them into a status with a message
that names the field plus a ``google.rpc.BadRequest`` detail (grpcio-status rich error
model) that machines can read. The interceptor's own refusals (draining, no token, bad
bytes, a bug) are errors of the same tree and go through the same function.
"""

from __future__ import annotations

import collections

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from cache_service import calls
from cache_service import errors as e

#: The one mapping, most specific first (UnknownRequest is a NotFound, DataDirFull a
#: ResourceExhausted, PoolMoved an Unavailable, ...): the first class ``exc`` is an
#: instance of names its code. Anything else is a bug: INTERNAL.
_CODES: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (e.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (e.NotFound, grpc.StatusCode.NOT_FOUND),
    (e.AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (e.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (e.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (e.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (e.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (e.SequenceOutOfRange, grpc.StatusCode.OUT_OF_RANGE),
    (e.Internal, grpc.StatusCode.INTERNAL),
    (e.KVCacheError, grpc.StatusCode.INVALID_ARGUMENT),
)


def status_code_of(exc: Exception) -> grpc.StatusCode:
    """The status code an error maps to (INTERNAL for anything unexpected)."""
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def to_status(exc: Exception) -> grpc.Status:
    """A status for ``exc``: message ``"<field>: <what>"`` and a BadRequest detail."""
    code = status_code_of(exc)
    field = getattr(exc, "field", "") or ""
    text = str(exc)
    message = f"{field}: {text}" if field and not text.startswith(field) else text
    details = []
    if field:
        bad = error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=field, description=text)])
        any_detail = any_pb2.Any()
        any_detail.Pack(bad)
        details.append(any_detail)
    status = rpc_status.to_status(status_pb2.Status(
        code=getattr(code_pb2, code.name), message=message, details=details))
    # An abort replaces the trailers set earlier: the request id goes in again here, and
    # the error's own (e.g. a cluster redirect naming the pool's owner).
    return _Status(status.code, status.details,
                   tuple(status.trailing_metadata) + calls.request_id_metadata()
                   + tuple(getattr(exc, "trailing_metadata", ())))


class _Status(collections.namedtuple("_Status", ("code", "details", "trailing_metadata")),
              grpc.Status):
    pass
