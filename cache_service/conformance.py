"""Conformance runner: drive a live cache server with replay traces and diff its answers.

    python -m cache_service.conformance --target HOST:PORT
    python -m cache_service.conformance --target HOST:PORT --config C.json --trace T.jsonl \
        [--expected T.expected.jsonl]

Without ``--trace`` it runs every bundled sample (``cache_service/replay_samples``) against
vLLM 0.33's recorded answers. With ``--trace`` it runs that trace; the answers it is diffed
against are ``--expected``, else ``T.expected.jsonl`` next to the trace, else this project's
replay tool (the reference implementation). Each trace gets its own pool (deleted after).
One trace operation becomes one ``Step`` (queries use GetPoolStats, GetRequest,
ResetPrefixCache), rendered like the replay tool; results are compared with
``cache_service.replay.same_result``. Exit status: 0 if every answer matched, 1 if any
differed, 2 for bad arguments or a --target that does not answer (one line).
docs/conformance.md explains the kit.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from cache_service.client import CacheClient, CacheError, TierCopy, ops
from cache_service.core.specs import AttentionSpec
from cache_service.replay import (
    embeds_digests,
    load_config,
    make_pool,
    read_expected,
    render_tier_copies,
    replay,
    same_result,
)
from cache_service.specs_proto import layer_spec_to_proto

SAMPLES = Path(__file__).resolve().parent / "replay_samples"
PROG = "python -m cache_service.conformance"


class ServerReplayer:
    """Trace operations as RPCs against one pool, rendered like the replay tool."""

    def __init__(self, client: CacheClient, pool_id: str, hash_block_size: int = 0,
                 lookahead: int = 0) -> None:
        self.client = client
        self.pool = pool_id
        self.auto_step = True  # until the trace's first "step", every allocate begins one
        self._copies: tuple[list[TierCopy], list[TierCopy]] = ([], [])  # of the last Step
        # The pool's hash recipe (for the prompt-embedding digests a trace asks for).
        self.hash_block_size = hash_block_size
        self.lookahead = lookahead

    def step(self, op, *, begin_step: bool = False):
        """Sends ``op`` as a one-op Step on the pool; answers its typed result (its host
        tier copies are kept for :meth:`apply` to render)."""
        answer = self.client.step(self.pool, [op], begin_step=begin_step)
        self._copies = (answer.demotions, answer.promotions)
        return answer.results[0]

    def apply(self, op: Any) -> dict[str, Any]:
        """One trace operation as RPCs; answers its outcome rendered as the replay tool renders
        it (an ``error`` key for a refused one)."""
        if not isinstance(op, dict):
            return {"op": None, "error": "not an object"}
        out: dict[str, Any] = {"op": op.get("op")}
        if "req" in op:
            out["req"] = op["req"]
        self._copies = ([], [])
        try:
            out.update(self._apply(op))
        except CacheError as exc:
            out["error"] = exc.code.name
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            # Not expressible as a protocol message (unknown op, missing or ill-typed
            # field): the reference rejects it too.
            out["error"] = f"not representable: {exc!r}"
        out.update(render_tier_copies(*self._copies))
        return out

    def _apply(self, op: dict[str, Any]) -> dict[str, Any]:
        name, rid = op["op"], op.get("req", "")
        if name == "add":
            tokens = op.get("tokens", [])
            digests: list[bytes] = []
            if op.get("prompt_embeds") is not None:
                # The digests a client computes from its embedding rows (docs/hashing.md).
                digests = embeds_digests(op["prompt_embeds"], len(tokens),
                                         self.hash_block_size, self.lookahead)
            r = self.step(ops.add(rid, tokens, cache_salt=op.get("cache_salt"),
                                  mm_items=[tuple(m) for m in op.get("mm_items", [])],
                                  prompt_embeds_digests=digests))
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
            out = {"ok": True, "hit_tokens_used": r.hit_tokens_used,
                   "num_computed_tokens": r.num_computed_tokens,
                   "new_block_ids": new, "block_ids": r.block_ids}
            if r.block_copies:
                out["block_copies"] = [[c.src_block_id, c.dst_block_id] for c in r.block_copies]
            return out
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
        if name == "reset_host_tier":
            return {"num_dropped": self.step(ops.reset_host_tier()).num_dropped}
        if name == "blocks":
            state = self.client.get_request(self.pool, rid)
            return {"block_ids": state.block_ids, "num_computed_tokens": state.num_computed_tokens,
                    "num_tokens": state.num_tokens}
        raise KeyError(f"unknown op {name!r}")


def register(client: CacheClient, config: dict[str, Any], pool_id: str) -> None:
    """A replay config as a RegisterPool call: one layer per group, same num_blocks."""
    core_config, options = load_config(config)
    # Attention pages grow with the block size, and the server's grouping evens out page
    # sizes by growing the smaller pages' block sizes: pad every attention layer to the
    # largest page instead, so each group keeps the block size the config gives it.
    page = max((g.spec.page_size_bytes for g in core_config.groups), default=0)
    layer_specs = [layer_spec_to_proto(f"layer{i}", replace(g.spec, page_size_padded=page)
                                       if isinstance(g.spec, AttentionSpec) else g.spec)
                   for i, g in enumerate(core_config.groups)]
    client.register_pool(
        pool_id, layer_specs, num_blocks=core_config.num_blocks,
        max_model_len=options.max_model_len, enable_caching=options.enable_caching,
        hash_algo=options.hash_algo, scheduler_block_size=options.scheduler_block_size,
        hash_block_size=options.hash_block_size, watermark=options.watermark,
        max_in_flight_tokens=options.max_in_flight_tokens, skip_capacity_check=True,
        prefix_cache_retention_interval=options.prefix_cache_retention_interval,
        enable_mamba_shared_prefix_checkpoint=options.enable_mamba_shared_prefix_checkpoint,
        use_eagle=options.use_eagle, host_tier_blocks=options.host_tier_blocks,
        num_hash_lookahead_tokens=options.num_hash_lookahead_tokens)


def parse_trace(text: str) -> list[Any]:
    """Trace operations ("#" lines and blank lines skipped)."""
    return [json.loads(line) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def reference_answers(config: dict[str, Any], trace: Sequence[Any]) -> list[dict[str, Any]]:
    """The replay tool's answers (this project's allocator core) for a trace."""
    out = io.StringIO()
    replay(make_pool(config), [json.dumps(op) for op in trace], out)
    return [json.loads(line) for line in out.getvalue().splitlines()]


def run_trace(client: CacheClient, name: str, config: dict[str, Any], trace: Sequence[Any],
              expected: Sequence[dict[str, Any]]) -> list[str]:
    """Replay ``trace`` on a fresh pool; the differences from ``expected``, one line each."""
    if len(expected) != len(trace):
        return [f"{name}: {len(trace)} operations but {len(expected)} expected answers"]
    pool_id = f"conformance-{os.getpid()}-{name}"[:128]
    register(client, config, pool_id)
    recipe = client.get_pool(pool_id).raw.hash_recipe
    replayer = ServerReplayer(client, pool_id, recipe.hash_block_size,
                              recipe.num_hash_lookahead_tokens)
    diffs = []
    try:
        for i, (op, want) in enumerate(zip(trace, expected)):
            if isinstance(op, dict) and op.get("op") == "hashes":
                continue  # a replay-tool query the protocol lacks: not compared
            got = replayer.apply(op)
            if not same_result(got, want):
                diffs.append(f"{name} op {i} {json.dumps(op)[:200]}\n"
                             f"    server:   {json.dumps(got)[:400]}\n"
                             f"    expected: {json.dumps(want)[:400]}")
    finally:
        client.delete_pool(pool_id)
    return diffs


def bundled() -> list[tuple[str, Path, Path, Path]]:
    """(name, config, trace, expected answers) of every bundled sample."""
    out = []
    for trace in sorted(SAMPLES.glob("*.jsonl")):
        if not trace.name.endswith(".expected.jsonl"):
            name = trace.name.removesuffix(".jsonl")
            out.append((name, SAMPLES / f"{name.split('.')[0]}.json", trace,
                        trace.with_name(f"{name}.expected.jsonl")))
    return out


def main(argv: list[str] | None = None) -> int:
    """Replays each trace against the server at ``--target`` and compares the answers with the
    replay tool's (or the expected file's); answers 0 when every trace conforms, 1 when one
    differs, 2 when the inputs or the server fail."""
    p = argparse.ArgumentParser(prog=PROG,
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="HOST:PORT of the server")
    p.add_argument("--token", help="bearer token (servers started with --auth-token)")
    p.add_argument("--config", type=Path, help="replay config JSON (with --trace)")
    p.add_argument("--trace", type=Path, help="a JSON-lines trace; default: the bundled samples")
    p.add_argument("--expected", type=Path,
                   help="expected answers; default: TRACE.expected.jsonl if present, else the "
                        "replay tool's answers")
    a = p.parse_args(argv)
    if (a.trace is None) != (a.config is None) or (a.expected and not a.trace):
        p.print_usage(sys.stderr)
        print("give --config and --trace together (and --expected only with them)",
              file=sys.stderr)
        return 2
    jobs: Sequence[tuple[str, Path, Path, Path | None]]
    if a.trace is None:
        jobs = bundled()
    else:
        default = a.trace.with_name(a.trace.name.removesuffix(".jsonl") + ".expected.jsonl")
        expected = a.expected or (default if default.is_file() else None)
        jobs = [(a.trace.name.removesuffix(".jsonl"), a.config, a.trace, expected)]
    failed = 0
    with CacheClient(a.target, token=a.token, default_timeout=60) as client:
        try:  # fail fast, in one line, on a dead address or a wrong token
            client.list_pools(timeout=5)
        except CacheError as exc:
            print(f"{PROG}: error: --target {a.target}: {exc.code.name}: "
                  f"{(exc.message or 'no answer').splitlines()[0]}", file=sys.stderr)
            return 2
        for name, config_path, trace_path, expected_path in jobs:
            try:
                config = json.loads(config_path.read_text())
                trace = parse_trace(trace_path.read_text())
                if expected_path is None:
                    source, want = "replay tool", reference_answers(config, trace)
                else:
                    provenance, want = read_expected(expected_path.read_text())
                    source = (f"vLLM {provenance['vllm_version']}" if provenance
                              else expected_path.name)
            except (OSError, ValueError, KeyError) as exc:
                print(f"{name}: cannot read inputs: {exc}", file=sys.stderr)
                return 2
            diffs = run_trace(client, name, config, trace, want)
            failed += bool(diffs)
            print(f"{name}: {len(trace)} ops vs {source}: "
                  f"{'ok' if not diffs else f'{len(diffs)} differ'}")
            for line in diffs[:5]:
                print("  " + line)
    print(f"{len(jobs) - failed}/{len(jobs)} traces conform")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
