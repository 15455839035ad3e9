"""bench/bench_policy.py run small, in process: on the generated agentic workload, pins,
classes and hints each recompute fewer session prompt tokens than plain LRU, and LRU
itself recomputes some (the pool is too small to keep every session); the JSON holds every
policy and the Step cost of both trees."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    sys.path.insert(0, str(REPO / "bench"))  # the script imports its siblings
    spec = importlib.util.spec_from_file_location("bench_policy",
                                                  REPO / "bench" / "bench_policy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_policy"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_policies_beat_plain_lru_on_the_agentic_workload(tmp_path: Path) -> None:
    out = tmp_path / "policy.json"
    assert _load().main(["--sessions", "6", "--turns", "5", "--step-requests", "16",
                         "--step-count", "5", "--step-rounds", "1", "--step-pairs", "1",
                         "--baseline-tree", str(REPO), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    runs = doc["agentic"]["policies"]
    lru = runs["lru"]["session_recomputed_tokens"]
    assert lru > 0 and runs["lru"]["session_hit_rate"] < 1.0
    for policy in ("pins", "classes", "hints"):
        assert runs[policy]["session_recomputed_tokens"] < lru, policy
    assert runs["pins"]["pinned_blocks"] > 0
    cost = doc["step_cost"]
    assert cost["this_tree_s"] > 0 and cost["baseline_tree_s"] > 0
