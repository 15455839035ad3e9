"""Every shell command README.md and docs/*.md show, and the ONE registry saying who runs it.

Extraction rule (:func:`shown_commands`), kept simple on purpose:

- code lines: every line of a fenced block and every line indented by 4+ spaces outside one;
  a trailing backslash joins the next line, a trailing `` # comment`` is dropped;
- inline spans: every `` `...` `` outside a fenced block;
- either is a command when its first word (after ``NAME=value`` environment assignments) is a
  command word: python, python3, bash, source, export, pip, docker, docker-compose, grpcurl
  or ``kvcache-<name>``, followed by a space or the end (so ``kvcache-executor: error: ...``
  and ``kvcache-local/base:...`` are not commands), and it has at least two words (a lone
  word such as `` `docker` `` or `` `kvcache-server` `` names a program in prose).

:data:`REGISTRY` maps each command's exact text to one of:

- :class:`Run`: run exactly as written by ``tests/<tier>``'s doc-command test, through
  :func:`run_as_written` (only :data:`SUBSTITUTIONS`' documented placeholders are replaced);
- :class:`RunBy`: an existing test runs it as written (the registry test checks that test file
  holds the command's text);
- :class:`Gated`: needs something this test run does not have (a GPU, a Docker engine, the
  network, or it is the test suite itself); says why and where it does run;
- :class:`Prose`: a tool or subcommand named in a sentence, not a command line (says why).

tests/core/test_doc_commands_registry.py fails on a shown command without an entry (naming the
file and line) and on an entry no doc shows any more.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = re.compile(r"^(?:[A-Z][A-Z0-9_]*=\S*\s+)*"
                     r"(?:python3?|bash|source|export|pip|docker|docker-compose|grpcurl"
                     r"|kvcache-[a-z-]+)(?=\s|$)")


@dataclass(frozen=True)
class Shown:
    """A command as a doc shows it, and where."""

    path: str
    line: int
    text: str


def _code_lines(lines: list[str]) -> Iterator[tuple[int, str]]:
    fenced, pending = False, None
    for no, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not (fenced or line.startswith("    ")):
            continue
        start, text = (pending[0], f"{pending[1]} {line.strip()}") if pending \
            else (no, line.strip())
        pending = None
        if text.endswith("\\"):
            pending = (start, text[:-1].rstrip())
            continue
        yield start, re.sub(r"\s+#.*$", "", text)


def _inline_spans(lines: list[str]) -> Iterator[tuple[int, str]]:
    fenced = False
    for no, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            for span in re.findall(r"`([^`]+)`", line):
                yield no, span


def is_command(text: str) -> bool:
    return bool(COMMAND.match(text)) and len(text.split()) >= 2


def shown_commands(root: Path = ROOT) -> list[Shown]:
    """Every command README.md and docs/*.md show, in file and line order."""
    found = []
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        lines = doc.read_text().splitlines()
        where = str(doc.relative_to(root))
        for no, text in [*_code_lines(lines), *_inline_spans(lines)]:
            if is_command(text):
                found.append(Shown(where, no, text))
    return sorted(found, key=lambda s: (s.path, s.line))


@dataclass(frozen=True)
class Run:
    """Run as written from the root of a copy of the checkout by ``tests/<tier>``'s
    doc-command test: exit status ``rc``, each of ``stdout`` in its output, each of ``files``
    (relative to the root) written. ``serve``: a server; the test waits for this output line,
    sends SIGTERM and expects exit 0. ``shrink``: size flags appended to a benchmark that takes
    minutes as written (its argparse takes the last value), so the run checks the command's
    code path and outputs but not its sizes: the one departure from "as written". ``after``:
    servers it needs, each started first by bash from the root and stopped after it."""

    tier: str
    rc: int = 0
    stdout: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    serve: str | None = None
    timeout: float = 120.0
    shrink: str = ""
    after: tuple[str, ...] = ()


@dataclass(frozen=True)
class RunBy:
    """Run as written by the test file ``test`` (which holds the command's text)."""

    test: str


@dataclass(frozen=True)
class Gated:
    """Needs ``resource``, which a plain test run does not have; ``reason`` says where it runs.
    ``part``: the part of the command after ``&&`` that runs as written here, and how."""

    resource: str
    reason: str
    part: tuple[str, Run] | None = None


@dataclass(frozen=True)
class Prose:
    """Named in a sentence, not a command line to run."""

    reason: str


Entry = Run | RunBy | Gated | Prose

# Documented placeholders -> what the runner puts in their place (docs/conformance.md: HOST:PORT
# is the server's address, C.json / T.jsonl any config and trace; docs/kernels.md: $OUT is the
# device machine's output folder).
SUBSTITUTIONS: dict[str, str] = {"$OUT": "{out}", "HOST:PORT": "{target}", "C.json": "{config}",
                                 "T.jsonl": "{trace}"}

_SERVING = '"event": "serving"'
_SUITE = Gated("the test suite itself", "runs every tier (scripts/test.sh is what CI runs); a test "
               "cannot run the run it is part of")
_DOCKER = "a Docker engine"
_BY_DOCKER_TIER = "tests/docker runs it when an engine answers (scripts/docker_env.sh)"
_GPU = "a CUDA GPU"


def _bench(name: str, shrink: str = "", tier: str = "bench", plot: bool = False) -> Run:
    """A benchmark: exit 0 and bench/results/<name>.json written (and, for one that ``plot``s,
    its picture bench/results/<name>.png)."""
    files = (f"bench/results/{name}.json",) + ((f"bench/results/{name}.png",) if plot else ())
    return Run(tier, files=files, timeout=300, shrink=shrink)


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def is_png(path: Path) -> bool:
    """``path`` starts with the PNG signature (a real image file, not an empty or text one)."""
    with path.open("rb") as f:
        return f.read(len(PNG_SIGNATURE)) == PNG_SIGNATURE

_CTL_TEST = "tests/service/test_ctl.py"

REGISTRY: dict[str, Entry] = {
    # docs/operations.md (kvcache-ctl runs as `python -m cache_service.ctl`: the console
    # script of an editable install may belong to another checkout)
    "kvcache-ctl pools": RunBy(_CTL_TEST),
    "kvcache-ctl pool llama": RunBy(_CTL_TEST),
    "kvcache-ctl request llama r1": RunBy(_CTL_TEST),
    "kvcache-ctl peek llama --tokens-file prompt.txt": RunBy(_CTL_TEST),
    "kvcache-ctl peek llama --text 'You are a helpful assistant.'": RunBy(_CTL_TEST),
    "kvcache-ctl sessions --requests": RunBy(_CTL_TEST),
    "kvcache-ctl sessions": RunBy(_CTL_TEST),  # docs/protocol.md
    "kvcache-ctl peek": Prose("names the subcommand in the alerts table"),
    "kvcache-ctl cluster": Prose("names the subcommand in the alerts table"),
    "kvcache-ctl events llama": RunBy(_CTL_TEST),
    "kvcache-ctl pools --json": RunBy(_CTL_TEST),
    "kvcache-ctl cluster --etcd-endpoints 127.0.0.1:2379": RunBy(
        "tests/cluster/test_ctl_cluster.py"),
    "kvcache-ctl top": RunBy("tests/service/test_ctl_top.py"),
    "python -m cache_service.ctl": Prose("names the module (`kvcache-ctl`'s alias) in a "
                                         "sentence"),
    # README.md
    "pip install torch==2.13.0 -e '.[executor]' && kvcache-demo": Gated(
        "the network and a fresh environment", "installs from the package index and re-points "
        "the machine's editable install; scripts/test.sh runs the same install",
        part=("kvcache-demo", Run("executor", stdout=("prefix hit rate",), timeout=300))),
    "bash scripts/test.sh": _SUITE,
    "bash scripts/test.sh tests/core -q": Gated(
        "the test suite itself", "scripts/test.sh pip-installs the project and lints before "
        "pytest; the core tier it selects is what `python3 -m pytest tests/core` runs"),
    "kvcache-demo --help": Run("executor", stdout=("--preset", "--requests")),
    "kvcache-server --port 50051 --metrics-port 9400": Run("service", serve=_SERVING),
    "kvcache-executor --help": Run("executor", stdout=("--preset", "--mamba-cache-mode")),
    "kvcache-demo --target 127.0.0.1:50061": Gated(
        "an executor serving on 127.0.0.1:50061", "a fixed port in the ephemeral range, which "
        "other runs on a shared machine take (seen: an etcd of the cluster tier); "
        "tests/executor/test_cli.py runs `kvcache-demo --target` against an executor"),
    "kvcache-demo --target": Prose("names the flag in a sentence"),
    "docker compose up --build": Gated(_DOCKER, _BY_DOCKER_TIER + " (test_compose.py)"),
    "docker-compose up --build": Gated(_DOCKER, _BY_DOCKER_TIER + " (test_compose.py)"),
    "bash scripts/docker/wheelhouse.sh": Gated(
        "the network", "downloads wheels from the package index; scripts/docker_env.sh runs it "
        "before the docker tier"),
    "python -m cache_service.replay --config cache_service/replay_samples/full_swa.json "
    "< cache_service/replay_samples/full_swa.bench.jsonl": Run("service", stdout=('"op"',)),
    "pip install -e '.[test-core]'": Gated(
        "the network", "installs from the package index into the machine's environment"),
    "pip install": Prose("names the tool in a sentence"),
    "python -m cache_service": Run("service", serve=_SERVING),
    # docs/benchmarks.md
    "python3 bench/bench_core.py": _bench("core", "--num-requests 200", plot=True),
    "python3 bench/bench_core.py --retention --num-requests 300 --max-batched-tokens 512 "
    "--num-blocks 4096": _bench("core_retention", "--num-requests 20"),
    "python3 bench/bench_service.py":
        _bench("service", "--steps 10 --warmup 1 --clients 1 --sizes 8", plot=True),
    "python3 bench/bench_cluster.py": _bench(  # needs etcd: the cluster tier
        "cluster", "--kills 1 --steps 10 --rounds 1 --clients 1 --seconds 0.5 --pools 3",
        tier="cluster", plot=True),
    "python3 bench/bench_cluster.py --parts failover,rolling --kills 3": Gated(
        "minutes of machine time and etcd", "the run the numbers come from; `python3 "
        "bench/bench_cluster.py` (every part, smaller sizes) runs in tests/cluster"),
    "python3 bench/bench_replication.py": _bench(  # needs etcd: the cluster tier
        "replication", "--kills 1 --steps 10 --rounds 1 --blocks 2048", tier="cluster"),
    "python3 bench/bench_durability.py": _bench(
        "durability", "--steps 10 --warmup 2 --rounds 1 --requests 500 --tail 10"),
    "python3 bench/bench_snapshot.py": _bench(
        "snapshot", "--blocks 20000 --requests 200 --tail 5 --tail-batch 16 --seconds 0.5"),
    "python3 bench/bench_chaos.py": _bench("chaos", "--runs 1 --scenarios lost_answers"),
    "python3 bench/bench_chaos.py --runs 2 --scenarios lost_answers,damaged_payload,"
    "damaged_length,sigkill_owner,sigstop_owner,rolling_restart,etcd_restart": Gated(
        "minutes of machine time and etcd", "the run the numbers come from; `python3 "
        "bench/bench_chaos.py` runs in tests/bench"),
    "python3 bench/bench_wal.py": _bench("wal", "--records 30 --rounds 2"),
    "python3 bench/bench_fairness.py --seconds 6": _bench("fairness"),
    "python3 bench/bench_fuzz.py --seeds 1,2,3 --calls 3000":
        _bench("fuzz", "--seeds 1 --calls 300"),
    "python3 bench/bench_leases.py": _bench("leases"),
    "PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --out bench/results/gpu_check.json": Gated(
        _GPU, "the device run of bench/gpu_check.py; its --dry-run runs in tests/bench"),
    "python3 bench/gpu_check.py --dry-run": RunBy("tests/bench/test_gpu_check.py"),
    "python3 bench/gpu_check.py": Gated(_GPU, "the device run; its --dry-run runs in tests/bench"),
    "python3 bench/bench_executor.py": _bench("executor", "--requests 4 --max-tokens 2"),
    "python3 bench/bench_executor.py --simulated-forward-ms 5 2 --requests 128 --concurrency 64 "
    "--max-tokens 32": _bench("executor_simulated", "--requests 16 --repeats 1 --max-tokens 4"),
    "python3 bench/bench_routing.py": _bench("routing", "--quick"),
    "python3 bench/bench_tier.py --quick": _bench("tier"),
    "python3 bench/bench_tier.py": _bench("tier", "--quick"),
    "python3 bench/bench_tier.py --trace "
    "../shared/data/mooncake-traces/conversation_trace.jsonl": Gated(
        "the Mooncake trace files beside the checkout (../shared/data, never committed)",
        "tests/bench/test_bench_tier.py runs the bench on a generated trace of the format"),
    "python3 bench/bench_service.py --sizes 256 --clients 1 --steps 300 --baseline-tree ../main":
        Gated("a second checkout at ../main", "the before side of a before/after comparison; "
              "`python3 bench/bench_service.py` runs in tests/bench"),
    "python3 bench/profile_step.py": _bench("profile_step"),
    "KVCACHE_CORE=auto python3 bench/bench_service.py --sizes 256 --clients 1 --steps 100 "
    "--vs-pure": _bench("service", "--sizes 8 --steps 5 --warmup 1 --rounds 1", plot=True),
    "KVCACHE_CORE=auto python3 bench/bench_core.py --num-requests 1000 --vs-pure --no-oracle "
    "--pool-blocks 0":
        _bench("core", "--num-requests 100", plot=True),
    "python3 bench/instruction_counts.py --check": RunBy("tests/bench/test_instruction_budgets.py"),
    "python3 bench/instruction_counts.py --core compiled": Gated(
        "valgrind and a compiled build of the core", "scripts/test.sh builds the compiled "
        "core; tests/bench/test_instruction_budgets.py runs the pure core's count"),
    "python3 bench/bench_mooncake.py --trace "
    "../shared/data/mooncake-traces/conversation_trace.jsonl --max-requests 500": Gated(
        "the Mooncake trace files beside the checkout (../shared/data, never committed)",
        "tests/bench/test_bench_mooncake.py runs the bench on a generated trace of the format"),
    # docs/architecture.md
    "python -m cache_service.core.build": Gated(
        "a C compiler and a minute or more of CPU", "scripts/test.sh runs it before the test "
        "pass against the compiled core"),
    "python -m cache_service.core --build-info": Run("service", stdout=('"variant"',)),
    # docs/conformance.md
    "python -m cache_service.conformance --target HOST:PORT":
        RunBy("tests/service/test_conformance.py"),
    "python -m cache_service.conformance --target HOST:PORT --config C.json --trace T.jsonl":
        RunBy("tests/service/test_conformance.py"),
    "python -m cache_service.conformance": Prose("names the module in a sentence"),
    "python -m cache_service.replay": Prose("names the module in a sentence"),
    # docs/deployment.md
    "kvcache-demo --target executor:50061 --preset <the executor's>": Prose(
        "the compose file's demo command, with a placeholder; tests/docker runs the stack"),
    "KVCACHE_WHEELHOUSE=wheelhouse-gpu bash scripts/docker/wheelhouse.sh": Gated(
        "the network", "downloads CUDA wheels from the package index"),
    "docker compose --profile gpu up --build executor-gpu": Gated(
        _DOCKER + " with a GPU", "the GPU profile; tests/docker/test_compose_file.py checks it"),
    "docker build": Prose("names the tool in a sentence"),
    "docker compose down": Gated(_DOCKER, _BY_DOCKER_TIER + " (test_compose.py)"),
    "docker compose up --exit-code-from demo": Gated(_DOCKER, _BY_DOCKER_TIER),
    "python -m kvcache_common.healthcheck": Prose("names the image's health-check module"),
    "docker stop": Prose("names the tool in a sentence"),
    "docker compose restart cache-service": Gated(_DOCKER, "an operator's step on a running stack"),
    "pip wheel": Prose("names the tool in a sentence"),
    'docker build --build-arg BASE_IMAGE="${KVCACHE_BASE_IMAGE:-python:3.11-slim}" --target '
    'cache-service -t kvcache/cache-service .': Gated(
        _DOCKER, _BY_DOCKER_TIER + " (conftest.py builds the images with it)"),
    'docker build --build-arg BASE_IMAGE="${KVCACHE_BASE_IMAGE:-python:3.11-slim}" --target '
    'executor -t kvcache/executor .': Gated(
        _DOCKER, _BY_DOCKER_TIER + " (conftest.py builds the images with it)"),
    "docker compose logs cache-service": Gated(_DOCKER, "an operator's step on a running stack"),
    "docker import": Prose("names the tool in a sentence"),
    "bash scripts/docker_env.sh": Gated(
        _DOCKER, "starts or installs a Docker engine as root; scripts/test.sh runs it"),
    "bash scripts/docker_env.sh stop": Gated(
        _DOCKER, "stops the engine scripts/docker_env.sh started; scripts/test.sh runs it"),
    "source scripts/docker_env.sh": Gated(
        _DOCKER, "starts or installs a Docker engine as root; scripts/test.sh runs it"),
    "python3 -m pytest; rc=$?": _SUITE,
    "docker compose restart": Prose("names the operator's step in a sentence"),
    # docs/executor.md
    "python -m executor": Prose("names the module (`kvcache-executor`'s alias) in a sentence"),
    "python -m executor --help": Run("executor", stdout=("--preset",)),
    "python3 -m pytest tests/executor -q": Gated(
        "the test suite itself", "the executor tier; a test cannot run the tier it is part of"),
    # docs/kernels.md
    "OMP_NUM_THREADS=1 python3 -m pytest tests/kernels -q": Gated(
        "the test suite itself", "the kernels tier; a test cannot run the run it is part of"),
    'OMP_NUM_THREADS=1 python3 -m pytest tests/kernels -q -m "not triton"': Gated(
        "the test suite itself", "the kernels tier without the interpreter tests"),
    "OMP_NUM_THREADS=1 python3 bench/bench_kernels_attention.py":
        _bench("kernels_attention", "--quick"),
    "PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --out $OUT/gpu_check.json 2>&1 "
    "| tee $OUT/gpu_check.log": Gated(_GPU, "the device machine's run of the GPU check"),
    "OMP_NUM_THREADS=1 python3 -m pytest tests/kernels/test_conv1d.py tests/kernels/test_ssd.py "
    "tests/kernels/test_selective_scan.py tests/kernels/test_norm.py "
    "tests/bench/test_gpu_check_mamba.py -q": Gated(
        "the test suite itself", "a selection of the kernels and bench tiers"),
    "OMP_NUM_THREADS=1 python3 bench/bench_kernels_mamba.py": _bench("kernels_mamba"),
    # docs/protocol.md
    "bash scripts/gen_protos.sh": RunBy("tests/service/test_protos.py"),
    "grpcurl -plaintext 127.0.0.1:50051 list": Gated(
        "the grpcurl binary", "not installed here; tests/service/test_reflection.py lists the "
        "services over reflection with a Python client"),
    "kvcache-server --help": Run("service", stdout=("--port", "--data-dir")),
}


def runs(tier: str) -> dict[str, Run]:
    """The commands (and parts of gated ones) that ``tests/<tier>`` runs as written."""
    found = {text: entry for text, entry in REGISTRY.items()
             if isinstance(entry, Run) and entry.tier == tier}
    for text, entry in REGISTRY.items():
        if isinstance(entry, Gated) and entry.part and entry.part[1].tier == tier:
            assert text.endswith(f"&& {entry.part[0]}"), f"{entry.part[0]!r} not in {text!r}"
            found[entry.part[0]] = entry.part[1]
    return found


def copy_checkout(dest: Path) -> Path:
    """The git-tracked files of this checkout under ``dest`` (what commands write, e.g.
    bench/results/, lands there instead of in the checkout)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return dest


def substitute(text: str, values: dict[str, str]) -> str:
    """``text`` with each documented placeholder of :data:`SUBSTITUTIONS` filled in."""
    for placeholder, template in SUBSTITUTIONS.items():
        if placeholder in text:
            text = text.replace(placeholder, template.format(**values))
    return text


def _env(root: Path) -> dict[str, str]:
    # The copy's packages, also for console scripts (kvcache-*) installed elsewhere; this
    # interpreter's directory first so `python3` is the one running the tests.
    return {**os.environ, "PYTHONPATH": str(root), "PATH": f"{Path(sys.executable).parent}:"
            f"{os.environ.get('PATH', '')}"}


def shell(command: str, root: Path, timeout: float,
          env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess[str]:
    """``command`` run by bash from ``root`` (a checkout or a copy of one), output captured;
    ``env`` sets (or, with None, unsets) environment variables."""
    merged: dict[str, str | None] = {**_env(root), **(env or {})}
    return subprocess.run(["bash", "-c", command], cwd=root, capture_output=True, text=True,
                          env={k: v for k, v in merged.items() if v is not None},
                          timeout=timeout)


def run_as_written(text: str, entry: Run, root: Path) -> None:
    """Runs the registered command ``text`` with bash from ``root`` and checks what its
    :class:`Run` entry promises."""
    command = f"{text} {entry.shrink}".strip()
    with contextlib.ExitStack() as servers:
        for server in entry.after:
            servers.enter_context(serving(server, root, _SERVING, entry.timeout))
        if entry.serve:
            with serving(command, root, entry.serve, entry.timeout):
                return
        _check(command, entry, root)


def _check(command: str, entry: Run, root: Path) -> None:
    for name in entry.files:  # the copy is shared: an earlier run's file must not count
        (root / name).unlink(missing_ok=True)
    done = shell(command, root, entry.timeout)
    tail = (done.stdout + done.stderr)[-3000:]
    assert done.returncode == entry.rc, f"{command}: exit {done.returncode}\n{tail}"
    for expected in entry.stdout:
        assert expected in done.stdout, f"{command}: no {expected!r} in its output\n{tail}"
    for name in entry.files:
        assert (root / name).is_file(), f"{command}: did not write {name}\n{tail}"
        if name.endswith(".json"):
            json.loads((root / name).read_text())
        if name.endswith(".png"):
            assert is_png(root / name), f"{command}: {name} is not a PNG image"


@contextlib.contextmanager
def serving(command: str, root: Path, ready: str, timeout: float) -> Iterator[None]:
    """Runs the server ``command`` with bash from ``root`` until its output has the line
    ``ready``; on leaving, SIGTERM, and it must exit 0 (the documented shutdown)."""
    proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=root, env=_env(root),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    up = threading.Event()

    def drain() -> None:  # also after `ready`: a full pipe would block the server
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if ready in line:
                up.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + timeout
        while not up.wait(0.1):
            assert proc.poll() is None, f"{command} exited:\n{''.join(seen)[-3000:]}"
            assert time.monotonic() < deadline, f"{command}: no {ready!r} in {timeout} s"
        yield
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, \
            f"{command}: exit {proc.returncode} after SIGTERM\n{''.join(seen)[-3000:]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)
