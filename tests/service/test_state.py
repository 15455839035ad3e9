"""``ServiceState.apply``, the one mutation entry point: deterministic (the same records give
the same answers and state), logs only accepted records (before changing anything), asks the
registry's fence last before logging a pool's record, and expires a session's requests
exactly as frees would."""

from __future__ import annotations

import copy
import pickle

import pytest

from cache_service.client import StepBuilder, ops, register_request
from cache_service.core.errors import KVCacheError, NotFound, UnknownRequest
from cache_service.errors import Unavailable
from cache_service.registry import PoolRegistry
from cache_service.snapshot import dumps_state
from cache_service.state import ServiceState, WalRecord
from kvcache_common.api.kvcache.internal.v1 import wal_pb2
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb

from .builders import Recorder, full_layers


def step(seq: int, *step_ops: pb.Op, sid: str = "s1", pool: str = "p") -> WalRecord:
    return WalRecord(step=pb.StepRequest(pool_id=pool, session_id=sid, sequence=seq,
                                         begin_step=True, ops=step_ops))


def records() -> list[WalRecord]:
    """A history: a pool, two sessions and a foreign client, retries, bad calls, an
    expiry in chunks, a close."""
    out = [WalRecord(register_pool=register_request("p", full_layers(block_size=4),
                                                    num_blocks=128, max_model_len=256))]
    for sid in ("s1", "s2"):
        out.append(WalRecord(open_session=wal_pb2.OpenSession(session_id=sid)))
    out += [
        step(1, *[op for i in range(5) for op in (ops.add(f"a{i}", list(range(i, i + 9))),
                                                  ops.allocate(f"a{i}", 9))]),
        step(1, *[op for i in range(5) for op in (ops.add(f"a{i}", list(range(i, i + 9))),
                                                  ops.allocate(f"a{i}", 9))]),  # retry
        step(1, ops.add("b", [1, 2, 3]), ops.allocate("b", 3), sid="s2"),
        step(0, ops.add("f", [5, 6]), ops.allocate("f", 2), sid=""),  # no session
        step(2, ops.decode(["a0", "a1", "f"], [1, 2, 3])),
        step(3, ops.allocate("ghost", 1)),  # rejected: nothing logged, number kept
        step(3, ops.free("a0"), ops.free("b")),  # frees another session's request too
        WalRecord(expire_session=wal_pb2.ExpireSession(session_id="s1", max_requests=2)),
        step(4, ops.new_step()),  # the session is expiring: refused
        WalRecord(expire_session=wal_pb2.ExpireSession(session_id="s1", max_requests=2)),
        WalRecord(close_session=pb.CloseSessionRequest(session_id="s2")),
    ]
    return out


def run(history: list[WalRecord]) -> tuple[ServiceState, Recorder, list]:
    recorder = Recorder()
    state = ServiceState(PoolRegistry(), durability=recorder)
    answers = []
    for record in history:
        try:
            answers.append(state.apply(record))
        except KVCacheError as exc:
            answers.append((type(exc).__name__, exc.field))
    return state, recorder, answers


def observe(state: ServiceState) -> tuple:
    entry = state.registry.get("p")
    pool = entry.pool
    free = [b.block_id for b in pool.manager.pool.free_block_queue.get_all_free_blocks()]
    return (pool.stats(), free, {rid: pool.block_ids(rid) for rid in pool.request_ids()},
            entry.feed.next_sequence,
            {sid: (s.last_sequence, s.expiring, state.ownership.requests_of(sid))
             for sid, s in state.sessions.items()})


def test_the_same_records_give_the_same_answers_and_state() -> None:
    first, log, answers = run(records())
    second, _, again = run(records())
    assert answers == again and observe(first) == observe(second)
    # Replaying only what was logged gives the same state as well.
    third, _, _ = run(log.records)
    assert observe(third) == observe(first)


def test_only_accepted_records_are_logged_and_sessions_expire_like_frees() -> None:
    state, log, answers = run(records())
    kinds = [r.WhichOneof("mutation") for r in log.records]
    # The retry (answered from the stored response), the rejected step and the step on
    # the expiring session are not logged.
    assert kinds == ["register_pool", "open_session", "open_session", "step", "step", "step",
                     "step", "step", "expire_session", "expire_session", "close_session"]
    assert answers[4] is answers[3]  # the retry: the stored answer itself
    assert answers[8] == ("UnknownRequest", "ops[0].allocate.request_id")
    assert answers[11] == ("NotFound", "session_id")
    assert answers[10].num_requests_freed == 2 and answers[10].num_requests_left == 2
    assert answers[12].num_requests_left == 0 and answers[13].num_requests_freed == 0
    assert set(state.sessions) == set() and state.counters.expired == 1
    assert state.counters.requests_expired == 4 and state.counters.retries_answered == 1
    pool = state.registry.get("p").pool
    assert pool.request_ids() == ["f"]  # the foreign request never expires
    # Expiry freed exactly like FreeOps: the same pool as freeing them by hand.
    by_hand, _, _ = run(records()[:10] + [step(4, ops.free("a1"), ops.free("a2"),
                                               ops.free("a3"), ops.free("a4"))])
    assert observe(state)[:4] == observe(by_hand)[:4]


def test_a_failed_append_changes_nothing() -> None:
    state, log, _ = run(records()[:4])
    before = observe(state)
    log.fail = True
    with pytest.raises(OSError):
        state.apply(step(2, ops.free("a1")))
    assert observe(state) == before
    log.fail = False
    assert state.apply(step(2, ops.free("a1"))).results[0].free.num_free_blocks > 0


def test_records_name_their_problems() -> None:
    state = ServiceState(PoolRegistry())
    with pytest.raises(NotFound) as exc:
        state.apply(WalRecord(expire_session=wal_pb2.ExpireSession(session_id="x",
                                                                   max_requests=1)))
    assert exc.value.field == "session_id"
    with pytest.raises(KVCacheError) as empty:
        state.apply(WalRecord())
    assert empty.value.field == "mutation"
    with pytest.raises(NotFound) as exc:
        state.apply(step(1, ops.new_step(), pool="nope", sid=""))
    assert exc.value.field == "pool_id"
    assert not isinstance(exc.value, UnknownRequest)


def test_a_snapshot_of_the_layout_before_ownership_restores_the_same_owners() -> None:
    """Snapshots written before :class:`Ownership` pickled ``_owners`` (pool -> request ->
    session) and each session's ``requests``; loading one gives the same state."""
    state, _, _ = run(records()[:7])  # s1 holds a0-a4, s2 holds b
    old = state.__getstate__()
    ownership = old.pop("ownership")
    old["_owners"] = {pool: ownership.owners_in(pool) for pool in ("p",)}
    old["sessions"] = {sid: copy.copy(s) for sid, s in old["sessions"].items()}
    for sid, session in old["sessions"].items():
        vars(session)["requests"] = dict.fromkeys(ownership.requests_of(sid))
    restored = pickle.loads(dumps_state(old))  # noqa: S301 - our own bytes
    loaded = ServiceState.__new__(ServiceState)
    loaded.__setstate__(restored)
    loaded.ownership.check()
    assert observe(loaded) == observe(state)
    assert loaded.ownership.requests_of("s1") == [("p", f"a{i}") for i in range(5)]
    assert not any(hasattr(s, "requests") for s in loaded.sessions.values())


def test_deleting_a_pool_drops_its_requests_from_their_sessions() -> None:
    state, _, _ = run(records()[:7])  # s1 holds a0-a4, s2 holds b, f has no session
    state.apply(WalRecord(register_pool=register_request(
        "q", full_layers(block_size=4), num_blocks=128, max_model_len=256)))
    state.apply(step(2, ops.add("x", [1, 2]), ops.allocate("x", 2), pool="q"))
    assert ("q", "x") in state.ownership.requests_of("s1")
    assert state.ownership.owner_of("q", "x") == "s1"
    state.apply(WalRecord(delete_pool=pb.DeletePoolRequest(pool_id="q")))
    assert ("q", "x") not in state.ownership.requests_of("s1")
    assert state.ownership.owner_of("q", "x") is None
    done = state.apply(WalRecord(expire_session=wal_pb2.ExpireSession(session_id="s1",
                                                                      max_requests=100)))
    assert (done.num_requests_freed, done.num_requests_left) == (5, 0)
    assert state.registry.get("p").pool.request_ids() == ["b", "f"]


class FencedRegistry(PoolRegistry):
    """A registry whose fence refuses the pools in ``lost`` (as a cluster member's does for
    pools it no longer owns), counting the asks."""

    def __init__(self) -> None:
        super().__init__()
        self.lost: set[str] = set()
        self.asked = 0

    def fence(self, pool_id: str) -> None:
        self.asked += 1
        if pool_id in self.lost:
            raise Unavailable(f"pool {pool_id!r} is owned elsewhere", field="pool_id")


def test_the_fence_is_asked_after_the_last_validation_slice_and_refuses_without_a_trace(
        ) -> None:
    recorder = Recorder()
    registry = FencedRegistry()
    state = ServiceState(registry, durability=recorder)
    for record in records()[:4]:
        state.apply(record)
    assert registry.asked == 2  # the pool's two records; sessions are not fenced
    before, logged = observe(state), len(recorder.records)
    big = StepBuilder("p", begin_step=True)
    for i in range(40):
        big.add(f"n{i}", [i % 5] * 8).allocate(f"n{i}", 8)
    big.request.session_id, big.request.sequence = "s1", 2
    work = state.apply_in_slices(WalRecord(step=big.request), 4)
    next(work)  # validation has begun: the pool was this replica's then
    registry.lost.add("p")  # ... and is lost before the validation ends
    with pytest.raises(Unavailable):
        for _ in work:
            pass
    assert observe(state) == before and len(recorder.records) == logged
    # Nothing was applied: the session's next number is still 2 (a redirected call goes on).
    registry.lost.clear()
    assert state.apply(step(2, ops.free("a1"))).results[0].free.num_free_blocks > 0
    # Session records are not fenced: an expiry frees requests of a lost pool's copy.
    registry.lost.add("p")
    expired = state.apply(WalRecord(expire_session=wal_pb2.ExpireSession(
        session_id="s1", max_requests=10)))
    assert expired.num_requests_freed == 4 and expired.num_requests_left == 0


def test_an_adopt_record_written_before_ownership_gives_the_same_owners() -> None:
    """AdoptPool records logged before :class:`Ownership` carried each session's requests
    in the pool on the session itself; replaying one installs the same owners."""
    dead, _, _ = run(records()[:8])
    data = pickle.loads(dead.export_pool("p"))  # noqa: S301 - our own bytes
    for session in data["sessions"]:
        vars(session)["requests"] = dict.fromkeys(dead.ownership.requests_of(session.session_id))
    heir = ServiceState(PoolRegistry(instance_id="heir"))
    heir.apply(WalRecord(adopt_pool=wal_pb2.AdoptPool(pool_id="p", from_member="m0",
                                                      state=dumps_state(data))))
    heir.ownership.check()
    assert observe(heir) == observe(dead)
    assert not any(hasattr(s, "requests") for s in heir.sessions.values())


def test_an_adopted_pool_keeps_its_state_incarnation_and_sessions_exactly_once() -> None:
    """A pool taken over from a dead replica (AdoptPool, cluster mode) is the pool it
    left: allocator, event numbers, incarnation and the sessions holding its requests,
    so the call in doubt resent with its original stamp is answered, not applied again."""
    dead, _, _ = run(records()[:8])  # s1 and s2 hold requests; s1's last call was seq 2
    last = step(2, ops.decode(["a0", "a1", "f"], [1, 2, 3]))
    payload = dead.export_pool("p")
    recorder = Recorder()
    heir = ServiceState(PoolRegistry(instance_id="heir"), durability=recorder)
    heir.apply(WalRecord(open_session=wal_pb2.OpenSession(session_id="own")))
    adopt = WalRecord(adopt_pool=wal_pb2.AdoptPool(pool_id="p", from_member="m0",
                                                   state=payload))
    heir.apply(adopt)
    mine = observe(heir)
    assert mine[:4] == observe(dead)[:4] and mine[4].pop("own") == (0, False, [])
    assert mine[4] == observe(dead)[4]
    assert heir.registry.get("p").incarnation == dead.registry.get("p").incarnation
    assert heir.ownership.owner_of("p", "a1") == "s1"
    assert heir.ownership.owner_of("p", "b") == "s2"
    before = observe(heir)
    # The in-doubt call resent under its stamp: the stored answer, nothing applied.
    assert heir.apply(last) == dead.sessions["s1"].last_response
    assert observe(heir) == before and len(recorder.records) == 2
    # The session goes on where it was; a second adoption is refused without a trace.
    heir.apply(step(3, ops.free("a1")))
    with pytest.raises(KVCacheError) as exc:
        heir.apply(adopt)
    assert exc.value.field == "pool_id" and len(recorder.records) == 3
    # The heir's own log replays to the same state (the record carries the pool).
    replayed = ServiceState(PoolRegistry(instance_id="heir"))
    for record in recorder.records:
        replayed.apply(record)
    assert observe(replayed) == observe(heir)
    bad = WalRecord(adopt_pool=wal_pb2.AdoptPool(pool_id="q", state=b"junk"))
    with pytest.raises(KVCacheError) as exc:
        heir.apply(bad)
    assert exc.value.field == "state"


def test_an_unknown_session_on_a_pool_owned_elsewhere_is_redirected_first() -> None:
    """A call stamped with another replica's session names the pool's owner (a redirect
    or UNAVAILABLE while it fails over), not the unknown session: the owner may know it."""
    registry = FencedRegistry()
    state = ServiceState(registry)
    for record in records()[:4]:
        state.apply(record)
    registry.lost.add("p")
    with pytest.raises(Unavailable):
        state.apply(step(1, ops.new_step(), sid="elsewhere"))
    registry.lost.clear()
    with pytest.raises(NotFound) as exc:
        state.apply(step(1, ops.new_step(), sid="elsewhere"))
    assert exc.value.field == "session_id"
