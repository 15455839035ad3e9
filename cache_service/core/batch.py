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
from collections.abc import Callable, Generator, Mapping, Sequence
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
from cache_service.core.hashing import HashRecipe, check_declared_recipe
from cache_service.core.ops import (
    AddRequest,
    Allocate,
    AppendTokens,
    Decode,
    FillPlaceholders,
    Free,
    Lookup,
    NewStep,
    Preempt,
)
from cache_service.core.request import Request
from cache_service.core.restore import RebuiltFromFields

MAX_REQUEST_ID_LEN = 256  # keeps hostile ids from bloating every table and event


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
    if num_tokens is not None and len(hashes) != num_tokens // hbs:
        raise InvalidArgument(
            f"expected {num_tokens // hbs} block hashes ({num_tokens} tokens, hash "
            f"block size {hbs}), got {len(hashes)}", field="block_hashes")
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


class BatchCheck:
    """Checks one batch against a pool's requests without changing anything.

    ``pending_hit(request_id)`` answers the hit tokens of the request's pending lookup if
    it is still fresh (no block change since), else None. ``check`` answers, per op, the
    prepared arguments the pool applies (token lists, or a decode's request objects)."""

    def __init__(self, requests: Mapping[str, Request], limits: BatchLimits,
                 pending_hit: Callable[[str], int | None]) -> None:
        self.requests = requests
        self.limits = limits
        self.pending_hit = pending_hit
        # request id -> [exists, num_tokens (placeholders included),
        # may_have_computed_tokens, num_placeholders, num_computed_tokens (-1: unknown,
        # after an allocate)] as the batch goes (the two flags are bools, hence ints)
        self.state: dict[str, list[int]] = {}
        self.blocks_moved = False  # a block-changing op came earlier in the batch
        self.last = False  # the op being checked is the batch's last (nothing reads after)

    def _state(self, rid: str) -> list[int]:
        st = self.state.get(rid)
        if st is None:
            req = self.requests.get(rid)
            st = ([False, 0, False, 0, 0] if req is None
                  else [True, len(req.all_token_ids) + req.num_placeholders,
                        req.num_computed_tokens > 0, req.num_placeholders,
                        req.num_computed_tokens])
            self.state[rid] = st
        return st

    def _require(self, rid: object, name: str = "request_id") -> list[int]:
        if type(rid) is not str:
            check_request_id(rid, name)
        st = self._state(rid)  # type: ignore[arg-type]
        if not st[0]:
            raise UnknownRequest(f"unknown request {rid!r:.80}", field=name)
        return st

    def _append(self, st: list[int], rid: str, tokens: Any, name: str) -> list[int]:
        checked = check_tokens(tokens, self.limits.token_limit, name)
        if st[3]:
            raise InvalidArgument(f"request {rid!r} ends in {st[3]} placeholder token(s); "
                                  "fill them (fill_placeholders) before appending known "
                                  "tokens", field=name)
        st[1] += len(checked)
        limit = self.limits.max_model_len
        if st[1] > limit:
            raise InvalidArgument(f"request {rid!r} would grow to {st[1]} tokens, beyond "
                                  f"max_model_len {limit}", field=name)
        return checked

    def _add_placeholders(self, st: list[int], rid: str, n: int, name: str) -> None:
        """``n`` placeholders on a request in decode (see the module docstring)."""
        if st[4] >= 0 and st[4] != st[1]:
            raise InvalidArgument(
                f"placeholder tokens are for a request in decode (every token computed); "
                f"request {rid!r} has {st[4]} of {st[1]} tokens computed", field=name)
        st[1] += n
        st[3] += n
        limit = self.limits.max_model_len
        if st[1] > limit:
            raise InvalidArgument(f"request {rid!r} would grow to {st[1]} tokens, beyond "
                                  f"max_model_len {limit}", field=name)

    @staticmethod
    def _no_unfilled_admission(st: list[int], rid: str) -> None:
        if st[3] and not st[2]:
            raise InvalidArgument(
                f"request {rid!r} has nothing computed and {st[3]} placeholder token(s) "
                "unfilled; fill them (fill_placeholders) before its lookup or allocate",
                field="request_id")

    def check(self, op: Any) -> Any:
        """One op; answers what the apply step needs (see :meth:`Pool.apply_batch`)."""
        kind = type(op)
        limits = self.limits
        if kind is Decode:
            return self._check_decode(op)
        if kind is Allocate:  # the hot path of generic decode steps: kept lean
            rid = op.request_id
            st = self.state.get(rid) if type(rid) is str else None
            if st is None or not st[0]:
                st = self._require(rid)
            if st[3] and not st[2]:
                self._no_unfilled_admission(st, rid)
            tokens = op.append_token_ids
            appended = self._append(st, rid, tokens, "append_token_ids") if tokens else None
            if op.num_placeholder_tokens:
                name = "num_placeholder_tokens"
                self._add_placeholders(st, rid, check_int(op.num_placeholder_tokens, name,
                                                          minimum=0,
                                                          maximum=limits.max_model_len), name)
            n = op.num_new_tokens
            maximum = limits.max_model_len
            if type(n) is not int or not 1 <= n <= limits.max_new_tokens:
                if n == 0 and type(n) is int and self._adopts_hit(op):
                    pass
                else:
                    raise InvalidArgument(
                        "num_new_tokens must be an integer in [1, max_in_flight_tokens="
                        f"{limits.max_new_tokens}] (0 only to adopt a fresh pending lookup "
                        f"hit; split longer chunks), got {n!r}", field="num_new_tokens")
            if op.num_lookahead_tokens:
                check_int(op.num_lookahead_tokens, "num_lookahead_tokens", minimum=0,
                          maximum=maximum)
            if op.num_encoder_tokens:
                check_int(op.num_encoder_tokens, "num_encoder_tokens", minimum=0)
            for flag in ("full_sequence_must_fit", "use_lookup", "delay_cache_blocks",
                         "include_table"):
                if type(getattr(op, flag)) is not bool:
                    raise InvalidArgument(f"{flag} must be true or false", field=flag)
            st[2] = True
            st[4] = -1
            self.blocks_moved = True
            return appended
        if kind is FillPlaceholders:
            return self._check_fill(op)
        if kind is AppendTokens:
            return self._append(self._require(op.request_id), op.request_id, op.token_ids,
                                "token_ids")
        if kind is AddRequest:
            rid = check_request_id(op.request_id)
            st = self._state(rid)
            if st[0]:
                raise DuplicateRequest(f"request {rid!r} already exists", field="request_id")
            tokens = check_tokens(op.token_ids, limits.token_limit)
            if len(tokens) > limits.max_model_len:
                raise InvalidArgument(f"prompt of {len(tokens)} tokens is longer than "
                                      f"max_model_len {limits.max_model_len}",
                                      field="token_ids")
            check_extra_keys(op.cache_salt, op.lora_name, op.lora_path)
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
            st[:] = [True, len(tokens), False, 0, 0]
            return tokens, hashes
        if kind is Lookup:
            st = self._require(op.request_id)
            if st[2]:
                raise FailedPrecondition(
                    f"lookup on request {op.request_id!r}, which has (or may have, after an "
                    "allocate earlier in this batch) computed tokens; only requests with "
                    "nothing computed can look up", field="request_id")
            self._no_unfilled_admission(st, op.request_id)
            return None
        if kind is Preempt:
            st = self._require(op.request_id)
            st[2] = False
            st[4] = 0
            self.blocks_moved = True
            return None
        if kind is Free:
            self._require(op.request_id)[:] = [False, 0, False, 0, 0]
            self.blocks_moved = True
            return None
        if kind is NewStep:
            return None
        raise InvalidArgument(f"not an op: {op!r:.80}", field="")

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
            if st[3] <= 0:
                raise InvalidArgument(f"request {rid!r} has no placeholder token left to "
                                      "fill", field=f"token_ids[{i}]")
            st[3] -= 1
        return tokens

    def _check_decode(self, op: Decode) -> list[Request] | None:
        """Per request, an allocate of 1 token with 1 appended. The pool's request
        objects when no earlier op of the batch touched them (the usual case), else None."""
        checks = self.decode_checks(op, 1 << 62)
        while True:
            try:
                next(checks)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]

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
                        [True, len(r.all_token_ids) + r.num_placeholders + 1, True,
                         r.num_placeholders + placeholders, -1] for r in part]))
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
            if not st[0]:
                raise UnknownRequest(f"unknown request {rid!r}", field=name)
            if placeholders:
                self._add_placeholders(st, rid, 1, name)
            else:
                if st[3]:
                    raise InvalidArgument(
                        f"request {rid!r} ends in {st[3]} placeholder token(s); fill them "
                        "(fill_placeholders) before appending known tokens",
                        field=f"token_ids[{i}]")
                st[1] += 1
                if st[1] > limit:
                    raise InvalidArgument(f"request {rid!r} would grow to {st[1]} tokens, "
                                          f"beyond max_model_len {limit}",
                                          field=f"token_ids[{i}]")
            st[2] = True
            st[4] = -1
        return None


def check_batch_in_slices(check: BatchCheck, ops: Sequence[Any],
                          slice_cost: int) -> Generator[None, None, list[Any]]:
    """:func:`check_batch` yielding after about ``slice_cost`` request-ops (inside a big
    decode op too); same answer and errors."""
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
        spent += 1
        if spent >= slice_cost:
            spent = 0
            yield
    return out


#: Token ids copied per unit of slice cost.
TOKENS_PER_COST = 64


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
