"""Static checks of docker-compose.yml and docs/deployment.md against the programs' settings
models (no engine needed): a misspelt variable would be silently ignored by pydantic-settings,
so every variable compose passes must be a real setting, and every setting must be documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from cache_service.settings import Settings
from executor.settings import ExecutorSettings

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
# Without comment lines: those may show `${VAR:-default}` as an example.
COMPOSE_TEXT = "\n".join(line for line in (REPO / "docker-compose.yml").read_text().splitlines()
                         if not line.lstrip().startswith("#"))
DOCS = (REPO / "docs/deployment.md").read_text()

CACHE_VARS = {"KVCACHE_" + name.upper() for name in Settings.model_fields}
EXECUTOR_VARS = {"KVCACHE_EXECUTOR_" + name.upper() for name in ExecutorSettings.model_fields}
# Variables the containers read that are not settings of ours.
RUNTIME_VARS = {"OMP_NUM_THREADS", "NVIDIA_DRIVER_CAPABILITIES"}


@pytest.mark.parametrize(("service", "known"), [
    ("cache-service", CACHE_VARS), ("executor", EXECUTOR_VARS), ("executor-gpu", EXECUTOR_VARS),
])
def test_service_environment_names_real_settings(service, known):
    env = set(COMPOSE["services"][service]["environment"])
    assert env - known - RUNTIME_VARS == set()


def test_every_setting_and_compose_variable_is_documented():
    interpolated = set(re.findall(r"\$\{([A-Z0-9_]+)", COMPOSE_TEXT))
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", DOCS))
    assert (CACHE_VARS | EXECUTOR_VARS | interpolated) - documented == set()


def test_ports_are_published_on_loopback_only():
    for name, service in COMPOSE["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (name, port)


def _seconds(text: str) -> float:
    match = re.fullmatch(r"(?:\$\{[A-Z_]+:-)?(\d+)s\}?", text)
    assert match, text
    return float(match.group(1))


@pytest.mark.parametrize(("service", "drain"), [
    ("cache-service", Settings.model_fields["drain_seconds"].default),
    ("executor", ExecutorSettings.model_fields["drain_seconds"].default),
])
def test_stop_grace_period_outlasts_the_default_drain(service, drain):
    assert _seconds(COMPOSE["services"][service]["stop_grace_period"]) > drain + 1


def test_services_wait_on_health_not_on_start():
    services = COMPOSE["services"]
    for name, service in services.items():
        for dependency, rule in service.get("depends_on", {}).items():
            assert rule == {"condition": "service_healthy"}, name
            assert "healthcheck" in services[dependency], dependency


def test_the_documented_commands_are_the_ones_the_tier_runs():
    """tests/docker builds with these `docker build` lines (conftest.build_image) and runs
    `up --build` with compose (test_compose.py): the docs cannot drift from what is tested."""
    shown = re.findall(r"^docker build .*$", DOCS, re.M)
    targets = ("cache-service", "executor")
    # (the base image: the one scripts/docker_env.sh exported, as conftest.build_image takes it)
    assert shown == ['docker build --build-arg BASE_IMAGE="${KVCACHE_BASE_IMAGE:-python:3.11-slim}"'
                     f" --target {t} -t kvcache/{t} ." for t in targets]
    assert re.search(r"^docker-compose up --build\b", DOCS, re.M)
    assert re.search(r"^docker compose up --build\b", DOCS, re.M)
