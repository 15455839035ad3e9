"""The pin records of ``ServiceState.apply`` (cache_service/pins.py) without a server:
deterministic (a replay of the accepted records gives the same pins, expiries and free
order), refused records are never logged, an expiry applies only to the expiry it saw (a
renewal in between wins), and the pin reaper expires exactly the pins that are due on its
clock."""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import pytest

from cache_service.client import ops, register_request
from cache_service.core.errors import KVCacheError
from cache_service.pins import PinReaper
from cache_service.registry import PoolRegistry
from cache_service.snapshot import dumps_state
from cache_service.state import ServiceState, WalRecord
from kvcache_common.api.kvcache.internal.v1 import wal_pb2
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb

from .builders import Recorder, full_layers

SYSTEM = list(range(1, 20))


def _pin(pin_id: str, expires_at: float, *, sid: str = "", tokens: list[int] = SYSTEM,
         ttl: float = 60.0, outlive: bool = False) -> WalRecord:
    return WalRecord(pin_prefix=wal_pb2.PinPrefix(request=pb.PinPrefixRequest(
        pool_id="p", pin_id=pin_id, token_ids=tokens, ttl_seconds=ttl, session_id=sid,
        outlive_session=outlive), expires_at=expires_at))


def _history() -> list[WalRecord]:
    return [
        WalRecord(register_pool=register_request("p", full_layers(block_size=4),
                                                 num_blocks=64, max_model_len=64)),
        WalRecord(open_session=wal_pb2.OpenSession(session_id="s1")),
        WalRecord(step=pb.StepRequest(pool_id="p", session_id="s1", sequence=1, ops=[
            ops.add("a", SYSTEM), ops.allocate("a", len(SYSTEM)), ops.free("a")])),
        _pin("free", 100.0),
        _pin("owned", 200.0, sid="s1"),
        _pin("kept", 300.0, sid="s1", tokens=SYSTEM[:9], outlive=True),
        _pin("free", 100.0),  # refused: exists
        _pin("bad", 100.0, ttl=0),  # refused: ttl
        WalRecord(renew_pin=wal_pb2.RenewPin(request=pb.RenewPinRequest(
            pool_id="p", pin_id="free", ttl_seconds=60), expires_at=150.0)),
        WalRecord(expire_pin=wal_pb2.ExpirePin(pool_id="p", pin_id="free", expires_at=100.0)),
        WalRecord(close_session=pb.CloseSessionRequest(session_id="s1")),
    ]


def _apply_all(state: ServiceState, history: list[WalRecord]) -> list[Any]:
    answers: list[Any] = []
    for record in history:
        try:
            answers.append(state.apply(record))
        except KVCacheError as exc:
            answers.append((type(exc).__name__, exc.field))
    return answers


def _view(state: ServiceState) -> object:
    pool = state.registry.get("p").pool
    queue = pool.manager.pool.free_block_queue
    return (pool.pins(), {p: {k: (v.session_id, v.outlive_session, v.expires_at)
                              for k, v in pins.items()} for p, pins in state.pin_leases.items()},
            [b.block_id for b in queue.get_all_free_blocks()])


def test_pin_records_replay_to_the_same_state() -> None:
    live = ServiceState(PoolRegistry(), durability=Recorder())
    answers = _apply_all(live, _history())
    assert answers[6] == ("AlreadyExists", "pin_id")
    assert answers[7] == ("InvalidArgument", "ttl_seconds")
    assert not answers[9].HasField("pin")  # the renewal won: the expiry changed nothing
    logged = live.durability.records  # type: ignore[attr-defined]
    assert len(logged) == len(_history()) - 2  # the refused records were not logged
    # "owned" died with its session; "free" (renewed) and "kept" (outlives it) remain.
    assert sorted(p.pin_id for p in live.registry.get("p").pool.pins()) == ["free", "kept"]
    replayed = ServiceState(PoolRegistry())
    _apply_all(replayed, logged)
    assert _view(replayed) == _view(live)
    restored = pickle.loads(dumps_state(live))  # a snapshot's encoding
    assert _view(restored) == _view(live)


def test_the_reaper_expires_what_is_due_on_its_clock() -> None:
    state = ServiceState(PoolRegistry())
    _apply_all(state, _history())
    now = [149.0]

    async def submit(record: WalRecord) -> object:
        return state.apply(record)

    reaper = PinReaper(state.pins, submit, clock=lambda: now[0])
    assert asyncio.run(reaper.expire_due()) == 0
    now[0] = 150.0
    assert asyncio.run(reaper.expire_due()) == 1  # "free" (renewed to 150)
    assert [p.pin_id for p in state.registry.get("p").pool.pins()] == ["kept"]
    now[0] = 1e9
    assert asyncio.run(reaper.expire_due()) == 1
    assert state.registry.get("p").pool.pins() == []
    assert state.pin_leases == {}
    with pytest.raises(KVCacheError):
        state.apply(WalRecord(drop_pin=pb.DropPinRequest(pool_id="p", pin_id="kept")))
