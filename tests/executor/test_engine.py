"""Engine scheduling rules that need no server, and the engine loop in process against the
session's real cache service (which ops each step sends, "no room" in a decode op)."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import pytest
import structlog
import torch
from hypothesis import given
from hypothesis import strategies as st

from cache_service.client import (
    AllocateResult,
    CacheClient,
    CacheError,
    DecodeResult,
    StepResult,
    ops,
)
from executor.cache import CacheTensors, model_layer_specs
from executor.cache_link import CacheLink, PoolPlan, cache_groups
from executor.engine import Engine, EngineConfig, EngineRequest, TokenEvent
from executor.errors import CacheUnavailable, PoolLost
from executor.model import HybridModel
from executor.presets import get_preset
from executor.runner import ModelRunner
from executor.scheduler import plan_chunk
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb

from paged_helpers import shared_prefix_workload


@given(start=st.integers(0, 500), extra=st.integers(0, 500), budget=st.integers(1, 300),
       block=st.sampled_from([0, 16, 48]), boundary=st.integers(0, 1000))
def test_chunk_plan_invariants(start: int, extra: int, budget: int, block: int,
                               boundary: int) -> None:
    total = start + extra
    if block and boundary:
        boundary = boundary // block * block  # lookups report block-aligned boundaries
    n = plan_chunk(start, total, budget, boundary=boundary, align_block=block)
    end = start + n
    assert 0 <= n <= min(budget, total - start)
    assert not (start < boundary < end)  # never crosses the shared-prefix boundary
    if block and n:
        # mid-prompt chunks end on block boundaries; the final partial block runs alone
        last_partial = end == total and start >= total // block * block
        assert end % block == 0 or end == boundary or last_partial
    if extra and budget >= max(block, 1):
        assert n > 0  # progress whenever the budget holds a block


def test_examples() -> None:
    assert plan_chunk(0, 170, 256, align_block=48) == 144  # checkpoint at 144 first ...
    assert plan_chunk(144, 170, 256, align_block=48) == 26  # ... then the tail
    assert plan_chunk(0, 170, 100, align_block=48) == 96
    assert plan_chunk(0, 170, 256, boundary=96, align_block=48) == 96
    assert plan_chunk(0, 170, 256) == 170  # no Mamba: one chunk
    assert plan_chunk(169, 170, 256, align_block=48) == 1  # decode


# ---------------------------------------------------------------------------------------
# The engine loop in process, against the session's real cache service
# ---------------------------------------------------------------------------------------

class RecordingLink(CacheLink):
    """A CacheLink that keeps every batch it sent with its answer (and whether it began a
    step), and fails the calls whose 0-based numbers are in ``fail_at`` with
    CacheUnavailable before sending them: a failed call applies nothing on the service."""

    def __init__(self, target: str, plan: PoolPlan, *,
                 fail_at: frozenset[int] = frozenset()) -> None:
        super().__init__(target, plan)
        self.sent: list[tuple[list[pb.Op], StepResult, bool]] = []
        self.fail_at = fail_at
        self.attempts = 0
        self.failed: list[list[pb.Op]] = []

    def step(self, step_ops: Sequence[pb.Op], *, begin_step: bool = False) -> StepResult:
        n, self.attempts = self.attempts, self.attempts + 1
        if n in self.fail_at:
            self.failed.append(list(step_ops))
            raise CacheUnavailable(f"injected failure of call {n}")
        result = super().step(step_ops, begin_step=begin_step)
        self.sent.append((list(step_ops), result, begin_step))
        return result


@pytest.fixture(scope="module")
def small_model() -> HybridModel:
    return HybridModel(get_preset("hybrid-fsm").replace(max_model_len=160))


def assert_views_agree(engine: Engine, link: CacheLink) -> None:
    """The engine's view of every request it registered is the service's: tokens (minus
    those not sent yet), computed tokens, live block ids; nothing else is registered. A
    request waiting for its preempt (``to_preempt``) may still hold what it held."""
    pool = link.plan.pool_id
    scheduler = engine.scheduler
    registered = [r for r in list(scheduler.running) + list(scheduler.waiting) if r.added]
    for req in registered:
        held = link.client.get_request(pool, req.request_id)
        assert held.num_tokens == len(req.tokens) - len(req.pending_append), req.request_id
        if req.request_id in scheduler.to_preempt:
            continue
        assert held.num_computed_tokens == req.num_computed, req.request_id
        assert [len(t) for t in req.tables] == [len(t) for t in held.block_ids] or not req.tables
        for mine, theirs in zip(req.tables, held.block_ids):
            # entries the service released (null: outside a sliding window, an old Mamba
            # state) are never read; every live one must agree
            assert all(b == m for m, b in zip(mine, theirs) if b), (mine, theirs)
    assert link.client.stats(pool).num_requests == len(registered) + len(scheduler.to_free)


def collect_into(out: list[int]) -> Callable[[TokenEvent], None]:
    """A request's sink that appends its tokens to ``out``."""
    return lambda ev: out.extend(ev.token_ids)


def run_engine(target: str, model: HybridModel, prompts: list[list[int]], max_tokens: int, *,
               num_blocks: int | None = None, fail_at: frozenset[int] = frozenset(),
               config: EngineConfig | None = None,
               enable_caching: bool = True,
               link_cls: type[RecordingLink] = RecordingLink,
               runner_cls: type[ModelRunner] = ModelRunner,
               ) -> tuple[list[list[int]], Engine, RecordingLink]:
    """Every prompt submitted at once, the engine stepped in this thread until done; the
    engine's and the service's views are compared after every step, failed ones included."""
    cfg = model.config
    plan = PoolPlan(pool_id=f"engine-test-{uuid.uuid4().hex[:8]}",
                    specs=model_layer_specs(cfg), max_model_len=cfg.max_model_len,
                    num_blocks=num_blocks, memory_bytes=None if num_blocks else 64 << 20,
                    vocab_size=cfg.vocab_size, enable_caching=enable_caching)
    link = link_cls(target, plan, fail_at=fail_at)
    info = link.register()
    cache = CacheTensors(cfg, cache_groups(info), info.num_blocks, info.layer_page_size_bytes)
    engine = Engine(runner_cls(model, cache), link, config or EngineConfig(max_num_seqs=8))
    outputs: list[list[int]] = [[] for _ in prompts]
    for prompt, out in zip(prompts, outputs):
        engine.submit(EngineRequest(engine.new_request_id(), prompt, max_tokens,
                                    sink=collect_into(out)))
    engine._drain_inbox(block=False)
    try:
        while engine.has_work:
            with contextlib.suppress(CacheUnavailable):  # Engine.run backs off and steps again
                engine.step()
            assert_views_agree(engine, link)
        stats = link.client.stats(plan.pool_id)
        assert stats.num_requests == 0 and stats.num_free_blocks == info.num_blocks - 1
    finally:
        link.close()
    return outputs, engine, link


def decode_ops(link: RecordingLink) -> list[tuple[pb.DecodeOp, DecodeResult]]:
    out = []
    for batch, result, _ in link.sent:
        for i, op in enumerate(batch):
            if op.WhichOneof("op") == "decode":
                out.append((op.decode, result.result(i, DecodeResult)))
    return out


def test_a_decode_step_sends_one_decode_op(cache_service, small_model) -> None:
    """Once every request decodes, a step's batch is one decode op naming every running
    request (oldest first) and no per-request allocate."""
    prompts = shared_prefix_workload(4, prefix_len=30, seed=1)
    outputs, engine, link = run_engine(cache_service.target, small_model, prompts, 12)
    assert all(len(o) == 12 for o in outputs)
    decodes = decode_ops(link)
    full = [op for op, _ in decodes if len(op.request_ids) == len(prompts)]
    assert full, "no step decoded every request in one op"
    steady = [batch for batch, _, _ in link.sent
              if any(op.WhichOneof("op") == "decode" and len(op.decode.request_ids) == len(prompts)
                     for op in batch)]
    for batch in steady:
        kinds = [op.WhichOneof("op") for op in batch]
        assert kinds.count("decode") == 1 and "allocate" not in kinds and "append" not in kinds
    assert engine.metrics.preemptions == 0


def test_no_room_in_a_decode_op_preempts_the_newest_and_keeps_outputs(cache_service,
                                                                        small_model) -> None:
    """A pool far too small: some decode op answers "no room" for a request while later
    requests of the same op get theirs; the engine preempts the newest and retries, and the
    tokens are those of a roomy pool."""
    prompts = shared_prefix_workload(6, prefix_len=60, seed=7)
    ref, _, _ = run_engine(cache_service.target, small_model, prompts, 40)
    got, engine, link = run_engine(cache_service.target, small_model, prompts, 40, num_blocks=24)
    assert got == ref
    assert engine.metrics.preemptions > 0
    failed = [(op, res) for op, res in decode_ops(link) if not res.all_ok]
    assert failed, "no decode op ran out of room: the test does not reach that path"
    # The retry round after such a step preempts the newest request and allocates the rest.
    retries = [batch for batch, _, _ in link.sent
               if batch and batch[0].WhichOneof("op") == "preempt"
               and any(op.WhichOneof("op") == "allocate" for op in batch[1:])]
    assert retries
    for batch, result, _ in link.sent:
        for op, res in zip(batch, result.results):
            if op.WhichOneof("op") == "allocate":
                assert isinstance(res, AllocateResult)


def test_the_step_stream_reopens_after_an_error(cache_service, small_model) -> None:
    """A rejected batch ends the StepStream: the link drops it and the next step opens a new
    one; an unknown pool still reads as PoolLost."""
    cfg = small_model.config
    plan = PoolPlan(pool_id=f"stream-test-{uuid.uuid4().hex[:8]}", specs=model_layer_specs(cfg),
                    max_model_len=cfg.max_model_len, num_blocks=64, vocab_size=cfg.vocab_size)
    link = CacheLink(cache_service.target, plan)
    try:
        with pytest.raises(PoolLost):
            link.step([ops.add("a", [1, 2, 3])])  # not registered yet
        link.register()
        link.step([ops.add("a", [1, 2, 3]), ops.allocate("a", 3)], begin_step=True)
        with pytest.raises(CacheError) as exc:
            link.step([ops.decode(["a", "nope"], [4, 5])])
        assert exc.value.field == "ops[0].decode.request_ids[1]"
        result = link.step([ops.decode(["a"], [4])], begin_step=True)
        assert result.result(0, DecodeResult).ok == [True]
        assert link.client.get_request(plan.pool_id, "a").num_computed_tokens == 4
    finally:
        link.close()


# ---------------------------------------------------------------------------------------
# Fault injection: the cache service fails one call of a step
# ---------------------------------------------------------------------------------------

def call_kinds(sent: list[tuple[list, object, bool]]) -> list[str]:
    """The role of each call of an engine step: "step" (call 1), "retry" (preempt the newest
    and retry after no room), "admission" (lookup + allocate of candidates) or "rollback"
    (preempt admitted candidates again to keep FCFS)."""
    kinds: list[str] = []
    for batch, _, begin in sent:
        first = batch[0].WhichOneof("op")
        if begin:
            kinds.append("step")
        elif first == "lookup":
            kinds.append("admission")
        elif kinds and kinds[-1] == "admission":
            kinds.append("rollback")
        else:
            assert first == "preempt", batch
            kinds.append("retry")
    return kinds


@pytest.fixture(scope="module")
def faulty_workload(cache_service, small_model):
    """Prompts and a pool that make a reference run need every kind of call, with the
    reference outputs and call kinds."""
    rng = __import__("random").Random(5)
    prompts = [[rng.randrange(1000) for _ in range(n)] for n in (60, 90, 90, 5)]
    ref, engine, link = run_engine(cache_service.target, small_model, prompts, 20, num_blocks=14)
    kinds = call_kinds(link.sent)
    assert {"step", "retry", "admission", "rollback"} <= set(kinds), kinds
    assert engine.metrics.preemptions and engine.metrics.admission_rollbacks
    return prompts, ref, kinds


@pytest.mark.parametrize("kind", ["step", "retry", "admission", "rollback"])
def test_a_failed_call_keeps_the_views_together(cache_service, small_model, faulty_workload,
                                                 kind: str) -> None:
    """UNAVAILABLE on the first call of each kind: after every step (the failed one too) the
    engine and the service agree on every request (run_engine checks), every request
    finishes with the reference's tokens, and the pool ends empty."""
    prompts, ref, kinds = faulty_workload
    at = kinds.index(kind)
    got, engine, link = run_engine(cache_service.target, small_model, prompts, 20,
                                   num_blocks=14, fail_at=frozenset({at}))
    assert len(link.failed) == 1
    assert got == ref


def test_every_third_call_failing_still_finishes(cache_service, small_model,
                                                 faulty_workload) -> None:
    """Many failures in one run, at every position of a step: same tokens in the end."""
    prompts, ref, kinds = faulty_workload
    got, _, link = run_engine(cache_service.target, small_model, prompts, 20, num_blocks=14,
                              fail_at=frozenset(range(1, 3 * len(kinds), 3)))
    assert got == ref
    assert len(link.failed) > 10


def test_a_hung_cache_service_costs_a_stream_retry_not_a_hang(cache_service,
                                                              small_model) -> None:
    """A stream step past its deadline (the service stopped with SIGSTOP): the link drops
    the stream, reconnects and resends the step under the same sequence number once the
    service answers again; it is applied once, logged and counted."""
    cfg = small_model.config
    plan = PoolPlan(pool_id=f"hung-{uuid.uuid4().hex[:8]}", specs=model_layer_specs(cfg),
                    max_model_len=cfg.max_model_len, num_blocks=64, vocab_size=cfg.vocab_size)
    link = CacheLink(cache_service.target, plan, timeout_s=1.0)
    pid = cache_service.proc.pid

    def resume_after_the_first_deadline() -> None:
        deadline = time.monotonic() + 30
        while link.stream_retries == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(pid, signal.SIGCONT)

    try:
        link.register()
        link.step([ops.add("a", [1, 2, 3]), ops.allocate("a", 3)], begin_step=True)
        resumer = threading.Thread(target=resume_after_the_first_deadline)
        with structlog.testing.capture_logs() as logs:
            os.kill(pid, signal.SIGSTOP)
            resumer.start()
            try:
                result = link.step([ops.decode(["a"], [4])], begin_step=True)
            finally:
                resumer.join()
                os.kill(pid, signal.SIGCONT)
        assert result.result(0, DecodeResult).ok == [True] and link.stream_retries == 1
        assert link.client.get_request(plan.pool_id, "a").num_tokens == 4  # applied once
        retries = [e for e in logs if e["event"] == "step_stream_retry"]
        assert [(e["reason"], e["attempt"]) for e in retries] == [("deadline_exceeded", 1)]
    finally:
        link.close()


# ---------------------------------------------------------------------------------------
# --async-cache-step: each step's cache call overlaps the previous forward pass
# ---------------------------------------------------------------------------------------

@functools.cache
def small_models(preset: str) -> HybridModel:
    """The preset with a short model length, so that a pool of 30 blocks is legal."""
    return HybridModel(get_preset(preset).replace(max_model_len=160))


def smallest_pool(target: str, model: HybridModel, enable_caching: bool) -> int:
    """The fewest blocks a pool of ``model`` may have (one request of max_model_len fits)."""
    cfg = model.config
    with CacheClient(target) as client:
        for n in range(4, 400):
            plan = PoolPlan(pool_id=f"size-probe-{uuid.uuid4().hex[:8]}",
                            specs=model_layer_specs(cfg), max_model_len=cfg.max_model_len,
                            num_blocks=n, vocab_size=cfg.vocab_size)
            try:
                client.register_pool(plan.pool_id, plan.layer_protos(), num_blocks=n,
                                     max_model_len=cfg.max_model_len,
                                     enable_caching=enable_caching)
            except CacheError:
                continue
            client.delete_pool(plan.pool_id)
            return n
    raise AssertionError("no pool size fits")


def cached_hashes(client: CacheClient, pool_id: str) -> set[tuple[int, int]]:
    """(group, block hash) of every block the pool's KV events leave cached."""
    last = client.stats(pool_id).last_event_sequence
    cached: set[tuple[int, int]] = set()
    if not last:
        return cached
    for event in client.subscribe_events(pool_id, from_sequence=1):
        if event.kind == "block_stored":
            cached |= {(event.group_idx, h) for h in event.block_hashes}
        elif event.kind == "block_removed":
            cached -= {(event.group_idx, h) for h in event.block_hashes}
        else:
            cached.clear()
        if event.sequence >= last:
            return cached
    raise AssertionError("the event stream ended early")


@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("preset", ["hybrid-fsm", "plamo2-like", "jamba-like", "gemma3-like",
                                    "nemotron-h-like"])
def test_overlapped_cache_steps_converge_to_the_sequential_run(cache_service, preset: str,
                                                               caching: bool) -> None:
    """Per preset, prefix caching on and off, a pool small enough to force preemptions: with
    the cache call of each step sent while the previous forward pass runs (decode slots as
    placeholders, ids one call later) the outputs, the cached block hashes, the hit rates and
    the preemptions equal those of the sequential run."""
    model = small_models(preset)
    prompts = shared_prefix_workload(6, prefix_len=40, seed=11)
    num_blocks = smallest_pool(cache_service.target, model, caching)
    runs = {}
    for overlap in (False, True):
        config = EngineConfig(max_num_seqs=8, async_cache_step=overlap)
        outputs, engine, link = run_engine(cache_service.target, model, prompts, 24,
                                           num_blocks=num_blocks, config=config,
                                           enable_caching=caching)
        with CacheClient(cache_service.target) as client:
            stats = client.stats(link.plan.pool_id)
            hashes = cached_hashes(client, link.plan.pool_id)
        placeholders = sum(op.WhichOneof("op") == "decode" and op.decode.placeholders
                           for batch, _, _ in link.sent for op in batch)
        runs[overlap] = (outputs, hashes, (stats.prefix_cache_queries, stats.prefix_cache_hits),
                         (engine.metrics.preemptions, engine.metrics.prompt_tokens,
                          engine.metrics.cached_tokens), placeholders)
    (out0, hashes0, hits0, pre0, ph0), (out1, hashes1, hits1, pre1, ph1) = runs[False], runs[True]
    assert all(len(o) == 24 for o in out0)
    assert out1 == out0
    assert hashes1 == hashes0
    assert hits1 == hits0
    assert pre1 == pre0
    # gemma3-like without caching: even its smallest pool (one group per layer) holds what
    # admission lets in, so nothing is preempted; every other case reaches that path.
    if caching or preset != "gemma3-like":
        assert pre0[0] > 0, "no preemption: the pool is not small enough to test that path"
    assert ph0 == 0 and ph1 > 0  # only the overlapped run sends placeholders
    assert bool(hashes0) == caching


class CopyInjectingLink(RecordingLink):
    """Adds one block copy (the first allocated request's Mamba state block into the pool's
    last block, which no request uses) to the first successful allocate answer, as the
    service answers a partial prefix hit's copy-on-write."""

    injected: tuple[int, int, int] | None = None

    def step(self, step_ops: Sequence[pb.Op], *, begin_step: bool = False) -> StepResult:
        result = super().step(step_ops, begin_step=begin_step)
        for answer in result.results:
            if self.injected is None and isinstance(answer, AllocateResult) and answer.ok:
                assert self.info is not None
                group = next(i for i, g in enumerate(self.info.groups)
                             if g.kind.startswith("mamba"))
                src = [b for b in answer.block_ids[group] if b][-1]
                copy = answer._m.block_copies.add()
                copy.group, copy.src_block_id = group, src
                copy.dst_block_id = self.info.num_blocks - 1
                self.injected = (group, src, copy.dst_block_id)
        return result


class OrderRecordingRunner(ModelRunner):
    """Records copy and forward calls in order; after each copy, checks the data moved."""

    calls: list[tuple[str, list[tuple[int, int, int]]]] = []

    def copy_blocks(self, copies: Sequence[tuple[int, int, int]]) -> None:
        super().copy_blocks(copies)
        if copies:
            OrderRecordingRunner.calls.append(("copy", list(copies)))
            for group, src, dst in copies:
                for slot in self.cache.slots[:len(self.cache.groups[group].layer_names)]:
                    assert torch.equal(slot[dst], slot[src])

    def forward(self, tokens, chunks):
        OrderRecordingRunner.calls.append(("forward", []))
        return super().forward(tokens, chunks)


def test_block_copies_of_an_answer_run_before_the_steps_forward(cache_service,
                                                                small_model) -> None:
    """A copy the service answers (a partial hit's copy-on-write) is run on the cache
    tensors before the forward pass of the step that received it; the outputs are those
    of a run without it (the destination block is unused)."""
    prompts = shared_prefix_workload(3, prefix_len=30, seed=3)
    ref, _, _ = run_engine(cache_service.target, small_model, prompts, 6)
    OrderRecordingRunner.calls = []
    got, _, link = run_engine(cache_service.target, small_model, prompts, 6,
                              link_cls=CopyInjectingLink, runner_cls=OrderRecordingRunner)
    assert got == ref
    assert isinstance(link, CopyInjectingLink) and link.injected is not None
    calls = OrderRecordingRunner.calls
    assert calls[0] == ("copy", [link.injected]) and calls[1][0] == "forward"
    assert [c for c in calls if c[0] == "copy"] == [calls[0]]  # only the answered copy
