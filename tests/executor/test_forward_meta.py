"""Forward metadata from block tables."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from executor.forward_meta import GroupLayout, SeqChunk, build_forward_meta

from paged_helpers import attention_meta, mamba_meta

ATTN = GroupLayout("attention", 4)
ALIGN = GroupLayout("mamba", 4, "align")
NONE = GroupLayout("mamba", 1024, "none")


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 12)), min_size=1, max_size=4),
       st.randoms())
def test_slot_mapping_follows_the_tables(reqs, rnd) -> None:
    ids = list(range(1, 400))
    rnd.shuffle(ids)
    chunks = []
    for computed, n in reqs:
        table = [ids.pop() for _ in range(-(-(computed + n) // 4))]
        chunks.append(SeqChunk(computed, n, [table]))
    meta = build_forward_meta(chunks, [ATTN])
    slots = attention_meta(meta, 0).slot_mapping.tolist()
    expected = [c.block_tables[0][p // 4] * 4 + p % 4
                for c in chunks for p in range(c.num_computed, c.num_computed + c.query_len)]
    assert slots == expected
    assert meta.positions.tolist() == [p for c in chunks
                                       for p in range(c.num_computed, c.num_computed + c.query_len)]
    assert meta.query_start_loc.tolist()[-1] == len(slots)
    seq_lens = [c.num_computed + c.query_len for c in chunks]
    assert attention_meta(meta, 0).seq_lens.tolist() == seq_lens
    assert meta.is_decode == all(c.query_len == 1 and c.num_computed > 0 for c in chunks)


def test_sliding_window_tables_may_start_with_null_blocks() -> None:
    # positions 0..7 dropped out of the window: entries 0 and 1 are the null block
    meta = build_forward_meta([SeqChunk(10, 2, [[0, 0, 7]])], [ATTN])
    assert attention_meta(meta, 0).slot_mapping.tolist() == [7 * 4 + 2, 7 * 4 + 3]


def test_align_mode_reads_the_checkpoint_and_writes_the_chunk_end_block() -> None:
    # computed 8 (state in block index 1), chunk of 5 ends at token 12 -> block index 3
    meta = build_forward_meta([SeqChunk(8, 5, [[0, 21, 0, 33]])], [ALIGN])
    m = mamba_meta(meta, 0)
    assert m.state_indices.tolist() == [33]
    assert (m.copy_src.tolist(), m.copy_dst.tolist()) == ([21], [33])
    assert m.has_initial_state.tolist() == [True]
    # continuing inside the same block: no copy; a fresh request: no initial state
    meta = build_forward_meta([SeqChunk(9, 1, [[0, 0, 33]]), SeqChunk(0, 3, [[5]])], [ALIGN])
    m = mamba_meta(meta, 0)
    assert m.state_indices.tolist() == [33, 5] and m.copy_src.numel() == 0
    assert m.has_initial_state.tolist() == [True, False]


def test_none_mode_uses_the_single_state_block() -> None:
    meta = build_forward_meta([SeqChunk(100, 1, [[12]])], [NONE])
    assert mamba_meta(meta, 0).state_indices.tolist() == [12]


@pytest.mark.parametrize("chunk, layout, field", [
    (SeqChunk(0, 9, [[3, 4]]), ATTN, "block_tables[0]"),           # table too short
    (SeqChunk(4, 2, [[3, 0]]), ATTN, "block_tables[0]"),           # new token on the null block
    (SeqChunk(4, 4, [[0, 0]]), ALIGN, "block_tables[0][1]"),       # final state on the null block
    (SeqChunk(0, 0, [[3]]), ATTN, "query_len"),
])
def test_bad_tables_name_the_field(chunk, layout, field) -> None:
    with pytest.raises(ValueError, match=field.replace("[", r"\[")):
        build_forward_meta([chunk], [layout])
