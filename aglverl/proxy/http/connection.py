"""One client connection: llhttp parses, the service admits each request at its head, exchanges run in order.

:class:`Connection` is the asyncio protocol of one accepted socket. It never parses: every byte read goes to
``httptools.HttpRequestParser`` (llhttp, strict: a bare LF, a control byte in a header, a malformed length or chunk
size, ``Content-Length`` with ``Transfer-Encoding`` are refused), whose callbacks build each request's
:class:`~aglverl.proxy.http.exchange.Exchange`:

- ``on_url`` / ``on_header``: the target and the headers, each line held to the limits (:mod:`.limits`) as it
  grows; a head (and a chunked body's trailer section) that comes a few bytes at a time is also measured per
  read, so a line past the limit is refused before it is whole (llhttp keeps its place: no byte is parsed twice).
- ``on_headers_complete``: the head is whole and no body byte has been read. The target is parsed as a URL (the
  path without query or fragment is what the service routes on), the version, ``Expect`` and ``Upgrade`` checked,
  then the service admits the request (:meth:`Service.admit <aglverl.proxy.http.service.Service.admit>`) or
  refuses it with an answer, and a body longer than the limit is refused (413). A refused request's body is
  never kept: its answer goes out as soon as the requests before it were answered, and the connection is then
  closed unless the body had already arrived whole.
- ``on_body`` / ``on_message_complete``: the body, handed to the exchange.

Requests run one at a time, in the order they came (HTTP/1.1 pipelining): the first one's body is read (after a
``100 Continue`` when its client asked for one), then its handler runs in a task of its own (:meth:`Service.respond
<aglverl.proxy.http.service.Service.respond>`); those behind it wait, and reading pauses while one waits
(:class:`~aglverl.proxy.http.flow.Flow`). When a handler ends, the next request starts, or the connection waits
for one, or closes (the client or the answer said ``close``, the request was not read whole, the server stops).

State (:class:`State`, changed in a few named places) and its deadline, one timer per connection, re-armed
only when it fires early or a nearer deadline comes: ``IDLE`` waits at most ``idle_timeout`` for a request
(then closed, unanswered), ``HEAD`` at most ``head_timeout`` for the rest of a head (then 408), ``BODY`` at most
``head_timeout`` between two reads of the body of the request whose turn it is (then its handler answers 408),
``BUSY`` runs a handler (no deadline: the handler has its own), ``CLOSING`` wrote its last answer: its write side
is shut and what the client still sends is read and dropped, unparsed, until the client closes or :data:`LINGER`
seconds passed, so that the client reads the answer before the socket goes (closing a socket with unread bytes
resets the connection, and the reset can destroy the answer in flight).

Errors: a request the parser refuses, a limit passed, a head timed out are
:class:`~aglverl.proxy.http.errors.HttpError` types, each answered once (:meth:`Service.refusal
<aglverl.proxy.http.service.Service.refusal>`), in order after the answers before it, and the connection closed; a body that breaks after its head was admitted
fails that exchange's :meth:`~aglverl.proxy.http.exchange.Exchange.body` (its handler answers). A handler that
raises gets a 500 when its answer had not started, and the connection closed otherwise. Cancellation: the client
leaving (or half-closing: as uvicorn and aiohttp, the server takes it for gone) cancels the handler whose answer
is under way, and wakes whatever waits on its socket; a request whose body had not all come never started one.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import httptools

from .errors import (
    BadRequest,
    BodyTooLarge,
    ExpectationFailed,
    HeadTimeout,
    HeadTooLarge,
    HttpError,
    MethodNotAllowed,
    NotImplementedCoding,
    TooManyConnections,
    UriTooLong,
    VersionNotSupported,
)
from .exchange import Answer, Exchange
from .flow import Flow
from .limits import Limits
from .service import Service

__all__ = ["LINGER", "Connection", "Site", "State"]

logger = logging.getLogger(__name__)

#: Seconds a closing connection keeps reading (and dropping) what its client still sends, at most.
LINGER = 2.0
_INTERNAL_ERROR = "internal server error: {!r}"
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
#: Headers a request holds once at most (lower case): two are ambiguous (which host, which type, which
#: credential?), refused as aiohttp refuses them (llhttp itself refuses a second ``Content-Length``).
_SINGLE = frozenset(
    (
        "host",
        "transfer-encoding",
        "content-type",
        "content-location",
        "content-range",
        "etag",
        "max-forwards",
        "server",
        "user-agent",
        "authorization",
    )
)


class State(enum.Enum):
    """Where a connection is (see the module docstring)."""

    IDLE = "idle"
    HEAD = "head"
    BODY = "body"
    BUSY = "busy"
    CLOSING = "closing"
    CLOSED = "closed"


class Site:
    """What the connections of one server share: the service, the limits, the open connections, the handlers'
    tasks, and whether the server is stopping."""

    __slots__ = ("connections", "limits", "on_close", "service", "stopping", "tasks")

    def __init__(self, service: Service, limits: Limits) -> None:
        self.service = service
        self.limits = limits
        self.connections: set[Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.stopping = False
        #: Called when a connection is lost (the server's wait for every connection to close).
        self.on_close: Callable[[], None] | None = None


class Connection(asyncio.Protocol):
    """The protocol of one client connection (see the module docstring)."""

    def __init__(self, site: Site) -> None:
        self._site = site
        self._limits = site.limits
        self._loop = asyncio.get_running_loop()
        self._transport: Any = None  # asyncio's transport, or uvloop's (not a subclass of asyncio's)
        self._flow: Flow | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._state = State.IDLE
        self._since = 0.0  # when the state's deadline started running
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        # the request being parsed
        self._reading: Exchange | None = None
        self._in_head = False
        self._url = b""
        self._lines = 0
        self._line = 0  # bytes of the head line being read, as far as reads tell
        self._began = False  # a request began in the read being parsed
        self._trailing = False  # a chunk's size line was read, and none of its data yet (or trailers come)
        self._past_request_line = False  # a line end of the head being read was seen
        self._single: set[str] = set()  # the headers of :data:`_SINGLE` the head being read holds
        # the requests read: the one whose turn it is (its body coming, or its handler running), those waiting
        self._active: Exchange | None = None
        self._task: asyncio.Task[None] | None = None
        self._pipeline: deque[Exchange] = deque()
        self._dead = False  # nothing more is parsed (the parser refused, or the connection closes)
        self._eof = False  # the client sends no more

    @property
    def state(self) -> State:
        return self._state

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._flow = Flow(transport)
        connections = self._site.connections
        full = len(connections) >= self._limits.max_connections
        connections.add(self)  # every open one, a refused one lingering too: each holds a socket
        if full:
            cap = self._limits.max_connections
            self._refuse_connection(
                TooManyConnections(
                    f"the server has {cap} connections open, its limit (max_connections): retry shortly",
                    {"Retry-After": "1"},
                )
            )
            return
        self._enter(State.IDLE)

    def connection_lost(self, exc: Exception | None) -> None:
        self._state = State.CLOSED
        self._dead = True
        site = self._site
        site.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        assert self._flow is not None
        self._flow.lose()
        active = self._active
        if active is not None and not active.finished and self._task is not None:
            self._task.cancel()  # the client left: its call is cancelled
        self._pipeline.clear()
        self._reading = None
        if site.on_close is not None:
            site.on_close()

    def eof_received(self) -> bool:
        """The client sends no more: the connection closes (as uvicorn's and aiohttp's do: an HTTP client that
        half-closes has gone), which cancels a handler under way."""
        self._eof = True
        return False

    def pause_writing(self) -> None:
        assert self._flow is not None
        self._flow.pause_writing()

    def resume_writing(self) -> None:
        assert self._flow is not None
        self._flow.resume_writing()

    def data_received(self, data: bytes) -> None:
        if self._dead:
            return  # closing (lingering), or the parser refused: dropped unread
        state = self._state
        if state is State.IDLE:  # its deadline is armed only if the head does not come whole at once
            self._state = State.HEAD
            self._since = self._loop.time()
        elif state is State.BODY:
            self._since = self._loop.time()  # the body's deadline runs from its last read
        between = self._reading is None
        self._began = False
        try:
            self._feed(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, HttpError):
                self._fail(cause)
            else:
                logger.error("HTTP server: a parser callback failed", exc_info=cause)
                self._fail(HttpError(_INTERNAL_ERROR.format(cause)))
        except httptools.HttpParserError as exc:
            self._fail(BadRequest(f"malformed HTTP/1.1 request: {exc}"))
        else:
            if self._in_head:
                self._watch_head(data, between)
            elif self._trailing:
                self._watch_line(data)
        self._advance()

    def _feed(self, data: bytes) -> None:
        parser = self._parser
        while True:
            try:
                parser.feed_data(data)
                return
            except httptools.HttpParserUpgrade as exc:
                # An Upgrade without a body, answered as HTTP/1.1 (RFC 9110, 7.8: a server may ignore it); the
                # parser stopped at the end of its head and goes on from there.
                data = data[exc.args[0] :]
                if not data:
                    return

    def _watch_head(self, data: bytes, between: bool) -> None:
        """Measure the head line being read from this read (llhttp reports a header line only once whole):
        past the limit, a 414 (the request line) or a 431 now. A head that began in a read after the end of the
        request before it (a pipelined one) is measured from the next read on."""
        if self._began and not between:
            self._line = 0
        elif self._watch_line(data):
            return
        if self._state is State.HEAD:
            self._arm()

    def _watch_line(self, data: bytes) -> bool:
        """Add this read to the measure of the head (or trailer) line being read; past the limit, fail and
        return ``True``."""
        newline = data.rfind(b"\n")
        if newline < 0:
            self._line += len(data)
        else:
            self._line = len(data) - newline - 1
            self._past_request_line = True
        limit = self._limits.max_line_bytes
        if self._line <= limit:
            return False
        if self._past_request_line:
            self._fail(HeadTooLarge(f"a request head line is longer than {limit} bytes"))
        else:
            self._fail(UriTooLong(f"request line longer than {limit} bytes"))
        return True

    # ------------------------------------------------------------------ parser callbacks
    def on_message_begin(self) -> None:
        self._reading = Exchange(self, self._limits.max_body_bytes)
        self._in_head = True
        self._began = True
        self._url = b""
        self._lines = 0
        self._line = 0
        self._past_request_line = False
        self._single.clear()

    def on_url(self, url: bytes) -> None:
        if self._url:
            url = self._url + url
        if len(url) > self._limits.max_line_bytes:
            raise UriTooLong(f"request target longer than {self._limits.max_line_bytes} bytes")
        self._url = url

    def on_header(self, name: bytes, value: bytes) -> None:
        limits = self._limits
        self._lines += 1
        if self._lines > limits.max_header_lines:
            raise HeadTooLarge(f"more than {limits.max_header_lines} header lines")
        if len(name) + len(value) + 2 > limits.max_line_bytes:
            shown = name[:64].decode("latin-1")
            raise HeadTooLarge(f"header line {shown!r} is longer than {limits.max_line_bytes} bytes")
        if not self._in_head:
            return  # a trailer of a chunked body: counted, not kept
        exchange = self._reading
        assert exchange is not None
        text = name.decode("latin-1")
        lowered = text.lower()
        if lowered in _SINGLE:
            if lowered in self._single:
                raise BadRequest(f"two {text!r} headers: a request has one")
            self._single.add(lowered)
        exchange.headers.add(text, value.decode("utf-8", "surrogateescape"))

    def on_headers_complete(self) -> None:
        exchange = self._reading
        assert exchange is not None
        self._read_head(exchange)
        site = self._site
        answer = site.service.admit(exchange)
        length = exchange.content_length
        if answer is None and length is not None and length > self._limits.max_body_bytes:
            limit = self._limits.max_body_bytes
            error = BodyTooLarge(f"request body of {length} bytes exceeds the limit of {limit} bytes")
            answer = site.service.refusal(error, exchange)
        exchange.answer = answer
        self._in_head = False  # from here on, what fails is the body's: its request has its turn in line
        self._pipeline.append(exchange)

    def _read_head(self, exchange: Exchange) -> None:
        """Fill in what the head says (raises :class:`HttpError` for a head the server does not serve)."""
        parser = self._parser
        version = parser.get_http_version()
        if version != "1.1" and version != "1.0":
            if version == "0.9":  # llhttp's reading of a request line without a version after its target
                raise BadRequest("malformed request line: the target is not followed by ' HTTP/1.1'")
            raise VersionNotSupported(f"HTTP/{version} is not served: use HTTP/1.1")
        if version == "1.1" and "host" not in self._single:
            raise BadRequest("an HTTP/1.1 request needs a Host header (RFC 9112, 3.2)")
        exchange.version = version
        exchange.method = parser.get_method().decode("ascii")
        exchange.keep_alive = parser.should_keep_alive()
        url = self._url
        try:
            parsed = httptools.parse_url(url)
        except httptools.HttpParserInvalidURLError:
            raise BadRequest(f"request target {url[:200]!r} is not a URL") from None
        exchange.target = url.decode("latin-1")
        exchange.path = parsed.path.decode("latin-1")
        query = parsed.query
        exchange.query = query.decode("latin-1") if query else ""
        headers = exchange.headers
        length = headers.get("Content-Length")
        if length is not None:
            exchange.content_length = int(length)  # llhttp took it: digits, one value
        coding = headers.get("Transfer-Encoding")
        if coding is not None:
            if coding.strip().lower() != "chunked":  # llhttp frames it; what else it codes, nothing decodes
                raise NotImplementedCoding(f"Transfer-Encoding {coding[:100]!r}: only chunked is served")
            exchange.chunked = True
        if parser.should_upgrade():
            if exchange.method == "CONNECT":
                raise MethodNotAllowed("CONNECT is not served: this server answers HTTP/1.1 requests")
            if exchange.chunked or exchange.content_length:
                raise MethodNotAllowed(
                    "an Upgrade request with a body is not served: send it without Upgrade"
                )
        expect = headers.get("Expect")
        if expect is not None:
            if expect.strip().lower() != "100-continue":
                raise ExpectationFailed(f"Expect: {expect[:100]!r} cannot be met (only 100-continue)")
            exchange.expect_continue = version == "1.1"

    def on_body(self, body: bytes) -> None:
        self._trailing = False
        exchange = self._reading
        assert exchange is not None
        exchange.feed_body(body)

    def on_chunk_header(self) -> None:
        # Until a byte of its data comes, what follows a chunk's size line may be the trailer section (after
        # the last, empty chunk): measured as a head is, since llhttp reports a trailer line only once whole.
        self._trailing = True
        self._line = 0
        self._past_request_line = True

    def on_chunk_complete(self) -> None:
        self._trailing = False

    def on_message_complete(self) -> None:
        self._trailing = False
        exchange, self._reading = self._reading, None
        assert exchange is not None
        exchange.end_body()

    # ------------------------------------------------------------------ running the exchanges
    def _advance(self) -> None:
        """Go on with the requests read: the one whose turn it is starts its handler once its body is whole;
        else the next one takes its turn (a refusal is written at once, and the connection goes on or closes).
        Reading pauses while a request waits behind another."""
        flow = self._flow
        assert flow is not None
        active = self._active
        if active is not None:
            if self._task is None and active.ready:
                self._begin(active)
            if self._pipeline:
                flow.pause_reading()
            return
        while self._pipeline and self._state is not State.CLOSING:
            exchange = self._pipeline.popleft()
            answer = exchange.answer
            if answer is None:
                self._take_turn(exchange)
                return
            self._write_refusal(exchange, answer)
            if not exchange.keep_alive:
                self._close()
                return
        if self._state is State.CLOSING:
            return
        if self._dead:
            self._close()
            return
        waiting = State.HEAD if self._in_head else State.IDLE
        if (
            self._state is not waiting
        ):  # no request runs: the connection waits for its next (or the rest of it)
            self._enter(waiting)
        flow.resume_reading()

    def _take_turn(self, exchange: Exchange) -> None:
        """``exchange``'s turn: its handler starts now if its body is in, else once it is."""
        assert self._flow is not None
        self._active = exchange
        if exchange.ready:
            self._begin(exchange)
        else:
            self._enter(State.BODY)
            if exchange.expect_continue:
                self.write(_CONTINUE)
        if self._pipeline:
            self._flow.pause_reading()
        else:
            self._flow.resume_reading()

    def _begin(self, exchange: Exchange) -> None:
        self._enter(State.BUSY)
        task = self._loop.create_task(self._run(exchange))
        self._task = task
        tasks = self._site.tasks
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _run(self, exchange: Exchange) -> None:
        """Run the service's handler for ``exchange``, then go on with the connection."""
        try:
            await self._site.service.respond(exchange)
            if not exchange.started:
                raise RuntimeError("the handler returned without answering")
        except (asyncio.CancelledError, ConnectionError):
            pass  # the client left, or the server stops: the connection goes
        except Exception as exc:
            logger.exception("HTTP server: the handler of %s %s failed", exchange.method, exchange.path)
            if not exchange.started and not self._transport.is_closing():
                exchange.keep_alive = False
                answer = self._site.service.refusal(HttpError(_INTERNAL_ERROR.format(exc)), exchange)
                self._write_refusal(exchange, answer)
        finally:
            self._task = None
            self._done(exchange)

    def _done(self, exchange: Exchange) -> None:
        """The handler of the request under way ended: next request, idle wait, or close."""
        if self._state is State.CLOSED or self._state is State.CLOSING:
            return
        self._active = None
        if not (exchange.finished and exchange.keep_alive and exchange.complete) or self._site.stopping:
            self._close()
            return
        self._advance()

    def _write_refusal(self, exchange: Exchange, answer: Answer) -> None:
        try:
            exchange.write_answer(answer.status, answer.headers, answer.body, answer.reason)
        except ConnectionError:
            pass

    def _fail(self, error: HttpError) -> None:
        """The parser refused what came, or a limit or the head deadline was passed: nothing more is parsed; a
        request whose head was admitted fails its body, any other gets ``error``'s answer in its turn."""
        self._dead = True
        assert self._flow is not None
        self._flow.pause_reading()
        exchange, self._reading = self._reading, None
        if exchange is not None and not self._in_head:
            exchange.fail_body(error)  # admitted (or refused) at its head: its handler answers
            return
        self._in_head = False
        if exchange is None:
            exchange = Exchange(self, 0)
        exchange.keep_alive = False
        exchange.answer = self._site.service.refusal(error, exchange)
        self._pipeline.append(exchange)

    def _refuse_connection(self, error: HttpError) -> None:
        exchange = Exchange(self, 0)
        exchange.keep_alive = False
        self._write_refusal(exchange, self._site.service.refusal(error, exchange))
        self._close()

    def _close(self) -> None:
        """Close after what was written: at once when the client is done sending, else lingering (see the
        module docstring)."""
        if self._state is State.CLOSING or self._state is State.CLOSED:
            return
        transport = self._transport
        self._dead = True
        if self._eof or transport.is_closing():
            self._state = State.CLOSING
            transport.close()
            return
        self._enter(State.CLOSING)
        assert self._flow is not None
        self._flow.resume_reading()  # what still comes is read, and dropped
        try:
            transport.write_eof()
        except (OSError, RuntimeError, NotImplementedError):
            transport.close()

    # ------------------------------------------------------------------ the deadline
    def _enter(self, state: State) -> None:
        self._state = state
        self._since = self._loop.time()
        self._arm()

    def _deadline(self) -> float | None:
        state = self._state
        if state is State.IDLE:
            return self._since + self._limits.idle_timeout
        if state is State.HEAD or state is State.BODY:
            return self._since + self._limits.head_timeout
        if state is State.CLOSING:
            return self._since + LINGER
        return None

    def _arm(self) -> None:
        deadline = self._deadline()
        if deadline is None:
            return
        timer = self._timer
        if timer is not None:
            if self._timer_at <= deadline:
                return  # it fires first, and is re-armed then
            timer.cancel()
        self._timer_at = deadline
        self._timer = self._loop.call_at(deadline, self._on_deadline)

    def _on_deadline(self) -> None:
        self._timer = None
        deadline = self._deadline()
        if deadline is None:
            return  # busy: armed again when the exchange ends
        if self._loop.time() < deadline:
            self._arm()
            return
        state = self._state
        seconds = self._limits.head_timeout
        if state is State.HEAD:
            self._fail(HeadTimeout(f"the request head did not arrive whole within {seconds:g} s"))
            self._advance()
        elif state is State.BODY:
            active = self._active
            assert active is not None
            active.fail_body(HeadTimeout(f"the request body stopped arriving for {seconds:g} s"))
            self._dead = True
            self._advance()
        elif state is State.CLOSING:
            self._transport.abort()  # done lingering: what a client that reads nothing left unread goes too
        else:
            self._state = State.CLOSING
            self._dead = True
            self._transport.close()  # idle past the keep-alive

    # ------------------------------------------------------------------ the exchanges' wire
    @property
    def closing(self) -> bool:
        """Whether the connection closes after the answer under way (the server stops)."""
        return self._site.stopping

    def write(self, data: bytes) -> None:
        transport = self._transport
        if transport.is_closing():
            raise ConnectionResetError("the client's connection is closed")
        transport.write(data)

    async def drain(self) -> None:
        assert self._flow is not None
        await self._flow.drain()

    def abort(self) -> None:
        self._dead = True
        self._state = State.CLOSING
        self._transport.close()

    def shutdown(self) -> None:
        """The server stops: an idle connection (or one in the middle of a head) closes now, a busy one after
        its answer."""
        if self._active is None and self._state is not State.CLOSED:
            self._dead = True
            self._state = State.CLOSING
            self._transport.close()
