"""Every command README.md and docs/*.md show has an entry in tests/doc_commands.py's registry
(run as written by a test, or gated on a resource with a reason), and every entry is still
shown: a command added to a doc without an entry fails here with its file and line."""

from __future__ import annotations

from tests.doc_commands import REGISTRY, ROOT, Gated, Prose, Run, RunBy, shown_commands


def test_every_shown_command_is_registered() -> None:
    missing = [f"{s.path}:{s.line}: {s.text}" for s in shown_commands() if s.text not in REGISTRY]
    assert not missing, ("commands the docs show with no entry in tests/doc_commands.py's "
                         "REGISTRY (say which test runs each, or why none can):\n"
                         + "\n".join(missing))


def test_every_registry_entry_is_still_shown() -> None:
    shown = {s.text for s in shown_commands()}
    stale = [text for text in REGISTRY if text not in shown]
    assert not stale, f"registered commands no doc shows any more: {stale}"


def test_a_test_said_to_run_a_command_holds_its_text() -> None:
    for text, entry in REGISTRY.items():
        if isinstance(entry, RunBy):
            source = (ROOT / entry.test).read_text()
            assert text in source, f"{entry.test} does not hold {text!r}"


def test_every_entry_says_who_runs_it_or_why_not() -> None:
    for text, entry in REGISTRY.items():
        assert isinstance(entry, Run | RunBy | Gated | Prose), text
        if isinstance(entry, Run):
            assert (ROOT / "tests" / entry.tier).is_dir(), f"{text!r}: no tier {entry.tier}"
        if isinstance(entry, Gated | Prose):
            assert entry.reason.strip(), f"{text!r}: no reason"


def test_the_extraction_rule(tmp_path) -> None:
    lines = ["Run `kvcache-demo --help` or `docker`; `kvcache-executor: error: x` is an error.",
             "", "    OMP_NUM_THREADS=1 python3 bench/x.py \\", "        --y 1   # writes z",
             "```", "kvcache-server   # or: python -m cache_service", "```"]
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("\n".join(lines) + "\n")
    found = [(s.line, s.text) for s in shown_commands(tmp_path)]
    assert found == [(1, "kvcache-demo --help"), (3, "OMP_NUM_THREADS=1 python3 bench/x.py --y 1")]
