"""32 concurrent clients drive scheduler-like Steps on shared and separate pools; afterwards
no block leaked and no request is left in any pool."""

from __future__ import annotations

import asyncio
import random

from cache_service.client import AllocateResult, AsyncCacheClient, ops

from .builders import hybrid_layers

NUM_CLIENTS = 32
STEPS = 12


def pool_of(client_id: int) -> str:
    if client_id < 16:
        return "conc-shared-a"  # 16 clients share one pool
    if client_id < 24:
        return "conc-shared-b"  # 8 share another
    return f"conc-own-{client_id}"  # 8 have their own


async def scheduler(target: str, client_id: int, seed: int) -> tuple[int, int]:
    """A tiny engine loop: admit, decode, finish; a request that gets no room is dropped.
    Returns (successful allocations, no-room answers)."""
    rng = random.Random(seed)
    shared_prefix = [rng.randrange(50) for _ in range(32)]
    pool = pool_of(client_id)
    live: set[str] = set()
    ok = no_room = 0
    n = 0
    async with AsyncCacheClient(target, default_timeout=60) as client:
        for _ in range(STEPS):
            batch = []
            for rid in sorted(live):
                if rng.random() < 0.25:
                    batch.append(ops.free(rid))
                    live.discard(rid)
                else:
                    batch += [ops.append(rid, [rng.randrange(50)]), ops.allocate(rid, 1)]
            for _ in range(rng.randrange(1, 3)):
                rid = f"c{client_id}-{n}"
                n += 1
                prompt = shared_prefix + [rng.randrange(50) for _ in range(rng.randrange(1, 40))]
                batch += [ops.add(rid, prompt), ops.allocate(rid, len(prompt))]
                live.add(rid)
            result = await client.step(pool, batch, begin_step=True)
            for op, res in zip(batch, result.results):
                if isinstance(res, AllocateResult):
                    if res.ok:
                        ok += 1
                    else:
                        no_room += 1
                        rid = op.allocate.request_id
                        if rid in live:
                            live.discard(rid)
                            await client.step(pool, [ops.free(rid)])
        if live:
            await client.step(pool, [ops.free(rid) for rid in sorted(live)])
    return ok, no_room


def test_32_clients_leave_no_leaks(server, client) -> None:
    pools = sorted({pool_of(i) for i in range(NUM_CLIENTS)})
    for pool_id in pools:
        client.register_pool(pool_id, hybrid_layers(), num_blocks=200, max_model_len=256)

    async def run_all() -> list[tuple[int, int]]:
        return await asyncio.gather(*[scheduler(server.target, i, seed=i)
                                      for i in range(NUM_CLIENTS)])

    outcomes = asyncio.run(run_all())
    assert sum(ok for ok, _ in outcomes) > NUM_CLIENTS * STEPS
    assert sum(no_room for _, no_room in outcomes) > 0, "the shared pools were never full"
    for pool_id in pools:
        stats = client.stats(pool_id)
        assert stats.num_requests == 0, pool_id
        assert stats.num_free_blocks == stats.num_blocks - 1, pool_id
        assert stats.usage == 0.0
