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
    block_extra_keys,
    external_block_hash,
    get_hash_fn,
    hash_block_tokens,
    hash_request_tokens,
    none_hash,
)

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


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=_case_id)
def test_golden_vectors(case):
    fn = get_hash_fn(case["algo"])
    got = hash_request_tokens(fn, case["tokens"], case["hash_block_size"],
                              lora_name=case["lora_name"], lora_path=case["lora_path"],
                              cache_salt=case["cache_salt"])
    assert [h.hex() for h in got] == case["expected"]
    assert [external_block_hash(h) for h in got] == case["external"]


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
    parent = sha(DEFAULT_NONE_HASH_SEED)
    lora = ("lora", case["lora_name"], case["lora_path"]) if case["lora_name"] else None
    for i, expected in enumerate(case["expected"]):
        keys = ([lora] if lora else []) + (
            [("cache_salt", case["cache_salt"])] if i == 0 and case["cache_salt"] else [])
        parent = sha((parent, tuple(case["tokens"][i * bs:(i + 1) * bs]),
                      tuple(keys) if keys else None))
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
