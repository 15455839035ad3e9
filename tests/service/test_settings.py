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
                                  ["--log-level", "loud"]])
def test_bad_values_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_settings(argv)
    assert exc.value.code == 2


def test_every_field_has_a_flag_and_a_description() -> None:
    from cache_service.settings import build_parser

    help_text = build_parser().format_help()
    for name, info in Settings.model_fields.items():
        assert info.description
        assert "--" + name.replace("_", "-") in help_text
