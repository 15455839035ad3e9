"""Fixtures of the docker tier: an engine, the two images (built once, tagged by content) and
a private network.

- No engine answering (DOCKER_HOST or the default socket) -> every test that needs one skips
  with ONE reason line; ``source scripts/docker_env.sh`` starts an engine on this machine.
- Images are built by the command docs/deployment.md shows, run as written with the docker CLI
  (``docker build --target <target> -t kvcache/<target> . --build-arg BASE_IMAGE=<base>``),
  then tagged ``kvcache-test/<target>:<hash>`` where the hash covers exactly the build context
  the .dockerignore admits (Dockerfile, wheelhouse, sources), the base image id and the target:
  an unchanged checkout reuses the image without calling ``docker build`` at all.
- One checkout's docker tier at a time per engine (an exclusive lock file next to the engine's
  socket): two checkouts testing at once would retag and remove each other's images.
- Containers join one session network so the executor reaches the cache service by alias.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from tests.tier_skip import fold_skips_at, skip_tier

REPO = Path(__file__).resolve().parents[2]
LOCAL_BASE_IMAGE = "kvcache-local/base:bookworm-py311"  # scripts/docker/base_image.sh
REGISTRY_BASE_IMAGE = "python:3.11-slim"
IMAGE_REPO = "kvcache-test"
# Test containers probe health every second (the image's own interval is for production);
# an empty "test" keeps the image's HEALTHCHECK command (the engine merges the two).
FAST_HEALTHCHECK = {"test": [], "interval": 1_000_000_000, "timeout": 5_000_000_000,
                    "retries": 3, "start_period": 60_000_000_000}


def _no_engine_reason() -> str | None:
    """None when an engine answers, else the one-line reason the tier skips."""
    where = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        client = docker.from_env(timeout=10)
        client.ping()
        client.close()
        return None
    except Exception as exc:  # any failure to reach an engine means: no engine
        return (f"docker tier: no Docker engine answers at {where} ({type(exc).__name__}); "
                "`source scripts/docker_env.sh` starts one")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without an engine, mark every `docker` test skipped (checked once per session)."""
    skip_tier(config, items, "docker", _no_engine_reason)


# Report every no-engine skip at one location, so `-ra` folds them into ONE line.
pytest_runtest_makereport = fold_skips_at(__file__)


@pytest.fixture(scope="session")
def docker_client():
    """A docker-py client to the live engine (collection already skipped the tier if none),
    held under the engine's tier lock for the session."""
    lock_path = os.environ.get("KVC_DOCKER_TIER_LOCK", "/tmp/kvcache-docker-tier.lock")
    with open(lock_path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"\ndocker tier: another checkout holds {lock_path}; waiting", file=sys.stderr)
            fcntl.flock(lock, fcntl.LOCK_EX)
        client = docker.from_env(timeout=900)  # builds can be silent for minutes (torch)
        yield client
        client.close()


@pytest.fixture(scope="session")
def base_image(docker_client) -> str:
    """KVCACHE_BASE_IMAGE, else the local debootstrap image when present, else the registry's."""
    chosen = os.environ.get("KVCACHE_BASE_IMAGE")
    if chosen:
        return chosen
    return LOCAL_BASE_IMAGE if _image_exists(docker_client, LOCAL_BASE_IMAGE) \
        else REGISTRY_BASE_IMAGE


@pytest.fixture(scope="session")
def wheelhouse(docker_client) -> Path:
    """The wheelhouse the Dockerfile installs from (a no-op when its stamp is current)."""
    subprocess.run(["bash", str(REPO / "scripts/docker/wheelhouse.sh")], check=True,
                   stdout=subprocess.DEVNULL)
    return REPO / "wheelhouse"


def context_hash(base_image_id: str, target: str) -> str:
    """sha256 over every file of the build context (as .dockerignore admits it), the base
    image id and the target: equal hashes mean `docker build` would produce the same image."""
    from docker.utils.build import exclude_paths

    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    digest = hashlib.sha256(f"{base_image_id}\0{target}\0".encode())
    for rel in sorted(exclude_paths(str(REPO), patterns, dockerfile="Dockerfile")):
        path = REPO / rel
        if path.is_file():
            digest.update(rel.encode() + b"\0")
            with path.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
    return digest.hexdigest()[:16]


def build_image(client, base_image: str, target: str) -> str:
    """The tag of an image of ``target`` for the current checkout, building it if absent and
    removing this target's older test tags (their layers stay as build cache)."""
    base_id = client.images.get(base_image).id if _image_exists(client, base_image) else base_image
    tag = f"{IMAGE_REPO}/{target}:{context_hash(base_id, target)}"
    if not _image_exists(client, tag):
        started = time.monotonic()
        # docs/deployment.md, as written (its optional --build-arg filled in)
        command = ["docker", "build", "--target", target, "-t", f"kvcache/{target}", ".",
                   "--build-arg", f"BASE_IMAGE={base_image}"]
        built = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1800)
        if built.returncode != 0:
            pytest.fail(f"{' '.join(command)} failed (rc {built.returncode}):\n"
                        f"{(built.stdout + built.stderr)[-3000:]}")
        client.images.get(f"kvcache/{target}").tag(tag)
        print(f"\nbuilt {tag} in {time.monotonic() - started:.0f} s")
    for image in client.images.list(name=f"{IMAGE_REPO}/{target}"):
        for old in image.tags:
            if old != tag:
                client.images.remove(old)
    return tag


def _image_exists(client, ref: str) -> bool:
    try:
        client.images.get(ref)
        return True
    except docker.errors.ImageNotFound:
        return False


@pytest.fixture(scope="session")
def cache_service_image(docker_client, base_image, wheelhouse) -> str:
    """Tag of the cache-service image for this checkout."""
    return build_image(docker_client, base_image, "cache-service")


@pytest.fixture(scope="session")
def executor_image(docker_client, base_image, wheelhouse) -> str:
    """Tag of the executor image for this checkout."""
    return build_image(docker_client, base_image, "executor")


@pytest.fixture(scope="session")
def docker_network(docker_client):
    """A private bridge network (testcontainers ``Network``) for this session, removed at
    the end together with anything still attached to it."""
    from testcontainers.core.network import Network

    network = Network().create()
    yield network
    leftover = docker_client.networks.get(network.name)
    for container in leftover.containers:  # a failed test may leave one attached
        container.remove(force=True)
    network.remove()


def wait_healthy(container, timeout: float = 120.0) -> None:
    """Wait until the container's HEALTHCHECK reports healthy; fail with its logs as soon as
    it exits or turns unhealthy. (Not the port: a published port answers before the server
    listens. testcontainers' HealthcheckWaitStrategy would wait out its timeout on an exit.)"""
    deadline = time.monotonic() + timeout
    while True:
        container.reload()
        state = container.attrs["State"]
        health = state.get("Health", {}).get("Status")
        if health == "healthy":
            return
        if state["Status"] in ("exited", "dead") or health == "unhealthy" \
                or time.monotonic() > deadline:
            logs = container.logs().decode(errors="replace")[-3000:]
            pytest.fail(f"{container.name} not healthy (limit {timeout:.0f} s): "
                        f"status={state['Status']} health={health} "
                        f"exit={state.get('ExitCode')}; logs:\n{logs}")
        time.sleep(0.25)


class Containers:
    """Starts containers for the tests and removes, at session end, any a test left."""

    def __init__(self, network) -> None:
        self.network = network
        self._started: list = []

    def start(self, image: str, alias: str, *, env: dict[str, str] | None = None,
              publish: int | None = None):
        """A started testcontainers ``DockerContainer`` on the session network under
        ``alias``, its port ``publish`` bound to 127.0.0.1 only, probed by the image's own
        HEALTHCHECK command every second; returns once that reports healthy."""
        from testcontainers.core.container import DockerContainer

        container = (DockerContainer(image, env=env or {})
                     .with_network(self.network).with_network_aliases(alias)
                     .with_kwargs(healthcheck=FAST_HEALTHCHECK, hostname=alias))
        if publish is not None:
            # with_bind_ports() cannot name a host address; docker-py takes (address, port),
            # which testcontainers' annotation of the mapping does not list.
            ports: dict[str, Any] = container.ports
            ports[f"{publish}/tcp"] = ("127.0.0.1", None)
        container.start()
        self._started.append(container)
        wait_healthy(container.get_wrapped_container())
        return container

    @staticmethod
    def published_port(container, port: int) -> int:
        """The host port (on 127.0.0.1) the engine mapped to the container's ``port``."""
        return int(container.get_exposed_port(port))

    @staticmethod
    def wait_exit(container, timeout: float = 60.0) -> int:
        """The container's exit code once it has stopped, as the engine reports it."""
        return int(container.get_wrapped_container().wait(timeout=timeout)["StatusCode"])

    def remove_all(self) -> None:
        """Force-remove every container started here that a test has not removed itself."""
        for container in self._started:
            with contextlib.suppress(docker.errors.NotFound):
                container.get_wrapped_container().remove(force=True)
        self._started.clear()


@pytest.fixture(scope="session")
def containers(docker_network) -> Iterator[Containers]:
    """The session's container starter (everything it started is removed at the end)."""
    starter = Containers(docker_network)
    yield starter
    starter.remove_all()
