"""The executor image next to the cache-service image on one docker network: the executor
registers its pool with the cache service by network alias (its HEALTHCHECK turns healthy only
then) and serves Generate through its published port; the second identical prompt is served
from the prefix cache that lives in the other container; SIGTERM ends it with exit code 0."""

from __future__ import annotations

import time

import pytest

from cache_service.client import CacheClient
from executor.client import ExecutorClient

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def stack(cache_service_image, executor_image, containers):
    cache = containers.start(cache_service_image, "cache-for-executor", publish=50051)
    executor = containers.start(executor_image, "executor", publish=50061, env={
        "KVCACHE_EXECUTOR_CACHE_SERVICE": "cache-for-executor:50051",
        "KVCACHE_EXECUTOR_POOL_ID": "docker-executor",
    })
    yield cache, executor
    executor.stop()
    cache.stop()


def test_generate_uses_the_cache_service_container(stack, containers):
    cache, executor = stack
    cache_target = f"127.0.0.1:{containers.published_port(cache, 50051)}"
    with CacheClient(cache_target) as cache_client:
        block = cache_client.get_pool("docker-executor").scheduler_block_size
    prompt = [3 + i % 500 for i in range(2 * block + 3)]  # two full blocks and a partial one
    target = f"127.0.0.1:{containers.published_port(executor, 50061)}"
    with ExecutorClient(target) as client:
        first = client.generate(prompt, max_tokens=6, timeout=120)
        second = client.generate(prompt, max_tokens=6, timeout=120)
    assert len(first.token_ids) == 6 and first.finish_reason
    assert first.prompt_tokens == len(prompt) and first.cached_tokens == 0
    # Greedy decoding of the same prompt is deterministic, and its full blocks now come
    # from the prefix cache held by the cache-service container.
    assert second.token_ids == first.token_ids
    assert second.cached_tokens == 2 * block, (block, second)

    # The engine frees a finished request in its next step, just after the last token went
    # out: wait for that step (bounded), then nothing of either request is held.
    deadline = time.monotonic() + 30
    with CacheClient(cache_target) as cache_client:
        while (stats := cache_client.stats("docker-executor")).num_requests and \
                time.monotonic() < deadline:
            time.sleep(0.05)
    assert stats.prefix_cache_hits > 0 and stats.num_requests == 0

    # The executor is PID 1 of its image too: SIGTERM reaches Python, which drains and exits 0.
    executor.get_wrapped_container().kill(signal="SIGTERM")
    assert containers.wait_exit(executor, timeout=30) == 0
