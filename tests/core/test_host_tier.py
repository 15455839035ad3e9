"""The host tier (core/host_tier.py, docs/semantics.md#host-tier): demotion when the device
evicts a cached block, lookups across both tiers, promotion by the allocation that uses a
host hit, ResetHostTierOp, snapshots, and a pool without a tier deciding as before."""

from __future__ import annotations

import dataclasses
import os
import pickle
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_service.core import _variant
from cache_service.core.errors import ConfigError, InvalidArgument
from cache_service.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from cache_service.core.hashing import external_block_hash
from cache_service.core.host_tier import HostTier, TierCopy, slot_of
from cache_service.core.operations import (
    AddRequest,
    Allocate,
    Free,
    Lookup,
    NewStep,
    Op,
    ResetHostTierOp,
)
from cache_service.core.pool import Pool
from cache_service.core.residency import MissReason
from cache_service.core.slices import run_to_end
from cache_service.replay import load_config

from builders import (
    SAMPLE_CONFIGS,
    full,
    make_pool,
    mamba,
    small_config,
    snapshot,
    swa,
)

HERE = Path(__file__).resolve().parent
CACHING_CONFIGS = [n for n in SAMPLE_CONFIGS if "nocache" not in n]
PROMPT_A = list(range(100, 117))  # 17 tokens: 4 full blocks of 4
PROMPT_B = list(range(200, 217))


def _tier(pool: Pool) -> HostTier:
    tier = pool.manager.host_tier
    assert tier is not None
    return tier


def serve(pool: Pool, rid: str, tokens: list[int], *, free: bool = True,
          chunk: int | None = None, copies: list[Any] | None = None) -> int:
    """Add, look up, allocate the rest (in chunks of ``chunk`` tokens, a step each: Mamba
    caches a state where a chunk ends), check, free; the hit. ``copies`` collects each
    allocation's tier copies."""
    pool.add_request(rid, tokens)
    hit = pool.lookup(rid).hit_tokens
    done = hit
    while done < len(tokens):
        n = min(chunk or len(tokens), len(tokens) - done)
        assert pool.allocate(rid, n).ok
        check_copies(pool)
        if copies is not None:
            copies.append(pool.tier_copies)
        pool.check_invariants()
        pool.new_step()
        done += n
    if free:
        pool.free(rid)
        pool.check_invariants()
    return hit


def check_copies(pool: Pool) -> None:
    """The copies of the last batch agree with the tier: a promotion's device block holds
    the key its host slot holds; a demotion's slot holds an entry; all are reserved."""
    tier = pool.manager.host_tier
    if tier is None:
        assert pool.tier_copies == ([], [])
        return
    demotions, promotions = pool.tier_copies
    for copy in promotions:
        block = pool.manager.pool.blocks[copy.block_id]
        assert block.block_hash is not None and block.group_id == copy.group
        entry = tier.lru[copy.group][block.block_hash]
        assert slot_of(entry) == copy.host_slot
        assert copy.host_slot in tier.reserved[copy.group]
    for copy in demotions:
        slots = {slot_of(e) for e in tier.lru[copy.group].values()}
        assert copy.host_slot in slots and copy.host_slot in tier.reserved[copy.group]
    assert len({(c.group, c.host_slot) for c in demotions}) == len(demotions)


class EventLedger:
    """What a router following a pool's events believes each tier holds: per (medium,
    group) the multiset of external hashes stored less those removed."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, int], Counter[int]] = {}

    def follow(self, pool: Pool) -> None:
        for e in pool.take_events():
            if isinstance(e, AllBlocksCleared):
                for (medium, g) in list(self.held):
                    if medium == e.medium:
                        self.held[(medium, g)].clear()
                continue
            held = self.held.setdefault((e.medium, e.group_idx), Counter())
            for h in e.block_hashes:
                if type(e) is BlockStored:
                    held[h] += 1
                else:
                    held[h] -= 1
                    assert held[h] >= 0, f"{e.medium} removal of a hash never stored"
        device = pool.prefix_snapshot()
        for g in range(pool.num_groups):
            want = Counter(external_block_hash(h) for h in device[g])
            assert +self.held.get(("GPU", g), Counter()) == want, f"group {g}: GPU events"
        tier = pool.manager.host_tier
        if tier is not None:
            for g, lru in enumerate(tier.lru):
                want = Counter(external_block_hash(h) for h in lru)
                assert +self.held.get(("CPU", g), Counter()) == want, f"group {g}: CPU events"


# -- options ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [-1, 16777217, True, 1.5, "4"])
def test_host_tier_blocks_is_checked(bad: Any) -> None:
    with pytest.raises(ConfigError) as err:
        make_pool(16, full(4), host_tier_blocks=bad)
    assert err.value.field == "host_tier_blocks"


def test_a_host_tier_needs_prefix_caching() -> None:
    with pytest.raises(ConfigError) as err:
        make_pool(16, full(4), host_tier_blocks=4, enable_caching=False)
    assert err.value.field == "host_tier_blocks"
    assert make_pool(16, full(4), host_tier_blocks=0, enable_caching=False).manager.host_tier \
        is None


def test_the_largest_tier_costs_nothing_until_used() -> None:
    pool = make_pool(16, full(4), host_tier_blocks=16777216)
    assert pool.stats().host_tier_blocks == 16777216
    assert pool.stats().host_tier_used_blocks == 0


# -- demotion and promotion, per group type ----------------------------------------------------
def test_an_evicted_block_is_demoted_and_a_later_hit_promotes_it() -> None:
    pool = make_pool(9, full(4), host_tier_blocks=16)  # 8 usable device blocks
    serve(pool, "a", PROMPT_A)  # blocks 1-5, 1-4 cached; queue: 5, 6, 7, 8, 4, 3, 2, 1
    pool.take_events()
    pool.add_request("b", PROMPT_B)
    assert pool.allocate("b", 17).ok  # blocks 5, 6, 7, 8 and a's cached block 4
    assert pool.tier_copies == ([TierCopy(0, 4, 0)], [])
    events = pool.take_events()
    removed = [e for e in events if type(e) is BlockRemoved]
    cpu = [e for e in events if type(e) is BlockStored and e.medium == "CPU"]
    assert [e.medium for e in removed] == ["GPU"]
    assert len(cpu) == 1 and cpu[0].block_hashes == removed[0].block_hashes
    assert (cpu[0].token_ids, cpu[0].parent_block_hash, cpu[0].block_size,
            cpu[0].prefix_lengths, cpu[0].group_idx) == ([], None, 4, [16], 0)
    assert events.index(removed[0]) < events.index(cpu[0])
    pool.free("b")
    # a's prompt hits all 16 tokens again: 3 blocks on the device, 1 in host memory.
    pool.add_request("a2", PROMPT_A)
    hit = pool.lookup("a2")
    assert hit.hit_tokens == 16 == hit.host_hit_tokens
    assert hit.block_ids == [[1, 2, 3, -1]]
    alloc = pool.allocate("a2", 1)
    assert alloc.ok and alloc.hit_tokens_used == 16
    demotions, promotions = pool.tier_copies
    assert len(promotions) == 1 and promotions[0].host_slot == 0
    table = alloc.block_ids[0]
    assert table[:3] == [1, 2, 3] and promotions[0].block_id == table[3]
    promoted = pool.manager.pool.blocks[table[3]]
    assert promoted.ref_cnt == 1 and promoted.hash_num_tokens == 16
    # The key is cached on the device again (announced), and stays in host memory.
    stored = [e for e in pool.take_events() if type(e) is BlockStored and e.medium == "GPU"]
    assert stored[0].block_hashes == cpu[0].block_hashes
    assert (stored[0].token_ids, stored[0].start_token, stored[0].prefix_lengths) \
        == (PROMPT_A[12:16], 12, [16])
    assert stored[0].parent_block_hash is not None
    check_copies(pool)
    pool.check_invariants()
    stats = pool.stats()
    assert (stats.host_demotions, stats.host_promotions) == (1 + len(demotions), 1)
    assert stats.host_tier_used_blocks == 1 + len(demotions)


def test_a_key_already_in_host_memory_is_touched_not_copied_again() -> None:
    tier = HostTier(2, [4], enable_events=True)
    events: list[Any] = []
    tier.demote(7, b"k1", 0, 4, events)
    tier.demote(8, b"k2", 0, 8, events)
    tier.begin_batch()
    tier.demote(9, b"k1", 0, 4, events)  # already held: touched (now the MRU), no copy
    assert tier.demotions == [] and tier.num_demotions == 2 and len(events) == 2
    tier.demote(5, b"k3", 0, 12, events)  # evicts the LRU entry, k2, and takes its slot
    assert tier.demotions == [TierCopy(0, 5, 1)]
    assert list(tier.lru[0]) == [b"k1", b"k3"] and tier.num_evictions == 1
    assert [type(e) for e in events[2:]] == [BlockRemoved, BlockStored]
    # Every slot reserved by this batch: the next block is dropped, as without a tier.
    tier.reserve(tier.lru[0][b"k1"])
    tier.demote(6, b"k4", 0, 16, events)
    assert tier.demotions == [TierCopy(0, 5, 1)] and list(tier.lru[0]) == [b"k1", b"k3"]
    tier.check_invariants()


def _hits_as_with_a_big_device(small: Pool, big: Pool, prompts: list[list[int]],
                               chunk: int | None = None) -> None:
    """Serving ``prompts`` in turn, the small pool with a host tier hits as much as the
    big pool that never evicts (the tier held everything the device dropped)."""
    hits = 0
    for i, prompt in enumerate(prompts):
        h_small = serve(small, f"s{i}", prompt, chunk=chunk)
        h_big = serve(big, f"s{i}", prompt, chunk=chunk)
        assert h_small == h_big, (i, h_small, h_big)
        hits += h_big
    assert hits > 0
    assert small.stats().host_promotions > 0
    assert big.stats().evictions == 0 < small.stats().evictions


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    bases = [[rng.randrange(1, 1000) for _ in range(length)] for _ in range(3)]
    return [bases[rng.randrange(3)][:rng.randrange(length // 2, length)]
            + [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 9))] for _ in range(n)]


def test_full_attention_hits_across_tiers_as_a_big_device_would() -> None:
    small = make_pool(16, full(4), max_model_len=256, host_tier_blocks=512)
    big = make_pool(600, full(4), max_model_len=256)
    _hits_as_with_a_big_device(small, big, _prompts(40, 32))


def test_sliding_window_tails_come_back_from_host_memory() -> None:
    small = make_pool(16, swa(4, 10), max_model_len=256, host_tier_blocks=512)
    big = make_pool(600, swa(4, 10), max_model_len=256)
    _hits_as_with_a_big_device(small, big, _prompts(40, 32, seed=1))


def test_mamba_checkpoints_come_back_from_host_memory() -> None:
    small = make_pool(6, mamba(4), max_model_len=256, host_tier_blocks=512)
    big = make_pool(600, mamba(4), max_model_len=256)
    _hits_as_with_a_big_device(small, big, _prompts(40, 32, seed=2), chunk=4)


def test_hybrid_full_and_sliding_window_hit_across_tiers() -> None:
    small = make_pool(30, full(4), swa(4, 10), max_model_len=256, host_tier_blocks=512)
    big = make_pool(1200, full(4), swa(4, 10), max_model_len=256)
    _hits_as_with_a_big_device(small, big, _prompts(40, 32, seed=3))


def test_hybrid_full_and_mamba_with_partial_hits_hit_across_tiers() -> None:
    # A Mamba group coarser than the hash block size: hits inside blocks (copy-on-write).
    small = make_pool(30, full(4), mamba(8), max_model_len=256, host_tier_blocks=512)
    big = make_pool(1200, full(4), mamba(8), max_model_len=256)
    assert small.manager.partial_hits
    _hits_as_with_a_big_device(small, big, _prompts(40, 32, seed=4), chunk=4)


def test_a_placeholder_is_one_free_block_to_admission() -> None:
    """A host hit costs the block it is promoted into, as a free cached device block does:
    the same request fits with the tier exactly when it fits without eviction."""
    pool = make_pool(9, full(4), host_tier_blocks=16)
    serve(pool, "a", PROMPT_A)
    serve(pool, "b", PROMPT_B)
    pool.add_request("a2", PROMPT_A)
    assert pool.lookup("a2").hit_tokens == 16
    free = pool.num_free_blocks
    assert pool.allocate("a2", 1).ok
    assert free - pool.num_free_blocks == 5  # 2 device hits + 2 promotions + 1 new


# -- refusals, reset, snapshots -----------------------------------------------------------------
def _tier_state(pool: Pool) -> Any:
    tier = _tier(pool)
    return ([[(k, slot_of(e), e.hash_num_tokens) for k, e in lru.items()] for lru in tier.lru],
            [sorted(r) for r in tier.reserved], tier.num_demotions, tier.num_promotions,
            tier.num_evictions)


def test_a_refused_allocation_changes_neither_tier() -> None:
    pool = make_pool(9, full(4), host_tier_blocks=16)
    serve(pool, "a", PROMPT_A)
    serve(pool, "b", PROMPT_B)
    pool.add_request("hold", list(range(300, 312)))
    assert pool.allocate("hold", 12).ok  # 3 of the 8 blocks
    pool.add_request("a2", PROMPT_A + list(range(500, 540)))
    assert -1 in pool.lookup("a2").block_ids[0]
    before = (snapshot(pool), _tier_state(pool), pool.take_events())
    assert not pool.allocate("a2", 41).ok  # needs 15 blocks
    assert pool.tier_copies == ([], [])
    after = (snapshot(pool), _tier_state(pool), pool.take_events())
    assert before[0][1:3] == after[0][1:3]  # the free queue and the requests
    # Host entries (order, slots) and counters; the last batch's reservations are released.
    assert before[1][0] == after[1][0] and before[1][2:] == after[1][2:]
    assert after[2] == []
    pool.check_invariants()


def test_reset_host_tier_drops_every_slot() -> None:
    pool = make_pool(9, full(4), host_tier_blocks=16)
    serve(pool, "a", PROMPT_A)
    serve(pool, "b", PROMPT_B)
    used = pool.stats().host_tier_used_blocks
    assert used > 0
    pool.take_events()
    device = snapshot(pool)[1]
    assert pool.reset_host_tier() == used
    events = pool.take_events()
    assert [type(e) for e in events] == [BlockRemoved] * used
    assert all(e.medium == "CPU" for e in events)
    stats = pool.stats()
    assert (stats.host_tier_used_blocks, stats.host_evictions) == (0, used)
    assert snapshot(pool)[1] == device  # the device pool is untouched
    pool.add_request("a2", PROMPT_A)
    hit = pool.lookup("a2")
    assert -1 not in hit.block_ids[0] and hit.hit_tokens == 4 * (4 - used)
    # As a batch op; a pool without a tier answers 0.
    assert pool.apply_batch([ResetHostTierOp()]) == [0]
    assert make_pool(9, full(4)).apply_batch([ResetHostTierOp()]) == [0]
    pool.check_invariants()


def test_invalidating_a_block_forgets_its_key_in_both_tiers() -> None:
    pool = make_pool(9, full(4), host_tier_blocks=16)
    serve(pool, "a", PROMPT_A)
    serve(pool, "b", PROMPT_B)  # demotes a's last block
    copies: list[Any] = []
    serve(pool, "a2", PROMPT_A, copies=copies)  # promotes it back: in both tiers now
    [promotion] = copies[0][1]
    pool.take_events()
    used = pool.stats().host_tier_used_blocks
    pool.evict_blocks([promotion.block_id])
    events = pool.take_events()
    assert [(type(e), e.medium) for e in events] == [(BlockRemoved, "GPU"), (BlockRemoved, "CPU")]
    assert pool.stats().host_tier_used_blocks == used - 1
    pool.check_invariants()
    pool.add_request("a3", PROMPT_A)
    assert pool.lookup("a3").hit_tokens == 12
    pool.free("a3")
    # The freed slot is the next one handed out.
    later: list[Any] = []
    serve(pool, "c", list(range(300, 317)), copies=later)
    serve(pool, "d", list(range(400, 417)), copies=later)
    slots = [c.host_slot for demotions, _ in later for c in demotions]
    assert slots and slots[0] == promotion.host_slot
    pool.check_invariants()


def test_a_reset_between_lookup_and_allocate_makes_the_allocate_look_up_again() -> None:
    pool = make_pool(9, full(4), host_tier_blocks=16)
    serve(pool, "a", PROMPT_A)
    serve(pool, "b", PROMPT_B)
    pool.apply_batch([AddRequest("a2", PROMPT_A)])
    out = pool.apply_batch([Lookup("a2"), ResetHostTierOp(), Allocate("a2", 1)])
    assert out[0].hit_tokens == 16 and out[1] == 1
    assert out[2].ok and out[2].hit_tokens_used == 12
    assert pool.tier_copies[1] == []
    pool.check_invariants()


def test_a_reset_after_an_allocate_of_its_batch_is_refused_and_changes_nothing() -> None:
    # The allocate may promote from slots the reset drops: copies no executor could run.
    pool = make_pool(9, full(4), host_tier_blocks=16)
    serve(pool, "a", PROMPT_A)
    serve(pool, "b", PROMPT_B)
    pool.apply_batch([AddRequest("a2", PROMPT_A)])
    before = (snapshot(pool), _tier_state(pool))
    with pytest.raises(InvalidArgument) as err:
        pool.apply_batch([Lookup("a2"), Allocate("a2", 1), ResetHostTierOp()])
    assert err.value.field == "ops[2].reset_host_tier"
    assert (snapshot(pool), _tier_state(pool)) == before
    pool.check_invariants()


def test_host_slot_evictions_follow_the_host_lru_and_are_announced() -> None:
    pool = make_pool(9, full(4), host_tier_blocks=2)
    for i in range(6):
        serve(pool, f"r{i}", list(range(1000 * i + 1, 1000 * i + 18)))
    stats = pool.stats()
    assert stats.host_tier_used_blocks == 2
    assert stats.host_evictions == stats.host_demotions - 2 > 0
    removed = [e for e in pool.take_events() if type(e) is BlockRemoved and e.medium == "CPU"]
    assert len(removed) == stats.host_evictions


def test_a_snapshot_plans_the_same_copies() -> None:
    pool = make_pool(16, full(4), max_model_len=256, host_tier_blocks=8)
    prompts = _prompts(40, 32, seed=5)
    for i, prompt in enumerate(prompts[:15]):
        serve(pool, f"p{i}", prompt)
    copy = pickle.loads(pickle.dumps(pool))
    assert _tier_state(copy) == _tier_state(pool)
    planned: list[Any] = []
    planned_by_copy: list[Any] = []
    for i, prompt in enumerate(prompts[15:]):
        assert serve(pool, f"q{i}", prompt, copies=planned) \
            == serve(copy, f"q{i}", prompt, copies=planned_by_copy)
    assert planned == planned_by_copy and any(p[1] for p in planned)
    assert pool.stats() == copy.stats()
    assert pool.take_events() == copy.take_events()


def tier_workload(name: str) -> tuple[Pool, list[Any]]:
    """A pool of a sample config with a small host tier after a prefix-sharing workload
    (with a reset in the middle); the hits and copies of every request."""
    pool = _pool(name, 16)
    answers: list[Any] = []
    for i, prompt in enumerate(_prompts(24, 60, seed=9)):
        answers.append(serve(pool, f"w{i}", prompt, chunk=8, copies=answers))
        if i == 12:
            answers.append(pool.reset_host_tier())
    stats = pool.stats()  # plain values: the result classes do not pickle across cores
    answers.append([getattr(stats, f.name) for f in dataclasses.fields(stats)])
    answers.append(pool.take_events())
    pool.add_request("pending", _prompts(1, 40, seed=9)[0])
    hit = pool.lookup("pending")
    answers.append((hit.hit_tokens, hit.block_ids, hit.host_hit_tokens))
    return pool, answers


@pytest.mark.parametrize("name", ["full", "full_swa_mamba", "full_mamba32"])
def test_the_other_core_plans_the_same_and_its_snapshot_loads_here(name: str,
                                                                  tmp_path: Path) -> None:
    other = "pure" if _variant.build_info()["variant"] == "compiled" else "compiled"
    if other == "compiled" and _variant._why_not() is not None:
        pytest.skip(f"no usable compiled core: {_variant._why_not()}")
    out = tmp_path / "tier.pickle"
    script = (f"import pickle, sys; sys.path.insert(0, {str(HERE)!r}); "
              "from test_host_tier import tier_workload; "
              "from cache_service.core import _variant; "
              f"assert _variant.build_info()['variant'] == {other!r}; "
              f"open({str(out)!r}, 'wb').write(pickle.dumps(tier_workload({name!r})))")
    env = {**os.environ, "KVCACHE_CORE": other, "PYTHONPATH": str(HERE.parents[1])}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300)
    theirs, their_answers = pickle.loads(out.read_bytes())
    ours, our_answers = tier_workload(name)
    assert their_answers == our_answers
    assert type(theirs) is Pool
    theirs.check_invariants()
    assert _tier_state(theirs) == _tier_state(ours)
    for pool in (theirs, ours):
        assert pool.allocate("pending", 1).ok
    assert theirs.tier_copies == ours.tier_copies
    assert snapshot(theirs)[1:] == snapshot(ours)[1:]
    assert theirs.stats().host_promotions == ours.stats().host_promotions > 0


def test_sliced_and_prepared_batches_plan_what_apply_batch_plans() -> None:
    pools = [make_pool(16, full(4), max_model_len=256, host_tier_blocks=8) for _ in range(3)]
    for i, prompt in enumerate(_prompts(30, 32, seed=11)):
        rid = f"r{i}"
        batch = [AddRequest(rid, prompt), Lookup(rid)]
        outs = [pools[0].apply_batch(batch[:2])]
        outs.append(pools[1].prepare_batch(batch[:2]).apply())
        outs.append(run_to_end(pools[2].prepare_batch(batch[:2]).apply_in_slices(1)))
        n = len(prompt) - outs[0][1].hit_tokens
        alloc = [Free(f"r{i - 1}"), Allocate(rid, n)] if i else [NewStep(), Allocate(rid, n)]
        res = [pools[0].apply_batch(alloc), pools[1].prepare_batch(alloc).apply(),
               run_to_end(run_to_end(pools[2].prepare_batch_in_slices(
                   alloc, slice_cost=1)).apply_in_slices(1))]
        assert [r[1].ok for r in res] == [True] * 3
        assert pools[0].tier_copies == pools[1].tier_copies == pools[2].tier_copies
        for pool in pools:
            check_copies(pool)
            pool.check_invariants()
    assert pools[0].stats() == pools[1].stats() == pools[2].stats()
    assert pools[0].stats().host_promotions > 0


# -- peek and miss reasons ----------------------------------------------------------------------
def test_peek_reports_both_tiers_and_evicted_means_from_both() -> None:
    pool = make_pool(9, full(4), host_tier_blocks=16)
    serve(pool, "a", PROMPT_A)
    serve(pool, "b", PROMPT_B)
    r = pool.prefix_residency(PROMPT_A, explain_misses=True)
    assert (r.hit_tokens, r.host_hit_tokens) == (12, 16)
    g = r.groups[0]
    assert (g.tokens, g.host_tokens, g.reason) == (12, 16, MissReason.NONE)
    assert pool.peek_prefix(PROMPT_A) == 12
    pool.reset_host_tier()
    g = pool.prefix_residency(PROMPT_A, explain_misses=True).groups[0]
    assert (g.tokens, g.host_tokens, g.reason) == (12, 12, MissReason.EVICTED)
    # Without a tier, host_* equal the device values.
    plain = make_pool(9, full(4))
    serve(plain, "a", PROMPT_A)
    r = plain.prefix_residency(PROMPT_A)
    assert r.host_hit_tokens == r.hit_tokens == 16 and r.groups[0].host_tokens == 16


def test_pins_hold_device_blocks_only() -> None:
    pool = make_pool(9, full(4), host_tier_blocks=16, max_pinned_blocks=4)
    serve(pool, "a", PROMPT_A)
    serve(pool, "b", PROMPT_B)
    info = pool.pin_prefix("p", PROMPT_A)
    assert (info.hit_tokens, info.num_blocks) == (12, 3)
    pool.check_invariants()


# -- random operation sequences ------------------------------------------------------------------
_KINDS = ["add"] * 6 + ["run"] * 14 + ["free"] * 6 + ["preempt"] * 2 + ["step"] * 3 + ["reset"]
_OP = st.tuples(st.sampled_from(_KINDS), st.integers(0, 7), st.integers(1, 40))


def _pool(name: str, host: int | None) -> Pool:
    config, options = load_config(small_config(name))
    options = dataclasses.replace(options, enable_events=True)
    if host is not None:
        options = dataclasses.replace(options, host_tier_blocks=host)
    return Pool(config, options)


def _drive(pool: Pool, ops: list[tuple[str, int, int]], seed: int = 0) -> list[Any]:
    """Runs ``ops`` (prompts from 3 shared stems); the outcomes, events and hits."""
    rng = random.Random(seed)
    stems = [[rng.randrange(1, 500) for _ in range(80)] for _ in range(3)]
    out: list[Any] = []
    tiered = pool.manager.host_tier is not None
    ledger = EventLedger()
    for n, (kind, a, b) in enumerate(ops):
        rid = f"r{a}"
        if kind == "add" and not pool.has_request(rid):
            stem = stems[a % 3]
            out.append(pool.apply_batch([AddRequest(rid, stem[:b + 8] + [600 + n])]))
        elif kind == "run" and pool.has_request(rid):
            info = pool.request_info(rid)
            ops_: list[Op] = []
            if not info.num_computed_tokens:
                ops_.append(Lookup(rid))
            left = info.num_tokens - info.num_computed_tokens
            ops_.append(Allocate(rid, max(1, min(b, left)) if left > 0 else 1,
                                 append_token_ids=[] if left > 0 else [700 + n]))
            res = pool.apply_batch(ops_)
            out.append([getattr(r, "hit_tokens", None) for r in res])
            out.append([(r.ok, r.num_computed_tokens) for r in res if hasattr(r, "ok")])
            if not tiered:
                out.append(res)
        elif kind == "free" and pool.has_request(rid):
            out.append(pool.apply_batch([Free(rid)]))
        elif kind == "preempt" and pool.has_request(rid):
            pool.preempt(rid)
        elif kind == "step":
            pool.apply_batch([NewStep()])
        elif kind == "reset":
            out.append(pool.apply_batch([ResetHostTierOp()]))
        check_copies(pool)
        pool.check_invariants()
        if not tiered:
            out.append(pool.take_events())
        else:
            ledger.follow(pool)
    return out


@pytest.mark.parametrize("name", CACHING_CONFIGS)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_OP, max_size=50))
def test_an_explicit_zero_tier_decides_as_no_tier(name: str, ops) -> None:
    plain, zero = _pool(name, None), _pool(name, 0)
    assert zero.manager.host_tier is None
    assert _drive(plain, ops) == _drive(zero, ops)
    assert plain.stats() == zero.stats()


@pytest.mark.parametrize("name", CACHING_CONFIGS)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_OP, max_size=50), host=st.sampled_from([1, 3, 16, 200]))
def test_random_operations_with_a_tier_keep_the_invariants(name: str, ops, host: int) -> None:
    pool = _pool(name, host)
    _drive(pool, ops)
    for rid in pool.request_ids():
        pool.free(rid)
    pool.check_invariants()
    assert pool.num_free_blocks == pool.stats().num_blocks - 1


#: Full attention only: a sliding-window or Mamba hit that a tier makes longer skips the
#: checkpoints before it (the request never computes them), so a later, shorter prompt
#: may find fewer (docs/semantics.md#host-tier).
FULL_ONLY = [n for n in CACHING_CONFIGS if n in ("full", "full_eagle")]


@pytest.mark.parametrize("name", FULL_ONLY)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(picks=st.lists(st.tuples(st.integers(0, 3), st.integers(4, 60)), min_size=1,
                      max_size=25),
       host=st.sampled_from([1, 2, 8, 64]))
def test_a_tier_never_hits_less_than_no_tier(name: str, picks, host: int) -> None:
    """The same prompts served one after the other (each to completion, then freed): every
    hit with a host tier is at least the hit without one."""
    plain, tiered = _pool(name, None), _pool(name, host)
    rng = random.Random(7)
    stems = [[rng.randrange(1, 500) for _ in range(90)] for _ in range(4)]
    for i, (stem, length) in enumerate(picks):
        prompt = stems[stem][:length] + [900 + i]
        h_plain = serve(plain, f"r{i}", prompt, chunk=8)
        h_tier = serve(tiered, f"r{i}", prompt, chunk=8)
        assert h_tier >= h_plain, (i, h_tier, h_plain)


@pytest.mark.parametrize("name", ["full", "full_eagle", "full_swa", "full_mamba32",
                                  "full_swa_mamba", "full_mamba_eagle_r0"])
def test_long_random_runs_promote_and_their_events_add_up(name: str) -> None:
    """400 seeded random ops (rare resets): promotions happen, the invariants hold after
    every op, and both tiers' events add up to what each tier holds."""
    rng = random.Random(name)
    kinds = [k for k in _KINDS if k != "reset"] * 4 + ["reset"]
    ops = [(rng.choice(kinds), rng.randrange(8), rng.randrange(1, 41)) for _ in range(400)]
    pool = _pool(name, 16)
    _drive(pool, ops)
    stats = pool.stats()
    assert stats.host_promotions > 0 and stats.host_demotions > 0, stats


# -- hit rate ------------------------------------------------------------------------------------
def _hit_rate(pool: Pool, rounds: int, working_set: int, prompt_len: int) -> float:
    """Round-robin over ``working_set`` distinct prompts: the fraction of prompt tokens hit."""
    hits = total = 0
    for r in range(rounds):
        for i in range(working_set):
            prompt = [10_000 * (i + 1) + t for t in range(prompt_len)]
            hits += serve(pool, f"w{r}-{i}", prompt)
            total += prompt_len
    return hits / total


def test_a_working_set_four_times_the_device_hits_with_a_four_times_host_tier() -> None:
    # 33 blocks of 4 tokens: 32 usable; 16 prompts of 32 tokens (8 blocks) = 128 blocks.
    device = 33
    without = _hit_rate(make_pool(device, full(4)), 3, 16, 32)
    with_tier = _hit_rate(make_pool(device, full(4), host_tier_blocks=4 * (device - 1)), 3, 16,
                          32)
    assert without == 0.0  # LRU over a cyclic working set larger than the pool
    assert with_tier > 0.5, with_tier


def test_tier_copy_is_frozen_and_compares_by_value() -> None:
    assert TierCopy(0, 3, 1) == TierCopy(0, 3, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        TierCopy(0, 3, 1).block_id = 4  # type: ignore[misc]
