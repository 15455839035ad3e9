#!/usr/bin/env python3
"""Longer fuzzing campaigns than the test tier's (tests/service/test_fuzz.py): several seeds,
many calls each, against one server per seed; the oracle of tests/service/fuzzing.py
(documented statuses only, rejected calls change nothing, the server stays up).

    python3 bench/bench_fuzz.py                       # 4 seeds x 5,000 calls
    python3 bench/bench_fuzz.py --seeds 1,2 --calls 20000

Prints a table (calls, calls/s, status mix, failures) and writes bench/results/fuzz.json;
exits 1 if any seed found a failure (the first ones are printed with their payloads).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.service.fuzzing import Fuzzer  # noqa: E402

from _common import print_table, write_results  # noqa: E402
from kvcache_common.launch import start_cache_service  # noqa: E402


def main() -> int:
    """Fuzzes a fresh server per seed; prints the table; answers 1 when any run found a
    failure."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="1,2,3,4", help="comma-separated seeds")
    parser.add_argument("--calls", type=int, default=5000, help="calls per seed")
    parser.add_argument("--out", type=Path, default=None, help="JSON path")
    args = parser.parse_args()
    rows, results, failed = [], [], False
    for seed in (int(s) for s in args.seeds.split(",")):
        with start_cache_service("--metrics-port", "0", "--max-message-bytes", str(1 << 20),
                                 "--max-tokens-per-step", "20000", "--max-peek-tokens",
                                 "20000", "--log-level", "warning") as srv:
            fuzzer = Fuzzer(srv.target, srv.metrics_port, seed)
            try:
                report = fuzzer.run(args.calls)
            finally:
                fuzzer.close()
        failed |= bool(report.failures)
        for line in report.failures[:5]:
            print(f"seed {seed}: {line}")
        results.append({"seed": seed, "calls": report.calls, "raw": report.raw,
                        "seconds": report.seconds, "by_code": report.by_code,
                        "by_rpc": report.by_rpc, "failures": report.failures[:20]})
        mix = ", ".join(f"{k} {v}" for k, v in sorted(report.by_code.items()))
        rows.append([seed, report.calls, report.raw, round(report.calls / report.seconds),
                     mix, len(report.failures)])
    print_table("Fuzzing campaigns (oracle: documented statuses, rejected calls change "
                "nothing, server alive)",
                ["seed", "calls", "raw-byte calls", "calls/s", "statuses", "failures"], rows)
    out = write_results("fuzz", {"campaigns": results}, args.out)
    print(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
