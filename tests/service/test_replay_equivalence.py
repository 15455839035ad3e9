"""Replay equivalence: a trace replayed through the server (one Step per trace op, other RPCs
for queries) gives the same results as ``python -m cache_service.replay`` on the same config.

Traces: every ``cache_service/replay_samples/*.jsonl`` next to its config, plus a generated
trace per sample config (so the check runs even for configs without a recorded trace).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cache_service.client import CacheClient
from cache_service.conformance import ServerReplayer, register
from cache_service.replay import Replayer, make_pool

SAMPLES = Path(__file__).resolve().parents[2] / "cache_service" / "replay_samples"
CONFIGS = sorted(SAMPLES.glob("*.json"))


def generated_trace(seed: int, config: Path) -> list[dict[str, Any]]:
    """Admissions with shared prefixes, decode, preemption, frees, queries, a reset and a
    few invalid ops; explicit steps after the first few auto-stepped allocations. The trace
    is written against an in-process replayer so that each admission allocates exactly the
    prompt minus its prefix hit, as a scheduler would."""
    rng = random.Random(seed)
    local = Replayer(make_pool(json.loads(config.read_text())))
    prefixes = [[rng.randrange(500) for _ in range(rng.choice([16, 48, 150]))]
                for _ in range(3)]
    trace: list[dict[str, Any]] = []

    def emit(op: dict[str, Any]) -> dict[str, Any]:
        trace.append(op)
        return local.apply(op)

    live: dict[str, int] = {}
    n = 0
    for step in range(30):
        if step >= 3:
            emit({"op": "step"})
        for rid in sorted(live):
            roll = rng.random()
            if roll < 0.12:
                emit({"op": "free", "req": rid})
                del live[rid]
            elif roll < 0.17:
                emit({"op": "preempt", "req": rid})
                hit = emit({"op": "lookup", "req": rid})["hit_tokens"]
                emit({"op": "allocate", "req": rid, "num_new_tokens": live[rid] - hit})
            else:
                emit({"op": "append", "req": rid, "tokens": [rng.randrange(500)]})
                emit({"op": "allocate", "req": rid, "num_new_tokens": 1})
                live[rid] += 1
        for _ in range(rng.randrange(3)):
            rid = f"r{n}"
            n += 1
            prompt = rng.choice(prefixes) + [rng.randrange(500)
                                             for _ in range(rng.randrange(1, 60))]
            emit({"op": "add", "req": rid, "tokens": prompt})
            hit = emit({"op": "lookup", "req": rid})["hit_tokens"]
            if emit({"op": "allocate", "req": rid, "num_new_tokens": len(prompt) - hit})["ok"]:
                live[rid] = len(prompt)
            else:
                emit({"op": "free", "req": rid})
        if step % 7 == 6:
            emit({"op": "usage"})
            for rid in sorted(live)[:2]:
                emit({"op": "blocks", "req": rid})
    emit({"op": "allocate", "req": "ghost", "num_new_tokens": 1})
    emit({"op": "free", "req": "ghost"})
    for rid in sorted(live):
        emit({"op": "free", "req": rid})
    emit({"op": "reset"})
    emit({"op": "usage"})
    return trace


def run_replay_tool(config: Path, trace: list[dict[str, Any]]) -> list[dict[str, Any]]:
    text = "\n".join(json.dumps(op) for op in trace) + "\n"
    proc = subprocess.run([sys.executable, "-m", "cache_service.replay", "--config",
                           str(config)], input=text, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def traces() -> list[tuple[str, Path, list[dict[str, Any]]]]:
    out = []
    for i, config in enumerate(CONFIGS):
        for recorded in sorted(SAMPLES.glob(f"{config.stem}.*.jsonl")):
            if recorded.name.endswith(".expected.jsonl"):
                continue
            ops_ = [json.loads(line) for line in recorded.read_text().splitlines()
                    if line.strip() and not line.lstrip().startswith("#")]
            out.append((recorded.stem, config, ops_))
        out.append((f"{config.stem}-generated", config, generated_trace(i, config)))
    return out


TRACES = traces()


def test_there_are_sample_configs() -> None:
    assert CONFIGS, f"no replay sample configs in {SAMPLES}"


@pytest.mark.parametrize("name,config,trace", TRACES, ids=[t[0] for t in TRACES])
def test_server_replay_equals_the_replay_tool(client: CacheClient, name: str, config: Path,
                                              trace: list[dict[str, Any]]) -> None:
    # "hashes" (the request's block hashes) is a replay-tool query the protocol lacks.
    trace = [op for op in trace if not (isinstance(op, dict) and op.get("op") == "hashes")]
    expected = run_replay_tool(config, trace)
    pool_id = f"replay-{name}"
    register(client, json.loads(config.read_text()), pool_id)
    recipe = client.get_pool(pool_id).raw.hash_recipe  # prompt embeddings hash with it
    replayer = ServerReplayer(client, pool_id, recipe.hash_block_size,
                              recipe.num_hash_lookahead_tokens)
    for i, (op, want) in enumerate(zip(trace, expected)):
        got = replayer.apply(op)
        if "error" in want or "error" in got:
            assert ("error" in want) == ("error" in got), (i, op, want, got)
            continue
        assert got == want, (i, op)
    assert len(expected) == len(trace)
    client.delete_pool(pool_id)
