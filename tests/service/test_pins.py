"""Prefix pins over gRPC (PinPrefix / RenewPin / DropPin, cache_service/pins.py) against
real servers: a pinned prefix survives traffic that evicts it without the pin, pins show
in PeekPrefix, GetPoolStats and /metrics, die with their session unless asked to outlive
it, expire at their TTL, and come back exactly after a SIGKILL and a restart on the data
directory. Bad calls answer an error naming the field and change nothing."""

from __future__ import annotations

import re
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from cache_service.client import AllocateResult, CacheClient, CacheError, StepBuilder
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.api.kvcache.v1 import cache_service_pb2_grpc as pb_grpc
from kvcache_common.launch import ServerProcess, start_cache_service

from .builders import full_layers

SYSTEM = list(range(1, 130))  # 129 tokens: 8 blocks of 16 can hit
NUM_BLOCKS = 129  # 128 usable; one 1024-token request needs 64


def _run(client: CacheClient, pool: str, rid: str, tokens: list[int]) -> None:
    step = client.step_batch(StepBuilder(pool).add(rid, tokens).allocate(rid, len(tokens)))
    assert step.result(1, AllocateResult).ok
    client.step_batch(StepBuilder(pool).free(rid))


def _flood(client: CacheClient, pool: str, start: int = 1000) -> None:
    """Fresh one-shot traffic that cycles the whole pool twice."""
    for i in range(4):
        _run(client, pool, f"flood{start + i}", [start + i] * 1000)


def _hit(stub: pb_grpc.CacheServiceStub, pool: str, tokens: list[int]) -> pb.PoolHit:
    return stub.PeekPrefix(pb.PeekPrefixRequest(pool_ids=[pool], token_ids=tokens)).hits[0]


def _stats(stub: pb_grpc.CacheServiceStub, pool: str) -> pb.PoolStats:
    return stub.GetPoolStats(pb.GetPoolStatsRequest(pool_id=pool)).stats


def _pin(stub: pb_grpc.CacheServiceStub, pool: str, pin_id: str, tokens: list[int], *,
         ttl: float = 600.0, **kwargs) -> pb.PinInfo:
    return stub.PinPrefix(pb.PinPrefixRequest(pool_id=pool, pin_id=pin_id, token_ids=tokens,
                                              ttl_seconds=ttl, **kwargs)).pin


def _error(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


@pytest.fixture
def pools(client: CacheClient) -> Iterator[Callable[..., str]]:
    made: list[str] = []

    def make(name: str, **options) -> str:
        client.register_pool(name, full_layers(), num_blocks=NUM_BLOCKS, max_model_len=1024,
                             **options)
        made.append(name)
        return name

    yield make
    for name in made:
        client.delete_pool(name)


def test_a_pinned_prefix_survives_a_flood_that_evicts_it_without_the_pin(
        client: CacheClient, stub: pb_grpc.CacheServiceStub, pools, server: ServerProcess
        ) -> None:
    plain, pinned = pools("pins-plain"), pools("pins-pinned")
    for pool in (plain, pinned):
        _run(client, pool, "sys", SYSTEM)
    before = time.time()
    pin = _pin(stub, pinned, "system-prompt", SYSTEM, ttl=600)
    assert (pin.prefix_tokens, pin.hit_tokens, pin.num_blocks, pin.growing) == (128, 128, 8,
                                                                                False)
    assert before + 600 <= pin.expires_at_unix_seconds <= time.time() + 600
    assert _hit(stub, pinned, SYSTEM).pinned_tokens == 128
    assert _hit(stub, plain, SYSTEM).pinned_tokens == 0
    stats = _stats(stub, pinned)
    assert (stats.num_pinned_blocks, stats.num_pins, stats.max_pinned_blocks) == (8, 1, 64)
    assert [(p.session_id_prefix, p.blocks) for p in stats.pinned_blocks] == [("", 8)]
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                  timeout=10).read().decode()
    assert re.search(rf'^kvcache_pool_pinned_blocks\{{pool="{pinned}"\}} 8\.0$', body, re.M)
    for pool in (plain, pinned):
        _flood(client, pool)
    assert _hit(stub, plain, SYSTEM).hit_tokens == 0
    assert _hit(stub, pinned, SYSTEM).hit_tokens == 128
    dropped = stub.DropPin(pb.DropPinRequest(pool_id=pinned, pin_id="system-prompt")).pin
    assert dropped.pin_id == "system-prompt" and dropped.num_blocks == 8
    assert _stats(stub, pinned).num_pinned_blocks == 0
    _flood(client, pinned, start=2000)
    assert _hit(stub, pinned, SYSTEM).hit_tokens == 0


def test_a_pin_on_a_prefix_not_computed_yet_holds_it_once_cached(
        client: CacheClient, stub: pb_grpc.CacheServiceStub, pools) -> None:
    pool = pools("pins-growing")
    pin = _pin(stub, pool, "p", SYSTEM)
    assert (pin.hit_tokens, pin.growing) == (0, True)
    _run(client, pool, "sys", SYSTEM)
    _flood(client, pool)
    assert _hit(stub, pool, SYSTEM).hit_tokens == 128
    renewed = stub.RenewPin(pb.RenewPinRequest(pool_id=pool, pin_id="p", ttl_seconds=60)).pin
    assert (renewed.hit_tokens, renewed.num_blocks, renewed.growing) == (128, 8, False)


def test_bad_pin_calls_name_the_field_and_change_nothing(
        client: CacheClient, stub: pb_grpc.CacheServiceStub, pools) -> None:
    pool = pools("pins-bad", max_pinned_blocks=10, session_pinned_block_quota=9)
    _run(client, pool, "sys", SYSTEM)
    _pin(stub, pool, "p", SYSTEM)
    other = [5000 + i for i in range(129)]
    _run(client, pool, "other", other)
    before = _stats(stub, pool)
    cases = {
        "ttl_seconds": lambda: _pin(stub, pool, "q", other, ttl=0),
        "pin_id": lambda: _pin(stub, pool, "p", other),
        "token_ids": lambda: _pin(stub, pool, "q", other),  # 8 + 8 > 10
        "session_id": lambda: _pin(stub, pool, "q", other, session_id="f" * 32),
        "outlive_session": lambda: _pin(stub, pool, "q", other, outlive_session=True),
        "pool_id": lambda: _pin(stub, "no-such-pool", "q", other),
    }
    codes = {}
    for field, call in cases.items():
        err = _error(call)
        assert err.details().startswith(field), (field, err.details())
        codes[field] = err.code()
    assert codes["token_ids"] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert codes["pin_id"] == grpc.StatusCode.ALREADY_EXISTS
    assert codes["ttl_seconds"] == grpc.StatusCode.INVALID_ARGUMENT
    err = _error(lambda: stub.DropPin(pb.DropPinRequest(pool_id=pool, pin_id="nope")))
    assert err.code() == grpc.StatusCode.NOT_FOUND and err.details().startswith("pin_id")
    err = _error(lambda: stub.RenewPin(pb.RenewPinRequest(pool_id=pool, pin_id="p",
                                                          ttl_seconds=-1)))
    assert err.details().startswith("ttl_seconds")
    after = _stats(stub, pool)
    assert after.num_pins == 1 and after.num_pinned_blocks == before.num_pinned_blocks
    assert after.pin_refusals == before.pin_refusals + 1  # the cap's (a statistic)
    with pytest.raises(CacheError) as bad:
        client.register_pool("pins-bad-opt", full_layers(), num_blocks=64, max_model_len=1024,
                             max_pinned_blocks=-1)
    assert bad.value.field == "options.max_pinned_blocks"


def test_pins_die_with_their_session_unless_they_outlive_it(server: ServerProcess) -> None:
    with CacheClient(server.target) as admin, grpc.insecure_channel(server.target) as ch:
        stub = pb_grpc.CacheServiceStub(ch)
        admin.register_pool("pins-owned", full_layers(), num_blocks=NUM_BLOCKS,
                            max_model_len=1024, session_pinned_block_quota=16)
        with CacheClient(server.target) as agent:
            _run(agent, "pins-owned", "sys", SYSTEM)
            sid = agent.session_id
            assert sid
            _pin(stub, "pins-owned", "dies", SYSTEM, session_id=sid)
            _pin(stub, "pins-owned", "lives", SYSTEM[:65], session_id=sid, outlive_session=True)
            stats = _stats(stub, "pins-owned")
            assert [(p.session_id_prefix, p.blocks) for p in stats.pinned_blocks] == [
                (sid[:8], 12)]
            err = _error(lambda: _pin(stub, "pins-owned", "over", SYSTEM, session_id=sid))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # 12 + 8 > 16
        # The client closed its session: "dies" went with it, "lives" stays to its TTL.
        stats = _stats(stub, "pins-owned")
        assert (stats.num_pins, stats.num_pinned_blocks) == (1, 4)
        assert stub.RenewPin(pb.RenewPinRequest(pool_id="pins-owned", pin_id="lives",
                                                ttl_seconds=5)).pin.hit_tokens == 64
        admin.delete_pool("pins-owned")


def test_a_pin_expires_at_its_ttl(client: CacheClient, stub: pb_grpc.CacheServiceStub,
                                  pools) -> None:
    pool = pools("pins-ttl")
    _run(client, pool, "sys", SYSTEM)
    pin = _pin(stub, pool, "short", SYSTEM, ttl=0.5)
    _pin(stub, pool, "long", SYSTEM[:33], ttl=600)
    deadline = time.monotonic() + 20
    while _stats(stub, pool).num_pins == 2:  # the reaper runs every 0.5 s
        assert time.monotonic() < deadline, "the pin did not expire"
        time.sleep(0.05)
    assert time.time() >= pin.expires_at_unix_seconds
    stats = _stats(stub, pool)
    assert (stats.num_pins, stats.num_pinned_blocks) == (1, 2)
    err = _error(lambda: stub.DropPin(pb.DropPinRequest(pool_id=pool, pin_id="short")))
    assert err.code() == grpc.StatusCode.NOT_FOUND


def test_a_release_hint_makes_a_closed_session_prefix_the_first_evicted(
        server: ServerProcess) -> None:
    with CacheClient(server.target) as admin, grpc.insecure_channel(server.target) as ch:
        stub = pb_grpc.CacheServiceStub(ch)
        admin.register_pool("pins-hint", full_layers(), num_blocks=NUM_BLOCKS,
                            max_model_len=1024)
        done = [list(range(1, 200)), list(range(300, 500))]  # 12 blocks each
        for i, tokens in enumerate(done):
            opened = stub.OpenSession(pb.OpenSessionRequest(client_name=f"s{i}"))
            sid = opened.session_id
            ops = StepBuilder("pins-hint").add(f"r{i}", tokens).allocate(f"r{i}", len(tokens))
            request = ops.request
            request.session_id, request.sequence = sid, 1
            stub.Step(request)
            # The first leaves with the hint, the second without.
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid, evict_first=(i == 0)))
        # 8 blocks of fresh traffic: the free queue's front is the hinted prefix.
        _run(admin, "pins-hint", "small", [7] * 128)
        assert _hit(stub, "pins-hint", done[0]).hit_tokens < 192
        assert _hit(stub, "pins-hint", done[1]).hit_tokens == 192
        admin.delete_pool("pins-hint")


def test_pins_survive_a_sigkill_and_a_restart_on_the_data_dir(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    server = start_cache_service("--data-dir", str(data_dir), "--fsync", "always")
    try:
        with CacheClient(server.target) as client, \
                grpc.insecure_channel(server.target) as ch:
            stub = pb_grpc.CacheServiceStub(ch)
            client.register_pool("p", full_layers(), num_blocks=NUM_BLOCKS, max_model_len=1024)
            _run(client, "p", "sys", SYSTEM)
            sid = client.session_id
            kept = _pin(stub, "p", "kept", SYSTEM, ttl=3600, session_id=sid,
                        outlive_session=True)
            growing = _pin(stub, "p", "growing", [9] * 40, ttl=3600)
            _pin(stub, "p", "dropped", SYSTEM[:33], ttl=3600)
            stub.DropPin(pb.DropPinRequest(pool_id="p", pin_id="dropped"))
            renewed = stub.RenewPin(pb.RenewPinRequest(pool_id="p", pin_id="kept",
                                                       ttl_seconds=1800)).pin
            before = _stats(stub, "p")
            server.signal(signal.SIGKILL)
            server.stop()
        assert server.returncode == -signal.SIGKILL
        server = start_cache_service("--data-dir", str(data_dir), "--fsync", "always")
        with CacheClient(server.target) as client, \
                grpc.insecure_channel(server.target) as ch:
            stub = pb_grpc.CacheServiceStub(ch)
            after = _stats(stub, "p")
            for name in ("num_pinned_blocks", "num_pins", "max_pinned_blocks",
                         "num_free_blocks", "pinned_blocks"):
                assert getattr(after, name) == getattr(before, name), name
            assert after.num_pins == 2
            again = stub.RenewPin(pb.RenewPinRequest(pool_id="p", pin_id="growing",
                                                     ttl_seconds=3600)).pin
            assert (again.hit_tokens, again.growing) == (growing.hit_tokens, True)
            _flood(client, "p")
            assert _hit(stub, "p", SYSTEM).pinned_tokens == 128
            err = _error(lambda: stub.DropPin(pb.DropPinRequest(pool_id="p",
                                                                pin_id="dropped")))
            assert err.code() == grpc.StatusCode.NOT_FOUND
            out = stub.DropPin(pb.DropPinRequest(pool_id="p", pin_id="kept")).pin
            assert out.expires_at_unix_seconds == renewed.expires_at_unix_seconds
            assert kept.expires_at_unix_seconds > renewed.expires_at_unix_seconds
    finally:
        server.stop()
