"""Prefix pins (cache_service/core/pins.py): a pinned prefix is never evicted, pins grow as
their prefix is cached, the cap and the account quota refuse at pin time, and a pool whose
pins hold nothing decides exactly as a pool without pins."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from cache_service.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from cache_service.core.pool import Pool
from cache_service.replay import load_config

from builders import SMALL_MAX_LEN, allocate_some, full, make_pool, small_config

SYSTEM = list(range(1, 14))  # 13 tokens: a 12-token (3-block) prefix can hit


def _run(pool: Pool, rid: str, tokens: list[int]) -> None:
    pool.add_request(rid, tokens)
    assert pool.allocate(rid, len(tokens)).ok
    pool.free(rid)


def _flood(pool: Pool, n: int, start: int = 1000) -> None:
    """One-shot requests of fresh tokens that, together, cycle the whole pool."""
    for i in range(n):
        _run(pool, f"flood{start + i}", [start + i] * 20)


def test_a_pinned_prefix_survives_a_flood_that_evicts_it_without_the_pin() -> None:
    plain = make_pool(17, full(4), max_model_len=32)
    pinned = make_pool(17, full(4), max_model_len=32)
    for pool in (plain, pinned):
        _run(pool, "sys", SYSTEM)
    info = pinned.pin_prefix("p", SYSTEM)
    assert (info.hit_tokens, info.num_blocks, info.growing) == (12, 3, False)
    assert pinned.num_free_blocks == plain.num_free_blocks - 3
    for pool in (plain, pinned):
        _flood(pool, 6)
        pool.check_invariants()
    assert plain.peek_prefix(SYSTEM) == 0
    assert pinned.peek_prefix(SYSTEM) == 12
    dropped = pinned.drop_pin("p")
    assert dropped.pin_id == "p" and pinned.pins() == []
    assert pinned.num_free_blocks == 16  # its blocks are evictable again...
    assert pinned.peek_prefix(SYSTEM) == 12  # ...but still cached, at the queue's back
    _flood(pinned, 6, start=2000)
    assert pinned.peek_prefix(SYSTEM) == 0
    pinned.check_invariants()


def test_a_pin_on_a_prefix_being_computed_takes_its_blocks_as_they_are_cached() -> None:
    pool = make_pool(17, full(4), max_model_len=32)
    info = pool.pin_prefix("p", SYSTEM)
    assert (info.hit_tokens, info.num_blocks, info.growing) == (0, 0, True)
    pool.add_request("a", SYSTEM)
    assert pool.allocate("a", 8).ok
    assert pool.pin_info("p").hit_tokens == 8
    assert pool.allocate("a", 5).ok
    pool.free("a")
    assert pool.pin_info("p") == dataclasses.replace(info, hit_tokens=12, num_blocks=3,
                                                     growing=False)
    _flood(pool, 6)
    assert pool.peek_prefix(SYSTEM) == 12
    pool.check_invariants()


def test_the_cap_refuses_at_pin_time_and_changes_nothing() -> None:
    pool = make_pool(17, full(4), max_model_len=32, max_pinned_blocks=4)
    _run(pool, "sys", SYSTEM)
    pool.pin_prefix("a", SYSTEM)  # 3 blocks
    other = [50 + i for i in range(13)]
    _run(pool, "other", other)
    free_before, stats_before = pool.num_free_blocks, pool.stats()
    with pytest.raises(ResourceExhausted) as err:
        pool.pin_prefix("b", other)  # 3 more: 6 > 4
    assert err.value.field == "token_ids" and "max_pinned_blocks" in str(err.value)
    assert pool.num_free_blocks == free_before
    assert pool.stats() == dataclasses.replace(stats_before, pin_refusals=1)  # a statistic
    assert [p.pin_id for p in pool.pins()] == ["a"]
    # Given as block hashes, the same refusal names the field the prefix came in.
    pool.add_request("o", other)
    hashes = pool.block_hashes("o")
    pool.free("o")
    with pytest.raises(ResourceExhausted) as err:
        pool.pin_prefix("b", block_hashes=hashes)
    assert err.value.field == "block_hashes"
    assert [p.pin_id for p in pool.pins()] == ["a"]
    # A pin sharing the pinned blocks adds nothing to the pinned total.
    pool.pin_prefix("a2", SYSTEM)
    assert pool.num_pinned_blocks == 3
    # A growing pin reserves its bound: 3 held + 3 reserved > 4.
    with pytest.raises(ResourceExhausted):
        pool.pin_prefix("c", [90 + i for i in range(13)])
    pool.check_invariants()


def test_the_default_cap_leaves_room_for_one_max_len_request() -> None:
    pool = make_pool(17, full(4), max_model_len=32)  # 16 usable, one request needs 8
    assert pool.max_pinned_blocks == 8
    for i in range(3):
        tokens = [10 * i + 1 + j for j in range(13)]
        _run(pool, f"s{i}", tokens)
        if i < 2:
            pool.pin_prefix(f"p{i}", tokens)
        else:
            with pytest.raises(ResourceExhausted):
                pool.pin_prefix(f"p{i}", tokens)
    pool.add_request("big", [7] * 32)
    assert pool.allocate("big", 32, full_sequence_must_fit=True).ok


def test_an_account_quota_counts_its_pins_only() -> None:
    pool = make_pool(33, full(4), max_model_len=32, pinned_block_quota=4)
    _run(pool, "sys", SYSTEM)
    pool.pin_prefix("a1", SYSTEM, account="a")
    with pytest.raises(ResourceExhausted) as err:
        pool.pin_prefix("a2", SYSTEM, account="a")  # charged 3 + 3 > 4
    assert "pinned_block_quota" in str(err.value)
    pool.pin_prefix("b1", SYSTEM, account="b")
    assert pool.pinned_blocks_by_account() == {"a": 3, "b": 3}
    assert pool.num_pinned_blocks == 3
    pool.drop_pin("a1")
    assert pool.pinned_blocks_by_account() == {"b": 3}


def test_bad_pins_are_refused_naming_the_field() -> None:
    pool = make_pool(17, full(4), max_model_len=32)
    _run(pool, "sys", SYSTEM)
    pool.pin_prefix("p", SYSTEM)
    with pytest.raises(AlreadyExists) as e1:
        pool.pin_prefix("p", SYSTEM)
    with pytest.raises(InvalidArgument) as e2:
        pool.pin_prefix("", SYSTEM)
    with pytest.raises(InvalidArgument) as e3:
        pool.pin_prefix("q", [1, 2, 3])  # no block can hit
    with pytest.raises(InvalidArgument) as e4:
        pool.pin_prefix("q", [1, -2, 3, 4, 5])
    with pytest.raises(InvalidArgument) as e5:
        pool.pin_prefix("q", block_hashes=[b"short"])
    with pytest.raises(NotFound) as e6:
        pool.drop_pin("nope")
    assert [e.value.field for e in (e1, e2, e3, e4, e5, e6)] == [
        "pin_id", "pin_id", "token_ids", "token_ids[1]", "block_hashes[0]", "pin_id"]
    assert [p.pin_id for p in pool.pins()] == ["p"]
    nocache = make_pool(17, full(4), max_model_len=32, enable_caching=False)
    with pytest.raises(FailedPrecondition):
        nocache.pin_prefix("p", SYSTEM)


def test_a_pin_by_block_hashes_holds_what_a_pin_by_tokens_holds() -> None:
    pool = make_pool(17, full(4), max_model_len=32)
    _run(pool, "sys", SYSTEM)
    pool.add_request("h", SYSTEM)
    hashes = pool.block_hashes("h")
    pool.free("h")
    by_hash = pool.pin_prefix("h", block_hashes=hashes)
    assert (by_hash.prefix_tokens, by_hash.hit_tokens, by_hash.num_blocks) == (12, 12, 3)
    assert pool.num_pinned_blocks == 3


# -- random operation sequences ----------------------------------------------------------

PREFIXES = [list(range(1, 25)), [7] * 8 + [9] * 8, list(range(30, 42))]
CONFIGS = ["full", "full_swa", "full_mamba", "full_swa_mamba"]


def _pool(name: str, **pin_options: Any) -> Pool:
    config, options = load_config(small_config(name))
    return Pool(config, dataclasses.replace(options, **pin_options))


class PinMachine(RuleBasedStateMachine):
    """Random requests, pins and drops. After every rule: the pool's invariants hold; a
    live pin's hit equals what a lookup of its prefix finds now and never shrinks (no
    block it needs was evicted); no account is charged beyond its quota."""

    config_name = "full"

    @initialize(quota=st.sampled_from([None, 12]), cap=st.sampled_from([None, 20]))
    def setup(self, quota: int | None, cap: int | None) -> None:
        # The small pools' default cap is tiny (one request's worst case is most of the
        # pool): an explicit cap lets pins hold blocks in every group kind.
        options = {k: v for k, v in (("pinned_block_quota", quota), ("max_pinned_blocks", cap))
                   if v is not None}
        self.pool = _pool(self.config_name, **options)
        self.next_id = 0
        self.pinned: dict[str, tuple[list[int], int]] = {}  # pin id -> (tokens, last hit)

    def _ids(self) -> list[str]:
        return self.pool.request_ids()

    @rule(prefix=st.sampled_from(PREFIXES),
          suffix=st.lists(st.integers(0, 20), min_size=1, max_size=30))
    def add(self, prefix: list[int], suffix: list[int]) -> None:
        self.pool.add_request(f"r{self.next_id}", (prefix + suffix)[:SMALL_MAX_LEN - 16])
        self.next_id += 1

    @precondition(lambda self: self.pool.request_ids())
    @rule(data=st.data(), look=st.booleans())
    def allocate(self, data: st.DataObject, look: bool) -> None:
        rid = data.draw(st.sampled_from(self._ids()))
        info = self.pool.request_info(rid)
        hit = self.pool.lookup(rid).hit_tokens if look and not info.num_computed_tokens else 0
        remaining = max(1, info.num_tokens - info.num_computed_tokens - hit)
        self.pool.allocate(rid, data.draw(st.integers(1, remaining)))

    @precondition(lambda self: self.pool.request_ids())
    @rule(data=st.data(), preempt=st.booleans())
    def release(self, data: st.DataObject, preempt: bool) -> None:
        rid = data.draw(st.sampled_from(self._ids()))
        (self.pool.preempt if preempt else self.pool.free)(rid)

    @rule()
    def step(self) -> None:
        self.pool.new_step()

    @rule(prefix=st.sampled_from(PREFIXES), cut=st.integers(5, 24),
          account=st.sampled_from(["a", "b"]))
    def pin(self, prefix: list[int], cut: int, account: str) -> None:
        pin_id = f"p{self.next_id}"
        self.next_id += 1
        tokens = prefix[:cut]
        try:
            info = self.pool.pin_prefix(pin_id, tokens, account=account)
        except (ResourceExhausted, InvalidArgument):
            return
        self.pinned[pin_id] = (tokens, info.hit_tokens)

    @precondition(lambda self: self.pinned)
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        pin_id = data.draw(st.sampled_from(sorted(self.pinned)))
        self.pool.drop_pin(pin_id)
        del self.pinned[pin_id]

    @invariant()
    def pins_hold(self) -> None:
        pool = self.pool
        pool.check_invariants()
        for pin_id, (tokens, last) in self.pinned.items():
            info = pool.pin_info(pin_id)
            now = pool.peek_prefix(tokens)
            assert info.hit_tokens == now, (pin_id, info, now)
            assert now >= last, f"pin {pin_id}: hit shrank from {last} to {now}"
            self.pinned[pin_id] = (tokens, now)

    def teardown(self) -> None:
        for rid in self._ids():
            self.pool.free(rid)
        self.pool.check_invariants()
        if self.pool.options.max_pinned_blocks is not None:
            return
        # The default cap: what an empty pool admits in one piece (a request of
        # max_model_len's worst case) still fits beside every pin.
        max_len = self.pool.options.max_model_len
        empty = _pool(self.config_name)
        for pool in (empty, self.pool):
            pool.add_request("big", [21] * (max_len - 1))
        n = self.pool.max_new_tokens
        assert self.pool.allocate("big", n).ok == empty.allocate("big", n).ok


@pytest.mark.parametrize("name", CONFIGS)
def test_random_operations_never_evict_a_pinned_prefix(name: str) -> None:
    machine = type(f"PinMachine_{name}", (PinMachine,), {"config_name": name})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=30, stateful_step_count=40, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))


_OP = st.one_of(
    st.tuples(st.just("add"), st.sampled_from(range(3)), st.integers(1, 30)),
    st.tuples(st.just("alloc"), st.integers(0, 50), st.integers(1, 40)),
    st.tuples(st.just("free"), st.integers(0, 50), st.just(0)),
    st.tuples(st.just("step"), st.just(0), st.just(0)),
)


def _drive(pool: Pool, ops: list[tuple[str, int, int]]) -> list[object]:
    """Applies ``ops`` (indices pick live requests); every answer and the free order."""
    out: list[object] = []
    n = 0
    for kind, a, b in ops:
        ids = pool.request_ids()
        if kind == "add":
            pool.add_request(f"r{n}", (PREFIXES[a] + [b] * b)[:SMALL_MAX_LEN - 16])
            n += 1
        elif kind == "alloc" and ids:
            out.append(allocate_some(pool, ids[a % len(ids)], b))
        elif kind == "free" and ids:
            out.append(pool.free(ids[a % len(ids)]))
        elif kind == "step":
            pool.new_step()
    queue = pool.manager.pool.free_block_queue
    out.append([blk.block_id for blk in queue.get_all_free_blocks()])
    # The pin counters aside (the pinned pool counts its idle pin), stats are equal.
    out.append(dataclasses.replace(pool.stats(), num_pins=0, max_pinned_blocks=0,
                                   pinned_blocks_by_account={}))
    return out


@pytest.mark.parametrize("name", CONFIGS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_OP, max_size=60))
def test_a_pool_whose_pins_hold_nothing_decides_as_the_plain_core(
        name: str, ops: list[tuple[str, int, int]]) -> None:
    plain = _pool(name)
    pinned = _pool(name, max_pinned_blocks=39, pinned_block_quota=39)
    # A live pin on a prefix no request ever computes (and one taken and dropped on it).
    pinned.pin_prefix("never", list(range(500, 517)))
    pinned.pin_prefix("gone", list(range(600, 617)))
    pinned.drop_pin("gone")
    assert _drive(plain, ops) == _drive(pinned, ops)
    pinned.check_invariants()


@pytest.mark.parametrize("name", ["full_mamba", "full_swa_mamba"])
def test_a_pin_holds_every_group_a_hit_needs(name: str) -> None:
    """Full attention's blocks, the sliding window's tail and the Mamba checkpoint at the
    prefix's end: after a flood, the prefix still hits in a pinned pool only."""
    tokens = list(range(1, 25)) + [3, 4]
    pools = [_pool(name, max_pinned_blocks=20) for _ in range(2)]
    for pool in pools:
        pool.add_request("a", tokens)
        assert pool.allocate("a", 12).ok  # the Mamba state is checkpointed at 12
        pool.new_step()
        assert pool.allocate("a", 14).ok
        pool.new_step()
        pool.free("a")
        assert pool.peek_prefix(tokens[:13]) == 12
    info = pools[1].pin_prefix("p", tokens[:13])
    kinds = [type(m).__name__ for m in pools[1].manager.coordinator.managers]
    held = pools[1]._pins.pins["p"].held  # type: ignore[union-attr]
    assert all(held[g] for g in range(len(kinds))), (kinds, held)
    assert info.hit_tokens == 12
    for pool in pools:
        for i in range(8):
            _run(pool, f"f{i}", [100 + i] * 40)
        pool.check_invariants()
    assert [pool.peek_prefix(tokens[:13]) for pool in pools] == [0, 12]
