"""Helpers of the executor tier: cache layouts without a cache service (for model unit
tests) and a trivial block-id source."""

from __future__ import annotations

import itertools
import math

from executor.batch import GroupLayout
from executor.cache import CacheTensors, GroupInfo, mamba_state_shapes
from executor.config import ModelConfig
from executor.model import layer_name


def one_group_per_layer(cfg: ModelConfig, block_size: int, mamba_cache_mode: str = "align",
                        num_blocks: int = 512) -> CacheTensors:
    """Every layer in its own group (all sharing one byte slot, like vLLM's aliasing), with a
    page big enough for any layer. Valid as long as block ids are never shared across groups."""
    pages = [2 * block_size * cfg.num_kv_heads * cfg.head_dim * 4]
    for kind in ("mamba1", "mamba2"):
        conv, ssm = mamba_state_shapes(cfg, kind)
        pages.append(4 * (math.prod(conv) + math.prod(ssm)))
    groups = []
    for i in range(cfg.num_layers):
        kind = cfg.layer_kind(i)
        is_attn = kind in ("full_attention", "sliding_window")
        mbs = block_size if mamba_cache_mode == "align" else cfg.max_model_len
        groups.append(GroupInfo((layer_name(i, kind),),
                                GroupLayout("attention" if is_attn else "mamba",
                                            block_size if is_attn else mbs, mamba_cache_mode)))
    return CacheTensors(cfg, groups, num_blocks, max(pages))


class BlockSource:
    """Hands out fresh, shuffled-looking block ids (never 0, never reused)."""

    def __init__(self, start: int = 1, stride: int = 5, num_blocks: int = 512) -> None:
        self._ids = (1 + (start + i * stride) % (num_blocks - 1) for i in itertools.count())
        self._seen: set[int] = set()

    def take(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            b = next(self._ids)
            if b in self._seen:
                raise RuntimeError("BlockSource exhausted")
            self._seen.add(b)
            out.append(b)
        return out


def shared_prefix_workload(n: int, *, prefix_len: int = 100, vocab: int = 1000,
                           seed: int = 0) -> list[list[int]]:
    """``n`` prompts: one shared prefix, then 5-30 unique tokens each."""
    import random

    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(vocab) for _ in range(rng.randint(5, 30))] for _ in range(n)]


def run_concurrently(target: str, prompts: list[list[int]], max_tokens: int, **kwargs):
    """Every prompt as its own Generate stream, all at once (threads, blocking client: the test
    process stays free of grpc.aio); results in prompt order."""
    from concurrent.futures import ThreadPoolExecutor

    from executor.client import ExecutorClient

    with ExecutorClient(target) as client, ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(client.generate, p, max_tokens, **kwargs) for p in prompts]
        return [f.result() for f in futures]
