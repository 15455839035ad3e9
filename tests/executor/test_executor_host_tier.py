"""The executor's host tier (executor/host_tier.py): demotions and promotions move the exact
bytes of every layer slot of a group, in the order the service's answers give, batched; a
failed copy is reported, never silently read; and end to end against the real cache service
(the engine in process), a workload larger than the device pool gets the same greedy output
with and without the tier, recomputing fewer prompt tokens with it."""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine import assert_views_agree, collect_into

from cache_service.client import CacheClient, PoolStats
from executor.cache import CacheGroup, CacheTensors, model_layer_specs
from executor.cache_link import CacheLink, PoolPlan, cache_groups
from executor.engine import Engine, EngineConfig, EngineRequest
from executor.forward_meta import GroupLayout
from executor.host_tier import SCRIBBLE, HostTier, TierCopy, fail_nth
from executor.launch import start_executor
from executor.model import HybridModel
from executor.model_config import ModelConfig
from executor.presets import get_preset
from executor.runner import ModelRunner
from executor.scheduler import AnswerCopies, Scheduler

from paged_helpers import run_concurrently

pytestmark = pytest.mark.timeout(300)

# Two groups: group 0 has three attention layers (slots 0-2), group 1 one (slot 0 only).
CFG = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_heads=2,
                  num_kv_heads=1, head_dim=16, max_model_len=64, pattern="FFFF")
NUM_BLOCKS = 12


def make_cache() -> CacheTensors:
    groups = [CacheGroup(("layers.0.attn", "layers.1.attn",
                          "layers.2.attn"), GroupLayout("attention", 4)),
              CacheGroup(("layers.3.attn",), GroupLayout("attention", 4))]
    page = 2 * 4 * CFG.num_kv_heads * CFG.head_dim * 4
    cache = CacheTensors(CFG, groups, NUM_BLOCKS, page)
    gen = torch.Generator().manual_seed(0)
    for slot in cache.slots:  # every block of every slot distinct bytes
        slot.copy_(torch.randint(0, 256, slot.shape, generator=gen, dtype=torch.uint8))
    return cache


def group_block(cache: CacheTensors, group: int, block: int) -> list[torch.Tensor]:
    return [s[block].clone() for s in cache.slots[:len(cache.groups[group].layer_names)]]


def test_the_store_has_one_host_tensor_per_layer_of_each_group() -> None:
    cache = make_cache()
    tier = HostTier(cache, 5)
    assert [len(g) for g in tier.slots] == [3, 1]
    assert all(t.shape == (5, cache.page_size_bytes) for g in tier.slots for t in g)
    assert tier.nbytes == 4 * 5 * cache.page_size_bytes
    with pytest.raises(ValueError, match="host_tier_blocks"):
        HostTier(cache, 0)


def test_demote_then_promote_round_trips_every_layer_slot_exactly() -> None:
    cache = make_cache()
    tier = HostTier(cache, 4)
    want = {(0, 3): group_block(cache, 0, 3), (0, 5): group_block(cache, 0, 5),
            (1, 7): group_block(cache, 1, 7)}
    assert tier.demote([TierCopy(0, 3, 2), TierCopy(0, 5, 0), TierCopy(1, 7, 2)]) == []
    for slot in cache.slots:  # the device blocks are reused: overwritten
        slot[[3, 5, 7]] = 0
    assert tier.promote([TierCopy(0, 9, 2), TierCopy(0, 10, 0), TierCopy(1, 11, 2)]) == []
    assert all(torch.equal(a, b) for a, b in zip(group_block(cache, 0, 9), want[(0, 3)]))
    assert all(torch.equal(a, b) for a, b in zip(group_block(cache, 0, 10), want[(0, 5)]))
    assert torch.equal(group_block(cache, 1, 11)[0], want[(1, 7)][0])
    # group 1 owns slot 0 only: its promotion leaves block 11 of slots 1-2 alone
    assert tier.stats.demotions == 3 and tier.stats.promotions == 3


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(1, NUM_BLOCKS - 1),
                          st.integers(0, 5)), min_size=1, max_size=12))
def test_a_batched_list_equals_the_copies_one_by_one(copies: list[tuple[int, int, int]]) -> None:
    """Batching per layer leaves what running the list in order leaves, a host slot named
    twice included (its last demotion wins)."""
    cache = make_cache()
    tier = HostTier(cache, 6)
    tier.demote([TierCopy(*c) for c in copies])
    expect: dict[tuple[int, int], list[torch.Tensor]] = {}
    for g, b, h in copies:
        expect[(g, h)] = group_block(cache, g, b)
    for (g, h), data in expect.items():
        assert all(torch.equal(tier.slots[g][j][h], d) for j, d in enumerate(data))


def test_one_answers_copies_run_demotions_then_promotions_then_block_copies() -> None:
    """The service may demote block 4 and promote into block 4 in the same answer (it was
    evicted and reused): the demotion reads the old bytes first. A block copy of the answer
    then sees the promoted bytes; the next answer's demotion sees the copy's."""
    cache = make_cache()
    tier = HostTier(cache, 4)
    runner = ModelRunner(None, cache, tier)  # type: ignore[arg-type]
    old4 = group_block(cache, 0, 4)
    tier.demote([TierCopy(0, 6, 1)])  # slot 1 holds block 6's bytes
    old6 = group_block(cache, 0, 6)
    answers = [AnswerCopies(demotions=[TierCopy(0, 4, 0)], promotions=[TierCopy(0, 4, 1)],
                            block_copies=[(0, 4, 8)]),
               AnswerCopies(demotions=[TierCopy(0, 8, 2)])]
    assert runner.run_copies(answers) == set()
    assert all(torch.equal(tier.slots[0][j][0], d) for j, d in enumerate(old4))
    for j in range(3):
        assert torch.equal(cache.slots[j][4], old6[j])
        assert torch.equal(cache.slots[j][8], old6[j])
        assert torch.equal(tier.slots[0][j][2], old6[j])


def test_bad_copies_are_refused_naming_the_value() -> None:
    tier = HostTier(make_cache(), 4)
    for copy, match in ((TierCopy(2, 1, 0), "group 2"), (TierCopy(0, 0, 0), "block 0"),
                        (TierCopy(0, NUM_BLOCKS, 0), f"block {NUM_BLOCKS}"),
                        (TierCopy(0, 1, 4), "host slot 4")):
        with pytest.raises(ValueError, match=match):
            tier.promote([copy])


def test_a_failed_promotion_is_reported_and_its_block_scribbled() -> None:
    cache = make_cache()
    tier = HostTier(cache, 4, fault=fail_nth("promotion", 2))
    tier.demote([TierCopy(0, 1, 0), TierCopy(0, 2, 1)])
    one = group_block(cache, 0, 1)
    assert tier.promote([TierCopy(0, 5, 0), TierCopy(0, 6, 1)]) == [(0, 6)]
    assert all(torch.equal(a, b) for a, b in zip(group_block(cache, 0, 5), one))
    assert all(bool((s[6] == SCRIBBLE).all()) for s in cache.slots)
    assert tier.stats.failed_promotions == 1 and tier.stats.promotions == 1


def test_a_failed_demotion_makes_its_slot_unreadable_until_rewritten() -> None:
    cache = make_cache()
    tier = HostTier(cache, 4, fault=fail_nth("demotion", 1))
    assert tier.demote([TierCopy(1, 3, 2)]) == [(1, 2)]
    assert tier.promote([TierCopy(1, 4, 2)]) == [(1, 4)]  # never the garbage
    assert tier.demote([TierCopy(1, 3, 2)]) == []  # rewritten: readable again
    assert tier.promote([TierCopy(1, 4, 2)]) == []
    assert torch.equal(cache.slots[0][4], cache.slots[0][3])


def test_garbage_spreads_through_copies_and_demotions() -> None:
    """A failed promotion's block copied by a block copy, or demoted by a later answer,
    stays garbage: the copy's destination is reported, the host slot goes bad."""
    cache = make_cache()
    runner = ModelRunner(None, cache, HostTier(cache, 4, fault=fail_nth("promotion", 1)))  # type: ignore[arg-type]
    answers = [AnswerCopies(promotions=[TierCopy(0, 3, 0)], block_copies=[(0, 3, 9)]),
               AnswerCopies(demotions=[TierCopy(0, 9, 1)])]
    assert runner.run_copies(answers) == {(0, 3), (0, 9)}
    assert runner.tier is not None and (0, 1) in runner.tier.bad


def test_copies_without_a_tier_are_an_error_not_ignored() -> None:
    runner = ModelRunner(None, make_cache())  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="no host tier"):
        runner.run_copies([AnswerCopies(demotions=[TierCopy(0, 1, 0)])])


# ---------------------------------------------------------------------------------------
# End to end: the engine in process against the session's real cache service
# ---------------------------------------------------------------------------------------

PROMPT_PREFIX, NUM_PREFIXES, DEVICE_BLOCKS = 64, 6, 20


@pytest.fixture(scope="module")
def tier_model() -> HybridModel:
    """Every group kind at once (full, sliding window, Mamba-2 in align mode)."""
    return HybridModel(get_preset("hybrid-fsm").replace(max_model_len=256))


def waves(vocab: int) -> list[list[list[int]]]:
    """Nine waves of two requests over six 64-token prefixes, round robin: the working set
    (six prefixes) is several device pools (DEVICE_BLOCKS holds about two), so without a
    tier a prefix is evicted before it comes back."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(vocab) for _ in range(PROMPT_PREFIX)] for _ in range(NUM_PREFIXES)]
    return [[prefixes[(2 * w + i) % NUM_PREFIXES] + [rng.randrange(vocab) for _ in range(5)]
             for i in range(2)] for w in range(9)]


@dataclass
class TierRun:
    outputs: list[list[int]]
    engine: Engine
    stats: PoolStats
    tier: HostTier | None


def run_waves(target: str, model: HybridModel, host_tier_blocks: int, *,
              fault: Callable[[str, TierCopy], bool] | None = None,
              async_cache_step: bool = False) -> TierRun:
    """The waves one after the other (each to completion), the engine stepped in this
    thread; the engine's and the service's views are compared after every step."""
    cfg = model.config
    plan = PoolPlan(pool_id=f"tier-test-{uuid.uuid4().hex[:8]}", specs=model_layer_specs(cfg),
                    max_model_len=cfg.max_model_len, num_blocks=DEVICE_BLOCKS,
                    vocab_size=cfg.vocab_size, host_tier_blocks=host_tier_blocks)
    link = CacheLink(target, plan)
    info = link.register()
    cache = CacheTensors(cfg, cache_groups(info), info.num_blocks, info.layer_page_size_bytes)
    tier = HostTier(cache, host_tier_blocks, fault=fault) if host_tier_blocks else None
    engine = Engine(ModelRunner(model, cache, tier), link,
                    EngineConfig(max_num_seqs=4, async_cache_step=async_cache_step))
    outputs: list[list[int]] = []
    try:
        for wave in waves(cfg.vocab_size):
            outs: list[list[int]] = [[] for _ in wave]
            for prompt, out in zip(wave, outs):
                engine.submit(EngineRequest(engine.new_request_id(), prompt, 4,
                                            sink=collect_into(out)))
            engine._drain_inbox(block=False)
            while engine.has_work:
                engine.step()
                assert_views_agree(engine, link)
            outputs += outs
        stats = link.client.stats(plan.pool_id)
    finally:
        link.close()
    return TierRun(outputs, engine, stats, tier)


@pytest.mark.parametrize("async_cache_step", [False, True], ids=["sequential", "overlapped"])
def test_a_working_set_beyond_the_pool_hits_the_host_tier_with_identical_outputs(
        cache_service, tier_model, async_cache_step: bool) -> None:
    none = run_waves(cache_service.target, tier_model, 0, async_cache_step=async_cache_step)
    tier = run_waves(cache_service.target, tier_model, 4 * DEVICE_BLOCKS,
                     async_cache_step=async_cache_step)
    assert tier.outputs == none.outputs and all(len(o) == 4 for o in tier.outputs)
    assert none.stats.evictions > 0 and none.engine.metrics.cached_tokens == 0
    # the tier turns those evictions into hits: fewer prompt tokens recomputed
    assert tier.engine.metrics.cached_tokens > 0
    assert tier.engine.metrics.computed_tokens < none.engine.metrics.computed_tokens
    assert tier.tier is not None
    assert tier.tier.stats.demotions == tier.stats.host_demotions > 0
    assert tier.tier.stats.promotions == tier.stats.host_promotions > 0
    assert tier.tier.stats.resets == 1  # the first Step told the service the tier is empty


def test_a_failed_promotion_recomputes_its_request_never_reads_the_garbage(
        cache_service, tier_model) -> None:
    """The first promotion copy fails (its device block is scribbled over): the request
    that would read it is preempted before the forward pass, the block's cache entry is
    dropped on the service, and the request recomputes; its greedy output is unchanged."""
    none = run_waves(cache_service.target, tier_model, 0)
    faulty = run_waves(cache_service.target, tier_model, 4 * DEVICE_BLOCKS,
                       fault=fail_nth("promotion", 1))
    assert faulty.outputs == none.outputs
    assert faulty.tier is not None and faulty.tier.stats.failed_promotions == 1
    # then the service was told to forget the host slots (the first Step's reset, and one
    # after the failure): a bad slot is never promoted from again
    assert faulty.tier.stats.resets == 2
    assert faulty.engine.metrics.tier_recomputes >= 1
    assert faulty.engine.metrics.preemptions >= faulty.engine.metrics.tier_recomputes


@pytest.mark.parametrize("nth", [1, 5])
def test_a_failed_demotion_is_never_promoted_from(cache_service, tier_model, nth: int) -> None:
    """The nth demotion fails (its host slot scribbled over): the service is told to forget
    the host tier with the next call, a promotion planned from the slot before that fails
    (and recomputes), and the outputs are those without a tier."""
    none = run_waves(cache_service.target, tier_model, 0)
    faulty = run_waves(cache_service.target, tier_model, 4 * DEVICE_BLOCKS,
                       fault=fail_nth("demotion", nth))
    assert faulty.outputs == none.outputs
    assert faulty.tier is not None and faulty.tier.stats.failed_demotions == 1
    assert faulty.tier.stats.resets == 2


def test_without_the_eviction_the_garbage_would_be_read(cache_service, tier_model,
                                                        monkeypatch) -> None:
    """The fault test is not vacuous: if the engine ran the forward pass over the failed
    block anyway, the outputs would change."""
    none = run_waves(cache_service.target, tier_model, 0)
    monkeypatch.setattr(Scheduler, "drop_unreadable", lambda self, scheduled, bad: scheduled)
    broken = run_waves(cache_service.target, tier_model, 4 * DEVICE_BLOCKS,
                       fault=fail_nth("promotion", 1))
    assert broken.outputs != none.outputs


# ---------------------------------------------------------------------------------------
# The executor process: --host-tier-blocks, and a restart is a new tier incarnation
# ---------------------------------------------------------------------------------------

def test_a_restarted_executor_tells_the_service_its_host_tier_is_empty(cache_service) -> None:
    pool_id = f"tier-restart-{uuid.uuid4().hex[:6]}"
    flags = ("--preset", "hybrid-fsm", "--max-model-len", "256", "--num-blocks",
             str(DEVICE_BLOCKS), "--host-tier-blocks", str(4 * DEVICE_BLOCKS), "--pool-id", pool_id)
    prompts = [p for wave in waves(1000) for p in wave]
    first = start_executor(cache_service.target, *flags)
    try:
        for p in prompts[:8]:  # one at a time: each prefix evicted before it returns
            run_concurrently(first.target, [p], 4)
    finally:
        first.stop()
    with CacheClient(cache_service.target) as cc:
        before = cc.stats(pool_id)
    assert before.host_tier_blocks == 4 * DEVICE_BLOCKS and before.host_tier_used_blocks > 0
    second = start_executor(cache_service.target, *flags)
    try:
        got = run_concurrently(second.target, prompts[8:9], 4)
    finally:
        second.stop()
    assert len(got[0].token_ids) == 4
    with CacheClient(cache_service.target) as cc:
        after = cc.stats(pool_id)
    # its first Step dropped every slot the first incarnation had demoted
    assert after.host_evictions >= before.host_evictions + before.host_tier_used_blocks


def test_the_settings_build_the_tier_and_its_fault_hook() -> None:
    from executor.server import host_tier
    from executor.settings import parse_settings

    cache = make_cache()
    assert host_tier(cache, parse_settings([])) is None
    tier = host_tier(cache, parse_settings(["--host-tier-blocks", "3",
                                            "--host-tier-fail-promotion", "2"]))
    assert tier is not None and tier.host_tier_blocks == 3
    tier.demote([TierCopy(0, 1, 0)])
    assert tier.promote([TierCopy(0, 2, 0)]) == []
    assert tier.promote([TierCopy(0, 3, 0)]) == [(0, 3)]  # the second promotion fails
