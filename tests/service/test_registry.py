"""The pool registry: idempotent registration and the first-difference rule."""

from __future__ import annotations

import dataclasses
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service.core.errors import AlreadyExists, NotFound, ResourceExhausted
from cache_service.core.pool import PoolOptions
from cache_service.core.specs import FullAttentionSpec, SlidingWindowSpec
from cache_service.registry import PoolDescription, PoolRegistry, first_difference


def description(**changes) -> PoolDescription:
    layers = (("f", FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8)),
              ("s", SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=8,
                                      sliding_window=64)))
    base = PoolDescription(layers, PoolOptions(max_model_len=512), num_blocks=256)
    return dataclasses.replace(base, **changes)


# (protocol path, how to change it), in the order first_difference compares fields:
# layer count, then per layer name, kind, spec fields; the budget; options; hybrid.
CHANGES = [
    ("layers", lambda d: dataclasses.replace(d, layers=d.layers[:1])),
    ("layers[0].name", lambda d: dataclasses.replace(d, layers=(("g", d.layers[0][1]),
                                                                d.layers[1]))),
    ("layers[0].head_size", lambda d: dataclasses.replace(d, layers=(
        (d.layers[0][0], dataclasses.replace(d.layers[0][1], head_size=16)), d.layers[1]))),
    ("layers[1].kind", lambda d: dataclasses.replace(d, layers=(
        d.layers[0], ("s", FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8,
                                             sliding_window=64))))),
    ("layers[1].sliding_window", lambda d: dataclasses.replace(d, layers=(
        d.layers[0], ("s", dataclasses.replace(d.layers[1][1], sliding_window=128))))),
    ("num_blocks", lambda d: dataclasses.replace(d, num_blocks=300)),
    ("options.hash_algo", lambda d: dataclasses.replace(
        d, options=dataclasses.replace(d.options, hash_algo="sha256_cbor"))),
    ("options.watermark", lambda d: dataclasses.replace(
        d, options=dataclasses.replace(d.options, watermark=0.1))),
    ("options.hybrid", lambda d: dataclasses.replace(d, hybrid=False)),
]


@settings(max_examples=40, deadline=None)
@given(st.sets(st.integers(0, len(CHANGES) - 1), min_size=1, max_size=4))
def test_the_first_differing_field_is_named(indices: set[int]) -> None:
    old = description()
    new = old
    for i in sorted(indices, reverse=True):  # dropping a layer last keeps indices valid
        new = CHANGES[i][1](new)
    assert first_difference(old, old) is None
    assert first_difference(old, new) == CHANGES[min(indices)][0]


def test_registration_is_idempotent_and_pools_are_isolated() -> None:
    registry = PoolRegistry(event_buffer=8)
    a, created = registry.register("a", description())
    assert created
    again, created = registry.register("a", description())
    assert again is a and not created
    with pytest.raises(AlreadyExists) as err:
        registry.register("a", description(num_blocks=300))
    assert err.value.field == "num_blocks"
    b, _ = registry.register("b", description())
    a.pool.add_request("r", [1, 2, 3])
    assert b.pool.request_ids() == [] and a.pool.request_ids() == ["r"]
    assert registry.delete("a") == 1
    with pytest.raises(NotFound):
        registry.get("a")
    assert [e.pool_id for e in registry] == ["b"]


def test_the_block_budget_admits_pools_until_spent_and_deletion_returns_it() -> None:
    registry = PoolRegistry(event_buffer=8, max_total_blocks=700)
    registry.register("a", description())
    registry.register("b", description(num_blocks=300))
    with pytest.raises(ResourceExhausted) as err:
        registry.register("c", description(num_blocks=145))
    assert err.value.field == "num_blocks" and "144 of 700 left" in str(err.value)
    with pytest.raises(ResourceExhausted) as err:
        registry.register("c", description(num_blocks=None, available_memory_bytes=1 << 30))
    assert err.value.field == "available_memory_bytes"
    assert [e.pool_id for e in registry] == ["a", "b"] and registry.total_blocks == 556
    registry.register("a", description())  # re-registering the same pool costs nothing
    registry.register("c", description(num_blocks=144))
    registry.delete("b")
    assert registry.total_blocks == 400
    registry.register("d", description(num_blocks=300))


def test_a_pool_of_two_billion_blocks_is_built_in_constant_memory() -> None:
    registry = PoolRegistry(event_buffer=8, max_total_blocks=2**31)
    tracemalloc.start()
    try:
        entry, _ = registry.register("big", description(num_blocks=2**31))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"registering cost {peak} bytes"
    entry.pool.add_request("r", list(range(64)))
    assert entry.pool.allocate("r", 64).ok and entry.pool.num_free_blocks == 2**31 - 1 - 8
