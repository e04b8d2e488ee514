"""A raw loopback HTTP server for tests of what a client or the proxy makes of a backend's exact bytes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import aiohttp
import pytest


class RawServer:
    """A loopback server: each request it reads (head and ``Content-Length`` body) is answered by ``answer``,
    a list of byte pieces written one at a time (``None``: close the connection there); records the requests
    and counts the connections."""

    def __init__(self, answer: Callable[[bytes], list[bytes | None]]) -> None:
        self.answer = answer
        self.requests: list[bytes] = []
        self.connections = 0
        self.closed = asyncio.Event()
        self.answered = asyncio.Event()  # set once an answer was written whole
        self.url = ""
        self._writers: set[asyncio.StreamWriter] = set()
        self._ended = asyncio.Event()  # set whenever no connection is being served
        self._ended.set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        self._ended.clear()
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                for piece in self.answer(head + body):
                    if piece is None:
                        writer.close()
                        return
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.001)  # pieces arrive as separate reads
                self.answered.set()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed.set()
            writer.close()
            self._writers.discard(writer)
            if not self._writers:
                self._ended.set()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[RawServer]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        try:
            yield self
        finally:
            server.close()
            for writer in list(self._writers):  # each handler then ends as a closed connection does
                writer.close()
            await self._ended.wait()


def whole(body: bytes, extra: bytes = b"") -> list[bytes | None]:
    """A 200 JSON answer of ``body``, written in four pieces (its head cut in two, its body too)."""
    return [
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + extra,
        b"Content-Length: %d\r\n\r\n" % len(body),
        body[:3],
        body[3:],
    ]


async def read_cut_short(response: aiohttp.ClientResponse) -> bytes:
    """What came of an answer the proxy broke off after its head went out, asserting that it was cut short: the
    connection closed without the body's last chunk, which aiohttp's client reports (a payload error) once the
    bytes that came are read."""
    data = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async for piece in response.content.iter_any():
            data += piece
    return data
