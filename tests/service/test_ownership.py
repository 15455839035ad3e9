"""Ownership against a naive model: every change keeps both lookups in step, and a session's
requests stay in the order of their adds."""

from __future__ import annotations

import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service.ownership import Ownership

POOLS = ("p", "q")
REQUESTS = ("a", "b", "c", "d")
SESSIONS = ("s1", "s2", "s3")

changes = st.lists(st.one_of(
    st.tuples(st.just("add"), st.sampled_from(POOLS), st.sampled_from(REQUESTS),
              st.sampled_from(SESSIONS)),
    st.tuples(st.just("release"), st.sampled_from(POOLS), st.sampled_from(REQUESTS)),
    st.tuples(st.just("drop_pool"), st.sampled_from(POOLS)),
    st.tuples(st.just("move_pool"), st.sampled_from(POOLS)),
), max_size=60)


class Model:
    """Owned requests as one list of (pool, request, session), oldest add first."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []

    def add(self, pool: str, rid: str, sid: str) -> None:
        self.release(pool, rid)
        self.rows.append((pool, rid, sid))

    def release(self, pool: str, rid: str) -> None:
        self.rows = [r for r in self.rows if r[:2] != (pool, rid)]

    def drop_pool(self, pool: str) -> None:
        self.rows = [r for r in self.rows if r[0] != pool]

    def move_pool(self, pool: str) -> None:
        """The pool leaves and comes back (a takeover): its requests now come last."""
        moved = [r for r in self.rows if r[0] == pool]
        self.drop_pool(pool)
        self.rows += moved


@settings(max_examples=300, deadline=None)
@given(changes)
def test_both_lookups_agree_with_the_model_after_every_change(steps: list[tuple]) -> None:
    owned, model = Ownership(), Model()
    for kind, *args in steps:
        if kind == "move_pool":
            # What a takeover does: another replica adopts what export read here.
            heir = pickle.loads(pickle.dumps(owned))
            moved = owned.owners_in(args[0])
            heir.drop_pool(args[0])
            heir.adopt(args[0], moved.items())
            owned = heir
        else:
            getattr(owned, kind)(*args)
        getattr(model, kind)(*args)
        owned.check()
        for sid in SESSIONS:
            mine = [(p, r) for p, r, s in model.rows if s == sid]
            assert owned.requests_of(sid) == mine
            assert owned.count(sid) == len(mine)
            assert owned.oldest(sid, 2) == mine[:2]
            assert owned.pools_of(sid) == sorted({p for p, _ in mine})
        for pool in POOLS:
            for rid in REQUESTS:
                want = [s for p, r, s in model.rows if (p, r) == (pool, rid)]
                assert owned.owner_of(pool, rid) == (want[0] if want else None)
        assert sorted(owned.sessions()) == sorted({s for *_, s in model.rows})


def test_release_answers_the_owner_once() -> None:
    owned = Ownership()
    owned.add("p", "a", "s1")
    assert owned.release("p", "a") == "s1"
    assert owned.release("p", "a") is None
    assert owned.requests_of("s1") == [] and list(owned.sessions()) == []
