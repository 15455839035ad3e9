"""Typed Python client of ``kvcache.v1.CacheService``.

    from cache_service.client import AsyncCacheClient, CacheClient, StepBuilder, layers, ops

    async with AsyncCacheClient("127.0.0.1:50051") as client:
        pool = await client.register_pool(
            "llama", [layers.full_attention(f"l{i}", block_size=16, num_kv_heads=8,
                                            head_size=128) for i in range(32)],
            num_blocks=1024, max_model_len=8192)
        step = await client.step("llama", [ops.add("r1", prompt), ops.lookup("r1"),
                                           ops.allocate("r1", len(prompt))], begin_step=True)
        table = step.results[2].block_ids     # one list of block ids per group

One :meth:`~AsyncCacheClient.step` per scheduler step carries every op of the step (a batch
with an invalid op is rejected whole, nothing applied); for big batches build them in place
with :class:`StepBuilder` and send them with ``step_batch``. The running requests' decode
step is cheapest as ONE ``ops.decode(request_ids, token_ids)`` op (or ``client.decode(...)``
when the step has nothing else), answered by a :class:`DecodeResult`. Results are
dataclasses or views, not protos.
Errors raise :class:`CacheError` (status code, message, offending field). Every call has a
deadline (``timeout``, default ``default_timeout``, spanning its retries); calls are
retried only on UNAVAILABLE (server draining, not reachable yet, or the connection lost),
by gRPC's own retry policy: at most ``max_retries`` (0..4) times, with bounded exponential
backoff (``backoff_base``, ``backoff_max``). A call that failed with UNAVAILABLE may
still have been applied (the connection can break after the server applied it and before
its answer arrived), so mutating calls are made exactly once with a session: by default
the first mutating call opens one (a background keepalive renews its lease) and every
mutating call carries the session id and a sequence number; a retry resends the same
number, and the server answers a retry of an applied call with the stored response
instead of applying it again. The session owns the
requests the client adds: if the client dies, the server frees them when the lease runs
out; ``close()`` ends the session and frees those not freed yet. ``session=False`` makes a
client without a session (nothing it adds expires; retries are then not deduplicated).
StepStream steps have a deadline too and are resent on a new stream under the same
number. :class:`CacheClient` is the same API, blocking.
"""

from cache_service.client._async import AsyncCacheClient, AsyncStepStream
from cache_service.client._builders import StepBuilder, layers, ops, register_request
from cache_service.client._errors import CacheError
from cache_service.client._results import (
    AddResult,
    AllocateResult,
    AppendResult,
    BlockCopy,
    DecodeResult,
    Event,
    FillResult,
    FreeResult,
    GroupInfo,
    LookupResult,
    NewStepResult,
    OpResult,
    PinInfo,
    PoolInfo,
    PoolStats,
    PreemptResult,
    RequestState,
    ResetHostTierResult,
    StepResult,
    TierCopy,
    step_result,
)
from cache_service.client._sync import CacheClient, StepStream

__all__ = [
    "AddResult", "AllocateResult", "AppendResult", "AsyncCacheClient", "AsyncStepStream",
    "BlockCopy",
    "CacheClient", "CacheError", "DecodeResult", "Event", "FillResult", "FreeResult", "GroupInfo",
    "LookupResult", "NewStepResult", "OpResult", "PinInfo", "PoolInfo", "PoolStats",
    "PreemptResult",
    "RequestState", "ResetHostTierResult", "StepBuilder", "StepResult", "StepStream",
    "TierCopy", "layers", "ops",
    "register_request", "step_result",
]
