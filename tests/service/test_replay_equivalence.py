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

from cache_service.client import CacheClient, CacheError, layers, ops
from cache_service.replay import Replayer, load_config, make_pool

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


class ServerReplayer:
    """Trace ops as RPCs against one pool, rendered like the replay tool."""

    def __init__(self, client: CacheClient, pool_id: str) -> None:
        self.client = client
        self.pool = pool_id
        self.auto_step = True

    def step(self, op, *, begin_step: bool = False):
        return self.client.step(self.pool, [op], begin_step=begin_step).results[0]

    def apply(self, op: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(op, dict):
            return {"op": None, "error": "not an object"}
        out: dict[str, Any] = {"op": op.get("op")}
        if "req" in op:
            out["req"] = op["req"]
        try:
            out.update(self._apply(op))
        except CacheError as exc:
            out["error"] = exc.code.name
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            # Not expressible as a protocol message (unknown op, missing or ill-typed
            # field): the replay tool must reject it too.
            out["error"] = f"not representable: {exc!r}"
        return out

    def _apply(self, op: dict[str, Any]) -> dict[str, Any]:
        name, rid = op["op"], op.get("req", "")
        if name == "add":
            r = self.step(ops.add(rid, op.get("tokens", []), cache_salt=op.get("cache_salt")))
            return {"num_tokens": r.num_tokens, "num_block_hashes": r.num_block_hashes}
        if name == "append":
            r = self.step(ops.append(rid, op.get("tokens", [])))
            return {"num_tokens": r.num_tokens, "num_block_hashes": r.num_block_hashes}
        if name == "lookup":
            r = self.step(ops.lookup(rid))
            out = {"hit_tokens": r.hit_tokens, "block_ids": r.block_ids}
            if r.shared_prefix_boundary:
                out["shared_prefix_boundary"] = r.shared_prefix_boundary
            return out
        if name == "allocate":
            r = self.step(ops.allocate(
                rid, op["num_new_tokens"], num_lookahead_tokens=op.get("num_lookahead_tokens", 0),
                full_sequence_must_fit=op.get("full_sequence_must_fit", False),
                use_lookup=op.get("use_lookup", True),
                delay_cache_blocks=op.get("delay_cache_blocks", False)),
                begin_step=self.auto_step)
            if not r.ok:
                return {"ok": False, "new_block_ids": None}
            # The protocol sends no per-group tables when nothing was allocated.
            new = r.new_block_ids or [[] for _ in r.block_ids]
            return {"ok": True, "hit_tokens_used": r.hit_tokens_used,
                    "num_computed_tokens": r.num_computed_tokens,
                    "new_block_ids": new, "block_ids": r.block_ids}
        if name in ("free", "preempt"):
            r = self.step(ops.free(rid) if name == "free" else ops.preempt(rid))
            return {"num_free_blocks": r.num_free_blocks}
        if name == "step":
            self.auto_step = False
            self.step(ops.new_step())
            return {}
        if name == "usage":
            s = self.client.stats(self.pool)
            return {"usage": s.usage, "num_free_blocks": s.num_free_blocks,
                    "num_cached_blocks": s.num_cached_blocks,
                    "num_cached_blocks_per_group": s.num_cached_blocks_per_group}
        if name == "reset":
            return {"ok": self.client.reset_prefix_cache(self.pool)}
        if name == "blocks":
            state = self.client.get_request(self.pool, rid)
            return {"block_ids": state.block_ids, "num_computed_tokens": state.num_computed_tokens,
                    "num_tokens": state.num_tokens}
        raise KeyError(f"unknown op {name!r}")


def register(client: CacheClient, config: Path, pool_id: str) -> None:
    """The sample config as a RegisterPool call: one layer per group, same num_blocks."""
    data = json.loads(config.read_text())
    core_config, options = load_config(data)
    layer_specs = [layers.from_spec(f"layer{i}", g.spec)
                   for i, g in enumerate(core_config.groups)]
    client.register_pool(
        pool_id, layer_specs, num_blocks=core_config.num_blocks,
        max_model_len=options.max_model_len, enable_caching=options.enable_caching,
        hash_algo=options.hash_algo, scheduler_block_size=options.scheduler_block_size,
        hash_block_size=options.hash_block_size, watermark=options.watermark,
        max_in_flight_tokens=options.max_in_flight_tokens, skip_capacity_check=True)


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
    register(client, config, pool_id)
    replayer = ServerReplayer(client, pool_id)
    for i, (op, want) in enumerate(zip(trace, expected)):
        got = replayer.apply(op)
        if "error" in want or "error" in got:
            assert ("error" in want) == ("error" in got), (i, op, want, got)
            continue
        assert got == want, (i, op)
    assert len(expected) == len(trace)
    client.delete_pool(pool_id)
