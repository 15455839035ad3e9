#!/usr/bin/env python3
"""Instruction counts of a fixed small core workload per op kind, under valgrind's callgrind,
against budgets kept in bench/instruction_budgets.json: a regression guard that a noisy,
shared machine cannot fool (the count of one run is repeatable to well under 1%; a timing is
not).

The workload (one process, ``PYTHONHASHSEED=0``): a ``Pool`` of one full-attention and one
sliding-window group (block size 16), 16 requests of 256 tokens (half of them behind one
shared 128-token prefix). Each op kind runs once untimed (warm-up: imports, the adaptive
interpreter's specialization), then once measured:

``add`` (16 add_request: the prompt hashing), ``lookup`` (16), ``allocate`` (16 prefills of
256 tokens), ``decode`` (32 ``Pool.decode`` steps of the 16), ``append_allocate`` (16 steps of
append + allocate(1) per request: the generic decode), ``free`` (16), ``evict`` (8 admissions
into a pool whose free blocks are all cached), ``manager_decode`` (32 steps of
``KVCacheManager.decode_slot`` over the 16, the core without the facade).

Only what runs inside each measured call is counted: the regions run inside
``functools.reduce`` and callgrind collects from its entry to its exit
(``--toggle-collect``), dumping one profile per region (``--dump-after``).

Counts depend on the interpreter build, so budgets are keyed by
``<implementation>-<version>-<machine>`` (``key()``); another build has no budget and the check
says so. ``--check`` fails (exit 1) when a kind exceeds its budget by more than 10%;
``--update`` writes this build's counts as its budgets (lower them with every change that makes
the core faster, and say why when raising one).

    python3 bench/instruction_counts.py --check
    python3 bench/instruction_counts.py --update
    python3 bench/instruction_counts.py --core compiled   # compiled / pure, noise-free

Writes bench/results/instructions.json.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BUDGETS = HERE / "instruction_budgets.json"
TOLERANCE = 0.10
PROMPT = 256
KINDS = ("add", "lookup", "allocate", "decode", "append_allocate", "free", "evict",
         "manager_decode")


def key() -> str:
    """What the counts depend on: the interpreter build and the processor."""
    return f"{sys.implementation.name}-{platform.python_version()}-{platform.machine()}"


# --- the workload (run under valgrind by the child) -------------------------------------------

def _workload() -> list[tuple[str, Callable[[], object]]]:
    sys.path.insert(0, str(REPO))
    # No cyclic collections: when one runs depends on every object allocated before, so an
    # unrelated change can move a full collection into a measured region (+48% on
    # manager_decode was seen) or out of it. The workload makes no cycles worth collecting.
    gc.disable()
    from cache_service.core.pool import Pool, PoolOptions  # noqa: PLC0415
    from cache_service.core.specs import (  # noqa: PLC0415
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    def pool(num_blocks: int) -> Pool:
        config = KVCacheConfig(num_blocks=num_blocks, groups=(
            KVCacheGroupSpec(("full",), FullAttentionSpec(
                block_size=16, num_kv_heads=1, head_size=1, dtype="float32")),
            KVCacheGroupSpec(("swa",), SlidingWindowSpec(
                block_size=16, num_kv_heads=1, head_size=1, dtype="float32",
                sliding_window=128))))
        return Pool(config, PoolOptions(max_model_len=1024, enable_events=True))

    shared = list(range(1000, 1128))

    def prompt(i: int) -> list[int]:
        own = [(i * 7919 + t) % 32000 for t in range(PROMPT)]
        return (shared + own)[:PROMPT] if i % 2 else own

    n = 16

    def fresh(tag: str, num_blocks: int = 1024) -> tuple[Pool, list[str]]:
        p = pool(num_blocks)
        return p, [f"{tag}{i}" for i in range(n)]

    def admit(p: Pool, rids: list[str]) -> None:
        for i, rid in enumerate(rids):
            p.add_request(rid, prompt(i))
            hit = p.lookup(rid).hit_tokens
            p.allocate(rid, PROMPT - hit, include_tables=False)

    def looked_up(p: Pool, rids: list[str], first: int = 0) -> list[int]:
        """Adds and looks up ``rids``; their tokens still to allocate."""
        todo = []
        for i, rid in enumerate(rids):
            p.add_request(rid, prompt(first + i))
            todo.append(PROMPT - p.lookup(rid).hit_tokens)
        return todo

    def case(kind: str, rnd: int) -> Callable[[], object]:
        """The measured callable of ``kind``; everything it needs is set up here."""
        tag = f"{kind}{rnd}-"
        if kind == "add":
            p, rids = fresh(tag)
            return lambda: [p.add_request(rid, prompt(i)) for i, rid in enumerate(rids)]
        if kind == "lookup":
            p, rids = fresh(tag)
            admit(p, rids[: n // 2])
            later = [f"{tag}b{i}" for i in range(n)]
            for i, rid in enumerate(later):
                p.add_request(rid, prompt(i))
            return lambda: [p.lookup(rid) for rid in later]
        if kind == "allocate":
            p, rids = fresh(tag)
            todo = looked_up(p, rids)
            return lambda: [p.allocate(rid, k, include_tables=False)
                            for rid, k in zip(rids, todo, strict=True)]
        if kind in ("decode", "append_allocate", "manager_decode"):
            p, rids = fresh(tag)
            admit(p, rids)
            if kind == "decode":
                return lambda: [p.decode(rids, [s] * n) for s in range(32)]
            if kind == "manager_decode":
                mgr = p.manager
                reqs = [p._requests[rid] for rid in rids]  # noqa: SLF001 (the core underneath)

                def steps() -> None:
                    for s in range(32):
                        for r in reqs:
                            r.append_tokens((s,))
                            mgr.decode_slot(r)
                            r.num_computed_tokens += 1
                return steps

            def generic() -> None:
                for s in range(16):
                    p.new_step()
                    for rid in rids:
                        p.append_tokens(rid, (s,))
                        p.allocate(rid, 1, use_lookup=False, include_tables=False)
            return generic
        if kind == "free":
            p, rids = fresh(tag)
            admit(p, rids)
            return lambda: [p.free(rid) for rid in rids]
        if kind == "evict":
            # ~25 blocks per request (both groups) fill a 220-block pool with 8 requests;
            # freed, their blocks stay cached, so the next 8 admissions evict.
            p, rids = fresh(tag, num_blocks=220)
            admit(p, rids[:8])
            for rid in rids[:8]:
                p.free(rid)
            later = rids[8:]
            todo = looked_up(p, later, first=1000)
            return lambda: [p.allocate(rid, k, include_tables=False)
                            for rid, k in zip(later, todo, strict=True)]
        raise ValueError(kind)

    out: list[tuple[str, Callable[[], object]]] = []
    for kind in KINDS:
        out.append((f"warmup:{kind}", case(kind, 0)))
        out.append((kind, case(kind, 1)))
    return out


def child() -> int:
    """Runs every region inside functools.reduce (the collection toggle); prints their
    names in order as one JSON line."""
    names = []
    for name, fn in _workload():
        functools.reduce(lambda acc, _: fn(), (0,), None)
        names.append(name)
    print(json.dumps(names))
    return 0


# --- the parent: valgrind, the dumps, the budgets ---------------------------------------------

def measure(core: str = "pure") -> dict[str, int]:
    """Instruction count per op kind (one callgrind run of the child, with ``core``)."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise RuntimeError("valgrind is not installed")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cg.out"
        # The budgets are the pure-Python core's (the reference; a compiled build's counts
        # are a fraction of them and would hide a regression of the source).
        env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(REPO),
               "KVCACHE_CORE": core}
        done = subprocess.run(
            [valgrind, "--tool=callgrind", "--collect-atstart=no",
             "--toggle-collect=functools_reduce", "--dump-after=functools_reduce",
             f"--callgrind-out-file={out}", sys.executable, str(Path(__file__).resolve()),
             "--child"], capture_output=True, text=True, env=env, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"the callgrind run failed:\n{done.stderr[-3000:]}")
        names = json.loads(done.stdout.strip().splitlines()[-1])
        dumps = sorted(Path(tmp).glob("cg.out.*"), key=lambda f: int(f.suffix[1:]))
        totals = []
        for dump in dumps:
            for line in dump.read_text().splitlines():
                if line.startswith("totals:") or line.startswith("summary:"):
                    totals.append(int(line.split()[1]))
                    break
        # Startup code may call reduce too: the regions are the last dumps.
        if len(totals) < len(names):
            raise RuntimeError(f"{len(totals)} callgrind dumps for {len(names)} regions")
        counts = dict(zip(names, totals[-len(names):], strict=True))
    return {k: counts[k] for k in KINDS}


def load_budgets() -> dict[str, dict[str, int]]:
    """The committed instruction budgets, by build key then op kind (empty without the file)."""
    return json.loads(BUDGETS.read_text()) if BUDGETS.exists() else {}


def main(argv: list[str] | None = None) -> int:
    """Counts instructions per op kind against this build's budgets; ``--check``: answers 1
    when a kind is over by more than the tolerance; ``--update``: writes the counts as the
    budgets."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help="exit 1 if a kind exceeds its budget by more than 10%%")
    mode.add_argument("--update", action="store_true",
                      help="write this build's counts as its budgets")
    mode.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--core", choices=("pure", "compiled"), default="pure",
                   help="the core to count (budgets are the pure core's: --core compiled "
                        "prints its counts over them, compiled / pure, and checks nothing)")
    p.add_argument("--out", type=Path, default=None, help="JSON path")
    args = p.parse_args(argv)
    if args.core != "pure" and (args.check or args.update):
        p.error("--check and --update take the pure core's counts (the budgets' core)")
    if args.child:
        return child()
    sys.path.insert(0, str(HERE))
    from _common import print_table, write_results  # noqa: PLC0415

    budgets = load_budgets()
    mine = budgets.get(key())
    if args.check and mine is None:
        print(f"no instruction budgets for {key()} in {BUDGETS.name} (have: "
              f"{', '.join(budgets) or 'none'}): nothing to check")
        return 0
    counts = measure(args.core)
    rows, over = [], []
    for kind in KINDS:
        budget = (mine or {}).get(kind)
        rel = counts[kind] / budget if budget else None
        if rel is not None and rel > 1 + TOLERANCE:
            over.append(kind)
        rows.append([kind, counts[kind], budget, f"{rel:.3f}x" if rel else "-",
                     "OVER" if kind in over else ("ok" if rel else "-")])
    print_table(f"instructions per op kind ({key()}, {args.core} core), budget (the pure "
                f"core's) + {TOLERANCE:.0%} allowed",
                ["kind", "instructions", "budget", "count / budget", ""], rows)
    if args.update:
        budgets[key()] = counts
        BUDGETS.write_text(json.dumps(budgets, indent=1, sort_keys=True) + "\n")
        print(f"wrote the budgets of {key()} to {BUDGETS}")
    path = write_results("instructions", {"key": key(), "core": args.core, "counts": counts,
                                          "budgets": mine, "over": over}, args.out)
    print(f"wrote {path}")
    if args.check and over:
        print(f"over budget (+{TOLERANCE:.0%}): {', '.join(over)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
