"""The host tier over kvcache.v1 (docs/protocol.md#host-tier) against real servers: a
workload larger than the device pool demotes blocks to host slots, a later lookup hits them
(block ids -1), the allocate that uses the hit promotes them from the very slots their
demotions named, and stats, /metrics, events, ResetHostTier, session retries, sliced Steps,
the conformance kit and a SIGKILL + restart on the data dir all agree."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from cache_service import convert
from cache_service.client import (
    AllocateResult,
    AsyncCacheClient,
    CacheClient,
    CacheError,
    LookupResult,
    ResetHostTierResult,
    StepBuilder,
    StepResult,
    TierCopy,
    ops,
)
from cache_service.conformance import reference_answers, run_trace
from cache_service.core.pool import Pool, PoolOptions
from cache_service.registry import PoolDescription, build_config
from cache_service.specs_proto import layer_spec_from_proto
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.api.kvcache.v1 import cache_service_pb2_grpc as pb_grpc
from kvcache_common.launch import ServerProcess, start_cache_service
from tests.metrics_text import scrape, value

from .builders import full_layers

BS = 16
DEVICE_BLOCKS = 17  # 16 usable: four 4-block prompts fill the device
MAX_LEN = 128
TIER = 64


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """A server of this module's own: its event feeds and /metrics hold only these pools."""
    with start_cache_service("--metrics-port", "0") as srv:
        yield srv
    assert srv.returncode == 0, srv.output()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[CacheClient]:
    with CacheClient(server.target, default_timeout=20) as c:
        yield c


@pytest.fixture(scope="module")
def stub(server: ServerProcess) -> Iterator[pb_grpc.CacheServiceStub]:
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.CacheServiceStub(channel)


def prompt(tag: int, blocks: int = 4) -> list[int]:
    """``blocks`` full blocks of tokens no other tag shares."""
    return [tag * 1000 + i for i in range(blocks * BS)]


def register(client: CacheClient, pool_id: str, tier: int = TIER, **kwargs) -> None:
    client.register_pool(pool_id, full_layers(), num_blocks=DEVICE_BLOCKS,
                         max_model_len=MAX_LEN, host_tier_blocks=tier, **kwargs)


def admit(client: CacheClient, pool_id: str, rid: str, tokens: list[int]
          ) -> tuple[LookupResult, StepResult]:
    """add + lookup, then the allocate of the rest (as the scheduler guide does it):
    (the lookup's answer, the allocate's Step answer)."""
    looked = client.step(pool_id, [ops.add(rid, tokens), ops.lookup(rid)],
                         begin_step=True).result(1, LookupResult)
    allocated = client.step(pool_id, [ops.allocate(rid, len(tokens) - looked.hit_tokens)])
    assert allocated.result(0, AllocateResult).ok
    return looked, allocated


def events(client: CacheClient, pool_id: str) -> list:
    """Every event of the pool so far (the feed read from sequence 1 up to the last)."""
    last = client.stats(pool_id).last_event_sequence
    out = []
    for e in client.subscribe_events(pool_id, from_sequence=1):
        out.append(e)
        if e.sequence >= last:
            break
    return out


def test_demote_hit_from_host_promote_from_the_same_slots(client: CacheClient,
                                                          server: ServerProcess) -> None:
    pool = "tier-main"
    register(client, pool)
    _, a = admit(client, pool, "a", prompt(1))
    a_blocks = a.result(0, AllocateResult).block_ids[0]
    assert a.demotions == [] and a.promotions == []  # nothing evicted yet
    client.step(pool, [ops.free("a")])
    for tag in (2, 3, 4):
        _, r = admit(client, pool, f"r{tag}", prompt(tag))
        assert r.demotions == [] and r.promotions == []
    # The device is full of live blocks but a's four cached ones: the next request evicts
    # them, and each is demoted, not dropped.
    with client.step_stream() as stream:
        looked = stream.step(pool, [ops.add("r5", prompt(5)), ops.lookup("r5")],
                             begin_step=True).result(1, LookupResult)
        assert looked.hit_tokens == 0
        five = stream.step(pool, [ops.allocate("r5", 64)])
    assert five.promotions == []
    assert sorted(c.block_id for c in five.demotions) == sorted(a_blocks)
    assert all(c.group == 0 and 0 <= c.host_slot < TIER for c in five.demotions)
    assert len({c.host_slot for c in five.demotions}) == 4
    slot_of = {c.block_id: c.host_slot for c in five.demotions}
    a_slots = [slot_of[b] for b in a_blocks]  # by position in a's prompt
    client.step(pool, [ops.free(f"r{tag}") for tag in (2, 3, 4, 5)])

    # A prompt sharing a's prefix: no device hit, a full hit from host memory.
    again = prompt(1) + [7]
    assert client.peek_prefix([pool], again) == {pool: 0}
    assert client.peek_prefix([pool], again, include_host=True) == {pool: 64}
    view = client.routing_view([pool], again).hits[0]
    assert (view.hit_tokens, view.host_hit_tokens) == (0, 64)
    assert (view.groups[0].tokens, view.groups[0].host_tokens) == (0, 64)
    looked, allocated = admit(client, pool, "a2", again)
    assert looked.hit_tokens == 64
    assert looked.block_ids == [[-1, -1, -1, -1]]
    answer = allocated.result(0, AllocateResult)
    assert answer.hit_tokens_used == 64
    table = answer.block_ids[0]
    assert all(b > 0 for b in table)
    # One promotion per host-only position, from the slot its demotion wrote, into the
    # block the table has there; the allocation's own evictions are demoted first, into
    # other slots (the promoted ones stay reserved until the next Step).
    assert allocated.promotions == [TierCopy(0, table[i], a_slots[i]) for i in range(4)]
    # Every free device block held a cached one: the 5 blocks taken (4 promotion targets
    # and 1 new) are each demoted before being overwritten.
    assert sorted(c.block_id for c in allocated.demotions) == sorted(table)
    assert {c.host_slot for c in allocated.demotions}.isdisjoint(a_slots)

    stats = client.stats(pool)
    assert (stats.host_tier_blocks, stats.host_demotions, stats.host_promotions,
            stats.host_evictions) == (TIER, 9, 4, 0)
    assert stats.host_tier_used_blocks == 9  # inclusive: a's entries stay in host memory
    page = scrape(server.metrics_port)
    assert value(page, "kvcache_host_tier_used_blocks", pool=pool) == 9
    assert value(page, "kvcache_host_demotions_total", pool=pool) == 9
    assert value(page, "kvcache_host_promotions_total", pool=pool) == 4
    assert value(page, "kvcache_host_evictions_total", pool=pool) == 0

    # The feed says which tier: one BlockStored "CPU" per demotion, device events "GPU".
    feed = events(client, pool)
    cpu_stored = [e for e in feed if e.kind == "block_stored" and e.medium == "CPU"]
    assert len(cpu_stored) == 9
    assert all(len(e.block_hashes) == 1 and e.token_ids == [] for e in cpu_stored)
    assert {e.medium for e in feed if e.kind != "all_blocks_cleared"} == {"CPU", "GPU"}
    assert not [e for e in feed if e.kind == "block_removed" and e.medium == "CPU"]

    # The executor restarted: its host tier is empty.
    reset = client.step(pool, [ops.reset_host_tier()])
    assert reset.result(0, ResetHostTierResult).num_dropped == 9
    assert reset.demotions == [] and reset.promotions == []
    stats = client.stats(pool)
    assert (stats.host_tier_used_blocks, stats.host_evictions) == (0, 9)
    assert client.peek_prefix([pool], prompt(2) + [7], include_host=True) == {pool: 0}
    removed = [e for e in events(client, pool)
               if e.kind == "block_removed" and e.medium == "CPU"]
    assert len(removed) == 9
    page = scrape(server.metrics_port)
    assert value(page, "kvcache_host_tier_used_blocks", pool=pool) == 0
    assert value(page, "kvcache_host_evictions_total", pool=pool) == 9
    client.delete_pool(pool)


def test_both_clients_answer_the_copies_of_a_decode(client: CacheClient,
                                                    server: ServerProcess) -> None:
    """A decode that grows a block evicts a cached one: ``client.decode()``'s answer and
    the async client's Step answer carry the demotion."""
    pool = "tier-decode"
    register(client, pool)
    for tag in (1, 2):  # 8 cached free blocks
        admit(client, pool, f"c{tag}", prompt(tag))
        client.step(pool, [ops.free(f"c{tag}")])
    for tag in (3, 4):  # the rest live
        admit(client, pool, f"r{tag}", prompt(tag))
    d = client.decode(pool, ["r3"], [5], begin_step=True)  # token 65: a new block
    assert d.all_ok and len(d.demotions) == 1 and d.promotions == []
    assert d.demotions[0].block_id == d.new_block_ids[0][0][0]

    async def other() -> list[TierCopy]:
        async with AsyncCacheClient(server.target) as c:
            answer = await c.step(pool, [ops.decode(["r4"], [5])], begin_step=True)
            return answer.demotions
    assert len(asyncio.run(other())) == 1
    client.delete_pool(pool)


def test_the_tier_lru_drops_its_oldest_entries(client: CacheClient) -> None:
    pool = "tier-lru"
    register(client, pool, tier=4)
    for tag in range(1, 8):  # each prompt evicts the previous ones' cached blocks
        admit(client, pool, f"r{tag}", prompt(tag))
        client.step(pool, [ops.free(f"r{tag}")])
    stats = client.stats(pool)
    assert stats.host_demotions > 4 and stats.host_evictions > 0
    assert stats.host_tier_used_blocks == 4
    assert stats.host_tier_used_blocks == stats.host_demotions - stats.host_evictions
    feed = events(client, pool)
    assert stats.host_evictions == sum(
        len(e.block_hashes) for e in feed if e.kind == "block_removed" and e.medium == "CPU")
    # The oldest demoted prompt fell out of host memory; nothing reaches past the device.
    assert client.peek_prefix([pool], prompt(1) + [7], include_host=True) == {pool: 0}
    client.delete_pool(pool)


def test_one_peek_over_pools_with_and_without_a_tier(client: CacheClient) -> None:
    """The routing index answers the pools without a tier, the pools with one answer
    themselves: each as its own lookup would."""
    for pool, tier in (("mix-off", 0), ("mix-on", TIER)):
        register(client, pool, tier=tier)
        admit(client, pool, "a", prompt(1))
        client.step(pool, [ops.free("a")])
        for tag in (2, 3, 4, 5):  # evicts a's blocks: demoted on mix-on only
            admit(client, pool, f"r{tag}", prompt(tag))
    probe = prompt(1) + [7]
    off, on = client.routing_view(["mix-off", "mix-on"], probe).hits
    assert (off.hit_tokens, off.host_hit_tokens, off.groups[0].host_tokens) == (0, 0, 0)
    assert (on.hit_tokens, on.host_hit_tokens, on.groups[0].host_tokens) == (0, 64, 64)
    probe = prompt(5) + [7]  # on the device in both
    off, on = client.routing_view(["mix-off", "mix-on"], probe).hits
    assert (off.hit_tokens, off.host_hit_tokens) == (64, 0)
    assert (on.hit_tokens, on.host_hit_tokens, on.groups[0].tokens) == (64, 64, 64)
    assert client.peek_prefix(["mix-off", "mix-on"], prompt(1) + [7], include_host=True) == \
        {"mix-off": 0, "mix-on": 64}
    for pool in ("mix-off", "mix-on"):
        client.delete_pool(pool)


def test_a_miss_reason_says_evicted_only_when_gone_from_both_tiers(
        client: CacheClient) -> None:
    pool = "tier-explain"
    register(client, pool)
    admit(client, pool, "a", prompt(1))
    client.step(pool, [ops.free("a")])
    for tag in (2, 3, 4, 5):  # r5 evicts a's blocks from the device: demoted
        admit(client, pool, f"r{tag}", prompt(tag))
    probe = prompt(1) + [7]

    def explained() -> pb.PoolHit:
        return client.routing_view([pool], probe, explain=True).hits[0]

    hit = explained()
    assert (hit.hit_tokens, hit.host_hit_tokens) == (0, 64)
    assert hit.groups[0].miss_reason == pb.MISS_REASON_NONE  # all of it in host memory
    assert client.step(pool, [ops.reset_host_tier()]).demotions == []
    hit = explained()
    assert (hit.hit_tokens, hit.host_hit_tokens, hit.groups[0].host_tokens) == (0, 0, 0)
    assert hit.groups[0].miss_reason == pb.MISS_REASON_EVICTED
    client.delete_pool(pool)


def test_without_a_tier_nothing_changes(client: CacheClient) -> None:
    pool = "tier-off"
    register(client, pool, tier=0)
    for tag in range(1, 7):
        _, r = admit(client, pool, f"r{tag}", prompt(tag))
        assert r.demotions == [] and r.promotions == []
        client.step(pool, [ops.free(f"r{tag}")])
    reset = client.step(pool, [ops.reset_host_tier()])
    assert reset.result(0, ResetHostTierResult).num_dropped == 0
    stats = client.stats(pool)
    assert (stats.host_tier_blocks, stats.host_tier_used_blocks, stats.host_demotions,
            stats.host_promotions, stats.host_evictions) == (0, 0, 0, 0, 0)
    view = client.routing_view([pool], prompt(6) + [7]).hits[0]
    assert view.host_hit_tokens == 0 and view.groups[0].host_tokens == 0
    assert client.get_pool(pool).raw.options.host_tier_blocks == 0
    client.delete_pool(pool)


@pytest.mark.parametrize(("tier", "changes"), [(-1, {}), (2**24 + 1, {}),
                                               (8, {"enable_caching": False})])
def test_a_bad_tier_is_invalid_argument_and_registers_nothing(client: CacheClient, tier: int,
                                                              changes: dict) -> None:
    with pytest.raises(CacheError) as err:
        register(client, "tier-bad", tier=tier, **changes)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.field == "options.host_tier_blocks"
    assert "tier-bad" not in {p.pool_id for p in client.list_pools()}


def test_the_option_is_echoed_and_part_of_the_description(client: CacheClient) -> None:
    register(client, "tier-echo", tier=32)
    assert client.get_pool("tier-echo").raw.options.host_tier_blocks == 32
    register(client, "tier-echo", tier=32)  # the same description: the same pool
    with pytest.raises(CacheError) as err:
        register(client, "tier-echo", tier=16)
    assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert err.value.field == "options.host_tier_blocks"
    client.delete_pool("tier-echo")


class RawSession:
    """Steps stamped with a session of the raw stub (so a resend is a true retry)."""

    def __init__(self, stub: pb_grpc.CacheServiceStub) -> None:
        self.stub = stub
        self.sid = stub.OpenSession(pb.OpenSessionRequest(client_name="tier")).session_id
        self.sequence = 0

    def request(self, pool: str, step_ops: list[pb.Op]) -> pb.StepRequest:
        self.sequence += 1
        return pb.StepRequest(pool_id=pool, ops=step_ops, begin_step=True,
                              session_id=self.sid, sequence=self.sequence)

    def step(self, pool: str, step_ops: list[pb.Op]) -> pb.StepResponse:
        return self.stub.Step(self.request(pool, step_ops))


def test_a_session_retry_answers_the_same_copies(stub: pb_grpc.CacheServiceStub,
                                                 client: CacheClient) -> None:
    pool = "tier-retry"
    register(client, pool)
    session = RawSession(stub)
    for tag in (1, 2, 3, 4):
        session.step(pool, [ops.add(f"r{tag}", prompt(tag)), ops.allocate(f"r{tag}", 64)])
        if tag == 1:
            session.step(pool, [ops.free("r1")])
    request = session.request(pool, [ops.add("r5", prompt(5)), ops.allocate("r5", 64)])
    first = stub.Step(request)
    assert len(first.demotions) == 4
    demoted = client.stats(pool).host_demotions
    again = stub.Step(request)  # the answer was "lost": resent under the same number
    assert again == first
    assert client.stats(pool).host_demotions == demoted  # not applied twice
    stub.CloseSession(pb.CloseSessionRequest(session_id=session.sid))
    client.delete_pool(pool)


def _history() -> list[list[pb.Op]]:
    """Steps that leave 16 cached free blocks on the device (4 prompts, freed)."""
    steps = [[ops.add(f"h{t}", prompt(t)), ops.allocate(f"h{t}", 64)] for t in (1, 2, 3, 4)]
    steps.append([ops.free(f"h{t}") for t in (1, 2, 3, 4)])
    return steps


def test_a_sliced_step_answers_the_copies_of_every_slice(client: CacheClient) -> None:
    """A Step far beyond the server's slice size (32 request-ops) demotes in several slices:
    its answer lists every copy, in the order the core plans them unsliced."""
    pool = "tier-sliced"
    register(client, pool)
    history = _history()
    for step_ops in history:
        client.step(pool, step_ops, begin_step=True)
    big = StepBuilder(pool, begin_step=True)
    for t in (5, 6):
        big.add(f"n{t}", prompt(t)).allocate(f"n{t}", 64)
        for i in range(40):  # filler between the demoting allocates: other slices
            big.add(f"f{t}-{i}", [1, 2, 3])
    for t in (5, 6):
        for i in range(40):
            big.free(f"f{t}-{i}")
    answer = client.step_batch(big)
    assert len(answer.demotions) == 8

    # The same history and batch on a core pool, applied in one piece.
    desc = PoolDescription(tuple((ls.name, layer_spec_from_proto(ls, "l"))
                                 for ls in full_layers()),
                           PoolOptions(max_model_len=MAX_LEN, host_tier_blocks=TIER),
                           num_blocks=DEVICE_BLOCKS)
    core = Pool(build_config(desc), desc.options)
    for step_ops in [*history, list(big.request.ops)]:
        core.apply_batch(convert.ops_from_proto(pb.StepRequest(ops=step_ops), "sha256"),
                         begin_step=True)
    demotions, promotions = core.tier_copies
    assert answer.demotions == [TierCopy(c.group, c.block_id, c.host_slot) for c in demotions]
    assert answer.promotions == [] == promotions
    client.delete_pool(pool)


def test_the_conformance_kit_replays_a_tier_trace_like_the_reference(
        client: CacheClient) -> None:
    """A trace through a tier (demotions, a host hit, promotions, a reset) answers the same
    over the protocol as the replay tool, copies included."""
    config = {"num_blocks": DEVICE_BLOCKS, "max_model_len": MAX_LEN, "host_tier_blocks": 8,
              "groups": [{"type": "full_attention", "block_size": BS}]}
    trace: list[dict] = []
    for t in (1, 2, 3, 4, 5):
        trace += [{"op": "add", "req": f"r{t}", "tokens": prompt(t)},
                  {"op": "lookup", "req": f"r{t}"},
                  {"op": "allocate", "req": f"r{t}", "num_new_tokens": 64}]
        if t == 1:
            trace.append({"op": "free", "req": "r1"})
    trace += [{"op": "free", "req": f"r{t}"} for t in (2, 3, 4, 5)]
    trace += [{"op": "add", "req": "a", "tokens": prompt(1) + [7]},
              {"op": "lookup", "req": "a"},
              {"op": "allocate", "req": "a", "num_new_tokens": 1},
              {"op": "usage"}, {"op": "reset_host_tier"}]
    expected = reference_answers(config, trace)
    assert "demotions" in expected[15] and "promotions" in expected[-3]
    assert expected[-4]["block_ids"] == [[-1, -1, -1, -1]]
    assert expected[-1]["num_dropped"] > 0
    assert run_trace(client, "tier", config, trace, expected) == []


def _stats(stub: pb_grpc.CacheServiceStub, pool: str) -> pb.PoolStats:
    return stub.GetPoolStats(pb.GetPoolStatsRequest(pool_id=pool)).stats


def _host_view(stub: pb_grpc.CacheServiceStub, pool: str, tokens: list[int]) -> pb.PoolHit:
    return stub.PeekPrefix(pb.PeekPrefixRequest(pool_ids=[pool], token_ids=tokens)).hits[0]


@pytest.mark.parametrize("flags", [(), ("--snapshot-every", "4")], ids=["log", "snapshot"])
def test_the_tier_survives_a_sigkill_and_a_restart_on_the_data_dir(
        tmp_path: Path, flags: tuple[str, ...]) -> None:
    """The tier is pool state: a restarted service plans with the tier the live executor
    still holds (same counters, same host hits, promotions from the same slots)."""
    data_dir = tmp_path / "data"
    pool = "p"
    server = start_cache_service("--data-dir", str(data_dir), "--fsync", "always", *flags)
    try:
        with CacheClient(server.target) as c, grpc.insecure_channel(server.target) as ch:
            stub = pb_grpc.CacheServiceStub(ch)
            register(c, pool)
            _, a = admit(c, pool, "a", prompt(1))
            a_blocks = a.result(0, AllocateResult).block_ids[0]
            c.step(pool, [ops.free("a")])
            for tag in (2, 3, 4, 5):
                _, r = admit(c, pool, f"r{tag}", prompt(tag))
            slot_of = {d.block_id: d.host_slot for d in r.demotions}  # r5 evicted a's
            a_slots = [slot_of[block] for block in a_blocks]
            c.step(pool, [ops.free(f"r{tag}") for tag in (2, 3, 4, 5)])
            _, b = admit(c, pool, "b", prompt(2) + [7])  # r2's blocks: still on the device
            admit(c, pool, "c", prompt(6))  # demotes more
            before = _stats(stub, pool)
            view = _host_view(stub, pool, prompt(1) + [7])
            assert before.host_demotions > 4 and before.host_promotions == 0
            assert (view.hit_tokens, view.host_hit_tokens) == (0, 64)
            if flags:
                server.wait_for(lambda r: r.get("event") == "snapshot_written", timeout=60)
            server.signal(signal.SIGKILL)
            server.stop()
        assert server.returncode == -signal.SIGKILL

        server = start_cache_service("--data-dir", str(data_dir), "--fsync", "always", *flags)
        recovered = server.wait_for(lambda r: r.get("event") == "recovered")
        if flags:
            assert recovered["snapshot_index"] > 0
        with CacheClient(server.target) as c, grpc.insecure_channel(server.target) as ch:
            stub = pb_grpc.CacheServiceStub(ch)
            assert _stats(stub, pool) == before
            assert _host_view(stub, pool, prompt(1) + [7]) == view
            looked, allocated = admit(c, pool, "a2", prompt(1) + [7])
            assert looked.block_ids == [[-1, -1, -1, -1]]
            table = allocated.result(0, AllocateResult).block_ids[0]
            assert allocated.promotions == [TierCopy(0, table[i], a_slots[i])
                                            for i in range(4)]
    finally:
        server.stop()
    assert server.returncode == 0, server.output()
