"""The executor's host tier (executor/host_tier.py): demotions and promotions move the exact
bytes of every layer slot of a group, in the order the service's answers give, batched; a
failed copy is reported, never silently read; and end to end against the real cache service
(the engine in process), a workload larger than the device pool gets the same greedy output
with and without the tier, recomputing fewer prompt tokens with it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.cache import CacheGroup, CacheTensors
from executor.forward_meta import GroupLayout
from executor.host_tier import SCRIBBLE, HostTier, TierCopy, fail_nth
from executor.model_config import ModelConfig
from executor.runner import ModelRunner
from executor.scheduler import AnswerCopies

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
    runner = ModelRunner(None, cache, HostTier(cache, 4))  # type: ignore[arg-type]
    old4 = group_block(cache, 0, 4)
    runner.tier.demote([TierCopy(0, 6, 1)])  # slot 1 holds block 6's bytes  # type: ignore[union-attr]
    old6 = group_block(cache, 0, 6)
    answers = [AnswerCopies(demotions=[TierCopy(0, 4, 0)], promotions=[TierCopy(0, 4, 1)],
                            block_copies=[(0, 4, 8)]),
               AnswerCopies(demotions=[TierCopy(0, 8, 2)])]
    assert runner.run_copies(answers) == set()
    tier = runner.tier
    assert tier is not None
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
