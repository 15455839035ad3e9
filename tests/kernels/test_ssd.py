"""Mamba-2 SSD (kernels.ssd): the chunked prefill and the decode update against the recurrence.

Decays are kept in the range real checkpoints see (A = -exp(U(0,1)), dt_bias = U(0,1) - 4).
Slots that a call must not read hold NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import ssd_scan, ssd_state_update

import kernel_helpers
from kernel_helpers import assert_close, assert_only_slots_changed, assert_refused, mamba_batch, randn

NAN = float("nan")


@dataclass
class SSDInputs:
    x: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor
    dt_bias: torch.Tensor

    def rows(self, lo: int, hi: int) -> tuple[torch.Tensor, ...]:
        return self.x[lo:hi], self.dt[lo:hi], self.A, self.B[lo:hi], self.C[lo:hi]


def ssd_inputs(gen: torch.Generator, device, tokens: int, heads: int = 4, head_dim: int = 8,
               groups: int = 2, state_size: int = 16, dtype: torch.dtype = torch.float32,
               d_per_channel: bool = False) -> SSDInputs:
    return SSDInputs(
        x=randn(tokens, heads, head_dim, generator=gen, dtype=dtype, device=device),
        dt=randn(tokens, heads, generator=gen, dtype=dtype, device=device),
        A=-torch.exp(torch.rand(heads, generator=gen)).to(device),
        B=randn(tokens, groups, state_size, generator=gen, dtype=dtype, device=device, scale=0.5),
        C=randn(tokens, groups, state_size, generator=gen, dtype=dtype, device=device, scale=0.5),
        D=randn(*((heads, head_dim) if d_per_channel else (heads,)), generator=gen, device=device),
        dt_bias=(torch.rand(heads, generator=gen) - 4).to(device),
    )


def states_for(gen, device, slots: int, heads: int = 4, head_dim: int = 8, state_size: int = 16,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return randn(slots, heads, head_dim, state_size, generator=gen, dtype=dtype, device=device)


@pytest.mark.parametrize("dtype, state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("groups, d_per_channel, dt_limit", [(1, False, (0.0, float("inf"))),
                                                             (2, True, (0.01, 0.05)),
                                                             (4, False, (0.0, float("inf")))])
def test_scan_matches_recurrence(device, gen, dtype, state_dtype, groups, d_per_channel, dt_limit):
    # chunk 8 with sequences of 13, 1, 0, 21 and 6 tokens: chunk and sequence boundaries interleave
    lengths = [13, 1, 0, 21, 6]
    batch = mamba_batch(lengths, 9, generator=gen, device=device, padding=(4,), fresh=(1, 2))
    inp = ssd_inputs(gen, device, sum(lengths), groups=groups, dtype=dtype, d_per_channel=d_per_channel)
    states = states_for(gen, device, 9, dtype=state_dtype)
    for row in (1, 2):
        states[batch.state_indices[row]] = NAN
    before, ref_states = states.clone(), states.clone()
    kwargs = dict(D=inp.D, dt_bias=inp.dt_bias, dt_limit=dt_limit)

    out = ssd_scan(*inp.rows(0, sum(lengths)), states, *batch.args, chunk_size=8, **kwargs)
    expected = ssd_scan(*inp.rows(0, sum(lengths)), ref_states, *batch.args, impl="reference", **kwargs)

    assert out.dtype == dtype and states.dtype == state_dtype and not out.isnan().any()
    assert_close(out, expected)
    assert_close(states, ref_states)
    assert_only_slots_changed(before, states, batch.used_slots())


@settings(max_examples=12, deadline=None)
@given(chunk=st.integers(1, 70), lengths=st.lists(st.integers(0, 70), min_size=1, max_size=3))
def test_result_does_not_depend_on_chunk_size(chunk, lengths):
    gen = torch.Generator().manual_seed(sum(lengths) + chunk)
    inp = ssd_inputs(gen, "cpu", sum(lengths), groups=1)
    batch = mamba_batch(lengths, 4, generator=gen)
    states = states_for(gen, "cpu", 4)
    ref_states = states.clone()
    out = ssd_scan(*inp.rows(0, sum(lengths)), states, *batch.args, D=inp.D, chunk_size=chunk)
    expected = ssd_scan(*inp.rows(0, sum(lengths)), ref_states, *batch.args, D=inp.D, chunk_size=64)
    assert_close(out, expected)
    assert_close(states, ref_states)


@settings(max_examples=12, deadline=None)
@given(length=st.integers(1, 80), cuts=st.lists(st.integers(0, 80), max_size=3))
def test_chunked_prefill_equals_one_shot(length, cuts):
    gen = torch.Generator().manual_seed(length)
    inp = ssd_inputs(gen, "cpu", length)
    states = states_for(gen, "cpu", 3)

    def run(lo, hi, batch, into):
        return ssd_scan(*inp.rows(lo, hi), into, *batch.args, D=inp.D, dt_bias=inp.dt_bias, chunk_size=16)

    kernel_helpers.assert_chunked_equals_whole(run, length, cuts, states, 3, generator=gen)


def test_decode_after_prefill_equals_longer_prefill(device, gen):
    prompt, extra = 20, 3
    inp = ssd_inputs(gen, device, prompt + extra)
    states = states_for(gen, device, 2)
    batch, longer = kernel_helpers.prefill_and_longer([prompt], extra, 2, generator=gen, device=device)
    long_states = states.clone()
    kwargs = dict(D=inp.D, dt_bias=inp.dt_bias)
    expected = ssd_scan(*inp.rows(0, prompt + extra), long_states, *longer.args, chunk_size=8, **kwargs)

    ssd_scan(*inp.rows(0, prompt), states, *batch.args, chunk_size=8, **kwargs)
    steps = [ssd_state_update(*inp.rows(t, t + 1), states, batch.state_indices, **kwargs)
             for t in range(prompt, prompt + extra)]
    assert_close(torch.cat(steps), expected[prompt:])
    assert_close(states, long_states)


@pytest.mark.parametrize("dtype, state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("groups", [1, 2])
def test_state_update_matches_reference_and_skips_padding(device, gen, dtype, state_dtype, groups):
    inp = ssd_inputs(gen, device, 6, groups=groups, dtype=dtype)
    states = states_for(gen, device, 10, dtype=state_dtype)
    indices = torch.tensor([4, -1, 0, 9, -1, 2], device=device)
    before, ref_states = states.clone(), states.clone()
    kwargs = dict(D=inp.D, dt_bias=inp.dt_bias)
    out = ssd_state_update(*inp.rows(0, 6), states, indices, **kwargs)
    expected = ssd_state_update(*inp.rows(0, 6), ref_states, indices, impl="reference", **kwargs)
    assert out.dtype == dtype and states.dtype == state_dtype
    assert_close(out, expected)
    assert_close(states, ref_states)
    assert_only_slots_changed(before, states, [4, 0, 9, 2])


def test_state_update_without_softplus_or_skip(device, gen):
    """dt used as given (no softplus, no bias) and no D: the bare recurrence S' = e^{dt A} S + dt x B."""
    inp = ssd_inputs(gen, device, 2, groups=1)
    dt = torch.rand(2, 4, generator=gen).to(device) * 0.1
    states = states_for(gen, device, 2)
    start = states.clone()
    out = ssd_state_update(inp.x, dt, inp.A, inp.B, inp.C, states, torch.tensor([1, 0], device=device),
                           dt_softplus=False)
    new = torch.exp(dt[:, :, None, None] * inp.A[:, None, None]) * start[[1, 0]] \
        + (dt[:, :, None, None] * inp.x[..., None]) * inp.B[:, :, None, :]
    assert_close(states[[1, 0]], new)
    assert_close(out, (new * inp.C[:, :, None, :]).sum(-1))


@pytest.mark.parametrize("change, field", [
    (dict(A=torch.zeros(3)), "A"),
    (dict(B=torch.zeros(5, 3, 16)), "B"),
    (dict(C=torch.zeros(5, 2, 8)), "C"),
    (dict(D=torch.zeros(4, 3)), "D"),
    (dict(dt=torch.zeros(5, 4, 1)), "dt"),
    (dict(state_indices=torch.tensor([0, 3])), "state_indices"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(dt_limit=(1.0, 0.5)), "dt_limit"),
])
def test_bad_arguments_name_the_field_and_change_nothing(gen, change, field):
    inp = ssd_inputs(gen, "cpu", 5)
    states = states_for(gen, "cpu", 3)
    args = dict(x=inp.x, dt=inp.dt, A=inp.A, B=inp.B, C=inp.C, ssm_states=states,
                **kernel_helpers.two_sequences_of_5())
    assert_refused(ssd_scan, args, change, field, states)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, groups, head_dim, state_size, d_per_channel",
                         [(2, 1, 16, 16, False), (4, 2, 8, 20, True)])  # 2nd: P < 16 and N not a power of 2
def test_triton_scan_and_update_match_torch(device, gen, triton_impl, dtype, heads, groups, head_dim, state_size,
                                            d_per_channel):
    lengths = [19, 1, 0, 12]
    shape = dict(heads=heads, head_dim=head_dim, state_size=state_size)
    batch = mamba_batch(lengths, 6, generator=gen, device=device, padding=(3,), fresh=(1,))
    inp = ssd_inputs(gen, device, sum(lengths), groups=groups, dtype=dtype, d_per_channel=d_per_channel, **shape)
    # the cache is a strided view into a pool (as the executor's block pool hands it out)
    pool = states_for(gen, device, 12, **shape).view(6, 2, heads, head_dim, state_size)
    states = pool[:, 1]
    states[batch.state_indices[1]] = NAN
    before, ref_states, other_half = states.clone(), states.clone(), pool[:, 0].clone()
    kwargs = dict(D=inp.D, dt_bias=inp.dt_bias)
    out = ssd_scan(*inp.rows(0, sum(lengths)), states, *batch.args, chunk_size=16, impl=triton_impl, **kwargs)
    expected = ssd_scan(*inp.rows(0, sum(lengths)), ref_states, *batch.args, impl="torch", **kwargs)
    assert_close(out, expected)
    assert_close(states, ref_states)
    assert_only_slots_changed(before, states, batch.used_slots())
    assert torch.equal(pool[:, 0], other_half)

    step = ssd_inputs(gen, device, 4, groups=groups, dtype=dtype, d_per_channel=d_per_channel, **shape)
    kwargs = dict(D=step.D, dt_bias=step.dt_bias, dt_limit=(0.01, 0.1))
    out = ssd_state_update(*step.rows(0, 4), states, batch.state_indices, impl=triton_impl, **kwargs)
    expected = ssd_state_update(*step.rows(0, 4), ref_states, batch.state_indices, impl="torch", **kwargs)
    assert_close(out, expected)
    assert_close(states, ref_states)
    assert torch.equal(pool[:, 0], other_half)
