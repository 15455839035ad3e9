"""Fixtures of the service tier: one real server subprocess per session (started the way a
user starts it: ``python -m cache_service --port 0``), clients, and pool factories.

Tests that need their own server (auth, TLS, SIGTERM) start one with
``kvcache_common.launch.start_cache_service``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import grpc
import pytest

from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.api.kvcache.v1 import cache_service_pb2_grpc as pb_grpc
from cache_service.client import CacheClient, PoolInfo, layers
from kvcache_common.launch import ServerProcess, start_cache_service

EVENT_BUFFER = 64  # small, so that OUT_OF_RANGE is cheap to provoke


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    with start_cache_service("--metrics-port", "0", "--event-buffer", str(EVENT_BUFFER),
                             "--max-ops-per-step", "4096", "--max-tokens-per-step", "100000",
                             "--max-peek-tokens", "100000",
                             "--max-message-bytes", str(4 * 1024 * 1024)) as srv:
        yield srv
    assert srv.returncode == 0, srv.output()


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> Iterator[CacheClient]:
    with CacheClient(server.target, default_timeout=20) as c:
        yield c


@pytest.fixture(scope="session")
def stub(server: ServerProcess) -> Iterator[pb_grpc.CacheServiceStub]:
    """The raw generated stub, for malformed messages the typed client cannot build."""
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.CacheServiceStub(channel)


_ids = itertools.count()


def hybrid_layers() -> list[pb.LayerSpec]:
    """2 full-attention + 2 sliding-window layers (window 32), block size 16."""
    return [
        layers.full_attention("f0", block_size=16, num_kv_heads=2, head_size=8),
        layers.sliding_window("s0", block_size=16, num_kv_heads=2, head_size=8,
                              sliding_window=32),
        layers.full_attention("f1", block_size=16, num_kv_heads=2, head_size=8),
        layers.sliding_window("s1", block_size=16, num_kv_heads=2, head_size=8,
                              sliding_window=32),
    ]


def full_layers(n: int = 2, block_size: int = 16) -> list[pb.LayerSpec]:
    return [layers.full_attention(f"l{i}", block_size=block_size, num_kv_heads=2, head_size=8)
            for i in range(n)]


@pytest.fixture
def new_pool(client: CacheClient):
    """``new_pool(layers=None, **options) -> PoolInfo``: a fresh pool with a unique id."""

    def make(layer_specs: list[pb.LayerSpec] | None = None, **kwargs) -> PoolInfo:
        kwargs.setdefault("max_model_len", 1024)
        if "available_memory_bytes" not in kwargs:
            kwargs.setdefault("num_blocks", 256)
        pool_id = kwargs.pop("pool_id", f"pool-{next(_ids)}")
        return client.register_pool(pool_id, layer_specs or full_layers(), **kwargs)

    return make
