"""deploy/grafana/kvcache.json and deploy/prometheus/alerts.yml name only metrics the servers
export: a cache-service replica in cluster mode (with --data-dir) and an executor over it are
scraped after real traffic, parsed with prometheus_client's parser, and every metric the
dashboard's queries and the alert expressions name must be among them."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from cache_service.client import CacheClient
from executor.client import ExecutorClient
from executor.launch import start_executor
from tests.cluster.conftest import Cluster

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/kvcache.json"
ALERTS = ROOT / "deploy/prometheus/alerts.yml"
_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum"),
             "summary": ("_count", "_sum")}


def exported(url: str) -> set[str]:
    """Every series name a /metrics page declares (families declared with no sample yet
    count with the names their type gives them)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(family.name + s for s in _SUFFIXES.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names


def named_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression uses (label matchers and by/without lists,
    whose label names look alike, removed first)."""
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\b(?:by|without)\s*\([^)]*\)", "", expr)
    return set(re.findall(r"\b((?:kvcache|grpc|process)_[a-z0-9_]+)\b", expr))


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"].removeprefix("label_values(").split(",")[0]
              for v in dash["templating"]["list"]]
    return exprs


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"]
            for rule in group["rules"]]


def test_files_are_well_formed() -> None:
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] and dash["__inputs"]
    for panel in dash["panels"]:
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}"
    rules = alert_rules()
    names = {r["alert"] for r in rules}
    assert {"KVCachePoolNearFull", "KVCacheHitRateCollapse", "KVCacheWALErrors",
            "KVCacheSnapshotFailures", "KVCacheLeaseExpiriesSpiking",
            "KVCacheReplicaCannotReachEtcd"} <= names
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["expr"]


def test_every_metric_they_name_is_exported(cluster: Cluster, tmp_path: Path) -> None:
    replica = cluster.start_replica("--metrics-port", "0", "--data-dir", str(tmp_path / "d"))
    with start_executor(replica.target, "--metrics-port", "0") as executor:
        with ExecutorClient(executor.target) as ex:
            ex.generate([1, 2, 3, 4, 5, 6, 7, 8], 4)
        with CacheClient(replica.target) as client:  # an explained lookup: miss counters
            (pool,) = client.list_pools()
            client.routing_view([pool.pool_id], [1, 2, 3], explain=True)
        names = exported(f"http://127.0.0.1:{replica.metrics_port}/metrics")
        names |= exported(f"http://127.0.0.1:{executor.metrics_port}/metrics")
    wanted: dict[str, set[str]] = {}
    for expr in dashboard_exprs():
        for name in named_metrics(expr):
            wanted.setdefault(name, set()).add("deploy/grafana/kvcache.json")
    for rule in alert_rules():
        for name in named_metrics(rule["expr"]):
            wanted.setdefault(name, set()).add(f"alerts.yml {rule['alert']}")
    assert len(wanted) > 30  # the parser found the queries
    missing = {name: sorted(where) for name, where in wanted.items() if name not in names}
    assert not missing, f"named but not exported: {missing}"
    # the series the alerts added to the server answer sensibly
    assert "kvcache_cluster_etcd_lease_valid" in names and "kvcache_wal_errors_total" in names
