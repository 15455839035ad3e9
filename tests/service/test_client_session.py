"""The client's I/O-free session bookkeeping (cache_service/client/_session.py): which
sessions a call that moved between replicas leaves to keep alive where it was answered."""

from __future__ import annotations

import grpc

from cache_service.client._errors import CacheError
from cache_service.client._routing import Moved
from cache_service.client._session import Carrier, SequencedCall, SessionStamp

REDIRECT = Moved(CacheError(grpc.StatusCode.UNAVAILABLE, "not the owner"), redirect=True)


def used(session_id: str) -> SessionStamp:
    """A session with one accepted call (it may own requests)."""
    return SessionStamp(session_id, 3.0, next_sequence=2)


def test_a_redirected_call_keeps_the_redirecting_replicas_session_alive_once_where_answered():
    sessions = {"x": used("sx"), "y": used("sy")}
    carrier = Carrier()
    for expected in (["sx"], []):  # the second time: kept alive there already
        call = SequencedCall(sessions, carrier)
        call.moved("x", sessions["x"], REDIRECT)
        keep = call.accepted("y", sessions["y"])
        assert [s.session_id for s in keep] == expected
    kept = carrier.adopted[("y", "sx")]
    assert kept is not sessions["x"]  # a copy: X's own numbering is untouched
    assert carrier.alive("y", kept, sessions)


def test_nothing_to_keep_for_an_unused_session_or_a_non_redirect():
    sessions = {"x": SessionStamp("sx", 3.0), "y": used("sy")}  # sx: nothing applied
    carrier = Carrier()
    call = SequencedCall(sessions, carrier)
    call.moved("x", sessions["x"], REDIRECT)
    assert call.accepted("y", sessions["y"]) == []
    assert carrier.adopted == {}
