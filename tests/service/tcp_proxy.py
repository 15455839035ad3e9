"""A TCP proxy between a real client and a real server that can break the next answer.

It runs an asyncio loop on its own thread (the clients under test are blocking). Armed
with :meth:`TcpProxy.arm`, it acts on the next server-to-client chunk of at least
``min_bytes`` bytes (smaller ones are HTTP/2 pings, acks and window updates, not an
answer):

* ``"drop"``: forwards only the chunk's first 9 bytes (one HTTP/2 frame header), then
  closes both sides of that connection: the server has applied the call, the client saw
  the start of the answer and then a dead connection;
* ``"stall"``: forwards nothing more on that connection and keeps it open: a hung server
  as the client sees it.

Either way it fires once (``fired`` is set) and disarms; later connections pass through.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Literal

Mode = Literal["drop", "stall"]


class TcpProxy:
    """``with TcpProxy(server_target) as proxy: CacheClient(proxy.target) ...``"""

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.rpartition(":")
        self._upstream = (host, int(port))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._mode: Mode | None = None
        self._min_bytes = 0
        self.fired = threading.Event()
        self.connections = 0
        self.port = 0

    def __enter__(self) -> "TcpProxy":
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        async def shutdown() -> None:
            assert self._server is not None
            self._server.close()
            for w in list(self._writers):
                w.transport.abort()
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def arm(self, mode: Mode, *, min_bytes: int = 30) -> None:
        """Break the next server answer of at least ``min_bytes`` bytes (see module doc)."""
        self.fired.clear()
        self._min_bytes = min_bytes
        self._mode = mode

    async def _serve(self, client_r: asyncio.StreamReader,
                     client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        server_r, server_w = await asyncio.open_connection(*self._upstream)
        self._writers |= {client_w, server_w}

        async def upstream() -> None:
            while data := await client_r.read(65536):
                server_w.write(data)
                await server_w.drain()
            server_w.close()

        async def downstream() -> None:
            while data := await server_r.read(65536):
                mode = self._mode
                if mode is not None and len(data) >= self._min_bytes:
                    self._mode = None
                    if mode == "drop":
                        client_w.write(data[:9])
                        await client_w.drain()
                        client_w.transport.abort()
                        server_w.transport.abort()
                        self.fired.set()
                        return
                    self.fired.set()
                    await asyncio.Event().wait()  # stall: hold the connection, send nothing
                client_w.write(data)
                await client_w.drain()
            client_w.close()

        pumps = [asyncio.ensure_future(upstream()), asyncio.ensure_future(downstream())]
        try:
            # Either side ending (or a stall's client giving up) ends the connection.
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            for w in (client_w, server_w):
                w.transport.abort()
                self._writers.discard(w)
