"""Validation of a whole batch of ops against a pool, before any of them is applied.

A batch is all or nothing: :meth:`Pool.apply_batch` asks :class:`BatchCheck` first and
applies only a batch that passed. The check simulates what the batch does to the state
the checks depend on (which request ids exist as adds and frees take effect, each
request's token count as appends arrive, whether it may have computed tokens), so that no
op can fail once application has started. Two rules keep the simulation exact:

* ``allocate.num_new_tokens`` is >= 1, except 0 to adopt a prefix hit that is known
  without running the batch: the request's pending lookup, still fresh, with no
  block-changing op (allocate, decode, free, preempt) earlier in the batch;
* a ``lookup`` may not follow an ``allocate`` of the same request in one batch (the
  allocate's outcome would decide whether the lookup is legal).

Placeholder tokens (slots allocated before their ids are known, filled by a later
``fill_placeholders``) follow the known tokens: known tokens cannot be appended behind
them; they are added only to a request in decode (every token computed, as far as the
batch can know: after an allocate of it earlier in the batch, whose outcome is unknown,
it is taken as computed); a request with nothing computed (admission) must have them
filled before it is looked up or allocated.

Errors name fields relative to the op (``num_new_tokens``); ``apply_batch`` prefixes
``ops[i].<kind>``. Every value is type-checked: replay traces deliver arbitrary JSON.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

from cache_service.core.errors import (
    DuplicateRequest,
    FailedPrecondition,
    InvalidArgument,
    KVCacheError,
    UnknownRequest,
    qualify,
)
from cache_service.core.eviction_classes import MAX_CLASS
from cache_service.core.hashing import (
    HashRecipe,
    MMItem,
    check_declared_recipe,
    check_mm_items,
    check_prompt_embeds,
)
from cache_service.core.operations import (
    TOKENS_PER_COST,
    AddRequest,
    Allocate,
    AppendTokens,
    Decode,
    FillPlaceholders,
    Free,
    Lookup,
    NewStep,
    Preempt,
    ResetHostTierOp,
    op_cost,
)
from cache_service.core.request import Request
from cache_service.core.restore import RebuiltFromFields
from cache_service.core.slices import run_to_end

MAX_REQUEST_ID_LEN = 256  # keeps hostile ids from bloating every table and event


#: A checked AddRequest: (tokens, client hashes or None, multimodal items, embedding
#: digests).
AddPlan = tuple[list[int], list[bytes] | None, tuple[MMItem, ...], tuple[bytes, ...]]


@dataclass(frozen=True, slots=True)
class BatchLimits(RebuiltFromFields):
    """The pool settings the checks need. ``token_limit``: token ids lie in [0, it)."""

    max_model_len: int
    token_limit: int
    hash_block_size: int
    digest_size: int
    enable_caching: bool
    max_new_tokens: int  # max_in_flight_tokens (default max_model_len): one allocate's cap
    recipe: HashRecipe


def check_int(value: object, name: str, *, minimum: int, maximum: int | None = None) -> int:
    """``value`` if it is an int (not a bool) in [minimum, maximum]."""
    if type(value) is not int or value < minimum or (maximum is not None and value > maximum):
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise InvalidArgument(f"{name} must be an integer {bound}, got {value!r}", field=name)
    return value


def check_tokens(token_ids: Any, limit: int, name: str = "token_ids") -> list[int]:
    """A non-empty list of int token ids in [0, limit)."""
    if isinstance(token_ids, (str, bytes)):
        raise InvalidArgument(f"{name} must be a sequence of integers", field=name)
    try:
        tokens = list(token_ids)
    except TypeError:
        raise InvalidArgument(f"{name} must be a sequence of integers", field=name) from None
    if not tokens:
        raise InvalidArgument(f"{name} must not be empty", field=name)
    # One pass: cheaper than set / min / max in both cores (callgrind: -2% on adding
    # 256-token prompts in the pure core, most of the check in the compiled one); a bad
    # value falls through to the checks that name the first one (types before ranges).
    for t in tokens:
        if type(t) is not int or t < 0 or t >= limit:
            break
    else:
        return tokens
    if set(map(type, tokens)) != {int}:
        i = next(i for i, t in enumerate(tokens) if type(t) is not int)
        raise InvalidArgument(f"{name}[{i}] must be an integer, got {tokens[i]!r}",
                              field=f"{name}[{i}]")
    if min(tokens) < 0 or max(tokens) >= limit:
        i = next(i for i, t in enumerate(tokens) if not 0 <= t < limit)
        raise InvalidArgument(f"{name}[{i}] = {tokens[i]} is out of range [0, {limit})",
                              field=f"{name}[{i}]")
    return tokens


def check_extra_keys(cache_salt: object, lora_name: object, lora_path: object) -> None:
    """The hash extra keys: optional strings; a LoRA path only with a LoRA name."""
    for value, name in ((cache_salt, "cache_salt"), (lora_name, "lora_name"),
                        (lora_path, "lora_path")):
        if value is not None and not isinstance(value, str):
            raise InvalidArgument(f"{name} must be a string or None", field=name)
    if lora_path is not None and lora_name is None:
        raise InvalidArgument("lora_path needs lora_name", field="lora_path")


def check_hashes(block_hashes: Any, num_tokens: int | None, limits: BatchLimits) -> list[bytes]:
    """Client block hashes: ``digest_size`` bytes each, one per full hash block."""
    try:
        hashes = list(block_hashes)
    except TypeError:
        raise InvalidArgument("block_hashes must be a sequence of bytes",
                              field="block_hashes") from None
    hbs = limits.hash_block_size
    # With lookahead hashing a block has a hash once the tokens after it exist.
    lookahead = limits.recipe.num_hash_lookahead_tokens
    if num_tokens is not None and len(hashes) != max(0, num_tokens - lookahead) // hbs:
        want = max(0, num_tokens - lookahead) // hbs
        ahead = f", {lookahead} lookahead tokens" if lookahead else ""
        raise InvalidArgument(
            f"expected {want} block hashes ({num_tokens} tokens, hash "
            f"block size {hbs}{ahead}), got {len(hashes)}", field="block_hashes")
    size = limits.digest_size
    if set(map(type, hashes)) <= {bytes} and set(map(len, hashes)) <= {size}:
        return hashes  # the usual case, checked at C speed (a long prompt's hashes)
    for i, h in enumerate(hashes):
        if not isinstance(h, (bytes, bytearray)) or len(h) != size:
            raise InvalidArgument(f"block_hashes[{i}] must be {size} bytes",
                                  field=f"block_hashes[{i}]")
    return [bytes(h) for h in hashes]


def check_request_id(rid: object, name: str = "request_id") -> str:
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_REQUEST_ID_LEN:
        raise InvalidArgument(f"request_id must be a string of 1-{MAX_REQUEST_ID_LEN} "
                              f"characters, got {rid!r:.80}", field=name)
    return rid


def _id_list(request_ids: Any) -> list[Any]:
    """``request_ids`` as a non-empty list (its items are checked where they are used)."""
    if isinstance(request_ids, (str, bytes)):
        raise InvalidArgument("request_ids must be a non-empty sequence of ids",
                              field="request_ids")
    try:
        rids = list(request_ids)
    except TypeError:
        raise InvalidArgument("request_ids must be a sequence of ids",
                              field="request_ids") from None
    if not rids:
        raise InvalidArgument("request_ids must be a non-empty sequence of ids",
                              field="request_ids")
    return rids


def check_decode_args(request_ids: Any, token_ids: Any,
                      limit: int) -> tuple[list[Any], list[int]]:
    """The checks of a decode op that need no request state: at least one request,
    distinct string ids, one token id in range per request. Answers them as lists."""
    rids = _id_list(request_ids)
    n = len(rids)
    try:
        num_tokens = len(token_ids)
    except TypeError:
        num_tokens = -1
    if num_tokens != n:
        raise InvalidArgument(f"expected one token per request ({n}), got "
                              f"{num_tokens if num_tokens >= 0 else token_ids!r}",
                              field="token_ids")
    tokens = check_tokens(token_ids, limit)
    try:
        distinct = len(set(rids)) == n
    except TypeError:  # an unhashable id
        distinct = False
    if not distinct:
        seen: set[str] = set()
        for i, rid in enumerate(rids):
            if not isinstance(rid, str):
                raise InvalidArgument(f"request_ids[{i}] must be a string, got {rid!r}",
                                      field=f"request_ids[{i}]")
            if rid in seen:
                raise InvalidArgument(f"request {rid!r} is listed twice",
                                      field=f"request_ids[{i}]")
            seen.add(rid)
    return rids, tokens


def check_placeholder_decode_args(request_ids: Any, token_ids: Any) -> list[Any]:
    """A placeholder decode op's distinct request ids; ``token_ids`` must be empty."""
    try:
        num_tokens = len(token_ids)
    except TypeError:
        num_tokens = -1
    if num_tokens != 0:
        raise InvalidArgument("token_ids must be empty with placeholders (each request "
                              "appends one placeholder token)", field="token_ids")
    rids, _ = check_decode_args(request_ids, [0] * _len_or_zero(request_ids), 1)
    return rids


def _len_or_zero(values: Any) -> int:
    try:
        return len(values)
    except TypeError:
        return 0


def check_fill_args(request_ids: Any, token_ids: Any, limit: int) -> tuple[list[Any], list[int]]:
    """A fill op's request ids (a non-empty sequence; repeats allowed) and one token id in
    range per entry."""
    rids = _id_list(request_ids)
    tokens = check_tokens(token_ids, limit)
    if len(tokens) != len(rids):
        raise InvalidArgument(f"expected one token per entry of request_ids ({len(rids)}), "
                              f"got {len(tokens)}", field="token_ids")
    return rids, tokens


@dataclass(slots=True)
class Simulated:
    """What the checks know of one request as the batch goes: whether it exists (adds and
    frees take effect), its tokens as appends arrive, whether it may have computed tokens,
    its trailing placeholders, and its computed tokens (-1: unknown, after an allocate whose
    outcome the checks cannot know)."""

    exists: bool = False
    num_tokens: int = 0  # placeholders included
    may_have_computed: bool = False
    num_placeholders: int = 0
    num_computed: int = 0

    # Written out (here and on the pool's result dataclasses): the dataclasses module's
    # generated __init__ is Python bytecode even in the compiled core, and these are built
    # per op and per request.
    def __init__(self, exists: bool = False, num_tokens: int = 0,
                 may_have_computed: bool = False, num_placeholders: int = 0,
                 num_computed: int = 0) -> None:
        self.exists = exists
        self.num_tokens = num_tokens
        self.may_have_computed = may_have_computed
        self.num_placeholders = num_placeholders
        self.num_computed = num_computed


class BatchCheck:
    """Checks one batch against a pool's requests without changing anything.

    ``pending_hit(request_id)`` answers the hit tokens of the request's pending lookup if
    it is still fresh (no block change since), else None. ``check`` answers, per op, the
    prepared arguments the pool applies (token lists, or a decode's request objects): one
    method per kind of op (``_CHECKS``)."""

    # A dict (the pool's own), not any Mapping: the compiled core then reads it with
    # native dict operations, once per request of every op.
    def __init__(self, requests: dict[str, Request], limits: BatchLimits,
                 pending_hit: Callable[[str], int | None]) -> None:
        self.requests = requests
        self.limits = limits
        self.pending_hit = pending_hit
        self.state: dict[str, Simulated] = {}  # by request id, as the batch goes
        self.blocks_moved = False  # a block-changing op came earlier in the batch
        self.allocated = False  # an allocate came earlier in the batch (it may promote)
        self.last = False  # the op being checked is the batch's last (nothing reads after)

    def check(self, op: Any) -> Any:
        """One op; answers what the apply step needs (see :meth:`Pool.apply_batch`)."""
        check = _CHECKS.get(type(op))
        if check is None:
            raise InvalidArgument(f"not an op: {op!r:.80}", field="")
        return check(self, op)

    def _state(self, rid: str) -> Simulated:
        st = self.state.get(rid)
        if st is None:
            req = self.requests.get(rid)
            st = (Simulated() if req is None
                  else Simulated(True, len(req.all_token_ids) + req.num_placeholders,
                                 req.num_computed_tokens > 0, req.num_placeholders,
                                 req.num_computed_tokens))
            self.state[rid] = st
        return st

    def _require(self, rid: object, name: str = "request_id") -> Simulated:
        if type(rid) is not str:
            check_request_id(rid, name)
        st = self._state(rid)  # type: ignore[arg-type]
        if not st.exists:
            raise UnknownRequest(f"unknown request {rid!r:.80}", field=name)
        return st

    def _grow(self, st: Simulated, rid: str, n: int, name: str) -> None:
        """``n`` more tokens, within ``max_model_len``."""
        st.num_tokens += n
        limit = self.limits.max_model_len
        if st.num_tokens > limit:
            raise InvalidArgument(f"request {rid!r} would grow to {st.num_tokens} tokens, "
                                  f"beyond max_model_len {limit}", field=name)

    def _append(self, st: Simulated, rid: str, tokens: Any, name: str) -> list[int]:
        checked = check_tokens(tokens, self.limits.token_limit, name)
        if st.num_placeholders:
            raise _placeholders_behind(st, rid, name)
        self._grow(st, rid, len(checked), name)
        return checked

    def _add_placeholders(self, st: Simulated, rid: str, n: int, name: str) -> None:
        """``n`` placeholders on a request in decode (see the module docstring)."""
        if st.num_computed >= 0 and st.num_computed != st.num_tokens:
            raise InvalidArgument(
                f"placeholder tokens are for a request in decode (every token computed); "
                f"request {rid!r} has {st.num_computed} of {st.num_tokens} tokens computed",
                field=name)
        st.num_placeholders += n
        self._grow(st, rid, n, name)

    @staticmethod
    def _no_unfilled_admission(st: Simulated, rid: str) -> None:
        if st.num_placeholders and not st.may_have_computed:
            raise InvalidArgument(
                f"request {rid!r} has nothing computed and {st.num_placeholders} placeholder "
                "token(s) unfilled; fill them (fill_placeholders) before its lookup or "
                "allocate", field="request_id")

    # -- one method per kind of op (_CHECKS) -------------------------------------------------
    def _check_allocate(self, op: Allocate) -> list[int] | None:
        """The tokens to append first (None: none). The hot path of generic decode steps:
        kept lean."""
        limits = self.limits
        rid = op.request_id
        self.allocated = True
        st = self.state.get(rid) if type(rid) is str else None
        if st is None or not st.exists:
            st = self._require(rid)
        if st.num_placeholders and not st.may_have_computed:
            self._no_unfilled_admission(st, rid)
        tokens = op.append_token_ids
        appended = self._append(st, rid, tokens, "append_token_ids") if tokens else None
        if op.num_placeholder_tokens:
            name = "num_placeholder_tokens"
            self._add_placeholders(st, rid, check_int(op.num_placeholder_tokens, name,
                                                      minimum=0,
                                                      maximum=limits.max_model_len), name)
        n = op.num_new_tokens
        if (type(n) is not int or not 1 <= n <= limits.max_new_tokens) and not (
                n == 0 and type(n) is int and self._adopts_hit(op)):
            raise InvalidArgument(
                "num_new_tokens must be an integer in [1, max_in_flight_tokens="
                f"{limits.max_new_tokens}] (0 only to adopt a fresh pending lookup "
                f"hit; split longer chunks), got {n!r}", field="num_new_tokens")
        if op.num_lookahead_tokens:
            check_int(op.num_lookahead_tokens, "num_lookahead_tokens", minimum=0,
                      maximum=limits.max_model_len)
        if op.num_encoder_tokens:
            check_int(op.num_encoder_tokens, "num_encoder_tokens", minimum=0)
        for flag in ("full_sequence_must_fit", "use_lookup", "delay_cache_blocks",
                     "include_table"):
            if type(getattr(op, flag)) is not bool:
                raise InvalidArgument(f"{flag} must be true or false", field=flag)
        st.may_have_computed = True
        st.num_computed = -1
        self.blocks_moved = True
        return appended

    def _check_append(self, op: AppendTokens) -> list[int]:
        """The tokens to append."""
        return self._append(self._require(op.request_id), op.request_id, op.token_ids,
                            "token_ids")

    def _check_add(self, op: AddRequest) -> AddPlan:
        """The prompt, the client's block hashes (None: the pool hashes), and the checked
        multimodal items and prompt-embedding digests."""
        limits = self.limits
        rid = check_request_id(op.request_id)
        st = self._state(rid)
        if st.exists:
            raise DuplicateRequest(f"request {rid!r} already exists", field="request_id")
        tokens = check_tokens(op.token_ids, limits.token_limit)
        if len(tokens) > limits.max_model_len:
            raise InvalidArgument(f"prompt of {len(tokens)} tokens is longer than "
                                  f"max_model_len {limits.max_model_len}",
                                  field="token_ids")
        check_extra_keys(op.cache_salt, op.lora_name, op.lora_path)
        if op.lora_id is not None:
            check_int(op.lora_id, "lora_id", minimum=1, maximum=(1 << 63) - 1)
            if op.lora_name is None:
                raise InvalidArgument("lora_id needs lora_name", field="lora_id")
        if op.eviction_class:
            check_int(op.eviction_class, "eviction_class", minimum=0, maximum=MAX_CLASS)
        if op.hash_recipe is not None:
            try:
                check_declared_recipe(limits.recipe, op.hash_recipe)
            except KVCacheError as exc:
                raise qualify(exc, "hash_recipe") from None
        hashes = None
        if op.block_hashes is not None:
            if not limits.enable_caching:
                raise InvalidArgument("the pool has prefix caching off; send no block "
                                      "hashes", field="block_hashes")
            hashes = check_hashes(op.block_hashes, len(tokens), limits)
        mm: tuple[MMItem, ...] = ()
        digests: tuple[bytes, ...] = ()
        if op.mm_items:
            mm = check_mm_items(op.mm_items, len(tokens))
        if op.prompt_embeds_digests:
            digests = check_prompt_embeds(op.prompt_embeds_digests, len(tokens),
                                          limits.hash_block_size)
        self.state[rid] = Simulated(True, len(tokens))
        return tokens, hashes, mm, digests

    def _check_lookup(self, op: Lookup) -> None:
        st = self._require(op.request_id)
        if st.may_have_computed:
            raise FailedPrecondition(
                f"lookup on request {op.request_id!r}, which has (or may have, after an "
                "allocate earlier in this batch) computed tokens; only requests with "
                "nothing computed can look up", field="request_id")
        self._no_unfilled_admission(st, op.request_id)

    def _check_preempt(self, op: Preempt) -> None:
        st = self._require(op.request_id)
        st.may_have_computed = False
        st.num_computed = 0
        self.blocks_moved = True

    def _check_free(self, op: Free) -> None:
        if type(op.evict_first) is not bool:
            raise InvalidArgument("evict_first must be a boolean", field="evict_first")
        if type(op.tail_first_across_groups) is not bool:
            raise InvalidArgument("tail_first_across_groups must be a boolean",
                                  field="tail_first_across_groups")
        self._require(op.request_id)
        self.state[op.request_id] = Simulated()
        self.blocks_moved = True

    def _check_new_step(self, op: NewStep) -> None:
        return None

    def _check_reset_host_tier(self, op: ResetHostTierOp) -> None:
        # An earlier allocate may have planned promotions from the slots this drops, and
        # the executor that lost them could never run those (the device blocks would be
        # cached without their data): the reset must come first.
        if self.allocated:
            raise InvalidArgument("reset_host_tier must come before every allocate of its "
                                  "batch (promotions from the dropped slots could not run)",
                                  field="")
        # A pending hit may name host slots this drops: later allocates look up again.
        self.blocks_moved = True

    def _adopts_hit(self, op: Allocate) -> bool:
        """Whether an allocate of 0 new tokens adopts a prefix hit known now (see the
        module docstring)."""
        if not op.use_lookup or self.blocks_moved:
            return False
        hit = self.pending_hit(op.request_id)
        return bool(hit)

    def _check_fill(self, op: FillPlaceholders) -> list[int]:
        """Each entry fills its request's oldest placeholder not filled by an earlier one;
        answers the token ids."""
        rids, tokens = check_fill_args(op.request_ids, op.token_ids, self.limits.token_limit)
        for i, rid in enumerate(rids):
            st = self._require(rid, f"request_ids[{i}]")
            if st.num_placeholders <= 0:
                raise InvalidArgument(f"request {rid!r} has no placeholder token left to "
                                      "fill", field=f"token_ids[{i}]")
            st.num_placeholders -= 1
        return tokens

    def _check_decode(self, op: Decode) -> list[Request] | None:
        """Per request, an allocate of 1 token with 1 appended. The pool's request
        objects when no earlier op of the batch touched them (the usual case), else None."""
        reqs = self._usual_decode(op)
        if reqs is not None:
            return reqs
        return run_to_end(self.decode_checks(op, 1 << 62))

    def _usual_decode(self, op: Decode) -> list[Request] | None:
        """:meth:`_check_decode` of the usual decode op in one pass, without a generator:
        no placeholders, every request registered, untouched earlier in the batch, in
        decode (no placeholder behind) and below ``max_model_len``. None (nothing changed
        but ``blocks_moved``) for any other op: :meth:`decode_checks` then decides, and
        names the field of an error."""
        if op.placeholders is not False:
            return None
        rids, _ = check_decode_args(op.request_ids, op.token_ids, self.limits.token_limit)
        self.blocks_moved = True
        state = self.state
        if state and not state.keys().isdisjoint(rids):
            return None
        limit = self.limits.max_model_len
        requests = self.requests
        reqs: list[Request] = []
        for rid in rids:
            req = requests.get(rid)
            if req is None or len(req.all_token_ids) >= limit or req.num_placeholders:
                return None
            reqs.append(req)
        if not self.last:  # the simulation only matters to later ops
            for rid, req in zip(rids, reqs):
                state[rid] = Simulated(True, len(req.all_token_ids) + 1, True, 0, -1)
        return reqs

    def decode_checks(self, op: Decode, slice_cost: int
                      ) -> Generator[None, None, list[Request] | None]:
        """:meth:`_check_decode` yielding after every ``slice_cost`` requests (same answer,
        same errors), so that a caller can do other work in between (on other pools)."""
        placeholders = op.placeholders
        if type(placeholders) is not bool:
            raise InvalidArgument("placeholders must be true or false", field="placeholders")
        if placeholders:
            rids = check_placeholder_decode_args(op.request_ids, op.token_ids)
        else:
            rids, _ = check_decode_args(op.request_ids, op.token_ids, self.limits.token_limit)
        self.blocks_moved = True
        state = self.state
        limit = self.limits.max_model_len
        requests = self.requests
        n = len(rids)
        if state.keys().isdisjoint(rids):
            # The usual case: nothing earlier in the batch touched these requests. Any
            # error is left to the loop below, which names the field.
            reqs: list[Request] | None = []
            simulate = not self.last  # the simulation only matters to later ops
            for lo in range(0, n, slice_cost):
                part_ids = rids[lo:lo + slice_cost]
                try:
                    part = [requests[rid] for rid in part_ids]
                except KeyError:
                    part = None
                if part is None or (
                        max([len(r.all_token_ids) + r.num_placeholders for r in part]) >= limit
                        if placeholders else
                        max(map(len, [r.all_token_ids for r in part])) >= limit
                        or any([r.num_placeholders for r in part])) or (
                        placeholders and any([r.num_computed_tokens != len(r.all_token_ids)
                                              + r.num_placeholders for r in part])):
                    if simulate:
                        for rid in rids[:lo]:  # undo: the loop below starts from scratch
                            del state[rid]
                    reqs = None
                    break
                if simulate:
                    state.update(zip(part_ids, [
                        Simulated(True, len(r.all_token_ids) + r.num_placeholders + 1, True,
                                  r.num_placeholders + placeholders, -1) for r in part]))
                reqs += part  # type: ignore[operator]
                if lo + slice_cost < n:
                    yield
            if reqs is not None:
                return reqs
        for i, rid in enumerate(rids):
            if i and not i % slice_cost:
                yield
            name = f"request_ids[{i}]"
            st = state.get(rid)
            if st is None:
                check_request_id(rid, name)
                st = self._state(rid)
            if not st.exists:
                raise UnknownRequest(f"unknown request {rid!r}", field=name)
            if placeholders:
                self._add_placeholders(st, rid, 1, name)
            else:
                if st.num_placeholders:
                    raise _placeholders_behind(st, rid, f"token_ids[{i}]")
                self._grow(st, rid, 1, f"token_ids[{i}]")
            st.may_have_computed = True
            st.num_computed = -1
        return None


def _placeholders_behind(st: Simulated, rid: str, name: str) -> InvalidArgument:
    """The error for known tokens appended behind placeholders (they go before them only:
    see the module docstring)."""
    return InvalidArgument(f"request {rid!r} ends in {st.num_placeholders} placeholder "
                           "token(s); fill them (fill_placeholders) before appending known "
                           "tokens", field=name)


#: The check of each kind of op.
_CHECKS: dict[type, Callable[[BatchCheck, Any], Any]] = {
    Allocate: BatchCheck._check_allocate,
    Decode: BatchCheck._check_decode,
    AppendTokens: BatchCheck._check_append,
    FillPlaceholders: BatchCheck._check_fill,
    AddRequest: BatchCheck._check_add,
    Lookup: BatchCheck._check_lookup,
    Free: BatchCheck._check_free,
    Preempt: BatchCheck._check_preempt,
    NewStep: BatchCheck._check_new_step,
    ResetHostTierOp: BatchCheck._check_reset_host_tier,
}


def check_batch_in_slices(check: BatchCheck, ops: Sequence[Any],
                          slice_cost: int) -> Generator[None, None, list[Any]]:
    """:func:`check_batch` yielding after about ``slice_cost`` units of work
    (:func:`ops.op_cost`; inside a big decode op and a long prompt too); same answer and
    errors."""
    out = []
    spent = 0
    last = len(ops) - 1
    for i, op in enumerate(ops):
        check.last = i == last
        try:
            if type(op) is AddRequest and _long(op.token_ids, slice_cost * TOKENS_PER_COST):
                # Only copying a long prompt out of its container is sliced here; the
                # checks then run on a plain list (tens of ms per million tokens), and
                # the pool hashes it in slices (Pool.prepare_batch_in_slices).
                tokens: list[int] = []
                step = slice_cost * TOKENS_PER_COST
                for lo in range(0, len(op.token_ids), step):
                    tokens += op.token_ids[lo:lo + step]
                    yield
                op = dataclasses.replace(op, token_ids=tokens)
            if type(op) is Decode and len(op.request_ids) > slice_cost:
                out.append((yield from check.decode_checks(op, slice_cost)))
                spent = 0
                continue
            out.append(check.check(op))
        except KVCacheError as exc:
            raise _qualify(exc, i, op) from None
        spent += op_cost(op.KIND, op)  # checked: its fields are sequences
        if spent >= slice_cost:
            spent = 0
            yield
    return out


def _long(token_ids: Any, threshold: int) -> bool:
    try:
        return not isinstance(token_ids, (str, bytes)) and len(token_ids) > threshold
    except TypeError:  # not a sequence: the check names it
        return False


def check_batch(check: BatchCheck, ops: Sequence[Any]) -> list[Any]:
    """:meth:`BatchCheck.check` of every op; the first error's field is prefixed with
    ``ops[i].<kind>``."""
    out: list[Any] = []
    append = out.append
    c = check.check
    last = len(ops) - 1
    for i, op in enumerate(ops):
        check.last = i == last
        try:
            append(c(op))
        except KVCacheError as exc:
            raise _qualify(exc, i, op) from None
    return out


def _qualify(exc: KVCacheError, i: int, op: Any) -> KVCacheError:
    kind = getattr(op, "KIND", None)
    return qualify(exc, f"ops[{i}].{kind}" if kind else f"ops[{i}]")
