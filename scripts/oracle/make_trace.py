"""Dev tool: random replay traces for differential tests against the vLLM oracle.

    python scripts/oracle/make_trace.py CONFIG.json --ops 3000 --seed 1 > t.jsonl

A loose scheduler: requests share prefixes (so there are hits), prefill in chunks,
decode one token at a time, and are freed or preempted at random; ``step``, ``usage``,
``reset``, ``blocks`` and a few invalid operations are mixed in. A ``lookup`` is always
followed by the same request's ``allocate`` (the pool re-runs stale lookups, vLLM does
not).

With a Mamba ``align`` group the chunks follow vLLM's scheduler rule: a chunk that starts
on a (Mamba) block boundary ends on one (or at the end of the sequence), and a chunk that
starts inside a block does not run past that block's end; with partial hits a prompt's
chunk also stops at its last hash-block boundary (where vLLM's scheduler stops so that
the state there is cached). To apply it to the *real* progress (an allocation may fail),
the generator runs every operation on this project's pool as it goes.

With ``use_eagle`` in the config the prompt's partial-entry boundary is EAGLE's (one
hash block below the whole prompt's last one) and allocations carry draft slots
(``num_lookahead_tokens``) more often, as a speculative-decoding scheduler's do. With
``num_hash_lookahead_tokens`` L it is ``num_prompt_tokens - max(1, L)`` rounded down (the
last L tokens' block has no hash yet), and allocations carry draft slots as with EAGLE.

``--mm`` also gives some prompts multimodal items (``mm_items``; an item of a shared
prefix keeps its identifier in most requests that share it, so hits happen, and gets
another in some, so they miss) or prompt embeddings (``prompt_embeds``, small float32
rows), and asks for block hashes (``hashes``) now and then: vLLM's own hashes are then
compared one by one.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from typing import Any

from cache_service.replay import Replayer, make_pool


def make_trace(config: dict[str, Any], num_ops: int, seed: int,
               mm: bool = False) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    mml = config["max_model_len"]
    bs = max(g["block_size"] for g in config["groups"] if g["type"] != "mamba") \
        if any(g["type"] != "mamba" for g in config["groups"]) else 16
    align = (any(g["type"] == "mamba" for g in config["groups"])
             and config.get("enable_caching", True))
    capacity = config["num_blocks"] * bs
    # The block grid Mamba states live on (the attention block size when they agree).
    cbs = max([g["block_size"] for g in config["groups"] if g["type"] == "mamba"] or [bs])
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice([1, 2, 3, 4, 6]) * bs)]
                for _ in range(4)]
    ops: list[dict[str, Any]] = []
    replayer = Replayer(make_pool(config))
    hbs = replayer.pool.hash_block_size
    partial_hits = replayer.pool.manager.partial_hits
    eagle = bool(config.get("use_eagle"))
    ahead = int(config.get("num_hash_lookahead_tokens", 0))
    speculative = eagle or ahead > 0

    def tail_boundary(num_prompt_tokens: int) -> int:
        """Where the prompt's partial entry sits (docs/semantics.md#eagle)."""
        if eagle:
            return max(num_prompt_tokens // hbs * hbs - hbs, 0)
        return (num_prompt_tokens - max(1, ahead)) // hbs * hbs
    # With partial hits: the prompt of each request, and the prompts whose request
    # stopped at its last hash-block boundary inside a block (a partial entry sits there).
    prompts: dict[str, list[int]] = {}
    reached: list[list[int]] = []
    # id -> [num_tokens, computed, running]
    reqs: dict[str, list[int]] = {}
    next_id = 0
    explicit_steps = False
    applied = 0
    # With EAGLE, partial hits and enable_mamba_shared_prefix_checkpoint, vLLM's scheduler
    # also ends a prompt chunk at the junction a lookup reported (the manager keys the
    # Mamba state there): the lookup is applied at once to learn (hit, junction).
    junction_stops = (eagle and partial_hits and align
                      and bool(config.get("enable_mamba_shared_prefix_checkpoint")))
    looked: tuple[int, int] | None = None

    def extras(op: dict[str, Any], tokens: list[int], prefix: list[int]) -> None:
        """Multimodal items or prompt embeddings for some prompts (``--mm``)."""
        r = rng.random()
        if r < 0.35:
            items: list[list[Any]] = []
            pos = rng.randrange(0, 8)
            while pos < len(tokens) - 1 and len(items) < 3:
                length = min(rng.randrange(1, 3 * bs), len(tokens) - pos)
                # Inside the shared prefix the identifier is the prefix's (equal content)
                # unless this request's image differs there.
                same = pos + length <= len(prefix) and rng.random() < 0.8
                ident = (f"p{prefixes.index(prefix)}-{pos}" if same
                         else f"img-{rng.randrange(3)}")
                items.append([ident, pos, length])
                pos += length + rng.randrange(0, 2 * bs)
            if items:
                op["mm_items"] = items
        elif r < 0.45:
            # Values exactly representable in float32: both sides hash the same bytes.
            op["prompt_embeds"] = [[(t % 16) / 8, rng.randrange(4) / 4] for t in tokens]

    while len(ops) < num_ops:
        if align:
            # Learn the real outcome of what was emitted so far (computed tokens).
            for emitted in ops[applied:]:
                out = replayer.apply(emitted)
                rid_ = emitted.get("req")
                if emitted.get("op") == "allocate" and rid_ in reqs and out.get("ok"):
                    reqs[rid_][1] = out["num_computed_tokens"]
                    prompt = prompts.get(rid_) if partial_hits else None
                    if prompt is not None and reqs[rid_][1] == tail_boundary(len(prompt)) \
                            and reqs[rid_][1] % cbs:
                        reached.append(prompt)
            applied = len(ops)
        if len(reqs) > 6 and rng.random() < 0.3:
            ops.append({"op": "free", "req": rng.choice(list(reqs))})
            del reqs[ops[-1]["req"]]
            continue
        if rng.random() < 0.005:
            # Drain: free everything, then a reset can succeed.
            for rid in list(reqs):
                ops.append({"op": "free", "req": rid})
            reqs.clear()
            ops.append({"op": "reset"})
            ops.append({"op": "usage"})
            continue
        r = rng.random()
        if r < 0.12 or not reqs:
            rid = f"r{next_id}"
            next_id += 1
            n = rng.randrange(1, max(2, min(mml, capacity // 3)))
            prefix = rng.choice(prefixes) if rng.random() < 0.7 else []
            tokens = (prefix + [rng.randrange(1000) for _ in range(n)])[:max(1, min(mml - 64, n))]
            if partial_hits:
                # Partial entries sit at a prompt's last hash-block boundary: only a resend
                # or an extension of that prompt can hit them.
                if reached and rng.random() < 0.5:
                    base = rng.choice(reached)
                    tokens = (base + [rng.randrange(1000) for _ in range(rng.randrange(0, 40))]
                              )[:mml - 64]
                prompts[rid] = tokens
            op: dict[str, Any] = {"op": "add", "req": rid, "tokens": tokens}
            if rng.random() < 0.05:
                op["cache_salt"] = "s"
            if mm:
                extras(op, tokens, prefix)
            ops.append(op)
            reqs[rid] = [len(tokens), 0, 0]
            continue
        rid = rng.choice(list(reqs))
        num_tokens, computed, running = reqs[rid]
        if r < 0.55:
            looked = None
            if computed == 0 and rng.random() < 0.9:
                ops.append({"op": "lookup", "req": rid})
                if junction_stops:
                    for emitted in ops[applied:]:
                        out = replayer.apply(emitted)
                    applied = len(ops)
                    looked = (out.get("hit_tokens", 0), out.get("shared_prefix_boundary", 0))
            remaining = num_tokens - computed
            if remaining <= 0:
                n = 1
            else:
                n = rng.randrange(1, remaining + 1)
                if align and computed % cbs:
                    # Inside a block: stop at its end at the latest.
                    n = min(n, cbs - computed % cbs)
                elif align and computed + n < num_tokens and (computed + n) % cbs:
                    n = (computed + n) // cbs * cbs - computed
                    if n <= 0:
                        if eagle and ops[-1] == {"op": "lookup", "req": rid}:
                            # A lookup belongs to this step's allocation: the pool re-runs
                            # a stale one, vLLM does not, and with EAGLE the junction it
                            # answered decides which blocks are kept. (Traces of configs
                            # without EAGLE keep the lookup, so that the committed samples
                            # stay reproducible: on them the re-run lookup answers alike.)
                            ops.pop()
                        continue  # vLLM schedules nothing for it this step
                tail = tail_boundary(num_tokens)
                if partial_hits and computed < tail < computed + n \
                        and tail > (num_tokens // cbs * cbs - cbs if eagle
                                    else (num_tokens - 1) // cbs * cbs):
                    n = tail - computed
            junction_stop = False
            if looked is not None and ops[-1] == {"op": "lookup", "req": rid}:
                hit, junction = looked
                if hit < junction < hit + n and junction <= num_tokens:
                    n, junction_stop = junction - hit, True
            op = {"op": "allocate", "req": rid, "num_new_tokens": n}
            if rng.random() < 0.15:
                op["full_sequence_must_fit"] = True
            if rng.random() < (0.5 if speculative else 0.05):
                op["num_lookahead_tokens"] = rng.randrange(1, 8)
            if rng.random() < 0.03 and not junction_stop:
                op["use_lookup"] = False
            ops.append(op)
            if not align:
                # Without Mamba checkpoints a guess of progress is enough: assume success.
                reqs[rid][1] = computed + n
            reqs[rid][2] = 1
        elif r < 0.75:
            if computed >= num_tokens and num_tokens < mml - 8:
                k = 1 if rng.random() < 0.9 else rng.randrange(2, 6)
                ops.append({"op": "append", "req": rid,
                            "tokens": [rng.randrange(1000) for _ in range(k)]})
                reqs[rid][0] += k
        elif r < 0.82:
            ops.append({"op": "free", "req": rid})
            del reqs[rid]
        elif r < 0.86:
            ops.append({"op": "preempt", "req": rid})
            reqs[rid][1] = 0
        elif r < 0.91:
            explicit_steps = explicit_steps or rng.random() < 0.3
            if explicit_steps:
                ops.append({"op": "step"})
        elif r < 0.94:
            ops.append({"op": "usage"})
        elif r < 0.95:
            ops.append({"op": "reset"})
        elif r < 0.98:
            if mm and rng.random() < 0.5:
                ops.append({"op": "hashes", "req": rid})
            else:
                ops.append({"op": "blocks", "req": rid})
        else:
            bad = rng.choice([{"op": "free", "req": "nope"}, {"op": "lookup", "req": "nope"},
                              {"op": "allocate", "req": rid, "num_new_tokens": 0,
                               "use_lookup": False} if computed == 0 else {"op": "usage"},
                              {"op": "frobnicate"}])
            ops.append(bad)
    return ops


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config")
    p.add_argument("--ops", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mm", action="store_true",
                   help="multimodal items, prompt embeddings and hashes ops too")
    a = p.parse_args()
    with open(a.config) as f:
        config = json.load(f)
    for op in make_trace(config, a.ops, a.seed, mm=a.mm):
        sys.stdout.write(json.dumps(op, separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
