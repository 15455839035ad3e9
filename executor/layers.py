"""Decoder building blocks: norms, RoPE, gated MLP, paged attention, Mamba-2 and Mamba-1 mixers.

Every mixer reads and writes its cache only through the ``kernels`` API, with the metadata
of ``executor.forward_meta`` (packed tokens, block tables, slot mapping, state indices).
Prompts, chunked prefill and decode go through the same calls; pure-decode batches use the
single-step Mamba kernels. Parameter names follow Hugging Face's where that costs nothing
(loaders map the rest).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import kernels
from executor.forward_meta import AttentionMeta, MambaMeta
from executor.model_config import ModelConfig


class RMSNorm(nn.Module):
    """RMS normalisation over the last dim in fp32; ``unit_offset`` applies the weight as
    (1 + w) (Gemma)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: Tensor) -> Tensor:
        """``x`` normalised over its last dim in fp32, weighted, in ``x``'s dtype."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.float()
        h = h * (1.0 + w if self.unit_offset else w)
        return h.to(x.dtype)


def apply_rope(x: Tensor, positions: Tensor, *, theta: float, rotary_dim: int,
               linear_factor: float = 1.0) -> Tensor:
    """Rotate the first channels of every head (half-split "rotate_half" layout, as Hugging Face
    Llama/Gemma/Bamba do): ``ceil(rotary_dim / 2)`` frequencies ``theta ** (-2i / rotary_dim)``
    (so an odd ``rotary_dim`` rotates ``rotary_dim + 1`` channels, as transformers does),
    divided by ``linear_factor`` (linear RoPE scaling). x: [T, H, D]; positions: [T]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32,
                                             device=x.device) / rotary_dim))
    if linear_factor != 1.0:
        inv_freq = inv_freq / linear_factor
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos = torch.cat([freqs.cos(), freqs.cos()], -1)[:, None, :]
    sin = torch.cat([freqs.sin(), freqs.sin()], -1)[:, None, :]
    half = inv_freq.shape[0]
    rot, rest = x[..., :2 * half].float(), x[..., 2 * half:]
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], -1)
    out = (rot * cos + rotated * sin).to(x.dtype)
    return torch.cat([out, rest], -1) if rest.shape[-1] else out


class GatedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.activation = cfg.mlp_activation

    def forward(self, x: Tensor) -> Tensor:
        """down(act(gate(x)) * up(x))."""
        g = self.gate_proj(x)
        g = F.silu(g) if self.activation == "silu" else F.gelu(g, approximate="tanh")
        return self.down_proj(g * self.up_proj(x))


class Attention(nn.Module):
    """GQA attention over the paged KV cache (full or sliding window, RoPE or NoPE)."""

    def __init__(self, cfg: ModelConfig, *, sliding: bool) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias)
        if cfg.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(cfg.head_dim, cfg.rms_norm_eps,
                                                  cfg.norm_unit_offset)
            self.k_norm: RMSNorm | None = RMSNorm(cfg.head_dim, cfg.rms_norm_eps,
                                                  cfg.norm_unit_offset)
        else:
            self.q_norm = self.k_norm = None
        self.sliding_window = cfg.sliding_window if sliding else None
        theta = cfg.rope_theta_local if (sliding and cfg.rope_theta_local) else cfg.rope_theta
        self.rope_theta = theta if cfg.use_rope else None
        self.rotary_dim = cfg.rotary_dim
        self.rope_linear_factor = (cfg.rope_linear_factor_local if sliding
                                   else cfg.rope_linear_factor)
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.softcap = cfg.attn_softcap

    def forward(self, x: Tensor, positions: Tensor, query_start_loc: Tensor, meta: AttentionMeta,
                cache: tuple[Tensor, Tensor]) -> Tensor:
        """Attention of the packed tokens ``x`` [T, hidden] over their cached KV (written first
        at the slots ``meta`` names); returns [T, hidden]."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        if self.rope_theta is not None:
            q = apply_rope(q, positions, theta=self.rope_theta, rotary_dim=self.rotary_dim,
                           linear_factor=self.rope_linear_factor)
            k = apply_rope(k, positions, theta=self.rope_theta, rotary_dim=self.rotary_dim,
                           linear_factor=self.rope_linear_factor)
        k_cache, v_cache = cache
        kernels.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        o = kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                    query_start_loc, scale=self.scale,
                                    sliding_window=self.sliding_window, softcap=self.softcap)
        return self.o_proj(o.reshape(t, -1))


def _copy_states(meta: MambaMeta, states: tuple[Tensor, ...]) -> None:
    # align mode: move the previous checkpoint into this chunk's block before the kernels
    # update it in place (the checkpoint itself may be shared through the prefix cache).
    if meta.copy_src.numel():
        for s in states:
            s[meta.copy_dst] = s[meta.copy_src]


def _causal_conv(x: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor,
                 query_start_loc: Tensor, is_decode: bool, meta: MambaMeta) -> Tensor:
    """A mixer's causal conv1d with SiLU over ``x``: one token per sequence when
    ``is_decode``, else the packed prefill chunks (the conv state advances in place)."""
    if is_decode:
        return kernels.causal_conv1d_update(x, weight, bias, conv_states, meta.state_indices,
                                            activation="silu")
    return kernels.causal_conv1d(x, weight, bias, conv_states,
                                 query_start_loc, meta.state_indices, meta.has_initial_state,
                                 activation="silu")


class Mamba2Mixer(nn.Module):
    """in_proj -> [z | xBC | dt]; causal conv1d on xBC; SSD scan; gated RMSNorm(y, z); out_proj."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, d_ssm, conv_dim = cfg.mamba2_heads, cfg.mamba2_d_ssm, cfg.mamba2_conv_dim
        self.in_proj = nn.Linear(cfg.hidden_size, d_ssm + conv_dim + h, bias=cfg.mamba_proj_bias)
        self.conv_weight = nn.Parameter(torch.empty(conv_dim, cfg.mamba_d_conv))
        self.conv_bias = nn.Parameter(torch.zeros(conv_dim)) if cfg.mamba_conv_bias else None
        self.dt_bias = nn.Parameter(torch.zeros(h))
        self.A_log = nn.Parameter(torch.zeros(h))
        self.D = nn.Parameter(torch.ones(h))
        self.norm_weight = nn.Parameter(torch.ones(d_ssm))
        self.out_proj = nn.Linear(d_ssm, cfg.hidden_size, bias=cfg.mamba_proj_bias)

    def forward(self, x: Tensor, query_start_loc: Tensor, is_decode: bool, meta: MambaMeta,
                cache: tuple[Tensor, Tensor]) -> Tensor:
        """The Mamba-2 mixer over the packed tokens ``x`` [T, hidden]: reads and updates the
        conv and SSM states at the slots ``meta`` names; returns [T, hidden]."""
        cfg = self.cfg
        h, p, g, n = cfg.mamba2_heads, cfg.mamba2_head_dim, cfg.mamba2_groups, cfg.mamba2_d_state
        d_ssm = cfg.mamba2_d_ssm
        conv_states, ssm_states = cache
        _copy_states(meta, cache)
        z, xbc, dt = torch.split(self.in_proj(x), [d_ssm, cfg.mamba2_conv_dim, h], dim=-1)
        xbc = xbc.contiguous()
        xbc = _causal_conv(xbc, self.conv_weight, self.conv_bias, conv_states, query_start_loc,
                           is_decode, meta)
        xs, b, c = torch.split(xbc, [d_ssm, g * n, g * n], dim=-1)
        t = x.shape[0]
        # contiguous: the kernels may view their inputs (splits of one projection are strided)
        xs = xs.reshape(t, h, p).contiguous()
        b, c = b.reshape(t, g, n).contiguous(), c.reshape(t, g, n).contiguous()
        z, dt = z.contiguous(), dt.contiguous()
        a = -torch.exp(self.A_log.float())
        if is_decode:
            y = kernels.ssd_state_update(xs, dt, a, b, c, ssm_states, meta.state_indices,
                                         D=self.D, dt_bias=self.dt_bias, dt_softplus=True,
                                         dt_limit=cfg.mamba2_dt_limit)
        else:
            y = kernels.ssd_scan(xs, dt, a, b, c, ssm_states, query_start_loc, meta.state_indices,
                                 meta.has_initial_state, chunk_size=cfg.mamba2_chunk_size,
                                 D=self.D, dt_bias=self.dt_bias, dt_softplus=True,
                                 dt_limit=cfg.mamba2_dt_limit)
        y = kernels.gated_rms_norm(y.reshape(t, d_ssm), z, self.norm_weight, eps=cfg.rms_norm_eps,
                                   group_size=d_ssm // g, norm_before_gate=False)
        return self.out_proj(y)


class Mamba1Mixer(nn.Module):
    """in_proj -> [x | z]; causal conv1d on x; x_proj -> (dt, B, C) (optionally RMS-normed,
    Jamba); dt_proj without bias (the bias is the scan's delta_bias); selective scan gated by z."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, n, r = cfg.mamba1_d_inner, cfg.mamba1_d_state, cfg.mamba1_dt_rank
        self.in_proj = nn.Linear(cfg.hidden_size, 2 * d, bias=cfg.mamba_proj_bias)
        self.conv_weight = nn.Parameter(torch.empty(d, cfg.mamba_d_conv))
        self.conv_bias = nn.Parameter(torch.zeros(d)) if cfg.mamba_conv_bias else None
        self.x_proj = nn.Linear(d, r + 2 * n, bias=False)
        self.dt_proj = nn.Linear(r, d, bias=True)
        self.A_log = nn.Parameter(torch.zeros(d, n))
        self.D = nn.Parameter(torch.ones(d))
        self.out_proj = nn.Linear(d, cfg.hidden_size, bias=cfg.mamba_proj_bias)
        if cfg.mamba1_inner_norms:
            self.dt_layernorm: RMSNorm | None = RMSNorm(r, cfg.rms_norm_eps)
            self.b_layernorm: RMSNorm | None = RMSNorm(n, cfg.rms_norm_eps)
            self.c_layernorm: RMSNorm | None = RMSNorm(n, cfg.rms_norm_eps)
        else:
            self.dt_layernorm = self.b_layernorm = self.c_layernorm = None

    def forward(self, x: Tensor, query_start_loc: Tensor, is_decode: bool, meta: MambaMeta,
                cache: tuple[Tensor, Tensor]) -> Tensor:
        """The Mamba-1 mixer over the packed tokens ``x`` [T, hidden]: reads and updates the
        conv and SSM states at the slots ``meta`` names; returns [T, hidden]."""
        cfg = self.cfg
        n, r = cfg.mamba1_d_state, cfg.mamba1_dt_rank
        conv_states, ssm_states = cache
        _copy_states(meta, cache)
        xs, z = (p.contiguous() for p in self.in_proj(x).chunk(2, dim=-1))
        xs = _causal_conv(xs, self.conv_weight, self.conv_bias, conv_states, query_start_loc,
                          is_decode, meta)
        xs = xs.contiguous()
        dt, b, c = torch.split(self.x_proj(xs), [r, n, n], dim=-1)
        # Jamba's inner norms: all three or none (cfg.mamba1_inner_norms)
        if self.dt_layernorm is not None:
            dt = self.dt_layernorm(dt)
        if self.b_layernorm is not None:
            b = self.b_layernorm(b)
        if self.c_layernorm is not None:
            c = self.c_layernorm(c)
        dt = (dt @ self.dt_proj.weight.t()).contiguous()
        t = x.shape[0]
        b, c = b.reshape(t, 1, n).contiguous(), c.reshape(t, 1, n).contiguous()
        a = -torch.exp(self.A_log.float())
        if is_decode:
            y = kernels.selective_state_update(xs, dt, a, b, c, ssm_states, meta.state_indices,
                                               D=self.D, z=z, dt_bias=self.dt_proj.bias,
                                               dt_softplus=True)
        else:
            y = kernels.selective_scan(xs, dt, a, b, c, ssm_states, query_start_loc,
                                       meta.state_indices, meta.has_initial_state, D=self.D, z=z,
                                       delta_bias=self.dt_proj.bias, delta_softplus=True)
        return self.out_proj(y)
