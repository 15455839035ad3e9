"""Pools come back from a pickle (what a snapshot holds) exactly as they were, in the core
this process runs and across cores: a pickle written by the pure-Python core loads in the
compiled one and the other way round (cache_service/core/restore.py). Checked by going on
with the same calls on the original and on the copy: same answers, tables, free-queue
order, statistics and events."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cache_service.core import _variant
from cache_service.core.operations import AddRequest, Allocate
from cache_service.core.pool import Pool
from cache_service.core.restore import fill_added_attributes

from builders import SAMPLE_CONFIGS, full, make_pool, snapshot_with_events, twin_pools

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def busy_pool(name: str) -> Pool:
    """A pool of a sample config (mixed block sizes: coarse hashes, partial hits) after
    admissions with a shared prefix and a salt, a prefix hit, decodes that fill, hash and
    evict blocks, a preemption and a free, with KV events queued and a lookup pending."""
    pool, _ = twin_pools(name, mixed=True)
    shared = [1, 2, 3, 4, 5, 6, 7, 8] * 2
    for i in range(4):
        pool.add_request(f"r{i}", shared + [i] * (3 + i), cache_salt="s" if i == 3 else None)
        pool.lookup(f"r{i}")
        pool.allocate(f"r{i}", pool.num_tokens(f"r{i}"))
    for step in range(8):
        pool.new_step()
        rids = [r for r in pool.request_ids() if pool.num_tokens(r) < pool.options.max_model_len]
        pool.decode(rids, [(step + j) % 5 for j in range(len(rids))])
    prompt = shared + [0] * 3
    pool.free("r0")
    pool.add_request("again", prompt)
    pool.lookup("again")  # a hit where the config's rules allow one (full: 16 tokens)
    pool.allocate("again", len(prompt))
    pool.preempt("r1")
    pool.add_request("pending", shared + [9] * 20)
    pool.lookup("pending")
    return pool


def go_on(pool: Pool) -> list[object]:
    """The same calls after the restore, answers collected."""
    answers: list[object] = []
    answers.append(pool.allocate("pending", 36).block_ids)
    pool.add_request("late", [1, 2, 3, 4, 5, 6, 7, 8] * 3)
    answers.append(pool.lookup("late"))
    answers.append(pool.allocate("late", 24).block_ids)
    for step in range(6):
        pool.new_step()
        rids = [r for r in sorted(pool.request_ids())
                if pool.num_tokens(r) < pool.options.max_model_len
                and pool.request_info(r).num_computed_tokens]
        out = pool.decode(rids, [step % 3] * len(rids))
        answers.append((out.ok, out.new_block_ids))
    answers.append(snapshot_with_events(pool))
    pool.check_invariants()
    return answers


@pytest.mark.parametrize("name", SAMPLE_CONFIGS)
def test_a_pickled_pool_goes_on_as_the_original(name: str) -> None:
    pool = busy_pool(name)
    copy = pickle.loads(pickle.dumps(pool, protocol=pickle.HIGHEST_PROTOCOL))
    copy.check_invariants()
    assert snapshot_with_events(copy) == snapshot_with_events(pool)
    assert go_on(copy) == go_on(pool)


def test_a_pool_with_an_account_quota_keeps_it() -> None:
    pool = make_pool(100, full(4), max_model_len=256, account_block_quota=10)
    pool.apply_batch([AddRequest("a1", [1] * 24, account="A"), Allocate("a1", 24),
                      AddRequest("a2", [2] * 24, account="A")])
    copy = pickle.loads(pickle.dumps(pool))
    assert copy.account_blocks("A") == pool.account_blocks("A") == 6
    # 6 more blocks would take account A past its 10: refused by both, counted by both.
    assert copy.allocate("a2", 24).ok is pool.allocate("a2", 24).ok is False
    assert copy.stats() == pool.stats()


def _other_core() -> str:
    """The core a cross-core pickle comes from: the one this process does not run."""
    return "pure" if _variant.build_info()["variant"] == "compiled" else "compiled"


@pytest.mark.parametrize("name", ["full_swa_mamba", "full_mamba32"])
def test_a_pickle_of_the_other_core_loads_in_this_one(name: str, tmp_path: Path) -> None:
    other = _other_core()
    if other == "compiled" and _variant._why_not() is not None:
        pytest.skip(f"no usable compiled core to write the pickle: {_variant._why_not()}")
    out = tmp_path / "pool.pickle"
    script = (f"import pickle, sys; sys.path.insert(0, {str(HERE)!r}); "
              "from test_restore import busy_pool; "
              "from cache_service.core import _variant; "
              f"assert _variant.build_info()['variant'] == {other!r}; "
              f"open({str(out)!r}, 'wb').write(pickle.dumps(busy_pool({name!r})))")
    env = {**os.environ, "KVCACHE_CORE": other, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120)
    copy = pickle.loads(out.read_bytes())
    assert type(copy) is Pool  # this core's class
    copy.check_invariants()
    pool = busy_pool(name)
    assert snapshot_with_events(copy) == snapshot_with_events(pool)
    assert go_on(copy) == go_on(pool)


PREV_RELEASE = HERE / "data" / "prev_release"  # written by data/write_prev_release.py


def _plain(value: Any) -> object:
    """As data/write_prev_release.py writes an answer (a lookup's hit as its three fields)."""
    if hasattr(value, "hit_tokens"):
        return [value.hit_tokens, _plain(value.block_ids), value.shared_prefix_boundary]
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return [[_plain(k), _plain(v)] for k, v in sorted(value.items())]
    return value


@pytest.mark.parametrize("name", sorted(p.stem for p in PREV_RELEASE.glob("*.pickle")))
def test_a_pool_pickled_by_the_previous_release_goes_on_as_it_would_have(name: str) -> None:
    """A snapshot outlives an upgrade: the previous release's pickle loads in this core,
    gets the attributes added since (restore.fill_added_attributes, which PoolEntry's
    unpickling calls) and answers what the previous release answered."""
    copy = pickle.loads((PREV_RELEASE / f"{name}.pickle").read_bytes())
    fill_added_attributes(copy)
    copy.check_invariants()
    want = json.loads((PREV_RELEASE / "answers.json").read_text())[name]
    assert json.loads(json.dumps(_plain(go_on(copy)[:-1]))) == want
