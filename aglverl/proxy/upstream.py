"""The proxy's HTTP/1.1 client to its backends: keep-alive connections per backend, one write per request, the
response head and body parsed from the socket's reads with no layer in between.

Why not :mod:`aiohttp`'s client: a relayed call pays for the client once per try, and aiohttp's (its session,
connector, timer context, payload writer, response and stream reader objects, each with its own bookkeeping)
was about a third of the proxy's CPU per call. The proxy needs far less of HTTP than a general client offers:
its backends are inference servers it was configured with, asked for JSON or an SSE stream. So this module
speaks exactly that much, strictly:

- :class:`Upstream` — the connections: :meth:`Upstream.request` takes an idle connection to the origin (or
  opens one within ``connect_timeout``), writes the request in one write (``Host`` and ``Content-Length``
  added; nothing else), and awaits the response head; :class:`UpstreamError` when no connection could be made (its ``kind``
  ``"connect"``), when the connection closed before a head came (``"closed"``: a kept connection the server had
  just closed, typically), or when what came is not HTTP/1.x (``"head"``). An idle connection is kept
  ``keepalive`` seconds (below the backends' own keep-alive, so that the server does not close one as it is
  reused); :meth:`Upstream.close` closes every connection.
- :class:`Response` — ``status``, ``reason``, ``headers`` (a :class:`~multidict.CIMultiDict`) and
  ``content_length`` once the head is in; the body read with :meth:`Response.readany` (what has arrived, ``b""``
  at its end) or :meth:`Response.read` (all of it); :class:`UpstreamError` (``"body"``) when the connection broke
  mid-body or its framing is wrong. Bodies framed by ``Content-Length``, chunks (trailers skipped) or the connection's end;
  ``1xx`` heads are skipped. The connection goes back to the pool as soon as the body has arrived whole (what
  is not read yet stays with the response); :meth:`Response.close` before that closes the connection. Reading
  stops while more than ``HIGH_WATER`` bytes wait unread (a slow agent slows its backend's stream, not the
  proxy's memory).
- Deadlines: ``request_timeout`` bounds each request from its send to its body's end: past it, whatever waits
  on the response raises :class:`TimeoutError` and the connection is closed. Cancellation while a response is
  unfinished: the caller closes it (:meth:`Response.close`).

Nothing here decompresses, follows redirects, keeps cookies or reads the environment's proxies: bodies are
relayed byte for byte to and from the configured backends only.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Iterable
from typing import Any

import orjson
from multidict import CIMultiDict
from yarl import URL

__all__ = [
    "Origin",
    "Response",
    "Upstream",
    "UpstreamError",
]

#: Bytes a response head may take (status line and headers).
MAX_HEAD = 64 * 1024
#: Bytes of a chunk-size line (extensions included) before the body counts as malformed.
MAX_CHUNK_LINE = 4096
#: Unread body bytes past which the connection stops reading until the caller catches up.
HIGH_WATER = 256 * 1024

_HEAD, _LENGTH, _CHUNKED, _UNTIL_CLOSE, _DONE = range(5)
_SIZE, _DATA, _DATA_END, _TRAILER = range(4)
_HEX = frozenset(b"0123456789abcdefABCDEF")


class UpstreamError(Exception):
    """A request to a backend that did not get a whole, well-formed HTTP answer; ``kind`` says how:

    - ``"connect"``: no connection could be made (refused, unresolvable, or not within ``connect_timeout``);
    - ``"closed"``: the backend closed (or reset) the connection before a response head came;
    - ``"head"``: what the backend sent is not an HTTP/1.x response head;
    - ``"body"``: the response body ended early or is framed wrongly.
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Origin:
    """Where a backend is: parsed once from its URL (``http(s)://host:port``)."""

    __slots__ = ("host", "host_header", "key", "port", "ssl")

    def __init__(self, url: str) -> None:
        parsed = URL(url)
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"backend {url!r} must be an absolute http(s) URL")
        self.host: str = parsed.host
        self.port: int = parsed.port or (443 if parsed.scheme == "https" else 80)
        self.ssl = parsed.scheme == "https"
        self.key = url
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = host if parsed.is_default_port() else f"{host}:{self.port}"


class _Connection(asyncio.Protocol):
    """One TCP connection to a backend: it hands what it reads to the response being received."""

    __slots__ = ("closed", "idle_since", "origin", "response", "transport", "upstream")

    def __init__(self, origin: Origin, upstream: Upstream) -> None:
        self.origin = origin
        self.upstream = upstream
        self.transport: asyncio.Transport | None = None
        self.response: Response | None = None
        self.closed = False
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # nothing was asked: a server that talks out of turn is not reused
            self.close()
            return
        response._feed(data)

    def eof_received(self) -> bool:
        return False  # close the transport: a half-closed backend connection is of no further use

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response, self.response = self.response, None
        if response is not None:
            response._lost(exc)
        self.upstream._gone(self)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()


class Response:
    """A backend's response: its head once :meth:`Upstream.request` returns it, its body read as it comes."""

    __slots__ = (
        "_chunk_left",
        "_chunk_state",
        "_chunks",
        "_conn",
        "_deadline",
        "_error",
        "_head",
        "_head_only",
        "_keep",
        "_left",
        "_loop",
        "_paused",
        "_pending",
        "_phase",
        "_unread",
        "_upstream",
        "_waiter",
        "content_length",
        "headers",
        "reason",
        "status",
    )

    def __init__(self, upstream: Upstream, conn: _Connection, head_only: bool) -> None:
        self._upstream = upstream
        self._conn: _Connection | None = conn
        self._loop = upstream.loop
        self._head_only = head_only
        self._phase = _HEAD
        self._head = b""
        self._pending = b""
        self._chunk_state = _SIZE
        self._chunk_left = 0
        self._left = 0
        self._chunks: list[bytes] = []
        self._unread = 0
        self._paused = False
        self._keep = True
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self.status = 0
        self.reason = ""
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.content_length: int | None = None

    # ------------------------------------------------------------------ reading (the caller's side)
    async def _wait(self) -> None:
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    async def readany(self) -> bytes:
        """The body bytes that have arrived (waiting for some), ``b""`` once the body has ended."""
        while True:
            chunks = self._chunks
            if chunks:
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._unread = 0
                if self._paused:
                    self._paused = False
                    conn = self._conn
                    if conn is not None and conn.transport is not None:
                        conn.transport.resume_reading()
                return data
            if self._error is not None:
                raise self._error
            if self._phase == _DONE:
                return b""
            await self._wait()

    async def read(self) -> bytes:
        """The whole body (the rest of it)."""
        parts = []
        while data := await self.readany():
            parts.append(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def drain(self) -> None:
        """Read what is left of the body, so that its connection goes back to the pool; errors end the
        reading."""
        try:
            while await self.readany():
                pass
        except (UpstreamError, OSError):
            pass

    async def json(self) -> Any:
        """The whole body, as JSON."""
        return orjson.loads(await self.read())

    def close(self) -> None:
        """Done with this response: a body not yet whole closes its connection (nothing more is read)."""
        self._fail(UpstreamError("body", "the response was closed before its end"))  # a no-op once it ended
        self._chunks.clear()

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the connection's side
    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _fail(self, error: BaseException) -> None:
        """The response cannot go on: ``error`` for whoever reads it; the connection is closed."""
        if self._phase == _DONE:
            return
        self._phase = _DONE
        self._error = error
        self._disarm()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.response = None
            conn.close()
            self._upstream._gone(conn)
        self._wake()

    def _expire(self) -> None:
        self._deadline = None
        self._fail(TimeoutError("the backend did not finish within request_timeout"))

    def _lost(self, exc: Exception | None) -> None:
        if self._phase == _UNTIL_CLOSE:  # the connection's end is the body's
            self._keep = False
            self._finish()
            return
        if self._phase == _HEAD:
            error = UpstreamError(
                "closed", f"the connection was closed before a response came{f' ({exc!r})' if exc else ''}"
            )
        else:
            error = UpstreamError("body", f"the connection was closed mid-body{f' ({exc!r})' if exc else ''}")
        self._fail(error)

    def _finish(self) -> None:
        self._phase = _DONE
        self._disarm()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.response = None
            if self._keep and not conn.closed:
                self._upstream._release(conn)
            else:
                conn.close()
                self._upstream._gone(conn)
        self._wake()

    def _push(self, data: bytes) -> None:
        self._chunks.append(data)
        self._unread += len(data)
        if self._unread > HIGH_WATER and not self._paused:
            conn = self._conn
            if conn is not None and conn.transport is not None:
                self._paused = True
                conn.transport.pause_reading()
        self._wake()

    def _feed(self, data: bytes) -> None:
        phase = self._phase
        if phase == _HEAD:
            data = self._feed_head(data)
            phase = self._phase
            if not data:
                return
        if phase == _LENGTH:
            left = self._left
            size = len(data)
            if size < left:
                self._left = left - size
                self._push(data)
                return
            if size > left:  # more than it said: the answer is taken as said, the connection not reused
                self._keep = False
                data = data[:left]
            self._left = 0
            self._chunks.append(data)
            self._unread += len(data)
            self._finish()
        elif phase == _CHUNKED:
            self._dechunk(data)
        elif phase == _UNTIL_CLOSE:
            self._push(data)
        else:  # bytes after a finished answer, before another request: not HTTP as asked
            self._keep = False
            conn = self._conn
            if conn is not None:
                conn.close()

    def _feed_head(self, data: bytes) -> bytes:
        """Take the head from ``data`` (what came before it included); returns what follows it."""
        buffer = self._head + data if self._head else data
        while True:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > MAX_HEAD:
                    self._fail(UpstreamError("head", f"a response head longer than {MAX_HEAD} bytes"))
                else:
                    self._head = buffer
                return b""
            self._head = b""
            try:
                informational = self._parse_head(buffer[:end])
            except UpstreamError as exc:
                self._fail(exc)
                return b""
            buffer = buffer[end + 4 :]
            if not informational:
                self._wake()
                if self._phase == _DONE:  # a head with no body
                    if buffer:
                        self._keep = False
                    self._finish()
                    return b""
                return buffer

    def _parse_head(self, head: bytes) -> bool:
        """Read a response head; ``True`` for a ``1xx`` one (another head follows)."""
        lines = head.decode("latin-1").split("\r\n")
        status_line = lines[0]
        code = status_line[9:12]
        if (
            status_line[:9] not in ("HTTP/1.1 ", "HTTP/1.0 ")
            or not (code.isdigit() and code.isascii())
            or status_line[12:13] not in ("", " ")
        ):
            raise UpstreamError("head", f"not an HTTP/1.x status line: {status_line[:100]!r}")
        status = int(code)
        if status < 100:
            raise UpstreamError("head", f"status {status} out of range")
        if status < 200:
            return True
        pairs = []
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name[0] in " \t" or name[-1] in " \t":
                raise UpstreamError("head", f"a malformed header line: {line[:100]!r}")
            pairs.append((name, value.strip()))
        headers = CIMultiDict(pairs)
        self.status = status
        self.reason = status_line[13:]
        self.headers = headers
        connection = headers.get("Connection", "").lower()
        if status_line[7] == "0" or "close" in connection:
            self._keep = False
        coding = headers.get("Transfer-Encoding")
        lengths = headers.getall("Content-Length", ())
        if lengths and coding is None:
            if len(set(lengths)) != 1 or not lengths[0].isdigit():
                raise UpstreamError("head", f"an invalid Content-Length: {', '.join(lengths)!r}")
            self.content_length = int(lengths[0])
        if self._head_only or status in (204, 304):
            self._phase = _DONE
        elif coding is not None:
            if coding.lower().rpartition(",")[2].strip() != "chunked":
                raise UpstreamError("head", f"a transfer coding other than chunked: {coding!r}")
            self._phase = _CHUNKED
        elif self.content_length is not None:
            self._left = self.content_length
            self._phase = _LENGTH if self._left else _DONE
        else:
            self._phase = _UNTIL_CLOSE
            self._keep = False
        return False

    def _dechunk(self, data: bytes) -> None:
        if self._pending:
            data = self._pending + data
            self._pending = b""
        elif self._chunk_state == _SIZE:
            # The usual read of a stream: exactly one whole chunk (an SSE event as the backend flushed it).
            eol = data.find(b"\r\n", 0, 18)
            if eol > 0 and _HEX.issuperset(data[:eol]):
                size = int(data[:eol], 16)
                if size and len(data) == eol + size + 4 and data[-2:] == b"\r\n":
                    self._push(data[eol + 2 : -2])
                    return
        out: list[bytes] = []
        pos, end = 0, len(data)
        state, left = self._chunk_state, self._chunk_left
        while pos < end:
            if state == _DATA:
                take = min(left, end - pos)
                out.append(data[pos : pos + take] if take < end or pos else data)
                pos += take
                left -= take
                if not left:
                    state = _DATA_END
            elif state == _SIZE:
                eol = self._line_end(data, pos, MAX_CHUNK_LINE, "a chunk-size line")
                if eol < 0:
                    break
                digits = data[pos:eol].partition(b";")[0].strip()
                if not digits or not _HEX.issuperset(digits):
                    self._fail(UpstreamError("body", f"a malformed chunk size: {data[pos:eol][:40]!r}"))
                    return
                left = int(digits, 16)
                pos = eol + 2
                state = _DATA if left else _TRAILER
            elif state == _DATA_END:
                if end - pos < 2:
                    self._pending = data[pos:]
                    break
                if data[pos : pos + 2] != b"\r\n":
                    self._fail(UpstreamError("body", "a chunk not followed by CRLF"))
                    return
                pos += 2
                state = _SIZE
            else:  # trailers, skipped, up to an empty line
                eol = self._line_end(data, pos, MAX_HEAD, "a trailer line")
                if eol < 0:
                    break
                if eol == pos:
                    if eol + 2 < end:
                        self._keep = False
                    self._chunk_state = state
                    if out:
                        for piece in out:
                            self._chunks.append(piece)
                            self._unread += len(piece)
                    self._finish()
                    return
                pos = eol + 2
        self._chunk_state, self._chunk_left = state, left
        if out:
            self._push(out[0] if len(out) == 1 else b"".join(out))

    def _line_end(self, data: bytes, pos: int, limit: int, what: str) -> int:
        """Where the line at ``pos`` ends (its CR); -1 when it has not all arrived: kept for the next read, or
        the body failed when it already runs past ``limit`` bytes."""
        eol = data.find(b"\r\n", pos)
        if eol < 0:
            if len(data) - pos > limit:
                self._fail(UpstreamError("body", f"{what} too long"))
            else:
                self._pending = data[pos:]
        return eol


class Upstream:
    """Keep-alive HTTP/1.1 connections to the backends (see the module docstring)."""

    def __init__(self, *, keepalive: float, connect_timeout: float, request_timeout: float) -> None:
        self.keepalive = keepalive
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self.loop = asyncio.get_running_loop()
        self._idle: dict[str, list[_Connection]] = {}
        self._all: set[_Connection] = set()
        self._origins: dict[str, Origin] = {}
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    def origin(self, url: str) -> Origin:
        """The parsed origin of a backend URL (kept)."""
        origin = self._origins.get(url)
        if origin is None:
            if len(self._origins) > 1024:
                self._origins.clear()
            origin = self._origins[url] = Origin(url)
        return origin

    async def request(
        self,
        method: str,
        backend: str,
        target: str,
        headers: Iterable[tuple[str, str]] | None = None,
        body: bytes | None = None,
    ) -> Response:
        """Send ``method target`` to ``backend`` (``http(s)://host:port``) and return the response once its head
        is in. ``headers`` are sent as given (``Host`` and ``Content-Length`` are this client's);
        ``request_timeout`` bounds the request to its body's end."""
        if self._closed:
            raise UpstreamError("connect", "the upstream client is closed")
        origin = self.origin(backend)
        lines = [f"{method} {target} HTTP/1.1\r\nHost: {origin.host_header}\r\n"]
        if headers is not None:
            for name, value in headers:
                if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
                    raise ValueError(f"header {name!r} has a line break or colon where none may be")
                lines.append(f"{name}: {value}\r\n")
        if body is not None or method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body) if body else 0}\r\n")
        lines.append("\r\n")
        if " " in target or "\r" in target or "\n" in target:
            raise ValueError(f"request target {target[:100]!r} has a space or line break")
        message = "".join(lines).encode("utf-8", "surrogateescape")
        if body:
            message += body
        conn = self._take(origin)
        if conn is None:
            conn = await self._connect(origin)
        response = Response(self, conn, method == "HEAD")
        conn.response = response
        response._deadline = self.loop.call_at(self.loop.time() + self.request_timeout, response._expire)
        assert conn.transport is not None
        try:
            conn.transport.write(message)
            while response._phase == _HEAD and response._error is None:
                await response._wait()
        except BaseException:
            response.close()
            raise
        if response._error is not None and response._phase == _DONE and not response.status:
            raise response._error
        return response

    async def get(
        self, backend: str, target: str, headers: Iterable[tuple[str, str]] | None = None
    ) -> tuple[int, bytes]:
        """A whole ``GET``: its status and body (small answers: a model listing, a health probe)."""
        response = await self.request("GET", backend, target, headers)
        try:
            return response.status, await response.read()
        finally:
            response.close()

    def _take(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin.key)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive:
                return conn
            conn.close()
            self._all.discard(conn)
        return None

    async def _connect(self, origin: Origin) -> _Connection:
        context: ssl.SSLContext | None = None
        if origin.ssl:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await self.loop.create_connection(
                    lambda: _Connection(origin, self), origin.host, origin.port, ssl=context
                )
        except TimeoutError:
            raise UpstreamError(
                "connect", f"no connection to {origin.key} within connect_timeout={self.connect_timeout:g}s"
            ) from None
        except OSError as exc:
            raise UpstreamError("connect", f"cannot connect to {origin.key}: {exc}") from exc
        if self._closed:
            conn.close()
            raise UpstreamError("connect", "the upstream client is closed")
        self._all.add(conn)
        return conn

    def _release(self, conn: _Connection) -> None:
        if self._closed:
            conn.close()
            self._all.discard(conn)
            return
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.origin.key, []).append(conn)

    def _gone(self, conn: _Connection) -> None:
        """``conn`` is closed: out of the pool's lists (an idle one the backend closed included)."""
        self._all.discard(conn)
        idle = self._idle.get(conn.origin.key)
        if idle and conn in idle:
            idle.remove(conn)

    async def close(self) -> None:
        """Close every connection (idle or in use: what waits on them gets an error)."""
        self._closed = True
        self._idle.clear()
        for conn in list(self._all):
            response = conn.response
            if response is not None:
                response._fail(UpstreamError("closed", "the proxy is shutting down"))
            conn.close()
        self._all.clear()
        await asyncio.sleep(0)  # let the transports' connection_lost run
