"""Each RPC against a real server subprocess; expected values come from an in-process Pool
built from the same description (the service must add nothing and lose nothing)."""

from __future__ import annotations

import random
import threading

import grpc
import pytest

from cache_service import convert
from cache_service.client import (
    AddResult,
    AllocateResult,
    CacheClient,
    CacheError,
    FreeResult,
    LookupResult,
    layers,
    ops,
    register_request,
)
from cache_service.registry import build_pool
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from tests.metrics_text import scrape, value, values

from .builders import EVENT_BUFFER, full_layers, hybrid_layers, pool_options


def local_pool(pool_id: str, layer_specs, **kwargs):
    """The in-process twin of a pool registered with the same arguments."""
    return build_pool(convert.description_from_proto(
        register_request(pool_id, layer_specs, **pool_options(**kwargs))))


def test_register_pool_answers_the_groups_and_is_idempotent(client: CacheClient,
                                                            new_pool) -> None:
    info = new_pool(hybrid_layers(), num_blocks=160)
    twin = local_pool(info.pool_id, hybrid_layers(), num_blocks=160)
    assert info.created
    assert info.num_blocks == twin.config.num_blocks == 160
    assert [g.layer_names for g in info.groups] == [list(g.layer_names)
                                                    for g in twin.config.groups]
    assert [g.kind for g in info.groups] == [g.spec.kind for g in twin.config.groups]
    assert {g.kind for g in info.groups} == {"full_attention", "sliding_window"}
    assert info.scheduler_block_size == twin.scheduler_block_size
    assert info.hash_block_size == twin.hash_block_size
    again = client.register_pool(info.pool_id, hybrid_layers(), num_blocks=160,
                                 max_model_len=1024)
    assert not again.created and again.raw == info.raw
    assert client.get_pool(info.pool_id).raw == info.raw
    assert info.pool_id in [p.pool_id for p in client.list_pools()]


def test_a_different_description_names_the_first_differing_field(client: CacheClient,
                                                                  new_pool) -> None:
    info = new_pool(hybrid_layers())
    changed = hybrid_layers()
    changed[3].sliding_window = 64
    with pytest.raises(CacheError) as err:
        client.register_pool(info.pool_id, changed, num_blocks=256, max_model_len=1024)
    assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert err.value.field == "layers[3].sliding_window"
    with pytest.raises(CacheError) as err:
        client.register_pool(info.pool_id, hybrid_layers(), num_blocks=256,
                             max_model_len=1024, watermark=0.1)
    assert err.value.field == "options.watermark"


def test_memory_budget_sizes_the_pool(new_pool) -> None:
    info = new_pool(full_layers(2), available_memory_bytes=1 << 20, max_model_len=256)
    assert info.num_blocks == (1 << 20) // info.page_size_bytes


def test_page_size_is_per_block_id_across_all_layers(new_pool) -> None:
    """page_size_bytes is what an executor allocates per block id: every layer of the
    largest group holds one page of the block; layer_page_size_bytes is one layer's page."""
    specs = hybrid_layers()
    pages = {2 * s.block_size * s.num_kv_heads * s.head_size * 2 for s in specs}  # bf16 K+V
    assert len(pages) == 1
    (layer_page,) = pages
    info = new_pool(specs, available_memory_bytes=1 << 20, max_model_len=256)
    largest = max(len(g.layer_names) for g in info.groups)
    assert len(info.groups) == 2 and largest == 2  # hybrid: one full and one window group
    assert info.layer_page_size_bytes == layer_page
    assert [g.page_size_bytes for g in info.groups] == [layer_page] * 2
    assert info.page_size_bytes == largest * layer_page
    assert info.num_blocks == (1 << 20) // info.page_size_bytes


def test_page_sizes_of_a_group_whose_layers_differ(new_pool) -> None:
    """One full-attention group of layers with different head sizes: a block id costs the
    sum of their pages; the group and layer page sizes are the largest layer's."""
    specs = [layers.full_attention("a", block_size=16, num_kv_heads=2, head_size=8),
             layers.full_attention("b", block_size=16, num_kv_heads=2, head_size=16)]
    pages = [2 * 16 * 2 * s.head_size * 2 for s in specs]  # bf16 K+V
    info = new_pool(specs, max_model_len=256)
    assert len(info.groups) == 1
    assert info.page_size_bytes == sum(pages)
    assert info.groups[0].page_size_bytes == info.layer_page_size_bytes == max(pages)


def test_lora_path_is_hashed_like_vllm(client: CacheClient, new_pool) -> None:
    """A LoRA request's blocks match vLLM's golden hashes only with the adapter's path."""
    import json
    from importlib import resources

    case = next(c for c in json.loads(resources.files("cache_service.core").joinpath(
        "hash_vectors.json").read_text("utf-8"))["cases"]
        if c["algo"] == "sha256_cbor" and c["name"] == "lora")
    info = new_pool(full_layers(), hash_algo="sha256_cbor")
    lora = dict(lora_name=case["lora_name"], lora_path=case["lora_path"])
    tokens = case["tokens"]
    client.step(info.pool_id, [ops.add("a", tokens, **lora), ops.allocate("a", len(tokens))])
    golden = [bytes.fromhex(h) for h in case["expected"]]
    hit = len(golden) * info.hash_block_size
    assert client.peek_prefix([info.pool_id], block_hashes=golden) == {info.pool_id: hit}
    assert client.peek_prefix([info.pool_id], tokens + [1], **lora) == {info.pool_id: hit}
    without_path = client.peek_prefix([info.pool_id], tokens + [1],
                                      lora_name=case["lora_name"])
    assert without_path == {info.pool_id: 0}
    for call in (lambda: client.step(info.pool_id, [ops.add("b", tokens, lora_path="/x")]),
                 lambda: client.peek_prefix([info.pool_id], tokens, lora_path="/x")):
        with pytest.raises(CacheError) as err:
            call()
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.field.endswith("lora_path")


def test_steps_drain_the_pool_events_without_subscribers() -> None:
    """The core queues KV events until taken: every Step must move them into the bounded
    feed even when nobody subscribes, so memory stays bounded however long a pool runs."""
    from cache_service.registry import PoolRegistry
    from cache_service.servicer import CacheServicer
    from cache_service.state import ServiceState

    registry = PoolRegistry(event_buffer=EVENT_BUFFER)
    servicer = CacheServicer(ServiceState(registry))
    entry, _ = registry.register("p", convert.description_from_proto(register_request(
        "p", full_layers(block_size=4), num_blocks=64, max_model_len=64)))
    queued = entry.pool.manager.pool  # the core's event queue lives in the block pool
    for step in range(300):
        rid = f"r{step}"
        batch = [ops.add(rid, list(range(step, step + 9))), ops.allocate(rid, 9),
                 ops.decode([rid], [1]), ops.free(rid)]
        servicer.step(pb.StepRequest(pool_id="p", begin_step=True, ops=batch))
        assert queued.events == []
    # Many events went through; the feed keeps the last EVENT_BUFFER of them.
    assert entry.feed.next_sequence > 3 * EVENT_BUFFER
    assert len(entry.feed.read(entry.feed.oldest, 10 * EVENT_BUFFER)) == EVENT_BUFFER


def test_delete_pool_drops_it_and_its_requests(client: CacheClient, new_pool) -> None:
    info = new_pool()
    client.step(info.pool_id, [pb.Op(add_request=pb.AddRequestOp(request_id="r",
                                                                 token_ids=[1, 2, 3]))])
    assert client.delete_pool(info.pool_id) == 1
    with pytest.raises(CacheError) as err:
        client.get_pool(info.pool_id)
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    assert info.pool_id not in [p.pool_id for p in client.list_pools()]


def _random_workload(rng: random.Random, steps: int) -> list[list[pb.Op]]:
    """Steps of adds (with shared prefixes), lookups, allocations, decode appends, frees,
    preemptions: the scheduler's calls, in batches."""
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice([16, 40, 64]))]
                for _ in range(3)]
    live: dict[str, int] = {}
    batches = []
    n = 0
    for _ in range(steps):
        batch = [ops.new_step()]
        for rid in list(live):
            roll = rng.random()
            if roll < 0.15:
                batch.append(ops.free(rid))
                del live[rid]
            elif roll < 0.2:
                batch.append(ops.preempt(rid))
                batch.append(ops.lookup(rid))
                batch.append(ops.allocate(rid, live[rid]))
            elif roll < 0.6:
                batch.append(ops.append(rid, [rng.randrange(1000)]))
                live[rid] += 1
                batch.append(ops.allocate(rid, 1))
            else:  # the same decode step as one op
                batch.append(ops.allocate(rid, 1, append_token_ids=[rng.randrange(1000)]))
                live[rid] += 1
        for _ in range(rng.randrange(3)):
            rid = f"r{n}"
            n += 1
            prompt = rng.choice(prefixes) + [rng.randrange(1000)
                                             for _ in range(rng.randrange(1, 30))]
            batch += [ops.add(rid, prompt), ops.lookup(rid)]
            batch.append(ops.allocate(rid, len(prompt)))  # the hit is subtracted below
            live[rid] = len(prompt)
        batches.append(batch)
    return batches


def _apply_local(pool, op: pb.Op):
    kind = op.WhichOneof("op")
    m = getattr(op, kind)
    if kind == "add_request":
        return pool.add_request(m.request_id, list(m.token_ids))
    if kind == "lookup":
        return pool.lookup(m.request_id)
    if kind == "allocate":
        if m.append_token_ids:
            pool.append_tokens(m.request_id, list(m.append_token_ids))
        return pool.allocate(m.request_id, m.num_new_tokens)
    if kind == "append_tokens":
        return pool.append_tokens(m.request_id, list(m.token_ids))
    if kind == "free":
        return pool.free(m.request_id)
    if kind == "preempt":
        return pool.preempt(m.request_id)
    return pool.new_step()


@pytest.mark.parametrize("layer_kind", ["full", "hybrid"])
def test_steps_match_the_in_process_core(client: CacheClient, new_pool,
                                         layer_kind: str) -> None:
    specs = full_layers() if layer_kind == "full" else hybrid_layers()
    info = new_pool(specs, num_blocks=48, max_model_len=256)
    twin = local_pool(info.pool_id, specs, num_blocks=48, max_model_len=256)
    rng = random.Random(7)
    hits: dict[str, int] = {}
    for batch in _random_workload(rng, 25):
        # Prompt allocations cover the prompt minus the hit: learn the hit from the twin
        # first, then send the same numbers to both.
        expected = []
        for op in batch:
            if op.WhichOneof("op") == "allocate" and op.allocate.request_id in hits:
                op.allocate.num_new_tokens -= hits.pop(op.allocate.request_id)
            result = _apply_local(twin, op)
            if op.WhichOneof("op") == "lookup":
                hits[op.lookup.request_id] = result.hit_tokens
            expected.append(result)
        got = client.step(info.pool_id, batch)
        for want, have in zip(expected, got.results):
            if isinstance(have, AllocateResult):
                assert have.ok == want.ok
                assert have.block_ids == [list(g) for g in want.block_ids]
                assert have.num_computed_tokens == want.num_computed_tokens
                if want.ok:  # no tables at all when no group got a block
                    assert have.new_block_ids == ([list(g) for g in want.new_block_ids]
                                                  if any(want.new_block_ids) else [])
            elif isinstance(have, LookupResult):
                assert have.hit_tokens == want.hit_tokens
                assert have.block_ids == [list(g) for g in want.block_ids]
        assert got.num_free_blocks == twin.stats().num_free_blocks
    stats = client.stats(info.pool_id)
    local = twin.stats()
    assert (stats.num_free_blocks, stats.num_cached_blocks, stats.num_requests) == (
        local.num_free_blocks, local.num_cached_blocks, local.num_requests)
    assert stats.prefix_cache_hits == local.prefix_hits + local.preempted_prefix_hits
    twin.check_invariants()


def test_step_stream_answers_each_request_in_order(client: CacheClient, new_pool) -> None:
    info = new_pool()
    with client.step_stream() as stream:
        first = stream.step(info.pool_id, [ops.add("a", list(range(40))), ops.lookup("a"),
                                           ops.allocate("a", 40)], begin_step=True)
        second = stream.step(info.pool_id, [ops.append("a", [7]), ops.allocate("a", 1)],
                             begin_step=True)
        third = stream.step(info.pool_id, [ops.free("a")])
    allocated = first.result(2, AllocateResult)
    assert allocated.ok and allocated.num_computed_tokens == 40
    assert second.result(1, AllocateResult).num_computed_tokens == 41
    assert third.result(0, FreeResult).num_free_blocks == info.num_blocks - 1


def test_step_stream_ends_with_the_status_of_an_invalid_batch(client: CacheClient,
                                                              new_pool) -> None:
    info = new_pool()
    with client.step_stream() as stream:
        stream.step(info.pool_id, [ops.add("a", [1, 2])])
        with pytest.raises(CacheError) as err:
            stream.step(info.pool_id, [ops.allocate("nobody", 1)])
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    assert err.value.field == "ops[0].allocate.request_id"


def test_peek_prefix_reports_each_pool_and_changes_nothing(client: CacheClient,
                                                           new_pool) -> None:
    warm, cold = new_pool(), new_pool()
    prompt = list(range(100, 164))  # 4 blocks of 16
    client.step(warm.pool_id, [ops.add("a", prompt), ops.allocate("a", 64), ops.free("a")])
    before = client.stats(warm.pool_id)
    hits = client.peek_prefix([warm.pool_id, cold.pool_id], prompt + [1])
    twin = local_pool(warm.pool_id, full_layers())
    twin.add_request("a", prompt)
    twin.allocate("a", 64)
    twin.free("a")
    assert hits == {warm.pool_id: twin.peek_prefix(prompt + [1]), cold.pool_id: 0}
    assert hits[warm.pool_id] == 64
    assert client.stats(warm.pool_id) == before
    with pytest.raises(CacheError) as err:
        client.peek_prefix([warm.pool_id, "no-such-pool"], prompt)
    assert err.value.code == grpc.StatusCode.NOT_FOUND and err.value.field == "pool_ids[1]"


def test_get_request_and_stats_and_reset(client: CacheClient, new_pool) -> None:
    info = new_pool()
    res = client.step(info.pool_id, [ops.add("a", list(range(50))), ops.allocate("a", 50)])
    state = client.get_request(info.pool_id, "a")
    assert state.block_ids == res.result(1, AllocateResult).block_ids
    assert (state.num_computed_tokens, state.num_tokens) == (50, 50)
    stats = client.stats(info.pool_id)
    assert stats.num_requests == 1
    assert stats.num_free_blocks == info.num_blocks - 1 - 4
    assert client.reset_prefix_cache(info.pool_id) is False  # blocks in use
    client.step(info.pool_id, [ops.free("a")])
    assert client.stats(info.pool_id).num_cached_blocks == 3
    assert client.reset_prefix_cache(info.pool_id) is True
    stats = client.stats(info.pool_id)
    assert (stats.num_cached_blocks, stats.num_requests) == (0, 0)
    assert stats.num_free_blocks == info.num_blocks - 1
    with pytest.raises(CacheError) as err:
        client.get_request(info.pool_id, "a")
    assert err.value.code == grpc.StatusCode.NOT_FOUND


def test_reset_with_block_ids_drops_only_those_entries_even_in_use(client: CacheClient,
                                                                   new_pool) -> None:
    """ResetPrefixCache(block_ids): an executor's failed copy left garbage in a block; its
    cache entry goes (the holder keeps the block), the next lookup misses from there, the
    other entries stay."""
    info = new_pool()
    prompt = list(range(200, 264))  # 4 blocks of 16
    res = client.step(info.pool_id, [ops.add("a", prompt), ops.allocate("a", 64)])
    blocks = res.result(1, AllocateResult).block_ids[0]
    assert client.reset_prefix_cache(info.pool_id, block_ids=[blocks[2]]) is True
    assert client.get_request(info.pool_id, "a").block_ids[0] == blocks  # still held
    client.step(info.pool_id, [ops.free("a")])
    assert client.peek_prefix([info.pool_id], prompt + [1]) == {info.pool_id: 32}
    assert client.stats(info.pool_id).num_cached_blocks == 3  # blocks 0, 1 and 3 stay


def test_block_stored_names_the_lora_id(client: CacheClient, new_pool) -> None:
    """vLLM 0.33's BlockStored.lora_id: the storing request's LoRA int id (not hashed)."""
    info = new_pool()
    pid = info.pool_id
    client.step(pid, [ops.add("a", list(range(32)), lora_id=7, lora_name="sql",
                              lora_path="/a/sql"), ops.allocate("a", 32),
                      ops.add("b", list(range(100, 132))), ops.allocate("b", 32)])
    events = list(_take(client.subscribe_events(pid, 1), 2))
    assert [(e.lora_name, e.lora_id) for e in events] == [("sql", 7), ("", None)]
    # The id is no part of the hash: the same adapter's prompt hits whatever its id.
    assert client.peek_prefix([pid], list(range(32)) + [1], lora_name="sql",
                              lora_path="/a/sql") == {pid: 32}


def test_events_stream_resume_and_out_of_range(client: CacheClient, new_pool) -> None:
    info = new_pool(hybrid_layers())
    prompt = list(range(64))
    client.step(info.pool_id, [ops.add("a", prompt), ops.allocate("a", 64), ops.free("a")])
    first = list(_take(client.subscribe_events(info.pool_id, 1), 2))
    assert [e.sequence for e in first] == [1, 2]
    assert {e.kind for e in first} == {"block_stored"}
    # One BlockStored per group, annotated with the group's kind and window.
    assert sorted((e.group_idx, e.spec_kind, e.sliding_window) for e in first) == sorted(
        (g.index, g.kind, g.sliding_window) for g in info.groups)
    assert all(e.token_ids == prompt and len(e.block_hashes) == 4 for e in first)
    assert all(e.parent_block_hash is None for e in first)
    # Each names the session whose Step added the storing request (vLLM's session_id).
    assert client.session_id and all(e.session_id == client.session_id for e in first)

    # A subscriber waiting for the next sequence sees it when it happens (asking for
    # next = last + 1 rather than "live only" makes the test independent of when the
    # subscription reaches the server): once it has received the events of one Step it is
    # certainly subscribed, and the reset's event reaches it live; a reconnect resumes
    # where it left off.
    live: list = []
    errors: list = []
    subscribed = threading.Event()
    nxt = client.stats(info.pool_id).last_event_sequence + 1

    def collect() -> None:
        try:
            for event in client.subscribe_events(info.pool_id, nxt):
                live.append(event)
                subscribed.set()
                if event.kind == "all_blocks_cleared":
                    return
        except CacheError as exc:
            errors.append(exc)
            subscribed.set()

    thread = threading.Thread(target=collect)
    thread.start()
    client.step(info.pool_id, [ops.add("b", [7] * 16 + [1]), ops.allocate("b", 17),
                               ops.free("b")])
    assert subscribed.wait(10) and not errors
    assert client.reset_prefix_cache(info.pool_id)
    thread.join(10)
    assert [e.kind for e in live] == ["block_stored"] * len(info.groups) + [
        "all_blocks_cleared"] and not errors
    assert [e.sequence for e in live] == list(range(nxt, nxt + len(live)))
    resumed = list(_take(client.subscribe_events(info.pool_id, first[-1].sequence + 1), 1))
    assert (resumed[0].sequence, resumed[0].kind) == (live[0].sequence, live[0].kind)

    # Push the first events out of the bounded buffer, then ask for them.
    for i in range(EVENT_BUFFER):
        client.step(info.pool_id, [ops.add(f"x{i}", [i] * 16 + [1]), ops.allocate(f"x{i}", 17),
                                   ops.free(f"x{i}")])
    assert client.stats(info.pool_id).last_event_sequence > EVENT_BUFFER + 3
    with pytest.raises(CacheError) as err:
        list(_take(client.subscribe_events(info.pool_id, 1), 1))
    assert err.value.code == grpc.StatusCode.OUT_OF_RANGE


def test_incarnation_changes_only_with_a_new_pool_state(client: CacheClient,
                                                        new_pool) -> None:
    """Every event carries its pool incarnation; resuming with a stale one is refused
    (naming the field) instead of splicing two histories with overlapping sequences."""
    info = new_pool()
    assert info.incarnation != 0
    assert client.get_pool(info.pool_id).incarnation == info.incarnation
    assert client.register_pool(info.pool_id, full_layers(), max_model_len=1024,
                                num_blocks=256).incarnation == info.incarnation  # same state
    client.step(info.pool_id, [ops.add("a", list(range(33))), ops.allocate("a", 33)])
    first = list(_take(client.subscribe_events(info.pool_id, 1, info.incarnation), 1))
    assert first[0].incarnation == info.incarnation

    client.delete_pool(info.pool_id)
    again = client.register_pool(info.pool_id, full_layers(), max_model_len=1024,
                                 num_blocks=256)
    assert again.incarnation not in (0, info.incarnation)
    client.step(info.pool_id, [ops.add("a", list(range(33))), ops.allocate("a", 33)])
    with pytest.raises(CacheError) as err:
        list(_take(client.subscribe_events(info.pool_id, 1, info.incarnation), 1))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.field == "incarnation" and str(info.incarnation) in str(err.value)
    fresh = list(_take(client.subscribe_events(info.pool_id, 1, again.incarnation), 1))
    assert (fresh[0].sequence, fresh[0].incarnation) == (1, again.incarnation)


def _take(iterator, n: int):
    for i, item in enumerate(iterator):
        yield item
        if i + 1 >= n:
            return


def test_metrics_and_request_ids(server, client: CacheClient, new_pool) -> None:
    info = new_pool()
    client.stats(info.pool_id)
    with pytest.raises(CacheError):
        client.get_request(info.pool_id, "nobody")
    with grpc.insecure_channel(server.target) as channel:
        from kvcache_common.api.kvcache.v1 import cache_service_pb2_grpc as pb_grpc

        stub = pb_grpc.CacheServiceStub(channel)
        _, call = stub.GetPoolStats.with_call(pb.GetPoolStatsRequest(pool_id=info.pool_id),
                                              metadata=(("x-request-id", "abc-123"),))
        assert ("x-request-id", "abc-123") in call.trailing_metadata()
    body = scrape(server.metrics_port)
    service = "kvcache.v1.CacheService"
    assert value(body, "grpc_server_handled_total", grpc_code="OK", grpc_method="GetPoolStats",
                 grpc_service=service, grpc_type="unary") >= 2
    assert value(body, "grpc_server_handled_total", grpc_code="NOT_FOUND",
                 grpc_method="GetRequest", grpc_service=service, grpc_type="unary") >= 1
    assert values(body, "grpc_server_handling_seconds_bucket", grpc_method="GetPoolStats")
    assert value(body, "kvcache_pool_free_blocks", pool=info.pool_id) > 0
    assert values(body, "kvcache_pool_evictions_total", pool=info.pool_id) == [0.0]


def _metric(body: str, name: str, method: str) -> float:
    """Series ``name`` of ``kvcache.v1.CacheService/method``, summed over its other labels
    (a handled count has one per status code; 0 if absent)."""
    return sum(values(body, name, grpc_method=method, grpc_service="kvcache.v1.CacheService"))


def test_a_long_lived_stream_shows_in_the_metrics_while_it_runs(server, client: CacheClient,
                                                                new_pool) -> None:
    """An open StepStream's messages are counted as they pass (and the call as started),
    not only when the stream ends."""
    info = new_pool()

    before = scrape(server.metrics_port)
    stream = client.step_stream()
    try:
        for i in range(3):
            stream.step(info.pool_id, [ops.add(f"r{i}", [1, 2, 3])])
        during = scrape(server.metrics_port)
    finally:
        stream.close()
    for name in ("grpc_server_msg_received_total", "grpc_server_msg_sent_total"):
        assert _metric(during, name, "StepStream") - _metric(before, name, "StepStream") == 3, name
    assert _metric(during, "grpc_server_started_total", "StepStream") \
        - _metric(before, "grpc_server_started_total", "StepStream") == 1
    # still open: not handled yet
    assert _metric(during, "grpc_server_handled_total", "StepStream") \
        == _metric(before, "grpc_server_handled_total", "StepStream")


def test_client_computed_hashes_hit_like_server_hashed_tokens(client: CacheClient,
                                                              new_pool) -> None:
    from cache_service.core.hashing import hash_request_tokens, sha256_cbor

    info = new_pool(full_layers(), hash_algo="sha256_cbor")
    prompt = list(range(500, 570))  # 4 full blocks + 6 tokens
    client.step(info.pool_id, [ops.add("a", prompt, cache_salt="s"), ops.allocate("a", 70),
                               ops.free("a")])
    hashes = hash_request_tokens(sha256_cbor, prompt, info.hash_block_size, cache_salt="s")
    assert len(hashes) == 4
    by_tokens = client.peek_prefix([info.pool_id], prompt, cache_salt="s")
    by_hashes = client.peek_prefix([info.pool_id], block_hashes=hashes, cache_salt="s")
    assert by_tokens == by_hashes == {info.pool_id: 64}
    assert client.peek_prefix([info.pool_id], prompt) == {info.pool_id: 0}  # other salt
    res = client.step(info.pool_id, [ops.add("b", prompt, block_hashes=hashes, cache_salt="s"),
                                     ops.lookup("b")])
    assert res.result(0, AddResult).num_block_hashes == 4
    assert res.result(1, LookupResult).hit_tokens == 64


def test_async_client_stream_builder_and_events(server, new_pool) -> None:
    import asyncio

    from cache_service.client import AsyncCacheClient, StepBuilder

    info = new_pool(hybrid_layers())

    async def scenario() -> tuple:
        async with AsyncCacheClient(server.target) as client:
            async with client.step_stream() as stream:
                first = await stream.step(info.pool_id, [ops.add("a", list(range(33))),
                                                         ops.allocate("a", 33)],
                                          begin_step=True)
                batch = StepBuilder(info.pool_id, begin_step=True)
                batch.allocate("a", 1, append_token_ids=[5], block_table=False)
                second = await client.step_batch(batch)
                with pytest.raises(CacheError) as err:
                    await stream.step(info.pool_id, [ops.add("a", [1])])
            events = []
            async for event in client.subscribe_events(info.pool_id, 1):
                events.append(event)
                if len(events) == 2:
                    break
            state = await client.get_request(info.pool_id, "a")
            return first, second, err.value, events, state

    first, second, err, events, state = asyncio.run(scenario())
    assert first.results[1].ok and first.results[1].num_computed_tokens == 33
    assert second.results[0].block_ids == [] and second.results[0].num_computed_tokens == 34
    assert err.code == grpc.StatusCode.ALREADY_EXISTS
    assert err.field == "ops[0].add_request.request_id"
    assert [e.sequence for e in events] == [1, 2]
    assert state.num_tokens == 34 and state.status == "RUNNING"
