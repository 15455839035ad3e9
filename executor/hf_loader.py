"""Load Hugging Face checkpoints (``config.json`` + ``*.safetensors``) into ``HybridModel``.

Supported architectures (chosen because their module structure maps 1:1 onto ours):

* ``bamba`` (IBM Bamba: Mamba-2 + full attention, partial RoPE, gated RMSNorm in groups);
* ``gemma3_text`` (Gemma 3 text: sliding : full layers as ``layer_types`` says, qk-norm,
  sandwich (1 + w) norms, scaled embeddings, local/global RoPE bases, query_pre_attn_scalar,
  GELU-tanh MLP).

``config.json`` is read the way transformers reads it: ``AutoConfig`` (transformers >= 5)
turns the 4.x layout (``rope_scaling``, flat ``rope_theta``, ``rope_local_base_freq``,
``sliding_window_pattern`` ...) into the 5.x one (``rope_parameters`` per layer type,
``layer_types``) and fills the architecture's defaults. Every key of the file either changes
nothing in the forward pass (:data:`NO_MATH_KEYS`), is honoured, or is refused: a ValueError
names the key. A checkpoint loads with transformers' logits or not at all.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from executor.errors import SettingError
from executor.model import HybridModel
from executor.model_config import ModelConfig

DEFAULT_MAX_MODEL_LEN = 4096  # checkpoints advertise 128k+; the pool must fit one such request

#: Keys that do not change the forward pass: bookkeeping, generation and training settings.
NO_MATH_KEYS = frozenset({
    "_name_or_path", "architectures", "transformers_version", "model_type", "dtype",
    "torch_dtype", "id2label", "label2id", "problem_type", "return_dict", "output_attentions",
    "output_hidden_states", "chunk_size_feed_forward", "is_encoder_decoder", "use_cache",
    "cache_implementation", "pad_token_id", "bos_token_id", "eos_token_id", "initializer_range",
    "attention_dropout", "num_logits_to_keep", "z_loss_coefficient", "time_step_min",
    "time_step_max", "time_step_floor", "_sliding_window_pattern", "attn_implementation",
})

#: 4.x keys AutoConfig folds into a 5.x key: honoured exactly when that key is.
LEGACY_KEYS = {"rope_scaling": "rope_parameters", "rope_theta": "rope_parameters",
               "rope_local_base_freq": "rope_parameters",
               "partial_rotary_factor": "rope_parameters", "sliding_window_pattern": "layer_types"}


class _Keys:
    """The normalized config with a record of every key read (to refuse the unread ones)."""

    def __init__(self, normalized: dict[str, Any], raw: dict[str, Any]) -> None:
        self.values = normalized
        self.raw = raw
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return self.values[key]

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        value = self.values.get(key)
        return default if value is None else value

    def require(self, key: str, allowed: Any, why: str) -> Any:
        """The value of ``key``; ValueError naming it unless it is one of ``allowed``."""
        value = self.get(key)
        if value not in allowed:
            raise ValueError(f"{key}: {value!r} is not supported ({why})")
        return value

    def unread(self) -> list[str]:
        """Keys of the file that were neither read nor free of math."""
        honoured = self.read | {old for old, new in LEGACY_KEYS.items() if new in self.read}
        return sorted(set(self.raw) - honoured - NO_MATH_KEYS)

    def rope(self, layer_type: str | None) -> tuple[float, float, float]:
        """(theta, linear scaling factor, partial rotary factor) of the layers of
        ``layer_type`` (``rope_parameters`` is flat, or keyed by layer type). Default and
        linear RoPE only; any other type or parameter is refused, named as the file names it."""
        params = self.get("rope_parameters") or {}
        keyed = layer_type is not None and layer_type in params
        p = params[layer_type] if keyed else params
        where = "rope_scaling" if "rope_scaling" in self.raw else (
            f"rope_parameters.{layer_type}" if keyed else "rope_parameters")
        kind = p.get("rope_type", "default")
        if kind not in ("default", "linear"):
            raise ValueError(f"{where}.rope_type: {kind!r} is not supported (default or linear "
                             f"RoPE only)")
        known = {"rope_type", "rope_theta", "partial_rotary_factor"}
        if kind == "linear":
            known.add("factor")
        extra = sorted(set(p) - known)
        if extra:
            raise ValueError(f"{where}.{extra[0]}: not supported with rope_type {kind!r}")
        if "rope_theta" not in p:
            raise ValueError(f"rope_parameters: no rope_theta for "
                             f"{layer_type or 'the attention layers'}")
        return (float(p["rope_theta"]), float(p["factor"]) if kind == "linear" else 1.0,
                float(p.get("partial_rotary_factor", 1.0)))


def _max_len(c: _Keys, max_model_len: int | None) -> int:
    limit = int(c["max_position_embeddings"])
    if max_model_len is None:
        return min(DEFAULT_MAX_MODEL_LEN, limit)
    if max_model_len > limit:
        raise SettingError(f"{max_model_len} exceeds the checkpoint's max_position_embeddings "
                           f"{limit}", field="--max-model-len")
    return max_model_len


def bamba_config(c: _Keys, max_model_len: int | None) -> ModelConfig:
    """The ModelConfig of a Hugging Face Bamba config (Mamba-2 and attention layers); raises on
    a key whose value this model cannot honour."""
    n = c["num_hidden_layers"]
    attn = set(c.get("attn_layer_indices") or [])
    c.require("hidden_act", ("silu",), "silu only")
    c.require("mlp_bias", (False,), "the MLP has no bias")
    heads = c["num_attention_heads"]
    hidden = c["hidden_size"]
    d_inner = int(c["mamba_expand"] * hidden)
    m_heads = c["mamba_n_heads"]
    d_head = c["mamba_d_head"]
    if d_head in (None, "auto"):
        d_head = d_inner // m_heads
    if d_head * m_heads != d_inner:
        raise ValueError("mamba_d_head: mamba_n_heads * mamba_d_head must equal "
                         "mamba_expand * hidden_size")
    limit = c.get("time_step_limit") or (0.0, float("inf"))
    theta, factor, fraction = c.rope(None)
    return ModelConfig(
        name="bamba", pattern="".join("F" if i in attn else "M" for i in range(n)),
        vocab_size=c["vocab_size"], hidden_size=hidden, intermediate_size=c["intermediate_size"],
        rms_norm_eps=c["rms_norm_eps"], tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or hidden // heads,
        rope_theta=theta, rope_linear_factor=factor, rope_fraction=fraction,
        attention_bias=bool(c.get("attention_bias", False)),
        mamba2_heads=m_heads, mamba2_head_dim=d_head, mamba2_groups=c["mamba_n_groups"],
        mamba2_d_state=c["mamba_d_state"], mamba2_chunk_size=c["mamba_chunk_size"],
        mamba2_dt_limit=(float(limit[0]), float(limit[1])), mamba_d_conv=c["mamba_d_conv"],
        mamba_conv_bias=bool(c["mamba_conv_bias"]), mamba_proj_bias=bool(c["mamba_proj_bias"]),
        max_model_len=_max_len(c, max_model_len),
    ).validate()


def gemma3_config(c: _Keys, max_model_len: int | None) -> ModelConfig:
    """The ModelConfig of a Hugging Face Gemma 3 text config (sliding and full attention
    layers); raises on a key whose value this model cannot honour."""
    n = c["num_hidden_layers"]
    types = list(c["layer_types"])
    if len(types) != n:
        raise ValueError(f"layer_types: {len(types)} entries for {n} layers")
    for i, t in enumerate(types):
        if t not in ("sliding_attention", "full_attention"):
            raise ValueError(f"layer_types[{i}]: {t!r} is not supported")
    c.require("use_bidirectional_attention", (False, None), "only causal attention")
    c.require("hidden_activation", ("gelu_pytorch_tanh",), "gelu_pytorch_tanh only")
    theta, factor, fraction = c.rope("full_attention")
    theta_local, factor_local, fraction_local = c.rope("sliding_attention")
    if fraction != 1.0 or fraction_local != 1.0:
        raise ValueError("rope_parameters.partial_rotary_factor: Gemma 3 rotates every channel")
    hidden = c["hidden_size"]
    head_dim = c["head_dim"]
    return ModelConfig(
        name="gemma3", pattern="".join("S" if t == "sliding_attention" else "F" for t in types),
        vocab_size=c["vocab_size"], hidden_size=hidden, intermediate_size=c["intermediate_size"],
        mlp_activation="gelu_tanh", rms_norm_eps=c["rms_norm_eps"], norm_unit_offset=True,
        sandwich_norm=True, embed_scale=hidden ** 0.5,
        tie_embeddings=bool(c.get("tie_word_embeddings", True)),
        final_logit_softcap=c.get("final_logit_softcapping"),
        num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"],
        head_dim=head_dim,
        rope_theta=theta, rope_theta_local=theta_local,
        rope_linear_factor=factor, rope_linear_factor_local=factor_local,
        sliding_window=c["sliding_window"], qk_norm=True,
        query_pre_attn_scalar=float(c.get("query_pre_attn_scalar") or head_dim),
        attn_softcap=c.get("attn_logit_softcapping"),
        attention_bias=bool(c.get("attention_bias", False)),
        max_model_len=_max_len(c, max_model_len),
    ).validate()


def _map_bamba(name: str) -> str | None:
    name = name.removeprefix("model.")
    if name == "final_layernorm.weight":
        return "norm.weight"
    name = (name.replace(".feed_forward.", ".mlp.").replace(".self_attn.", ".mixer.")
            .replace(".mamba.conv1d.weight", ".mixer.conv_weight")
            .replace(".mamba.conv1d.bias", ".mixer.conv_bias")
            .replace(".mamba.norm.weight", ".mixer.norm_weight").replace(".mamba.", ".mixer."))
    return name


def _map_gemma3(name: str) -> str | None:
    name = name.removeprefix("model.").removeprefix("language_model.")
    return (name.replace(".self_attn.", ".mixer.")
            .replace(".post_attention_layernorm.", ".post_mixer_layernorm.")
            .replace(".pre_feedforward_layernorm.", ".pre_ff_layernorm.")
            .replace(".post_feedforward_layernorm.", ".post_ff_layernorm."))


#: model_type -> (its ModelConfig from the config's keys, a checkpoint tensor's name -> ours).
ARCHITECTURES: dict[str, tuple[Callable[[_Keys, int | None], ModelConfig],
                               Callable[[str], str | None]]] = {
    "bamba": (bamba_config, _map_bamba), "gemma3_text": (gemma3_config, _map_gemma3)}


def read_config(path: str | Path, max_model_len: int | None = None) -> ModelConfig:
    """The ModelConfig of the checkpoint at ``path``: ``config.json`` normalized by
    transformers' ``AutoConfig``; ValueError naming the first key that is not supported."""
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    model_type = raw.get("model_type", "")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type: {model_type!r} is not supported; expected one of "
                         f"{sorted(ARCHITECTURES)}")
    try:
        import transformers
        from transformers import AutoConfig
    except ImportError:
        raise ValueError("reading a checkpoint's config.json needs transformers >= 5 "
                         "(pip install 'kvcache-service[hf]')") from None
    if int(transformers.__version__.split(".")[0]) < 5:
        raise ValueError(f"transformers {transformers.__version__} is too old to normalize "
                         "config.json; >= 5 is needed")
    try:
        normalized = AutoConfig.from_pretrained(str(path), local_files_only=True).to_dict()
    except (ValueError, TypeError, KeyError) as exc:  # strict dataclass validation
        raise ValueError(f"config.json: transformers rejects it: {exc}") from None
    make_config, _ = ARCHITECTURES[model_type]
    keys = _Keys(normalized, raw)
    cfg = make_config(keys, max_model_len)
    unread = keys.unread()
    if unread:
        raise ValueError(f"{unread[0]}: not supported (this loader does not know what it changes)")
    return cfg


def load_hf_model(path: str | Path, *, max_model_len: int | None = None) -> HybridModel:
    """A ``HybridModel`` (fp32) with the checkpoint's weights. Every model parameter must be
    found in the checkpoint (tied ``lm_head`` excepted); unknown checkpoint tensors are errors.
    ``max_model_len``: the longest sequence served (default: the checkpoint's
    ``max_position_embeddings``, at most DEFAULT_MAX_MODEL_LEN)."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg = read_config(path, max_model_len)
    _, rename = ARCHITECTURES[json.loads((path / "config.json").read_text())["model_type"]]
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
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected "
                                 f"{tuple(target.shape)}")
            with torch.no_grad():
                target.copy_(tensor.to(target.dtype))
            loaded.add(ours)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return model
