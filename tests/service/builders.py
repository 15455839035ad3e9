"""Builders shared by the service-tier tests: layer lists, pool options, the server's settings,
an in-memory state whose durability records every log record (and its replay and snapshot).
Test modules and conftest.py import them from here (never from conftest or each other)."""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from typing import Any

from cache_service.client import layers
from cache_service.registry import PoolRegistry
from cache_service.state import NoDurability, ServiceState, WalRecord
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb

EVENT_BUFFER = 64  # the session server's event buffer: small, so OUT_OF_RANGE is cheap to provoke


def pool_options(**kwargs: Any) -> dict[str, Any]:
    """RegisterPool keyword arguments with the tier's defaults: max_model_len 1024 and, unless a
    memory budget is given, 256 blocks."""
    kwargs.setdefault("max_model_len", 1024)
    if "available_memory_bytes" not in kwargs:
        kwargs.setdefault("num_blocks", 256)
    return kwargs


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


class Recorder(NoDurability):
    """A durability that keeps every appended record in memory; fails the next append when
    ``fail`` is set."""

    keeps_records = True

    def __init__(self) -> None:
        self.records: list[WalRecord] = []
        self.fail = False

    def append(self, record: WalRecord) -> None:
        if self.fail:
            raise OSError("disk full")
        self.records.append(record)


def fresh_state() -> tuple[ServiceState, Recorder]:
    """An in-memory service state and the durability that keeps its records."""
    recorder = Recorder()
    return ServiceState(PoolRegistry(), durability=recorder), recorder


def replayed_pool(records: Iterable[WalRecord], pool_id: str = "p") -> Any:
    """Pool ``pool_id`` of a fresh state that applied ``records`` (what recovery does with
    the write-ahead log)."""
    replayed, _ = fresh_state()
    for record in records:
        replayed.apply(record)
    return replayed.registry.get(pool_id).pool


def snapshot_copy(pool: Any) -> Any:
    """``pool`` pickled and loaded again (a snapshot pickles the pools whole), checked to keep
    its options."""
    restored = pickle.loads(pickle.dumps(pool))
    assert restored.options == pool.options
    return restored
