"""Shedding at the socket: while the proxy is overloaded, a new call is turned away before aiohttp reads it.

A 429 decided in a handler costs the proxy most of what relaying a call costs in HTTP machinery alone: aiohttp
parses the request, makes its request object, routes it, runs a task for its handler, writes a response and
drains the body (a quarter of a whole call, ``benchmarks/RESULTS.md``). Past its capacity the proxy would then
spend its CPU refusing. :class:`Shedder` sits between the connection and aiohttp's protocol (it holds aiohttp's
:class:`~aiohttp.web_protocol.RequestHandler` and hands it every byte it does not take itself): while the proxy
sheds (:attr:`Overload.shedding <aglverl.proxy.overload.Overload.shedding>`), it reads the head of each request
that starts on an idle connection (the request line, ``Content-Length``), and a call of a rollout attempt that
is not under way, drawn in the share to turn away (:meth:`Overload.refuses
<aglverl.proxy.overload.Overload.refuses>`: the same decision the handler's path makes), gets a 429 written
straight to the socket, its body read past as it arrives, never parsed; everything else goes to aiohttp as it
came. The decision needs no byte of the body: as soon as a request's head is in, before its body is read.

What it answers is what :class:`~aglverl.proxy.overload.Overload` answers: ``Retry-After`` and a spread
``retry-after-ms``, the error in the agent's API (chat completions, Responses, Messages, any registered API);
the call is counted as rejected and shed. Only requests it can frame for certain are judged here: an attributed
route (``/rollout/{id}/attempt/{id}/v1/...``, ids without percent-escapes), HTTP/1.1, a ``Content-Length`` (or
no body), no ``Expect``, on a connection where aiohttp has no request in hand (its responses keep their order).
A connection whose framing it cannot follow (``Transfer-Encoding``, a head over 64 KiB) is handed to aiohttp
whole from then on; what it does not judge, the handler's admission judges the same way (unattributed
``/v1/...`` calls, calls that arrive while the proxy does not shed).

Its per-byte work when the proxy does not shed is one search for the end of each request's head and its
length: the framing it must know to find the next request.

It also serves, without aiohttp's server, the calls it can read for certain (``own_http_server``, on by
default): on a connection aiohttp has had nothing of, a request that :meth:`Inbound.read
<aglverl.proxy.inbound.Inbound.read>` takes (an attributed route, HTTP/1.1, a ``Content-Length`` within
``max_body_bytes``, clean headers) has its body read here and the proxy's handler run on it in a task of its own;
what arrives meanwhile waits its turn (pipelined requests are answered in order), reading pauses past 64 KiB of
it, the agent leaving cancels the call (as aiohttp cancels a handler), ``Connection: close`` closes after the
answer, and a connection idle for aiohttp's keep-alive (:data:`KEEPALIVE`, an hour, unless configured) since its
last answer, or since it opened, is closed. The first request this
does not take goes to aiohttp, which then has the connection to its end.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from typing import Any

from .api import APIS, Translator
from .call import ProxyError
from .gate import Gate
from .inbound import Inbound, InboundRequest, InboundWriter, internal_error
from .meters import Meters
from .overload import Overload

__all__ = ["Shedder"]

logger = logging.getLogger(__name__)

#: A head longer than this is not followed (aiohttp refuses heads past 8 KiB of a line anyway).
HEAD_LIMIT = 64 << 10
_ROLLOUT = b"/rollout/"
_ATTEMPT = b"/attempt/"
_V1 = b"/v1/"
#: What aiohttp's protocol must have for the shedder to know it holds no request (else nothing is shed here).
_IDLE_FIELDS = ("_request_in_progress", "_messages")
#: Seconds a connection whose calls are read here is kept idle, unless aiohttp's protocol says otherwise (its
#: ``keepalive_timeout``: the same bound for every connection, whoever reads its calls).
KEEPALIVE = 3630.0


class _Refusals:
    """The 429 bodies by the route after ``/v1/``, in its agent's API (the message fixed: its numbers would be
    the only per-call work)."""

    def __init__(self) -> None:
        self._bodies: dict[bytes, bytes] = {}

    def body(self, route: bytes) -> bytes:
        body = self._bodies.get(route)
        if body is None:
            found = APIS.match(route.decode("latin-1"))
            message = (
                "the LLM proxy is overloaded: the call was not forwarded; retry after the Retry-After delay"
            )
            body = ProxyError(429, message).body(Translator(*found) if found is not None else None)
            if len(self._bodies) < 64:  # routes are few; one with a path parameter is made anew past that
                self._bodies[route] = body
        return body


_REFUSALS = _Refusals()


class Shedder(asyncio.Protocol):
    """One connection's protocol: aiohttp's, behind the shedding of new calls, with the calls it can read for
    certain read and answered here (see the module docstring)."""

    __slots__ = (
        "_answered_at",
        "_body",
        "_drained",
        "_dropping",
        "_gate",
        "_handed",
        "_head",
        "_held",
        "_idle",
        "_inbound",
        "_inner",
        "_keepalive",
        "_lost",
        "_meters",
        "_overload",
        "_pending",
        "_reading_paused",
        "_remaining",
        "_serve",
        "_task",
        "_transport",
        "_write_paused",
    )

    def __init__(
        self, inner: Any, overload: Overload, gate: Gate, meters: Meters, serve: Inbound | None = None
    ) -> None:
        self._inner = inner
        self._overload = overload
        self._gate = gate
        self._meters = meters
        self._transport: Any = None  # asyncio's transport, or uvloop's (not a subclass of asyncio's)
        self._head = b""  # the start of a head not complete yet
        self._held = (
            False  # whether ``_head`` was kept from aiohttp (a call that may be refused or read here)
        )
        self._remaining = 0  # bytes of the current request still to come
        self._dropping = False  # they belong to a refused call: read past, not handed on
        self._lost = not all(hasattr(inner, name) for name in _IDLE_FIELDS)
        #: Which calls are read here, and their handler (``None``: aiohttp reads every call).
        self._serve = serve
        self._handed = False  # aiohttp has had bytes of this connection: it serves it to its end
        self._inbound: InboundRequest | None = None  # the call read here whose body is coming in
        self._body: list[bytes] = []
        self._task: asyncio.Task[None] | None = None  # the call read here being answered
        self._pending = b""  # what came while it is answered (a pipelined request)
        self._reading_paused = False
        self._write_paused = False
        self._drained: asyncio.Future[None] | None = None
        self._idle: asyncio.TimerHandle | None = None  # closes a connection idle since its last answer here
        self._answered_at = 0.0  # when the last call read here was answered, or the connection opened
        self._keepalive = KEEPALIVE  # aiohttp's keep-alive, once the connection is made

    # ------------------------------------------------------------------ asyncio.Protocol, handed on
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        inner = self._inner
        inner.connection_made(transport)
        if self._serve is not None and not self._lost:
            # Until aiohttp has a request of this connection, its idle close is this protocol's: aiohttp's own
            # timer (armed as the connection opens, and pushed back only by requests it serves) would otherwise
            # close a connection whose calls are read here, however busy, once its keep-alive ran out.
            self._keepalive = float(getattr(inner, "_keepalive_timeout", KEEPALIVE))
            handle = getattr(inner, "_keepalive_handle", None)
            if handle is not None:
                handle.cancel()
                inner._keepalive_handle = None
            self._answered_at = time.monotonic()
            self._idle = asyncio.get_running_loop().call_later(self._keepalive, self._idle_check)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._task is not None:
            self._task.cancel()  # the agent left: its call is cancelled, as aiohttp cancels a handler
        if self._idle is not None:
            self._idle.cancel()
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(ConnectionResetError("the agent's connection was lost"))
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._write_paused = True
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None
        self._inner.resume_writing()

    def eof_received(self) -> bool | None:
        if self._held and self._head:
            self._hand(self._head)  # what was kept back goes on: aiohttp answers the half request
            self._head, self._held = b"", False
        return self._inner.eof_received()

    # ------------------------------------------------------------------ the bytes
    def data_received(self, data: bytes) -> None:
        if self._lost:
            self._inner.data_received(data)
            return
        if self._task is not None:  # a call read here is being answered: what follows waits its turn
            self._pending += data
            if len(self._pending) > HEAD_LIMIT and not self._reading_paused:
                self._reading_paused = True
                self._transport.pause_reading()
            return
        while data:
            if self._remaining:  # the body of the current request
                n = self._remaining
                part, data = (data, b"") if len(data) <= n else (data[:n], data[n:])
                self._remaining -= len(part)
                if self._inbound is not None:
                    self._body.append(part)
                    if not self._remaining:
                        self._start_here()
                elif not self._dropping:
                    self._inner.data_received(part)
                elif not self._remaining:
                    self._dropping = False
            else:
                data = self._request(data)
            if self._task is not None:
                self._pending = data
                return

    def _hand(self, data: bytes) -> None:
        """Hand ``data`` to aiohttp, which from now on serves this connection's requests."""
        self._handed = True
        self._inner.data_received(data)

    def _request(self, data: bytes) -> bytes:
        """Take a request starting at ``data`` (after a kept start of its head): judge it when its head is in;
        returns what follows it in ``data`` (a pipelined request), handing on or dropping the rest."""
        before, held = self._head, self._held
        buf = before + data if before else data
        fresh = held or not before  # aiohttp has had none of this request: it may still be refused
        reads_here = self._serve is not None and not self._handed
        end = buf.find(b"\r\n\r\n")
        if end < 0:  # the head is not complete yet
            if len(buf) > HEAD_LIMIT:
                return self._give_up(buf if held else data)
            keep = fresh and (reads_here or self._overload.shedding)
            if not keep:  # handed on; a copy is kept only to find the request's length
                self._hand(buf if held else data)
            self._head, self._held = buf, keep
            return b""
        self._head, self._held = b"", False
        head = buf[: end + 4]
        length = _length(head)
        if length is None:
            return self._give_up(buf if held else data)
        total = end + 4 + length
        upto = min(total, len(buf))
        if fresh and self._overload.shedding and self._refuse(head):
            self._remaining = total - upto
            self._dropping = self._remaining > 0
            return buf[upto:]
        if fresh and reads_here and (request := self._serve.read(head, length)) is not None:  # type: ignore[union-attr]
            self._inbound = request
            self._body = [buf[end + 4 : upto]] if upto > end + 4 else []
            self._remaining = total - upto
            if not self._remaining:
                self._start_here()
            return buf[upto:]
        mine = buf if held else data  # what aiohttp has not had yet, from where it starts in ``buf``
        self._hand(mine[: upto - (len(buf) - len(mine))])
        self._remaining = total - upto
        return buf[upto:]

    # ------------------------------------------------------------------ calls read here
    def _start_here(self) -> None:
        """The call read here has its whole body: its handler runs in a task of its own."""
        request, self._inbound = self._inbound, None
        assert request is not None
        body, self._body = self._body, []
        request._body = body[0] if len(body) == 1 else b"".join(body)
        request._payload_writer = InboundWriter(self)
        request.transport = self._transport
        self._task = asyncio.get_running_loop().create_task(self._serve_here(request))

    async def _serve_here(self, request: InboundRequest) -> None:
        serve, writer = self._serve, request._payload_writer
        assert serve is not None and writer is not None
        keep = False
        try:
            response = await serve.handler(request, request.rollout_id, request.attempt_id, request.target)
            if request.answered:  # written whole already (:meth:`InboundRequest.send_whole`)
                keep = request.keep_alive
            else:
                await response.prepare(request)
                await response.write_eof()
                keep = bool(response.keep_alive) and request.keep_alive
        except (asyncio.CancelledError, ConnectionError):
            pass  # the agent left (or the proxy is closing): the connection goes
        except Exception as exc:
            logger.exception("proxy failure answering %s %s", request.method, request.path)
            if not writer.sent and not self._transport.is_closing():
                self._transport.write(internal_error(f"internal proxy error: {exc!r}"))
        finally:
            self._task = None
            self._after(keep)

    def _after(self, keep: bool) -> None:
        """A call read here was answered: the connection goes on to what came meanwhile, waits idle, or ends."""
        transport = self._transport
        if not keep or transport.is_closing():
            self._pending = b""
            transport.close()
            return
        if self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
        data, self._pending = self._pending, b""
        if data:
            self.data_received(data)
        self._answered_at = time.monotonic()
        if self._idle is None and not transport.is_closing():
            self._idle = asyncio.get_running_loop().call_later(self._keepalive, self._idle_check)

    def _idle_check(self) -> None:
        """Close the connection once it has been idle for the keep-alive since its last answer here, or since it
        opened (one timer per connection, looked at when it fires rather than re-armed per call)."""
        self._idle = None
        if self._task is not None or self._remaining or self._head or self._handed:
            return  # busy (its end arms the timer again), or aiohttp's to close
        left = self._answered_at + self._keepalive - time.monotonic()
        if left > 0:
            self._idle = asyncio.get_running_loop().call_later(left, self._idle_check)
        else:
            self._transport.close()

    def write(self, data: bytes) -> None:
        """Write to the agent (what :class:`~aglverl.proxy.inbound.InboundWriter` writes through)."""
        transport = self._transport
        if transport.is_closing():
            raise ConnectionResetError("the agent's connection is closed")
        transport.write(data)

    async def drain(self) -> None:
        """Wait while the agent's socket is full."""
        if self._write_paused:
            if self._drained is None:
                self._drained = asyncio.get_running_loop().create_future()
            await self._drained

    def _give_up(self, rest: bytes) -> bytes:
        """Framing this connection's requests is past what is followed here: aiohttp gets everything."""
        self._lost = True
        self._head, self._held = b"", False
        self._hand(rest)
        return b""

    def _refuse(self, head: bytes) -> bool:
        """Whether the request of ``head`` is a new call to turn away now (see the module docstring); answers it
        when it is."""
        inner = self._inner
        if inner._request_in_progress or inner._messages:
            return False  # aiohttp holds a request here: an answer now would overtake its answer
        line = head[: head.find(b"\r\n")]
        parts = line.split(b" ")
        if len(parts) != 3 or parts[2] != b"HTTP/1.1" or not parts[1].startswith(_ROLLOUT):
            return False
        path = parts[1]
        at = path.find(_ATTEMPT, len(_ROLLOUT))
        v1 = path.find(_V1, at + len(_ATTEMPT)) if at > 0 else -1
        if v1 < 0 or b"%" in path[:v1]:
            return False
        lower = head.lower()
        if b"\r\nexpect:" in lower:
            return False
        rollout_id = path[len(_ROLLOUT) : at].decode("latin-1")
        attempt_id = path[at + len(_ATTEMPT) : v1].decode("latin-1")
        if not self._overload.refuses(self._gate.in_flight, rollout_id, attempt_id):
            return False
        self._answer(path[v1 + len(_V1) :].split(b"?", 1)[0], b"\r\nconnection: close\r\n" in lower)
        return True

    def _answer(self, route: bytes, close: bool) -> None:
        """Write the 429 for a refused call to ``route`` (after ``/v1/``) and count it."""
        body = _REFUSALS.body(route)
        policy = self._overload.policy
        delay = policy.retry_after * random.uniform(0.5, 1.5)
        answer = b"".join(
            (
                b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nContent-Length: ",
                str(len(body)).encode(),
                b"\r\nRetry-After: ",
                str(math.ceil(policy.retry_after)).encode(),
                b"\r\nretry-after-ms: ",
                str(round(delay * 1e3)).encode(),
                b"\r\nConnection: close\r\n\r\n" if close else b"\r\n\r\n",
                body,
            )
        )
        self._meters.calls.inc(1, "rejected")
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.write(answer)
            if close:
                transport.close()


def _length(head: bytes) -> int | None:
    """The body length a request head announces (0 without one); ``None``: framing not followed here
    (``Transfer-Encoding``, or a length that is not a number). The usual spellings are looked for as they are;
    only a head that has neither is lowered (per call, this is the shedder's work when it does not shed)."""
    if b"ransfer-" in head or b"RANSFER-" in head:  # Transfer-Encoding, as any client spells it
        return None
    at = head.find(b"\r\nContent-Length:")
    if at < 0:
        at = head.find(b"\r\ncontent-length:")
        if at < 0:
            at = head.lower().find(b"\r\ncontent-length:")
            if at < 0:
                return 0
    value = head[at + 17 : head.find(b"\r\n", at + 17)].strip()
    return int(value) if value.isdigit() else None
