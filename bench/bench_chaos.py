#!/usr/bin/env python3
"""The chaos tier as a benchmark: every scenario of tests/chaos/scenarios.py, ``--runs``
times each with its own seed, judged by the tier's one checker (tests/chaos/checker.py):
every Step a client saw acknowledged is there exactly once, nothing applied twice, tables
and stats equal to a replay of the acknowledged history through the core.

    python3 bench/bench_chaos.py                      # 3 runs of each scenario: minutes
    python3 bench/bench_chaos.py --runs 10 --scenarios sigstop_owner,lost_answers

Prints a table (scenario x runs x acknowledged / in doubt / lost / duplicated, runs that
were not exact, the longest Step a client waited) and writes bench/results/chaos.json.
Cluster scenarios need the ``etcd`` binary and disk_full needs root (a tmpfs): without
them those rows say skipped.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.chaos, from a checkout
# As tests/conftest.py: gRPC's fork handlers can deadlock the fork() that starts a server in
# a process whose gRPC threads are busy (the load clients); nothing here forks but to exec.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from tests.chaos.scenarios import SCENARIOS, can_mount  # noqa: E402

from _common import print_table, write_results  # noqa: E402
from kvcache_common.etcd_launch import etcd_binary  # noqa: E402

CLUSTER = {"sigkill_owner", "sigstop_owner", "rolling_restart", "etcd_restart"}


def skipped(name: str) -> str | None:
    """Why scenario ``name`` cannot run on this machine (no etcd, no mountable filesystem), or
    None."""
    if name in CLUSTER and etcd_binary() is None:
        return "no etcd binary"
    if name == "disk_full":
        return can_mount()
    return None


def main() -> None:
    """Runs the chosen scenarios ``--runs`` times each and prints a table of what the checker
    found."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per scenario (seeds)")
    parser.add_argument("--seed", type=int, default=1000, help="the first run's seed")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated, of: {', '.join(SCENARIOS)}")
    args = parser.parse_args()
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        parser.error(f"--scenarios: unknown {unknown}")
    rows: list[list] = []
    results: dict[str, dict] = {}
    for name in names:
        why = skipped(name)
        if why:
            results[name] = {"skipped": why}
            rows.append([name, 0, "-", "-", "-", "-", "-", "-", f"skipped: {why}"])
            continue
        runs: list[dict] = []
        for run in range(args.runs):
            seed = args.seed + run
            start = time.monotonic()
            with tempfile.TemporaryDirectory(prefix=f"chaos-{name}-") as tmp:
                try:
                    verdict = SCENARIOS[name](seed, Path(tmp))
                    outcome: dict = {"acknowledged": verdict.acknowledged,
                               "in_doubt": verdict.in_doubt, "rejected": verdict.rejected,
                               "lost": verdict.lost, "duplicated": verdict.duplicated,
                               "mismatched": verdict.mismatched, "exact": verdict.exact,
                               "longest_step_s": round(verdict.longest_step, 3),
                               "errors": verdict.errors[:5]}
                except Exception as exc:  # a scenario that could not run is a result too
                    outcome = {"error": f"{type(exc).__name__}: {exc}"[:500],
                               "traceback": traceback.format_exc()[-2000:], "exact": False}
            outcome.update(seed=seed, seconds=round(time.monotonic() - start, 1))
            runs.append(outcome)
        results[name] = {"runs": runs}

        def total(key: str, runs: list[dict] = runs) -> int:
            return sum(r.get(key, 0) for r in runs)
        rows.append([name, len(runs), total("acknowledged"), total("in_doubt"),
                     total("lost"), total("duplicated"),
                     sum(not r["exact"] for r in runs),
                     max((r.get("longest_step_s", 0.0) for r in runs), default=0.0),
                     "; ".join(sorted({r["error"][:60] for r in runs if "error" in r}))])
    print_table(f"Chaos scenarios ({args.runs} runs each, seeds {args.seed}..)",
                ["scenario", "runs", "acknowledged", "in doubt", "lost", "duplicated",
                 "runs not exact", "longest Step s", "notes"], rows)
    print(f"wrote {write_results('chaos', {'runs_per_scenario': args.runs, 'scenarios': results})}")


if __name__ == "__main__":
    main()
