"""Channel construction shared by the async and the blocking client."""

from __future__ import annotations

import grpc


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def channel_credentials(tls: bool,
                        root_certificates: bytes | None) -> grpc.ChannelCredentials | None:
    if not tls and root_certificates is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=root_certificates)


CHANNEL_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30000),
    ("grpc.keepalive_timeout_ms", 10000),
    # Reconnect within 2 s once a restarted server is back (gRPC's default backoff grows
    # to 2 minutes, longer than any retry budget here).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
