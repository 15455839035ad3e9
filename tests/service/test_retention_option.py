"""``PoolOptions.prefix_cache_retention_interval`` over the protocol: absent = dense (what
clients written before the field get), 0 and N are kept exactly, the pool decides with
them, and a restart (write-ahead log replay, snapshot) keeps them
(docs/semantics.md#checkpoint-retention)."""

from __future__ import annotations

import pytest

from cache_service import convert
from cache_service.client import layers, ops, register_request
from cache_service.core.errors import KVCacheError
from cache_service.state import ServiceState, WalRecord
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb

from .builders import fresh_state, replayed_pool, snapshot_copy

PROMPT = [(7 * i + 3) % 1000 for i in range(200)]


def hybrid_layers() -> list[pb.LayerSpec]:
    return [layers.full_attention("attn", block_size=16, num_kv_heads=1, head_size=1,
                                  dtype="float32"),
            layers.mamba("ssm", block_size=16, shapes=[[4]], dtypes=["float32"],
                         mamba_cache_mode="align")]


def register(retention: int | None, pool: str = "p") -> WalRecord:
    return WalRecord(register_pool=register_request(
        pool, hybrid_layers(), num_blocks=256, max_model_len=1024,
        prefix_cache_retention_interval=retention))


def prefill_and_probe(state: ServiceState, pool: str = "p") -> int:
    """Prefill PROMPT[:200] in vLLM-style chunks, then the hit of a request sharing 150
    tokens: 128 with dense Mamba checkpoints, 0 with sparse ones."""
    done = 0
    for i, end in enumerate((64, 128, 192, 200)):
        op_list = [ops.add("a", PROMPT[:200])] if i == 0 else []
        op_list.append(ops.allocate("a", end - done))
        state.apply(WalRecord(step=pb.StepRequest(pool_id=pool, begin_step=True, ops=op_list)))
        done = end
    return state.registry.get(pool).pool.peek_prefix(PROMPT[:150] + [999] * 10)


@pytest.mark.parametrize(("retention", "hit"), [(None, 128), (0, 0), (128, 128)])
def test_the_option_reaches_the_pool_and_survives_log_replay_and_snapshot(
        retention: int | None, hit: int) -> None:
    state, log = fresh_state()
    state.apply(register(retention))
    entry = state.registry.get("p")
    assert entry.pool.options.prefix_cache_retention_interval == retention
    echoed = convert.options_to_proto(entry.pool.options, True)
    assert echoed.HasField("prefix_cache_retention_interval") == (retention is not None)
    assert convert.options_from_proto(echoed)[0] == entry.pool.options
    assert prefill_and_probe(state) == hit
    # Recovery replays the logged records: the same option, the same decisions.
    again = replayed_pool(log.records)
    assert again.options.prefix_cache_retention_interval == retention
    assert again.peek_prefix(PROMPT[:150] + [999] * 10) == hit
    # A snapshot pickles the pools whole.
    restored = snapshot_copy(entry.pool)
    restored.add_request("z", PROMPT[:150] + [999] * 10)
    assert restored.lookup("z").hit_tokens == hit


def test_absent_is_dense_and_zero_is_kept() -> None:
    opts = pb.PoolOptions(max_model_len=64)
    assert convert.options_from_proto(opts)[0].prefix_cache_retention_interval is None
    opts.prefix_cache_retention_interval = 0
    assert convert.options_from_proto(opts)[0].prefix_cache_retention_interval == 0


def test_an_interval_the_pool_cannot_use_is_refused_and_registers_nothing() -> None:
    state, log = fresh_state()
    with pytest.raises(KVCacheError) as e:
        state.apply(register(24))  # not a multiple of the scheduler block size 16
    assert e.value.field == "options.prefix_cache_retention_interval"
    assert "multiple of scheduler_block_size" in str(e.value)
    assert log.records == []
    with pytest.raises(KVCacheError):
        state.registry.get("p")


def test_reopening_with_another_setting_names_the_difference() -> None:
    state, _ = fresh_state()
    state.apply(register(0))
    with pytest.raises(KVCacheError) as e:
        state.apply(register(None))
    assert e.value.field == "options.prefix_cache_retention_interval"
