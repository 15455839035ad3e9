"""End to end, on loopback, real processes: one cache service (session), executors started as
``python -m executor`` subprocesses, driven through gRPC."""

from __future__ import annotations

import pytest

from cache_service.client import CacheClient
from executor.client import ExecutorClient
from executor.presets import PRESETS

from paged_helpers import run_concurrently, shared_prefix_workload, start_executor

MAX_TOKENS = 6


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_prefix_caching_changes_no_output_and_hits(cache_service, preset: str) -> None:
    prompts = shared_prefix_workload(6, prefix_len=110, seed=len(preset))
    on = start_executor(cache_service.target, "--preset", preset)
    off = start_executor(cache_service.target, "--preset", preset, "--enable-prefix-caching", "false")
    try:
        # the first request alone warms the cache, then the rest arrive together
        first_on = run_concurrently(on.target, prompts[:1], MAX_TOKENS)
        rest_on = run_concurrently(on.target, prompts[1:], MAX_TOKENS)
        first_off = run_concurrently(off.target, prompts[:1], MAX_TOKENS)
        rest_off = run_concurrently(off.target, prompts[1:], MAX_TOKENS)
        with_cache, without = first_on + rest_on, first_off + rest_off
        assert [g.token_ids for g in with_cache] == [g.token_ids for g in without]
        assert all(len(g.token_ids) == MAX_TOKENS and g.finish_reason == "length" for g in with_cache)
        assert sum(g.cached_tokens for g in without) == 0
        assert sum(g.cached_tokens for g in rest_on) > 0, [g.cached_tokens for g in with_cache]
        assert all(g.prompt_tokens == len(p) for g, p in zip(with_cache, prompts))
        with ExecutorClient(on.target) as c:
            pool_id = c.info().pool_id
        with CacheClient(cache_service.target) as cc:
            stats = cc.stats(pool_id)
        assert stats.prefix_cache_hits > 0
        assert stats.num_requests == 0  # every request was freed
    finally:
        on.stop()
        off.stop()
    assert on.returncode == 0 and off.returncode == 0


def test_preemption_keeps_outputs_identical(cache_service) -> None:
    """A pool far too small for the batch: requests get preempted and recomputed, and the
    tokens are the same as with plenty of room."""
    prompts = shared_prefix_workload(6, prefix_len=60, seed=7)
    roomy = start_executor(cache_service.target, "--preset", "hybrid-fsm")
    tight = start_executor(cache_service.target, "--preset", "hybrid-fsm", "--num-blocks", "24",
                           "--max-model-len", "160")
    try:
        ref = run_concurrently(roomy.target, prompts, 12)
        got = run_concurrently(tight.target, prompts, 12)
    finally:
        roomy.stop()
        tight.stop()
    assert [g.token_ids for g in got] == [g.token_ids for g in ref]
    assert sum(g.num_preemptions for g in got) > 0
    assert sum(g.num_preemptions for g in ref) == 0


def test_two_executors_do_not_share_blocks(cache_service) -> None:
    prompts = shared_prefix_workload(3, prefix_len=120, seed=11)
    a = start_executor(cache_service.target, "--preset", "gemma3-like", "--pool-id", "iso-a")
    b = start_executor(cache_service.target, "--preset", "gemma3-like", "--pool-id", "iso-b")
    try:
        first_a = run_concurrently(a.target, prompts[:1], 4)
        second_a = run_concurrently(a.target, prompts[1:2], 4)
        # b has never seen the prefix: no hit, although a's pool caches it
        first_b = run_concurrently(b.target, prompts[1:2], 4)
        second_b = run_concurrently(b.target, prompts[2:3], 4)
    finally:
        a.stop()
        b.stop()
    assert second_a[0].cached_tokens >= 96
    assert first_b[0].cached_tokens == 0
    assert second_b[0].cached_tokens >= 96
    assert first_b[0].token_ids == second_a[0].token_ids  # same model, same prompt
    with CacheClient(cache_service.target) as cc:
        ids = {p.pool_id for p in cc.list_pools()}
        assert {"iso-a", "iso-b"} <= ids
        assert cc.stats("iso-a").prefix_cache_hits > 0
        assert first_a[0].cached_tokens == 0
