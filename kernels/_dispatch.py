"""Choosing an implementation for a kernel call, and importing Triton only when it is needed.

Every public op in `kernels` takes ``impl: str | None``. ``None`` means "pick by device": CUDA
tensors run the Triton kernels, CPU tensors run the vectorized torch code. Forcing ``"triton"``
on CPU tensors only works when ``TRITON_INTERPRET=1`` was set before the Triton module was first
imported (Triton reads the variable when it decorates the kernels).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from kernels import reference

IMPLS: tuple[str, ...] = ("reference", "torch", "triton")


def select_impl(impl: str | None, *tensors: torch.Tensor | None) -> str:
    """Return the implementation to run: ``impl`` if given, else by the tensors' device.

    All non-None tensors must live on one device. Raises ValueError naming ``impl`` for an
    unknown name, and for ``"triton"`` on CPU tensors without ``TRITON_INTERPRET=1``.
    """
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(f"tensors: all inputs must be on one device, got {names}")
    device_type = next(iter(devices)).type if devices else "cpu"
    if impl is None:
        return "triton" if device_type == "cuda" else "torch"
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS} or None, got {impl!r}")
    if impl == "triton" and device_type != "cuda" and not triton_interpret_enabled():
        raise ValueError(
            "impl: 'triton' on CPU tensors needs TRITON_INTERPRET=1 set before the kernels are imported"
        )
    return impl


def triton_interpret_enabled() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def load_triton_module(name: str) -> ModuleType:
    """Import ``kernels.<name>`` (a module of Triton kernels) on first use.

    Kept lazy so that importing ``kernels`` never imports triton: CPU users may not have it.
    """
    try:
        return importlib.import_module(f"kernels.{name}")
    except ImportError as exc:
        if (exc.name or "").split(".")[0] != "triton":
            raise
        raise ImportError(f"kernels.{name} needs the 'triton' package, which cannot be imported: {exc}") from exc


def run_impl(which: str, name: str, triton_module: str, torch_impl: Callable[..., torch.Tensor],
             *args: Any, **kwargs: Any) -> torch.Tensor:
    """Run op ``name`` as ``which`` (an answer of :func:`select_impl`) says: ``kernels.reference.<name>``,
    ``kernels.<triton_module>.<name>`` (imported on first use) or ``torch_impl``."""
    if which == "reference":
        return getattr(reference, name)(*args, **kwargs)
    if which == "triton":
        return getattr(load_triton_module(triton_module), name)(*args, **kwargs)
    return torch_impl(*args, **kwargs)
