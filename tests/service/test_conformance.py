"""The conformance kit: `python -m cache_service.conformance` against a real server
subprocess; docs/conformance.md's two commands run as written (HOST:PORT, C.json and T.jsonl
filled in through tests/doc_commands.py's substitution table); the bundled answers carry
their provenance."""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cache_service.conformance import SAMPLES, bundled
from cache_service.replay import read_expected
from kvcache_common.launch import ServerProcess
from tests.doc_commands import ROOT, shell, substitute

BUNDLED = "python -m cache_service.conformance --target HOST:PORT"
ANY_TRACE = "python -m cache_service.conformance --target HOST:PORT --config C.json --trace T.jsonl"


def conformance(server: ServerProcess, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cache_service.conformance", "--target",
                           server.target, *args], capture_output=True, text=True, timeout=600)


def test_every_expected_file_is_stamped_with_its_provenance() -> None:
    expected = sorted(SAMPLES.glob("*.expected.jsonl"))
    assert len(expected) == len(bundled()) >= 12
    for path in expected:
        provenance, results = read_expected(path.read_text())
        name = path.name.removesuffix(".expected.jsonl")
        assert provenance is not None, path.name
        assert provenance["vllm_version"] == "0.33.0"
        assert provenance["config"] == f"{name.split('.')[0]}.json"
        assert provenance["trace"] == f"{name}.jsonl"
        assert provenance["trace_generator"] and provenance["command"].startswith(
            "python scripts/oracle/oracle_diff.py")
        trace = (SAMPLES / provenance["trace"]).read_text()
        assert provenance["trace_sha256"] == hashlib.sha256(trace.encode()).hexdigest(), \
            f"{path.name}: the trace changed after its answers were recorded"
        ops = [line for line in trace.splitlines() if line.strip() and not line.startswith("#")]
        assert len(results) == len(ops)


def test_the_bundled_samples_conform(server: ServerProcess) -> None:
    proc = shell(substitute(BUNDLED, {"target": server.target}), ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == f"{len(bundled())}/{len(bundled())} traces conform"
    assert all(": " in line and line.endswith("vs vLLM 0.33.0: ok") for line in lines[:-1])


def test_a_wrong_answer_is_reported(server: ServerProcess, tmp_path: Path) -> None:
    """A tampered expected file (one block id changed) fails, naming the operation."""
    name, config, trace, expected = bundled()[0]
    provenance, results = read_expected(expected.read_text())
    index = next(i for i, r in enumerate(results) if r.get("new_block_ids"))
    group = next(g for g in results[index]["new_block_ids"] if g)
    group[0] += 1000
    bad = tmp_path / "bad.expected.jsonl"
    bad.write_text("\n".join(json.dumps(r) for r in results) + "\n")
    proc = conformance(server, "--config", str(config), "--trace", str(trace),
                       "--expected", str(bad))
    assert proc.returncode == 1
    assert "1 differ" in proc.stdout and f"op {index} " in proc.stdout
    assert proc.stdout.splitlines()[-1] == "0/1 traces conform"


def test_any_trace_without_answers_is_checked_against_the_replay_tool(
        server: ServerProcess, tmp_path: Path) -> None:
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"num_blocks": 8, "max_model_len": 64,
                                  "groups": [{"type": "full_attention", "block_size": 4}]}))
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(op) for op in [
        {"op": "add", "req": "a", "tokens": list(range(10))}, {"op": "lookup", "req": "a"},
        {"op": "allocate", "req": "a", "num_new_tokens": 10}, {"op": "free", "req": "a"},
        {"op": "add", "req": "b", "tokens": list(range(9))}, {"op": "lookup", "req": "b"},
        {"op": "allocate", "req": "b", "num_new_tokens": 1}, {"op": "usage"},
        {"op": "frobnicate"}]) + "\n")
    proc = shell(substitute(ANY_TRACE, {"target": server.target, "config": str(config),
                                        "trace": str(trace)}), ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == ["t: 9 ops vs replay tool: ok", "1/1 traces conform"]


@pytest.mark.parametrize("args", [["--trace", "x.jsonl"], ["--expected", "e.jsonl"]])
def test_bad_arguments_exit_2(server: ServerProcess, args: list[str]) -> None:
    assert conformance(server, *args).returncode == 2


def test_a_dead_target_is_one_line_exit_2() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    proc = shell(substitute(BUNDLED, {"target": dead}), ROOT, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    # The client resends a read until the probe's 5 s deadline: the last word is either
    # the refused connection or the deadline that ended the resends.
    prefix = f"python -m cache_service.conformance: error: --target {dead}: "
    assert proc.stderr.startswith((prefix + "UNAVAILABLE", prefix + "DEADLINE_EXCEEDED"))


def test_the_docs_example_count_is_the_bundled_count() -> None:
    doc = (ROOT / "docs/conformance.md").read_text()
    n = len(bundled())
    assert f"`{n}/{n} traces conform`" in doc
