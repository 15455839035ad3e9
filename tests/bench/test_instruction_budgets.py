"""The instruction-count guard (bench/instruction_counts.py): the fixed core workload runs, and
under callgrind no op kind exceeds its budget in bench/instruction_budgets.json by more than
10%. Counts depend on the interpreter build: without valgrind or without budgets for this
build the check is skipped (the budgets' key says which build they are for)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "instruction_counts.py"
sys.path.insert(0, str(REPO / "bench"))

import instruction_counts  # noqa: E402
from tests.doc_commands import shell  # noqa: E402

COMMAND = "python3 bench/instruction_counts.py --check"


def test_the_workload_runs_every_kind_once_warm() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--child"], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    names = json.loads(done.stdout.strip().splitlines()[-1])
    assert names == [n for kind in instruction_counts.KINDS for n in (f"warmup:{kind}", kind)]


def test_no_op_kind_exceeds_its_budget(checkout_copy: Path) -> None:
    budgets = instruction_counts.load_budgets()
    for build in budgets.values():
        assert set(build) == set(instruction_counts.KINDS)
    if shutil.which("valgrind") is None:
        pytest.skip("valgrind is not installed")
    if instruction_counts.key() not in budgets:
        pytest.skip(f"no instruction budgets for {instruction_counts.key()} "
                    f"(bench/instruction_counts.py --update writes them)")
    # docs/benchmarks.md's command, as written, from a copy of the checkout.
    done = shell(COMMAND, checkout_copy, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads((checkout_copy / "bench" / "results" / "instructions.json").read_text())
    assert doc["over"] == [] and set(doc["counts"]) == set(instruction_counts.KINDS)
