"""Listening sockets and aiohttp start-up for the daemon's HTTP servers.

:func:`bind_listener` makes the listening socket every server here uses (uvicorn's, aiohttp's and the LLM proxy's
own alike); :class:`HttpListener` serves one aiohttp application on such a socket, and is the one place the two
aiohttp servers (the embedded inference server, the mock vLLM) start and stop: bind, set up the runner,
start the site; on the way out stop accepting, give in-flight handlers a grace period, cancel the rest, close.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Collection
from typing import Any

import anyio
from aiohttp import web

__all__ = ["HttpListener", "bind_listener", "is_loopback", "refuse_open_address", "url_of"]

#: Pending connections the kernel keeps per listener; several hundred agents may connect at once.
BACKLOG = 4096


def bind_listener(host: str, port: int) -> socket.socket:
    """A non-blocking TCP listener on ``host:port`` (``port=0``: an ephemeral port).

    The socket is created with ``IPPROTO_TCP`` explicitly: servers set ``TCP_NODELAY`` on accepted
    connections only when the listener's protocol says TCP, and without it every small response waits
    ~40 ms for Nagle + delayed ACK (measured on this kind of machine).
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    family, socktype, proto, _, addr = infos[0]
    sock = socket.socket(family, socktype, proto or socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``); a name that is not an address is not."""
    if host.strip("[]").lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def refuse_open_address(host: str, token: str | None, *, allow_unauthenticated: bool, keys: str) -> None:
    """``ValueError`` for serving on ``host`` without a token when it is not a loopback address, unless
    ``allow_unauthenticated`` (``keys`` names the settings, for the message): anyone who reaches the address could
    otherwise queue work, post results and read every rollout."""
    if token or allow_unauthenticated or is_loopback(host):
        return
    raise ValueError(
        f"refusing to serve on {host!r} without a token: anyone who reaches that address could queue work, post "
        f"rewards and read every rollout; set a token, bind a loopback address, or, if the network is yours alone, "
        f"ask for it explicitly ({keys})"
    )


def url_of(sock: socket.socket) -> str:
    """``http://host:port`` of a bound listener (IPv6 hosts in brackets)."""
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


class HttpListener:
    """One aiohttp application served on a :func:`bind_listener` socket, on the running asyncio loop.

    ``keepalive_timeout``: seconds an idle connection is kept (``None``: aiohttp's default);
    ``shutdown_timeout``: how long the runner's cleanup waits for connections to close. Handlers are cancelled
    when their client goes away (``handler_cancellation``); no access log is written.

    :meth:`start` binds and returns once connections are accepted; :meth:`stop` shuts down (safe to call
    when not started, or twice). Neither is reentrant; use them from the loop that serves.
    """

    def __init__(
        self,
        app: web.Application,
        host: str,
        port: int,
        *,
        keepalive_timeout: float | None = None,
        shutdown_timeout: float = 1.0,
    ) -> None:
        self.app, self.host, self.port = app, host, port
        self._options: dict[str, Any] = {"shutdown_timeout": shutdown_timeout}
        if keepalive_timeout is not None:
            self._options["keepalive_timeout"] = keepalive_timeout
        self._runner: web.AppRunner | None = None
        self._sock: socket.socket | None = None
        self._url: str | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` once started."""
        if self._url is None:
            raise RuntimeError("the HTTP listener is not serving")
        return self._url

    async def start(self) -> str:
        """Bind ``host:port`` and start accepting connections; returns :attr:`url` (``port`` is then the bound one).

        Raises ``OSError`` when the address cannot be bound; on any failure (or cancellation) the socket and
        the runner are closed before the error propagates.
        """
        if self._runner is not None:
            raise RuntimeError("the HTTP listener is already serving")
        sock = bind_listener(self.host, self.port)
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None, **self._options)
        try:
            await runner.setup()
            await web.SockSite(runner, sock).start()
        except BaseException:
            sock.close()
            with anyio.CancelScope(shield=True):
                await runner.cleanup()
            raise
        self._runner, self._sock, self._url = runner, sock, url_of(sock)
        self.port = int(sock.getsockname()[1])
        return self._url

    async def stop(
        self, handlers: Collection[asyncio.Task[Any]] = (), *, grace: float = 0.0, cancel_wait: float = 1.0
    ) -> None:
        """Stop accepting, let ``handlers`` (the requests in flight) finish for ``grace`` seconds, cancel the
        rest and wait up to ``cancel_wait`` seconds for them, then close every connection and the socket.

        aiohttp's own graceful shutdown never cancels a streaming handler (it only stops waiting for it),
        hence the explicit cancellation. Not shielded: callers that stop on cancellation shield the call.
        """
        runner, sock = self._runner, self._sock
        if runner is None:
            return
        self._runner = self._sock = self._url = None
        try:
            for site in list(runner.sites):
                await site.stop()
            if grace > 0 and (pending := [t for t in handlers if not t.done()]):
                await asyncio.wait(pending, timeout=grace)
            if pending := [t for t in handlers if not t.done()]:
                for task in pending:
                    task.cancel()
                await asyncio.wait(pending, timeout=cancel_wait)
            await runner.cleanup()
        finally:
            if sock is not None:
                sock.close()
