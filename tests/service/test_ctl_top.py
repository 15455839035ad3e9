"""``kvcache-ctl top`` in a real 80x24 terminal (tmux), against a real server under load:
it shows the pools with live Step rates, fits the screen, sorts on a key, and quits on q
and on Ctrl-C with exit 0."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cache_service.client import CacheClient, layers, ops
from kvcache_common.launch import start_cache_service

ROOT = Path(__file__).resolve().parents[2]
DOC_TOP = "kvcache-ctl top"

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")


def wait_for(check: Callable[[], str | None], timeout: float, what: str) -> str:
    """Polls a terminal (the only way to watch one) until ``check`` answers."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last is not None:
            return last
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class Terminal:
    """One tmux session of 80x24 on a private server socket."""

    def __init__(self, command: str, tmp: Path) -> None:
        self.socket = f"kvctl-{uuid.uuid4().hex[:8]}"
        self.rc_file = tmp / "rc"
        shell = f"{command}; echo $? > {shlex.quote(str(self.rc_file))}; sleep 60"
        self.tmux("new-session", "-d", "-x", "80", "-y", "24", "-s", "top", shell)

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], check=True,
                              capture_output=True, text=True, timeout=30).stdout

    def screen(self) -> list[str]:
        return self.tmux("capture-pane", "-p", "-t", "top").splitlines()

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "top", *keys)

    def exit_code(self, timeout: float = 30) -> int:
        return int(wait_for(lambda: self.rc_file.read_text().strip() or None
                            if self.rc_file.exists() else None, timeout, "top to exit"))

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True,
                       timeout=30)


@pytest.fixture
def loaded() -> Iterator[tuple[str, str]]:
    """A server (target, metrics URL) with pools ``alpha`` and ``beta``, both getting Steps
    from a background thread until the test ends."""
    stop = threading.Event()
    with start_cache_service("--metrics-port", "0") as srv, \
            CacheClient(srv.target, client_name="load") as client:
        spec = [layers.full_attention("a", block_size=4, num_kv_heads=1, head_size=8)]
        for name, blocks in (("alpha", 64), ("beta", 200)):
            client.register_pool(name, spec, num_blocks=blocks, max_model_len=64)

        def load() -> None:
            i = 0
            while not stop.is_set():
                for pool in ("alpha", "beta"):
                    rid = f"r{i}"
                    client.step(pool, [ops.add(rid, list(range(1, 33))),
                                       ops.allocate(rid, 32)], begin_step=True)
                    client.step(pool, [ops.free(rid)])
                i += 1

        thread = threading.Thread(target=load, daemon=True)
        thread.start()
        try:
            yield srv.target, f"http://127.0.0.1:{srv.metrics_port}/metrics"
        finally:
            stop.set()
            thread.join(30)


def _top_command(target: str, metrics: str) -> str:
    argv = [sys.executable, "-m", "cache_service.ctl", *shlex.split(DOC_TOP)[1:],
            "--target", target, "--metrics-url", metrics]
    path = shlex.quote(os.environ.get("PYTHONPATH", str(ROOT)))
    return f"cd {shlex.quote(str(ROOT))} && env PYTHONPATH={path} " + shlex.join(argv)


def _rows(screen: list[str]) -> list[str]:
    return [line.split()[0] for line in screen if line.startswith(("alpha", "beta"))]


def test_top_live_sorted_fits_and_quits(loaded, tmp_path: Path) -> None:
    target, metrics = loaded
    term = Terminal(_top_command(target, metrics), tmp_path)
    try:
        def stepping() -> str | None:
            screen = term.screen()
            rows = [line.split() for line in screen if line.startswith(("alpha", "beta"))]
            # STEP/s is the 7th column: a number above 0 for both once two scrapes are in
            if len(rows) == 2 and all(r[6] not in ("-", "0.0") for r in rows):
                return "\n".join(screen)
            return None

        shown = wait_for(stepping, 60, "both pools with a Step rate")
        screen = shown.splitlines()
        assert len(screen) <= 24 and all(len(line) <= 80 for line in screen)
        assert "POOL" in shown and "P99ms" in shown and "SESS" in shown
        # default sort: usage, descending (alpha has fewer blocks: higher usage when busy,
        # but both may be idle at the sample): sort by name is deterministic
        term.keys("n")
        wait_for(lambda: "sort:pool" if "sort:pool" in "\n".join(term.screen()) else None,
                 30, "the sort to change")
        assert _rows(term.screen()) == ["alpha", "beta"]
        term.keys("q")
        assert term.exit_code() == 0
    finally:
        term.close()


def test_top_quits_on_ctrl_c(loaded, tmp_path: Path) -> None:
    target, metrics = loaded
    term = Terminal(_top_command(target, metrics), tmp_path)
    try:
        wait_for(lambda: "ok" if len(_rows(term.screen())) == 2 else None, 60, "the pools")
        term.keys("C-c")
        assert term.exit_code() == 0
        # the alternate screen is gone: the shell's screen is back, no table left on it
        assert "POOL" not in "\n".join(term.screen())
    finally:
        term.close()
