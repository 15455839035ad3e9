"""The executor's side of the KV cache: per-layer cache specs, and the physical tensors
allocated from the pool configuration the cache service answers.

Memory layout (vLLM's): all groups share one block-id space and a block id belongs to one group
at a time, so memory is one byte buffer per *layer slot* of ``num_blocks * page_size_bytes``;
layer j of every group views slot j. Block b of any layer lies in bytes
``[b * page, (b + 1) * page)`` of its slot, so two groups never overlap while they own different
blocks. The views are strided in the block dimension (the kernels index blocks, they never
flatten the cache). Memory = ``num_slots * num_blocks * page`` where ``num_slots`` is the largest
group's layer count — e.g. a 5 sliding : 1 full model needs one slot, not six.

Attention page: ``[2, block_size, Hkv, D]`` (K then V). Mamba page: conv state
``[W-1, conv_dim]`` then SSM state, padded to the shared page size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from cache_service.core.specs import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
)
from executor.forward_meta import GroupLayout
from executor.model import layer_name
from executor.model_config import ModelConfig

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def mamba_state_shapes(cfg: ModelConfig, kind: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(conv state shape, ssm state shape) of one request for a Mamba layer of ``kind``."""
    w = cfg.mamba_d_conv - 1
    if kind == "mamba2":
        return (w, cfg.mamba2_conv_dim), (cfg.mamba2_heads, cfg.mamba2_head_dim, cfg.mamba2_d_state)
    return (w, cfg.mamba1_d_inner), (cfg.mamba1_d_inner, cfg.mamba1_d_state)


def model_layer_specs(cfg: ModelConfig, *, block_size: int = 16,
                      mamba_cache_mode: MambaCacheMode = "align",
                      kernel_block_alignment: int = 16) -> dict[str, KVCacheSpec]:
    """Every layer's cache need, in layer order. Mamba hybrids are unified the way vLLM's
    platform code does it (attention block size raised until a page holds a Mamba state;
    Mamba pages padded; align mode: Mamba block size = attention block size)."""
    specs: dict[str, KVCacheSpec] = {}
    for i in range(cfg.num_layers):
        kind = cfg.layer_kind(i)
        name = layer_name(i, kind)
        if kind == "full_attention":
            specs[name] = FullAttentionSpec(block_size=block_size, num_kv_heads=cfg.num_kv_heads,
                                            head_size=cfg.head_dim, dtype=cfg.dtype)
        elif kind == "sliding_window":
            specs[name] = SlidingWindowSpec(block_size=block_size, num_kv_heads=cfg.num_kv_heads,
                                            head_size=cfg.head_dim, dtype=cfg.dtype,
                                            sliding_window=cfg.sliding_window)
        else:
            conv, ssm = mamba_state_shapes(cfg, kind)
            specs[name] = MambaSpec(block_size=cfg.max_model_len, shapes=(conv, ssm),
                                    dtypes=(cfg.dtype, cfg.dtype), mamba_type=kind,
                                    mamba_cache_mode=mamba_cache_mode)
    if any(isinstance(s, MambaSpec) for s in specs.values()):
        from cache_service.core.grouping import unify_mamba_hybrid

        specs = dict(unify_mamba_hybrid(specs, mamba_cache_mode=mamba_cache_mode,
                                        max_model_len=cfg.max_model_len,
                                        kernel_block_alignment=kernel_block_alignment))
    return specs


@dataclass(frozen=True)
class CacheGroup:
    """One KV-cache group of the pool: its layers (by name) and geometry."""

    layer_names: tuple[str, ...]
    layout: GroupLayout


class CacheTensors:
    """Physical cache of one model: ``layer_tensors[i]`` is (k, v) or (conv, ssm) of layer i,
    ``layer_group[i]`` the group whose block tables index it."""

    def __init__(self, cfg: ModelConfig, groups: Sequence[CacheGroup], num_blocks: int,
                 page_size_bytes: int, device: torch.device | str = "cpu") -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks: need the null block and at least one more, "
                             f"got {num_blocks}")
        self.cfg = cfg
        self.groups = list(groups)
        self.layout = [g.layout for g in self.groups]
        self.num_blocks = num_blocks
        self.page_size_bytes = page_size_bytes
        self.device = torch.device(device)
        names = [layer_name(i, cfg.layer_kind(i)) for i in range(cfg.num_layers)]
        where: dict[str, tuple[int, int]] = {}
        for g, info in enumerate(self.groups):
            for j, name in enumerate(info.layer_names):
                if name not in names:
                    raise ValueError(f"groups[{g}].layer_names: {name!r} is not a layer of "
                                     f"the model")
                where[name] = (g, j)
        missing = [n for n in names if n not in where]
        if missing:
            raise ValueError(f"groups: layers {missing} are in no group")
        self.num_slots = max((len(g.layer_names) for g in self.groups), default=0)
        self.slots = [torch.zeros(num_blocks, page_size_bytes, dtype=torch.uint8, device=device)
                      for _ in range(self.num_slots)]
        dtype = TORCH_DTYPES[cfg.dtype]
        self.layer_group: list[int] = []
        self.layer_tensors: list[tuple[Tensor, Tensor]] = []
        for i, name in enumerate(names):
            g, j = where[name]
            kind = cfg.layer_kind(i)
            gl = self.groups[g].layout
            expected = "attention" if kind in ("full_attention", "sliding_window") else "mamba"
            if gl.kind != expected:
                raise ValueError(f"groups[{g}]: layer {name!r} is {kind} but the group is "
                                 f"{gl.kind}")
            self.layer_group.append(g)
            self.layer_tensors.append(self._views(self.slots[j], kind, gl, dtype))

    def _views(self, slot: Tensor, kind: str, gl: GroupLayout,
               dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        cfg, n = self.cfg, self.num_blocks
        esize = torch.empty((), dtype=dtype).element_size()
        if kind in ("full_attention", "sliding_window"):
            per = gl.block_size * cfg.num_kv_heads * cfg.head_dim
            need = 2 * per * esize
            if need > self.page_size_bytes:
                raise ValueError(f"page_size_bytes: {self.page_size_bytes} < attention page {need}")
            kv = slot[:, :need].view(dtype).view(n, 2, gl.block_size, cfg.num_kv_heads,
                                                 cfg.head_dim)
            return kv[:, 0], kv[:, 1]
        conv_shape, ssm_shape = mamba_state_shapes(cfg, kind)
        conv_bytes = math.prod(conv_shape) * esize
        ssm_bytes = math.prod(ssm_shape) * esize
        if conv_bytes + ssm_bytes > self.page_size_bytes:
            raise ValueError(f"page_size_bytes: {self.page_size_bytes} < Mamba state "
                             f"{conv_bytes + ssm_bytes}")
        conv = slot[:, :conv_bytes].view(dtype).view(n, *conv_shape)
        ssm = slot[:, conv_bytes:conv_bytes + ssm_bytes].view(dtype).view(n, *ssm_shape)
        return conv, ssm

    def copy_blocks(self, copies: Sequence[tuple[int, int, int]]) -> None:
        """Run ``(group, src, dst)`` block copies in order: block ``dst`` of every layer of
        the group gets block ``src``'s data (a partial prefix hit's copy-on-write; the
        service answers them with the allocation). Must run before the step's forward."""
        for group, src, dst in copies:
            if not 0 <= group < len(self.groups):
                raise ValueError(f"block copy: group {group} is not in [0, {len(self.groups)})")
            for block in (src, dst):
                if not 0 < block < self.num_blocks:
                    raise ValueError(f"block copy: block {block} is not in [1, {self.num_blocks})")
            # A group's layer j lives in slot j, indexed by the pool's block ids.
            for slot in self.slots[:len(self.groups[group].layer_names)]:
                slot[dst].copy_(slot[src])

    @property
    def nbytes(self) -> int:
        """Bytes of cache memory: ``num_slots * num_blocks * page_size_bytes`` (the slots
        are byte tensors)."""
        return sum(s.numel() for s in self.slots)

