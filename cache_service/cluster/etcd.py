"""The replica's connection to etcd: an ``aetcd`` client that moves on to the next
endpoint (and rebuilds its channel and watcher) after a failure."""

from __future__ import annotations

import asyncio

import aetcd
import grpc
import structlog

#: What a lost or restarting etcd raises through aetcd.
ETCD_ERRORS: tuple[type[BaseException], ...] = (
    aetcd.exceptions.ClientError, grpc.aio.AioRpcError, asyncio.TimeoutError, OSError)

_log = structlog.get_logger("cache_service.cluster")


def parse_endpoints(endpoints: str) -> list[tuple[str, int]]:
    """``"host:port[,host:port]"`` (an ``http://`` prefix is accepted) -> pairs; raises
    ValueError naming the bad entry."""
    out = []
    for raw in endpoints.split(","):
        entry = raw.strip().removeprefix("http://")
        host, sep, port = entry.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd endpoint {raw!r} is not host:port")
        out.append((host, int(port)))
    if not out:
        raise ValueError("no etcd endpoint given")
    return out


class Etcd:
    """One ``aetcd.Client`` at a time; :meth:`reconnect` replaces it with one for the next
    endpoint. Every call gets ``timeout`` seconds."""

    def __init__(self, endpoints: str, timeout: float) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.timeout = timeout
        self._index = 0
        self.client = self._new_client()

    def _new_client(self) -> aetcd.Client:
        host, port = self.endpoints[self._index]
        return aetcd.Client(host=host, port=port, timeout=self.timeout)

    @property
    def endpoint(self) -> str:
        host, port = self.endpoints[self._index]
        return f"{host}:{port}"

    async def reconnect(self) -> None:
        """Drops the current client (its watches end) and connects to the next endpoint."""
        old = self.client
        self._index = (self._index + 1) % len(self.endpoints)
        self.client = self._new_client()
        try:
            await asyncio.wait_for(old.close(), self.timeout)
        except (Exception, asyncio.CancelledError):  # closing a dead channel may fail
            pass
        _log.info("etcd_reconnect", endpoint=self.endpoint)

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.client.close(), self.timeout)
        except ETCD_ERRORS:
            pass
