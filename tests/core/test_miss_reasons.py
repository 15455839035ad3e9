"""Miss reasons: one test per cause, each built so that only that cause applies.

Every test caches a prompt for real (add, lookup, allocate, free) and then asks the pool
to explain a lookup (``prefix_residency(..., explain_misses=True)`` is what PeekPrefix
with ``explain`` runs; ``lookup(explain_misses=True)`` is the Step ``lookup`` op).
"""

from __future__ import annotations

import pytest

from cache_service.core.hashing import hash_request_tokens, sha256_pickle
from cache_service.core.pool import Pool
from cache_service.core.residency import MissReason

from builders import full, make_pool, mamba, swa

PROMPT = list(range(100, 117))  # 17 tokens: 4 full blocks of 4 are cacheable


def serve(pool: Pool, rid: str, tokens: list[int], *, first_chunk: int = 0, **keys) -> None:
    """One request's whole prefill (in one chunk, or ``first_chunk`` tokens then the
    rest), then free (its blocks stay cached)."""
    pool.add_request(rid, tokens, **keys)
    hit = pool.lookup(rid).hit_tokens
    if first_chunk:
        assert pool.allocate(rid, first_chunk - hit).ok
        pool.new_step()
        hit = first_chunk
    assert pool.allocate(rid, len(tokens) - hit).ok
    pool.free(rid)


def reasons(pool: Pool, tokens: list[int], **kwargs) -> list[tuple[int, MissReason | None]]:
    r = pool.prefix_residency(tokens, explain_misses=True, **kwargs)
    return [(g.tokens, g.reason) for g in r.groups]


def test_none_when_the_group_holds_all_it_could() -> None:
    pool = make_pool(32, full(4))
    serve(pool, "a", PROMPT)
    assert reasons(pool, PROMPT) == [(16, MissReason.NONE)]


def test_never_cached() -> None:
    pool = make_pool(32, full(4))
    serve(pool, "a", PROMPT)
    other = [1] * 17
    assert reasons(pool, other) == [(0, MissReason.NEVER_CACHED)]
    # A prompt that diverges after 2 blocks stops there, for the same reason.
    assert reasons(pool, PROMPT[:8] + [1] * 9) == [(8, MissReason.NEVER_CACHED)]


def test_evicted_by_allocation_pressure_with_how_long_ago() -> None:
    pool = make_pool(9, full(4))  # 8 usable blocks
    serve(pool, "a", PROMPT)  # 5 blocks, 4 cached
    pool.add_request("b", [1] * 32)
    assert pool.allocate("b", 32).ok  # takes all 8 blocks: evicts a's 4 cached ones
    r = pool.prefix_residency(PROMPT, explain_misses=True).groups[0]
    assert (r.tokens, r.reason) == (0, MissReason.EVICTED)
    # a's block 0 was evicted first (LRU by free order: tail first ... head last).
    assert 0 <= r.evicted_removals_ago < 4
    assert pool.stats().evictions == 4


def test_evicted_by_reset() -> None:
    pool = make_pool(32, full(4))
    serve(pool, "a", PROMPT)
    assert pool.reset_prefix_cache()
    assert reasons(pool, PROMPT) == [(0, MissReason.EVICTED)]


def test_different_salt() -> None:
    pool = make_pool(32, full(4))
    serve(pool, "a", PROMPT, cache_salt="tenant-a")
    assert reasons(pool, PROMPT) == [(0, MissReason.DIFFERENT_SALT_OR_LORA)]
    assert reasons(pool, PROMPT, cache_salt="tenant-b") == \
        [(0, MissReason.DIFFERENT_SALT_OR_LORA)]
    assert reasons(pool, PROMPT, cache_salt="tenant-a") == [(16, MissReason.NONE)]


def test_different_lora() -> None:
    pool = make_pool(32, full(4))
    serve(pool, "a", PROMPT, lora_name="sql", lora_path="/adapters/sql")
    # The same adapter name with another path hashes differently.
    assert reasons(pool, PROMPT, lora_name="sql", lora_path="/other/sql") == \
        [(0, MissReason.DIFFERENT_SALT_OR_LORA)]
    assert reasons(pool, PROMPT, lora_name="sql", lora_path="/adapters/sql") == \
        [(16, MissReason.NONE)]


@pytest.mark.parametrize(("window", "expected"), [
    # Hit alignment 8 (scheduler block size) over 4-token blocks: 12 tokens held by
    # every group, but only 8 are usable.
    (8, [(12, MissReason.CUT_TO_ALIGNMENT), (12, MissReason.CUT_TO_ALIGNMENT)]),
    # Window 4 (1 block) under alignment 8: the sliding-window group keeps only the
    # block that ends each aligned segment, so the block at tokens 8-12 exists for the
    # full group only.
    (4, [(12, MissReason.NONE), (8, MissReason.OUTSIDE_SLIDING_WINDOW)]),
], ids=["cut_to_alignment", "outside_sliding_window"])
def test_a_hit_under_alignment_8_names_why_each_group_stops(
        window: int, expected: list[tuple[int, MissReason]]) -> None:
    pool = make_pool(32, full(4), swa(4, window), scheduler_block_size=8)
    serve(pool, "a", PROMPT)
    r = pool.prefix_residency(PROMPT[:13], explain_misses=True)
    assert r.hit_tokens == 8
    assert [(g.tokens, g.reason) for g in r.groups] == expected


def test_no_mamba_checkpoint() -> None:
    # Chunks of 16 + 1 tokens: full attention caches 4 blocks, Mamba one state (where
    # the first chunk ended, at 16 tokens).
    pool = make_pool(32, full(4), mamba(4))
    serve(pool, "a", PROMPT, first_chunk=16)
    pool.new_step()
    r = pool.prefix_residency(PROMPT[:13], explain_misses=True)
    assert r.hit_tokens == 0
    assert [(g.tokens, g.reason) for g in r.groups] == \
        [(12, MissReason.NONE), (0, MissReason.NO_MAMBA_CHECKPOINT)]
    assert pool.prefix_residency(PROMPT).groups[1].checkpoints == [16]


def test_hash_recipe_mismatch() -> None:
    pool = make_pool(32, full(4), hash_algo="sha256_cbor")
    serve(pool, "a", PROMPT)
    wrong = hash_request_tokens(sha256_pickle, PROMPT, 4)  # another algorithm's hashes
    assert reasons(pool, PROMPT, block_hashes=wrong) == \
        [(0, MissReason.HASH_RECIPE_MISMATCH)]
    # The Step lookup op explains the same way for a request added with client hashes.
    pool.add_request("b", PROMPT, block_hashes=wrong)
    hit = pool.lookup("b", explain_misses=True)
    assert hit.hit_tokens == 0
    assert [(g.tokens, g.reason) for g in hit.groups] == \
        [(0, MissReason.HASH_RECIPE_MISMATCH)]


def test_lookup_without_explain_builds_nothing() -> None:
    pool = make_pool(32, full(4))
    serve(pool, "a", PROMPT)
    pool.add_request("b", PROMPT)
    assert pool.lookup("b").groups is None
    assert pool.stats().miss_reasons == {}
    pool.lookup("b", explain_misses=True)
    assert pool.stats().miss_reasons == {(0, "none"): 1}
