"""Conformance replay: run a JSON-lines operation trace against the allocator core.

    python -m cache_service.replay --config CONFIG.json < TRACE.jsonl

Prints one compact JSON object per operation (see ARCHITECTURE.md, "Conformance
replay tool"). Block ids, hit lengths and free counts equal vLLM 0.33's for the same
config and trace, which is how this project is checked against vLLM's own manager
(shared/tools/vllm-oracle) and how other implementations can check themselves
against this one. A failed operation prints an "error" field and the replay goes on.
Every change goes through ``Pool.apply_batch`` (a batch of one op), the entry point the
service uses too.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TextIO

from cache_service.core.hashing import prompt_embeds_digests
from cache_service.core.operations import (
    AddRequest,
    Allocate,
    AppendTokens,
    Free,
    Lookup,
    NewStep,
    Op,
    Preempt,
    ResetHostTierOp,
)
from cache_service.core.pool import Pool, PoolOptions
from cache_service.core.specs import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    RSWASpec,
    SlidingWindowSpec,
)
from cache_service.errors import InvalidArgument, KVCacheError

_GROUP_KEYS = {"type", "block_size", "sliding_window", "attention_chunk_size",
               "mamba_cache_mode", "rswa_window"}
_CONFIG_KEYS = {"num_blocks", "max_model_len", "enable_caching", "hash_algo", "groups",
                "scheduler_block_size", "hash_block_size", "watermark",
                "max_in_flight_tokens", "prefix_cache_retention_interval",
                "enable_mamba_shared_prefix_checkpoint", "use_eagle", "host_tier_blocks",
                "num_hash_lookahead_tokens"}


class ConfigFileError(ValueError):
    """The replay config is malformed (the message names the key)."""


def _group_spec(i: int, g: Any, max_model_len: int) -> KVCacheSpec:
    if not isinstance(g, dict):
        raise ConfigFileError(f"groups[{i}] must be an object")
    unknown = set(g) - _GROUP_KEYS
    if unknown:
        raise ConfigFileError(f"groups[{i}]: unknown key(s) {sorted(unknown)}")
    kind = g.get("type")
    # Per-layer byte sizes do not matter for replay: 1 head of dimension 1.
    common: dict[str, Any] = {"num_kv_heads": 1, "head_size": 1, "dtype": "float32"}
    try:
        if kind == "mamba":
            mode = g.get("mamba_cache_mode", "align")
            bs = g.get("block_size", max_model_len if mode == "none" else None)
            if bs is None:
                raise ConfigFileError(f"groups[{i}].block_size is required for mamba align")
            return MambaSpec(block_size=bs, shapes=((1,),), dtypes=("float32",),
                             mamba_cache_mode=mode)
        bs = g.get("block_size")
        if bs is None:
            raise ConfigFileError(f"groups[{i}].block_size is required")
        if kind == "full_attention":
            return FullAttentionSpec(block_size=bs, **common)
        if kind == "sliding_window":
            return SlidingWindowSpec(block_size=bs, sliding_window=g.get("sliding_window", 0),
                                     **common)
        if kind == "chunked_local_attention":
            return ChunkedLocalAttentionSpec(block_size=bs,
                                             attention_chunk_size=g.get("attention_chunk_size", 0),
                                             **common)
        if kind == "cross_attention":
            return CrossAttentionSpec(block_size=bs, **common)
        if kind == "rswa":
            return RSWASpec(block_size=bs, rswa_window=g.get("rswa_window", 0), **common)
        if kind == "circular_buffer":
            return CircularBufferSpec(block_size=bs, **common)
    except KVCacheError as e:
        raise ConfigFileError(f"groups[{i}].{e.field or 'spec'}: {e}") from None
    except TypeError as e:
        raise ConfigFileError(f"groups[{i}]: {e}") from None
    raise ConfigFileError(
        f"groups[{i}].type must be one of full_attention, sliding_window, "
        f"chunked_local_attention, mamba, cross_attention, rswa, circular_buffer; "
        f"got {kind!r}")


def load_config(data: Any) -> tuple[KVCacheConfig, PoolOptions]:
    """Replay config JSON (already parsed) -> (KVCacheConfig, PoolOptions)."""
    if not isinstance(data, dict):
        raise ConfigFileError("config must be a JSON object")
    unknown = set(data) - _CONFIG_KEYS
    if unknown:
        raise ConfigFileError(f"unknown config key(s) {sorted(unknown)}")
    for key in ("num_blocks", "max_model_len", "groups"):
        if key not in data:
            raise ConfigFileError(f"config key {key!r} is required")
    max_model_len = data["max_model_len"]
    if type(max_model_len) is not int or max_model_len <= 0:
        raise ConfigFileError(f"max_model_len must be a positive integer, got {max_model_len!r}")
    if type(data["num_blocks"]) is not int or data["num_blocks"] < 1:
        raise ConfigFileError(f"num_blocks must be a positive integer, got {data['num_blocks']!r}")
    groups = data["groups"]
    if not isinstance(groups, list):
        raise ConfigFileError("groups must be a list")
    specs = [_group_spec(i, g, max_model_len) for i, g in enumerate(groups)]
    config = KVCacheConfig(
        num_blocks=data["num_blocks"],
        groups=tuple(KVCacheGroupSpec((f"layer{i}",), s) for i, s in enumerate(specs)))
    enable_caching = data.get("enable_caching", True)
    if not isinstance(enable_caching, bool):
        raise ConfigFileError("enable_caching must be true or false")
    retention = data.get("prefix_cache_retention_interval")
    if retention is not None and type(retention) is not int:
        raise ConfigFileError("prefix_cache_retention_interval must be null (dense) or an "
                              f"integer, got {retention!r}")
    shared_prefix_checkpoint = data.get("enable_mamba_shared_prefix_checkpoint", False)
    if not isinstance(shared_prefix_checkpoint, bool):
        raise ConfigFileError("enable_mamba_shared_prefix_checkpoint must be true or false")
    use_eagle = data.get("use_eagle", False)
    if not isinstance(use_eagle, bool):
        raise ConfigFileError("use_eagle must be true or false")
    host_tier = data.get("host_tier_blocks", 0)
    if type(host_tier) is not int:
        raise ConfigFileError(f"host_tier_blocks must be an integer, got {host_tier!r}")
    options = PoolOptions(
        max_model_len=max_model_len, enable_caching=enable_caching,
        prefix_cache_retention_interval=retention,
        enable_mamba_shared_prefix_checkpoint=shared_prefix_checkpoint, use_eagle=use_eagle,
        host_tier_blocks=host_tier,
        hash_algo=data.get("hash_algo", "sha256"),
        scheduler_block_size=data.get("scheduler_block_size"),
        hash_block_size=data.get("hash_block_size"),
        watermark=data.get("watermark", 0.0),
        max_in_flight_tokens=data.get("max_in_flight_tokens"),
        num_hash_lookahead_tokens=data.get("num_hash_lookahead_tokens", 0),
        enable_events=False)
    return config, options


def make_pool(data: Any) -> Pool:
    """The Pool a config file describes; ConfigFileError naming the field the core refuses."""
    config, options = load_config(data)
    try:
        return Pool(config, options)
    except KVCacheError as e:
        raise ConfigFileError(f"{e.field or 'config'}: {e}") from None


class Replayer:
    """Applies trace operations to a pool and renders results like the vLLM oracle."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.auto_step = True  # until the first explicit "step"
        self._copies: tuple[Sequence[Any], Sequence[Any]] = ([], [])  # of the last op
        self._ops: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "add": self._add, "lookup": self._lookup, "allocate": self._allocate,
            "append": self._append, "free": self._free, "preempt": self._preempt,
            "step": self._step, "usage": self._usage, "reset": self._reset,
            "blocks": self._blocks, "hashes": self._hashes,
            "reset_host_tier": self._reset_host_tier,
        }

    @staticmethod
    def _req(op: dict[str, Any]) -> str:
        if "req" not in op:
            raise InvalidArgument("missing 'req'", field="req")
        return op["req"]

    def _one(self, op: Op, *, begin_step: bool = False) -> Any:
        """Every change goes through the pool's one entry point, as the service's do; the
        host tier's copies of the batch are kept for :meth:`apply` to print."""
        outcome = self.pool.apply_batch([op], begin_step=begin_step)[0]
        self._copies = self.pool.tier_copies
        return outcome

    def _add(self, op: dict[str, Any]) -> dict[str, Any]:
        tokens = op.get("tokens", [])
        digests: list[bytes] = []
        if op.get("prompt_embeds") is not None:
            digests = embeds_digests(op["prompt_embeds"], len(tokens),
                                      self.pool.hash_block_size,
                                      self.pool.hash_recipe.num_hash_lookahead_tokens)
        # Multimodal items: [identifier, offset, length] lists (checked by the pool).
        info = self._one(AddRequest(self._req(op), tokens, cache_salt=op.get("cache_salt"),
                                    mm_items=op.get("mm_items", ()),
                                    prompt_embeds_digests=digests))
        return {"num_tokens": info.num_tokens, "num_block_hashes": info.num_block_hashes}

    def _lookup(self, op: dict[str, Any]) -> dict[str, Any]:
        res = self._one(Lookup(self._req(op)))
        out: dict[str, Any] = {"hit_tokens": res.hit_tokens, "block_ids": res.block_ids}
        if res.shared_prefix_boundary:
            out["shared_prefix_boundary"] = res.shared_prefix_boundary
        return out

    def _allocate(self, op: dict[str, Any]) -> dict[str, Any]:
        rid = self._req(op)
        if "num_new_tokens" not in op:
            raise InvalidArgument("missing 'num_new_tokens'", field="num_new_tokens")
        # An invalid allocate (e.g. an unknown request) fails before the step begins.
        res = self._one(Allocate(
            rid, op["num_new_tokens"], num_lookahead_tokens=op.get("num_lookahead_tokens", 0),
            full_sequence_must_fit=op.get("full_sequence_must_fit", False),
            use_lookup=op.get("use_lookup", True),
            delay_cache_blocks=op.get("delay_cache_blocks", False)), begin_step=self.auto_step)
        if not res.ok:
            return {"ok": False, "new_block_ids": None}
        out = {"ok": True, "hit_tokens_used": res.hit_tokens_used,
               "num_computed_tokens": res.num_computed_tokens,
               "new_block_ids": res.new_block_ids, "block_ids": res.block_ids}
        if res.block_copies:
            # As scripts/oracle/oracle_cow.py prints vLLM's: [source, copy] block ids.
            out["block_copies"] = [[c.src_block_id, c.dst_block_id] for c in res.block_copies]
        return out

    def _append(self, op: dict[str, Any]) -> dict[str, Any]:
        info = self._one(AppendTokens(self._req(op), op.get("tokens", [])))
        return {"num_tokens": info.num_tokens, "num_block_hashes": info.num_block_hashes}

    def _free(self, op: dict[str, Any]) -> dict[str, Any]:
        return {"num_free_blocks": self._one(Free(self._req(op)))}

    def _preempt(self, op: dict[str, Any]) -> dict[str, Any]:
        return {"num_free_blocks": self._one(Preempt(self._req(op)))}

    def _step(self, op: dict[str, Any]) -> dict[str, Any]:
        self.auto_step = False
        self._one(NewStep())
        return {}

    def _usage(self, op: dict[str, Any]) -> dict[str, Any]:
        s = self.pool.stats()
        # num_cached_blocks: distinct (group, hash) keys, vLLM's len(map); per group too.
        return {"usage": s.usage, "num_free_blocks": s.num_free_blocks,
                "num_cached_blocks": s.num_cached_blocks,
                "num_cached_blocks_per_group": s.num_cached_blocks_per_group}

    def _reset(self, op: dict[str, Any]) -> dict[str, Any]:
        return {"ok": self.pool.reset_prefix_cache()}

    def _blocks(self, op: dict[str, Any]) -> dict[str, Any]:
        rid = self._req(op)
        info = self.pool.request_info(rid)
        return {"block_ids": self.pool.block_ids(rid),
                "num_computed_tokens": info.num_computed_tokens, "num_tokens": info.num_tokens}

    def _reset_host_tier(self, op: dict[str, Any]) -> dict[str, Any]:
        return {"num_dropped": self._one(ResetHostTierOp())}

    def _hashes(self, op: dict[str, Any]) -> dict[str, Any]:
        hashes = self.pool.block_hashes(self._req(op))
        return {"hash_block_size": self.pool.hash_block_size,
                "block_hashes": [h.hex() for h in hashes]}

    def apply(self, op: Any) -> dict[str, Any]:
        """One operation -> its output object (with "error" when it failed)."""
        if not isinstance(op, dict):
            return {"op": None, "error": "an operation must be a JSON object"}
        name = op.get("op")
        out: dict[str, Any] = {"op": name}
        if "req" in op:
            out["req"] = op["req"]
        handler = self._ops.get(name) if isinstance(name, str) else None
        if handler is None:
            out["error"] = f"unknown op {name!r}"
            return out
        self._copies = ([], [])
        try:
            out.update(handler(op))
        except KVCacheError as e:
            out["error"] = f"{type(e).__name__}: {e}"
        out.update(render_tier_copies(*self._copies))
        return out


def render_tier_copies(demotions: Sequence[Any], promotions: Sequence[Any]
                       ) -> dict[str, list[list[int]]]:
    """The host tier's copies of one operation as ``[group, block_id, host_slot]``
    triples, in order; no key for an empty list (a pool without a tier prints none)."""
    out = {}
    for name, copies in (("demotions", demotions), ("promotions", promotions)):
        if copies:
            out[name] = [[c.group, c.block_id, c.host_slot] for c in copies]
    return out
def embeds_digests(rows: Any, num_tokens: int, hash_block_size: int,
                    lookahead: int) -> list[bytes]:
    """An add op's ``prompt_embeds`` (one list of floats per prompt token, held as float32
    as vLLM's tensor would be) as the per-block digests the pool takes."""
    if not isinstance(rows, list) or len(rows) != num_tokens or not all(
            isinstance(r, list) and len(r) == len(rows[0]) and r for r in rows):
        raise InvalidArgument("prompt_embeds must be one non-empty list of numbers per "
                              "prompt token, all of one length", field="prompt_embeds")
    try:
        raw = b"".join(struct.pack(f"<{len(r)}f", *r) for r in rows)
    except struct.error:
        raise InvalidArgument("prompt_embeds rows must hold numbers",
                              field="prompt_embeds") from None
    return prompt_embeds_digests(raw, num_tokens, hash_block_size, lookahead)


def same_result(ours: dict[str, Any], theirs: dict[str, Any]) -> bool:
    """Conformance rule against vLLM's output for one operation: every field vLLM
    printed must match; error texts differ by design, so only the presence of "error"
    must agree; extra fields of ours (e.g. ``num_cached_blocks_per_group``) are allowed."""
    if ("error" in ours) != ("error" in theirs):
        return False
    return all(k == "error" or ours.get(k) == v for k, v in theirs.items())


PROVENANCE_PREFIX = "# provenance: "


def read_expected(text: str) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """An ``*.expected.jsonl`` file: its provenance (the ``# provenance: {...}`` header
    line: who produced the answers, with which config and command) and its results, one
    per trace operation. Other ``#`` lines and blank lines are ignored."""
    provenance = None
    results = []
    for line in text.splitlines():
        if line.startswith(PROVENANCE_PREFIX):
            provenance = json.loads(line[len(PROVENANCE_PREFIX):])
        elif line.strip() and not line.startswith("#"):
            results.append(json.loads(line))
    return provenance, results


def replay(pool: Pool, lines: Iterable[str], out: TextIO) -> int:
    """Replay ``lines``; returns the number of failed operations."""
    replayer = Replayer(pool)
    failures = 0
    for lineno, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            op = json.loads(line)
        except json.JSONDecodeError as e:
            res: dict[str, Any] = {"op": None, "line": lineno, "error": f"bad JSON: {e}"}
        else:
            res = replayer.apply(op)
        failures += "error" in res
        out.write(json.dumps(res, separators=(",", ":")) + "\n")
    return failures


def main(argv: list[str] | None = None) -> int:
    """kvcache-replay's entry point: replays the trace on stdin, one JSON result per operation
    on stdout; answers 2 for a bad config, 1 with ``--strict`` when an operation failed."""
    parser = argparse.ArgumentParser(
        prog="kvcache-replay",
        description="Replay a JSON-lines KV-cache operation trace (stdin) against the "
                    "allocator core and print one JSON result per operation (stdout).",
        epilog="Ops: add(req, tokens, cache_salt?), lookup(req), allocate(req, "
               "num_new_tokens, num_lookahead_tokens?, full_sequence_must_fit?, use_lookup?), "
               "append(req, tokens), free(req), preempt(req), step, usage, reset, blocks(req), "
               "hashes(req), reset_host_tier. Until the first 'step', every allocate starts a "
               "new step. With a host tier (config host_tier_blocks), an operation that "
               "planned copies prints its demotions / promotions as [group, block_id, "
               "host_slot]. Exit status: 0, or 2 for a bad config.")
    parser.add_argument("--config", required=True, metavar="CONFIG.json",
                        help='pool config: {"num_blocks", "max_model_len", "groups": [{"type", '
                             '"block_size", "sliding_window", "attention_chunk_size", '
                             '"mamba_cache_mode"}], "enable_caching", "hash_algo", '
                             '"scheduler_block_size", "hash_block_size", "watermark", '
                             '"host_tier_blocks"}')
    parser.add_argument("--strict", action="store_true",
                        help="exit with status 1 if any operation failed")
    args = parser.parse_args(argv)
    try:
        with open(args.config) as f:
            data = json.load(f)
        pool = make_pool(data)
    except (OSError, json.JSONDecodeError, ConfigFileError) as e:
        print(f"kvcache-replay: bad config {args.config}: {e}", file=sys.stderr)
        return 2
    failures = replay(pool, sys.stdin, sys.stdout)
    return 1 if args.strict and failures else 0


if __name__ == "__main__":
    sys.exit(main())
