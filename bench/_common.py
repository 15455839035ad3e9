"""Small helpers shared by the benchmarks in bench/: latency summaries, a rich table, the
JSON results file and a PNG plot beside it. Benchmarks are scripts, not tests; results go to
bench/results/ (git-ignored).

Benchmarks run from a checkout, installed or not (``python3 bench/<name>.py``): Python puts
bench/ on sys.path, and importing this module puts the checkout's root there too, so a
benchmark imports ``_common`` before the project's packages.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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
    """A table cell: ``-`` for None, 4 significant digits for a float (thousands separated),
    ints with separators."""
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


def write_results(name: str, payload: dict[str, Any], path: Path | None = None,
                  plot: Sequence[Panel] = ()) -> Path:
    """Write ``payload`` plus run metadata to ``bench/results/<name>.json`` (or ``path``),
    and, when ``plot`` has panels, the picture of them beside it (same name, ``.png``)."""
    out = path or RESULTS_DIR / f"{name}.json"
    if plot:
        write_plot(out.with_suffix(".png"), plot, title=name)
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


# Plots: a small declarative spec per panel, drawn by write_plot. matplotlib is imported only
# there (the `bench` extra), so a benchmark that does not plot runs without it.


@dataclass(frozen=True)
class Bars:
    """Grouped bars: one group per label, one bar per series (``series[name][i]`` belongs to
    ``labels[i]``; NaN leaves a gap). ``reference`` draws a dashed line, e.g. 1.0 for parity."""

    title: str
    labels: Sequence[str]
    series: Mapping[str, Sequence[float]]
    ylabel: str = ""
    reference: float | None = None


@dataclass(frozen=True)
class Cdf:
    """The empirical distribution (fraction of samples <= x) of each named sample set."""

    title: str
    samples: Mapping[str, Sequence[float]]
    xlabel: str = ""
    log_x: bool = True


@dataclass(frozen=True)
class Line:
    """One line per series over the shared ``x`` values, with markers at the points."""

    title: str
    x: Sequence[float]
    series: Mapping[str, Sequence[float]]
    xlabel: str = ""
    ylabel: str = ""


Panel = Bars | Cdf | Line


def write_plot(path: Path, panels: Sequence[Panel], title: str = "") -> Path:
    """Draw ``panels`` side by side into the PNG ``path`` (Agg backend: no display needed)."""
    import matplotlib  # noqa: PLC0415 -- the optional `bench` extra, only when plotting

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.ticker import FuncFormatter  # noqa: PLC0415

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        ax.set_title(panel.title, fontsize=10)
        ax.grid(True, alpha=0.3)
        if isinstance(panel, Bars):
            width = 0.8 / max(1, len(panel.series))
            for i, (name, values) in enumerate(panel.series.items()):
                ax.bar([j + (i - (len(panel.series) - 1) / 2) * width
                        for j in range(len(panel.labels))], values, width, label=name)
            ax.set_xticks(range(len(panel.labels)), panel.labels)
            if panel.reference is not None:
                ax.axhline(panel.reference, color="black", linestyle="--", linewidth=1)
            ax.set_ylim(top=ax.get_ylim()[1] * 1.25)  # room for the legend above the bars
            ax.set_ylabel(panel.ylabel)
        elif isinstance(panel, Cdf):
            for name, samples in panel.samples.items():
                xs = sorted(samples)
                if not xs:
                    continue
                ax.step(xs, [(k + 1) / len(xs) for k in range(len(xs))], where="post",
                        label=name)
            if panel.log_x:
                ax.set_xscale("log")
                # 2, not 2x10^0; and only 1, 2 and 5 of each decade, so the labels fit.
                plain = FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "125" else "")
                ax.xaxis.set_major_formatter(plain)
                ax.xaxis.set_minor_formatter(plain)
            ax.set_xlabel(panel.xlabel)
            ax.set_ylabel("fraction of samples <=")
        else:
            for name, values in panel.series.items():
                ax.plot(panel.x, values, marker="o", label=name)
            ax.set_xticks(list(panel.x))
            ax.set_ylim(bottom=0)  # a scaling curve read from zero, not from its minimum
            ax.set_xlabel(panel.xlabel)
            ax.set_ylabel(panel.ylabel)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


class PoolCalls:
    """The Pool facade (what the gRPC servicer calls) driven by request id, in the calls the
    lock-step scheduler loops of bench_core.py and mooncake_sim.py make of a side. The pool's
    allocate also advances its own computed tokens, so that is inside the timed call;
    ``include_tables`` goes to every allocate (False where the loop never reads the tables).
    A subclass's ``add`` calls :meth:`add_prompt` with the request's prompt."""

    def __init__(self, pool: Any, include_tables: bool = True) -> None:
        self.pool = pool
        self.include_tables = include_tables
        self.computed_tokens: dict[str, int] = {}
        self.tokens: dict[str, int] = {}
        self.preemptions: dict[str, int] = {}

    def add_prompt(self, rid: str, prompt: Sequence[int]) -> str:
        """Adds the request to the pool; answers its id (the handle the other calls take)."""
        self.tokens[rid] = self.pool.add_request(rid, prompt).num_tokens
        self.computed_tokens[rid] = 0
        self.preemptions[rid] = 0
        return rid

    def lookup(self, rid: str) -> tuple[None, int]:
        """The pool's cached prefix of the request: (None, hit tokens); the hit stays pending
        for its allocate."""
        return None, self.pool.lookup(rid).hit_tokens

    def admit(self, rid: str, n: int, blocks: Any, hit: int, has_running: bool) -> bool:
        """First allocation of ``n`` tokens, using the pending hit (the whole sequence must
        fit); False: no room."""
        return bool(self.pool.allocate(rid, n, full_sequence_must_fit=True,
                                       include_tables=self.include_tables).ok)

    def after_admit(self, rid: str, n: int, hit: int) -> None:
        """Records the hit and ``n`` tokens as computed (the pool advanced its own count
        already)."""
        self.computed_tokens[rid] = hit + n

    def allocate(self, rid: str, n: int) -> bool:
        """Room for ``n`` more tokens of a running request (no lookup); False: no room."""
        return bool(self.pool.allocate(rid, n, use_lookup=False,
                                       include_tables=self.include_tables).ok)

    def after_allocate(self, rid: str, n: int) -> None:
        """Records the ``n`` allocated tokens as computed."""
        self.computed_tokens[rid] += n

    def free(self, rid: str) -> None:
        """Frees the request in the pool."""
        self.pool.free(rid)

    def preempt(self, rid: str) -> None:
        """Preempts the request in the pool (blocks freed, request kept)."""
        self.pool.preempt(rid)

    def after_preempt(self, rid: str) -> None:
        """Records the preemption: nothing computed."""
        self.computed_tokens[rid] = 0
        self.preemptions[rid] += 1

    def append(self, rid: str, token: int) -> None:
        """Appends one decoded token in the pool and records the new token count."""
        self.tokens[rid] = self.pool.append_tokens(rid, (token,)).num_tokens

    def new_step(self) -> None:
        """Starts a scheduler step in the pool."""
        self.pool.new_step()

    def usage(self) -> float:
        """The share of the pool's blocks in use."""
        return float(self.pool.stats().usage)

    def take_events(self) -> list[Any]:
        """The KV events the pool produced since the last call."""
        return list(self.pool.take_events())

    def computed(self, rid: str) -> int:
        """The request's computed tokens as recorded here."""
        return self.computed_tokens[rid]

    def num_tokens(self, rid: str) -> int:
        """The request's tokens as the pool last answered."""
        return self.tokens[rid]

    def num_preemptions(self, rid: str) -> int:
        """How often the request was preempted."""
        return self.preemptions[rid]
