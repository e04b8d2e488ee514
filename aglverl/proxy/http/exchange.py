"""One request and its answer on a connection: what a handler reads and how it writes.

:class:`Exchange` is the whole interface a handler has to HTTP. The request, as the connection read its head:
``method``, ``target`` (as sent), ``path`` and ``query`` (the target's, a fragment dropped: what routing reads),
``version``, ``headers`` (a case-insensitive multi-dict, values decoded as UTF-8 with surrogate escapes so that
they go on byte for byte), ``content_length``, ``keep_alive``; ``state``, the service's own (what it made of the
head at admission). The body: ``await exchange.body()`` (whole: the handler starts once it has arrived).

The answer, in one of two ways:

- :meth:`Exchange.send_whole` — status, headers and body in one write, with ``Content-Length`` (no body to a
  ``HEAD``, none for 1xx, 204, 304);
- :meth:`Exchange.start`, then :meth:`Exchange.write` per piece and :meth:`Exchange.end` — a stream: chunked for an
  HTTP/1.1 client, delimited by the connection's close for an HTTP/1.0 one; :meth:`Exchange.abort` instead of the
  end closes the connection without the last chunk (the client sees the body cut short, never whole).

Every answer carries ``Date`` and, when the connection closes after it, ``Connection: close``; the headers given
are written as given but the framing ones (``Content-Length``, ``Transfer-Encoding``, ``Connection``, ``Date``),
which are the writer's. A header holding a line break is a ``ValueError`` (nothing written). Each write waits
while the client's socket is full (:class:`~aglverl.proxy.http.flow.Flow`); a write to a client that left raises
``ConnectionResetError``. Cancelled, a write stops waiting (what was written stays written).

The connection's side (``feed_body``, ``end_body``, ``fail_body``, ``write_answer``) is how it hands the body
over and writes refusals decided at the head; handlers do not call those.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Protocol

from multidict import CIMultiDict

from .errors import BodyTooLarge, HttpError

__all__ = ["Answer", "Exchange", "Wire"]

#: Headers the writer sets itself (lower case).
_FRAMING = frozenset(("content-length", "transfer-encoding", "connection", "date"))
_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}" for s in HTTPStatus}
_NO_HEADERS: Mapping[str, str] = {}
_DATE: dict[int, str] = {}


def _date() -> str:
    """The ``Date`` header line for now (made once a second)."""
    now = int(time.time())
    line = _DATE.get(now)
    if line is None:
        _DATE.clear()
        line = _DATE[now] = "Date: " + email.utils.formatdate(now, usegmt=True)
    return line


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole answer decided without a handler (a refusal at the head): written by the connection as
    :meth:`Exchange.send_whole` would write it."""

    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)
    reason: str | None = None


class Wire(Protocol):
    """What an exchange writes through: its connection."""

    @property
    def closing(self) -> bool:
        """Whether the connection closes after the answer under way (the server stops)."""

    def write(self, data: bytes) -> None:
        """Write to the client; ``ConnectionResetError`` once it has gone."""

    async def drain(self) -> None:
        """Wait while the client's socket is full; ``ConnectionResetError`` once it has gone."""

    def abort(self) -> None:
        """Close the connection now, without what an answer under way still lacks."""


class Exchange:
    """One request and its answer (see the module docstring)."""

    __slots__ = (
        "_chunked_out",
        "_complete",
        "_error",
        "_finished",
        "_head_only",
        "_limit",
        "_parts",
        "_size",
        "_started",
        "_wire",
        "answer",
        "chunked",
        "content_length",
        "expect_continue",
        "headers",
        "keep_alive",
        "method",
        "path",
        "query",
        "state",
        "target",
        "version",
    )

    def __init__(self, wire: Wire, limit: int) -> None:
        self._wire = wire
        self._limit = limit  # the body's bound (bytes)
        self.method = ""
        self.target = ""
        self.path = ""
        self.query = ""
        self.version = "1.1"
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.content_length: int | None = None
        self.chunked = False  # the body comes with Transfer-Encoding
        self.expect_continue = False
        self.keep_alive = (
            True  # the client keeps the connection after this answer (and, once sent, the server)
        )
        #: The service's own: what it made of the head when it admitted the request.
        self.state: Any = None
        #: A refusal decided at the head, written by the connection when the exchange's turn comes.
        self.answer: Answer | None = None
        self._parts: list[bytes] = []
        self._size = 0
        self._complete = False  # the whole body is in
        self._error: HttpError | None = None  # why the body will not come
        self._started = False
        self._finished = False
        self._chunked_out = False
        self._head_only = False

    # ------------------------------------------------------------------ the request
    @property
    def complete(self) -> bool:
        """Whether the whole request, body included, has been read."""
        return self._complete

    async def body(self) -> bytes:
        """The request's body (the connection starts the handler once it has all arrived). Raises
        :class:`~aglverl.proxy.http.errors.BodyTooLarge` for a chunked body past the limit, another
        :class:`~aglverl.proxy.http.errors.HttpError` for one the parser refused or that stopped arriving."""
        if self._error is not None:
            raise self._error
        parts = self._parts
        if len(parts) == 1:
            return parts[0]
        body = b"".join(parts)
        self._parts = [body]
        return body

    @property
    def ready(self) -> bool:
        """Whether its handler can start: the body is whole, or will not come (:meth:`body` raises why)."""
        return self._complete or self._error is not None

    # ------------------------------------------------------------------ the answer
    @property
    def started(self) -> bool:
        """Whether the answer's head has been written."""
        return self._started

    @property
    def finished(self) -> bool:
        """Whether the whole answer has been written."""
        return self._finished

    async def send_whole(
        self,
        status: int,
        headers: Mapping[str, str] = _NO_HEADERS,
        body: bytes = b"",
        reason: str | None = None,
    ) -> None:
        """Write a whole answer in one write (see the module docstring); ``ConnectionResetError`` when the client
        has gone."""
        self.write_answer(status, headers, body, reason)
        await self._wire.drain()

    async def start(
        self, status: int, headers: Mapping[str, str] = _NO_HEADERS, reason: str | None = None
    ) -> None:
        """Write the head of a streamed answer now (its body follows by :meth:`write`, then :meth:`end`)."""
        if self._started:
            raise RuntimeError("the answer has started already")
        framing = []
        if self.method == "HEAD" or status < 200 or status in (204, 304):
            self._head_only = True
        elif self.version == "1.1":
            self._chunked_out = True
            framing.append("Transfer-Encoding: chunked")
        else:
            self.keep_alive = False  # an HTTP/1.0 client reads the body to the connection's close
        self._started = True
        self._wire.write(self._head(status, headers, reason, framing))
        await self._wire.drain()

    async def write(self, data: bytes) -> None:
        """Write a piece of a streamed answer (nothing for an empty one)."""
        if not data or self._head_only:
            return
        if self._finished or not self._started:
            raise RuntimeError("write() belongs between start() and end()")
        if self._chunked_out:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        self._wire.write(data)
        await self._wire.drain()

    async def end(self, data: bytes = b"") -> None:
        """Write the last piece (if any) and end a streamed answer."""
        if self._finished:
            return
        if not self._started:
            raise RuntimeError("end() ends a streamed answer that start() began")
        self._finished = True
        if self._head_only:
            return
        if self._chunked_out:
            data = (b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data)) if data else b"0\r\n\r\n"
        if data:
            self._wire.write(data)
            await self._wire.drain()

    def abort(self) -> None:
        """Close the connection without the rest of the answer: the client sees it cut short, never whole."""
        self._finished = True
        self.keep_alive = False
        self._wire.abort()

    # ------------------------------------------------------------------ writing
    def write_answer(
        self, status: int, headers: Mapping[str, str], body: bytes, reason: str | None = None
    ) -> None:
        """Write a whole answer now (what :meth:`send_whole` writes); the connection's, for refusals."""
        if self._started:
            raise RuntimeError("the answer has started already")
        framing = []
        if status < 200 or status in (204, 304):
            body = b""
        else:
            framing.append(f"Content-Length: {len(body)}")
            if body and "Content-Type" not in headers:
                framing.append("Content-Type: application/octet-stream")
        head = self._head(status, headers, reason, framing)
        self._started = self._finished = True
        self._wire.write(head if self.method == "HEAD" or not body else head + body)

    def _head(self, status: int, headers: Mapping[str, str], reason: str | None, framing: list[str]) -> bytes:
        """The answer's head: status line, the given headers, the framing, ``Date``, ``Connection``. Decides
        whether the connection is kept after it (:attr:`keep_alive`)."""
        if reason is None:
            line = _STATUS_LINES.get(status) or f"HTTP/1.1 {status} "
        else:
            line = f"HTTP/1.1 {status} {reason}"
        lines = [line]
        lines.extend(f"{name}: {value}" for name, value in headers.items() if name.lower() not in _FRAMING)
        lines.extend(framing)
        lines.append(_date())
        keep = self.keep_alive = self.keep_alive and self._complete and not self._wire.closing
        if not keep:
            lines.append("Connection: close")
        elif self.version == "1.0":
            lines.append("Connection: keep-alive")
        text = "\r\n".join(lines)
        breaks = len(lines) - 1
        if text.count("\n") != breaks or text.count("\r") != breaks:
            raise ValueError("a response header holds a line break")
        try:
            return text.encode("latin-1") + b"\r\n\r\n"
        except UnicodeEncodeError:  # not a header relayed as read (those are latin-1): UTF-8 on the wire
            return text.encode("utf-8", "surrogateescape") + b"\r\n\r\n"

    # ------------------------------------------------------------------ the connection's side
    def feed_body(self, data: bytes) -> None:
        """A piece of the body, as the parser read it (dropped for a refused request, or past the bound)."""
        if self.answer is not None or self._error is not None:
            return
        self._size += len(data)
        if self._size > self._limit:
            self._parts = []
            self.fail_body(BodyTooLarge(f"request body exceeds the limit of {self._limit} bytes"))
            return
        self._parts.append(data)

    def end_body(self) -> None:
        """The whole request has been read."""
        self._complete = True

    def fail_body(self, error: HttpError) -> None:
        """The body will not come whole: :meth:`body` raises ``error``."""
        if self._error is None and not self._complete:
            self._error = error
