"""Plain helpers of the kernel tests (imported as ``from kernel_helpers import ...``; pytest puts
tests/kernels on sys.path): the tolerance table, reproducible random tensors, and the Mamba ops'
packed batches with the "untouched slots stay bit-identical" check, the chunked-prefill and
decode-after-prefill set-ups and the "a bad argument is refused and changes nothing" check.
conftest.py wraps some of them as fixtures; test modules never import conftest or each other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

# (rtol, atol) per (kind, dtype). "recurrence": outputs and states of the Mamba ops vs their
# token-by-token references; "attention": paged attention and anything compared against a softmax
# over many keys.
TOLERANCES: dict[tuple[str, torch.dtype], tuple[float, float]] = {
    ("recurrence", torch.float32): (6e-4, 2e-3),
    ("recurrence", torch.float16): (3e-3, 5e-3),
    ("recurrence", torch.bfloat16): (1e-2, 5e-2),
    ("attention", torch.float32): (1e-4, 1e-4),
    ("attention", torch.float16): (1e-3, 2e-3),
    ("attention", torch.bfloat16): (1e-2, 1.5e-2),
}


def tolerance(dtype: torch.dtype, kind: str = "recurrence") -> tuple[float, float]:
    """(rtol, atol) for comparing an output of ``dtype`` with its fp32 reference."""
    return TOLERANCES[(kind, dtype)]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, kind: str = "recurrence") -> None:
    """torch.testing.assert_close with the tolerance table; NaNs never pass."""
    rtol, atol = tolerance(expected.dtype, kind)
    torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=rtol, atol=atol, equal_nan=False)


def rms_error_ratio(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected||_rms / ||expected||_rms in fp32: robust for bf16."""
    diff = (actual.float() - expected.float()).pow(2).mean().sqrt()
    return float(diff / expected.float().pow(2).mean().sqrt().clamp(min=1e-12))


def randn(*shape: int, generator: torch.Generator, dtype: torch.dtype = torch.float32,
          device: torch.device | str = "cpu", scale: float = 1.0) -> torch.Tensor:
    """Standard-normal tensor drawn on CPU (reproducible across devices), then cast and moved."""
    return (torch.randn(*shape, generator=generator) * scale).to(dtype=dtype, device=device)


# ==================================================================================================
# Mamba helpers: packed batches with cache slots, and the "untouched slots stay bit-identical"
# check.
# ==================================================================================================


class MambaBatch:
    """Packed-batch metadata of the Mamba ops: query_start_loc int32 [B+1], state_indices int64 [B]
    (-1 = padding row), has_initial_state bool [B]."""

    def __init__(self, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
                 has_initial_state: torch.Tensor) -> None:
        self.query_start_loc = query_start_loc
        self.state_indices = state_indices
        self.has_initial_state = has_initial_state

    @property
    def args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.query_start_loc, self.state_indices, self.has_initial_state

    def used_slots(self) -> list[int]:
        return [int(i) for i in self.state_indices.tolist() if i >= 0]


def mamba_batch(lengths: list[int], num_slots: int, *, generator: torch.Generator,
                device: torch.device | str = "cpu", padding: tuple[int, ...] = (),
                fresh: tuple[int, ...] = ()) -> MambaBatch:
    """Sequences of ``lengths`` in distinct random slots; rows in ``padding`` get index -1, rows in
    ``fresh`` get has_initial_state False."""
    assert num_slots >= len(lengths)
    slots = torch.randperm(num_slots, generator=generator)[: len(lengths)]
    for row in padding:
        slots[row] = -1
    starts = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    has_initial = torch.tensor([row not in fresh for row in range(len(lengths))], dtype=torch.bool)
    return MambaBatch(starts.to(device), slots.to(device), has_initial.to(device))


def assert_only_slots_changed(before: torch.Tensor, after: torch.Tensor, slots: list[int]) -> None:
    """Every slot (dim 0) not in ``slots`` is bit-identical, NaNs included."""
    keep = [s for s in range(before.shape[0]) if s not in set(slots)]
    b, a = before[keep].cpu().contiguous(), after[keep].cpu().contiguous()
    assert torch.equal(b.view(torch.uint8), a.view(torch.uint8)), f"slots outside {slots} changed"


def assert_refused(op: Callable[..., Any], args: dict[str, Any], change: dict[str, Any],
                              field: str, states: torch.Tensor) -> None:
    """``op(**args)`` with ``change`` applied raises a ValueError naming ``field`` and leaves
    ``states`` bit-identical (a bad argument is refused before anything is written)."""
    before = states.clone()
    with pytest.raises(ValueError, match=field):
        op(**{**args, **change})
    assert torch.equal(states, before)


def in_pieces(run: Callable[[int, int, MambaBatch], torch.Tensor], length: int, cuts: list[int],
                  one: MambaBatch, num_slots: int, *, generator: torch.Generator) -> torch.Tensor:
    """The outputs of ``run(lo, hi, batch)`` over ``[0, length)`` cut at ``cuts`` (a chunked
    prefill), concatenated: each piece is its own one-sequence batch of ``num_slots`` slots in
    ``one``'s state slot, only the first one fresh."""
    bounds = sorted({0, length, *[c for c in cuts if c <= length]})
    pieces = []
    for k, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        part = mamba_batch([hi - lo], num_slots, generator=generator, fresh=(0,) if k == 0 else ())
        part.state_indices[:] = one.state_indices
        pieces.append(run(lo, hi, part))
    return torch.cat(pieces)


def prefill_and_longer(lengths: list[int], extra: int, num_slots: int, *, generator: torch.Generator,
                       device: str | torch.device) -> tuple[MambaBatch, MambaBatch]:
    """A fresh prefill batch of ``lengths`` and the same sequences ``extra`` tokens longer, in
    the same state slots (decode after prefill must equal the longer prefill)."""
    fresh = tuple(range(len(lengths)))
    batch = mamba_batch(lengths, num_slots, generator=generator, device=device, fresh=fresh)
    longer = mamba_batch([n + extra for n in lengths], num_slots, generator=generator, device=device,
                         fresh=fresh)
    longer.state_indices[:] = batch.state_indices
    return batch, longer


def assert_chunked_equals_whole(run: Callable[[int, int, MambaBatch, torch.Tensor], torch.Tensor], length: int,
                                cuts: list[int], states: torch.Tensor, num_slots: int, *,
                                generator: torch.Generator) -> None:
    """``run(lo, hi, batch, states)`` (one Mamba op over rows ``[lo, hi)``) as one prefill of
    ``length`` tokens and as a chunked prefill cut at ``cuts`` (see :func:`in_pieces`) gives
    the same outputs and the same final ``states``."""
    one = mamba_batch([length], num_slots, generator=generator, fresh=(0,))
    whole_states = states.clone()
    whole = run(0, length, one, whole_states)
    pieces = in_pieces(lambda lo, hi, part: run(lo, hi, part, states), length, cuts, one, num_slots,
                       generator=generator)
    assert_close(pieces, whole)
    assert_close(states, whole_states)


def two_sequences_of_5() -> dict[str, torch.Tensor]:
    """The packed-batch arguments of 5 tokens as sequences of 1 and 4 in slots 0 and 2, both
    with a prior state (the bad-argument tests' valid baseline)."""
    return dict(query_start_loc=torch.tensor([0, 1, 5], dtype=torch.int32), state_indices=torch.tensor([0, 2]),
                has_initial_state=torch.tensor([True, True]))
