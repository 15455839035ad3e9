#!/usr/bin/env python3
"""Replication benchmark: what a synchronous standby costs per Step, and how fast a pool
fails over to it after its owner is SIGKILLed (no shared storage).

Starts its own etcd and cache-service replicas as processes, each replica on its own
``--data-dir`` (``--fsync batch``, the default):

* ``latency``: three 2-replica clusters side by side, ``--replication sync``, ``async``
  and ``none``; the same sequential Step (a decode op over 8 requests) on a pool of each,
  interleaved in rounds; Step p50 of each and the ratios (goal for sync <= 1.3x none).
* ``failover``: 3 replicas (``--replication sync``, ``--etcd-lease-ttl 2``: the shortest
  lease etcd grants with its default election timeout); one client steps a pool in a loop;
  its owner is SIGKILLed; the time from the kill to the first Step answered after the
  owner was gone is one sample, and every time the client had to register the pool again
  (a new incarnation) is counted (0 expected: the standby promotes itself with the
  pool's state). A fresh replica replaces the dead one before the next kill.
* ``catchup``: a standby joining an owner with a pool of ``--blocks`` blocks in use:
  seconds from the owner choosing it (it joined) until the owner logs it live (snapshot
  pickled, sent, unpickled, acknowledged).

    python3 bench/bench_replication.py                 # about a minute
    python3 bench/bench_replication.py --kills 20      # p99 over more kills

Prints a table and writes bench/results/replication.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import percentile, print_table, write_results
from bench_cluster import LAYERS, kill_owners, owner_target
from cache_service.client import CacheClient, ops
from kvcache_common.etcd_launch import EtcdServer, etcd_binary
from kvcache_common.launch import ServerProcess, start_cache_service

TTL = 2


def replica(etcd: EtcdServer, cluster: str, root: Path, mode: str) -> ServerProcess:
    """A cluster replica with its own data dir under ``root`` and replication ``mode``."""
    member = uuid.uuid4().hex[:8]
    return start_cache_service(
        "--drain-seconds", "1", "--port", "0", "--etcd-endpoints", etcd.endpoint,
        "--cluster-name", cluster, "--etcd-lease-ttl", str(TTL), "--member-id", member,
        "--data-dir", str(root / member), "--replication", mode)


def register(client: CacheClient, pool: str, blocks: int = 4096) -> None:
    """Registers the benchmark's pool ``pool`` of ``blocks`` blocks."""
    client.register_pool(pool, LAYERS, num_blocks=blocks, max_model_len=8192)


def _wait_live(owner: ServerProcess, timeout: float = 60) -> None:
    owner.wait_for(lambda r: r.get("event") == "standby_live", timeout)


def _decode_loop(client: CacheClient, pool: str, n: int) -> list[float]:
    rids = [f"d{i}" for i in range(8)]
    out = []
    for _ in range(n):
        start = time.perf_counter()
        client.decode(pool, rids, [7] * 8)
        out.append(time.perf_counter() - start)
    return out


def bench_latency(etcd: EtcdServer, root: Path, steps: int, rounds: int) -> dict:
    """Step latency with replication sync, async and off (two replicas each), interleaved in
    rounds."""
    names = {mode: f"lat-{mode}-{uuid.uuid4().hex[:6]}" for mode in ("sync", "async", "none")}
    clusters = {mode: [replica(etcd, name, root, mode) for _ in range(2)]
                for mode, name in names.items()}
    samples: dict[str, list[float]] = {mode: [] for mode in clusters}
    try:
        clients = {mode: CacheClient(",".join(r.target for r in reps), default_timeout=30)
                   for mode, reps in clusters.items()}
        for mode, client in clients.items():
            register(client, "lat")
            if mode != "none":
                owner = next(r for r in clusters[mode]
                             if r.target == owner_target(clusters[mode], "lat"))
                _wait_live(owner)
            client.step("lat", [op for i in range(8) for op in (
                ops.add(f"d{i}", [1] * 20), ops.allocate(f"d{i}", 20))])
            _decode_loop(client, "lat", 50)  # warm-up
        for _ in range(rounds):
            for mode, client in clients.items():
                samples[mode] += _decode_loop(client, "lat", steps)
        for client in clients.values():
            client.close()
    finally:
        for reps in clusters.values():
            for r in reps:
                r.stop()
    p50 = {mode: percentile(sorted(xs), 50) for mode, xs in samples.items()}
    p99 = {mode: percentile(sorted(xs), 99) for mode, xs in samples.items()}
    return {"steps": steps * rounds, "sync_p50_us": round(p50["sync"] * 1e6, 1),
            "async_p50_us": round(p50["async"] * 1e6, 1),
            "none_p50_us": round(p50["none"] * 1e6, 1),
            "sync_p99_us": round(p99["sync"] * 1e6, 1),
            "none_p99_us": round(p99["none"] * 1e6, 1),
            "ratio_p50": round(p50["sync"] / p50["none"], 3)}


def bench_failover(etcd: EtcdServer, root: Path, kills: int) -> dict:
    """Failover times over ``kills`` SIGKILLs of a pool's owner with a synchronous standby."""
    cluster = f"fo-{uuid.uuid4().hex[:6]}"
    # Each victim is killed only once its standby copy is live.
    samples, again = kill_owners(lambda: replica(etcd, cluster, root, "sync"), kills,
                                 _wait_live)
    xs = sorted(samples)
    return {"kills": kills, "samples_s": [round(x, 3) for x in samples],
            "p50_s": round(percentile(xs, 50), 3) if xs else None,
            "p99_s": round(percentile(xs, 99), 3) if xs else None,
            "lease_ttl_s": TTL, "registered_again": again}


def bench_catchup(etcd: EtcdServer, root: Path, blocks: int) -> dict:
    """How long a new standby takes to catch up with a pool of ``blocks`` blocks."""
    cluster = f"cu-{uuid.uuid4().hex[:6]}"
    owner = replica(etcd, cluster, root, "sync")
    try:
        with CacheClient(owner.target, default_timeout=60) as client:
            register(client, "big", blocks)
            per = 4096  # tokens per request: 256 blocks of 16
            n = blocks // 256 - 1
            for i in range(0, n, 16):
                client.step("big", [op for j in range(i, min(n, i + 16)) for op in (
                    ops.add(f"b{j}", list(range(j * per, j * per + per))),
                    ops.allocate(f"b{j}", per))])
            standby = replica(etcd, cluster, root, "sync")
            try:
                rec = owner.wait_for(lambda r: r.get("event") == "standby_live", 300)
                chosen = next(r for r in owner.records
                              if r.get("event") == "standby_chosen")
                # From the owner's choice of the standby (it joined) to its copy live.
                seconds = (_when(rec) - _when(chosen))
                sent = next((r for r in owner.records
                             if r.get("event") == "standby_snapshot_sent"), {})
            finally:
                standby.stop()
    finally:
        owner.stop()
    return {"blocks": blocks, "blocks_in_use": n * 256, "seconds_to_live": round(seconds, 3),
            "snapshot_bytes": sent.get("bytes"), "live_at_index": rec.get("index")}


def _when(record: dict) -> float:
    return datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).timestamp()


def main() -> int:
    """Runs the chosen parts, prints the table and writes the JSON results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200, help="latency: Steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=65536, help="catchup: pool size")
    parser.add_argument("--parts", default="latency,failover,catchup")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if etcd_binary() is None:
        print("bench_replication: no etcd binary (apt-get install etcd-server)")
        return 1
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        etcd = EtcdServer(Path(tmp) / "etcd")
        etcd.start()
        try:
            if "latency" in parts:
                results["latency"] = bench_latency(etcd, Path(tmp), args.steps, args.rounds)
            if "failover" in parts:
                results["failover"] = bench_failover(etcd, Path(tmp), args.kills)
            if "catchup" in parts:
                results["catchup"] = bench_catchup(etcd, Path(tmp), args.blocks)
        finally:
            etcd.stop()
    rows: list[list] = []
    if "latency" in results:
        lat = results["latency"]
        rows += [["Step p50, --replication none (us)", lat["none_p50_us"],
                  f"p99 {lat['none_p99_us']} us"],
                 ["Step p50, --replication async (us)", lat["async_p50_us"],
                  f"{lat['async_p50_us'] / lat['none_p50_us']:.2f}x none"],
                 ["Step p50, --replication sync (us)", lat["sync_p50_us"],
                  f"{lat['ratio_p50']:.2f}x none (goal <= 1.3x); p99 {lat['sync_p99_us']} us"]]
    if "failover" in results:
        fo = results["failover"]
        rows.append(["failover p50 after SIGKILL (s)", fo["p50_s"],
                     f"p99 {fo['p99_s']} s over {fo['kills']} kills, lease TTL {TTL} s; "
                     f"registered again {fo['registered_again']} times (goal 0)"])
    if "catchup" in results:
        cu = results["catchup"]
        rows.append(["new standby live (s)", cu["seconds_to_live"],
                     f"{cu['blocks_in_use']} of {cu['blocks']} blocks in use; snapshot "
                     f"{cu['snapshot_bytes']} bytes"])
    print_table("Replication (sync standby)", ["measure", "value", "notes"], rows)
    path = write_results("replication", results)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
