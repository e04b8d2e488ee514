"""What can go wrong in an HTTP exchange, as types: each refusal the server makes itself is an :class:`HttpError`
subclass carrying its status and a message naming what the client did wrong.

Raised by the connection (a head the parser refuses, a head or a body past a limit, a head that takes too long, a
connection past the cap) and by :meth:`Exchange.body <aglverl.proxy.http.exchange.Exchange.body>` (a chunked body
that grows past the limit); the service renders each as the answer its clients read
(:meth:`Service.refusal <aglverl.proxy.http.service.Service.refusal>`). Pure: nothing here does I/O.
"""

from __future__ import annotations

__all__ = [
    "BadRequest",
    "BodyTooLarge",
    "ExpectationFailed",
    "HeadTimeout",
    "HeadTooLarge",
    "HttpError",
    "MethodNotAllowed",
    "NotImplementedCoding",
    "TooManyConnections",
    "UriTooLong",
    "VersionNotSupported",
]


class HttpError(Exception):
    """A request the server refuses before any handler saw it: ``status`` and a message naming the problem.

    ``headers``: what the answer carries besides (a 503's ``Retry-After``)."""

    status = 500

    def __init__(self, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}


class BadRequest(HttpError):
    """The bytes are not an HTTP/1.1 request the parser (llhttp) takes: a bare LF, a control byte, a malformed
    header, two lengths, an invalid chunk size..."""

    status = 400


class MethodNotAllowed(HttpError):
    """``CONNECT``, or an ``Upgrade`` with a body: the server speaks HTTP/1.1 requests and answers only."""

    status = 405


class HeadTimeout(HttpError):
    """A request's head did not arrive whole within the head timeout."""

    status = 408


class BodyTooLarge(HttpError):
    """A body longer than the server takes (its ``Content-Length``, or a chunked body as it grows)."""

    status = 413


class UriTooLong(HttpError):
    """A request target longer than a head line may be."""

    status = 414


class ExpectationFailed(HttpError):
    """An ``Expect`` other than ``100-continue``."""

    status = 417


class HeadTooLarge(HttpError):
    """Too many header lines, or a line too long (431: Request Header Fields Too Large)."""

    status = 431


class NotImplementedCoding(HttpError):
    """A transfer coding other than ``chunked`` (RFC 9112, 6.1: 501): nothing here would decode it."""

    status = 501


class TooManyConnections(HttpError):
    """A connection past the cap on open connections."""

    status = 503


class VersionNotSupported(HttpError):
    """A request of another HTTP version than 1.0 or 1.1."""

    status = 505
