"""A data directory outlives an upgrade: this release starts on what a SIGKILLed server of
the previous release left (tests/service/data/prev_release/: a snapshot and a log tail,
written by data/write_prev_release.py) and every request, table and statistic its clients
saw acknowledged is there, exactly once; then it goes on serving the same pools."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from cache_service.client import CacheClient, ops
from kvcache_common.launch import start_cache_service

PREV_RELEASE = Path(__file__).resolve().parent / "data" / "prev_release"


def test_the_previous_release_data_dir_restores_everything_acknowledged(tmp_path: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(PREV_RELEASE / "data", data)
    (data / "LOCK").unlink(missing_ok=True)
    expected = json.loads((PREV_RELEASE / "expected.json").read_text())
    with start_cache_service("--data-dir", str(data)) as server, \
            CacheClient(server.target) as client:
        for pool_id, want in expected.items():
            stats = client.stats(pool_id)
            assert (stats.num_free_blocks, stats.num_cached_blocks, stats.num_requests,
                    stats.evictions) == (want["num_free_blocks"], want["num_cached_blocks"],
                                         want["num_requests"], want["evictions"]), pool_id
            for rid, seen in want["requests"].items():
                r = client.get_request(pool_id, rid)
                assert (r.num_tokens, r.num_computed_tokens, r.block_ids) == (
                    seen["num_tokens"], seen["num_computed_tokens"], seen["block_ids"]), rid
            prompt = [1, 2, 3, 4] * 8 + [199] * 104  # write_prev_release.prompt(99)
            assert client.peek_prefix([pool_id], prompt)[pool_id] == want["peek"]
            # ... and goes on serving the pool.
            client.step(pool_id, [ops.add("new", prompt[:20]), ops.allocate("new", 20)])
            assert client.get_request(pool_id, "new").num_computed_tokens == 20
            client.step(pool_id, [ops.free("new")])
    assert server.returncode == 0, server.output()
