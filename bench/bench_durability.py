"""Durability benchmark: what the write-ahead log costs a decode Step, and how long a
restart takes for a big state.

1. Step latency, side by side in one run: three real servers (in-memory, ``--data-dir
   --fsync batch``, ``--data-dir --fsync always``) each get the same 256-request decode
   Steps (one ``decode`` op), in interleaved rounds so that machine noise hits all three
   alike. Reported: p50/p99 and the p50 ratio to in-memory (goal for batch: <= 1.15x).
2. Restart time vs state size: a data directory holding a ``--blocks`` pool with
   ``--requests`` live requests is built in-process through ``ServiceState.apply`` (as a
   server would log it), snapshotted, then ``--tail`` more decode Steps are logged after
   the snapshot. Then a real server starts on it: its "recovered" line times the snapshot
   load and the log replay (replay rate in records/s and decode ops/s), and the bench the
   seconds from exec to "serving" (Python imports included).

    python3 bench/bench_durability.py              # under a minute
    python3 bench/bench_durability.py --steps 500  # steadier latency numbers

Prints two tables and writes bench/results/durability.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import print_table, ratio, summarize_ns, write_results  # noqa: E402
from bench_service import DECODE, admit, decode_batch, model, pool_kwargs  # noqa: E402
from cache_service.client import (  # noqa: E402
    CacheClient,
    DecodeResult,
    StepBuilder,
    register_request,
)
from cache_service.durability import open_data_dir  # noqa: E402
from cache_service.server import new_state  # noqa: E402
from cache_service.settings import parse_settings  # noqa: E402
from cache_service.state import WalRecord, replay_record  # noqa: E402
from kvcache_common.launch import ServerProcess, start_cache_service  # noqa: E402

MODES = (("in-memory", ()), ("--fsync batch", ("--fsync", "batch")),
         ("--fsync always", ("--fsync", "always")))


def filesystem_of(path: Path) -> str:
    """The file system type holding ``path`` (fsync costs depend on it)."""
    best, kind = "", "?"
    for line in Path("/proc/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) > 2 and str(path.resolve()).startswith(parts[1]) and \
                len(parts[1]) >= len(best):
            best, kind = parts[1], parts[2]
    return kind


def bench_steps(root: Path, n: int, steps: int, warmup: int, rounds: int) -> dict:
    """p50 of an n-request decode Step against each server mode, interleaved."""
    servers: dict[str, ServerProcess] = {}
    clients: dict[str, CacheClient] = {}
    samples: dict[str, list[int]] = {name: [] for name, _ in MODES}
    try:
        for i, (name, flags) in enumerate(MODES):
            extra = ("--data-dir", str(root / f"steps-{i}"), *flags) if flags else ()
            servers[name] = start_cache_service("--log-level", "warning", *extra)
            client = clients[name] = CacheClient(servers[name].target, default_timeout=60)
            client.register_pool("bench", model(), **pool_kwargs(n, steps + warmup))
            admit(client, "bench", n)
            for step in range(warmup):
                client.step_batch(decode_batch("bench", n, step, DECODE))
        per_round = max(1, steps // rounds)
        step = warmup
        for _ in range(rounds):
            for name, _flags in MODES:
                client = clients[name]
                for k in range(per_round):
                    batch = decode_batch("bench", n, step + k, DECODE)
                    t0 = time.perf_counter_ns()
                    result = client.step_batch(batch)
                    elapsed = time.perf_counter_ns() - t0
                    decoded = result.results[0]
                    assert isinstance(decoded, DecodeResult) and decoded.all_ok, \
                        "decode found no room; enlarge the pool"
                    samples[name].append(elapsed)
            step += per_round
    finally:
        for client in clients.values():
            client.close()
        for server in servers.values():
            server.stop()
    return {name: summarize_ns(s) for name, s in samples.items()}


def build_state(directory: Path, num_blocks: int, requests: int, prompt: int,
                tail: int, tail_batch: int, headroom: int = 64) -> dict:
    """A data directory with a big pool: admissions + a snapshot + a log tail
    (``headroom``: tokens each request may still grow by after the tail)."""
    settings = parse_settings(["--event-buffer", "10000"])
    data_dir, state = open_data_dir(directory, new_state=lambda i: new_state(settings, i),
                                    apply=replay_record, fsync="never", snapshot_every=10**9)
    state.durability = data_dir
    started = time.perf_counter()
    state.apply(WalRecord(register_pool=register_request(
        "big", model(), num_blocks=num_blocks, max_model_len=prompt + tail + headroom)))
    for start in range(0, requests, 500):
        batch = StepBuilder("big", begin_step=True)
        for i in range(start, min(requests, start + 500)):
            tokens = [(i * 7919 + t) % 32000 for t in range(prompt)]
            batch.add(f"r{i}", tokens).allocate(f"r{i}", prompt)
        state.apply(WalRecord(step=batch.request))
    built = time.perf_counter() - started
    t0 = time.perf_counter()
    data_dir.snapshotter.take_now(state)
    snapshot_seconds = time.perf_counter() - t0
    snapshot_bytes = sum(p.stat().st_size for p in directory.glob("snapshot-*.snap"))
    rids = [f"r{i}" for i in range(tail_batch)]
    for step in range(tail):
        state.apply(WalRecord(step=StepBuilder("big", begin_step=True)
                              .decode(rids, [step % 32000] * tail_batch).request))
    stats = state.registry.get("big").pool.stats()
    data_dir.close()  # no final snapshot: the tail stays in the log
    wal_bytes = sum(p.stat().st_size for p in directory.glob("wal-*.log"))
    return {"build_seconds": round(built, 2), "snapshot_write_seconds": round(snapshot_seconds, 3),
            "snapshot_bytes": snapshot_bytes, "wal_tail_bytes": wal_bytes,
            "num_blocks": num_blocks, "live_requests": stats.num_requests,
            "blocks_in_use": stats.num_blocks - 1 - stats.num_free_blocks,
            "tail_records": tail, "tail_ops": tail * tail_batch}


def bench_restart(directory: Path, state_info: dict) -> dict:
    """A real server started on the directory: exec -> "serving", and its "recovered"
    line (snapshot load and log replay, timed by the server itself)."""
    t0 = time.perf_counter()
    server = start_cache_service("--data-dir", str(directory), "--log-level", "warning")
    serving = time.perf_counter() - t0
    line = server.wait_for(lambda r: r.get("event") == "recovered")
    try:
        with CacheClient(server.target) as client:
            stats = client.stats("big")
        assert stats.num_requests == state_info["live_requests"]
    finally:
        server.signal(9)  # leave the directory as it was (no final snapshot)
        server.stop()
    replay_rate = line["replay_records_per_second"]
    return {"snapshot_load_seconds": line["snapshot_seconds"],
            "replay_seconds": line["replay_seconds"],
            "restore_seconds": round(line["snapshot_seconds"] + line["replay_seconds"], 3),
            "restore_cpu_seconds": line["cpu_seconds"],
            "records_replayed": line["records_replayed"],
            "replay_records_per_s": replay_rate,
            "replay_ops_per_s": round(replay_rate * state_info["tail_ops"]
                                      / max(1, state_info["tail_records"])),
            "server_exec_to_serving_seconds": round(serving, 3)}


def main() -> int:
    """Measures Steps per durability mode, interleaved in rounds, and prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests-per-step", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200, help="measured Steps per mode")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=10_000, help="live requests")
    parser.add_argument("--prompt", type=int, default=128, help="tokens per request")
    parser.add_argument("--tail", type=int, default=200, help="decode Steps after the "
                        "snapshot (the log replayed at restart)")
    parser.add_argument("--tail-batch", type=int, default=256, help="requests per tail Step")
    parser.add_argument("--data-root", type=Path, default=None,
                        help="where the data directories go (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="kvcache-durability-", dir=args.data_root))
    try:
        fs = filesystem_of(root)
        steps = bench_steps(root, args.requests_per_step, args.steps, args.warmup,
                            args.rounds)
        base = steps["in-memory"]["p50_us"]
        print_table(f"{args.requests_per_step}-request decode Step through gRPC, data dir on "
                    f"{fs} (interleaved, {args.steps} Steps each)",
                    ["server", "p50 ms", "p99 ms", "p50 vs in-memory"],
                    [[name, s["p50_us"] / 1e3, s["p99_us"] / 1e3, ratio(s["p50_us"], base)]
                     for name, s in steps.items()])
        state_dir = root / "big"
        info = build_state(state_dir, args.blocks, args.requests, args.prompt, args.tail,
                           args.tail_batch)
        restart = bench_restart(state_dir, info)
        print_table(f"Restart: {info['num_blocks']:,}-block pool, {info['live_requests']:,} "
                    f"live requests ({info['blocks_in_use']:,} blocks in use), snapshot "
                    f"{info['snapshot_bytes'] / 1e6:.1f} MB + log tail of "
                    f"{info['tail_records']} Steps ({info['tail_ops']:,} decode ops)",
                    ["measure", "value"],
                    [["snapshot load (s)", restart["snapshot_load_seconds"]],
                     ["log replay (s)", restart["replay_seconds"]],
                     ["state restored: load + replay (s)", restart["restore_seconds"]],
                     ["  of which process CPU time (s)", restart["restore_cpu_seconds"]],
                     ["log replay rate (records/s)", restart["replay_records_per_s"]],
                     ["log replay rate (decode ops/s)", restart["replay_ops_per_s"]],
                     ["server exec -> serving (s)", restart["server_exec_to_serving_seconds"]],
                     ["snapshot write (s)", info["snapshot_write_seconds"]]])
        out = write_results("durability", {
            "filesystem": fs, "step_latency": steps,
            "batch_vs_memory": round(steps["--fsync batch"]["p50_us"] / base, 3),
            "always_vs_memory": round(steps["--fsync always"]["p50_us"] / base, 3),
            "state": info, "restart": restart}, args.out)
        print(f"wrote {out} (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs: "
              "wall times stretch on a busy machine, CPU times do not)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
