"""The facade the gRPC service and the replay tool use: one KV-cache pool.

A :class:`Pool` is one :class:`KVCacheManager` (one coordinator, one block pool) plus a
registry of requests by id. Every method validates its whole input before it changes
anything: bad input raises a :mod:`errors` exception and leaves the pool as it was.
"No room" is a normal answer (``Allocation.ok == False``), never an exception.

Semantics follow vLLM 0.33 (see docs/kv-cache-semantics.md). Two pool-level rules:

* ``lookup`` remembers its hit for the request's next ``allocate``. If the pool's
  blocks changed in between (another allocate, free, preempt, reset or eviction), the
  remembered blocks may have been reused, so ``allocate`` looks the prefix up again
  instead of pinning stale blocks.
* On a successful ``allocate`` the request's computed tokens advance by hit + new
  tokens, and its first allocation (after ``add`` or ``preempt``) records
  prefix-cache statistics.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from cache_service.core.errors import (
    DuplicateRequest,
    FailedPrecondition,
    InvalidArgument,
    UnknownRequest,
)
from cache_service.core.events import KVEvent
from cache_service.core.hashing import get_hash_fn, hash_request_tokens
from cache_service.core.kv_cache_manager import KVCacheManager, resolve_block_sizes
from cache_service.core.request import Request, RequestStatus
from cache_service.core.residency import (
    ExplainContext,
    ExtraKeys,
    GroupResidency,
    PrefixLog,
    Residency,
    explain,
    group_residency,
)
from cache_service.core.single_type_managers import HitBlocks
from cache_service.core.specs import KVCacheConfig

_TOKEN_LIMIT = 2**31


@dataclass(frozen=True)
class PoolOptions:
    """Pool-wide settings. ``scheduler_block_size`` / ``hash_block_size`` None = the
    rules of semantics §6.1. ``vocab_size`` None accepts token ids in [0, 2**31)."""

    max_model_len: int
    enable_caching: bool = True
    hash_algo: str = "sha256"  # "sha256" | "sha256_cbor"
    scheduler_block_size: int | None = None
    hash_block_size: int | None = None
    watermark: float = 0.0
    max_in_flight_tokens: int | None = None
    enable_events: bool = True
    vocab_size: int | None = None


@dataclass(slots=True)
class RequestInfo:
    request_id: str
    num_tokens: int
    num_computed_tokens: int
    num_block_hashes: int
    status: str
    num_preemptions: int


@dataclass(slots=True)
class PrefixHit:
    """The longest usable prefix hit; ``block_ids`` per group (null block = 0)."""

    hit_tokens: int
    block_ids: list[list[int]]
    shared_prefix_boundary: int = 0
    #: Per-group reach and miss reason; only when the lookup was asked to explain.
    groups: list[GroupResidency] | None = None


@dataclass(slots=True)
class Allocation:
    """``new_block_ids`` (None when not ok): blocks added by this call, per group;
    ``block_ids``: the request's whole table per group after the call (None when the
    caller asked for no tables: copying long tables dominates the cost of a decode step)."""

    ok: bool
    new_block_ids: list[list[int]] | None
    block_ids: list[list[int]] | None
    num_computed_tokens: int
    hit_tokens_used: int = 0


@dataclass(slots=True)
class DecodeOutcome:
    """Outcome of :meth:`Pool.decode`. ``ok[i]`` answers ``request_ids[i]`` (False = no
    room: nothing allocated for it). ``new_block_ids`` maps the index of every request that
    got at least one new block to its new blocks per group; most decode steps add none,
    so it is usually small (no per-request objects are built for the others)."""

    ok: list[bool]
    new_block_ids: dict[int, list[list[int]]]


@dataclass(slots=True)
class PoolCounters:
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    usage: float
    prefix_queries: int
    prefix_hits: int
    prefix_requests: int
    preempted_prefix_queries: int
    preempted_prefix_hits: int
    preempted_prefix_requests: int
    evictions: int
    allocation_failures: int
    preemptions: int
    num_requests: int
    num_cached_blocks_per_group: list[int] = field(default_factory=list)
    #: (group index, miss reason) -> explained lookups that answered it.
    miss_reasons: dict[tuple[int, str], int] = field(default_factory=dict)


def _check_int(value: object, name: str, *, minimum: int) -> int:
    if type(value) is not int or value < minimum:  # bool is not accepted either
        raise InvalidArgument(f"{name} must be an integer >= {minimum}, got {value!r}",
                              field=name)
    return value


class Pool:
    """One KV-cache pool: a coordinator and a registry of requests by id."""

    def __init__(self, config: KVCacheConfig, options: PoolOptions) -> None:
        _check_int(options.max_model_len, "max_model_len", minimum=1)
        _check_int(config.num_blocks, "num_blocks", minimum=1)
        if options.vocab_size is not None:
            _check_int(options.vocab_size, "vocab_size", minimum=1)
        if options.max_in_flight_tokens is not None:
            _check_int(options.max_in_flight_tokens, "max_in_flight_tokens", minimum=1)
        if not 0.0 <= options.watermark < 1.0:
            raise InvalidArgument(f"watermark must be in [0, 1), got {options.watermark!r}",
                                  field="watermark")
        hash_fn = get_hash_fn(options.hash_algo)
        sched, hbs = resolve_block_sizes(config, options.enable_caching,
                                         options.scheduler_block_size, options.hash_block_size)
        self._config = config
        self._options = options
        self._sched = sched
        self._hbs = hbs
        self._hash_fn = hash_fn if options.enable_caching else None
        self._digest_size = len(hash_fn(b""))
        self._token_limit = options.vocab_size if options.vocab_size is not None else _TOKEN_LIMIT
        self._manager = KVCacheManager(
            config, max_model_len=options.max_model_len, scheduler_block_size=sched,
            hash_block_size=hbs, max_in_flight_tokens=options.max_in_flight_tokens,
            enable_caching=options.enable_caching, enable_events=options.enable_events,
            watermark=options.watermark)
        self._requests: dict[str, Request] = {}
        self._table_ids = self._manager.coordinator.get_block_ids
        # request id -> (hit blocks, hit tokens, epoch of the lookup)
        self._pending: dict[str, tuple[HitBlocks, int, int]] = {}
        self._epoch = 0  # bumped by every operation that may reuse or unpin blocks
        self._allocation_failures = 0
        self._preemptions = 0
        # Follows the prefix-cache map: recently removed keys and extra-key combinations
        # for miss reasons; the routing index attaches its bits here.
        self._log = PrefixLog(len(config.groups))
        if options.enable_caching:
            self._manager.pool.observer = self._log

    # -- properties ----------------------------------------------------------------------
    @property
    def config(self) -> KVCacheConfig:
        return self._config

    @property
    def options(self) -> PoolOptions:
        return self._options

    @property
    def scheduler_block_size(self) -> int:
        return self._sched

    @property
    def hash_block_size(self) -> int:
        return self._hbs

    @property
    def num_groups(self) -> int:
        return len(self._config.groups)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free + evictable cached ones)."""
        return self._manager.pool.get_num_free_blocks()

    @property
    def prefix_log(self) -> PrefixLog:
        """The observer of this pool's prefix-cache map (see :mod:`residency`)."""
        return self._log

    @property
    def manager(self) -> KVCacheManager:
        """The underlying vLLM-equivalent manager (for tests and tools)."""
        return self._manager

    # -- validation helpers -------------------------------------------------------------
    def _get(self, request_id: str) -> Request:
        req = self._requests.get(request_id)
        if req is None:
            raise UnknownRequest(f"unknown request {request_id!r}", field="request_id")
        return req

    def _check_tokens(self, token_ids: Sequence[int], name: str = "token_ids") -> list[int]:
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
        limit = self._token_limit
        if min(tokens) < 0 or max(tokens) >= limit:
            i = next(i for i, t in enumerate(tokens) if not 0 <= t < limit)
            raise InvalidArgument(f"{name}[{i}] = {tokens[i]} is out of range [0, {limit})",
                                  field=f"{name}[{i}]")
        return tokens

    def _check_hashes(self, block_hashes: Sequence[bytes], num_tokens: int | None) -> list[bytes]:
        try:
            hashes = list(block_hashes)
        except TypeError:
            raise InvalidArgument("block_hashes must be a sequence of bytes",
                                  field="block_hashes") from None
        if num_tokens is not None and len(hashes) != num_tokens // self._hbs:
            raise InvalidArgument(
                f"expected {num_tokens // self._hbs} block hashes ({num_tokens} tokens, hash "
                f"block size {self._hbs}), got {len(hashes)}", field="block_hashes")
        size = self._digest_size
        if set(map(type, hashes)) <= {bytes} and set(map(len, hashes)) <= {size}:
            return hashes  # the usual case, checked at C speed (long prompts' lookups)
        for i, h in enumerate(hashes):
            if not isinstance(h, (bytes, bytearray)) or len(h) != size:
                raise InvalidArgument(f"block_hashes[{i}] must be {size} bytes",
                                      field=f"block_hashes[{i}]")
        return [bytes(h) for h in hashes]

    @staticmethod
    def _check_optional_str(value: object, name: str) -> None:
        if value is not None and not isinstance(value, str):
            raise InvalidArgument(f"{name} must be a string or None", field=name)

    def _check_extra_keys(self, cache_salt: object, lora_name: object,
                          lora_path: object) -> None:
        """The hash extra keys: optional strings; a LoRA path only with a LoRA name."""
        self._check_optional_str(cache_salt, "cache_salt")
        self._check_optional_str(lora_name, "lora_name")
        self._check_optional_str(lora_path, "lora_path")
        if lora_path is not None and lora_name is None:
            raise InvalidArgument("lora_path needs lora_name", field="lora_path")

    def _info(self, req: Request) -> RequestInfo:
        return RequestInfo(req.request_id, len(req.all_token_ids), req.num_computed_tokens,
                           len(req.block_hashes), req.status, req.num_preemptions)

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, token_ids: Sequence[int], *,
                    cache_salt: str | None = None, lora_name: str | None = None,
                    block_hashes: Sequence[bytes] | None = None,
                    lora_path: str | None = None) -> RequestInfo:
        """Register a request and hash its full blocks (or adopt the client's hashes,
        one per ``hash_block_size`` full block). A LoRA request's blocks hash
        ``("lora", lora_name, lora_path)``: pass the path to match vLLM's hashes."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgument("request_id must be a non-empty string", field="request_id")
        if request_id in self._requests:
            raise DuplicateRequest(f"request {request_id!r} already exists", field="request_id")
        tokens = self._check_tokens(token_ids)
        if len(tokens) > self._options.max_model_len:
            raise InvalidArgument(f"prompt of {len(tokens)} tokens is longer than max_model_len "
                                  f"{self._options.max_model_len}", field="token_ids")
        self._check_extra_keys(cache_salt, lora_name, lora_path)
        hashes = None if block_hashes is None else self._check_hashes(block_hashes, len(tokens))
        req = Request(request_id, tokens, hash_fn=self._hash_fn, hash_block_size=self._hbs,
                      cache_salt=cache_salt, lora_name=lora_name, lora_path=lora_path,
                      block_hashes=hashes)
        self._requests[request_id] = req
        if cache_salt or lora_name is not None:
            self._log.saw_keys(ExtraKeys(cache_salt, lora_name, lora_path))
        return self._info(req)

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> RequestInfo:
        """Append decoded tokens; newly completed blocks are hashed."""
        req = self._get(request_id)
        tokens = self._check_tokens(token_ids)
        if len(req.all_token_ids) + len(tokens) > self._options.max_model_len:
            raise InvalidArgument(
                f"request {request_id!r} would grow to {len(req.all_token_ids) + len(tokens)} "
                f"tokens, beyond max_model_len {self._options.max_model_len}", field="token_ids")
        req.append_tokens(tokens)
        return self._info(req)

    def request_info(self, request_id: str) -> RequestInfo:
        return self._info(self._get(request_id))

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is registered (O(1), builds nothing)."""
        return request_id in self._requests

    def num_tokens(self, request_id: str) -> int:
        """Tokens the request holds (prompt + appended); UnknownRequest if unknown."""
        return len(self._get(request_id).all_token_ids)

    def token_counts(self, request_ids: Sequence[str]) -> list[int]:
        """:meth:`num_tokens` of many requests at once; UnknownRequest naming
        ``request_ids[i]`` for the first unknown one."""
        return [len(req.all_token_ids) for req in self._get_all(request_ids)]

    def _get_all(self, request_ids: Sequence[str]) -> list[Request]:
        requests = self._requests
        try:
            return [requests[rid] for rid in request_ids]
        except (KeyError, TypeError):
            i = next(i for i, rid in enumerate(request_ids)
                     if not isinstance(rid, str) or rid not in requests)
            raise UnknownRequest(f"unknown request {request_ids[i]!r}",
                                 field=f"request_ids[{i}]") from None

    def block_hashes(self, request_id: str) -> list[bytes]:
        """The request's block hashes (one per full ``hash_block_size`` block)."""
        return list(self._get(request_id).block_hashes)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def block_ids(self, request_id: str) -> list[list[int]]:
        self._get(request_id)
        return self._manager.get_block_ids(request_id)

    # -- lookup / allocate ----------------------------------------------------------------
    def lookup(self, request_id: str, *, explain_misses: bool = False) -> PrefixHit:
        """Longest usable prefix hit of a request with nothing computed. Takes no
        references; remembered for the request's next ``allocate``. ``explain_misses``
        adds every group's reach and miss reason (costs probes and rehashing)."""
        req = self._get(request_id)
        if req.num_computed_tokens:
            raise FailedPrecondition(
                f"lookup on request {request_id!r} with {req.num_computed_tokens} computed "
                f"tokens; only requests with nothing computed can look up", field="request_id")
        blocks, hit, boundary = self._manager.get_computed_blocks(req)
        self._pending[request_id] = (blocks, hit, self._epoch)
        result = PrefixHit(hit, [[b.block_id for b in g] for g in blocks], boundary)
        if explain_misses:
            result.groups = self._residency(
                req.block_hashes, req.num_tokens - 1, hit, req.all_token_ids,
                ExtraKeys(req.cache_salt, req.lora_name, req.lora_path),
                client_hashes=req.client_hashes, explain_misses=True).groups
        return result

    def allocate(self, request_id: str, num_new_tokens: int, *, num_lookahead_tokens: int = 0,
                 full_sequence_must_fit: bool = False, use_lookup: bool = True,
                 delay_cache_blocks: bool = False, num_encoder_tokens: int = 0,
                 include_tables: bool = True) -> Allocation:
        """Slots for ``num_new_tokens`` more tokens (after the pending lookup's hit when
        ``use_lookup``). ``ok=False`` when they do not fit. ``include_tables=False`` leaves
        ``block_ids`` None (callers that track tables from ``new_block_ids``)."""
        req = self._requests.get(request_id)
        if req is None:
            raise UnknownRequest(f"unknown request {request_id!r}", field="request_id")
        if type(num_new_tokens) is not int or num_new_tokens < 0:
            _check_int(num_new_tokens, "num_new_tokens", minimum=0)
        if num_lookahead_tokens:
            _check_int(num_lookahead_tokens, "num_lookahead_tokens", minimum=0)
        if num_encoder_tokens:
            _check_int(num_encoder_tokens, "num_encoder_tokens", minimum=0)
        return self._allocate(req, num_new_tokens, num_lookahead_tokens, full_sequence_must_fit,
                              use_lookup, delay_cache_blocks, num_encoder_tokens,
                              include_tables)

    def _allocate(self, req: Request, num_new_tokens: int, num_lookahead_tokens: int = 0,
                  full_sequence_must_fit: bool = False, use_lookup: bool = True,
                  delay_cache_blocks: bool = False, num_encoder_tokens: int = 0,
                  include_tables: bool = True) -> Allocation:
        """:meth:`allocate` of a registered request with checked counts."""
        request_id = req.request_id
        manager = self._manager
        pending = self._pending.get(request_id) if use_lookup else None
        if pending is not None:
            blocks, hit, epoch = pending
            if epoch != self._epoch:
                # Blocks may have been reused since the lookup: look the prefix up again.
                blocks, hit, _ = manager.get_computed_blocks(req)
        else:
            blocks, hit = None, 0
        if num_new_tokens == 0 and hit == 0:
            raise InvalidArgument("num_new_tokens must be > 0 when there is no prefix hit to "
                                  "adopt", field="num_new_tokens")
        if pending is not None or request_id in self._pending:
            del self._pending[request_id]
        self._epoch += 1
        new = manager.allocate_slots(
            req, num_new_tokens, hit, blocks, num_lookahead_tokens,
            delay_cache_blocks=delay_cache_blocks, num_encoder_tokens=num_encoder_tokens,
            full_sequence_must_fit=full_sequence_must_fit)
        if new is None:
            self._allocation_failures += 1
            return Allocation(False, None,
                                  self._table_ids(request_id) if include_tables else None,
                                  req.num_computed_tokens, 0)
        if req.status != RequestStatus.RUNNING:
            # Admission (first allocation after add or preempt): prefix-cache stats.
            manager.record_prefix_cache_stats(req, hit)
            req.status = RequestStatus.RUNNING
        req.num_computed_tokens += hit + num_new_tokens
        return Allocation(True, [[b.block_id for b in g] for g in new],
                              self._table_ids(request_id) if include_tables else None,
                              req.num_computed_tokens, hit)

    def decode(self, request_ids: Sequence[str], token_ids: Sequence[int]) -> DecodeOutcome:
        """The decode step of many requests: for each ``i`` in order, the same as
        ``append_tokens(request_ids[i], [token_ids[i]])`` then
        ``allocate(request_ids[i], 1, include_tables=False)`` (same outcome, statistics and
        events), without building per-request result objects.

        Validated whole before anything changes: one token per request, distinct
        registered ids, token ids in range, no request beyond ``max_model_len``. The usual
        request is RUNNING (computed tokens > 0, hence no pending lookup), so it goes
        straight to the manager; any other takes the general allocation path."""
        reqs = self._check_decode(request_ids, token_ids)
        self._epoch += 1  # as the first allocate of the equivalent op list would
        allocate_slots = self._manager.allocate_slots
        running = RequestStatus.RUNNING
        ok = [True] * len(reqs)
        grown: dict[int, list[list[int]]] = {}
        for i, (req, token) in enumerate(zip(reqs, token_ids)):
            req.append_token(token)
            if req.status == running and req.num_computed_tokens:
                new = allocate_slots(req, 1)
                if new is None:
                    self._allocation_failures += 1
                    ok[i] = False
                    continue
                req.num_computed_tokens += 1
                if any(new):
                    grown[i] = [[b.block_id for b in g] for g in new]
            else:
                r = self._allocate(req, 1, include_tables=False)
                ok[i] = r.ok
                if r.ok and any(r.new_block_ids):
                    grown[i] = r.new_block_ids
        return DecodeOutcome(ok, grown)

    def check_decode_args(self, request_ids: Sequence[str], token_ids: Sequence[int]) -> None:
        """The checks of :meth:`decode` that need no request state: at least one request,
        distinct string ids, one token id in range per request."""
        if isinstance(request_ids, str) or not len(request_ids):
            raise InvalidArgument("request_ids must be a non-empty sequence of ids",
                                  field="request_ids")
        n = len(request_ids)
        if len(token_ids) != n:
            raise InvalidArgument(f"expected one token per request ({n}), got "
                                  f"{len(token_ids)}", field="token_ids")
        self._check_tokens(token_ids)
        try:
            distinct = len(set(request_ids)) == n
        except TypeError:  # an unhashable id
            distinct = False
        if not distinct:
            seen: set[str] = set()
            for i, rid in enumerate(request_ids):
                if not isinstance(rid, str):
                    raise InvalidArgument(f"request_ids[{i}] must be a string, got {rid!r}",
                                          field=f"request_ids[{i}]")
                if rid in seen:
                    raise InvalidArgument(f"request {rid!r} is listed twice",
                                          field=f"request_ids[{i}]")
                seen.add(rid)

    def _check_decode(self, request_ids: Sequence[str],
                      token_ids: Sequence[int]) -> list[Request]:
        """The requests of a :meth:`decode` batch, or the first error (nothing changed)."""
        self.check_decode_args(request_ids, token_ids)
        reqs = self._get_all(request_ids)
        limit = self._options.max_model_len
        for i, req in enumerate(reqs):
            if len(req.all_token_ids) >= limit:
                raise InvalidArgument(f"request {req.request_id!r} would grow beyond "
                                      f"max_model_len {limit}", field=f"token_ids[{i}]")
        return reqs

    # -- release ----------------------------------------------------------------------------
    def free(self, request_id: str) -> int:
        """Free the request's blocks (tail first) and forget it; returns free blocks."""
        req = self._get(request_id)
        self._epoch += 1
        self._manager.free(req)
        del self._requests[request_id]
        self._pending.pop(request_id, None)
        return self.num_free_blocks

    def preempt(self, request_id: str) -> int:
        """Free the blocks but keep the request: computed tokens back to 0, PREEMPTED."""
        req = self._get(request_id)
        self._epoch += 1
        self._manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self._preemptions += 1
        self._pending.pop(request_id, None)
        return self.num_free_blocks

    def new_step(self) -> None:
        """A scheduler step begins (Mamba states cached last step become hittable)."""
        self._manager.new_step_starts()

    # -- router / stats -----------------------------------------------------------------------
    def peek_prefix(self, token_ids: Sequence[int] | None = None, *,
                    block_hashes: Sequence[bytes] | None = None, cache_salt: str | None = None,
                    lora_name: str | None = None, lora_path: str | None = None) -> int:
        """Hit length in tokens a request with this prompt would get now. Read-only:
        registers nothing, takes no references, changes no statistics. With only
        ``block_hashes``, the cap is the hashed length (the token count is unknown)."""
        return self.prefix_residency(token_ids, block_hashes=block_hashes,
                                     cache_salt=cache_salt, lora_name=lora_name,
                                     lora_path=lora_path, groups=False).hit_tokens

    def peek_input(self, token_ids: Sequence[int] | None, block_hashes: Sequence[bytes] | None,
                   keys: ExtraKeys) -> tuple[list[bytes], int, list[int] | None]:
        """(hashes at this pool's recipe, hit cap in tokens, checked tokens or None) of a
        peek; validates everything (the hit cap is the hashed length without tokens)."""
        if token_ids is None and block_hashes is None:
            raise InvalidArgument("give token_ids or block_hashes", field="token_ids")
        self._check_extra_keys(keys.cache_salt, keys.lora_name, keys.lora_path)
        tokens = None if token_ids is None else self._check_tokens(token_ids)
        hashes = None if block_hashes is None else self._check_hashes(
            block_hashes, None if tokens is None else len(tokens))
        if self._hash_fn is None:
            return [], 0, tokens
        if hashes is None:
            assert tokens is not None
            hashes = hash_request_tokens(self._hash_fn, tokens, self._hbs,
                                         lora_name=keys.lora_name, lora_path=keys.lora_path,
                                         cache_salt=keys.cache_salt)
        max_len = len(tokens) - 1 if tokens is not None else len(hashes) * self._hbs
        return hashes, max_len, tokens

    def prefix_residency(self, token_ids: Sequence[int] | None = None, *,
                         block_hashes: Sequence[bytes] | None = None,
                         cache_salt: str | None = None, lora_name: str | None = None,
                         lora_path: str | None = None, groups: bool = True,
                         explain_misses: bool = False) -> Residency:
        """:meth:`peek_prefix` with every group's reach (``groups``) and miss reason
        (``explain_misses``), probing this pool. Tokens and client hashes may be given
        together: then the hashes are looked up and checked against the pool's recipe."""
        keys = ExtraKeys(cache_salt, lora_name, lora_path)
        hashes, max_len, tokens = self.peek_input(token_ids, block_hashes, keys)
        if self._hash_fn is None:
            return Residency(0, group_residency(self._manager.coordinator.managers, (), 0,
                                                self._manager.pool) if groups else [])
        _, hit, _ = self._manager.coordinator.find_longest_cache_hit(hashes, max_len)
        if not groups and not explain_misses:
            return Residency(hit, [])
        return self._residency(hashes, max_len, hit, tokens, keys,
                               client_hashes=block_hashes is not None,
                               explain_misses=explain_misses)

    def _residency(self, hashes: Sequence[bytes], max_len: int, hit: int,
                   tokens: Sequence[int] | None, keys: ExtraKeys, *, client_hashes: bool,
                   explain_misses: bool) -> Residency:
        managers = self._manager.coordinator.managers
        block_pool = self._manager.pool
        result = Residency(hit, group_residency(managers, hashes, max_len, block_pool))
        if explain_misses and self._hash_fn is not None:
            explain(result, ExplainContext(managers, block_pool, self._log, self._hash_fn,
                                           hashes, max_len, keys, tokens, client_hashes))
        return result

    def stats(self) -> PoolCounters:
        pool = self._manager.pool
        s = self._manager.stats  # cumulative: the pool never takes (resets) them
        return PoolCounters(
            num_blocks=pool.num_blocks, num_free_blocks=pool.get_num_free_blocks(),
            num_cached_blocks=pool.num_cached_keys, usage=pool.get_usage(),
            prefix_queries=s.queries, prefix_hits=s.hits, prefix_requests=s.requests,
            preempted_prefix_queries=s.preempted_queries, preempted_prefix_hits=s.preempted_hits,
            preempted_prefix_requests=s.preempted_requests, evictions=pool.num_evictions,
            allocation_failures=self._allocation_failures, preemptions=self._preemptions,
            num_requests=len(self._requests),
            num_cached_blocks_per_group=pool.num_cached_keys_per_group(),
            miss_reasons=dict(self._log.misses))

    def take_events(self) -> list[KVEvent]:
        return self._manager.take_events()

    def prefix_snapshot(self) -> list[list[bytes]]:
        """Every cached block's hash, per group: a hash appears once per block cached
        under it (what the BlockStored / BlockRemoved events add up to)."""
        block_pool = self._manager.pool
        out = []
        for gid in range(self.num_groups):
            hashes = []
            for h, entry in block_pool.group_map(gid).items():
                if type(entry) is dict:
                    hashes.extend([h] * len(entry))
                else:
                    hashes.append(h)
            out.append(hashes)
        return out

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; False (nothing changes) while blocks are in use."""
        ok = self._manager.reset_prefix_cache()
        if ok:
            self._epoch += 1
        return ok

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the cache entries of these block ids (e.g. corrupt data)."""
        ids = list(block_ids)
        for i, b in enumerate(ids):
            if type(b) is not int or not 0 <= b < self._config.num_blocks:
                raise InvalidArgument(f"block_ids[{i}] = {b!r} is out of range "
                                      f"[0, {self._config.num_blocks})", field=f"block_ids[{i}]")
        self._epoch += 1
        self._manager.evict_blocks(ids)

    # -- invariants ------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError naming the broken invariant (semantics §2.4). O(pool)."""
        pool = self._manager.pool
        pool.check_invariants()
        refs: dict[int, int] = {}
        owner_group: dict[int, int] = {}
        for gid, manager in enumerate(self._manager.coordinator.managers):
            assert set(manager.req_to_blocks) == set(manager.req_to_ids), \
                f"group {gid}: block and id tables out of sync"
            for rid, table in manager.req_to_blocks.items():
                assert rid in self._requests, f"group {gid}: table of unregistered request {rid!r}"
                ids = manager.req_to_ids[rid]
                assert ids == [b.block_id for b in table], \
                    f"group {gid}, request {rid!r}: id table {ids} != blocks"
                seen: set[int] = set()
                for block in table:
                    if block.is_null:
                        continue
                    assert block.block_id not in seen, \
                        f"block {block.block_id} twice in request {rid!r}'s group-{gid} table"
                    seen.add(block.block_id)
                    assert owner_group.setdefault(block.block_id, gid) == gid, \
                        f"block {block.block_id} is in tables of groups {owner_group[block.block_id]} and {gid}"
                    assert pool.blocks[block.block_id] is block, \
                        f"block {block.block_id} in a table is not the pool's block"
                    refs[block.block_id] = refs.get(block.block_id, 0) + 1
                    if block.block_hash is not None:
                        assert block.group_id == gid, \
                            f"block {block.block_id} cached for group {block.group_id} but held by group {gid}"
        used = 0
        for block in pool.blocks:
            if block is None or block.is_null:
                continue
            assert block.ref_cnt == refs.get(block.block_id, 0), \
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != {refs.get(block.block_id, 0)} tables holding it"
            used += block.ref_cnt > 0
        assert pool.get_num_free_blocks() + used == pool.num_blocks - 1, \
            f"free {pool.get_num_free_blocks()} + used {used} != num_blocks - 1 = {pool.num_blocks - 1}"
        if not self._requests:
            assert used == 0, f"{used} blocks still referenced with no request registered"
