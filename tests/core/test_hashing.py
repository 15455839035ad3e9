"""Block hashing: golden vectors from vLLM 0.33 (scripts/gen_hash_vectors.py) and the
chaining / extra-key invariants of docs/semantics.md#hashing and docs/hashing.md."""

from __future__ import annotations

import hashlib
import json
import struct
from importlib import resources

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service.core.errors import InvalidArgument
from cache_service.core.hashing import (
    DEFAULT_NONE_HASH_SEED,
    EMPTY_EMBEDS_DIGEST,
    block_extra_keys,
    check_mm_items,
    check_prompt_embeds,
    external_block_hash,
    get_hash_fn,
    hash_block_tokens,
    hash_request_tokens,
    none_hash,
    prompt_embeds_digests,
)
from cache_service.core.request import Request

ALGOS = ("sha256", "sha256_cbor")
GOLDEN = json.loads(
    resources.files("cache_service.core").joinpath("hash_vectors.json").read_text("utf-8")
)
tokens_st = st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=120)


@pytest.fixture(autouse=True)
def _default_seed(monkeypatch):
    # The golden vectors use the default NONE_HASH seed; a CI runner may export one.
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


def _case_id(case: dict) -> str:
    return f"{case['algo']}-{case['name']}"


def test_golden_file_covers_both_algorithms_and_the_extra_keys():
    algos = {c["algo"] for c in GOLDEN["cases"]}
    assert algos == set(ALGOS)
    for algo in ALGOS:
        cases = [c for c in GOLDEN["cases"] if c["algo"] == algo]
        assert any(c["cache_salt"] for c in cases)
        assert any(c["lora_name"] for c in cases)
        assert sum(len(c["expected"]) for c in cases) > 80
    assert GOLDEN["vllm_version"] == "0.33.0"


@pytest.mark.parametrize("algo", ALGOS)
def test_none_hash_matches_vllm(algo):
    assert GOLDEN["none_hash_seed"] == DEFAULT_NONE_HASH_SEED
    assert none_hash(get_hash_fn(algo)).hex() == GOLDEN["none_hash"][algo]


@pytest.mark.parametrize("algo", ALGOS)
def test_none_hash_follows_pythonhashseed(algo, monkeypatch):
    seeded = GOLDEN["seeded_none_hash"]
    monkeypatch.setenv("PYTHONHASHSEED", seeded["PYTHONHASHSEED"])
    assert none_hash(get_hash_fn(algo)).hex() == seeded[algo]
    monkeypatch.delenv("PYTHONHASHSEED")
    assert none_hash(get_hash_fn(algo)).hex() == GOLDEN["none_hash"][algo]


def _digests(case: dict) -> list[bytes]:
    """The case's per-block prompt-embedding digests, from its raw embedding bytes."""
    pe = case.get("prompt_embeds")
    if pe is None:
        return []
    return prompt_embeds_digests(bytes.fromhex(pe["bytes"]), pe["rows"],
                                 case["hash_block_size"], case.get("lookahead", 0))


def _num_prompt(case: dict) -> int:
    return case.get("num_prompt_tokens", len(case["tokens"]))


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=_case_id)
def test_golden_vectors(case):
    fn = get_hash_fn(case["algo"])
    mm = check_mm_items([tuple(m) for m in case.get("mm_items", [])], _num_prompt(case))
    got = hash_request_tokens(fn, case["tokens"], case["hash_block_size"],
                              lora_name=case["lora_name"], lora_path=case["lora_path"],
                              cache_salt=case["cache_salt"], mm_items=mm,
                              prompt_embeds=_digests(case), lookahead=case.get("lookahead", 0))
    assert [h.hex() for h in got] == case["expected"]
    assert [external_block_hash(h) for h in got] == case["external"]


def test_golden_file_covers_multimodal_embeddings_and_lookahead():
    for algo in ALGOS:
        cases = [c for c in GOLDEN["cases"] if c["algo"] == algo]
        assert sum(len(c["expected"]) for c in cases if c.get("mm_items")) >= 20
        assert sum(len(c["expected"]) for c in cases if c.get("prompt_embeds")) >= 10
        assert {c.get("lookahead", 0) for c in cases} >= {0, 1, 2, 3}
        # Blocks past the prompt's embedding rows, and an item straddling blocks.
        assert any(len(c["expected"]) * c["hash_block_size"] > c["prompt_embeds"]["rows"]
                   for c in cases if c.get("prompt_embeds"))


@pytest.mark.parametrize("case", [c for c in GOLDEN["cases"] if c.get("prompt_embeds")],
                         ids=_case_id)
def test_prompt_embeds_digests_are_vllms(case):
    # vLLM's own ("prompt_embeds", digest) keys, from the raw bytes of its tensor.
    assert [d.hex() for d in _digests(case)] == case["prompt_embeds"]["digests"]


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=_case_id)
def test_request_hashes_golden_vectors_incrementally(case):
    # The pool's Request: the prompt, then the output tokens one at a time (the decode
    # hot path, with its lookahead-shifted block test).
    fn = get_hash_fn(case["algo"])
    num_prompt = _num_prompt(case)
    if not num_prompt:
        return
    mm = check_mm_items([tuple(m) for m in case.get("mm_items", [])], num_prompt)
    req = Request("r", case["tokens"][:num_prompt], hash_fn=fn,
                  hash_block_size=case["hash_block_size"], cache_salt=case["cache_salt"],
                  lora_name=case["lora_name"], lora_path=case["lora_path"], mm_items=mm,
                  prompt_embeds=tuple(_digests(case)),
                  hash_lookahead=case.get("lookahead", 0))
    for t in case["tokens"][num_prompt:]:
        req.append_token(t)
    assert [h.hex() for h in req.block_hashes] == case["expected"]


# --- the documented sha256_cbor recipe, re-derived without cbor2 (docs/hashing.md) ---

def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for info, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | info]) + struct.pack(fmt, n)
    raise ValueError(n)


def _cbor(obj) -> bytes:
    if obj is None:
        return b"\xf6"
    if isinstance(obj, bytes):
        return _cbor_head(2, len(obj)) + obj
    if isinstance(obj, str):
        raw = obj.encode("utf-8")
        return _cbor_head(3, len(raw)) + raw
    if isinstance(obj, int):
        return _cbor_head(0, obj) if obj >= 0 else _cbor_head(1, -1 - obj)
    if isinstance(obj, tuple):
        return _cbor_head(4, len(obj)) + b"".join(_cbor(x) for x in obj)
    raise TypeError(type(obj))


@pytest.mark.parametrize("case", [c for c in GOLDEN["cases"] if c["algo"] == "sha256_cbor"],
                         ids=_case_id)
def test_cbor_recipe_from_the_docs_reproduces_the_golden_vectors(case):
    def sha(obj) -> bytes:
        return hashlib.sha256(_cbor(obj)).digest()

    assert sha(DEFAULT_NONE_HASH_SEED).hex() == GOLDEN["none_hash"]["sha256_cbor"]
    bs = case["hash_block_size"]
    ahead = case.get("lookahead", 0)
    pe = case.get("prompt_embeds")
    parent = sha(DEFAULT_NONE_HASH_SEED)
    lora = ("lora", case["lora_name"], case["lora_path"]) if case["lora_name"] else None
    for i, expected in enumerate(case["expected"]):
        # docs/hashing.md section 2, literally: the window is the block plus the lookahead.
        start, end = i * bs, (i + 1) * bs
        window = end + ahead
        keys = [lora] if lora else []
        keys += [("mm", ident, off - start) for ident, off, n in case.get("mm_items", [])
                 if off < window and off + n > start]
        keys += [("cache_salt", case["cache_salt"])] if i == 0 and case["cache_salt"] else []
        if pe is not None:
            width = len(pe["bytes"]) // 2 // pe["rows"]
            rows = bytes.fromhex(pe["bytes"])[start * width:min(window, pe["rows"]) * width]
            keys.append(("prompt_embeds", hashlib.sha256(rows).digest()))
        extra = tuple(keys) if keys else None
        if ahead:
            extra = (extra, *case["tokens"][end:window])
        parent = sha((parent, tuple(case["tokens"][start:end]), extra))
        assert parent.hex() == expected
        assert int.from_bytes(parent[-8:], "big") == case["external"][i]


# --- invariants ---

@pytest.mark.parametrize("algo", ALGOS)
@settings(max_examples=40, deadline=None)
@given(tokens=tokens_st, bs=st.integers(1, 9), salt=st.sampled_from([None, "s1"]))
def test_chaining_matches_hash_block_tokens(algo, tokens, bs, salt):
    fn = get_hash_fn(algo)
    got = hash_request_tokens(fn, tokens, bs, cache_salt=salt)
    parent = None
    for i, h in enumerate(got):
        keys = block_extra_keys(i * bs, (i + 1) * bs, lora_name=None, lora_path=None,
                                cache_salt=salt)
        parent = hash_block_tokens(fn, parent, tokens[i * bs:(i + 1) * bs], keys)
        assert h == parent
    assert len(got) == len(tokens) // bs  # partial blocks are never hashed


@pytest.mark.parametrize("algo", ALGOS)
@settings(max_examples=40, deadline=None)
@given(tokens=tokens_st, bs=st.integers(1, 9), cuts=st.lists(st.integers(0, 120), max_size=4),
       salt=st.sampled_from([None, "s1"]), lora=st.sampled_from([None, "adapter"]))
def test_incremental_equals_one_shot(algo, tokens, bs, cuts, salt, lora) -> None:
    fn = get_hash_fn(algo)
    extra = dict(cache_salt=salt, lora_name=lora, lora_path=lora and "/p")
    one_shot = hash_request_tokens(fn, tokens, bs, **extra)
    hashes: list[bytes] = []
    # Tokens arrive in pieces (prompt, then decode steps); each call extends the chain.
    for n in sorted(c for c in cuts if c <= len(tokens)) + [len(tokens)]:
        hashes += hash_request_tokens(fn, tokens[:n], bs, parent=hashes[-1] if hashes else None,
                                      start_block=len(hashes), **extra)
    assert hashes == one_shot


def test_equal_prefixes_hash_equal_and_divergence_propagates():
    fn = get_hash_fn("sha256_cbor")
    a = hash_request_tokens(fn, list(range(64)), 16)
    b = hash_request_tokens(fn, list(range(32)) + [7] * 32, 16)
    assert a[:2] == b[:2]
    assert a[2] != b[2] and a[3] != b[3]
    # Same tokens at block 3 but a different prefix -> different hash (the chain).
    c = hash_request_tokens(fn, [9] * 48 + list(range(48, 64)), 16)
    assert c[3] != a[3]


@pytest.mark.parametrize("algo", ALGOS)
def test_salt_only_changes_block_zero_key(algo):
    fn = get_hash_fn(algo)
    tokens = list(range(48))
    plain = hash_request_tokens(fn, tokens, 16)
    salted = hash_request_tokens(fn, tokens, 16, cache_salt="tenant")
    assert all(p != s for p, s in zip(plain, salted))  # the chain carries the salt on
    assert block_extra_keys(0, 16, lora_name=None, lora_path=None,
                            cache_salt="tenant") == (("cache_salt", "tenant"),)
    assert block_extra_keys(16, 32, lora_name=None, lora_path=None, cache_salt="tenant") is None
    # Block 1 hashed with no extra keys on top of the salted block 0 reproduces the chain.
    assert hash_block_tokens(fn, salted[0], tokens[16:32], None) == salted[1]
    assert hash_request_tokens(fn, tokens, 16, cache_salt="") == plain


@pytest.mark.parametrize("algo", ALGOS)
def test_lora_key_on_every_block(algo):
    fn = get_hash_fn(algo)
    tokens = list(range(48))
    hashes = hash_request_tokens(fn, tokens, 16, lora_name="a", lora_path="/a",
                                 cache_salt="s")
    assert block_extra_keys(0, 16, lora_name="a", lora_path="/a", cache_salt="s") == (
        ("lora", "a", "/a"), ("cache_salt", "s"))
    for i in (1, 2):
        keys = block_extra_keys(i * 16, i * 16 + 16, lora_name="a", lora_path="/a",
                                cache_salt="s")
        assert keys == (("lora", "a", "/a"),)
        assert hash_block_tokens(fn, hashes[i - 1], tokens[i * 16:i * 16 + 16], keys) == hashes[i]
    # The adapter path is part of the key: re-pointing a name gives new hashes.
    other = hash_request_tokens(fn, tokens, 16, lora_name="a", lora_path="/b", cache_salt="s")
    assert all(h != o for h, o in zip(hashes, other))


def test_partial_blocks_not_hashed():
    fn = get_hash_fn("sha256")
    assert hash_request_tokens(fn, list(range(15)), 16) == []
    assert len(hash_request_tokens(fn, list(range(47)), 16)) == 2
    full = hash_request_tokens(fn, list(range(48)), 16)
    assert hash_request_tokens(fn, list(range(47)), 16) == full[:2]
    # Incremental call with nothing new: no hashes.
    assert hash_request_tokens(fn, list(range(47)), 16, parent=full[1], start_block=2) == []


def test_external_block_hash_is_last_eight_bytes_big_endian():
    h = bytes(range(32))
    assert external_block_hash(h) == int.from_bytes(bytes(range(24, 32)), "big")
    assert external_block_hash(b"\xff" * 32) == 2**64 - 1
    assert external_block_hash(b"\x00" * 24 + b"\x00" * 7 + b"\x01") == 1


def test_hash_fns_are_the_documented_recipes():
    import pickle

    import cbor2

    obj = (b"p", (1, 2), None)
    assert get_hash_fn("sha256")(obj) == hashlib.sha256(
        pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert get_hash_fn("sha256_cbor")(obj) == hashlib.sha256(
        cbor2.dumps(obj, canonical=True)).digest()


@pytest.mark.parametrize("algo", ["md5", "xxhash", "", None])
def test_unknown_algorithm_names_the_field(algo):
    with pytest.raises(InvalidArgument) as e:
        get_hash_fn(algo)
    assert e.value.field == "hash_algo"


@pytest.mark.parametrize("kwargs, field", [
    (dict(hash_block_size=0), "hash_block_size"),
    (dict(hash_block_size=-16), "hash_block_size"),
    (dict(hash_block_size=16, start_block=-1), "start_block"),
    (dict(hash_block_size=16, start_block=1), "parent"),  # a chain needs its parent
    (dict(hash_block_size=16, parent=b"x" * 32), "parent"),  # block 0 has none
])
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(InvalidArgument) as e:
        hash_request_tokens(get_hash_fn("sha256"), list(range(64)), **kwargs)
    assert e.value.field == field


# --- multimodal items, prompt embeddings, lookahead (docs/hashing.md section 2) ---

mm_st = st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(1, 12), st.integers(0, 6)),
                 max_size=5)


def _layout(gaps_and_lengths: list[tuple[str, int, int]]) -> tuple[tuple[str, int, int], ...]:
    """Sorted, non-overlapping items from (identifier, length, gap before) triples."""
    items, pos = [], 0
    for ident, length, gap in gaps_and_lengths:
        pos += gap
        items.append((ident, pos, length))
        pos += length
    return tuple(items)


@pytest.mark.parametrize("algo", ALGOS)
@settings(max_examples=40, deadline=None)
@given(tokens=tokens_st, bs=st.integers(1, 9), cuts=st.lists(st.integers(0, 120), max_size=4),
       ahead=st.integers(0, 3), layout=mm_st, embeds=st.booleans())
def test_incremental_equals_one_shot_with_window_keys(algo, tokens, bs, cuts, ahead, layout,
                                                      embeds) -> None:
    fn = get_hash_fn(algo)
    mm = tuple(m for m in _layout(layout) if m[1] + m[2] <= len(tokens))
    digests = [bytes([i % 256]) * 32 for i in range(-(-len(tokens) // bs))] if embeds else []
    extra = dict(mm_items=mm, prompt_embeds=digests, lookahead=ahead, cache_salt="s")
    one_shot = hash_request_tokens(fn, tokens, bs, **extra)
    assert len(one_shot) == max(0, len(tokens) - ahead) // bs
    hashes: list[bytes] = []
    for n in sorted(c for c in cuts if c <= len(tokens)) + [len(tokens)]:
        hashes += hash_request_tokens(fn, tokens[:n], bs, parent=hashes[-1] if hashes else None,
                                      start_block=len(hashes), **extra)
    assert hashes == one_shot


@pytest.mark.parametrize("algo", ALGOS)
def test_lookahead_hash_covers_the_next_tokens(algo):
    fn = get_hash_fn(algo)
    a = hash_request_tokens(fn, list(range(17)), 16, lookahead=1)
    b = hash_request_tokens(fn, list(range(16)) + [99], 16, lookahead=1)
    assert len(a) == 1 and a != b  # same block, other next token: another key
    assert hash_request_tokens(fn, list(range(16)), 16, lookahead=1) == []
    assert a[0] == hash_block_tokens(fn, None, range(16), (None, 16))
    assert a != hash_request_tokens(fn, list(range(17)), 16)


@pytest.mark.parametrize("algo", ALGOS)
def test_mm_key_names_item_and_relative_offset(algo):
    fn = get_hash_fn(algo)
    tokens = [5] * 48
    shifted = hash_request_tokens(fn, tokens, 16, mm_items=(("img", 18, 4),))
    other = hash_request_tokens(fn, tokens, 16, mm_items=(("img", 20, 4),))
    renamed = hash_request_tokens(fn, tokens, 16, mm_items=(("img2", 18, 4),))
    plain = hash_request_tokens(fn, tokens, 16)
    assert shifted[0] == plain[0] == other[0] == renamed[0]  # block 0 has no item
    assert len({shifted[1], other[1], renamed[1], plain[1]}) == 4
    assert hash_block_tokens(fn, plain[0], tokens[16:32], (("mm", "img", 2),)) == shifted[1]


def test_embedding_digests_past_the_rows_hash_no_bytes():
    fn = get_hash_fn("sha256_cbor")
    digests = [b"\x01" * 32]  # one block of rows
    got = hash_request_tokens(fn, [0] * 32, 16, prompt_embeds=digests)
    assert got[1] == hash_block_tokens(fn, got[0], [0] * 16,
                                       (("prompt_embeds", EMPTY_EMBEDS_DIGEST),))
    rows = bytes(range(40)) * 4  # 20 rows of 8 bytes
    assert prompt_embeds_digests(rows, 20, 8, lookahead=2) == [
        hashlib.sha256(rows[i * 8:min(i + 10, 20) * 8]).digest() for i in (0, 8, 16)]


@pytest.mark.parametrize("items, field", [
    ([("a", 0, 0)], "mm_items[0].length"),
    ([("a", -1, 2)], "mm_items[0].offset"),
    ([("", 0, 2)], "mm_items[0].identifier"),
    ([(3, 0, 2)], "mm_items[0].identifier"),
    ([("a", 8, 3)], "mm_items[0].length"),  # past the prompt's 10 tokens
    ([("a", 0, 4), ("b", 3, 2)], "mm_items[1].offset"),  # overlapping
    ([("a", 5, 2), ("b", 0, 2)], "mm_items[1].offset"),  # unsorted
    ([("a", 0)], "mm_items[0]"),
    ([("a", True, 2)], "mm_items[0].offset"),
    (5, "mm_items"),
])
def test_bad_mm_items_name_the_field(items, field):
    with pytest.raises(InvalidArgument) as exc:
        check_mm_items(items, 10)
    assert exc.value.field == field


@pytest.mark.parametrize("digests, field", [
    ([b"x" * 32], "prompt_embeds_digests"),  # 40 tokens at 16 need 3
    ([b"x" * 32, b"x" * 31, b"x" * 32], "prompt_embeds_digests[1]"),
    ([b"x" * 32, "x" * 32, b"x" * 32], "prompt_embeds_digests[1]"),
    (7, "prompt_embeds_digests"),
])
def test_bad_prompt_embeds_digests_name_the_field(digests, field):
    with pytest.raises(InvalidArgument) as exc:
        check_prompt_embeds(digests, 40, 16)
    assert exc.value.field == field
    assert check_prompt_embeds([], 40, 16) == ()
