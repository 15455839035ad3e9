"""Whether a server can listen where its settings say, checked before gRPC binds: gRPC's own
failure is a bare ``RuntimeError`` after a C-core log line, where a user needs one line naming
the flag to change."""

from __future__ import annotations

import errno
import socket


def port_in_use(host: str, port: int, flag: str = "--port") -> str | None:
    """Why ``host:port`` cannot be listened on (one line naming ``--host`` or ``flag``), or
    None. Binds like gRPC does (SO_REUSEADDR), so a port in TIME_WAIT counts as free; port 0
    (ephemeral) and -1 (disabled) are always fine."""
    if port <= 0:
        return None
    try:
        addresses = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"--host: cannot resolve {host!r} ({exc.strerror})"
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    # the hint names the flag that is in use, not always --port
                    off = ", -1 for none" if flag == "--metrics-port" else ""
                    return (f"{flag}: {host}:{port} is already in use (another server "
                            f"running? pick another port, or {flag} 0 for a free one{off})")
                return f"--host: cannot listen on {host}:{port} ({exc.strerror})"
    return None


def ports_in_use(host: str, port: int, metrics_port: int) -> str | None:
    """Why a server cannot listen on its gRPC port or its metrics port, or None: what both
    servers check before starting anything slow (a second start of the same command answers
    at once)."""
    return port_in_use(host, port) or port_in_use(host, metrics_port, "--metrics-port")
