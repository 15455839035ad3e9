"""Dev tool (never run by tests or CI): vLLM 0.33's own KV-cache-manager unit tests run
against this project's core (docs/conformance.md, "vLLM's unit tests against our core").

It runs the chosen files of ``tests/v1/core`` from the ``vllm==0.33.0`` sdist twice under the
oracle venv's pytest: once as vLLM ships them (vLLM's own pass count), once with
``scripts/oracle/vllm_ut_adapter.py`` replacing vLLM's ``BlockPool``, single-type managers and
``KVCacheManager`` by adapters over ``cache_service.core`` (pure build). It prints, per file
and in total: tests collected, vLLM's passes, and for the tests vLLM passes: how many ran
against us (built an adapted object and finished), passed, failed (an assertion: a divergence),
not runnable (grouped by the feature they need), and those that never touch the allocator.

    ~/.cache/vllm-oracle-venv/bin/python scripts/oracle/vllm_unit_tests.py \\
        --sdist /tmp/vllm-sdist/vllm-0.33.0 --out /tmp/vllm_unit_tests.json

Get the sdist with ``~/.cache/vllm-oracle-venv/bin/pip download --no-deps --no-binary :all:
vllm==0.33.0`` (then unpack it); its tests are not in the wheel.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
DEFAULT_PYTHON = Path.home() / ".cache/vllm-oracle-venv/bin/python"
FILES = ("test_single_type_kv_cache_manager.py", "test_prefix_caching.py",
         "test_kv_cache_utils.py", "prefix_cache/test_partial_prefix_cache_hits.py",
         "prefix_cache/test_partial_prefix_cache_primitives.py",
         "prefix_cache/test_mamba_eagle_resume_checkpoint.py", "test_mamba_align_chunk_split.py")


def run_pytest(python: Path, sdist: Path, files: list[str], adapt: bool, extra: list[str],
               timeout: int) -> list[dict[str, Any]]:
    """One pytest run; each test's first record (see vllm_ut_adapter's hooks)."""
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as tmp:
        results = Path(tmp.name)
    env = dict(os.environ, VLLM_UT_RESULTS=str(results), VLLM_UT_ADAPT="1" if adapt else "0",
               KVCACHE_CORE="pure", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT),
                                           os.environ.get("PYTHONPATH", "")]))
    core = sdist / "tests/v1/core"
    cmd = [str(python), "-m", "pytest", "-q", "-p", "vllm_ut_adapter", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", "--rootdir", str(sdist), *extra,
           *[str(core / f) for f in files]]
    tail = ""
    try:
        proc = subprocess.run(cmd, cwd=str(sdist / "tests"), env=env, timeout=timeout,
                              capture_output=True, text=True, check=False)
        # A file that fails to import is one "error" line in pytest's summary.
        for line in proc.stdout.splitlines():
            if line.startswith("ERROR ") and "::" not in line:
                print(f"collection error ({'adapted' if adapt else 'vLLM'} run): {line[6:]}",
                      file=sys.stderr)
        tail = proc.stdout[-3000:] + proc.stderr[-3000:]
    except subprocess.TimeoutExpired:
        print(f"pytest timed out after {timeout}s ({'adapted' if adapt else 'vLLM'} run); "
              "counts are partial", file=sys.stderr)
    if not results.read_text().strip():
        print(f"no test ran: {' '.join(cmd)}\n{tail}",
              file=sys.stderr)
    seen: dict[str, dict[str, Any]] = {}
    for line in results.read_text().splitlines():
        rec = json.loads(line)
        seen.setdefault(rec["nodeid"], rec)
    results.unlink()
    return list(seen.values())


def _file_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return path.split("tests/v1/core/", 1)[-1]


def summarize(vllm: list[dict[str, Any]], ours: list[dict[str, Any]]) -> dict[str, Any]:
    """The table: per file and in total, plus not-runnable and failure groups."""
    by_id = {r["nodeid"]: r for r in ours}
    files: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    missing: collections.Counter[str] = collections.Counter()
    failures: dict[str, list[str]] = collections.defaultdict(list)
    for rec in vllm:
        row = files[_file_of(rec["nodeid"])]
        row["collected"] += 1
        if rec["outcome"] != "passed":
            row["vllm_not_passed"] += 1
            continue
        row["vllm_passed"] += 1
        us = by_id.get(rec["nodeid"], {"outcome": "not_runnable", "feature": "no result (crash)",
                                      "touched": False})
        if us["outcome"] == "passed" and not us["touched"]:
            row["untouched"] += 1  # a helper or a vLLM-only path: says nothing about us
        elif us["outcome"] == "passed":
            row["run"] += 1
            row["passed"] += 1
        elif us["outcome"] == "failed":
            row["run"] += 1
            row["failed"] += 1
            failures[us.get("feature", "")].append(rec["nodeid"])
        else:
            row["not_runnable"] += 1
            missing[us.get("feature", "unknown")] += 1
    total: collections.Counter[str] = collections.Counter()
    for row in files.values():
        total.update(row)
    return {"files": {f: dict(c) for f, c in sorted(files.items())}, "total": dict(total),
            "not_runnable_by_feature": dict(missing.most_common()),
            "failures": {k: v for k, v in sorted(failures.items(), key=lambda kv: -len(kv[1]))}}


COLUMNS = ("collected", "vllm_passed", "run", "passed", "failed", "not_runnable", "untouched")


def print_table(summary: dict[str, Any]) -> None:
    """The summary as text."""
    width = max(len(f) for f in [*summary["files"], "total"])
    print(f"{'file':<{width}}  " + "  ".join(f"{c:>12}" for c in COLUMNS))
    for name, row in [*summary["files"].items(), ("total", summary["total"])]:
        print(f"{name:<{width}}  " + "  ".join(f"{row.get(c, 0):>12}" for c in COLUMNS))
    print("\nnot runnable against us, by what they need:")
    for feature, n in summary["not_runnable_by_feature"].items():
        print(f"  {n:5d}  {feature}")
    print("\nfailed against us (assertion), by first assertion:")
    for feature, ids in summary["failures"].items():
        print(f"  {len(ids):5d}  {feature}  (e.g. {ids[0].split('::', 1)[-1]})")


def main(argv: list[str] | None = None) -> int:
    """Run both passes, print the table, write --out."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sdist", type=Path, default=Path("/tmp/vllm-sdist/vllm-0.33.0"),
                    help="the unpacked vllm==0.33.0 sdist (holds tests/v1/core)")
    ap.add_argument("--python", type=Path, default=DEFAULT_PYTHON,
                    help="the oracle venv's interpreter (vLLM 0.33 and pytest installed)")
    ap.add_argument("--files", nargs="+", default=list(FILES),
                    help="files under tests/v1/core (default: the allocator's)")
    ap.add_argument("-k", dest="keyword", help="pytest -k expression, for both passes")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per pytest pass")
    ap.add_argument("--out", type=Path, help="write the summary and every record as JSON")
    args = ap.parse_args(argv)
    if not (args.sdist / "tests/v1/core").is_dir():
        ap.error(f"--sdist {args.sdist}: no tests/v1/core (unpack vllm-0.33.0.tar.gz)")
    extra = ["-k", args.keyword] if args.keyword else []
    vllm = run_pytest(args.python, args.sdist, args.files, False, extra, args.timeout)
    ours = run_pytest(args.python, args.sdist, args.files, True, extra, args.timeout)
    summary = summarize(vllm, ours)
    print_table(summary)
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "vllm": vllm, "ours": ours},
                                       indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
