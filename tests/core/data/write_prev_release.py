"""Writes tests/core/data/prev_release/: pickles of busy pools (test_restore.busy_pool, one
per sample config) written by the PREVIOUS release's core, and answers.json, what that
release answered when it went on with them (test_restore.go_on, as plain data). Run it
from that release's tree (a checkout of the last landed commit):

    cd OLD && PYTHONPATH=$PWD KVCACHE_CORE=pure \\
        python3 NEW/tests/core/data/write_prev_release.py NEW/tests/core/data/prev_release

tests/core/test_restore.py loads them in this release's cores (a snapshot outlives an
upgrade). Regenerate from the then previous release when a release changes the pickles."""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.getcwd(), "tests", "core"))
from test_restore import busy_pool, go_on  # noqa: E402

from builders import SAMPLE_CONFIGS  # noqa: E402


def plain(value: Any) -> object:
    """An answer of go_on as JSON data (a lookup's hit as its three fields)."""
    if hasattr(value, "hit_tokens"):
        return [value.hit_tokens, plain(value.block_ids), value.shared_prefix_boundary]
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return [[plain(k), plain(v)] for k, v in sorted(value.items())]
    return value


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    answers = {}
    for name in SAMPLE_CONFIGS:
        (out / f"{name}.pickle").write_bytes(pickle.dumps(busy_pool(name)))
        answers[name] = plain(go_on(busy_pool(name))[:-1])  # the last is a snapshot
    (out / "answers.json").write_text(json.dumps(answers, sort_keys=True) + "\n")
    print(f"wrote {len(answers)} pools to {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
