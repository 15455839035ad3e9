"""Fixtures of the executor tier: the preset models (built once), and the real servers
(one cache service per session)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from executor.model import HybridModel
from kvcache_common.launch import ServerProcess


@pytest.fixture(scope="session")
def models() -> Iterator[dict[str, HybridModel]]:
    from executor.presets import PRESETS

    yield {name: HybridModel(cfg) for name, cfg in PRESETS.items()}


@pytest.fixture(scope="session")
def cache_service() -> Iterator[ServerProcess]:
    """One real cache service for the whole executor tier."""
    from kvcache_common.launch import start_cache_service

    with start_cache_service() as srv:
        yield srv
    assert srv.returncode == 0, srv.output()
