"""The chaos tier (tests/chaos): faults under seeded client load, one checker
(``checker.py``). Cluster scenarios need the etcd binary: without it they skip with ONE
line, as the cluster tier does; the disk-full scenario needs root for its tmpfs."""

from __future__ import annotations

import pytest

from kvcache_common.etcd_launch import etcd_binary
from tests.tier_skip import fold_skips_at, skip_tier


def _no_etcd_reason() -> str | None:
    if etcd_binary() is None:
        return ("chaos tier: no `etcd` binary on PATH for the cluster scenarios "
                "(`apt-get install etcd-server`; scripts/test.sh installs it)")
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_tier(config, [i for i in items if i.get_closest_marker("chaos")], "cluster",
              _no_etcd_reason)


pytest_runtest_makereport = fold_skips_at(__file__)
