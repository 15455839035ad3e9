"""Builders shared by the allocator-core tests (imported as ``from builders import ...``; pytest
puts tests/core on sys.path). Test modules import from here, never from each other.

Spec builders take the block size first, then the kind's own size; attention shapes and Mamba
state sizes are keyword-only (``full(16, head=64)``, ``swa(16, 128)``, ``mamba(16, state=100)``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cache_service.core.block import KVCacheBlock
from cache_service.core.block_pool import BlockPool
from cache_service.core.pool import Pool, PoolOptions
from cache_service.core.request import Request
from cache_service.core.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
)
from cache_service.replay import load_config

SAMPLES = Path(__file__).resolve().parents[2] / "cache_service" / "replay_samples"
SAMPLE_CONFIGS = sorted(p.stem for p in SAMPLES.glob("*.json"))

def full(bs: int = 16, *, head: int = 1, **kw: Any) -> FullAttentionSpec:
    """One KV head of ``head`` dims (bfloat16); ``kw``: sliding_window / attention_chunk_size."""
    return FullAttentionSpec(block_size=bs, head_size=head, **kw)


def swa(bs: int = 16, window: int = 128, *, head: int = 1) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=bs, sliding_window=window, head_size=head)


def chunked(bs: int = 16, chunk: int = 64, *, head: int = 1) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(block_size=bs, attention_chunk_size=chunk, head_size=head)


def mamba(bs: int = 16, mode: MambaCacheMode = "align", *, state: int = 1) -> MambaSpec:
    """One fp32 state of ``state`` elements per block."""
    return MambaSpec(block_size=bs, shapes=((state,),), dtypes=("float32",), mamba_cache_mode=mode)


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
    hashes = [fake_hash(i) for i in range(len(pattern))] if hashes is None else list(hashes)
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


def load_sample_config(name: str) -> dict[str, Any]:
    return json.loads((SAMPLES / f"{name}.json").read_text())


SMALL_BLOCK = 4
SMALL_MAX_LEN = 96


def small_config(name: str) -> dict[str, Any]:
    """The sample config scaled down so that random runs fill and evict the pool (block
    sizes keep their ratios to 16, so a coarser Mamba group keeps partial hits on)."""
    c = load_sample_config(name)
    c["num_blocks"] = 40
    c["max_model_len"] = SMALL_MAX_LEN
    for g in c["groups"]:
        if g["type"] == "mamba" and g.get("mamba_cache_mode") == "none":
            g["block_size"] = SMALL_MAX_LEN
        else:
            g["block_size"] = SMALL_BLOCK * max(1, g["block_size"] // 16)
        if g["type"] == "sliding_window":
            g["sliding_window"] = 10
    return c


def snapshot(p: Pool) -> tuple[Any, ...]:
    """Everything observable about a pool, to prove a rejected call changed nothing."""
    free = [b.block_id for b in p.manager.pool.free_block_queue.get_all_free_blocks()]
    reqs = {rid: (p.request_info(rid), p.block_ids(rid), p.block_hashes(rid))
            for rid in p.request_ids()}
    # Pending lookups by block id: block objects compare by identity, and twin pools (built
    # to be compared with each other) hold different objects for the same block.
    pending = {rid: ([[b.block_id for b in group] for group in blocks], hit, epoch)
               for rid, (blocks, hit, epoch) in p._pending.items()}
    return p.stats(), free, reqs, pending


def snapshot_with_events(pool: Pool) -> tuple[Any, ...]:
    """`snapshot` plus the pool's queued KV events (taken)."""
    return snapshot(pool), pool.take_events()


def cross_attention(bs: int = 16) -> CrossAttentionSpec:
    return CrossAttentionSpec(block_size=bs)


def twin_pools(name: str, *, mixed: bool = False) -> tuple[Pool, Pool]:
    """Two identical small pools of a sample config, with KV events on; ``mixed`` doubles
    the block size of every group after the first (hybrid alignment and coarse hashes)."""
    raw = small_config(name)
    if mixed:
        for g in raw["groups"][1:]:
            if g["block_size"] == SMALL_BLOCK:
                g["block_size"] = 2 * SMALL_BLOCK
    config, options = load_config(raw)
    options = dataclasses.replace(options, enable_events=True)
    return Pool(config, options), Pool(config, options)


def prefill_chunks(p: Pool, rid: str, done: int, ends: Sequence[int]) -> None:
    """Allocates ``rid`` from ``done`` computed tokens in chunks ending at ``ends`` (ends at
    or below what is done are skipped), a step each, then starts the next step."""
    for end in ends:
        if end <= done:
            continue
        p.new_step()
        assert p.allocate(rid, end - done).ok
        done = end
    p.new_step()


def prefill(p: Pool, rid: str, prompt: list[int], ends: list[int]) -> int:
    """Look up, then prefill in chunks ending at ``ends`` (after the hit), a step each;
    returns the hit."""
    p.add_request(rid, prompt)
    hit = p.lookup(rid).hit_tokens
    prefill_chunks(p, rid, hit, ends)
    p.check_invariants()
    return hit


def allocate_some(pool: Pool, rid: str, want: int) -> Any:
    """Allocates up to ``want`` of ``rid``'s tokens not yet computed (at least one), after
    its lookup's hit when nothing is computed yet; the pool's answer."""
    info = pool.request_info(rid)
    hit = pool.lookup(rid).hit_tokens if not info.num_computed_tokens else 0
    left = max(1, info.num_tokens - info.num_computed_tokens - hit)
    return pool.allocate(rid, min(want, left))
