"""Offline checks of the cluster deployments (no engine, no etcd): the compose `cluster`
profile and the Kubernetes manifests name real settings, wire replicas, executors and etcd
together consistently, and probe health the way the programs report it."""

from __future__ import annotations

from pathlib import Path

import yaml

from cache_service.settings import Settings
from executor.settings import ExecutorSettings

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
K8S = list(yaml.safe_load_all((REPO / "deploy/kubernetes/cache-service.yaml").read_text()))
CACHE_VARS = {"KVCACHE_" + name.upper() for name in Settings.model_fields}
EXECUTOR_VARS = {"KVCACHE_EXECUTOR_" + name.upper() for name in ExecutorSettings.model_fields}
REPLICAS = ["cache-0", "cache-1", "cache-2"]


def by_kind(kind: str) -> list[dict]:
    return [doc for doc in K8S if doc and doc["kind"] == kind]


def test_compose_cluster_profile_has_etcd_three_replicas_two_executors_and_a_demo():
    profile = {name for name, svc in COMPOSE.items() if "cluster" in svc.get("profiles", [])}
    assert profile == {"etcd", *REPLICAS, "executor-a", "executor-b", "demo-cluster"}


def test_compose_replicas_are_distinct_members_of_one_cluster():
    envs = [COMPOSE[name]["environment"] for name in REPLICAS]
    for name, env in zip(REPLICAS, envs):
        assert set(env) <= CACHE_VARS
        assert env["KVCACHE_ETCD_ENDPOINTS"] == "etcd:2379"
        assert env["KVCACHE_MEMBER_ID"] == name
        assert env["KVCACHE_ADVERTISE_ADDRESS"] == f"{name}:{env['KVCACHE_PORT']}"
        assert COMPOSE[name]["depends_on"] == {"etcd": {"condition": "service_healthy"}}
    assert len({env["KVCACHE_CLUSTER_NAME"] for env in envs}) == 1
    # One shared volume, each replica logging under <root>/<member-id> (a restarted member
    # recovers its own pools; a dead member's pools are restored from its log).
    for name, env in zip(REPLICAS, envs):
        root = env["KVCACHE_SHARED_DATA_ROOT"]
        assert COMPOSE[name]["volumes"] == [f"cluster-data:{root}"]
        settings = Settings(**{key[len("KVCACHE_"):].lower(): value
                               for key, value in env.items() if "${" not in str(value)})
        assert settings.state_dir == Path(root) / name


def test_compose_executors_know_every_replica_and_own_distinct_pools():
    seeds = ",".join(f"{name}:50051" for name in REPLICAS)
    pools = set()
    for name in ("executor-a", "executor-b"):
        env = COMPOSE[name]["environment"]
        assert set(env) <= EXECUTOR_VARS | {"OMP_NUM_THREADS"}
        assert env["KVCACHE_EXECUTOR_CACHE_SERVICE"] == seeds
        pools.add(env["KVCACHE_EXECUTOR_POOL_ID"])
        assert set(COMPOSE[name]["depends_on"]) == set(REPLICAS)
    assert len(pools) == 2
    command = " ".join(COMPOSE["demo-cluster"]["command"])
    assert "executor-a:50061" in command and "executor-b:50061" in command


def test_k8s_statefulset_behind_a_headless_service():
    (sts,) = by_kind("StatefulSet")
    services = {s["metadata"]["name"]: s for s in by_kind("Service")}
    headless = services[sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for svc in services.values():
        assert svc["spec"]["selector"].items() <= labels.items()
    assert sts["spec"]["replicas"] >= 3


def test_k8s_replicas_are_named_by_pod_and_probed_on_grpc_health():
    (sts,) = by_kind("StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert set(env) - {"POD_NAME", "POD_NAMESPACE"} <= CACHE_VARS
    assert env["KVCACHE_ETCD_ENDPOINTS"]  # etcd comes from a chart/operator, not from here
    assert env["KVCACHE_MEMBER_ID"] == "$(POD_NAME)"
    assert env["KVCACHE_ADVERTISE_ADDRESS"].startswith(
        f"$(POD_NAME).{sts['spec']['serviceName']}.")
    assert env["KVCACHE_ADVERTISE_ADDRESS"].endswith(f":{env['KVCACHE_PORT']}")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == int(env["KVCACHE_PORT"])
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == ports["grpc"]
    assert pod["terminationGracePeriodSeconds"] > float(env["KVCACHE_DRAIN_SECONDS"]) + 1
    assert not any(doc["kind"].lower().startswith("etcd") for doc in K8S)


def test_k8s_replicas_replicate_to_a_standby_each_on_its_own_volume():
    (sts,) = by_kind("StatefulSet")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KVCACHE_REPLICATION"] == "sync"
    assert "KVCACHE_SHARED_DATA_ROOT" not in env
    (template,) = sts["spec"]["volumeClaimTemplates"]
    assert template["spec"]["accessModes"] == ["ReadWriteOnce"]  # no shared volume
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts[template["metadata"]["name"]] == env["KVCACHE_DATA_DIR"]
    assert not any("persistentVolumeClaim" in v
                   for v in sts["spec"]["template"]["spec"].get("volumes", []))
    settings = Settings(**{key[len("KVCACHE_"):].lower(): value for key, value in env.items()
                           if key.startswith("KVCACHE_") and "$(" not in str(value)})
    assert settings.replication == "sync" and settings.state_dir == Path("/data")
