"""A router's prefix index, rebuilt from a pool's KV events alone.

Feed it every event of ``SubscribeEvents`` (in sequence order) and it answers, for a token
sequence, the hit length ``PeekPrefix`` would answer, without asking the server. It is the
reference for routers in other languages: it uses only the pool's ``PoolConfig``, the
events and the hash recipe of docs/hashing.md, with the hit rules of docs/protocol.md#kv-events.
Events of the host tier (``medium`` "CPU", docs/protocol.md#host-tier) are counted apart:
a position is cached on the device when the device counts hold it, and in either tier when
either count does (the same rules over "either tier", which is ``PoolHit.host_hit_tokens``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from cache_service.core.hashing import external_block_hash, get_hash_fn, hash_request_tokens
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.enums import HASH_ALGOS, LAYER_KINDS

# The layer kinds whose groups can hit (cross-attention never does).
_CACHEABLE = {"full_attention", "sliding_window", "chunked_local_attention", "mamba"}

Present = Callable[[int], bool]


class EventIndex:
    """Cached keys per group, counted: +1 per stored hash, -1 per removed one."""

    def __init__(self, config: pb.PoolConfig) -> None:
        self.groups = list(config.groups)
        self.hash_block_size = config.hash_block_size
        self.hash_lookahead = config.options.num_hash_lookahead_tokens
        self.enabled = config.options.enable_caching and bool(self.groups)
        self._hash_fn = get_hash_fn(HASH_ALGOS.name(config.options.hash_algo) or "sha256")
        self.kinds = [LAYER_KINDS.name(g.kind) for g in self.groups]  # by group index
        self.alignment = (config.scheduler_block_size if len(self.groups) > 1
                          else self.groups[0].block_size if self.groups else 1)
        self.counts: list[Counter[int]] = [Counter() for _ in self.groups]
        #: The host tier's keys per group (events with medium "CPU").
        self.host_counts: list[Counter[int]] = [Counter() for _ in self.groups]
        # Groups with one spec are searched jointly; full attention first (stable).
        specs: dict[tuple, list[int]] = {}
        for g in self.groups:
            key = (g.kind, g.block_size, g.sliding_window, g.attention_chunk_size,
                   g.mamba_cache_mode)
            specs.setdefault(key, []).append(g.index)
        self.spec_groups = sorted(specs.values(), key=lambda ids: not self._is_full(ids[0]))

    def _is_full(self, gid: int) -> bool:
        return self.kinds[gid] == "full_attention"

    # -- the feed ------------------------------------------------------------------------
    def apply(self, event: pb.KVEvent) -> None:
        """Applies one KV event of the pool (stored, removed, all cleared) to the mirrored
        counts."""
        kind = event.WhichOneof("event")
        if kind == "block_stored":
            stored = event.block_stored
            self._tier(stored.medium)[stored.group_idx].update(stored.block_hashes)
        elif kind == "block_removed":
            removed = event.block_removed
            counts = self._tier(removed.medium)[removed.group_idx]
            for h in removed.block_hashes:
                counts[h] -= 1
                if counts[h] <= 0:
                    del counts[h]
        else:  # ResetPrefixCache: the device cache (the host tier is reset on its own)
            for counts in self.counts:
                counts.clear()

    def _tier(self, medium: str) -> list[Counter[int]]:
        return self.host_counts if medium == "CPU" else self.counts

    def num_cached_keys(self) -> int:
        """Distinct (group, block hash) keys cached now, over all groups."""
        return sum(len(c) for c in self.counts)

    # -- hits ----------------------------------------------------------------------------
    def hit_tokens(self, token_ids: Sequence[int], *, cache_salt: str | None = None,
                   lora_name: str | None = None, lora_path: str | None = None,
                   include_host: bool = False,
                   mm_items: Sequence[tuple[str, int, int]] = (),
                   prompt_embeds_digests: Sequence[bytes] = ()) -> int:
        """The hit a request with this prompt would get from the device (capped at
        ``len - 1`` tokens); ``include_host``: across both tiers; ``mm_items`` /
        ``prompt_embeds_digests`` as docs/hashing.md section 2 (taken as valid: the pool
        would refuse bad ones)."""
        if not self.enabled or len(token_ids) < 2:
            return 0
        fine = [external_block_hash(h) for h in hash_request_tokens(
            self._hash_fn, token_ids, self.hash_block_size, lora_name=lora_name,
            lora_path=lora_path, cache_salt=cache_salt, mm_items=mm_items,
            prompt_embeds=prompt_embeds_digests, lookahead=self.hash_lookahead)]
        limit = len(token_ids) - 1
        searched: dict[int, int] = {}  # full spec group -> its (downward closed) hit
        while True:
            cur = limit
            for ids in self.spec_groups:
                if ids[0] in searched:
                    cur = min(cur, searched[ids[0]])
                    continue
                cur = self._search(ids, fine, cur, include_host)
                if self._is_full(ids[0]):
                    searched[ids[0]] = cur
            if cur >= limit:
                return limit
            limit = cur
            if len(self.spec_groups) == 2 and self._is_full(self.spec_groups[0][0]):
                return limit

    def _search(self, ids: list[int], fine: list[int], limit: int, include_host: bool) -> int:
        group = self.groups[ids[0]]
        bs = group.block_size
        k = bs // self.hash_block_size
        n = min(limit // bs, len(fine) // k)
        counts, host = self.counts, self.host_counts

        def present(i: int) -> bool:
            h = fine[(i + 1) * k - 1]
            if include_host:
                return all(h in counts[g] or h in host[g] for g in ids)
            return all(h in counts[g] for g in ids)

        kind = self.kinds[ids[0]]
        if kind not in _CACHEABLE:
            return 0
        if kind == "full_attention":
            hit = next((i for i in range(n) if not present(i)), n) * bs
            return hit - hit % self.alignment
        if kind == "sliding_window":
            return self._sliding(present, n, bs, -(-(group.sliding_window - 1) // bs))
        if kind == "chunked_local_attention":
            chunk = group.attention_chunk_size
            start = limit // chunk * chunk // bs
            end = limit // bs
            return next((i for i in range(start, end) if not present(i)), end) * bs
        # Mamba: the last checkpoint on an aligned boundary.
        for i in range(n - 1, -1, -1):
            if present(i) and (i + 1) * bs % self.alignment == 0:
                return (i + 1) * bs
        return 0

    def _sliding(self, present: Present, n: int, bs: int, need: int) -> int:
        """The last run of ``need`` cached positions ending on an aligned boundary, or
        the run that starts at position 0."""
        run = 0
        for i in range(n - 1, -1, -1):
            if not present(i):
                run = 0
            elif run or (i + 1) * bs % self.alignment == 0:
                run += 1
                if run >= need:
                    return (i + run) * bs
        hit = run * bs
        return hit - hit % self.alignment
