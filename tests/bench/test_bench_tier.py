"""bench/bench_tier.py in --quick mode on a small generated trace of the Mooncake format (the
real traces are data beside the checkout, never committed): both executors replay it to the
end with identical greedy outputs, the device pool is a quarter of the working set, and the
host tier turns evictions into hits (more cached prompt tokens, fewer recomputed). The
prefix-sharing mode runs as docs/benchmarks.md shows it (tests/doc_commands.py's registry)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def write_trace(path: Path, n: int, seed: int = 3) -> None:
    """Conversations of 1-4 turns interleaved with others (turn k extends turn k-1's hash
    ids), so a conversation's prefix returns after others pushed it out of a small pool."""
    rng = random.Random(seed)
    convs: list[list[int]] = []
    next_id = 1
    lines = []
    for i in range(n):
        open_convs = [c for c in convs if len(c) < 5]  # 5 blocks of 48 fit --quick's 256
        if open_convs and rng.random() < 0.6:
            ids = rng.choice(open_convs)
            ids.append(next_id)
            next_id += 1
        else:
            ids = list(range(next_id, next_id + 2))
            next_id += 2
            convs.append(ids)
        lines.append(json.dumps({"timestamp": i, "input_length": len(ids) * 512 - 100,
                                 "output_length": 3, "hash_ids": list(ids)}))
    path.write_text("\n".join(lines) + "\n")


def test_the_trace_mode_keeps_outputs_and_hits_the_host_tier(tmp_path: Path) -> None:
    trace, out = tmp_path / "trace.jsonl", tmp_path / "tier.json"
    write_trace(trace, 40)
    done = subprocess.run([sys.executable, str(REPO / "bench" / "bench_tier.py"), "--quick",
                           "--trace", str(trace), "--trace-block-tokens", "48", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["outputs_identical"] is True
    none, tier = report["runs"]["no host tier"], report["runs"]["host tier 4x"]
    assert none["requests"] == tier["requests"] == 40
    assert none["device_blocks"] == tier["device_blocks"]
    assert report["working_set_blocks"] >= 3 * none["device_blocks"]
    assert tier["host_tier_blocks"] == 4 * tier["device_blocks"] and none["host_tier_blocks"] == 0
    assert none["evictions"] > 0 and tier["host_promotions"] > 0
    assert tier["cached_tokens"] > none["cached_tokens"]
    assert tier["computed_prompt_tokens"] < none["computed_prompt_tokens"]
    assert report["bookkeeping"]["this_tree_us"] > 0
    assert "greedy outputs identical with and without the tier" in done.stdout
