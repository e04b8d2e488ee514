"""The HTTP/1.1 server of one socket: the listener's life cycle.

:class:`HttpServer` binds (:func:`~aglverl._net.bind_listener`: ``IPPROTO_TCP``, so that every accepted socket
gets ``TCP_NODELAY``), serves each connection with a :class:`~aglverl.proxy.http.connection.Connection` under the
:class:`~aglverl.proxy.http.limits.Limits`, and stops: no new connection, idle ones closed at once, the handlers
under way given ``grace`` seconds, then cancelled, every connection closed, the socket closed.
"""

from __future__ import annotations

import asyncio

from ..._net import BACKLOG, bind_listener, url_of
from .connection import Connection, Site
from .limits import Limits
from .service import Service

__all__ = ["HttpServer", "Service"]


class HttpServer:
    """One :class:`Service` served on ``host:port`` (see the module docstring).

    :meth:`start` returns once connections are accepted; :meth:`stop` shuts down (safe when not started, or
    twice). Use both from the loop that serves.
    """

    def __init__(self, service: Service, host: str, port: int, limits: Limits | None = None) -> None:
        self.host, self.port = host, port
        self._site = Site(service, limits or Limits())
        self._server: asyncio.Server | None = None
        self._url: str | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` once started."""
        if self._url is None:
            raise RuntimeError("the HTTP server is not serving")
        return self._url

    @property
    def connections(self) -> int:
        """Connections open now."""
        return len(self._site.connections)

    async def start(self) -> str:
        """Bind ``host:port`` and accept connections; returns :attr:`url` (``port`` is then the bound one).
        ``OSError`` when the address cannot be bound (the socket is closed first)."""
        if self._server is not None:
            raise RuntimeError("the HTTP server is already serving")
        site = self._site
        site.stopping = False
        sock = bind_listener(self.host, self.port)
        try:
            loop = asyncio.get_running_loop()
            self._server = await loop.create_server(lambda: Connection(site), sock=sock, backlog=BACKLOG)
        except BaseException:
            sock.close()
            raise
        self._url = url_of(sock)
        self.port = int(sock.getsockname()[1])
        return self._url

    async def stop(self, *, grace: float = 0.0, cancel_wait: float = 1.0) -> None:
        """Stop accepting, close idle connections, let the handlers under way finish for ``grace`` seconds,
        cancel the rest and wait up to ``cancel_wait`` seconds for them, then close every connection (waiting up
        to ``cancel_wait`` for them to go). Not shielded: a caller that stops on cancellation shields the call."""
        server, site = self._server, self._site
        if server is None:
            return
        self._server = self._url = None
        site.stopping = True
        server.close()
        for connection in list(site.connections):
            connection.shutdown()
        if grace > 0 and (pending := [t for t in site.tasks if not t.done()]):
            await asyncio.wait(pending, timeout=grace)
        if pending := [t for t in site.tasks if not t.done()]:
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=cancel_wait)
        closed = asyncio.Event()
        site.on_close = lambda: None if site.connections else closed.set()
        for connection in list(site.connections):
            connection.abort()
        if site.connections:
            try:
                await asyncio.wait_for(closed.wait(), cancel_wait)
            except TimeoutError:
                pass
        site.on_close = None
