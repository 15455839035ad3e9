"""The one table of op sizes (cache_service.core.operations.OP_SIZE_FIELDS) reads the protocol's op
messages and the core ops alike: the per-Step limits count a Step before it is converted,
the slicing counts the converted ops, and both must see the same sizes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service import convert
from cache_service.core import operations as ops
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb

KINDS = sorted(ops.OP_SIZE_FIELDS)


def test_the_table_has_one_row_per_kind_of_op_in_the_protocol() -> None:
    oneof = pb.Op.DESCRIPTOR.oneofs_by_name["op"]
    assert sorted(f.name for f in oneof.fields) == KINDS
    core_kinds = {cls.KIND for cls in (ops.AddRequest, ops.Lookup, ops.Allocate,
                                       ops.AppendTokens, ops.Free, ops.Preempt, ops.NewStep,
                                       ops.Decode, ops.FillPlaceholders, ops.ResetHostTierOp)}
    assert core_kinds == set(KINDS)


def _proto_op(kind: str, num_ids: int, num_tokens: int) -> pb.Op:
    """An op of ``kind`` naming ``num_ids`` requests (where the kind names many) and
    carrying ``num_tokens`` token ids (where it carries any)."""
    op = pb.Op()
    body = getattr(op, kind)
    body.SetInParent()
    per, tokens = ops.OP_SIZE_FIELDS[kind]
    if per is None:
        if "request_id" in body.DESCRIPTOR.fields_by_name:
            body.request_id = "r"
    else:
        getattr(body, per).extend(f"r{i}" for i in range(num_ids))
    if tokens is not None:
        n = num_ids if per is not None else num_tokens  # one token per request named
        getattr(body, tokens).extend(range(n))
    if kind == "allocate":
        body.num_new_tokens = 1
    return op


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(KINDS), st.integers(1, 40), st.integers(1, 200))
def test_a_protocol_op_and_its_core_op_have_the_same_size(kind: str, num_ids: int,
                                                         num_tokens: int) -> None:
    op = _proto_op(kind, num_ids, num_tokens)
    [core] = convert.ops_from_proto(pb.StepRequest(ops=[op]), "sha256")
    body = getattr(op, kind)
    assert kind == core.KIND
    assert ops.op_requests(kind, body) == ops.op_requests(kind, core)
    assert ops.op_tokens(kind, body) == ops.op_tokens(kind, core)
    assert ops.op_cost(kind, body) == ops.op_cost(kind, core)


def test_the_cost_rule() -> None:
    """One unit per request an op names, plus one per TOKENS_PER_COST token ids of an op
    that names one request (a decode op's token ids are one per request: not extra)."""
    per_cost = ops.TOKENS_PER_COST
    add = ops.AddRequest("a", list(range(3 * per_cost + 1)))
    assert (ops.op_requests("add_request", add), ops.op_tokens("add_request", add),
            ops.op_cost("add_request", add)) == (1, 3 * per_cost + 1, 1 + 3)
    decode = ops.Decode([f"r{i}" for i in range(5)], [7] * 5)
    assert (ops.op_requests("decode", decode), ops.op_tokens("decode", decode),
            ops.op_cost("decode", decode)) == (5, 5, 5)
    assert ops.op_cost("free", ops.Free("a")) == ops.op_requests("free", ops.Free("a")) == 1
