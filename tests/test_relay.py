"""What an agent gets through the whole proxy from a backend that breaks HTTP (a raw loopback server answering
exact bytes): a 502 naming what was wrong while nothing has reached the agent; once the answer's head went out,
an answer cut short that the agent's HTTP client sees as such, never a whole 200."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import anyio
import httptools
import orjson
import pytest
from helpers.raw_http import RawServer, whole
from test_translate import claim, finish, proxied
from yarl import URL

from aglverl.store import LLMCall

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


#: A chat completion as a backend answers it (no ids: the proxy records the call without them).
ANSWER = b'{"id":"c","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"yes"},"finish_reason":"stop"}]}'
JSON_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENT = (
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"y"}}]}\n\n'
)


def backend_answering(pieces: list[bytes | None]) -> Callable[[bytes], list[bytes | None]]:
    """A raw backend: a model listing and a health probe as vLLM answers them, ``pieces`` for every call."""

    def answer(request: bytes) -> list[bytes | None]:
        if request.startswith(b"GET"):
            return whole(b'{"object":"list","data":[{"id":"m","object":"model"}]}')
        return pieces

    return answer


class AgentGot:
    """What a raw agent got for one call: the status, the body, whether the answer was whole (its framing's
    end arrived) and whether the proxy closed the connection."""

    def __init__(self) -> None:
        self.status = 0
        self.body = b""
        self.whole = False
        self.closed = False

    def on_body(self, data: bytes) -> None:
        self.body += data

    def on_message_complete(self) -> None:
        self.whole = True


async def agent_call(base: str, body: bytes) -> AgentGot:
    """POST ``body`` to ``base``'s chat route on a raw socket and read the answer to its end (or the
    connection's)."""
    url = URL(base + "/chat/completions")
    reader, writer = await asyncio.open_connection(url.host, url.port)
    got = AgentGot()
    parser = httptools.HttpResponseParser(got)
    head = f"POST {url.raw_path} HTTP/1.1\r\nHost: {url.host}\r\nContent-Type: application/json\r\n"
    writer.write(head.encode() + b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
    try:
        with anyio.fail_after(10):
            while not got.whole:
                data = await reader.read(65536)
                if not data:
                    got.closed = True
                    break
                parser.feed_data(data)
                got.status = parser.get_status_code()
    finally:
        writer.close()
    return got


async def through_the_proxy(pieces: list[bytes | None], call: bytes) -> tuple[AgentGot, list[LLMCall], str]:
    """A raw agent's ``call`` through a proxy to a raw backend answering ``pieces``: what the agent got, the
    calls the store recorded, the backend's URL."""
    async with (
        RawServer(backend_answering(pieces)).running() as server,
        proxied(server.url) as (proxy, store),
    ):
        rollout_id, attempt_id, base = claim(proxy, store)
        got = await agent_call(base, call)
        return got, finish(store, rollout_id, attempt_id), server.url


CHAT_CALL = b'{"model":"m","messages":[{"role":"user","content":"Say yes."}],"max_tokens":4}'
STREAM_CALL = b'{"model":"m","messages":[{"role":"user","content":"Say yes."}],"max_tokens":4,"stream":true}'


#: Answers that are not well-formed HTTP: what follows a JSON answer's status line and type, and the words the
#: agent's 502 must hold.
BAD_AFTER_JSON_HEAD = {
    "non-ascii-length": (b"Content-Length: \xc2\xb2\r\n\r\n{}", "Content-Length"),
    "latin-1-digit-length": (b"Content-Length: \xb2\r\n\r\n{}", "Content-Length"),  # '²'.isdigit()
    "length-not-a-number": (b"Content-Length: abc\r\n\r\n{}", "Content-Length"),
    "two-lengths": (b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}", "Content-Length"),
    "gzip-coding": (b"Transfer-Encoding: gzip\r\n\r\n{}", "other than chunked"),
    "chunked-then-gzip": (
        b"Transfer-Encoding: chunked, gzip\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        "other than chunked",
    ),
    "length-and-chunked": (
        b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        "Content-Length",
    ),
    "bad-chunk-size": (b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n", "chunk size"),
    "control-byte": (b"X-Bad: a\x01b\r\nContent-Length: 2\r\n\r\n{}", "header value"),
}
#: Whole answers (``None``: the connection closed there) and the words of the agent's 502.
BAD_ANSWERS: dict[str, tuple[list[bytes | None], str]] = {
    "101": ([b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n"], "switched"),
    "bare-lf-head": ([b"HTTP/1.1 200 OK\nContent-Length: 2\n\n{}"], "CR"),
    "not-http": ([b"SSH-2.0-OpenSSH_9.6\r\n\r\n"], "Expected HTTP/"),
    "closed-before-head": ([None], "closed the connection without answering"),
    "length-cut-short": ([JSON_HEAD + b"Content-Length: 99\r\n\r\n{", None], "broke off"),
    **{name: ([JSON_HEAD + rest], words) for name, (rest, words) in BAD_AFTER_JSON_HEAD.items()},
}


@pytest.mark.parametrize(("pieces", "words"), list(BAD_ANSWERS.values()), ids=list(BAD_ANSWERS))
async def test_an_answer_that_is_not_well_formed_http_reaches_the_agent_as_a_502_naming_it(
    pieces: list[bytes | None], words: str
) -> None:
    got, calls, backend = await through_the_proxy(pieces, CHAT_CALL)
    assert (got.status, got.whole) == (502, True), got.body[:300]
    message = orjson.loads(got.body)["error"]["message"]
    assert backend in message and words in message
    assert [c.status for c in calls] == ["failed"]


@pytest.mark.parametrize(
    ("call", "pieces"),
    [
        pytest.param(
            CHAT_CALL,
            [JSON_HEAD + b"Transfer-Encoding: chunked\r\n\r\n", b'40\r\n{"id":', None],
            id="chunked-json-cut",
        ),
        pytest.param(
            CHAT_CALL,
            [JSON_HEAD + b"Transfer-Encoding: chunked\r\n\r\n", b"zz\r\n{}\r\n0\r\n\r\n"],
            id="chunked-json-bad-size",
        ),
        pytest.param(STREAM_CALL, [SSE_HEAD, b"%x\r\n%b\r\n" % (len(EVENT), EVENT), None], id="sse-cut"),
        pytest.param(
            STREAM_CALL, [SSE_HEAD, b"%x\r\n%b\r\n" % (len(EVENT), EVENT), b"-1\r\n"], id="sse-bad-size"
        ),
    ],
)
async def test_an_answer_broken_after_its_head_went_out_ends_without_its_last_chunk(
    call: bytes, pieces: list[bytes | None]
) -> None:
    """The agent's client sees the answer cut short (the connection closes without the terminating chunk),
    never a whole 200; a stream also gets an error event saying what broke."""
    got, calls, _ = await through_the_proxy(pieces, call)
    assert (got.status, got.whole, got.closed) == (200, False, True)
    if call is STREAM_CALL:
        assert got.body.startswith(EVENT) and b"broke off" in got.body
    assert [c.status for c in calls] == ["failed"]


async def test_an_informational_head_before_the_answer_is_skipped_through_the_proxy() -> None:
    pieces: list[bytes | None] = [
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n",
        JSON_HEAD + b"Content-Length: %d\r\n\r\n%b" % (len(ANSWER), ANSWER),
    ]
    got, calls, _ = await through_the_proxy(pieces, CHAT_CALL)
    assert (got.status, got.whole, orjson.loads(got.body)) == (200, True, orjson.loads(ANSWER))
    assert [c.status for c in calls] == ["ok"]
