"""The commands README.md and docs/*.md show that tests/doc_commands.py's registry gives to
this tier, run as written (bash, from the root of a copy of the checkout)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.doc_commands import run_as_written, runs

COMMANDS = runs("bench")


@pytest.mark.parametrize("text", COMMANDS)
def test_runs_as_written(text: str, checkout_copy: Path) -> None:
    run_as_written(text, COMMANDS[text], checkout_copy)
