"""Session-wide test settings shared by every tier.

Two shared cores: torch ops get 10-20x slower when two processes fight over intra-op
threads, so every test process uses one thread.
"""

from __future__ import annotations

import importlib.util
import os

from hypothesis import settings as hypothesis_settings

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
# gRPC's fork handlers can deadlock Popen's fork() in a process that has used grpc.aio
# (seen: a test hanging inside fork while starting a server). Tests only fork to exec
# servers, so the handlers are not needed. Must be set before grpc is imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

if importlib.util.find_spec("torch") is not None:  # the cache-service tiers run without torch
    import torch

    torch.set_num_threads(1)


# Hypothesis' per-example deadline measures wall time, which on a shared 2-core machine says
# more about the neighbours than about the code: examples are bounded by their size instead.
hypothesis_settings.register_profile("kvcache", deadline=None)
hypothesis_settings.load_profile("kvcache")
