"""The protocol files: generated stubs match the .proto files, and buf lint / format pass."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.doc_commands import shell

REPO = Path(__file__).resolve().parents[2]
GENERATED = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
GEN_PROTOS = "bash scripts/gen_protos.sh"


def _generated_files(root: Path) -> dict[str, Path]:
    return {str(p.relative_to(root)): p for p in root.rglob("*")
            if p.is_file() and p.name.endswith(GENERATED)}


def test_generated_stubs_have_not_drifted(tmp_path: Path) -> None:
    # Generate into a scratch copy of the layout so the module path matches.
    script = REPO / "scripts" / "gen_protos.sh"
    work = tmp_path / "repo"
    (work / "scripts").mkdir(parents=True)
    shutil.copy(script, work / "scripts" / "gen_protos.sh")
    shutil.copytree(REPO / "proto", work / "proto")
    done = shell(GEN_PROTOS, work, timeout=300)  # docs/protocol.md's command, as written
    assert done.returncode == 0, done.stdout + done.stderr
    out = work / "kvcache_common" / "api"
    fresh = _generated_files(out)
    committed = _generated_files(REPO / "kvcache_common" / "api")
    assert fresh, "the script generated nothing"
    assert sorted(fresh) == sorted(committed), "stub files differ: run scripts/gen_protos.sh"
    drifted = [name for name in fresh if not filecmp.cmp(fresh[name], committed[name],
                                                         shallow=False)]
    assert not drifted, f"stale generated stubs {drifted}: run scripts/gen_protos.sh"


@pytest.mark.skipif(shutil.which("buf") is None, reason="buf (pip install buf-bin) not found")
@pytest.mark.parametrize("command", [["buf", "lint"],
                                     ["buf", "format", "--diff", "--exit-code"]])
def test_buf(command: list[str]) -> None:
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_stubs_import_under_the_package_path() -> None:
    from kvcache_common.api.kvcache.v1 import cache_service_pb2, cache_service_pb2_grpc

    service = cache_service_pb2.DESCRIPTOR.services_by_name["CacheService"]
    assert service.full_name == "kvcache.v1.CacheService"
    assert hasattr(cache_service_pb2_grpc, "CacheServiceStub")


BASELINE = REPO / "proto" / "BREAKING_BASELINE"


@pytest.mark.skipif(shutil.which("buf") is None, reason="buf (pip install buf-bin) not found")
def test_protocol_changes_are_additive(tmp_path: Path) -> None:
    """`buf breaking` against the protos of the commit named in proto/BREAKING_BASELINE (the
    main that the current change started from): kvcache.v1 is public, so fields and RPCs are
    only added (removed ones `reserved`), and the WAL record must keep reading old logs.
    Move the baseline forward only when a change has landed."""
    commit = BASELINE.read_text().strip()
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the baseline protos cannot be read")
    archive = subprocess.run(["git", "archive", commit, "proto"], cwd=REPO,
                             capture_output=True, check=False)
    assert archive.returncode == 0, (
        f"baseline commit {commit} is not in this clone: {archive.stderr.decode()}")
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive.stdout, check=True)
    result = subprocess.run(["buf", "breaking", "proto", "--against", str(tmp_path / "proto")],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
