"""The proxy's own HTTP/1.1 server for the agents' attributed calls (``aglverl.proxy.inbound`` and the connection
protocol ``aglverl.proxy.shed.Shedder``), over real loopback sockets: raw bytes written to the proxy, a real
:class:`~aglverl.testing.MockVLLM` behind it, the answers read back byte for byte.

Covered: a request cut anywhere (the head byte by byte, the body in pieces); keep-alive, requests sent one after
another and pipelined (in one write, and while another is being answered, a big one included); ``Connection:
close``; what goes to aiohttp's server instead and is still answered the same (``HTTP/1.0``, a chunked request
body, ``Expect: 100-continue``, percent-escapes in the path, a malformed header, a body over ``max_body_bytes``)
and the connection after it; the proxy's error answers; streamed answers (chunked framing, ``[DONE]``, the
terminator); an agent that leaves while its call is answered or while it sends its body; a large answer read
slowly; and the same requests through ``own_http_server=False`` (aiohttp's server for everything) giving the same
answers.

Which server wrote a whole answer the proxy relays shows in its head: ``InboundRequest.send_whole`` writes the
answer's headers, then ``Content-Length`` and its own ``Date``; aiohttp's response writes ``Content-Length`` last
(:attr:`Answer.by_aiohttp`). Once a request of a connection went to aiohttp, the connection is aiohttp's to its
end.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
import orjson
import pytest

import aglverl.proxy.app as proxy_app
from aglverl._net import HttpListener
from aglverl.metrics import Registry
from aglverl.models import Rollout
from aglverl.proxy import LLMProxy, RetryPolicy
from aglverl.store import LLMCall, TaskStore
from aglverl.testing import MockVLLM

pytestmark = pytest.mark.anyio

#: Fast retries so that nothing here waits on a backoff.
FAST_RETRY = RetryPolicy(attempts=3, total_timeout=5.0, backoff_initial=0.01, backoff_max=0.05)
#: Bound, in seconds, on every wait for the proxy (an answer, a close, a counter).
WAIT = 5.0


#: The two event loops the proxy runs on (the CLI's and shards' uvloop, an embedding application's asyncio).
LOOPS = pytest.mark.parametrize(
    "anyio_backend", [("asyncio", {}), ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"]
)


# ---------------------------------------------------------------------------------------------- helpers
@asynccontextmanager
async def proxied(mock: MockVLLM, **settings: Any) -> AsyncIterator[tuple[LLMProxy, TaskStore]]:
    """A proxy in front of ``mock``, served on 127.0.0.1 in a task group, and its store."""
    store = TaskStore()
    proxy = LLMProxy(store, backends=[mock.url], registry=Registry(), retry=FAST_RETRY, **settings)
    async with anyio.create_task_group() as tg:
        await tg.start(proxy.serve)
        yield proxy, store
        tg.cancel_scope.cancel()


def claim(store: TaskStore) -> tuple[str, str]:
    store.enqueue({"q": 1})
    task = store.try_claim()
    assert task is not None and task.attempt_id is not None
    return task.rollout_id, task.attempt_id


def finish(store: TaskStore, rollout_id: str, attempt_id: str) -> list[LLMCall]:
    """Complete the rollout; the calls the store kept for it."""
    store.submit_result(Rollout(rollout_id=rollout_id, attempt_id=attempt_id, final_reward=1.0))
    return store.record(rollout_id).calls


def route(rollout_id: str, attempt_id: str, tail: str = "chat/completions") -> str:
    return f"/rollout/{rollout_id}/attempt/{attempt_id}/v1/{tail}"


def chat(content: str = "Say yes.", **extra: Any) -> dict[str, Any]:
    return {"model": "mock", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


def request(
    path: str,
    body: bytes | dict[str, Any] | None = None,
    *,
    method: str = "POST",
    version: str = "HTTP/1.1",
    headers: Sequence[str] = (),
    length: bool = True,
) -> bytes:
    """A request as an agent writes it: request line, ``Host``, ``headers``, a JSON ``Content-Type`` and the
    ``Content-Length`` of ``body`` (``length=False``: none, the caller frames the body)."""
    data = orjson.dumps(body) if isinstance(body, dict) else (body or b"")
    lines = [f"{method} {path} {version}", "Host: 127.0.0.1", *headers]
    if body is not None:
        lines.append("Content-Type: application/json")
    if length and (body is not None or method == "POST"):
        lines.append(f"Content-Length: {len(data)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


@dataclass
class Answer:
    """One response as it came: status line, headers (names lowered, in order), the body (chunked framing taken
    off) and ``raw``, the bytes after the head as they were sent."""

    version: str
    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes
    raw: bytes

    def header(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k == name.lower()]
        assert len(values) <= 1, f"{name} sent {len(values)} times"
        return values[0] if values else None

    def json(self) -> Any:
        return orjson.loads(self.body)

    @property
    def by_aiohttp(self) -> bool:
        """Whether aiohttp's response machinery wrote this whole answer's head, not the inbound path's
        ``InboundRequest.send_whole``: that one writes the answer's headers, then ``Content-Length`` and its own
        ``Date`` (then ``Connection: close``); aiohttp's writes ``Content-Length`` last. (Both carry the
        backend's ``Server``, relayed.) Only for whole answers the proxy relays."""
        names = [name for name, _ in self.headers if name != "connection"]
        assert "content-length" in names and "date" in names, names
        return names[-2:] != ["content-length", "date"]

    def events(self) -> list[bytes]:
        """The SSE events' ``data:`` payloads."""
        return [e.removeprefix(b"data: ") for e in self.body.split(b"\n\n") if e.strip()]


class Agent:
    """An agent's raw connection to the proxy: writes bytes as given, reads answers ``piece`` bytes at a time
    (``pause`` seconds after each read: a slow reader)."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, piece: int, pause: float
    ) -> None:
        self.reader, self.writer = reader, writer
        self.piece, self.pause = piece, pause
        self._buf = bytearray()

    @classmethod
    @asynccontextmanager
    async def connect(
        cls, url: str, *, piece: int = 1 << 16, pause: float = 0.0, rcvbuf: int | None = None
    ) -> AsyncIterator[Agent]:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        assert host == "127.0.0.1"
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:  # a small window: the proxy's writes fill its socket while the agent dawdles
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        with anyio.fail_after(WAIT):
            await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
            reader, writer = await asyncio.open_connection(sock=sock, limit=max(piece, 1024))
        agent = cls(reader, writer, piece, pause)
        try:
            yield agent
        finally:
            agent.close()

    async def send(self, *pieces: bytes, pause: float = 0.0) -> None:
        """Write ``pieces`` one write each (with ``pause`` seconds after each but the last)."""
        for i, piece in enumerate(pieces):
            self.writer.write(piece)
            await self.writer.drain()
            if i < len(pieces) - 1:
                await asyncio.sleep(pause)

    def close(self) -> None:
        if not self.writer.is_closing():
            self.writer.close()

    async def _more(self) -> bool:
        data = await self.reader.read(self.piece)
        if self.pause:
            await asyncio.sleep(self.pause)
        self._buf += data
        return bool(data)

    async def _until(self, separator: bytes) -> bytes:
        while (at := self._buf.find(separator)) < 0:
            if not await self._more():
                raise AssertionError(f"the proxy closed before {separator!r}; got {bytes(self._buf)!r}")
        out = bytes(self._buf[: at + len(separator)])
        del self._buf[: at + len(separator)]
        return out

    async def _exactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            if not await self._more():
                raise AssertionError(
                    f"the proxy closed {n - len(self._buf)} bytes short: {bytes(self._buf)!r}"
                )
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    async def head(self, seconds: float = WAIT) -> bytes:
        """The next response head as sent (an interim ``1xx`` one included)."""
        with anyio.fail_after(seconds):
            return await self._until(b"\r\n\r\n")

    async def answer(self, seconds: float = WAIT, *, to_head: bool = False) -> Answer:
        """The next whole response (``to_head``: the answer to a ``HEAD``, which has no body)."""
        with anyio.fail_after(seconds):
            head = await self._until(b"\r\n\r\n")
            line, *fields = head[:-4].decode("latin-1").split("\r\n")
            version, status, reason = [*line.split(" ", 2), ""][:3]
            headers = [(k.strip().lower(), v.strip()) for k, _, v in (f.partition(":") for f in fields)]
            answer = Answer(version, int(status), reason, headers, b"", b"")
            if to_head:
                pass
            elif answer.header("transfer-encoding") == "chunked":
                raw, body = bytearray(), bytearray()
                while True:
                    size_line = await self._until(b"\r\n")
                    size = int(size_line.split(b";")[0], 16)
                    chunk = await self._exactly(size + 2)
                    raw += size_line + chunk
                    assert chunk.endswith(b"\r\n"), f"a chunk not ended by CRLF: {chunk[-8:]!r}"
                    body += chunk[:-2]
                    if size == 0:
                        break
                answer.raw, answer.body = bytes(raw), bytes(body)
            elif (length := answer.header("content-length")) is not None:
                answer.body = answer.raw = await self._exactly(int(length))
            elif not (answer.status < 200 or answer.status in (204, 304)):
                answer.body = answer.raw = await self.rest(seconds)
            return answer

    async def answer_after(self, data: bytes) -> Answer | None:
        """Send ``data`` (a request) and read its answer; ``None`` if the proxy had closed the connection."""
        try:
            await self.send(data)
            with anyio.fail_after(WAIT):
                while not self._buf:
                    if not await self._more():
                        return None
        except ConnectionError:
            return None
        return await self.answer()

    async def rest(self, seconds: float = WAIT) -> bytes:
        """Whatever comes until the proxy closes the connection (it must close it within ``seconds``)."""
        with anyio.fail_after(seconds):
            while await self._more():
                pass
        out = bytes(self._buf)
        self._buf.clear()
        return out

    async def first_event(self) -> bytes:
        """A streamed answer's head and its first SSE event (as sent, framing included)."""
        with anyio.fail_after(WAIT):
            head = await self._until(b"\r\n\r\n")
            return head + await self._until(b"\n\n")


async def until(predicate: Callable[[], bool]) -> None:
    """Return once ``predicate()`` holds (checked every few milliseconds, for at most :data:`WAIT` seconds): for
    the proxy's counters, which signal nothing when they change."""
    with anyio.fail_after(WAIT):
        while not predicate():  # noqa: ASYNC110  # nothing to wait on: the counters signal nothing
            await anyio.sleep(0.005)


def assert_openai_error(payload: Any, status: int, *words: str) -> None:
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    for word in words:
        assert word in error["message"], (word, error["message"])


def assert_answered_by_aiohttp(answers: list[Answer], mock: MockVLLM, body: dict[str, Any]) -> None:
    """Each of ``answers`` is the mock's whole answer to ``body``, written by aiohttp's server."""
    for answer in answers:
        assert_answered(answer, mock, body)
        assert answer.by_aiohttp


def assert_answered(answer: Answer, mock: MockVLLM, body: dict[str, Any]) -> None:
    """``answer`` is the mock's whole chat answer to ``body``: a 200, JSON, its ``Content-Length`` its size."""
    assert answer.status == 200, answer
    assert answer.header("content-type") == "application/json"
    assert answer.header("content-length") == str(len(answer.body))
    payload = answer.json()
    [(prompt, response)] = mock.expected(body)
    assert payload["object"] == "chat.completion" and payload["prompt_token_ids"] == prompt
    assert payload["choices"][0]["token_ids"] == response


def shape(value: Any) -> Any:
    """A JSON value's structure: keys and list lengths kept, scalars as their type's name."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [shape(v) for v in value]
    return type(value).__name__


# ---------------------------------------------------------------------------------------------- 1. cut requests
@LOOPS
async def test_a_request_cut_byte_by_byte_and_in_pieces_is_read_whole_answered_and_recorded() -> None:
    body = chat()
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        data = request(route(rid, aid), body)
        end = data.index(b"\r\n\r\n") + 4
        head, payload = data[:end], data[end:]
        third = len(payload) // 3
        async with Agent.connect(proxy.url) as agent:
            await agent.send(*(head[i : i + 1] for i in range(len(head))), pause=0)
            await agent.send(payload[:third], payload[third : 2 * third], payload[2 * third :], pause=0.002)
            answer = await agent.answer()
        calls = finish(store, rid, aid)
    assert_answered(answer, mock, body)
    assert not answer.by_aiohttp  # read and answered by the inbound path
    [(prompt, response)] = mock.expected(body)
    [call] = calls
    assert (call.status, call.prompt_token_ids, call.response_token_ids) == ("ok", prompt, response)
    assert call.path == "/v1/chat/completions" and call.finish_reason == "length"
    [seen] = mock.generation_requests()
    assert orjson.loads(seen.body)["messages"] == body["messages"]


# ---------------------------------------------------------------------------------------------- 2. keep-alive
@LOOPS
async def test_keep_alive_answers_requests_one_after_another_then_two_pipelined_in_one_write_in_order() -> (
    None
):
    bodies = [chat(f"turn {i}") for i in range(5)]
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        answers = []
        async with Agent.connect(proxy.url) as agent:
            for body in bodies[:3]:
                await agent.send(request(route(rid, aid), body))
                answers.append(await agent.answer())
            await agent.send(request(route(rid, aid), bodies[3]) + request(route(rid, aid), bodies[4]))
            answers += [await agent.answer(), await agent.answer()]
            # the connection is still open and serving after all that
            await agent.send(request(route(rid, aid), bodies[0]))
            answers.append(await agent.answer())
        calls = finish(store, rid, aid)
    for answer, body in zip(answers, [*bodies, bodies[0]], strict=True):
        assert_answered(answer, mock, body)  # each answer is its own request's: the order kept
        assert answer.header("connection") is None and not answer.by_aiohttp
    assert [c.status for c in calls] == ["ok"] * 6


@LOOPS
async def test_requests_sent_while_another_is_answered_wait_their_turn_a_big_one_included() -> None:
    """A request that arrives while the connection's call is in the backend is held, its answer sent after the
    first one's; a pipelined body well over the 64 KiB the connection buffers (reading pauses, then resumes)."""
    first, small, big = chat("first"), chat("second"), chat("x" * (300 << 10))
    async with MockVLLM(latency=0.3) as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        async with Agent.connect(proxy.url) as agent:
            await agent.send(request(route(rid, aid), first))
            with anyio.fail_after(WAIT):
                await mock.wait_until(lambda m: m.active == 1)  # the first call is in the backend
            await agent.send(request(route(rid, aid), small) + request(route(rid, aid), big))
            answers = [await agent.answer() for _ in range(3)]
        calls = finish(store, rid, aid)
    for answer, body in zip(answers, [first, small, big], strict=True):
        assert_answered(answer, mock, body)
    assert [len(orjson.loads(r.body)["messages"][0]["content"]) for r in mock.generation_requests()] == [
        5,
        6,
        300 << 10,
    ]
    assert [c.status for c in calls] == ["ok"] * 3


# ---------------------------------------------------------------------------------------------- 3. Connection: close
@LOOPS
@pytest.mark.parametrize("kind", ["whole", "stream", "error"])
async def test_connection_close_is_answered_with_connection_close_and_the_connection_is_closed(
    kind: str,
) -> None:
    body = chat(stream=kind == "stream")
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        path = route("rollout-nope" if kind == "error" else rid, aid)
        async with Agent.connect(proxy.url) as agent:
            await agent.send(request(path, body, headers=["Connection: close"]))
            answer = await agent.answer()
            after = await agent.rest()  # the proxy closes: EOF, nothing after the answer
    assert answer.header("connection") == "close" and after == b""
    if kind == "whole":
        assert_answered(answer, mock, body)
    elif kind == "stream":
        assert answer.status == 200 and answer.events()[-1] == b"[DONE]"
    else:
        assert answer.status == 404
        assert_openai_error(answer.json(), 404, "rollout-nope")


# ---------------------------------------------------------------------------------------------- 4. aiohttp's requests
def chunked(data: bytes, size: int = 20) -> bytes:
    pieces = [data[i : i + size] for i in range(0, len(data), size)]
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


async def test_http_1_0_goes_to_aiohttp_and_is_answered_then_closed_or_kept_alive_as_asked() -> None:
    body = chat()
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        async with Agent.connect(proxy.url) as agent:
            await agent.send(request(route(rid, aid), body, version="HTTP/1.0"))
            closing = await agent.answer()
            after = await agent.rest()
        async with Agent.connect(proxy.url) as agent:
            await agent.send(
                request(route(rid, aid), body, version="HTTP/1.0", headers=["Connection: keep-alive"])
            )
            kept = await agent.answer()
            await agent.send(request(route(rid, aid), body))
            following = await agent.answer()
        calls = finish(store, rid, aid)
    assert_answered_by_aiohttp([closing, kept, following], mock, body)
    assert closing.version == "HTTP/1.0" and after == b""
    assert [c.status for c in calls] == ["ok"] * 3


async def test_a_chunked_request_body_goes_to_aiohttp_and_the_connection_goes_on() -> None:
    body = chat()
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        async with Agent.connect(proxy.url) as agent:
            head = request(route(rid, aid), b"", headers=["Transfer-Encoding: chunked"], length=False)
            framed = chunked(orjson.dumps(body))
            await agent.send(head, framed[:33], framed[33:], pause=0.002)
            first = await agent.answer()
            await agent.send(request(route(rid, aid), body))
            following = await agent.answer()
        calls = finish(store, rid, aid)
    assert_answered_by_aiohttp(
        [first, following], mock, body
    )  # the connection is aiohttp's from the chunked request on
    assert [c.status for c in calls] == ["ok"] * 2


async def test_expect_100_continue_goes_to_aiohttp_which_sends_the_interim_then_the_answer() -> None:
    body = chat()
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        data = request(route(rid, aid), body, headers=["Expect: 100-continue"])
        end = data.index(b"\r\n\r\n") + 4
        async with Agent.connect(proxy.url) as agent:
            await agent.send(data[:end])  # the head alone: the body only once the proxy says continue
            interim = await agent.head()
            await agent.send(data[end:])
            first = await agent.answer()
            await agent.send(request(route(rid, aid), body))
            following = await agent.answer()
        calls = finish(store, rid, aid)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert_answered_by_aiohttp([first, following], mock, body)
    assert [c.status for c in calls] == ["ok"] * 2


async def test_a_percent_escaped_rollout_id_goes_to_aiohttp_and_reaches_its_rollout() -> None:
    body = chat()
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        # rollout-... as %72o%6C%6Cout%2D...: the same id, percent-escaped
        escaped = "".join(f"%{ord(c):02X}" if c in "rl-" else c for c in rid)
        assert escaped != rid
        async with Agent.connect(proxy.url) as agent:
            await agent.send(request(route(escaped, aid), body))
            first = await agent.answer()
            await agent.send(request(route(rid, aid), body))
            following = await agent.answer()
        calls = finish(store, rid, aid)
    assert_answered_by_aiohttp([first, following], mock, body)
    assert [(c.rollout_id, c.status) for c in calls] == [(rid, "ok")] * 2


async def test_a_malformed_header_line_gets_aiohttps_400() -> None:
    body = orjson.dumps(chat())
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        async with Agent.connect(proxy.url) as agent:
            data = request(route(rid, aid), body, headers=["X-Broken header without a colon"])
            await agent.send(data)
            answer = await agent.answer()
            await agent.rest()  # aiohttp closes a connection whose request it cannot parse
        async with Agent.connect(proxy.url) as agent:  # and the proxy serves on
            await agent.send(request(route(rid, aid), chat()))
            following = await agent.answer()
    assert answer.status == 400 and answer.header("content-type") == "text/plain; charset=utf-8"
    assert b"X-Broken header without a colon" in answer.body  # aiohttp's parser names the line
    assert_answered(following, mock, chat())
    assert len(mock.generation_requests()) == 1


async def test_a_body_over_max_body_bytes_goes_to_aiohttp_and_gets_413_naming_the_limit() -> None:
    big, body = chat("x" * 2000), chat()
    async with MockVLLM() as mock, proxied(mock, max_body_bytes=1000) as (proxy, store):
        rid, aid = claim(store)
        async with Agent.connect(proxy.url) as agent:
            await agent.send(request(route(rid, aid), big))
            refused = await agent.answer()
            await agent.send(request(route(rid, aid), body))
            following = await agent.answer()
        async with Agent.connect(proxy.url) as agent:  # a body within the limit is read here
            await agent.send(request(route(rid, aid), body))
            answered = await agent.answer()
        calls = finish(store, rid, aid)
    assert refused.status == 413
    assert_openai_error(refused.json(), 413, "1000 bytes")
    assert_answered(following, mock, body)
    assert following.by_aiohttp  # the connection went to aiohttp with the request over the limit
    assert_answered(answered, mock, body)
    assert not answered.by_aiohttp
    assert len(mock.generation_requests()) == 2 and [c.status for c in calls] == ["ok"] * 2


async def test_a_request_for_aiohttp_pipelined_after_one_read_here_is_answered_in_order() -> None:
    """The first request is read here, the second (chunked) pipelined behind it in one write goes to aiohttp once
    the first is answered, and the third after it too."""
    bodies = [chat(f"turn {i}") for i in range(3)]
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        second = request(route(rid, aid), b"", headers=["Transfer-Encoding: chunked"], length=False)
        second += chunked(orjson.dumps(bodies[1]))
        async with Agent.connect(proxy.url) as agent:
            await agent.send(
                request(route(rid, aid), bodies[0]) + second + request(route(rid, aid), bodies[2])
            )
            answers = [await agent.answer() for _ in range(3)]
        calls = finish(store, rid, aid)
    for answer, body in zip(answers, bodies, strict=True):
        assert_answered(answer, mock, body)
    assert [a.by_aiohttp for a in answers] == [False, True, True]
    assert [c.status for c in calls] == ["ok"] * 3


# ---------------------------------------------------------------------------------------------- 5. errors
@pytest.mark.parametrize("own", [True, False], ids=["own", "aiohttp"])
async def test_an_unknown_rollout_or_attempt_is_404_and_a_finished_rollout_409_naming_the_id(
    own: bool,
) -> None:
    async with MockVLLM() as mock, proxied(mock, own_http_server=own) as (proxy, store):
        rid, aid = claim(store)
        answers = []
        async with Agent.connect(proxy.url) as agent:
            for path in (route("rollout-nope", aid), route(rid, "attempt-nope")):
                await agent.send(request(path, chat()))
                answers.append(await agent.answer())
            finish(store, rid, aid)
            await agent.send(request(route(rid, aid), chat()))
            answers.append(await agent.answer())
            await agent.send(request(route(rid, aid), chat()))  # the connection still serves after errors
            answers.append(await agent.answer())
    for answer, (status, word) in zip(
        answers, [(404, "rollout-nope"), (404, "attempt-nope"), (409, rid), (409, rid)], strict=True
    ):
        assert answer.status == status and answer.header("content-type") == "application/json"
        assert answer.header("content-length") == str(len(answer.body))
        assert_openai_error(answer.json(), status, word)
    assert mock.generation_requests() == [] and proxy.m_calls.value("rejected") == 4


# ---------------------------------------------------------------------------------------------- 6. streams
@LOOPS
async def test_a_streamed_answer_is_chunked_ends_with_done_and_the_terminator_and_is_recorded() -> None:
    body = chat(max_tokens=6, stream=True, stream_options={"include_usage": True})
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        async with Agent.connect(proxy.url) as agent:
            await agent.send(request(route(rid, aid), body))
            answer = await agent.answer()
            await agent.send(request(route(rid, aid), chat()))  # the connection goes on after a stream
            following = await agent.answer()
        calls = finish(store, rid, aid)
    assert answer.status == 200 and (answer.header("content-type") or "").startswith("text/event-stream")
    assert answer.header("transfer-encoding") == "chunked" and answer.header("content-length") is None
    assert answer.raw.endswith(b"0\r\n\r\n") and answer.body.endswith(b"data: [DONE]\n\n")
    events = answer.events()
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    [(prompt, response)] = mock.expected(body)
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []] == response
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    assert_answered(following, mock, chat())
    first, second = calls
    assert (first.status, first.prompt_token_ids, first.response_token_ids) == ("ok", prompt, response)
    assert second.status == "ok"


# ---------------------------------------------------------------------------------------------- 7-8. agents leaving
@LOOPS
@pytest.mark.parametrize("stream", [True, False], ids=["mid-stream", "before-the-answer"])
async def test_an_agent_leaving_while_its_call_is_answered_cancels_it_and_the_proxy_serves_on(
    stream: bool,
) -> None:
    async with MockVLLM(completion_tokens=200, chunk_latency=0.02) as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        if not stream:
            mock.stall_next()  # an answer that never comes
        async with Agent.connect(proxy.url) as agent:
            await agent.send(request(route(rid, aid), chat(max_tokens=200, stream=stream)))
            if stream:
                first = await agent.first_event()
                assert first.startswith(b"HTTP/1.1 200 ") and b"data: " in first
            else:
                with anyio.fail_after(WAIT):
                    await mock.wait_until(lambda m: m.active == 1)
        # the agent closed its socket
        with anyio.fail_after(WAIT):
            await mock.wait_until(lambda m: m.cancelled == 1)  # the upstream request was cancelled
        await until(lambda: proxy.m_calls.value("cancelled") == 1 and proxy.in_flight == 0)
        async with Agent.connect(proxy.url) as agent:
            await agent.send(request(route(rid, aid), chat()))
            following = await agent.answer()
        calls = finish(store, rid, aid)
    assert_answered(following, mock, chat())
    assert [(c.status, c.error) for c in calls] == [("failed", "agent disconnected"), ("ok", None)]
    assert calls[0].response_token_ids is None


@LOOPS
@pytest.mark.parametrize("where", ["head", "body"])
async def test_an_agent_leaving_while_it_sends_its_request_leaves_nothing_recorded(where: str) -> None:
    body = chat()
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        data = request(route(rid, aid), body)
        end = data.index(b"\r\n\r\n")
        cut = end - 10 if where == "head" else end + 4 + len(orjson.dumps(body)) // 2
        async with Agent.connect(proxy.url) as agent:
            await agent.send(data[:cut])
            agent.writer.write_eof()  # the agent is done sending: the proxy, on its end, closes
            assert await agent.rest() == b""  # no answer to half a request, and the proxy saw the end
        async with Agent.connect(proxy.url) as agent:
            await agent.send(data)
            following = await agent.answer()
        counters = proxy.counters()
        calls = finish(store, rid, aid)
    assert_answered(following, mock, body)
    assert len(mock.generation_requests()) == 1 and len(calls) == 1 and calls[0].status == "ok"
    assert counters["proxy/calls_ok"] == 1
    assert counters["proxy/calls_cancelled"] == counters["proxy/calls_rejected"] == 0


# ---------------------------------------------------------------------------------------------- 9. both servers alike
AUTH = "Authorization: Bearer s3cret"
Ids = dict[str, str]


def call_to(tail: str, body: Any = None, *, method: str = "POST", headers: Sequence[str] = (AUTH,)) -> Any:
    """A case: the request to ``tail`` after the claimed attempt's ``/v1/`` (``{name}`` in a ``tail`` that starts
    with ``/``: a whole path with the ids below)."""

    def make(ids: Ids) -> bytes:
        path = tail.format(**ids) if tail.startswith("/") else route(ids["rid"], ids["aid"], tail)
        return request(path, body, method=method, headers=headers)

    return make


def raw_head(target: str, *lines: str) -> Any:
    """A case: a ``POST`` to ``target`` (after the claimed attempt's ``/v1/``, sent as written, latin-1) with
    exactly these header ``lines`` and a ``{}`` body."""

    def make(ids: Ids) -> bytes:
        head = [f"POST {route(ids['rid'], ids['aid'], target)} HTTP/1.1", *lines, "Content-Length: 2"]
        return ("\r\n".join(head) + "\r\n\r\n{}").encode("latin-1")

    return make


STREAM = {"stream": True, "stream_options": {"include_usage": True}}
#: Requests sent to a proxy with its own HTTP server and to one without (``{rid}``/``{aid}``: the claimed
#: attempt's ids, ``{done}``/``{done_aid}``: a finished rollout's).
CASES: dict[str, Any] = {
    "chat": call_to("chat/completions", chat(logprobs=True, n=2)),
    "chat-stream": call_to("chat/completions", chat(logprobs=True, **STREAM)),
    "completions": call_to("completions", {"model": "mock", "prompt": ["ab", "cd"], "max_tokens": 3}),
    "responses": call_to("responses", {"model": "mock", "input": "hi", "max_output_tokens": 4}),
    "responses-stream": call_to(
        "responses", {"model": "mock", "input": "hi", "max_output_tokens": 4, "stream": True}
    ),
    "messages": call_to(
        "messages", {"model": "mock", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    ),
    "messages-stream": call_to(
        "messages",
        {"model": "mock", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "stream": True},
    ),
    "models": call_to("models", method="GET"),
    "v1-root": call_to("", method="GET"),
    "query": call_to("chat/completions?x=1", chat()),
    "double-slash": call_to("/chat/completions", chat()),
    "empty-body": call_to("chat/completions", b""),
    "no-token": call_to("chat/completions", chat(), headers=()),
    "not-json": call_to("chat/completions", b'{"model": "mock",'),
    "not-object": call_to("completions", b"[1, 2]"),
    "unknown-rollout": call_to("/rollout/rollout-nope/attempt/{aid}/v1/chat/completions", chat()),
    "finished-rollout": call_to("/rollout/{done}/attempt/{done_aid}/v1/chat/completions", chat()),
    "dot-segment": call_to("/rollout/{rid}/attempt/{aid}/v1/../health", method="GET"),
    "no-route": call_to("/rollout/{rid}/attempt/{aid}/v2/chat/completions", chat()),
    "head": call_to("models", method="HEAD"),
    # heads HTTP/1.1 refuses (RFC 9112, 3.2: no Host, or two) and a duplicated single-valued header
    "no-host": raw_head("chat/completions", AUTH, "Content-Type: application/json"),
    "two-hosts": raw_head("chat/completions", "Host: a", "Host: b", AUTH, "Content-Type: application/json"),
    "two-content-types": raw_head(
        "chat/completions", "Host: a", AUTH, "Content-Type: application/json", "Content-Type: text/plain"
    ),
    # request targets with bytes a request-target cannot hold (RFC 9112, 3.2; RFC 3986)
    "lf-in-target": raw_head("chat/completions\nX-Injected:1", "Host: a", AUTH),
    "ctl-in-target": raw_head("chat/completions\x01", "Host: a", AUTH),
    "tab-in-target": raw_head("chat/\tcompletions", "Host: a", AUTH),
    "utf8-in-target": raw_head("chat/completions\xc3\xa9", "Host: a", AUTH),
}


def sse_shape(body: bytes) -> list[Any]:
    """An SSE body's structure: each event's lines, a ``data:`` line's JSON as its :func:`shape`."""
    events = []
    for event in body.split(b"\n\n"):
        if not event.strip():
            continue
        lines: list[Any] = []
        for line in event.split(b"\n"):
            name, _, value = line.partition(b": ")
            lines.append(shape(orjson.loads(value)) if name == b"data" and value != b"[DONE]" else line)
        events.append(lines)
    return events


@pytest.mark.parametrize("case", sorted(CASES))
async def test_the_same_request_gets_the_same_answer_with_and_without_the_own_http_server(case: str) -> None:
    """Status, headers that matter, the body's structure (a proxy's error: the very same body), what the proxy
    counted and recorded, and whether the connection serves on: the same whichever server read the request."""
    seen = []
    async with MockVLLM() as mock:
        for own in (True, False):
            async with proxied(mock, own_http_server=own, token="s3cret") as (proxy, store):
                rid, aid = claim(store)
                done, done_aid = claim(store)
                finish(store, done, done_aid)
                ids = {"rid": rid, "aid": aid, "done": done, "done_aid": done_aid}
                async with Agent.connect(proxy.url) as agent:
                    await agent.send(CASES[case](ids))
                    answer = await agent.answer(to_head=case == "head")
                    counted = {
                        k: v for k, v in proxy.counters().items() if k.startswith("proxy/calls_") and v
                    }
                    following = await agent.answer_after(request(route(rid, aid), chat(), headers=[AUTH]))
                calls = finish(store, rid, aid)
            for name, value in ids.items():  # each run's own ids out of what is compared
                answer.body = answer.body.replace(value.encode(), b"{%s}" % name.encode())
            recorded = [
                (c.status, c.path, c.prompt_token_ids, c.response_token_ids, c.logprobs) for c in calls
            ]
            serves_on = None if following is None else following.status
            seen.append((answer, counted, serves_on, recorded))
    (mine, mine_counted, mine_on, mine_calls), (theirs, theirs_counted, theirs_on, theirs_calls) = seen
    assert mine.status == theirs.status, (mine, theirs)
    assert mine_counted == theirs_counted  # each call counted the same (a request refused before: none)
    assert mine_on == theirs_on  # the connection answers a next request (its status), or it was closed (None)
    kind = mine.header("content-type") or ""
    assert kind == (theirs.header("content-type") or "")
    assert mine.header("connection") == theirs.header("connection")
    if not mine.body and not theirs.body:
        pass  # the answer to a HEAD
    elif kind.startswith("application/json"):
        assert shape(mine.json()) == shape(theirs.json())
        if mine.status >= 400:
            assert mine.json() == theirs.json()
    elif kind.startswith("text/event-stream"):
        assert mine.header("transfer-encoding") == theirs.header("transfer-encoding") == "chunked"
        assert sse_shape(mine.body) == sse_shape(theirs.body)
    else:
        assert mine.body == theirs.body
    assert mine_calls == theirs_calls


# ---------------------------------------------------------------------------------------------- 10. slow readers
@LOOPS
@pytest.mark.parametrize(("stream", "tokens"), [(False, 50_000), (True, 20_000)], ids=["whole", "stream"])
async def test_a_large_answer_read_slowly_arrives_whole_and_correct(stream: bool, tokens: int) -> None:
    """A few MB of answer (tokens with their logprobs), read by an agent with a small receive window a piece at a
    time with a pause after each: more than the loopback socket's buffers hold (Linux's send buffer grows to 4 MiB
    at most), so the proxy's writes wait on the agent's reading; it all arrives, as the backend sent it."""
    body = chat(max_tokens=tokens, logprobs=True, stream=stream)
    async with MockVLLM(completion_tokens=tokens) as mock, proxied(mock) as (proxy, store):
        async with aiohttp.ClientSession() as http:  # the same call straight to the backend, for reference
            async with http.post(
                f"{mock.url}/v1/chat/completions", json={**body, "return_token_ids": True}
            ) as r:
                direct = await r.read()
        rid, aid = claim(store)
        async with Agent.connect(proxy.url, piece=16 << 10, pause=0.001, rcvbuf=4096) as agent:
            await agent.send(request(route(rid, aid), body))
            answer = await agent.answer(seconds=30)
            await agent.send(request(route(rid, aid), chat()))
            following = await agent.answer()
        calls = finish(store, rid, aid)
    assert answer.status == 200 and len(answer.body) > 4 << 20

    def volatile_free(payload: bytes) -> Any:
        value = orjson.loads(payload)
        value.pop("id", None)
        value.pop("created", None)
        return value

    if stream:
        direct_events = [e.removeprefix(b"data: ") for e in direct.split(b"\n\n") if e.strip()]
        assert answer.events()[-1] == direct_events[-1] == b"[DONE]"
        assert [volatile_free(e) for e in answer.events()[:-1]] == [
            volatile_free(e) for e in direct_events[:-1]
        ]
    else:
        assert answer.header("content-length") == str(len(answer.body))
        assert volatile_free(answer.body) == volatile_free(direct)
    assert_answered(following, mock, chat())
    [(prompt, response)] = mock.expected(body)
    first = calls[0]
    assert (first.status, first.prompt_token_ids, first.response_token_ids) == ("ok", prompt, response)
    assert first.logprobs is not None and len(first.logprobs) == tokens


# ---------------------------------------------------------------------------------------------- shutdown
async def test_shutdown_cancels_a_call_read_here_after_its_grace_and_closes_every_connection() -> None:
    async with MockVLLM() as mock:
        store = TaskStore()
        proxy = LLMProxy(
            store, backends=[mock.url], registry=Registry(), retry=FAST_RETRY, shutdown_grace=0.2
        )
        rid, aid = claim(store)
        async with anyio.create_task_group() as tg:
            await tg.start(proxy.serve)
            async with Agent.connect(proxy.url) as idle, Agent.connect(proxy.url) as waiting:
                await idle.send(request(route(rid, aid), chat()))
                answered = await idle.answer()  # then idle, kept alive
                mock.stall_next()
                await waiting.send(request(route(rid, aid), chat()))
                with anyio.fail_after(WAIT):
                    await mock.wait_until(lambda m: m.active == 1)
                tg.cancel_scope.cancel()  # the proxy shuts down
                with anyio.CancelScope(shield=True):
                    left = (await idle.rest(), await waiting.rest())
        with anyio.fail_after(WAIT):
            await mock.wait_until(lambda m: m.cancelled == 1)
        calls = finish(store, rid, aid)
    assert_answered(answered, mock, chat())
    assert left == (b"", b"")  # both closed; the waiting one got no answer
    assert [(c.status, c.error) for c in calls] == [("ok", None), ("failed", "proxy shutting down")]


async def test_a_connection_read_here_stays_open_in_use_past_the_keepalive_and_closes_once_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """aiohttp arms its idle timer as a connection opens and pushes it back only for requests it serves itself:
    a connection whose calls are all read here must not be closed by it while in use. Its idle close is the
    same keep-alive, counted from its last answer. (The listener is given a short keep-alive: aiohttp's
    default is an hour.)"""
    keepalive = 0.4
    monkeypatch.setattr(
        proxy_app, "HttpListener", functools.partial(HttpListener, keepalive_timeout=keepalive)
    )
    body = chat()
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        async with Agent.connect(proxy.url) as agent:
            started = time.monotonic()
            answers = []
            while time.monotonic() - started < 3 * keepalive:  # in use for three times the keep-alive
                answers.append(await agent.answer_after(request(route(rid, aid), body)))
                await anyio.sleep(keepalive / 4)
            assert len(answers) >= 4 and None not in answers, answers
            for answer in answers:
                assert answer is not None
                assert_answered(answer, mock, body)
                assert not answer.by_aiohttp
            assert await agent.rest() == b""  # idle: closed by the proxy within WAIT
