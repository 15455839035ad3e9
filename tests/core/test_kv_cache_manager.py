"""KVCacheManager: lookup cap, admission checks, stats, events (docs/semantics.md#manager-api)."""

from __future__ import annotations

import pytest

from cache_service.core.errors import ConfigError, InvalidArgument
from cache_service.core.events import BlockRemoved, BlockStored
from cache_service.core.hashing import get_hash_fn
from cache_service.core.kv_cache_manager import KVCacheManager, resolve_block_sizes
from cache_service.core.request import Request, RequestStatus

from builders import config, full, mamba, swa

HASH = get_hash_fn("sha256")


def manager(*specs, num_blocks=64, caching=True, events=False, watermark=0.0):
    cfg = config(num_blocks, *specs)
    sched, hbs = resolve_block_sizes(cfg, caching)
    return KVCacheManager(cfg, max_model_len=1024, scheduler_block_size=sched,
                          hash_block_size=hbs, enable_caching=caching, enable_events=events,
                          watermark=watermark)


def request(m: KVCacheManager, rid: str, tokens) -> Request:
    return Request(rid, tokens, hash_fn=HASH if m.enable_caching else None,
                   hash_block_size=m.pool.hash_block_size)


def admit(m: KVCacheManager, req: Request, n: int | None = None):
    blocks, hit, _ = m.get_computed_blocks(req)
    n = req.num_tokens - hit if n is None else n
    new = m.allocate_slots(req, n, hit, blocks)
    if new is not None:
        req.num_computed_tokens += hit + n
        req.status = RequestStatus.RUNNING
    return new, hit


@pytest.mark.parametrize("specs,caching,expected", [
    ((full(16),), True, (16, 16)),
    ((full(32), swa(16)), True, (32, 16)),
    ((full(16), mamba(16)), True, (16, 16)),
    ((full(16), mamba(64, "none")), True, (64, 64)),  # non-align Mamba: hash = scheduler
    ((full(32), swa(16)), False, (32, 32)),
])
def test_resolve_block_sizes(specs, caching, expected) -> None:
    assert resolve_block_sizes(config(8, *specs), caching) == expected


def test_resolve_block_sizes_rejects_bad_override() -> None:
    with pytest.raises(ConfigError):
        resolve_block_sizes(config(8, full(16)), True, scheduler_block_size=0)


def test_hit_is_capped_below_the_last_token() -> None:
    m = manager(full(16))
    first = request(m, "a", list(range(48)))
    admit(m, first)
    m.free(first)
    again = request(m, "b", list(range(48)))
    _, hit, _ = m.get_computed_blocks(again)
    assert hit == 32  # a fully cached 48-token prompt recomputes its last block
    longer = request(m, "c", list(range(49)))
    assert m.get_computed_blocks(longer)[1] == 48


def test_lookup_takes_no_references() -> None:
    m = manager(full(16))
    a = request(m, "a", list(range(40)))
    admit(m, a)
    m.free(a)
    free = m.pool.get_num_free_blocks()
    m.get_computed_blocks(request(m, "b", list(range(40))))
    assert m.pool.get_num_free_blocks() == free


def test_zero_new_tokens_without_hit_is_rejected() -> None:
    m = manager(full(16))
    with pytest.raises(InvalidArgument):
        m.allocate_slots(request(m, "a", [1, 2]), 0)


def test_failed_allocation_pins_nothing() -> None:
    m = manager(full(4), num_blocks=6)  # 5 usable blocks
    a = request(m, "a", list(range(12)))
    admit(m, a)
    m.free(a)  # 3 cached free blocks
    b = request(m, "b", list(range(12)) + list(range(100, 112)))
    blocks, hit, _ = m.get_computed_blocks(b)
    assert hit == 12
    assert m.allocate_slots(b, 12, hit, blocks) is None  # needs 3 new + 3 evictable hits
    assert all(blk.ref_cnt == 0 for blk in blocks[0])
    assert m.pool.get_num_free_blocks() == 5


def test_full_sequence_must_fit_checks_the_whole_prompt() -> None:
    m = manager(full(4), num_blocks=6)
    a = request(m, "a", list(range(40)))  # 10 blocks needed, 5 available
    assert m.allocate_slots(a, 8, full_sequence_must_fit=True) is None
    assert m.allocate_slots(a, 8) is not None  # the first chunk alone fits


def test_watermark_applies_to_admissions_only() -> None:
    m = manager(full(4), num_blocks=11, watermark=0.3)  # watermark 3 blocks, 10 usable
    a = request(m, "a", list(range(32)))
    assert m.allocate_slots(a, 32) is None  # 8 + 3 > 10
    assert m.allocate_slots(a, 28) is not None  # 7 + 3 <= 10
    a.status = RequestStatus.RUNNING
    a.num_computed_tokens = 28
    assert m.allocate_slots(a, 12) is not None  # running: no watermark, 3 more fit


def test_prefix_cache_stats_recorded_at_admission() -> None:
    m = manager(full(4))
    a = request(m, "a", list(range(16)))
    admit(m, a)
    m.record_prefix_cache_stats(a, 0)
    m.free(a)
    b = request(m, "b", list(range(16)))
    _, hit = admit(m, b)
    b.num_preemptions = 1
    m.record_prefix_cache_stats(b, hit)
    s = m.make_prefix_cache_stats()
    assert (s.requests, s.queries, s.hits) == (1, 16, 0)
    assert (s.preempted_requests, s.preempted_queries, s.preempted_hits) == (1, 16, 12)
    assert m.make_prefix_cache_stats().requests == 0  # taken stats reset
    m.free(b)
    assert m.reset_prefix_cache() and m.stats.reset


def test_events_are_annotated_with_the_group_spec() -> None:
    m = manager(full(4), swa(4, 8), num_blocks=40, events=True)
    a = request(m, "a", list(range(9)))
    admit(m, a)
    stored = [e for e in m.take_events() if isinstance(e, BlockStored)]
    assert [(e.group_idx, e.spec_kind, e.sliding_window) for e in stored] == [
        (0, "full_attention", None), (1, "sliding_window", 8)]
    assert stored[0].token_ids == list(range(8)) and len(stored[0].block_hashes) == 2


def test_eviction_events_precede_new_stored_events() -> None:
    m = manager(full(4), num_blocks=4, events=True)  # 3 usable
    a = request(m, "a", list(range(12)))
    admit(m, a, 11)
    m.free(a)
    m.take_events()
    b = request(m, "b", list(range(50, 62)))
    admit(m, b, 11)
    kinds = [type(e) for e in m.take_events()]
    assert kinds == [BlockRemoved, BlockRemoved, BlockStored]


def test_delay_cache_blocks_then_explicit_cache() -> None:
    m = manager(full(4))
    a = request(m, "a", list(range(8)))
    assert m.allocate_slots(a, 8, delay_cache_blocks=True) is not None
    assert m.pool.num_cached_keys == 0
    m.cache_blocks(a, 8)
    assert m.pool.num_cached_keys == 2


def test_no_caching_never_hashes_or_hits() -> None:
    m = manager(swa(4, 8), mamba(1024, "none"), caching=False)
    a = request(m, "a", list(range(20)))
    assert a.block_hashes == []
    admit(m, a)
    m.free(a)
    b = request(m, "b", list(range(20)))
    assert m.get_computed_blocks(b)[1] == 0
    assert m.pool.num_cached_keys == 0


# -- the manager surface of docs/semantics.md#manager-surface -------------------------------

def _queue(m: KVCacheManager) -> list[int]:
    return [b.block_id for b in m.pool.free_block_queue.get_all_free_blocks()]


@pytest.mark.parametrize("specs", [(full(4),), (full(4), swa(4, 8)), (full(4), mamba(4))])
def test_pop_blocks_for_free_then_release_reversed_is_vllms_deferred_free(specs) -> None:
    # The request is forgotten at once; its blocks (each table without its leading nulls,
    # concatenated) stay held until released. Released last first, the cached ones join
    # the back of the free queue in that order; ``free`` releases group by group instead.
    def admitted():
        m = manager(*specs, num_blocks=40)
        req = request(m, "r", list(range(30)))
        admit(m, req)
        return m, req

    m, req = admitted()
    tables = m.get_blocks("r")
    popped = m.pop_blocks_for_free(req)
    expected = [b for t in tables for b in t[next((i for i, b in enumerate(t)
                                                   if not b.is_null), len(t)):]]
    assert popped == expected and all(b.ref_cnt == 1 for b in popped)
    assert m.get_block_ids("r") == [[] for _ in specs]
    m.pool.free_blocks(reversed(popped))
    cached = [b.block_id for b in reversed(popped) if b.block_hash is not None]
    assert _queue(m)[-len(cached):] == cached

    twin, twin_req = admitted()
    per_group = [b.block_id for t in twin.get_blocks("r") for b in reversed(t)
                 if not b.is_null and b.block_hash is not None]
    twin.free(twin_req)
    assert _queue(twin)[-len(per_group):] == per_group
    if len(specs) == 1:
        assert _queue(twin) == _queue(m)


def test_truncate_computed_blocks_cuts_every_group_at_the_endpoint() -> None:
    m = manager(full(4), mamba(4), num_blocks=64)
    first = request(m, "a", list(range(20)))
    admit(m, first)
    m.free(first)
    second = request(m, "b", list(range(20)) + [99])
    m.new_step_starts()
    blocks, hit, _ = m.get_computed_blocks(second)
    assert hit == 20 and [len(g) for g in blocks] == [5, 5]
    cut = m.truncate_computed_blocks(blocks, 12)
    assert [len(g) for g in cut] == [3, 3]
    assert cut[0] == blocks[0][:3] and [len(g) for g in blocks] == [5, 5]  # pure
    # Mamba may end before the endpoint (a connector brings the state); others may not.
    short = (blocks[0], blocks[1][:2])
    assert [len(g) for g in m.truncate_computed_blocks(short, 12)] == [3, 2]
    with pytest.raises(InvalidArgument) as exc:
        m.truncate_computed_blocks(blocks, 10)
    assert exc.value.field == "num_computed_tokens"
    with pytest.raises(InvalidArgument):
        m.truncate_computed_blocks((blocks[0][:2], blocks[1]), 12)
    assert m.truncate_computed_blocks(blocks, 0) is m.empty_blocks
