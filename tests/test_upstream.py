"""The proxy's HTTP/1.1 client (``aglverl.proxy.upstream``) against a raw loopback server that answers with
exactly the bytes each test gives it: framings, keep-alive, and every way a backend can answer wrongly."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import pytest

from aglverl.proxy.upstream import Upstream, UpstreamError

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


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

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
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

    @asynccontextmanager
    async def running(self) -> AsyncIterator[RawServer]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        try:
            yield self
        finally:
            server.close()


@asynccontextmanager
async def client(**kw: float) -> AsyncIterator[Upstream]:
    upstream = Upstream(
        keepalive=kw.get("keepalive", 10.0),
        connect_timeout=kw.get("connect_timeout", 2.0),
        request_timeout=kw.get("request_timeout", 5.0),
    )
    try:
        yield upstream
    finally:
        await upstream.close()


def whole(body: bytes, extra: bytes = b"") -> list[bytes | None]:
    return [
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + extra,
        b"Content-Length: %d\r\n\r\n" % len(body),
        body[:3],
        body[3:],
    ]


async def test_a_body_by_length_over_several_reads_and_the_connection_is_kept_for_the_next_request() -> None:
    async with RawServer(lambda _: whole(b'{"answer": 42}')).running() as server, client() as upstream:
        for _ in range(3):
            response = await upstream.request(
                "POST", server.url, "/v1/chat/completions?x=1", [("X-Agent", "a")], b"{}"
            )
            assert (response.status, response.reason) == (200, "OK")
            assert response.headers["content-type"] == "application/json" and response.content_length == 14
            assert await response.json() == {"answer": 42}
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nX-Agent: a\r\n" in first and b"\r\nContent-Length: 2\r\n\r\n{}" in first


async def test_a_chunked_body_cut_anywhere_is_put_back_together_extensions_and_trailers_skipped() -> None:
    wire = b"4;name=value\r\nWiki\r\n6\r\npedia \r\nE\r\nin \r\n\r\nchunks.\r\n0\r\nExpires: never\r\n\r\n"
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    pieces: list[bytes | None] = [head + wire[:1], *[wire[i : i + 1] for i in range(1, len(wire))]]
    async with RawServer(lambda _: pieces).running() as server, client() as upstream:
        response = await upstream.request("GET", server.url, "/stream")
        assert response.content_length is None
        assert await response.read() == b"Wikipedia in \r\n\r\nchunks."
        again = await upstream.request("GET", server.url, "/stream")  # the connection was clean for reuse
        assert await again.read() == b"Wikipedia in \r\n\r\nchunks."
    assert server.connections == 1


async def test_chunks_arrive_one_by_one_as_a_stream() -> None:
    events = [b"data: %d\n\n" % i for i in range(5)]
    answer: list[bytes | None] = [
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    ]
    answer += [b"%x\r\n%s\r\n" % (len(e), e) for e in events] + [b"0\r\n\r\n"]
    async with RawServer(lambda _: answer).running() as server, client() as upstream:
        response = await upstream.request("POST", server.url, "/v1/chat/completions", body=b"{}")
        got = b""
        while piece := await response.readany():
            got += piece
        assert got == b"".join(events)


async def test_informational_heads_are_skipped_and_bodiless_answers_end_at_their_head() -> None:
    def answer(request: bytes) -> list[bytes | None]:
        if request.startswith(b"HEAD"):
            return [b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n"]
        if b"/empty" in request:
            return [b"HTTP/1.1 204 No Content\r\n\r\n"]
        return [b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok"]

    async with RawServer(answer).running() as server, client() as upstream:
        created = await upstream.request("POST", server.url, "/", body=b"x")
        assert created.status == 201 and await created.read() == b"ok"
        head = await upstream.request("HEAD", server.url, "/")
        assert head.status == 200 and head.content_length == 99 and await head.read() == b""
        empty = await upstream.request("GET", server.url, "/empty")
        assert empty.status == 204 and await empty.read() == b""
    assert server.connections == 1


async def test_a_body_until_the_connection_closes_and_connection_close_are_not_reused() -> None:
    def answer(request: bytes) -> list[bytes | None]:
        if b"/close" in request:
            return [b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 3\r\n\r\nbye"]
        return [b"HTTP/1.1 200 OK\r\n\r\nall of ", b"it", None]

    async with RawServer(answer).running() as server, client() as upstream:
        assert await (await upstream.request("GET", server.url, "/eof")).read() == b"all of it"
        assert await (await upstream.request("GET", server.url, "/close")).read() == b"bye"
        assert await (await upstream.request("GET", server.url, "/close")).read() == b"bye"
    assert server.connections == 3


@pytest.mark.parametrize(
    ("answer", "kind", "words"),
    [
        ([b"SSH-2.0-OpenSSH_9.6\r\n\r\n"], "head", "not an HTTP/1.x status line"),
        ([b"HTTP/1.1 200 OK\r\n bad: fold\r\n\r\n"], "head", "malformed header line"),
        ([b"HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\n"], "head", "invalid Content-Length"),
        ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n"], "head", "other than chunked"),
        ([b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 20000], "head", "longer than"),
        ([None], "closed", "closed before a response came"),
        ([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", None], "body", "closed mid-body"),
        (
            [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n"],
            "body",
            "malformed chunk size",
        ),
        ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabcd"], "body", "not followed by CRLF"),
    ],
)
async def test_what_is_not_http_is_an_upstream_error_naming_what_was_wrong(
    answer: list[bytes | None], kind: str, words: str
) -> None:
    async with RawServer(lambda _: answer).running() as server, client() as upstream:
        with pytest.raises(UpstreamError) as caught:
            response = await upstream.request("GET", server.url, "/")
            await response.read()
        assert caught.value.kind == kind and words in str(caught.value)


async def test_a_refused_connection_is_a_connect_error_naming_the_backend() -> None:
    async with RawServer(lambda _: []).running() as server:
        url = server.url
    async with client() as upstream:
        with pytest.raises(UpstreamError) as caught:
            await upstream.request("GET", url, "/")
    assert caught.value.kind == "connect" and url in str(caught.value)


async def test_request_timeout_ends_a_request_mid_body_and_closes_its_connection() -> None:
    def answer(request: bytes) -> list[bytes | None]:
        return [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npart"] if b"/part" in request else []

    async with RawServer(answer).running() as server, client(request_timeout=0.3) as upstream:
        response = await upstream.request("GET", server.url, "/part")
        assert await response.readany() == b"part"
        with pytest.raises(TimeoutError), anyio.fail_after(5):
            await response.readany()
        with anyio.fail_after(5):
            await server.closed.wait()  # the backend sees the connection go
        with pytest.raises(TimeoutError), anyio.fail_after(5):  # and before the head
            await upstream.request("GET", server.url, "/none")


async def test_a_response_closed_before_its_end_closes_its_connection_and_the_next_request_gets_a_new_one() -> (
    None
):
    answer: list[bytes | None] = [b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n01234", b"56789"]
    async with RawServer(lambda _: answer).running() as server, client() as upstream:
        response = await upstream.request("GET", server.url, "/")
        assert await response.readany() == b"01234"
        response.close()
        with anyio.fail_after(5):
            await server.closed.wait()
        assert await (await upstream.request("GET", server.url, "/")).read() == b"0123456789"
    assert server.connections == 2


async def test_a_cancelled_request_closes_its_connection() -> None:
    async with RawServer(lambda _: []).running() as server, client() as upstream:
        with anyio.move_on_after(0.2):
            await upstream.request("GET", server.url, "/")
        with anyio.fail_after(5):
            await server.closed.wait()


async def test_an_idle_connection_past_keepalive_is_not_reused() -> None:
    async with RawServer(lambda _: whole(b"ok")).running() as server, client(keepalive=0.05) as upstream:
        assert await (await upstream.request("GET", server.url, "/")).read() == b"ok"
        await anyio.sleep(0.1)
        assert await (await upstream.request("GET", server.url, "/")).read() == b"ok"
    assert server.connections == 2


async def test_a_line_break_in_a_header_or_target_is_refused_before_anything_is_sent() -> None:
    async with RawServer(lambda _: whole(b"ok")).running() as server, client() as upstream:
        with pytest.raises(ValueError, match="line break"):
            await upstream.request("GET", server.url, "/", [("X-Evil", "a\r\nHost: other")])
        with pytest.raises(ValueError, match="space or line break"):
            await upstream.request("GET", server.url, "/ HTTP/1.1\r\nX: y")
    assert server.requests == []


async def test_a_large_body_read_slowly_arrives_whole() -> None:
    body = bytes(range(256)) * 4096  # 1 MiB: past the high-water mark, so reading pauses and resumes
    async with RawServer(lambda _: whole(body)).running() as server, client() as upstream:
        response = await upstream.request("GET", server.url, "/")
        got = bytearray()
        while piece := await response.readany():
            got += piece
            await anyio.sleep(0.001)
        assert bytes(got) == body


async def test_a_connection_whose_last_read_passed_the_high_water_mark_reads_again_for_the_next_request() -> (
    None
):
    from aglverl.proxy.upstream import HIGH_WATER

    body = b"x" * (HIGH_WATER + 1)  # left unread until it has all arrived
    async with RawServer(lambda _: whole(body)).running() as server, client() as upstream:
        response = await upstream.request("GET", server.url, "/")
        with anyio.fail_after(5):
            await server.answered.wait()
        assert await response.read() == body
        with anyio.fail_after(5):
            again = await upstream.request("GET", server.url, "/")
            assert await again.read() == body
    assert server.connections == 1
