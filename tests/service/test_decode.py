"""The compact ``decode`` op over gRPC: it answers and changes exactly what the generic
per-request ops (``allocate`` with ``append_token_ids``) do, and a bad decode op rejects
its whole batch naming the field."""

from __future__ import annotations

import random

import grpc
import pytest

from cache_service.client import (
    AllocateResult,
    CacheClient,
    CacheError,
    DecodeResult,
    StepBuilder,
    ops,
)

from .builders import hybrid_layers


def request_state(client: CacheClient, pool_id: str, rids: list[str]) -> list:
    return [client.get_request(pool_id, rid) for rid in rids]


def comparable_stats(client: CacheClient, pool_id: str) -> tuple:
    s = client.stats(pool_id)
    return (s.num_free_blocks, s.num_cached_blocks, s.num_requests, s.prefix_cache_queries,
            s.prefix_cache_hits, s.evictions, s.allocation_failures, s.preemptions,
            s.num_cached_blocks_per_group, s.last_event_sequence)


def test_decode_op_equals_generic_allocate_ops(client: CacheClient, new_pool) -> None:
    """Twin pools, one driven by generic ops and one by decode ops, through admissions,
    frees in the same batch, a pool that runs out, and preemptions."""
    kwargs = dict(num_blocks=40, max_model_len=256)
    generic = new_pool(hybrid_layers(), **kwargs).pool_id
    compact = new_pool(hybrid_layers(), **kwargs).pool_id
    rng = random.Random(3)
    running: list[str] = []
    saw_no_room = saw_grown = False
    for step in range(40):
        # A step: free one finished request, decode the running ones, admit one more.
        head = [ops.free(running.pop(0))] if step % 7 == 6 else []
        tokens = [rng.randrange(50) for _ in running]
        rid = f"r{step}"
        prompt = [rng.randrange(50) for _ in range(rng.randrange(1, 40))]
        tail = [ops.add(rid, prompt), ops.allocate(rid, len(prompt))]
        per_request = [ops.allocate(r, 1, block_table=False, append_token_ids=[t])
                       for r, t in zip(running, tokens)]
        want = client.step(generic, head + per_request + tail, begin_step=True)
        got = client.step(compact, head + ([ops.decode(running, tokens)] if running else [])
                          + tail, begin_step=True)
        if running:
            decoded = got.results[len(head)]
            assert isinstance(decoded, DecodeResult)
            allocs = [want.result(len(head) + i, AllocateResult) for i in range(len(running))]
            assert decoded.ok == [a.ok for a in allocs]
            assert decoded.new_block_ids == {i: a.new_block_ids for i, a in enumerate(allocs)
                                             if a.ok and a.new_block_ids}
            saw_no_room |= not decoded.all_ok
            saw_grown |= bool(decoded.new_block_ids)
            # No room: preempt the requests that got none (the scheduler's answer).
            victims = [running[i] for i in decoded.failed]
            if victims:
                for pool in (generic, compact):
                    client.step(pool, [ops.preempt(v) for v in victims])
                running = [r for r in running if r not in victims]
        admitted = got.result(-1, AllocateResult).ok
        assert admitted == want.result(-1, AllocateResult).ok
        assert got.num_free_blocks == want.num_free_blocks
        if admitted:
            running.append(rid)
        ids = sorted(set(running) | {rid})
        assert request_state(client, compact, ids) == request_state(client, generic, ids)
        assert comparable_stats(client, compact) == comparable_stats(client, generic)
    assert saw_no_room and saw_grown  # the workload reached both interesting outcomes


def test_client_decode_helper_and_builder(client: CacheClient, new_pool) -> None:
    pool_id = new_pool(hybrid_layers()).pool_id
    batch = StepBuilder(pool_id, begin_step=True)
    for rid, n in (("a", 15), ("b", 16)):
        batch.add(rid, list(range(n))).allocate(rid, n)
    client.step_batch(batch)
    result = client.decode(pool_id, ["a", "b"], [7, 8], begin_step=True)
    assert result.ok == [True, True] and result.failed == []
    # "a" fills its block; "b" starts a new block in both groups (full, sliding window).
    assert list(result.new_block_ids) == [1]
    state = client.get_request(pool_id, "b")
    assert result.new_block_ids[1] == [t[-1:] for t in state.block_ids]
    assert (state.num_tokens, state.num_computed_tokens) == (17, 17)
    step = client.step_batch(StepBuilder(pool_id).decode(["b", "a"], [1, 2]))
    assert step.result(0, DecodeResult).ok == [True, True]
    assert client.get_request(pool_id, "a").num_computed_tokens == 17


@pytest.mark.parametrize("decode, code, field", [
    (ops.decode(["a", "nope"], [1, 2]), grpc.StatusCode.NOT_FOUND, "request_ids[1]"),
    (ops.decode(["a", "a"], [1, 2]), grpc.StatusCode.INVALID_ARGUMENT, "request_ids[1]"),
    (ops.decode(["a", "b"], [1]), grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
    (ops.decode(["a", "b"], [1, -2]), grpc.StatusCode.INVALID_ARGUMENT, "token_ids[1]"),
    (ops.decode([], []), grpc.StatusCode.INVALID_ARGUMENT, "request_ids"),
    # "gone" is freed by the op before; "long" reaches max_model_len with this token + 1.
    (ops.decode(["a", "gone"], [1, 2]), grpc.StatusCode.NOT_FOUND, "request_ids[1]"),
    (ops.decode(["long", "a"], [1, 2]), grpc.StatusCode.INVALID_ARGUMENT, "token_ids[0]"),
])
def test_a_bad_decode_op_rejects_the_whole_batch(client: CacheClient, new_pool, decode,
                                                 code: grpc.StatusCode, field: str) -> None:
    pool_id = new_pool(max_model_len=64).pool_id
    setup = StepBuilder(pool_id)
    for rid, n in (("a", 5), ("b", 5), ("gone", 5), ("long", 63)):
        setup.add(rid, list(range(n))).allocate(rid, n)
    client.step_batch(setup)
    ids = ["a", "b", "gone", "long"]
    before = request_state(client, pool_id, ids), comparable_stats(client, pool_id)
    batch = [ops.free("gone"), ops.append("long", [3]), decode]
    with pytest.raises(CacheError) as exc:
        client.step(pool_id, batch, begin_step=True)
    assert exc.value.code == code
    assert exc.value.field == f"ops[2].decode.{field}"
    assert (request_state(client, pool_id, ids), comparable_stats(client, pool_id)) == before


def test_decode_of_a_request_added_earlier_in_the_batch(client: CacheClient,
                                                        new_pool) -> None:
    pool_id = new_pool().pool_id
    got = client.step(pool_id, [ops.add("n", [1, 2, 3]), ops.allocate("n", 3),
                                ops.decode(["n"], [4])], begin_step=True)
    assert got.result(2, DecodeResult).ok == [True]
    assert client.get_request(pool_id, "n").num_computed_tokens == 4
    with pytest.raises(CacheError) as exc:  # decode leaves computed tokens: no lookup
        client.step(pool_id, [ops.add("m", [1, 2]), ops.decode(["m"], [3]), ops.lookup("m")])
    assert exc.value.field == "ops[2].lookup.request_id"
