"""``kvcache-executor`` / ``python -m executor``: the executor service.

Lifecycle:

1. build the model (preset, ModelConfig JSON or Hugging Face checkpoint), listen, log ONE JSON
   line ``{"event": "serving", "port": ..., "metrics_port": ...}``; health is NOT_SERVING;
2. a background thread registers the pool with the cache service, retrying with backoff while
   it is unreachable, allocates the cache tensors from the answered config, starts the engine
   thread, then health turns SERVING (Generate/Execute answer UNAVAILABLE until then);
3. if the cache service restarts and forgets the pool, the engine re-registers (same
   description -> same config, so the tensors stay) and re-queues its requests;
4. on SIGTERM/SIGINT: health NOT_SERVING, new Generate calls get UNAVAILABLE, running requests
   get ``drain_seconds`` to finish, then the server stops; exit code 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.process_collector import ProcessCollector

from kvcache_common.api.kvcache.v1 import executor_pb2 as epb
from kvcache_common.api.kvcache.v1 import executor_pb2_grpc as epb_grpc
from cache_service.client import CacheError
from kvcache_common.metrics_http import serve_metrics
from kvcache_common.logs import configure_logging
from executor.batch import SeqChunk
from executor.cache import CacheTensors, GroupInfo, model_layer_specs
from executor.cache_link import CacheLink, CacheUnavailable, PoolPlan, group_layouts
from executor.config import ModelConfig
from executor.engine import Engine, EngineConfig, Request, TokenEvent
from executor.model import HybridModel
from executor.presets import get_preset
from executor.runner import ModelRunner
from executor.sampling import SamplingParams, sample
from executor.settings import ExecutorSettings, parse_settings

SERVICE_NAME = epb.DESCRIPTOR.services_by_name["ExecutorService"].full_name
log = structlog.get_logger("executor.server")


def build_model(settings: ExecutorSettings) -> HybridModel:
    """The model named by the settings (checkpoint > config JSON > preset)."""
    if settings.hf_checkpoint is not None:
        from executor.hf_loader import load_hf_model

        return load_hf_model(settings.hf_checkpoint)
    if settings.model_config_json is not None:
        cfg = ModelConfig.from_dict(json.loads(settings.model_config_json.read_text()))
    else:
        cfg = get_preset(settings.preset)
    if settings.seed is not None:
        cfg = cfg.replace(seed=settings.seed)
    if settings.max_model_len:
        cfg = cfg.replace(max_model_len=settings.max_model_len)
    return HybridModel(cfg)


def pool_plan(model: HybridModel, settings: ExecutorSettings) -> PoolPlan:
    cfg = model.config
    mode = settings.mamba_cache_mode if settings.enable_prefix_caching else "none"
    specs = model_layer_specs(cfg, block_size=settings.block_size, mamba_cache_mode=mode)
    pool_id = settings.pool_id or f"{cfg.name}-{uuid.uuid4().hex[:8]}"
    return PoolPlan(pool_id=pool_id, specs=specs, max_model_len=cfg.max_model_len,
                    num_blocks=settings.num_blocks or None,
                    memory_bytes=int(settings.cache_memory_mb * 1024 * 1024),
                    enable_caching=settings.enable_prefix_caching, vocab_size=cfg.vocab_size)


def _sampling(msg: epb.SamplingParams) -> SamplingParams:
    return SamplingParams(temperature=msg.temperature, top_k=msg.top_k,
                          top_p=msg.top_p if msg.top_p else 1.0, seed=msg.seed).validate()


def _stats_msg(stats: Any) -> epb.RequestStats:
    return epb.RequestStats(prompt_tokens=stats.prompt_tokens, cached_tokens=stats.cached_tokens,
                            time_to_first_token_s=stats.time_to_first_token_s,
                            output_tokens=stats.output_tokens, num_preemptions=stats.num_preemptions,
                            total_time_s=stats.total_time_s)


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

    def start(self, on_ready: Any, on_fatal: Any) -> None:
        t = threading.Thread(target=self._bring_up, args=(on_ready, on_fatal), name="executor-register",
                             daemon=True)
        t.start()
        self._threads.append(t)

    def _bring_up(self, on_ready: Any, on_fatal: Any) -> None:
        delay = 0.1
        while not self._closing.is_set():
            try:
                info = self.link.register()
                break
            except CacheError as exc:  # the service rejected our description: cannot serve
                log.error("registration_failed", error=str(exc), field=exc.field)
                on_fatal()
                return
            except CacheUnavailable as exc:
                log.warning("cache_service_unreachable", target=self.settings.cache_service,
                            retry_in_s=delay, error=str(exc)[:200])
                self._closing.wait(delay)
                delay = min(delay * 2, 2.0)
        else:
            return
        groups = [GroupInfo(tuple(g.layer_names), lay) for g, lay in zip(info.groups, group_layouts(info))]
        cache = CacheTensors(self.model.config, groups, info.num_blocks, info.layer_page_size_bytes,
                             device=self.settings.device)
        self.runner = ModelRunner(self.model, cache)
        self.engine = Engine(self.runner, self.link, EngineConfig(
            max_num_seqs=self.settings.max_num_seqs, max_tokens_per_step=self.settings.max_tokens_per_step))
        t = threading.Thread(target=self.engine.run, name="executor-engine", daemon=True)
        t.start()
        self._threads.append(t)
        log.info("registered", pool_id=self.plan.pool_id, num_blocks=info.num_blocks,
                 groups=len(info.groups), page_size_bytes=info.page_size_bytes,
                 cache_bytes=cache.nbytes)
        self.ready.set()
        on_ready()

    def close(self) -> None:
        self._closing.set()
        if self.engine is not None:
            self.engine.stop()
        for t in self._threads:
            t.join(timeout=5)
        self.link.close()


class ExecutorServicer(epb_grpc.ExecutorServiceServicer):
    def __init__(self, ex: Executor) -> None:
        self.ex = ex

    async def _require_ready(self, context: grpc.aio.ServicerContext) -> None:
        if self.ex.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "executor is draining")
        if not self.ex.ready.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "executor is not registered with the cache service yet")

    async def Generate(self, request: epb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[epb.GenerateResponse]:
        await self._require_ready(context)
        engine = self.ex.engine
        assert engine is not None
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        rid = request.request_id or engine.new_request_id()
        if len(rid) > 200:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: at most 200 characters")
        try:
            req = Request(rid, list(request.prompt_token_ids), request.max_tokens,
                          sampling=_sampling(request.sampling),
                          stop_token_ids=frozenset(request.stop_token_ids),
                          cache_salt=request.cache_salt,
                          sink=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
            engine.submit(req)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        done = False
        try:
            while True:
                ev = await events.get()
                if ev.error:
                    done = True
                    await context.abort(grpc.StatusCode.ABORTED, ev.error)
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

    async def Execute(self, request: epb.ExecuteRequest,
                      context: grpc.aio.ServicerContext) -> epb.ExecuteResponse:
        await self._require_ready(context)
        runner = self.ex.runner
        assert runner is not None
        if not request.sequences:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sequences: at least one is required")
        tokens, chunks, params, positions = [], [], [], []
        try:
            for i, s in enumerate(request.sequences):
                if not s.token_ids:
                    raise ValueError(f"sequences[{i}].token_ids: at least one token is required")
                if s.num_computed_tokens < 0:
                    raise ValueError(f"sequences[{i}].num_computed_tokens: must be >= 0")
                end = s.num_computed_tokens + len(s.token_ids)
                if end > self.ex.model.config.max_model_len:
                    raise ValueError(f"sequences[{i}]: {end} tokens exceed max_model_len")
                tokens.append(list(s.token_ids))
                chunks.append(SeqChunk(s.num_computed_tokens, len(s.token_ids),
                                       [list(t.block_ids) for t in s.block_tables]))
                params.append(_sampling(s.sampling))
                positions.append(end)
            logits = await asyncio.to_thread(runner.forward, tokens, chunks)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        picks = sample(logits, params, positions)
        out = epb.ExecuteResponse()
        for i, (s, tok) in enumerate(zip(request.sequences, picks)):
            o = out.outputs.add(request_id=s.request_id, token_id=tok)
            if request.return_logits:
                o.logits.extend(logits[i].tolist())
        return out

    async def GetInfo(self, request: epb.GetInfoRequest,
                      context: grpc.aio.ServicerContext) -> epb.GetInfoResponse:
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
        engine = self.ex.engine
        ready = GaugeMetricFamily("kvcache_executor_ready", "1 once registered with the cache service")
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
                ("cache_calls", m.cache_calls, "cache-service calls"),
                ("prompt_tokens", m.prompt_tokens, "prompt tokens admitted"),
                ("cached_tokens", m.cached_tokens, "prompt tokens served from the prefix cache"),
                ("computed_tokens", m.computed_tokens, "tokens run through the model"),
                ("generated_tokens", m.generated_tokens, "tokens sampled"),
                ("preemptions", m.preemptions, "requests preempted"),
                ("finished_requests", m.finished, "requests finished"),
                ("reregistrations", m.reregistrations, "pool re-registrations"),
                ("cache_stream_retries", engine.link.stream_retries,
                 "StepStream steps resent after a deadline or a broken stream")):
            c = CounterMetricFamily(f"kvcache_executor_{name}", doc)
            c.add_metric([], float(value))
            yield c
        for name, value in (("running_requests", len(engine.running)),
                            ("waiting_requests", len(engine.waiting))):
            g = GaugeMetricFamily(f"kvcache_executor_{name}", name.replace("_", " "))
            g.add_metric([], float(value))
            yield g


async def serve(settings: ExecutorSettings, model: HybridModel | None = None) -> int:
    loop = asyncio.get_running_loop()
    model = (model or build_model(settings)).to(settings.device)
    ex = Executor(settings, model)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0),
                                      ("grpc.http2.min_ping_interval_without_data_ms", 5000)])
    epb_grpc.add_ExecutorServiceServicer_to_server(ExecutorServicer(ex), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(f"{settings.host}:{settings.port}")
    if port == 0:
        log.error("bind_failed", host=settings.host, port=settings.port)
        return 1
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def mark_serving() -> None:
        if not ex.draining:
            for name in ("", SERVICE_NAME):
                await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    stop = asyncio.Event()
    exit_code = 0

    def fatal() -> None:
        nonlocal exit_code
        exit_code = 1
        loop.call_soon_threadsafe(stop.set)

    ex.start(lambda: asyncio.run_coroutine_threadsafe(mark_serving(), loop), fatal)
    metrics_server, metrics_port = None, -1
    if settings.metrics_port >= 0:
        registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=registry)
        registry.register(EngineCollector(ex))
        metrics_server = await serve_metrics(registry, settings.host, settings.metrics_port)
        metrics_port = metrics_server.sockets[0].getsockname()[1]
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("serving", host=settings.host, port=port, metrics_port=metrics_port,
             model=model.config.name, pool_id=ex.plan.pool_id, cache_service=settings.cache_service)
    await stop.wait()
    log.info("draining", grace_seconds=settings.drain_seconds)
    ex.draining = True
    await health_servicer.enter_graceful_shutdown()
    deadline = time.monotonic() + settings.drain_seconds
    while ex.engine is not None and (ex.engine.running or ex.engine.waiting) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await server.stop(1.0)
    await asyncio.to_thread(ex.close)
    if metrics_server is not None:
        metrics_server.close()
    log.info("stopped", exit_code=exit_code)
    return exit_code


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(argv)
    configure_logging(settings.log_level)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return asyncio.run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
