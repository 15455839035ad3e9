"""Forward-pass metadata built from block tables: what the kernels need for one packed batch.

A batch is B requests, each contributing ``query_len`` new tokens after ``num_computed``
tokens whose cache entries already exist. Tokens are packed request after request.

Attention groups get a block table, kv lengths and a slot per new token. Mamba groups get one
state slot per request: the kernels read the initial state from it and write the final state
back. In ``align`` mode the initial state (after ``num_computed`` tokens) lives in the block of
token ``num_computed - 1`` and the final state must land in the block of the chunk's last
token; when those differ we copy the state first (``copy_src`` -> ``copy_dst``), so a cached
checkpoint block is never written in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from executor.errors import InvalidArgument


@dataclass(frozen=True)
class GroupLayout:
    """One KV-cache group as the executor sees it."""

    kind: str  # "attention" | "mamba"
    block_size: int
    mamba_cache_mode: str = "none"  # mamba groups only: "none" | "align"


@dataclass(frozen=True)
class SeqChunk:
    """One request's part of a batch: ``query_len`` tokens after ``num_computed`` cached ones;
    ``block_tables[g]`` is the request's table in group g (null block = 0)."""

    num_computed: int
    query_len: int
    block_tables: Sequence[Sequence[int]]


@dataclass
class AttentionMeta:
    block_tables: Tensor  # int32 [B, max_blocks]
    seq_lens: Tensor  # int32 [B], kv length including this step's tokens
    slot_mapping: Tensor  # int64 [T]


@dataclass
class MambaMeta:
    state_indices: Tensor  # int64 [B]
    has_initial_state: Tensor  # bool [B]
    copy_src: Tensor  # int64 [K]
    copy_dst: Tensor  # int64 [K]


@dataclass
class ForwardMeta:
    positions: Tensor  # int64 [T]
    query_start_loc: Tensor  # int32 [B+1]
    logits_indices: Tensor  # int64 [B]: each request's last token
    is_decode: bool  # every request: one token, with an initial state
    groups: list[AttentionMeta | MambaMeta] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens in the packed batch (T)."""
        return int(self.positions.shape[0])


def _block(table: Sequence[int], index: int, *, group: int, what: str) -> int:
    if index >= len(table):
        raise InvalidArgument(f"block_tables[{group}]: {what} needs block index {index} but the "
                              f"table has {len(table)} entries")
    block = int(table[index])
    if block <= 0:
        raise InvalidArgument(f"block_tables[{group}][{index}]: {what} needs a real block, "
                              f"got {block}")
    return block


def build_forward_meta(chunks: Sequence[SeqChunk], layout: Sequence[GroupLayout],
                       device: torch.device | str = "cpu") -> ForwardMeta:
    """Metadata for one forward over ``chunks`` (in batch order). Raises InvalidArgument naming
    the request/group when a table is too short or points at the null block where data must live."""
    if not chunks:
        raise InvalidArgument("chunks: empty batch")
    qlens = [c.query_len for c in chunks]
    if min(qlens) <= 0:
        raise InvalidArgument("query_len: every request needs at least one new token")
    positions = torch.cat([torch.arange(c.num_computed, c.num_computed + c.query_len)
                           for c in chunks])
    qsl = torch.zeros(len(chunks) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(qlens), 0)
    is_decode = all(c.query_len == 1 and c.num_computed > 0 for c in chunks)
    meta = ForwardMeta(positions=positions.to(device), query_start_loc=qsl.to(device),
                       logits_indices=(qsl[1:] - 1).long().to(device), is_decode=is_decode)
    for g, gl in enumerate(layout):
        tables = [list(c.block_tables[g]) for c in chunks]
        if gl.kind == "attention":
            width = max(1, max(len(t) for t in tables))
            bt = torch.zeros(len(chunks), width, dtype=torch.int32)
            for b, t in enumerate(tables):
                bt[b, :len(t)] = torch.tensor(t, dtype=torch.int32)
            seq_lens = torch.tensor([c.num_computed + c.query_len for c in chunks],
                                    dtype=torch.int32)
            slots = []
            for b, c in enumerate(chunks):
                pos = torch.arange(c.num_computed, c.num_computed + c.query_len)
                last = (c.num_computed + c.query_len - 1) // gl.block_size
                _block(tables[b], last, group=g, what=f"request {b} token {int(pos[-1])}")
                blocks = bt[b].long()[pos // gl.block_size]
                if bool((blocks <= 0).any()):
                    raise InvalidArgument(f"block_tables[{g}]: request {b} maps a new token to "
                                          f"the null block")
                slots.append(blocks * gl.block_size + pos % gl.block_size)
            meta.groups.append(AttentionMeta(bt.to(device), seq_lens.to(device),
                                             torch.cat(slots).to(device)))
        elif gl.kind == "mamba":
            idx, init, src, dst = [], [], [], []
            for b, c in enumerate(chunks):
                if gl.mamba_cache_mode == "align":
                    out = _block(tables[b], (c.num_computed + c.query_len - 1) // gl.block_size,
                                 group=g, what=f"request {b} final state")
                    if c.num_computed > 0:
                        inp = _block(tables[b], (c.num_computed - 1) // gl.block_size,
                                     group=g, what=f"request {b} initial state")
                        if inp != out:
                            src.append(inp)
                            dst.append(out)
                else:
                    out = _block(tables[b], 0, group=g, what=f"request {b} state")
                idx.append(out)
                init.append(c.num_computed > 0)
            meta.groups.append(MambaMeta(
                torch.tensor(idx, dtype=torch.int64, device=device),
                torch.tensor(init, dtype=torch.bool, device=device),
                torch.tensor(src, dtype=torch.int64, device=device),
                torch.tensor(dst, dtype=torch.int64, device=device)))
        else:
            raise InvalidArgument(f"layout[{g}].kind: unknown {gl.kind!r}")
    return meta
