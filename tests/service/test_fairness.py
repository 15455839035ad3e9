"""Long calls share the loop: while a sliced call works on a pool, calls on other pools run
between its slices, and calls on the same pool wait until it is done (they never see half
of it). In-process, with the real gate and state, on the real event loop."""

from __future__ import annotations

import asyncio

from cache_service import convert
from cache_service.client import StepBuilder, layers, register_request
from cache_service.fairness import PoolGate
from cache_service.registry import PoolRegistry
from cache_service.state import ServiceState, WalRecord

N = 400


def state_with_pools() -> ServiceState:
    state = ServiceState(PoolRegistry())
    for pool in ("big", "small"):
        state.apply(WalRecord(register_pool=register_request(
            pool, [layers.full_attention("l", block_size=16, num_kv_heads=1, head_size=8)],
            num_blocks=4 * N, max_model_len=256)))
        admit = StepBuilder(pool, begin_step=True)
        for i in range(N):
            admit.add(f"r{i}", [i % 7] * 16).allocate(f"r{i}", 16)
        state.apply(WalRecord(step=admit.request))
    return state


def decode(pool: str, n: int, token: int) -> WalRecord:
    return WalRecord(step=StepBuilder(pool, begin_step=True).decode(
        [f"r{i}" for i in range(n)], [token] * n).request)


def test_other_pools_run_between_slices_and_the_same_pool_waits() -> None:
    state = state_with_pools()
    gate = PoolGate()
    order: list[str] = []

    async def big() -> None:
        work = state.apply_in_slices(decode("big", N, 1), 8)
        next(work)
        await gate.finish(work, ["big"])
        order.append("big done")

    def big_progress() -> int:
        """Tokens of the big pool's last request: 17 once the big Step is applied."""
        return state.registry.get("big").pool.request_info(f"r{N - 1}").num_tokens

    async def other(pool: str) -> None:
        await asyncio.sleep(0)  # the big call has started and yielded
        await gate.wait_idle([pool])
        order.append(f"{pool} ran, big at {big_progress()}")
        state.apply(decode(pool, 4, 2))

    async def main() -> None:
        await asyncio.gather(big(), other("small"), other("big"))

    asyncio.run(main())
    # The small pool's call ran between the slices; the big pool's waited for the end.
    assert order == ["small ran, big at 16", "big ran, big at 17", "big done"]
    # The sliced Step ended exactly as a one-piece Step would.
    reference = state_with_pools()
    reference.apply(decode("big", N, 1))
    reference.apply(decode("big", 4, 2))
    for rid in (f"r{i}" for i in range(N)):
        assert (reference.registry.get("big").pool.block_ids(rid)
                == state.registry.get("big").pool.block_ids(rid))
    assert (convert.stats_to_proto(reference.registry.get("big").pool.stats(), 0)
            == convert.stats_to_proto(state.registry.get("big").pool.stats(), 0))


def test_a_cancelled_caller_does_not_stop_its_sliced_step() -> None:
    state = state_with_pools()
    gate = PoolGate()

    async def main() -> None:
        work = state.apply_in_slices(decode("big", N, 1), 8)
        next(work)
        task = asyncio.ensure_future(gate.finish(work, ["big"]))
        await asyncio.sleep(0)
        task.cancel()
        await gate.wait_idle(["big"])  # returns only once the Step is fully applied

    asyncio.run(main())
    pool = state.registry.get("big").pool
    assert all(pool.request_info(f"r{i}").num_tokens == 17 for i in range(N))
