"""Multimodal items, prompt-embedding digests and lookahead hashing through the protocol
(docs/hashing.md section 2): the hashes a real server stores and announces are vLLM 0.33's
golden vectors (cache_service/core/hash_vectors.json), probes and pins hash with the same
inputs, and a lookahead pool states its recipe."""

from __future__ import annotations

import json
from importlib import resources

import grpc
import pytest

from cache_service.client import AddResult, AppendResult, CacheClient, CacheError, Event, ops
from cache_service.core.hashing import prompt_embeds_digests

from .builders import full_layers

GOLDEN = {(c["algo"], c["name"]): c for c in json.loads(
    resources.files("cache_service.core").joinpath("hash_vectors.json").read_text("utf-8"))
    ["cases"]}


def _stored(client: CacheClient, pool_id: str) -> list[Event]:
    """The pool's BlockStored events so far (the feed ends where it is now)."""
    last = client.stats(pool_id).last_event_sequence
    out: list[Event] = []
    if last == 0:
        return out
    for event in client.subscribe_events(pool_id, 1):
        if event.kind == "block_stored":
            out.append(event)
        if event.sequence >= last:
            return out
    return out


def _inputs(case: dict) -> dict:
    extra: dict = {}
    if case.get("mm_items"):
        extra["mm_items"] = [tuple(m) for m in case["mm_items"]]
    if case.get("prompt_embeds"):
        pe = case["prompt_embeds"]
        extra["prompt_embeds_digests"] = prompt_embeds_digests(
            bytes.fromhex(pe["bytes"]), pe["rows"], case["hash_block_size"],
            case.get("lookahead", 0))
    for key in ("cache_salt", "lora_name", "lora_path"):
        if case.get(key):
            extra[key] = case[key]
    return extra


@pytest.mark.parametrize("name", ["mm_one_item", "mm_many_items", "mm_lora_salt",
                                  "embeds_tokens_lora_salt", "lookahead_3_lora_salt",
                                  "lookahead_2_mm", "lookahead_2_embeds"])
def test_stored_hashes_are_vllms(client: CacheClient, new_pool, name: str) -> None:
    case = GOLDEN[("sha256_cbor", name)]
    ahead = case.get("lookahead", 0)
    info = new_pool(full_layers(block_size=case["hash_block_size"]), hash_algo="sha256_cbor",
                    num_hash_lookahead_tokens=ahead)
    assert info.raw.hash_recipe.num_hash_lookahead_tokens == ahead
    assert info.raw.options.num_hash_lookahead_tokens == ahead
    num_prompt = case.get("num_prompt_tokens", len(case["tokens"]))
    prompt, rest = case["tokens"][:num_prompt], case["tokens"][num_prompt:]
    extra = _inputs(case)
    pid = info.pool_id
    client.step(pid, [ops.add("a", prompt, **extra), ops.allocate("a", len(prompt))])
    for t in rest:  # decode: each token appended, then computed
        client.step(pid, [ops.allocate("a", 1, append_token_ids=[t])])
    bs = case["hash_block_size"]
    stored = _stored(client, pid)
    announced = [h for e in stored for h in e.block_hashes]
    # Every block hashed (the last one's KV is computed once the next token is appended).
    assert announced[:len(case["external"])] == case["external"][:len(announced)]
    assert len(announced) >= len(case["external"]) - 1
    if ahead:
        tokens = case["tokens"]
        looked = [t for e in stored for t in (e.lookahead_token_ids or [])]
        assert looked == [tokens[(i + 1) * bs:(i + 1) * bs + ahead]
                          for i in range(len(announced))]
    # A probe with the same inputs hits what was stored; another identifier does not.
    # (A probe is a prompt: of the prompt's tokens, whose embeddings the digests are.)
    hit = min(len(announced) * bs, (len(prompt) - 1) // bs * bs)  # capped at len-1
    probe = {k: v for k, v in extra.items()}
    assert client.peek_prefix([pid], prompt, **probe) == {pid: hit}
    if "mm_items" in extra:
        other = [(f"x-{ident}", off, n) for ident, off, n in extra["mm_items"]]
        # The first block whose hash window (block + lookahead) reaches the first item.
        first_item_block = max(0, extra["mm_items"][0][1] - ahead) // bs
        assert client.peek_prefix([pid], prompt, **{**probe, "mm_items": other}) == {
            pid: min(hit, first_item_block * bs)}


def test_pin_hashes_with_multimodal_items(client: CacheClient, new_pool) -> None:
    info = new_pool(full_layers(block_size=16))
    pid = info.pool_id
    tokens = list(range(100, 164))
    items = [("img", 20, 10)]
    client.step(pid, [ops.add("a", tokens, mm_items=items), ops.allocate("a", 64)])
    pin = client.pin_prefix(pid, "p", tokens, ttl_seconds=60, mm_items=items)
    plain = client.pin_prefix(pid, "q", tokens, ttl_seconds=60)
    assert pin.hit_tokens == 48 and plain.hit_tokens == 16  # block 1 on holds the item


def test_lookahead_pool_hashes_a_block_once_its_next_token_exists(client: CacheClient,
                                                                   new_pool) -> None:
    info = new_pool(full_layers(block_size=16), num_hash_lookahead_tokens=1)
    pid = info.pool_id
    added = client.step(pid, [ops.add("a", list(range(32)))]).result(0, AddResult)
    assert added.num_block_hashes == 1  # block 1 waits for token 32
    appended = client.step(pid, [ops.append("a", [7])]).result(0, AppendResult)
    assert appended.num_block_hashes == 2
    with pytest.raises(CacheError) as err:
        new_pool(full_layers(block_size=16), num_hash_lookahead_tokens=1, use_eagle=True)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.field == "options.num_hash_lookahead_tokens"
