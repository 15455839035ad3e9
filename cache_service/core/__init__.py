"""The allocator core: pure Python (no gRPC, no torch), vLLM 0.33-exact semantics.

Entry point: :class:`Pool` (one KV-cache pool) configured by a :class:`KVCacheConfig`
(groups of layer specs) and :class:`PoolOptions`.
"""

from cache_service.core.errors import (
    AlreadyExists,
    ConfigError,
    DuplicateRequest,
    FailedPrecondition,
    InvalidArgument,
    KVCacheError,
    NotFound,
    UnknownRequest,
)
from cache_service.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from cache_service.core.pool import (
    Allocation,
    Pool,
    PoolCounters,
    PoolOptions,
    PrefixHit,
    RequestInfo,
)
from cache_service.core.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SizingLimits,
    SlidingWindowSpec,
)

__all__ = [
    "AllBlocksCleared", "Allocation", "AlreadyExists", "BlockRemoved", "BlockStored",
    "ChunkedLocalAttentionSpec", "ConfigError", "CrossAttentionSpec", "DuplicateRequest",
    "FailedPrecondition", "FullAttentionSpec", "InvalidArgument", "KVCacheConfig",
    "KVCacheError", "KVCacheGroupSpec", "KVCacheSpec", "KVEvent", "PrefixHit",
    "MambaSpec", "NotFound", "Pool", "PoolOptions", "PoolCounters", "RequestInfo",
    "SizingLimits", "SlidingWindowSpec", "UnknownRequest",
]
