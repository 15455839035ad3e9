"""Gated RMSNorm (kernels.norm) against the row-by-row reference and its defining properties."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import gated_rms_norm

from kernel_helpers import assert_close, randn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_size", [None, 8])
@pytest.mark.parametrize("norm_before_gate, gated", [(False, True), (True, True), (False, False)])
def test_matches_reference(device, gen, dtype, group_size, norm_before_gate, gated):
    x = randn(9, 32, generator=gen, dtype=dtype, device=device)
    z = randn(9, 32, generator=gen, dtype=dtype, device=device) if gated else None
    weight = randn(32, generator=gen, device=device)
    kwargs = dict(group_size=group_size, norm_before_gate=norm_before_gate)
    out = gated_rms_norm(x, z, weight, **kwargs)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, gated_rms_norm(x, z, weight, impl="reference", **kwargs))


def test_mamba2_order_gates_before_normalising(device, gen):
    """norm_before_gate=False: y = rmsnorm_groups(x * silu(z)) * weight, written out directly."""
    x, z = randn(3, 12, generator=gen, device=device), randn(3, 12, generator=gen, device=device)
    weight = randn(12, generator=gen, device=device)
    gated = (x * F.silu(z)).view(3, 3, 4)
    expected = (gated / gated.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()).view(3, 12) * weight
    assert_close(gated_rms_norm(x, z, weight, eps=1e-5, group_size=4), expected)


@settings(max_examples=25, deadline=None)
@given(scale=st.floats(1e-2, 1e2), rows=st.integers(1, 4), groups=st.sampled_from([1, 2, 4]))
def test_each_group_is_scale_invariant(scale, rows, groups):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 16, generator=gen)
    weight = torch.randn(16, generator=gen)
    factors = torch.full((16,), scale).view(groups, -1)
    factors[0] = 1.0  # scaling one group must not change the others, nor itself
    scaled = (x.view(rows, groups, -1) * factors).view(rows, 16)
    kwargs = dict(eps=0.0, group_size=16 // groups)
    assert_close(gated_rms_norm(scaled, None, weight, **kwargs), gated_rms_norm(x, None, weight, **kwargs))


def test_leading_dimensions_are_kept(gen):
    x = torch.randn(2, 3, 8, generator=gen)
    weight = torch.randn(8, generator=gen)
    assert_close(gated_rms_norm(x, x, weight).view(6, 8), gated_rms_norm(x.view(6, 8), x.view(6, 8), weight))


@pytest.mark.parametrize("change, field", [
    (dict(z=torch.zeros(4, 7)), "z"),
    (dict(weight=torch.zeros(7)), "weight"),
    (dict(group_size=3), "group_size"),
    (dict(eps=-1.0), "eps"),
])
def test_bad_arguments_name_the_field(change, field):
    args = dict(x=torch.zeros(4, 8), z=None, weight=torch.ones(8))
    args.update(change)
    with pytest.raises(ValueError, match=field):
        gated_rms_norm(**args)


@pytest.mark.triton
@pytest.mark.parametrize("group_size, norm_before_gate", [(None, False), (8, True)])
def test_triton_matches_torch(device, gen, triton_impl, group_size, norm_before_gate):
    x = randn(5, 32, generator=gen, device=device)
    z = randn(5, 32, generator=gen, device=device)
    weight = randn(32, generator=gen, device=device)
    kwargs = dict(group_size=group_size, norm_before_gate=norm_before_gate)
    assert_close(gated_rms_norm(x, z, weight, impl=triton_impl, **kwargs),
                 gated_rms_norm(x, z, weight, impl="torch", **kwargs))
