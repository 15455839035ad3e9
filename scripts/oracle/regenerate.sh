#!/usr/bin/env bash
# Dev tool (never run by tests): regenerate the sample traces and the vLLM oracle's
# expected outputs. Needs the oracle venv (shared/tools/vllm-oracle/setup_venv.sh).
#   bash scripts/oracle/regenerate.sh [NAME ...]     (default: every sample)
set -euo pipefail
TOOLS="$(cd "$(dirname "$0")" && pwd)"
cd "$TOOLS/../../cache_service/replay_samples"
PY="${VLLM_ORACLE_PY:-$HOME/.cache/vllm-oracle-venv/bin/python}"
ORACLE="${VLLM_ORACLE:-$TOOLS/../../../shared/tools/vllm-oracle/vllm_oracle.py}"
declare -A SCENARIO=([full]="full" [full_swa]="full_swa" [full_mamba]="full_mamba"
  [swa_mamba_nocache]="swa_mamba" [full_swa_mamba_nocache]="full_swa_mamba"
  [full_swa_mamba]="full_swa_mamba --enable-caching"
  [full_mamba32]="full_mamba --mamba-block-size 32")
# Sparse checkpoint retention (vLLM 0.33's engine default 0, and an interval): the
# configs say so in prefix_cache_retention_interval, the bench runs with the same setting.
for r in 0 128; do
  SCENARIO[full_swa_r$r]="full_swa --retention-interval $r"
  SCENARIO[full_mamba_r$r]="full_mamba --retention-interval $r"
done
SCENARIO[full_swa_mamba_r0]="full_swa_mamba --enable-caching --retention-interval 0"
SCENARIO[mamba_align_r0]="mamba --enable-caching --retention-interval 0"  # attention-free
SCENARIO[full_swa_mamba_r128]="full_swa_mamba --enable-caching --retention-interval 128"
SCENARIO[mamba_align_r128]="mamba --enable-caching --retention-interval 128"
# EAGLE (use_eagle; the configs say so): every group mix, dense and sparse. The wrapper
# (oracle_cow.py) builds vLLM's manager with use_eagle=True; full_mamba32_eagle_r0 also
# turns on enable_mamba_shared_prefix_checkpoint, which only acts with EAGLE.
SCENARIO[full_eagle]="full --use-eagle"
SCENARIO[full_swa_eagle_r0]="full_swa --retention-interval 0 --use-eagle"
SCENARIO[full_mamba_eagle_r0]="full_mamba --retention-interval 0 --use-eagle"
E_SP="--use-eagle --enable-mamba-shared-prefix-checkpoint"
SCENARIO[full_mamba32_eagle_r0]="full_mamba --mamba-block-size 32 --retention-interval 0 $E_SP"
SCENARIO[full_swa_mamba_eagle_r128]="full_swa_mamba --enable-caching --retention-interval 128 --use-eagle"
SCENARIO[mamba_align_eagle_r0]="mamba --enable-caching --retention-interval 0 --use-eagle"
# The admission watermark (KVCacheManager(watermark=0.1): 10% of the pool kept free when a
# waiting or preempted request is admitted next to running ones).
SCENARIO[full_swa_r0_wm10]="full_swa --retention-interval 0 --watermark 0.1"
# Lookahead hashing (num_hash_lookahead_tokens; the configs say so): vLLM's manager and
# block hasher with lookahead L (oracle_cow.py). Their mixed traces also carry multimodal
# items, prompt embeddings and hashes ops (make_trace.py --mm).
SCENARIO[full_la1]="full --num-hash-lookahead-tokens 1"
SCENARIO[full_mamba32_la3_r0]="full_mamba --mamba-block-size 32 --retention-interval 0 --num-hash-lookahead-tokens 3"
declare -A MIXED_ARGS=([full_la1]="--mm" [full_mamba32_la3_r0]="--mm")
# vLLM 0.33's R-SWA and circular-buffer spec types, alone and next to full attention
# (oracle_cow.py builds them; the configs give the window, the ring and the block sizes).
SCENARIO[rswa]="rswa --retention-interval 0 --rswa-window 16"
SCENARIO[full_rswa]="full_rswa --retention-interval 0 --rswa-window 16"
SCENARIO[cbuf]="cbuf --block-size 8 --retention-interval 0 --ring-size 8"
SCENARIO[full_cbuf]="full_cbuf --retention-interval 0 --ring-size 8"
SCENARIO[full_rswa_cbuf]="full_rswa_cbuf --retention-interval 0 --rswa-window 48 --rswa-block-size 32 --ring-size 8"
BENCH_ARGS="--num-blocks 128 --num-requests 12 --prompt-min 64 --prompt-max 900 --decode-min 4
  --decode-max 40 --prefix-min 64 --prefix-max 512 --num-prefixes 4 --max-concurrency 8
  --max-batched-tokens 512 --seed 7"
export VLLM_ORACLE="$ORACLE" VLLM_ORACLE_PY="$PY" PYTHONPATH="$TOOLS/../.."
names=("$@")
[ "${#names[@]}" -gt 0 ] || names=("${!SCENARIO[@]}")
for name in "${names[@]}"; do
  [ -n "${SCENARIO[$name]+x}" ] || { echo "regenerate: unknown sample $name" >&2; exit 2; }
  # A realistic scheduler workload (shared prefixes, chunked prefill, decode,
  # preemption) from the oracle's own bench, small enough to commit.
  # shellcheck disable=SC2086
  # (through the wrapper, which passes vllm_oracle.py's arguments on and adds
  # --use-eagle / --enable-mamba-shared-prefix-checkpoint)
  "$PY" "$TOOLS/oracle_cow.py" --bench --scenario ${SCENARIO[$name]} $BENCH_ARGS \
    --emit-trace "$name.bench.jsonl" --json > /dev/null
  # Random mixed operations, incl. usage/reset/blocks, errors and explicit steps.
  # shellcheck disable=SC2086
  python3 "$TOOLS/make_trace.py" "$name.json" --ops 600 --seed 11 ${MIXED_ARGS[$name]:-} \
    > "$name.mixed.jsonl"
  # The commands that generated each trace go into the answers' provenance header.
  # shellcheck disable=SC2086
  bench_cmd="oracle_cow.py --bench --scenario ${SCENARIO[$name]} $(echo $BENCH_ARGS) --emit-trace $name.bench.jsonl"
  mixed_cmd="python scripts/oracle/make_trace.py $name.json --ops 600 --seed 11${MIXED_ARGS[$name]:+ ${MIXED_ARGS[$name]}}"
  python3 "$TOOLS/oracle_diff.py" "$name.json" "$name.bench.jsonl" --write --trace-command "$bench_cmd"
  python3 "$TOOLS/oracle_diff.py" "$name.json" "$name.mixed.jsonl" --write --trace-command "$mixed_cmd"
done
