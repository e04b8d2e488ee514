"""The template's loop: prepare the agent once (:mod:`.preparing`), say ``ready``, then answer the runner's
requests on the control socket (forks, spares, preloads) until it closes (see the package's docstring).
Stdlib only."""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import sys
import time

from .preload import KNOWN, Installed, preload
from .preparing import STAMPS, agent_folders, changed, own_files, prepare
from .processes import children, descendants, subreaper, threads
from .supervisor import supervise
from .wire import drain, receive, send, traceback, wake_pipe

#: How long a template whose runner is gone waits for its supervisors to exit (the waiting ones exit as their
#: channels close, just before): their CPU time then reaches the runner's children's time.
_LINGER_SECONDS = 0.5


def _reap(supervisors: set[int], reparented: bool) -> None:
    """Collect ended supervisors; kill whatever a dead supervisor left behind (reparented here)."""
    abnormal = reparented
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            break
        if pid in supervisors:
            supervisors.discard(pid)
            abnormal = abnormal or status != 0
        else:
            abnormal = True
    if not abnormal:
        return
    tree = children()
    for stray in tree.get(os.getpid(), ()):
        if stray in supervisors:
            continue  # a live attempt's supervisor: its processes are its own
        for pid in [stray, *descendants(stray, tree)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


class _Template:
    """The template once its agent is prepared: ``run`` (what a fork runs, ``None`` for a bare template) and the
    agent's ``files``; it answers the runner on ``ctl``."""

    def __init__(self, ctl: socket.socket, run, files: list, installed: Installed) -> None:
        self.ctl = ctl
        self.run = run
        self.files = files
        self.installed = installed  # what it may import before its forks
        self.wake, self.wake_w = wake_pipe()
        self.supervisors: set[int] = set()
        self.buffer = bytearray()
        self.fds: list[int] = []  # descriptors received, not yet taken by their requests

    def serve(self) -> None:
        """Answer requests until the runner closes the control socket; then linger and exit."""
        watched: list = [self.ctl, self.wake]
        while True:
            ready, _, _ = select.select(watched, [], [])
            if self.wake in ready:
                drain(self.wake)
                _reap(self.supervisors, reparented=False)
            if self.ctl not in ready:
                continue
            if not receive(self.ctl, self.buffer, self.fds):  # the runner closed the control socket
                self.linger()
                os._exit(0)
            while b"\n" in self.buffer:
                end = self.buffer.index(b"\n")
                request = json.loads(bytes(self.buffer[:end]))
                del self.buffer[: end + 1]
                if "preload" in request:
                    self.preload([str(n) for n in request["preload"]])
                else:
                    self.fork(request)

    def preload(self, names: list[str]) -> None:
        """Import ``names`` (the installation's modules of them); say how many, and which were left out."""
        count, culprit, skipped = preload(sorted(names), self.installed)
        if culprit is not None:
            send(self.ctl, {"threads": threads(), "module": culprit})
            os._exit(0)  # a thread runs here now: this template must not fork again
        for path, stamp in own_files(self.files).items():  # the files it brought in; not a new look at
            STAMPS.setdefault(path, stamp)  # those it had: a change made meanwhile stays a change
        gc.freeze()
        send(self.ctl, {"preloaded": count, "skipped": skipped})

    def fork(self, request: dict) -> None:
        """Fork a supervisor for ``request`` (a spare: its channel alone), or say why not."""
        need = 1 if request.get("spare") else 3
        mine, self.fds[:] = self.fds[:need], self.fds[need:]
        stale = changed(STAMPS)
        running = threads()
        if stale is not None or running > 1 or len(mine) != need:
            for fd in mine:
                os.close(fd)
            if stale is not None:
                send(self.ctl, {"stale": stale})
                os._exit(0)
            send(
                self.ctl,
                {"threads": running}
                if running > 1
                else {"error": "a fork request came without its descriptors"},
            )
            return
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:
            # the descriptors of requests not yet read (pipelined) are theirs: neither this supervisor nor its
            # agent may hold them (an attempt's output stays open while anyone does)
            supervise(request, mine, [self.ctl.fileno(), self.wake, self.wake_w, *self.fds], self.run)
        for fd in mine:
            os.close(fd)
        self.supervisors.add(pid)
        send(self.ctl, {"forked": pid})

    def linger(self) -> None:
        """Wait (briefly) for the supervisors to exit once the runner is gone."""
        deadline = time.monotonic() + _LINGER_SECONDS
        while True:
            _reap(self.supervisors, reparented=False)
            left = deadline - time.monotonic()
            if not self.supervisors or left <= 0:
                return
            select.select([self.wake], [], [], left)
            drain(self.wake)


def main(argv: list[str]) -> None:
    """The template: ``argv`` is its control socket's descriptor, its kind and spec."""
    started_ns = time.time_ns()  # what was written since is not the installation's (preload.Installed)
    ctl = socket.socket(fileno=int(argv[0]))
    ctl.setblocking(True)
    kind, spec = argv[1], argv[2:]
    reaper = subreaper()
    try:
        run, files = prepare(kind, spec)
    except BaseException as exc:  # the agent cannot be loaded: say why, then stop
        send(ctl, {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback().format_exc()[-4000:]})
        os._exit(1)
    STAMPS.update(own_files(files))
    KNOWN.update(sys.modules)
    gc.freeze()  # what is imported now stays out of the collector's reach: forks do not copy it by collecting
    template = _Template(ctl, run, files, Installed(agent_folders(files), started_ns))
    send(
        ctl,
        {"ready": {"pid": os.getpid(), "threads": threads(), "subreaper": reaper, "files": len(STAMPS)}},
    )
    template.serve()
