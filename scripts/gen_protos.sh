#!/usr/bin/env bash
# Regenerates the Python stubs of EVERY .proto under proto/ into kvcache_common/api/
# (messages *_pb2.py, typing stubs *_pb2.pyi, services *_pb2_grpc.py), so that they import
# as kvcache_common.api.kvcache.v1.cache_service_pb2.
#   bash scripts/gen_protos.sh [OUT_DIR]      (default: kvcache_common/api)
# tests/service/test_protos.py runs it into a temp dir and fails on drift; commit the output.
# protoc writes imports relative to proto/ ("from kvcache.v1 import x_pb2"); they are
# rewritten to absolute package imports below.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-kvcache_common/api}"
mkdir -p "$out"
# Drop stale generated files (a removed .proto must not leave stubs behind).
find "$out" \( -name '*_pb2.py' -o -name '*_pb2.pyi' -o -name '*_pb2_grpc.py' \) -delete

mapfile -t protos < <(cd proto && find . -name '*.proto' | sed 's|^\./||' | LC_ALL=C sort)
if [ "${#protos[@]}" -eq 0 ]; then
    echo "gen_protos: no .proto files under proto/" >&2
    exit 1
fi
python3 -m grpc_tools.protoc -I proto \
    --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" "${protos[@]}"

# Every directory of the generated tree is a package.
find "$out" -type d -exec sh -c 'test -f "$1/__init__.py" || : > "$1/__init__.py"' _ {} \;

# protoc emits "from kvcache.v1 import foo_pb2 as ..." (relative to proto/): make them
# absolute under the package that $out maps to.
pkg="$(echo "$out" | sed 's|/*$||; s|/|.|g')"
find "$out" \( -name '*_pb2.py' -o -name '*_pb2.pyi' -o -name '*_pb2_grpc.py' \) -print0 |
    xargs -0 sed -i -E "s/^from (kvcache(\.[A-Za-z0-9_]+)*) import /from ${pkg}.\1 import /"
echo "gen_protos: ${#protos[@]} file(s) -> $out"
