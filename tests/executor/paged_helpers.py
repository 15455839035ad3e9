"""Helpers of the executor tier: cache layouts without a cache service (for model unit
tests), a trivial block-id source, chunked runs of a model on the paged cache, typed
access to per-group metadata and op results, and small probes of a running executor."""

from __future__ import annotations

import itertools
import math
from typing import Unpack

import torch

from executor.cache import CacheGroup, CacheTensors, mamba_state_shapes
from executor.client import GenerateOptions, Generation
from executor.forward_meta import (
    AttentionMeta,
    ForwardMeta,
    GroupLayout,
    MambaMeta,
    SeqChunk,
    build_forward_meta,
)
from executor.model import HybridModel, layer_name
from executor.model_config import ModelConfig


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
        groups.append(CacheGroup((layer_name(i, kind),),
                                GroupLayout("attention" if is_attn else "mamba",
                                            block_size if is_attn else mbs, mamba_cache_mode)))
    return CacheTensors(cfg, groups, num_blocks, max(pages))


class BlockSource:
    """Hands out fresh, shuffled-looking block ids (never 0, never reused)."""

    def __init__(self, start: int = 1, stride: int = 5, num_blocks: int = 512) -> None:
        self._ids = (1 + (start + i * stride) % (num_blocks - 1) for i in itertools.count())
        self._seen: set[int] = set()

    def take(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            b = next(self._ids)
            if b in self._seen:
                raise RuntimeError("BlockSource exhausted")
            self._seen.add(b)
            out.append(b)
        return out


def tables_for(cache: CacheTensors, n_tokens: int, src: BlockSource) -> list[list[int]]:
    """One block table per group of ``cache``, long enough for ``n_tokens``, from ``src``."""
    out = []
    for gl in cache.layout:
        n = -(-n_tokens // gl.block_size)
        out.append(src.take(n))
    return out


def run_chunks(model: HybridModel, cache: CacheTensors, tokens: torch.Tensor, cuts: list[int],
               tables: list[list[int]]) -> torch.Tensor:
    """Feed ``tokens`` in chunks ending at ``cuts``; logits of every position."""
    outs, start = [], 0
    for end in cuts:
        meta = build_forward_meta([SeqChunk(start, end - start, tables)], cache.layout)
        h = model(tokens[start:end], meta, cache)
        outs.append(model.compute_logits(h))
        start = end
    return torch.cat(outs)


def attention_meta(meta: ForwardMeta, group: int) -> AttentionMeta:
    """``meta.groups[group]``, asserted to be an attention group's."""
    m = meta.groups[group]
    assert isinstance(m, AttentionMeta), m
    return m


def mamba_meta(meta: ForwardMeta, group: int) -> MambaMeta:
    """``meta.groups[group]``, asserted to be a Mamba group's."""
    m = meta.groups[group]
    assert isinstance(m, MambaMeta), m
    return m



def shared_prefix_workload(n: int, *, prefix_len: int = 100, vocab: int = 1000,
                           seed: int = 0) -> list[list[int]]:
    """``n`` prompts: one shared prefix, then 5-30 unique tokens each."""
    import random

    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(vocab) for _ in range(rng.randint(5, 30))] for _ in range(n)]


def run_concurrently(target: str, prompts: list[list[int]], max_tokens: int,
                     **kwargs: Unpack[GenerateOptions]) -> list[Generation]:
    """Every prompt as its own Generate stream, all at once (threads, blocking client: the test
    process stays free of grpc.aio); results in prompt order."""
    from concurrent.futures import ThreadPoolExecutor

    from executor.client import ExecutorClient

    with ExecutorClient(target) as client, ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(client.generate, p, max_tokens, **kwargs) for p in prompts]
        return [f.result() for f in futures]


def health_status(target: str) -> str:
    """The overall gRPC health status of ``target`` by name ("SERVING", "NOT_SERVING" ...)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as ch:
        answer = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
