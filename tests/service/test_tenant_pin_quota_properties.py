"""The per-tenant pinned-block quota under random records on ``ServiceState`` (no server):
after every record each tenant's pins over all its pools are charged at most its
``max_pinned_blocks``, no pinned block is free, a refused pin changes nothing (pins, leases,
free queues), and a replay of the accepted records gives the same pins."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service.client import ops, register_request
from cache_service.core.errors import KVCacheError, ResourceExhausted
from cache_service.pins import tenant_pinned_blocks
from cache_service.registry import PoolRegistry
from cache_service.state import ServiceState, WalRecord
from kvcache_common.api.kvcache.internal.v1 import wal_pb2
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb

from .builders import Recorder, full_layers

QUOTAS = {"a": 10, "b": 6}
POOLS = {"a": ("a/p1", "a/p2"), "b": ("b/p1",)}
ALL_POOLS = [p for pools in POOLS.values() for p in pools]
LENGTHS = (9, 17, 33)  # prompts of 2, 4 and 8 blocks of 4 that can hit


def _tenant(pool_id: str) -> wal_pb2.TenantContext:
    name = pool_id.split("/")[0]
    return wal_pb2.TenantContext(name=name, max_pinned_blocks=QUOTAS[name])


def _prompt(family: int, length: int) -> list[int]:
    return [family * 1000 + i for i in range(length)]


# One random record: (kind, pool index, prompt family, prompt length index, flag)
RECORDS = st.lists(st.tuples(st.sampled_from(["pin", "pin", "drop", "run", "flood"]),
                             st.integers(0, len(ALL_POOLS) - 1), st.integers(0, 3),
                             st.integers(0, len(LENGTHS) - 1), st.booleans()),
                   max_size=40)


def _view(state: ServiceState) -> Any:
    out = []
    for pool_id in ALL_POOLS:
        pool = state.registry.get(pool_id).pool
        queue = pool.manager.pool.free_block_queue
        out.append((pool.pins(), [b.block_id for b in queue.get_all_free_blocks()]))
    leases = {p: {k: (v.session_id, v.expires_at) for k, v in pins.items()}
              for p, pins in state.pin_leases.items()}
    return out, leases


@settings(max_examples=60, deadline=None)
@given(RECORDS)
def test_tenant_quotas_hold_and_refusals_change_nothing(records: list[tuple]) -> None:
    state = ServiceState(PoolRegistry(), durability=Recorder())
    for pool_id in ALL_POOLS:
        state.apply(WalRecord(tenant=_tenant(pool_id), register_pool=register_request(
            pool_id, full_layers(block_size=4), num_blocks=48, max_model_len=64)))
    live: list[tuple[str, str]] = []
    for counter, (kind, pool_index, family, length, flag) in enumerate(records, 1):
        pool_id = ALL_POOLS[pool_index]
        tokens = _prompt(family, LENGTHS[length])
        if kind == "pin":
            pin_id = f"pin{counter}"
            record = WalRecord(tenant=_tenant(pool_id), pin_prefix=wal_pb2.PinPrefix(
                request=pb.PinPrefixRequest(pool_id=pool_id, pin_id=pin_id,
                                            token_ids=tokens, ttl_seconds=60),
                expires_at=1000.0 + counter))
        elif kind == "drop" and live:
            pool_id, pin_id = live[pool_index % len(live)]
            record = WalRecord(tenant=_tenant(pool_id), drop_pin=pb.DropPinRequest(
                pool_id=pool_id, pin_id=pin_id))
        else:
            kind = "run" if kind == "drop" else kind
            rid = f"r{counter}"
            prompt = tokens if kind == "run" else [9_000_000 + counter] * 60
            record = WalRecord(tenant=_tenant(pool_id), step=pb.StepRequest(
                pool_id=pool_id, ops=[ops.add(rid, prompt), ops.lookup(rid),
                                      ops.allocate(rid, len(prompt))]))
        before = _view(state)
        try:
            state.apply(record)
        except ResourceExhausted as exc:
            assert kind == "pin" and exc.field == "token_ids"
            assert _view(state) == before, "a refused pin changed state"
        except KVCacheError:
            # e.g. a pin on a prefix the pool cannot hold: refused, nothing changed
            assert _view(state) == before
        else:
            if kind == "pin":
                live.append((pool_id, record.pin_prefix.request.pin_id))
            elif kind == "drop":
                live.remove((pool_id, record.drop_pin.pin_id))
        if kind in ("run", "flood") and record.HasField("step"):
            rid = record.step.ops[0].add_request.request_id
            if state.registry.get(pool_id).pool.has_request(rid):
                state.apply(WalRecord(tenant=_tenant(pool_id), step=pb.StepRequest(
                    pool_id=pool_id, ops=[pb.Op(free=pb.FreeOp(request_id=rid,
                                                               evict_first=flag))])))
        for tenant, quota in QUOTAS.items():
            assert tenant_pinned_blocks(state, tenant) <= quota
        for pool_id in ALL_POOLS:
            state.registry.get(pool_id).pool.check_invariants()
    replayed = ServiceState(PoolRegistry())
    for record in state.durability.records:  # type: ignore[attr-defined]
        replayed.apply(record)
    assert _view(replayed) == _view(state)
