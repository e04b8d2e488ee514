"""Raw HTTP/1.1 on loopback, both sides of the proxy. The agent's side: its socket written byte for byte, answers
read back as they were sent (status line, headers in order, chunked framing taken off), and the proxy in front of
a :class:`~aglverl.testing.MockVLLM` with its store. The backend's side: :class:`RawServer`, a server that answers
exact bytes (what a client or the proxy makes of a malformed or broken answer), and :func:`read_cut_short`, what
an aiohttp client gets of an answer the proxy broke off. Shared by the tests of the proxy's HTTP server, its
upstream client and its relay."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
import orjson
import pytest

from aglverl.metrics import Registry
from aglverl.models import Rollout
from aglverl.proxy import LLMProxy, RetryPolicy
from aglverl.store import LLMCall, TaskStore
from aglverl.testing import MockVLLM

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


def split_answer(raw: bytes, head_only: bool = False) -> tuple[int, dict[str, str], bytes, bytes]:
    """The first answer in ``raw`` (all a server sent): its status, headers (names lowered), body (chunked framing
    taken off; without a length, to the end) and what follows it."""
    end = raw.index(b"\r\n\r\n")
    head, raw = raw[:end].decode("latin-1"), raw[end + 4 :]
    status = int(head.split(" ", 2)[1])
    fields = {k.strip().lower(): v.strip() for k, _, v in (f.partition(":") for f in head.split("\r\n")[1:])}
    if head_only or status == 100:
        return status, fields, b"", raw
    if fields.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            line, _, raw = raw.partition(b"\r\n")
            size = int(line, 16)
            body, raw = body + raw[:size], raw[size + 2 :]
            if not size:
                return status, fields, body, raw
    size = int(fields.get("content-length", len(raw)))
    return status, fields, raw[:size], raw[size:]


# ---------------------------------------------------------------------------------------------- backends
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
