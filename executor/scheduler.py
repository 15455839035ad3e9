"""The scheduler: which requests compute which tokens in one engine step, and the cache calls
that get their slots from the cache service (vLLM keeps its scheduler apart from the engine
too: the engine runs the forward passes and samples, the scheduler decides what they compute).

One step's calls (:meth:`Scheduler.schedule`):

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

Failures (a call that fails applied nothing on the service): if call 1 fails, everything the
step changed is rolled back (:class:`StepRollback`) and the step is retried later. If a later
call of the step fails, what the service granted in the earlier calls still runs (an
allocation that is never computed would put the two views apart), and a request the scheduler
already moved back to the waiting queue but whose ``preempt`` did not reach the service is
remembered in ``to_preempt``: the next step's call 1 sends that ``preempt`` first.

Chunking (:func:`plan_chunk`): a chunk is at most the remaining token budget. With Mamba
groups in ``align`` mode a chunk ends on a block boundary (only states at block boundaries are
cached), except the last one, which covers the prompt's final partial block (so the state at
the prompt's last block boundary is always checkpointed); and a chunk never crosses the
shared-prefix boundary the lookup reported (so the state at the end of a prefix shared with
cached data gets cached).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from cache_service.client import AllocateResult, DecodeResult, LookupResult, StepResult, ops
from executor.cache_link import CacheLink
from executor.errors import CacheUnavailable
from executor.forward_meta import GroupLayout
from executor.host_tier import TierCopy, tier_copies
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb

if TYPE_CHECKING:  # the engine owns the requests, its settings and its metrics
    from executor.engine import EngineConfig, EngineMetrics, EngineRequest

log = structlog.get_logger("executor.scheduler")


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
class AnswerCopies:
    """The copies one Step answer asks for, in the order the executor runs them
    (docs/protocol.md#host-tier): ``reset`` (this answer carried our ResetHostTierOp: the
    host slots are forgotten first), every demotion, every promotion, then the block
    copies; then the next answer's, and after the last one the forward pass."""

    demotions: list[TierCopy] = field(default_factory=list)
    promotions: list[TierCopy] = field(default_factory=list)
    block_copies: list[tuple[int, int, int]] = field(default_factory=list)
    reset: bool = False


@dataclass
class DecodeBatch:
    """The running requests of one step that share its ``decode`` op (in op order)."""

    requests: list[EngineRequest] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # the token each one appends
    op_index: int = -1  # the op's index in the step's batch


class StepRollback:
    """What a step changes in the scheduler before its first call answers: the free and
    preempt lists it sends, and ``added`` / ``pending_append`` of the requests it touches. A
    failed call applied nothing on the service, so :meth:`restore` makes the two agree again."""

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

    def restore(self, scheduler: Scheduler) -> None:
        """Undoes the step's sync-state changes on every touched request and gives the
        scheduler back the frees, preempts and fills the step took."""
        scheduler.to_free = self.to_free + scheduler.to_free
        scheduler.to_preempt = self.to_preempt + scheduler.to_preempt
        scheduler.fill_queue = self.fill_queue + scheduler.fill_queue
        for req, added, pending, fill, sent in reversed(self._requests):
            req.added = added
            req.pending_append = pending
            req.pending_fill = fill
            req.placeholders_sent = sent


class Scheduler:
    """The engine's scheduling state (the waiting and running queues, what the service must
    still be told) and the cache calls of each step. Runs on the engine's loop thread only."""

    def __init__(self, link: CacheLink, config: EngineConfig, layout: list[GroupLayout],
                 metrics: EngineMetrics) -> None:
        self.link = link
        self.config = config
        self.layout = layout
        self.metrics = metrics
        aligned = [g.block_size for g in layout
                   if g.kind == "mamba" and g.mamba_cache_mode == "align"]
        self.mamba_align_block = max(aligned) if aligned else 0
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.to_free: list[str] = []
        # Requests moved to waiting whose preempt has not reached the service yet.
        self.to_preempt: list[str] = []
        # Requests with sampled ids of placeholders to send (async cache steps).
        self.fill_queue: list[EngineRequest] = []
        self.free_blocks_hint: int | None = None
        # (group, src, dst) block copies the service answered during this step's calls
        # (partial prefix hits): run, in order, before the step's forward pass.
        self.block_copies: list[tuple[int, int, int]] = []
        # Every answer of this step's calls with its copies, in the order received.
        self.answers: list[AnswerCopies] = []
        # Host tier: send a ResetHostTierOp with the next step's call 1 (set at start: a
        # new executor's host tier is empty; and after a failed demotion: a bad host slot).
        self.reset_host_tier = False
        # Device blocks whose cache entries the service must drop (a failed promotion left
        # garbage in them) before the next step's call 1 can look them up.
        self.to_evict: list[int] = []

    @property
    def has_requests(self) -> bool:
        """Requests waiting or running."""
        return bool(self.waiting or self.running)

    @property
    def has_work(self) -> bool:
        """Requests to run, or frees and preempts the service has not been sent yet."""
        return bool(self.waiting or self.running or self.to_free or self.to_preempt)

    def finished(self, req: EngineRequest) -> None:
        """``req`` runs no more: it leaves the running queue, freed by the next step's call."""
        self.running.remove(req)
        self.to_free.append(req.request_id)

    def abort(self, rid: str) -> list[EngineRequest]:
        """Drops the request ``rid`` from the queues (freed on the service by the next
        step's call when it was registered there); the requests dropped."""
        dropped = []
        for coll in (self.waiting, self.running):
            for req in list(coll):
                if req.request_id == rid:
                    coll.remove(req)
                    dropped.append(req)
                    if req.added:
                        self.to_free.append(rid)
                        if rid in self.to_preempt:  # freed instead
                            self.to_preempt.remove(rid)
        return dropped

    def drop_all(self) -> list[EngineRequest]:
        """Drops every request (each registered one is freed by the next step's call);
        the requests dropped, running ones first."""
        dropped = list(self.running) + list(self.waiting)
        self.fill_queue = []  # their placeholders go with them
        for req in dropped:
            if req.added:
                self.to_free.append(req.request_id)
        self.running.clear()
        self.waiting.clear()
        self.to_preempt = []  # those requests are freed now
        return dropped

    def requeue_all(self) -> None:
        """The service forgot every request (its pool was lost): all of them wait again, in
        arrival order, unregistered, to be recomputed (their outputs are kept)."""
        everyone = sorted(list(self.running) + list(self.waiting), key=lambda r: r.arrival)
        self.running.clear()
        self.waiting = deque(everyone)
        self.to_free = []
        self.to_preempt = []
        self.fill_queue = []
        self.to_evict = []  # block ids of the forgotten pool
        for req in everyone:
            req.added = False
            req.num_computed = 0
            req.tables = []
            req.pending_append = []
            req.pending_fill = []
            req.placeholders_sent = 0
            req.boundary = 0
        self.free_blocks_hint = None

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


    def schedule(self, finish_inflight: Callable[[], None] | None = None
                 ) -> list[ScheduledChunk]:
        """This step's cache calls (see the module docstring); the chunks to compute.
        ``finish_inflight``: ends the forward pass in flight (its sampling included), when
        there is one: a preemption waits for it (see below)."""
        self.block_copies = []
        self.answers = []
        if self.to_evict:  # before any lookup can hit them again; fails the step otherwise
            self.link.evict_blocks(self.to_evict)
            self.to_evict = []
        step_ops: list[pb.Op] = []
        reset = self.reset_host_tier
        if reset:  # first: nothing of this batch may hit a host slot we no longer hold
            step_ops.append(ops.reset_host_tier())
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
            result = self._call(step_ops, begin_step=True)
        except Exception:
            rollback.restore(self)
            raise
        if reset:
            self.reset_host_tier = False
            self.answers[-1].reset = True
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
            if finish_inflight is not None:
                # The victim's sampled token must reach the service before its preempt
                # (else the block it completes is freed uncached): finish the pass first.
                finish_inflight()
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
                result = self._call(round_ops)
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

    def _call(self, step_ops: Sequence[pb.Op], *, begin_step: bool = False) -> StepResult:
        """One Step call; its answer's host-tier copies are recorded (in ``answers``, in
        the order received) before anything of it is used."""
        result = self.link.step(step_ops, begin_step=begin_step)
        self.answers.append(AnswerCopies(tier_copies(result.demotions),
                                         tier_copies(result.promotions)))
        return result

    def _note_copies(self, answer: AllocateResult | DecodeResult) -> None:
        copies = [(c.group, c.src_block_id, c.dst_block_id) for c in answer.block_copies]
        self.block_copies += copies
        self.answers[-1].block_copies += copies  # the answer being read is the last one

    def drop_unreadable(self, scheduled: list[ScheduledChunk],
                        bad: set[tuple[int, int]]) -> list[ScheduledChunk]:
        """A copy left garbage in the device blocks ``bad`` ((group, block) pairs): every
        scheduled request whose tables hold one is preempted (it recomputes; no forward
        pass reads them) and the blocks' cache entries are dropped on the service before
        the next lookup. Returns the chunks still to run."""
        self.to_evict += sorted({b for _, b in bad})
        keep = []
        for c in scheduled:
            req = c.req
            if any(b in req.tables[g] for g, b in bad if g < len(req.tables)):
                log.warning("tier_copy_failed_recompute", request_id=req.request_id)
                self.metrics.tier_recomputes += 1
                self._to_waiting(req)
                self.to_preempt.append(req.request_id)
            else:
                keep.append(c)
        return keep

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
            result = self._call(admit_ops)
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
                result = self._call([ops.preempt(r.request_id) for r in rollback])
                self.free_blocks_hint = result.num_free_blocks
            except CacheUnavailable as exc:  # they hold blocks until the next step's call 1
                log.warning("admission_rollback_failed", error=str(exc))
                self.to_preempt += [r.request_id for r in rollback]
        return admitted


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


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
