"""Placement and redirects on a real etcd with three replica processes."""

from __future__ import annotations

from collections import Counter

import grpc
import pytest

from cache_service.client import AllocateResult, CacheClient, CacheError, ops
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.launch import ServerProcess
from tests.cluster.conftest import Cluster, owner_of, raw_stub, small_layers, wait_until
from tests.metrics_text import scrape, values

pytestmark = pytest.mark.cluster


def register(client: CacheClient, pool_id: str):
    return client.register_pool(pool_id, small_layers(), num_blocks=64, max_model_len=256)


def test_pools_spread_and_a_client_of_one_replica_works_against_the_owners(three: Cluster):
    entry = three.replicas[0]
    with CacheClient(entry.target) as client:
        infos = [register(client, f"p{i}") for i in range(12)]
        assert all(info.created for info in infos)
        owners = {f"p{i}": owner_of(three, f"p{i}") for i in range(12)}
        # Rendezvous hashing over three members: 12 pools never all land on one.
        assert len(set(owners.values())) >= 2, Counter(owners.values())
        for i in range(12):
            pid = f"p{i}"
            prompt = list(range(1 + i, 40 + i))
            step = client.step(pid, [ops.add("r", prompt), ops.lookup("r"),
                                     ops.allocate("r", len(prompt))], begin_step=True)
            alloc = step.results[2]
            assert isinstance(alloc, AllocateResult) and alloc.ok
            # The state lives on the owner: its own GetRequest sees the request.
            got = raw_stub(owners[pid]).GetRequest(
                pb.GetRequestRequest(pool_id=pid, request_id="r"), timeout=5)
            assert got.num_tokens == len(prompt)
        # Registering again through another replica answers the same pool, not a new one.
        with CacheClient(three.replicas[1].target) as other:
            again = register(other, "p3")
            assert not again.created
            assert other.get_request("p3", "r").num_tokens == 39 + 0


def test_a_non_owner_redirects_with_the_owner_in_trailing_metadata(three: Cluster):
    with CacheClient(three.replicas[0].target) as client:
        register(client, "moved")
    owner = owner_of(three, "moved")
    other = next(r for r in three.replicas if r.target != owner)
    with pytest.raises(grpc.RpcError) as info:
        raw_stub(other.target).Step(pb.StepRequest(pool_id="moved", ops=[
            ops.add("x", [1, 2, 3])]), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert dict(info.value.trailing_metadata())["x-kvcache-owner"] == owner
    assert "owned by replica" in info.value.details()
    # The redirected Step was not applied anywhere.
    with pytest.raises(grpc.RpcError) as missing:
        raw_stub(owner).GetRequest(pb.GetRequestRequest(pool_id="moved", request_id="x"),
                                   timeout=5)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND


def _started(replica: ServerProcess, method: str) -> float:
    """``grpc_server_started_total`` of ``method`` on ``replica`` (its metrics endpoint)."""
    return sum(values(scrape(replica.metrics_port), "grpc_server_started_total",
                      grpc_method=method))


def test_a_redirect_is_answered_once_not_retried_by_the_clients_grpc(cluster: Cluster):
    """The client's gRPC retries UNAVAILABLE (4 times here); a redirect tells it not to
    (a negative retry pushback), so the non-owner sees the call once and the client asks
    the owner at once."""
    for _ in range(3):
        cluster.start_replica("--metrics-port", "0")
    with CacheClient(cluster.replicas[0].target) as client:
        register(client, "once")
    owner = owner_of(cluster, "once")
    other = next(r for r in cluster.replicas if r.target != owner)
    before = _started(other, "GetPool")
    with CacheClient(other.target, max_retries=4) as client:
        assert client.get_pool("once").pool_id == "once"
    assert _started(other, "GetPool") - before == 1


def test_a_bad_registration_is_rejected_and_stores_nothing(three: Cluster):
    with CacheClient(three.replicas[0].target) as client:
        with pytest.raises(CacheError) as info:
            client.register_pool("bad", small_layers(), num_blocks=64, max_model_len=0)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        # Nothing was placed: no replica knows the pool.
        for replica in three.replicas:
            with pytest.raises(grpc.RpcError) as missing:
                raw_stub(replica.target).GetPool(pb.GetPoolRequest(pool_id="bad"), timeout=5)
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_registration_the_owner_refuses_leaves_nothing_in_etcd(cluster: Cluster):
    """Beyond the owner's block budget (checked only there): RESOURCE_EXHAUSTED naming the
    field, and the placement is undone, so the pool is unknown everywhere."""
    for _ in range(3):
        cluster.start_replica("--max-total-blocks", "100")
    with CacheClient(",".join(r.target for r in cluster.replicas)) as client:
        with pytest.raises(CacheError) as info:
            client.register_pool("huge", small_layers(), num_blocks=101, max_model_len=256)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert info.value.field == "num_blocks"

    def all_unknown() -> bool:
        codes = []
        for replica in cluster.replicas:
            with pytest.raises(grpc.RpcError) as missing:
                raw_stub(replica.target).GetPool(pb.GetPoolRequest(pool_id="huge"), timeout=5)
            codes.append(missing.value.code())
        return codes == [grpc.StatusCode.NOT_FOUND] * len(codes)

    # The other replicas learn of the undone placement through their etcd watch (a redirect
    # to the refusing owner until then, milliseconds later; longer on a loaded machine).
    wait_until(all_unknown, 10, "every replica forgetting the pool")


def test_step_streams_and_peek_prefix_span_replicas(three: Cluster):
    prompt = list(range(100, 165))  # 4 full blocks of 16 + 1 (a hit never covers the last token)
    with CacheClient(three.replicas[0].target) as client:
        for i in range(6):
            register(client, f"s{i}")
        assert len({owner_of(three, f"s{i}") for i in range(6)}) >= 2
        with client.step_stream() as stream:
            for i in range(6):
                r = stream.step(f"s{i}", [ops.add("r", prompt), ops.lookup("r"),
                                          ops.allocate("r", len(prompt))], begin_step=True)
                alloc = r.results[2]
                assert isinstance(alloc, AllocateResult) and alloc.ok
        # One PeekPrefix on one replica answers for pools on all three.
        hits = client.peek_prefix([f"s{i}" for i in range(6)] , prompt)
        assert hits == {f"s{i}": 64 for i in range(6)}, hits
    # The same through a raw stub on each replica (the fan-out is server-side).
    for replica in three.replicas:
        answer = raw_stub(replica.target).PeekPrefix(pb.PeekPrefixRequest(
            pool_ids=[f"s{i}" for i in range(6)], token_ids=prompt), timeout=5)
        assert [(h.pool_id, h.hit_tokens) for h in answer.hits] == [
            (f"s{i}", 64) for i in range(6)]


def test_delete_removes_the_pool_from_the_cluster(three: Cluster):
    with CacheClient(three.replicas[2].target) as client:
        register(client, "gone")
        client.step("gone", [ops.add("r", [1, 2, 3])])
        assert client.delete_pool("gone") == 1
    for replica in three.replicas:
        with pytest.raises(grpc.RpcError) as missing:
            raw_stub(replica.target).GetPool(pb.GetPoolRequest(pool_id="gone"), timeout=5)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
