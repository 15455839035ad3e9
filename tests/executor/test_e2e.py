"""End to end, on loopback, real processes: one cache service (session), executors started as
``python -m executor`` subprocesses, driven through gRPC."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import grpc
import pytest

from cache_service.client import AllocateResult, CacheClient, LookupResult, ops
from executor.client import ExecutorClient, generate_request
from executor.launch import start_executor, wait_ready
from executor.presets import PRESETS
from kvcache_common.api.kvcache.v1 import executor_pb2 as epb
from kvcache_common.launch import start_cache_service
from tests.metrics_text import scrape, value

from paged_helpers import (
    health_status,
    run_concurrently,
    shared_prefix_workload,
)

MAX_TOKENS = 6
pytestmark = pytest.mark.timeout(180)  # a hang fails fast, with its traceback


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_prefix_caching_changes_no_output_and_hits(cache_service, preset: str) -> None:
    prompts = shared_prefix_workload(6, prefix_len=110, seed=len(preset))
    on = start_executor(cache_service.target, "--preset", preset)
    off = start_executor(cache_service.target, "--preset", preset, "--no-enable-prefix-caching")
    try:
        # the first request alone warms the cache, then the rest arrive together
        first_on = run_concurrently(on.target, prompts[:1], MAX_TOKENS)
        rest_on = run_concurrently(on.target, prompts[1:], MAX_TOKENS)
        first_off = run_concurrently(off.target, prompts[:1], MAX_TOKENS)
        rest_off = run_concurrently(off.target, prompts[1:], MAX_TOKENS)
        with_cache, without = first_on + rest_on, first_off + rest_off
        assert [g.token_ids for g in with_cache] == [g.token_ids for g in without]
        assert all(len(g.token_ids) == MAX_TOKENS and g.finish_reason == "length"
                   for g in with_cache)
        assert sum(g.cached_tokens for g in without) == 0
        assert sum(g.cached_tokens for g in rest_on) > 0, [g.cached_tokens for g in with_cache]
        assert all(g.prompt_tokens == len(p) for g, p in zip(with_cache, prompts))
        with ExecutorClient(on.target) as c:
            pool_id = c.info().pool_id
        with CacheClient(cache_service.target) as cc:
            stats = cc.stats(pool_id)
        assert stats.prefix_cache_hits > 0
        assert stats.num_requests == 0  # every request was freed
    finally:
        on.stop()
        off.stop()
    assert on.returncode == 0 and off.returncode == 0


def test_preemption_keeps_outputs_identical(cache_service) -> None:
    """A pool far too small for the batch: requests get preempted and recomputed, and the
    tokens are the same as with plenty of room."""
    prompts = shared_prefix_workload(6, prefix_len=60, seed=7)
    roomy = start_executor(cache_service.target, "--preset", "hybrid-fsm")
    tight = start_executor(cache_service.target, "--preset", "hybrid-fsm", "--num-blocks", "24",
                           "--max-model-len", "160")
    try:
        ref = run_concurrently(roomy.target, prompts, 40)
        got = run_concurrently(tight.target, prompts, 40)
    finally:
        roomy.stop()
        tight.stop()
    assert [g.token_ids for g in got] == [g.token_ids for g in ref]
    assert sum(g.num_preemptions for g in got) > 0
    assert sum(g.num_preemptions for g in ref) == 0


def test_two_executors_do_not_share_blocks(cache_service) -> None:
    prompts = shared_prefix_workload(3, prefix_len=120, seed=11)
    a = start_executor(cache_service.target, "--preset", "gemma3-like", "--pool-id", "iso-a")
    b = start_executor(cache_service.target, "--preset", "gemma3-like", "--pool-id", "iso-b")
    try:
        first_a = run_concurrently(a.target, prompts[:1], 4)
        second_a = run_concurrently(a.target, prompts[1:2], 4)
        # b has never seen the prefix: no hit, although a's pool caches it
        first_b = run_concurrently(b.target, prompts[1:2], 4)
        second_b = run_concurrently(b.target, prompts[2:3], 4)
    finally:
        a.stop()
        b.stop()
    assert second_a[0].cached_tokens >= 96
    assert first_b[0].cached_tokens == 0
    assert second_b[0].cached_tokens >= 96
    assert first_b[0].token_ids == second_a[0].token_ids  # same model, same prompt
    with CacheClient(cache_service.target) as cc:
        ids = {p.pool_id for p in cc.list_pools()}
        assert {"iso-a", "iso-b"} <= ids
        assert cc.stats("iso-a").prefix_cache_hits > 0
        assert first_a[0].cached_tokens == 0


def _external_prefill(cc: CacheClient, ex: ExecutorClient, pool: str, rid: str, prompt: list[int],
                      salt: str, first_chunk: int) -> tuple[int, int]:
    """A minimal external scheduler: add + lookup, then lookup + allocate per chunk, Execute
    with the tables it got. Returns (hit tokens, next token)."""
    looked_up = cc.step(pool, [ops.add(rid, prompt, cache_salt=salt or None), ops.lookup(rid)],
                        begin_step=True)
    hit = looked_up.result(1, LookupResult).hit_tokens
    start, token = hit, -1
    while start < len(prompt):
        n = min(first_chunk if start == hit else len(prompt), len(prompt) - start)
        step_ops = ([ops.lookup(rid), ops.allocate(rid, n)] if start == hit
                    else [ops.allocate(rid, n)])
        alloc = cc.step(pool, step_ops, begin_step=start != hit).result(-1, AllocateResult)
        assert alloc.ok
        out = ex.execute(epb.ExecuteRequest(sequences=[epb.ExecuteSequence(
            request_id=rid, token_ids=prompt[start:start + n], num_computed_tokens=start,
            block_tables=[epb.GroupBlockTable(block_ids=t) for t in alloc.block_ids])]))
        token = out.outputs[0].token_id
        start += n
    return hit, token


@pytest.mark.parametrize("preset", ["plamo2-like", "gemma3-like"])
def test_cache_memory_stays_within_the_budget(cache_service, preset: str) -> None:
    """The executor allocates num_blocks x one layer's page per layer slot: never more
    than the budget it registered, and not far below it either."""
    budget_mb = 4
    ex = start_executor(cache_service.target, "--preset", preset, "--pool-id", f"budget-{preset}",
                        "--cache-memory-mb", str(budget_mb))
    try:
        registered = ex.wait_for(lambda r: r.get("event") == "registered")
    finally:
        ex.stop()
    assert 0.5 * budget_mb * 2**20 <= registered["cache_bytes"] <= budget_mb * 2**20


@pytest.mark.parametrize("preset", ["nemotron-h-like", "gemma3-like"])
def test_execute_with_an_external_scheduler_matches_generate(cache_service, preset: str) -> None:
    prompt = shared_prefix_workload(1, prefix_len=80, seed=3)[0]
    proc = start_executor(cache_service.target, "--preset", preset)
    try:
        with ExecutorClient(proc.target) as ex, CacheClient(cache_service.target) as cc:
            ref = ex.generate(prompt, 6).token_ids
            pool = ex.info().pool_id
            # once over the prefix Generate cached (a hit), once salted (no hit, two chunks)
            for rid, salt in (("ext-hit", ""), ("ext-cold", "salt")):
                hit, tok = _external_prefill(cc, ex, pool, rid, prompt, salt, first_chunk=32)
                assert (hit > 0) == (salt == ""), hit
                tokens = [tok]
                while len(tokens) < 6:
                    pos = len(prompt) + len(tokens) - 1
                    step = cc.step(pool, [ops.append(rid, [tokens[-1]]), ops.allocate(rid, 1)],
                                   begin_step=True)
                    alloc = step.result(-1, AllocateResult)
                    out = ex.execute(epb.ExecuteRequest(
                        return_logits=True, sequences=[epb.ExecuteSequence(
                            request_id=rid, token_ids=[tokens[-1]], num_computed_tokens=pos,
                            block_tables=[epb.GroupBlockTable(block_ids=t)
                                          for t in alloc.block_ids])]))
                    assert len(out.outputs[0].logits) == 1000
                    logits = out.outputs[0].logits
                    assert out.outputs[0].token_id == max(range(1000), key=lambda i: logits[i])
                    tokens.append(out.outputs[0].token_id)
                cc.step(pool, [ops.free(rid)])
                assert tokens == ref, rid
    finally:
        proc.stop()


def test_waits_for_the_cache_service_and_reregisters_after_its_restart(gate) -> None:
    target = gate.target
    proc = start_executor(target, "--preset", "gemma3-like", wait_serving=False)
    cs = None
    try:
        assert health_status(proc.target) == "NOT_SERVING"
        with ExecutorClient(proc.target) as ex:
            with pytest.raises(grpc.RpcError) as err:
                ex.generate([1, 2, 3], 2)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            cs = start_cache_service()
            gate.open_to(cs.target)
            wait_ready(proc.target, 30)
            prompt = shared_prefix_workload(1, prefix_len=64, seed=5)[0]
            before = ex.generate(prompt, 200)
            stream = ex.stub.Generate(generate_request(prompt, 200), timeout=60)
            first = next(stream)  # in flight when the service dies
            cs.proc.kill()  # a crash: the new instance knows no pools
            cs.stop()
            cs = start_cache_service()  # on a port of its own: new connections go there
            gate.open_to(cs.target)
            rest = list(stream)
            after = ex.generate(prompt, 200)
        # the in-flight request was re-queued and recomputed: same tokens, nothing lost
        assert list(first.token_ids) + [t for m in rest for t in m.token_ids] == before.token_ids
        assert rest[-1].stats.num_preemptions == 1
        assert after.token_ids == before.token_ids
        proc.wait_for(lambda r: r.get("event") == "pool_lost", timeout=5)
    finally:
        proc.stop()
        if cs is not None:
            cs.stop()
    assert proc.returncode == 0


@pytest.fixture(scope="module")
def gemma(cache_service):
    proc = start_executor(cache_service.target, "--preset", "gemma3-like")
    yield proc
    proc.stop()


def test_bad_input_is_rejected_naming_the_field(gemma) -> None:
    with ExecutorClient(gemma.target) as ex:
        for prompt, max_tokens, field in (([1, 5000], 3, "prompt_token_ids[1]"),
                                          ([], 3, "prompt_token_ids"),
                                          ([1, 2], 0, "max_tokens"),
                                          ([1] * 2040, 20, "max_tokens")):
            with pytest.raises(grpc.RpcError) as err:
                ex.generate(prompt, max_tokens)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            ex.generate([1, 2], 2, temperature=-1.0)
        assert "sampling.temperature" in err.value.details()
        for tables, field in (([[0]], "block_tables"), ([[99999]], "block_tables")):
            with pytest.raises(grpc.RpcError) as err:
                ex.execute(epb.ExecuteRequest(sequences=[epb.ExecuteSequence(
                    token_ids=[1, 2], num_computed_tokens=0,
                    block_tables=([epb.GroupBlockTable(block_ids=t) for t in tables]
                                  * ex.info().num_groups))]))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in err.value.details()
        assert ex.generate([1, 2, 3], 2).finish_reason == "length"  # still serving


def test_stop_tokens_and_seeded_sampling(gemma) -> None:
    prompts = shared_prefix_workload(4, prefix_len=40, seed=9)
    with ExecutorClient(gemma.target) as ex:
        ref = ex.generate(prompts[0], 8)
        stop = ref.token_ids[3]
        cut = ex.generate(prompts[0], 8, stop_token_ids=[stop])
        assert cut.finish_reason == "stop"
        assert cut.token_ids == ref.token_ids[:ref.token_ids.index(stop) + 1]
        alone = ex.generate(prompts[1], 10, temperature=1.0, seed=42)
        other_seed = ex.generate(prompts[1], 10, temperature=1.0, seed=43)
    # the same seeded request inside a busy batch samples the same tokens
    batch = run_concurrently(gemma.target, [prompts[2], prompts[1], prompts[3]], 10,
                             temperature=1.0, seed=42)
    assert batch[1].token_ids == alone.token_ids
    assert other_seed.token_ids != alone.token_ids


def test_drains_on_sigterm_and_frees_cancelled_requests(cache_service) -> None:
    """Settings from the environment; metrics; a cancelled stream frees its blocks; SIGTERM
    lets the running request finish before the process exits 0."""
    proc = start_executor(cache_service.target, "--metrics-port", "0",
                          env={"KVCACHE_EXECUTOR_PRESET": "jamba-like",
                               "KVCACHE_EXECUTOR_POOL_ID": "drain"})
    with ExecutorClient(proc.target) as ex, CacheClient(cache_service.target) as cc:
        assert ex.info().model == "jamba-like"
        prompt = shared_prefix_workload(1, prefix_len=40, seed=2)[0]
        stream = ex.stub.Generate(generate_request(prompt, 300), timeout=60)
        next(stream)  # running now
        stream.cancel()
        deadline = time.monotonic() + 10
        while cc.stats("drain").num_requests and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cc.stats("drain").num_requests == 0
        metrics = scrape(proc.metrics_port, timeout=5)
        assert value(metrics, "kvcache_executor_ready") == 1
        assert value(metrics, "kvcache_executor_generated_tokens_total") > 0
        # a long request in flight, then SIGTERM: it still completes
        stream = ex.stub.Generate(generate_request(prompt, 120), timeout=60)
        first = next(stream)
        proc.signal(signal.SIGTERM)
        rest = list(stream)
        tokens = list(first.token_ids) + [t for m in rest for t in m.token_ids]
        assert len(tokens) == 120 and rest[-1].finish_reason == "length"
    assert proc.stop() == 0
    proc.wait_for(lambda r: r.get("event") == "draining", timeout=1)


def test_demo_runs_locally_and_against_a_target(cache_service, tmp_path) -> None:
    out = tmp_path / "demo.json"
    small = ["--requests", "6", "--prefix-len", "96", "--max-tokens", "4", "--concurrency", "3"]
    done = subprocess.run([sys.executable, "-m", "executor.demo", *small, "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    on, off = report["runs"]
    assert report["outputs_identical"] is True
    assert on["hit_rate"] > 0 and off["hit_rate"] == 0 and on["requests"] == 6
    assert "prefix hit rate" in done.stdout
    proc = start_executor(cache_service.target, "--preset", report["preset"])
    try:
        done = subprocess.run([sys.executable, "-m", "executor.demo", *small,
                               "--target", proc.target, "--json", str(out)],
                              capture_output=True, text=True, timeout=120)
    finally:
        proc.stop()
    assert done.returncode == 0, done.stdout + done.stderr
    (only,) = json.loads(out.read_text())["runs"]
    assert only["requests"] == 6 and only["output_tokens"] == 24


def test_durable_cache_service_restart_mid_generation_loses_nothing(tmp_path, gate) -> None:
    """A cache service with --data-dir killed (SIGKILL) and restarted on its directory while
    several generations are in flight: the executor keeps its pool and session (no
    re-registration, no recompute), resends its in-flight Step under the same sequence
    number, and every output equals the uninterrupted run's."""
    flags = ("--data-dir", str(tmp_path / "cache"))
    cs = start_cache_service(*flags)
    gate.open_to(cs.target)
    proc = start_executor(gate.target, "--preset", "gemma3-like")
    try:
        prompts = shared_prefix_workload(3, prefix_len=48, seed=11)
        with ExecutorClient(proc.target) as ex:
            reference = [ex.generate(p, 120).token_ids for p in prompts]
            streams = [ex.stub.Generate(generate_request(p, 120), timeout=120) for p in prompts]
            firsts = [next(s) for s in streams]  # all three in flight
            cs.proc.kill()
            cs.stop()
            cs = start_cache_service(*flags)
            gate.open_to(cs.target)
            rests = [list(s) for s in streams]
        for first, rest, ref in zip(firsts, rests, reference):
            assert list(first.token_ids) + [t for m in rest for t in m.token_ids] == ref
            assert rest[-1].stats.num_preemptions == 0  # nothing was recomputed
        events = {r.get("event") for r in proc.records}
        assert "pool_lost" not in events, proc.output()
        assert events & {"cache_step_in_doubt", "step_stream_retry"}, proc.output()
        recovered = cs.wait_for(lambda r: r.get("event") == "recovered")
        assert recovered["records_replayed"] > 0 and recovered["pools"] == 1
    finally:
        proc.stop()
        cs.stop()
    assert proc.returncode == 0
