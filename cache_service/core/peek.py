"""Read-only prefix probes of one pool: the hit a prompt would get now, and what each group
holds of it (:class:`PrefixPeek`, behind :meth:`Pool.peek_prefix` and
:meth:`Pool.prefix_residency`).

A probe registers nothing, takes no references and changes no statistics. Its input is
checked as a batch's would be (the same errors, naming the same fields), and a long prompt
is checked and hashed a slice at a time (``*_in_slices``: a generator yielding between
slices), because hashing is the cost of a long prompt; the cache itself is read after the
last slice, in one piece, so the answer is the hit at that moment.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Sequence
from typing import Any

from cache_service.core.batch import BatchLimits, check_extra_keys, check_hashes, check_tokens
from cache_service.core.errors import InvalidArgument
from cache_service.core.hashing import HashFn, check_mm_items, check_prompt_embeds
from cache_service.core.kv_cache_manager import KVCacheManager
from cache_service.core.residency import (
    ExplainContext,
    ExtraKeys,
    PrefixLog,
    Residency,
    explain,
    group_residency,
)

#: A peek's checked input: (hashes or None when caching is off, hit cap, tokens or None).
PeekInput = tuple[list[bytes] | None, int, Sequence[int] | None]


def hash_in_slices(hash_fn: HashFn | None, token_ids: Sequence[int], hash_block_size: int,
                   token_limit: int, slice_blocks: int, keys: ExtraKeys, lookahead: int = 0
                   ) -> Generator[None, None, list[bytes]]:
    """The block hashes of a prompt, ``slice_blocks`` blocks at a time, yielding between
    slices (each slice's tokens checked as ``check_tokens`` would; an error names the global
    index). With ``hash_fn`` None (caching off) the tokens are only checked."""
    if isinstance(token_ids, (str, bytes)):
        raise InvalidArgument("token_ids must be a sequence of integers", field="token_ids")
    hbs = hash_block_size
    n = len(token_ids)
    step = slice_blocks * hbs
    hashes: list[bytes] = []
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        chunk = token_ids[lo:hi]
        if set(map(type, chunk)) != {int} or min(chunk) < 0 or max(chunk) >= token_limit:
            check_tokens(token_ids[:hi], token_limit)  # raises, naming the first bad one
        if hash_fn is not None:
            # A block's lookahead tokens may lie in the next slice: they are hashed
            # now and checked with it (an error there still fails the whole probe).
            hashes += keys.hash_request(
                hash_fn, token_ids, hbs, lookahead, parent=hashes[-1] if hashes else None,
                start_block=len(hashes), stop_block=hi // hbs)
        if hi < n:
            yield
    return hashes


def probe_keys(cache_salt: str | None, lora_name: str | None, lora_path: str | None,
                mm_items: Any, prompt_embeds_digests: Any) -> ExtraKeys:
    """A probe's extra keys from its request fields; the multimodal items and digests
    are checked with its tokens (:meth:`PrefixPeek.input_in_slices`), here only made
    tuples."""
    try:
        mm = tuple(tuple(item) for item in mm_items)
    except TypeError:
        raise InvalidArgument("mm_items must be a sequence of (identifier, offset, length)",
                              field="mm_items") from None
    try:
        digests = tuple(prompt_embeds_digests)
    except TypeError:
        raise InvalidArgument("prompt_embeds_digests must be a sequence of digests",
                              field="prompt_embeds_digests") from None
    return ExtraKeys(cache_salt, lora_name, lora_path, mm, digests)


class PrefixPeek:
    """The probes of one pool's cache (its manager, limits, hash function and prefix log)."""

    __slots__ = ("_manager", "_limits", "_hash_fn", "_hbs", "_log")

    def __init__(self, manager: KVCacheManager, limits: BatchLimits, hash_fn: HashFn | None,
                 log: PrefixLog) -> None:
        self._manager = manager
        self._limits = limits
        self._hash_fn = hash_fn  # None: caching is off (every probe answers 0)
        self._hbs = limits.hash_block_size
        self._log = log

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as its constructor call (the same form in both cores: restore.py).
        return PrefixPeek, (self._manager, self._limits, self._hash_fn, self._log)

    def input_in_slices(self, token_ids: Sequence[int] | None,
                        block_hashes: Sequence[bytes] | None, keys: ExtraKeys, *,
                        slice_blocks: int = 1 << 62) -> Generator[None, None, PeekInput]:
        """The checked input of a peek, hashing ``slice_blocks`` blocks at a time: (the
        prompt's hashes at this pool's recipe, or None when caching is off; the hit cap in
        tokens, the hashed length when only hashes are given; the checked tokens or
        None). Reads nothing of the cache: the routing index hashes a prompt once per
        hash identity with it."""
        if token_ids is None and block_hashes is None:
            raise InvalidArgument("give token_ids or block_hashes", field="token_ids")
        check_extra_keys(keys.cache_salt, keys.lora_name, keys.lora_path)
        if (keys.mm_items or keys.prompt_embeds) and token_ids is not None:
            n = len(token_ids)
            keys = dataclasses.replace(
                keys, mm_items=check_mm_items(keys.mm_items, n) if keys.mm_items else (),
                prompt_embeds=check_prompt_embeds(keys.prompt_embeds, n, self._hbs)
                if keys.prompt_embeds else ())
        lookahead = self._limits.recipe.num_hash_lookahead_tokens
        hashes: list[bytes] | None
        tokens: Sequence[int] | None
        limit = self._limits.token_limit
        if (token_ids is not None and block_hashes is None
                and len(token_ids) > slice_blocks * self._hbs):
            # A long prompt: checked and hashed a slice at a time (converting or checking
            # a million token ids at once would hold the caller for a long time too).
            hashes = yield from hash_in_slices(self._hash_fn, token_ids, self._hbs, limit,
                                               slice_blocks, keys, lookahead)
            tokens = token_ids
        else:
            tokens = None if token_ids is None else check_tokens(token_ids, limit)
            hashes = None if block_hashes is None else check_hashes(
                block_hashes, None if tokens is None else len(tokens), self._limits)
            if hashes is None and tokens is not None and self._hash_fn is not None:
                hashes = keys.hash_request(self._hash_fn, tokens, self._hbs, lookahead)
        if self._hash_fn is None or hashes is None:
            return None, 0, tokens
        max_len = len(tokens) - 1 if tokens is not None else len(hashes) * self._hbs
        return hashes, max_len, tokens

    def residency_in_slices(self, token_ids: Sequence[int] | None,
                            block_hashes: Sequence[bytes] | None, keys: ExtraKeys, *,
                            groups: bool, explain_misses: bool, slice_blocks: int
                            ) -> Generator[None, None, Residency]:
        """The hit (and with ``groups`` every group's reach, with ``explain_misses`` every
        group's miss reason) of a prompt given as tokens, client hashes or both (then the
        hashes are looked up and checked against the pool's recipe)."""
        hashes, max_len, tokens = yield from self.input_in_slices(
            token_ids, block_hashes, keys, slice_blocks=slice_blocks)
        coordinator = self._manager.coordinator
        if hashes is None:
            return Residency(0, group_residency(coordinator.managers, (), 0,
                                                self._manager.pool) if groups else [])
        block_pool = self._manager.pool
        _, hit, _ = coordinator.find_longest_cache_hit(hashes, max_len, block_pool)
        host_hit: int | None = None
        if coordinator.host_view is not None:
            _, host_hit, _ = coordinator.find_longest_cache_hit(hashes, max_len)
        if not groups and not explain_misses:
            return Residency(hit, [], host_hit)
        return self.residency(hashes, max_len, hit, tokens, keys,
                              client_hashes=block_hashes is not None,
                              explain_misses=explain_misses, host_hit=host_hit)

    def residency(self, hashes: Sequence[bytes], max_len: int, hit: int,
                  tokens: Sequence[int] | None, keys: ExtraKeys, *, client_hashes: bool,
                  explain_misses: bool, host_hit: int | None = None) -> Residency:
        """Every group's reach of ``hashes`` (capped at ``max_len``) beside the pool's
        ``hit`` (and ``host_hit``, across both tiers, with a host tier); with
        ``explain_misses`` (and caching on) every group's miss reason."""
        coordinator = self._manager.coordinator
        managers = coordinator.managers
        block_pool = self._manager.pool
        view = coordinator.host_view
        result = Residency(hit, group_residency(managers, hashes, max_len, block_pool, view),
                           host_hit if view is not None else None)
        if explain_misses and self._hash_fn is not None:
            probe = block_pool if view is None else view
            explain(result, ExplainContext(managers, probe, self._log, self._hash_fn,
                                           hashes, max_len, keys, tokens, client_hashes,
                                           self._limits.recipe.num_hash_lookahead_tokens))
        return result
