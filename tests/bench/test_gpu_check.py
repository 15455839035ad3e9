"""bench/gpu_check.py in --dry-run mode: the plumbing of the one-shot GPU check, on CPU.

The real run happens once, on an H200, with no second chance; this runs every step end to end on
tiny shapes (Triton kernels in the interpreter, a quick test subset) and checks the report.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_check.py"


def _load_module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_runs_every_step_and_reports(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("KERNELS_TEST_DEVICE", None)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] is True
    rows = {row["check"]: row for row in report["rows"]}
    assert rows["kernel_tests"]["passed"] > 0 and rows["kernel_tests"]["failures"] == 0
    assert rows["copy_bandwidth"]["value"] > 0
    decode = [row for name, row in rows.items() if name.startswith("decode_attention")]
    assert {row["splits"] for row in decode} >= {1, 4}  # the auto choice and the forced variants ran
    for row in decode + [rows["prefill_attention"]]:
        assert row["value"] > 0 and row["rms_error"] < 1e-2
    if (REPO / "bench" / "gpu_check_mamba.py").exists():
        assert any(row.get("unit") in ("GB/s", "TFLOP/s") and "decode" not in name and "prefill_attention" != name
                   and name != "copy_bandwidth" for name, row in rows.items())
    assert all(row["ok"] for row in report["rows"])
    assert "GPU check (DRY RUN" in proc.stdout


def test_a_failing_step_is_recorded_and_the_rest_still_run():
    gpu_check = _load_module()

    def broken():
        raise RuntimeError("kernel exploded")

    rows = gpu_check._guard("decode_attention", broken, "cpu")
    assert rows == [dict(check="decode_attention", device="cpu", error="RuntimeError: kernel exploded", ok=False)]
    assert gpu_check._guard("fine", lambda: dict(check="fine", ok=True), "cpu") == [dict(check="fine", ok=True)]
