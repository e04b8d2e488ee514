"""The runner's end of a template's or supervisor's channel: a connected ``AF_UNIX`` stream socket as anyio's
:class:`~anyio.abc.UNIXSocketStream`, with one of its races taken out.

On the asyncio backend (anyio 4.16), that stream waits for its socket with a reader (or writer) callback that is
the wait's own ``Future.set_result``. When the task waiting in ``receive`` is cancelled in the loop iteration
whose poll found the socket readable (a task woken in the same iteration cancels the runner's scope as the peer
writes or exits: the runner's shutdown, an attempt ended at its deadline), the callback runs on the cancelled
future and asyncio reports ``InvalidStateError`` from the loop. Nothing is lost (the wait was over), but an
application sees an error it did not make, and a test under anyio's plugin fails. :func:`open_channel` gives the
stream callbacks that resolve the wait only while it is pending; everything else is anyio's.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import anyio
import anyio.abc

__all__ = ["open_channel"]

try:
    from anyio._backends._asyncio import UNIXSocketStream as _AsyncioUNIXSocketStream
except ImportError:  # pragma: no cover - a layout of anyio's without it: its stream as it is
    _AsyncioUNIXSocketStream = None  # type: ignore[assignment,misc]


def _resolve(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_result(None)


if _AsyncioUNIXSocketStream is not None and hasattr(_AsyncioUNIXSocketStream, "_wait_until_readable"):

    class _Channel(_AsyncioUNIXSocketStream):  # type: ignore[misc,valid-type]
        def _wait_until_readable(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[Any]:
            future: asyncio.Future[Any] = super()._wait_until_readable(loop)
            loop.add_reader(self._raw_socket, _resolve, future)  # in place of ``future.set_result``
            return future

        def _wait_until_writable(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[Any]:
            future: asyncio.Future[Any] = super()._wait_until_writable(loop)
            loop.add_writer(self._raw_socket, _resolve, future)
            return future

else:  # pragma: no cover
    _Channel = None  # type: ignore[assignment,misc]


async def open_channel(sock: socket.socket) -> anyio.abc.UNIXSocketStream:
    """``sock`` (connected, ``AF_UNIX``, ``SOCK_STREAM``; the stream owns it from now on) as a stream."""
    stream = await anyio.abc.UNIXSocketStream.from_socket(sock)
    if _Channel is not None and type(stream) is _AsyncioUNIXSocketStream:
        stream.__class__ = _Channel
    return stream
