"""``kvcache-ctl top``: pools as rows, refreshed every ``--interval`` seconds.

Columns: blocks used / cached / free, hit rate (cumulative), evictions/s, Steps/s and p99
Step latency over the last interval (from the server's ``kvcache_pool_step_seconds``
histogram on /metrics; ``-`` when /metrics cannot be read), open sessions holding requests
in the pool. Keys: q quits; u h e s p c n sort by usage, hit rate, evictions/s, Steps/s,
p99, sessions, name. Fits 80x24: pool names are cut, rows beyond the screen are left out
(the header says how many).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import select
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from cache_service.ctl.views import Row, pool_row

#: sort key -> (column, descending)
SORT_KEYS = {"u": "usage", "h": "hit", "e": "evictions", "s": "steps", "p": "p99",
             "c": "sessions", "n": "pool"}
_ROW_VALUE = {"usage": "usage", "hit": "hit_rate", "evictions": "evictions_per_s",
              "steps": "steps_per_s", "p99": "p99_ms", "sessions": "sessions", "pool": "pool"}


@dataclass
class StepHistogram:
    """One pool's cumulative ``kvcache_pool_step_seconds`` buckets (upper bound -> count)."""

    count: float = 0.0
    buckets: dict[float, float] = field(default_factory=dict)


def scrape_steps(url: str, timeout: float) -> dict[str, StepHistogram] | None:
    """Per-pool Step histograms from /metrics; None if it cannot be read."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310
            text = response.read().decode()
    except (OSError, ValueError):
        return None
    out: dict[str, StepHistogram] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "kvcache_pool_step_seconds":
            continue
        for sample in family.samples:
            h = out.setdefault(sample.labels.get("pool", ""), StepHistogram())
            if sample.name.endswith("_count"):
                h.count = sample.value
            elif sample.name.endswith("_bucket"):
                h.buckets[float(sample.labels["le"])] = sample.value
    return out


def p99_seconds(now: StepHistogram, before: StepHistogram | None) -> float | None:
    """The bucket upper bound holding the 99th percentile of the Steps between two scrapes
    (of all Steps without an earlier scrape); None without Steps."""
    count = now.count - (before.count if before else 0.0)
    if count <= 0:
        return None
    for le in sorted(now.buckets):
        done = now.buckets[le] - (before.buckets.get(le, 0.0) if before else 0.0)
        if done >= 0.99 * count:
            return le
    return math.inf


@dataclass
class Sample:
    at: float
    rows: list[Row]
    steps: dict[str, StepHistogram] | None


def default_metrics_url(target: str) -> str:
    """The /metrics address of the first target's host on the default metrics port (9400)."""
    host = target.split(",")[0].rpartition(":")[0] or "127.0.0.1"
    return f"http://{host}:9400/metrics"


def take_sample(client: Any, metrics_url: str, timeout: float) -> Sample:
    """One sample: every pool's row (stats and sessions holding requests in it) and the Step
    latency histograms, timestamped."""
    rows = [pool_row(info, client.stats(info.pool_id)) for info in client.list_pools()]
    sessions: dict[str, int] = {}
    for s in client.list_sessions().sessions:
        for p in s.pools:
            sessions[p.pool_id] = sessions.get(p.pool_id, 0) + 1
    for r in rows:
        r["sessions"] = sessions.get(r["pool"], 0)
    return Sample(time.monotonic(), rows, scrape_steps(metrics_url, timeout))


def rates(now: Sample, before: Sample | None) -> list[Row]:
    """``now``'s rows with evictions/s, Steps/s and p99 (ms) since ``before``."""
    old = {r["pool"]: r for r in before.rows} if before else {}
    span = max(now.at - before.at, 1e-6) if before else 0.0
    for r in now.rows:
        prev = old.get(r["pool"])
        r["evictions_per_s"] = (r["evictions"] - prev["evictions"]) / span if prev else 0.0
        r["steps_per_s"] = r["p99_ms"] = None
        if now.steps is not None:
            h = now.steps.get(r["pool"], StepHistogram())
            h_before = before.steps.get(r["pool"]) if before and before.steps else None
            if before is not None and before.steps is not None:
                r["steps_per_s"] = (h.count - (h_before.count if h_before else 0.0)) / span
            p99 = p99_seconds(h, h_before if before else None)
            r["p99_ms"] = p99 * 1000 if p99 is not None else None
    return now.rows


def _fmt(value: float | None, spec: str) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return ">10s"
    return format(value, spec)


def frame(rows: list[Row], *, target: str, sort: str, metrics_ok: bool,
          height: int) -> Group:
    """The screen: a header line and the pools table, at most ``height`` lines."""
    key = _ROW_VALUE[sort]
    ordered = sorted(rows, key=lambda r: (r[key] is None, r[key] if sort == "pool"
                                          else -(r[key] or 0), r["pool"]))
    room = max(1, height - 6)  # header, blank, table title + header + rules
    shown = ordered[:room]
    table = Table(box=None, pad_edge=False, expand=False, header_style="bold reverse")
    for name, width in (("POOL", 16), ("USED", 7), ("CACHED", 7), ("FREE", 7), ("HIT%", 6),
                        ("EVIC/s", 7), ("STEP/s", 7), ("P99ms", 6), ("SESS", 4)):
        table.add_column(name, justify="left" if name == "POOL" else "right",
                         no_wrap=True, max_width=width, overflow="ellipsis")
    for r in shown:
        table.add_row(r["pool"], str(r["used"]), str(r["cached"]), str(r["free"]),
                      f"{r['hit_rate'] * 100:.1f}", _fmt(r["evictions_per_s"], ".1f"),
                      _fmt(r["steps_per_s"], ".1f"), _fmt(r["p99_ms"], ".2f"),
                      str(r["sessions"]))
    more = f" ({len(rows) - len(shown)} more)" if len(rows) > len(shown) else ""
    metrics = "" if metrics_ok else " | no /metrics: --metrics-url"
    header = Text(f"kvcache-ctl top {target[:24]} {time.strftime('%H:%M:%S')} "
                  f"{len(rows)} pools{more} sort:{sort}{metrics}", no_wrap=True,
                  overflow="ellipsis")
    keys = Text("q quit  sort: u usage h hit e evic s steps p p99 c sess n name",
                style="dim", no_wrap=True, overflow="ellipsis")
    return Group(header, keys, table)


@contextlib.contextmanager
def _keys() -> Iterator[bool]:
    """stdin in cbreak mode (keys arrive one by one, unechoed) while inside; yields whether
    stdin is a terminal."""
    if not sys.stdin.isatty():
        yield False
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _wait_key(seconds: float, tty_in: bool) -> str:
    """A key pressed within ``seconds`` ("" if none): the refresh timer and the keyboard."""
    if not tty_in:
        time.sleep(seconds)
        return ""
    ready, _, _ = select.select([sys.stdin], [], [], seconds)
    return os.read(sys.stdin.fileno(), 1).decode(errors="ignore") if ready else ""


def run_top(client: Any, args: argparse.Namespace, console: Console) -> int:
    """``kvcache-ctl top``: a refreshing table of per-pool rates (``--once``: one frame, two
    samples ``--interval`` apart); answers the exit code."""
    url = args.metrics_url or default_metrics_url(args.target)
    sort = args.sort
    before = take_sample(client, url, args.timeout)
    if args.once:
        time.sleep(args.interval)
        now = take_sample(client, url, args.timeout)
        rows = rates(now, before)
        if args.json:
            import json

            print(json.dumps(rows, indent=2, default=str))
        else:
            console.print(frame(rows, target=args.target, sort=sort,
                                metrics_ok=now.steps is not None, height=console.height))
        return 0
    with _keys() as tty_in, Live(console=console, screen=True, auto_refresh=False) as live:
        try:
            rows = rates(before, None)
            while True:
                live.update(frame(rows, target=args.target, sort=sort,
                                  metrics_ok=before.steps is not None,
                                  height=console.height), refresh=True)
                deadline = time.monotonic() + args.interval
                while (left := deadline - time.monotonic()) > 0:
                    key = _wait_key(left, tty_in).lower()
                    if key == "q":
                        return 0
                    if key in SORT_KEYS:
                        sort = SORT_KEYS[key]
                        live.update(frame(rows, target=args.target, sort=sort,
                                          metrics_ok=before.steps is not None,
                                          height=console.height), refresh=True)
                now = take_sample(client, url, args.timeout)
                rows = rates(now, before)
                before = now
        except KeyboardInterrupt:
            return 0
