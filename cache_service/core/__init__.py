"""The allocator core: pure Python (no gRPC, no torch), vLLM 0.33-exact semantics.

Entry point: :class:`Pool` (one KV-cache pool) configured by a :class:`KVCacheConfig`
(groups of layer specs) and :class:`PoolOptions`.

Pure Python or compiled by mypyc from the same sources: :mod:`cache_service.core._variant`
chooses before the first core module loads; ``python -m cache_service.core --build-info``
says which.
"""

from cache_service.core import _variant

_variant.activate(__path__)

from cache_service.core.errors import (  # noqa: E402 (after the build is chosen)
    AlreadyExists,
    ConfigError,
    DuplicateRequest,
    FailedPrecondition,
    InvalidArgument,
    KVCacheError,
    NotFound,
    UnknownRequest,
)
from cache_service.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent  # noqa: E402
from cache_service.core.pool import (  # noqa: E402
    Allocation,
    Pool,
    PoolCounters,
    PoolOptions,
    PrefixHit,
    RequestInfo,
)
from cache_service.core.specs import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    RSWASpec,
    SizingLimits,
    SlidingWindowSpec,
)

__all__ = [
    "AllBlocksCleared", "Allocation", "AlreadyExists", "BlockRemoved", "BlockStored",
    "ChunkedLocalAttentionSpec", "CircularBufferSpec", "ConfigError", "CrossAttentionSpec",
    "DuplicateRequest",
    "FailedPrecondition", "FullAttentionSpec", "InvalidArgument", "KVCacheConfig",
    "KVCacheError", "KVCacheGroupSpec", "KVCacheSpec", "KVEvent", "PrefixHit",
    "MambaSpec", "NotFound", "Pool", "PoolOptions", "PoolCounters", "RequestInfo", "RSWASpec",
    "SizingLimits", "SlidingWindowSpec", "UnknownRequest",
]
