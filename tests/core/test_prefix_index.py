"""The routing index answers exactly what each pool's own lookup answers.

A stateful property test drives pools of many layouts (full, sliding window, Mamba,
chunked local, hybrids, two hash block sizes = two key spaces) through random
allocations, frees, preemptions, explicit evictions, resets and pool deletions, and after
every step compares ``PrefixIndex.peek`` over all pools with each pool's
``prefix_residency`` (hit, every group's reach and Mamba checkpoints) for prompts that
share prefixes with the load, and the index's hash map with one rebuilt from the pools.
"""

from __future__ import annotations

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

from cache_service.core.pool import Pool, PoolOptions
from cache_service.core.prefix_index import PrefixIndex, keyspace_of
from cache_service.core.residency import ExtraKeys
from cache_service.core.slices import run_to_end

from builders import chunked, config, fake_hash, full, mamba, place_cached, swa

MAX_LEN = 96
LAYOUTS = {
    "full": (full(4),),
    "full8": (full(8),),
    "swa": (swa(4, 10),),
    "mamba": (mamba(4),),
    "full_swa": (full(4), swa(4, 10)),
    "full_mamba": (full(4), mamba(4)),
    "full_swa_mamba": (full(4), swa(4, 10), mamba(4)),
    "full4_full8": (full(4), full(8)),
    "full_swa8": (full(4), swa(8, 12)),
    "full_chunked": (full(4), chunked(4, 16)),
    "swa_mamba": (swa(4, 10), mamba(4)),
}
PREFIXES = [[7] * 12, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [3, 1] * 10, []]


def new_pool(layout: str) -> Pool:
    return Pool(config(36, *LAYOUTS[layout]), PoolOptions(max_model_len=MAX_LEN))


def answers_of_pools(pools: dict[str, Pool], prompt: list[int]) -> list[tuple]:
    out = []
    for pool in pools.values():
        r = pool.prefix_residency(prompt)
        out.append((r.hit_tokens, [(g.tokens, g.checkpoints) for g in r.groups]))
    return out


def answers_of_index(index: PrefixIndex, pools: dict[str, Pool], prompt: list[int]) -> list[tuple]:
    first: dict = {}
    for pool in pools.values():
        first.setdefault(keyspace_of(pool), pool)

    def query(ns):
        hashes, max_len, _ = run_to_end(first[ns].peek_input_in_slices(prompt, None, ExtraKeys()))
        return hashes, max_len
    return [(r.hit_tokens, [(g.tokens, g.checkpoints) for g in r.groups])
            for r in index.peek(list(pools), query)]


def rebuilt_maps(pools: dict[str, Pool]) -> dict:
    maps: dict = {}
    for pool in pools.values():
        m = maps.setdefault(keyspace_of(pool), {})
        for gid, bit in enumerate(pool.prefix_log.bits):
            for h in pool.manager.pool.group_map(gid):
                m[h] = m.get(h, 0) | bit
    return maps


class IndexMachine(RuleBasedStateMachine):
    @initialize(layouts=st.lists(st.sampled_from(sorted(LAYOUTS)), min_size=2, max_size=5))
    def setup(self, layouts: list[str]) -> None:
        self.index = PrefixIndex()
        self.pools: dict[str, Pool] = {}
        self.layouts: dict[str, str] = {}
        for i, layout in enumerate(layouts):
            self._create(f"p{i}", layout)
        self.prompts: list[list[int]] = [p + [0] for p in PREFIXES]
        self.next_id = 0

    def _create(self, key: str, layout: str) -> None:
        pool = new_pool(layout)
        self.pools[key] = pool
        self.layouts[key] = layout
        self.index.attach(key, pool, keyspace_of(pool))

    def _requests(self) -> list[tuple[str, str]]:
        return [(k, r) for k, p in self.pools.items() for r in p.request_ids()]

    @rule(data=st.data(), prefix=st.sampled_from(PREFIXES),
          suffix=st.lists(st.integers(0, 9), min_size=1, max_size=40), chunks=st.integers(1, 3),
          keep=st.booleans())
    def run_prompt(self, data, prefix, suffix, chunks, keep) -> None:
        """A request's whole prefill (lookup, then 1-3 chunks, a step between each)."""
        key = data.draw(st.sampled_from(sorted(self.pools)))
        pool = self.pools[key]
        tokens = (prefix + suffix)[:MAX_LEN - 8]
        self.prompts = (self.prompts + [tokens])[-8:]
        rid = f"r{self.next_id}"
        self.next_id += 1
        pool.add_request(rid, tokens)
        hit = pool.lookup(rid).hit_tokens
        left = len(tokens) - hit
        for c in range(chunks):
            n = left if c == chunks - 1 else max(1, left // chunks)
            if n <= 0:
                break
            if not pool.allocate(rid, n).ok:
                break
            left -= n
            pool.new_step()
        if not keep:
            pool.free(rid)

    @precondition(lambda self: self._requests())
    @rule(data=st.data(), token=st.integers(0, 9))
    def decode(self, data, token) -> None:
        key, rid = data.draw(st.sampled_from(self._requests()))
        pool = self.pools[key]
        info = pool.request_info(rid)
        if info.num_computed_tokens and info.num_tokens < MAX_LEN:
            pool.decode([rid], [token])

    @precondition(lambda self: self._requests())
    @rule(data=st.data(), preempt=st.booleans())
    def release(self, data, preempt) -> None:
        key, rid = data.draw(st.sampled_from(self._requests()))
        (self.pools[key].preempt if preempt else self.pools[key].free)(rid)

    @rule(data=st.data(), ids=st.lists(st.integers(1, 35), max_size=6))
    def evict(self, data, ids) -> None:
        self.pools[data.draw(st.sampled_from(sorted(self.pools)))].evict_blocks(ids)

    @rule(data=st.data())
    def reset(self, data) -> None:
        pool = self.pools[data.draw(st.sampled_from(sorted(self.pools)))]
        for rid in pool.request_ids():
            pool.free(rid)
        assert pool.reset_prefix_cache()

    @precondition(lambda self: len(self.pools) > 1)
    @rule(data=st.data(), recreate=st.booleans())
    def delete_pool(self, data, recreate) -> None:
        key = data.draw(st.sampled_from(sorted(self.pools)))
        self.index.detach(key)
        layout = self.layouts.pop(key)
        del self.pools[key]
        if recreate:
            self._create(key + "x", layout)

    @invariant()
    def index_answers_like_pools(self) -> None:
        assert {ns: self.index._spaces[ns].map for ns in self.index._spaces
                if self.index._spaces[ns].map} == \
            {ns: m for ns, m in rebuilt_maps(self.pools).items() if m}
        for prompt in self.prompts:
            for cut in (len(prompt), len(prompt) // 2 + 1):
                p = prompt[:cut]
                assert answers_of_index(self.index, self.pools, p) == \
                    answers_of_pools(self.pools, p), (p, self.layouts)


def test_index_answers_exactly_what_pools_answer() -> None:
    run_state_machine_as_test(IndexMachine, settings=settings(
        max_examples=60, stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))


def test_key_spaces_keep_recipes_apart() -> None:
    """Pools with another hash block size or algorithm never share map entries."""
    index = PrefixIndex()
    a = Pool(config(36, full(4)), PoolOptions(max_model_len=MAX_LEN))
    b = Pool(config(36, full(4)), PoolOptions(max_model_len=MAX_LEN, hash_algo="sha256_cbor"))
    c = Pool(config(36, full(8)), PoolOptions(max_model_len=MAX_LEN))
    for key, pool in (("a", a), ("b", b), ("c", c)):
        index.attach(key, pool, keyspace_of(pool))
    assert len({index.keyspace(k) for k in "abc"}) == 3
    tokens = list(range(17))
    for pool in (a, b, c):
        pool.add_request("r", tokens)
        assert pool.allocate("r", len(tokens)).ok
    assert [index.num_keys(index.keyspace(k)) for k in "abc"] == [4, 4, 2]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), layouts=st.lists(st.sampled_from(sorted(LAYOUTS)), min_size=1,
                                        max_size=4))
def test_index_matches_pools_on_arbitrary_cached_patterns(data, layouts) -> None:
    """Any set of cached blocks per group (not only what a load produces: holes, states
    past the full run, windows cut anywhere) gets the pools' own answers."""
    index = PrefixIndex()
    pools = {}
    fine = [fake_hash(i) for i in range(24)]  # at the keyspace's hash block size (4)
    for n, layout in enumerate(layouts):
        if layout == "full8":
            continue  # another keyspace: covered by the stateful test
        pool = Pool(config(128, *LAYOUTS[layout]), PoolOptions(max_model_len=MAX_LEN))
        block_pool = pool.manager.pool
        for gid, manager in enumerate(pool.manager.coordinator.managers):
            k = manager.block_size // 4
            held = data.draw(st.lists(st.booleans(), min_size=24 // k, max_size=24 // k))
            place_cached(block_pool, held, [gid], block_size=manager.block_size,
                         hashes=[fine[(j + 1) * k - 1] for j in range(24 // k)])
        pools[f"p{n}"] = pool
        index.attach(f"p{n}", pool, keyspace_of(pool))
    if not pools:
        return
    cut = data.draw(st.integers(1, 24))
    hashes = fine[:cut]
    got = [(r.hit_tokens, [(g.tokens, g.checkpoints) for g in r.groups])
           for r in index.peek(list(pools), lambda ns: (hashes, cut * 4))]
    want = []
    for pool in pools.values():
        r = pool.prefix_residency(block_hashes=hashes)
        want.append((r.hit_tokens, [(g.tokens, g.checkpoints) for g in r.groups]))
    assert got == want
