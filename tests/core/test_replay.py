"""The conformance replay tool: committed samples equal vLLM 0.33's outputs; CLI errors."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cache_service.replay import (
    ConfigFileError,
    main,
    make_pool,
    read_expected,
    replay,
    same_result,
)

from builders import SAMPLES

TRACES = sorted(p for p in SAMPLES.glob("*.jsonl") if not p.name.endswith(".expected.jsonl"))


def expected_path(trace: Path) -> Path:
    return trace.with_name(trace.name.removesuffix(".jsonl") + ".expected.jsonl")


def run(config: dict, trace: str) -> list[dict]:
    out = io.StringIO()
    replay(make_pool(config), io.StringIO(trace), out)
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_every_sample_config_has_traces() -> None:
    configs = {p.stem for p in SAMPLES.glob("*.json")}
    assert configs >= {"full", "full_swa", "full_mamba", "swa_mamba_nocache",
                       "full_swa_mamba_nocache", "full_mamba32"}
    assert {t.name.split(".")[0] for t in TRACES} == configs


@pytest.mark.parametrize("trace", TRACES, ids=lambda p: p.name)
def test_sample_equals_vllm_oracle(trace: Path) -> None:
    config = json.loads((SAMPLES / f"{trace.name.split('.')[0]}.json").read_text())
    _, expected = read_expected(expected_path(trace).read_text())
    ours = run(config, trace.read_text())
    assert len(ours) == len(expected)
    bad = [i for i, (o, e) in enumerate(zip(ours, expected)) if not same_result(o, e)]
    assert not bad, f"op {bad[0]}: ours {ours[bad[0]]} vs vLLM {expected[bad[0]]}"


def test_output_format() -> None:
    cfg = {"num_blocks": 16, "max_model_len": 64,
           "groups": [{"type": "full_attention", "block_size": 4}]}
    trace = "\n".join([
        "# comment", "",
        '{"op":"add","req":"a","tokens":[1,2,3,4,5]}',
        '{"op":"lookup","req":"a"}',
        '{"op":"allocate","req":"a","num_new_tokens":5}',
        '{"op":"blocks","req":"a"}',
        '{"op":"usage"}',
        '{"op":"free","req":"a"}',
        '{"op":"free","req":"a"}',
        '{"op":"nope"}',
        "not json",
        '{"op":"reset"}',
    ])
    out = run(cfg, trace)
    assert out[0] == {"op": "add", "req": "a", "num_tokens": 5, "num_block_hashes": 1}
    assert out[1] == {"op": "lookup", "req": "a", "hit_tokens": 0, "block_ids": [[]]}
    assert out[2] == {"op": "allocate", "req": "a", "ok": True, "hit_tokens_used": 0,
                      "num_computed_tokens": 5, "new_block_ids": [[1, 2]], "block_ids": [[1, 2]]}
    assert out[3] == {"op": "blocks", "req": "a", "block_ids": [[1, 2]],
                      "num_computed_tokens": 5, "num_tokens": 5}
    assert out[4]["usage"] == pytest.approx(2 / 15) and out[4]["num_cached_blocks"] == 1
    assert out[5] == {"op": "free", "req": "a", "num_free_blocks": 15}
    assert "UnknownRequest" in out[6]["error"] and "unknown op" in out[7]["error"]
    assert out[8]["line"] == 11 and "bad JSON" in out[8]["error"]
    assert out[9] == {"op": "reset", "ok": True}


@pytest.mark.parametrize("config,message", [
    ({"max_model_len": 64, "groups": []}, "num_blocks"),
    ({"num_blocks": 8, "max_model_len": 64, "groups": [{"type": "lstm", "block_size": 4}]},
     "groups[0].type"),
    ({"num_blocks": 8, "max_model_len": 64, "groups": [{"type": "full_attention"}]},
     "groups[0].block_size"),
    ({"num_blocks": 8, "max_model_len": 64, "groups": [
        {"type": "sliding_window", "block_size": 4, "sliding_window": -1}]}, "sliding_window"),
    ({"num_blocks": 8, "max_model_len": 64, "colour": 1, "groups": []}, "colour"),
    ({"num_blocks": 8, "max_model_len": 64, "hash_algo": "md5",
      "groups": [{"type": "full_attention", "block_size": 4}]}, "hash_algo"),
    ({"num_blocks": 8, "max_model_len": 64, "groups": [
        {"type": "full_attention", "block_size": 4},
        {"type": "mamba", "block_size": 4, "mamba_cache_mode": "none"}]}, "mamba_cache_mode"),
    ({"num_blocks": 8, "max_model_len": 64, "host_tier_blocks": "8",
      "groups": [{"type": "full_attention", "block_size": 4}]}, "host_tier_blocks"),
    ({"num_blocks": 8, "max_model_len": 64, "host_tier_blocks": -1,
      "groups": [{"type": "full_attention", "block_size": 4}]}, "host_tier_blocks"),
    ({"num_blocks": 8, "max_model_len": 64, "host_tier_blocks": 8, "enable_caching": False,
      "groups": [{"type": "full_attention", "block_size": 4}]}, "host_tier_blocks"),
])
def test_bad_config_is_a_clear_error(config, message) -> None:
    with pytest.raises(ConfigFileError, match=message.replace("[", r"\[").replace("]", r"\]")):
        make_pool(config)


def test_cli_bad_config_exits_2(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "c.json"
    bad.write_text('{"num_blocks": 8}')
    assert main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad config" in err and "max_model_len" in err and err.count("\n") == 1
    assert main(["--config", str(tmp_path / "missing.json")]) == 2


def test_cli_end_to_end(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "cache_service.replay", "--config", str(SAMPLES / "full.json")],
        input='{"op":"add","req":"a","tokens":[1,2]}\n{"op":"free","req":"b"}\n',
        capture_output=True, text=True, check=True)
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert lines[0]["num_tokens"] == 2 and "error" in lines[1]
    helptext = subprocess.run([sys.executable, "-m", "cache_service.replay", "--help"],
                              capture_output=True, text=True, check=True).stdout
    assert "--config" in helptext and "allocate" in helptext
