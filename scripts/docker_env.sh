#!/usr/bin/env bash
# Docker engine for the docker test tier (tests/docker) on a machine with no engine and no registry.
#
#   source scripts/docker_env.sh        # test.sh does this: sets DOCKER_HOST & co. in the caller
#   bash scripts/docker_env.sh          # same work; prints the `export` lines on stdout
#   bash scripts/docker_env.sh stop     # stop the dockerd this script started (by its PID file)
#
# Exports DOCKER_HOST, TESTCONTAINERS_RYUK_DISABLED=true, TESTCONTAINERS_CONNECTION_MODE=
# docker_host, KVCACHE_BASE_IMAGE, and KVC_DOCKERD_STARTED=1 when this call started the daemon.
#
# Idempotent: an engine that already answers is reused (DOCKER_HOST, the default socket, or ours);
# otherwise docker.io is installed with apt-get if missing and dockerd is started on its own
# socket/data-root/exec-root without iptables (see docs/dev-environment.md). Then the local base
# image (debootstrap, cached) and the wheelhouse (cached) are built only when absent.
# Progress goes to stderr. When no engine can be had it prints ONE line and returns 0, so the
# caller goes on and the docker tier skips. Never changes the caller's shell options.

_kvc_log() { echo "docker_env: $*" >&2; }

# Own engine locations; the env names let a second checkout use another engine.
_kvc_sock="${KVC_DOCKER_SOCK:-/run/kvc-docker.sock}"
_kvc_pidfile="${KVC_DOCKER_PIDFILE:-/run/kvc-docker.pid}"
_kvc_log_file="${KVC_DOCKER_LOG:-/var/log/kvc-dockerd.log}"
_kvc_data_root="${KVC_DOCKER_DATA_ROOT:-/var/lib/kvc-docker}"
_kvc_exec_root="${KVC_DOCKER_EXEC_ROOT:-/run/kvc-docker}"
_kvc_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

_kvc_engine_answers() {  # $1: DOCKER_HOST value
    DOCKER_HOST="$1" timeout 15 docker version --format '{{.Server.Version}}' >/dev/null 2>&1
}

_kvc_install_missing() {
    local pkgs=()
    command -v dockerd >/dev/null 2>&1 || pkgs+=(docker.io)
    command -v docker-compose >/dev/null 2>&1 || pkgs+=(docker-compose)
    command -v debootstrap >/dev/null 2>&1 || pkgs+=(debootstrap)
    [ "${#pkgs[@]}" -eq 0 ] && return 0
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        _kvc_log "cannot install ${pkgs[*]}: needs root and apt-get"
        return 1
    fi
    _kvc_log "installing ${pkgs[*]} with apt-get"
    # policy-rc.d 101: do not let the package start the system dockerd; we start our own.
    local had_policy=0
    [ -e /usr/sbin/policy-rc.d ] && had_policy=1
    [ "$had_policy" = 1 ] || printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d 2>/dev/null
    local rc=0
    { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}"; } \
        >/tmp/kvc-apt.log 2>&1 || rc=$?
    [ "$had_policy" = 1 ] || rm -f /usr/sbin/policy-rc.d
    [ "$rc" = 0 ] || _kvc_log "apt-get failed (rc=$rc), see /tmp/kvc-apt.log"
    return "$rc"
}

_kvc_start_dockerd() {
    local host="unix://$_kvc_sock" i
    # A stale PID file from a dead daemon would make dockerd refuse to start.
    if [ -f "$_kvc_pidfile" ] && ! kill -0 "$(cat "$_kvc_pidfile")" 2>/dev/null; then
        rm -f "$_kvc_pidfile"
    fi
    if [ ! -f "$_kvc_pidfile" ]; then
        _kvc_log "starting dockerd on $host (log: $_kvc_log_file)"
        mkdir -p "$_kvc_data_root" "$_kvc_exec_root" "$(dirname "$_kvc_log_file")"
        # setsid + nohup: the daemon outlives the shell that sourced us (pytest runs after it).
        setsid nohup dockerd --data-root "$_kvc_data_root" --exec-root "$_kvc_exec_root" \
            -H "$host" --pidfile "$_kvc_pidfile" --iptables=false --ip6tables=false \
            >>"$_kvc_log_file" 2>&1 </dev/null &
    fi
    for i in $(seq 1 60); do
        _kvc_engine_answers "$host" && return 0
        sleep 0.5
    done
    _kvc_log "dockerd did not answer on $host within 30 s; tail of $_kvc_log_file:"
    tail -n 5 "$_kvc_log_file" >&2 2>/dev/null
    return 1
}

# Prints the DOCKER_HOST of an engine that answers, starting one if needed.
_kvc_find_or_start_engine() {
    local h
    for h in "${DOCKER_HOST:-}" "unix://$_kvc_sock" "unix:///var/run/docker.sock"; do
        [ -n "$h" ] && _kvc_engine_answers "$h" && { echo "$h"; return 0; }
    done
    command -v docker >/dev/null 2>&1 || _kvc_install_missing || return 1
    command -v dockerd >/dev/null 2>&1 || _kvc_install_missing || return 1
    _kvc_start_dockerd || return 1
    echo "unix://$_kvc_sock"
}

_kvc_main() {
    # One setup at a time: two checkouts starting at once would both start a dockerd on the
    # same socket and PID file.
    local lock_fd
    exec {lock_fd}>"${KVC_DOCKER_SETUP_LOCK:-/tmp/kvcache-docker-setup.lock}"
    flock -x "$lock_fd"
    _kvc_setup
    local rc=$?
    exec {lock_fd}>&-
    return "$rc"
}

_kvc_setup() {
    local host ours_before=0
    [ -f "$_kvc_pidfile" ] && kill -0 "$(cat "$_kvc_pidfile")" 2>/dev/null && ours_before=1
    if ! command -v docker >/dev/null 2>&1 && [ "$(id -u)" != 0 ]; then
        echo "docker_env: no Docker engine and no way to install one (not root); tests/docker will skip" >&2
        return 0
    fi
    if ! host="$(_kvc_find_or_start_engine)"; then
        echo "docker_env: no Docker engine could be started; tests/docker will skip" >&2
        return 0
    fi
    export DOCKER_HOST="$host"
    # Lets the caller stop only a daemon that this call started (`docker_env.sh stop`).
    if [ "$ours_before" = 0 ] && [ -f "$_kvc_pidfile" ]; then
        export KVC_DOCKERD_STARTED=1
    fi
    export TESTCONTAINERS_RYUK_DISABLED=true        # the reaper image cannot be pulled here
    export TESTCONTAINERS_CONNECTION_MODE=docker_host  # else it dials the bridge gateway
    # compose and debootstrap may still be missing when an engine was already running.
    _kvc_install_missing || _kvc_log "continuing without the missing tools"

    # Base image: honour a caller's choice (e.g. python:3.11-slim where a registry answers).
    if [ -z "${KVCACHE_BASE_IMAGE:-}" ]; then
        if KVCACHE_BASE_IMAGE="$(bash "$_kvc_repo/scripts/docker/base_image.sh")"; then
            export KVCACHE_BASE_IMAGE
        else
            unset KVCACHE_BASE_IMAGE
            _kvc_log "local base image build failed; tests/docker will skip"
        fi
    fi
    bash "$_kvc_repo/scripts/docker/wheelhouse.sh" >&2 || _kvc_log "wheelhouse build failed; tests/docker will skip"
    _kvc_log "ready: DOCKER_HOST=$DOCKER_HOST KVCACHE_BASE_IMAGE=${KVCACHE_BASE_IMAGE:-<none>}"
}

_kvc_stop() {
    if [ -f "$_kvc_pidfile" ]; then
        local pid
        pid="$(cat "$_kvc_pidfile")"
        _kvc_log "stopping dockerd pid $pid"
        kill "$pid" 2>/dev/null
        for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    else
        _kvc_log "no dockerd started by this script ($_kvc_pidfile absent)"
    fi
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then  # executed, not sourced
    if [ "${1:-}" = stop ]; then _kvc_stop; exit 0; fi
    _kvc_main
    for _v in DOCKER_HOST TESTCONTAINERS_RYUK_DISABLED TESTCONTAINERS_CONNECTION_MODE \
        KVCACHE_BASE_IMAGE KVC_DOCKERD_STARTED; do
        [ -n "${!_v:-}" ] && echo "export $_v=${!_v}"
    done
    exit 0
fi
_kvc_main
unset -f _kvc_log _kvc_engine_answers _kvc_install_missing _kvc_start_dockerd \
    _kvc_find_or_start_engine _kvc_main _kvc_setup _kvc_stop
unset _kvc_sock _kvc_pidfile _kvc_log_file _kvc_data_root _kvc_exec_root _kvc_repo
true
