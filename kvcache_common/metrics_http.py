"""The Prometheus endpoint of both servers: ``GET /metrics`` on its own port, served on the
server's event loop (no thread, no extra dependency beyond prometheus-client)."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest


async def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> asyncio.Server:
    """Serves ``GET /metrics`` (text exposition) on the running loop; answers 404 for any
    other path. Minimal HTTP/1.0: one request per connection."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
            parts = head.split(b"\r\n", 1)[0].split()
            path = parts[1].split(b"?", 1)[0] if len(parts) >= 2 else b""
            if len(parts) >= 2 and parts[0] == b"GET" and path in (b"/metrics", b"/"):
                body, status, ctype = generate_latest(registry), b"200 OK", \
                    CONTENT_TYPE_LATEST.encode()
            else:
                body, status, ctype = b"not found\n", b"404 Not Found", b"text/plain"
            writer.write(b"HTTP/1.0 " + status + b"\r\nContent-Type: " + ctype +
                         b"\r\nContent-Length: " + str(len(body)).encode() +
                         b"\r\nConnection: close\r\n\r\n" + body)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError,
                asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)
