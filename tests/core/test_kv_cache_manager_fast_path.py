"""The no-op fast path of ``KVCacheManager.allocate_slots`` (a running request's token that
fits its tables) changes nothing observable: random decode sequences on twin pools, one
with the fast path off, give the same answers, tables, free-queue order, statistics and
KV events, for every sample config (scaled down so that windows slide, Mamba states move,
blocks fill, get cached and evicted) and a mixed-block-size variant of each."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_service.core.pool import Pool

from builders import SAMPLE_CONFIGS, SMALL_BLOCK, snapshot_with_events, twin_pools

CASES = [(name, mixed) for name in SAMPLE_CONFIGS for mixed in (False, True)]


def fast_and_general(name: str, mixed: bool) -> tuple[Pool, Pool]:
    """Twin pools (``builders.twin_pools``), the second with the fast path off."""
    fast, general = twin_pools(name, mixed=mixed)
    general.manager.fast_path = False
    return fast, general


@pytest.mark.parametrize("name, mixed", CASES)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.data_too_large])
@given(data=st.data())
def test_fast_path_equals_general_path(name: str, mixed: bool, data: st.DataObject) -> None:
    fast, general = fast_and_general(name, mixed)
    limit = fast.options.max_model_len
    n_added = 0
    for _ in range(30):
        for _ in range(data.draw(st.integers(0, 1), label="admissions")):
            rid = f"r{n_added}"
            n_added += 1
            prompt = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=24),
                               label="prompt")
            for pool in (fast, general):
                pool.add_request(rid, prompt)
                pool.lookup(rid)
                pool.allocate(rid, len(prompt))
        action = data.draw(st.sampled_from(["decode", "decode", "decode", "preempt", "free"]),
                           label="action")
        live = sorted(fast.request_ids())
        if action != "decode" and live:
            victim = data.draw(st.sampled_from(live), label="victim")
            for pool in (fast, general):
                getattr(pool, action)(victim)
            continue
        rids = [r for r in live if fast.num_tokens(r) < limit]
        if not rids:
            continue
        rids = data.draw(st.lists(st.sampled_from(rids), min_size=1, unique=True), label="rids")
        tokens = data.draw(st.lists(st.integers(0, 3), min_size=len(rids), max_size=len(rids)),
                           label="tokens")
        for pool in (fast, general):
            pool.new_step()
        got = fast.decode(rids, tokens)
        want = general.decode(rids, tokens)
        assert (got.ok, got.new_block_ids) == (want.ok, want.new_block_ids)
        assert snapshot_with_events(fast) == snapshot_with_events(general)
        fast.check_invariants()
    assert snapshot_with_events(fast) == snapshot_with_events(general)


@pytest.mark.parametrize("name, mixed", CASES)
def test_fast_path_is_taken_by_long_decodes(name: str, mixed: bool) -> None:
    """Not vacuous: in every config a long decode mostly takes the fast path."""
    fast, general = fast_and_general(name, mixed)
    for pool in (fast, general):
        pool.add_request("a", [1, 2, 3])
        pool.allocate("a", 3)
    for token in range(60):
        for pool in (fast, general):
            pool.new_step()
            assert pool.decode(["a"], [token % 3]).ok == [True]
        assert snapshot_with_events(fast) == snapshot_with_events(general)
    assert fast.manager.fast_path_answers >= 20
    assert general.manager.fast_path_answers == 0


def test_fast_path_is_taken_inside_a_block_and_not_across() -> None:
    """A decode inside the last block is answered by the fast path; the token that
    opens a new block, or completes one that gets hashed, is not."""
    fast, general = fast_and_general("full", False)
    for pool in (fast, general):
        pool.add_request("a", [1] * (SMALL_BLOCK + 1))
        pool.allocate("a", SMALL_BLOCK + 1)
    seen = []
    for token in range(2 * SMALL_BLOCK):
        before = fast.manager.fast_path_answers
        for pool in (fast, general):
            pool.decode(["a"], [token])
        seen.append(fast.manager.fast_path_answers - before)
        assert snapshot_with_events(fast) == snapshot_with_events(general)
    # Per block, the token that completes it (it gets hashed) and the one that opens
    # the next (a block is allocated) take the general path; the others the fast one.
    n = SMALL_BLOCK + 1
    expected = []
    for _ in range(2 * SMALL_BLOCK):
        n += 1  # tokens after the append; the new token's slot is n - 1
        opens = (n - 1) % SMALL_BLOCK == 0
        completes = n % SMALL_BLOCK == 0
        expected.append(0 if opens or completes else 1)
    assert seen == expected
