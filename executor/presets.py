"""Named model presets: real hybrid architectures' layer mixes and ratios, scaled down so a
2-core CPU runs them in milliseconds per step (a few layers, hidden 128, vocab 1000).

Real shapes they imitate are listed in docs/executor.md.
"""

from __future__ import annotations

import math

from executor.model_config import ModelConfig

_BASE = ModelConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_heads=4,
                    num_kv_heads=1, head_dim=32, mamba2_heads=4, mamba2_head_dim=32,
                    mamba2_d_state=16, mamba1_d_inner=128, mamba1_d_state=16, mamba1_dt_rank=8,
                    max_model_len=2048, tie_embeddings=False)

PRESETS: dict[str, ModelConfig] = {
    # PLaMo-2: Mamba-2 on even layers, sliding-window attention (1 kv head) on odd ones.
    "plamo2-like": _BASE.replace(name="plamo2-like", pattern="MSMSMS", sliding_window=64),
    # Jamba: Mamba-1 with dt/B/C norms, one NoPE full-attention layer per period (offset 2).
    "jamba-like": _BASE.replace(name="jamba-like", pattern="mmFm", use_rope=False,
                                mamba1_inner_norms=True),
    # Gemma 3: 5 sliding : 1 full, qk-norm, sandwich (1+w) norms, scaled embeddings,
    # local/global RoPE bases, query_pre_attn_scalar.
    "gemma3-like": _BASE.replace(name="gemma3-like", pattern="SSSSSF", sliding_window=32,
                                 norm_unit_offset=True, sandwich_norm=True, qk_norm=True,
                                 embed_scale=math.sqrt(128), mlp_activation="gelu_tanh",
                                 rope_theta=1_000_000.0, rope_theta_local=10_000.0,
                                 query_pre_attn_scalar=32.0),
    # Nemotron-H: mostly Mamba-2 (grouped B/C), NoPE GQA attention.
    "nemotron-h-like": _BASE.replace(name="nemotron-h-like", pattern="MMFMM", use_rope=False,
                                     num_kv_heads=2, mamba2_groups=2),
    # Everything at once: full + sliding window + Mamba-2.
    "hybrid-fsm": _BASE.replace(name="hybrid-fsm", pattern="MSFM", sliding_window=48),
}

DEFAULT_PRESET = "hybrid-fsm"


def get_preset(name: str) -> ModelConfig:
    """The preset called ``name``; ValueError naming the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"preset: unknown name {name!r}; expected one of "
                         f"{sorted(PRESETS)}") from None
