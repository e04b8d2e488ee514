"""The proxy's HTTP/1.1 client (``aglverl.proxy.upstream``) against a raw loopback server that answers with
exactly the bytes each test gives it: framings, keep-alive, and every way a backend can answer wrongly."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
from helpers.raw_http import RawServer, whole

from aglverl.proxy.upstream import ConnectError, ReadError, RemoteProtocolError, Upstream, UpstreamError

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


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


@pytest.mark.parametrize(
    "trailers",
    [[b"X-Trailer: " + b"v" * 4096] * 40, [b"X-T: 1\r\n" * 512] * 40],
    ids=["one-long-value", "many-lines"],
)
async def test_trailers_past_the_head_limit_are_a_protocol_error_before_the_deadline(
    trailers: list[bytes],
) -> None:
    """llhttp holds a trailer's value until its line ends: without a bound a backend could grow the proxy by
    whatever it sends until the request's deadline."""
    from aglverl.proxy.upstream import MAX_HEAD

    answer: list[bytes | None] = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n"]
    answer += trailers
    assert sum(map(len, trailers)) > 2 * MAX_HEAD
    async with RawServer(lambda _: answer).running() as server, client(request_timeout=60) as upstream:
        response = await upstream.request("GET", server.url, "/")
        with pytest.raises(RemoteProtocolError, match="trailers longer than"), anyio.fail_after(5):
            await response.read()
        with anyio.fail_after(5):
            await server.closed.wait()


async def test_many_small_chunks_whose_framing_passes_the_head_limit_arrive_whole() -> None:
    body = bytes(range(256)) * 80  # 20,480 one-byte chunks: 120 KiB of framing in all
    wire = b"".join(b"1\r\n%s\r\n" % body[i : i + 1] for i in range(len(body))) + b"0\r\nX-End: 1\r\n\r\n"
    answer: list[bytes | None] = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"]
    answer += [wire[i : i + 8192] for i in range(0, len(wire), 8192)]
    async with RawServer(lambda _: answer).running() as server, client() as upstream:
        assert await (await upstream.request("GET", server.url, "/")).read() == body


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
    ("answer", "error", "words"),
    [
        ([b"SSH-2.0-OpenSSH_9.6\r\n\r\n"], RemoteProtocolError, "Expected HTTP/"),
        ([b"HTTP/2.0 200 OK\r\n\r\n"], RemoteProtocolError, "not HTTP/1.x"),
        ([b"HTTP/1.1 99 Low\r\n\r\n"], RemoteProtocolError, "Invalid status code"),
        ([b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok"], RemoteProtocolError, "CR after response line"),
        ([b"HTTP/1.1 200 OK\r\n bad: fold\r\n\r\n"], RemoteProtocolError, "malformed response head"),
        ([b"HTTP/1.1 200 OK\r\nX: a\x01b\r\nContent-Length: 0\r\n\r\n"], RemoteProtocolError, "header value"),
        ([b"HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\n"], RemoteProtocolError, "Content-Length"),
        ([b"HTTP/1.1 200 OK\r\nContent-Length: \xc2\xb2\r\n\r\nab"], RemoteProtocolError, "Content-Length"),
        ([b"HTTP/1.1 200 OK\r\nContent-Length: abc\r\n\r\n"], RemoteProtocolError, "Content-Length"),
        ([b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\n"], RemoteProtocolError, "Content-Length"),
        (
            [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nab"],
            RemoteProtocolError,
            "Duplicate Content-Length",
        ),
        (
            [
                b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n0\r\n\r\n"
            ],
            RemoteProtocolError,
            "Content-Length",
        ),
        ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n"], RemoteProtocolError, "other than chunked"),
        (
            [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n2\r\nab\r\n0\r\n\r\n"],
            RemoteProtocolError,
            "other than chunked",
        ),
        ([b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n"], RemoteProtocolError, "switched"),
        ([b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 20000], RemoteProtocolError, "longer than"),
        ([b"HTTP/1.1 200 OK\r\nX: ", b"y" * 70000], RemoteProtocolError, "longer than"),
        ([None], ReadError, "closed before a response came"),
        ([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", None], ReadError, "closed mid-body"),
        (
            [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", None],
            ReadError,
            "closed mid-body",
        ),
        (
            [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"zz\r\nab\r\n"],
            RemoteProtocolError,
            "chunk size",
        ),
        (
            [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"fffffffffffffffffff\r\nab"],
            RemoteProtocolError,
            "Chunk size overflow",
        ),
        (
            [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabcd"],
            RemoteProtocolError,
            "chunk data",
        ),
    ],
)
async def test_what_is_not_http_is_an_upstream_error_of_its_kind_naming_what_was_wrong(
    answer: list[bytes | None], error: type[UpstreamError], words: str
) -> None:
    async with RawServer(lambda _: answer).running() as server, client() as upstream:
        with pytest.raises(error) as caught, anyio.fail_after(5):
            response = await upstream.request("GET", server.url, "/")
            await response.read()
        assert words in str(caught.value)
        with anyio.fail_after(5):
            await server.closed.wait()  # never reused


async def test_a_body_that_breaks_in_the_read_that_brings_its_head_fails_the_request_itself() -> None:
    """Nothing of it can have reached an agent: the request raises, rather than hand out a 200 that then
    breaks (the proxy then answers 502, not a 200 with an empty body)."""
    answer: list[bytes | None] = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"]
    async with RawServer(lambda _: answer).running() as server, client() as upstream:
        with pytest.raises(RemoteProtocolError, match="chunk size"):
            await upstream.request("GET", server.url, "/")


async def test_bytes_after_a_whole_answer_or_before_a_request_are_not_taken_and_close_the_connection() -> (
    None
):
    def answer(request: bytes) -> list[bytes | None]:
        return [
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nspoof"
        ]

    async with RawServer(answer).running() as server, client() as upstream:
        for _ in range(2):
            assert await (await upstream.request("GET", server.url, "/")).read() == b"ok"
    assert server.connections == 2  # the connection that carried the extra answer was not reused


async def test_a_body_until_close_cut_by_a_reset_is_a_read_error_not_a_whole_body() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\npart")
        await writer.drain()
        await asyncio.sleep(0.05)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # RST, not FIN

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with client() as upstream:
            response = await upstream.request("GET", url, "/")
            with pytest.raises(ReadError, match="mid-body"), anyio.fail_after(5):
                await response.read()
    finally:
        server.close()


async def test_a_refused_connection_is_a_connect_error_naming_the_backend() -> None:
    async with RawServer(lambda _: []).running() as server:
        url = server.url
    async with client() as upstream:
        with pytest.raises(ConnectError) as caught:
            await upstream.request("GET", url, "/")
    assert url in str(caught.value)


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
