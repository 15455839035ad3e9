"""``PoolOptions.use_eagle`` over the protocol: absent = off, the pool's hits drop their
last block with it, and a restart (write-ahead log replay, snapshot) keeps it
(docs/semantics.md#eagle)."""

from __future__ import annotations

import pytest

from cache_service import convert
from cache_service.client import layers, ops, register_request
from cache_service.core.errors import KVCacheError
from cache_service.state import ServiceState, WalRecord
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb

from .builders import fresh_state, replayed_pool, snapshot_copy

PROMPT = [(7 * i + 3) % 1000 for i in range(64)]


def register(use_eagle: bool, pool: str = "p") -> WalRecord:
    full = [layers.full_attention("attn", block_size=16, num_kv_heads=1, head_size=1,
                                  dtype="float32")]
    return WalRecord(register_pool=register_request(
        pool, full, num_blocks=128, max_model_len=1024, use_eagle=use_eagle))


def prefill_then_resend(state: ServiceState, pool: str = "p") -> int:
    """Prefill PROMPT (4 blocks), then the hit of the same prompt sent again: 48 tokens
    (capped one short of the prompt) without EAGLE, 32 with it (the last hit block is
    given up for the drafter)."""
    state.apply(WalRecord(step=pb.StepRequest(pool_id=pool, begin_step=True, ops=[
        ops.add("a", PROMPT), ops.allocate("a", len(PROMPT))])))
    state.apply(WalRecord(step=pb.StepRequest(pool_id=pool, begin_step=True, ops=[
        ops.add("b", PROMPT)])))
    return state.registry.get(pool).pool.lookup("b").hit_tokens


@pytest.mark.parametrize(("use_eagle", "hit"), [(False, 48), (True, 32)])
def test_the_option_reaches_the_pool_and_survives_log_replay_and_snapshot(
        use_eagle: bool, hit: int) -> None:
    state, log = fresh_state()
    state.apply(register(use_eagle))
    entry = state.registry.get("p")
    assert entry.pool.options.use_eagle is use_eagle
    echoed = convert.options_to_proto(entry.pool.options, True)
    assert echoed.use_eagle is use_eagle
    assert convert.options_from_proto(echoed)[0] == entry.pool.options
    assert prefill_then_resend(state) == hit
    again = replayed_pool(log.records)
    assert again.options.use_eagle is use_eagle
    assert again.lookup("b").hit_tokens == hit
    restored = snapshot_copy(entry.pool)
    restored.add_request("z", PROMPT)
    assert restored.lookup("z").hit_tokens == hit


def test_absent_is_off() -> None:
    assert convert.options_from_proto(pb.PoolOptions(max_model_len=64))[0].use_eagle is False


def test_reopening_with_another_setting_names_the_difference() -> None:
    state, _ = fresh_state()
    state.apply(register(True))
    with pytest.raises(KVCacheError) as e:
        state.apply(register(False))
    assert e.value.field == "options.use_eagle"
