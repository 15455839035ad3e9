"""Long work cut into slices (so the service can serve others in between) ends exactly where
the one-piece call does: a decode op applied in slices, and a prefix peek hashed in slices."""

from __future__ import annotations

from collections.abc import Generator
from typing import TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service.core.errors import InvalidArgument, KVCacheError
from cache_service.core.operations import AddRequest, Allocate, Decode, Free

from builders import full, make_pool, swa

T = TypeVar("T")


def drive(gen: Generator[None, None, T]) -> tuple[T, int]:
    """Runs a generator to its end: (its value, how many times it yielded)."""
    yields = 0
    while True:
        try:
            next(gen)
            yields += 1
        except StopIteration as done:
            return done.value, yields


def two_pools():
    return [make_pool(400, full(4), swa(4, 8), max_model_len=512) for _ in range(2)]


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 9), st.lists(st.integers(1, 30), min_size=40, max_size=40),
       st.integers(2, 12))
def test_a_batch_applied_in_slices_equals_the_one_piece_batch(slice_cost: int,
                                                               prompts: list[int],
                                                               steps: int) -> None:
    whole, sliced = two_pools()
    rids = [f"r{i}" for i in range(len(prompts))]
    setup = [op for i, n in enumerate(prompts)
             for op in (AddRequest(rids[i], [i % 5] * n), Allocate(rids[i], n))]
    for pool in (whole, sliced):
        pool.apply_batch(setup)
    for step in range(steps):
        # A decode op bigger than a slice, and small ops around it.
        batch = [Free(rids[step]), Decode(rids[step + 1:], [step % 3] * (len(rids) - step - 1)),
                 AddRequest(f"n{step}", [7] * 9)]
        a = whole.prepare_batch(batch, begin_step=True).apply()
        b, yields = drive(sliced.prepare_batch(batch, begin_step=True)
                          .apply_in_slices(slice_cost))
        assert a == b
        assert yields >= (len(rids) - step - 1) // slice_cost
        assert whole.stats() == sliced.stats()
        assert whole.take_events() == sliced.take_events()
        live = rids[step + 1:]
        assert [whole.block_ids(r) for r in live] == [sliced.block_ids(r) for r in live]
    sliced.check_invariants()


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 7), st.integers(0, 300), st.sampled_from([None, "salt"]),
       st.sampled_from([None, "lora"]))
def test_a_peek_hashed_in_slices_equals_the_one_piece_peek(slice_blocks: int, length: int,
                                                           salt: str | None,
                                                           lora: str | None) -> None:
    pool = make_pool(400, full(4), max_model_len=512)
    prompt = [t % 11 for t in range(200)]
    pool.apply_batch([AddRequest("cached", prompt, cache_salt=salt, lora_name=lora),
                      Allocate("cached", len(prompt))])
    query = (prompt + [3] * 400)[:max(1, length)]
    expected = pool.peek_prefix(query, cache_salt=salt, lora_name=lora)
    hit, yields = drive(pool.peek_prefix_in_slices(query, cache_salt=salt, lora_name=lora,
                                                   slice_blocks=slice_blocks))
    assert hit == expected
    assert yields == max(0, -(-len(query) // (slice_blocks * 4)) - 1)  # 4-token blocks
    if length > 8:
        assert expected == min(len(query) - 1, 200) // 4 * 4  # the shared prefix is found


def test_a_bad_token_in_a_late_slice_is_named_by_its_index() -> None:
    pool = make_pool(400, full(4), max_model_len=512, vocab_size=100)
    for bad in (-5, 100):
        with pytest.raises(InvalidArgument) as err:
            drive(pool.peek_prefix_in_slices([1] * 1000 + [bad] + [2] * 50, slice_blocks=2))
        assert err.value.field == "token_ids[1000]"


@pytest.mark.parametrize("bad", ["unknown", "full"])
def test_a_bad_request_in_a_late_slice_rejects_the_whole_batch(bad: str) -> None:
    pool = make_pool(400, full(4), max_model_len=64)
    rids = [f"r{i}" for i in range(80)]
    pool.apply_batch([op for rid in rids for op in (AddRequest(rid, [1] * 8),
                                                     Allocate(rid, 8))])
    if bad == "full":  # r70 reaches max_model_len: one more token is too many
        pool.apply_batch([Allocate("r70", 56, append_token_ids=[2] * 56)])
        ids, field = rids, "ops[0].decode.token_ids[70]"
    else:
        ids, field = rids[:70] + ["ghost"] + rids[70:], "ops[0].decode.request_ids[70]"
    before = (pool.stats(), [pool.block_ids(r) for r in rids])
    with pytest.raises(KVCacheError) as err:
        drive(pool.prepare_batch_in_slices([Decode(ids, [3] * len(ids))], slice_cost=8))
    assert err.value.field == field
    assert (pool.stats(), [pool.block_ids(r) for r in rids]) == before


@pytest.mark.parametrize(("salt", "lora"), [(None, None), ("s", "adapter")])
def test_a_long_prompt_is_admitted_in_slices_exactly_as_in_one_piece(salt, lora) -> None:
    prompt = [t % 97 for t in range(3000)]
    whole, sliced = (make_pool(2000, full(4), swa(4, 8), max_model_len=4096) for _ in "ab")
    batch = [AddRequest("p", prompt, cache_salt=salt, lora_name=lora), Allocate("p", 3000),
             AddRequest("q", prompt[:2500], cache_salt=salt, lora_name=lora)]
    a = whole.apply_batch(batch)
    prepared, yields = drive(sliced.prepare_batch_in_slices(batch, slice_cost=8))
    b, _ = drive(prepared.apply_in_slices(8))
    # Copied 128 tokens (8 units of 16) and hashed 8 blocks (32 tokens) at a time: ~215
    # slices.
    assert a == b and yields >= 5500 // 32
    assert whole.take_events() == sliced.take_events()
    assert whole.request_info("q") == sliced.request_info("q")
    assert whole.peek_prefix(prompt, cache_salt=salt, lora_name=lora) == \
        sliced.peek_prefix(prompt, cache_salt=salt, lora_name=lora) > 2000
    with pytest.raises(InvalidArgument) as err:
        drive(sliced.prepare_batch_in_slices(
            [AddRequest("x", [1] * 5), AddRequest("y", [1] * 2999 + [-1])], slice_cost=8))
    assert err.value.field == "ops[1].add_request.token_ids[2999]"
