"""Typed operations of one batch (:meth:`Pool.apply_batch`) and their outcomes.

One class per kind of scheduler operation. ``KIND`` is the op's name in error paths
(``ops[3].allocate.num_new_tokens``) and equals the protocol's oneof field name, so that
the service reports the same paths the client sent. Values are checked by the pool when
the batch is applied (any Python value may arrive here from a replay trace), never by
the constructors: the fields the pool checks are ``Checked[T]`` (errors.py), which the
compiled core reads through to its check instead of raising TypeError.

The size of an op, in one table (:data:`OP_SIZE_FIELDS`) for every place that counts it:
:func:`op_requests` and :func:`op_tokens` are what the service's per-Step limits count
(``max_ops_per_step``, ``max_tokens_per_step``), and :func:`op_cost` is the work the
service slices a long Step by (checking, hashing and applying it a slice at a time).
The protocol's ops have the same field names, so the same functions size a Step before
it is converted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from cache_service.core.errors import Checked
from cache_service.core.hashing import DeclaredRecipe


@dataclass(slots=True)
class AddRequest:
    """Register a request (state WAITING) and hash its full blocks, or adopt the
    client's ``block_hashes`` (one per full ``hash_block_size`` block)."""

    KIND: ClassVar[str] = "add_request"
    request_id: Checked[str]
    token_ids: Sequence[int]
    block_hashes: Sequence[bytes] | None = None
    cache_salt: Checked[str | None] = None
    lora_name: Checked[str | None] = None
    lora_path: Checked[str | None] = None
    hash_recipe: Checked[DeclaredRecipe | None] = None  # checked against the pool's when given
    #: Whose quota the request counts against (pools with an account block quota).
    account: Checked[str | None] = None
    #: The eviction class of the blocks it releases (:mod:`eviction_classes`); 0 = default.
    eviction_class: Checked[int] = 0
    #: Multimodal items ``(identifier, offset, length)``, sorted by offset and
    #: non-overlapping, each inside the prompt; hashed as vLLM's ``("mm", ...)`` keys.
    mm_items: Sequence[Any] = ()
    #: Per-block prompt-embedding digests (docs/hashing.md#prompt-embeddings), one per
    #: block with an embedding row, or none.
    prompt_embeds_digests: Sequence[bytes] = ()
    #: vLLM's ``LoRARequest.lora_int_id`` (>= 1; needs ``lora_name``): not hashed, only
    #: named by the BlockStored events the request triggers (vLLM's ``lora_id``).
    lora_id: Checked[int | None] = None


@dataclass(slots=True)
class Lookup:
    """The longest usable prefix hit of a request with nothing computed."""

    KIND: ClassVar[str] = "lookup"
    request_id: Checked[str]
    #: Also answer every group's reach and miss reason (PrefixHit.groups).
    explain: Checked[bool] = False


@dataclass(slots=True)
class Allocate:
    """Slots for ``num_new_tokens`` more tokens, after appending ``append_token_ids`` and
    then ``num_placeholder_tokens`` tokens whose ids are not known yet (see
    :class:`FillPlaceholders`). ``include_table=False`` leaves the outcome's whole table
    None."""

    KIND: ClassVar[str] = "allocate"
    request_id: Checked[str]
    num_new_tokens: Checked[int]
    num_lookahead_tokens: Checked[int] = 0
    full_sequence_must_fit: Checked[bool] = False
    use_lookup: Checked[bool] = True
    delay_cache_blocks: Checked[bool] = False
    include_table: Checked[bool] = True
    append_token_ids: Sequence[int] = ()
    num_encoder_tokens: Checked[int] = 0  # cross-attention input (not in the protocol)
    num_placeholder_tokens: Checked[int] = 0


@dataclass(slots=True)
class AppendTokens:
    """Append decoded tokens (newly completed blocks are hashed)."""

    KIND: ClassVar[str] = "append_tokens"
    request_id: Checked[str]
    token_ids: Sequence[int]


@dataclass(slots=True)
class Free:
    """Free a request's blocks (they stay cached) and forget it. ``evict_first`` (a
    release hint): the blocks nothing else holds go to the front of the free queue, the
    first to be evicted, instead of its back (:mod:`release_hints`).
    ``tail_first_across_groups``: release them in the order of vLLM's deferred free
    (``pop_blocks_for_free``): all groups' tables concatenated, last block first."""

    KIND: ClassVar[str] = "free"
    request_id: Checked[str]
    evict_first: Checked[bool] = False
    tail_first_across_groups: Checked[bool] = False


@dataclass(slots=True)
class Preempt:
    """Free a request's blocks but keep it (computed tokens back to 0, PREEMPTED)."""

    KIND: ClassVar[str] = "preempt"
    request_id: Checked[str]


@dataclass(slots=True)
class NewStep:
    """A scheduler step begins."""

    KIND: ClassVar[str] = "new_step"


@dataclass(slots=True)
class Decode:
    """The decode step of many requests: for each ``i``, append ``token_ids[i]`` to
    ``request_ids[i]`` and allocate one slot (an :class:`Allocate` of 1 token without
    table), answered compactly by a ``DecodeOutcome``. With ``placeholders`` each request
    appends one placeholder token instead (``token_ids`` empty): the token its running
    forward pass is sampling, whose id a later :class:`FillPlaceholders` brings."""

    KIND: ClassVar[str] = "decode"
    request_ids: Sequence[str]
    token_ids: Sequence[int]
    placeholders: Checked[bool] = False


@dataclass(slots=True)
class FillPlaceholders:
    """For each ``i`` in order, ``token_ids[i]`` becomes the id of the oldest placeholder
    token of ``request_ids[i]`` (an id may repeat: its next placeholder). Blocks whose
    tokens are then all known and computed are cached, as the allocation that computed
    them would have cached them had the ids been known."""

    KIND: ClassVar[str] = "fill_placeholders"
    request_ids: Sequence[str]
    token_ids: Sequence[int]


@dataclass(slots=True)
class ResetHostTierOp:
    """The executor's host tier lost its contents (it restarted): forget every host slot
    (docs/semantics.md#host-tier); the device pool is untouched. A no-op without a tier."""

    KIND: ClassVar[str] = "reset_host_tier"


Op = (AddRequest | Lookup | Allocate | AppendTokens | Free | Preempt | NewStep | Decode
      | FillPlaceholders | ResetHostTierOp)
#: One outcome per op: RequestInfo (add, append), PrefixHit (lookup), Allocation
#: (allocate), int = free blocks after the op (free, preempt), None (new_step),
#: DecodeOutcome (decode), int = placeholders filled (fill_placeholders), int = host
#: slots dropped (reset_host_tier).
OpOutcome = Any

#: Token ids per unit of work: checking, copying and hashing (one hash block at the usual
#: size of 16) that many tokens costs about what applying one request-op does.
TOKENS_PER_COST = 16

#: Per kind: (the field that names one request per entry, or None: the op names one
#: request; the field holding token ids, or None).
OP_SIZE_FIELDS: dict[str, tuple[str | None, str | None]] = {
    AddRequest.KIND: (None, "token_ids"),
    Lookup.KIND: (None, None),
    Allocate.KIND: (None, "append_token_ids"),
    AppendTokens.KIND: (None, "token_ids"),
    Free.KIND: (None, None),
    Preempt.KIND: (None, None),
    NewStep.KIND: (None, None),
    Decode.KIND: ("request_ids", "token_ids"),
    FillPlaceholders.KIND: ("request_ids", "token_ids"),
    ResetHostTierOp.KIND: (None, None),
}


def op_requests(kind: str, op: Any) -> int:
    """Request-ops: one per request a decode or fill op names, else one. ``op``: a core op
    or the protocol's message of that kind (a validated one: its fields are sequences)."""
    per, _ = OP_SIZE_FIELDS[kind]
    return 1 if per is None else len(getattr(op, per))


def op_tokens(kind: str, op: Any) -> int:
    """Token ids the op carries (0 for kinds without any)."""
    _, tokens = OP_SIZE_FIELDS[kind]
    return 0 if tokens is None else len(getattr(op, tokens))


def op_cost(kind: str, op: Any) -> int:
    """Units of work: one per request-op, plus one per :data:`TOKENS_PER_COST` token ids
    of an op naming one request (a decode or fill op carries one token id per request it
    names, paid for with the request)."""
    per, tokens = OP_SIZE_FIELDS[kind]
    if per is not None:
        return len(getattr(op, per))
    return 1 if tokens is None else 1 + len(getattr(op, tokens)) // TOKENS_PER_COST
