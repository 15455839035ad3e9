#!/usr/bin/env bash
# The project's test command (README, CI): installs everything, lints, then runs every test tier.
#   bash scripts/test.sh [pytest args...]
# - The lint step (ruff check: lint rules only, no reformatting; mypy: strict on
#   cache_service/core, lenient elsewhere; both configured in pyproject.toml) runs before pytest
#   and fails the run on any finding.
# - torch is pinned to the CPU build 2.13.0 first: an unpinned torch would pull a multi-GB CUDA build.
# - scripts/docker_env.sh starts a Docker engine and builds the local base image when it can, so the
#   docker tier (tests/docker) runs for real; when no engine can be had it prints one line and the
#   tier skips. Every other tier needs no Docker. As root on a machine without Docker it installs
#   docker.io, docker-compose and debootstrap with apt-get, and starts dockerd on a FIXED socket
#   (/run/kvc-docker.sock, data in /var/lib/kvc-docker; see README "Tests").
# - Two checkouts may test at once: both use that one engine. Each run holds a shared lock on it
#   (flock, $KVC_DOCKER_LOCK) while it tests; the run that started the engine stops it at the end
#   only when no other run holds the lock. The docker tier itself runs one checkout at a time
#   (tests/docker/conftest.py), the other tiers in parallel.
# - the etcd binary (apt-get install etcd-server) is installed when missing for the cluster tier
#   (tests/cluster); when it cannot be had it prints one line and that tier skips.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[executor,test]'

# The whole tree: ruff reads every Python file; mypy checks the packages that pyproject.toml's
# [tool.mypy] `files` lists (every top-level package, scripts and tests).
python3 -m ruff check .
python3 -m mypy

# The cluster tier (tests/cluster) runs a real etcd: Debian's etcd-server package. Without
# root/apt-get (or offline) it prints one line and the tier skips.
if ! command -v etcd >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
        && { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server; } >/dev/null 2>&1
    then :
    else echo "cluster tier: could not install etcd-server; tests/cluster will skip"
    fi
fi

export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1
exec 9>"${KVC_DOCKER_LOCK:-/tmp/kvcache-docker-engine.lock}"
flock -s 9  # "this run uses the engine": kept until this script exits
if [ -f scripts/docker_env.sh ]; then
    # shellcheck source=scripts/docker_env.sh
    source scripts/docker_env.sh || echo "docker tier: engine setup failed; tests/docker will skip"
fi

rc=0
# The pure-Python core is the reference: every tier runs against it, even where a compiled
# build (python -m cache_service.core.build) is present.
KVCACHE_CORE=pure python3 -m pytest "$@" || rc=$?
# Then the mypyc-compiled core (python -m cache_service.core.build: 25 s to 2.5 min of CPU)
# against the core tier and the replay conformance: the same answers, block for block (about
# 2 min on 2 cores; docs/architecture.md, "Compiled core"). KVCACHE_TEST_COMPILED=0 skips it.
# A machine without a C compiler or the interpreter's headers prints one line and skips it.
if [ "$#" = 0 ] && [ "${KVCACHE_TEST_COMPILED:-1}" != 0 ]; then
    if python3 -m cache_service.core.build >/dev/null 2>/tmp/kvcache-core-build.$$.log; then
        KVCACHE_CORE=compiled python3 -m pytest -q tests/core tests/service/test_replay_equivalence.py tests/service/test_upgrade.py || rc=$?
    else
        echo "compiled core: the build failed ($(tail -n 1 /tmp/kvcache-core-build.$$.log)); its test pass is skipped"
    fi
    rm -f /tmp/kvcache-core-build.$$.log
fi
# Stop the engine only if this run started it (a developer's own engine keeps running) and no
# other run still uses it (the shared lock turns exclusive only when this run is the last).
if [ -n "${KVC_DOCKERD_STARTED:-}" ]; then
    if flock -x -n 9; then
        bash scripts/docker_env.sh stop || true
    else
        echo "test.sh: another run still uses the Docker engine; it keeps running (stop it later: bash scripts/docker_env.sh stop)" >&2
    fi
fi
exit "$rc"
