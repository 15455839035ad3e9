"""Per-session block quota inside a pool, over gRPC: two clients (each its own session)
share a pool with a quota; the greedy one gets "no room" once at its quota while the other
still allocates, and the quota shows in GetPoolStats-independent metrics."""

from __future__ import annotations

from cache_service.client import AllocateResult, CacheClient, StepBuilder
from kvcache_common.launch import ServerProcess
from tests.metrics_text import scrape, value

from .builders import full_layers

QUOTA = 12  # blocks per session; the pool has 255 usable


def metric(server: ServerProcess, name: str, pool: str) -> float:
    """Series ``name`` of ``pool`` on the server's /metrics page."""
    return value(scrape(server.metrics_port), name, pool=pool)


def test_a_session_at_its_quota_gets_no_room_while_another_still_allocates(
        server: ServerProcess) -> None:
    with CacheClient(server.target, default_timeout=20) as greedy, \
            CacheClient(server.target, default_timeout=20) as modest:
        info = greedy.register_pool("quota-pool", full_layers(block_size=16), num_blocks=256,
                                    max_model_len=1024, session_block_quota=QUOTA)
        assert info.raw.options.session_block_quota == QUOTA
        # Two layers of one group: a block id per 16 tokens. 5 requests x 3 blocks = 15.
        results = []
        for i in range(5):
            batch = StepBuilder("quota-pool", begin_step=True)
            batch.add(f"g{i}", [i] * 48).allocate(f"g{i}", 48)
            results.append(greedy.step_batch(batch).result(1, AllocateResult).ok)
        assert results == [True, True, True, True, False]  # 12 blocks, then no room
        step = modest.step_batch(StepBuilder("quota-pool").add("m", [9] * 64).allocate("m", 64))
        assert step.result(1, AllocateResult).ok  # the other session's allocation succeeds
        stats = modest.stats("quota-pool")
        assert stats.num_free_blocks == 255 - QUOTA - 4
        assert metric(server, "kvcache_pool_session_quota_refusals_total", "quota-pool") == 1
        assert metric(server, "kvcache_pool_session_block_quota", "quota-pool") == QUOTA
        assert metric(server, "kvcache_pool_max_session_blocks", "quota-pool") == QUOTA
        # Freeing one of its requests gives the greedy session room again.
        greedy.step_batch(StepBuilder("quota-pool").free("g0"))
        step = greedy.step_batch(StepBuilder("quota-pool").allocate("g4", 48))
        assert step.result(0, AllocateResult).ok
        greedy.delete_pool("quota-pool")
