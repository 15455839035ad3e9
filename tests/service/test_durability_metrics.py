"""The durability series the alert rules use (deploy/prometheus/alerts.yml), on a real full
file system: each refused log write counts in kvcache_wal_errors_total, the last logged
record is kvcache_wal_last_index."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from cache_service.client import CacheClient, CacheError, StepBuilder
from kvcache_common.launch import start_cache_service

from .builders import hybrid_layers
from .test_wal_faults import _fill, _prompt


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.name + "".join(f"{{{v}}}" for v in s.labels.values()): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_refused_log_writes_are_counted(tmpfs: Callable[[str], Path]) -> None:
    mnt = tmpfs("size=4m")
    with start_cache_service("--data-dir", str(mnt / "data"), "--metrics-port", "0",
                             "--fsync", "always", "--snapshot-every", "1000000") as server, \
            CacheClient(server.target, default_timeout=15) as client:
        client.register_pool("p", hybrid_layers(), max_model_len=4096, num_blocks=1024)
        client.step_batch(StepBuilder("p").add("a", _prompt(0)))
        before = scrape(server.metrics_port)
        assert before["kvcache_wal_errors_total"] == 0
        assert before["kvcache_wal_last_index"] >= 2  # the pool and the add (and a session)
        assert before["kvcache_snapshots_total{failed}"] == 0
        filler = _fill(mnt)
        refused = 0
        for i in range(50):  # the log may still hold a little room past the filler
            try:
                client.step_batch(StepBuilder("p").add(f"x{i}", _prompt(1 + i)))
            except CacheError:
                refused += 1
                if refused == 2:
                    break
        assert refused == 2
        after = scrape(server.metrics_port)
        assert after["kvcache_wal_errors_total"] == 2
        assert after["kvcache_wal_last_index"] >= before["kvcache_wal_last_index"]
        filler.unlink()
