"""Every user mistake is ONE clear line: the real commands (``python -m executor``,
``python -m cache_service``, ``python -m executor.demo``) run as a user runs them, and each
mistake must end with a non-zero exit code and one line naming what to change. Also: the
readiness line at any log level, and a killed demo leaves no servers behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from executor.launch import start_executor
from kvcache_common.launch import start_cache_service

from paged_helpers import health_status

pytestmark = pytest.mark.timeout(120)


def run(*argv: str, timeout: float = 60,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def one_error_line(done: subprocess.CompletedProcess, prog: str) -> str:
    """The single line a failed start printed on stderr (nothing else there)."""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"{prog}: error: "), lines
    return lines[0]


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something is listening on (held for the test)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("module,prog,flags", [
    ("cache_service", "kvcache-server", []),
    # a bare boolean flag parses too (else argparse would answer first)
    ("executor", "kvcache-executor", ["--enable-prefix-caching"])])
def test_a_port_in_use_is_one_line(busy_port: int, module: str, prog: str,
                                   flags: list[str]) -> None:
    done = run("-m", module, *flags, "--host", "127.0.0.1", "--port", str(busy_port))
    assert done.returncode == 2
    assert f"--port: 127.0.0.1:{busy_port} is already in use" in one_error_line(done, prog)


def test_an_unknown_preset_is_one_line_from_a_flag_or_the_environment() -> None:
    for done, named in ((run("-m", "executor", "--preset", "gemma-9000"), "--preset"),
                        (run("-m", "executor", env={"KVCACHE_EXECUTOR_PRESET": "gemma-9000"}),
                         "--preset (from KVCACHE_EXECUTOR_PRESET)")):
        assert done.returncode == 2
        line = one_error_line(done, "kvcache-executor")
        assert line.startswith(f"kvcache-executor: error: {named}: "), line
        assert "'hybrid-fsm'" in line, line


def test_a_setting_that_cannot_work_stops_the_start() -> None:
    """Mamba align blocks of 48 tokens cannot be prefilled 24 at a time: refused before
    listening."""
    done = run("-m", "executor", "--port", "0", "--preset", "hybrid-fsm",
               "--max-tokens-per-step", "24")
    assert done.returncode == 2
    line = one_error_line(done, "kvcache-executor")
    assert line.startswith("kvcache-executor: error: --max-tokens-per-step: 24 is below the Mamba "
                           "block size 48"), line
    assert done.stdout == ""  # no "listening" / "serving" line


def test_a_pool_the_cache_service_refuses_ends_the_process(cache_service) -> None:
    """Found only at registration (after listening): the process exits 1 with one line, instead
    of staying up and never SERVING."""
    done = run("-m", "executor", "--port", "0", "--cache-service", cache_service.target,
               "--preset", "hybrid-fsm", "--num-blocks", "3")
    assert done.returncode == 1, done.stdout[-2000:]
    line = one_error_line(done, "kvcache-executor")
    assert "the cache service refused the pool (num_blocks: " in line and "--num-blocks" in line


def test_help_lists_the_choices() -> None:
    done = run("-m", "executor", "--help")
    assert done.returncode == 0
    assert "--preset {gemma3-like,hybrid-fsm,jamba-like,nemotron-h-like,plamo2-like}" in done.stdout
    assert "--mamba-cache-mode {align,none}" in done.stdout
    assert "[--enable-prefix-caching | --no-enable-prefix-caching]" in done.stdout


def test_a_bare_boolean_flag_means_true() -> None:
    from executor.settings import parse_settings

    assert parse_settings(["--enable-prefix-caching"]).enable_prefix_caching is True
    assert parse_settings(["--no-enable-prefix-caching"]).enable_prefix_caching is False


def test_the_executor_runs_one_intra_op_thread_unless_told_otherwise(
        monkeypatch: pytest.MonkeyPatch, gate) -> None:
    """Executors share the host's cores: ``python -m executor`` sets OMP_NUM_THREADS=1 (unless
    set) before torch is imported, so torch in the started process runs one intra-op thread
    where it would default to one per core; a value in the environment wins."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: torch would default to one thread anyway")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # tests/conftest.py sets both
        monkeypatch.delenv(var, raising=False)
    unreachable = gate.target  # never opened; listening comes before registering
    for env, threads in (({}, 1), ({"OMP_NUM_THREADS": "2"}, 2)):
        with start_executor(unreachable, "--preset", "gemma3-like", wait_serving=False,
                            env=env) as ex:
            assert ex.ready_record is not None
            assert ex.ready_record["torch_threads"] == threads, env


def test_serving_means_serving_at_every_log_level(gate) -> None:
    """At --log-level warning both servers still print their readiness lines; the executor's
    "serving" comes only once it has registered (its health is SERVING by then)."""
    ex = start_executor(gate.target, "--preset", "gemma3-like", "--log-level", "warning",
                        wait_serving=False)
    try:
        assert ex.ready_record is not None and ex.ready_record["event"] == "listening"
        assert not any(r.get("event") == "serving" for r in ex.records)
        with start_cache_service("--log-level", "warning") as cs:
            gate.open_to(cs.target)
            assert cs.ready_record is not None and cs.ready_record["event"] == "serving"
            serving = ex.wait_for(lambda r: r.get("event") == "serving", timeout=60)
            assert serving["port"] == ex.port
            assert health_status(ex.target) == "SERVING"
            assert_same_discovery_as_the_cache_service(ex.target)
            ex.stop()
    finally:
        ex.stop()
    assert ex.returncode == 0


def assert_same_discovery_as_the_cache_service(target: str) -> None:
    """Both servers start through kvcache_common.serving: health answers List, reflection
    names v1 and v1alpha."""
    with grpc.insecure_channel(target) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        statuses = health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(),
                                                            timeout=10).statuses
    assert {"kvcache.v1.ExecutorService", "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= services, services
    serving = health_pb2.HealthCheckResponse.SERVING
    assert {name: s.status for name, s in statuses.items()} == {
        "": serving, "kvcache.v1.ExecutorService": serving}


def test_demo_waits_for_an_executor_that_is_not_registered_yet(tmp_path, gate) -> None:
    """--target at an executor whose cache service is not up: the demo says what it waits for,
    then gives up with one line; with the cache service started meanwhile it runs."""
    ex = start_executor(gate.target, "--preset", "hybrid-fsm", wait_serving=False)
    small = ["--requests", "2", "--prefix-len", "16", "--max-tokens", "2", "--concurrency", "2"]
    try:
        done = run("-m", "executor.demo", *small, "--target", ex.target, "--wait-seconds", "1")
        assert done.returncode == 1
        assert "not registered with its cache service yet" in done.stdout.replace("\n", " ")
        assert f"--target {ex.target}: no executor became SERVING within 1 s" in \
            one_error_line(done, "kvcache-demo")
        demo = subprocess.Popen([sys.executable, "-m", "executor.demo", *small,
                                 "--target", ex.target, "--wait-seconds", "60"],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert demo.stdout is not None
            assert demo.stdout.readline().startswith("waiting up to 60 s for the executor")
            with start_cache_service() as cs:
                gate.open_to(cs.target)
                out, _ = demo.communicate(timeout=60)
        finally:
            demo.kill()
        assert demo.returncode == 0, out
        assert "a tiny random-weight model" in out
    finally:
        ex.stop()


def test_sigkill_of_the_demo_stops_its_servers() -> None:
    """The demo's servers die with it, even when it is SIGKILLed (one executor here, to keep
    the test short; the other is started the same way)."""
    demo = subprocess.Popen([sys.executable, "-m", "executor.demo", "--requests", "2000",
                             "--no-compare"], stdout=subprocess.PIPE, text=True)
    try:
        assert demo.stdout is not None
        for line in demo.stdout:  # printed once all three are up
            if line.startswith("cache service "):
                break
        children = _children(demo.pid)
        assert len(children) == 2, children
    finally:
        demo.kill()
        demo.wait()
    deadline = time.monotonic() + 30
    while (alive := [pid for pid in children if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"servers {alive} outlived the demo"


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("module,prog", [("cache_service", "kvcache-server"),
                                         ("executor", "kvcache-executor"),
                                         ("executor.demo", "kvcache-demo")])
def test_an_unknown_flag_is_one_line_not_the_usage(module: str, prog: str) -> None:
    done = run("-m", module, "--no-such-flag")
    assert done.returncode == 2
    line = one_error_line(done, prog)
    assert "unrecognized arguments: --no-such-flag" in line and f"{prog} --help" in line


def test_a_metrics_port_in_use_names_the_metrics_flag(busy_port: int) -> None:
    done = run("-m", "cache_service", "--port", "0", "--metrics-port", str(busy_port))
    assert done.returncode == 2
    line = one_error_line(done, "kvcache-server")
    assert line.startswith(f"kvcache-server: error: --metrics-port: 127.0.0.1:{busy_port} is "
                           "already in use")
    assert "--metrics-port 0 for a free one, -1 for none" in line and "--port 0" not in line


def test_no_numpy_warning_without_numpy(tmp_path) -> None:
    """Where numpy is not installed (a fresh venv, the images), torch warns at import; the
    executor's one-line errors stay one line."""
    (tmp_path / "numpy.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    env = {"PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"}
    bare = run("-c", "import torch", env=env)
    assert "Failed to initialize NumPy" in bare.stderr  # what a user without numpy saw
    done = run("-m", "executor", "--port", "0", "--preset", "hybrid-fsm",
               "--max-tokens-per-step", "24", env=env)
    assert done.returncode == 2
    assert "--max-tokens-per-step: 24" in one_error_line(done, "kvcache-executor")
    quiet = run("-c", "import executor, torch, warnings; warnings.warn('other')", env=env)
    assert "NumPy" not in quiet.stderr and "UserWarning: other" in quiet.stderr


def test_an_executor_whose_log_reader_died_still_stops_cleanly(cache_service) -> None:
    """A killed demo leaves its executors a stdout pipe with no reader: the SIGTERM that
    PR_SET_PDEATHSIG sends must still stop them (their 'draining' line used to raise
    BrokenPipeError and leave them up until the cache service went away)."""
    r, w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "executor", "--port", "0", "--cache-service",
                             cache_service.target, "--drain-seconds", "0"],
                            stdout=w, stderr=subprocess.PIPE, text=True)
    os.close(w)
    with os.fdopen(r) as out:
        for line in out:
            if '"event": "serving"' in line:
                break
    proc.send_signal(signal.SIGTERM)  # the reader is closed now
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "BrokenPipeError" not in err


def _demo_mid_workload() -> tuple[subprocess.Popen, list[int]]:
    demo = subprocess.Popen([sys.executable, "-m", "executor.demo", "--requests", "2000"],
                            stdout=subprocess.PIPE, text=True)
    assert demo.stdout is not None
    for line in demo.stdout:  # printed once all three are up, before the workload
        if line.startswith("cache service "):
            break
    children = _children(demo.pid)
    assert len(children) == 3, children
    return demo, children


def _gone_within(children: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (alive := [pid for pid in children if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def test_sigkill_of_the_demo_mid_workload_stops_all_three_at_once() -> None:
    """Its executors used to drain for 11-16 s after a kill -9 (nobody waits for their
    requests then): they stop at once now (--drain-seconds 0 for the demo's own)."""
    demo, children = _demo_mid_workload()
    demo.kill()
    demo.wait()
    assert not _gone_within(children, 5), "servers outlived the demo by more than 5 s"


def test_ctrl_c_of_the_demo_mid_workload_is_fast() -> None:
    """Ctrl-C used to take 6-8 s: the servers now stop together and without a drain."""
    demo, children = _demo_mid_workload()
    started = time.monotonic()
    demo.send_signal(signal.SIGINT)
    assert demo.wait(timeout=30) == 130
    assert time.monotonic() - started < 5
    assert not _gone_within(children, 1)
