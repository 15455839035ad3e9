"""Shared fixtures for the kernel tests (attention and Mamba).

Device: the tests run on CPU unless ``KERNELS_TEST_DEVICE=cuda`` is set (bench/gpu_check.py sets it
on a GPU machine); the ``device`` fixture hands the chosen torch.device to every test.

Triton on CPU (how the ``@pytest.mark.triton`` tests work): Triton decides whether a kernel runs in
its CPU interpreter when the ``@triton.jit`` decorator executes, i.e. when a ``kernels.triton_*``
module is first imported. `kernels` imports those modules lazily (only when a Triton
implementation is called), and no test imports them at collection time, so setting
``TRITON_INTERPRET=1`` here, at conftest import, precedes every such import in this process.
On CUDA the variable is left alone and the same tests run the compiled kernels. Use the
``triton_impl`` fixture in Triton tests: it skips when triton is not installed and checks that
the interpreter really is on when the tensors live on CPU. Keep their shapes tiny (a few
programs, a few loop iterations): the interpreter costs ~1 ms per program per op.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch  # does not import triton: TRITON_INTERPRET below still precedes that

DEVICE = os.environ.get("KERNELS_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    """The device the kernel tests run on (KERNELS_TEST_DEVICE, default cpu)."""
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.skip("KERNELS_TEST_DEVICE=cuda but no CUDA device is available")
    return torch.device(DEVICE)


@pytest.fixture
def gen() -> torch.Generator:
    """A CPU generator with a fixed seed: create tensors on CPU with it, then move them."""
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def triton_impl(device: torch.device) -> str:
    """The impl name for Triton tests; skips without triton; on CPU demands the interpreter."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if device.type == "cpu":
        assert os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"), (
            "TRITON_INTERPRET must be 1 for Triton tests on CPU (tests/kernels/conftest.py sets it)")
        compiled = _compiled_triton_kernels()
        assert not compiled, f"imported before TRITON_INTERPRET was set, so they cannot run on CPU: {compiled}"
    return "triton"


def _compiled_triton_kernels() -> list[str]:
    """Kernels in already-imported kernels.triton_* modules that are not interpreter functions."""
    from triton.runtime.jit import JITFunction

    found = []
    for name, module in list(sys.modules.items()):
        if name.startswith("kernels.triton_"):
            found += [f"{name}.{attr}" for attr, value in vars(module).items() if isinstance(value, JITFunction)]
    return found
