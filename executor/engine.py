"""The engine loop: continuous batching with chunked prefill over a paged cache whose blocks the
cache service hands out.

One engine step:

1. **Step call** (always one): ``begin_step``; frees of finished requests; the running
   requests' allocations, oldest first: every request in pure decode (one new token, its last
   sampled one) shares ONE compact ``decode`` op (append + allocate one slot each, answered
   with the new blocks only), the others (prefill chunks) get ``append`` + ``allocate``;
   ``add`` + ``lookup`` for the admission candidates (FCFS, within the token budget and
   ``max_num_seqs``).
2. If a running request got "no room" (a failed ``allocate``, or a ``False`` in the decode
   op's ``ok``: the op tries every request in order, a failure does not stop the later ones,
   and the failed one's token stays appended): preempt the newest running request (its blocks
   go back, it returns to the front of the waiting queue) and retry the failed allocations,
   one extra call per round (vLLM's policy). No admissions in such a step.
3. **Admission call** (only when candidates exist): ``lookup`` + ``allocate
   (full_sequence_must_fit)`` per candidate, with chunk sizes planned from the hits the first
   call reported. A lookup must be followed directly by its allocate (lookups take no
   references), so admission cannot share call 1 without guessing the hit. Candidates whose
   prompt shares a not-yet-cached prefix with an earlier candidate wait for the next step: the
   earlier one's blocks are then cached (Mamba checkpoints cached in a step are only reusable
   from the next one) and the hit stays what call 1 reported. If a candidate does not fit,
   admission stops there (FCFS) and later candidates that did fit are rolled back (preempt).
4. One forward pass over every scheduled chunk; sample where a chunk reaches the end of the
   known tokens; stream tokens; finished requests are freed in the next step's call.

Failures (a call that fails applied nothing on the service): if call 1 fails, everything the
step changed is rolled back (:class:`StepRollback`) and the step is retried later. If a later
call of the step fails, what the service granted in the earlier calls still runs (an
allocation that is never computed would put the two views apart), and a request the engine
already moved back to the waiting queue but whose ``preempt`` did not reach the service is
remembered in ``to_preempt``: the next step's call 1 sends that ``preempt`` first.

Chunking: a chunk is at most the remaining token budget. With Mamba groups in ``align`` mode
a chunk ends on a block boundary (only states at block boundaries are cached), except the last
one, which covers the prompt's final partial block (so the state at the prompt's last block
boundary is always checkpointed); and a chunk never crosses the shared-prefix boundary the
lookup reported (so the state at the end of a prefix shared with cached data gets cached).
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import structlog
from torch import Tensor

from cache_service.client import AllocateResult, DecodeResult, LookupResult, StepResult, ops
from executor.batch import GroupLayout, SeqChunk
from executor.cache_link import CacheLink
from executor.errors import CacheUnavailable, InvalidArgument, PoolLost, SettingError
from executor.runner import ModelRunner
from executor.sampling import SamplingParams, sample

log = structlog.get_logger("executor.engine")


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 64  # running requests at most
    max_tokens_per_step: int = 256  # token budget of one forward pass (chunked prefill)
    # Send each step's cache calls while the previous forward pass runs (see the module
    # docstring); the executor's --async-cache-step, on by default there.
    async_cache_step: bool = False


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prefix hit at the first admission
    time_to_first_token_s: float = 0.0
    output_tokens: int = 0
    num_preemptions: int = 0
    total_time_s: float = 0.0


@dataclass
class TokenEvent:
    """What the engine reports for a request: new tokens, and at the end the finish reason
    and stats (``error`` if it was dropped)."""

    request_id: str
    token_ids: list[int]
    finish_reason: str = ""
    stats: RequestStats | None = None
    error: str = ""


@dataclass
class EngineRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset[int] = frozenset()
    cache_salt: str = ""
    sink: Callable[[TokenEvent], object] | None = None  # its return value is ignored
    # engine state
    outputs: list[int] = field(default_factory=list)
    num_computed: int = 0
    tables: list[list[int]] = field(default_factory=list)
    added: bool = False  # registered with the cache service
    pending_append: list[int] = field(default_factory=list)  # outputs the service has not seen
    # async cache steps: sampled ids of placeholders the service holds, not sent yet
    pending_fill: list[int] = field(default_factory=list)
    placeholders_sent: int = 0  # placeholders sent whose ids are still being sampled
    sampling_now: bool = False  # the forward pass in flight samples its next token
    finishing: bool = False  # that token is its last (it reaches max_tokens / the model length)
    boundary: int = 0  # shared-prefix boundary from the last lookup
    admitted_once: bool = False
    done: bool = False  # finished or aborted: a forward pass in flight samples nothing for it
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    stats: RequestStats = field(default_factory=RequestStats)

    @property
    def tokens(self) -> list[int]:
        """Prompt then generated tokens (a new list)."""
        return self.prompt + self.outputs


@dataclass(frozen=True)
class ScheduledChunk:
    """Scheduled work: compute ``req``'s tokens ``[start, start + n)`` in this step's forward."""

    req: EngineRequest
    start: int
    n: int


@dataclass(frozen=True)
class PendingAllocate:
    """An ``allocate`` of ``n`` slots for ``req`` in a batch; its answer is at ``op_index``."""

    req: EngineRequest
    n: int
    op_index: int


@dataclass(frozen=True)
class Candidate:
    """An admission candidate whose call-1 ``lookup`` answer is at ``op_index``."""

    req: EngineRequest
    op_index: int


@dataclass
class DecodeBatch:
    """The running requests of one step that share its ``decode`` op (in op order)."""

    requests: list[EngineRequest] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # the token each one appends
    op_index: int = -1  # the op's index in the step's batch


class StepRollback:
    """What a step changes in the engine before its first call answers: the free and preempt
    lists it sends, and ``added`` / ``pending_append`` of the requests it touches. A failed
    call applied nothing on the service, so :meth:`restore` makes the engine agree again."""

    def __init__(self, to_free: list[str], to_preempt: list[str],
                 fill_queue: list[EngineRequest]) -> None:
        self.to_free = to_free
        self.to_preempt = to_preempt
        self.fill_queue = fill_queue
        self._requests: list[tuple[EngineRequest, bool, list[int], list[int], int]] = []

    def touch(self, req: EngineRequest) -> None:
        """Remember ``req``'s sync state before the step changes it."""
        self._requests.append((req, req.added, req.pending_append, req.pending_fill,
                               req.placeholders_sent))

    def restore(self, engine: Engine) -> None:
        """Undoes the step's sync-state changes on every touched request and gives the engine
        back the frees, preempts and fills the step took."""
        engine.to_free = self.to_free + engine.to_free
        engine.to_preempt = self.to_preempt + engine.to_preempt
        engine.fill_queue = self.fill_queue + engine.fill_queue
        for req, added, pending, fill, sent in reversed(self._requests):
            req.added = added
            req.pending_append = pending
            req.pending_fill = fill
            req.placeholders_sent = sent


@dataclass
class InflightForward:
    """A forward pass running on the engine's worker thread (``--async-cache-step``)."""

    scheduled: list[ScheduledChunk]
    future: Future[Tensor]
    started_at: float
    done_at: float | None = None  # set by the worker when the pass ends


@dataclass
class EngineMetrics:
    steps: int = 0
    step_seconds: float = 0.0
    forward_seconds: float = 0.0
    cache_call_seconds: float = 0.0
    # Of cache_call_seconds, the time no forward pass ran meanwhile (the engine blocked on
    # the cache service): all of it without --async-cache-step.
    cache_wait_seconds: float = 0.0
    cache_calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0  # running requests preempted for lack of blocks (then recomputed)
    admission_rollbacks: int = 0  # admitted-then-undone candidates (FCFS); the service counts
    # these as preemptions too, because the engine undoes them with a preempt op
    finished: int = 0
    reregistrations: int = 0


class Engine:
    """Owns the scheduling state; ``run()`` loops in a dedicated thread. ``submit`` and
    ``abort`` are thread-safe (they go through an inbox the loop drains)."""

    def __init__(self, runner: ModelRunner, link: CacheLink, config: EngineConfig = EngineConfig(),
                 *, on_reregister: Callable[[], None] | None = None) -> None:
        self.runner = runner
        self.link = link
        self.config = config
        self.layout: list[GroupLayout] = runner.layout
        self.max_model_len = runner.model.config.max_model_len
        self.vocab_size = runner.model.config.vocab_size
        aligned = [g.block_size for g in self.layout
                   if g.kind == "mamba" and g.mamba_cache_mode == "align"]
        self.mamba_align_block = max(aligned) if aligned else 0
        check_engine_config(config, self.mamba_align_block)
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.to_free: list[str] = []
        # Requests the engine moved to waiting whose preempt has not reached the service yet.
        self.to_preempt: list[str] = []
        # Requests with sampled ids of placeholders to send (async cache steps).
        self.fill_queue: list[EngineRequest] = []
        self.inflight: InflightForward | None = None
        self._worker: ThreadPoolExecutor | None = None
        self.inbox: queue.Queue[tuple[str, EngineRequest | str | None]] = queue.Queue()
        self.metrics = EngineMetrics()
        self.free_blocks_hint: int | None = None
        self.on_reregister = on_reregister
        self._stop = threading.Event()
        self._ids = itertools.count()
        # (group, src, dst) block copies the service answered during this step's calls
        # (partial prefix hits): run, in order, before the step's forward pass.
        self.block_copies: list[tuple[int, int, int]] = []

    # ------------------------------------------------------------------ public, thread-safe
    def submit(self, req: EngineRequest) -> None:
        """Queues a validated request (raises InvalidArgument naming the field otherwise);
        thread-safe."""
        self.validate(req)
        self.inbox.put(("add", req))

    def abort(self, request_id: str) -> None:
        """Asks the engine loop to drop ``request_id`` (a no-op for an unknown one);
        thread-safe."""
        self.inbox.put(("abort", request_id))

    def stop(self) -> None:
        """Asks the engine loop to stop after the current step; thread-safe."""
        self._stop.set()
        self.inbox.put(("wake", None))

    def new_request_id(self) -> str:
        """A request id unique in this process."""
        return f"req-{next(self._ids)}-{time.monotonic_ns()}"

    def validate(self, req: EngineRequest) -> None:
        """Raises InvalidArgument naming the field of the first thing wrong with ``req`` (empty
        prompt, token out of vocabulary, bad max_tokens, too long, sampling)."""
        if not req.prompt:
            raise InvalidArgument("at least one token is required", field="prompt_token_ids")
        bad = next((i for i, t in enumerate(req.prompt) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidArgument(f"{req.prompt[bad]} is outside [0, {self.vocab_size})",
                                  field=f"prompt_token_ids[{bad}]")
        if req.max_tokens < 1:
            raise InvalidArgument(f"must be >= 1, got {req.max_tokens}", field="max_tokens")
        if len(req.prompt) + req.max_tokens > self.max_model_len:
            raise InvalidArgument(f"prompt ({len(req.prompt)}) + max_tokens ({req.max_tokens}) "
                                  f"exceeds max_model_len {self.max_model_len}", field="max_tokens")
        req.sampling.validate()

    @property
    def has_work(self) -> bool:
        """Whether anything is waiting, running, to be freed or preempted, or in flight."""
        return bool(self.waiting or self.running or self.to_free or self.to_preempt
                    or self.inflight is not None)

    def run(self) -> None:
        """Loop until ``stop()``: drain the inbox, step while there is work."""
        while not self._stop.is_set():
            self._drain_inbox(block=not self.has_work)
            if self._stop.is_set():
                break
            if not self.has_work:
                continue
            try:
                try:
                    self.step()
                except PoolLost:
                    self.handle_pool_lost()
            except CacheUnavailable as exc:
                log.warning("cache_unavailable", error=str(exc))
                self._stop.wait(0.5)  # back off; stop() still ends the loop at once
            except Exception as exc:  # a bug or a rejected batch: fail the requests, keep serving
                log.exception("engine_step_failed")
                self.fail_all(f"engine step failed: {exc}")

    def fail_all(self, error: str) -> None:
        """Drop every request with ``error`` and free whatever the service holds for them."""
        self._discard_inflight()
        self.fill_queue = []  # their placeholders go with them
        for req in list(self.running) + list(self.waiting):
            if req.added:
                self.to_free.append(req.request_id)
            self._emit(req, [], error=error)
        self.running.clear()
        self.waiting.clear()
        self.to_preempt = []  # those requests are freed now

    # ------------------------------------------------------------------ scheduling
    def _drain_inbox(self, *, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if isinstance(payload, EngineRequest):  # kind "add"
                payload.stats.prompt_tokens = len(payload.prompt)
                self.waiting.append(payload)
            elif kind == "abort":
                self._abort(str(payload))
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _abort(self, rid: str) -> None:
        for coll in (self.waiting, self.running):
            for req in list(coll):
                if req.request_id == rid:
                    coll.remove(req)
                    req.done = True
                    if req.added:
                        self.to_free.append(rid)
                        if rid in self.to_preempt:  # freed instead
                            self.to_preempt.remove(rid)
                    self._emit(req, [], finish="abort")

    def chunk_len(self, req: EngineRequest, start: int, budget: int) -> int:
        """Tokens to compute from ``start`` under ``budget`` (0: cannot progress now)."""
        return plan_chunk(start, len(req.tokens) + req.sampling_now, budget, boundary=req.boundary,
                          align_block=self.mamba_align_block)

    def _blocks_estimate(self, req: EngineRequest) -> int:
        """Blocks a request may need for its whole sequence (no hit): admission sizing only."""
        n = len(req.tokens) + req.max_tokens - len(req.outputs)
        total = 0
        for g in self.layout:
            if g.kind == "mamba":
                total += 2
            else:
                total += -(-n // g.block_size)
        return total

    def step(self) -> None:
        """One engine step: its cache calls, then its forward pass. With
        ``async_cache_step`` the calls run while the previous step's forward pass (launched
        on the worker thread) computes, then that pass is finished (sampling) and this
        step's is launched; the engine waits on the cache only for the part of a call that
        outlasts the forward pass."""
        t0 = time.perf_counter()
        calls0, secs0 = self.link.calls, self.link.call_seconds
        self.link.intervals = []
        overlapped = self.inflight
        scheduled = self._schedule()
        self.metrics.cache_calls += self.link.calls - calls0
        self.metrics.cache_call_seconds += self.link.call_seconds - secs0
        if self.inflight is not None:
            self._join()
        # After the pass in flight (a copy's destination may be a block it still wrote)
        # and before this step's: its tables may hold a copy's destination.
        self.runner.copy_blocks(self.block_copies)
        done_at = overlapped.done_at if overlapped is not None else None
        self.metrics.cache_wait_seconds += exposed_wait(self.link.intervals, done_at)
        if self.config.async_cache_step:
            scheduled = [c for c in scheduled if not c.req.done]
            if scheduled:
                self._launch(scheduled)
        elif scheduled:
            tf = time.perf_counter()
            self._execute(scheduled)
            self.metrics.forward_seconds += time.perf_counter() - tf
        self.metrics.steps += 1
        self.metrics.step_seconds += time.perf_counter() - t0

    def _schedule(self) -> list[ScheduledChunk]:
        """This step's cache calls (see the module docstring); the chunks to compute."""
        self.block_copies = []
        step_ops = []
        fill_queue = self.fill_queue
        if fill_queue:  # first: frees, preempts and decodes come after their fills
            rids: list[str] = []
            toks: list[int] = []
            for req in fill_queue:
                rids += [req.request_id] * len(req.pending_fill)
                toks += req.pending_fill
            step_ops.append(ops.fill(rids, toks))
        step_ops += [ops.free(rid) for rid in self.to_free]
        step_ops += [ops.preempt(rid) for rid in self.to_preempt]
        # Nothing below is committed unless call 1 succeeds (a failed Step applied nothing).
        rollback = StepRollback(self.to_free, self.to_preempt, fill_queue)
        for req in fill_queue:
            rollback.touch(req)
            req.pending_fill = []
        self.to_free, self.to_preempt, self.fill_queue = [], [], []
        budget = self.config.max_tokens_per_step
        decoding, planned, budget = self._plan_running(step_ops, rollback, budget)
        candidates = self._plan_candidates(step_ops, rollback, budget)
        try:
            result = self.link.step(step_ops, begin_step=True)
        except Exception:
            rollback.restore(self)
            raise
        self.free_blocks_hint = result.num_free_blocks

        scheduled: list[ScheduledChunk] = []
        # no room: their tokens are appended, the retry allocates
        failed: list[PendingAllocate] = []
        if decoding:
            decoded = result.result(decoding.op_index, DecodeResult)
            ok, grown = decoded.ok, decoded.new_block_ids
            self._note_copies(decoded)
            for i, req in enumerate(decoding.requests):
                if not ok[i]:
                    failed.append(PendingAllocate(req, 1, -1))
                    continue
                if i in grown:
                    req.tables = [t + new for t, new in zip(req.tables, grown[i])]
                scheduled.append(ScheduledChunk(req, req.num_computed, 1))
        failed += self._take_allocations(planned, result, scheduled)
        if failed:
            if self.inflight is not None:
                # The victim's sampled token must reach the service before its preempt
                # (else the block it completes is freed uncached): finish the pass first.
                self._join()
                failed = [a for a in failed if not a.req.done]
                scheduled = [c for c in scheduled if not c.req.done]
            if failed:
                scheduled = self._preempt_and_retry(scheduled, failed)
        elif candidates:
            budget = self.config.max_tokens_per_step - sum(c.n for c in scheduled)
            scheduled += self._admit(candidates, result.results, budget)
        return scheduled

    def _plan_running(self, step_ops: list, rollback: StepRollback, budget: int
                      ) -> tuple[DecodeBatch | None, list[PendingAllocate], int]:
        """Append the running requests' ops to ``step_ops`` (oldest first); returns the decode
        batch, the generic allocations and the budget left.

        A request in pure decode (one new token: its last sampled one, not yet appended) goes
        into ONE ``decode`` op (append + allocate 1 slot, answered without block tables: the
        engine extends ``req.tables`` with the new blocks). Everything else (prefill chunks)
        gets ``append`` + ``allocate``. Invariant: the service applies the allocations in
        ``self.running`` order, exactly as one allocate per request would — the decode op only
        takes requests that precede every generic allocation (a decode request behind a
        prefill chunk, rare, gets generic ops), and it is placed before those allocations.
        """
        decode = DecodeBatch()
        generic: list[tuple[EngineRequest, list[int], int]] = []  # (req, tokens to append, n)
        for req in self.running:
            n = self.chunk_len(req, req.num_computed, budget)
            if n == 0:
                continue
            budget -= n
            pending = req.pending_append
            if pending or req.sampling_now:
                rollback.touch(req)
                req.pending_append = []
            if req.sampling_now:
                # Its token is being sampled by the forward pass in flight: a placeholder.
                req.placeholders_sent += 1
                if not generic:
                    decode.requests.append(req)
                else:
                    generic.append((req, pending, n))
            elif n == 1 and len(pending) == 1 and not generic \
                    and not self.config.async_cache_step:
                decode.requests.append(req)
                decode.token_ids.append(pending[0])
            else:
                generic.append((req, pending, n))
        if decode.requests:
            decode.op_index = len(step_ops)
            rids = [r.request_id for r in decode.requests]
            step_ops.append(ops.decode(rids, placeholders=True) if self.config.async_cache_step
                            else ops.decode(rids, decode.token_ids))
        planned: list[PendingAllocate] = []
        for req, pending, n in generic:
            if pending:
                step_ops.append(ops.append(req.request_id, pending))
            planned.append(PendingAllocate(req, n, len(step_ops)))
            step_ops.append(ops.allocate(req.request_id, n,
                                         num_placeholder_tokens=1 if req.sampling_now else 0))
        return (decode if decode.requests else None), planned, budget

    def _plan_candidates(self, step_ops: list, rollback: StepRollback,
                         budget: int) -> list[Candidate]:
        """Append ``add``/``append`` + ``lookup`` of the waiting requests that may be admitted
        this step (FCFS, within the budget, ``max_num_seqs`` and the free-block estimate)."""
        candidates: list[Candidate] = []
        free_est = self.free_blocks_hint
        for req in self.waiting:
            if budget <= 0 or len(self.running) + len(candidates) >= self.config.max_num_seqs:
                break
            need = self._blocks_estimate(req)
            if candidates and free_est is not None and need > free_est:
                break
            if free_est is not None:
                free_est -= need
            rollback.touch(req)
            if not req.added:
                step_ops.append(ops.add(req.request_id, req.tokens,
                                        cache_salt=req.cache_salt or None))
                req.added = True
            elif req.pending_append:
                step_ops.append(ops.append(req.request_id, req.pending_append))
            req.pending_append = []
            candidates.append(Candidate(req, len(step_ops)))
            step_ops.append(ops.lookup(req.request_id))
            budget -= 1  # a candidate computes at least one token
        return candidates

    def _take_allocations(self, allocs: list[PendingAllocate], result: StepResult,
                          scheduled: list[ScheduledChunk]) -> list[PendingAllocate]:
        """Each allocation's answer: granted -> the request's new tables and a scheduled
        chunk (appended to ``scheduled``); refused -> returned, to preempt for."""
        refused = []
        for alloc in allocs:
            answer = result.result(alloc.op_index, AllocateResult)
            self._note_copies(answer)
            if answer.ok:
                alloc.req.tables = answer.block_ids
                scheduled.append(ScheduledChunk(alloc.req, alloc.req.num_computed, alloc.n))
            else:
                refused.append(alloc)
        return refused

    def _preempt_and_retry(self, scheduled: list[ScheduledChunk],
                           failed: list[PendingAllocate]) -> list[ScheduledChunk]:
        """vLLM's policy: while a running request gets no room, preempt the newest running
        request and retry; a request that is itself the newest is preempted. If a round's call
        fails, the victim's preempt is sent with the next step and the requests still without
        room wait for the next step (their tokens are appended; they only need slots)."""
        while failed:
            victim = self.running[-1]
            fill = victim.pending_fill  # async: its last sampled id, sent before the preempt
            round_ops = [ops.fill([victim.request_id] * len(fill), fill)] if fill else []
            if fill:
                victim.pending_fill = []
                self.fill_queue.remove(victim)
            round_ops.append(ops.preempt(victim.request_id))
            self._to_waiting(victim)
            scheduled = [c for c in scheduled if c.req is not victim]
            survivors = [a for a in failed if a.req is not victim]
            retry = [PendingAllocate(a.req, a.n, i)
                     for i, a in enumerate(survivors, start=len(round_ops))]
            round_ops += [ops.allocate(a.req.request_id, a.n) for a in retry]
            try:
                result = self.link.step(round_ops)
            except CacheUnavailable as exc:
                log.warning("preempt_call_failed", error=str(exc))
                self.to_preempt.append(victim.request_id)
                if fill:  # the next step's call 1 fills it before the preempt
                    victim.pending_fill = fill
                    self.fill_queue.append(victim)
                break
            self.free_blocks_hint = result.num_free_blocks
            failed = self._take_allocations(retry, result, scheduled)
        order = {id(r): i for i, r in enumerate(self.running)}
        return sorted(scheduled, key=lambda c: order.get(id(c.req), 0))

    def _note_copies(self, answer: AllocateResult | DecodeResult) -> None:
        self.block_copies += [(c.group, c.src_block_id, c.dst_block_id)
                              for c in answer.block_copies]

    def _to_waiting(self, req: EngineRequest) -> None:
        """Preempted: back to the front of the queue; everything is recomputed on re-admission."""
        self.running.remove(req)
        req.num_computed = 0
        req.tables = []
        req.boundary = 0
        req.stats.num_preemptions += 1
        self.metrics.preemptions += 1
        self.waiting.appendleft(req)

    def _admit(self, candidates: list[Candidate], first: Sequence[object],
               budget: int) -> list[ScheduledChunk]:
        """The admission call (``lookup`` + ``allocate(full_sequence_must_fit)`` per
        candidate); returns the admitted chunks. If the call fails the candidates stay
        waiting (nothing applied; they look up again next step)."""
        admit_ops = []
        plan: list[PendingAllocate] = []
        unit = min(g.block_size for g in self.layout)
        for cand in candidates:
            req = cand.req
            lk = first[cand.op_index]
            assert isinstance(lk, LookupResult)
            shared = max((_common_prefix(req.tokens, a.req.tokens) for a in plan), default=0)
            if shared // unit * unit > lk.hit_tokens:
                break  # an earlier candidate computes our prefix now: wait one step, then hit it
            req.boundary = (lk.shared_prefix_boundary
                            if lk.shared_prefix_boundary > lk.hit_tokens else 0)
            n = self.chunk_len(req, lk.hit_tokens, budget)
            if n <= 0:
                break
            admit_ops.append(ops.lookup(req.request_id))
            plan.append(PendingAllocate(req, n, len(admit_ops)))
            admit_ops.append(ops.allocate(req.request_id, n, full_sequence_must_fit=True))
            budget -= n
        if not plan:
            return []
        try:
            result = self.link.step(admit_ops)
        except CacheUnavailable as exc:  # admit next step; the running requests still run now
            log.warning("admission_call_failed", error=str(exc))
            return []
        self.free_blocks_hint = result.num_free_blocks
        admitted: list[ScheduledChunk] = []
        rollback: list[EngineRequest] = []
        stopped = False
        for alloc in plan:
            req = alloc.req
            answer = result.result(alloc.op_index, AllocateResult)
            self._note_copies(answer)  # also a rolled-back one's: its blocks may be reused
            if not answer.ok:
                stopped = True
                continue
            start = answer.hit_tokens_used
            if stopped or start + alloc.n > len(req.tokens):
                rollback.append(req)  # FCFS, or the hit changed under us: undo and retry later
                continue
            self.waiting.remove(req)
            self.running.append(req)
            req.tables = answer.block_ids
            req.num_computed = start
            if not req.admitted_once:
                req.admitted_once = True
                req.stats.cached_tokens = start
                self.metrics.prompt_tokens += len(req.prompt)
                self.metrics.cached_tokens += start
            admitted.append(ScheduledChunk(req, start, alloc.n))
        if rollback:
            self.metrics.admission_rollbacks += len(rollback)
            try:
                result = self.link.step([ops.preempt(r.request_id) for r in rollback])
                self.free_blocks_hint = result.num_free_blocks
            except CacheUnavailable as exc:  # they hold blocks until the next step's call 1
                log.warning("admission_rollback_failed", error=str(exc))
                self.to_preempt += [r.request_id for r in rollback]
        return admitted

    def _execute(self, scheduled: list[ScheduledChunk]) -> None:
        """The forward pass of ``scheduled`` in this thread, then sampling."""
        tokens, chunks = _inputs(scheduled)
        logits = self.runner.forward(tokens, chunks)
        self._computed(scheduled)
        self._sample(scheduled, logits)

    def _launch(self, scheduled: list[ScheduledChunk]) -> None:
        """Starts the forward pass of ``scheduled`` on the worker thread and records now what
        it will have done (computed tokens; which requests sample, and which of those
        finish by length), so that the next step can be planned while it runs."""
        tokens, chunks = _inputs(scheduled)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        forward = self.runner.forward

        def run() -> Tensor:
            try:
                return forward(tokens, chunks)
            finally:
                inflight.done_at = time.perf_counter()

        inflight = InflightForward(scheduled, None, time.perf_counter())  # type: ignore[arg-type]
        inflight.future = self._worker.submit(run)
        self.inflight = inflight
        self._computed(scheduled)
        for c in scheduled:
            req = c.req
            if req.sampling_now and (len(req.outputs) + 1 >= req.max_tokens
                                 or len(req.tokens) + 1 >= self.max_model_len):
                # Its next token is its last: freed by the next step's call, as it would be
                # after this pass without the overlap.
                req.finishing = True
                self.running.remove(req)
                self.to_free.append(req.request_id)

    def _join(self) -> None:
        """Waits for the forward pass in flight, then samples."""
        inflight, self.inflight = self.inflight, None
        assert inflight is not None
        logits = inflight.future.result()
        assert inflight.done_at is not None  # set before the future completes
        self.metrics.forward_seconds += inflight.done_at - inflight.started_at
        self._sample(inflight.scheduled, logits)

    def _discard_inflight(self) -> None:
        """Lets a forward pass in flight end, keeping nothing of it (its requests are being
        dropped or recomputed)."""
        inflight, self.inflight = self.inflight, None
        if inflight is not None:
            with contextlib.suppress(Exception):
                inflight.future.result()
            for c in inflight.scheduled:
                c.req.sampling_now = False

    def _computed(self, scheduled: list[ScheduledChunk]) -> None:
        self.metrics.computed_tokens += sum(c.n for c in scheduled)
        for c in scheduled:
            req = c.req
            req.num_computed = c.start + c.n
            req.sampling_now = req.num_computed == len(req.tokens)

    def _sample(self, scheduled: list[ScheduledChunk], logits: Tensor) -> None:
        rows, params, positions = [], [], []
        for b, c in enumerate(scheduled):
            req = c.req
            if req.sampling_now:
                req.sampling_now = False
                if req.done:  # aborted meanwhile
                    continue
                rows.append(b)
                params.append(req.sampling)
                positions.append(req.num_computed)
        if not rows:
            return
        picks = sample(logits[rows], params, positions)
        now = time.perf_counter()
        for b, tok in zip(rows, picks):
            req = scheduled[b].req
            req.outputs.append(tok)
            self.metrics.generated_tokens += 1
            if req.first_token_at is None:
                req.first_token_at = now
                req.stats.time_to_first_token_s = now - req.arrival
            finish = ""
            if tok in req.stop_token_ids:
                finish = "stop"
            elif len(req.outputs) >= req.max_tokens or len(req.tokens) >= self.max_model_len:
                finish = "length"
            if req.placeholders_sent:
                # The service holds a placeholder for it: its id goes with the next call
                # (not for a last token: the request is freed instead).
                req.placeholders_sent -= 1
                if not finish:
                    if not req.pending_fill:
                        self.fill_queue.append(req)
                    req.pending_fill.append(tok)
            else:
                req.pending_append = [tok]
            if finish:
                req.done = True
                if not req.finishing:
                    self.running.remove(req)
                    self.to_free.append(req.request_id)
                self.metrics.finished += 1
            self._emit(req, [tok], finish=finish)

    def _emit(self, req: EngineRequest, tokens: list[int], *, finish: str = "",
              error: str = "") -> None:
        stats = None
        if finish or error:
            req.stats.output_tokens = len(req.outputs)
            req.stats.total_time_s = time.perf_counter() - req.arrival
            stats = req.stats
        if req.sink is not None:
            req.sink(TokenEvent(req.request_id, tokens, finish, stats, error))

    # ------------------------------------------------------------------ service restarts
    def handle_pool_lost(self) -> None:
        """The cache service forgot our pool: every request goes back to waiting (in arrival
        order, outputs kept and recomputed), then we register again."""
        log.warning("pool_lost", running=len(self.running), waiting=len(self.waiting))
        if self.inflight is not None:
            self._join()  # its tokens are real; only the service's view is gone
        for req in self.running:
            req.stats.num_preemptions += 1  # its computed tokens are gone: it is recomputed
        everyone = sorted(list(self.running) + list(self.waiting), key=lambda r: r.arrival)
        self.running.clear()
        self.waiting = deque(everyone)
        self.to_free = []
        self.to_preempt = []
        self.fill_queue = []
        for req in everyone:
            req.added = False
            req.num_computed = 0
            req.tables = []
            req.pending_append = []
            req.pending_fill = []
            req.placeholders_sent = 0
            req.boundary = 0
        self.free_blocks_hint = None
        self.metrics.reregistrations += 1
        while not self._stop.is_set():
            try:
                self.link.register()
                break
            except CacheUnavailable:
                self._stop.wait(0.5)
        if self.on_reregister is not None:
            self.on_reregister()


def check_engine_config(config: EngineConfig, mamba_align_block: int) -> None:
    """Settings that can never work with this pool layout (checked at start)."""
    if config.max_tokens_per_step < max(mamba_align_block, 1):
        raise SettingError(f"{config.max_tokens_per_step} is below the Mamba block size "
                           f"{mamba_align_block}; prefill could never progress (raise it to at "
                           f"least {mamba_align_block}, or use --mamba-cache-mode none)",
                           field="--max-tokens-per-step")


def plan_chunk(start: int, total: int, budget: int, *, boundary: int = 0,
               align_block: int = 0) -> int:
    """Length of the next chunk of a request with ``start`` of ``total`` tokens computed.

    Never more than ``budget``; never across the shared-prefix ``boundary``; with Mamba
    ``align_block`` > 0, a chunk ends on a block boundary unless it completes the tokens from
    within their last partial block (the state at the last boundary is checkpointed first).
    """
    end = min(total, start + budget)
    if end <= start:
        return 0
    if boundary and start < boundary < end:
        end = boundary
    elif align_block:
        aligned = end // align_block * align_block
        if end < total or aligned > start:
            end = aligned
    return max(0, end - start)


def _inputs(scheduled: list[ScheduledChunk]) -> tuple[list[list[int]], list[SeqChunk]]:
    """The forward pass's token lists and chunks (the tables as they are now: the engine
    replaces a request's table lists, never changes them in place)."""
    return ([c.req.tokens[c.start:c.start + c.n] for c in scheduled],
            [SeqChunk(c.start, c.n, c.req.tables) for c in scheduled])


def exposed_wait(intervals: list[tuple[float, float]], forward_done: float | None) -> float:
    """Seconds of the cache calls ``intervals`` during which no forward pass ran: all of
    each call, except the part before ``forward_done`` (the end of the pass they overlapped;
    None = none did)."""
    if forward_done is None:
        return sum(end - start for start, end in intervals)
    return sum(max(0.0, end - max(start, forward_done)) for start, end in intervals)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
