"""The proxy's HTTP/1.1 client to its backends: keep-alive connections per backend, one write per request, each
response parsed by llhttp (:class:`httptools.HttpResponseParser`, the parser uvicorn runs) as the socket's reads
come in, with no layer in between.

Why not :mod:`aiohttp`'s client: a relayed call pays for the client once per try, and aiohttp's (its session,
connector, timer context, payload writer, response and stream reader objects, each with its own bookkeeping)
was about a third of the proxy's CPU per call. The proxy needs far less of HTTP than a general client offers:
its backends are inference servers it was configured with, asked for JSON or an SSE stream. So this module
keeps what a pool needs (connections, deadlines, back pressure) and leaves the framing to llhttp:

- :class:`Upstream` — the connections: :meth:`Upstream.request` takes an idle connection to the origin (or
  opens one within ``connect_timeout``), writes the request in one write (``Host`` and ``Content-Length``
  added; nothing else), and awaits the response head. An idle connection is kept ``keepalive`` seconds (below
  the backends' own keep-alive, so that the server does not close one as it is reused); :meth:`Upstream.close`
  closes every connection.
- :class:`Response` — ``status``, ``reason``, ``headers`` (a :class:`~multidict.CIMultiDict`) and
  ``content_length`` once the head is in; the body read with :meth:`Response.readany` (what has arrived, ``b""``
  at its end) or :meth:`Response.read` (all of it). Bodies framed by ``Content-Length``, chunks (trailers
  skipped) or the connection's end; ``1xx`` heads are skipped. The connection goes back to the pool as soon as
  the body has arrived whole (what is not read yet stays with the response); :meth:`Response.close` before that
  closes the connection. Reading stops while more than ``HIGH_WATER`` bytes wait unread (a slow agent slows its
  backend's stream, not the proxy's memory).
- Errors, caught by type (:mod:`~aglverl.proxy.pool` maps them to the agent's answer): :class:`ConnectError`
  (no connection could be made), :class:`ReadError` (the connection closed or broke before the response's
  end: before its head, a kept connection the server had just closed, typically; mid-body, a truncated answer),
  :class:`RemoteProtocolError` (what came is not a well-formed HTTP/1.1 response: a bad status line, header,
  ``Content-Length``, chunk size, a transfer coding other than ``chunked``, a head or trailers over
  ``MAX_HEAD`` bytes, a switch of protocols, bytes the client did not ask for); all are
  :class:`UpstreamError`. A response whose head is well-formed but whose body is not raises when read; one
  that broke before :meth:`Upstream.request` returned raises there (nothing of it can have reached the agent
  yet).
- Deadlines: ``request_timeout`` bounds each request from its send to its body's end: past it, whatever waits
  on the response raises :class:`TimeoutError` and the connection is closed. Cancellation while a response is
  unfinished: the caller closes it (:meth:`Response.close`); a request cancelled before its head closes its
  connection.

A connection's state is one :class:`State`, changed in a few named places (the request's write, the head's
arrival, the body's end, the close). Nothing here decompresses, follows redirects, keeps cookies or reads the
environment's proxies: bodies are relayed byte for byte to and from the configured backends only.
"""

from __future__ import annotations

import asyncio
import enum
import ssl
import time
from collections.abc import Iterable
from typing import Any

import httptools
import orjson
from multidict import CIMultiDict
from yarl import URL

__all__ = [
    "ConnectError",
    "Origin",
    "ReadError",
    "RemoteProtocolError",
    "Response",
    "State",
    "Upstream",
    "UpstreamError",
]

#: Bytes a response head may take (status line and headers, ``1xx`` heads before it included).
MAX_HEAD = 64 * 1024
#: Unread body bytes past which the connection stops reading until the caller catches up.
HIGH_WATER = 256 * 1024


class UpstreamError(Exception):
    """A request to a backend that did not get a whole, well-formed HTTP answer (one of the subclasses)."""


class ConnectError(UpstreamError):
    """No connection could be made (refused, unresolvable, not within ``connect_timeout``, client closed)."""


class ReadError(UpstreamError):
    """The connection closed or broke before the response's end (before its head, or mid-body)."""


class RemoteProtocolError(UpstreamError):
    """What the backend sent is not a well-formed HTTP/1.1 response (its head or its body's framing)."""


class State(enum.Enum):
    """Where a connection to a backend is."""

    IDLE = "idle"  #: connected, no request on it (in the pool, or just opened)
    HEAD = "head"  #: a request went out; its response head is awaited
    BODY = "body"  #: the head is in; the body is being read
    CLOSED = "closed"  #: closed (by either side): never used again


class _Stop(Exception):
    """Raised from a parser callback to stop the parse (the reason is kept on the connection)."""


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
    """One TCP connection to a backend: it feeds what it reads to llhttp, whose callbacks (the ``on_*``
    methods) fill the response being received. Its :class:`State` says where the exchange on it is."""

    __slots__ = (
        "_head_bytes",
        "_head_only",
        "_headers",
        "_keep",
        "_reason",
        "_since_chunk_head",
        "_until_close",
        "idle_since",
        "origin",
        "parser",
        "response",
        "state",
        "transport",
        "upstream",
    )

    def __init__(self, origin: Origin, upstream: Upstream) -> None:
        self.origin = origin
        self.upstream = upstream
        self.transport: asyncio.Transport | None = None
        self.response: Response | None = None
        self.state = State.IDLE
        self.idle_since = 0.0
        self.parser = httptools.HttpResponseParser(self)
        self._headers: list[tuple[str, str]] = []
        self._reason = ""
        self._head_bytes = 0
        self._head_only = False
        self._keep = True
        self._until_close = False
        self._since_chunk_head: int | None = None

    # ------------------------------------------------------------------ the pool's side
    def start(self, response: Response, message: bytes, head_only: bool) -> None:
        """Send a request (``message``, whole) whose answer ``response`` receives."""
        assert self.state is State.IDLE and self.transport is not None
        self.state = State.HEAD
        self.response = response
        self._headers = []
        self._reason = ""
        self._head_bytes = 0
        self._since_chunk_head = None
        self._head_only = head_only
        self.transport.write(message)

    def close(self) -> None:
        if self.state is not State.CLOSED:
            self.state = State.CLOSED
            if self.transport is not None:
                self.transport.close()

    def _end(self) -> None:
        """The response's body has ended: the connection goes back to the pool, or closes."""
        self.response = None
        if self.state is State.CLOSED:
            return
        if not self._keep:
            self.close()
            self.upstream._gone(self)
            return
        self.state = State.IDLE
        if self._head_only:  # llhttp would take the next bytes for the body the head announced
            self.parser = httptools.HttpResponseParser(self)
        self.upstream._release(self)

    def _fail(self, error: BaseException) -> None:
        """The exchange cannot go on: the response gets ``error``, the connection is closed."""
        response, self.response = self.response, None
        self.close()
        self.upstream._gone(self)
        if response is not None:
            response._fail(error)

    # ------------------------------------------------------------------ asyncio's side
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        state = self.state
        if state is State.HEAD:
            self._head_bytes += len(data)
        elif state is not State.BODY:  # nothing was asked: a server that talks out of turn is not reused
            self._fail(RemoteProtocolError("the backend sent bytes that were not asked for"))
            return
        elif (
            self._since_chunk_head is not None
        ):  # the last chunk's trailers, maybe (llhttp keeps their values)
            self._since_chunk_head += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(RemoteProtocolError("the backend switched protocols, which was not asked"))
            return
        except httptools.HttpParserError as exc:
            if self.state is not State.CLOSED:  # else a callback stopped the parse, and said why
                what = (
                    "a malformed response head" if self.state is State.HEAD else "a malformed response body"
                )
                self._fail(_protocol_error(what, exc))
            return
        if self.state is State.HEAD and self._head_bytes > MAX_HEAD:
            self._fail(RemoteProtocolError(f"a response head longer than {MAX_HEAD} bytes"))
        elif self.state is State.BODY and self._since_chunk_head and self._since_chunk_head > MAX_HEAD:
            self._fail(RemoteProtocolError(f"trailers longer than {MAX_HEAD} bytes after the last chunk"))

    def eof_received(self) -> bool:
        return False  # close the transport: a half-closed backend connection is of no further use

    def connection_lost(self, exc: Exception | None) -> None:
        state, self.state = self.state, State.CLOSED
        response, self.response = self.response, None
        self.upstream._gone(self)
        if response is None:
            return
        why = f" ({exc!r})" if exc else ""
        if state is State.BODY and self._until_close and exc is None:  # the connection's end is the body's
            response._finish()
        elif state is State.HEAD:
            response._fail(ReadError(f"the connection was closed before a response came{why}"))
        else:
            response._fail(ReadError(f"the connection was closed mid-body{why}"))

    # ------------------------------------------------------------------ llhttp's callbacks
    def _out_of_turn(self) -> None:
        """Bytes of a response that was not asked for (after a whole one): the connection is not reused."""
        self._fail(RemoteProtocolError("the backend sent a response that was not asked for"))
        raise _Stop

    def on_status(self, reason: bytes) -> None:
        if self.state is not State.HEAD:
            self._out_of_turn()
        self._reason = reason.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.state is State.HEAD:
            self._headers.append((name.decode("latin-1"), value.decode("latin-1")))
        # else: a trailer, skipped

    def on_headers_complete(self) -> None:
        if self.state is not State.HEAD:
            self._out_of_turn()
        response = self.response
        assert response is not None
        parser = self.parser
        status = parser.get_status_code()
        version = parser.get_http_version()
        if version not in ("1.1", "1.0"):
            self._fail(RemoteProtocolError(f"a response in HTTP/{version}, not HTTP/1.x"))
            raise _Stop
        if status == 101:
            self._fail(RemoteProtocolError("the backend switched protocols (101), which was not asked"))
            raise _Stop
        if status < 200:  # 1xx: another head follows (llhttp ends this one's message, bodiless)
            self._headers = []
            return
        headers: CIMultiDict[str] = CIMultiDict(self._headers)
        chunked = False
        if "Transfer-Encoding" in headers:
            codings = [c.strip().lower() for v in headers.getall("Transfer-Encoding") for c in v.split(",")]
            if codings != ["chunked"]:
                self._fail(
                    RemoteProtocolError(f"a transfer coding other than chunked: {', '.join(codings)!r}")
                )
                raise _Stop
            chunked = True
        length = headers.get("Content-Length")
        response.content_length = None if length is None else int(length)  # llhttp checked its digits
        response.status = status
        response.reason = self._reason
        response.headers = headers
        self._keep = parser.should_keep_alive()
        self.state = State.BODY
        self._until_close = (
            not chunked and length is None and status not in (204, 304) and not self._head_only
        )
        if self._until_close:
            self._keep = False
        response._wake()
        if self._head_only:
            response._finish()
            self._end()

    def on_chunk_header(self) -> None:
        self._since_chunk_head = 0

    def on_body(self, data: bytes) -> None:
        response = self.response
        if response is None:
            self._out_of_turn()
        self._since_chunk_head = None
        response._push(data)  # type: ignore[union-attr]

    def on_message_complete(self) -> None:
        if self.state is State.HEAD:
            return  # a 1xx head's end
        response = self.response
        if response is None:
            return  # a HEAD request's answer, ended at its head
        response._finish()
        self._end()


def _protocol_error(what: str, exc: httptools.HttpParserError) -> RemoteProtocolError:
    """The error for llhttp's refusal ``exc``, naming what it refused (an error of ours in a callback, kept as
    its context, is named too)."""
    reason = str(exc) or type(exc).__name__
    if exc.__context__ is not None and not isinstance(exc.__context__, _Stop):
        reason += f" ({exc.__context__!r})"
    return RemoteProtocolError(f"{what}: {reason}")


class Response:
    """A backend's response: its head once :meth:`Upstream.request` returns it, its body read as it comes.

    ``_conn`` is its connection until the body has ended (or failed); then ``None``."""

    __slots__ = (
        "_chunks",
        "_conn",
        "_deadline",
        "_error",
        "_loop",
        "_paused",
        "_unread",
        "_waiter",
        "content_length",
        "headers",
        "reason",
        "status",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, conn: _Connection) -> None:
        self._conn: _Connection | None = conn
        self._loop = loop
        self._chunks: list[bytes] = []
        self._unread = 0
        self._paused = False
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
        """The body bytes that have arrived (waiting for some), ``b""`` once the body has ended; raises the
        :class:`UpstreamError` (or :class:`TimeoutError`) that ended it early."""
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
            if self._conn is None:
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
        conn = self._conn
        if conn is not None:
            conn._fail(ReadError("the response was closed before its end"))
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

    def _settle(self) -> None:
        self._conn = None
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._wake()

    def _fail(self, error: BaseException) -> None:
        """The response cannot go on: ``error`` for whoever reads it (its connection is closed by the caller)."""
        if self._conn is not None:
            self._error = error
            self._settle()

    def _finish(self) -> None:
        conn = self._conn
        if self._paused and conn is not None and conn.transport is not None:
            self._paused = False  # the connection reads again: it goes back to the pool
            conn.transport.resume_reading()
        self._settle()

    def _expire(self) -> None:
        self._deadline = None
        conn = self._conn
        if conn is not None:
            conn._fail(TimeoutError("the backend did not finish within request_timeout"))

    def _push(self, data: bytes) -> None:
        self._chunks.append(data)
        self._unread += len(data)
        if self._unread > HIGH_WATER and not self._paused:
            conn = self._conn
            if conn is not None and conn.transport is not None:
                self._paused = True
                conn.transport.pause_reading()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


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
        ``request_timeout`` bounds the request to its body's end. Raises :class:`UpstreamError` (a subclass)
        or :class:`TimeoutError` when no well-formed head came, ``ValueError`` (before anything is sent) for a
        line break in a header or the target. Cancelled before the head, the connection is closed."""
        if self._closed:
            raise ConnectError("the upstream client is closed")
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
        response = Response(self.loop, conn)
        response._deadline = self.loop.call_at(self.loop.time() + self.request_timeout, response._expire)
        try:
            conn.start(response, message, method == "HEAD")
            while not response.status and response._error is None:
                await response._wait()
        except BaseException:
            response.close()
            raise
        if response._error is not None:  # nothing of it can have reached the agent: fail the request itself
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
            if conn.state is State.IDLE and now - conn.idle_since < self.keepalive:
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
            raise ConnectError(
                f"no connection to {origin.key} within connect_timeout={self.connect_timeout:g}s"
            ) from None
        except OSError as exc:
            raise ConnectError(f"cannot connect to {origin.key}: {exc}") from exc
        if self._closed:
            conn.close()
            raise ConnectError("the upstream client is closed")
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
        """Close every connection (idle or in use: what waits on them gets a :class:`ReadError`)."""
        self._closed = True
        self._idle.clear()
        for conn in list(self._all):
            conn._fail(ReadError("the proxy is shutting down"))
        self._all.clear()
        await asyncio.sleep(0)  # let the transports' connection_lost run
