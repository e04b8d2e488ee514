"""The proxy's HTTP/1.1 server: one per socket, on llhttp (``httptools``), shaped as uvicorn's ``httptools_impl``.

Every request on the proxy's socket goes through it (attributed or not, HTTP/1.0, ``HEAD``, ``Expect:
100-continue``, chunked bodies); no parsing is written here, only the protocol around the parser. Its parts, one
module each, each holding the next:

- :mod:`.server` — :class:`HttpServer` (bind, accept, stop); :mod:`.service` — :class:`Service`, what it serves:
  a request admitted or refused at its head, answered in a task, the server's own refusals spelled by it;
- :mod:`.connection` — :class:`~aglverl.proxy.http.connection.Connection`, the asyncio protocol of one
  connection: parser callbacks, the head checked against the limits, admission before the body, the queue of
  pipelined requests, the idle and head deadlines, the close;
- :mod:`.exchange` — :class:`Exchange`, one request and its answer: what a handler reads (method, target, path,
  query, headers, body) and writes (``send_whole``; ``start``, ``write``, ``end``), the answer's framing;
- :mod:`.flow` — pausing reading and writing, and the wait for a full socket to drain;
- :mod:`.limits` — :class:`Limits`, the bounds (header lines, line length, head and idle timeouts, connections,
  body), and :mod:`.errors`, the refusals as types (:class:`HttpError` and one subclass per status).

It imports nothing of the proxy (the proxy's parts import it).
"""

from __future__ import annotations

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
from .limits import Limits
from .server import HttpServer
from .service import Service

__all__ = [
    "Answer",
    "BadRequest",
    "BodyTooLarge",
    "Exchange",
    "ExpectationFailed",
    "HeadTimeout",
    "HeadTooLarge",
    "HttpError",
    "HttpServer",
    "Limits",
    "MethodNotAllowed",
    "NotImplementedCoding",
    "Service",
    "TooManyConnections",
    "UriTooLong",
    "VersionNotSupported",
]
