"""The model on the paged cache: chunking, batching and block placement must not change the
numbers (beyond fp32 reassociation)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.forward_meta import SeqChunk, build_forward_meta
from executor.model import HybridModel
from executor.presets import PRESETS

from paged_helpers import BlockSource, mamba_meta, one_group_per_layer, run_chunks, tables_for

BS = 16
ATOL, RTOL = 2e-3, 1e-4  # logits have std ~10; fp32 kernels agree to ~1e-5


def random_tokens(model: HybridModel, n: int, *, seed: int) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (n,),
                         generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_chunked_prefill_and_decode_match_one_shot(models, preset: str) -> None:
    model = models[preset]
    cache = one_group_per_layer(model.config, BS)
    src = BlockSource()
    tokens = random_tokens(model, 90, seed=3)
    one_shot = run_chunks(model, cache, tokens, [90], tables_for(cache, 90, src))
    # chunks that straddle block boundaries, then three decode steps
    pieces = run_chunks(model, cache, tokens, [13, 16, 50, 87, 88, 89, 90],
                        tables_for(cache, 90, src))
    torch.testing.assert_close(pieces, one_shot, atol=ATOL, rtol=RTOL)
    assert one_shot.std() > 3.0  # random weights give clear greedy winners


@pytest.mark.parametrize("preset", ["hybrid-fsm", "jamba-like", "gemma3-like"])
def test_packed_batch_equals_requests_alone(models, preset: str) -> None:
    model = models[preset]
    cache = one_group_per_layer(model.config, BS)
    src = BlockSource()
    gen = torch.Generator().manual_seed(5)
    a = torch.randint(0, model.config.vocab_size, (40,), generator=gen)
    b = torch.randint(0, model.config.vocab_size, (25,), generator=gen)
    ta, tb = tables_for(cache, 41, src), tables_for(cache, 26, src)
    alone_a = run_chunks(model, cache, a, [40], ta)
    alone_b = run_chunks(model, cache, b, [25], tb)
    ta2, tb2 = tables_for(cache, 41, src), tables_for(cache, 26, src)
    meta = build_forward_meta([SeqChunk(0, 40, ta2), SeqChunk(0, 25, tb2)], cache.layout)
    both = model.compute_logits(model(torch.cat([a, b]), meta, cache))
    torch.testing.assert_close(both[:40], alone_a, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(both[40:], alone_b, atol=ATOL, rtol=RTOL)
    # a mixed step: one decode + one prefill continuation in the same pass
    x = torch.tensor([7, 8])
    meta = build_forward_meta([SeqChunk(40, 1, ta2), SeqChunk(25, 1, tb2)], cache.layout)
    assert meta.is_decode
    dec = model.compute_logits(model(x, meta, cache))
    ref_a = run_chunks(model, cache, torch.cat([a, x[:1]]), [41], tables_for(cache, 41, src))[-1]
    torch.testing.assert_close(dec[0], ref_a, atol=ATOL, rtol=RTOL)
    # mixed: a decode row (varlen kernels, one token with a state) next to a fresh prefill
    tc = tables_for(cache, 26, src)
    meta = build_forward_meta([SeqChunk(41, 1, ta2), SeqChunk(0, 25, tc)], cache.layout)
    assert not meta.is_decode
    mixed = model.compute_logits(model(torch.cat([x[1:], b]), meta, cache))
    ref = run_chunks(model, cache, torch.cat([a, x]), [42], tables_for(cache, 42, src))[-1]
    torch.testing.assert_close(mixed[0], ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(mixed[1:], alone_b, atol=ATOL, rtol=RTOL)


def test_align_mode_never_writes_a_checkpoint_in_place(models) -> None:
    """Continuing from a checkpoint block (a prefix hit) copies the state into the new block:
    the checkpoint stays bit-identical, so other requests can still hit it."""
    model = models["hybrid-fsm"]
    cache = one_group_per_layer(model.config, BS)
    src = BlockSource()
    tokens = random_tokens(model, 48, seed=9)
    tables = tables_for(cache, 48, src)
    run_chunks(model, cache, tokens, [32], tables)  # state after 32 tokens lives in block index 1
    mamba = [i for i, g in enumerate(cache.layout) if g.kind == "mamba"]
    layer = next(i for i, g in enumerate(cache.layer_group) if g == mamba[0])
    ckpt = tables[mamba[0]][1]
    before = [t[ckpt].clone() for t in cache.layer_tensors[layer]]
    meta = build_forward_meta([SeqChunk(32, 8, tables)], cache.layout)
    assert mamba_meta(meta, mamba[0]).copy_src.tolist() == [ckpt]
    model(tokens[32:40], meta, cache)
    for b, t in zip(before, cache.layer_tensors[layer]):
        assert torch.equal(b, t[ckpt])


def test_weights_are_deterministic_in_the_seed() -> None:
    cfg = PRESETS["hybrid-fsm"]
    a, b, c = HybridModel(cfg), HybridModel(cfg), HybridModel(cfg.replace(seed=1))
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), na
    assert not torch.equal(a.embed_tokens.weight, c.embed_tokens.weight)


@settings(max_examples=8, deadline=None)
@given(cuts=st.lists(st.integers(1, 59), min_size=1, max_size=4, unique=True))
def test_any_chunking_matches_one_shot(models, cuts: list[int]) -> None:
    model = models["plamo2-like"]
    cache = one_group_per_layer(model.config, BS)
    src = BlockSource(start=sum(cuts) % 100)
    tokens = random_tokens(model, 60, seed=11)
    ref = run_chunks(model, cache, tokens, [60], tables_for(cache, 60, src))
    got = run_chunks(model, cache, tokens, sorted(cuts) + [60], tables_for(cache, 60, src))
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)
