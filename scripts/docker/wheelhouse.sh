#!/usr/bin/env bash
# Fills wheelhouse/ (repo root, git-ignored) with wheels of every third-party runtime dependency
# of the images: the project's dependencies, its `executor` extra with torch pinned to the CPU
# build, and the build backend (setuptools, wheel) that the Dockerfile uses to build the project.
#
# Why: pip inside `docker build` cannot verify TLS here, so the Dockerfile installs ONLY from this
# directory (`pip install --no-index --find-links`). This script uses whatever index the host's pip
# is configured for, so it works unchanged where PyPI is reachable; there, set
# KVCACHE_TORCH_SPEC=torch==2.13.0+cpu and PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
# to keep torch on its CPU build (PyPI's Linux wheel is the CUDA one; the gpu profile wants it,
# in KVCACHE_WHEELHOUSE=wheelhouse-gpu). Skips all work when the stamp of the same requirement
# list is present.
set -euo pipefail

repo="$(cd "$(dirname "$0")/../.." && pwd)"
out="${KVCACHE_WHEELHOUSE:-$repo/wheelhouse}"
torch_spec="${KVCACHE_TORCH_SPEC:-torch==2.13.0}"

# torch comes from the pinned spec, never from the extra's range (that could pull a CUDA build).
reqs="$(python3 "$repo/scripts/docker/requirements.py" "$repo/pyproject.toml" \
    --extra executor --extra cluster --torch-spec "$torch_spec" --build-system)"
stamp_value="$(printf '%s\n' "$reqs" "${PIP_EXTRA_INDEX_URL:-}" "$(python3 -c 'import sys; print(sys.version_info[:2])')" | sha256sum | cut -c1-16)"

if [ -f "$out/.stamp" ] && [ "$(cat "$out/.stamp")" = "$stamp_value" ]; then
    echo "wheelhouse: up to date ($out)"
    exit 0
fi
echo "wheelhouse: building $out for: $(echo "$reqs" | tr '\n' ' ')"
rm -rf "$out"
mkdir -p "$out"
printf '%s\n' "$reqs" >"$out/requirements.txt"
# `pip wheel` (not `pip download`): a dependency published only as an sdist becomes a wheel here,
# so the image build needs no compiler and no index.
# (The grep drops this machine's harmless "Location ... is ignored" notes from its pip config.)
python3 -m pip wheel -q -w "$out" -r "$out/requirements.txt" 2>&1 | { grep -v 'is ignored: it is neither' || true; } >&2
[ "${PIPESTATUS[0]}" = 0 ] || { echo "wheelhouse: pip wheel failed" >&2; exit 1; }
echo "$stamp_value" >"$out/.stamp"
echo "wheelhouse: $(ls "$out"/*.whl | wc -l) wheels, $(du -sh "$out" | cut -f1)"
