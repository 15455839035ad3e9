"""Load Hugging Face checkpoints (``config.json`` + ``*.safetensors``) into ``HybridModel``.

Supported architectures (chosen because their module structure maps 1:1 onto ours):

* ``bamba`` (IBM Bamba: Mamba-2 + full attention, partial RoPE, gated RMSNorm in groups);
* ``gemma3_text`` (Gemma 3 text: 5 sliding : 1 full, qk-norm, sandwich (1 + w) norms, scaled
  embeddings, local/global RoPE bases, query_pre_attn_scalar, GELU-tanh MLP).

Only what our kernels compute is accepted: unsupported options (RoPE scaling, MoE, ...) raise
ValueError naming the config key instead of loading a subtly different model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from executor.config import ModelConfig
from executor.model import HybridModel

DEFAULT_MAX_MODEL_LEN = 4096  # checkpoints advertise 128k+; the pool must fit one such request


def _num(value: Any) -> float:
    """A float from config.json; transformers writes inf as {"__float__": "Infinity"}."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def _rope_theta(params: dict[str, Any] | None, key: str | None, default: float) -> float:
    """rope_theta from ``rope_parameters`` (flat, or keyed by layer type); default RoPE only."""
    if not params:
        return default
    p = params.get(key, params) if key else params
    if p.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters{'.' + key if key else ''}.rope_type: "
                         f"{p.get('rope_type')!r} is not supported (default RoPE only)")
    return float(p.get("rope_theta", default))


def bamba_config(c: dict[str, Any], max_model_len: int) -> ModelConfig:
    n = c["num_hidden_layers"]
    attn = set(c.get("attn_layer_indices") or [])
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: {c['hidden_act']!r} is not supported (silu only)")
    heads = c["num_attention_heads"]
    hidden = c["hidden_size"]
    d_inner = int(c.get("mamba_expand", 2) * hidden)
    m_heads = c["mamba_n_heads"]
    d_head = c.get("mamba_d_head", "auto")
    if d_head in (None, "auto"):
        d_head = d_inner // m_heads
    if d_head * m_heads != d_inner:
        raise ValueError("mamba_d_head: mamba_n_heads * mamba_d_head must equal mamba_expand * hidden_size")
    limit = c.get("time_step_limit") or (0.0, math.inf)
    rope = c.get("rope_parameters") or {}
    return ModelConfig(
        name="bamba", pattern="".join("F" if i in attn else "M" for i in range(n)),
        vocab_size=c["vocab_size"], hidden_size=hidden, intermediate_size=c["intermediate_size"],
        rms_norm_eps=c.get("rms_norm_eps", 1e-5), tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or hidden // heads,
        rope_theta=_rope_theta(rope, None, 10000.0),
        rope_fraction=float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.5))),
        attention_bias=bool(c.get("attention_bias", False)),
        mamba2_heads=m_heads, mamba2_head_dim=d_head, mamba2_groups=c.get("mamba_n_groups", 1),
        mamba2_d_state=c["mamba_d_state"], mamba2_chunk_size=c.get("mamba_chunk_size", 256),
        mamba2_dt_limit=(_num(limit[0]), _num(limit[1])), mamba_d_conv=c.get("mamba_d_conv", 4),
        mamba_conv_bias=bool(c.get("mamba_conv_bias", True)),
        mamba_proj_bias=bool(c.get("mamba_proj_bias", False)),
        max_model_len=min(max_model_len, int(c.get("max_position_embeddings", max_model_len))),
    ).validate()


def gemma3_config(c: dict[str, Any], max_model_len: int) -> ModelConfig:
    n = c["num_hidden_layers"]
    types = c.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    if c.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention: only causal attention is supported")
    act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation: {act!r} is not supported (gelu_pytorch_tanh only)")
    rope = c.get("rope_parameters") or {}
    hidden = c["hidden_size"]
    return ModelConfig(
        name="gemma3", pattern="".join("S" if t == "sliding_attention" else "F" for t in types),
        vocab_size=c["vocab_size"], hidden_size=hidden, intermediate_size=c["intermediate_size"],
        mlp_activation="gelu_tanh", rms_norm_eps=c.get("rms_norm_eps", 1e-6), norm_unit_offset=True,
        sandwich_norm=True, embed_scale=hidden ** 0.5, tie_embeddings=bool(c.get("tie_word_embeddings", True)),
        final_logit_softcap=c.get("final_logit_softcapping"),
        num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
        rope_theta=_rope_theta(rope, "full_attention", c.get("rope_theta", 1_000_000.0)),
        rope_theta_local=_rope_theta(rope, "sliding_attention", c.get("rope_local_base_freq", 10_000.0)),
        sliding_window=c["sliding_window"], qk_norm=True,
        query_pre_attn_scalar=float(c.get("query_pre_attn_scalar") or c["head_dim"]),
        attn_softcap=c.get("attn_logit_softcapping"), attention_bias=bool(c.get("attention_bias", False)),
        max_model_len=min(max_model_len, int(c.get("max_position_embeddings", max_model_len))),
    ).validate()


def _map_bamba(name: str) -> str | None:
    name = name.removeprefix("model.")
    if name == "final_layernorm.weight":
        return "norm.weight"
    name = (name.replace(".feed_forward.", ".mlp.").replace(".self_attn.", ".mixer.")
            .replace(".mamba.conv1d.weight", ".mixer.conv_weight").replace(".mamba.conv1d.bias", ".mixer.conv_bias")
            .replace(".mamba.norm.weight", ".mixer.norm_weight").replace(".mamba.", ".mixer."))
    return name


def _map_gemma3(name: str) -> str | None:
    name = name.removeprefix("model.").removeprefix("language_model.")
    return (name.replace(".self_attn.", ".mixer.").replace(".post_attention_layernorm.", ".post_mixer_layernorm.")
            .replace(".pre_feedforward_layernorm.", ".pre_ff_layernorm.")
            .replace(".post_feedforward_layernorm.", ".post_ff_layernorm."))


ARCHITECTURES = {"bamba": (bamba_config, _map_bamba), "gemma3_text": (gemma3_config, _map_gemma3)}


def load_hf_model(path: str | Path, *, max_model_len: int = DEFAULT_MAX_MODEL_LEN) -> HybridModel:
    """A ``HybridModel`` (fp32) with the checkpoint's weights. Every model parameter must be
    found in the checkpoint (tied ``lm_head`` excepted); unknown checkpoint tensors are errors."""
    from safetensors.torch import load_file

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    model_type = config.get("model_type", "")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type: {model_type!r} is not supported; expected one of {sorted(ARCHITECTURES)}")
    make_config, rename = ARCHITECTURES[model_type]
    cfg = make_config(config, max_model_len)
    model = HybridModel(cfg, init=False)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for f in files:
        for name, tensor in load_file(str(f)).items():
            ours = rename(name)
            if ours == "lm_head.weight" and cfg.tie_embeddings:
                continue
            if ours not in params:
                raise ValueError(f"{f.name}: tensor {name!r} has no counterpart in the model")
            target = params[ours]
            if ours.endswith("conv_weight"):
                tensor = tensor.squeeze(1)  # nn.Conv1d weight [C, 1, W] -> [C, W]
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected {tuple(target.shape)}")
            with torch.no_grad():
                target.copy_(tensor.to(target.dtype))
            loaded.add(ours)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return model
