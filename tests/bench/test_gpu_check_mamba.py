"""The Mamba GPU check's dry-run mode (bench/gpu_check_mamba.py): tiny shapes on CPU, same plumbing."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "gpu_check_mamba.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check_mamba", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_reports_both_checks_and_agrees_with_the_reference(gpu_check):
    rows = gpu_check.run("cpu", dry_run=True)
    assert [r["check"] for r in rows] == ["mamba2_state_update_bandwidth", "ssd_prefill_tflops"]
    for row in rows:
        assert row["dry_run"] and row["ok"] and row["oracle"] == "reference"
        assert row["rms_error_vs_oracle"] < 1e-2
        assert row["ms"] > 0 and math.isfinite(row["fraction_of_peak"]) and row["fraction_of_peak"] > 0
    assert rows[0]["GBps"] > 0 and rows[1]["TFLOPs"] > 0


def test_flop_count_matches_the_chunked_algorithm(gpu_check):
    # one chunk, one head, Q=2, P=3, N=5: scores 2*Q*Q*N, diagonal 2*Q*Q*P, end state and carried 2*Q*P*N each
    assert gpu_check._ssd_flops(1, 1, 2, 3, 5) == 2 * 2 * 5 * 2 + 2 * 2 * 3 * 2 + 2 * (2 * 2 * 3 * 5)


def test_full_size_needs_a_gpu(gpu_check):
    with pytest.raises(ValueError, match="dry_run"):
        gpu_check.run("cpu", dry_run=False)
