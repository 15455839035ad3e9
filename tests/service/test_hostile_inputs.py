"""Malformed and hostile input: the right status code, the offending field named in a
BadRequest detail, and no state change (pool stats, a live request, the pool list)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc
import pytest
from grpc_status import rpc_status

from cache_service.client import CacheClient, layers, ops
from cache_service.client._errors import field_violations
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb

from .builders import full_layers

POOL = "hostile"
CBOR_POOL = "hostile-cbor"
VOCAB = 1000
MAX_LEN = 256
LIVE = "live"  # a running request with computed tokens
Code = grpc.StatusCode


@dataclass
class Case:
    name: str
    rpc: str
    request: Callable[[], object]
    code: grpc.StatusCode
    field: str | None = None


def step(*step_ops: pb.Op, pool: str = POOL) -> Callable[[], pb.StepRequest]:
    return lambda: pb.StepRequest(pool_id=pool, ops=list(step_ops))


def register(**changes) -> Callable[[], pb.RegisterPoolRequest]:
    def build() -> pb.RegisterPoolRequest:
        req = pb.RegisterPoolRequest(pool_id="hostile-new", layers=full_layers(),
                                     num_blocks=64,
                                     options=pb.PoolOptions(max_model_len=MAX_LEN))
        for key, value in changes.items():
            value(req) if callable(value) else setattr(req, key, value)
        return req
    return build


def _layer(**kw) -> Callable[[pb.RegisterPoolRequest], None]:
    def edit(req: pb.RegisterPoolRequest) -> None:
        for k, v in kw.items():
            setattr(req.layers[0], k, v)
    return edit


def _chunked_local_only(req: pb.RegisterPoolRequest) -> None:
    del req.layers[:]
    req.layers.append(layers.chunked_local("cl", block_size=16, num_kv_heads=1, head_size=1,
                                           dtype="float32", attention_chunk_size=64))


def _hashes(n: int, size: int = 32) -> list[bytes]:
    return [bytes([i]) * size for i in range(n)]


CASES = [
    Case("pin on an unknown pool", "PinPrefix",
         lambda: pb.PinPrefixRequest(pool_id="nope", pin_id="p", token_ids=[1] * 32,
                                     ttl_seconds=10),
         Code.NOT_FOUND, "pool_id"),
    Case("pin without a ttl", "PinPrefix",
         lambda: pb.PinPrefixRequest(pool_id=POOL, pin_id="p", token_ids=[1] * 32),
         Code.INVALID_ARGUMENT, "ttl_seconds"),
    Case("pin with a negative token id", "PinPrefix",
         lambda: pb.PinPrefixRequest(pool_id=POOL, pin_id="p", token_ids=[1, -2] * 16,
                                     ttl_seconds=10),
         Code.INVALID_ARGUMENT, "token_ids[1]"),
    Case("renew an unknown pin", "RenewPin",
         lambda: pb.RenewPinRequest(pool_id=POOL, pin_id="ghost", ttl_seconds=10),
         Code.NOT_FOUND, "pin_id"),
    Case("drop an unknown pin", "DropPin",
         lambda: pb.DropPinRequest(pool_id=POOL, pin_id="ghost"),
         Code.NOT_FOUND, "pin_id"),
    Case("unknown pool", "Step", lambda: pb.StepRequest(pool_id="nope", ops=[ops.new_step()]),
         Code.NOT_FOUND, "pool_id"),
    Case("allocate unknown request", "Step", step(ops.allocate("ghost", 1)),
         Code.NOT_FOUND, "ops[0].allocate.request_id"),
    Case("negative num_new_tokens", "Step", step(ops.allocate(LIVE, -1)),
         Code.INVALID_ARGUMENT, "ops[0].allocate.num_new_tokens"),
    Case("huge num_new_tokens", "Step", step(ops.allocate(LIVE, 2**62)),
         Code.INVALID_ARGUMENT, "ops[0].allocate.num_new_tokens"),
    Case("zero num_new_tokens", "Step", step(ops.allocate(LIVE, 0)),
         Code.INVALID_ARGUMENT, "ops[0].allocate.num_new_tokens"),
    Case("negative lookahead", "Step", step(ops.allocate(LIVE, 1, num_lookahead_tokens=-5)),
         Code.INVALID_ARGUMENT, "ops[0].allocate.num_lookahead_tokens"),
    Case("duplicate of a live request", "Step", step(ops.add(LIVE, [1, 2])),
         Code.ALREADY_EXISTS, "ops[0].add_request.request_id"),
    Case("duplicate within the batch", "Step", step(ops.add("d", [1]), ops.add("d", [2])),
         Code.ALREADY_EXISTS, "ops[1].add_request.request_id"),
    Case("empty token list", "Step", step(ops.add("e", [])),
         Code.INVALID_ARGUMENT, "ops[0].add_request.token_ids"),
    Case("negative token id", "Step", step(ops.add("e", [1, 2, -3])),
         Code.INVALID_ARGUMENT, "ops[0].add_request.token_ids[2]"),
    Case("token id beyond vocab", "Step", step(ops.add("e", [1, VOCAB])),
         Code.INVALID_ARGUMENT, "ops[0].add_request.token_ids[1]"),
    Case("token id beyond int32", "Step", step(ops.add("e", [2**40])),
         Code.INVALID_ARGUMENT, "ops[0].add_request.token_ids[0]"),
    Case("prompt longer than max_model_len", "Step", step(ops.add("e", [1] * (MAX_LEN + 1))),
         Code.INVALID_ARGUMENT, "ops[0].add_request.token_ids"),
    Case("empty request id", "Step", step(ops.add("", [1])),
         Code.INVALID_ARGUMENT, "ops[0].add_request.request_id"),
    Case("request id too long", "Step", step(ops.add("x" * 300, [1])),
         Code.INVALID_ARGUMENT, "ops[0].add_request.request_id"),
    Case("block hashes on a sha256 pool", "Step",
         step(ops.add("h", [1] * 32, block_hashes=_hashes(2))),
         Code.INVALID_ARGUMENT, "ops[0].add_request.block_hashes"),
    Case("block hash of the wrong length", "Step",
         step(ops.add("h", [1] * 32, block_hashes=_hashes(2, 31)), pool=CBOR_POOL),
         Code.INVALID_ARGUMENT, "ops[0].add_request.block_hashes[0]"),
    Case("wrong number of block hashes", "Step",
         step(ops.add("h", [1] * 32, block_hashes=_hashes(3)), pool=CBOR_POOL),
         Code.INVALID_ARGUMENT, "ops[0].add_request.block_hashes"),
    # Multimodal items and prompt-embedding digests (docs/hashing.md section 2).
    Case("multimodal item past the prompt", "Step",
         step(ops.add("m", [1] * 20, mm_items=[("img", 10, 20)])),
         Code.INVALID_ARGUMENT, "ops[0].add_request.mm_items[0].length"),
    Case("overlapping multimodal items", "Step",
         step(ops.add("m", [1] * 40, mm_items=[("a", 0, 10), ("b", 9, 5)])),
         Code.INVALID_ARGUMENT, "ops[0].add_request.mm_items[1].offset"),
    Case("multimodal items out of order", "Step",
         step(ops.add("m", [1] * 40, mm_items=[("a", 20, 4), ("b", 2, 4)])),
         Code.INVALID_ARGUMENT, "ops[0].add_request.mm_items[1].offset"),
    Case("multimodal item without an identifier", "Step",
         step(ops.add("m", [1] * 40, mm_items=[("", 0, 4)])),
         Code.INVALID_ARGUMENT, "ops[0].add_request.mm_items[0].identifier"),
    Case("empty multimodal item", "Step",
         step(ops.add("m", [1] * 40, mm_items=[("a", 3, 0)])),
         Code.INVALID_ARGUMENT, "ops[0].add_request.mm_items[0].length"),
    Case("multimodal item at a negative offset", "Step",
         step(ops.add("m", [1] * 40, mm_items=[("a", -1, 4)])),
         Code.INVALID_ARGUMENT, "ops[0].add_request.mm_items[0].offset"),
    Case("prompt-embedding digests, one too few", "Step",
         step(ops.add("m", [0] * 40, prompt_embeds_digests=_hashes(2))),
         Code.INVALID_ARGUMENT, "ops[0].add_request.prompt_embeds_digests"),
    Case("prompt-embedding digest of the wrong length", "Step",
         step(ops.add("m", [0] * 40, prompt_embeds_digests=_hashes(2) + _hashes(1, 31))),
         Code.INVALID_ARGUMENT, "ops[0].add_request.prompt_embeds_digests[2]"),
    Case("declared lookahead differs from the pool's", "Step",
         step(ops.add("h", [1] * 32, block_hashes=_hashes(2),
                      hash_recipe=pb.HashRecipe(num_hash_lookahead_tokens=1)), pool=CBOR_POOL),
         Code.INVALID_ARGUMENT, "ops[0].add_request.hash_recipe.num_hash_lookahead_tokens"),
    Case("LoRA id without a LoRA name", "Step", step(ops.add("l", [1] * 8, lora_id=3)),
         Code.INVALID_ARGUMENT, "ops[0].add_request.lora_id"),
    Case("negative LoRA id", "Step",
         step(ops.add("l", [1] * 8, lora_name="a", lora_path="/a", lora_id=-3)),
         Code.INVALID_ARGUMENT, "ops[0].add_request.lora_id"),
    Case("free unknown request", "Step", step(ops.free("ghost")),
         Code.NOT_FOUND, "ops[0].free.request_id"),
    Case("valid ops before an invalid one are not applied", "Step",
         step(ops.add("fresh", [5] * 40), ops.allocate("fresh", 40), ops.append(LIVE, [3]),
              ops.allocate(LIVE, 1), ops.allocate("ghost", 1)),
         Code.NOT_FOUND, "ops[4].allocate.request_id"),
    Case("allocate after free in the batch", "Step",
         step(ops.free(LIVE), ops.allocate(LIVE, 1)),
         Code.NOT_FOUND, "ops[1].allocate.request_id"),
    Case("preempt unknown request", "Step", step(ops.preempt("ghost")),
         Code.NOT_FOUND, "ops[0].preempt.request_id"),
    Case("decode op for an unknown request", "Step", step(ops.decode([LIVE, "ghost"], [1, 2])),
         Code.NOT_FOUND, "ops[0].decode.request_ids[1]"),
    Case("decode op with a request listed twice", "Step", step(ops.decode([LIVE, LIVE], [1, 2])),
         Code.INVALID_ARGUMENT, "ops[0].decode.request_ids[1]"),
    Case("decode op with more tokens than requests", "Step", step(ops.decode([LIVE], [1, 2])),
         Code.INVALID_ARGUMENT, "ops[0].decode.token_ids"),
    Case("decode op token beyond vocab", "Step", step(ops.decode([LIVE], [VOCAB])),
         Code.INVALID_ARGUMENT, "ops[0].decode.token_ids[0]"),
    Case("fill of a request without placeholders", "Step", step(ops.fill([LIVE], [1])),
         Code.INVALID_ARGUMENT, "ops[0].fill_placeholders.token_ids[0]"),
    Case("lookup on a running request", "Step", step(ops.lookup(LIVE)),
         Code.FAILED_PRECONDITION, "ops[0].lookup.request_id"),
    Case("lookup after allocate in the batch", "Step",
         step(ops.add("l", [1] * 20), ops.allocate("l", 20), ops.lookup("l")),
         Code.FAILED_PRECONDITION, "ops[2].lookup.request_id"),
    Case("append beyond max_model_len", "Step", step(ops.append(LIVE, [1] * MAX_LEN)),
         Code.INVALID_ARGUMENT, "ops[0].append_tokens.token_ids"),
    Case("append out-of-vocab token", "Step", step(ops.append(LIVE, [4, VOCAB + 7])),
         Code.INVALID_ARGUMENT, "ops[0].append_tokens.token_ids[1]"),
    Case("decode op with an out-of-vocab token", "Step",
         step(ops.allocate(LIVE, 1, append_token_ids=[4, -7])),
         Code.INVALID_ARGUMENT, "ops[0].allocate.append_token_ids[1]"),
    Case("reset the host tier of an unknown pool", "Step",
         lambda: pb.StepRequest(pool_id="nope", ops=[ops.reset_host_tier()]),
         Code.NOT_FOUND, "pool_id"),
    Case("op with nothing set", "Step", step(ops.new_step(), pb.Op()),
         Code.INVALID_ARGUMENT, "ops[1]"),
    Case("too many ops", "Step", step(*[ops.new_step()] * 5000),
         Code.RESOURCE_EXHAUSTED, "ops"),
    Case("oversized message", "Step", step(ops.add("big", [2**40] * 1_000_000)),
         Code.RESOURCE_EXHAUSTED),
    Case("layer kind unset", "RegisterPool", register(layers=_layer(kind=0)),
         Code.INVALID_ARGUMENT, "layers[0].kind"),
    Case("block size zero", "RegisterPool", register(layers=_layer(block_size=0)),
         Code.INVALID_ARGUMENT, "layers[0].block_size"),
    Case("negative head size", "RegisterPool", register(layers=_layer(head_size=-8)),
         Code.INVALID_ARGUMENT, "layers[0].head_size"),
    Case("sliding window missing", "RegisterPool",
         register(layers=_layer(kind=pb.LAYER_KIND_SLIDING_WINDOW)),
         Code.INVALID_ARGUMENT, "layers[0].sliding_window"),
    Case("rswa window missing", "RegisterPool",
         register(layers=_layer(kind=pb.LAYER_KIND_RSWA)),
         Code.INVALID_ARGUMENT, "layers[0].rswa_window"),
    Case("negative rswa window", "RegisterPool",
         register(layers=_layer(kind=pb.LAYER_KIND_RSWA, rswa_window=-1)),
         Code.INVALID_ARGUMENT, "layers[0].rswa_window"),
    Case("rswa window on a ring", "RegisterPool",
         register(layers=_layer(kind=pb.LAYER_KIND_CIRCULAR_BUFFER, rswa_window=16)),
         Code.INVALID_ARGUMENT, "layers[0].rswa_window"),
    Case("unknown dtype", "RegisterPool", register(layers=_layer(dtype="float7")),
         Code.INVALID_ARGUMENT, "layers[0].dtype"),
    Case("mamba without states", "RegisterPool",
         register(layers=_layer(kind=pb.LAYER_KIND_MAMBA, num_kv_heads=0, head_size=0,
                                dtype="")),
         Code.INVALID_ARGUMENT, "layers[0].mamba_states"),
    Case("duplicate layer names", "RegisterPool",
         register(layers=lambda r: setattr(r.layers[1], "name", r.layers[0].name)),
         Code.INVALID_ARGUMENT, "layers[1].name"),
    Case("watermark out of range", "RegisterPool",
         register(options=lambda r: setattr(r.options, "watermark", 1.5)),
         Code.INVALID_ARGUMENT, "options.watermark"),
    Case("negative retention interval", "RegisterPool",
         register(options=lambda r: setattr(r.options, "prefix_cache_retention_interval", -16)),
         Code.INVALID_ARGUMENT, "options.prefix_cache_retention_interval"),
    Case("retention interval without sliding-window or Mamba groups", "RegisterPool",
         register(options=lambda r: setattr(r.options, "prefix_cache_retention_interval", 16)),
         Code.INVALID_ARGUMENT, "options.prefix_cache_retention_interval"),
    Case("EAGLE with chunked local attention", "RegisterPool",
         register(layers=_chunked_local_only,
                  options=lambda r: setattr(r.options, "use_eagle", True)),
         Code.INVALID_ARGUMENT, "options.use_eagle"),
    Case("negative host tier", "RegisterPool",
         register(options=lambda r: setattr(r.options, "host_tier_blocks", -1)),
         Code.INVALID_ARGUMENT, "options.host_tier_blocks"),
    Case("host tier beyond 2**24 slots", "RegisterPool",
         register(options=lambda r: setattr(r.options, "host_tier_blocks", 2**24 + 1)),
         Code.INVALID_ARGUMENT, "options.host_tier_blocks"),
    Case("host tier without prefix caching", "RegisterPool",
         register(options=lambda r: r.options.MergeFrom(
             pb.PoolOptions(host_tier_blocks=64, enable_caching=False))),
         Code.INVALID_ARGUMENT, "options.host_tier_blocks"),
    Case("negative hash lookahead", "RegisterPool",
         register(options=lambda r: setattr(r.options, "num_hash_lookahead_tokens", -1)),
         Code.INVALID_ARGUMENT, "options.num_hash_lookahead_tokens"),
    Case("hash lookahead with EAGLE's block drop", "RegisterPool",
         register(options=lambda r: r.options.MergeFrom(
             pb.PoolOptions(num_hash_lookahead_tokens=1, use_eagle=True))),
         Code.INVALID_ARGUMENT, "options.num_hash_lookahead_tokens"),
    Case("hash lookahead without prefix caching", "RegisterPool",
         register(options=lambda r: r.options.MergeFrom(
             pb.PoolOptions(num_hash_lookahead_tokens=1, enable_caching=False))),
         Code.INVALID_ARGUMENT, "options.num_hash_lookahead_tokens"),
    Case("max_model_len missing", "RegisterPool",
         register(options=lambda r: setattr(r.options, "max_model_len", 0)),
         Code.INVALID_ARGUMENT, "options.max_model_len"),
    Case("no budget", "RegisterPool", register(budget=lambda r: r.ClearField("budget")),
         Code.INVALID_ARGUMENT, "budget"),
    Case("too few blocks for max_model_len", "RegisterPool", register(num_blocks=5),
         Code.INVALID_ARGUMENT, "num_blocks"),
    # The two reproducers of a rejected RegisterPool that used to leave its pool behind
    # (UNKNOWN "Value out of range" while answering, then every ListPools failed):
    Case("page size overflows int64", "RegisterPool",
         register(layers=_layer(block_size=2**40, num_kv_heads=2**20, head_size=2**20),
                  num_blocks=4, options=lambda r: setattr(r.options, "skip_capacity_check",
                                                          True)),
         Code.INVALID_ARGUMENT, "layers[0].block_size"),
    Case("huge mamba state", "RegisterPool",
         register(layers=lambda r: r.layers[0].CopyFrom(layers.mamba(
             "m", block_size=MAX_LEN, shapes=[(2**31, 2**31, 2**31)], dtypes=["float32"]))),
         Code.INVALID_ARGUMENT, "layers[0].mamba_states[0].shape"),
    # Within the field's own range but beyond the server's block budget (--max-total-blocks):
    Case("num_blocks beyond the server budget", "RegisterPool", register(num_blocks=2**31),
         Code.RESOURCE_EXHAUSTED, "num_blocks"),
    Case("host tier beyond the server budget", "RegisterPool",
         register(options=lambda r: setattr(r.options, "host_tier_blocks", 2**24)),
         Code.RESOURCE_EXHAUSTED, "options.host_tier_blocks"),
    Case("memory budget of tiny pages beyond the server budget", "RegisterPool",
         register(available_memory_bytes=2**60), Code.RESOURCE_EXHAUSTED,
         "available_memory_bytes"),
    Case("bad pool id", "RegisterPool", register(pool_id="has space"),
         Code.INVALID_ARGUMENT, "pool_id"),
    Case("existing pool, other description", "RegisterPool",
         register(pool_id=POOL, num_blocks=65), Code.ALREADY_EXISTS, "num_blocks"),
    Case("peek unknown pool", "PeekPrefix",
         lambda: pb.PeekPrefixRequest(pool_ids=[POOL, "nope"], token_ids=[1]),
         Code.NOT_FOUND, "pool_ids[1]"),
    Case("peek with tokens and hashes", "PeekPrefix",
         lambda: pb.PeekPrefixRequest(pool_ids=[CBOR_POOL], token_ids=[1] * 16,
                                      block_hashes=_hashes(1)),
         Code.INVALID_ARGUMENT, "token_ids"),
    Case("peek names a pool twice", "PeekPrefix",
         lambda: pb.PeekPrefixRequest(pool_ids=[POOL, CBOR_POOL, POOL], token_ids=[1] * 16),
         Code.INVALID_ARGUMENT, "pool_ids[2]"),
    Case("peek tokens x hash recipes over --max-peek-tokens", "PeekPrefix",
         lambda: pb.PeekPrefixRequest(pool_ids=[POOL, CBOR_POOL], token_ids=[1] * 50_001),
         Code.RESOURCE_EXHAUSTED, "token_ids"),
    Case("explained peek, hashes not one per full block of the tokens", "PeekPrefix",
         lambda: pb.PeekPrefixRequest(pool_ids=[CBOR_POOL], token_ids=[1] * 33,
                                      block_hashes=_hashes(1), explain=True),
         Code.INVALID_ARGUMENT, "block_hashes"),
    Case("explained peek, token out of the vocabulary", "PeekPrefix",
         lambda: pb.PeekPrefixRequest(pool_ids=[POOL], token_ids=[1, VOCAB], explain=True),
         Code.INVALID_ARGUMENT, "token_ids[1]"),
    Case("peek with overlapping multimodal items", "PeekPrefix",
         lambda: pb.PeekPrefixRequest(pool_ids=[POOL], token_ids=[1] * 32, mm_items=[
             pb.MultiModalItem(identifier="a", offset=0, length=8),
             pb.MultiModalItem(identifier="b", offset=4, length=8)]),
         Code.INVALID_ARGUMENT, "mm_items[1].offset"),
    Case("pin with too many prompt-embedding digests", "PinPrefix",
         lambda: pb.PinPrefixRequest(pool_id=POOL, pin_id="p", token_ids=[1] * 32,
                                     ttl_seconds=10, prompt_embeds_digests=_hashes(3)),
         Code.INVALID_ARGUMENT, "prompt_embeds_digests"),
    Case("snapshot of an unknown pool", "GetPrefixSnapshot",
         lambda: pb.GetPrefixSnapshotRequest(pool_id="nope"), Code.NOT_FOUND, "pool_id"),
    Case("snapshot of a qualified pool id", "GetPrefixSnapshot",
         lambda: pb.GetPrefixSnapshotRequest(pool_id="t/" + POOL), Code.NOT_FOUND, "pool_id"),
    Case("decode requests count as ops (--max-ops-per-step)", "Step",
         step(ops.decode([f"d{i}" for i in range(4097)], [1] * 4097)),
         Code.RESOURCE_EXHAUSTED, "ops"),
    Case("token ids over --max-tokens-per-step", "Step",
         step(ops.add("t1", [1] * 60_000), ops.add("t2", [1] * 40_001)),
         Code.RESOURCE_EXHAUSTED, "ops"),
    Case("get unknown request", "GetRequest",
         lambda: pb.GetRequestRequest(pool_id=POOL, request_id="ghost"),
         Code.NOT_FOUND, "request_id"),
    Case("get unknown pool", "GetPool", lambda: pb.GetPoolRequest(pool_id="nope"),
         Code.NOT_FOUND, "pool_id"),
    Case("reset the cache of an unknown pool", "ResetPrefixCache",
         lambda: pb.ResetPrefixCacheRequest(pool_id="nope"), Code.NOT_FOUND, "pool_id"),
    Case("evict a block id past the pool", "ResetPrefixCache",
         lambda: pb.ResetPrefixCacheRequest(pool_id=POOL, block_ids=[1, 64]),
         Code.INVALID_ARGUMENT, "block_ids[1]"),
    Case("evict a negative block id", "ResetPrefixCache",
         lambda: pb.ResetPrefixCacheRequest(pool_id=POOL, block_ids=[-1]),
         Code.INVALID_ARGUMENT, "block_ids[0]"),
    Case("stats of unknown pool", "GetPoolStats", lambda: pb.GetPoolStatsRequest(pool_id="x"),
         Code.NOT_FOUND, "pool_id"),
    Case("delete unknown pool", "DeletePool", lambda: pb.DeletePoolRequest(pool_id="x"),
         Code.NOT_FOUND, "pool_id"),
    Case("a client name of 257 characters", "OpenSession",
         lambda: pb.OpenSessionRequest(client_name="x" * 257),
         grpc.StatusCode.INVALID_ARGUMENT, "client_name"),
    Case("keep an unknown session alive", "KeepAlive",
         lambda: pb.KeepAliveRequest(session_id="no-such-session"),
         grpc.StatusCode.NOT_FOUND, "session_id"),
    Case("close an unknown session", "CloseSession",
         lambda: pb.CloseSessionRequest(session_id="no-such-session"),
         grpc.StatusCode.NOT_FOUND, "session_id"),
]


@pytest.fixture(scope="module")
def pools(client: CacheClient) -> None:
    client.register_pool(POOL, full_layers(), num_blocks=64, max_model_len=MAX_LEN,
                         vocab_size=VOCAB)
    client.register_pool(CBOR_POOL, [layers.full_attention("l", block_size=16, num_kv_heads=1,
                                                           head_size=8)],
                         num_blocks=64, max_model_len=MAX_LEN, hash_algo="sha256_cbor")
    client.step(POOL, [ops.add(LIVE, list(range(40))), ops.lookup(LIVE),
                       ops.allocate(LIVE, 40)], begin_step=True)


def snapshot(client: CacheClient) -> tuple:
    return (client.stats(POOL), client.stats(CBOR_POOL), client.get_request(POOL, LIVE),
            sorted((p.pool_id, p.raw.SerializeToString()) for p in client.list_pools()))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_rejected_whole_with_the_field_named(case: Case, client: CacheClient, stub,
                                             pools: None) -> None:
    before = snapshot(client)
    with pytest.raises(grpc.RpcError) as err:
        getattr(stub, case.rpc)(case.request(), timeout=20)
    assert err.value.code() == case.code, err.value.details()
    if case.field is not None:
        status = rpc_status.from_call(err.value)
        assert status is not None, "no rich status details"
        assert field_violations(status)[0][0] == case.field
        assert err.value.details().startswith(case.field)
    assert snapshot(client) == before


# RPCs whose hostile input is tested elsewhere: StepStream carries Step's messages (the
# stream tests), SubscribeEvents below, ListPools and ListSessions take no input.
ELSEWHERE = {"StepStream", "SubscribeEvents", "ListPools", "ListSessions"}


def test_the_table_covers_every_rpc_and_every_op_kind() -> None:
    service = pb.DESCRIPTOR.services_by_name["CacheService"]
    assert {c.rpc for c in CASES} == {m.name for m in service.methods} - ELSEWHERE
    requests = [c.request() for c in CASES if c.rpc == "Step"]
    steps = [r for r in requests if isinstance(r, pb.StepRequest)]
    assert len(steps) == len(requests)
    # the op a case expects to be rejected is its last one
    kinds = {s.ops[-1].WhichOneof("op") for s in steps if s.ops}
    assert kinds >= {f.name for f in pb.Op.DESCRIPTOR.oneofs_by_name["op"].fields} - {"new_step"}
    assert len({c.name for c in CASES}) == len(CASES), "two cases share a name"


def test_snapshot_sees_every_kind_of_state_change(client: CacheClient, pools: None) -> None:
    """The "no state change" check above is only as good as `snapshot`: each change a
    wrongly accepted request could make must show in it."""
    changes = [
        ("a request added", lambda: client.step(POOL, [ops.add("probe", [1, 2, 3])]),
         lambda: client.step(POOL, [ops.free("probe")])),
        ("blocks allocated", lambda: client.step(CBOR_POOL, [ops.add("probe", [1] * 20),
                                                             ops.lookup("probe"),
                                                             ops.allocate("probe", 20)]),
         lambda: client.step(CBOR_POOL, [ops.free("probe")])),
        ("a pool registered", lambda: client.register_pool("hostile-probe", full_layers(),
                                                           num_blocks=64, max_model_len=MAX_LEN),
         lambda: client.delete_pool("hostile-probe")),
    ]
    for what, change, undo in changes:
        before = snapshot(client)
        change()
        try:
            assert snapshot(client) != before, f"snapshot missed: {what}"
        finally:
            undo()


def test_subscribing_from_a_future_sequence_is_out_of_range(client: CacheClient,
                                                            pools: None) -> None:
    from cache_service.client import CacheError

    last = client.stats(POOL).last_event_sequence
    with pytest.raises(CacheError) as err:
        next(iter(client.subscribe_events(POOL, last + 5)))
    assert err.value.code == grpc.StatusCode.OUT_OF_RANGE


def _valid_op(draw, live: list[str], n: int) -> pb.Op:
    from hypothesis import strategies as st

    choice = draw(st.sampled_from(["add", "append", "allocate", "free"] if live else ["add"]))
    if choice == "add":
        rid = f"h{n}"
        live.append(rid)
        return ops.add(rid, draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)))
    rid = draw(st.sampled_from(live))
    if choice == "append":
        return ops.append(rid, [draw(st.integers(0, VOCAB - 1))])
    if choice == "allocate":
        return ops.allocate(rid, draw(st.integers(1, 20)))
    live.remove(rid)
    return ops.free(rid)


INVALID_OPS = [ops.allocate("ghost", 1), ops.add(LIVE, [1]), ops.append(LIVE, [-1]),
               ops.allocate(LIVE, 0), ops.lookup(LIVE), pb.Op()]


def test_any_batch_with_an_invalid_op_changes_nothing(client: CacheClient, pools: None) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from cache_service.client import CacheError

    @settings(max_examples=25, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.data())
    def check(data) -> None:
        live: list[str] = []  # valid ops never touch LIVE, so every INVALID_OP stays invalid
        batch = [_valid_op(data.draw, live, n) for n in range(data.draw(st.integers(0, 8)))]
        bad = data.draw(st.sampled_from(INVALID_OPS))
        at = data.draw(st.integers(0, len(batch)))
        batch.insert(at, bad)
        before = snapshot(client)
        try:
            client.step(POOL, batch, begin_step=True)
        except CacheError as exc:
            assert exc.field.startswith("ops["), exc
        else:
            raise AssertionError("an invalid batch was accepted")
        assert snapshot(client) == before

    check()
