"""A router that knows a pool only from its KV events answers the same hits as PeekPrefix.

For every group type (full, sliding window with and without a coarser hit alignment,
chunked local, Mamba align alone and in a hybrid), a scheduler drives a real server with
shared prefixes, arbitrary chunks (also the Mamba-poisoning kind), decode, frees, evictions
(the pool is small) and prefix-cache resets. After every Step the subscriber applies the new
events to its ``EventIndex`` and must answer every probe exactly as ``PeekPrefix`` does.
"""

from __future__ import annotations

import random

import pytest

from cache_service.client import AllocateResult, CacheClient, LookupResult, layers, ops
from cache_service.client.event_index import EventIndex
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.api.kvcache.v1 import cache_service_pb2_grpc as pb_grpc

FULL = layers.full_attention("f", block_size=16, num_kv_heads=2, head_size=8)
SWA = layers.sliding_window("s", block_size=16, sliding_window=32, num_kv_heads=2, head_size=8)
MAMBA = layers.mamba("m", block_size=16, shapes=[[4]], dtypes=["float32"],
                     mamba_cache_mode="align")

POOLS = {
    "full": [FULL],
    "full_swa": [FULL, SWA],
    # Sliding block 16 under a 32-token hit alignment: only some blocks are cached.
    "full32_swa16": [layers.full_attention("f", block_size=32, num_kv_heads=2, head_size=8),
                     layers.sliding_window("s", block_size=16, sliding_window=17,
                                           num_kv_heads=2, head_size=16)],
    "full_chunked": [FULL, layers.chunked_local("c", block_size=16, attention_chunk_size=64,
                                                num_kv_heads=2, head_size=8)],
    "mamba": [MAMBA],
    "full_swa_mamba": [FULL, SWA, MAMBA],
}


class Subscriber:
    """Follows a pool's events with sequence numbers, feeding an EventIndex."""

    def __init__(self, stub: pb_grpc.CacheServiceStub, client: CacheClient, pool_id: str,
                 config: pb.PoolConfig) -> None:
        self.stub, self.client, self.pool_id = stub, client, pool_id
        self.index = EventIndex(config)
        self.next = 1
        self.kinds: set[str] = set()

    def catch_up(self) -> None:
        last = self.client.stats(self.pool_id).last_event_sequence
        if last < self.next:
            return
        call = self.stub.SubscribeEvents(pb.SubscribeEventsRequest(
            pool_id=self.pool_id, from_sequence=self.next), timeout=20)
        try:
            for batch in call:
                for event in batch.events:
                    assert event.sequence == self.next, "events arrive in order, no gaps"
                    self.index.apply(event)
                    self.kinds.add(event.WhichOneof("event"))
                    if event.WhichOneof("event") == "block_stored":
                        check_stored_event(event.block_stored)
                    self.next += 1
                if self.next > last:
                    break
        finally:
            call.cancel()


def check_stored_event(e: pb.BlockStored) -> None:
    """The documented shape of a BlockStored."""
    assert e.block_hashes, "never empty"
    if e.medium == "CPU" or not e.token_ids:
        # The host tier's: a demotion into host memory ("CPU") or a promotion back to the
        # device ("GPU"): one key, no tokens.
        assert len(e.block_hashes) == len(e.prefix_lengths) == 1
        assert e.prefix_lengths[0] % e.block_size == 0 and e.prefix_lengths[0] > 0
        assert not e.token_ids and not e.HasField("parent_block_hash") and not e.lora_name
        return
    assert e.medium == "GPU"
    assert len(e.prefix_lengths) == len(e.block_hashes)
    assert e.start_token % e.block_size == 0 and len(e.token_ids) % e.block_size == 0
    assert all(length % e.block_size == 0 for length in e.prefix_lengths)
    assert list(e.prefix_lengths) == sorted(set(e.prefix_lengths))
    assert e.start_token < e.prefix_lengths[0] and \
        e.prefix_lengths[-1] <= e.start_token + len(e.token_ids)
    assert e.HasField("parent_block_hash") == (e.start_token > 0)


def drive(client: CacheClient, sub: Subscriber, pool_id: str, seed: int,
          tier: bool = False) -> int:
    """A random scheduler; returns how many probes were compared (with ``tier``, the hit
    across both tiers too)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(500) for _ in range(rng.choice([40, 64, 100, 130]))]
                for _ in range(3)]
    running: dict[str, list[int]] = {}  # id -> [computed, num_tokens]
    prompts: dict[str, list[int]] = {}
    compared = 0
    for step in range(70):
        batch: list[pb.Op] = []
        r = rng.random()
        if r < 0.3 or not running:
            rid = f"r{seed}-{step}"
            prompt = rng.choice(prefixes)[:rng.randrange(16, 131)] + \
                [rng.randrange(500) for _ in range(rng.randrange(1, 60))]
            prompts[rid] = prompt
            first = rng.choice([len(prompt), rng.randrange(1, len(prompt) + 1), 16, 120])
            batch = [ops.add(rid, prompt), ops.lookup(rid)]
            res = client.step(pool_id, batch, begin_step=True)
            hit = res.result(1, LookupResult).hit_tokens
            n = max(1, min(first, len(prompt) - hit))
            out = client.step(pool_id, [ops.allocate(rid, n)]).result(0, AllocateResult)
            if out.ok:
                running[rid] = [out.num_computed_tokens, len(prompt)]
            else:
                client.step(pool_id, [ops.free(rid)])
        elif r < 0.75:
            rid = rng.choice(list(running))
            computed, total = running[rid]
            if computed < total:
                n = rng.choice([total - computed, rng.randrange(1, total - computed + 1)])
                out = client.step(pool_id, [ops.allocate(rid, n)], begin_step=True).result(0,
                                AllocateResult)
            else:
                tok = rng.randrange(500)
                prompts[rid].append(tok)
                out = client.step(pool_id, [ops.allocate(rid, 1, append_token_ids=[tok])],
                                            begin_step=True).result(0, AllocateResult)
                running[rid][1] += 1
            if out.ok:
                running[rid][0] = out.num_computed_tokens
            else:
                client.step(pool_id, [ops.free(rid)])
                del running[rid]
        elif r < 0.97 and step != 35:
            rid = rng.choice(list(running))
            client.step(pool_id, [ops.free(rid)], begin_step=True)
            del running[rid]
        else:
            for rid in running:
                client.step(pool_id, [ops.free(rid)])
            running.clear()
            assert client.reset_prefix_cache(pool_id)
        # The next step begins, so Mamba states cached this step are hittable, as in a
        # PeekPrefix made between steps.
        client.step(pool_id, [], begin_step=True)
        sub.catch_up()
        probes = [p + [7] for p in list(prompts.values())[-6:]] + \
            [p[:rng.randrange(2, len(p) + 1)] for p in prefixes]
        for probe in probes:
            want = client.peek_prefix([pool_id], probe)[pool_id]
            assert sub.index.hit_tokens(probe) == want, (step, probe[:8], len(probe), want)
            compared += 1
            if tier:
                want = client.peek_prefix([pool_id], probe, include_host=True)[pool_id]
                got = sub.index.hit_tokens(probe, include_host=True)
                assert got == want, ("host", step, probe[:8], len(probe), want)
    return compared


@pytest.mark.parametrize("name", sorted(POOLS))
def test_event_index_answers_like_peek_prefix(client: CacheClient, stub, new_pool,
                                              name: str) -> None:
    # Small pools, so that cached blocks get evicted (a Mamba request holds 1-2 blocks).
    info = new_pool(POOLS[name], num_blocks=8 if name == "mamba" else 40, max_model_len=512,
                    skip_capacity_check=True)
    sub = Subscriber(stub, client, info.pool_id, info.raw)
    compared = drive(client, sub, info.pool_id, seed=sorted(POOLS).index(name))
    assert compared > 300
    # The run really exercised stores, evictions and resets.
    assert sub.kinds == {"block_stored", "block_removed", "all_blocks_cleared"}
    assert client.stats(info.pool_id).evictions > 0


@pytest.mark.parametrize("name", ["full", "full_swa", "full_swa_mamba"])
def test_with_a_host_tier_the_index_answers_both_tiers(client: CacheClient, stub, new_pool,
                                                       name: str) -> None:
    """Events of medium "CPU" (demotions, the tier's LRU) counted apart give the device hit
    and the hit across both tiers (``PoolHit.host_hit_tokens``), as PeekPrefix answers
    them; a prefix-cache reset clears the device only."""
    info = new_pool(POOLS[name], num_blocks=24, max_model_len=512, skip_capacity_check=True,
                    host_tier_blocks=16)
    sub = Subscriber(stub, client, info.pool_id, info.raw)
    compared = drive(client, sub, info.pool_id, seed=sorted(POOLS).index(name), tier=True)
    assert compared > 300
    stats = client.stats(info.pool_id)
    assert stats.host_demotions > 0 and stats.host_evictions > 0 and stats.host_promotions > 0
