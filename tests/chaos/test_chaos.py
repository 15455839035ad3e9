"""The chaos tier's short seeded set (CI): each scenario of ``scenarios.py`` once, under
client load, judged by the one checker: every Step a client saw acknowledged is there
exactly once, nothing applied twice, tables and stats equal to a replay of the
acknowledged history. ``bench/bench_chaos.py`` runs them more often.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .checker import Verdict
from .scenarios import LEASE_TTL, SCENARIOS, can_mount

pytestmark = pytest.mark.chaos
SEED = 20


def _exact(verdict: Verdict) -> None:
    assert verdict.exact, verdict.explain()
    assert verdict.acknowledged > 0 and not verdict.rejected, verdict.explain()


def test_answers_lost_after_their_headers(tmp_path: Path) -> None:
    verdict = SCENARIOS["lost_answers"](SEED, tmp_path)
    _exact(verdict)
    assert verdict.in_doubt == 0, verdict.explain()  # the clients resent every one


def test_a_damaged_payload_byte_is_refused_at_start(tmp_path: Path) -> None:
    _exact(SCENARIOS["damaged_payload"](SEED, tmp_path))


def test_a_damaged_length_field_is_refused_at_start(tmp_path: Path) -> None:
    _exact(SCENARIOS["damaged_length"](SEED, tmp_path))


def test_disk_full_loses_nothing_acknowledged(tmp_path: Path) -> None:
    why = can_mount()
    if why:
        pytest.skip(why)
    verdict = SCENARIOS["disk_full"](SEED, tmp_path)
    assert verdict.exact, verdict.explain()


STORAGE = pytest.mark.parametrize("prefix", ["", "standby_"],
                                  ids=["shared_storage", "without_shared_storage"])


@pytest.mark.cluster
@STORAGE
def test_sigkill_of_an_owner(prefix: str, tmp_path: Path) -> None:
    _exact(SCENARIOS[f"{prefix}sigkill_owner"](SEED, tmp_path))


@pytest.mark.cluster
@STORAGE
def test_sigstop_of_an_owner_costs_a_bounded_stall(prefix: str, tmp_path: Path) -> None:
    verdict = SCENARIOS[f"{prefix}sigstop_owner"](SEED, tmp_path)
    _exact(verdict)
    # The stopped owner held its pool's calls until its etcd lease ran out; then one
    # attempt's deadline (the clients' attempt_timeout, 1 s) and the next replica.
    assert verdict.longest_step < LEASE_TTL + 1.0 + 3.0, verdict.explain()


@pytest.mark.cluster
def test_a_rolling_restart(tmp_path: Path) -> None:
    _exact(SCENARIOS["rolling_restart"](SEED, tmp_path))


@pytest.mark.cluster
def test_etcd_killed_and_restarted(tmp_path: Path) -> None:
    _exact(SCENARIOS["etcd_restart"](SEED, tmp_path))
