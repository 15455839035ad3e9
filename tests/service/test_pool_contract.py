"""What a pool promises a foreign client: the chunk budget is enforced, PoolConfig shows the
options in use (defaults filled in), and the hash recipe is published and checkable."""

from __future__ import annotations

import grpc
import pytest

from cache_service.client import AddResult, AllocateResult, CacheClient, CacheError, ops
from cache_service.core.hashing import sha256_cbor, sha256_pickle
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb


def test_max_in_flight_tokens_is_enforced(client: CacheClient, new_pool) -> None:
    info = new_pool(max_in_flight_tokens=128)
    client.step(info.pool_id, [ops.add("a", list(range(200)))])
    with pytest.raises(CacheError) as err:
        client.step(info.pool_id, [ops.lookup("a"), ops.allocate("a", 200)])
    assert err.value.field == "ops[1].allocate.num_new_tokens"
    assert "max_in_flight_tokens=128" in err.value.message
    state = client.get_request(info.pool_id, "a")
    assert (state.num_computed_tokens, state.status) == (0, "WAITING")  # batch not applied
    first = client.step(info.pool_id, [ops.allocate("a", 128)]).result(0, AllocateResult)
    assert first.ok and first.num_computed_tokens == 128
    second = client.step(info.pool_id, [ops.allocate("a", 72)]).result(0, AllocateResult)
    assert second.num_computed_tokens == 200


def test_pool_config_options_show_the_values_in_use(client: CacheClient, new_pool) -> None:
    info = new_pool(max_model_len=1024)
    opts = info.raw.options
    assert (opts.scheduler_block_size, opts.hash_block_size) == (16, 16)
    assert opts.scheduler_block_size == info.scheduler_block_size
    assert opts.max_in_flight_tokens == 1024  # default: max_model_len
    assert opts.HasField("enable_caching") and opts.HasField("enable_events")
    assert opts.hash_algo == pb.HASH_ALGO_SHA256
    assert client.get_pool(info.pool_id).raw.options == opts
    assert new_pool(max_in_flight_tokens=256).raw.options.max_in_flight_tokens == 256


@pytest.mark.parametrize("algo, fn", [("sha256", sha256_pickle), ("sha256_cbor", sha256_cbor)])
def test_pool_config_publishes_the_hash_recipe(new_pool, algo, fn) -> None:
    recipe = new_pool(hash_algo=algo).raw.hash_recipe
    assert recipe.none_hash_seed == "vllm-none-hash"
    assert recipe.none_hash == fn("vllm-none-hash")
    assert recipe.hash_block_size == 16
    assert recipe.hash_algo == {"sha256": pb.HASH_ALGO_SHA256,
                                "sha256_cbor": pb.HASH_ALGO_SHA256_CBOR}[algo]


@pytest.mark.parametrize("declared, field", [
    (pb.HashRecipe(none_hash=sha256_cbor("my-seed")), "none_hash"),
    (pb.HashRecipe(none_hash_seed="my-seed"), "none_hash_seed"),
    (pb.HashRecipe(hash_block_size=32), "hash_block_size"),
    (pb.HashRecipe(hash_algo=pb.HASH_ALGO_SHA256), "hash_algo"),
])
def test_a_declared_recipe_mismatch_names_the_field(client: CacheClient, stub, new_pool,
                                                     declared, field) -> None:
    info = new_pool(hash_algo="sha256_cbor")
    with pytest.raises(CacheError) as err:
        client.step(info.pool_id, [ops.add("a", list(range(40)), hash_recipe=declared)])
    assert err.value.code.name == "INVALID_ARGUMENT"
    assert err.value.field == f"ops[0].add_request.hash_recipe.{field}"
    assert client.stats(info.pool_id).num_requests == 0
    with pytest.raises(grpc.RpcError) as rpc_err:
        stub.PeekPrefix(pb.PeekPrefixRequest(pool_ids=[info.pool_id], token_ids=list(range(40)),
                                             hash_recipe=declared), timeout=10)
    assert rpc_err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert rpc_err.value.details().startswith(f"hash_recipe.{field}")


def test_the_published_recipe_is_accepted(client: CacheClient, new_pool) -> None:
    info = new_pool(hash_algo="sha256_cbor")
    result = client.step(info.pool_id, [ops.add("a", list(range(40)),
                                                hash_recipe=info.raw.hash_recipe)])
    assert result.result(0, AddResult).num_block_hashes == 2
