"""What the template and its supervisors say and hear: JSON lines on sockets (descriptors riding on a line's
first byte), and the pipe ``SIGCHLD`` wakes ``select`` through. Stdlib only."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys


def send(sock: socket.socket, *messages: dict) -> None:
    """Write ``messages`` as JSON lines (one write); nothing when the runner is gone."""
    try:
        sock.sendall("".join(json.dumps(message) + "\n" for message in messages).encode())
    except OSError:
        pass  # the runner is gone; what it would have read no longer matters


def receive(sock: socket.socket, buffer: bytearray, fds: list[int]) -> bool:
    """Read what ``sock`` has (data into ``buffer``, descriptors onto ``fds``); False once it is closed."""
    try:
        data, ancillary, _, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(16 * 4))
    except InterruptedError:
        return True
    except ConnectionError:  # reset by the runner (it closed with data unread): closed all the same
        return False
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % 4
            fds.extend(int.from_bytes(payload[i : i + 4], sys.byteorder) for i in range(0, usable, 4))
    if not data:
        return False
    buffer.extend(data)
    return True


def wake_pipe() -> tuple[int, int]:
    """A pipe the kernel's SIGCHLD writes a byte to (``signal.set_wakeup_fd``): ``select`` wakes on it."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.set_wakeup_fd(w)
    return r, w


def drain(fd: int) -> None:
    """Read a non-blocking pipe empty."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def traceback():
    """The ``traceback`` module, imported when something failed (a bare template starts without it)."""
    import traceback

    return traceback
