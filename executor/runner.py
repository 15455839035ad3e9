"""Model + cache tensors + one lock: runs a forward pass over a batch of chunks and returns
the next-token logits of each request (the engine and ``Execute`` share it)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from executor.cache import CacheTensors
from executor.errors import InvalidArgument
from executor.forward_meta import GroupLayout, SeqChunk, build_forward_meta
from executor.host_tier import HostTier
from executor.model import HybridModel

if TYPE_CHECKING:
    from executor.scheduler import AnswerCopies


class ModelRunner:
    def __init__(self, model: HybridModel, cache: CacheTensors,
                 tier: HostTier | None = None) -> None:
        self.model = model
        self.cache = cache
        self.tier = tier  # the host tier (None: the pool has none)
        self.lock = threading.Lock()  # one forward at a time: the cache tensors are shared
        self.device = cache.device

    @property
    def layout(self) -> list[GroupLayout]:
        """The cache's layout, one entry per pool group."""
        return self.cache.layout

    def copy_blocks(self, copies: Sequence[tuple[int, int, int]]) -> None:
        """The step's ``(group, src, dst)`` block copies, before its forward pass."""
        if copies:
            with self.lock:
                self.cache.copy_blocks(copies)

    def run_copies(self, answers: Sequence[AnswerCopies]) -> set[tuple[int, int]]:
        """Every copy of the step's answers, answer by answer in the order received: the
        host-tier reset, demotions, promotions, then block copies (before the step's
        forward pass). Returns the (group, device block) pairs a failed copy left holding
        garbage: a failed promotion's destination, and a block copy's destination whose
        source was one. A block the service asks to demote while it holds garbage makes
        its host slot bad (the tier fails a promotion from it)."""
        bad: set[tuple[int, int]] = set()
        tier = self.tier
        for a in answers:
            if tier is not None:
                with self.lock:
                    if a.reset:
                        tier.reset()
                    if a.demotions:
                        tier.demote(a.demotions, suspect=bad)
                    if a.promotions:
                        bad.update(tier.promote(a.promotions))
            elif a.demotions or a.promotions:
                raise RuntimeError("the service sent host-tier copies but this executor "
                                   "has no host tier (--host-tier-blocks)")
            self.copy_blocks(a.block_copies)
            for g, src, dst in a.block_copies:  # in order, as they ran
                if (g, src) in bad:
                    bad.add((g, dst))
                else:
                    bad.discard((g, dst))
        return bad

    def forward(self, tokens: Sequence[Sequence[int]], chunks: Sequence[SeqChunk]) -> Tensor:
        """``tokens[b]`` are request b's ``chunks[b].query_len`` new tokens. Returns fp32
        logits [B, vocab] at each request's last new token. Bad input (a client's, through
        ``Execute``) raises :class:`InvalidArgument` before anything runs."""
        if len(tokens) != len(chunks):
            raise InvalidArgument("tokens: one token list per chunk", field="tokens")
        for b, (t, c) in enumerate(zip(tokens, chunks)):
            if len(t) != c.query_len:
                raise InvalidArgument(f"{len(t)} tokens but query_len {c.query_len}",
                                      field=f"sequences[{b}].token_ids")
            if len(c.block_tables) != len(self.layout):
                raise InvalidArgument(f"{len(c.block_tables)} tables but the pool has "
                                      f"{len(self.layout)} groups",
                                      field=f"sequences[{b}].block_tables")
            bad = [x for t in c.block_tables for x in t if not 0 <= int(x) < self.cache.num_blocks]
            if bad:
                raise InvalidArgument(f"block id {bad[0]} is outside [0, {self.cache.num_blocks})",
                                      field=f"sequences[{b}].block_tables")
        vocab = self.model.config.vocab_size
        flat = [int(x) for t in tokens for x in t]
        if any(x < 0 or x >= vocab for x in flat):
            raise InvalidArgument(f"every token must be in [0, {vocab})", field="token_ids")
        meta = build_forward_meta(chunks, self.layout, device=self.device)
        input_ids = torch.tensor(flat, dtype=torch.long, device=self.device)
        with self.lock:
            hidden = self.model(input_ids, meta, self.cache)
            return self.model.compute_logits(hidden[meta.logits_indices]).cpu()
