"""Stateful property tests: random operation sequences keep the pool invariants
(docs/semantics.md#invariants).

After every step: every block is free, cached-and-free or referenced; ref counts equal
the number of tables holding the block; free + used == num_blocks - 1; no block is in
two groups. When all requests are freed nothing is left referenced.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from cache_service.core.errors import FailedPrecondition
from cache_service.replay import make_pool

from builders import SAMPLE_CONFIGS, SMALL_MAX_LEN, small_config

PREFIXES = [[7] * 8, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], []]


class PoolMachine(RuleBasedStateMachine):
    config_name = "full"

    @initialize()
    def setup(self) -> None:
        self.pool = make_pool(small_config(self.config_name))
        self.next_id = 0

    def _ids(self) -> list[str]:
        return self.pool.request_ids()

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 20), min_size=1,
                                                            max_size=40))
    def add(self, prefix, suffix) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        tokens = (prefix + suffix)[:SMALL_MAX_LEN - 16]
        info = self.pool.add_request(rid, tokens)
        assert info.num_tokens == len(tokens)

    @precondition(lambda self: self.pool.request_ids())
    @rule(data=st.data(), must_fit=st.booleans(), lookahead=st.sampled_from([0, 0, 0, 3]),
          look=st.booleans())
    def allocate(self, data, must_fit, lookahead, look) -> None:
        rid = data.draw(st.sampled_from(self._ids()))
        info = self.pool.request_info(rid)
        hit = 0
        if look and info.num_computed_tokens == 0:
            hit = self.pool.lookup(rid).hit_tokens
            # A hit ends on a hash-block boundary; on a scheduler-block boundary too unless the
            # pool has partial hits (a Mamba group coarser than the hash block: docs/semantics.md).
            assert hit < info.num_tokens and hit % self.pool.hash_block_size == 0
        remaining = max(1, info.num_tokens - info.num_computed_tokens - hit)
        n = data.draw(st.integers(1, remaining))
        res = self.pool.allocate(rid, n, num_lookahead_tokens=lookahead,
                                 full_sequence_must_fit=must_fit)
        after = self.pool.request_info(rid)
        if res.ok:
            assert res.block_ids is not None and res.new_block_ids is not None
            assert after.num_computed_tokens == info.num_computed_tokens + res.hit_tokens_used + n
            assert after.status == "RUNNING"
            for ids, new in zip(res.block_ids, res.new_block_ids):
                real_new = [i for i in new if i]
                assert ids[len(ids) - len(new):] == new or not real_new
        else:
            assert after.num_computed_tokens == info.num_computed_tokens
            assert res.new_block_ids is None

    @precondition(lambda self: self.pool.request_ids())
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 20), min_size=1, max_size=5))
    def append(self, data, tokens) -> None:
        rid = data.draw(st.sampled_from(self._ids()))
        if self.pool.request_info(rid).num_tokens + len(tokens) <= SMALL_MAX_LEN:
            self.pool.append_tokens(rid, tokens)

    @precondition(lambda self: self.pool.request_ids())
    @rule(data=st.data())
    def lookup_only(self, data) -> None:
        rid = data.draw(st.sampled_from(self._ids()))
        try:
            self.pool.lookup(rid)
        except FailedPrecondition:
            assert self.pool.request_info(rid).num_computed_tokens > 0

    @precondition(lambda self: self.pool.request_ids())
    @rule(data=st.data())
    def free(self, data) -> None:
        rid = data.draw(st.sampled_from(self._ids()))
        self.pool.free(rid)
        assert rid not in self.pool.request_ids()

    @precondition(lambda self: self.pool.request_ids())
    @rule(data=st.data())
    def preempt(self, data) -> None:
        rid = data.draw(st.sampled_from(self._ids()))
        self.pool.preempt(rid)
        assert self.pool.block_ids(rid) == [[] for _ in range(self.pool.num_groups)]

    @rule()
    def step(self) -> None:
        self.pool.new_step()

    @rule()
    def reset(self) -> None:
        ok = self.pool.reset_prefix_cache()
        assert ok == (self.pool.stats().usage == 0.0)

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 20), min_size=1,
                                                            max_size=8))
    def peek(self, prefix, suffix) -> None:
        before = self.pool.stats()
        assert 0 <= self.pool.peek_prefix(prefix + suffix) < len(prefix + suffix)
        assert self.pool.stats() == before

    @invariant()
    def invariants_hold(self) -> None:
        self.pool.check_invariants()

    def teardown(self) -> None:
        for rid in self._ids():
            self.pool.free(rid)
        self.pool.check_invariants()
        stats = self.pool.stats()
        assert stats.num_free_blocks == stats.num_blocks - 1 and stats.usage == 0.0
        assert self.pool.reset_prefix_cache()


@pytest.mark.parametrize("name", SAMPLE_CONFIGS)
def test_random_operations_keep_invariants(name: str) -> None:
    machine = type(f"PoolMachine_{name}", (PoolMachine,), {"config_name": name})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=50, stateful_step_count=40, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))
