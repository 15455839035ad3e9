"""Executor service: hybrid models on a paged cache managed by the cache service."""

import kvcache_common.quiet_torch  # noqa: F401  (before any torch import)
