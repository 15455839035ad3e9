#!/usr/bin/env bash
# Prints the tag of a local Debian bookworm base image with python3 + venv, building it if absent.
#
# No registry is reachable here, so `FROM python:3.11-slim` cannot be pulled: the image is made
# with debootstrap from the machine's own Debian mirror and `docker import`ed. The rootfs tarball
# is cached (KVC_DOCKER_CACHE, default /var/cache/kvcache-docker) so a wiped engine re-imports it
# in seconds. bookworm's python3 is 3.11, the same ABI as the host-built wheelhouse (cp311).
# Needs DOCKER_HOST pointing at an engine, root, and debootstrap; a missing one is ONE line on
# stderr naming it (exit 1, nothing on stdout). Progress goes to stderr.
set -euo pipefail

tag="${KVCACHE_LOCAL_BASE_TAG:-kvcache-local/base:bookworm-py311}"
cache_dir="${KVC_DOCKER_CACHE:-/var/cache/kvcache-docker}"
suite=bookworm
include=python3,python3-venv
tarball="$cache_dir/rootfs-$suite-minbase-$(echo "$include" | tr ',' '+').tar"

log() { echo "base_image: $*" >&2; }

# What is missing, in one line each, with the way out: scripts/docker_env.sh gets all of it.
command -v docker >/dev/null || {
    log "the docker CLI is not installed (as root: apt-get install docker.io, or source scripts/docker_env.sh, which also starts an engine)"
    exit 1
}
timeout 15 docker version --format '{{.Server.Version}}' >/dev/null 2>&1 || {
    log "no Docker engine answers at ${DOCKER_HOST:-the default socket} (start one, or source scripts/docker_env.sh: as root it installs and starts one)"
    exit 1
}

if docker image inspect "$tag" >/dev/null 2>&1; then
    echo "$tag"
    exit 0
fi

# The first non-security deb.debian.org-style mirror in the apt sources (deb822 or one-line form).
apt_mirror() {
    local uri
    uri="$(awk '/^URIs:/ {u=$2} /^Suites:/ && u != "" && $0 ~ /bookworm( |$)/ {print u; exit}' \
        /etc/apt/sources.list.d/*.sources 2>/dev/null || true)"
    [ -n "$uri" ] || uri="$(awk '$1 == "deb" && $3 == "bookworm" {print $2; exit}' \
        /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true)"
    echo "${uri:-http://deb.debian.org/debian}"
}

if [ ! -s "$tarball" ]; then
    command -v debootstrap >/dev/null || {
        log "debootstrap is not installed (as root: apt-get install debootstrap; source scripts/docker_env.sh does it) -- or use a registry's python:3.11-slim and leave KVCACHE_BASE_IMAGE unset"
        exit 1
    }
    mirror="$(apt_mirror)"
    mkdir -p "$cache_dir"
    rootfs="$(mktemp -d "$cache_dir/rootfs.XXXXXX")"
    trap 'rm -rf "$rootfs"' EXIT
    log "debootstrap --variant=minbase --include=$include $suite from $mirror (about a minute)"
    debootstrap --variant=minbase --include="$include" "$suite" "$rootfs" "$mirror" \
        >"$cache_dir/debootstrap.log" 2>&1 || { log "debootstrap failed, see $cache_dir/debootstrap.log"; exit 1; }
    # Package caches are dead weight in every image built on top.
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/doc/* \
        "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/*
    tar --numeric-owner -C "$rootfs" -cf "$tarball.part" .
    mv "$tarball.part" "$tarball"
fi

log "importing $tarball as $tag"
docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["/bin/bash"]' "$tarball" "$tag" >/dev/null
echo "$tag"
