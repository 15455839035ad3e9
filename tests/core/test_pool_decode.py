"""``Pool.decode``: the batched decode step equals the per-request append + allocate loop
(results, tables, statistics, events), and bad input changes nothing."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_service.core.errors import InvalidArgument, KVCacheError, UnknownRequest
from cache_service.core.kv_cache_manager import BlockCopy
from cache_service.core.operations import Allocate, AppendTokens, Op
from cache_service.core.pool import Pool

from builders import SAMPLE_CONFIGS, full, make_pool, snapshot_with_events, swa, twin_pools


def loop_decode(pool: Pool, rids: list[str], tokens: list[int]
                ) -> tuple[list[bool], dict, list[BlockCopy]]:
    """The reference: append + allocate per request in one batch, as a generic Step would
    (copy-on-write copies keep their blocks until the batch ends)."""
    ops: list[Op] = []
    for rid, token in zip(rids, tokens):
        ops += [AppendTokens(rid, [token]), Allocate(rid, 1, include_table=False)]
    ok, grown, copies = [], {}, []
    for i, r in enumerate(pool.apply_batch(ops)[1::2]):
        ok.append(r.ok)
        if r.ok and r.new_block_ids and any(r.new_block_ids):
            grown[i] = r.new_block_ids
        copies += r.block_copies
    return ok, grown, copies


@pytest.mark.parametrize("name", SAMPLE_CONFIGS)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.data_too_large])
@given(data=st.data())
def test_decode_equals_append_then_allocate(name: str, data: st.DataObject) -> None:
    fast, ref = twin_pools(name)
    limit = fast.options.max_model_len
    for step in range(12):
        # Admissions (some only added: WAITING requests take the general path), then a
        # decode of a random subset; pools this small run out, so some answers are "no".
        for _ in range(data.draw(st.integers(0, 2))):
            rid = f"r{step}-{len(fast.request_ids())}"
            prompt = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=20))
            admit = data.draw(st.booleans(), label="admit")
            for pool in (fast, ref):
                pool.add_request(rid, prompt)
                if admit:
                    pool.lookup(rid)
                    pool.allocate(rid, len(prompt))
        if data.draw(st.booleans(), label="preempt") and fast.request_ids():
            victim = data.draw(st.sampled_from(sorted(fast.request_ids())))
            fast.preempt(victim)
            ref.preempt(victim)
        live = [r for r in sorted(fast.request_ids()) if fast.num_tokens(r) < limit]
        if not live:
            continue
        rids = data.draw(st.lists(st.sampled_from(live), min_size=1, unique=True))
        tokens = data.draw(st.lists(st.integers(0, 5), min_size=len(rids),
                                    max_size=len(rids)))
        fast.new_step()
        ref.new_step()
        result = fast.decode(rids, tokens)
        assert (result.ok, result.new_block_ids, result.block_copies) == \
            loop_decode(ref, rids, tokens)
        assert snapshot_with_events(fast) == snapshot_with_events(ref)
        fast.check_invariants()


def test_decode_reports_only_requests_that_got_blocks() -> None:
    pool = make_pool(64, full(4), swa(4, window=32), max_model_len=64)
    for rid, n in (("a", 3), ("b", 4), ("c", 8)):
        pool.add_request(rid, list(range(n)))
        pool.allocate(rid, n)
    free = pool.num_free_blocks
    result = pool.decode(["a", "b", "c"], [9, 9, 9])
    assert result.ok == [True, True, True]
    # a: 4 tokens fit its block; b and c cross into a new block in both groups.
    assert sorted(result.new_block_ids) == [1, 2]
    assert all(len(tables) == 2 and all(len(g) == 1 for g in tables)
               for tables in result.new_block_ids.values())
    assert pool.num_free_blocks == free - 4
    assert [pool.num_tokens(r) for r in "abc"] == [4, 5, 9]
    assert [pool.request_info(r).num_computed_tokens for r in "abc"] == [4, 5, 9]
    for i, rid in ((1, "b"), (2, "c")):  # the new blocks end the request's tables
        assert [t[-1:] for t in pool.block_ids(rid)] == result.new_block_ids[i]


def test_decode_without_room_answers_no_for_that_request() -> None:
    pool = make_pool(4, full(4), max_model_len=64)  # 3 usable blocks
    pool.add_request("a", [1] * 4)
    pool.allocate("a", 4)
    pool.add_request("b", [2] * 8)
    pool.allocate("b", 8)
    result = pool.decode(["a", "b"], [5, 6])
    assert result.ok == [False, False] and result.new_block_ids == {}
    assert pool.stats().allocation_failures == 2
    assert pool.num_tokens("a") == 5  # the token stays appended, as with allocate
    assert pool.request_info("a").num_computed_tokens == 4


@pytest.mark.parametrize("rids, tokens, error, field", [
    (["a", "zz"], [1, 1], UnknownRequest, "request_ids[1]"),
    (["a", "a"], [1, 1], InvalidArgument, "request_ids[1]"),
    (["a", "b"], [1], InvalidArgument, "token_ids"),
    (["a", "b"], [1, -1], InvalidArgument, "token_ids[1]"),
    (["a", "b"], [1, 1.0], InvalidArgument, "token_ids[1]"),
    (["a", "full"], [1, 1], InvalidArgument, "token_ids[1]"),
    ([], [], InvalidArgument, "request_ids"),
    ("ab", [1, 1], InvalidArgument, "request_ids"),
    (["a", ["b"]], [1, 1], InvalidArgument, "request_ids[1]"),
])
def test_bad_decode_names_the_field_and_changes_nothing(rids, tokens, error: type,
                                                        field: str) -> None:
    pool = make_pool(64, full(4), max_model_len=16)
    for rid, n in (("a", 3), ("b", 5), ("full", 16)):
        pool.add_request(rid, list(range(n)))
        pool.allocate(rid, n)
    pool.take_events()
    before = snapshot_with_events(pool)
    with pytest.raises(error) as exc:
        pool.decode(rids, tokens)
    assert isinstance(exc.value, KVCacheError) and exc.value.field == field
    assert snapshot_with_events(pool) == before


def test_request_queries() -> None:
    pool = make_pool(16, full(4), max_model_len=64)
    assert not pool.has_request("a") and pool.num_free_blocks == 15
    pool.add_request("a", [1, 2, 3, 4, 5])
    pool.allocate("a", 5)
    assert pool.has_request("a") and pool.num_tokens("a") == 5
    assert pool.num_free_blocks == pool.stats().num_free_blocks == 13
    with pytest.raises(UnknownRequest):
        pool.num_tokens("b")
