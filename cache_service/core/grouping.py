"""Layer specs + a memory budget -> KV-cache groups and pool size (vLLM 0.33's
``kv_cache_planning``; docs/semantics.md#grouping).

A *group* is a set of layers that share one block table per request. All groups share one
pool and one block-id space: a block id stands for one page in every layer slot, so every
group must have the same page size, and one block id costs ``page_size_bytes(groups)``
= the largest group's summed layer pages (groups with fewer layers than the largest leave
"padding" unused). Steps, in order:

1. ``hybrid=False``: promote sliding-window / chunked-local layers of a model that also has
   full attention to full attention (keeping the window for the compute), or fail.
2. no layers -> no groups (the pool is only the null block);
3. all layers merge into one spec -> one group;
4. one type and block size, different pages -> one group with a UniformTypeKVCacheSpecs;
5. otherwise unify page sizes (pad Mamba; scale the block size of attention layers whose
   page divides the largest; else pad), bucket layers by spec, and split the buckets into
   groups of equal layer count (strided, so pipeline stages stay balanced).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from cache_service.core.errors import Checked, ConfigError
from cache_service.core.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaCacheMode,
    MambaSpec,
    SizingLimits,
    SlidingWindowSpec,
    SpecMergeError,
    UniformTypeKVCacheSpecs,
    cdiv,
    layer_spec,
)

#: vLLM 0.33's wording when the hybrid manager is off and the layers cannot become one type.
PROMOTION_FAILED = "Failed to promote local KV cache specs to one unified type."


def get_kv_cache_groups(layer_specs: Mapping[str, KVCacheSpec], *,
                        hybrid: bool = True) -> list[KVCacheGroupSpec]:
    """The KV-cache groups of a model, given each layer's spec in layer order.

    With ``hybrid=False`` the result is at most one group, or ConfigError
    (``field="hybrid"``). Every layer is in exactly one group.
    """
    specs = _checked_specs(layer_specs)
    if not hybrid:
        specs = _promote_local_specs(specs)
    if not specs:
        return []
    if _mergeable(list(specs.values())):
        merged = type(next(iter(specs.values()))).merge(list(specs.values()))
        return [KVCacheGroupSpec(tuple(specs), merged)]
    uniform = UniformTypeKVCacheSpecs.from_specs(specs)
    if uniform is not None:
        return [KVCacheGroupSpec(tuple(specs), uniform)]
    return _group_by_pattern(_unify_page_sizes(specs))


def get_kv_cache_config(layer_specs: Mapping[str, KVCacheSpec], *,
                        available_memory: Checked[int | None] = None,
                        num_blocks: Checked[int | None] = None,
                        limits: Checked[SizingLimits | None] = None,
                        hybrid: bool = True) -> KVCacheConfig:
    """The pool layout for these layers and exactly one of ``available_memory`` (bytes;
    ``num_blocks = available_memory // page_size_bytes``) or ``num_blocks`` (including the
    null block). With ``limits``, the usable blocks (all but the null block) must hold one
    request of ``limits.max_model_len`` tokens in every group (vLLM's startup check).
    """
    if (available_memory is None) == (num_blocks is None):
        raise ConfigError("give exactly one of available_memory and num_blocks",
                          field="num_blocks" if num_blocks is not None else "available_memory")
    budget_field = "available_memory" if num_blocks is None else "num_blocks"
    budget = available_memory if num_blocks is None else num_blocks
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise ConfigError(f"{budget_field} must be a non-negative integer, got {budget!r}",
                          field=budget_field)
    if limits is not None and not isinstance(limits, SizingLimits):
        raise ConfigError("limits must be a SizingLimits", field="limits")
    groups = get_kv_cache_groups(layer_specs, hybrid=hybrid)
    if not groups:
        # Attention-free model: the block pool still needs its null block.
        return KVCacheConfig(num_blocks=1, groups=())
    per_block = page_size_bytes(groups)
    blocks = budget if num_blocks is not None else budget // per_block
    if blocks < 2:
        raise ConfigError(
            f"{budget_field}={budget} gives {blocks} block(s) of {per_block} bytes; at least 2 "
            "are needed (block 0 is the null block)", field=budget_field)
    if limits is not None:
        needed = max_memory_usage_bytes(groups, limits)
        usable = (blocks - 1) * per_block
        if needed > usable:
            raise ConfigError(
                f"To serve at least one request with the model's max seq len "
                f"({limits.max_model_len}), {needed} bytes ({cdiv(needed, per_block)} blocks) of "
                f"KV cache are needed, which is larger than the available KV cache memory "
                f"({usable} bytes in {blocks - 1} usable blocks). Raise {budget_field} or lower "
                f"max_model_len.", field=budget_field)
    return KVCacheConfig(num_blocks=blocks, groups=tuple(groups))


def page_size_bytes(config_or_groups: KVCacheConfig | Sequence[KVCacheGroupSpec]) -> int:
    """Bytes one block id costs across all layers: the largest group's summed layer pages
    (what an executor allocates per block). 0 without groups."""
    groups = (config_or_groups.groups if isinstance(config_or_groups, KVCacheConfig)
              else config_or_groups)
    return max((sum(layer_spec(g.spec, name).page_size_bytes for name in g.layer_names)
                for g in groups), default=0)


def max_memory_usage_bytes(groups: Sequence[KVCacheGroupSpec], limits: SizingLimits) -> int:
    """Worst-case bytes of one request: each group claims its own blocks from the shared
    pool, so it is the sum of the groups' block needs times the bytes of a block id."""
    blocks = sum(cdiv(g.spec.max_memory_usage_bytes(limits), g.spec.page_size_bytes)
                 for g in groups)
    return blocks * page_size_bytes(groups)


def unify_mamba_hybrid(layer_specs: Mapping[str, KVCacheSpec], *, mamba_cache_mode: str,
                       max_model_len: int,
                       kernel_block_alignment: int = 16) -> dict[str, KVCacheSpec]:
    """Prepare a Mamba hybrid the way vLLM's platform code does before grouping.

    The attention block size is raised to the smallest multiple of
    ``max(kernel_block_alignment, current block size)`` (itself rounded to a multiple of
    ``kernel_block_alignment``) whose attention page holds one Mamba state; Mamba pages are
    padded to exactly that attention page. Mamba block size: the attention block size in
    ``"align"`` mode, ``max_model_len`` in ``"none"`` mode. Layers keep their order.
    """
    if mamba_cache_mode not in ("none", "align"):
        raise ConfigError(f"mamba_cache_mode must be 'none' or 'align', got "
                          f"{mamba_cache_mode!r}", field="mamba_cache_mode")
    mode: MambaCacheMode = "align" if mamba_cache_mode == "align" else "none"
    for value, name in ((max_model_len, "max_model_len"),
                        (kernel_block_alignment, "kernel_block_alignment")):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}", field=name)
    specs = _checked_specs(layer_specs)
    attention = {n: s for n, s in specs.items() if isinstance(s, AttentionSpec)}
    mamba = {n: s for n, s in specs.items() if isinstance(s, MambaSpec)}
    if not mamba:
        return specs
    out = dict(specs)
    if not attention:
        # Pure Mamba: nothing to align pages with.
        for name, spec in mamba.items():
            out[name] = replace(spec, mamba_cache_mode=mode,
                                block_size=spec.block_size if mode == "align"
                                else max_model_len)
        return out
    block_sizes = {s.block_size for s in attention.values()}
    if len(block_sizes) > 1:
        raise ConfigError(f"attention layers of a Mamba hybrid must share one block size, got "
                          f"{sorted(block_sizes)}", field="block_size")
    block_size = block_sizes.pop()
    per_token = max(s.real_page_size_bytes // s.block_size for s in attention.values())
    state_page = max(s.real_page_size_bytes for s in mamba.values())
    alignment = max(kernel_block_alignment, block_size)
    needed = alignment * cdiv(state_page, alignment * per_token)
    needed = kernel_block_alignment * cdiv(needed, kernel_block_alignment)
    block_size = max(block_size, needed)
    attn_page = block_size * per_token
    for name, attn_spec in attention.items():
        out[name] = replace(attn_spec, block_size=block_size)
    for name, spec in mamba.items():
        out[name] = replace(
            spec, mamba_cache_mode=mode,
            block_size=block_size if mode == "align" else max_model_len,
            page_size_padded=attn_page if attn_page != spec.real_page_size_bytes else None)
    return out


# --- steps --------------------------------------------------------------------------------

def _checked_specs(layer_specs: Mapping[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    if not isinstance(layer_specs, Mapping):
        raise ConfigError("layer specs must be a mapping of layer name to spec",
                          field="layer_specs")
    for name, spec in layer_specs.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"layer name must be a non-empty string, got {name!r}",
                              field="layer_specs")
        if not isinstance(spec, KVCacheSpec) or isinstance(spec, UniformTypeKVCacheSpecs):
            raise ConfigError(f"layer {name!r}: expected a per-layer KVCacheSpec, got "
                              f"{type(spec).__name__}", field=f"layer_specs[{name!r}]")
        if spec.page_size_bytes <= 0:
            raise ConfigError(f"layer {name!r} has an empty page", field=f"layer_specs[{name!r}]")
    return dict(layer_specs)


def _mergeable(specs: list[KVCacheSpec]) -> bool:
    """Whether all specs fit one plain group. Conflicting windows are an error, not a
    "no" (as in vLLM, where they raise ValueError through this check)."""
    try:
        type(specs[0]).merge(specs)
    except SpecMergeError:
        return False
    return True


def _is_one_type(specs: dict[str, KVCacheSpec]) -> bool:
    return not specs or _mergeable(list(specs.values())) or \
        UniformTypeKVCacheSpecs.is_uniform_type(specs)


def _promote_local_specs(specs: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Step 1: rewrite sliding-window / chunked-local layers as full attention carrying
    their window, when the model has full attention too; the result must be one type."""
    if _is_one_type(specs):
        return specs
    values = list(specs.values())
    has_full = any(isinstance(s, FullAttentionSpec) for s in values)
    has_local = any(isinstance(s, (SlidingWindowSpec, ChunkedLocalAttentionSpec))
                    for s in values)
    promoted = dict(specs)
    if has_full and has_local:
        full_sizes = {s.block_size for s in values if isinstance(s, FullAttentionSpec)}
        full_block_size = next(iter(full_sizes)) if len(full_sizes) == 1 else None
        for name, spec in specs.items():
            if isinstance(spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec)):
                promoted[name] = _as_full_attention(spec, full_block_size or spec.block_size)
    if not _is_one_type(promoted):
        raise ConfigError(PROMOTION_FAILED + " (the hybrid manager is off; Mamba and "
                          "local-only layer mixes need hybrid=True)", field="hybrid")
    return promoted


def _as_full_attention(spec: SlidingWindowSpec | ChunkedLocalAttentionSpec,
                       block_size: int) -> FullAttentionSpec:
    padded = None
    if spec.page_size_padded is not None:
        # Keep the padding, but never below the real page at the new block size.
        padded = max(spec.page_size_padded,
                     spec.real_page_size_bytes * block_size // spec.block_size)
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
        dtype=spec.dtype, head_size_v=spec.head_size_v, page_size_padded=padded,
        sliding_window=getattr(spec, "sliding_window", None),
        attention_chunk_size=getattr(spec, "attention_chunk_size", None))


def _unify_page_sizes(specs: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Step 6: give every layer the largest page size P. Mamba: pad to P. Others: if the
    page divides P, multiply the block size (more tokens per page); else pad (attention)."""
    target = max(s.page_size_bytes for s in specs.values())
    out: dict[str, KVCacheSpec] = {}
    for name, spec in specs.items():
        page = spec.page_size_bytes
        if page == target:
            new = spec
        elif isinstance(spec, MambaSpec):
            new = replace(spec, page_size_padded=target)
        elif target % page == 0 and getattr(spec, "page_size_padded", None) is None:
            new = replace(spec, block_size=spec.block_size * (target // page))
        elif isinstance(spec, AttentionSpec):
            new = replace(spec, page_size_padded=target)
        else:
            raise ConfigError(f"layer {name!r}: page size {page} cannot be unified with {target}",
                              field=f"layer_specs[{name!r}]")
        out[name] = new
    return out


def _group_by_pattern(specs: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """Steps 7-9: bucket layers by spec (first-seen order), merge mergeable buckets, and
    split every bucket into groups of ``group_size`` layers, strided."""
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in specs.items():
        by_spec.setdefault(spec, []).append(name)
    buckets: list[tuple[list[str], list[KVCacheSpec]]] = []
    for spec, names in by_spec.items():
        for bucket_names, bucket_specs in buckets:
            try:
                type(bucket_specs[0]).merge([*bucket_specs, spec])
            except ConfigError:  # incompatible, including conflicting windows
                continue
            bucket_names.extend(names)
            bucket_specs.append(spec)
            break
        else:
            buckets.append((list(names), [spec]))
    sizes = [len(names) for names, _ in buckets]
    group_size = min(sizes)
    if max(sizes) < 1.5 * min(sizes):
        # Nearly equal buckets (e.g. 12 SW + 13 full with a drafter): pad the smaller
        # ones instead of splitting the larger ones into many mostly-empty groups.
        group_size = max(sizes)
    groups: list[KVCacheGroupSpec] = []
    for names, _ in buckets:
        n = cdiv(len(names), group_size)
        for i in range(n):
            # Strided (j -> group j mod n), so each pipeline stage holds a share of every group.
            members = names[i::n]
            member_specs = [specs[m] for m in members]
            groups.append(KVCacheGroupSpec(tuple(members),
                                           type(member_specs[0]).merge(member_specs)))
    return groups
