"""``kvcache-ctl`` against a real server: each view's numbers are the service's, errors are
one line with the documented exit code, and ``events --follow`` resumes where it stopped."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cache_service.client import CacheClient, LookupResult, layers, ops
from kvcache_common.launch import ServerProcess, start_cache_service

PROMPT = list(range(1, 30))

# The commands docs/operations.md shows (tests/doc_commands.py: RunBy this file).
DOC_POOLS = "kvcache-ctl pools"
DOC_POOL = "kvcache-ctl pool llama"
DOC_REQUEST = "kvcache-ctl request llama r1"
DOC_PEEK_FILE = "kvcache-ctl peek llama --tokens-file prompt.txt"
DOC_PEEK_TEXT = "kvcache-ctl peek llama --text 'You are a helpful assistant.'"
DOC_SESSIONS = "kvcache-ctl sessions --requests"
DOC_EVENTS = "kvcache-ctl events llama"
DOC_JSON = "kvcache-ctl pools --json"


def ctl_argv(command: str) -> list[str]:
    """A documented ``kvcache-ctl ...`` line as argv, through this interpreter (the console
    script of an editable install may point at another checkout)."""
    words = shlex.split(command)
    assert words[0] == "kvcache-ctl"
    return [sys.executable, "-m", "cache_service.ctl", *words[1:]]


def ctl(command: str, target: str, *extra: str, cwd: Path | None = None,
        timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ctl_argv(command), "--target", target, *extra],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[ServerProcess, CacheClient]]:
    """A server with pool ``llama`` (full + sliding window, a session quota) and request r1
    of PROMPT added by a session named ``ctl-test``."""
    with start_cache_service("--metrics-port", "0") as srv, \
            CacheClient(srv.target, client_name="ctl-test") as client:
        spec = [layers.full_attention("a", block_size=4, num_kv_heads=1, head_size=8),
                layers.sliding_window("s", block_size=4, num_kv_heads=1, head_size=8,
                                      sliding_window=8)]
        client.register_pool("llama", spec, num_blocks=128, max_model_len=128,
                             session_block_quota=60)
        client.step("llama", [ops.add("r0", PROMPT), ops.allocate("r0", len(PROMPT))],
                    begin_step=True)
        client.step("llama", [ops.free("r0")])
        hit = client.step("llama", [ops.add("r1", PROMPT), ops.lookup("r1")]).results[1]
        assert isinstance(hit, LookupResult)
        client.step("llama", [ops.allocate("r1", len(PROMPT) - hit.hit_tokens)],
                    begin_step=True)
        yield srv, client


def test_pools_json_is_the_services_stats(served) -> None:
    srv, client = served
    done = ctl(DOC_JSON, srv.target)
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)
    stats = client.stats("llama")
    assert row["pool"] == "llama" and row["blocks"] == stats.num_blocks == 128
    assert row["free"] == stats.num_free_blocks and row["cached"] == stats.num_cached_blocks
    assert row["used"] == 127 - stats.num_free_blocks > 0
    assert row["hit_rate"] == pytest.approx(stats.prefix_cache_hits
                                            / stats.prefix_cache_queries)
    assert row["groups"] == ["full_attention", "sliding_window"]


def test_pools_and_pool_tables(served) -> None:
    srv, client = served
    done = ctl(DOC_POOLS, srv.target)
    assert done.returncode == 0 and "llama" in done.stdout and "full, swa" in done.stdout
    done = ctl(DOC_POOL, srv.target)
    assert done.returncode == 0, done.stderr
    assert "sliding_window" in done.stdout and "session block quota" in done.stdout
    data = json.loads(ctl(DOC_POOL, srv.target, "--json").stdout)
    per_group = client.stats("llama").num_cached_blocks_per_group
    assert [g["cached_blocks"] for g in data["group_stats"]] == per_group
    assert data["group_stats"][1]["sliding_window"] == 8


def test_request_tables(served) -> None:
    srv, client = served
    data = json.loads(ctl(DOC_REQUEST, srv.target, "--json").stdout)
    state = client.get_request("llama", "r1")
    assert [t["block_ids"] for t in data["tables"]] == state.block_ids
    assert data["status"] == state.status and data["num_tokens"] == len(PROMPT)
    done = ctl(DOC_REQUEST, srv.target)
    assert " ".join(map(str, state.block_ids[0])) in done.stdout


def test_peek_explains_per_group(served, tmp_path: Path) -> None:
    srv, _ = served
    (tmp_path / "prompt.txt").write_text(" ".join(map(str, PROMPT)))
    done = ctl(DOC_PEEK_FILE, srv.target, "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (hit,) = json.loads(done.stdout)
    assert hit["hit_tokens"] == 28
    assert [g["miss_reason"] for g in hit["groups"]] == ["none", "none"]
    # the text mode: one token per UTF-8 byte, never cached here
    (miss,) = json.loads(ctl(DOC_PEEK_TEXT, srv.target, "--json").stdout)
    assert miss["prompt_tokens"] == len(b"You are a helpful assistant.")
    assert {g["miss_reason"] for g in miss["groups"]} == {"never_cached"}
    table = ctl(DOC_PEEK_TEXT, srv.target).stdout
    assert "never_cached" in table and "0 of 28 prompt tokens" in table


def test_sessions_show_requests_and_quota(served) -> None:
    srv, client = served
    done = ctl(DOC_SESSIONS, srv.target, "--json")
    assert done.returncode == 0, done.stderr
    (mine,) = [s for s in json.loads(done.stdout) if s["client_name"] == "ctl-test"]
    assert client.session_id is not None and client.session_id.startswith(mine["session"])
    assert len(mine["session"]) == 8  # never the whole id: it is a credential
    (pool,) = mine["pools"]
    assert pool["pool"] == "llama" and pool["request_ids"] == ["r1"]
    assert pool["block_quota"] == 60 and pool["blocks_held"] > 0
    assert 0 < mine["lease_remaining_seconds"] <= 30
    assert "ctl-test" in ctl(DOC_SESSIONS, srv.target).stdout


def test_events_tail_and_follow_resume(served) -> None:
    srv, client = served
    last = client.stats("llama").last_event_sequence
    done = ctl(DOC_EVENTS, srv.target, "--json")
    assert done.returncode == 0, done.stderr
    seqs = [json.loads(line)["sequence"] for line in done.stdout.splitlines()]
    assert seqs == list(range(max(1, last - 19), last + 1))
    assert "stored" in ctl(DOC_EVENTS, srv.target).stdout
    follow = subprocess.Popen([*ctl_argv(DOC_EVENTS), "--target", srv.target, "--follow",
                               "--from", str(last + 1), "--json"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        client.reset_prefix_cache("llama")  # r1 holds blocks: answers False, no event
        client.step("llama", [ops.free("r1")])
        client.reset_prefix_cache("llama")  # one AllBlocksCleared
        assert follow.stdout is not None
        line = json.loads(follow.stdout.readline())
        assert line["sequence"] == last + 1 and line["kind"] == "all_blocks_cleared"
        follow.send_signal(signal.SIGINT)
        _, err = follow.communicate(timeout=30)
    finally:
        follow.kill()
    assert follow.returncode == 130
    assert f"--from {last + 2} --incarnation {line['incarnation']}" in err


def test_errors_are_one_line_with_exit_codes(served, tmp_path: Path) -> None:
    srv, _ = served
    done = ctl("kvcache-ctl pool nope", srv.target)
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == "kvcache-ctl: error: NOT_FOUND: pool_id: unknown pool 'nope'\n"
    done = ctl("kvcache-ctl pools --timeout 1", "127.0.0.1:1")
    assert done.returncode == 3 and done.stderr.count("\n") == 1
    assert "cannot reach the cache service at 127.0.0.1:1" in done.stderr
    done = ctl("kvcache-ctl pools --bogus", srv.target)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "unrecognized arguments: --bogus" in done.stderr
    (tmp_path / "bad.txt").write_text("1 2 x")
    done = ctl(f"kvcache-ctl peek llama --tokens-file {tmp_path / 'bad.txt'}", srv.target)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--tokens-file" in done.stderr


def test_token_is_sent() -> None:
    with start_cache_service("--auth-token", "s3cret") as srv:
        done = ctl(DOC_POOLS, srv.target)
        assert done.returncode == 1 and "UNAUTHENTICATED" in done.stderr
        assert "KVCACHE_AUTH_TOKEN" in done.stderr and done.stderr.count("\n") == 1
        env_run = subprocess.run([*ctl_argv(DOC_JSON), "--target", srv.target],
                                 capture_output=True, text=True, timeout=60,
                                 env={**os.environ,
                                      "KVCACHE_AUTH_TOKEN": "s3cret"})
        assert env_run.returncode == 0 and json.loads(env_run.stdout) == []


def test_sessions_are_per_tenant(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("ta a\ntb b\ntroot ops admin\n")
    spec = [layers.full_attention("a", block_size=4, num_kv_heads=1, head_size=8)]
    with start_cache_service("--auth-tokens-file", str(tokens)) as srv, \
            CacheClient(srv.target, token="ta", client_name="client-a") as a, \
            CacheClient(srv.target, token="tb", client_name="client-b") as b:
        for client in (a, b):
            client.register_pool("p", spec, num_blocks=64, max_model_len=32)
            client.step("p", [ops.add("r", [1, 2, 3])])

        def names(token: str) -> list[tuple[str, list[str]]]:
            done = ctl(DOC_SESSIONS, srv.target, "--json", "--token", token)
            assert done.returncode == 0, done.stderr
            return sorted((s["client_name"], [p["pool"] for p in s["pools"]])
                          for s in json.loads(done.stdout))

        assert names("ta") == [("client-a", ["p"])]
        assert names("tb") == [("client-b", ["p"])]
        assert names("troot") == [("client-a", ["a/p"]), ("client-b", ["b/p"])]
