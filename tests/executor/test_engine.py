"""Engine scheduling rules that need no server (the loop itself is covered end to end)."""

from __future__ import annotations

from hypothesis import given, strategies as st

from executor.engine import plan_chunk


@given(start=st.integers(0, 500), extra=st.integers(0, 500), budget=st.integers(1, 300),
       block=st.sampled_from([0, 16, 48]), boundary=st.integers(0, 1000))
def test_chunk_plan_invariants(start: int, extra: int, budget: int, block: int, boundary: int) -> None:
    total = start + extra
    if block and boundary:
        boundary = boundary // block * block  # lookups report block-aligned boundaries
    n = plan_chunk(start, total, budget, boundary=boundary, align_block=block)
    end = start + n
    assert 0 <= n <= min(budget, total - start)
    assert not (start < boundary < end)  # never crosses the shared-prefix boundary
    if block and n:
        # mid-prompt chunks end on block boundaries; the final partial block runs alone
        assert end % block == 0 or end == boundary or (end == total and start >= total // block * block)
    if extra and budget >= max(block, 1):
        assert n > 0  # progress whenever the budget holds a block


def test_examples() -> None:
    assert plan_chunk(0, 170, 256, align_block=48) == 144  # checkpoint at 144 first ...
    assert plan_chunk(144, 170, 256, align_block=48) == 26  # ... then the tail
    assert plan_chunk(0, 170, 100, align_block=48) == 96
    assert plan_chunk(0, 170, 256, boundary=96, align_block=48) == 96
    assert plan_chunk(0, 170, 256) == 170  # no Mamba: one chunk
    assert plan_chunk(169, 170, 256, align_block=48) == 1  # decode
