"""What a StepStream step that got no answer means (``cache_service/client/_retry.py``,
:class:`StepResends`, the one place both clients' streams ask): no I/O, so the outcomes are
built as the streams see them (the status a gRPC call ended with is a real
``grpc.aio.AioRpcError``; the blocking stream's ``grpc.RpcError`` answers the same
``code()`` / ``details()`` / ``trailing_metadata()``)."""

from __future__ import annotations

import grpc
import pytest

from cache_service.client import CacheError
from cache_service.client._retry import NoAnswer, StepResends
from cache_service.client._routing import Moved, Routes
from kvcache_common.backoff import Backoff
from kvcache_common.redirect import OWNER_ADDRESS_KEY

A, B = "127.0.0.1:1", "127.0.0.1:2"


def status(code: grpc.StatusCode, details: str = "", trailers: tuple = ()) -> grpc.RpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers),
                                details)


def resends(max_retries: int = 2, seeds: str = A) -> tuple[StepResends, list]:
    told: list[tuple[str, int]] = []
    routes = Routes(seeds, lambda address: address)
    return StepResends(routes, "p", 1.5, max_retries, Backoff(0.01, 0.02),
                       lambda reason, attempt: told.append((reason, attempt))), told


def test_a_missed_deadline_is_resent_at_once_and_a_lost_stream_after_a_backoff() -> None:
    steps, told = resends()
    assert steps.after(NoAnswer.TIMED_OUT, A) == 0.0  # the wait already passed
    assert 0.005 <= steps.after(NoAnswer.ENDED, A) <= 0.02
    assert told == [("deadline_exceeded", 1), ("unavailable", 2)]
    with pytest.raises(CacheError) as spent:  # max_retries resends, no more
        steps.after(status(grpc.StatusCode.UNAVAILABLE, "gone"), A)
    assert spent.value.code == grpc.StatusCode.UNAVAILABLE and len(told) == 2


def test_the_errors_name_what_happened() -> None:
    for outcome, code, message in (
            (NoAnswer.TIMED_OUT, grpc.StatusCode.DEADLINE_EXCEEDED,
             "no StepStream answer within 1.5 s"),
            (NoAnswer.ENDED, grpc.StatusCode.UNAVAILABLE, "StepStream ended")):
        steps, _ = resends(max_retries=0)
        with pytest.raises(CacheError) as err:
            steps.after(outcome, A)
        assert (err.value.code, err.value.message) == (code, message)


def test_an_error_status_ends_the_step_without_a_resend() -> None:
    steps, told = resends()
    with pytest.raises(CacheError) as err:
        steps.after(status(grpc.StatusCode.INVALID_ARGUMENT, "ops[0]: bad"), A)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and told == []


def test_a_redirect_moves_the_step_to_the_owner_it_names() -> None:
    steps, told = resends()
    with pytest.raises(Moved) as moved:
        steps.after(status(grpc.StatusCode.UNAVAILABLE, "not mine",
                           ((OWNER_ADDRESS_KEY, B),)), A)
    assert moved.value.redirect and steps.routes.address("p") == B and told == []


def test_an_unavailable_replica_is_given_up_for_the_next_seed() -> None:
    steps, told = resends(seeds=f"{A},{B}")
    with pytest.raises(Moved) as moved:
        steps.after(status(grpc.StatusCode.UNAVAILABLE, "draining"), A)
    assert not moved.value.redirect and steps.routes.address("p") == B and told == []
    # With one replica there is nowhere else: the step is resent to it.
    alone, told = resends()
    assert alone.after(status(grpc.StatusCode.UNAVAILABLE, "draining"), A) > 0
    assert told == [("unavailable", 1)]
