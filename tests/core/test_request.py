"""Request: incremental block hashing at the hash block size."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cache_service.core.hashing import get_hash_fn, hash_request_tokens
from cache_service.core.request import Request, RequestStatus

HASH = get_hash_fn("sha256_cbor")


@given(st.lists(st.integers(0, 50), min_size=1, max_size=40),
       st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=7), max_size=6),
       st.sampled_from([1, 3, 4]))
def test_incremental_hashes_equal_one_shot(prompt, appends, bs) -> None:
    req = Request("r", prompt, hash_fn=HASH, hash_block_size=bs, cache_salt="s")
    for chunk in appends:
        req.append_tokens(chunk)
    tokens = prompt + [t for c in appends for t in c]
    assert req.block_hashes == hash_request_tokens(HASH, tokens, bs, cache_salt="s")
    assert req.num_tokens == len(tokens) and req.num_prompt_tokens == len(prompt)


def test_client_hashes_are_adopted_and_extended() -> None:
    tokens = list(range(10))
    true = hash_request_tokens(HASH, tokens + [7, 7], 4)
    req = Request("r", tokens, hash_fn=HASH, hash_block_size=4, block_hashes=true[:2])
    assert req.block_hashes == true[:2]
    req.append_tokens([7, 7])
    assert req.block_hashes == true


def test_no_hash_function_means_no_hashes() -> None:
    req = Request("r", list(range(32)), hash_fn=None, hash_block_size=4)
    req.append_tokens([1] * 8)
    assert req.block_hashes == [] and req.status == RequestStatus.WAITING
