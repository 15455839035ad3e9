"""KV-cache events (vLLM ``kv_events``): what prefix-aware routers subscribe to.

Hashes are published as 64-bit integers, vLLM 0.33's default:
``int.from_bytes(digest, "big") & (2**64 - 1)`` (see ``hashing.external_block_hash``).
Events are queued in operation order (an allocation that evicts then caches yields
the removals first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union


@dataclass
class BlockStored:
    """Blocks newly cached by one request in one group. ``parent_block_hash`` is the
    logical parent in the request's hash chain (None when the range starts at block
    0); ``token_ids`` covers the whole range; ``extra_keys`` has one untagged entry
    per stored block (LoRA name, salt) or None. ``spec_kind`` / ``sliding_window``
    are filled in from the group's spec when events are taken."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int = 0
    spec_kind: str | None = None
    sliding_window: int | None = None
    medium: str = "GPU"


@dataclass
class BlockRemoved:
    """One cache key dropped (eviction or explicit invalidation)."""

    block_hashes: list[int]
    group_idx: int = 0
    medium: str = "GPU"


@dataclass
class AllBlocksCleared:
    """The prefix cache was reset."""

    medium: str = field(default="GPU")


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
