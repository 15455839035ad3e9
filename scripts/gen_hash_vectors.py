#!/usr/bin/env python3
"""Generate cache_service/core/hash_vectors.json: golden block hashes computed by vLLM 0.33.

A development script, not part of the package or of CI. It imports only vLLM (never
``cache_service``), so every expected value in the output is vLLM's own answer:
``vllm.utils.hashing.get_hash_fn_by_name`` + ``vllm.v1.core.kv_cache_utils.init_none_hash``
+ ``get_request_block_hasher`` applied to real ``vllm.v1.request.Request`` objects (with a
``LoRARequest`` and ``cache_salt`` where a case has them).

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

import vllm
from vllm.lora.request import LoRARequest
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
    ]


def vllm_hashes(case: dict, hash_fn) -> list[bytes]:
    hasher = kv_cache_utils.get_request_block_hasher(case["hash_block_size"], hash_fn)
    lora = None
    if case.get("lora_name") is not None:
        lora = LoRARequest(case["lora_name"], 1, case["lora_path"])
    req = Request(
        request_id=case["name"],
        prompt_token_ids=list(case["tokens"]),
        sampling_params=SamplingParams(max_tokens=16),
        pooling_params=None,
        lora_request=lora,
        cache_salt=case.get("cache_salt"),
        block_hasher=hasher,
    )
    one_shot = [bytes(h) for h in req.block_hashes]
    # Sanity: vLLM's own incremental path (prompt, then output tokens one at a time)
    # agrees with the one-shot hashes we record.
    split = len(case["tokens"]) // 2
    inc = Request(
        request_id=case["name"] + "-inc",
        prompt_token_ids=list(case["tokens"][:split]) or [0],
        sampling_params=SamplingParams(max_tokens=len(case["tokens"]) + 1),
        pooling_params=None,
        lora_request=lora,
        cache_salt=case.get("cache_salt"),
        block_hasher=hasher,
    )
    if split:
        for t in case["tokens"][split:]:
            inc.append_output_token_ids(t)
        assert [bytes(h) for h in inc.block_hashes] == one_shot, case["name"]
    return one_shot


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
            hashes = vllm_hashes(case, hash_fn)
            doc["cases"].append({
                **{k: case.get(k) for k in ("name", "hash_block_size", "cache_salt",
                                            "lora_name", "lora_path")},
                "algo": algo,
                "tokens": case["tokens"],
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
