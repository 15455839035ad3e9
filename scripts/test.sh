#!/usr/bin/env bash
# The project's test command (README, CI): installs everything, lints, then runs every test tier.
#   bash scripts/test.sh [pytest args...]
# - The lint step (ruff check: lint rules only, no reformatting; mypy: strict on
#   cache_service/core, lenient elsewhere; both configured in pyproject.toml) runs before pytest
#   and fails the run on any finding.
# - torch is pinned to the CPU build 2.13.0 first: an unpinned torch would pull a multi-GB CUDA build.
# - scripts/docker_env.sh starts a Docker engine and builds the local base image when it can, so the
#   docker tier (tests/docker) runs for real; when no engine can be had it prints one line and the
#   tier skips. Every other tier needs no Docker.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[executor,test]'

# TODO: lint the whole tree (LINT_PATHS=(.) and no --follow-imports) once cache_service/ and
# executor/ (with tests/executor) are clean; until then imported modules are checked silently.
LINT_PATHS=(kernels bench scripts tests/conftest.py tests/core tests/service tests/kernels tests/bench
            tests/docker)
python3 -m ruff check "${LINT_PATHS[@]}"
python3 -m mypy --follow-imports=silent "${LINT_PATHS[@]}"

export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1
if [ -f scripts/docker_env.sh ]; then
    # shellcheck source=scripts/docker_env.sh
    source scripts/docker_env.sh || echo "docker tier: engine setup failed; tests/docker will skip"
fi

rc=0
python3 -m pytest "$@" || rc=$?
# Stop the engine only if this run started it (a developer's own engine keeps running).
if [ -n "${KVC_DOCKERD_STARTED:-}" ]; then bash scripts/docker_env.sh stop || true; fi
exit "$rc"
