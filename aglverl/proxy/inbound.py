"""The proxy's own HTTP/1.1 reading and writing of an agent's attributed call, in place of aiohttp's server.

An agent's calls to ``/rollout/{rollout_id}/attempt/{attempt_id}/v1/...`` are nearly all the proxy serves, and
aiohttp's server spends ~100 µs of CPU on each one's machinery alone (its parser, request object, router,
handler task and writer; ``benchmarks/RESULTS.md``). The connection (:class:`~aglverl.proxy.shed.Shedder`)
already finds each request's head and length; for a request it can read for certain it asks :meth:`Inbound.read`
here for an :class:`InboundRequest`, reads its body, and runs the proxy's handler on it in a task of its own.
Everything else (another route, ``HTTP/1.0``, ``HEAD``, ``Expect``, a chunked body, percent-escapes or dot
segments in the path, a malformed or duplicated header, a body over ``max_body_bytes``) goes to aiohttp, which
then serves that connection to its end, exactly as before.

What the handler gets is what it reads of aiohttp's ``web.Request`` (method, headers, ``match_info``,
``rel_url``'s raw path and query, the body) and what aiohttp's response objects need to write themselves
(``version``, ``keep_alive`` and a payload writer): the handler's ``web.Response`` / ``web.StreamResponse``
write through :class:`InboundWriter`, one ``write`` per response head and body, chunked framing for a stream,
and waits while the agent's socket is full. Pure plumbing: no policy, nothing of the proxy's parts.
"""

from __future__ import annotations

import email.utils
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import HttpVersion11, web
from multidict import CIMultiDict, CIMultiDictProxy

__all__ = ["Inbound", "InboundRequest", "InboundWriter"]

_ROLLOUT = b"/rollout/"
_ATTEMPT = b"/attempt/"
_V1 = b"/v1/"
#: Methods read here (``HEAD``, ``CONNECT`` and anything else: aiohttp's).
_METHODS = frozenset((b"GET", b"POST", b"PUT", b"PATCH", b"DELETE", b"OPTIONS"))
#: A head's header lines: each a name as HTTP allows it (RFC 9110's token), a colon, a value without line
#: breaks or NULs.
_HEADER_BLOCK = re.compile(
    r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[^\r\n\x00]*(?:\r\n[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[^\r\n\x00]*)*"
).fullmatch

#: Headers :meth:`InboundRequest.send_whole` sets itself.
_SET_HERE = CIMultiDict({"Content-Length": "", "Date": "", "Connection": "", "Transfer-Encoding": ""})
_DATE: dict[int, str] = {}


def _date() -> str:
    """The ``Date`` header line for now (made once a second)."""
    now = int(time.time())
    line = _DATE.get(now)
    if line is None:
        _DATE.clear()
        line = _DATE[now] = "Date: " + email.utils.formatdate(now, usegmt=True)
    return line


#: A request target as HTTP allows it: visible ASCII only (no space, control or 8-bit byte).
_VISIBLE = re.compile(rb"[\x21-\x7e]+").fullmatch
#: The headers a request may hold once only (aiohttp's singletons, and the length), as the lowered head spells
#: them: a request with two of one (or without ``Host``) goes to aiohttp, which refuses it.
_SINGLETONS = re.compile(
    r"\r\n(host|content-length|content-type|content-location|content-range|etag|max-forwards|server|user-agent):"
).findall

#: The handler a read request goes to: ``(request, rollout_id, attempt_id, target)`` (``target``: the raw path
#: from ``/v1/`` on, what goes upstream) to the response it wrote or is to be written.
Handler = Callable[[Any, str, str, str], Awaitable[Any]]


class RawURL:
    """What the proxy reads of a request's URL: its path and query string, both as sent."""

    __slots__ = ("raw_path", "raw_query_string")

    def __init__(self, raw_path: str, raw_query_string: str) -> None:
        self.raw_path = raw_path
        self.raw_query_string = raw_query_string


class InboundRequest:
    """An attributed call read here: the parts of aiohttp's ``web.Request`` that the proxy reads, and those that
    aiohttp's response objects use to write themselves (``version``, ``keep_alive``, ``_payload_writer``,
    ``_prepare_hook``)."""

    __slots__ = (
        "_body",
        "_payload_writer",
        "answered",
        "attempt_id",
        "content_length",
        "headers",
        "keep_alive",
        "match_info",
        "method",
        "path",
        "rel_url",
        "rollout_id",
        "target",
        "transport",
        "version",
    )

    def __init__(
        self,
        method: str,
        raw_path: str,
        query: str,
        headers: CIMultiDictProxy[str],
        length: int,
        ids: tuple[str, str, str],
        keep_alive: bool,
    ) -> None:
        self.method = method
        self.path = raw_path  # no percent-escapes: the raw path is the decoded one
        self.rel_url = RawURL(raw_path, query)
        self.headers = headers
        self.content_length = length
        self.rollout_id, self.attempt_id, route = ids
        self.match_info: Mapping[str, str] = {"rollout_id": ids[0], "attempt_id": ids[1], "path": route}
        self.target = "/v1/" + route
        self.keep_alive = keep_alive
        self.version = HttpVersion11
        self._body = b""
        self._payload_writer: InboundWriter | None = None
        self.answered = False  # whether :meth:`send_whole` wrote the answer
        self.transport: Any = None  # the agent's connection (as aiohttp's request has it), set once read

    async def read(self) -> bytes:
        """The request's body (read whole before the handler started)."""
        return self._body

    async def send_whole(self, response: web.Response) -> None:
        """Write ``response``, a whole answer, in one write (what its own ``prepare()`` and ``write_eof()``
        would write, without aiohttp's per-response machinery): its status, its headers, ``Content-Length``,
        ``Date`` and, when the agent asked to close, ``Connection: close``. Raises ``ConnectionResetError``
        once the agent has gone."""
        writer = self._payload_writer
        assert writer is not None and not self.answered
        status, body = response.status, response.body
        if not isinstance(body, bytes):
            raise TypeError("a whole answer's body is bytes")
        lines = [f"HTTP/1.1 {status} {response.reason}"]
        lines.extend(f"{name}: {value}" for name, value in response.headers.items() if name not in _SET_HERE)
        if status < 200 or status in (204, 304):
            body = b""
        else:
            lines.append(f"Content-Length: {len(body)}")
            if body and "Content-Type" not in response.headers:
                lines.append("Content-Type: application/octet-stream")
        lines.append(_date())
        if not self.keep_alive:
            lines.append("Connection: close")
        head = "\r\n".join(lines)
        if head.count("\n") != len(lines) - 1 or head.count("\r") != len(lines) - 1:
            raise ValueError("a response header holds a line break")
        self.answered = True
        writer.sent = True
        writer.output_size = len(body)
        connection = writer._connection
        connection.write(head.encode("utf-8", "surrogateescape") + b"\r\n\r\n" + body)
        await connection.drain()

    async def _prepare_hook(self, response: Any) -> None:
        """aiohttp's response calls this as it starts: nothing to do here (no signals)."""


class InboundWriter:
    """The agent's side of a response, as aiohttp's response objects write it (its ``AbstractStreamWriter``'s
    calls): the head kept until the first body bytes (or sent at once for a stream), chunked framing when the
    length is not known, each write waiting while the connection's transport is paused."""

    __slots__ = ("_chunked", "_connection", "_head", "buffer_size", "length", "output_size", "sent")

    def __init__(self, connection: Any) -> None:
        #: What writes: ``write(bytes)`` (raises ``ConnectionResetError`` once the agent left) and ``drain()``.
        self._connection = connection
        self._head = b""
        self._chunked = False
        self.length: int | None = None
        self.output_size = 0
        self.buffer_size = 0
        self.sent = False  # whether any byte of the response went out

    def enable_chunking(self) -> None:
        self._chunked = True

    def enable_compression(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the proxy never compresses what it relays")

    async def write_headers(self, status_line: str, headers: CIMultiDict[str]) -> None:
        lines = [status_line]
        lines.extend(f"{name}: {value}" for name, value in headers.items())
        text = "\r\n".join(lines)
        if "\n" in text.replace("\r\n", "") or "\r" in text.replace("\r\n", ""):
            raise ValueError("a response header holds a line break")
        self._head = (text + "\r\n\r\n").encode("utf-8", "surrogateescape")

    def send_headers(self) -> None:
        if self._head:
            head, self._head = self._head, b""
            self.sent = True
            self._connection.write(head)

    async def write(self, chunk: bytes | bytearray | memoryview) -> None:
        if not chunk:
            return
        self.output_size += len(chunk)
        if self._chunked:
            chunk = b"%x\r\n%b\r\n" % (len(chunk), bytes(chunk))
        head, self._head = self._head, b""
        self.sent = True
        self._connection.write(head + chunk if head else chunk)
        await self._connection.drain()

    async def write_eof(self, chunk: bytes = b"") -> None:
        self.output_size += len(chunk)
        if self._chunked:
            chunk = (b"%x\r\n%b\r\n0\r\n\r\n" % (len(chunk), chunk)) if chunk else b"0\r\n\r\n"
        head, self._head = self._head, b""
        data = head + chunk if head else chunk
        if data:
            self.sent = True
            self._connection.write(data)
            await self._connection.drain()

    async def drain(self) -> None:
        await self._connection.drain()

    def set_eof(self) -> None:
        """aiohttp's interface; nothing is buffered here."""


class Inbound:
    """Which requests are read here, and the handler they go to (see the module docstring). ``limit``: the
    body bound (``max_body_bytes`` as the proxy started serving, as aiohttp's ``client_max_size`` is): a bigger
    body is aiohttp's, whose handler answers it with a 413."""

    __slots__ = ("handler", "limit")

    def __init__(self, handler: Handler, limit: int) -> None:
        self.handler = handler
        self.limit = limit

    def read(self, head: bytes, length: int) -> InboundRequest | None:
        """The request of ``head`` (its whole head, ``length``: its body's, known to be by ``Content-Length``
        or none) if it is one read here; ``None`` sends it to aiohttp."""
        if length > self.limit:
            return None
        end = head.find(b"\r\n")
        parts = head[:end].split(b" ")
        if len(parts) != 3 or parts[2] != b"HTTP/1.1" or parts[0] not in _METHODS:
            return None
        target = parts[1]
        if (
            not target.startswith(_ROLLOUT)
            or b"%" in target
            or b"/." in target
            or b"\\" in target
            or not _VISIBLE(target)
        ):
            return None
        path, _, query = target.partition(b"?")
        at = path.find(_ATTEMPT, len(_ROLLOUT))
        v1 = path.find(_V1, at + len(_ATTEMPT)) if at > 0 else -1
        if v1 < 0:
            return None
        rollout_id, attempt_id = path[len(_ROLLOUT) : at], path[at + len(_ATTEMPT) : v1]
        if not rollout_id or not attempt_id or b"/" in rollout_id or b"/" in attempt_id:
            return None  # aiohttp's route does not match these: its 404 names them
        block = head[end + 2 : -4].decode("utf-8", "surrogateescape")
        if not _HEADER_BLOCK(block):
            return None  # a malformed header (or none at all): aiohttp answers it, a 400 naming what is wrong
        lowered = "\r\n" + block.lower()
        if (
            "\r\nexpect:" in lowered
            or "\r\nupgrade:" in lowered
            or "\r\ntransfer-encoding:" in lowered
            or len(singletons := _SINGLETONS(lowered)) != len(set(singletons))
            or "host" not in singletons
        ):
            return None  # what they ask for is aiohttp's to do; two lengths, aiohttp refuses
        headers: CIMultiDict[str] = CIMultiDict()
        add = headers.add
        for line in block.split("\r\n"):
            name, _, value = line.partition(":")
            add(name, value.strip(" \t"))
        close = "\r\nconnection:" in lowered and any(
            "close" in (token.strip() for token in value.lower().split(","))
            for value in headers.getall("Connection")
        )
        ids = (
            rollout_id.decode("latin-1"),
            attempt_id.decode("latin-1"),
            path[v1 + len(_V1) :].decode("latin-1"),
        )
        return InboundRequest(
            parts[0].decode("latin-1"),
            path.decode("latin-1"),
            query.decode("latin-1"),
            CIMultiDictProxy(headers),
            length,
            ids,
            not close,
        )


def internal_error(message: str) -> bytes:
    """A whole ``500`` answer naming ``message``, after which the connection closes."""
    body = message.encode("utf-8", "replace")
    return (
        b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain; charset=utf-8\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%b" % (len(body), body)
    )
