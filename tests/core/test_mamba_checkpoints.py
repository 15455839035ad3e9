"""Mamba ``align`` checkpoints a foreign scheduler cannot poison
(docs/semantics.md#mamba-checkpoints-from-untrusted-schedulers).

A state block may enter the prefix cache only if it holds the state at its own boundary.
vLLM's scheduler guarantees that by splitting prefill chunks at block multiples; ours are
arbitrary clients, so the pool checks it.
"""

from __future__ import annotations

import pytest

from cache_service.core.events import BlockStored
from cache_service.core.hashing import external_block_hash
from cache_service.core.pool import Pool

from builders import full, make_pool, mamba

PROMPT = [(7 * i + 3) % 1000 for i in range(300)]


def hybrid() -> Pool:
    return make_pool(256, full(16), mamba(16), max_model_len=1024, enable_events=True)


def run_chunks(p: Pool, ends: list[int], prompt: list[int] = PROMPT) -> None:
    """Prefill ``prompt`` in chunks ending at ``ends``, one scheduler step each."""
    p.add_request("a", prompt)
    assert p.lookup("a").hit_tokens == 0
    done = 0
    for end in ends:
        p.new_step()
        assert p.allocate("a", end - done).ok
        done = end
    p.new_step()
    p.check_invariants()


def shared(n: int) -> list[int]:
    """A prompt sharing the first ``n`` tokens of PROMPT, then diverging."""
    return PROMPT[:n] + [999] * 40


def test_chunk_crossing_a_boundary_from_mid_block_is_never_cached() -> None:
    p = hybrid()
    run_chunks(p, [120, 240, 300])
    # Block 7 ([112, 128)) holds the state after 120 tokens: caching it under the key of
    # [0, 128) would make this a 128-token hit resuming from the wrong state.
    assert p.peek_prefix(shared(200)) == 0
    # The state after 240 tokens is at block 14's boundary: a real checkpoint.
    assert p.peek_prefix(shared(250)) == 240
    table = p.block_ids("a")[1]
    assert table[7] == 0, "the stale state block was released, not kept as a checkpoint"


def test_vllm_style_chunks_still_checkpoint_every_chunk_end() -> None:
    p = hybrid()
    run_chunks(p, [128, 240, 300])
    assert p.peek_prefix(shared(200)) == 128
    assert p.peek_prefix(shared(250)) == 240


def test_decode_filling_the_last_block_in_place_is_cached() -> None:
    """The prompt's last chunk ends mid-block (300); decode steps then write the state in
    place, one token at a time, so the state at 304 is exact and cacheable."""
    p = hybrid()
    run_chunks(p, [128, 256, 300])
    for tok in (11, 12, 13, 14):
        p.append_tokens("a", [tok])
        assert p.allocate("a", 1).ok
        p.new_step()
    decoded = PROMPT + [11, 12, 13, 14]
    assert p.peek_prefix(decoded[:304] + [5] * 8) == 304


@pytest.mark.parametrize("ends, checkpoints", [
    ([120, 240, 300], [240]),
    ([100, 299, 300], []),
    ([17, 32, 250, 256, 300], [32, 256]),  # 17 -> 32 and 250 -> 256 stay inside one block
    ([128, 256, 300], [128, 256]),
])
def test_only_states_at_chunk_ends_on_boundaries_are_announced(ends: list[int],
                                                                 checkpoints: list[int]) -> None:
    """Whatever the chunking, every Mamba block that enters the cache holds the state of a
    chunk that ended exactly on its boundary."""
    p = hybrid()
    run_chunks(p, ends)
    position = {external_block_hash(h): (i + 1) * 16 for i, h in enumerate(p.block_hashes("a"))}
    stored = [position[h] for e in p.take_events()
              if isinstance(e, BlockStored) and e.group_idx == 1 for h in e.block_hashes]
    assert stored == checkpoints
