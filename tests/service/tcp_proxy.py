"""A TCP proxy between a real client and a real server that can break the next answer.

It runs an asyncio loop on its own thread (the clients under test are blocking). Armed
with :meth:`TcpProxy.arm`, it acts on the next server-to-client chunk of at least
``min_bytes`` bytes (smaller ones are HTTP/2 pings, acks and window updates, not an
answer):

* ``"drop"``: forwards only the chunk's first 9 bytes (one HTTP/2 frame header), then
  closes both sides of that connection: the server has applied the call, the client saw
  the start of the answer and then a dead connection;
* ``"stall"``: forwards nothing more on that connection and keeps it open: a hung server
  as the client sees it;
* ``"headers"``: forwards the server's HTTP/2 frames up to and including the next answer's
  response HEADERS frame (one that does not end its stream, i.e. not a trailers-only
  error), then resets both sides: what a proxy or load balancer dropping a connection
  mid-answer does. gRPC's own retries never resend a call whose headers arrived, so only
  the client's resend can learn the answer (``min_bytes`` does not apply).

Either way it fires once (``fired`` is set) and disarms; later connections pass through.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Literal

Mode = Literal["drop", "stall", "headers"]

_FRAME_HEADER = 9  # HTTP/2: length (3 bytes), type, flags, stream id (4 bytes)
_HEADERS, _END_STREAM = 0x1, 0x1
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # what a client sends before its frames

#: One HTTP/2 frame: type, flags, stream id, and its bytes (header included).
Frame = tuple[int, int, int, bytes]


class Frames:
    """Cuts one direction of an HTTP/2 connection into whole frames (a TCP read may end
    inside one); ``preface``: bytes to pass through first (the client's connection
    preface, which is no frame)."""

    def __init__(self, preface: int = 0) -> None:
        self._buffer = bytearray()
        self._preface = preface

    def feed(self, data: bytes) -> list[Frame]:
        """The frames ``data`` completes (a preface is passed as a frame of type -1)."""
        self._buffer += data
        frames: list[Frame] = []
        if self._preface:
            if len(self._buffer) < self._preface:
                return frames
            frames.append((-1, 0, 0, bytes(self._buffer[:self._preface])))
            del self._buffer[:self._preface]
            self._preface = 0
        end = 0
        while len(self._buffer) - end >= _FRAME_HEADER:
            length = int.from_bytes(self._buffer[end:end + 3], "big")
            if len(self._buffer) - end < _FRAME_HEADER + length:
                break
            kind, flags = self._buffer[end + 3], self._buffer[end + 4]
            stream = int.from_bytes(self._buffer[end + 5:end + 9], "big") & 0x7FFFFFFF
            frames.append((kind, flags, stream,
                           bytes(self._buffer[end:end + _FRAME_HEADER + length])))
            end += _FRAME_HEADER + length
        del self._buffer[:end]
        return frames


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
        #: Calls the client began (HTTP/2 HEADERS frames it sent), over all connections.
        self.calls_sent = 0
        self.port = 0

    def __enter__(self) -> TcpProxy:
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

    def _until_headers(self, frames: list[Frame]) -> tuple[bytes, bool]:
        """The bytes of ``frames`` to forward, and whether they end with the response
        HEADERS frame an armed ``"headers"`` proxy resets after."""
        out = bytearray()
        for kind, flags, stream, raw in frames:
            out += raw
            if (self._mode == "headers" and kind == _HEADERS and stream
                    and not flags & _END_STREAM):
                return bytes(out), True
        return bytes(out), False

    async def _serve(self, client_r: asyncio.StreamReader,
                     client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        server_r, server_w = await asyncio.open_connection(*self._upstream)
        self._writers |= {client_w, server_w}

        answers, calls = Frames(), Frames(preface=len(_PREFACE))

        async def upstream() -> None:
            while data := await client_r.read(65536):
                self.calls_sent += sum(1 for kind, flags, stream, _ in calls.feed(data)
                                       if kind == _HEADERS and stream)
                server_w.write(data)
                await server_w.drain()
            server_w.close()

        async def downstream() -> None:
            while data := await server_r.read(65536):
                data, reset = self._until_headers(answers.feed(data))
                if reset:
                    self._mode = None
                    client_w.write(data)
                    await client_w.drain()
                    client_w.transport.abort()
                    server_w.transport.abort()
                    self.fired.set()
                    return
                mode = self._mode if self._mode != "headers" else None
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
        except asyncio.CancelledError:
            pass  # the proxy is closing (asyncio would log a cancelled connection handler)
        finally:
            for pump in pumps:
                pump.cancel()
            for w in (client_w, server_w):
                w.transport.abort()
                self._writers.discard(w)
