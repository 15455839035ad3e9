"""Fixtures of the allocator-core tests; plain builders live in ``builders.py``."""

from __future__ import annotations

import pytest

from cache_service.core.pool import Pool

from builders import full, make_pool


@pytest.fixture
def small_full_pool() -> Pool:
    """64 blocks of 4 tokens, one full-attention group, max_model_len 256."""
    return make_pool(64, full(4), max_model_len=256)
