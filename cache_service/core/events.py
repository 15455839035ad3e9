"""KV-cache events (vLLM ``kv_events``): what prefix-aware routers subscribe to.

Hashes are published as 64-bit integers, vLLM 0.33's default:
``int.from_bytes(digest, "big") & (2**64 - 1)`` (see ``hashing.external_block_hash``).
Events are queued in operation order (an allocation that evicts then caches yields
the removals first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cache_service.core.restore import RebuiltFromFields


@dataclass
class BlockStored(RebuiltFromFields):
    """Blocks newly cached by one request in one group, from one caching call that
    scanned the table positions ``[start_token / block_size, end)``. Only positions that
    entered the cache are announced (null positions of sliding-window and Mamba tables,
    masked ones and stale Mamba states are not), so ``block_hashes`` may have gaps:
    ``prefix_lengths[i]`` is the prefix length (in tokens) whose hash is
    ``block_hashes[i]``. ``parent_block_hash`` is the hash of the position just before
    the range in the request's chain (None when the range starts at 0), cached or not;
    ``token_ids`` are the tokens of the whole range, from ``start_token``. Never empty:
    a call that caches nothing announces nothing. ``extra_keys`` has one untagged entry
    per stored block (LoRA name, ``(identifier, relative offset)`` per multimodal item,
    salt, prompt-embedding digest: vLLM's event form) or None. ``spec_kind`` /
    ``sliding_window`` are filled in from the group's spec when events are taken;
    ``session_id`` is the session that added the storing request (None = none), as vLLM
    0.33's events carry it. Each hash is one more cached block under that key (duplicates
    are announced again): docs/protocol.md#kv-events."""

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
    prefix_lengths: list[int] = field(default_factory=list)
    start_token: int = 0
    session_id: str | None = None
    #: With lookahead hashing (docs/hashing.md#lookahead): per stored block, the tokens
    #: after it that its hash covers (vLLM 0.33's ``lookahead_token_ids``); else None.
    lookahead_token_ids: list[list[int]] | None = None
    #: The storing request's LoRA int id (vLLM 0.33's ``lora_id``); None = none.
    lora_id: int | None = None

    # Written out, not generated: the dataclasses module's generated __init__ is Python
    # bytecode even in the compiled core, and one is built per caching call of a decode
    # step (it was most of the cost of building the event). Same signature and defaults.
    def __init__(self, block_hashes: list[int], parent_block_hash: int | None,
                 token_ids: list[int], block_size: int, lora_name: str | None = None,
                 extra_keys: list[tuple[Any, ...] | None] | None = None, group_idx: int = 0,
                 spec_kind: str | None = None, sliding_window: int | None = None,
                 medium: str = "GPU", prefix_lengths: list[int] | None = None,
                 start_token: int = 0, session_id: str | None = None,
                 lookahead_token_ids: list[list[int]] | None = None,
                 lora_id: int | None = None) -> None:
        self.block_hashes = block_hashes
        self.parent_block_hash = parent_block_hash
        self.token_ids = token_ids
        self.block_size = block_size
        self.lora_name = lora_name
        self.extra_keys = extra_keys
        self.group_idx = group_idx
        self.spec_kind = spec_kind
        self.sliding_window = sliding_window
        self.medium = medium
        self.prefix_lengths = [] if prefix_lengths is None else prefix_lengths
        self.start_token = start_token
        self.session_id = session_id
        self.lookahead_token_ids = lookahead_token_ids
        self.lora_id = lora_id


@dataclass
class BlockRemoved(RebuiltFromFields):
    """One cached block left the cache (eviction or explicit invalidation): exactly one
    hash. Another block cached under the same key keeps the key cached."""

    block_hashes: list[int]
    group_idx: int = 0
    medium: str = "GPU"


@dataclass
class AllBlocksCleared(RebuiltFromFields):
    """The prefix cache was reset."""

    medium: str = field(default="GPU")


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
