"""Pool facade: results, validation before mutation, lookups, stats."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from cache_service.core.errors import (
    ConfigError,
    DuplicateRequest,
    FailedPrecondition,
    InvalidArgument,
    UnknownRequest,
)
from cache_service.core.events import BlockStored
from cache_service.core.hashing import DeclaredRecipe, get_hash_fn, hash_request_tokens
from cache_service.core.pool import Pool

from builders import full, make_pool, snapshot, swa


def test_lifecycle(small_full_pool: Pool) -> None:
    p = small_full_pool
    info = p.add_request("a", list(range(10)))
    assert (info.num_tokens, info.num_block_hashes, info.status) == (10, 2, "WAITING")
    assert p.lookup("a").hit_tokens == 0
    res = p.allocate("a", 10)
    assert res.ok and res.new_block_ids == [[1, 2, 3]] and res.block_ids == [[1, 2, 3]]
    assert res.num_computed_tokens == 10 and p.request_info("a").status == "RUNNING"
    p.append_tokens("a", [10, 11])
    assert p.request_info("a").num_block_hashes == 3
    assert p.allocate("a", 1).new_block_ids == [[]]
    assert p.free("a") == 63 and p.request_ids() == []
    p.check_invariants()


def test_prefix_hit_and_stats(small_full_pool: Pool) -> None:
    p = small_full_pool
    p.add_request("a", list(range(10)))
    p.allocate("a", 10)
    p.add_request("b", list(range(10)) + [99])
    look = p.lookup("b")
    assert look.hit_tokens == 8 and look.block_ids == [[1, 2]]
    res = p.allocate("b", 3)
    assert res.hit_tokens_used == 8 and res.num_computed_tokens == 11
    assert res.block_ids is not None and res.block_ids[0][:2] == [1, 2]
    s = p.stats()
    assert (s.prefix_requests, s.prefix_queries, s.prefix_hits) == (2, 21, 8)
    assert s.num_cached_blocks == 2 and s.num_requests == 2
    p.check_invariants()


def test_preempt_and_readmit_hits_own_blocks(small_full_pool: Pool) -> None:
    p = small_full_pool
    p.add_request("a", list(range(13)))
    p.allocate("a", 13)
    assert p.preempt("a") == 63
    info = p.request_info("a")
    assert (info.num_computed_tokens, info.status, info.num_preemptions) == (0, "PREEMPTED", 1)
    assert p.block_ids("a") == [[]]
    assert p.lookup("a").hit_tokens == 12
    assert p.allocate("a", 1).ok
    s = p.stats()
    assert (s.preempted_prefix_requests, s.preempted_prefix_hits, s.preemptions) == (1, 12, 1)


def test_stale_lookup_is_redone(small_full_pool: Pool) -> None:
    p = small_full_pool
    p.add_request("a", list(range(9)))
    p.allocate("a", 9)
    p.free("a")
    p.add_request("b", list(range(9)))
    assert p.lookup("b").hit_tokens == 8
    assert p.reset_prefix_cache()  # the looked-up blocks are no longer cached
    res = p.allocate("b", 9)
    assert res.ok and res.hit_tokens_used == 0 and res.num_computed_tokens == 9
    p.check_invariants()


def test_no_room_is_a_result_not_an_error() -> None:
    p = make_pool(4, full(4), max_model_len=64)  # 3 usable blocks
    p.add_request("a", list(range(20)))
    res = p.allocate("a", 20)
    assert not res.ok and res.new_block_ids is None and res.num_computed_tokens == 0
    assert p.stats().allocation_failures == 1 and p.request_info("a").status == "WAITING"


def test_peek_prefix_is_read_only(small_full_pool: Pool) -> None:
    p = small_full_pool
    p.add_request("a", list(range(12)), cache_salt="x")
    p.allocate("a", 12)
    before = snapshot(p)
    assert p.peek_prefix(list(range(12)) + [5], cache_salt="x") == 12
    assert p.peek_prefix(list(range(12)) + [5]) == 0  # different salt, different chain
    hashes = hash_request_tokens(get_hash_fn("sha256"), list(range(12)), 4, cache_salt="x")
    assert p.peek_prefix(block_hashes=hashes[:2]) == 8
    assert snapshot(p) == before


def test_client_block_hashes_equal_server_hashing(small_full_pool: Pool) -> None:
    p = small_full_pool
    tokens = list(range(9))
    hashes = hash_request_tokens(get_hash_fn("sha256"), tokens, 4)
    p.add_request("a", tokens, block_hashes=hashes)
    p.add_request("b", tokens)
    assert p.block_hashes("a") == p.block_hashes("b") == hashes


def test_events_are_taken_once(small_full_pool: Pool) -> None:
    p = small_full_pool
    p.add_request("a", list(range(8)))
    p.allocate("a", 8)
    events = p.take_events()
    assert [type(e) for e in events] == [BlockStored]
    assert isinstance(events[0], BlockStored) and events[0].spec_kind == "full_attention"
    assert p.take_events() == []


def test_reset_fails_while_blocks_are_used(small_full_pool: Pool) -> None:
    p = small_full_pool
    p.add_request("a", list(range(8)))
    p.allocate("a", 8)
    assert not p.reset_prefix_cache() and p.stats().num_cached_blocks == 2
    p.free("a")
    assert p.reset_prefix_cache() and p.stats().num_cached_blocks == 0


BAD_CALLS = [
    (lambda p: p.add_request("a", [1, 2]), DuplicateRequest, "request_id"),
    (lambda p: p.add_request("", [1]), InvalidArgument, "request_id"),
    (lambda p: p.add_request("n", []), InvalidArgument, "token_ids"),
    (lambda p: p.add_request("n", [1, -1]), InvalidArgument, "token_ids[1]"),
    (lambda p: p.add_request("n", [1, 2**31]), InvalidArgument, "token_ids[1]"),
    (lambda p: p.add_request("n", [1, "x"]), InvalidArgument, "token_ids[1]"),
    (lambda p: p.add_request("n", [1, True]), InvalidArgument, "token_ids[1]"),
    (lambda p: p.add_request("n", [1] * 257), InvalidArgument, "token_ids"),
    (lambda p: p.add_request("n", [1] * 8, block_hashes=[b"x" * 32]), InvalidArgument,
     "block_hashes"),
    (lambda p: p.add_request("n", [1] * 8, block_hashes=[b"x" * 32, b"y"]), InvalidArgument,
     "block_hashes[1]"),
    (lambda p: p.add_request("n", [1], cache_salt=5), InvalidArgument, "cache_salt"),
    (lambda p: p.append_tokens("zz", [1]), UnknownRequest, "request_id"),
    (lambda p: p.append_tokens("a", []), InvalidArgument, "token_ids"),
    (lambda p: p.append_tokens("a", [1] * 250), InvalidArgument, "token_ids"),
    (lambda p: p.lookup("zz"), UnknownRequest, "request_id"),
    (lambda p: p.lookup("a"), FailedPrecondition, "request_id"),
    (lambda p: p.allocate("zz", 1), UnknownRequest, "request_id"),
    (lambda p: p.allocate("b", 0, use_lookup=False), InvalidArgument, "num_new_tokens"),
    (lambda p: p.allocate("b", -3), InvalidArgument, "num_new_tokens"),
    (lambda p: p.allocate("b", 1.5), InvalidArgument, "num_new_tokens"),
    (lambda p: p.allocate("b", 1, num_lookahead_tokens=-1), InvalidArgument,
     "num_lookahead_tokens"),
    (lambda p: p.free("zz"), UnknownRequest, "request_id"),
    (lambda p: p.preempt("zz"), UnknownRequest, "request_id"),
    (lambda p: p.block_ids("zz"), UnknownRequest, "request_id"),
    (lambda p: p.peek_prefix(), InvalidArgument, "token_ids"),
    (lambda p: p.peek_prefix([1, 2], block_hashes=[b"x" * 32]), InvalidArgument,
     "block_hashes"),
    (lambda p: p.evict_blocks([1, 64]), InvalidArgument, "block_ids[1]"),
]


@pytest.mark.parametrize("call,error,field", BAD_CALLS)
def test_bad_input_raises_and_changes_nothing(small_full_pool: Pool, call, error, field) -> None:
    p = small_full_pool
    p.add_request("a", list(range(10)))
    p.allocate("a", 10)
    p.add_request("b", list(range(10)) + [7])
    p.lookup("b")  # a pending lookup is part of the state too
    before = snapshot(p)
    with pytest.raises(error) as info:
        call(p)
    assert info.value.field == field
    assert snapshot(p) == before
    p.check_invariants()


@pytest.mark.parametrize("kwargs", [
    {"watermark": 1.5}, {"hash_algo": "md5"}, {"vocab_size": 0}, {"max_in_flight_tokens": 0},
])
def test_bad_options_raise(kwargs) -> None:
    with pytest.raises(InvalidArgument):
        make_pool(8, full(4), **kwargs)


def test_vocab_size_bounds_token_ids() -> None:
    p = make_pool(8, full(4), vocab_size=100)
    with pytest.raises(InvalidArgument, match=r"token_ids\[0\]"):
        p.add_request("a", [100])
    assert p.add_request("a", [99]).num_tokens == 1


def test_invalid_group_mix_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        make_pool(8, full(4), swa(3, 8), scheduler_block_size=4)


def test_cross_attention_is_sized_by_encoder_tokens() -> None:
    from builders import cross_attention

    p = make_pool(32, full(4), cross_attention(4), enable_caching=False)
    p.add_request("a", list(range(6)))
    res = p.allocate("a", 6, num_encoder_tokens=10)
    assert [len(g) for g in res.new_block_ids] == [2, 3]
    res = p.allocate("a", 3)  # encoder input already allocated: nothing new for it
    assert [len(g) for g in res.new_block_ids] == [1, 0]
    assert p.free("a") == 31
    p.check_invariants()


def test_allocate_without_tables(small_full_pool: Pool) -> None:
    p = small_full_pool
    p.add_request("a", list(range(10)))
    res = p.allocate("a", 10, include_tables=False)
    assert res.ok and res.block_ids is None and res.new_block_ids == [[1, 2, 3]]
    assert p.block_ids("a") == [[1, 2, 3]]


LORA_VECTORS = [c for c in json.loads(resources.files("cache_service.core").joinpath(
    "hash_vectors.json").read_text("utf-8"))["cases"]
    if c["lora_name"] and not ({"mm_items", "prompt_embeds", "lookahead"} & c.keys())]


@pytest.mark.parametrize("case", LORA_VECTORS, ids=lambda c: f"{c['algo']}-{c['name']}")
def test_lora_requests_hash_like_vllm(case: dict) -> None:
    """vLLM hashes ("lora", name, path): a request with the adapter's path must reproduce
    its golden vectors, and the same prompt without the path must not."""
    assert case["lora_path"]
    p = make_pool(256, full(case["hash_block_size"]), hash_algo=case["algo"])
    extra = dict(lora_name=case["lora_name"], cache_salt=case["cache_salt"])
    p.add_request("a", case["tokens"], lora_path=case["lora_path"], **extra)
    assert [h.hex() for h in p.block_hashes("a")] == case["expected"]
    p.add_request("no-path", case["tokens"], **extra)
    assert p.block_hashes("no-path")[0].hex() != case["expected"][0]
    # Appended tokens chain from the same keys; peek_prefix hashes with them too.
    p.allocate("a", len(case["tokens"]))
    assert p.peek_prefix(case["tokens"] + [1], lora_path=case["lora_path"], **extra) \
        == len(case["expected"]) * case["hash_block_size"]
    assert p.peek_prefix(case["tokens"] + [1], **extra) == 0


def test_lora_path_needs_a_lora_name(small_full_pool: Pool) -> None:
    p = small_full_pool
    before = snapshot(p)
    with pytest.raises(InvalidArgument) as exc:
        p.add_request("a", [1, 2, 3], lora_path="/adapters/x")
    assert exc.value.field == "lora_path" and snapshot(p) == before
    with pytest.raises(InvalidArgument):
        p.peek_prefix([1, 2, 3], lora_path="/adapters/x")


def test_max_in_flight_tokens_bounds_one_allocate() -> None:
    p = make_pool(64, full(4), max_model_len=256, max_in_flight_tokens=8)
    p.add_request("a", list(range(20)))
    before = snapshot(p)
    with pytest.raises(InvalidArgument) as err:
        p.allocate("a", 9)
    assert err.value.field == "num_new_tokens" and snapshot(p) == before
    assert p.max_new_tokens == 8 and p.allocate("a", 8).ok


def test_hash_recipe_check_names_the_differing_field(small_full_pool: Pool) -> None:
    recipe = small_full_pool.hash_recipe
    assert (recipe.hash_algo, recipe.none_hash_seed, recipe.hash_block_size) == \
        ("sha256", "vllm-none-hash", 4)
    small_full_pool.check_hash_recipe(
        DeclaredRecipe(hash_algo="sha256", none_hash=recipe.none_hash))
    with pytest.raises(InvalidArgument) as err:
        small_full_pool.check_hash_recipe(DeclaredRecipe(hash_algo="sha256", hash_block_size=16))
    assert err.value.field == "hash_block_size"
