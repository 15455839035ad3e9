"""Start a single-member etcd server (the ``etcd`` binary, Debian's ``etcd-server``) on
loopback with its own data dir and free ports, for the cluster test tier and the cluster
benchmark::

    etcd = EtcdServer(tmp_dir / "etcd")
    etcd.start()                        # waits for /health
    ... --etcd-endpoints etcd.endpoint ...
    etcd.kill(); etcd.start()           # a restart keeps the data dir (and the leases)
    etcd.stop()
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (another process may take it before it is used)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def etcd_binary() -> str | None:
    """Path of the etcd binary, or None."""
    return shutil.which("etcd")


class EtcdServer:
    """One etcd member on 127.0.0.1; :meth:`kill` and :meth:`start` keep its data dir.
    Its log goes to ``<data_dir>.log``."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        """The client endpoint, ``127.0.0.1:<port>``."""
        return f"127.0.0.1:{self.client_port}"

    @property
    def log_path(self) -> Path:
        """Where etcd's log goes, next to its data dir."""
        return self.data_dir.with_suffix(".log")

    def start(self, timeout: float = 30.0) -> None:
        """Starts etcd and waits until /health says true (raises TimeoutError)."""
        client_url = f"http://{self.endpoint}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [etcd_binary() or "etcd", "--name", "kvcache", "--data-dir", str(self.data_dir),
                 "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                 "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                 "--initial-cluster", f"kvcache={peer_url}"],
                stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if time.monotonic() > deadline:
                raise TimeoutError(f"etcd not healthy after {timeout} s; see {self.log_path}")
            time.sleep(0.05)

    def healthy(self) -> bool:
        """Whether /health says true; raises RuntimeError when etcd exited."""
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError(f"etcd exited; see {self.log_path}")
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as r:
                return b'"health":"true"' in r.read()
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL (a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
