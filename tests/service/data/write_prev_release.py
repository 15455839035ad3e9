"""Writes tests/service/data/prev_release/: a --data-dir left by a SIGKILLed server of the
PREVIOUS release (a snapshot plus a log tail), and expected.json, what its clients saw
acknowledged. Run it with that release's tree (a checkout of the last landed commit):

    PYTHONPATH=<old tree> python3 tests/service/data/write_prev_release.py OUT_DIR

tests/service/test_upgrade.py starts this release on a copy of the directory and checks
that every acknowledged request, table and statistic is there. Regenerate it (from the
then previous release) when a release changes what a snapshot holds."""

from __future__ import annotations

import json
import shutil
import signal
import sys
from pathlib import Path

from cache_service.client import CacheClient, layers, ops
from kvcache_common.launch import start_cache_service

POOLS = {
    "full": [layers.full_attention("f", block_size=16, num_kv_heads=1, head_size=8)],
    "swa": [layers.full_attention("f", block_size=16, num_kv_heads=1, head_size=8),
            layers.sliding_window("s", block_size=16, sliding_window=32, num_kv_heads=1,
                                  head_size=8)],
    "mamba": [layers.full_attention("f", block_size=16, num_kv_heads=1, head_size=8),
              layers.mamba("m", block_size=16, shapes=[(4,)], dtypes=["float32"],
                         mamba_cache_mode="align")],
}


def prompt(i: int) -> list[int]:
    return [1, 2, 3, 4] * 8 + [100 + i] * (5 + i)  # a 32-token shared prefix


def main(out: Path) -> None:
    data = out / "data"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    server = start_cache_service("--data-dir", str(data), "--snapshot-every", "25")
    # Sessionless: a session would expire between writing the directory and the test.
    with CacheClient(server.target, session=False) as client:
        for pool_id, specs in POOLS.items():
            client.register_pool(pool_id, specs, max_model_len=256, num_blocks=64)
        for rnd in range(6):
            for pool_id in POOLS:
                for i in range(3):
                    rid = f"r{rnd}-{i}"
                    p = prompt(rnd * 3 + i)
                    client.step(pool_id, [ops.add(rid, p), ops.lookup(rid),
                                          ops.allocate(rid, len(p))])
                    for t in range(4):
                        client.step(pool_id, [ops.decode([rid], [7 + t])])
                    if (rnd + i) % 2:
                        client.step(pool_id, [ops.free(rid)])
            if rnd == 3:
                server.wait_for(lambda r: r.get("event") == "snapshot_written", timeout=60)
        expected: dict = {}
        for pool_id in POOLS:
            stats = client.stats(pool_id)
            reqs = {}
            for rnd in range(6):
                for i in range(3):
                    rid = f"r{rnd}-{i}"
                    if (rnd + i) % 2 == 0:
                        r = client.get_request(pool_id, rid)
                        reqs[rid] = {"num_tokens": r.num_tokens,
                                     "num_computed_tokens": r.num_computed_tokens,
                                     "block_ids": r.block_ids}
            expected[pool_id] = {
                "num_free_blocks": stats.num_free_blocks,
                "num_cached_blocks": stats.num_cached_blocks,
                "num_requests": stats.num_requests, "evictions": stats.evictions,
                "requests": reqs,
                "peek": client.peek_prefix([pool_id], prompt(99))[pool_id]}
    server.signal(signal.SIGKILL)
    server.stop()
    (out / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
