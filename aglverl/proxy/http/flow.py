"""Flow control of one connection: reading paused while requests wait their turn, writing waits while the
client's socket is full.

:class:`Flow` holds the transport's two directions. Reading: :meth:`Flow.pause_reading` /
:meth:`Flow.resume_reading` (idempotent) stop the transport from reading while a request is queued behind
another (what it pipelines waits in the kernel, not in the server's memory). Writing: the transport calls
:meth:`Flow.pause_writing` past its high-water mark and :meth:`Flow.resume_writing` once it drained;
:meth:`Flow.drain` returns at once while writing flows, else waits for that. The connection lost,
:meth:`Flow.lose` wakes every waiter with ``ConnectionResetError``.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["Flow"]


class Flow:
    """Pausing and resuming a connection's reading and writing (see the module docstring)."""

    __slots__ = ("_drained", "_lost", "_transport", "read_paused", "write_paused")

    def __init__(self, transport: Any) -> None:
        self._transport = transport  # asyncio's transport, or uvloop's (not a subclass of asyncio's)
        self.read_paused = False
        self.write_paused = False
        self._drained: asyncio.Future[None] | None = None
        self._lost = False

    def pause_reading(self) -> None:
        if not self.read_paused and not self._lost:
            self.read_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused and not self._lost:
            self.read_paused = False
            self._transport.resume_reading()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    async def drain(self) -> None:
        """Return once the client's socket takes more; ``ConnectionResetError`` once the connection is lost.
        Cancelled, it stops waiting (nothing is lost: what was written stays written)."""
        if self._lost:
            raise ConnectionResetError("the client's connection was lost")
        if not self.write_paused:
            return
        if self._drained is None:
            self._drained = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._drained)

    def lose(self) -> None:
        """The connection is gone: waiters get ``ConnectionResetError``, and nothing is paused or resumed any
        more."""
        self._lost = True
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_exception(ConnectionResetError("the client's connection was lost"))
            drained.exception()  # retrieved here: a waiter cancelled meanwhile leaves no "never retrieved" log
