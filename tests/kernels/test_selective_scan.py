"""Mamba-1 selective scan and state update (kernels.selective_scan) against the recurrence.

Shapes stay small: the reference walks every token. Slots that a call must not read hold NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import selective_scan, selective_state_update

import kernel_helpers
from kernel_helpers import assert_close, assert_only_slots_changed, assert_refused, mamba_batch, randn

NAN = float("nan")


@dataclass
class ScanInputs:
    u: torch.Tensor
    delta: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor
    z: torch.Tensor
    delta_bias: torch.Tensor

    def rows(self, lo: int, hi: int) -> tuple[torch.Tensor, ...]:
        return self.u[lo:hi], self.delta[lo:hi], self.A, self.B[lo:hi], self.C[lo:hi]

    def extras(self, lo: int, hi: int) -> dict:
        return dict(D=self.D, z=self.z[lo:hi], delta_bias=self.delta_bias)


def scan_inputs(gen: torch.Generator, device, tokens: int, channels: int = 16, groups: int = 2,
                state_size: int = 8, dtype: torch.dtype = torch.float32) -> ScanInputs:
    return ScanInputs(
        u=randn(tokens, channels, generator=gen, dtype=dtype, device=device),
        delta=randn(tokens, channels, generator=gen, dtype=dtype, device=device),
        A=-(torch.rand(channels, state_size, generator=gen) + 1).to(device),
        B=randn(tokens, groups, state_size, generator=gen, dtype=dtype, device=device),
        C=randn(tokens, groups, state_size, generator=gen, dtype=dtype, device=device),
        D=randn(channels, generator=gen, device=device),
        z=randn(tokens, channels, generator=gen, dtype=dtype, device=device),
        delta_bias=(torch.rand(channels, generator=gen) - 4).to(device),
    )


def states_for(gen, device, slots: int, channels: int = 16, state_size: int = 8,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return randn(slots, channels, state_size, generator=gen, dtype=dtype, device=device)


@pytest.mark.parametrize("dtype, state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("groups, use_extras", [(1, True), (4, True), (2, False)])
def test_scan_matches_recurrence(device, gen, dtype, state_dtype, groups, use_extras):
    lengths = [9, 1, 0, 30, 4]
    batch = mamba_batch(lengths, 7, generator=gen, device=device, padding=(4,), fresh=(1, 2))
    inp = scan_inputs(gen, device, sum(lengths), groups=groups, dtype=dtype)
    states = states_for(gen, device, 7, dtype=state_dtype)
    for row in (1, 2):
        states[batch.state_indices[row]] = NAN
    before, ref_states = states.clone(), states.clone()
    extras = inp.extras(0, sum(lengths)) if use_extras else {}

    out = selective_scan(*inp.rows(0, sum(lengths)), states, *batch.args, **extras)
    expected = selective_scan(*inp.rows(0, sum(lengths)), ref_states, *batch.args, impl="reference", **extras)

    assert out.dtype == dtype and states.dtype == state_dtype and not out.isnan().any()
    assert_close(out, expected)
    assert_close(states, ref_states)
    assert_only_slots_changed(before, states, batch.used_slots())


def test_long_sequence_crosses_token_blocks(gen):
    """More tokens than the CPU path's precompute block, so the state crosses block edges."""
    inp = scan_inputs(gen, "cpu", 150, channels=8, groups=1, state_size=4)
    batch = mamba_batch([150], 2, generator=gen)
    states = states_for(gen, "cpu", 2, channels=8, state_size=4)
    ref_states = states.clone()
    out = selective_scan(*inp.rows(0, 150), states, *batch.args, **inp.extras(0, 150))
    expected = selective_scan(*inp.rows(0, 150), ref_states, *batch.args, impl="reference", **inp.extras(0, 150))
    assert_close(out, expected)
    assert_close(states, ref_states)


@settings(max_examples=12, deadline=None)
@given(length=st.integers(1, 40), cuts=st.lists(st.integers(0, 40), max_size=3))
def test_chunked_prefill_equals_one_shot(length, cuts):
    gen = torch.Generator().manual_seed(length)
    inp = scan_inputs(gen, "cpu", length, channels=8, state_size=4)
    states = states_for(gen, "cpu", 3, channels=8, state_size=4)

    def run(lo, hi, batch, into):
        return selective_scan(*inp.rows(lo, hi), into, *batch.args, **inp.extras(lo, hi))

    kernel_helpers.assert_chunked_equals_whole(run, length, cuts, states, 3, generator=gen)


def test_decode_after_prefill_equals_longer_prefill(device, gen):
    prompt, extra = 12, 3
    inp = scan_inputs(gen, device, prompt + extra)
    states = states_for(gen, device, 2)
    batch, longer = kernel_helpers.prefill_and_longer([prompt], extra, 2, generator=gen, device=device)
    long_states = states.clone()
    expected = selective_scan(*inp.rows(0, prompt + extra), long_states, *longer.args, **inp.extras(0, prompt + extra))

    selective_scan(*inp.rows(0, prompt), states, *batch.args, **inp.extras(0, prompt))
    steps = [selective_state_update(*inp.rows(t, t + 1), states, batch.state_indices, D=inp.D,
                                    z=inp.z[t:t + 1], dt_bias=inp.delta_bias)
             for t in range(prompt, prompt + extra)]
    assert_close(torch.cat(steps), expected[prompt:])
    assert_close(states, long_states)


@pytest.mark.parametrize("dtype, state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("groups", [1, 2])
def test_state_update_matches_reference_and_skips_padding(device, gen, dtype, state_dtype, groups):
    inp = scan_inputs(gen, device, 5, channels=32, groups=groups, dtype=dtype)
    states = states_for(gen, device, 8, channels=32, dtype=state_dtype)
    indices = torch.tensor([7, -1, 1, 3, -1], device=device)
    before, ref_states = states.clone(), states.clone()
    kwargs = dict(D=inp.D, z=inp.z, dt_bias=inp.delta_bias)
    out = selective_state_update(*inp.rows(0, 5), states, indices, **kwargs)
    expected = selective_state_update(*inp.rows(0, 5), ref_states, indices, impl="reference", **kwargs)
    assert out.dtype == dtype
    assert_close(out, expected)
    assert_close(states, ref_states)
    assert_only_slots_changed(before, states, [7, 1, 3])


def test_state_update_is_the_stated_recurrence(device, gen):
    """No softplus/bias/D/z: s' = exp(dt A) s + dt u B and y = s' C, written out directly."""
    inp = scan_inputs(gen, device, 2, channels=4, groups=1, state_size=3)
    dt = torch.rand(2, 4, generator=gen).to(device)
    states = states_for(gen, device, 2, channels=4, state_size=3)
    start = states.clone()
    out = selective_state_update(*inp.rows(0, 2)[:1], dt, *inp.rows(0, 2)[2:], states,
                                 torch.tensor([1, 0], device=device), dt_softplus=False)
    new = torch.exp(dt[..., None] * inp.A) * start[[1, 0]] + (dt * inp.u)[..., None] * inp.B[:, 0, None, :]
    assert_close(states[[1, 0]], new)
    assert_close(out, (new * inp.C[:, 0, None, :]).sum(-1))


@pytest.mark.parametrize("change, field", [
    (dict(A=torch.zeros(16, 4)), "B"),
    (dict(A=torch.zeros(15, 8)), "A"),
    (dict(B=torch.zeros(5, 3, 8)), "B"),
    (dict(z=torch.zeros(5, 15)), "z"),
    (dict(delta_bias=torch.zeros(3)), "delta_bias"),
    (dict(ssm_states=torch.zeros(3, 16, 4)), "ssm_states"),
    (dict(has_initial_state=torch.tensor([True])), "has_initial_state"),
])
def test_bad_arguments_name_the_field_and_change_nothing(gen, change, field):
    inp = scan_inputs(gen, "cpu", 5)
    states = states_for(gen, "cpu", 3)
    args = dict(u=inp.u, delta=inp.delta, A=inp.A, B=inp.B, C=inp.C, ssm_states=states,
                **kernel_helpers.two_sequences_of_5())
    assert_refused(selective_scan, args, change, field, states)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_scan_and_update_match_torch(device, gen, triton_impl, dtype):
    lengths = [7, 1, 0, 5]
    batch = mamba_batch(lengths, 6, generator=gen, device=device, padding=(3,), fresh=(1,))
    inp = scan_inputs(gen, device, sum(lengths), channels=16, groups=2, state_size=8, dtype=dtype)
    states = states_for(gen, device, 6)
    states[batch.state_indices[1]] = NAN
    before, ref_states = states.clone(), states.clone()
    out = selective_scan(*inp.rows(0, 13), states, *batch.args, impl=triton_impl, **inp.extras(0, 13))
    expected = selective_scan(*inp.rows(0, 13), ref_states, *batch.args, impl="torch", **inp.extras(0, 13))
    assert_close(out, expected)
    assert_close(states, ref_states)
    assert_only_slots_changed(before, states, batch.used_slots())

    step = scan_inputs(gen, device, 4, channels=16, groups=2, state_size=8, dtype=dtype)
    kwargs = dict(D=step.D, z=step.z, dt_bias=step.delta_bias)
    out = selective_state_update(*step.rows(0, 4), states, batch.state_indices, impl=triton_impl, **kwargs)
    expected = selective_state_update(*step.rows(0, 4), ref_states, batch.state_indices, impl="torch", **kwargs)
    assert_close(out, expected)
    assert_close(states, ref_states)
