"""What docs/protocol.md's "Python client" section says of the layer builders and
register_pool holds against a real server: a mistyped keyword names register_pool, and on a
Mamba-align pool one allocate of the whole prompt caches no state checkpoint (no hit for the
next request) while a prefill chunked at a block boundary does."""

from __future__ import annotations

import pytest

from cache_service.client import CacheClient, LookupResult, layers, ops

PROMPT = list(range(1, 41))  # 40 tokens: boundaries at 16 and 32


def hybrid_mamba() -> list:
    return [layers.full_attention("attn", block_size=16, num_kv_heads=1, head_size=8),
            layers.sliding_window("swa", block_size=16, num_kv_heads=1, head_size=8,
                                  sliding_window=32),
            layers.mamba("ssm", block_size=16, shapes=[(4, 8), (2, 8, 4)],
                         dtypes=["float32", "float32"], mamba_cache_mode="align")]


def hit_of(client: CacheClient, pool: str, rid: str) -> int:
    result = client.step(pool, [ops.add(rid, PROMPT), ops.lookup(rid)]).results[1]
    assert isinstance(result, LookupResult)
    return result.hit_tokens


def test_a_mistyped_register_pool_keyword_names_register_pool(client: CacheClient) -> None:
    with pytest.raises(TypeError, match=r"^register_pool\(\) got an unexpected keyword "
                                        r"argument 'num_block'; it takes: num_blocks, "):
        client.register_pool("typo", hybrid_mamba(), num_block=64, max_model_len=64)


def test_mamba_align_caches_only_at_chunk_boundaries(client: CacheClient) -> None:
    client.register_pool("doc-align", hybrid_mamba(), num_blocks=256, max_model_len=128)
    # one allocate of the whole prompt: the chunk ends at 40, no boundary: no checkpoint
    assert hit_of(client, "doc-align", "a") == 0
    client.step("doc-align", [ops.allocate("a", 40)], begin_step=True)
    client.step("doc-align", [ops.free("a")])
    assert hit_of(client, "doc-align", "b") == 0
    client.step("doc-align", [ops.free("b")])
    # prefill in two chunks, the first ending on the block boundary 32: a checkpoint there
    assert hit_of(client, "doc-align", "c") == 0
    client.step("doc-align", [ops.allocate("c", 32)], begin_step=True)
    client.step("doc-align", [ops.allocate("c", 8)], begin_step=True)
    client.step("doc-align", [ops.free("c")])
    assert hit_of(client, "doc-align", "d") == 32
