"""Greedy and seeded sampling."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from executor.sampling import SamplingParams, sample, sample_one


@given(st.integers(0, 2**31), st.integers(0, 10_000))
def test_seeded_sampling_depends_only_on_seed_and_position(seed: int, pos: int) -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(seed % 1000))
    p = SamplingParams(temperature=0.8, seed=seed)
    assert sample_one(logits, p, pos) == sample_one(logits.clone(), p, pos)
    # inside a batch, next to other rows, the pick is the same
    batch = torch.stack([torch.zeros(50), logits])
    assert sample(batch, [SamplingParams(), p], [0, pos])[1] == sample_one(logits, p, pos)


def test_greedy_is_argmax_and_top_k_restricts() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    assert sample(logits[None], [SamplingParams()], [0]) == [1]
    picks = {sample_one(logits, SamplingParams(temperature=5.0, top_k=2, seed=s), 0)
             for s in range(60)}
    assert picks == {1, 3}
    picks = {sample_one(logits, SamplingParams(temperature=5.0, top_p=0.3, seed=s), 0)
             for s in range(30)}
    assert picks == {1}
    many = {sample_one(logits, SamplingParams(temperature=5.0, seed=s), 0) for s in range(60)}
    assert many == {0, 1, 2, 3}


@pytest.mark.parametrize("bad, field", [(dict(temperature=-1.0), "temperature"),
                                        (dict(top_k=-2), "top_k"), (dict(top_p=1.5), "top_p")])
def test_bad_params_name_the_field(bad, field) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad).validate()
