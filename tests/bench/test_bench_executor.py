"""bench/bench_executor.py's timed stand-in mode, in process and short: the engine over the
stand-in runs the workload to the end with the overlap on and off, against the core in
process and against a real cache service, producing the same tokens, and its exposed cache
wait is part of its cache-call time (all of it without the overlap)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from executor.demo import make_workload
from kvcache_common.launch import start_cache_service

REPO = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    sys.path.insert(0, str(REPO / "bench"))  # the script imports its sibling _common
    spec = importlib.util.spec_from_file_location("bench_executor",
                                                  REPO / "bench" / "bench_executor.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("remote", [False, True], ids=["in-process", "service"])
def test_the_stand_in_runs_the_workload_alike_with_and_without_overlap(remote: bool) -> None:
    bench = _load()
    args = argparse.Namespace(preset="hybrid-fsm", sim_blocks=512, concurrency=6, max_tokens=9)
    prompts = make_workload(10, prefix_len=40, suffix_len=12, num_prefixes=2, vocab=1000, seed=0)
    with start_cache_service() if remote else contextlib.nullcontext() as server:
        target = server.target if server is not None else None
        off = bench.run_simulated(target, args, 1.0, False, prompts)
        on = bench.run_simulated(target, args, 1.0, True, prompts)
    for run in (off, on):
        assert run["generated_tokens"] == 10 * 9
        assert 0 < run["cache_wait_s"] <= run["cache_call_s"]
    assert off["cache_wait_s"] == pytest.approx(off["cache_call_s"])
    assert on["outputs_digest"] == off["outputs_digest"]
