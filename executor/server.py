"""The executor service (``kvcache-executor``, started by :mod:`executor.cli`).

Lifecycle:

1. build the model (preset, ModelConfig JSON or Hugging Face checkpoint) and check the
   settings against it: a setting that cannot work (an unknown preset, a bad checkpoint,
   ``--max-tokens-per-step`` below the Mamba block size, a port in use ...) ends the process
   here with exit code 2 and ONE line ``kvcache-executor: error: <setting>:
   <why>`` on stderr;
2. listen, log ``{"event": "listening", "port": ..., "metrics_port": ...}``; health is
   NOT_SERVING; a background thread registers the pool with the cache service, retrying
   with backoff while it is unreachable, allocates the cache tensors from the answered
   config, starts the engine thread, then health turns SERVING and the ONE line
   ``{"event": "serving", "port": ..., ...}`` is logged (at every ``--log-level``: the same
   meaning as the cache service's line). Generate/Execute answer UNAVAILABLE until then;
3. if the cache service restarts and forgets the pool, the engine re-registers (same
   description -> same config, so the tensors stay) and re-queues its requests;
4. on SIGTERM/SIGINT: health NOT_SERVING, new Generate calls get UNAVAILABLE, running requests
   get ``drain_seconds`` to finish, then the server stops; exit code 0.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import grpc
import structlog
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.process_collector import ProcessCollector

from cache_service.client import CacheError
from cache_service.core.specs import MambaSpec
from executor.cache import CacheTensors, model_layer_specs
from executor.cache_link import CacheLink, PoolPlan, cache_groups
from executor.engine import Engine, EngineConfig, EngineRequest, TokenEvent, check_engine_config
from executor.errors import (
    CacheUnavailable,
    ExecutorError,
    InvalidArgument,
    NotReady,
    RequestFailed,
)
from executor.forward_meta import SeqChunk
from executor.host_tier import HostTier, fail_nth
from executor.model import HybridModel
from executor.model_config import ModelConfig
from executor.presets import get_preset
from executor.runner import ModelRunner
from executor.sampling import SamplingParams, sample
from executor.settings import ExecutorSettings
from kvcache_common.api.kvcache.v1 import executor_pb2 as epb
from kvcache_common.api.kvcache.v1 import executor_pb2_grpc as epb_grpc
from kvcache_common.backoff import Backoff
from kvcache_common.cli import exit_with_error
from kvcache_common.logs import lifecycle
from kvcache_common.serving import ListenError, start_server

SERVICE_NAME = epb.DESCRIPTOR.services_by_name["ExecutorService"].full_name
log = structlog.get_logger("executor.server")
#: Between registration attempts while the cache service is unreachable (no limit).
REGISTER_BACKOFF = Backoff(0.1, 2.0)

# The one place where executor errors become gRPC statuses (most specific first).
_CODES: tuple[tuple[type[ExecutorError], grpc.StatusCode], ...] = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (NotReady, grpc.StatusCode.UNAVAILABLE),
    (CacheUnavailable, grpc.StatusCode.UNAVAILABLE),
    (RequestFailed, grpc.StatusCode.ABORTED),
)


def status_code_of(exc: ExecutorError) -> grpc.StatusCode:
    """The status an executor error answers (INTERNAL for a class with no mapping)."""
    return next((code for cls, code in _CODES if isinstance(exc, cls)), grpc.StatusCode.INTERNAL)


def _answers_errors(handler: Any) -> Any:
    """Wraps a unary handler: an ExecutorError it raises becomes its status."""
    @functools.wraps(handler)
    async def call(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(self, request, context)
        except ExecutorError as exc:
            await context.abort(status_code_of(exc), str(exc))
    return call


def _streams_errors(handler: Any) -> Any:
    """Wraps a response-streaming handler: an ExecutorError it raises ends the stream with
    its status."""
    @functools.wraps(handler)
    async def call(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            async for msg in handler(self, request, context):
                yield msg
        except ExecutorError as exc:
            await context.abort(status_code_of(exc), str(exc))
    return call


def build_model(settings: ExecutorSettings) -> HybridModel:
    """The model named by the settings (checkpoint > config JSON > preset). A file that
    cannot be read or describes an unsupported model raises InvalidArgument naming the flag
    and the file's key."""
    if settings.hf_checkpoint is not None:
        from executor.hf_loader import load_hf_model

        try:
            return load_hf_model(settings.hf_checkpoint,
                                 max_model_len=settings.max_model_len or None)
        except (OSError, ValueError) as exc:
            raise InvalidArgument(f"{settings.hf_checkpoint}: {exc}",
                                  field="--hf-checkpoint") from None
    if settings.model_config_json is not None:
        try:
            cfg = ModelConfig.from_dict(json.loads(settings.model_config_json.read_text()))
        except (OSError, ValueError) as exc:
            raise InvalidArgument(f"{settings.model_config_json}: {exc}",
                                  field="--model-config-json") from None
    else:
        cfg = get_preset(settings.preset)  # unknown names are refused by the settings
    if settings.seed is not None:
        cfg = cfg.replace(seed=settings.seed)
    if settings.max_model_len:
        cfg = cfg.replace(max_model_len=settings.max_model_len)
    return HybridModel(cfg)


def pool_plan(model: HybridModel, settings: ExecutorSettings) -> PoolPlan:
    """What the executor registers; raises SettingError for settings that can never work
    with this model's pool layout (checked before listening)."""
    cfg = model.config
    mode = settings.mamba_cache_mode if settings.enable_prefix_caching else "none"
    specs = model_layer_specs(cfg, block_size=settings.block_size, mamba_cache_mode=mode)
    aligned = [s.block_size for s in specs.values()
               if isinstance(s, MambaSpec) and s.mamba_cache_mode == "align"]
    check_engine_config(engine_config(settings), max(aligned, default=0))
    pool_id = settings.pool_id or f"{cfg.name}-{uuid.uuid4().hex[:8]}"
    return PoolPlan(pool_id=pool_id, specs=specs, max_model_len=cfg.max_model_len,
                    num_blocks=settings.num_blocks or None,
                    memory_bytes=int(settings.cache_memory_mb * 1024 * 1024),
                    enable_caching=settings.enable_prefix_caching, vocab_size=cfg.vocab_size,
                    host_tier_blocks=settings.host_tier_blocks)


def host_tier(cache: CacheTensors, settings: ExecutorSettings) -> HostTier | None:
    """The host tier the settings ask for (None without --host-tier-blocks)."""
    if not settings.host_tier_blocks:
        return None
    fault = (fail_nth("promotion", settings.host_tier_fail_promotion)
             if settings.host_tier_fail_promotion else None)
    return HostTier(cache, settings.host_tier_blocks, fault=fault)


def engine_config(settings: ExecutorSettings) -> EngineConfig:
    """The engine's limits and modes from the executor's settings."""
    return EngineConfig(max_num_seqs=settings.max_num_seqs,
                        max_tokens_per_step=settings.max_tokens_per_step,
                        async_cache_step=settings.async_cache_step)


def _sampling(msg: epb.SamplingParams) -> SamplingParams:
    return SamplingParams(temperature=msg.temperature, top_k=msg.top_k,
                          top_p=msg.top_p if msg.top_p else 1.0, seed=msg.seed).validate()


def _stats_msg(stats: Any) -> epb.RequestStats:
    return epb.RequestStats(prompt_tokens=stats.prompt_tokens, cached_tokens=stats.cached_tokens,
                            time_to_first_token_s=stats.time_to_first_token_s,
                            output_tokens=stats.output_tokens,
                            num_preemptions=stats.num_preemptions, total_time_s=stats.total_time_s)


class Executor:
    """Model, cache link, cache tensors and engine of one executor process."""

    def __init__(self, settings: ExecutorSettings, model: HybridModel) -> None:
        self.settings = settings
        self.model = model
        self.plan = pool_plan(model, settings)
        self.link = CacheLink(settings.cache_service, self.plan)
        self.runner: ModelRunner | None = None
        self.engine: Engine | None = None
        self.ready = threading.Event()
        self.draining = False
        self._threads: list[threading.Thread] = []
        self._closing = threading.Event()

    def start(self, on_ready: Callable[[], Any], on_fatal: Callable[[str], None]) -> None:
        """Registers and brings up the engine on a thread; then ``on_ready()``, or
        ``on_fatal(one line saying why)`` if the executor can never serve."""
        t = threading.Thread(target=self._bring_up, args=(on_ready, on_fatal),
                             name="executor-register", daemon=True)
        t.start()
        self._threads.append(t)

    def _bring_up(self, on_ready: Callable[[], Any], on_fatal: Callable[[str], None]) -> None:
        attempt = 0
        while not self._closing.is_set():
            try:
                info = self.link.register()
                break
            except CacheError as exc:  # the service rejected our description: cannot serve
                log.error("registration_failed", error=str(exc), field=exc.field)
                on_fatal(f"the cache service refused the pool ({exc.message}); check "
                         f"--num-blocks / --cache-memory-mb / --max-model-len / --block-size")
                return
            except CacheUnavailable as exc:
                delay = REGISTER_BACKOFF.delay(attempt)
                attempt += 1
                log.warning("cache_service_unreachable", target=self.settings.cache_service,
                            retry_in_s=round(delay, 3), error=str(exc)[:200])
                self._closing.wait(delay)
        else:
            return
        try:  # a failure here must end the process, not leave it up and never SERVING
            cache = CacheTensors(self.model.config, cache_groups(info), info.num_blocks,
                                 info.layer_page_size_bytes, device=self.settings.device)
            tier = host_tier(cache, self.settings)
            self.runner = ModelRunner(self.model, cache, tier)
            self.engine = Engine(self.runner, self.link, engine_config(self.settings))
        except Exception as exc:
            log.exception("bring_up_failed")
            on_fatal(f"cannot serve the pool the cache service answered: {exc}")
            return
        t = threading.Thread(target=self.engine.run, name="executor-engine", daemon=True)
        t.start()
        self._threads.append(t)
        log.info("registered", pool_id=self.plan.pool_id, num_blocks=info.num_blocks,
                 groups=len(info.groups), page_size_bytes=info.page_size_bytes,
                 cache_bytes=cache.nbytes, host_tier_bytes=tier.nbytes if tier else 0)
        self.ready.set()
        on_ready()

    def close(self, join_seconds: float = 5.0) -> None:
        """Stops the engine and the link; waits up to ``join_seconds`` per thread (one
        blocked on a cache service that is gone would hold the stop that long)."""
        self._closing.set()
        if self.engine is not None:
            self.engine.stop()
        for t in self._threads:
            t.join(timeout=join_seconds)
        self.link.close()


class ExecutorServicer(epb_grpc.ExecutorServiceServicer):
    def __init__(self, ex: Executor) -> None:
        self.ex = ex

    def _require_ready(self) -> None:
        if self.ex.draining:
            raise NotReady("executor is draining")
        if not self.ex.ready.is_set():
            raise NotReady("executor is not registered with the cache service yet")

    @_streams_errors
    async def Generate(self, request: epb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[epb.GenerateResponse]:
        """Streams the tokens of one request as the engine samples them; aborts it when the
        caller goes away."""
        self._require_ready()
        engine = self.ex.engine
        assert engine is not None
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        rid = request.request_id or engine.new_request_id()
        if len(rid) > 200:
            raise InvalidArgument("at most 200 characters", field="request_id")
        engine.submit(EngineRequest(rid, list(request.prompt_token_ids), request.max_tokens,
                              sampling=_sampling(request.sampling),
                              stop_token_ids=frozenset(request.stop_token_ids),
                              cache_salt=request.cache_salt,
                              sink=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev)))
        done = False
        try:
            while True:
                ev = await events.get()
                if ev.error:
                    done = True
                    raise RequestFailed(ev.error)
                msg = epb.GenerateResponse(request_id=rid, token_ids=ev.token_ids,
                                           finish_reason=ev.finish_reason)
                if ev.stats is not None:
                    msg.stats.CopyFrom(_stats_msg(ev.stats))
                if ev.finish_reason:
                    done = True
                yield msg
                if done:
                    return
        finally:
            if not done:  # the client went away: stop computing for it
                engine.abort(rid)

    @_answers_errors
    async def Execute(self, request: epb.ExecuteRequest,
                      context: grpc.aio.ServicerContext) -> epb.ExecuteResponse:
        """One raw forward pass with the caller's block tables (no engine, no cache service)."""
        self._require_ready()
        runner = self.ex.runner
        assert runner is not None
        if not request.sequences:
            raise InvalidArgument("at least one is required", field="sequences")
        tokens, chunks, params, positions = [], [], [], []
        for i, s in enumerate(request.sequences):
            if not s.token_ids:
                raise InvalidArgument("at least one token is required",
                                      field=f"sequences[{i}].token_ids")
            if s.num_computed_tokens < 0:
                raise InvalidArgument("must be >= 0", field=f"sequences[{i}].num_computed_tokens")
            end = s.num_computed_tokens + len(s.token_ids)
            if end > self.ex.model.config.max_model_len:
                raise InvalidArgument(f"{end} tokens exceed max_model_len", field=f"sequences[{i}]")
            tokens.append(list(s.token_ids))
            chunks.append(SeqChunk(s.num_computed_tokens, len(s.token_ids),
                                   [list(t.block_ids) for t in s.block_tables]))
            params.append(_sampling(s.sampling))
            positions.append(end)
        logits = await asyncio.to_thread(runner.forward, tokens, chunks)
        picks = sample(logits, params, positions)
        out = epb.ExecuteResponse()
        for i, (s, tok) in enumerate(zip(request.sequences, picks)):
            o = out.outputs.add(request_id=s.request_id, token_id=tok)
            if request.return_logits:
                o.logits.extend(logits[i].tolist())
        return out

    async def GetInfo(self, request: epb.GetInfoRequest,
                      context: grpc.aio.ServicerContext) -> epb.GetInfoResponse:
        """The model, its config, the pool and whether the executor is ready."""
        cfg = self.ex.model.config
        info = self.ex.link.info
        return epb.GetInfoResponse(
            model=cfg.name, vocab_size=cfg.vocab_size, max_model_len=cfg.max_model_len,
            cache_service_target=self.ex.settings.cache_service, pool_id=self.ex.plan.pool_id,
            num_groups=len(info.groups) if info else 0, ready=self.ex.ready.is_set(),
            model_config_json=json.dumps(cfg.to_dict(), default=str))


class EngineCollector:
    """Scrape-time engine counters (read without locks: plain int/float attributes)."""

    def __init__(self, ex: Executor) -> None:
        self.ex = ex

    def collect(self) -> Iterable[Any]:
        """The engine's counters and gauges at scrape time."""
        engine = self.ex.engine
        ready = GaugeMetricFamily("kvcache_executor_ready",
                                  "1 once registered with the cache service")
        ready.add_metric([], 1.0 if self.ex.ready.is_set() else 0.0)
        yield ready
        if engine is None:
            return
        m = engine.metrics
        for name, value, doc in (
                ("steps", m.steps, "engine steps"),
                ("step_seconds", m.step_seconds, "time in engine steps"),
                ("forward_seconds", m.forward_seconds, "time in forward passes"),
                ("cache_call_seconds", m.cache_call_seconds, "time in cache-service calls"),
                ("cache_wait_seconds", m.cache_wait_seconds,
                 "time blocked on cache-service calls with no forward pass running"),
                ("cache_calls", m.cache_calls, "cache-service calls"),
                ("prompt_tokens", m.prompt_tokens, "prompt tokens admitted"),
                ("cached_tokens", m.cached_tokens, "prompt tokens served from the prefix cache"),
                ("computed_tokens", m.computed_tokens, "tokens run through the model"),
                ("generated_tokens", m.generated_tokens, "tokens sampled"),
                ("preemptions", m.preemptions, "running requests preempted for lack of blocks"),
                ("admission_rollbacks", m.admission_rollbacks,
                 "admitted candidates undone to keep FCFS (sent as preempt ops)"),
                ("finished_requests", m.finished, "requests finished"),
                ("reregistrations", m.reregistrations, "pool re-registrations"),
                ("cache_stream_retries", engine.link.stream_retries,
                 "StepStream steps resent after a deadline or a broken stream")):
            c = CounterMetricFamily(f"kvcache_executor_{name}", doc)
            c.add_metric([], float(value))
            yield c
        tier = engine.runner.tier
        if tier is not None:
            ts = tier.stats
            for name, value, doc in (
                    ("host_tier_demotions", ts.demotions, "host-tier demotion copies run"),
                    ("host_tier_promotions", ts.promotions, "host-tier promotion copies run"),
                    ("host_tier_failed_copies", ts.failed_demotions + ts.failed_promotions,
                     "host-tier copies that failed (their requests recompute)"),
                    ("host_tier_recomputes", m.tier_recomputes,
                     "requests preempted to recompute after a failed promotion"),
                    ("host_tier_copy_seconds", ts.copy_seconds,
                     "time the engine spent running (CUDA: issuing) host-tier copies")):
                c = CounterMetricFamily(f"kvcache_executor_{name}", doc)
                c.add_metric([], float(value))
                yield c
        for name, value in (("running_requests", len(engine.scheduler.running)),
                            ("waiting_requests", len(engine.scheduler.waiting))):
            g = GaugeMetricFamily(f"kvcache_executor_{name}", name.replace("_", " "))
            g.add_metric([], float(value))
            yield g


def prepare(settings: ExecutorSettings, model: HybridModel | None = None) -> Executor:
    """The model and the executor the settings describe; raises SettingError (or another
    InvalidArgument) naming the setting that cannot work. Nothing listens yet."""
    model = (model or build_model(settings)).to(settings.device)
    return Executor(settings, model)


async def serve(settings: ExecutorSettings, ex: Executor) -> int:
    """Runs the prepared executor until SIGTERM/SIGINT; returns the exit code."""
    loop = asyncio.get_running_loop()
    registry = None
    if settings.metrics_port >= 0:
        registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=registry)
        registry.register(EngineCollector(ex))
    try:
        listener = await start_server(
            service_name=SERVICE_NAME,
            add_servicers=lambda server: epb_grpc.add_ExecutorServiceServicer_to_server(
                ExecutorServicer(ex), server),
            host=settings.host, port=settings.port,
            options=[("grpc.so_reuseport", 0),
                     ("grpc.http2.min_ping_interval_without_data_ms", 5000)],
            serving=False, metrics=registry, metrics_port=settings.metrics_port)
    except ListenError as exc:  # taken since main() checked it
        return exit_with_error("kvcache-executor", str(exc), 2)
    where = dict(host=settings.host, port=listener.port, metrics_port=listener.metrics_port,
                 model=ex.model.config.name, pool_id=ex.plan.pool_id,
                 cache_service=settings.cache_service)
    # Lifecycle lines print at any --log-level (supervisors and launchers wait for them).
    # torch_threads: the intra-op threads torch got (OMP_NUM_THREADS, set by executor.cli
    # before torch is imported).
    lifecycle().info("listening", **where, torch_threads=torch.get_num_threads())

    async def mark_serving() -> None:
        if not ex.draining:
            await listener.mark_serving()
            lifecycle().info("serving", **where)

    exit_code = 0
    why = ""

    def fatal(message: str) -> None:
        nonlocal exit_code, why
        exit_code, why = 1, message
        loop.call_soon_threadsafe(listener.request_stop)

    ex.start(lambda: asyncio.run_coroutine_threadsafe(mark_serving(), loop), fatal)
    await listener.wait()

    def refuse_new() -> None:
        ex.draining = True

    async def engine_idle(grace_seconds: float) -> None:
        """Running and waiting requests finish, or the grace passes."""
        deadline = time.monotonic() + grace_seconds
        while (ex.engine is not None and ex.engine.scheduler.has_requests
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)

    async def close() -> None:
        # --drain-seconds 0 means "stop at once": then no thread gets 5 s to finish.
        await asyncio.to_thread(ex.close, min(5.0, max(0.5, settings.drain_seconds)))

    # stop_grace 1 s: the requests were waited for above; what is left (a finished
    # stream's last message, health watchers) must not hold the process until a
    # supervisor's kill timeout.
    await listener.shutdown(settings.drain_seconds, refuse_new=refuse_new,
                            wait_idle=engine_idle, close=close, stop_grace_seconds=1.0,
                            exit_code=exit_code)
    return exit_with_error("kvcache-executor", why, exit_code) if why else exit_code
