"""Session-wide test settings and fixtures shared by every tier.

Two shared cores: torch ops get 10-20x slower when two processes fight over intra-op
threads, so every test process uses one thread.

``gate``: a fixed address for a server that is not up yet or restarts on another port (no
test reserves a port and releases it for a server to take later: another process can take
it in between).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings as hypothesis_settings

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
# gRPC's fork handlers can deadlock Popen's fork() in a process that has used grpc.aio
# (seen: a test hanging inside fork while starting a server). Tests only fork to exec
# servers, so the handlers are not needed. Must be set before grpc is imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

if importlib.util.find_spec("torch") is not None:  # the cache-service tiers run without torch
    import torch

    torch.set_num_threads(1)


# Hypothesis' per-example deadline measures wall time, which on a shared 2-core machine says
# more about the neighbours than about the code: examples are bounded by their size instead.
hypothesis_settings.register_profile("kvcache", deadline=None)
hypothesis_settings.load_profile("kvcache")


class Gate:
    """A TCP endpoint the test owns for its whole life: it hangs up on every connection
    until :meth:`open_to` names a server, then forwards new connections to it (a later
    ``open_to`` moves new connections to a restarted server). Counts the connections it hung
    up on (also those whose server did not answer), so a test can wait for a client's
    failed attempt."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.target = f"127.0.0.1:{self.port}"
        self._upstream: tuple[str, int] | None = None
        self._cond = threading.Condition()
        self.refused = 0
        threading.Thread(target=self._accept, name="gate", daemon=True).start()

    def open_to(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        with self._cond:
            self._upstream = (host, int(port))

    def wait_refused(self, count: int, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.refused >= count, timeout)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        self._listener.close()

    def _refuse(self, conn: socket.socket) -> None:
        # Counted before the hang-up: a client that sees it fail finds it counted already.
        with self._cond:
            self.refused += 1
            self._cond.notify_all()
        conn.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            with self._cond:
                upstream = self._upstream
            try:
                if upstream is None:
                    raise ConnectionRefusedError
                server = socket.create_connection(upstream, timeout=10)
                server.settimeout(None)
            except OSError:
                self._refuse(conn)
                continue
            for src, dst in ((conn, server), (server, conn)):
                threading.Thread(target=_pump, args=(src, dst), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


@pytest.fixture
def gate() -> Iterator[Gate]:
    """A :class:`Gate`, closed after the test."""
    g = Gate()
    yield g
    g.close()


@pytest.fixture(scope="session")
def checkout_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the checkout's tracked files: the docs' commands run from its root, so what
    they write (bench/results/, ...) never lands in the checkout."""
    from tests.doc_commands import copy_checkout

    return copy_checkout(tmp_path_factory.mktemp("checkout"))
