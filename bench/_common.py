"""Small helpers shared by the benchmarks in bench/: latency summaries, a rich table, and
the JSON results file. Benchmarks are scripts, not tests; results go to bench/results/
(git-ignored).

Benchmarks run from a checkout, installed or not (``python3 bench/<name>.py``): Python puts
bench/ on sys.path, and importing this module puts the checkout's root there too, so a
benchmark imports ``_common`` before the project's packages.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

RESULTS_DIR = REPO / "bench" / "results"


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of already sorted values (the vLLM oracle's definition,
    so that numbers from both sides are comparable); NaN when empty."""
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, int(round(p / 100.0 * (len(sorted_values) - 1)))))
    return sorted_values[k]


def summarize_ns(samples_ns: Sequence[int]) -> dict[str, Any]:
    """n, mean, p50, p90, p99 and max of nanosecond samples, in microseconds."""
    xs = sorted(samples_ns)
    if not xs:
        return {"n": 0}
    return {
        "n": len(xs),
        "mean_us": round(sum(xs) / len(xs) / 1e3, 2),
        "p50_us": round(percentile(xs, 50) / 1e3, 2),
        "p90_us": round(percentile(xs, 90) / 1e3, 2),
        "p99_us": round(percentile(xs, 99) / 1e3, 2),
        "max_us": round(xs[-1] / 1e3, 2),
    }


def ratio(a: float | None, b: float | None) -> str:
    """``a / b`` as ``"1.23x"``, or ``"-"`` when either side is missing or zero."""
    if not a or not b:
        return "-"
    return f"{a / b:.2f}x"


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
                console: Console | None = None) -> None:
    """One rich table; the first column is left-aligned, the others right-aligned."""
    table = Table(title=title, title_justify="left")
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(fmt(v) for v in row))
    if console is None:
        # A pipe gets rich's 80 columns, which truncates wide tables in logs.
        console = Console(width=max(Console().width, 180))
    console.print(table)


def write_results(name: str, payload: dict[str, Any], path: Path | None = None) -> Path:
    """Write ``payload`` plus run metadata to ``bench/results/<name>.json`` (or ``path``)."""
    out = path or RESULTS_DIR / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    variant = sys.modules.get("cache_service.core._variant")
    doc = {
        "benchmark": name,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "argv": sys.argv[1:],
        # Which core build ran (pure Python or mypyc-compiled), when the core was loaded.
        **({"core_build": variant.build_info()} if variant is not None else {}),
        **payload,
    }
    out.write_text(json.dumps(doc, indent=1) + "\n")
    return out
