#!/usr/bin/env bash
# The project's test command (README, CI): installs everything, then runs every test tier.
#   bash scripts/test.sh [pytest args...]
# - torch is pinned to the CPU build 2.13.0 first: an unpinned torch would pull a multi-GB CUDA build.
# - scripts/docker_env.sh starts a Docker engine and builds the local base image when it can, so the
#   docker tier (tests/docker) runs for real; when no engine can be had it prints one line and the
#   tier skips. Every other tier needs no Docker.
# - the etcd binary (apt-get install etcd-server) is installed when missing for the cluster tier
#   (tests/cluster); when it cannot be had it prints one line and that tier skips.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[executor,test]'

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
if [ -f scripts/docker_env.sh ]; then
    # shellcheck source=scripts/docker_env.sh
    source scripts/docker_env.sh || echo "docker tier: engine setup failed; tests/docker will skip"
fi

rc=0
python3 -m pytest "$@" || rc=$?
# Stop the engine only if this run started it (a developer's own engine keeps running).
if [ -n "${KVC_DOCKERD_STARTED:-}" ]; then bash scripts/docker_env.sh stop || true; fi
exit "$rc"
