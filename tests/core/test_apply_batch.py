"""``Pool.apply_batch``: a rejected batch changes nothing and names ``ops[i].<kind>.<field>``;
an accepted batch equals its ops applied one by one (outcomes, state, events)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_service.core.errors import (
    DuplicateRequest,
    FailedPrecondition,
    InvalidArgument,
    KVCacheError,
    UnknownRequest,
)
from cache_service.core.operations import (
    AddRequest,
    Allocate,
    AppendTokens,
    Decode,
    Free,
    Lookup,
    NewStep,
    Op,
    Preempt,
)
from cache_service.core.pool import Pool

from builders import full, make_pool, twin_pools
from builders import snapshot_with_events as snapshot


def running_pool() -> Pool:
    """"a" running with 10 tokens, "b" waiting with a pending lookup hit, events taken."""
    p = make_pool(64, full(4), max_model_len=64)
    p.apply_batch([AddRequest("a", list(range(10))), Allocate("a", 10)])
    p.apply_batch([AddRequest("b", list(range(10)) + [7]), Lookup("b")])
    p.take_events()
    return p


def wrong_type(value: object) -> Any:
    """``value`` passed where the op's annotation wants another type, as an untyped caller
    may: the pool must reject it by name."""
    return value


VALID_PREFIX: list[Op] = [AddRequest("c", [1, 2, 3]), Allocate("c", 3), Decode(["a"], [5]),
                          AppendTokens("c", [9]), Preempt("a"), NewStep()]


@pytest.mark.parametrize("bad, error, field", [
    (AddRequest("c", [1]), DuplicateRequest, "add_request.request_id"),
    (AddRequest("d", []), InvalidArgument, "add_request.token_ids"),
    (AddRequest("d", [1, -2]), InvalidArgument, "add_request.token_ids[1]"),
    (AddRequest("x" * 257, [1]), InvalidArgument, "add_request.request_id"),
    (AddRequest("d", [1], lora_path="/p"), InvalidArgument, "add_request.lora_path"),
    (Allocate("zz", 1), UnknownRequest, "allocate.request_id"),
    (Allocate("c", 0), InvalidArgument, "allocate.num_new_tokens"),
    (Allocate("b", 0), InvalidArgument, "allocate.num_new_tokens"),  # blocks moved before
    (Allocate("c", 65), InvalidArgument, "allocate.num_new_tokens"),
    (Allocate("c", 1, use_lookup=wrong_type("yes")), InvalidArgument, "allocate.use_lookup"),
    (Allocate("c", 1, append_token_ids=[1] * 61), InvalidArgument,
     "allocate.append_token_ids"),
    (Lookup("c"), FailedPrecondition, "lookup.request_id"),  # allocated earlier in the batch
    (AppendTokens("c", [wrong_type("t")]), InvalidArgument, "append_tokens.token_ids[0]"),
    (Decode(["a", "a"], [1, 1]), InvalidArgument, "decode.request_ids[1]"),
    (Decode(["c", "zz"], [1, 1]), UnknownRequest, "decode.request_ids[1]"),
    (Free("zz"), UnknownRequest, "free.request_id"),
    ("not an op", InvalidArgument, ""),
])
def test_a_rejected_batch_changes_nothing(bad, error: type[KVCacheError], field: str) -> None:
    p = running_pool()
    before = snapshot(p)
    with pytest.raises(error) as exc:
        p.apply_batch([*VALID_PREFIX, bad], begin_step=True)
    n = len(VALID_PREFIX)
    assert exc.value.field == (f"ops[{n}].{field}" if field else f"ops[{n}]")
    assert snapshot(p) == before
    p.check_invariants()


def test_a_later_free_makes_an_earlier_id_reusable_within_the_batch() -> None:
    p = running_pool()
    outs = p.apply_batch([Free("a"), AddRequest("a", [4, 5]), Allocate("a", 2)])
    assert outs[2].ok and p.request_info("a").num_tokens == 2
    with pytest.raises(UnknownRequest) as exc:
        p.apply_batch([Free("b"), Lookup("b")])
    assert exc.value.field == "ops[1].lookup.request_id"


def test_zero_new_tokens_adopts_a_fresh_hit_only() -> None:
    p = make_pool(64, full(4), max_model_len=64)
    p.apply_batch([AddRequest("a", list(range(9))), Allocate("a", 9), Free("a")])
    p.apply_batch([AddRequest("b", list(range(9))), Lookup("b")])
    out = p.apply_batch([Allocate("b", 0)])[0]  # the cached 8 tokens, nothing new
    assert out.ok and out.hit_tokens_used == 8 and out.num_computed_tokens == 8


# -- property: a batch equals its ops one by one -------------------------------------------

def draw_batch(data: st.DataObject, pool: Pool, fresh: list[int]) -> list:
    """A batch that is mostly valid for ``pool`` (ids it knows, counts that fit), with
    now and then an op that is not (an unknown id, a bad count, a lookup too late)."""
    live = set(pool.request_ids())
    ops: list = []
    for _ in range(data.draw(st.integers(1, 8), label="size")):
        known = sorted(live) if live else ["ghost"]
        rid = data.draw(st.sampled_from(known + ["ghost"] if data.draw(st.integers(0, 9))
                                        == 0 else known), label="rid")
        kind = data.draw(st.sampled_from(["add", "add", "lookup", "allocate", "allocate",
                                          "append", "free", "preempt", "new_step",
                                          "decode", "decode"]), label="kind")
        toks = data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=12), label="t")
        if kind == "add":
            fresh[0] += 1
            rid = f"r{fresh[0]}"
            ops.append(AddRequest(rid, toks))
            live.add(rid)
        elif kind == "lookup":
            ops.append(Lookup(rid))
        elif kind == "allocate":
            n = data.draw(st.integers(-1, 10), label="n")
            ops.append(Allocate(rid, n, append_token_ids=toks[:data.draw(
                st.integers(0, 2), label="append")]))
        elif kind == "append":
            ops.append(AppendTokens(rid, toks[:3]))
        elif kind == "free":
            ops.append(Free(rid))
            live.discard(rid)
        elif kind == "preempt":
            ops.append(Preempt(rid))
        elif kind == "new_step":
            ops.append(NewStep())
        else:
            rids = data.draw(st.lists(st.sampled_from(known), min_size=1, max_size=4,
                                      unique=True), label="rids")
            ops.append(Decode(rids, [toks[0]] * len(rids)))
    return ops


def stricter_rule(ops: list, bad: int, exc: KVCacheError) -> bool:
    """Whether ``ops[bad]`` was refused by a rule only a whole batch has (see the test)."""
    op = ops[bad]
    if isinstance(exc, FailedPrecondition) and isinstance(op, Lookup):
        return True
    moved = (Allocate, Decode, Free, Preempt)
    return (isinstance(exc, InvalidArgument) and isinstance(op, Allocate)
            and op.num_new_tokens == 0
            and any(isinstance(o, moved) or (isinstance(o, Lookup)
                                             and o.request_id == op.request_id)
                    for o in ops[:bad]))


def op_index(exc: KVCacheError) -> tuple[int, str]:
    """(i, field relative to the op) of a batch error ``ops[i].<kind>.<field>``."""
    head, _, rest = exc.field.partition(".")
    return int(head[4:-1]), rest


@pytest.mark.parametrize("name", ["full_swa_mamba", "full_swa"])
@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_a_batch_equals_its_ops_one_by_one(name: str, data: st.DataObject) -> None:
    batched, single = twin_pools(name)
    history: list[tuple[list, bool]] = []  # accepted batches, to rebuild the twin
    fresh = [0]
    for _ in range(12):
        ops = draw_batch(data, batched, fresh)
        begin = data.draw(st.booleans(), label="begin_step")
        before = snapshot(batched)
        try:
            outcomes = batched.apply_batch(ops, begin_step=begin)
        except KVCacheError as exc:
            assert snapshot(batched) == before, "a rejected batch changed the pool"
            bad, field = op_index(exc)
            assert field.startswith(ops[bad].KIND)
            if begin:
                single.new_step()
            for i, op in enumerate(ops[:bad + 1]):
                try:
                    single.apply_batch([op])
                except KVCacheError as one:
                    assert i == bad and type(one) is type(exc), (i, bad, one, exc)
                    assert op_index(one)[1] == field
                    break
            else:
                # The batch's two stricter rules (core/batch.py's docstring): a lookup after
                # an allocate of the same request (which may have computed tokens) is refused
                # without running it, and an allocate of 0 tokens adopts only a hit known
                # before the batch (no lookup of it nor block-changing op earlier in it).
                assert stricter_rule(ops, bad, exc), (bad, exc)
            # The twin applied the ops before ``bad``: rebuild it from the accepted batches.
            _, single = twin_pools(name)
            for old_ops, old_begin in history:
                if old_begin:
                    single.new_step()
                for op in old_ops:
                    single.apply_batch([op])
            single.take_events()  # the batched twin's were taken as they came
            continue
        if begin:
            single.new_step()
        assert outcomes == [single.apply_batch([op])[0] for op in ops]
        assert snapshot(batched) == snapshot(single)
        history.append((ops, begin))
    batched.check_invariants()

