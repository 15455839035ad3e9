"""Account block quotas inside a pool: beyond its quota an account's allocations answer "no
room" while other accounts' still succeed; usage follows allocations, window releases,
preemption and frees."""

from __future__ import annotations

from cache_service.core.operations import AddRequest, Allocate, Decode, Free, Preempt

from builders import full, make_pool, swa


def held(pool, rid: str) -> int:
    return sum(1 for ids in pool.block_ids(rid) for b in ids if b)


def test_an_account_beyond_its_quota_gets_no_room_and_others_do_not_notice() -> None:
    pool = make_pool(100, full(4), max_model_len=256, account_block_quota=10)
    pool.apply_batch([AddRequest("a1", [1] * 24, account="A"), Allocate("a1", 24),  # 6
                      AddRequest("a2", [2] * 16, account="A"),
                      AddRequest("b1", [3] * 20, account="B")])
    assert pool.account_blocks("A") == 6
    a2, b1 = pool.apply_batch([Allocate("a2", 16), Allocate("b1", 20)])
    assert a2.ok and b1.ok and (pool.account_blocks("A"), pool.account_blocks("B")) == (10, 5)
    pool.apply_batch([AddRequest("a3", [4] * 4, account="A")])
    (a3,) = pool.apply_batch([Allocate("a3", 4)])
    assert not a3.ok and pool.stats().quota_refusals == 1
    assert pool.num_free_blocks > 50  # the pool had room: the quota said no
    # Decode: a1 needs a 7th block (A is at its quota), b1 a 6th (B is not).
    outcome = pool.apply_batch([Decode(["a1", "b1"], [5, 6])])[0]
    assert outcome.ok == [False, True]
    assert (pool.account_blocks("A"), pool.account_blocks("B")) == (10, 6)
    stats = pool.stats()
    assert (stats.account_block_quota, stats.quota_refusals, stats.max_account_blocks) == \
        (10, 2, 10)
    # Freeing and preempting give room back.
    pool.apply_batch([Free("a2")])
    assert pool.account_blocks("A") == held(pool, "a1") == 6
    assert pool.apply_batch([Allocate("a3", 4)])[0].ok
    pool.apply_batch([Preempt("a1")])
    assert pool.account_blocks("A") == held(pool, "a3") == 1


def test_usage_follows_sliding_window_releases() -> None:
    pool = make_pool(200, swa(4, 8), max_model_len=512, account_block_quota=6)
    pool.apply_batch([AddRequest("r", [1] * 8, account=""), Allocate("r", 8)])
    for _ in range(40):  # decode far past the window: old blocks are released
        assert pool.apply_batch([Decode(["r"], [2])])[0].ok == [True]
        assert pool.account_blocks("") == held(pool, "r") <= 6
    pool.apply_batch([Free("r")])
    assert pool.account_blocks("") == 0 and pool.stats().max_account_blocks == 0
