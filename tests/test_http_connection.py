"""One connection of the proxy's HTTP server (``aglverl.proxy.http.connection``) under any sequence of requests,
cut anywhere: a property test against a model, over a real loopback socket.

The server serves a small echo service of this module (the proxy's own service is ``tests/test_http.py``'s):
it refuses ``/deny`` at the head (401), streams ``/stream`` in three chunks, and answers anything else with what
it read. Hypothesis draws a sequence of requests (kept, ``Connection: close``, ``HTTP/1.0``, chunked, refused at
the head, malformed) and the points the bytes are cut at; the whole sequence is written to one connection, piece
by piece. The model says what must come back: one answer per request, in order, up to the first that closes
the connection (a malformed head: 400; ``close``; HTTP/1.0), and then the close; after a last kept answer, the
close once the connection has been idle for its idle timeout (never a connection left open for good, never an
answer to what was not asked).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

import anyio
import orjson
from helpers.raw_http import split_answer
from hypothesis import given, settings
from hypothesis import strategies as st

from aglverl.proxy.http import Answer, Exchange, HttpError, HttpServer, Limits

#: Bound, in seconds, on one example's exchange (its answers and the idle close).
WAIT = 10.0
IDLE = 0.1


class Echo:
    """The service: ``/deny`` refused at its head, ``/stream`` streamed, anything else echoed."""

    def admit(self, exchange: Exchange) -> Answer | None:
        if exchange.path == "/deny":
            return Answer(401, b'{"denied": true}', {"Content-Type": "application/json"})
        return None

    async def respond(self, exchange: Exchange) -> None:
        body = await exchange.body()
        if exchange.path == "/stream":
            await exchange.start(200, {"Content-Type": "text/event-stream"})
            for i in range(3):
                await exchange.write(b"data: %d\n\n" % i)
            await exchange.end()
            return
        seen = {"method": exchange.method, "path": exchange.path, "body": body.decode("latin-1")}
        await exchange.send_whole(200, {"Content-Type": "application/json"}, orjson.dumps(seen))

    def refusal(self, error: HttpError, exchange: Exchange) -> Answer:
        return Answer(
            error.status, orjson.dumps({"error": error.message}), {"Content-Type": "application/json"}
        )


@dataclass(frozen=True)
class Req:
    """A request of the sequence, its bytes, and what it must get: ``(status, the echo's answer or None)`` and
    whether the connection closes after it."""

    data: bytes
    status: int
    seen: dict[str, str] | None
    closes: bool


@st.composite
def requests(draw: st.DrawFn) -> Req:
    kind = draw(st.sampled_from(["post", "get", "chunked", "stream", "deny", "close", "http10", "malformed"]))
    body = draw(st.binary(min_size=0, max_size=300).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")))
    text = body.decode("latin-1")
    if kind == "post":
        data = b"POST /p HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
        return Req(data, 200, {"method": "POST", "path": "/p", "body": text}, False)
    if kind == "get":
        return Req(
            b"GET /g?q=1#f HTTP/1.1\r\nHost: h\r\n\r\n",
            200,
            {"method": "GET", "path": "/g", "body": ""},
            False,
        )
    if kind == "chunked":
        size = draw(st.integers(1, 50))
        pieces = [body[i : i + size] for i in range(0, len(body), size)]
        framed = b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
        data = b"PUT /c HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n" + framed
        return Req(data, 200, {"method": "PUT", "path": "/c", "body": text}, False)
    if kind == "stream":
        return Req(b"GET /stream HTTP/1.1\r\nHost: h\r\n\r\n", 200, {"stream": "012"}, False)
    if kind == "deny":
        return Req(b"GET /deny HTTP/1.1\r\nHost: h\r\n\r\n", 401, None, False)
    if kind == "close":
        data = b"GET /x HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"
        return Req(data, 200, {"method": "GET", "path": "/x", "body": ""}, True)
    if kind == "http10":
        return Req(b"GET /o HTTP/1.0\r\n\r\n", 200, {"method": "GET", "path": "/o", "body": ""}, True)
    bad = draw(
        st.sampled_from(
            [
                b"GET / HTTP/1.1\nHost: h\n\n",
                b"GET / HTTP/1.1\r\nX: a\x01b\r\n\r\n",
                b"BREW / HTTP/1.1\r\n\r\n",
            ]
        )
    )
    return Req(bad, 400, None, True)


def parse(raw: bytes) -> list[tuple[int, object]]:
    """The answers in ``raw``: ``(status, body as JSON, or the stream's events joined)``."""
    out: list[tuple[int, object]] = []
    while raw:
        status, fields, body, raw = split_answer(raw)
        if fields.get("transfer-encoding") == "chunked":
            events = "".join(e.removeprefix(b"data: ").decode() for e in body.split(b"\n\n") if e)
            out.append((status, {"stream": events}))
        else:
            out.append((status, orjson.loads(body) if status == 200 else None))
    return out


def cut(data: bytes, points: list[int]) -> list[bytes]:
    edges = sorted({p % (len(data) + 1) for p in points} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(edges) if b > a]


async def run(sequence: list[Req], points: list[int]) -> list[tuple[int, object]]:
    """Write the sequence to one connection, piece by piece; the answers that came until the server closed it
    (within :data:`WAIT`: a connection left open fails the example)."""
    server = HttpServer(Echo(), "127.0.0.1", 0, Limits(idle_timeout=IDLE, head_timeout=WAIT))
    await server.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            with anyio.fail_after(WAIT):
                for piece in cut(b"".join(r.data for r in sequence), points):
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0)
                raw = await reader.read(-1)
        except ConnectionError:
            raw = b""
        finally:
            writer.close()
    finally:
        await server.stop()
    return parse(raw)


@settings(max_examples=60, deadline=None)
@given(
    sequence=st.lists(requests(), min_size=1, max_size=6),
    points=st.lists(st.integers(min_value=0, max_value=4000), max_size=12),
)
def test_any_sequence_of_requests_cut_anywhere_gets_its_answers_in_order_then_the_close(
    sequence: list[Req], points: list[int]
) -> None:
    expected: list[tuple[int, object]] = []
    for req in sequence:
        expected.append((req.status, req.seen))
        if req.closes:
            break
    assert anyio.run(run, sequence, points) == expected
