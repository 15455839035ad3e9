"""Eviction classes and release hints over gRPC Steps (AddRequestOp.eviction_class,
FreeOp.evict_first) against the session's real server: a class-1 prefix survives class-0
traffic that evicts it in a plain pool, a hinted free is evicted first, and a bad class is
refused naming the field with nothing applied."""

from __future__ import annotations

import pytest

from cache_service.client import AllocateResult, CacheClient, CacheError, StepBuilder

from .builders import full_layers

PREFIX = list(range(1, 130))  # 8 blocks of 16 can hit


def _run(client: CacheClient, pool: str, rid: str, tokens: list[int], *, cls: int = 0,
         hint: bool = False) -> None:
    step = client.step_batch(StepBuilder(pool).add(rid, tokens, eviction_class=cls)
                             .allocate(rid, len(tokens)))
    assert step.result(1, AllocateResult).ok
    client.step_batch(StepBuilder(pool).free(rid, evict_first=hint))


@pytest.fixture
def pool_pair(client: CacheClient):
    names = ["policy-plain", "policy-tuned"]
    for name in names:
        client.register_pool(name, full_layers(), num_blocks=129, max_model_len=1024)
    yield names
    for name in names:
        client.delete_pool(name)


def test_a_higher_class_prefix_survives_default_traffic(client: CacheClient,
                                                        pool_pair: list[str]) -> None:
    plain, tuned = pool_pair
    _run(client, plain, "s", PREFIX)
    _run(client, tuned, "s", PREFIX, cls=1)
    for pool in pool_pair:
        for i in range(4):  # 4 x 63 blocks of class-0 traffic through 128 blocks
            _run(client, pool, f"x{i}", [1000 + i] * 1000)
    assert [client.peek_prefix([p], PREFIX)[p] for p in pool_pair] == [0, 128]


def test_a_hinted_free_is_evicted_first(client: CacheClient, pool_pair: list[str]) -> None:
    plain, tuned = pool_pair
    for pool in pool_pair:
        _run(client, pool, "old", list(range(500, 629)))  # freed first: LRU's victim
        _run(client, pool, "new", PREFIX, hint=pool == tuned)
        _run(client, pool, "fill", [7] * 1000)  # 63 of the 128 blocks: evicts the front
    peek = {p: (client.peek_prefix([p], PREFIX)[p],
                client.peek_prefix([p], list(range(500, 629)))[p]) for p in pool_pair}
    assert peek[plain] == (128, 128)  # 63 blocks came from the never-used ones
    # With the hint, the hinted request's blocks were handed out before any other.
    assert peek[tuned] == (0, 128)


def test_an_eviction_class_out_of_range_is_refused_naming_the_field(
        client: CacheClient, pool_pair: list[str]) -> None:
    pool = pool_pair[0]
    with pytest.raises(CacheError) as err:
        client.step_batch(StepBuilder(pool).add("a", [1, 2, 3]).add("b", [4], eviction_class=16))
    assert err.value.field == "ops[1].add_request.eviction_class"
    assert client.stats(pool).num_requests == 0


def test_a_free_in_vllm_deferred_order_releases_the_last_group_tail_first(
        client: CacheClient) -> None:
    # Full attention and a (never exceeded) sliding window, 4-token blocks, 4 usable
    # blocks: r holds [[1, 2], [3, 4]]
    # (cached). Group by group, the free queue becomes 2, 1, 4, 3 (each table tail first);
    # in vLLM's deferred order 4, 3, 2, 1 (the concatenation, last first). The next
    # request's one block per group shows which came first.
    from cache_service.client import layers

    got = {}
    for deferred in (False, True):
        pool = f"deferred-{deferred}"
        client.register_pool(pool, [
            layers.full_attention("full", block_size=4, num_kv_heads=1, head_size=4),
            layers.sliding_window("swa", block_size=4, num_kv_heads=1, head_size=4,
                                  sliding_window=64)],
            num_blocks=5, max_model_len=64, skip_capacity_check=True)
        try:
            step = client.step_batch(StepBuilder(pool).add("r", list(range(9))).allocate("r", 8))
            assert step.result(1, AllocateResult).block_ids == [[1, 2], [3, 4]]
            client.step_batch(StepBuilder(pool).free("r", tail_first_across_groups=deferred))
            step = client.step_batch(StepBuilder(pool).add("s", [50, 51, 52]).allocate("s", 3))
            got[deferred] = step.result(1, AllocateResult).block_ids
        finally:
            client.delete_pool(pool)
    assert got == {False: [[2], [1]], True: [[4], [3]]}
