"""The Docker quick start on a machine that lacks something (no docker CLI, no engine, no
debootstrap): scripts/docker/base_image.sh says in ONE line what is missing and how to get it,
prints nothing on stdout, exits 1, and the documented line then leaves KVCACHE_BASE_IMAGE
unset (it used to export it empty). Runs without an engine: the docker CLI is a stub."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tests.doc_commands import ROOT, shell

QUICK_START = ('KVCACHE_BASE_IMAGE="$(bash scripts/docker/base_image.sh)" && export '
               'KVCACHE_BASE_IMAGE')


def _stub_docker(bin_dir: Path, engine: bool) -> None:
    """A docker CLI whose engine answers (``engine``) or not; no image exists."""
    script = bin_dir / "docker"
    script.write_text("#!/bin/sh\n" + ('[ "$1" = version ] && exit 0\n' if engine else "")
                      + "exit 1\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize("docker,missing", [
    ("none", "the docker CLI is not installed"),
    ("no-engine", "no Docker engine answers"),
    ("engine", "debootstrap is not installed")])
def test_what_is_missing_is_one_line(tmp_path: Path, docker: str, missing: str) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if docker != "none":
        _stub_docker(bin_dir, engine=docker == "engine")
    for tool in ("bash", "awk", "cat", "mkdir", "tr", "timeout", "env", "sh", "printenv"):
        target = next((Path(d) / tool for d in ("/usr/bin", "/bin") if (Path(d) / tool).exists()),
                      None)
        if target is not None and not (bin_dir / tool).exists():
            (bin_dir / tool).symlink_to(target)
    env = {"PATH": str(bin_dir), "KVC_DOCKER_CACHE": str(tmp_path / "cache"),
           "DOCKER_HOST": None, "HOME": os.environ.get("HOME", "/tmp")}
    done = shell("bash scripts/docker/base_image.sh", ROOT, timeout=60, env=env)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"base_image: {missing}")
    assert "scripts/docker_env.sh" in done.stderr
    # docs/deployment.md's line, as written: nothing exported for compose to pick up
    as_written = shell(f"{QUICK_START}; printenv KVCACHE_BASE_IMAGE || echo unset", ROOT,
                       timeout=60, env={**env, "KVCACHE_BASE_IMAGE": None})
    assert as_written.stdout == "unset\n", as_written.stdout
    assert QUICK_START in (ROOT / "docs/deployment.md").read_text()
