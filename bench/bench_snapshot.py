"""Snapshot benchmark: how long the serving loop stops while a big state is snapshotted,
the old way (``fork()`` of the serving process, the child pickling its copy-on-write
image) and the new one (the log rotated, a separately started compaction process
replaying it into the previous snapshot), side by side in one run; then the restart time
of that state.

1. A data directory holding a ``--blocks`` pool with ``--requests`` live requests (prompt
   ``--prompt`` tokens each) is built in-process through ``ServiceState.apply`` (as a
   server logs it), snapshotted, and ``--tail`` decode Steps of ``--tail-batch`` requests
   are logged after it (bench_durability.build_state).
2. The directory is opened as a server opens it (recovery), and an asyncio loop serves:
   a ticker wakes every millisecond (its lateness is the loop's pause) while a decode
   Step is applied and logged every ``--step-interval-ms``. Three windows of the same
   loop, each as long as the compaction took (at least ``--seconds``): a compaction
   snapshot, a fork snapshot, no snapshot (the baseline). Reported per window: the longest
   pause, p99 pause, how long starting the snapshot blocked the loop, and the seconds
   until the snapshot was committed.
3. A real server starts on the directory (the compaction's snapshot + the log after it):
   seconds from exec to "serving", and the snapshot load + replay its "recovered" line
   reports.

    python3 bench/bench_snapshot.py                  # full size: minutes on a busy machine
    python3 bench/bench_snapshot.py --blocks 100000 --requests 1000

Prints two tables and writes bench/results/snapshot.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import print_table, ratio, summarize_ns, write_results  # noqa: E402
from bench_durability import build_state, filesystem_of  # noqa: E402
from cache_service.client import CacheClient, StepBuilder  # noqa: E402
from cache_service.durability import DataDir, open_data_dir  # noqa: E402
from cache_service.fairness import keep_heap_frozen  # noqa: E402
from cache_service.server import new_state  # noqa: E402
from cache_service.settings import parse_settings  # noqa: E402
from cache_service.snapshot import delete_before, write_snapshot  # noqa: E402
from cache_service.state import ServiceState, WalRecord, replay_record  # noqa: E402
from kvcache_common.launch import start_cache_service  # noqa: E402


def fork_snapshot(data_dir: DataDir, state: ServiceState) -> threading.Event:
    """The snapshot the server took before (BGSAVE-like): rotate, fork, the child writes
    its copy-on-write image; a thread reaps it and deletes what it covers. Returns an
    event set once it is committed."""
    through = data_dir.wal.rotate()
    pid = os.fork()
    if pid == 0:  # the child: write and leave without any parent cleanup
        code = 1
        try:
            write_snapshot(data_dir.directory, state, through, data_dir.snapshotter.tag)
            code = 0
        finally:
            os._exit(code)
    done = threading.Event()

    def reap() -> None:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the forked snapshot failed"
        delete_before(data_dir.directory, through)
        data_dir.wal.drop_through(through)
        data_dir.snapshotter.last_index = through
        done.set()

    threading.Thread(target=reap, daemon=True).start()
    return done


def compaction_snapshot(data_dir: DataDir, state: ServiceState) -> threading.Event:
    """The server's snapshot now: Snapshotter.start (rotate, spawn the compaction)."""
    snapshotter = data_dir.snapshotter
    snapshotter.start()
    done = threading.Event()

    def wait() -> None:
        snapshotter.wait()
        done.set()

    threading.Thread(target=wait, daemon=True).start()
    return done


async def serve_window(data_dir: DataDir, state: ServiceState, snapshot: Any, *,
                       seconds: float, step_interval: float, batch: int, requests: int,
                       step0: int) -> dict[str, Any]:
    """Runs the loop (ticker + decode Steps) until the snapshot is committed (or for
    ``seconds`` without one); answers the pauses seen."""
    # Requests the log tail did not decode, a slice per Step in turn: each grows by a
    # token every (requests - batch) / batch Steps, far within max_model_len.
    rids = [f"r{i}" for i in range(batch, requests)]
    lateness: list[int] = []
    step_ns: list[int] = []
    stop = asyncio.Event()

    at: list[float] = []  # when each pause ended

    async def ticker() -> None:
        while not stop.is_set():
            t0 = time.perf_counter_ns()
            await asyncio.sleep(0.001)
            lateness.append(max(0, time.perf_counter_ns() - t0 - 1_000_000))
            at.append(time.perf_counter())

    async def steps() -> None:
        step = step0
        while not stop.is_set():
            t0 = time.perf_counter_ns()
            at = (step * batch) % max(1, len(rids) - batch + 1)
            state.apply(WalRecord(step=StepBuilder("big", begin_step=True).decode(
                rids[at:at + batch], [step % 32000] * batch).request))
            step_ns.append(time.perf_counter_ns() - t0)
            step += 1
            await asyncio.sleep(step_interval)

    # As the server does (cache_service.fairness): survivors leave the collector's view.
    tasks = [asyncio.create_task(ticker()), asyncio.create_task(steps()),
             asyncio.create_task(keep_heap_frozen())]
    await asyncio.sleep(0.2)  # both running before the snapshot starts
    lateness.clear()
    at.clear()
    started = time.perf_counter()
    t0 = time.perf_counter_ns()
    done = snapshot(data_dir, state) if snapshot is not None else None
    start_ms = (time.perf_counter_ns() - t0) / 1e6
    committed = 0.0
    while done is not None and not done.is_set():
        await asyncio.sleep(0.01)
        committed = time.perf_counter() - started
    # Every window lasts as long (outliers of a shared machine grow with the length).
    await asyncio.sleep(max(0.0, seconds - (time.perf_counter() - started)))
    stop.set()
    tasks.pop().cancel()
    await asyncio.gather(*tasks)
    pauses = summarize_ns(lateness)
    worst = sorted(range(len(lateness)), key=lateness.__getitem__)[-5:]
    return {"max_pause_ms": round(pauses["max_us"] / 1e3, 2),
            "longest_pauses": [(round(lateness[i] / 1e6, 1), round(at[i] - started, 2))
                               for i in reversed(worst)],  # (ms, s after the start)
            "p99_pause_ms": round(pauses["p99_us"] / 1e3, 2),
            "window_seconds": round(time.perf_counter() - started, 2),
            "start_blocked_ms": round(start_ms, 2) if done is not None else None,
            "seconds_to_commit": round(committed, 2) if done is not None else None,
            "steps": len(step_ns), "step_p50_ms": round(summarize_ns(step_ns)["p50_us"] / 1e3, 2)
            if step_ns else None}


def bench_pauses(directory: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Step latency while each kind of snapshot runs (the compaction process first, then the
    others as long as it took), with their durations and memory."""
    settings = parse_settings(["--event-buffer", "10000"])
    t0 = time.perf_counter()
    data_dir, state = open_data_dir(directory, new_state=lambda i: new_state(settings, i),
                                    apply=replay_record, fsync="batch", snapshot_every=10**9)
    state.durability = data_dir
    opened = time.perf_counter() - t0
    rss_before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    out: dict[str, Any] = {"open_in_process_seconds": round(opened, 2)}
    step = 0
    seconds = args.seconds
    try:
        # The compaction first: the others then run as long as it took.
        for name, snapshot in (("compaction process (new)", compaction_snapshot),
                               ("fork (old)", fork_snapshot), ("no snapshot (baseline)", None)):
            out[name] = asyncio.run(serve_window(
                data_dir, state, snapshot, seconds=seconds,
                step_interval=args.step_interval_ms / 1000, batch=args.tail_batch,
                requests=args.requests, step0=step))
            seconds = max(seconds, out[name]["seconds_to_commit"] or 0.0)
            step += 10_000
        assert data_dir.snapshotter.failed == 0
    finally:
        data_dir.close()  # no final snapshot: the restart below loads the compaction's
    out["children_max_rss_mb"] = round(
        max(rss_before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024, 1)
    return out


def _restart(directory: Path, *, stop_cleanly: bool) -> tuple[dict[str, Any], float]:
    """A real server started on the directory: its "recovered" line and the seconds from
    exec to "serving"; then SIGKILL (the directory stays as it is) or SIGTERM (a final
    snapshot: the next start replays nothing)."""
    t0 = time.perf_counter()
    server = start_cache_service("--data-dir", str(directory), "--log-level", "warning",
                                 timeout=600)
    serving = time.perf_counter() - t0
    line = server.wait_for(lambda r: r.get("event") == "recovered")
    try:
        with CacheClient(server.target) as client:
            client.stats("big")
    finally:
        if not stop_cleanly:
            server.signal(9)
        server.stop(timeout=600)
    return line, serving


def bench_restart(directory: Path) -> dict[str, Any]:
    """Two restarts: after a crash (the compaction's snapshot + the records logged since,
    while it ran), then after a clean stop (the final snapshot alone)."""
    out: dict[str, Any] = {}
    for name, stop_cleanly in (("after_crash", True), ("after_clean_stop", False)):
        line, serving = _restart(directory, stop_cleanly=stop_cleanly)
        out[name] = {"exec_to_serving_seconds": round(serving, 2),
                     "snapshot_load_seconds": line["snapshot_seconds"],
                     "replay_seconds": line["replay_seconds"],
                     "records_replayed": line["records_replayed"],
                     "restore_cpu_seconds": line["cpu_seconds"]}
    return out


def main() -> int:
    """Builds the state, measures the pauses and the restarts, prints the table and writes the
    JSON results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=10_000, help="live requests")
    parser.add_argument("--prompt", type=int, default=128, help="tokens per request")
    parser.add_argument("--tail", type=int, default=200, help="decode Steps logged after "
                        "the snapshot before the run")
    parser.add_argument("--tail-batch", type=int, default=256, help="requests per Step")
    parser.add_argument("--seconds", type=float, default=3.0, help="the shortest window "
                        "(each lasts as long as the compaction's)")
    parser.add_argument("--step-interval-ms", type=float, default=20.0)
    parser.add_argument("--data-root", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="JSON path")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="kvcache-snapshot-", dir=args.data_root))
    try:
        directory = root / "big"
        info = build_state(directory, args.blocks, args.requests, args.prompt, args.tail,
                           args.tail_batch, headroom=4096)  # the windows' decode Steps
        pauses = bench_pauses(directory, args)
        restart = bench_restart(directory)
        windows = [k for k in pauses if isinstance(pauses[k], dict)]
        base = pauses["no snapshot (baseline)"]["max_pause_ms"]
        print_table(f"Serving-loop pauses while a snapshot is taken: {info['num_blocks']:,}-"
                    f"block pool, {info['live_requests']:,} live requests, a "
                    f"{args.tail_batch}-request decode Step every {args.step_interval_ms:g} ms"
                    f" (data dir on {filesystem_of(root)})",
                    ["window", "longest pause ms", "p99 pause ms", "vs baseline",
                     "start blocked ms", "s to commit", "Step p50 ms"],
                    [[k, pauses[k]["max_pause_ms"], pauses[k]["p99_pause_ms"],
                      ratio(pauses[k]["max_pause_ms"], base), pauses[k]["start_blocked_ms"],
                      pauses[k]["seconds_to_commit"], pauses[k]["step_p50_ms"]]
                     for k in windows])
        crash, clean = restart["after_crash"], restart["after_clean_stop"]
        print_table("Restart of that state (a real server)",
                    ["measure", "after a crash", "after a clean stop"],
                    [["exec -> serving (s)", crash["exec_to_serving_seconds"],
                      clean["exec_to_serving_seconds"]],
                     ["snapshot load (s)", crash["snapshot_load_seconds"],
                      clean["snapshot_load_seconds"]],
                     ["log replay (s)", crash["replay_seconds"], clean["replay_seconds"]],
                     ["records replayed", crash["records_replayed"], clean["records_replayed"]],
                     ["restore CPU time (s)", crash["restore_cpu_seconds"],
                      clean["restore_cpu_seconds"]]])
        print(f"in-process open before the run: {pauses['open_in_process_seconds']} s; the "
              f"snapshot children's peak RSS: {pauses['children_max_rss_mb']} MB")
        out = write_results("snapshot", {"state": info, "pauses": pauses, "restart": restart,
                                         "args": vars(args) | {"data_root": None, "out": None}},
                            args.out)
        print(f"wrote {out} (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
