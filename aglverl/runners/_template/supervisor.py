"""An attempt's supervisor, forked by the template: a session of its own, a child subreaper, the agent's process
forked (or ``posix_spawn``ed) and watched to its end with everything it started, each step said on the
attempt's channel (see the package's docstring). Stdlib only."""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import socket
import stat
import time

from .agent import become_agent
from .preparing import STAMPS, changed
from .processes import descendants, subreaper
from .wire import drain, receive, send, traceback, wake_pipe

#: After the SIGKILL, how long a supervisor waits for its processes before it reports the ones left (a process
#: in uninterruptible sleep cannot be killed until it wakes): less than the runner waits for its answers past the
#: grace period (``aglverl.runners.supervised.ANSWER_MARGIN_SECONDS``).
_KILL_WAIT_SECONDS = 5.0
#: How much of the result file a supervisor reads (``aglverl.runners.seam.RESULT_MAX``).
_RESULT_MAX = 256


class _Supervisor:
    def __init__(self, channel: socket.socket, grace: float) -> None:
        self.channel = channel
        self.grace = grace
        self.agent = 0
        self.cpu = 0.0
        self.exit: dict | None = None
        self.deadline: float | None = None  # SIGKILL then (after a SIGTERM)
        self.killed_at: float | None = None
        self.strays = 0
        self.buffer = b""
        self.channel_open = True
        self.report = -1  # the agent's list of the modules it imported (read until its end)
        self.imported = b""
        self.result_file: str | None = None  # read once the attempt's processes are gone
        self.own_cpu = 0.0  # this process's CPU seconds when the attempt began
        self.waits = False  # once done, it waits for another attempt (it says so)
        self.unsent = False  # the agent's exit is not yet said

    def kill(self, sig: int) -> None:
        """``sig`` to the agent's process group and to every other process below this one."""
        try:
            os.killpg(self.agent, sig)
        except OSError:
            pass
        for pid in descendants(os.getpid()):
            try:
                if os.getpgid(pid) != self.agent:
                    os.kill(pid, sig)
            except OSError:
                pass

    def stop(self, grace: float) -> None:
        if self.deadline is None:
            self.kill(signal.SIGTERM)
            self.deadline = time.monotonic() + grace

    def reap(self) -> bool:
        """Collect ended children; True once none is left."""
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return True
            if pid == 0:
                return False
            self.cpu += usage.ru_utime + usage.ru_stime
            if pid == self.agent:
                self.exit = (
                    {"signal": os.WTERMSIG(status)}
                    if os.WIFSIGNALED(status)
                    else {"code": os.WEXITSTATUS(status)}
                )
                self.unsent = True  # said at once if processes are left, else with "done" (one write)
            else:
                self.strays += 1

    def read_channel(self) -> None:
        try:
            data = self.channel.recv(4096)
        except OSError:
            data = b""
        if not data:  # the runner is gone: end the attempt
            self.stop(self.grace)
            self.channel_open = False
            return
        self.buffer += data
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            words = line.split()
            if words and words[0] == b"stop":
                self.stop(float(words[1]) if len(words) > 1 else self.grace)

    def run(self, wake: int) -> int:
        left = 0
        while True:
            if self.reap():
                break
            if self.unsent:
                self.unsent = False
                send(self.channel, {"exited": self.exit})
            if self.exit is not None and self.deadline is None:
                self.stop(self.grace)  # the agent ended: what it left behind goes too
            now = time.monotonic()
            if self.deadline is not None and now >= self.deadline:
                self.kill(signal.SIGKILL)
                if self.killed_at is None:
                    self.killed_at = now
                elif now - self.killed_at > _KILL_WAIT_SECONDS:
                    left = len(descendants(os.getpid()))
                    break
                self.deadline = now + 1.0  # again once a second while unkillable ones remain
            timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
            watched: list = [wake, self.channel] if self.channel_open else [wake]
            if self.report >= 0:
                watched.append(self.report)
            ready, _, _ = select.select(watched, [], [], timeout)
            if wake in ready:
                drain(wake)
            if self.channel in ready:
                self.read_channel()
            if self.report in ready:
                self.read_report()
        while self.report >= 0:  # the agent is gone: what it wrote is all there is
            self.read_report()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.cpu += usage.ru_utime + usage.ru_stime - self.own_cpu
        done: dict = {"cpu_s": round(self.cpu, 6), "strays": self.strays, "left": left}
        if self.waits and not left and self.channel_open:
            done["waits"] = True
        if self.result_file:
            done["result"] = _read_result(self.result_file)
        try:
            done["imported"] = json.loads(self.imported) if self.imported else []
        except ValueError:
            pass
        said = [{"exited": self.exit}] if self.unsent else []
        send(self.channel, *said, {"done": done})
        return left

    def read_report(self) -> None:
        try:
            chunk = os.read(self.report, 1 << 16)
        except OSError:  # BlockingIOError too: a process it could not kill still holds the pipe
            chunk = b""
        if chunk and len(self.imported) < (1 << 20):
            self.imported += chunk
            return
        os.close(self.report)
        self.report = -1


def _read_result(path: str) -> str:
    """The first bytes of the regular file ``path`` (``""`` when there is none; never blocks on a FIFO)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        return os.read(fd, _RESULT_MAX).decode("utf-8", errors="replace")
    except OSError:
        return ""
    finally:
        os.close(fd)


def _spawn_agent(supervisor: _Supervisor, request: dict, fds: list[int]) -> None:
    """Exec the program with ``posix_spawn`` (a vfork: nothing of this process copied; ~1 ms less than a fork
    and an exec from Python): in its own process group, the default signal dispositions, its streams; the
    working directory is this supervisor's (set first). Says ``started`` or ``failed`` on the channel."""
    env, argv = request["env"], request["argv"]
    program = argv[0]
    if os.sep not in program:
        for folder in env.get("PATH", os.defpath).split(os.pathsep):
            candidate = os.path.join(folder or ".", program)
            if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
                program = candidate
                break
    actions = [
        (os.POSIX_SPAWN_DUP2, fds[0], 0),
        (os.POSIX_SPAWN_DUP2, fds[1], 1),
        (os.POSIX_SPAWN_DUP2, fds[1], 2),
        *[(os.POSIX_SPAWN_CLOSE, fd) for fd in sorted(set(fds)) if fd > 2],
    ]
    defaults = (
        signal.SIGTERM,
        signal.SIGINT,
        signal.SIGHUP,
        signal.SIGQUIT,
        signal.SIGCHLD,
        signal.SIGPIPE,
        signal.SIGXFSZ,
        signal.SIGUSR1,
        signal.SIGUSR2,
    )
    why = None
    try:
        os.chdir(request["cwd"])
    except OSError as exc:
        why = f"cannot enter its working directory {request['cwd']!r}: {exc.strerror}"
    try:
        if why is None and os.sep not in program:
            why = f"cannot run {program!r}: No such file or directory"
        if why is None:
            pid = os.posix_spawn(
                program, argv, env, file_actions=actions, setpgroup=0, setsigmask=(), setsigdef=defaults
            )
    except OSError as exc:
        why = f"cannot run {argv[0]!r}: {os.strerror(exc.errno or 0)}"
    finally:
        for fd in fds[:2]:
            os.close(fd)
    if why is not None:
        send(supervisor.channel, {"failed": why})
        return
    supervisor.agent = pid
    send(supervisor.channel, {"started": pid})


def _await_attempt(channel: socket.socket, pending: bytes = b"") -> tuple[dict, list[int], bytes] | None:
    """A waiting supervisor's next attempt: its request (one JSON line whose first byte carries the attempt's stdin
    and output), the descriptors, and what came after the line; ``None`` once the channel is closed. ``stop``
    lines before it (sent for the attempt that just ended, after it ended) are skipped."""
    buffer = bytearray(pending)
    fds: list[int] = []
    while True:
        while b"\n" not in buffer:
            if not receive(channel, buffer, fds):
                for fd in fds:
                    os.close(fd)
                return None
        end = buffer.index(b"\n")
        line = bytes(buffer[:end])
        del buffer[: end + 1]
        if line.split(b" ", 1)[0] != b"stop":
            return json.loads(line), fds, bytes(buffer)


def _attempt(
    channel: socket.socket, request: dict, fds: list[int], run, wake: int, wake_w: int, pending: bytes
):
    """Run one attempt to its end (see the module docstring); returns how many of its processes could not be
    killed, and what the channel held after the attempt's own lines."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    supervisor = _Supervisor(channel, float(request.get("grace", 5.0)))
    supervisor.own_cpu = usage.ru_utime + usage.ru_stime
    supervisor.buffer = pending
    supervisor.result_file = request.get("result_file")
    supervisor.waits = run is None  # a bare supervisor waits for its next attempt once this one is done
    drain(wake)
    if run is None and not request.get("limits"):
        _spawn_agent(supervisor, request, fds)  # the cheap way, when nothing needs a fork to set up
        return supervisor.run(wake), supervisor.buffer
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    report_r, report_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        become_agent(request, fds, [wake, wake_w, err_r, report_r, fds[2]], run, err_w, report_w)
    try:
        os.setpgid(pid, pid)  # as the agent does: whichever runs first, its group exists before a kill
    except OSError:
        pass
    os.close(err_w)
    os.close(report_w)
    os.set_blocking(report_r, False)
    supervisor.report = report_r
    for fd in fds[:2]:
        os.close(fd)
    supervisor.agent = pid
    why = b""
    while True:
        chunk = os.read(err_r, 4096)  # empty once the program was exec'd or the agent runs (close-on-exec)
        if not chunk:
            break
        why += chunk
    os.close(err_r)
    if why:
        send(channel, {"failed": why.decode(errors="replace")})
    else:
        send(channel, {"started": pid})
    return supervisor.run(wake), supervisor.buffer


def supervise(request: dict, fds: list[int], inherited: list[int], run) -> None:
    """A forked supervisor (see the module docstring): of one attempt, or, for a bare template (a spawned
    program), of one attempt at a time for as long as the runner keeps it. Never returns."""
    try:
        os.setsid()
        wake, wake_w = wake_pipe()  # before closing the template's: a SIGCHLD always has a pipe to wake
        for fd in inherited:
            os.close(fd)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            # only the runner (or the channel closing) ends the supervisor
            signal.signal(signum, signal.SIG_IGN)
        subreaper()
        channel = socket.socket(fileno=fds[-1])
        channel.setblocking(True)
        pending = b""
        waiting = bool(request.get("spare"))  # forked ahead of its attempt: the attempt comes on the channel
        while True:
            if waiting:
                attempt = _await_attempt(channel, pending)
                if attempt is None:
                    os._exit(0)  # the runner no longer needs it
                request, received, pending = attempt
                if len(received) != 2:
                    for fd in received:
                        os.close(fd)
                    send(
                        channel, {"failed": "a waiting supervisor got an attempt without its two descriptors"}
                    )
                    os._exit(0)
                fds = [*received, fds[-1]]
                stale = changed(STAMPS) if run is not None else None
                if stale is not None:  # a spare forked before the agent's file changed: it must not run it
                    for fd in received:
                        os.close(fd)
                    send(channel, {"failed": f"{stale} changed", "stale": stale})
                    os._exit(0)
            left, pending = _attempt(channel, request, fds, run, wake, wake_w, pending)
            if run is not None or left:
                os._exit(0)
            waiting = True  # all of the attempt's processes are gone: it may be given the next one
    except BaseException:  # a supervisor never returns into the template's loop
        traceback().print_exc()
        os._exit(70)
    os._exit(0)
