"""The bounds a connection holds its client to, as one frozen value (policy apart from the code that applies it).

Each bound, what it protects, and what a client past it gets:

- ``max_header_lines`` header lines in a head (aiohttp's default, 128): past it, 431.
- ``max_line_bytes``: the longest head line (the request line, or a header's name and value; aiohttp's default,
  8,190): a longer target is a 414, a longer header line a 431, refused as the line grows (a head dribbled a byte
  at a time costs the server its bytes once, never a rescan).
- ``head_timeout``: seconds a request's head may take to arrive whole, from its first byte (or from the end of
  the answer before it): past it, 408 and the connection closed. What a client that stops mid-head gets.
- ``idle_timeout``: seconds a kept-alive connection may wait for its next request: past it, closed (no answer:
  it asked nothing). Longer than the keep-alive of the clients agents use (httpx 5 s, aiohttp 15 s), so that the
  client, not the server, drops an idle connection, and never sends a request into one being closed.
- ``max_connections``: connections open at once: past it, a new connection gets a 503 with ``Retry-After`` at
  once and is closed (a clear answer an SDK retries after the delay, where a silent close reads as a network
  failure).
- ``max_body_bytes``: a request's body (413), checked against its ``Content-Length`` before a body byte is read,
  and as a chunked body grows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Limits"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """The bounds of every connection of one server (see the module docstring); positive values only."""

    max_header_lines: int = 128
    max_line_bytes: int = 8190
    head_timeout: float = 20.0
    idle_timeout: float = 75.0
    max_connections: int = 8192
    max_body_bytes: int = 32 << 20

    def __post_init__(self) -> None:
        for name in ("max_header_lines", "max_line_bytes", "max_connections", "max_body_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("head_timeout", "idle_timeout"):
            value = getattr(self, name)
            if (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or not (math.isfinite(value) and value > 0)
            ):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
