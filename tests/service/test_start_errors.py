"""Start errors of the real ``kvcache-server`` command (``python -m cache_service``): every
one is a single line on stderr naming the flag (and the environment variable when the value
came from one), nothing on stdout, exit status 2 -- never a traceback, never JSON."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from cache_service.client import CacheClient, StepBuilder
from kvcache_common.launch import start_cache_service

from .builders import hybrid_layers


def _run(*flags: str, env: Mapping[str, str] | None = None,
         user: str | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "cache_service", "--port", "0", "--metrics-port", "-1",
            *flags]
    if user is not None:
        argv = ["setpriv", f"--reuid={user}", "--regid=nogroup", "--clear-groups", *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, **(env or {})})


def _one_line_error(done: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert done.stdout == "", done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    line = lines[0]
    assert line.startswith("kvcache-server: error: "), line
    for needle in needles:
        assert needle in line, (needle, line)
    return line


def test_a_data_dir_that_is_a_file(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("x")
    _one_line_error(_run("--data-dir", str(path)), "--data-dir", str(path),
                    "not a directory")


def test_a_data_dir_under_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    path = tmp_path / "file" / "data"
    _one_line_error(_run("--data-dir", str(path)), "--data-dir", str(path), "is a file")


def test_a_data_dir_from_the_environment_names_the_variable(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("x")
    _one_line_error(_run(env={"KVCACHE_DATA_DIR": str(path)}),
                    "--data-dir (from KVCACHE_DATA_DIR)", str(path))


def test_a_data_dir_on_a_read_only_file_system(tmpfs: Callable[[str], Path]) -> None:
    read_only_dir = tmpfs("ro,size=1m")
    _one_line_error(_run("--data-dir", str(read_only_dir)), "--data-dir",
                    str(read_only_dir), "read-only")
    _one_line_error(_run("--data-dir", str(read_only_dir / "sub")), "--data-dir",
                    "read-only")


def test_a_data_dir_this_process_may_not_write(tmp_path: Path) -> None:
    path = tmp_path / "data"
    path.mkdir(mode=0o555)
    if os.geteuid() != 0:
        _one_line_error(_run("--data-dir", str(path)), "--data-dir", str(path),
                        "may not be written", "Permission denied")
        return
    # Root ignores permission bits, not the immutable attribute (EPERM).
    if shutil.which("chattr") is None or subprocess.run(
            ["chattr", "+i", str(path)], capture_output=True, check=False).returncode:
        pytest.skip("root ignores permissions and this file system has no chattr +i")
    try:
        _one_line_error(_run("--data-dir", str(path)), "--data-dir", str(path),
                        "may not be written", "Operation not permitted")
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=False)


def test_a_data_dir_in_use(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with start_cache_service("--data-dir", str(data_dir)):
        _one_line_error(_run("--data-dir", str(data_dir)), "--data-dir", "in use")


def test_a_corrupt_snapshot(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with start_cache_service("--data-dir", str(data_dir)) as server, \
            CacheClient(server.target) as client:
        client.register_pool("p", hybrid_layers(), max_model_len=1024, num_blocks=256)
        client.step_batch(StepBuilder("p").add("r", list(range(40))))
        server.stop()  # a clean stop writes the final snapshot
    (snapshot,) = data_dir.glob("snapshot-*.snap")
    data = bytearray(snapshot.read_bytes())
    data[-1] ^= 0xFF
    snapshot.write_bytes(bytes(data))
    _one_line_error(_run("--data-dir", str(data_dir)), "--data-dir", str(snapshot))


def test_a_bad_value_from_the_environment_names_flag_and_variable() -> None:
    _one_line_error(_run(env={"KVCACHE_FSYNC": "bogus"}), "--fsync (from KVCACHE_FSYNC)")
    # The flag wins over the variable, and is what the error names then.
    line = _one_line_error(_run("--fsync", "bogus", env={"KVCACHE_FSYNC": "always"}),
                           "--fsync")
    assert "KVCACHE_FSYNC" not in line


def test_a_missing_tenants_file(tmp_path: Path) -> None:
    path = tmp_path / "missing"
    _one_line_error(_run("--auth-tokens-file", str(path)), "--auth-tokens-file", str(path))
    _one_line_error(_run(env={"KVCACHE_AUTH_TOKENS_FILE": str(path)}),
                    "--auth-tokens-file (from KVCACHE_AUTH_TOKENS_FILE)")


def test_a_missing_tls_file(tmp_path: Path) -> None:
    _one_line_error(_run("--tls-cert", str(tmp_path / "c.pem"), "--tls-key",
                         str(tmp_path / "k.pem")), "--tls-", "cannot read")


def test_a_port_in_use_from_the_environment_names_flag_and_variable() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "cache_service", "--metrics-port", "-1"],
                              capture_output=True, text=True, timeout=60, check=False,
                              env={**os.environ, "KVCACHE_PORT": str(port)})
    _one_line_error(done, "--port (from KVCACHE_PORT)", f":{port} is already in use")
