"""The per-tenant pinned-block quota against a real server with a tenants file: a tenant's
pins over all its pools are bounded by its ``max_pinned_blocks`` (a tenants-file line, else
``--tenant-max-pinned-blocks``), a pin beyond it is refused naming the prefix's field with
nothing changed, other tenants are not charged, and GetPoolStats and /metrics show the
pinned blocks per tenant."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from cache_service.client import AllocateResult, CacheClient, CacheError, StepBuilder
from kvcache_common.launch import ServerProcess, start_cache_service

from .builders import full_layers

SYSTEM = list(range(1, 130))  # 129 tokens: a pin of 8 blocks of 16
TENANTS_FILE = """\
tok-a   a   max_pinned_blocks=12
tok-b   b
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    path: Path = tmp_path_factory.mktemp("tenants") / "tenants"
    path.write_text(TENANTS_FILE)
    with start_cache_service("--auth-tokens-file", str(path), "--metrics-port", "0",
                             "--tenant-max-pinned-blocks", "16") as srv:
        yield srv
    assert srv.returncode == 0, srv.output()


def _cached(client: CacheClient, pool: str) -> None:
    """Registers ``pool`` and caches SYSTEM in it."""
    client.register_pool(pool, full_layers(), num_blocks=129, max_model_len=1024)
    step = client.step_batch(StepBuilder(pool).add("sys", SYSTEM).allocate("sys", len(SYSTEM)))
    assert step.result(1, AllocateResult).ok
    client.step_batch(StepBuilder(pool).free("sys"))


def _view(client: CacheClient, pool: str) -> tuple:
    """What a refused pin must not change: the pool's stats but the refusal counter, and its
    cached blocks."""
    stats = client.stats(pool)
    snapshot = client.prefix_snapshot(pool)
    return (stats.num_pins, stats.num_pinned_blocks, stats.num_free_blocks,
            stats.num_cached_blocks, stats.evictions, snapshot.SerializeToString())


def _tenant_pinned(server: ServerProcess, tenant: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                  timeout=10).read().decode()
    found = re.search(rf'^kvcache_tenant_pinned_blocks\{{tenant="{tenant}"\}} (\S+)$', body,
                      re.M)
    assert found, body
    return float(found.group(1))


def test_a_tenant_quota_bounds_its_pins_over_all_its_pools(server: ServerProcess) -> None:
    with CacheClient(server.target, token="tok-a") as a, \
            CacheClient(server.target, token="tok-b") as b:
        for pool in ("p1", "p2"):
            _cached(a, pool)
        _cached(b, "p1")  # tenant b's own p1
        a.pin_prefix("p1", "s1", SYSTEM, ttl_seconds=600)
        before = _view(a, "p2")
        refusals = a.stats("p2").pin_refusals
        with pytest.raises(CacheError) as over:  # 8 + 8 > 12, though p2 has no pin
            a.pin_prefix("p2", "s2", SYSTEM, ttl_seconds=600)
        assert (over.value.code, over.value.field) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                       "token_ids")
        assert "tenant 'a' has 8 pinned blocks" in over.value.message
        assert "(max_pinned_blocks) of 12" in over.value.message
        assert _view(a, "p2") == before
        assert a.stats("p2").pin_refusals == refusals + 1
        with pytest.raises(CacheError):  # the refused id was not taken: still refused alike
            a.pin_prefix("p2", "s2", SYSTEM, ttl_seconds=600)
        # Exactly up to the quota is fine: 8 + 4.
        assert a.pin_prefix("p2", "half", SYSTEM[:65], ttl_seconds=600).num_blocks == 4
        # Tenant b is charged nothing of a's pins; its quota is the server default (16).
        assert b.pin_prefix("p1", "s1", SYSTEM, ttl_seconds=600).num_blocks == 8
        assert b.pin_prefix("p1", "s1-again", SYSTEM[:113], ttl_seconds=600).num_blocks == 7
        with pytest.raises(CacheError) as b_over:  # 15 + 4 > 16
            b.pin_prefix("p1", "more", SYSTEM[:65], ttl_seconds=600)
        assert "(max_pinned_blocks) of 16" in b_over.value.message
        pinned = {(t, p): c.stats(p).tenant_pinned_blocks
                  for t, c, pools in (("a", a, ("p1", "p2")), ("b", b, ("p1",)))
                  for p in pools}
        assert pinned == {("a", "p1"): 12, ("a", "p2"): 12, ("b", "p1"): 15}
        assert (_tenant_pinned(server, "a"), _tenant_pinned(server, "b")) == (12.0, 15.0)
        # Dropping a pin gives the tenant room back, in any of its pools.
        a.drop_pin("p1", "s1")
        assert a.pin_prefix("p2", "s2", SYSTEM, ttl_seconds=600).num_blocks == 8
        assert a.stats("p1").tenant_pinned_blocks == 12
        for pool in ("p1", "p2"):
            a.delete_pool(pool)
        b.delete_pool("p1")


def test_a_growing_pin_is_charged_what_it_may_hold(server: ServerProcess) -> None:
    """A pin on a prefix not cached yet is charged its bound (8 blocks here) against the
    tenant quota at once, so caching the prefix later can never take the tenant over it."""
    with CacheClient(server.target, token="tok-a") as a:
        a.register_pool("g", full_layers(), num_blocks=129, max_model_len=1024)
        pin = a.pin_prefix("g", "later", SYSTEM, ttl_seconds=600)
        assert (pin.growing, pin.num_blocks, a.stats("g").tenant_pinned_blocks) == (True, 0, 8)
        with pytest.raises(CacheError) as over:
            a.pin_prefix("g", "more", SYSTEM[:81], ttl_seconds=600)  # 8 + 5 > 12
        assert over.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        a.delete_pool("g")
