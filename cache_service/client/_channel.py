"""Channel construction shared by the async and the blocking client, retry policy included.

Unary calls are retried by gRPC (a service-config ``retryPolicy``): on UNAVAILABLE only,
the same request bytes again, so a mutating call is resent under the same session sequence
number and the service applies it once (``_session.py``). The call's ``timeout`` spans all
its attempts. gRPC allows at most 5 attempts, hence ``max_retries <= 4``. Streams are not
under the policy: a StepStream step is resent by hand (``_retry.py``) and an event
subscription is resumed by its caller.
"""

from __future__ import annotations

import json
from typing import Any

import grpc

from kvcache_common.api.kvcache.v1 import cache_service_pb2 as pb
from kvcache_common.backoff import Backoff

#: gRPC treats a retry policy's ``maxAttempts`` above 5 as 5.
MAX_RETRIES = 4
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata carrying ``token`` as a bearer token (none without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def channel_credentials(tls: bool,
                        root_certificates: bytes | None) -> grpc.ChannelCredentials | None:
    """TLS credentials when ``tls`` or ``root_certificates`` ask for them (None: plaintext)."""
    if not tls and root_certificates is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=root_certificates)


CHANNEL_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30000),
    ("grpc.keepalive_timeout_ms", 10000),
    # Reconnect within 2 s once a restarted server is back (gRPC's default backoff grows
    # to 2 minutes, longer than any retry budget here).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    # gRPC keeps a request for its retries only up to this size (default 256 KiB): a
    # larger Step would silently lose its retries.
    ("grpc.per_rpc_retry_buffer_size", MAX_MESSAGE_BYTES),
]


def _seconds(value: float) -> str:
    return f"{max(value, 0.001):.3f}s"


def retry_service_config(max_retries: int, backoff: Backoff) -> dict[str, Any]:
    """The service config that retries every unary CacheService call on UNAVAILABLE up to
    ``max_retries`` times, waiting ``backoff`` (gRPC's jitter: uniform in [0, delay])."""
    service = pb.DESCRIPTOR.services_by_name["CacheService"]
    unary = [{"service": service.full_name, "method": m.name} for m in service.methods
             if not m.client_streaming and not m.server_streaming]
    return {"methodConfig": [{"name": unary, "retryPolicy": {
        "maxAttempts": max_retries + 1, "initialBackoff": _seconds(backoff.base),
        "maxBackoff": _seconds(backoff.cap), "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"]}}]}


def channel_options(max_retries: int, backoff: Backoff,
                    ssl_target_name_override: str | None) -> list[tuple[str, int | str]]:
    """The channel arguments of a client; raises ValueError naming ``max_retries`` outside
    0..MAX_RETRIES (gRPC would cap it silently)."""
    if not 0 <= max_retries <= MAX_RETRIES:
        raise ValueError(f"max_retries: {max_retries} is not in 0..{MAX_RETRIES} (gRPC's "
                         f"retry policy allows at most {MAX_RETRIES + 1} attempts)")
    options = list(CHANNEL_OPTIONS)
    if max_retries:  # a policy needs maxAttempts >= 2
        options.append(("grpc.service_config",
                        json.dumps(retry_service_config(max_retries, backoff))))
    if ssl_target_name_override:
        options.append(("grpc.ssl_target_name_override", ssl_target_name_override))
    return options
