"""Dev tool: diff ``cache_service.replay`` against the vLLM oracle (never run in CI).

    python scripts/oracle/oracle_diff.py CONFIG.json TRACE.jsonl [--expected F]

Without ``--expected`` it runs the vLLM oracle (VLLM_ORACLE, its venv python
VLLM_ORACLE_PY) on the trace with the scenario matching CONFIG, and with ``--write``
stores its output as TRACE.expected.jsonl, headed by a ``# provenance: {...}`` line (vLLM
version, the oracle's resolved config and arguments, config and trace file with the
trace's sha256, the command that generated the trace, the command that wrote the file).
Results are compared with ``cache_service.replay.same_result`` (as tests/core/test_replay.py
does).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ORACLE = Path(os.environ.get(
    "VLLM_ORACLE", Path(__file__).resolve().parents[3] / "shared/tools/vllm-oracle/vllm_oracle.py"))
# The oracle as vLLM's scheduler would drive it: copy-on-write copies drained each op.
SCHEDULING_ORACLE = Path(__file__).resolve().parent / "oracle_cow.py"
ORACLE_PY = Path(os.environ.get("VLLM_ORACLE_PY",
                                Path.home() / ".cache/vllm-oracle-venv/bin/python"))


def oracle_args(config: dict[str, Any]) -> list[str]:
    kinds = [g["type"] for g in config["groups"]]
    names = {"full_attention": "full", "sliding_window": "swa", "mamba": "mamba",
             "rswa": "rswa", "circular_buffer": "cbuf"}
    scenario = "_".join(names[k] for k in kinds)
    args = ["--scenario", scenario, "--num-blocks", str(config["num_blocks"]),
            "--max-model-len", str(config["max_model_len"]),
            "--block-size", str(config["groups"][0]["block_size"]),
            "--hash-fn", config.get("hash_algo", "sha256"),
            "--enable-caching" if config.get("enable_caching", True) else "--no-caching"]
    retention = config.get("prefix_cache_retention_interval")
    args += ["--retention-interval", "none" if retention is None else str(retention)]
    if config.get("use_eagle"):
        args.append("--use-eagle")
    if config.get("enable_mamba_shared_prefix_checkpoint"):
        args.append("--enable-mamba-shared-prefix-checkpoint")
    if config.get("watermark"):
        args += ["--watermark", str(config["watermark"])]
    if config.get("num_hash_lookahead_tokens"):
        args += ["--num-hash-lookahead-tokens", str(config["num_hash_lookahead_tokens"])]
    for g in config["groups"]:
        if g["type"] == "sliding_window":
            args += ["--sliding-window", str(g["sliding_window"])]
        if g["type"] == "mamba":
            args += ["--mamba-block-size", str(g["block_size"])]
        if g["type"] == "rswa":
            args += ["--rswa-window", str(g["rswa_window"]),
                     "--rswa-block-size", str(g["block_size"])]
        if g["type"] == "circular_buffer":
            args += ["--ring-size", str(g["block_size"])]
    return args


def run_oracle(config: dict[str, Any], trace: str) -> list[dict[str, Any]]:
    proc = subprocess.run([str(ORACLE_PY), str(SCHEDULING_ORACLE), *oracle_args(config)],
                          input=trace, capture_output=True, text=True, check=True,
                          env={**os.environ, "VLLM_ORACLE": str(ORACLE)})
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def provenance(config_path: Path, trace_path: Path, trace: str, config: dict[str, Any],
               trace_command: str | None) -> dict[str, Any]:
    args = oracle_args(config)
    proc = subprocess.run([str(ORACLE_PY), str(SCHEDULING_ORACLE), *args, "--describe"],
                          capture_output=True, text=True, check=True,
                          env={**os.environ, "VLLM_ORACLE": str(ORACLE)})
    described = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        "answers_by": "vLLM's own KVCacheManager, in process on a CPU (vllm_oracle.py, "
                      "copy-on-write copies drained after each op as vLLM's scheduler does: "
                      "scripts/oracle/oracle_cow.py)",
        "vllm_version": described["vllm_version"],
        "oracle_config": described,
        "oracle_args": args,
        "config": config_path.name,
        "trace": trace_path.name,
        "trace_sha256": hashlib.sha256(trace.encode()).hexdigest(),
        "trace_generator": trace_command,
        "command": f"python scripts/oracle/oracle_diff.py {config_path.name} {trace_path.name} "
                   "--write",
    }


def run_ours(config: dict[str, Any], trace: str) -> list[dict[str, Any]]:
    from cache_service.replay import make_pool, replay

    out = io.StringIO()
    replay(make_pool(config), io.StringIO(trace), out)
    return [json.loads(line) for line in out.getvalue().splitlines()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config")
    p.add_argument("trace")
    p.add_argument("--expected", help="compare with this file instead of running the oracle")
    p.add_argument("--write", action="store_true", help="write TRACE.expected.jsonl")
    p.add_argument("--trace-command", help="how TRACE was generated (for the provenance)")
    a = p.parse_args()
    config = json.loads(Path(a.config).read_text())
    trace = Path(a.trace).read_text()
    if a.expected:
        from cache_service.replay import read_expected  # noqa: PLC0415 (dev tool)

        _, theirs = read_expected(Path(a.expected).read_text())
    else:
        theirs = run_oracle(config, trace)
        if a.write:
            trace_path = Path(a.trace)
            expected = trace_path.with_name(trace_path.name.removesuffix(".jsonl")
                                            + ".expected.jsonl")
            stamp = provenance(Path(a.config), trace_path, trace, config, a.trace_command)
            expected.write_text("# provenance: " + json.dumps(stamp, separators=(",", ":"))
                                + "\n" + "".join(json.dumps(r, separators=(",", ":")) + "\n"
                                                 for r in theirs))
    from cache_service.replay import same_result

    ours = run_ours(config, trace)
    if len(ours) != len(theirs):
        print(f"length differs: ours {len(ours)} vs oracle {len(theirs)}")
        return 1
    bad = [i for i, (o, t) in enumerate(zip(ours, theirs)) if not same_result(o, t)]
    for i in bad[:5]:
        print(f"op {i}:\n  ours   {json.dumps(ours[i])[:600]}\n"
              f"  oracle {json.dumps(theirs[i])[:600]}")
    print(f"{len(ours)} ops compared, {len(bad)} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
