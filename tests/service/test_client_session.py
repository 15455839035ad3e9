"""The client's I/O-free session bookkeeping (cache_service/client/_session.py): which
sessions a call leaves to keep alive on the replica that answered it."""

from __future__ import annotations

from cache_service.client._session import Carrier, SequencedCall, SessionStamp


def answer(sessions: dict[str, SessionStamp], carrier: Carrier, pool: str,
           address: str) -> list[str]:
    """One call on ``pool`` accepted at ``address`` under its own session: the ids of the
    sessions to keep alive there from now on."""
    call = SequencedCall(sessions, carrier, pool)
    return [s.session_id for s in call.accepted(address, sessions[address])]


def test_a_pool_answered_elsewhere_keeps_the_sessions_it_had_alive_there_once():
    sessions = {"x": SessionStamp("sx", 3.0), "y": SessionStamp("sy", 3.0)}
    carrier = Carrier()
    assert answer(sessions, carrier, "p", "x") == []  # the pool's first replica
    assert answer(sessions, carrier, "p", "x") == []
    # The pool moved (redirected, or a read learned the new owner): sx may own requests
    # there now, brought along by the hand-over.
    assert answer(sessions, carrier, "p", "y") == ["sx"]
    assert answer(sessions, carrier, "p", "y") == []  # kept alive there already
    kept = carrier.adopted[("y", "sx")]
    assert kept is not sessions["x"]  # a copy: X's own numbering is untouched
    assert kept.next_sequence == sessions["x"].next_sequence
    assert carrier.alive("y", kept, sessions)
    assert answer(sessions, carrier, "p", "x") == ["sy"]  # moved back: sy came along


def test_other_pools_and_calls_without_a_pool_keep_nothing_more():
    sessions = {"x": SessionStamp("sx", 3.0), "y": SessionStamp("sy", 3.0)}
    carrier = Carrier()
    assert answer(sessions, carrier, "p", "x") == []
    assert answer(sessions, carrier, "q", "y") == []  # sx never had a call on q
    assert answer(sessions, carrier, "", "y") == []
    assert carrier.adopted == {}


def test_an_expired_session_is_not_kept_alive_anywhere():
    sessions = {"x": SessionStamp("sx", 3.0), "y": SessionStamp("sy", 3.0)}
    carrier = Carrier()
    assert answer(sessions, carrier, "p", "x") == []
    carrier.lost("sx")
    assert answer(sessions, carrier, "p", "y") == []
