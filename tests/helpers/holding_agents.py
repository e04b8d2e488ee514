"""Agents that hold their supervisor, so that it can no longer answer the runner (stdlib only; nothing of aglverl).

Each connects to the TCP server ``HOLD_GATE`` (``host:port``) names once it holds, sends one line ``<its pid>
<its supervisor's pid> <what it did>``, and then sleeps; it writes no reward. ``HOLD`` says how it holds:

- ``stop``: ``SIGSTOP`` to its parent (the supervisor);
- ``attach``: ``ptrace(PTRACE_ATTACH)`` on its parent (the kernel stops the tracee);
- ``seize``: ``ptrace(PTRACE_SEIZE)`` then ``ptrace(PTRACE_INTERRUPT)`` (stopped without a signal);
- ``stop-after-exit``: starts a child that ``SIGSTOP``\\s the supervisor when it is sent ``SIGTERM`` (the
  supervisor sends it once the agent exited: its answers after the agent's exit then never come), writes the
  reward 1 and exits 0;
- ``flood``: takes a duplicate of its supervisor's channel to the runner (``pidfd_getfd``: the same right as
  ``ptrace``) and fills it with lines no supervisor says (``{}``), without end.

:class:`HoldingAgent` is the agent class (the fork server forks it); ``python holding_agents.py`` the program.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import time

_PTRACE_ATTACH = 16
_PTRACE_SEIZE = 0x4206
_PTRACE_INTERRUPT = 0x4207
_PIDFD_GETFD = 438  # the same number on every Linux architecture


def _say(line: str) -> None:
    host, port = os.environ["HOLD_GATE"].rsplit(":", 1)
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(line.encode() + b"\n")


def _ptrace(request: int, pid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    if libc.ptrace(request, pid, None, None) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"ptrace({request:#x}, {pid}): {os.strerror(errno)}")


def _take_channel(supervisor: int) -> int:
    """A duplicate of the supervisor's channel (its one socket), taken with ``pidfd_getfd``."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(supervisor)
    for name in os.listdir(f"/proc/{supervisor}/fd"):
        if os.readlink(f"/proc/{supervisor}/fd/{name}").startswith("socket:"):
            fd = int(libc.syscall(_PIDFD_GETFD, pidfd, int(name), 0))
            if fd < 0:
                errno = ctypes.get_errno()
                raise OSError(errno, f"pidfd_getfd: {os.strerror(errno)}")
            return fd
    raise RuntimeError(f"process {supervisor} has no socket")


def _stop_after_exit() -> None:
    read, write = os.pipe()
    if os.fork() == 0:

        def on_term(signum: int, frame: object) -> None:
            supervisor = os.getppid()  # the agent has exited: its child is the supervisor's (a subreaper)
            os.kill(supervisor, signal.SIGSTOP)

        signal.signal(signal.SIGTERM, on_term)
        os.write(write, b"1")
        while True:
            time.sleep(300)
    os.read(read, 1)
    _say(f"{os.getpid()} {os.getppid()} stop-after-exit")
    with open(os.environ["AGL_REWARD_FILE"], "w") as f:
        f.write("1")


def hold() -> None:
    how = os.environ["HOLD"]
    if how == "stop-after-exit":
        _stop_after_exit()
        return
    supervisor = os.getppid()
    if how == "stop":
        os.kill(supervisor, signal.SIGSTOP)
    elif how == "attach":
        _ptrace(_PTRACE_ATTACH, supervisor)
    elif how == "seize":
        _ptrace(_PTRACE_SEIZE, supervisor)
        _ptrace(_PTRACE_INTERRUPT, supervisor)
    elif how == "flood":
        channel = _take_channel(supervisor)
        _say(f"{os.getpid()} {supervisor} {how}")
        junk = b"{}\n" * 4096
        while True:
            os.write(channel, junk)
    else:
        raise ValueError(f"HOLD={how!r}")
    _say(f"{os.getpid()} {supervisor} {how}")
    while True:
        time.sleep(300)


class HoldingAgent:
    def run(self) -> None:
        hold()


if __name__ == "__main__":
    hold()
    sys.exit(0)
