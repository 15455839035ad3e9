"""docker-compose.yml, run for real with the compose CLI (Debian's docker-compose 1.29.2 here;
testcontainers' DockerCompose needs Compose v2) and the README's command as written, `up
--build`: compose builds the images through the docker CLI (so a build context the
.dockerignore gets wrong fails here), the whole stack comes up in dependency order on health
checks, the demo client exits 0 with its summary, and `down` leaves nothing of the project
behind. The session's images were built first by the documented `docker build` commands, so
compose's build is served from the layer cache."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from executor.client import ExecutorClient, generate_request

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.docker

PROJECT_LABEL = "com.docker.compose.project"
DEMO_REQUESTS, DEMO_MAX_TOKENS = 12, 8  # small: the tier has minutes on two cores


def demo_summary(logs: str) -> dict[str, float]:
    """The numeric rows of the demo's summary table (``requests``, ``prefix hit rate`` in %,
    ``output tokens``, ...), from its log whatever the table's border characters are."""
    rows = {}
    for line in logs.splitlines():
        match = re.search(r"\W(requests|prefix hit rate|output tokens)\W+([0-9.]+)", line)
        if match:
            rows[match.group(1)] = float(match.group(2))
    assert set(rows) == {"requests", "prefix hit rate", "output tokens"}, logs[-3000:]
    return rows


def compose_command() -> list[str]:
    """`docker-compose` (v1) when installed, else the `docker compose` plugin."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
    if probe.returncode == 0:
        return ["docker", "compose"]
    pytest.skip("docker tier: neither docker-compose nor the compose plugin is installed")


class Project:
    """One compose project with a unique name, the test images, and ephemeral host ports."""

    def __init__(self, base_image: str, executor_image: str) -> None:
        self.name = f"kvctest{uuid.uuid4().hex[:8]}"
        self.env = {
            **os.environ,
            # the images keep compose's default tags (kvcache/<target>:latest), as for a user
            "KVCACHE_BASE_IMAGE": base_image,
            "KVCACHE_EXECUTOR_GPU_IMAGE": executor_image,  # only created, never run, here
            "KVCACHE_HEALTH_INTERVAL": "1s",
            "KVCACHE_DEMO_REQUESTS": str(DEMO_REQUESTS),
            "KVCACHE_DEMO_MAX_TOKENS": str(DEMO_MAX_TOKENS),
            # Empty = an ephemeral host port: never collides with servers on this host.
            "KVCACHE_PUBLISH_PORT": "", "KVCACHE_PUBLISH_METRICS_PORT": "",
            "KVCACHE_EXECUTOR_PUBLISH_PORT": "", "KVCACHE_EXECUTOR_PUBLISH_METRICS_PORT": "",
            "KVCACHE_EXECUTOR_GPU_PUBLISH_PORT": "",
        }
        self.base = compose_command() + ["-p", self.name, "-f", str(REPO / "docker-compose.yml")]

    def run(self, *args: str, timeout: float = 300, check: bool = True
            ) -> subprocess.CompletedProcess:
        result = subprocess.run(self.base + list(args), env=self.env, cwd=REPO, text=True,
                                capture_output=True, timeout=timeout)
        if check and result.returncode != 0:
            pytest.fail(f"{' '.join(args)} -> rc {result.returncode}\n{result.stdout[-3000:]}"
                        f"\n{result.stderr[-3000:]}")
        return result

    def containers(self, docker_client, service: str) -> list:
        return docker_client.containers.list(all=True, filters={"label": [
            f"{PROJECT_LABEL}={self.name}", f"com.docker.compose.service={service}"]})

    def started_at(self, docker_client, service: str) -> datetime:
        (container,) = self.containers(docker_client, service)
        # The engine reports nanoseconds; fromisoformat takes at most microseconds.
        stamp = container.attrs["State"]["StartedAt"]
        head, _, frac = stamp.rstrip("Z").partition(".")
        return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}")

    def leftovers(self, docker_client) -> list[str]:
        """Names of this project's containers and networks that still exist."""
        label = {"label": f"{PROJECT_LABEL}={self.name}"}
        return ([c.name for c in docker_client.containers.list(all=True, filters=label)]
                + [n.name for n in docker_client.networks.list(filters=label)])


@pytest.fixture
def project(base_image, cache_service_image, executor_image, docker_client) -> Iterator[Project]:
    proj = Project(base_image, executor_image)
    yield proj
    proj.run("--profile", "gpu", "down", "--volumes", "--remove-orphans", "--timeout", "20",
             check=False)


def test_stack_runs_the_demo_and_comes_down_clean(project, docker_client):
    # The README's `up --build`; --exit-code-from: returns the demo's exit code and stops the
    # stack when it exits.
    up = project.run("up", "--build", "--exit-code-from", "demo", timeout=900, check=False)
    demo_logs = project.run("logs", "--no-color", "demo").stdout
    assert up.returncode == 0, f"demo exit {up.returncode}\n{up.stdout[-4000:]}{up.stderr[-2000:]}"
    summary = demo_summary(demo_logs)
    assert summary["requests"] == DEMO_REQUESTS, demo_logs[-3000:]
    assert summary["output tokens"] == DEMO_REQUESTS * DEMO_MAX_TOKENS  # no stop tokens
    # The workload shares prefixes: the executor's pool in the cache-service container hits.
    assert summary["prefix hit rate"] > 0, demo_logs[-3000:]

    # depends_on/service_healthy held: each service started only after the one it depends on
    # passed a health probe, and the first probe runs one interval (1 s) after start.
    cache, executor, demo = (project.started_at(docker_client, s)
                             for s in ("cache-service", "executor", "demo"))
    assert (executor - cache).total_seconds() >= 0.9
    assert (demo - executor).total_seconds() >= 0.9
    assert project.containers(docker_client, "executor-gpu") == []  # gpu profile not active
    # When the demo exited, compose stopped the servers with SIGTERM: both drained, exit 0.
    for service in ("cache-service", "executor"):
        (container,) = project.containers(docker_client, service)
        state = container.attrs["State"]
        assert (state["Status"], state["ExitCode"]) == ("exited", 0), (service, state)

    project.run("down", "--volumes", "--remove-orphans", "--timeout", "20")
    assert project.leftovers(docker_client) == []


def _wait_healthy(project: Project, docker_client, service: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while True:
        (container,) = project.containers(docker_client, service)
        container.reload()
        if container.attrs["State"].get("Health", {}).get("Status") == "healthy":
            return
        assert time.monotonic() < deadline, f"{service} not healthy: {container.attrs['State']}"
        time.sleep(0.5)  # polling the engine's health status, bounded by the deadline


def test_restarting_the_cache_service_loses_no_request(project, docker_client):
    """`docker compose restart cache-service` mid-generation: the service drains, writes a
    snapshot to its data-dir volume and comes back with every pool, request and session;
    the executor resends its in-flight Step and its output equals an uninterrupted run."""
    project.run("up", "--no-build", "-d", "executor")  # and cache-service, healthy first
    _wait_healthy(project, docker_client, "executor")
    host_port = project.run("port", "executor", "50061").stdout.strip()
    prompt = [(7 * i) % 50 + 1 for i in range(40)]
    with ExecutorClient(host_port) as ex:
        # Long enough (milliseconds per token) to still run when the SIGTERM arrives.
        reference = ex.generate(prompt, 1500, timeout=300).token_ids
        stream = ex.stub.Generate(generate_request(prompt, 1500), timeout=300)
        first = next(stream)  # in flight
        project.run("restart", "cache-service", timeout=120)
        rest = list(stream)
    assert list(first.token_ids) + [t for m in rest for t in m.token_ids] == reference
    assert rest[-1].stats.num_preemptions == 0  # nothing recomputed
    _wait_healthy(project, docker_client, "cache-service")
    cache_logs = project.run("logs", "--no-color", "cache-service").stdout
    recovered = [line for line in cache_logs.splitlines() if '"event": "recovered"' in line]
    assert len(recovered) == 2 and '"pools": 1' in recovered[1], cache_logs[-3000:]
    executor_logs = project.run("logs", "--no-color", "executor").stdout
    assert "pool_lost" not in executor_logs, executor_logs[-3000:]
    # The restart hit the generation: the executor resent a Step whose outcome was in doubt.
    assert "cache_step_in_doubt" in executor_logs or "step_stream_retry" in executor_logs, \
        executor_logs[-3000:]


def test_gpu_profile_reserves_one_nvidia_gpu(project, docker_client):
    # No GPU here: create the containers without starting them and read the device request
    # the engine accepted (compose 1.29 must send a well-formed one).
    project.run("--profile", "gpu", "up", "--no-build", "--no-start", "executor-gpu")
    (created,) = project.containers(docker_client, "executor-gpu")
    requests = created.attrs["HostConfig"]["DeviceRequests"]
    assert [(r["Driver"], r["Count"], r["Capabilities"]) for r in requests] == \
        [("nvidia", 1, [["gpu"]])]


ETCD_IMAGE = os.environ.get("KVCACHE_ETCD_IMAGE", "quay.io/coreos/etcd:v3.5.17")
REPLICAS = ("cache-0", "cache-1", "cache-2")


@pytest.fixture
def etcd_image(docker_client) -> str:
    """The compose profile's etcd image, pulled if absent; the test skips (one line) on a
    machine that has neither the image nor a registry."""
    import docker.errors

    try:
        docker_client.images.get(ETCD_IMAGE)
    except docker.errors.ImageNotFound:
        try:
            docker_client.images.pull(ETCD_IMAGE)
        except docker.errors.APIError as exc:
            pytest.skip(f"docker tier: the etcd image {ETCD_IMAGE} is not here and cannot be "
                        f"pulled ({type(exc).__name__}); set KVCACHE_ETCD_IMAGE")
    return ETCD_IMAGE


def test_cluster_profile_runs_the_demo_over_three_replicas(project, docker_client, etcd_image):
    """The documented `--profile cluster up demo-cluster`: etcd, three replicas that join
    it, two executors whose pools are placed through it, and the demo against both."""
    project.env.update(KVCACHE_ETCD_IMAGE=etcd_image, KVCACHE_CLUSTER_PUBLISH_PORT="")
    try:
        up = project.run("--profile", "cluster", "up", "--no-build", "--exit-code-from",
                         "demo-cluster", "demo-cluster", timeout=900, check=False)
        demo_logs = project.run("logs", "--no-color", "demo-cluster").stdout
        assert up.returncode == 0, f"demo exit {up.returncode}\n{up.stdout[-4000:]}"
        summary = demo_summary(demo_logs)  # the second run's table (executor-b)
        assert summary["requests"] == DEMO_REQUESTS, demo_logs[-3000:]
        assert summary["output tokens"] == DEMO_REQUESTS * DEMO_MAX_TOKENS
        placed: dict[str, str] = {}
        for service in REPLICAS:
            logs = project.run("--profile", "cluster", "logs", "--no-color", service).stdout
            records = [json.loads(line[line.index("{"):]) for line in logs.splitlines()
                       if '"event"' in line]
            assert any(r["event"] == "member_joined" for r in records), (service, logs[-2000:])
            placed.update((r["pool_id"], r["owner"]) for r in records
                          if r["event"] == "pool_placed")
        # Each executor's pool was placed once, on a replica of the cluster.
        assert {"executor-a", "executor-b"} <= set(placed), placed
        assert set(placed.values()) <= set(REPLICAS), placed
    finally:
        project.run("--profile", "cluster", "down", "--volumes", "--remove-orphans",
                    "--timeout", "20", check=False)
    assert project.leftovers(docker_client) == []
