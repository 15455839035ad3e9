"""The one mapping of errors to gRPC statuses: every class of the core's tree and the shell's
answers its documented code, and an error's trailers (a redirect, the draining pushback)
ride along with the request id."""

from __future__ import annotations

import grpc
import pytest

from cache_service import calls, errors
from cache_service.cluster.keys import Owner
from cache_service.cluster.placement import PoolMoved
from cache_service.core import errors as core
from cache_service.status import status_code_of, to_status

C = grpc.StatusCode


@pytest.mark.parametrize(("error", "code"), [
    (core.InvalidArgument("x"), C.INVALID_ARGUMENT),
    (core.ConfigError("x"), C.INVALID_ARGUMENT),
    (core.UnknownRequest("x"), C.NOT_FOUND),
    (core.DuplicateRequest("x"), C.ALREADY_EXISTS),
    (core.FailedPrecondition("x"), C.FAILED_PRECONDITION),
    (core.ResourceExhausted("x"), C.RESOURCE_EXHAUSTED),
    (errors.DataDirFull("x"), C.RESOURCE_EXHAUSTED),
    (errors.Unavailable("x"), C.UNAVAILABLE),
    (errors.DataDirUnwritable("x"), C.UNAVAILABLE),
    (errors.Draining(), C.UNAVAILABLE),
    (PoolMoved("p", Owner("m1", "10.0.0.1:1", lease=1, token=1)), C.UNAVAILABLE),
    (errors.Unauthenticated(), C.UNAUTHENTICATED),
    (errors.UndecodableMessage("kvcache.v1.CacheService/Step", "DecodeError"),
     C.INVALID_ARGUMENT),
    (errors.SequenceOutOfRange("x", oldest=1, next_sequence=2), C.OUT_OF_RANGE),
    (errors.Internal("r1"), C.INTERNAL),
    (core.KVCacheError("x"), C.INVALID_ARGUMENT),
    (RuntimeError("a bug"), C.INTERNAL),
])
def test_each_error_answers_its_code(error: Exception, code: grpc.StatusCode) -> None:
    assert status_code_of(error) == code
    assert to_status(error).code == code


def test_draining_carries_the_negative_pushback_and_the_request_id() -> None:
    token = calls.request_id.set("r1")
    try:
        status = to_status(errors.Draining())
    finally:
        calls.request_id.reset(token)
    trailers = dict(status.trailing_metadata)
    assert status.details == "server is shutting down; retry on another instance"
    assert trailers["grpc-retry-pushback-ms"] == "-1"
    assert trailers[calls.REQUEST_ID_KEY] == "r1"


def test_a_field_is_named_in_the_message_once() -> None:
    status = to_status(core.InvalidArgument("must be >= 1", field="ops[2].allocate.n"))
    assert status.details == "ops[2].allocate.n: must be >= 1"
    status = to_status(core.InvalidArgument("ops[2] is bad", field="ops[2]"))
    assert status.details == "ops[2] is bad"
