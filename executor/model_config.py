"""The hybrid model's hyper-parameters (one frozen dataclass) and its layer pattern.

The pattern has one character per decoder layer: ``F`` full attention, ``S`` sliding-window
attention, ``M`` Mamba-2, ``m`` Mamba-1. Every layer is ``mixer + gated MLP`` with pre-norms
(Jamba / Bamba / Granite style); Gemma-style models add sandwich norms.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

LAYER_KINDS = {"F": "full_attention", "S": "sliding_window", "M": "mamba2", "m": "mamba1"}


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of one hybrid decoder. ``validate()`` names the offending field."""

    name: str = "custom"
    pattern: str = "FM"
    vocab_size: int = 1000
    hidden_size: int = 128
    intermediate_size: int = 256
    mlp_activation: str = "silu"  # "silu" | "gelu_tanh"
    rms_norm_eps: float = 1e-6
    norm_unit_offset: bool = False  # Gemma: RMSNorm weight is applied as (1 + w)
    sandwich_norm: bool = False  # Gemma 3: extra norms after the mixer and after the MLP
    embed_scale: float = 1.0  # Gemma: sqrt(hidden_size)
    tie_embeddings: bool = True
    final_logit_softcap: float | None = None
    # attention
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    use_rope: bool = True  # False: NoPE (Jamba, Granite-4.0-H, Nemotron-H)
    rope_theta: float = 10000.0  # full-attention layers
    rope_theta_local: float | None = None  # sliding layers; None -> rope_theta
    rope_fraction: float = 1.0  # partial rotary (Bamba: 0.5)
    rope_linear_factor: float = 1.0  # linear RoPE scaling of full-attention layers (positions / f)
    rope_linear_factor_local: float = 1.0  # the same for sliding-window layers
    sliding_window: int = 64
    qk_norm: bool = False  # Gemma 3: RMSNorm on q and k per head
    query_pre_attn_scalar: float | None = None  # scale = this ** -0.5 (None -> head_dim)
    attn_softcap: float | None = None
    attention_bias: bool = False
    # Mamba-2
    mamba2_heads: int = 4
    mamba2_head_dim: int = 32
    mamba2_groups: int = 1
    mamba2_d_state: int = 16
    mamba2_chunk_size: int = 64
    mamba2_dt_limit: tuple[float, float] = (0.0, math.inf)
    # Mamba-1
    mamba1_d_inner: int = 256
    mamba1_d_state: int = 16
    mamba1_dt_rank: int = 8
    mamba1_inner_norms: bool = False  # Jamba: RMSNorm on dt, B and C inside the mixer
    # shared by both Mamba kinds
    mamba_d_conv: int = 4
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    # runtime
    dtype: str = "float32"
    max_model_len: int = 4096
    seed: int = 0
    weight_scale: float = 1.0  # std multiplier of random weights (bigger -> clearer greedy argmax)

    @property
    def num_layers(self) -> int:
        """One layer per character of ``pattern``."""
        return len(self.pattern)

    @property
    def mamba2_d_ssm(self) -> int:
        """The Mamba-2 inner width: heads x head dim."""
        return self.mamba2_heads * self.mamba2_head_dim

    @property
    def mamba2_conv_dim(self) -> int:
        """The Mamba-2 conv channels: x, then B and C of every group."""
        return self.mamba2_d_ssm + 2 * self.mamba2_groups * self.mamba2_d_state

    @property
    def rotary_dim(self) -> int:
        """The RoPE dimension ``int(head_dim * rope_fraction)`` (Hugging Face's): frequencies
        are ``theta ** (-2i / rotary_dim)``; ``2 * ceil(rotary_dim / 2)`` channels rotate (one
        more than ``rotary_dim`` when it is odd)."""
        return int(self.head_dim * self.rope_fraction)

    def layer_kind(self, i: int) -> str:
        """The kind of layer ``i`` (from its ``pattern`` character)."""
        return LAYER_KINDS[self.pattern[i]]

    def validate(self) -> ModelConfig:
        """Answers ``self`` when every field is in range; raises ValueError naming the first
        field that is not."""

        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"ModelConfig.{name}: {why}")

        if not self.pattern or any(c not in LAYER_KINDS for c in self.pattern):
            raise bad("pattern", f"{self.pattern!r} must be a non-empty string over "
                                 f"{sorted(LAYER_KINDS)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                     "head_dim", "sliding_window", "mamba2_heads", "mamba2_head_dim",
                     "mamba2_groups", "mamba2_d_state", "mamba2_chunk_size", "mamba1_d_inner",
                     "mamba1_d_state", "mamba1_dt_rank", "mamba_d_conv", "max_model_len"):
            if getattr(self, name) <= 0:
                raise bad(name, "must be positive")
        if self.num_heads % self.num_kv_heads:
            raise bad("num_kv_heads", "must divide num_heads")
        if self.mamba2_heads % self.mamba2_groups:
            raise bad("mamba2_groups", "must divide mamba2_heads")
        if self.mamba_d_conv < 2:
            raise bad("mamba_d_conv", "must be at least 2")
        if self.mlp_activation not in ("silu", "gelu_tanh"):
            raise bad("mlp_activation", "must be 'silu' or 'gelu_tanh'")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise bad("dtype", "must be float32, bfloat16 or float16")
        if not 0.0 < self.rope_fraction <= 1.0:
            raise bad("rope_fraction", "must be in (0, 1]")
        rotated = -(-self.rotary_dim // 2) * 2  # an odd rotary_dim rotates one more channel
        if self.use_rope and not (self.rotary_dim >= 1 and rotated <= self.head_dim):
            raise bad("rope_fraction", f"rotates {self.rotary_dim} of {self.head_dim} channels")
        for name in ("rope_linear_factor", "rope_linear_factor_local"):
            if not getattr(self, name) >= 1.0:
                raise bad(name, "must be >= 1")
        return self

    def to_dict(self) -> dict[str, Any]:
        """The config as JSON-ready values (:meth:`from_dict` reads it back)."""
        d = asdict(self)
        d["mamba2_dt_limit"] = list(self.mamba2_dt_limit)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """The config of :meth:`to_dict`'s output, validated; raises ValueError on unknown
        fields."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"ModelConfig: unknown field(s) {unknown}")
        d = dict(d)
        if "mamba2_dt_limit" in d:
            d["mamba2_dt_limit"] = tuple(float(v) for v in d["mamba2_dt_limit"])
        return cls(**d).validate()

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with ``changes``, validated."""
        return replace(self, **changes).validate()


__all__ = ["LAYER_KINDS", "ModelConfig"]
