"""Tenancy against a real server with a tenants file: tenant B calls every RPC on tenant A's
pool, request, session and event feed and gets NOT_FOUND (exactly as for names that do not
exist), A's state does not change, each tenant lists only its own pools, an admin tenant sees
all, and per-tenant limits on pools and blocks hold."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from cache_service.client import layers, ops, register_request
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.api.kvcache.v1 import cache_service_pb2_grpc as pb_grpc
from kvcache_common.launch import start_cache_service

TOKENS = {"a": "tok-a", "b": "tok-b", "ops": "tok-ops", "small": "tok-small"}
TENANTS_FILE = """\
# token    tenant   options
tok-a      a
tok-b      b
tok-ops    ops      admin
tok-small  small    max_pools=1 max_blocks=100
"""
NOT_FOUND = grpc.StatusCode.NOT_FOUND


class Caller:
    """The raw stub with one tenant's token on every call."""

    def __init__(self, channel: grpc.Channel, tenant: str) -> None:
        self.stub = pb_grpc.CacheServiceStub(channel)
        self.metadata = (("authorization", f"Bearer {TOKENS[tenant]}"),)

    def __getattr__(self, rpc: str) -> Callable:
        method = getattr(self.stub, rpc)
        return lambda request, **kw: method(request, metadata=self.metadata, timeout=20, **kw)


def register(pool_id: str, num_blocks: int = 64) -> pb.RegisterPoolRequest:
    return register_request(pool_id, [layers.full_attention("l", block_size=16,
                                                            num_kv_heads=1, head_size=8)],
                            num_blocks=num_blocks, max_model_len=256)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator:
    path: Path = tmp_path_factory.mktemp("tenants") / "tenants"
    path.write_text(TENANTS_FILE)
    with start_cache_service("--auth-tokens-file", str(path)) as srv:
        yield srv
    assert srv.returncode == 0, srv.output()


@pytest.fixture(scope="module")
def channel(server) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.target) as ch:
        yield ch


@pytest.fixture(scope="module")
def a_state(channel) -> dict:
    """Tenant A: pool "p" with a running request "r", a session, and events."""
    a = Caller(channel, "a")
    a.RegisterPool(register("p"))
    session = a.OpenSession(pb.OpenSessionRequest(client_name="a")).session_id
    a.Step(pb.StepRequest(pool_id="p", session_id=session, sequence=1, ops=[
        ops.add("r", list(range(40))), ops.allocate("r", 40)]))
    return {"session": session}


def snapshot(a: Caller) -> tuple:
    return (a.GetPoolStats(pb.GetPoolStatsRequest(pool_id="p")).stats.SerializeToString(),
            a.GetRequest(pb.GetRequestRequest(pool_id="p", request_id="r"))
            .SerializeToString(),
            [p.pool_id for p in a.ListPools(pb.ListPoolsRequest()).pools])


@dataclass
class Probe:
    name: str
    call: Callable[[Caller, str, str], object]  # (caller, pool id, A's session id)


def _first(stream) -> object:
    return next(iter(stream))


PROBES = [
    Probe("GetPool", lambda c, p, s: c.GetPool(pb.GetPoolRequest(pool_id=p))),
    Probe("DeletePool", lambda c, p, s: c.DeletePool(pb.DeletePoolRequest(pool_id=p))),
    Probe("Step", lambda c, p, s: c.Step(pb.StepRequest(pool_id=p, ops=[ops.free("r")]))),
    Probe("StepStream", lambda c, p, s: _first(c.StepStream(iter([
        pb.StepRequest(pool_id=p, ops=[ops.free("r")])])))),
    Probe("PeekPrefix", lambda c, p, s: c.PeekPrefix(pb.PeekPrefixRequest(
        pool_ids=[p], token_ids=list(range(40))))),
    Probe("PeekPrefix explain", lambda c, p, s: c.PeekPrefix(pb.PeekPrefixRequest(
        pool_ids=[p], token_ids=list(range(40)), explain=True))),
    Probe("GetPrefixSnapshot", lambda c, p, s: c.GetPrefixSnapshot(
        pb.GetPrefixSnapshotRequest(pool_id=p))),
    Probe("GetRequest", lambda c, p, s: c.GetRequest(pb.GetRequestRequest(pool_id=p,
                                                                          request_id="r"))),
    Probe("GetPoolStats", lambda c, p, s: c.GetPoolStats(pb.GetPoolStatsRequest(pool_id=p))),
    Probe("ResetPrefixCache", lambda c, p, s: c.ResetPrefixCache(
        pb.ResetPrefixCacheRequest(pool_id=p))),
    Probe("SubscribeEvents", lambda c, p, s: _first(c.SubscribeEvents(
        pb.SubscribeEventsRequest(pool_id=p, from_sequence=1)))),
    Probe("KeepAlive (A's session)", lambda c, p, s: c.KeepAlive(
        pb.KeepAliveRequest(session_id=s))),
    Probe("CloseSession (A's session)", lambda c, p, s: c.CloseSession(
        pb.CloseSessionRequest(session_id=s))),
    Probe("Step in A's session", lambda c, p, s: c.Step(pb.StepRequest(
        pool_id="own", session_id=s, sequence=2, ops=[ops.new_step()]))),
]


@pytest.mark.parametrize("probe", PROBES, ids=[p.name for p in PROBES])
@pytest.mark.parametrize("pool_id", ["p", "a/p", "nope"])
def test_another_tenants_pool_answers_exactly_like_one_that_does_not_exist(
        channel, a_state: dict, probe: Probe, pool_id: str) -> None:
    a, b = Caller(channel, "a"), Caller(channel, "b")
    b.RegisterPool(register("own"))  # B's own pool (for the session probe)
    before = snapshot(a)
    with pytest.raises(grpc.RpcError) as err:
        probe.call(b, pool_id, a_state["session"])
    assert err.value.code() == NOT_FOUND, err.value.details()
    assert pool_id == "a/p" or "a/" not in err.value.details()  # internal ids never shown
    if "A's session" in probe.name:
        assert "session" in err.value.details()
    else:
        assert err.value.details() == f"pool_id: unknown pool {pool_id!r}" or \
            err.value.details() == f"pool_ids[0]: unknown pool {pool_id!r}"
    assert snapshot(a) == before


def test_each_tenant_lists_only_its_pools_and_ids_are_per_tenant(channel, a_state) -> None:
    a, b, admin = Caller(channel, "a"), Caller(channel, "b"), Caller(channel, "ops")
    created = b.RegisterPool(register("p", num_blocks=32))  # same id, B's own namespace
    assert created.created and created.config.pool_id == "p"
    assert created.config.num_blocks == 32
    assert a.GetPool(pb.GetPoolRequest(pool_id="p")).config.num_blocks == 64
    assert "p" in [p.pool_id for p in b.ListPools(pb.ListPoolsRequest()).pools]
    assert all("/" not in p.pool_id for p in a.ListPools(pb.ListPoolsRequest()).pools)
    everything = [p.pool_id for p in admin.ListPools(pb.ListPoolsRequest()).pools]
    assert {"a/p", "b/p"} <= set(everything)
    # The admin acts on any pool by its qualified id.
    stats = admin.GetPoolStats(pb.GetPoolStatsRequest(pool_id="a/p")).stats
    assert stats.num_requests == 1
    hit = admin.PeekPrefix(pb.PeekPrefixRequest(pool_ids=["a/p"], token_ids=list(range(40))))
    assert hit.hits[0].pool_id == "a/p" and hit.hits[0].hit_tokens == 32
    assert b.DeletePool(pb.DeletePoolRequest(pool_id="p")).num_requests_dropped == 0
    assert a.GetPool(pb.GetPoolRequest(pool_id="p")).config.num_blocks == 64


def test_a_tenant_without_a_token_entry_is_unauthenticated(channel) -> None:
    stub = pb_grpc.CacheServiceStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        stub.ListPools(pb.ListPoolsRequest(), metadata=(("authorization", "Bearer nope"),),
                       timeout=20)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_per_tenant_limits_on_pools_and_blocks(channel) -> None:
    small = Caller(channel, "small")
    with pytest.raises(grpc.RpcError) as err:
        small.RegisterPool(register("big", num_blocks=101))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details().startswith("num_blocks:") and "max_blocks" in err.value.details()
    # Host-tier slots count against max_blocks too: 60 blocks + 41 slots of one group.
    tiered = register("tiered", num_blocks=60)
    tiered.options.host_tier_blocks = 41
    with pytest.raises(grpc.RpcError) as err:
        small.RegisterPool(tiered)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details().startswith("options.host_tier_blocks:")
    assert "41 host-tier slots" in err.value.details()
    assert small.ListPools(pb.ListPoolsRequest()).pools == []
    assert small.RegisterPool(register("one", num_blocks=100)).created
    assert not small.RegisterPool(register("one", num_blocks=100)).created  # idempotent
    with pytest.raises(grpc.RpcError) as err:
        small.RegisterPool(register("two", num_blocks=20))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details().startswith("pool_id:") and "max_pools" in err.value.details()
    assert [p.pool_id for p in small.ListPools(pb.ListPoolsRequest()).pools] == ["one"]
    small.DeletePool(pb.DeletePoolRequest(pool_id="one"))
    assert small.RegisterPool(register("two", num_blocks=20)).created
