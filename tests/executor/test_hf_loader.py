"""Hugging Face checkpoints: tiny random-weight models built by ``transformers`` from a config
(no download), saved with save_pretrained, loaded into our model and run through the paged
cache (chunked prefill + decode steps): logits must match transformers' own forward."""

from __future__ import annotations

import json

import pytest
import torch

from executor.hf_loader import load_hf_model

from paged_helpers import BlockSource, one_group_per_layer
from test_model import run, tables_for

transformers = pytest.importorskip("transformers")

PROMPT_LENGTHS = (1, 23, 70)


def _bamba(tmp_path):
    cfg = transformers.BambaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        attn_layer_indices=[1, 3], num_attention_heads=4, num_key_value_heads=2,
        mamba_n_heads=4, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=32,
        max_position_embeddings=512, tie_word_embeddings=False)
    return cfg, transformers.BambaForCausalLM


def _gemma3(tmp_path):
    cfg = transformers.Gemma3TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
        query_pre_attn_scalar=24, max_position_embeddings=512)
    return cfg, transformers.Gemma3ForCausalLM


def _random_model(cfg, cls):
    torch.manual_seed(0)
    hf = cls(cfg).eval()
    with torch.no_grad():  # larger weights than HF's init: logits that clearly differ
        for name, p in hf.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0.0, 0.2)
    return hf


@pytest.mark.parametrize("arch", [_bamba, _gemma3], ids=["bamba", "gemma3"])
def test_logits_match_transformers(tmp_path, arch) -> None:
    cfg, cls = arch(tmp_path)
    hf = _random_model(cfg, cls)
    hf.save_pretrained(tmp_path)
    ours = load_hf_model(tmp_path)
    assert ours.config.pattern == ("MFMF" if cfg.model_type == "bamba" else "SSSSSF")
    cache = one_group_per_layer(ours.config, 16, num_blocks=256)
    src = BlockSource(num_blocks=256)
    gen = torch.Generator().manual_seed(1)
    for n in PROMPT_LENGTHS:
        tokens = torch.randint(0, cfg.vocab_size, (n + 3,), generator=gen)
        with torch.no_grad():
            ref = hf(tokens[None]).logits[0].float()
        # prompt in two chunks (when long enough), then three decode steps
        cuts = ([n // 2] if n > 1 else []) + [n, n + 1, n + 2, n + 3]
        got = run(ours, cache, tokens, cuts, tables_for(cache, n + 3, src))
        scale = ref.abs().max().item()
        torch.testing.assert_close(got, ref, atol=2e-4 * max(scale, 1.0), rtol=1e-4)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_unsupported_checkpoints_are_named(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type"):
        load_hf_model(tmp_path)


def test_executor_serves_a_checkpoint(cache_service, tmp_path) -> None:
    from executor.client import ExecutorClient
    from executor.launch import start_executor

    cfg, cls = _bamba(tmp_path)
    hf = _random_model(cfg, cls)
    hf.save_pretrained(tmp_path)
    prompt = list(range(1, 60))
    with torch.no_grad():  # greedy continuation, one token at a time
        ids = torch.tensor([prompt])
        for _ in range(4):
            ids = torch.cat([ids, hf(ids).logits[:, -1:].argmax(-1)], dim=1)
    proc = start_executor(cache_service.target, "--hf-checkpoint", str(tmp_path), "--max-model-len", "512")
    try:
        with ExecutorClient(proc.target) as ex:
            assert ex.info().model == "bamba"
            assert ex.generate(prompt, 4).token_ids == ids[0, len(prompt):].tolist()
    finally:
        proc.stop()
