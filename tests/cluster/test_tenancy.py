"""Tenancy in cluster mode: every replica reads the same tenants file; a redirect and a
PeekPrefix fan-out act for the caller's tenant (its token travels with them), and neither
reveals anything of another tenant's pools."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from cache_service.client import CacheClient, ops
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.redirect import owner_from_metadata
from tests.cluster.conftest import Cluster, owner_of, raw_stub, small_layers

pytestmark = pytest.mark.cluster

TOKENS = {"a": "tok-a", "b": "tok-b", "ops": "tok-ops"}
TENANTS_FILE = "tok-a a\ntok-b b\ntok-ops ops admin\n"
PROMPT = list(range(1, 66))
HIT = 64  # 4 full blocks of 16 (a prefix hit leaves at least the last token to compute)


def auth(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[tenant]}"),)


def peek(target: str, tenant: str, pool_ids: list[str]) -> dict[str, int]:
    answer = raw_stub(target).PeekPrefix(pb.PeekPrefixRequest(
        pool_ids=pool_ids, token_ids=PROMPT), timeout=10, metadata=auth(tenant))
    return {hit.pool_id: hit.hit_tokens for hit in answer.hits}


def test_redirects_and_fan_out_act_for_the_callers_tenant_only(cluster: Cluster,
                                                                tmp_path: Path):
    tenants = tmp_path / "tenants"
    tenants.write_text(TENANTS_FILE)
    for _ in range(3):
        cluster.start_replica("--auth-tokens-file", str(tenants))
    targets = ",".join(r.target for r in cluster.replicas)
    # Both tenants call their pool "p": two pools (a/p and b/p inside), placed independently.
    # No session: closing one would free the request the test reads later.
    with CacheClient(targets, token=TOKENS["a"], session=False) as a:
        a.register_pool("p", small_layers(), num_blocks=64, max_model_len=256)
        a.step("p", [ops.add("r", PROMPT), ops.allocate("r", len(PROMPT))], begin_step=True)
    with CacheClient(targets, token=TOKENS["b"]) as b:
        b.register_pool("p", small_layers(), num_blocks=64, max_model_len=256)
    owner_a = owner_of(cluster, "p", metadata=auth("a"))
    owner_b = owner_of(cluster, "p", metadata=auth("b"))
    elsewhere = next(r.target for r in cluster.replicas if r.target != owner_a)

    # A redirect names the owner of the caller's own pool, in the caller's words.
    with pytest.raises(grpc.RpcError) as moved:
        raw_stub(elsewhere).GetPool(pb.GetPoolRequest(pool_id="p"), timeout=10,
                                    metadata=auth("a"))
    assert moved.value.code() == grpc.StatusCode.UNAVAILABLE
    assert owner_from_metadata(moved.value.trailing_metadata()) == owner_a
    assert "a/p" not in (moved.value.details() or "")
    # The client follows it with its token: a client given only a non-owner works.
    with CacheClient(elsewhere, token=TOKENS["a"]) as a:
        assert a.get_request("p", "r").num_tokens == len(PROMPT)

    # PeekPrefix on a replica that does not own a/p: forwarded to the owner as tenant a.
    assert peek(elsewhere, "a", ["p"]) == {"p": HIT}
    # The same id for tenant b is b's pool (empty), wherever it lives.
    for replica in cluster.replicas:
        assert peek(replica.target, "b", ["p"]) == {"p": 0}
    # Tenant b cannot name a's pool: NOT_FOUND, answered without a lookup elsewhere and
    # without an owner in the trailers.
    for replica in cluster.replicas:
        with pytest.raises(grpc.RpcError) as hidden:
            peek(replica.target, "b", ["a/p"])
        assert hidden.value.code() == grpc.StatusCode.NOT_FOUND
        assert owner_from_metadata(hidden.value.trailing_metadata()) is None
    # No token, no answer: the fan-out never speaks for a caller the replica did not admit.
    with pytest.raises(grpc.RpcError) as anonymous:
        raw_stub(elsewhere).PeekPrefix(pb.PeekPrefixRequest(pool_ids=["p"],
                                                            token_ids=PROMPT), timeout=10)
    assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # An admin names pools by their internal ids, across replicas.
    assert peek(owner_b, "ops", ["a/p", "b/p"]) == {"a/p": HIT, "b/p": 0}
