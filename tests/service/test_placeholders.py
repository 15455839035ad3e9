"""Placeholder tokens over real gRPC: a pool driven with placeholders filled one call later
ends like its twin driven with known tokens; bad placeholder input rejects the whole Step
naming the field; a --data-dir server killed with placeholders outstanding recovers them."""

from __future__ import annotations

import signal
from pathlib import Path

import grpc
import pytest

from cache_service.client import CacheClient, CacheError, DecodeResult, FillResult, ops
from kvcache_common.launch import start_cache_service

from .builders import hybrid_layers
from .test_decode import comparable_stats, request_state


def test_placeholders_filled_one_call_later_end_like_known_tokens(client: CacheClient,
                                                                  new_pool) -> None:
    kwargs = dict(num_blocks=64, max_model_len=256)
    known = new_pool(hybrid_layers(), **kwargs).pool_id
    lag = new_pool(hybrid_layers(), **kwargs).pool_id
    rids = ["a", "b", "c"]
    prompts = [[1] * 20, [1] * 20 + [2] * 5, [3] * 9]
    for pool in (known, lag):
        client.step(pool, [op for rid, p in zip(rids, prompts)
                           for op in (ops.add(rid, p), ops.allocate(rid, len(p)))])
    outputs = [[7 + (i + j) % 3 for j in range(30)] for i in range(3)]
    for step in range(30):
        tokens = [out[step] for out in outputs]
        want = client.step(known, [ops.decode(rids, tokens)], begin_step=True)
        lag_ops = [ops.fill(rids, [out[step - 1] for out in outputs])] if step else []
        got = client.step(lag, lag_ops + [ops.decode(rids, placeholders=True)],
                          begin_step=True)
        a = want.result(0, DecodeResult)
        b = got.result(len(lag_ops), DecodeResult)
        assert (a.ok, a.new_block_ids) == (b.ok, b.new_block_ids)
        if lag_ops:
            assert got.result(0, FillResult).num_filled == 3
    lag_state = client.get_request(lag, "a")
    assert (lag_state.num_tokens, lag_state.num_placeholder_tokens) == (50, 1)
    client.step(lag, [ops.fill(rids, [out[-1] for out in outputs])])
    assert request_state(client, lag, rids) == request_state(client, known, rids)
    for pool in (known, lag):
        client.step(pool, [ops.free(rid) for rid in rids])
    assert comparable_stats(client, lag)[:-1] == comparable_stats(client, known)[:-1]


@pytest.mark.parametrize("bad, field", [
    (ops.fill(["a", "a"], [1, 2]), "ops[1].fill_placeholders.token_ids[1]"),
    (ops.fill(["a"], [1, 2]), "ops[1].fill_placeholders.token_ids"),
    (ops.fill(["w"], [1]), "ops[1].fill_placeholders.token_ids[0]"),
    (ops.decode(["w"], placeholders=True), "ops[1].decode.request_ids[0]"),
    (ops.decode(["a"], [3], placeholders=True), "ops[1].decode.token_ids"),
    (ops.decode(["a"], [3]), "ops[1].decode.token_ids[0]"),
    (ops.allocate("a", 1, append_token_ids=[3]), "ops[1].allocate.append_token_ids"),
    (ops.allocate("p", 1, num_placeholder_tokens=1), "ops[1].allocate.num_placeholder_tokens"),
    (ops.lookup("pre"), "ops[1].lookup.request_id"),
])
def test_bad_placeholder_input_names_the_field_and_changes_nothing(
        client: CacheClient, new_pool, bad, field: str) -> None:
    pool = new_pool(num_blocks=64, max_model_len=256).pool_id
    client.step(pool, [ops.add("a", [1] * 5), ops.allocate("a", 5),   # a: in decode
                       ops.add("p", [1] * 9), ops.allocate("p", 4),   # p: in prefill
                       ops.add("w", [2] * 3),                         # w: waiting
                       ops.add("pre", [3] * 4), ops.allocate("pre", 4),
                       ops.add("q", [4] * 5), ops.allocate("q", 5)])
    client.step(pool, [ops.decode(["a", "pre", "q"], placeholders=True), ops.preempt("pre")])
    rids = ["a", "p", "w", "pre", "q"]
    before = (request_state(client, pool, rids), comparable_stats(client, pool))
    with pytest.raises(CacheError) as exc:
        client.step(pool, [ops.fill(["q"], [4]), bad])  # a valid op first: undone too
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.field == field
    assert (request_state(client, pool, rids), comparable_stats(client, pool)) == before


def test_placeholders_survive_a_kill_of_a_durable_server(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    flags = ("--data-dir", str(data_dir), "--fsync", "always")
    with start_cache_service(*flags) as server, CacheClient(server.target) as c:
        c.register_pool("p", hybrid_layers(), num_blocks=64, max_model_len=256)
        c.step("p", [ops.add("a", [1] * 15), ops.allocate("a", 15)])
        c.step("p", [ops.decode(["a"], placeholders=True)])  # token 15 ends block 0
        before = c.get_request("p", "a")
        server.signal(signal.SIGKILL)
        server.proc.wait(timeout=30)
    assert before.num_placeholder_tokens == 1
    with start_cache_service(*flags) as server, CacheClient(server.target) as c:
        assert c.get_request("p", "a") == before
        assert c.stats("p").num_cached_blocks == 0
        c.step("p", [ops.fill(["a"], [9])])  # the recovered placeholder takes its id
        assert c.get_request("p", "a").num_placeholder_tokens == 0
        assert c.stats("p").num_cached_blocks > 0
