"""bench/bench_mooncake.py on a small generated trace of the Mooncake format (the real traces
are data beside the checkout, never committed): every side replays it to the end, the core,
the Pool facade and the live server make the same decisions, the block-op counts follow the
peers' definitions, and the vLLM column says "not installed" without the oracle's venv."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from tests.doc_commands import is_png

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from mooncake_sim import TRACE_BLOCK, load_trace  # noqa: E402


def write_trace(path: Path, n: int, seed: int = 1, max_output: int = 12) -> list[dict]:
    """Multi-turn conversations (up to 5 blocks): turn k of a conversation extends turn
    k-1's hash ids (the trace's prefix chaining), half of them behind one shared
    system-prompt block."""
    rng = random.Random(seed)
    next_id = 1
    convs: list[list[int]] = []
    records = []
    for i in range(n):
        ids = rng.choice(convs) if convs else []
        if ids and len(ids) < 5 and rng.random() < 0.6:
            ids.extend(range(next_id, next_id + rng.randint(1, 2)))
        else:
            ids = ([0] if rng.random() < 0.5 else []) + [next_id]
            convs.append(ids)
        next_id = max(next_id, max(ids) + 1)
        length = (len(ids) - 1) * TRACE_BLOCK + rng.randint(1, TRACE_BLOCK)
        records.append({"timestamp": i * 10, "input_length": length,
                        "output_length": rng.randint(1, max_output), "hash_ids": list(ids)})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def run_bench(trace: Path, out: Path, *extra: str) -> dict:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "bench_mooncake.py"), "--trace", str(trace),
         "--block-size", "128", "--sliding-window", "256", "--max-concurrency", "8",
         "--max-batched-tokens", "2048", "--oracle-python", "/nonexistent/python",
         "--out", str(out), *extra],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert is_png(out.with_suffix(".png"))  # the ratio bars beside the JSON
    return json.loads(out.read_text())


def test_tokens_follow_the_hash_ids(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    records = write_trace(trace, 30)
    reqs = {r.rid: r for r in load_trace(trace)}
    by_id: dict[int, list[int]] = {}
    for no, rec in enumerate(records):
        tokens = reqs[f"m{no}"].tokens()
        assert len(tokens) == rec["input_length"]
        for k, h in enumerate(rec["hash_ids"]):
            block = tokens[k * TRACE_BLOCK:(k + 1) * TRACE_BLOCK]
            seen = by_id.setdefault(h, block)
            common = min(len(seen), len(block))
            assert seen[:common] == block[:common]  # equal ids, equal tokens
    assert len({tuple(b[:1]) for b in by_id.values()}) == len(by_id)  # distinct ids differ


@pytest.mark.parametrize(("num_blocks", "max_output"), [(None, 12), (80, 400)],
                         ids=["roomy", "tight"])
def test_every_side_replays_the_trace_alike(tmp_path: Path, num_blocks: int | None,
                                            max_output: int) -> None:
    trace = tmp_path / "t.jsonl"
    records = write_trace(trace, 40, max_output=max_output)
    extra = ["--sides", "core,pool,server,vllm"]
    if num_blocks is not None:
        extra += ["--num-blocks", str(num_blocks)]
    doc = run_bench(trace, tmp_path / "out.json", *extra)
    assert doc["requests"] == 40
    for kind in ("full", "full_swa"):
        core, pool, server = (doc["runs"][f"{kind}/{s}"] for s in ("core", "pool", "server"))
        for run in (core, pool, server):
            assert run["decisions"]["finished"] == 40
        assert pool["decisions"] == core["decisions"]
        # (The server's batched step could differ after a failed allocation; on this trace
        # it does not.)
        assert server["decisions"] == {k: core["decisions"][k] for k in server["decisions"]}
        # Dynamo's count: each request's hash ids once, plus the stored blocks.
        query = sum(len(r["hash_ids"]) for r in records)
        assert core["query_blocks"] == query
        assert core["block_ops_dynamo"] == query + core["decisions"]["stored_blocks"]
        assert core["block_ops_llmd"] == core["block_ops_dynamo"] + \
            core["decisions"]["removed_blocks"]
        assert core["decisions"]["stored_blocks"] > 0
        assert 0 < core["hit_rate"] < 1  # the conversations share prefixes
        assert doc["summary"][kind]["vllm"] == "not installed"
    if num_blocks is not None:  # the tight pool preempts and evicts
        assert sum(doc["runs"][f"{k}/core"]["decisions"]["preemptions"]
                   for k in ("full", "full_swa")) > 0
        assert doc["runs"]["full_swa/core"]["decisions"]["removed_blocks"] > 0
