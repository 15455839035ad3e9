"""Fixtures of the service tier: one real server subprocess per session (started the way a
user starts it: ``python -m cache_service --port 0``), clients, and pool factories.

Tests that need their own server (auth, TLS, SIGTERM) start one with
``kvcache_common.launch.start_cache_service``.
"""

from __future__ import annotations

import itertools
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from cache_service.client import CacheClient, PoolInfo
from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.api.kvcache.v1 import cache_service_pb2_grpc as pb_grpc
from kvcache_common.launch import ServerProcess, start_cache_service

from .builders import EVENT_BUFFER, full_layers, pool_options


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    with start_cache_service("--metrics-port", "0", "--event-buffer", str(EVENT_BUFFER),
                             "--max-ops-per-step", "4096", "--max-tokens-per-step", "100000",
                             "--max-peek-tokens", "100000",
                             "--max-message-bytes", str(4 * 1024 * 1024)) as srv:
        yield srv
    assert srv.returncode == 0, srv.output()


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> Iterator[CacheClient]:
    with CacheClient(server.target, default_timeout=20) as c:
        yield c


@pytest.fixture(scope="session")
def stub(server: ServerProcess) -> Iterator[pb_grpc.CacheServiceStub]:
    """The raw generated stub, for malformed messages the typed client cannot build."""
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.CacheServiceStub(channel)


_ids = itertools.count()


@pytest.fixture
def new_pool(client: CacheClient) -> Callable[..., PoolInfo]:
    """``new_pool(layers=None, **options) -> PoolInfo``: a fresh pool with a unique id."""

    def make(layer_specs: list[pb.LayerSpec] | None = None, **kwargs: Any) -> PoolInfo:
        pool_id = kwargs.pop("pool_id", f"pool-{next(_ids)}")
        return client.register_pool(pool_id, layer_specs or full_layers(), **pool_options(**kwargs))

    return make


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """``tmpfs(options) -> Path``: a real tmpfs mounted with ``options`` (e.g. ``size=4m``,
    ``ro,size=1m``) under ``tmp_path``, unmounted after the test. Skips (one line) unless
    root and mount works."""
    mounted: list[Path] = []

    def mount(options: str) -> Path:
        if os.geteuid() != 0:
            pytest.skip("a small or read-only file system needs a tmpfs: mount needs root")
        mnt = tmp_path / f"tmpfs{len(mounted)}"
        mnt.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
