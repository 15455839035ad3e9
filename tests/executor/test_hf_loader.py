"""Hugging Face checkpoints: tiny random-weight models built by ``transformers`` from a config
(no download), saved with save_pretrained, loaded into our model and run through the paged
cache (chunked prefill + decode steps): logits must match transformers' own forward. Each
checkpoint is read in the 5.x config layout (as save_pretrained writes it) and in the 4.x
layout published checkpoints ship (``rope_scaling``, flat ``rope_theta``,
``sliding_window_pattern`` ...); both must mean the same model. Keys that change the math and
are not supported are refused, named."""

from __future__ import annotations

import json

import pytest
import torch

from executor.errors import SettingError
from executor.hf_loader import load_hf_model, read_config

from paged_helpers import BlockSource, one_group_per_layer, run_chunks, tables_for

transformers = pytest.importorskip("transformers")

PROMPT_LENGTHS = (1, 23, 70)


def _bamba():
    """Bamba with rope_theta 50000 and head_dim 18: an odd rotary dimension (9 -> transformers
    rotates 10 channels at frequencies over 9)."""
    cfg = transformers.BambaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        attn_layer_indices=[1, 3], num_attention_heads=4, num_key_value_heads=2, head_dim=18,
        mamba_n_heads=4, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=32,
        max_position_embeddings=512, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    return cfg, transformers.BambaForCausalLM


def _bamba_4x(c: dict) -> dict:
    c = dict(c)
    del c["rope_parameters"]  # Bamba 4.x: a flat rope_theta (its rotary fraction is fixed)
    c["rope_theta"] = 50000.0
    return c


def _gemma3():
    """Gemma 3 with linear RoPE scaling (factor 8) on the full layers and the pattern SSFSSF."""
    cfg = transformers.Gemma3TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
        query_pre_attn_scalar=24, max_position_embeddings=512,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    return cfg, transformers.Gemma3ForCausalLM


def _gemma3_4x(c: dict) -> dict:
    c = {k: v for k, v in c.items() if k not in ("rope_parameters", "layer_types")}
    c.update(rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, sliding_window_pattern=3,
             rope_scaling={"rope_type": "linear", "factor": 8.0})
    return c


ARCHS = {"bamba": (_bamba, _bamba_4x, "MFMF"), "gemma3": (_gemma3, _gemma3_4x, "SSFSSF")}


def _random_model(cfg, cls):
    torch.manual_seed(0)
    hf = cls(cfg).eval()
    with torch.no_grad():  # larger weights than HF's init: logits that clearly differ
        for name, p in hf.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0.0, 0.2)
    return hf


def _rewrite_config(path, change) -> None:
    file = path / "config.json"
    file.write_text(json.dumps(change(json.loads(file.read_text()))))


@pytest.fixture(params=sorted(ARCHS))
def checkpoint(request, tmp_path):
    """(directory, transformers model, 4.x rewrite, expected pattern) of a saved checkpoint."""
    make, to_4x, pattern = ARCHS[request.param]
    cfg, cls = make()
    hf = _random_model(cfg, cls)
    hf.save_pretrained(tmp_path)
    return tmp_path, hf, to_4x, pattern


def test_logits_match_transformers_in_both_config_layouts(checkpoint) -> None:
    path, hf, to_4x, pattern = checkpoint
    ours = load_hf_model(path)
    assert ours.config.pattern == pattern
    cache = one_group_per_layer(ours.config, 16, num_blocks=256)
    src = BlockSource(num_blocks=256)
    gen = torch.Generator().manual_seed(1)
    vocab = ours.config.vocab_size
    refs = []
    for n in PROMPT_LENGTHS:
        tokens = torch.randint(0, vocab, (n + 3,), generator=gen)
        with torch.no_grad():
            ref = hf(tokens[None]).logits[0].float()
        refs.append((tokens, ref))
        # prompt in two chunks (when long enough), then three decode steps
        cuts = ([n // 2] if n > 1 else []) + [n, n + 1, n + 2, n + 3]
        got = run_chunks(ours, cache, tokens, cuts, tables_for(cache, n + 3, src))
        scale = ref.abs().max().item()
        torch.testing.assert_close(got, ref, atol=2e-4 * max(scale, 1.0), rtol=1e-4)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
    # The same checkpoint with a 4.x config.json: transformers reads the same model from it
    # (same logits), and so do we (the same ModelConfig, hence the logits above).
    _rewrite_config(path, to_4x)
    hf4 = type(hf).from_pretrained(path).eval()
    for tokens, ref in refs:
        with torch.no_grad():
            torch.testing.assert_close(hf4(tokens[None]).logits[0].float(), ref)
    assert read_config(path) == ours.config


def test_the_math_changing_keys_are_honoured(tmp_path) -> None:
    """Every key that changes the math (once read and then ignored) reaches ModelConfig."""
    cfg, _ = _bamba()
    cfg.save_pretrained(tmp_path)
    _rewrite_config(tmp_path, _bamba_4x)
    bamba = read_config(tmp_path)
    assert (bamba.rope_theta, bamba.rotary_dim, bamba.head_dim) == (50000.0, 9, 18)
    cfg, _ = _gemma3()
    cfg.save_pretrained(tmp_path)
    _rewrite_config(tmp_path, _gemma3_4x)
    gemma = read_config(tmp_path)
    assert gemma.pattern == "SSFSSF"
    assert (gemma.rope_linear_factor, gemma.rope_linear_factor_local) == (8.0, 1.0)
    assert (gemma.rope_theta, gemma.rope_theta_local) == (1_000_000.0, 10_000.0)


@pytest.mark.parametrize("arch,change,key", [
    ("gemma3", lambda c: {**_gemma3_4x(c), "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "rope_scaling.rope_type"),
    ("gemma3", lambda c: {**c, "rope_parameters": {
        "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "rope_parameters.full_attention.rope_type"),
    ("gemma3", lambda c: {**c, "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma3", lambda c: {**c, "mystery_knob": 3}, "mystery_knob"),
    ("bamba", lambda c: {**c, "mlp_bias": True}, "mlp_bias"),
    ("bamba", lambda c: {**c, "hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_keys_are_refused_by_name(tmp_path, arch: str, change, key: str) -> None:
    cfg, _ = ARCHS[arch][0]()
    cfg.save_pretrained(tmp_path)
    _rewrite_config(tmp_path, change)
    with pytest.raises(ValueError, match=f"^{key.replace('.', '[.]')}: "):
        read_config(tmp_path)


def test_unsupported_checkpoints_are_named(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type"):
        load_hf_model(tmp_path)


def test_max_model_len_is_the_settings_within_the_checkpoints(tmp_path) -> None:
    cfg, _ = _bamba()
    cfg.save_pretrained(tmp_path)
    assert read_config(tmp_path).max_model_len == 512  # max_position_embeddings < 4096
    assert read_config(tmp_path, 256).max_model_len == 256
    with pytest.raises(SettingError, match="^--max-model-len: 1024 exceeds"):
        read_config(tmp_path, 1024)


def test_executor_serves_a_checkpoint(cache_service, tmp_path) -> None:
    from executor.client import ExecutorClient
    from executor.launch import start_executor

    cfg, cls = _bamba()
    hf = _random_model(cfg, cls)
    hf.save_pretrained(tmp_path)
    prompt = list(range(1, 60))
    with torch.no_grad():  # greedy continuation, one token at a time
        ids = torch.tensor([prompt])
        for _ in range(4):
            ids = torch.cat([ids, hf(ids).logits[:, -1:].argmax(-1)], dim=1)
    proc = start_executor(cache_service.target, "--hf-checkpoint", str(tmp_path),
                          "--max-model-len", "256")
    try:
        with ExecutorClient(proc.target) as ex:
            info = ex.info()
            assert (info.model, info.max_model_len) == ("bamba", 256)
            assert ex.generate(prompt, 4).token_ids == ids[0, len(prompt):].tolist()
    finally:
        proc.stop()
