"""Chained block hashes for prefix caching, bit-exact with vLLM 0.33.

The hash of block ``i`` of a request is
``hash_fn((parent, tuple(block_tokens), extra_keys))`` where ``parent`` is the hash of
block ``i-1`` (``NONE_HASH`` for block 0). Every hash therefore fingerprints the whole
prefix up to the end of its block plus every extra key seen so far. Only *full* blocks
are hashed. The byte-level recipe of ``sha256_cbor`` (the cross-language one) is in
``docs/hashing.md``; ``hash_vectors.json`` holds golden vectors produced by vLLM itself.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import cbor2

from cache_service.core.errors import Checked, InvalidArgument
from cache_service.core.restore import RebuiltFromFields

HashFn = Callable[[object], bytes]

#: Seed of every chain when ``PYTHONHASHSEED`` is unset (vLLM 0.33, cryptographic hashes).
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"

_sha256 = hashlib.sha256
_pickle_dumps = pickle.dumps
_PROTOCOL = pickle.HIGHEST_PROTOCOL
_cbor_dumps = cbor2.dumps


def sha256_pickle(obj: object) -> bytes:
    """vLLM's ``sha256``: SHA-256 of the highest-protocol pickle. Reproducible only with
    the same pickle format (CPython 3.8+ protocol 5), so not across languages."""
    return _sha256(_pickle_dumps(obj, protocol=_PROTOCOL)).digest()


def sha256_cbor(obj: object) -> bytes:
    """vLLM's ``sha256_cbor``: SHA-256 of canonical CBOR (tuples become arrays, bytes
    byte strings, None null); reproducible in any language."""
    return _sha256(_cbor_dumps(obj, canonical=True)).digest()


HASH_FUNCTIONS: dict[str, HashFn] = {
    "sha256": sha256_pickle,
    "sha256_cbor": sha256_cbor,
}


def get_hash_fn(algo: Checked[str]) -> HashFn:
    """The hash function named ``algo`` (``"sha256"`` or ``"sha256_cbor"``)."""
    try:
        return HASH_FUNCTIONS[algo]
    except (KeyError, TypeError):
        raise InvalidArgument(
            f"unknown hash algorithm {algo!r}; expected one of {sorted(HASH_FUNCTIONS)}",
            field="hash_algo",
        ) from None


_none_hashes: dict[tuple[HashFn, str], bytes] = {}


def none_hash_seed() -> str:
    """The seed of every chain: ``$PYTHONHASHSEED`` if set, else ``"vllm-none-hash"``."""
    return os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)


def none_hash(hash_fn: HashFn) -> bytes:
    """The parent hash of every chain's first block: ``hash_fn(seed)``, seed =
    ``$PYTHONHASHSEED`` if set, else ``"vllm-none-hash"`` (so that independent processes
    agree). Cached per (hash function, seed): the seed is re-read so that a changed
    environment is never answered from a stale cache."""
    seed = none_hash_seed()
    key = (hash_fn, seed)
    h = _none_hashes.get(key)
    if h is None:
        h = _none_hashes[key] = hash_fn(seed)
    return h


#: A block's tagged extra keys: ``("lora", name, path)``, ``("mm", identifier,
#: relative offset)``, ``("cache_salt", salt)``, ``("prompt_embeds", digest)``.
ExtraKeys = tuple[tuple[object, ...], ...]

#: A multimodal item of a prompt: (identifier, offset, length) of its placeholder tokens.
MMItem = tuple[str, int, int]
MMItems = Sequence[MMItem]
#: Per-block prompt-embedding digests (:func:`prompt_embeds_digests`); empty = none.
EmbedsDigests = Sequence[bytes]



def hash_block_tokens(
    hash_fn: HashFn,
    parent: bytes | None,
    token_ids: Sequence[int],
    extra_keys: ExtraKeys | None,
) -> bytes:
    """The hash of one full block whose predecessor hashed to ``parent`` (None = first block)."""
    if parent is None:
        parent = none_hash(hash_fn)
    return hash_fn((parent, tuple(token_ids), extra_keys))


def block_extra_keys(
    start: int,
    end: int,
    *,
    lora_name: str | None,
    lora_path: str | None,
    cache_salt: str | None,
) -> ExtraKeys | None:
    """Extra keys of the block covering tokens ``[start, end)`` in vLLM 0.33's tagged form:
    ``("lora", name, path)`` on every block of a LoRA request, then ``("cache_salt", salt)``
    on the block that starts at token 0 only. None when there are none (not an empty tuple:
    the two hash differently). vLLM always has a LoRA path; ``None`` is hashed as given.
    Multimodal and prompt-embedding keys: :func:`window_extra_keys`."""
    keys: list[tuple[object, ...]] = []
    if lora_name is not None:
        keys.append(("lora", lora_name, lora_path))
    if cache_salt and start == 0:  # vLLM tests truthiness: an empty salt is no salt
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def hash_request_tokens(
    hash_fn: HashFn,
    token_ids: Sequence[int],
    hash_block_size: int,
    *,
    parent: bytes | None = None,
    start_block: int = 0,
    stop_block: int | None = None,
    lora_name: str | None = None,
    lora_path: str | None = None,
    cache_salt: str | None = None,
    mm_items: MMItems = (),
    prompt_embeds: EmbedsDigests = (),
    lookahead: int = 0,
) -> list[bytes]:
    """Hashes of the full ``hash_block_size``-token blocks of ``token_ids`` from block
    ``start_block`` on (up to block ``stop_block``, exclusive, if given); a trailing
    partial block is not hashed. With ``lookahead`` L > 0 a block is hashed only once the
    L tokens after it exist, and its hash covers them (:func:`window_extra_keys`);
    ``mm_items`` / ``prompt_embeds`` add vLLM's multimodal and prompt-embedding keys
    (checked by the caller: :func:`check_mm_items`, :func:`check_prompt_embeds`).

    Incremental use: pass the request's last existing hash as ``parent`` and the number of
    hashes it already has as ``start_block``; the result equals the tail of a one-shot
    call. ``parent`` must be None exactly when ``start_block`` is 0.
    """
    if not isinstance(hash_block_size, int) or hash_block_size <= 0:
        raise InvalidArgument(f"hash_block_size must be a positive integer, got "
                              f"{hash_block_size!r}", field="hash_block_size")
    if not isinstance(start_block, int) or start_block < 0:
        raise InvalidArgument(f"start_block must be a non-negative integer, got "
                              f"{start_block!r}", field="start_block")
    if (parent is None) != (start_block == 0):
        raise InvalidArgument("parent must be given exactly when start_block > 0 "
                              "(block 0 always chains from NONE_HASH)", field="parent")
    if mm_items or prompt_embeds or lookahead:
        return _hash_with_window_keys(
            hash_fn, token_ids, hash_block_size, parent, start_block, stop_block,
            lora_name, lora_path, cache_salt, mm_items, prompt_embeds, lookahead)
    bs = hash_block_size
    num_full = len(token_ids) // bs
    if stop_block is not None:
        num_full = min(num_full, stop_block)
    if num_full <= start_block:
        return []
    # One tuple conversion of just the needed range; tuple slices are tuples already.
    toks = tuple(token_ids[start_block * bs: num_full * bs])
    if parent is None:
        parent = none_hash(hash_fn)
    lora_key = None if lora_name is None else ("lora", lora_name, lora_path)
    # The extra keys are the same for every block except block 0 (which alone carries
    # the salt), so they are built once.
    rest_keys = None if lora_key is None else (lora_key,)
    hashes: list[bytes] = []
    append = hashes.append
    offset = 0
    block = start_block
    if block == 0:
        first_keys = block_extra_keys(0, bs, lora_name=lora_name, lora_path=lora_path,
                                      cache_salt=cache_salt)
        parent = hash_fn((parent, toks[:bs], first_keys))
        append(parent)
        offset = bs
    end = len(toks)
    while offset < end:
        parent = hash_fn((parent, toks[offset: offset + bs], rest_keys))
        append(parent)
        offset += bs
    return hashes


#: SHA-256 of no bytes: the embedding digest of a block whose window lies past the
#: prompt's embedding rows (vLLM hashes the empty slice).
EMPTY_EMBEDS_DIGEST = hashlib.sha256(b"").digest()


def window_extra_keys(
    start: int,
    window_end: int,
    *,
    lora_key: tuple[str | None, ...] | None,
    cache_salt: str | None,
    mm_items: MMItems,
    embeds_digest: bytes | None,
) -> ExtraKeys | None:
    """vLLM 0.33's tagged extra keys of the block starting at token ``start`` whose hash
    window ends at ``window_end`` (the block's end, plus the lookahead tokens), in vLLM's
    order: the LoRA key; ``("mm", identifier, offset - start)`` for every item (sorted by
    offset, non-overlapping) whose placeholder overlaps ``[start, window_end)`` -- the
    relative offset is negative for an item that began in an earlier block; the salt
    (block 0 only); ``("prompt_embeds", digest)``. None when there are none."""
    keys: list[tuple[object, ...]] = []
    if lora_key is not None:
        keys.append(lora_key)
    if mm_items:
        # The first item ending after ``start``; items are sorted by offset and do not
        # overlap, so their ends are sorted too.
        lo, hi = 0, len(mm_items)
        while lo < hi:
            mid = (lo + hi) // 2
            item = mm_items[mid]
            if item[1] + item[2] <= start:
                lo = mid + 1
            else:
                hi = mid
        for i in range(lo, len(mm_items)):
            ident, offset, _length = mm_items[i]
            if offset >= window_end:
                break
            keys.append(("mm", ident, offset - start))
    if cache_salt and start == 0:
        keys.append(("cache_salt", cache_salt))
    if embeds_digest is not None:
        keys.append(("prompt_embeds", embeds_digest))
    return tuple(keys) if keys else None


def _hash_with_window_keys(
    hash_fn: HashFn, token_ids: Sequence[int], bs: int, parent: bytes | None,
    start_block: int, stop_block: int | None, lora_name: str | None,
    lora_path: str | None, cache_salt: str | None, mm_items: MMItems,
    prompt_embeds: EmbedsDigests, lookahead: int,
) -> list[bytes]:
    """:func:`hash_request_tokens` with multimodal / prompt-embedding keys or lookahead
    (the general, slower path; the plain one never comes here)."""
    num_full = (len(token_ids) - lookahead) // bs
    if stop_block is not None:
        num_full = min(num_full, stop_block)
    if num_full <= start_block:
        return []
    if parent is None:
        parent = none_hash(hash_fn)
    lora_key = None if lora_name is None else ("lora", lora_name, lora_path)
    num_digests = len(prompt_embeds)
    hashes: list[bytes] = []
    for block in range(start_block, num_full):
        start = block * bs
        end = start + bs
        digest: bytes | None = None
        if num_digests:
            digest = prompt_embeds[block] if block < num_digests else EMPTY_EMBEDS_DIGEST
        keys = window_extra_keys(start, end + lookahead, lora_key=lora_key,
                                 cache_salt=cache_salt, mm_items=mm_items,
                                 embeds_digest=digest)
        extra: object = keys
        if lookahead == 1:
            extra = (keys, token_ids[end])
        elif lookahead:
            extra = (keys, *token_ids[end:end + lookahead])
        parent = hash_fn((parent, tuple(token_ids[start:end]), extra))
        hashes.append(parent)
    return hashes


def prompt_embeds_digests(rows: bytes, num_rows: int, hash_block_size: int,
                          lookahead: int = 0) -> list[bytes]:
    """The per-block digests a request with prompt embeddings sends (docs/hashing.md):
    ``rows`` is the embedding matrix's raw bytes, row-major, ``num_rows`` rows (one per
    prompt token) of equal size, in the dtype the engine holds them in. Digest ``i`` is
    SHA-256 of rows ``[i*B, min((i+1)*B + lookahead, num_rows))``: the rows of block
    ``i``'s hash window, as vLLM 0.33 hashes its prompt_embeds tensor. One digest per
    block that has a row (``ceil(num_rows / B)``)."""
    if num_rows <= 0 or len(rows) % num_rows:
        raise InvalidArgument(f"{len(rows)} bytes do not split into {num_rows} equal rows",
                              field="prompt_embeds")
    width = len(rows) // num_rows
    bs = hash_block_size
    return [_sha256(rows[i * width: min(i + bs + lookahead, num_rows) * width]).digest()
            for i in range(0, num_rows, bs)]


def check_mm_items(items: object, num_prompt_tokens: int, field: str = "mm_items"
                   ) -> tuple[MMItem, ...]:
    """Multimodal items as the hash takes them: each ``(identifier, offset, length)`` with
    a non-empty identifier, ``length >= 1`` and its placeholder inside the prompt; sorted
    by offset and non-overlapping (vLLM's engine sorts them; two items sharing a token
    have no meaning). InvalidArgument names the first bad field."""
    try:
        seq = list(items)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidArgument(f"{field} must be a sequence of (identifier, offset, length)",
                              field=field) from None
    out: list[MMItem] = []
    prev_end = 0
    for i, item in enumerate(seq):
        where = f"{field}[{i}]"
        try:
            ident, offset, length = item
        except (TypeError, ValueError):
            raise InvalidArgument(f"{where} must be (identifier, offset, length)",
                                  field=where) from None
        if not isinstance(ident, str) or not ident:
            raise InvalidArgument(f"{where}.identifier must be a non-empty string",
                                  field=f"{where}.identifier")
        if type(offset) is not int or offset < 0:
            raise InvalidArgument(f"{where}.offset must be a non-negative integer, got "
                                  f"{offset!r}", field=f"{where}.offset")
        if type(length) is not int or length < 1:
            raise InvalidArgument(f"{where}.length must be a positive integer, got "
                                  f"{length!r}", field=f"{where}.length")
        if offset + length > num_prompt_tokens:
            raise InvalidArgument(f"{where} covers tokens [{offset}, {offset + length}), past "
                                  f"the prompt's {num_prompt_tokens} tokens",
                                  field=f"{where}.length")
        if offset < prev_end:
            raise InvalidArgument(f"{where} starts at {offset}, inside or before the previous "
                                  f"item (which ends at {prev_end}): items must be sorted by "
                                  f"offset and must not overlap", field=f"{where}.offset")
        prev_end = offset + length
        out.append((ident, offset, length))
    return tuple(out)


def check_prompt_embeds(digests: object, num_prompt_tokens: int, hash_block_size: int,
                        field: str = "prompt_embeds_digests") -> tuple[bytes, ...]:
    """Per-block prompt-embedding digests: 32 bytes each, exactly one per block that has
    an embedding row (``ceil(num_prompt_tokens / hash_block_size)``), or none at all."""
    try:
        seq = list(digests)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidArgument(f"{field} must be a sequence of 32-byte digests",
                              field=field) from None
    if not seq:
        return ()
    want = -(-num_prompt_tokens // hash_block_size)
    if len(seq) != want:
        raise InvalidArgument(f"{field} has {len(seq)} digests; a prompt of "
                              f"{num_prompt_tokens} tokens with hash_block_size "
                              f"{hash_block_size} needs {want} (one per block with a row)",
                              field=field)
    for i, d in enumerate(seq):
        if not isinstance(d, bytes) or len(d) != 32:
            raise InvalidArgument(f"{field}[{i}] must be 32 bytes (a SHA-256 digest)",
                                  field=f"{field}[{i}]")
    return tuple(seq)


def external_block_hash(h: bytes) -> int:
    """The 64-bit integer published for a block hash in KV events (vLLM 0.33 default):
    the last 8 bytes of the hash as an unsigned big-endian integer."""
    return int.from_bytes(h[-8:], "big")  # == int.from_bytes(h, "big") & (2**64 - 1)


@dataclass(frozen=True)
class HashRecipe(RebuiltFromFields):
    """How the pool hashes blocks: a client that computes its own hashes (or a router that
    predicts hits) must use the same. ``none_hash = hash_fn(none_hash_seed)`` is the parent
    of every chain's first block (docs/hashing.md)."""

    hash_algo: str
    none_hash_seed: str
    none_hash: bytes
    hash_block_size: int
    #: vLLM's ``num_hash_lookahead_tokens``: tokens after each block its hash covers
    #: (docs/hashing.md#lookahead); 0 = none.
    num_hash_lookahead_tokens: int = 0


@dataclass(frozen=True, slots=True)
class DeclaredRecipe:
    """What a client says it hashes with; None = not declared (not checked)."""

    hash_algo: str | None = None
    none_hash_seed: str | None = None
    none_hash: bytes | None = None
    hash_block_size: int | None = None
    num_hash_lookahead_tokens: int | None = None


def check_declared_recipe(recipe: HashRecipe, declared: DeclaredRecipe) -> None:
    """InvalidArgument naming the first declared field that differs from ``recipe``:
    hashes computed any other way would never hit, so a mismatch is an error, not a silent
    0% hit rate."""
    for name in ("hash_algo", "none_hash_seed", "none_hash", "hash_block_size",
                 "num_hash_lookahead_tokens"):
        theirs = getattr(declared, name)
        ours = getattr(recipe, name)
        if theirs is not None and theirs != ours:
            def shown(v: object) -> str:
                return v.hex() if isinstance(v, bytes) else repr(v)
            raise InvalidArgument(f"the pool hashes with {name} {shown(ours)}, the client "
                                  f"declared {shown(theirs)}: its hashes would never hit",
                                  field=name)
