"""``kvcache-ctl cluster`` against real replicas on a real etcd: members, each pool's owner
and fencing token as etcd holds them; an unreachable etcd is one line, exit 3."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from cache_service.client import CacheClient
from tests.cluster.conftest import Cluster, owner_of, small_layers, wait_until

DOC_CLUSTER = "kvcache-ctl cluster --etcd-endpoints 127.0.0.1:2379"


def ctl_cluster(endpoint: str, name: str, *extra: str) -> subprocess.CompletedProcess[str]:
    words = DOC_CLUSTER.split()[1:]
    words[words.index("127.0.0.1:2379")] = endpoint
    return subprocess.run([sys.executable, "-m", "cache_service.ctl", *words,
                           "--cluster-name", name, *extra],
                          capture_output=True, text=True, timeout=60)


def test_cluster_view_names_owners_and_fencing_tokens(three: Cluster) -> None:
    targets = ",".join(r.target for r in three.replicas)
    with CacheClient(targets, session=False) as client:
        for pool in ("p0", "p1", "p2"):
            client.register_pool(pool, small_layers(), num_blocks=64, max_model_len=256)
    owners = {pool: owner_of(three, pool) for pool in ("p0", "p1", "p2")}

    def settled() -> dict | None:
        done = ctl_cluster(three.etcd.endpoint, three.name, "--json")
        assert done.returncode == 0, done.stderr
        data = json.loads(done.stdout)
        return data if len(data["members"]) == 3 and all(
            p["owner"] for p in data["pools"]) and len(data["pools"]) == 3 else None

    data = wait_until(settled, 20, "three members owning three pools")
    assert {m["address"] for m in data["members"]} == {r.target for r in three.replicas}
    for row in data["pools"]:
        assert row["address"] == owners[row["pool"]]
        assert row["fencing_token"] > 0 and row["registered"]
        assert row["placement"] == row["owner"]  # nobody left: placement is the owner
    table = ctl_cluster(three.etcd.endpoint, three.name).stdout
    assert "fencing token" in table and "p1" in table


def test_cluster_view_etcd_unreachable_is_one_line() -> None:
    done = ctl_cluster("127.0.0.1:1", "x", "--timeout", "1")
    assert done.returncode == 3 and done.stderr.count("\n") == 1, done.stderr
    assert "no etcd endpoint answered" in done.stderr
    env = {k: v for k, v in os.environ.items() if k != "KVCACHE_ETCD_ENDPOINTS"}
    done = subprocess.run([sys.executable, "-m", "cache_service.ctl", "cluster"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2 and "--etcd-endpoints" in done.stderr
