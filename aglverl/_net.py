"""Listening sockets for the daemon's HTTP servers."""

from __future__ import annotations

import socket

__all__ = ["bind_listener", "url_of"]

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


def url_of(sock: socket.socket) -> str:
    """``http://host:port`` of a bound listener (IPv6 hosts in brackets)."""
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"
