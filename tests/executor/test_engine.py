"""Engine scheduling rules that need no server, and the engine loop in process against the
session's real cache service (which ops each step sends, "no room" in a decode op)."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import pytest
import structlog
from hypothesis import given, strategies as st

from cache_service.client import AllocateResult, CacheError, DecodeResult, ops
from executor.cache import CacheTensors, GroupInfo, model_layer_specs
from executor.cache_link import CacheLink, PoolLost, PoolPlan, group_layouts
from executor.engine import Engine, EngineConfig, Request, plan_chunk
from executor.model import HybridModel
from executor.presets import get_preset
from executor.runner import ModelRunner
from paged_helpers import shared_prefix_workload


@given(start=st.integers(0, 500), extra=st.integers(0, 500), budget=st.integers(1, 300),
       block=st.sampled_from([0, 16, 48]), boundary=st.integers(0, 1000))
def test_chunk_plan_invariants(start: int, extra: int, budget: int, block: int, boundary: int) -> None:
    total = start + extra
    if block and boundary:
        boundary = boundary // block * block  # lookups report block-aligned boundaries
    n = plan_chunk(start, total, budget, boundary=boundary, align_block=block)
    end = start + n
    assert 0 <= n <= min(budget, total - start)
    assert not (start < boundary < end)  # never crosses the shared-prefix boundary
    if block and n:
        # mid-prompt chunks end on block boundaries; the final partial block runs alone
        assert end % block == 0 or end == boundary or (end == total and start >= total // block * block)
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
    """A CacheLink that keeps every batch it sent with its answer."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[tuple[list, object]] = []

    def step(self, step_ops, *, begin_step=False):
        result = super().step(step_ops, begin_step=begin_step)
        self.sent.append((list(step_ops), result))
        return result


@pytest.fixture(scope="module")
def small_model() -> HybridModel:
    return HybridModel(get_preset("hybrid-fsm").replace(max_model_len=160))


def run_engine(target: str, model: HybridModel, prompts: list[list[int]], max_tokens: int, *,
               num_blocks: int | None = None) -> tuple[list[list[int]], Engine, RecordingLink]:
    """Every prompt submitted at once, the engine stepped in this thread until done."""
    cfg = model.config
    plan = PoolPlan(pool_id=f"engine-test-{uuid.uuid4().hex[:8]}",
                    specs=model_layer_specs(cfg), max_model_len=cfg.max_model_len,
                    num_blocks=num_blocks, memory_bytes=None if num_blocks else 64 << 20,
                    vocab_size=cfg.vocab_size)
    link = RecordingLink(target, plan)
    info = link.register()
    groups = [GroupInfo(tuple(g.layer_names), lay) for g, lay in zip(info.groups, group_layouts(info))]
    cache = CacheTensors(cfg, groups, info.num_blocks, info.layer_page_size_bytes)
    engine = Engine(ModelRunner(model, cache), link, EngineConfig(max_num_seqs=8))
    outputs: list[list[int]] = [[] for _ in prompts]
    for i, prompt in enumerate(prompts):
        engine.submit(Request(engine.new_request_id(), prompt, max_tokens,
                              sink=lambda ev, i=i: outputs[i].extend(ev.token_ids)))
    engine._drain_inbox(block=False)
    try:
        while engine.has_work:
            engine.step()
            for req in engine.running:  # the tables the engine keeps match the service's
                held = link.client.get_request(plan.pool_id, req.request_id).block_ids
                assert [len(t) for t in req.tables] == [len(t) for t in held]
                for mine, theirs in zip(req.tables, held):
                    # entries the service released (null: outside a sliding window, an old
                    # Mamba state) are never read; every live one must agree
                    assert all(b == m for m, b in zip(mine, theirs) if b), (mine, theirs)
    finally:
        link.close()
    return outputs, engine, link


def decode_ops(link: RecordingLink) -> list[tuple[object, DecodeResult]]:
    out = []
    for batch, result in link.sent:
        for op, res in zip(batch, result.results):
            if op.WhichOneof("op") == "decode":
                out.append((op.decode, res))
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
    steady = [batch for batch, _ in link.sent
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
    retries = [batch for batch, _ in link.sent if batch and batch[0].WhichOneof("op") == "preempt"
               and any(op.WhichOneof("op") == "allocate" for op in batch[1:])]
    assert retries
    for batch, result in link.sent:
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
        assert result.results[0].ok == [True]
        assert link.client.get_request(plan.pool_id, "a").num_computed_tokens == 4
    finally:
        link.close()


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
        assert result.results[0].ok == [True] and link.stream_retries == 1
        assert link.client.get_request(plan.pool_id, "a").num_tokens == 4  # applied once
        retries = [e for e in logs if e["event"] == "step_stream_retry"]
        assert [(e["reason"], e["attempt"]) for e in retries] == [("deadline_exceeded", 1)]
    finally:
        link.close()
