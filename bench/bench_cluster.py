#!/usr/bin/env python3
"""Cluster-mode benchmark: failover time, cluster overhead per Step, Steps/s of 1-3 replicas.

Starts its own etcd (the ``etcd`` binary) and cache-service replicas as processes
(``--etcd-lease-ttl 2``, the shortest etcd grants):

* ``failover``: 3 replicas; one client steps a pool in a loop (add + free of a request per
  Step); the pool's owner is SIGKILLed; the time from the kill to the first successful Step
  sent after the owner's process was gone (the client follows redirects and, as replicas share no storage,
  registers the pool again on NOT_FOUND) is one sample. A fresh replica replaces the dead
  one before the next kill. p50 / p99 / max over ``--kills`` (default 5; 20 give a
  p99 that is not just the maximum).
  Measured twice: without shared storage, and with ``--shared-data-root`` (the new owner
  restores the pool from the dead owner's log: no registration again; the number of times
  the client had to register again is reported, 0 expected).
* ``rolling``: 3 replicas on a shared data root, ``--pools`` pools stepped by 3 client
  threads; each replica in turn gets SIGTERM (it hands its pools over) and is started again
  on its port and member id. The longest time any pool went without an answered Step
  (goal <= 1 s) and the number of client errors (goal 0).
* ``overhead``: the same sequential Step (a decode op over 8 requests) against a standalone
  replica and against a one-member cluster replica that owns the pool (the fencing check on
  every call is the difference); mean round trip each, interleaved in rounds; ratio.
* ``scaling``: ``--clients`` client processes, one pool each, placed over 1, 2 and 3
  replicas; each steps for ``--seconds``; total Steps/s. On a 2-core machine the clients and
  all replicas share the cores: the shape matters, not the absolute.

    python3 bench/bench_cluster.py               # about a minute
    python3 bench/bench_cluster.py --kills 20    # a p99 over 20 failovers
    python3 bench/bench_cluster.py --parts failover,rolling --kills 3   # failover only

Prints a table and writes bench/results/cluster.json.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

from _common import Bars, Line, Panel, percentile, print_table, ratio, write_results
from cache_service.client import CacheClient, CacheError, layers, ops
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.api.kvcache.v1 import cache_service_pb2_grpc as pb_grpc
from kvcache_common.etcd_launch import EtcdServer, etcd_binary
from kvcache_common.launch import ServerProcess, start_cache_service

TTL = 2
LAYERS = [layers.full_attention(f"l{i}", block_size=16, num_kv_heads=2, head_size=8)
          for i in range(2)]


def replica(etcd: EtcdServer | None, cluster: str, shared: Path | None = None,
            member: str | None = None, port: int = 0) -> ServerProcess:
    """A replica; with ``shared``, on that shared data root (``member``, else a fresh
    member id), on ``port`` (0: any)."""
    flags = ["--drain-seconds", "1", "--port", str(port)]
    if etcd is not None:
        flags += ["--etcd-endpoints", etcd.endpoint, "--cluster-name", cluster,
                  "--etcd-lease-ttl", str(TTL)]
    if shared is not None:
        flags += ["--shared-data-root", str(shared), "--member-id",
                  member or uuid.uuid4().hex[:8]]
    return start_cache_service(*flags)


def register(client: CacheClient, pool_id: str) -> None:
    """A pool whose 8 decoding requests can each grow by ~4,000 tokens."""
    client.register_pool(pool_id, LAYERS, num_blocks=4096, max_model_len=8192)


def owner_target(replicas: list[ServerProcess], pool_id: str) -> str:
    """The replica that answers GetPool itself."""
    for r in replicas:
        if r.returncode is None:
            # A raw stub: asks this replica only (a client would follow the redirect).
            with grpc.insecure_channel(r.target) as channel:
                try:
                    pb_grpc.CacheServiceStub(channel).GetPool(
                        pb.GetPoolRequest(pool_id=pool_id), timeout=10)
                    return r.target
                except grpc.RpcError:
                    continue
    raise RuntimeError(f"no replica serves {pool_id}")


def one_kill(client: CacheClient, pool: str, victim: ServerProcess
              ) -> tuple[float | None, int]:
    """Steps ``pool`` in a thread, SIGKILLs its owner, answers the seconds from the kill to
    the first successful Step sent after the owner's process was gone (None: none in 30 s)
    and how many times the pool had to be registered again."""
    state = {"killed": 0.0, "dead": 0.0, "back": 0.0, "stop": False, "lost": 0}

    def load() -> None:
        i = 0
        while not state["stop"]:
            started = time.monotonic()
            try:
                client.step(pool, [ops.add(f"r{i}", [1, 2, 3]), ops.free(f"r{i}")])
                # Only a Step sent after the victim was gone counts.
                if state["dead"] and started > state["dead"] and not state["back"]:
                    state["back"] = time.monotonic()
            except CacheError:
                state["lost"] += 1
                register(client, pool)  # NOT_FOUND: no shared state; register again
            i += 1

    worker = threading.Thread(target=load)
    worker.start()
    time.sleep(0.3)  # a steady stream of steps before the kill
    state["killed"] = time.monotonic()
    victim.signal(signal.SIGKILL)
    victim.proc.wait(10)
    state["dead"] = time.monotonic()
    while not state["back"] and time.monotonic() - state["killed"] < 30:
        time.sleep(0.01)
    state["stop"] = True
    worker.join(30)
    return (state["back"] - state["killed"] if state["back"] else None), int(state["lost"])


def kill_owners(start_replica: Callable[[], ServerProcess], kills: int,
                ready: Callable[[ServerProcess], None] = lambda victim: None
                ) -> tuple[list[float], int]:
    """SIGKILLs the owner of a fresh pool ``kills`` times among 3 replicas made by
    ``start_replica`` (a new one replaces each victim; ``ready(victim)`` runs before each
    kill): the failover samples (seconds; a kill with no Step back in 30 s gives none) and
    how many times a pool had to be registered again."""
    replicas = [start_replica() for _ in range(3)]
    samples: list[float] = []
    registered_again = 0
    try:
        for k in range(kills):
            live = [r for r in replicas if r.returncode is None]
            with CacheClient(",".join(r.target for r in live), default_timeout=30,
                             backoff_base=0.02, backoff_max=0.1) as client:
                pool = f"f{k}"
                register(client, pool)
                victim = next(r for r in live if r.target == owner_target(live, pool))
                ready(victim)
                sample, lost = one_kill(client, pool, victim)
            registered_again += lost
            if sample is not None:
                samples.append(sample)
            victim.stop()
            replicas.append(start_replica())
    finally:
        for r in replicas:
            r.stop()
    return samples, registered_again


def bench_failover(etcd: EtcdServer, kills: int, shared: Path | None = None) -> dict:
    """Failover times over ``kills`` SIGKILLs of a pool's owner among 3 replicas (``shared``:
    on a shared data root) (see the module docstring)."""
    cluster = f"bench-{uuid.uuid4().hex[:6]}"
    samples, registered_again = kill_owners(lambda: replica(etcd, cluster, shared), kills)
    xs = sorted(samples)
    return {"kills": kills, "samples_s": [round(x, 3) for x in samples],
            "p50_s": round(percentile(xs, 50), 3), "p99_s": round(percentile(xs, 99), 3),
            "max_s": round(xs[-1], 3) if xs else None, "lease_ttl_s": TTL,
            "shared_data_root": shared is not None, "registered_again": registered_again}


def bench_rolling(etcd: EtcdServer, shared: Path, pools: int) -> dict:
    """A rolling restart of 3 replicas under load (see the module docstring)."""
    cluster = f"bench-{uuid.uuid4().hex[:6]}"
    members = [replica(etcd, cluster, shared, f"m{i}") for i in range(3)]
    targets = ",".join(r.target for r in members)
    names = [f"roll{i}" for i in range(pools)]
    last: dict[str, float] = {}
    stall: dict[str, float] = dict.fromkeys(names, 0.0)
    errors: list[str] = []
    stop = threading.Event()

    def load(mine: list[str]) -> None:
        with CacheClient(targets, default_timeout=30, backoff_base=0.02,
                         backoff_max=0.1) as client:
            i = 0
            while not stop.is_set():
                pool = mine[i % len(mine)]
                try:
                    client.step(pool, [ops.add(f"r{i}", [1, 2, 3]), ops.allocate(f"r{i}", 3),
                                       ops.free(f"r{i}")])
                except CacheError as exc:
                    errors.append(str(exc))
                now = time.monotonic()
                if pool in last:
                    stall[pool] = max(stall[pool], now - last[pool])
                last[pool] = now
                i += 1

    try:
        with CacheClient(targets, default_timeout=30) as client:
            for pool in names:
                register(client, pool)
        threads = [threading.Thread(target=load, args=(names[t::3],)) for t in range(3)]
        for t in threads:
            t.start()
        for i, old in enumerate(list(members)):
            time.sleep(1.0)  # steady load between restarts (a pace, not a sync)
            port = old.port
            old.stop()  # SIGTERM: the pools are handed over
            members[i] = replica(etcd, cluster, shared, f"m{i}", port)
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(60)
    finally:
        for r in members:
            r.stop()
    return {"pools": pools, "longest_stall_s": round(max(stall.values()), 3),
            "stall_s": {p: round(v, 3) for p, v in stall.items()},
            "client_errors": len(errors), "errors": errors[:5]}


def _step_loop(client: CacheClient, pool: str, n: int) -> float:
    rids = [f"d{i}" for i in range(8)]
    start = time.perf_counter()
    for _ in range(n):
        client.decode(pool, rids, [7] * 8)
    return (time.perf_counter() - start) / n


def bench_overhead(etcd: EtcdServer, steps: int, rounds: int) -> dict:
    """The mean Step round trip against a standalone replica and a one-member cluster replica,
    interleaved in rounds; answers both and their ratio."""
    standalone = replica(None, "")
    member = replica(etcd, f"bench-{uuid.uuid4().hex[:6]}")
    means: dict[str, list[float]] = {"standalone": [], "cluster": []}
    try:
        clients = {"standalone": CacheClient(standalone.target),
                   "cluster": CacheClient(member.target)}
        for c in clients.values():
            register(c, "o")
            c.step("o", [op for i in range(8) for op in (
                ops.add(f"d{i}", [1] * 20), ops.allocate(f"d{i}", 20))])
            _step_loop(c, "o", 50)  # warm-up
        for _ in range(rounds):
            for name, c in clients.items():
                means[name].append(_step_loop(c, "o", steps))
        for c in clients.values():
            c.close()
    finally:
        standalone.stop()
        member.stop()
    alone = sorted(means["standalone"])[len(means["standalone"]) // 2]
    member_s = sorted(means["cluster"])[len(means["cluster"]) // 2]
    return {"steps_per_round": steps, "rounds": rounds, "standalone_us": round(alone * 1e6, 1),
            "cluster_us": round(member_s * 1e6, 1), "ratio": round(member_s / alone, 3)}


def _client_proc(targets: str, pool: str, seconds: float, out: mp.Queue) -> None:
    with CacheClient(targets, default_timeout=30) as client:
        register(client, pool)
        rids = [f"d{i}" for i in range(8)]
        client.step(pool, [op for i in range(8) for op in (
            ops.add(f"d{i}", [1] * 20), ops.allocate(f"d{i}", 20))])
        n = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            client.decode(pool, rids, [7] * 8)
            n += 1
    out.put(n)


def bench_scaling(etcd: EtcdServer, clients: int, seconds: float) -> list[dict]:
    """Steps/s of ``clients`` client processes over 1, 2 and 3 replicas, one row each."""
    rows = []
    ctx = mp.get_context("spawn")
    for size in (1, 2, 3):
        cluster = f"bench-{uuid.uuid4().hex[:6]}"
        replicas = [replica(etcd, cluster) for _ in range(size)]
        try:
            targets = ",".join(r.target for r in replicas)
            out: mp.Queue = ctx.Queue()
            procs = [ctx.Process(target=_client_proc, args=(targets, f"s{i}", seconds, out))
                     for i in range(clients)]
            for p in procs:
                p.start()
            counts = [out.get(timeout=seconds + 120) for _ in procs]
            for p in procs:
                p.join(30)
            placement = Counter(owner_target(replicas, f"s{i}") for i in range(clients))
            rows.append({"replicas": size, "clients": clients,
                         "steps_per_s": round(sum(counts) / seconds, 1),
                         "pools_per_replica": sorted(placement.values(), reverse=True)})
        finally:
            for r in replicas:
                r.stop()
    return rows


def plot(results: dict[str, Any]) -> list[Panel]:
    """Steps/s against the number of replicas, and the failover times (kill to the pool
    answering again) without and with a shared data root; the parts this run measured."""
    panels: list[Panel] = []
    if "scaling" in results:
        scaling = results["scaling"]
        panels.append(Line("Steps/s vs replicas", [r["replicas"] for r in scaling],
                           {"Steps/s, all clients": [r["steps_per_s"] for r in scaling]},
                           "replicas", "Steps/s"))
    if "failover" in results:
        runs = {"no shared storage": results["failover"],
                "shared data root": results["failover_shared"]}
        panels.append(Bars(f"failover, kill to answering (lease TTL {TTL} s)",
                           ["p50", "p99", "max"],
                           {name: [r[q] if r[q] is not None else float("nan")
                                   for q in ("p50_s", "p99_s", "max_s")]
                            for name, r in runs.items()}, "seconds"))
    return panels


def main() -> int:
    """Runs the chosen parts, prints the table and writes bench/results/cluster.json."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300, help="overhead: steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--pools", type=int, default=6, help="rolling: pools under load")
    parser.add_argument("--parts", default="overhead,scaling,failover,rolling",
                        help="comma-separated parts to run")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if etcd_binary() is None:
        print("bench_cluster: no etcd binary (apt-get install etcd-server)")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        etcd = EtcdServer(Path(tmp) / "etcd")
        etcd.start()
        try:
            results: dict = {}
            if "overhead" in parts:
                results["overhead"] = bench_overhead(etcd, args.steps, args.rounds)
            if "scaling" in parts:
                results["scaling"] = bench_scaling(etcd, args.clients, args.seconds)
            if "failover" in parts:
                results["failover"] = bench_failover(etcd, args.kills)
                results["failover_shared"] = bench_failover(etcd, args.kills,
                                                            Path(tmp) / "shared")
            if "rolling" in parts:
                results["rolling"] = bench_rolling(etcd, Path(tmp) / "rolling", args.pools)
        finally:
            etcd.stop()
    rows: list[list] = []
    if "failover" in results:
        failover, shared = results["failover"], results["failover_shared"]
        rows += [
            ["failover p50 (s)", failover["p50_s"], (
                f"p99 {failover['p99_s']} s, max {failover['max_s']} s over {args.kills} "
                f"kills, lease TTL {TTL} s; no shared storage")],
            ["failover p50, shared data root (s)", shared["p50_s"], (
                f"p99 {shared['p99_s']} s (goal <= 3 s), max {shared['max_s']} s; pool "
                f"restored, registered again {shared['registered_again']} times (no "
                f"shared storage: {failover['registered_again']})")]]
    if "rolling" in results:
        rolling = results["rolling"]
        rows.append(["rolling restart, longest pool stall (s)", rolling["longest_stall_s"],
                     (f"goal <= 1 s; {rolling['pools']} pools, 3 replicas, "
                      f"{rolling['client_errors']} client errors (goal 0)")])
    if "overhead" in results:
        overhead = results["overhead"]
        rows += [["Step, standalone (us)", overhead["standalone_us"], ""],
                 ["Step, cluster member (us)", overhead["cluster_us"],
                  f"{overhead['ratio']:.3f}x standalone (goal <= 1.05x)"]]
    if "scaling" in results:
        one = results["scaling"][0]["steps_per_s"]
        rows += [[f"Steps/s, {r['replicas']} replica(s)", r["steps_per_s"],
                  (f"{ratio(r['steps_per_s'], one)} of 1 replica; pools per replica "
                   f"{r['pools_per_replica']}")] for r in results["scaling"]]
    print_table("Cluster mode (etcd)", ["measure", "value", "notes"], rows)
    path = write_results("cluster", results, plot=plot(results))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
