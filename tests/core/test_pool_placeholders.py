"""Placeholder tokens: slots allocated before the token ids are known, filled one call later
(an engine overlapping its next Step with the running forward pass). A run that fills every
placeholder one call later makes the same allocations and ends with the same cache as the
run that knew the tokens; bad input names the field and changes nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_service.core.errors import InvalidArgument, KVCacheError
from cache_service.core.operations import (
    Allocate,
    AppendTokens,
    Decode,
    FillPlaceholders,
    Free,
    Preempt,
)
from cache_service.core.pool import Pool

from builders import SAMPLE_CONFIGS, full, make_pool, snapshot, snapshot_with_events, twin_pools


def cached_blocks(pool: Pool) -> set[tuple[int, bytes, int]]:
    """(group, block hash, block id) of every cached block."""
    out = set()
    for gid, blocks in enumerate(pool.manager.pool._maps):
        for h, entry in blocks.items():
            for block in (entry.values() if isinstance(entry, dict) else [entry]):
                out.add((gid, h, block.block_id))
    return out


@dataclass
class Gen:
    """A request of the simulated engine: its prompt and the tokens it will generate."""

    prompt: list[int]
    outputs: list[int]
    decoded: int = 0  # tokens appended so far (known or placeholder)
    state: str = "waiting"  # waiting | new | running | failed (no room last step) | done

    def known(self) -> list[int]:
        return self.prompt + self.outputs[:self.decoded]


# With lookahead hashing a block's hash waits for the token after it too, which in the
# lagging run is a placeholder one call longer: its blocks are cached a call later, as in
# vLLM under async scheduling (its hasher reads only known tokens). Not the same per call.
SYNC_LIKE_CONFIGS = [name for name in SAMPLE_CONFIGS if "_la" not in name]


@pytest.mark.parametrize("name", SYNC_LIKE_CONFIGS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.data_too_large])
@given(data=st.data())
def test_placeholders_filled_one_call_later_converge(name: str, data: st.DataObject) -> None:
    sync, lag = twin_pools(name)
    limit = sync.options.max_model_len
    reqs: dict[str, Gen] = {}
    # Generated tokens come from their own range, so no prompt can hit a block that holds a
    # generated token only one of the runs has cached yet; prompts share prefixes.
    prefixes = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1], [2, 2, 2, 2, 2, 2, 2, 2]]
    stores: dict[str, list[Any]] = {"sync": [], "lag": []}

    def take_events() -> None:
        for key, pool in (("sync", sync), ("lag", lag)):
            stores[key] += [e.block_hashes for e in pool.take_events()
                            if type(e).__name__ == "BlockStored"]

    for step in range(14):
        # The lagging run learns last step's sampled tokens now: fill them first.
        fills = [(rid, g.outputs[g.decoded - 1]) for rid, g in reqs.items()
                 if g.state in ("running", "failed") and g.decoded
                 and lag.request_info(rid).num_placeholder_tokens]
        head: list[Any] = []
        if fills:
            head.append(FillPlaceholders([r for r, _ in fills], [t for _, t in fills]))
        # Finished requests are freed, requests left without room are preempted, and a
        # random running one may be too.
        tail: list[Any] = []
        for rid, g in reqs.items():
            if g.state in ("running", "failed") and g.decoded == len(g.outputs):
                tail.append(Free(rid))
                g.state = "done"
            elif g.state == "failed":
                tail.append(Preempt(rid))
                g.state = "waiting"
        running = [r for r, g in reqs.items() if g.state == "running"]
        preempt: bool = data.draw(st.booleans(), label="preempt")
        if running and preempt:
            victim = data.draw(st.sampled_from(running))
            tail.append(Preempt(victim))
            reqs[victim].state = "waiting"
        assert sync.apply_batch(tail, begin_step=True) == lag.apply_batch(head + tail,
                                                                          begin_step=True)[
            len(head):]
        # Admissions: new requests, then waiting ones, each a lookup and the rest computed.
        for _ in range(data.draw(st.integers(0, 2), label="new")):
            rid = f"r{step}-{len(reqs)}"
            prompt = data.draw(st.sampled_from(prefixes)) + data.draw(
                st.lists(st.integers(0, 3), min_size=1, max_size=10))
            outputs = data.draw(st.lists(st.integers(10, 13), min_size=1,
                                         max_size=limit - len(prompt)))
            reqs[rid] = Gen(prompt, outputs)
            assert sync.add_request(rid, prompt) == lag.add_request(rid, prompt)
        for rid, g in reqs.items():
            if g.state != "waiting":
                continue
            hit = sync.lookup(rid)
            assert hit == lag.lookup(rid)
            n = len(g.known()) - hit.hit_tokens
            a, b = sync.allocate(rid, n), lag.allocate(rid, n)
            assert a == b
            if a.ok:
                g.state = "new"
            else:
                sync.preempt(rid)  # FCFS: the rest wait too
                lag.preempt(rid)
                break
        # The decode of every request that ran last step.
        live = [r for r, g in reqs.items() if g.state == "running"]
        if live:
            tokens = [reqs[r].outputs[reqs[r].decoded] for r in live]
            a = sync.apply_batch([Decode(live, tokens)])[0]
            b = lag.apply_batch([Decode(live, [], placeholders=True)])[0]
            assert (a.ok, a.new_block_ids) == (b.ok, b.new_block_ids)
            for rid, ok in zip(live, a.ok):
                reqs[rid].decoded += 1
                if not ok:
                    reqs[rid].state = "failed"
        for g in reqs.values():
            if g.state == "new":
                g.state = "running"
        for rid in sync.request_ids():
            assert sync.block_ids(rid) == lag.block_ids(rid)
        take_events()
        lag.check_invariants()
    # The end: the lagging run fills its last placeholders, then everything is freed.
    fills = [(rid, g.outputs[g.decoded - 1]) for rid, g in reqs.items()
             if g.state != "done" and lag.has_request(rid)
             and lag.request_info(rid).num_placeholder_tokens]
    if fills:
        lag.fill_placeholders([r for r, _ in fills], [t for _, t in fills])
    for rid in sync.request_ids():
        sync.free(rid)
        lag.free(rid)
    take_events()
    assert snapshot(sync) == snapshot(lag)
    assert cached_blocks(sync) == cached_blocks(lag)
    assert sorted(map(tuple, stores["sync"])) == sorted(map(tuple, stores["lag"]))


def test_a_block_is_cached_only_once_its_last_placeholder_is_filled() -> None:
    pool = make_pool(32, full(4), max_model_len=64)
    other = make_pool(32, full(4), max_model_len=64)
    pool.add_request("a", [1, 2, 3])
    pool.allocate("a", 3)
    pool.take_events()
    pool.decode(["a"], [], placeholders=True)  # token 3 of the first block: unknown
    info = pool.request_info("a")
    assert (info.num_tokens, info.num_placeholder_tokens, info.num_computed_tokens) == (4, 1, 4)
    assert pool.block_hashes("a") == [] and pool.take_events() == []
    # A lookup of the same prefix does not hit the block whose last token is a placeholder.
    pool.add_request("b", [1, 2, 3, 4, 5])
    assert pool.lookup("b").hit_tokens == 0
    pool.fill_placeholders(["a"], [4])
    stored = pool.take_events()
    assert [type(e).__name__ for e in stored] == ["BlockStored"]
    assert pool.request_info("a").num_placeholder_tokens == 0
    assert pool.lookup("b").hit_tokens == 4
    # The same block as when the token was known at allocation.
    other.add_request("a", [1, 2, 3])
    other.allocate("a", 3)
    other.decode(["a"], [4])
    assert other.block_hashes("a") == pool.block_hashes("a")
    assert cached_blocks(other) == cached_blocks(pool)


def test_a_finished_request_frees_its_unused_placeholder_slot() -> None:
    pool = make_pool(8, full(4), max_model_len=64)
    pool.add_request("a", [1, 2, 3, 4])
    pool.allocate("a", 4)
    result = pool.decode(["a"], [], placeholders=True)  # the slot for token 4: a new block
    assert result.new_block_ids == {0: [[2]]}
    assert pool.num_free_blocks == 5
    pool.free("a")  # it finished: the placeholder is never filled
    assert pool.num_free_blocks == 7
    pool.check_invariants()


def test_preempted_request_is_admitted_again_once_filled() -> None:
    pool = make_pool(16, full(4), max_model_len=64)
    pool.add_request("a", [1, 2, 3])
    pool.allocate("a", 3)
    pool.decode(["a"], [], placeholders=True)
    pool.preempt("a")
    assert pool.request_info("a").num_placeholder_tokens == 1
    with pytest.raises(InvalidArgument) as exc:
        pool.lookup("a")
    assert exc.value.field == "request_id"
    pool.fill_placeholders(["a"], [9])
    assert pool.lookup("a").hit_tokens == 0  # its block was never cached: 9 came too late
    assert pool.allocate("a", 4).ok
    assert pool.request_info("a").num_computed_tokens == 4


def _pool_with_requests() -> Pool:
    pool = make_pool(64, full(4), max_model_len=16)
    pool.add_request("a", [1, 2, 3])
    pool.allocate("a", 3)
    pool.decode(["a"], [], placeholders=True)  # a: 4 tokens, the last a placeholder
    pool.add_request("b", [1, 2, 3, 4, 5])
    pool.allocate("b", 2)  # b: in prefill
    pool.add_request("w", [7, 7])  # w: waiting
    pool.add_request("f", list(range(16)))  # max_model_len
    pool.allocate("f", 16)
    return pool


@pytest.mark.parametrize("op, field", [
    (FillPlaceholders(["a", "a"], [1, 2]), "ops[0].fill_placeholders.token_ids[1]"),
    (FillPlaceholders(["b"], [1]), "ops[0].fill_placeholders.token_ids[0]"),
    (FillPlaceholders(["a", "zz"], [1, 1]), "ops[0].fill_placeholders.request_ids[1]"),
    (FillPlaceholders(["a"], [1, 2]), "ops[0].fill_placeholders.token_ids"),
    (FillPlaceholders(["a"], [-1]), "ops[0].fill_placeholders.token_ids[0]"),
    (FillPlaceholders([], []), "ops[0].fill_placeholders.request_ids"),
    (Decode(["b"], [], placeholders=True), "ops[0].decode.request_ids[0]"),
    (Decode(["w"], [], placeholders=True), "ops[0].decode.request_ids[0]"),
    (Decode(["a"], [5], placeholders=True), "ops[0].decode.token_ids"),
    (Decode(["a"], [5]), "ops[0].decode.token_ids[0]"),
    (Decode(["a", "b"], [], placeholders=True), "ops[0].decode.request_ids[1]"),
    (Decode(["f"], [], placeholders=True), "ops[0].decode.request_ids[0]"),  # too long
    (Allocate("b", 1, num_placeholder_tokens=1), "ops[0].allocate.num_placeholder_tokens"),
    (Allocate("w", 1, num_placeholder_tokens=1), "ops[0].allocate.num_placeholder_tokens"),
    (Allocate("a", 1, num_placeholder_tokens=-1), "ops[0].allocate.num_placeholder_tokens"),
    (Allocate("a", 1, num_placeholder_tokens=13), "ops[0].allocate.num_placeholder_tokens"),
    (Allocate("a", 1, append_token_ids=[5]), "ops[0].allocate.append_token_ids"),
    (AppendTokens("a", [5]), "ops[0].append_tokens.token_ids"),
])
def test_bad_placeholder_input_names_the_field_and_changes_nothing(op: Any,
                                                                    field: str) -> None:
    pool = _pool_with_requests()
    pool.take_events()
    before = snapshot_with_events(pool)
    with pytest.raises(KVCacheError) as exc:
        pool.apply_batch([op])
    assert exc.value.field == field
    assert snapshot_with_events(pool) == before


def test_a_batch_simulates_placeholders() -> None:
    """Fill then append in one batch is fine; a fill later in the batch than the append is
    not (the append would land behind a placeholder), and the batch changes nothing."""
    pool = _pool_with_requests()
    pool.apply_batch([FillPlaceholders(["a"], [4]), AppendTokens("a", [5])])
    assert pool.request_info("a").num_tokens == 5
    pool.add_request("g", [1, 2])
    pool.allocate("g", 2)
    # g may take two placeholders (two forward passes in flight).
    pool.apply_batch([Decode(["g"], [], placeholders=True),
                      Decode(["g"], [], placeholders=True)])
    assert pool.request_info("g").num_placeholder_tokens == 2
    before = snapshot(pool)
    with pytest.raises(InvalidArgument) as exc:
        pool.apply_batch([FillPlaceholders(["g"], [3]), AppendTokens("g", [1]),
                          FillPlaceholders(["g"], [2])])
    assert exc.value.field == "ops[1].append_tokens.token_ids"
    assert snapshot(pool) == before
