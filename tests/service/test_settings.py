"""Settings: flags over KVCACHE_* environment variables over defaults."""

from __future__ import annotations

import pytest

from cache_service.settings import Settings, parse_settings


def test_defaults() -> None:
    s = parse_settings([])
    assert (s.host, s.port, s.metrics_port) == ("127.0.0.1", 50051, 9400)
    assert s.auth_token is None and s.tls_cert is None
    assert s.lease_ttl_seconds == 30.0


def test_environment_then_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHE_PORT", "6000")
    monkeypatch.setenv("KVCACHE_DRAIN_SECONDS", "1.5")
    monkeypatch.setenv("KVCACHE_AUTH_TOKEN", "t0k")
    s = parse_settings([])
    assert (s.port, s.drain_seconds) == (6000, 1.5)
    assert s.auth_token is not None and s.auth_token.get_secret_value() == "t0k"
    assert "t0k" not in repr(s)  # secrets stay out of logs
    assert parse_settings(["--port", "7000"]).port == 7000
    monkeypatch.setenv("KVCACHE_LEASE_TTL_SECONDS", "2.5")
    assert parse_settings([]).lease_ttl_seconds == 2.5
    assert parse_settings(["--lease-ttl-seconds", "4"]).lease_ttl_seconds == 4.0


@pytest.mark.parametrize("argv", [["--port", "-1"], ["--metrics-port", "-2"],
                                  ["--event-buffer", "0"], ["--tls-cert", "c.pem"],
                                  ["--lease-ttl-seconds", "0"],
                                  ["--log-level", "loud"], ["--fsync", "sometimes"],
                                  ["--fsync-interval-ms", "0"], ["--snapshot-every", "0"],
                                  ["--etcd-lease-ttl", "1"], ["--cluster-name", "a/b"]])
def test_bad_values_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_settings(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    # One line naming the offending flag, no traceback.
    assert err and err[-1].startswith("kvcache-server: error:")
    assert argv[0] in err[-1] or (argv[0] == "--tls-cert" and "--tls-key" in err[-1])


def test_every_field_has_a_flag_an_env_var_and_a_description(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_settings(["--help"])
    assert exc.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    for name, info in Settings.model_fields.items():
        assert info.description
        assert "--" + name.replace("_", "-") in help_text
        assert "KVCACHE_" + name.upper() in help_text
    assert "{debug,info,warning,error}" in help_text  # choices are listed


def test_durability_settings(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    s = parse_settings([])
    assert (s.data_dir, s.fsync) == (None, "batch")  # in-memory unless a directory is given
    monkeypatch.setenv("KVCACHE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("KVCACHE_FSYNC", "never")
    s = parse_settings([])
    assert (s.data_dir, s.fsync) == (tmp_path, "never")
    assert parse_settings(["--fsync", "always"]).fsync == "always"


def test_a_shared_data_root_holds_each_members_directory(capsys: pytest.CaptureFixture[str],
                                                          tmp_path) -> None:
    cluster = ["--etcd-endpoints", "etcd:2379", "--shared-data-root", str(tmp_path)]
    s = parse_settings([*cluster, "--member-id", "m1"])
    assert s.state_dir == tmp_path / "m1"
    assert parse_settings([*cluster, "--member-id", "m1", "--data-dir",
                           str(tmp_path / "m1")]).state_dir == tmp_path / "m1"
    assert parse_settings(["--data-dir", str(tmp_path)]).state_dir == tmp_path
    for argv in (cluster, [*cluster, "--member-id", "m1", "--data-dir", str(tmp_path)]):
        with pytest.raises(SystemExit) as exc:  # no member id; a data dir elsewhere
            parse_settings(argv)
        assert exc.value.code == 2
        assert "--shared-data-root" in capsys.readouterr().err.splitlines()[-1]
