"""``kvcache.v1.CacheService`` on top of the pool registry.

Every handler runs on the server's one event loop and calls the allocator synchronously
(no awaits between reading and writing allocator state), so calls never interleave inside
a pool. Step batches are validated whole before any op is applied: field checks, plus a
simulation of which request ids exist as the batch's adds / frees take effect. A batch
that passes is applied op by op. A ``decode`` op (many requests' decode step in packed
arrays) is the hot path of big batches: one validation pass, then ``Pool.decode``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import structlog

from cache_service import convert
from cache_service.status import ResourceExhausted, Unavailable, qualify, to_status
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.api.kvcache.v1 import cache_service_pb2_grpc as pb_grpc
from cache_service.core.errors import (
    DuplicateRequest,
    FailedPrecondition,
    InvalidArgument,
    KVCacheError,
    UnknownRequest,
)
from cache_service.core.pool import DecodeOutcome
from cache_service.core.prefix_index import Namespace
from cache_service.core.residency import ExtraKeys
from cache_service.event_feed import SequenceOutOfRange
from cache_service.registry import PoolEntry, PoolRegistry, check_pool_id

MAX_REQUEST_ID_LEN = 256
HASH_LEN = 32  # sha256 digests
TOKEN_LIMIT = 2**31  # the core's bound on token ids when the pool has no vocab_size

_log = structlog.get_logger("cache_service.servicer")

_ADD, _LOOKUP, _ALLOCATE, _APPEND, _FREE, _PREEMPT, _NEW_STEP, _DECODE = (
    "add_request", "lookup", "allocate", "append_tokens", "free", "preempt", "new_step",
    "decode")


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """Ends the call with the error's status (raises)."""
    await context.abort_with_status(to_status(exc))


def _check_tokens(tokens: Any, limit: int, field: str) -> None:
    """Token ids must lie in [0, limit) (limit = vocab_size, else 2**31 as in the core)."""
    if not tokens:
        raise InvalidArgument("at least one token id is required", field=field)
    if min(tokens) < 0 or max(tokens) >= limit:
        bad = next(i for i, t in enumerate(tokens) if not 0 <= t < limit)
        raise InvalidArgument(f"token id {tokens[bad]} out of range [0, {limit})",
                              field=f"{field}[{bad}]")


def _check_request_id(rid: str, field: str) -> None:
    if not rid or len(rid) > MAX_REQUEST_ID_LEN:
        raise InvalidArgument(f"request_id must be 1-{MAX_REQUEST_ID_LEN} characters",
                              field=field)


def check_lora(lora_name: str, lora_path: str) -> None:
    """A LoRA path is hashed with its name: it needs one (as the core checks)."""
    if lora_path and not lora_name:
        raise InvalidArgument("lora_path needs lora_name", field="lora_path")


def check_block_hashes(entry: PoolEntry, hashes: Any, num_tokens: int, field: str) -> None:
    """Client-computed hashes: sha256_cbor pools only, one 32-byte hash per full block."""
    if not hashes:
        return
    opts = entry.pool.options
    if opts.hash_algo != "sha256_cbor":
        raise InvalidArgument("client block hashes need a pool with hash_algo "
                              "HASH_ALGO_SHA256_CBOR (the cross-language recipe)", field=field)
    if not opts.enable_caching:
        raise InvalidArgument("the pool has prefix caching off; send no block hashes",
                              field=field)
    expected = num_tokens // entry.pool.hash_block_size
    if len(hashes) != expected:
        raise InvalidArgument(f"expected {expected} hashes (one per full "
                              f"{entry.pool.hash_block_size}-token block), got {len(hashes)}",
                              field=field)
    for i, h in enumerate(hashes):
        if len(h) != HASH_LEN:
            raise InvalidArgument(f"a block hash is {HASH_LEN} bytes, got {len(h)}",
                                  field=f"{field}[{i}]")


class StepValidator:
    """Checks a whole batch against the pool without changing it.

    The pool validates each call before it mutates, but a batch must be all or nothing, so
    this mirrors the pool's checks over a simulation of the batch: which request ids exist
    as adds and frees take effect, each request's token count as appends arrive, and
    whether it may have computed tokens. Two protocol rules keep the simulation exact:
    ``allocate.num_new_tokens`` must be >= 1 (a prefix hit never covers the last prompt
    token, so a real step always has one), and a ``lookup`` may not follow an ``allocate``
    of the same request in one batch (its outcome decides whether the lookup is legal).
    """

    def __init__(self, entry: PoolEntry) -> None:
        self.entry = entry
        self.pool = entry.pool
        self.max_model_len = self.pool.options.max_model_len
        vocab = self.pool.options.vocab_size
        self.token_limit = vocab if vocab is not None else TOKEN_LIMIT
        # request id -> [exists, num_tokens, may_have_computed_tokens]
        self.state: dict[str, list] = {}

    def _state(self, rid: str) -> list:
        st = self.state.get(rid)
        if st is None:
            try:
                info = self.pool.request_info(rid)
                st = [True, info.num_tokens, info.num_computed_tokens > 0]
            except UnknownRequest:
                st = [False, 0, False]
            self.state[rid] = st
        return st

    def _require(self, rid: str) -> list:
        st = self._state(rid)
        if not st[0]:
            _check_request_id(rid, "request_id")
            raise UnknownRequest(f"unknown request {rid!r}", field="request_id")
        return st

    def _append(self, st: list, rid: str, tokens: Any, field: str) -> None:
        _check_tokens(tokens, self.token_limit, field)
        st[1] += len(tokens)
        if st[1] > self.max_model_len:
            raise InvalidArgument(f"request {rid!r} would grow to {st[1]} tokens, beyond "
                                  f"max_model_len {self.max_model_len}", field=field)

    def validate(self, ops: Any) -> list[tuple[str, Any]]:
        """``(kind, op message)`` of every op, for the apply loop to reuse (a decode op's
        is ``(request ids, token ids)`` as lists); raises the first op's error, its field
        qualified as ``ops[i].<kind>.<field>``."""
        check = self.check
        plan = []
        append = plan.append
        for i, op in enumerate(ops):
            kind = op.WhichOneof("op")
            try:
                m = getattr(op, kind) if kind else None
                if kind == _DECODE:
                    # Each read of a repeated string field builds new str objects, whose
                    # hashes every dict lookup would compute again: convert once.
                    m = (list(m.request_ids), list(m.token_ids))
                check(kind, m)
            except KVCacheError as exc:
                raise qualify(exc, f"ops[{i}].{kind}" if kind else f"ops[{i}]") from None
            append((kind, m))
        return plan

    def check(self, kind: str | None, m: Any) -> None:
        """One op (``m`` is its set submessage); errors name fields relative to the op
        (``num_new_tokens``)."""
        if kind == _DECODE:
            self._check_decode(*m)
        elif kind == _ALLOCATE:  # the hot path of decode steps: kept lean
            rid = m.request_id
            st = self.state.get(rid)
            if st is None or not st[0]:
                st = self._require(rid)
            tokens = m.append_token_ids
            if tokens:
                self._append(st, rid, tokens, "append_token_ids")
            n = m.num_new_tokens
            if n < 1 or n > self.max_model_len:
                raise InvalidArgument(f"must be in [1, max_model_len={self.max_model_len}], "
                                      f"got {n}", field="num_new_tokens")
            la = m.num_lookahead_tokens
            if la and (la < 0 or la > self.max_model_len):
                raise InvalidArgument(f"must be in [0, max_model_len={self.max_model_len}], "
                                      f"got {la}", field="num_lookahead_tokens")
            st[2] = True
        elif kind == _APPEND:
            self._append(self._require(m.request_id), m.request_id, m.token_ids, "token_ids")
        elif kind == _ADD:
            _check_request_id(m.request_id, "request_id")
            st = self._state(m.request_id)
            if st[0]:
                raise DuplicateRequest(f"request {m.request_id!r} already exists",
                                       field="request_id")
            _check_tokens(m.token_ids, self.token_limit, "token_ids")
            if len(m.token_ids) > self.max_model_len:
                raise InvalidArgument(f"{len(m.token_ids)} tokens exceed max_model_len="
                                      f"{self.max_model_len}", field="token_ids")
            check_block_hashes(self.entry, m.block_hashes, len(m.token_ids), "block_hashes")
            check_lora(m.lora_name, m.lora_path)
            st[:] = [True, len(m.token_ids), False]
        elif kind == _LOOKUP:
            st = self._require(m.request_id)
            if st[2]:
                raise FailedPrecondition(
                    f"request {m.request_id!r} has (or may have, after an allocate "
                    "earlier in this batch) computed tokens; only requests with nothing "
                    "computed can look up", field="request_id")
        elif kind == _PREEMPT:
            self._require(m.request_id)[2] = False
        elif kind == _FREE:
            self._require(m.request_id)[:] = [False, 0, False]
        elif kind is None:
            raise InvalidArgument("an op must set one of add_request, lookup, allocate, "
                                  "append_tokens, free, preempt, new_step, decode", field="")

    def _check_decode(self, rids: Any, tokens: Any) -> None:
        """A DecodeOp: per request, an allocate of 1 token with 1 appended (the checks
        that cannot fail for those counts are skipped). The pool is asked only about
        requests no earlier op of the batch touched; each ends up in the simulation with
        one more token and (possibly) computed tokens."""
        self.pool.check_decode_args(rids, tokens)
        state = self.state
        limit = self.max_model_len
        if state.keys().isdisjoint(rids):
            # The usual case (no earlier op of the batch touched these requests): ask the
            # pool once. Any error is left to the loop below, which names the field.
            try:
                counts = self.pool.token_counts(rids)
            except UnknownRequest:
                counts = None
            if counts is not None and max(counts) < limit:
                state.update(zip(rids, [[True, c + 1, True] for c in counts]))
                return
        num_tokens = self.pool.num_tokens
        has_request = self.pool.has_request
        for i, rid in enumerate(rids):
            st = state.get(rid)
            if st is None:
                if not has_request(rid):
                    _check_request_id(rid, f"request_ids[{i}]")
                    raise UnknownRequest(f"unknown request {rid!r}", field=f"request_ids[{i}]")
                st = state[rid] = [True, num_tokens(rid) + 1, True]
            elif not st[0]:
                raise UnknownRequest(f"unknown request {rid!r}", field=f"request_ids[{i}]")
            else:
                st[1] += 1
                st[2] = True
            if st[1] > limit:
                raise InvalidArgument(f"request {rid!r} would grow to {st[1]} tokens, beyond "
                                      f"max_model_len {limit}", field=f"token_ids[{i}]")


def write_decode(out: pb.DecodeResult, result: DecodeOutcome) -> None:
    """Fills a DecodeResult's packed arrays (the layout documented in the proto)."""
    out.ok.extend(result.ok)
    grown = result.new_block_ids
    if grown:
        out.grown.extend(grown)
        counts = out.new_block_counts
        ids = out.new_block_ids
        for tables in grown.values():
            for table in tables:
                counts.append(len(table))
                ids.extend(table)


class BlockTableCache:
    """Whole block tables of one pool's requests, kept serialized while unchanged.

    Copying ~70 Python ints into protobuf fields costs ~3 us per request and step, the
    largest service cost of a big decode Step; but a decode step changes a request's table
    only when it crosses a block boundary. So each request's last ``block_ids`` fragment is
    kept as bytes and merged in again while the table is equal.
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[list[list[int]], bytes]] = {}

    def write(self, out: pb.AllocateResult, request_id: str, tables: list[list[int]]) -> None:
        """Appends ``tables`` to ``out.block_ids``."""
        entry = self._entries.get(request_id)
        if entry is None or entry[0] != tables:
            fragment = pb.AllocateResult()
            for ids in tables:
                fragment.block_ids.add().block_ids.extend(ids)
            # Keep our own copy: the comparison must not see later changes to ``tables``.
            entry = ([list(ids) for ids in tables], fragment.SerializeToString())
            self._entries[request_id] = entry
        out.MergeFromString(entry[1])

    def forget(self, request_id: str) -> None:
        self._entries.pop(request_id, None)


class CacheServicer(pb_grpc.CacheServiceServicer):
    """The gRPC handlers. ``draining`` (set on SIGTERM) turns new stream messages away."""

    def __init__(self, registry: PoolRegistry, *, max_ops_per_step: int = 65536) -> None:
        self.registry = registry
        self.max_ops_per_step = max_ops_per_step
        self.draining = False
        self._tables: dict[str, BlockTableCache] = {}  # by pool id
        # pool id -> (its last PeekPrefix answer, that answer's serialized hits entry)
        self._peek_fragments: dict[str, tuple[Any, bytes]] = {}
        # pool id list -> (registry version, what PeekPrefix derives from the list)
        self._peek_plans: dict[tuple[str, ...], tuple[int, tuple]] = {}

    # -- helpers -----------------------------------------------------------------------

    async def _unary(self, context: grpc.aio.ServicerContext, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (KVCacheError, SequenceOutOfRange) as exc:
            await _abort(context, exc)

    # -- pools -------------------------------------------------------------------------

    async def RegisterPool(self, request: pb.RegisterPoolRequest,
                           context: grpc.aio.ServicerContext) -> pb.RegisterPoolResponse:
        def run() -> pb.RegisterPoolResponse:
            check_pool_id(request.pool_id)
            desc = convert.description_from_proto(request)
            entry, created = self.registry.register(request.pool_id, desc)
            return pb.RegisterPoolResponse(config=convert.pool_config_to_proto(entry),
                                           created=created)
        return await self._unary(context, run)

    async def GetPool(self, request: pb.GetPoolRequest,
                      context: grpc.aio.ServicerContext) -> pb.GetPoolResponse:
        return await self._unary(context, lambda: pb.GetPoolResponse(
            config=convert.pool_config_to_proto(self.registry.get(request.pool_id))))

    async def ListPools(self, request: pb.ListPoolsRequest,
                        context: grpc.aio.ServicerContext) -> pb.ListPoolsResponse:
        return pb.ListPoolsResponse(pools=[convert.pool_config_to_proto(e)
                                           for e in self.registry])

    async def DeletePool(self, request: pb.DeletePoolRequest,
                         context: grpc.aio.ServicerContext) -> pb.DeletePoolResponse:
        def run() -> pb.DeletePoolResponse:
            dropped = self.registry.delete(request.pool_id)
            self._tables.pop(request.pool_id, None)
            self._peek_fragments.pop(request.pool_id, None)
            return pb.DeletePoolResponse(num_requests_dropped=dropped)
        return await self._unary(context, run)

    # -- steps -------------------------------------------------------------------------

    def step(self, request: pb.StepRequest) -> pb.StepResponse:
        """Validates then applies one batch (raises a core error and changes nothing if
        any op is invalid)."""
        entry = self.registry.get(request.pool_id)
        ops = request.ops
        if len(ops) > self.max_ops_per_step:
            raise ResourceExhausted(f"{len(ops)} ops exceed the limit of "
                                    f"{self.max_ops_per_step} per Step", field="ops")
        plan = StepValidator(entry).validate(ops)
        pool = entry.pool
        if request.begin_step:
            pool.new_step()
        # Results are filled in place (add() + field writes): building submessages with
        # constructors copies them and costs ~2x on a 256-request decode step.
        response = pb.StepResponse()
        add_result = response.results.add
        table_cache = self._tables.get(request.pool_id)
        if table_cache is None:
            table_cache = self._tables[request.pool_id] = BlockTableCache()
        for i, (kind, m) in enumerate(plan):
            try:
                if kind == _DECODE:
                    write_decode(add_result().decode, pool.decode(*m))
                elif kind == _ALLOCATE:
                    rid = m.request_id
                    if m.append_token_ids:
                        pool.append_tokens(rid, m.append_token_ids)
                    whole_table = not m.skip_block_table
                    if (m.num_lookahead_tokens or m.full_sequence_must_fit or m.skip_lookup
                            or m.delay_cache_blocks):
                        r = pool.allocate(rid, m.num_new_tokens,
                                          num_lookahead_tokens=m.num_lookahead_tokens,
                                          full_sequence_must_fit=m.full_sequence_must_fit,
                                          use_lookup=not m.skip_lookup,
                                          delay_cache_blocks=m.delay_cache_blocks,
                                          include_tables=whole_table)
                    else:  # the common case, with fewer keyword arguments to pass
                        r = pool.allocate(rid, m.num_new_tokens,
                                          include_tables=whole_table)
                    out = add_result().allocate
                    out.num_computed_tokens = r.num_computed_tokens
                    if r.ok:
                        out.ok = True
                        out.hit_tokens_used = r.hit_tokens_used
                        new_ids = r.new_block_ids
                        if any(new_ids):  # most decode steps allocate nothing: send no tables
                            tables = out.new_block_ids
                            for ids in new_ids:
                                tables.add().block_ids.extend(ids)
                    if whole_table:
                        table_cache.write(out, rid, r.block_ids)
                elif kind == _APPEND:
                    info = pool.append_tokens(m.request_id, m.token_ids)
                    out = add_result().append_tokens
                    out.num_tokens = info.num_tokens
                    out.num_block_hashes = info.num_block_hashes
                elif kind == _ADD:
                    info = pool.add_request(
                        m.request_id, m.token_ids, cache_salt=m.cache_salt or None,
                        lora_name=m.lora_name or None, lora_path=m.lora_path or None,
                        block_hashes=list(m.block_hashes) if m.block_hashes else None)
                    out = add_result().add_request
                    out.num_tokens = info.num_tokens
                    out.num_block_hashes = info.num_block_hashes
                elif kind == _LOOKUP:
                    lk = pool.lookup(m.request_id, explain_misses=m.explain)
                    out = add_result().lookup
                    out.hit_tokens = lk.hit_tokens
                    out.shared_prefix_boundary = lk.shared_prefix_boundary
                    tables = out.block_ids
                    for ids in lk.block_ids:
                        tables.add().block_ids.extend(ids)
                    if lk.groups is not None:
                        convert.write_residency(out.groups, lk.groups)
                elif kind == _FREE:
                    add_result().free.num_free_blocks = pool.free(m.request_id)
                    table_cache.forget(m.request_id)
                elif kind == _PREEMPT:
                    add_result().preempt.num_free_blocks = pool.preempt(m.request_id)
                else:
                    pool.new_step()
                    add_result().new_step.SetInParent()
            except KVCacheError as exc:
                # The validator let through an op the core rejects, so the ops before it
                # stay applied. Still the client's error, but a gap in StepValidator: log it.
                entry.flush_events()
                _log.error("step_partially_applied", pool_id=request.pool_id, op_index=i,
                           error=str(exc), field=exc.field)
                raise qualify(exc, f"ops[{i}].{kind}") from None
        entry.flush_events()
        response.num_free_blocks = pool.num_free_blocks
        return response

    async def Step(self, request: pb.StepRequest,
                   context: grpc.aio.ServicerContext) -> pb.StepResponse:
        try:
            return self.step(request)
        except KVCacheError as exc:
            await _abort(context, exc)

    async def StepStream(self, request_iterator: AsyncIterator[pb.StepRequest],
                         context: grpc.aio.ServicerContext) -> AsyncIterator[pb.StepResponse]:
        async for request in request_iterator:
            try:
                if self.draining:
                    raise Unavailable("server is draining; reconnect to another instance")
                response = self.step(request)
            except KVCacheError as exc:
                await _abort(context, exc)
            yield response

    # -- queries -----------------------------------------------------------------------

    async def PeekPrefix(self, request: pb.PeekPrefixRequest,
                         context: grpc.aio.ServicerContext) -> pb.PeekPrefixResponse:
        return await self._unary(context, lambda: self.peek_prefix(request))

    def peek_prefix(self, request: pb.PeekPrefixRequest) -> pb.PeekPrefixResponse:
        """Answers from the routing index; with ``explain``, asks each pool itself."""
        if not request.pool_ids:
            raise InvalidArgument("at least one pool id is required", field="pool_ids")
        tokens, hashes = request.token_ids, request.block_hashes
        if not tokens and not hashes or (tokens and hashes and not request.explain):
            raise InvalidArgument("give token_ids or block_hashes (exactly one; both only "
                                  "with explain)", field="token_ids")
        check_lora(request.lora_name, request.lora_path)
        pool_ids = tuple(request.pool_ids)
        plan = self._peek_plan(pool_ids)
        entries, min_vocab, first_non_cbor, first_pool = plan
        token_list = list(tokens) if tokens else None
        hash_list = list(hashes) if hashes else None
        if token_list and (min(token_list) < 0 or max(token_list) >= min_vocab):
            for entry in entries:  # name the offending token against each pool's vocab
                _check_tokens(token_list, entry.pool.options.vocab_size or TOKEN_LIMIT,
                              "token_ids")
        if hash_list:
            if set(map(len, hash_list)) != {HASH_LEN}:
                j = next(j for j, h in enumerate(hash_list) if len(h) != HASH_LEN)
                raise InvalidArgument(f"a block hash is {HASH_LEN} bytes",
                                      field=f"block_hashes[{j}]")
            if first_non_cbor is not None:
                raise InvalidArgument(
                    f"pool {pool_ids[first_non_cbor]!r} does not use sha256_cbor hashes",
                    field=f"pool_ids[{first_non_cbor}]")
        keys = ExtraKeys(request.cache_salt or None,
                         request.lora_name or None, request.lora_path or None)
        if request.explain:
            answers = [entry.pool.prefix_residency(
                token_list, block_hashes=hash_list, cache_salt=keys.cache_salt,
                lora_name=keys.lora_name, lora_path=keys.lora_path, explain_misses=True)
                for entry in entries]
        else:
            def query(namespace: Namespace) -> tuple[list[bytes], int]:
                if hash_list is not None:  # checked above: 32-byte hashes, cbor pools
                    return hash_list, len(hash_list) * namespace[2]
                hashed, max_len, _ = first_pool[namespace].peek_input(token_list, None, keys)
                return hashed, max_len
            answers = self.registry.index.peek(pool_ids, query)
        # Each pool's entry is kept serialized while its answer is the same object (the
        # index hands out an unchanged answer again): building ~6 fields per pool costs
        # more than the index lookup itself in a many-pool answer.
        cache = self._peek_fragments
        parts = []
        for entry, answer in zip(entries, answers):
            cached = cache.get(entry.pool_id)
            if cached is None or cached[0] is not answer:
                one = pb.PeekPrefixResponse()
                hit = one.hits.add(pool_id=entry.pool_id, hit_tokens=answer.hit_tokens)
                convert.write_residency(hit.groups, answer.groups)
                cached = (answer, one.SerializeToString())
                if not request.explain:
                    cache[entry.pool_id] = cached
            parts.append(cached[1])
        return pb.PeekPrefixResponse.FromString(b"".join(parts))

    def _peek_plan(self, pool_ids: tuple[str, ...]) -> tuple:
        """(entries, smallest token limit, index of the first pool without sha256_cbor
        hashes or None, first pool per namespace) of a pool list; kept until a pool is
        registered or deleted (routers ask about the same pools again and again)."""
        version = self.registry.version
        cached = self._peek_plans.get(pool_ids)
        if cached is not None and cached[0] == version:
            return cached[1]
        entries = [self.registry.get(pid, field=f"pool_ids[{i}]")
                   for i, pid in enumerate(pool_ids)]
        min_vocab = min(e.pool.options.vocab_size or TOKEN_LIMIT for e in entries)
        first_non_cbor = next((i for i, e in enumerate(entries)
                               if e.pool.options.hash_algo != "sha256_cbor"), None)
        first_pool: dict[Namespace, Any] = {}
        for entry in entries:
            first_pool.setdefault(self.registry.index.namespace(entry.pool_id), entry.pool)
        plan = (entries, min_vocab, first_non_cbor, first_pool)
        if len(self._peek_plans) >= 64:
            self._peek_plans.clear()
        self._peek_plans[pool_ids] = (version, plan)
        return plan

    async def GetRequest(self, request: pb.GetRequestRequest,
                         context: grpc.aio.ServicerContext) -> pb.GetRequestResponse:
        def run() -> pb.GetRequestResponse:
            pool = self.registry.get(request.pool_id).pool
            _check_request_id(request.request_id, "request_id")
            info = pool.request_info(request.request_id)
            return pb.GetRequestResponse(
                block_ids=convert.tables(pool.block_ids(request.request_id)),
                num_computed_tokens=info.num_computed_tokens, num_tokens=info.num_tokens,
                num_block_hashes=info.num_block_hashes, status=info.status,
                num_preemptions=info.num_preemptions)
        return await self._unary(context, run)

    async def GetPoolStats(self, request: pb.GetPoolStatsRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetPoolStatsResponse:
        def run() -> pb.GetPoolStatsResponse:
            entry = self.registry.get(request.pool_id)
            return pb.GetPoolStatsResponse(stats=convert.stats_to_proto(
                entry.pool.stats(), entry.feed.next_sequence - 1))
        return await self._unary(context, run)

    async def ResetPrefixCache(self, request: pb.ResetPrefixCacheRequest,
                               context: grpc.aio.ServicerContext
                               ) -> pb.ResetPrefixCacheResponse:
        def run() -> pb.ResetPrefixCacheResponse:
            entry = self.registry.get(request.pool_id)
            ok = entry.pool.reset_prefix_cache()
            entry.flush_events()
            return pb.ResetPrefixCacheResponse(reset=ok)
        return await self._unary(context, run)

    # -- events ------------------------------------------------------------------------

    async def GetPrefixSnapshot(self, request: pb.GetPrefixSnapshotRequest,
                                context: grpc.aio.ServicerContext
                                ) -> pb.GetPrefixSnapshotResponse:
        # Consistent by construction: handlers run on one event loop and every mutation
        # publishes its events before returning, so the map and the feed agree here.
        def run() -> pb.GetPrefixSnapshotResponse:
            entry = self.registry.get(request.pool_id)
            return convert.snapshot_to_proto(entry.pool, entry.feed.next_sequence - 1)
        return await self._unary(context, run)

    async def SubscribeEvents(self, request: pb.SubscribeEventsRequest,
                              context: grpc.aio.ServicerContext
                              ) -> AsyncIterator[pb.SubscribeEventsResponse]:
        try:
            entry = self.registry.get(request.pool_id)
            start = request.from_sequence if request.HasField("from_sequence") else None
            subscription = entry.feed.subscribe(start)
            async for batch in subscription:
                yield pb.SubscribeEventsResponse(
                    events=[convert.event_to_proto(seq, e) for seq, e in batch])
        except (KVCacheError, SequenceOutOfRange) as exc:
            await _abort(context, exc)
