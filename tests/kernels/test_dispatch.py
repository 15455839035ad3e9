"""kernels._dispatch: choosing an implementation, and importing triton only when needed."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from kernels._dispatch import IMPLS, load_triton_module, select_impl


def test_default_follows_the_device(device):
    expected = "triton" if device.type == "cuda" else "torch"
    assert select_impl(None, torch.zeros(1, device=device), None) == expected


def test_cuda_tensors_default_to_triton():
    # select_impl only looks at .device, so a stand-in lets a CPU machine check the CUDA branch.
    assert select_impl(None, SimpleNamespace(device=torch.device("cuda", 0))) == "triton"
    assert select_impl(None, torch.zeros(1)) == "torch"
    assert select_impl(None) == "torch"


@pytest.mark.parametrize("impl", IMPLS)
def test_forced_impl_is_returned(impl, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_impl(impl, torch.zeros(1)) == impl


def test_unknown_impl_is_rejected():
    with pytest.raises(ValueError, match="impl"):
        select_impl("cuda", torch.zeros(1))


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        select_impl("triton", torch.zeros(1))


def test_mixed_devices_are_rejected():
    with pytest.raises(ValueError, match="one device"):
        select_impl(None, torch.zeros(1), torch.zeros(1, device="meta"))


def test_missing_kernel_module_is_not_blamed_on_triton():
    with pytest.raises(ModuleNotFoundError, match="kernels.no_such_module"):
        load_triton_module("no_such_module")


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env})


def test_cpu_use_never_imports_triton():
    code = """
import sys, torch, kernels
k = torch.randn(2, 4, 1, 8); v = torch.randn(2, 4, 1, 8)
kernels.write_kv_cache(k[0], v[0], k, v, torch.arange(4))
kernels.paged_attention(torch.randn(4, 2, 8), k, v, torch.tensor([[0]], dtype=torch.int32),
                        torch.tensor([4], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32), scale=1.0)
assert "triton" not in sys.modules, "triton was imported"
"""
    result = _python(code)
    assert result.returncode == 0, result.stderr


def test_triton_impl_without_triton_says_so():
    code = """
import sys, torch
sys.modules["triton"] = None  # makes 'import triton' fail as if it were not installed
import kernels
k = torch.zeros(1, 4, 1, 8)
kernels.write_kv_cache(k[0], k[0], k, k.clone(), torch.arange(4), impl="triton")
"""
    result = _python(code, TRITON_INTERPRET="1")
    assert result.returncode != 0
    assert "needs the 'triton' package" in result.stderr
