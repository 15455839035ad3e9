"""The replica's connection to etcd: an ``aetcd`` client that moves on to the next
endpoint (and rebuilds its channel and watcher) after a failure."""

from __future__ import annotations

import asyncio
import contextlib

import aetcd
import grpc
import structlog

from kvcache_common.backoff import Backoff

#: What a lost or restarting etcd raises through aetcd.
ETCD_ERRORS: tuple[type[BaseException], ...] = (
    aetcd.exceptions.ClientError, grpc.aio.AioRpcError, asyncio.TimeoutError, OSError)

_log = structlog.get_logger("cache_service.cluster")


def stray_cancel() -> bool:
    """True inside ``except CancelledError`` when the running task itself is not being
    cancelled: a call on a channel that another task closed (:meth:`Etcd.reconnect`, after
    the keep-alive or the watch noticed an outage) ends that way. Such an error is an etcd
    failure like any other; letting it end the task would stop renewals for good."""
    task = asyncio.current_task()
    return task is not None and not task.cancelling()


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


#: Between attempts to reach etcd again (joining, or following the cluster view after a
#: lost watch): the tree's one backoff rule (:mod:`kvcache_common.backoff`), over the same
#: 0.1 to 0.5 s span as the channel's own reconnect backoff below.
RETRY_BACKOFF = Backoff(0.1, 0.5)


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
        # Reconnect within ~0.5 s once etcd is back: gRPC's default backoff grows to 2 min,
        # far beyond a lease TTL of a few seconds.
        return aetcd.Client(host=host, port=port, timeout=self.timeout, options={
            "grpc.initial_reconnect_backoff_ms": 100, "grpc.min_reconnect_backoff_ms": 100,
            "grpc.max_reconnect_backoff_ms": 500})

    @property
    def endpoint(self) -> str:
        """The endpoint the current client talks to, ``host:port``."""
        host, port = self.endpoints[self._index]
        return f"{host}:{port}"

    async def reconnect(self, failed: aetcd.Client) -> None:
        """Drops ``failed`` (its watches end) and connects to the next endpoint, unless
        another task has replaced it already (the keep-alive and the watch both notice an
        outage; one new client serves both)."""
        if failed is not self.client:
            return
        old = self.client
        self._index = (self._index + 1) % len(self.endpoints)
        self.client = self._new_client()
        try:
            await asyncio.wait_for(old.close(), self.timeout)
        except ETCD_ERRORS + (RuntimeError, ValueError) as exc:  # a dead channel may not close
            _log.debug("etcd_close_failed", error=str(exc))
        _log.info("etcd_reconnect", endpoint=self.endpoint)

    async def close(self) -> None:
        """Closes the current client (an unreachable etcd is not waited for past ``timeout``)."""
        with contextlib.suppress(*ETCD_ERRORS):
            await asyncio.wait_for(self.client.close(), self.timeout)
