"""The runner's end of a template's or supervisor's channel (``aglverl.runners.channel``): a receive cancelled in
the loop iteration that finds its socket readable leaves no error in the loop, on asyncio and on uvloop, and the
stream still carries bytes and file descriptors both ways."""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

import anyio
import pytest

from aglverl.runners.channel import open_channel

pytestmark = pytest.mark.anyio

LOOPS = pytest.mark.parametrize(
    "anyio_backend", [("asyncio", {}), ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"]
)


@LOOPS
async def test_a_receive_cancelled_as_its_socket_becomes_readable_leaves_no_error_in_the_loop() -> None:
    """A task woken in the same iteration cancels the reader's scope while the peer's bytes arrive: with anyio's
    own stream the socket's reader callback then sets the result of the cancelled wait (``InvalidStateError``
    from the loop, reported by asyncio's exception handler)."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    try:
        for _ in range(20):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            channel = await open_channel(ours)
            go = anyio.Event()
            async with anyio.create_task_group() as tg:

                async def cancel_on(go: anyio.Event, scope: anyio.CancelScope) -> None:
                    await go.wait()
                    scope.cancel()

                tg.start_soon(channel.receive)
                tg.start_soon(cancel_on, go, tg.cancel_scope)
                await anyio.wait_all_tasks_blocked()
                go.set()  # the canceller wakes in the next iteration...
                theirs.send(b"x")  # ...whose poll finds the reader's socket readable
            for _ in range(3):
                await asyncio.sleep(0)
            await channel.aclose()
            theirs.close()
    finally:
        loop.set_exception_handler(None)
    assert errors == []


@LOOPS
async def test_the_channel_carries_bytes_and_descriptors_and_ends_at_the_peers_close() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    channel = await open_channel(ours)
    read, write = os.pipe()
    try:
        await channel.send_fds(b"f", [write])
        message, fds, _, _ = socket.recv_fds(theirs, 1, 1)
        assert message == b"f" and len(fds) == 1
        os.write(fds[0], b"through the descriptor")
        os.close(fds[0])
        assert os.read(read, 64) == b"through the descriptor"
        big = os.urandom(1 << 20)  # past the socket's buffer: the send waits for the peer to read
        async with anyio.create_task_group() as tg:
            tg.start_soon(channel.send, big)
            got = bytearray()
            while len(got) < len(big):
                got += await anyio.to_thread.run_sync(theirs.recv, 1 << 16)
        assert bytes(got) == big
        theirs.sendall(b"answer\n")
        assert await channel.receive() == b"answer\n"
        theirs.close()
        with pytest.raises(anyio.EndOfStream):
            await channel.receive()
    finally:
        await channel.aclose()
        os.close(read)
        os.close(write)
