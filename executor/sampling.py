"""Next-token choice: greedy, or seeded sampling that depends only on (seed, position).

Seeding per position (not per request stream) makes a request's tokens independent of how
the engine batched or preempted it, and lets ``Execute`` reproduce ``Generate`` exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from executor.errors import InvalidArgument


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 -> greedy
    top_k: int = 0  # 0 -> whole vocabulary
    top_p: float = 1.0  # 1 (or 0) -> no nucleus cut
    seed: int = 0

    def validate(self) -> SamplingParams:
        """Answers ``self``; raises InvalidArgument naming the first field out of range."""
        if not (self.temperature >= 0.0):
            raise InvalidArgument(f"must be >= 0, got {self.temperature}",
                                  field="sampling.temperature")
        if self.top_k < 0:
            raise InvalidArgument(f"must be >= 0, got {self.top_k}",
                                  field="sampling.top_k")
        if not (0.0 <= self.top_p <= 1.0):
            raise InvalidArgument(f"must be in [0, 1], got {self.top_p}",
                                  field="sampling.top_p")
        if self.seed < 0:
            raise InvalidArgument(f"must be >= 0, got {self.seed}",
                                  field="sampling.seed")
        return self

    @property
    def greedy(self) -> bool:
        """Temperature 0: the argmax token, no randomness."""
        return self.temperature == 0.0


def sample_one(logits: Tensor, params: SamplingParams, position: int) -> int:
    """Pick the token at ``position`` (the index it will have in the sequence) from fp32
    ``logits [vocab]``."""
    if params.greedy:
        return int(torch.argmax(logits))
    scaled = logits.float() / params.temperature
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, -1)
    if 0.0 < params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # keep tokens whose preceding mass is below top_p (always keeps the first)
        drop = (torch.cumsum(sorted_p, -1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
    gen = torch.Generator().manual_seed((params.seed * 1_000_003 + position) % (2**63))
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))


def sample(logits: Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
    """One token per row of ``logits [B, vocab]``; greedy rows share one argmax."""
    out: list[int] = [0] * len(params)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        picks = torch.argmax(logits[greedy], dim=-1).tolist()
        for i, t in zip(greedy, picks):
            out[i] = int(t)
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = sample_one(logits[i], p, positions[i])
    return out
