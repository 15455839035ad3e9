"""The checker itself (``checker.py``) against a real server: it passes an honest history,
and catches a Step applied twice and an acknowledged Step that is not there."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from cache_service.client import CacheClient, ops
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.launch import ServerProcess, start_cache_service

from .checker import History, check
from .load import LAYERS, POOL, next_step, pool_request


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with start_cache_service() as srv:
        yield srv


def _history(client: CacheClient, pool_id: str, steps: int) -> History:
    """``steps`` seeded Steps sent and acknowledged (sessionless: the test may resend)."""
    history = History(pool_request(pool_id))
    client.register_pool(pool_id, LAYERS, **POOL)
    rng, live = random.Random(pool_id), dict[str, int]()
    for serial in range(steps):
        request, live = next_step(rng, live, pool_id, serial)
        client.step_raw(request)
        history.record(request, "ack", 0.0)
    return history


def test_an_honest_history_is_exact(server: ServerProcess) -> None:
    with CacheClient(server.target, session=False) as client:
        verdict = check(client, [_history(client, "honest", 30)])
    assert verdict.exact and verdict.acknowledged == 30, verdict.explain()


def test_a_step_applied_twice_is_caught(server: ServerProcess) -> None:
    with CacheClient(server.target, session=False) as client:
        history = _history(client, "twice", 20)
        add = pb.StepRequest(pool_id="twice", ops=[ops.add("t", list(range(20))),
                                                   ops.allocate("t", 20)])
        decode = pb.StepRequest(pool_id="twice", ops=[ops.append("t", [1]),
                                                      ops.allocate("t", 1)])
        for request in (add, decode):
            client.step_raw(request)
            history.record(request, "ack", 0.0)
        client.step_raw(decode)  # applied again, acknowledged once
        verdict = check(client, [history])
    assert verdict.duplicated >= 1 and not verdict.exact, verdict.explain()


def test_an_acknowledged_step_that_is_not_there_is_caught(server: ServerProcess) -> None:
    with CacheClient(server.target, session=False) as client:
        history = _history(client, "lost", 20)
        history.record(pb.StepRequest(pool_id="lost", ops=[  # never sent
            ops.add("ghost", list(range(20))), ops.allocate("ghost", 20)]), "ack", 0.0)
        verdict = check(client, [history])
    assert verdict.lost >= 1 and not verdict.exact, verdict.explain()


def test_a_step_in_doubt_may_have_been_applied_or_not(server: ServerProcess) -> None:
    with CacheClient(server.target, session=False) as client:
        applied = _history(client, "doubt-applied", 10)
        applied.steps[-1].outcome = "doubt"
        not_applied = _history(client, "doubt-not", 10)
        not_applied.record(pb.StepRequest(pool_id="doubt-not", ops=[  # never sent
            ops.add("ghost", list(range(20))), ops.allocate("ghost", 20)]), "doubt", 0.0)
        verdict = check(client, [applied, not_applied])
    assert verdict.exact and verdict.in_doubt == 2, verdict.explain()
