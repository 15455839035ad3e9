"""The engine loop: continuous batching with chunked prefill over a paged cache whose blocks the
cache service hands out.

One engine step (:meth:`Engine.step`): the scheduler's cache calls (:mod:`executor.scheduler`:
which requests compute which tokens, and their slots from the service), then one forward pass
over every scheduled chunk; sample where a chunk reaches the end of the known tokens; stream
tokens; finished requests are freed in the next step's call. With ``async_cache_step`` a step's
calls run while the previous step's forward pass computes (on a worker thread); tokens that
pass is still sampling go to the service as placeholders, their ids one step later.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import structlog
from torch import Tensor

from executor.cache_link import CacheLink
from executor.errors import CacheUnavailable, InvalidArgument, PoolLost, SettingError
from executor.forward_meta import GroupLayout, SeqChunk
from executor.runner import ModelRunner
from executor.sampling import SamplingParams, sample
from executor.scheduler import ScheduledChunk, Scheduler

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
    # Host tier: requests preempted because a promotion into a block they read failed
    # (they recompute; docs/executor.md#host-tier).
    tier_recomputes: int = 0


class Engine:
    """Runs the requests: its :class:`Scheduler` (``scheduler``) plans each step and makes
    its cache calls, the engine runs the forward pass and samples. ``run()`` loops in a
    dedicated thread. ``submit`` and ``abort`` are thread-safe (they go through an inbox the
    loop drains)."""

    def __init__(self, runner: ModelRunner, link: CacheLink, config: EngineConfig = EngineConfig(),
                 *, on_reregister: Callable[[], None] | None = None) -> None:
        self.runner = runner
        self.link = link
        self.config = config
        self.layout: list[GroupLayout] = runner.layout
        self.max_model_len = runner.model.config.max_model_len
        self.vocab_size = runner.model.config.vocab_size
        self.metrics = EngineMetrics()
        self.scheduler = Scheduler(link, config, self.layout, self.metrics)
        check_engine_config(config, self.scheduler.mamba_align_block)
        # A new executor's host tier is empty (a new tier incarnation): the service must
        # forget what an earlier incarnation demoted, with our first Step.
        self.scheduler.reset_host_tier = runner.tier is not None
        self.inflight: InflightForward | None = None
        self._worker: ThreadPoolExecutor | None = None
        self.inbox: queue.Queue[tuple[str, EngineRequest | str | None]] = queue.Queue()
        self.on_reregister = on_reregister
        self._stop = threading.Event()
        self._ids = itertools.count()

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
        """Whether the scheduler has work, or a forward pass is in flight."""
        return self.scheduler.has_work or self.inflight is not None

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
        for req in self.scheduler.drop_all():
            self._emit(req, [], error=error)

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
                self.scheduler.waiting.append(payload)
            elif kind == "abort":
                self._abort(str(payload))
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _abort(self, rid: str) -> None:
        for req in self.scheduler.abort(rid):
            req.done = True
            self._emit(req, [], finish="abort")


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
        scheduled = self.scheduler.schedule(self._join if self.inflight is not None else None)
        self.metrics.cache_calls += self.link.calls - calls0
        self.metrics.cache_call_seconds += self.link.call_seconds - secs0
        if self.inflight is not None:
            self._join()
        # After the pass in flight (a copy's destination may be a block it still wrote,
        # a demotion's source one it wrote) and before this step's: its tables may hold a
        # copy's destination. Per answer, in order: demotions, promotions, block copies.
        tier = self.runner.tier
        failures = tier.failures if tier is not None else 0
        bad = self.runner.run_copies(self.scheduler.answers)
        if bad:  # a failed copy: nothing reads those blocks; their requests recompute
            scheduled = self.scheduler.drop_unreadable(scheduled, bad)
        if tier is not None and tier.failures > failures:
            # Host memory we cannot trust (a bad slot; the service keeps a promoted block's
            # host copy, so it would plan the same promotion again): the service forgets
            # every slot with the next call, before its lookups.
            self.scheduler.reset_host_tier = True
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
                self.scheduler.finished(req)

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
                        self.scheduler.fill_queue.append(req)
                    req.pending_fill.append(tok)
            else:
                req.pending_append = [tok]
            if finish:
                req.done = True
                if not req.finishing:
                    self.scheduler.finished(req)
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
        scheduler = self.scheduler
        log.warning("pool_lost", running=len(scheduler.running), waiting=len(scheduler.waiting))
        if self.inflight is not None:
            self._join()  # its tokens are real; only the service's view is gone
        for req in scheduler.running:
            req.stats.num_preemptions += 1  # its computed tokens are gone: it is recomputed
        scheduler.requeue_all()
        scheduler.reset_host_tier = self.runner.tier is not None
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


