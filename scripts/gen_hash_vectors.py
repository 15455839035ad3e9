#!/usr/bin/env python3
"""Generate cache_service/core/hash_vectors.json: golden block hashes computed by vLLM 0.33.

A development script, not part of the package or of CI. It imports only vLLM (never
``cache_service``), so every expected value in the output is vLLM's own answer:
``vllm.utils.hashing.get_hash_fn_by_name`` + ``vllm.v1.core.kv_cache_utils.init_none_hash``
+ ``get_request_block_hasher`` applied to real ``vllm.v1.request.Request`` objects (with a
``LoRARequest``, ``cache_salt``, multimodal features (``MultiModalFeatureSpec`` with a
``PlaceholderRange``), a ``prompt_embeds`` tensor, output tokens and
``num_hash_lookahead_tokens`` where a case has them). For prompt embeddings the file
records the tensor's raw bytes (float32, row-major) and vLLM's own per-block digests
(the ``("prompt_embeds", digest)`` key it put in each block's extra keys).

Run it with the vLLM oracle venv (see ../shared/tools/vllm-oracle/README.md):

    bash ../shared/tools/vllm-oracle/setup_venv.sh          # once, ~3 min
    ~/.cache/vllm-oracle-venv/bin/python scripts/gen_hash_vectors.py
    # writes cache_service/core/hash_vectors.json (use --out to write elsewhere)

PYTHONHASHSEED is removed from the environment first (the vectors use the default
NONE_HASH seed "vllm-none-hash"); one extra entry records NONE_HASH for seed "0".
The output is deterministic: rerunning must give a byte-identical file.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import sys
from pathlib import Path

os.environ.pop("PYTHONHASHSEED", None)  # before vLLM resolves the NONE_HASH seed
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch
import vllm
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

ALGOS = ("sha256", "sha256_cbor")
OUT = Path(__file__).resolve().parent.parent / "cache_service" / "core" / "hash_vectors.json"


def cases() -> list[dict]:
    """Inputs only; every expected value comes from vLLM below."""
    rng = random.Random(20261130)

    def toks(n: int, vocab: int = 152064) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    shared = toks(32)
    # One integer of each CBOR head width (0-23 inline, 1, 2, 4, 8 bytes) around the edges.
    widths = [0, 1, 23, 24, 255, 256, 65535, 65536, 4294967295, 4294967296, 2**40 + 7, 2**63 - 1]
    return [
        dict(name="empty", tokens=[], hash_block_size=16),
        dict(name="partial_block_only", tokens=toks(15), hash_block_size=16),
        dict(name="one_block", tokens=list(range(16)), hash_block_size=16),
        dict(name="three_blocks_and_partial", tokens=toks(50), hash_block_size=16),
        dict(name="block_size_1", tokens=toks(5), hash_block_size=1),
        dict(name="block_size_32", tokens=toks(100), hash_block_size=32),
        dict(name="cbor_int_widths", tokens=widths, hash_block_size=4),
        dict(name="long_prompt", tokens=toks(1000), hash_block_size=16),
        dict(name="shared_prefix_a", tokens=shared + toks(20), hash_block_size=16),
        dict(name="shared_prefix_b", tokens=shared + toks(20), hash_block_size=16),
        dict(name="salt", tokens=toks(40), hash_block_size=16, cache_salt="tenant-a"),
        dict(name="salt_unicode", tokens=toks(40), hash_block_size=16,
             cache_salt="sel-\u00e9-\U0001f642"),
        dict(name="empty_salt_is_no_salt", tokens=list(range(16)), hash_block_size=16,
             cache_salt=""),
        dict(name="lora", tokens=toks(40), hash_block_size=16,
             lora_name="sql-adapter", lora_path="/adapters/sql"),
        dict(name="lora_and_salt", tokens=toks(40), hash_block_size=16,
             lora_name="sql-adapter", lora_path="/adapters/sql", cache_salt="tenant-a"),
    ] + extended_cases(rng, toks)


def extended_cases(rng: random.Random, toks) -> list[dict]:
    """Multimodal items, prompt embeddings and lookahead hashing (issue 22). A case's
    ``num_prompt_tokens`` (default: all of ``tokens``) splits prompt from output tokens;
    ``mm_items`` are (identifier, offset, length); ``embeds_rows`` asks for a random
    float32 embedding matrix of that many rows x ``EMBED_WIDTH``."""
    many: list[list] = []
    pos = 3
    while pos < 180:
        length = rng.randrange(1, 40)
        many.append([f"img-{len(many)}", pos, length])
        pos += length + rng.randrange(0, 12)
    many = [m for m in many if m[1] + m[2] <= 200]
    return [
        dict(name="mm_one_item", tokens=toks(64), hash_block_size=16,
             mm_items=[["sha-of-image-a", 5, 20]]),
        dict(name="mm_item_on_block_edges", tokens=toks(64), hash_block_size=16,
             mm_items=[["img-a", 16, 16], ["img-b", 32, 1]]),
        dict(name="mm_two_items_one_block", tokens=toks(48), hash_block_size=16,
             mm_items=[["img-a", 1, 3], ["img-b", 4, 2], ["img-c", 9, 30]]),
        dict(name="mm_many_items", tokens=toks(230), hash_block_size=16, mm_items=many,
             num_prompt_tokens=200),
        dict(name="mm_lora_salt", tokens=toks(70), hash_block_size=16,
             mm_items=[["img-a", 0, 40]], lora_name="vl-adapter",
             lora_path="/adapters/vl", cache_salt="tenant-b"),
        dict(name="mm_same_item_other_offset", tokens=[7] * 64, hash_block_size=16,
             mm_items=[["img-a", 18, 10]]),
        dict(name="embeds_only", tokens=[0] * 40 + toks(30), hash_block_size=16,
             num_prompt_tokens=40, embeds_rows=40),
        dict(name="embeds_tokens_lora_salt", tokens=toks(50), hash_block_size=16,
             embeds_rows=50, lora_name="a", lora_path="/p", cache_salt="s"),
        dict(name="embeds_and_mm", tokens=toks(40), hash_block_size=8, embeds_rows=40,
             mm_items=[["aud-1", 6, 12]]),
        dict(name="lookahead_1", tokens=toks(50), hash_block_size=16, lookahead=1),
        dict(name="lookahead_1_exact_blocks", tokens=toks(32), hash_block_size=16,
             lookahead=1),
        dict(name="lookahead_3_lora_salt", tokens=toks(70), hash_block_size=16,
             lookahead=3, lora_name="sql-adapter", lora_path="/adapters/sql",
             cache_salt="tenant-a", num_prompt_tokens=40),
        dict(name="lookahead_2_mm", tokens=toks(80), hash_block_size=16, lookahead=2,
             mm_items=[["img-a", 17, 14], ["img-b", 32, 3], ["img-c", 49, 20]]),
        dict(name="lookahead_2_embeds", tokens=toks(60), hash_block_size=16, lookahead=2,
             embeds_rows=45, num_prompt_tokens=45),
        dict(name="lookahead_block_size_1", tokens=toks(6), hash_block_size=1, lookahead=2),
    ]


EMBED_WIDTH = 4  # float32 columns of a case's embedding matrix (small: it is in the file)


def embeds_tensor(case: dict) -> torch.Tensor | None:
    if not case.get("embeds_rows"):
        return None
    gen = torch.Generator().manual_seed(len(case["name"]))  # deterministic per case
    return torch.randn(case["embeds_rows"], EMBED_WIDTH, generator=gen, dtype=torch.float32)


def vllm_request(case: dict, hasher, request_id: str, num_prompt: int) -> Request:
    lora = None
    if case.get("lora_name") is not None:
        lora = LoRARequest(case["lora_name"], 1, case["lora_path"])
    mm = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                mm_position=PlaceholderRange(offset=off, length=n))
          for ident, off, n in case.get("mm_items", [])]
    embeds = embeds_tensor(case)
    return Request(
        request_id=request_id,
        # An embeddings-only prompt has no token ids (vLLM holds zeros for them).
        prompt_token_ids=(None if embeds is not None and not any(case["tokens"][:num_prompt])
                          else list(case["tokens"][:num_prompt])),
        prompt_embeds=embeds,
        mm_features=mm or None,
        sampling_params=SamplingParams(max_tokens=len(case["tokens"]) + 1),
        pooling_params=None,
        lora_request=lora,
        cache_salt=case.get("cache_salt"),
        block_hasher=hasher,
    )


def vllm_hashes(case: dict, hash_fn) -> tuple[list[bytes], list[str] | None]:
    """vLLM's hashes of the case (prompt, then its output tokens one at a time), and the
    per-block prompt-embeds digests vLLM computed (None without embeddings)."""
    lookahead = case.get("lookahead", 0)
    hasher = kv_cache_utils.get_request_block_hasher(
        case["hash_block_size"], hash_fn, num_hash_lookahead_tokens=lookahead)
    num_prompt = case.get("num_prompt_tokens", len(case["tokens"]))
    if num_prompt == 0:
        return [], None
    req = vllm_request(case, hasher, case["name"], num_prompt)
    for t in case["tokens"][num_prompt:]:
        req.append_output_token_ids(t)
    one_shot = [bytes(h) for h in req.block_hashes]
    digests = None
    if req.prompt_embeds is not None:
        bs = case["hash_block_size"]
        # vLLM's own key per block with a row (digests past the rows are of no bytes).
        digests = []
        for start in range(0, num_prompt, bs):
            (key,) = kv_cache_utils._gen_prompt_embeds_extra_hash_keys(
                req, start, start + bs + lookahead)
            digests.append(key[1].hex())
    if "mm_items" in case or "embeds_rows" in case or lookahead or num_prompt != len(
            case["tokens"]):
        return one_shot, digests
    # Sanity: vLLM's own incremental path (prompt, then output tokens one at a time)
    # agrees with the one-shot hashes we record.
    split = len(case["tokens"]) // 2
    if split:
        inc = vllm_request(case, hasher, case["name"] + "-inc", split)
        for t in case["tokens"][split:]:
            inc.append_output_token_ids(t)
        assert [bytes(h) for h in inc.block_hashes] == one_shot, case["name"]
    return one_shot, None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()

    doc: dict = {
        "generator": "scripts/gen_hash_vectors.py",
        "vllm_version": vllm.__version__,
        "python": ".".join(map(str, sys.version_info[:3])),
        "pickle_protocol": pickle.HIGHEST_PROTOCOL,
        "cbor2_version": _version("cbor2"),
        "none_hash_seed": kv_cache_utils.DEFAULT_NONE_HASH_SEED,
        "none_hash": {},
        "seeded_none_hash": {"PYTHONHASHSEED": "0"},
        "cases": [],
    }
    for algo in ALGOS:
        hash_fn = get_hash_fn_by_name(algo)
        os.environ["PYTHONHASHSEED"] = "0"
        kv_cache_utils.init_none_hash(hash_fn)
        doc["seeded_none_hash"][algo] = bytes(kv_cache_utils.NONE_HASH).hex()
        del os.environ["PYTHONHASHSEED"]
        kv_cache_utils.init_none_hash(hash_fn)  # the default seed again, for the cases
        doc["none_hash"][algo] = bytes(kv_cache_utils.NONE_HASH).hex()
        for case in cases():
            hashes, digests = vllm_hashes(case, hash_fn)
            # Keys of the issue-22 cases only where they apply: the older cases' lines
            # stay byte-identical.
            extended = {k: case[k] for k in ("num_prompt_tokens", "mm_items", "lookahead")
                        if k in case}
            embeds = embeds_tensor(case)
            if embeds is not None:
                extended["prompt_embeds"] = {
                    "dtype": "float32", "rows": embeds.shape[0], "width": EMBED_WIDTH,
                    "bytes": bytes(embeds.numpy().tobytes()).hex(), "digests": digests}
            doc["cases"].append({
                **{k: case.get(k) for k in ("name", "hash_block_size", "cache_salt",
                                            "lora_name", "lora_path")},
                "algo": algo,
                "tokens": case["tokens"],
                **extended,
                "expected": [h.hex() for h in hashes],
                "external": [kv_cache_utils.maybe_convert_block_hash(h) for h in hashes],
            })
    # One case per line keeps the file reviewable in a diff.
    cases_text = ",\n  ".join(json.dumps(c, ensure_ascii=False) for c in doc.pop("cases"))
    head = json.dumps(doc, indent=1, ensure_ascii=False)[:-2]
    text = head + ',\n "cases": [\n  ' + cases_text + "\n ]\n}\n"
    args.out.write_text(text, encoding="utf-8")
    json.loads(text)  # the hand-joined layout must still be valid JSON
    print(f"wrote {args.out}: {text.count(chr(10) + '  {')} cases, vLLM {vllm.__version__}")
    return 0


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    sys.exit(main())
