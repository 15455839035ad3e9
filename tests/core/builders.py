"""Builders shared by the allocator-core tests (imported as ``from builders import ...``)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from cache_service.core.block import KVCacheBlock
from cache_service.core.block_pool import BlockPool
from cache_service.core.pool import Pool, PoolOptions
from cache_service.core.request import Request
from cache_service.core.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

SAMPLES = Path(__file__).resolve().parents[2] / "cache_service" / "replay_samples"
SAMPLE_CONFIGS = sorted(p.stem for p in SAMPLES.glob("*.json"))


def full(bs: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs)


def swa(bs: int = 16, window: int = 128) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=bs, sliding_window=window)


def chunked(bs: int = 16, chunk: int = 64) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(block_size=bs, attention_chunk_size=chunk)


def mamba(bs: int = 16, mode: str = "align") -> MambaSpec:
    return MambaSpec(block_size=bs, shapes=((1,),), dtypes=("float32",), mamba_cache_mode=mode)


def config(num_blocks: int, *specs: KVCacheSpec) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=num_blocks, groups=tuple(
        KVCacheGroupSpec((f"layer{i}",), s) for i, s in enumerate(specs)))


def make_pool(num_blocks: int, *specs: KVCacheSpec, max_model_len: int = 4096,
              **options) -> Pool:
    return Pool(config(num_blocks, *specs), PoolOptions(max_model_len=max_model_len, **options))


def fake_hash(i: int) -> bytes:
    """A distinct 32-byte hash for position ``i`` (tests that place cache entries)."""
    return hashlib.sha256(f"block-{i}".encode()).digest()


def dummy_request(request_id: str = "r", hashes: Sequence[bytes] = ()) -> Request:
    req = Request(request_id, [1], hash_fn=None, hash_block_size=1)
    req.block_hashes = list(hashes)
    return req


def place_cached(pool: BlockPool, pattern: Sequence[bool], group_ids: Sequence[int] = (0,),
                 *, block_size: int = 1, hashes: Sequence[bytes] | None = None) -> list[bytes]:
    """Cache a free block under ``hashes[i]`` (default ``fake_hash(i)``) for each ``i``
    with ``pattern[i]`` true, in every group of ``group_ids``; returns the hash list (one
    per position)."""
    if hashes is None:
        hashes = [fake_hash(i) for i in range(len(pattern))]
    req = dummy_request(hashes=hashes)
    for gid in group_ids:
        for i, cached in enumerate(pattern):
            if cached:
                block = pool.get_new_blocks(1)[0]
                pool.cache_full_blocks(req, [block], [hashes[i]], 0, 1, block_size, gid)
                pool.free_blocks([block])
    return hashes


def table_ids(blocks: Sequence[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def load_sample_config(name: str) -> dict:
    return json.loads((SAMPLES / f"{name}.json").read_text())



def cross_attention(bs: int = 16) -> "CrossAttentionSpec":
    from cache_service.core.specs import CrossAttentionSpec

    return CrossAttentionSpec(block_size=bs)
