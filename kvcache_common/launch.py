"""Start a server the way a user does (a subprocess), wait for its "serving" log line,
and make sure it dies with its parent.

Used by the demo, the benchmarks and every test tier::

    from kvcache_common.launch import start_cache_service

    with start_cache_service("--metrics-port", "0") as srv:
        client = CacheClient(srv.target)
        ...
    assert srv.returncode == 0      # after a clean SIGTERM

Any process that prints JSON log lines on stdout works with :func:`start_process`: it
reads stdout on a thread, keeps every parsed record (``records``) and every raw line
(``lines``), and returns once a record matches ``ready`` (default: ``event == "serving"``).
The record's ``port`` (and ``metrics_port``) are exposed as attributes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Record = dict[str, Any]


class ServerProcess:
    """A running server subprocess and the JSON records of its stdout."""

    def __init__(self, proc: subprocess.Popen, ready: Callable[[Record], bool]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self.records: list[Record] = []
        self.ready_record: Record | None = None
        self._ready = ready
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            record: Record | None = None
            if line.startswith("{"):
                try:
                    record = json.loads(line)
                except ValueError:
                    record = None
            with self._cond:
                self.lines.append(line)
                if isinstance(record, dict):
                    self.records.append(record)
                    if self.ready_record is None and self._ready(record):
                        self.ready_record = record
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    # -- waiting -------------------------------------------------------------------------

    def wait_for(self, predicate: Callable[[Record], bool], timeout: float = 30.0) -> Record:
        """The first record matching ``predicate``; raises TimeoutError (with the output so
        far) if none arrives in time, RuntimeError if the process exits first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for record in self.records:
                    if predicate(record):
                        return record
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise RuntimeError(f"process exited with {self.proc.returncode} before the "
                                       f"expected log line; output:\n" + self.output())
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no matching log line; output:\n" + self.output())
                self._cond.wait(min(left, 0.2))

    def wait_ready(self, timeout: float = 30.0) -> Record:
        """Waits for the ready log line (raises TimeoutError, or RuntimeError if the process
        exited) and answers it."""
        record = self.wait_for(self._ready, timeout)
        self.ready_record = record
        return record

    def output(self) -> str:
        """The last 200 lines the process wrote, for error messages."""
        with self._cond:
            return "\n".join(self.lines[-200:])

    # -- addresses -----------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The gRPC port the ready line announced."""
        assert self.ready_record is not None, "not ready yet"
        return int(self.ready_record["port"])

    @property
    def metrics_port(self) -> int:
        """The metrics port the ready line announced (-1: none)."""
        assert self.ready_record is not None, "not ready yet"
        return int(self.ready_record.get("metrics_port", -1))

    @property
    def target(self) -> str:
        """``127.0.0.1:<port>``, for a client."""
        return f"127.0.0.1:{self.port}"

    # -- stopping ------------------------------------------------------------------------

    @property
    def returncode(self) -> int | None:
        """The exit status, or None while it runs."""
        return self.proc.poll()

    def signal(self, sig: int = signal.SIGTERM) -> None:
        """Sends ``sig`` unless the process has exited."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, wait up to ``timeout``, then SIGKILL. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._reader.join(5)
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _is_serving(record: Record) -> bool:
    return record.get("event") == "serving"


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: SIGTERM the child when the process that started it dies, so a killed test
    run (timeout, ^C twice) leaves no orphaned servers. Note: tied to the starting thread."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start_process(argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                  ready: Callable[[Record], bool] = _is_serving, timeout: float = 60.0,
                  cwd: str | None = None) -> ServerProcess:
    """Starts ``argv`` (stdout captured, stderr merged into it) and waits until a JSON
    stdout record satisfies ``ready``. The process is killed if it does not get ready."""
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    full_env.update(env or {})
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=full_env, cwd=cwd, bufsize=1,
                            preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    server = ServerProcess(proc, ready)
    try:
        server.wait_ready(timeout)
    except BaseException:
        server.stop(timeout=5)
        raise
    return server


def start_cache_service(*flags: str, env: Mapping[str, str] | None = None,
                        timeout: float = 60.0) -> ServerProcess:
    """``python -m cache_service --port 0 --metrics-port -1 <flags>`` on 127.0.0.1
    (later flags override the defaults given here)."""
    argv = [sys.executable, "-m", "cache_service", "--host", "127.0.0.1", "--port", "0",
            "--metrics-port", "-1", *flags]
    return start_process(argv, env=env, timeout=timeout)
