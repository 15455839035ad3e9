"""A tier that needs something the machine may not have (a Docker engine, the etcd binary)
skips every test with ONE line: :func:`skip_tier` marks the tier's tests skipped at
collection, :func:`fold_skip` (called from the conftest's ``pytest_runtest_makereport``
hookwrapper, which :func:`fold_skips_at` makes) reports them all at one location, so ``-ra``
folds them into one line."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import pytest

_SKIP_REASONS = pytest.StashKey[set[str]]()


def skip_tier(config: pytest.Config, items: list[pytest.Item], marker: str,
              reason: Callable[[], str | None]) -> None:
    """Marks every test with ``marker`` skipped when ``reason()`` (asked once, only if the
    run collected such a test) says why the tier cannot run."""
    tier = [item for item in items if item.get_closest_marker(marker)]
    why = reason() if tier else None
    if why:
        config.stash.setdefault(_SKIP_REASONS, set()).add(why)
        for item in tier:
            item.add_marker(pytest.mark.skip(reason=why))


def fold_skip(item: pytest.Item, report: pytest.TestReport, location: str) -> None:
    """Reports a tier skip of :func:`skip_tier` at ``location`` (the tier's conftest)."""
    reasons = item.config.stash.get(_SKIP_REASONS, set())
    if report.skipped and isinstance(report.longrepr, tuple) \
            and any(report.longrepr[2].endswith(why) for why in reasons):
        report.longrepr = (location, 1, report.longrepr[2])


def fold_skips_at(location: str) -> Callable[..., Generator[None, Any, None]]:
    """A tier conftest's ``pytest_runtest_makereport`` hookwrapper (assign it to that name):
    every skip of :func:`skip_tier` reported at ``location`` (the conftest's ``__file__``)."""
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item: pytest.Item,
                                  call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
        outcome = yield
        fold_skip(item, outcome.get_result(), location)
    return pytest_runtest_makereport
