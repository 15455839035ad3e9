"""bench/gpu_check.py in --dry-run mode: the one-shot GPU check's plumbing, on CPU.

The real run happens on an H200 with a short budget, so everything that can be wrong without a GPU
is checked here, once, on tiny shapes: every step runs (Triton kernels in the interpreter, a quick
kernel-test subset), the derived numbers in the report are consistent with the sizes moved and the
times measured, each row's verdict follows from its error, and the Triton Mamba kernels (not the
torch fallback) are what the Mamba rows timed.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from tests.doc_commands import shell

REPO = Path(__file__).resolve().parents[2]
DRY_RUN = "python3 bench/gpu_check.py --dry-run"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dry_run(checkout_copy: Path) -> tuple[dict[str, Any], str]:
    """The report and stdout of one ``gpu_check.py --dry-run`` (about a minute on one core),
    docs/benchmarks.md's command run as written from a copy of the checkout (the report goes
    to its bench/results/)."""
    env: dict[str, str | None] = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                                  # the script must choose these itself on CPU
                                  "KERNELS_TEST_DEVICE": None, "TRITON_INTERPRET": None}
    proc = shell(DRY_RUN, checkout_copy, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = checkout_copy / "bench" / "results" / "gpu_check.json"
    return json.loads(report.read_text()), proc.stdout


@pytest.fixture(scope="module")
def rows(dry_run: tuple[dict[str, Any], str]) -> dict[str, dict[str, Any]]:
    report, _ = dry_run
    by_check = {row["check"]: row for row in report["rows"]}
    assert len(by_check) == len(report["rows"]), "two rows share a check name"
    return by_check


def test_every_step_ran_and_is_in_the_printed_table(dry_run, rows):
    report, stdout = dry_run
    assert report["dry_run"] is True and report["gpu"] is None
    names = set(rows)
    assert {"kernel_tests", "copy_bandwidth", "prefill_attention", "mamba2_state_update_bandwidth",
            "ssd_prefill_tflops"} <= names
    # decode: the automatic split choice plus the forced variants 1 and 4
    assert {row["splits"] for name, row in rows.items() if name.startswith("decode_attention")} == {1, 4}
    for kind in ("decode", "prefill"):
        sweep = [name for name in names if name.startswith(f"sweep {kind} ")]
        assert len(sweep) >= 2, f"tile sweep for {kind}: {sweep}"
        assert sum("(the current default)" in rows[name]["shape"] for name in sweep) == 1
    assert "GPU check (DRY RUN" in stdout
    for name in names:  # the table may wrap a long name over two lines: look for its first word run
        assert name.split(" (")[0].split(" tiles")[0] in stdout, name


def test_kernel_test_step_counts_come_from_the_junit_report(rows):
    tests = rows["kernel_tests"]
    assert tests["device"] == "cpu" and tests["returncode"] == 0
    assert tests["failures"] == tests["errors"] == 0 and tests["failed_tests"] == []
    assert tests["passed"] == tests["tests"] - tests["skipped"] >= 1


def test_bandwidth_and_flop_rates_match_the_bytes_and_times_reported(rows):
    gpu_check = _load("gpu_check")
    gpu_check_mamba = _load("gpu_check_mamba")
    copy = rows["copy_bandwidth"]
    copied = 2 * (1 << 16) * 2  # read + write of the dry run's 65,536 bf16 values
    assert copy["value"] == pytest.approx(copied / (copy["ms"] / 1e3) / 1e9, rel=1e-9)
    assert copy["fraction"] == pytest.approx(copy["value"] / gpu_check.COPY_CEILING_GBPS, rel=1e-9)
    decode = [row for name, row in rows.items() if name.startswith("decode_attention")]
    moved_gb = next(row["kv_GB"] for row in decode if "kv_GB" in row)
    # K and V of 2 requests x 40 tokens x 2 KV heads x 16 dims, plus q read and written, in bf16
    assert moved_gb * 1e9 == pytest.approx(2 * (2 * 40 * 2 * 16) * 2 + 2 * (2 * 4 * 16) * 2)
    for row in decode:
        assert row["value"] == pytest.approx(moved_gb / (row["ms"] / 1e3), rel=1e-9)
        # "% of copy" is relative to the bandwidth measured in the same run
        assert row["of_copy"] == pytest.approx(row["value"] / copy["value"], rel=1e-9)
    state = rows["mamba2_state_update_bandwidth"]
    assert state["value"] == state["GBps"] and state["unit"] == "GB/s"
    assert state["fraction"] == pytest.approx(state["GBps"] / gpu_check_mamba.PEAK_BANDWIDTH_GBPS, rel=1e-9)
    prefill = rows["ssd_prefill_tflops"]
    # 2 sequences x 40 tokens in chunks of 16 -> 3 chunks each; 4 heads, head 16, state 16
    flops = gpu_check_mamba._ssd_flops(2 * 3, 4, 16, 16, 16)
    assert prefill["TFLOPs"] == pytest.approx(flops / (prefill["ms"] / 1e3) / 1e12, rel=1e-9)
    assert prefill["value"] == prefill["TFLOPs"] and prefill["unit"] == "TFLOP/s"


def test_the_host_tier_rows_time_the_executors_batched_copies(rows):
    gpu_check = _load("gpu_check")
    for name in ("host_tier demote (device->host)", "host_tier promote (host->device)"):
        row = rows[name]
        assert row["bytes"] == 2 * 16 * 256  # 16 blocks x 2 layers x 256-byte pages
        assert row["value"] == pytest.approx(row["bytes"] / (row["ms"] / 1e3) / 1e9, rel=1e-9)
        assert row["fraction"] == pytest.approx(row["value"] / gpu_check.HOST_LINK_GBPS, rel=1e-9)
        assert row["of_copy"] == pytest.approx(row["value"] / row["raw_copy_GBps"], rel=1e-9)
        assert row["ok"] is True  # the blocks round-tripped bit-exactly


def test_each_verdict_follows_from_its_error(rows):
    checked = [row for row in rows.values() if row.get("rms_error") is not None]
    assert len(checked) >= 8
    for row in checked:
        assert math.isfinite(row["rms_error"]) and 0 <= row["rms_error"] < 1e-2, row
        assert row["ok"] is True
    assert all(row["ok"] for row in rows.values())


def test_the_mamba_rows_timed_the_triton_kernels_against_the_reference(rows):
    for name in ("mamba2_state_update_bandwidth", "ssd_prefill_tflops"):
        row = rows[name]
        assert row["impl"] == "triton" and row["oracle"] == "reference" and row["dry_run"] is True, row


def test_a_failing_step_is_recorded_and_the_rest_still_run():
    gpu_check = _load("gpu_check")

    def broken():
        raise RuntimeError("kernel exploded")

    rows = gpu_check._guard("decode_attention", broken, "cpu")
    assert rows == [dict(check="decode_attention", device="cpu", error="RuntimeError: kernel exploded", ok=False)]
    assert gpu_check._guard("fine", lambda: dict(check="fine", ok=True), "cpu") == [dict(check="fine", ok=True)]
