"""The routing index stays exact through every way the service state changes.

A stateful property test drives one ``ServiceState`` (no processes) with records as the
servicer, the lease reaper and recovery make them: pools of three tenants registered and
deleted, prefills and frees inside and outside sessions, lease expiries in chunks
(``ExpireSession``), session closes, resets; and it restarts the state the two ways a
server restarts: from a snapshot (pickled as ``snapshot.write_snapshot`` pickles it, so the
index is left out and rebuilt) and by replaying every accepted record into a fresh state
(WAL recovery). After every step the index's hash maps equal maps rebuilt from the pools,
no key space mixes tenants, and ``PeekPrefix`` through the servicer answers, for every
tenant, exactly what each of its pools' own lookup answers.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from cache_service.client import StepBuilder, layers
from cache_service.client._builders import register_request
from cache_service.core.errors import KVCacheError, NotFound
from cache_service.registry import PoolRegistry
from cache_service.servicer import CacheServicer
from cache_service.snapshot import _StatePickler
from cache_service.state import ServiceState, WalRecord
from cache_service.tenants import ANONYMOUS, Namespace, Tenant, tenant_of
from kvcache_common.api.kvcache.internal.v1 import wal_pb2
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb

MAX_LEN = 64
TENANTS = {"default": ANONYMOUS, "a": Tenant("a"), "b": Tenant("b")}
LAYOUTS: dict[str, dict[str, Any]] = {
    "full": dict(layers=[layers.full_attention("f", block_size=4, num_kv_heads=1,
                                               head_size=4)]),
    "full_swa": dict(layers=[
        layers.full_attention("f", block_size=4, num_kv_heads=1, head_size=4),
        layers.sliding_window("s", block_size=4, num_kv_heads=1, head_size=4,
                              sliding_window=8)]),
    "full8": dict(layers=[layers.full_attention("f", block_size=8, num_kv_heads=1,
                                                head_size=4)]),
    "cbor": dict(layers=[layers.full_attention("f", block_size=4, num_kv_heads=1,
                                               head_size=4)], hash_algo="sha256_cbor"),
}
# Every tenant sends the same prefixes: equal hashes must still never cross tenants.
PREFIXES = [[7] * 12, list(range(1, 17)), [3, 1] * 10]


def internal_id(tenant: str, pool: str) -> str:
    return Namespace(TENANTS[tenant]).inner(pool) or ""


class RoutingMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.state = ServiceState(PoolRegistry(64, instance_id="i"), lease_ttl_seconds=5.0)
        self.applied: list[bytes] = []  # the WAL: every accepted record, serialized
        self.pools: dict[str, str] = {}  # internal id -> layout
        self.sessions: dict[str, tuple[str, int]] = {}  # id -> (tenant, last sequence)
        self.n = 0
        self.prompts = [p + [0] for p in PREFIXES]

    # -- the one way in: records -----------------------------------------------------
    def apply(self, record: WalRecord) -> Any:
        try:
            response = self.state.apply(record)
        except KVCacheError:
            return None  # rejected whole: nothing changed, nothing logged
        self.applied.append(record.SerializeToString())
        return response

    def apply_as(self, tenant: str, **record: Any) -> Any:
        """:meth:`apply` of the record with ``record``'s fields, under ``tenant``'s context."""
        return self.apply(WalRecord(**record, tenant=wal_pb2.TenantContext(name=tenant)))

    def _draw_pool(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(sorted(self.pools)))

    def _requests(self) -> list[tuple[str, str]]:
        return [(e.pool_id, rid) for e in self.state.registry for rid in e.pool.request_ids()]

    # -- rules -----------------------------------------------------------------------
    @precondition(lambda self: len(self.pools) < 6)
    @rule(tenant=st.sampled_from(sorted(TENANTS)), layout=st.sampled_from(sorted(LAYOUTS)))
    def register(self, tenant: str, layout: str) -> None:
        pool_id = internal_id(tenant, f"p{self.n}")
        self.n += 1
        spec = LAYOUTS[layout]
        request = register_request(pool_id, spec["layers"], num_blocks=40,
                                   max_model_len=MAX_LEN,
                                   hash_algo=spec.get("hash_algo", "sha256"))
        # Small (prefills evict), but valid: a rejected registration would test nothing.
        assert self.apply_as(tenant, register_pool=request)
        self.pools[pool_id] = layout

    @precondition(lambda self: self.pools)
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        pool_id = self._draw_pool(data)
        self.apply_as(tenant_of(pool_id), delete_pool=pb.DeletePoolRequest(pool_id=pool_id))
        del self.pools[pool_id]

    @precondition(lambda self: self.pools)
    @rule(data=st.data(), prefix=st.sampled_from(PREFIXES),
          suffix=st.lists(st.integers(0, 9), min_size=1, max_size=30), keep=st.booleans(),
          in_session=st.booleans())
    def prefill(self, data: st.DataObject, prefix: list[int], suffix: list[int], keep: bool,
                in_session: bool) -> None:
        pool_id = self._draw_pool(data)
        tenant = tenant_of(pool_id)
        tokens = (prefix + suffix)[:MAX_LEN - 4]
        self.prompts = (self.prompts + [tokens])[-6:]
        rid = f"r{self.n}"
        self.n += 1
        batch = StepBuilder(pool_id, begin_step=True)
        batch.add(rid, tokens).lookup(rid).allocate(rid, len(tokens), use_lookup=True)
        if not keep:
            batch.free(rid)
        request = batch.request
        mine = sorted(s for s, (t, _) in self.sessions.items() if t == tenant)
        if in_session and mine:
            sid = data.draw(st.sampled_from(mine))
            seq = self.sessions[sid][1] + 1
            request.session_id, request.sequence = sid, seq
            if self.apply_as(tenant, step=request):
                self.sessions[sid] = (tenant, seq)
        else:
            self.apply_as(tenant, step=request)

    @precondition(lambda self: self._requests())
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        pool_id, rid = data.draw(st.sampled_from(self._requests()))
        self.apply_as(tenant_of(pool_id), step=StepBuilder(pool_id).free(rid).request)

    @rule(tenant=st.sampled_from(sorted(TENANTS)))
    def open_session(self, tenant: str) -> None:
        sid = f"s{self.n}"
        self.n += 1
        if self.apply_as(tenant, open_session=wal_pb2.OpenSession(session_id=sid)):
            self.sessions[sid] = (tenant, 0)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), chunk=st.integers(1, 2))
    def lease_expires(self, data: st.DataObject, chunk: int) -> None:
        """The reaper's records: chunks of at most ``chunk`` requests until none is left."""
        sid = data.draw(st.sampled_from(sorted(self.sessions)))
        del self.sessions[sid]
        while True:
            result = self.apply(WalRecord(expire_session=wal_pb2.ExpireSession(
                session_id=sid, max_requests=chunk)))
            if result is None or not result.num_requests_left:
                break

    @precondition(lambda self: self.sessions)
    @rule(data=st.data())
    def close_session(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.sessions)))
        tenant, _ = self.sessions.pop(sid)
        self.apply_as(tenant, close_session=pb.CloseSessionRequest(session_id=sid))

    @precondition(lambda self: self.pools)
    @rule(data=st.data())
    def reset(self, data: st.DataObject) -> None:
        pool_id = self._draw_pool(data)
        self.apply_as(tenant_of(pool_id),
                      reset_prefix_cache=pb.ResetPrefixCacheRequest(pool_id=pool_id))

    @rule()
    def restart_from_snapshot(self) -> None:
        buffer = io.BytesIO()
        _StatePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(self.state)
        assert b"index_map" not in buffer.getvalue()  # derived state is not written
        self.state = pickle.loads(buffer.getvalue())

    @rule()
    def restart_by_replaying_the_log(self) -> None:
        fresh = ServiceState(PoolRegistry(64, instance_id="i"), lease_ttl_seconds=5.0)
        for payload in self.applied:
            fresh.apply(WalRecord.FromString(payload))
        self.state = fresh

    # -- what must hold after every step ------------------------------------------------
    @invariant()
    def index_is_exact_and_per_tenant(self) -> None:
        index = self.state.registry.index
        spaces = index._spaces
        rebuilt: dict[Any, dict[bytes, int]] = {}
        for entry in self.state.registry:
            space = index.keyspace(entry.pool_id)
            assert space.tenant == tenant_of(entry.pool_id)
            m = rebuilt.setdefault(space, {})
            for gid, bit in enumerate(entry.pool.prefix_log.bits):
                for h in entry.pool.manager.pool.group_map(gid):
                    m[h] = m.get(h, 0) | bit
        assert {s: dict(v.map) for s, v in spaces.items() if v.map} == \
            {s: m for s, m in rebuilt.items() if m}

    @invariant()
    def peek_prefix_answers_what_each_pool_answers(self) -> None:
        servicer = CacheServicer(self.state)
        for name, tenant in TENANTS.items():
            ns = Namespace(tenant)
            mine = [e for e in self.state.registry if tenant_of(e.pool_id) == name]
            if not mine:
                continue
            for prompt in self.prompts:
                response = servicer.peek_prefix(pb.PeekPrefixRequest(
                    pool_ids=[ns.outer(e.pool_id) for e in mine], token_ids=prompt),
                    tenant)
                got = [(h.pool_id, h.hit_tokens, [g.tokens for g in h.groups])
                       for h in response.hits]
                want = []
                for e in mine:
                    r = e.pool.prefix_residency(prompt)
                    want.append((ns.outer(e.pool_id), r.hit_tokens,
                                 [g.tokens for g in r.groups]))
                assert got == want, (name, prompt)
            # Another tenant's pools do not exist for this one, whatever id it tries.
            for other in self.state.registry:
                if tenant_of(other.pool_id) != name:
                    for pid in (other.pool_id, Namespace(TENANTS[tenant_of(
                            other.pool_id)]).outer(other.pool_id)):
                        if ns.inner(pid) in self.pools:
                            continue  # the same short id names one of its own pools
                        with pytest.raises(NotFound):
                            servicer.peek_prefix(pb.PeekPrefixRequest(
                                pool_ids=[pid], token_ids=self.prompts[0]), tenant)


def test_index_stays_exact_through_every_mutation_path() -> None:
    run_state_machine_as_test(RoutingMachine, settings=settings(
        max_examples=40, stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))
