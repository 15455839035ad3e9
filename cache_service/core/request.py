"""The per-request state the service holds (vLLM ``v1.request.Request``, trimmed).

``block_hashes`` covers every *full* ``hash_block_size`` block of ``all_token_ids``
and is extended incrementally when tokens are appended. When prefix caching is off
no hashes are computed (as in vLLM, whose requests then get no block hasher).

``num_placeholders`` tokens follow ``all_token_ids``: slots were allocated for them
before their ids were known (an engine overlapping its next step's cache call with the
forward pass that samples them). Only known tokens are hashed, so a block holding a
placeholder is never cached nor hit; :meth:`Request.fill_placeholder` makes the oldest
one known.

With lookahead hashing (``hash_lookahead`` L > 0, a pool option) block ``i`` is hashed only
once the L tokens after it exist (docs/hashing.md#lookahead). ``mm_items`` and
``prompt_embeds`` are the multimodal / prompt-embedding hash inputs, checked by the caller.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, Final

from mypy_extensions import mypyc_attr

from cache_service.core.hashing import HashFn, MMItem, hash_request_tokens


class RequestStatus:
    """Request states that matter to the allocator (plain strings: enum attribute
    access is measurably slow on the hot path)."""

    WAITING: Final = "WAITING"
    RUNNING: Final = "RUNNING"
    PREEMPTED: Final = "PREEMPTED"


#: A request's attributes (its slots and its pickled state: a compiled class has no
#: ``__slots__`` to read back).
_FIELDS: Final = ("request_id", "all_token_ids", "num_prompt_tokens", "num_computed_tokens",
                  "status", "num_preemptions", "cache_salt", "lora_name", "lora_path",
                  "block_hashes", "_hash_fn", "_hash_block_size", "num_in_flight_tokens",
                  "client_hashes", "num_placeholders", "shared_prefix_boundary", "session_id",
                  "mm_items", "prompt_embeds", "_hash_lookahead", "lora_id", "_next_hash_at")


@mypyc_attr(allow_interpreted_subclasses=True)  # unpickled without __init__: restore.py
class Request:
    """A request registered in a pool. ``num_computed_tokens`` is advanced by the
    pool after each successful allocation (hit + new tokens)."""

    __slots__ = _FIELDS

    def __init__(self, request_id: str, token_ids: Sequence[int], *, hash_fn: HashFn | None,
                 hash_block_size: int, cache_salt: str | None = None,
                 lora_name: str | None = None, lora_path: str | None = None,
                 block_hashes: Sequence[bytes] | None = None,
                 mm_items: tuple[MMItem, ...] = (), prompt_embeds: tuple[bytes, ...] = (),
                 hash_lookahead: int = 0) -> None:
        self.request_id = request_id
        self.all_token_ids: list[int] = list(token_ids)
        self.num_prompt_tokens = len(self.all_token_ids)
        self.num_computed_tokens = 0
        # Tokens scheduled but not yet processed; always 0 for synchronous callers.
        self.num_in_flight_tokens = 0
        # Tokens after all_token_ids whose ids are not known yet.
        self.num_placeholders = 0
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        # The junction of the last lookup (a shared prefix a sparse-retention group has
        # not cached yet; 0 = none): its checkpoint is retained
        # (docs/semantics.md#checkpoint-retention).
        self.shared_prefix_boundary = 0
        # The client session that added the request (None = none): BlockStored events
        # it triggers carry it, as vLLM's do.
        self.session_id: str | None = None
        # vLLM's LoRA int id (None = none): named by the BlockStored events, not hashed.
        self.lora_id: int | None = None
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        # Hashed with the name as ("lora", name, path), as vLLM does (it always has a path).
        self.lora_path = lora_path
        self._hash_fn = hash_fn
        self._hash_block_size = hash_block_size
        self.mm_items = mm_items
        self.prompt_embeds = prompt_embeds
        self._hash_lookahead = hash_lookahead
        self.block_hashes: list[bytes] = []
        # The token count at which the next block gets its hash (-1: never, caching off):
        # the decode hot path compares one int.
        self._next_hash_at = -1
        # The leading hashes came from the client (miss reasons check their recipe).
        self.client_hashes = block_hashes is not None
        if hash_fn is not None:
            if block_hashes is not None:
                # Client-computed hashes (validated by the caller); later blocks
                # chain from the last of them.
                self.block_hashes = list(block_hashes)
            self._update_block_hashes()

    def __reduce__(self) -> tuple[Any, ...]:
        # Token ids travel as one packed array: a snapshot holds millions of them, and
        # unpickling them one int object at a time dominated the restart time.
        state = {name: getattr(self, name) for name in _FIELDS}
        state["all_token_ids"] = _pack(self.all_token_ids)
        return (_restore_request, (state,))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_tokens(self, token_ids: Sequence[int]) -> None:
        """Append output tokens and hash any block they complete."""
        self.all_token_ids.extend(token_ids)
        if self._hash_fn is not None:
            self._update_block_hashes()

    def append_token(self, token_id: int) -> None:
        """:meth:`append_tokens` of one token (the decode hot path). Hashes stay complete
        up to the last full block, so a block completes exactly when the token count
        reaches ``_next_hash_at`` (a multiple of the hash block size, plus the
        lookahead)."""
        tokens = self.all_token_ids
        tokens.append(token_id)
        if len(tokens) == self._next_hash_at:
            self._update_block_hashes()

    def fill_placeholder(self, token_id: int) -> None:
        """The oldest placeholder becomes ``token_id`` (the caller checked there is one)."""
        self.num_placeholders -= 1
        self.append_token(token_id)

    def _update_block_hashes(self) -> None:
        hashes = self.block_hashes
        bs = self._hash_block_size
        start = len(hashes)
        if (start + 1) * bs + self._hash_lookahead <= len(self.all_token_ids):
            assert self._hash_fn is not None
            hashes.extend(hash_request_tokens(
                self._hash_fn, self.all_token_ids, bs,
                parent=hashes[-1] if hashes else None, start_block=start,
                lora_name=self.lora_name, lora_path=self.lora_path,
                cache_salt=self.cache_salt, mm_items=self.mm_items,
                prompt_embeds=self.prompt_embeds, lookahead=self._hash_lookahead))
        # Every block with its tokens (and lookahead) known has a hash now, so this
        # lies past the current length.
        self._next_hash_at = (len(hashes) + 1) * bs + self._hash_lookahead


def _restore_request(state: dict[str, Any]) -> Request:
    req = Request.__new__(Request)
    req.num_placeholders = 0  # snapshots written before placeholders existed lack it
    req.shared_prefix_boundary = 0  # ... and before sparse retention
    req.session_id = None  # ... and before events named the session
    req.mm_items = ()  # ... and before multimodal / prompt-embedding keys and lookahead
    req.prompt_embeds = ()
    req._hash_lookahead = 0
    req.lora_id = None  # ... and before events named the LoRA id
    state["all_token_ids"] = state["all_token_ids"].tolist()
    for name, value in state.items():
        setattr(req, name, value)
    if "_next_hash_at" not in state:  # a snapshot from before it existed
        req._next_hash_at = -1 if req._hash_fn is None else (
            (len(req.block_hashes) + 1) * req._hash_block_size + req._hash_lookahead)
    return req


def _pack(token_ids: list[int]) -> array[int]:
    try:
        return array("i", token_ids)  # the pool's token ids lie in [0, 2**31)
    except OverflowError:
        return array("q", token_ids)
