"""The hybrid decoder: embedding -> N x (norm, mixer, residual, norm, MLP, residual) -> norm ->
logits. Mixers are chosen per layer from the pattern (see ``executor.model_config``).

``forward`` takes packed tokens of several requests plus ``ForwardMeta`` and the per-layer cache
tensors; it never allocates cache memory itself. Weights are random but deterministic in
``config.seed`` (same seed -> bit-identical weights), or loaded (``executor.hf_loader``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor, nn

from executor.forward_meta import AttentionMeta, ForwardMeta, MambaMeta
from executor.layers import Attention, GatedMLP, Mamba1Mixer, Mamba2Mixer, RMSNorm
from executor.model_config import ModelConfig


class LayerCaches(Protocol):
    """What the model needs from the cache: per layer, its group id and its two tensors
    ((k, v) for attention, (conv, ssm) for Mamba)."""

    layer_group: Sequence[int]
    layer_tensors: Sequence[tuple[Tensor, Tensor]]


def layer_name(i: int, kind: str) -> str:
    """The cache-spec name of layer i (what the cache service groups)."""
    return f"layers.{i}.{'attn' if kind in ('full_attention', 'sliding_window') else 'mamba'}"


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.kind = cfg.layer_kind(index)
        eps, off = cfg.rms_norm_eps, cfg.norm_unit_offset
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, off)
        if self.kind in ("full_attention", "sliding_window"):
            self.mixer: nn.Module = Attention(cfg, sliding=self.kind == "sliding_window")
        elif self.kind == "mamba2":
            self.mixer = Mamba2Mixer(cfg)
        else:
            self.mixer = Mamba1Mixer(cfg)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, eps, off)
        self.mlp = GatedMLP(cfg)
        if cfg.sandwich_norm:
            self.post_mixer_layernorm: RMSNorm | None = RMSNorm(cfg.hidden_size, eps, off)
            self.post_ff_layernorm: RMSNorm | None = RMSNorm(cfg.hidden_size, eps, off)
        else:
            self.post_mixer_layernorm = self.post_ff_layernorm = None

    def forward(self, h: Tensor, meta: ForwardMeta, group_meta: AttentionMeta | MambaMeta,
                cache: tuple[Tensor, Tensor]) -> Tensor:
        """One layer (norm, mixer, norm, MLP, residuals) over the packed hidden states ``h``."""
        x = self.input_layernorm(h)
        if isinstance(self.mixer, Attention):
            x = self.mixer(x, meta.positions, meta.query_start_loc, group_meta, cache)
        else:
            x = self.mixer(x, meta.query_start_loc, meta.is_decode, group_meta, cache)
        if self.post_mixer_layernorm is not None:
            x = self.post_mixer_layernorm(x)
        h = h + x
        x = self.mlp(self.pre_ff_layernorm(h))
        if self.post_ff_layernorm is not None:
            x = self.post_ff_layernorm(x)
        return h + x


class HybridModel(nn.Module):
    def __init__(self, cfg: ModelConfig, *, init: bool = True) -> None:
        super().__init__()
        self.config = cfg.validate()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.lm_head = (None if cfg.tie_embeddings
                        else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
        if init:
            init_random_weights(self, cfg.seed, cfg.weight_scale)
        self.to(getattr(torch, cfg.dtype))
        self.eval()
        self.requires_grad_(False)

    @property
    def layer_names(self) -> list[str]:
        """The name of every layer, in order, as the cache pool knows them."""
        cfg = self.config
        return [layer_name(i, cfg.layer_kind(i)) for i in range(cfg.num_layers)]

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, meta: ForwardMeta, caches: LayerCaches) -> Tensor:
        """input_ids [T] (packed) -> final hidden states [T, hidden] (after the last norm)."""
        h = self.embed_tokens(input_ids)
        if self.config.embed_scale != 1.0:
            h = h * torch.tensor(self.config.embed_scale, dtype=h.dtype)
        for i, layer in enumerate(self.layers):
            g = caches.layer_group[i]
            h = layer(h, meta, meta.groups[g], caches.layer_tensors[i])
        return self.norm(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, hidden] -> fp32 logits [N, vocab]."""
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = (hidden @ w.t()).float()
        cap = self.config.final_logit_softcap
        return cap * torch.tanh(logits / cap) if cap else logits


def _inv_softplus(x: Tensor) -> Tensor:
    return x + torch.log(-torch.expm1(-x))


def init_random_weights(model: HybridModel, seed: int, scale: float = 1.0) -> None:
    """Deterministic random weights: parameters are filled in registration order from one
    seeded generator. Embeddings have std 1 so tied logits spread widely (greedy decoding then
    has clear winners and is robust to fp32 reassociation)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name:
                continue  # ones (or zeros for (1 + w) norms): identity at init
            if leaf == "A_log":
                if p.dim() == 1:  # Mamba-2: one decay per head
                    p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 15 + 1))
                else:  # Mamba-1: S4D-real init, A = -(1..N) per channel
                    one_to_n = torch.arange(1, p.shape[1] + 1, dtype=torch.float32)
                    p.copy_(torch.log(one_to_n).expand_as(p))
            elif leaf == "dt_bias" or name.endswith("dt_proj.bias"):
                dt = torch.exp(torch.rand(p.shape, generator=gen) * (math.log(0.1) - math.log(1e-3))
                               + math.log(1e-3))
                p.copy_(_inv_softplus(dt))
            elif leaf == "D":
                p.fill_(1.0)
            elif leaf == "conv_weight":
                p.copy_(torch.randn(p.shape, generator=gen) * scale / math.sqrt(p.shape[1]))
            elif leaf.endswith("bias"):
                p.zero_()
            elif name == "embed_tokens.weight" or name == "lm_head.weight":
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * scale / math.sqrt(p.shape[1]))
