"""The routing view over gRPC: PeekPrefix with per-group residency and miss reasons,
the Step lookup op's explain, the miss-reason metrics, and GetPrefixSnapshot + resume.
"""

from __future__ import annotations

import contextlib
import random
import signal
import threading
from collections import Counter
from collections.abc import Iterator

import pytest

from cache_service.client import CacheClient, CacheError, ops
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.launch import ServerProcess, start_cache_service
from tests.metrics_text import scrape, value
from tests.service.builders import hybrid_layers

PROMPT = list(range(100, 165))  # 65 tokens: 4 blocks of 16 are cacheable


def serve(client: CacheClient, pool_id: str, rid: str, tokens: list[int]) -> None:
    """One request's prefill in one chunk, then free: its blocks stay cached."""
    client.step(pool_id, [ops.add(rid, tokens), ops.lookup(rid),
                          ops.allocate(rid, len(tokens)), ops.free(rid)])


def test_peek_prefix_answers_hit_and_residency_per_pool(client, new_pool) -> None:
    plain, hybrid, empty = new_pool(), new_pool(hybrid_layers()), new_pool()
    serve(client, plain.pool_id, "a", PROMPT)
    serve(client, hybrid.pool_id, "a", PROMPT[:40])
    view = client.routing_view([plain.pool_id, hybrid.pool_id, empty.pool_id], PROMPT)
    got = {h.pool_id: (h.hit_tokens, [(g.group_idx, g.kind, g.tokens, g.blocks,
                                       g.miss_reason) for g in h.groups])
           for h in view.hits}
    full, swa = pb.LAYER_KIND_FULL_ATTENTION, pb.LAYER_KIND_SLIDING_WINDOW
    # Without explain the reasons stay UNSPECIFIED (0).
    assert got == {
        plain.pool_id: (64, [(0, full, 64, 4, 0)]),
        hybrid.pool_id: (32, [(0, full, 32, 2, 0), (1, swa, 32, 2, 0)]),
        empty.pool_id: (0, [(0, full, 0, 0, 0)]),
    }
    # The same hits as the plain PeekPrefix answer.
    assert client.peek_prefix([plain.pool_id, hybrid.pool_id, empty.pool_id], PROMPT) == \
        {plain.pool_id: 64, hybrid.pool_id: 32, empty.pool_id: 0}


def test_explain_names_reasons_and_feeds_the_metrics(client, new_pool, server) -> None:
    pool = new_pool()
    serve(client, pool.pool_id, "a", PROMPT)
    assert client.reset_prefix_cache(pool.pool_id)
    serve(client, pool.pool_id, "b", PROMPT[:32] + [1] * 33)
    view = client.routing_view([pool.pool_id], PROMPT, explain=True)
    (group,) = view.hits[0].groups
    # Blocks 0-1 are cached again (by b); block 2 of PROMPT was removed by the reset.
    assert (view.hits[0].hit_tokens, group.tokens, group.miss_reason) == \
        (32, 32, pb.MISS_REASON_EVICTED)
    # The Step lookup op explains the same way, on request.
    result = client.step_raw(pb.StepRequest(pool_id=pool.pool_id, ops=[
        ops.add("c", PROMPT), ops.lookup("c", explain=True), ops.free("c")]))
    lookup = result.results[1].lookup
    assert [(g.tokens, g.miss_reason) for g in lookup.groups] == \
        [(32, pb.MISS_REASON_EVICTED)]
    assert value(scrape(server.metrics_port), "kvcache_pool_prefix_misses_total", group="0",
                 pool=pool.pool_id, reason="evicted") == 2


def test_explain_detects_a_hash_recipe_mismatch(client, new_pool) -> None:
    pool = new_pool(hash_algo="sha256_cbor")
    serve(client, pool.pool_id, "a", PROMPT)
    foreign = [bytes([i]) * 32 for i in range(4)]  # not the pool's recipe
    view = client.routing_view([pool.pool_id], PROMPT, block_hashes=foreign, explain=True)
    assert [g.miss_reason for g in view.hits[0].groups] == \
        [pb.MISS_REASON_HASH_RECIPE_MISMATCH]
    # Tokens with hashes are only accepted with explain.
    with pytest.raises(Exception, match="token_ids"):
        client.routing_view([pool.pool_id], PROMPT, block_hashes=foreign)


def test_deleted_pool_leaves_the_index(client, new_pool) -> None:
    a, b = new_pool(), new_pool()
    serve(client, a.pool_id, "x", PROMPT)
    serve(client, b.pool_id, "x", PROMPT)
    client.delete_pool(a.pool_id)
    assert client.peek_prefix([b.pool_id], PROMPT) == {b.pool_id: 64}
    with pytest.raises(Exception, match="pool_ids"):
        client.peek_prefix([a.pool_id], PROMPT)


# -- snapshot + resume -------------------------------------------------------------------

class Follower:
    """A router's index fed by SubscribeEvents: a count per (group, hash)."""

    def __init__(self, client: CacheClient, pool_id: str, start: int,
                 initial: Counter | None = None, incarnation: int | None = None) -> None:
        self.index: Counter = Counter(initial or {})
        self.first_sequence: int | None = None
        self.last_sequence = start - 1
        self.gap = False
        self._cond = threading.Condition()
        self._events = client.subscribe_events(pool_id, from_sequence=start,
                                               incarnation=incarnation)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with contextlib.suppress(CacheError):  # the channel closes when the test ends
            self._follow()

    def _follow(self) -> None:
        for e in self._events:
            with self._cond:
                if self.first_sequence is None:
                    self.first_sequence = e.sequence
                self.gap |= e.sequence != self.last_sequence + 1
                self.last_sequence = e.sequence
                if e.kind == "all_blocks_cleared":
                    self.index.clear()
                for h in e.block_hashes:
                    key = (e.group_idx, h)
                    self.index[key] += 1 if e.kind == "block_stored" else -1
                    if not self.index[key]:
                        del self.index[key]
                self._cond.notify_all()

    def wait_for(self, sequence: int, timeout: float = 30) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self.last_sequence >= sequence, timeout), \
                f"follower stuck at {self.last_sequence}, expected {sequence}"


def snapshot_index(snap: pb.GetPrefixSnapshotResponse) -> Counter:
    return Counter((g.group_idx, h) for g in snap.groups for h in g.block_hashes)


@pytest.fixture(scope="module")
def big_buffer_server() -> Iterator[ServerProcess]:
    """Its own server: followers must not fall out of a small replay buffer."""
    with start_cache_service("--event-buffer", "1000000") as srv:
        yield srv
    assert srv.returncode == 0, srv.output()


def test_snapshot_mid_load_then_resume_equals_following_from_the_start(
        big_buffer_server: ServerProcess) -> None:
    with CacheClient(big_buffer_server.target, default_timeout=20) as client:
        pool_id = "routing-snapshot"
        # Small and hybrid: the load evicts, and both groups store and remove.
        client.register_pool(pool_id, hybrid_layers(), num_blocks=48, max_model_len=128)
        from_start = Follower(client, pool_id, 1)
        rng = random.Random(7)
        prefixes = [[rng.randrange(1000) for _ in range(48)] for _ in range(4)]
        half = threading.Event()

        def load() -> None:
            for i in range(120):
                tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(40)]
                serve(client, pool_id, f"r{i}", tokens)
                if i == 40:
                    assert client.reset_prefix_cache(pool_id)
                if i == 60:
                    half.set()

        loader = threading.Thread(target=load)
        loader.start()
        assert half.wait(60)
        snap = client.prefix_snapshot(pool_id)  # while the loader keeps going
        resumed = Follower(client, pool_id, snap.sequence + 1, snapshot_index(snap))
        loader.join(120)
        assert not loader.is_alive()
        last = client.stats(pool_id).last_event_sequence
        assert last > snap.sequence > 0
        from_start.wait_for(last)
        resumed.wait_for(last)
        assert resumed.first_sequence == snap.sequence + 1
        assert not from_start.gap and not resumed.gap
        assert resumed.index == from_start.index == snapshot_index(
            client.prefix_snapshot(pool_id))
        assert len(from_start.index) > 0


def test_async_client_has_the_routing_calls(client, new_pool, server) -> None:
    import asyncio

    from cache_service.client import AsyncCacheClient

    pool = new_pool()
    serve(client, pool.pool_id, "a", PROMPT)

    async def scenario():
        async with AsyncCacheClient(server.target) as aclient:
            view = await aclient.routing_view([pool.pool_id], PROMPT, explain=True)
            snap = await aclient.prefix_snapshot(pool.pool_id)
        return view, snap

    view, snap = asyncio.run(scenario())
    assert [(g.tokens, g.miss_reason) for g in view.hits[0].groups] == \
        [(64, pb.MISS_REASON_NONE)]
    assert sum(len(g.block_hashes) for g in snap.groups) == 4
    assert snap.sequence == client.stats(pool.pool_id).last_event_sequence


def test_bad_routing_calls_name_the_field(client, new_pool) -> None:
    pool = new_pool(hash_algo="sha256_cbor")
    with pytest.raises(CacheError) as err:
        client.prefix_snapshot("no-such-pool")
    assert (err.value.code.name, err.value.field) == ("NOT_FOUND", "pool_id")
    # With explain, tokens and hashes must agree in count (one hash per full block).
    with pytest.raises(CacheError) as err:
        client.routing_view([pool.pool_id], PROMPT, block_hashes=[b"x" * 32], explain=True)
    assert (err.value.code.name, err.value.field) == ("INVALID_ARGUMENT", "block_hashes")
    with pytest.raises(CacheError) as err:
        client.routing_view([pool.pool_id, "no-such-pool"], PROMPT)
    assert (err.value.code.name, err.value.field) == ("NOT_FOUND", "pool_ids[1]")


def test_snapshot_of_a_pool_without_events(client, new_pool) -> None:
    pool = new_pool(enable_events=False)
    serve(client, pool.pool_id, "a", PROMPT)
    snap = client.prefix_snapshot(pool.pool_id)
    assert snap.sequence == 0  # no feed to resume: the snapshot alone is the state
    assert [len(g.block_hashes) for g in snap.groups] == [4]


def _routing_state(client: CacheClient, pool_ids: list[str], prompts: list[list[int]]
                   ) -> tuple:
    """Everything a router reads: residency of each prompt, each pool's snapshot."""
    views = [client.routing_view(pool_ids, p).SerializeToString() for p in prompts]
    snaps = {}
    for pid in pool_ids:
        snap = client.prefix_snapshot(pid)
        snaps[pid] = (snap.sequence, snap.incarnation, snapshot_index(snap))
    return views, snaps


def test_a_restarted_server_answers_the_same_and_a_router_resumes_its_feed(
        tmp_path) -> None:
    """SIGKILL, then a restart on the data directory (a background snapshot loaded, the log
    after it replayed: the index is rebuilt, not restored): PeekPrefix residency and
    GetPrefixSnapshot answer exactly as before, and a router that followed the feed
    resumes it after its last event, naming the incarnation, with no gap."""
    # Each start listens on a port of its own: the router reconnects to the new address.
    flags = ("--data-dir", str(tmp_path / "data"), "--snapshot-every", "40",
             "--event-buffer", "100000")
    server = start_cache_service(*flags)
    try:
        with CacheClient(server.target, default_timeout=20) as client:
            pools = ["r-full", "r-hybrid"]
            client.register_pool(pools[0], hybrid_layers()[:1], num_blocks=40,
                                 max_model_len=128)
            client.register_pool(pools[1], hybrid_layers(), num_blocks=48,
                                 max_model_len=128)
            router = Follower(client, pools[1], 1)
            rng = random.Random(11)
            prefixes = [[rng.randrange(1000) for _ in range(48)] for _ in range(3)]
            prompts = [p + [rng.randrange(1000) for _ in range(30)] for p in prefixes]

            def fresh() -> list[int]:
                return rng.choice(prefixes) + [rng.randrange(1000) for _ in range(30)]
            for i in range(60):  # small pools: the load evicts
                for pid in pools:
                    serve(client, pid, f"r{i}", fresh())
            assert client.reset_prefix_cache(pools[0])
            for i in range(60, 70):
                serve(client, pools[0], f"r{i}", fresh())
            for p in prompts:
                serve(client, pools[1], "p", p)
            before = _routing_state(client, pools, prompts)
            assert any(h.hit_tokens for h in client.routing_view(pools, prompts[0]).hits)
            assert client.stats(pools[1]).evictions > 0
            last = before[1][pools[1]][0]
            router.wait_for(last)
            assert before[1][pools[1]][2] == router.index
        # A background snapshot committed (its compaction process takes a while on a busy
        # machine); the records after its rotation point stay in the log.
        server.wait_for(lambda r: r.get("event") == "snapshot_written", timeout=120)
        server.signal(signal.SIGKILL)
        server.stop()

        server = start_cache_service(*flags)
        recovered = server.wait_for(lambda r: r.get("event") == "recovered")
        assert recovered["snapshot_index"] > 0 and recovered["records_replayed"] > 0
        with CacheClient(server.target, default_timeout=20) as client:
            assert _routing_state(client, pools, prompts) == before
            incarnation = before[1][pools[1]][1]
            resumed = Follower(client, pools[1], last + 1, router.index, incarnation)
            for i in range(70, 90):
                serve(client, pools[1], f"r{i}", fresh())
            now = client.prefix_snapshot(pools[1])
            assert now.sequence > last
            resumed.wait_for(now.sequence)
            assert resumed.first_sequence == last + 1 and not resumed.gap
            assert resumed.index == snapshot_index(now)
    finally:
        server.stop()
