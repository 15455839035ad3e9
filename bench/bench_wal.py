"""Log engine benchmark: our segment format (cache_service.wal) against SQLite in WAL mode
(stdlib sqlite3), on the Step path: append + commit of one realistic record at a time.

The record is what the server logs for a 256-request decode Step (a serialized
``WalRecord``). Each engine appends ``--records`` of them, one commit per record, under each
durability policy, interleaved in rounds so that machine noise hits both alike:

* ``always``: durable before the answer (ours: write + fdatasync; SQLite:
  ``synchronous=FULL``, an fsync of its -wal file per commit);
* ``batch``: written before the answer, synced later (ours: write, the sync thread
  fdatasyncs every 50 ms; SQLite: ``synchronous=NORMAL``, synced at checkpoints);
* ``never``: written, synced when the OS decides (SQLite: ``synchronous=OFF``).

Then each reads its log back whole (what a restart does before replay). Reported: p50/p99
of one append+commit in microseconds and SQLite's p50 as a ratio of ours.

    python3 bench/bench_wal.py                    # ~20 s
    python3 bench/bench_wal.py --records 2000     # steadier

Prints a table and writes bench/results/wal.json.
"""

from __future__ import annotations

import argparse
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import print_table, ratio, summarize_ns, write_results  # noqa: E402
from bench_durability import filesystem_of  # noqa: E402
from bench_service import DECODE, decode_batch  # noqa: E402
from cache_service.state import WalRecord  # noqa: E402
from cache_service.wal import FsyncPolicy, WriteAheadLog, scan  # noqa: E402

POLICIES: tuple[FsyncPolicy, ...] = ("always", "batch", "never")
_SQLITE_SYNC = {"always": "FULL", "batch": "NORMAL", "never": "OFF"}


def step_records(n: int, requests: int) -> list[bytes]:
    """``n`` serialized WalRecords of ``requests``-request decode Steps."""
    return [WalRecord(step=decode_batch("bench", requests, i, DECODE).request)
            .SerializeToString() for i in range(n)]


class OurLog:
    def __init__(self, directory: Path, policy: FsyncPolicy) -> None:
        directory.mkdir()
        self.directory = directory
        self.log = WriteAheadLog(directory, 1, fsync=policy)

    def append(self, payload: bytes) -> None:
        """Appends one record (durable as the fsync policy says)."""
        self.log.append(payload)

    def close(self) -> None:
        """Closes the log."""
        self.log.close()

    def read_all(self) -> int:
        """Scans the log from disk; answers how many records it holds."""
        return len(scan(self.directory, repair=False).records)


class SqliteLog:
    def __init__(self, directory: Path, policy: FsyncPolicy) -> None:
        directory.mkdir()
        self.path = directory / "log.db"
        self.db = sqlite3.connect(self.path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(f"PRAGMA synchronous={_SQLITE_SYNC[policy]}")
        self.db.execute("CREATE TABLE log (idx INTEGER PRIMARY KEY, payload BLOB NOT NULL)")
        self.next = 1

    def append(self, payload: bytes) -> None:
        """Inserts one record in its own transaction (durable as the synchronous mode says)."""
        self.db.execute("BEGIN")
        self.db.execute("INSERT INTO log VALUES (?, ?)", (self.next, payload))
        self.db.execute("COMMIT")
        self.next += 1

    def close(self) -> None:
        """Closes the database."""
        self.db.close()

    def read_all(self) -> int:
        """Reads every record back in order; answers how many there are."""
        with sqlite3.connect(self.path) as db:
            return len(db.execute("SELECT idx, payload FROM log ORDER BY idx").fetchall())


ENGINES = (("ours", OurLog), ("sqlite-wal", SqliteLog))


def bench(root: Path, records: list[bytes], rounds: int) -> dict:
    """Append latencies of our log and SQLite per fsync policy, interleaved in rounds, and the
    time to read each back."""
    out: dict[str, dict] = {}
    per_round = max(1, len(records) // rounds)
    for policy in POLICIES:
        logs = {name: cls(root / f"{name}-{policy}", policy) for name, cls in ENGINES}
        samples: dict[str, list[int]] = {name: [] for name, _ in ENGINES}
        for r in range(rounds):  # interleaved: noise hits both engines alike
            chunk = records[r * per_round:(r + 1) * per_round]
            for name, log in logs.items():
                append = log.append
                for payload in chunk:
                    t0 = time.perf_counter_ns()
                    append(payload)
                    samples[name].append(time.perf_counter_ns() - t0)
        for name, log in logs.items():
            log.close()
            read_started = time.perf_counter()
            count = log.read_all()
            read_s = time.perf_counter() - read_started
            assert count == len(samples[name]), (name, count)
            out[f"{name} {policy}"] = {**summarize_ns(samples[name]),
                                       "read_back_s": round(read_s, 4)}
    return out


def main() -> int:
    """Writes the same records to each engine, prints the table and writes the JSON results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=600, help="records per engine "
                        "and policy")
    parser.add_argument("--requests", type=int, default=256, help="requests per decode "
                        "Step record")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--data-root", type=Path, default=None, help="where the logs go "
                        "(default: a temporary directory; fsync costs depend on the disk)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path")
    args = parser.parse_args()
    records = step_records(args.records, args.requests)
    root = Path(tempfile.mkdtemp(prefix="bench-wal-", dir=args.data_root))
    try:
        results = bench(root, records, args.rounds)
        fs = filesystem_of(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for policy in POLICIES:
        ours, lite = results[f"ours {policy}"], results[f"sqlite-wal {policy}"]
        rows.append((policy, ours["p50_us"], ours["p99_us"], lite["p50_us"], lite["p99_us"],
                     ratio(lite["p50_us"], ours["p50_us"]), ours["read_back_s"],
                     lite["read_back_s"]))
    print_table(f"append+commit of one {args.requests}-request decode Step record "
                f"({len(records[0])} bytes), {args.records} per engine, on {fs}",
                ("fsync", "ours p50 us", "ours p99 us", "sqlite p50 us", "sqlite p99 us",
                 "sqlite/ours p50", "ours read s", "sqlite read s"), rows)
    write_results("wal", {"records": args.records, "requests_per_record": args.requests,
                          "record_bytes": len(records[0]), "filesystem": fs,
                          "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
