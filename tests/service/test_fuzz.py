"""Seeded fuzzing of every RPC (streams included) over the wire, with raw-byte damage; the
oracle is in ``fuzzing.py``: documented statuses only, rejected calls change nothing, the
server stays up. ``KVCACHE_FUZZ_SEED`` / ``KVCACHE_FUZZ_CALLS`` override the seed and count;
``bench/bench_fuzz.py`` runs longer campaigns."""

from __future__ import annotations

import os

import pytest

from kvcache_common.launch import start_cache_service
from tests.metrics_text import scrape

from .fuzzing import REQUESTS, Fuzzer, undecodable_total

SEED = int(os.environ.get("KVCACHE_FUZZ_SEED", "20261201"))
CALLS = int(os.environ.get("KVCACHE_FUZZ_CALLS", "2000"))


@pytest.fixture(scope="module")
def fuzz_server():
    with start_cache_service("--metrics-port", "0", "--max-message-bytes", str(1 << 20),
                             "--max-ops-per-step", "4096", "--max-tokens-per-step", "20000",
                             "--max-peek-tokens", "20000", "--max-total-blocks", "100000",
                             "--event-buffer", "64", "--log-level", "warning") as srv:
        yield srv
    assert srv.returncode == 0, srv.output()


def test_fuzzed_calls_get_documented_statuses_and_rejected_ones_change_nothing(
        fuzz_server) -> None:
    fuzzer = Fuzzer(fuzz_server.target, fuzz_server.metrics_port, SEED)
    try:
        report = fuzzer.run(CALLS)
    finally:
        fuzzer.close()
    assert not report.failures, "\n".join(report.failures[:10])
    assert report.calls == CALLS and report.raw >= CALLS // 5
    assert set(report.by_rpc) == set(REQUESTS)  # every RPC, the streams included
    # Both outcomes are well represented: the fuzzer is neither too tame nor only noise.
    assert report.by_code.get("OK", 0) >= CALLS // 20
    assert report.by_code.get("INVALID_ARGUMENT", 0) >= CALLS // 5
    # damaged bytes were counted
    assert undecodable_total(scrape(fuzz_server.metrics_port)) >= report.raw // 3
