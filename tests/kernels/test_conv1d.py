"""Causal conv1d with cached state (kernels.conv1d) against the token-by-token reference.

Slots that a call must not read hold NaN (fresh sequences' slots), so reading them shows up as NaN
in an output; slots a call must not write are checked bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import causal_conv1d, causal_conv1d_update

import kernel_helpers
from kernel_helpers import assert_close, assert_only_slots_changed, assert_refused, mamba_batch, randn

NAN = float("nan")


def conv_inputs(gen: torch.Generator, device: torch.device, tokens: int, channels: int, width: int,
                slots: int, dtype: torch.dtype = torch.float32, state_dtype: torch.dtype | None = None):
    x = randn(tokens, channels, generator=gen, dtype=dtype, device=device)
    weight = randn(channels, width, generator=gen, dtype=dtype, device=device, scale=0.5)
    bias = randn(channels, generator=gen, dtype=dtype, device=device)
    states = randn(slots, width - 1, channels, generator=gen, dtype=state_dtype or dtype, device=device)
    return x, weight, bias, states


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("activation, use_bias", [("silu", True), (None, False)])
def test_prefill_matches_reference(device, gen, dtype, width, activation, use_bias):
    lengths = [1, 7, 0, 20, 5]
    batch = mamba_batch(lengths, 8, generator=gen, device=device, padding=(4,), fresh=(1, 2))
    x, weight, bias, states = conv_inputs(gen, device, sum(lengths), 24, width, 8, dtype)
    bias = bias if use_bias else None
    for row in (1, 2):  # fresh sequences: whatever their slot holds must be ignored
        states[batch.state_indices[row]] = NAN
    ref_states, states_before = states.clone(), states.clone()

    out = causal_conv1d(x, weight, bias, states, *batch.args, activation=activation)
    expected = causal_conv1d(x, weight, bias, ref_states, *batch.args, activation=activation, impl="reference")

    assert out.dtype == dtype and not out.isnan().any()
    assert_close(out, expected)
    assert_close(states, ref_states)
    assert_only_slots_changed(states_before, states, batch.used_slots())


def test_final_state_holds_last_raw_inputs(device, gen):
    """The slot keeps the last W-1 raw inputs of [start state | x], left-padded from the state."""
    batch = mamba_batch([2, 6], 3, generator=gen, device=device)
    x, weight, bias, states = conv_inputs(gen, device, 8, 5, 4, 3)
    start = states.clone()
    causal_conv1d(x, weight, bias, states, *batch.args)
    first, second = batch.state_indices.tolist()
    torch.testing.assert_close(states[first], torch.cat([start[first][-1:], x[:2]]), rtol=0, atol=0)
    torch.testing.assert_close(states[second], x[-3:], rtol=0, atol=0)


@settings(max_examples=15, deadline=None)
@given(length=st.integers(1, 40), cuts=st.lists(st.integers(0, 40), max_size=3), width=st.integers(2, 4))
def test_chunked_prefill_equals_one_shot(length, cuts, width):
    gen = torch.Generator().manual_seed(length * 7 + width)
    x, weight, bias, states = conv_inputs(gen, "cpu", length, 6, width, 2)

    def run(lo, hi, batch, into):
        return causal_conv1d(x[lo:hi], weight, bias, into, *batch.args)

    kernel_helpers.assert_chunked_equals_whole(run, length, cuts, states, 2, generator=gen)


def test_decode_after_prefill_equals_longer_prefill(device, gen):
    lengths, extra = [9, 3], 3
    x, weight, bias, states = conv_inputs(gen, device, sum(lengths) + 2 * extra, 16, 4, 4)
    decode_x = x[sum(lengths):].view(extra, 2, 16)
    batch, longer = kernel_helpers.prefill_and_longer(lengths, extra, 4, generator=gen, device=device)
    longer_x = torch.cat([x[:9], decode_x[:, 0], x[9:12], decode_x[:, 1]])
    long_states = states.clone()
    expected = causal_conv1d(longer_x, weight, bias, long_states, *longer.args)

    causal_conv1d(x[:12], weight, bias, states, *batch.args)
    steps = [causal_conv1d_update(decode_x[i], weight, bias, states, batch.state_indices) for i in range(extra)]
    assert_close(torch.stack(steps)[:, 0], expected[9:12])
    assert_close(torch.stack(steps)[:, 1], expected[15:18])
    assert_close(states, long_states)


@pytest.mark.parametrize("dtype, state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.bfloat16, torch.float32)])
def test_update_matches_reference_and_skips_padding(device, gen, dtype, state_dtype):
    x, weight, bias, states = conv_inputs(gen, device, 6, 40, 4, 10, dtype, state_dtype)
    indices = torch.tensor([3, -1, 0, 7, -1, 9], device=device)
    before, ref_states = states.clone(), states.clone()
    out = causal_conv1d_update(x, weight, bias, states, indices)
    expected = causal_conv1d_update(x, weight, bias, ref_states, indices, impl="reference")
    assert out.dtype == dtype
    assert_close(out, expected)
    assert_close(states, ref_states)
    assert_only_slots_changed(before, states, [3, 0, 7, 9])
    # a padding row runs from a zero state: its output is act(bias + w[:, -1] * x)
    assert_close(out[1], torch.nn.functional.silu(bias.float() + weight[:, -1].float() * x[1].float()).to(dtype))


@pytest.mark.parametrize("change, field", [
    (dict(weight=torch.zeros(5, 4)), "weight"),
    (dict(bias=torch.zeros(3)), "bias"),
    (dict(state_indices=torch.tensor([0, 9])), "state_indices"),
    (dict(state_indices=torch.tensor([1, 1])), "state_indices"),
    (dict(query_start_loc=torch.tensor([0, 3, 2], dtype=torch.int32)), "query_start_loc"),
    (dict(query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32)), "query_start_loc"),
    (dict(has_initial_state=torch.tensor([1, 0])), "has_initial_state"),
    (dict(activation="relu"), "activation"),
    (dict(impl="fast"), "impl"),
])
def test_bad_arguments_name_the_field_and_change_nothing(gen, change, field):
    x, weight, bias, states = conv_inputs(gen, "cpu", 6, 8, 4, 3)
    args = dict(x=x, weight=weight, bias=bias, conv_states=states,
                query_start_loc=torch.tensor([0, 2, 6], dtype=torch.int32), state_indices=torch.tensor([0, 2]),
                has_initial_state=torch.tensor([True, False]))
    assert_refused(causal_conv1d, args, change, field, states)


@pytest.mark.triton
@pytest.mark.parametrize("width", [2, 4])
def test_triton_matches_torch(device, gen, triton_impl, width):
    lengths = [1, 13, 0, 6]
    batch = mamba_batch(lengths, 6, generator=gen, device=device, padding=(3,), fresh=(1,))
    x, weight, bias, _ = conv_inputs(gen, device, sum(lengths), 20, width, 6)
    # the cache is a strided view: the executor's vLLM-style layout stores [W-1, C] inside a larger block
    pool = randn(6, width - 1 + 2, 20, generator=gen, device=device)
    states = pool[:, 1:width]
    states[batch.state_indices[1]] = NAN
    before, ref_states = states.clone(), states.clone()
    out = causal_conv1d(x, weight, bias, states, *batch.args, impl=triton_impl)
    expected = causal_conv1d(x, weight, bias, ref_states, *batch.args, impl="torch")
    assert_close(out, expected)
    assert_close(states, ref_states)
    assert_only_slots_changed(before, states, batch.used_slots())

    decode = randn(4, 20, generator=gen, device=device)
    out = causal_conv1d_update(decode, weight, bias, states, batch.state_indices, activation=None, impl=triton_impl)
    expected = causal_conv1d_update(decode, weight, bias, ref_states, batch.state_indices, activation=None,
                                    impl="torch")
    assert_close(out, expected)
    assert_close(states, ref_states)
