"""The cache-service image, run by testcontainers and driven from the host with the typed
client: readiness comes from the image's HEALTHCHECK, the gRPC API works through the published
port, and SIGTERM drains and exits 0 (the exit code read from the engine)."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import time

import pytest

from cache_service.client import CacheClient, layers, ops

pytestmark = pytest.mark.docker

BLOCK = 16


def _pool(client: CacheClient, pool_id: str) -> None:
    specs = [layers.full_attention(f"l{i}", block_size=BLOCK, num_kv_heads=2, head_size=64)
             for i in range(2)]
    info = client.register_pool(pool_id, specs, num_blocks=128, max_model_len=1024)
    assert info.created and info.num_blocks == 128 and len(info.groups) == 1


@pytest.fixture(scope="module")
def cache_container(cache_service_image, containers):
    container = containers.start(cache_service_image, "cache-service", publish=50051)
    yield container
    container.stop()


def test_step_and_prefix_hit_through_the_published_port(cache_container, containers):
    target = f"127.0.0.1:{containers.published_port(cache_container, 50051)}"
    prompt = list(range(1000, 1000 + 2 * BLOCK + 8))  # two full blocks and a partial one
    with CacheClient(target) as client:
        _pool(client, "docker-step")
        first = client.step("docker-step", [ops.add("r1", prompt), ops.lookup("r1"),
                                            ops.allocate("r1", len(prompt))], begin_step=True)
        added, looked, allocated = first.results
        assert added.num_block_hashes == 2 and looked.hit_tokens == 0
        assert allocated.ok and len(allocated.block_ids[0]) == 3
        assert 0 not in allocated.block_ids[0]  # block 0 is the null block
        client.step("docker-step", [ops.free("r1")], begin_step=True)

        # Same prompt again: both full blocks come from the prefix cache, same block ids.
        second = client.step("docker-step", [ops.add("r2", prompt), ops.lookup("r2"),
                                             ops.allocate("r2", len(prompt) - 2 * BLOCK)],
                             begin_step=True)
        assert second.results[1].hit_tokens == 2 * BLOCK
        assert second.results[2].block_ids[0][:2] == allocated.block_ids[0][:2]


def test_event_feed_replays_the_stored_blocks(cache_container, containers):
    target = f"127.0.0.1:{containers.published_port(cache_container, 50051)}"
    prompt = list(range(7, 7 + 3 * BLOCK))
    with CacheClient(target) as client:
        _pool(client, "docker-events")
        client.step("docker-events", [ops.add("r", prompt), ops.lookup("r"),
                                      ops.allocate("r", len(prompt))], begin_step=True)
        feed = client.subscribe_events("docker-events", from_sequence=1)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            # The feed never ends by itself; read what the step produced, with a deadline.
            events = pool.submit(lambda: list(itertools.islice(feed, 1))).result(timeout=20)
        feed.close()
    assert events[0].sequence == 1 and events[0].kind == "block_stored"
    assert len(events[0].block_hashes) == 3 and events[0].parent_block_hash is None


def test_sigterm_drains_and_exits_zero(cache_service_image, containers):
    container = containers.start(cache_service_image, "cache-drain",
                                 env={"KVCACHE_DRAIN_SECONDS": "2"}, publish=50051)
    try:
        target = f"127.0.0.1:{containers.published_port(container, 50051)}"
        prompt = list(range(BLOCK))
        with CacheClient(target) as client:
            _pool(client, "docker-drain")
            client.step("docker-drain", [ops.add("r", prompt), ops.lookup("r"),
                                         ops.allocate("r", len(prompt))], begin_step=True)
            # An open stream during shutdown. Its first event (the stored block) proves the
            # subscription has reached the server before the signal is sent.
            feed = client.subscribe_events("docker-drain", from_sequence=1)
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                assert pool.submit(next, feed).result(timeout=20).kind == "block_stored"
                drained = pool.submit(list, feed)
                wrapped = container.get_wrapped_container()
                started = time.monotonic()
                wrapped.kill(signal="SIGTERM")
                # The stream ends cleanly (no error) when the server drains.
                assert drained.result(timeout=20) == []
            exit_code = containers.wait_exit(container, timeout=30)
            elapsed = time.monotonic() - started
        logs = wrapped.logs().decode(errors="replace")
        assert exit_code == 0, logs[-2000:]
        events = [json.loads(line)["event"] for line in logs.splitlines() if line.startswith("{")]
        assert events.index("serving") < events.index("draining") < events.index("stopped")
        assert elapsed < 2 + 10  # drain grace + process exit, far from docker's SIGKILL
    finally:
        container.stop()
