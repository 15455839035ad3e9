"""The client's one exception: :class:`CacheError`."""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

#: Codes after which the call may or may not have been applied.
IN_DOUBT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                      grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
                      grpc.StatusCode.INTERNAL})


class CacheError(Exception):
    """A failed call: ``code`` (grpc.StatusCode), ``message``, and ``field`` — the first
    field named by the server's BadRequest detail ("" if none)."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str = "") -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.field = field

    @property
    def in_doubt(self) -> bool:
        """The call may or may not have been applied (the answer was lost): resend the SAME
        call, under the same sequence number, to learn its outcome without applying it twice."""
        return self.code in IN_DOUBT

    @classmethod
    def from_rpc(cls, exc: grpc.RpcError) -> CacheError:
        """The CacheError of a failed call: its code, message, and the first field its
        BadRequest detail names."""
        field = ""
        try:
            status = rpc_status.from_call(exc)
        except Exception:  # aio errors may not carry trailers in every state
            status = None
        if status is not None:
            violations = field_violations(status)
            if violations:
                field = violations[0][0]
        return cls(exc.code(), exc.details() or "", field)


def field_violations(status: status_pb2.Status) -> list[tuple[str, str]]:
    """(field, description) pairs of a status's BadRequest details (the fields a rejected call
    names)."""
    out: list[tuple[str, str]] = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            out.extend((v.field, v.description) for v in bad.field_violations)
    return out
