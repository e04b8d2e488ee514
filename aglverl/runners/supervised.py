"""One attempt's process as its supervisor reports it on the attempt's channel (:class:`SupervisedProcess`), and
its end by the runner itself when that supervisor stops answering.

A supervisor (:mod:`aglverl.runners._template`) is a process of the agent's own user, and so within the agent's
reach: a ``SIGSTOP`` to its parent, or a ``ptrace`` attach, freezes it, and then nothing it would say comes. (An
agent may trace its supervisor where it runs as root, or where Linux's Yama module is absent or its
``ptrace_scope`` is 0; with ``ptrace_scope`` 1, Ubuntu's default, a process may trace only its descendants, and
the supervisor is the agent's ancestor.)
So every wait for a supervisor's answer that the runner must have is bounded: its first word once it was given
an attempt (:data:`START_ANSWER_SECONDS`), the agent's exit and the attempt's end once the runner asked it to
stop (the grace period plus :data:`ANSWER_MARGIN_SECONDS`), and the attempt's end once the agent exited (the
supervisor then ends what the agent left: the same bound). Past it, the runner ends the supervisor and every
process of the attempt itself (:func:`end_unanswered`: ``SIGCONT``, then ``SIGKILL``, to the processes of the
supervisor's session (the agent's process group is one of its groups) and of its tree, then to the supervisor),
and the attempt fails as lost, with the reason (:attr:`SupervisedProcess.lost`). The pipes and the channel a
supervisor uses were looked at for the same: it writes to nothing an agent can fill (its one blocking write is
to the channel, which the runner reads as long as the attempt runs; the agent's import report is read
non-blocking and capped). But an agent may take a duplicate of the channel (``pidfd_getfd``, the same right as
``ptrace``) and fill it: a line no supervisor says (or one of over :data:`LINE_MAX` bytes) ends the supervisor
and the attempt at once, as lost; a channel closed under it reads as a supervisor gone (and it ends the
attempt). The template the supervisors are forked from is bounded alike
(:attr:`Template.answer_seconds <aglverl.runners.template.Template.answer_seconds>`).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import orjson
from anyio.streams.buffered import BufferedByteReceiveStream

from ._template.processes import descendants, table
from .seam import AgentExit, LaunchFailed

__all__ = [
    "ANSWER_MARGIN_SECONDS",
    "START_ANSWER_SECONDS",
    "SupervisedProcess",
    "TemplateGone",
    "TemplateStale",
    "describe",
    "end_unanswered",
    "read_line",
    "receive_line",
]

logger = logging.getLogger(__name__)

#: How long past the grace period the runner waits for a supervisor's answer once it asked it to stop, or once
#: the agent exited (the supervisor's own wait for killed processes is shorter: see ``_KILL_WAIT_SECONDS`` in
#: :mod:`aglverl.runners._template.supervisor`).
ANSWER_MARGIN_SECONDS = 10.0
#: How long a supervisor given an attempt may take to say the agent runs (or why not): a fork or a
#: ``posix_spawn`` away, milliseconds (an agent may stop its supervisor before it said so).
START_ANSWER_SECONDS = 10.0
#: The longest line a template or supervisor may send.
LINE_MAX = 1 << 20
#: What a supervisor says on an attempt's channel (one of these keys a line): anything else was not said by it.
_SAID = frozenset({"started", "failed", "stale", "exited", "done"})
#: How many times the runner looks for processes of an unanswering supervisor's attempt (one may fork while
#: the others are killed).
_SWEEPS = 5


class TemplateGone(Exception):
    """The template died (or was never there); a new one may be started."""


class TemplateStale(Exception):
    """The agent's file changed since the template imported it; the template has exited."""


async def receive_line(reader: BufferedByteReceiveStream) -> bytes | None:
    """The next line (without its newline), or ``None`` once the other end is gone; ``anyio.DelimiterNotFound``
    when no newline comes within :data:`LINE_MAX` bytes."""
    try:
        return await reader.receive_until(b"\n", LINE_MAX)
    except (
        anyio.IncompleteRead,
        anyio.EndOfStream,
        anyio.BrokenResourceError,
        anyio.ClosedResourceError,
        OSError,
    ):
        return None


async def read_line(reader: BufferedByteReceiveStream) -> dict[str, Any] | None:
    """The next JSON line, or ``None`` once the other end is gone (or sent what is not a JSON line)."""
    try:
        data = await receive_line(reader)
        message = orjson.loads(data) if data is not None else None
    except (anyio.DelimiterNotFound, orjson.JSONDecodeError):
        logger.warning("a template or supervisor sent a line that is not JSON; treating it as gone")
        return None
    return message if isinstance(message, dict) else None


def _pidfd(pid: int) -> int | None:
    """A pidfd of ``pid`` (signals then reach that process, never one that reused its number), or ``None``."""
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


class SupervisedProcess:
    """One attempt's process, as its supervisor (``supervisor``: its pid) reports it on the attempt's
    ``channel`` (see :mod:`aglverl.runners.template`). :meth:`wait` and :meth:`finished` read the channel;
    :meth:`stop` writes to it. ``grace``: the attempt's grace period (what the supervisor waits between
    ``SIGTERM`` and ``SIGKILL``), for the bounds of the waits (see the module docstring)."""

    def __init__(
        self,
        supervisor: int,
        channel: anyio.abc.UNIXSocketStream,
        name: str,
        *,
        grace: float = 5.0,
        reader: BufferedByteReceiveStream | None = None,
        pidfd: int | None = None,
    ) -> None:
        self.supervisor = supervisor
        self.pid = 0
        self.name = name
        self.grace = grace
        self.exit: AgentExit | None = None
        self.cpu_seconds: float | None = None
        self.strays = 0
        #: The modules the agent imported that its template had not (a forked agent's, once it is done).
        self.imported: list[str] = []
        #: The launch's ``result_file`` as the supervisor read it once the attempt's processes were gone.
        self.result: str | None = None
        #: Why the runner ended the supervisor and the attempt's processes itself (it stopped answering), else
        #: ``None``.
        self.lost: str | None = None
        #: Called once no process of the attempt is left (a fork server learns what to import from it).
        self.on_done: Callable[[SupervisedProcess], None] | None = None
        #: Given the supervisor once its attempt is done, when it waits for another (a spawned program's: no
        #: fork for the next attempt); True when kept, else its channel is closed and it exits.
        self.on_idle: Callable[[SupervisedProcess], bool] | None = None
        self._channel = channel
        self._reader = reader or BufferedByteReceiveStream(channel)
        self._pidfd = pidfd if pidfd is not None else _pidfd(supervisor)
        self._done = False
        self._waits = False  # its supervisor said it waits for another attempt
        self._deadline = float("inf")  # its answers are due by then (once it was asked to stop)
        self._why = ""  # what it was asked, for the message past the deadline
        self._garbled: str | None = None  # what its channel carried that no supervisor says
        self._reading: anyio.CancelScope | None = None

    def _due(self, seconds: float, why: str) -> None:
        """Its answers are due within ``seconds`` (unless due earlier already)."""
        deadline = anyio.current_time() + seconds
        if deadline < self._deadline:
            self._deadline, self._why = deadline, f"within {seconds:g} s of {why}"
            if self._reading is not None:
                self._reading.deadline = deadline

    async def _next(self) -> dict[str, Any] | None:
        """The supervisor's next message; ``None`` once its channel is closed, or when it carried what no
        supervisor says (then :attr:`_garbled` says what: another process has the channel)."""
        try:
            data = await receive_line(self._reader)
        except anyio.DelimiterNotFound:
            what = "a line of over 1 MiB"
        else:
            if data is None:
                return None
            try:
                message = orjson.loads(data)
            except orjson.JSONDecodeError:
                message = None
            if isinstance(message, dict) and not _SAID.isdisjoint(message):
                return message
            what = repr(bytes(data[:60]))
        self._garble(what)
        return None

    def _garble(self, what: str) -> None:
        """The channel carried ``what``, which no supervisor says: its supervisor is to be ended."""
        if self._garbled is None:
            self._garbled = (
                f"sent what no supervisor says on its channel, {what} (another process writing on it?)"
            )

    async def _read_until(self, enough: Callable[[], bool]) -> None:
        """Read the channel until ``enough()``; past the deadline, or once the channel carried what no supervisor
        says, end the supervisor and the attempt."""
        try:
            with anyio.CancelScope(deadline=self._deadline) as self._reading:
                while not enough():
                    self._take(await self._next())
        finally:
            self._reading = None
        if self._garbled is not None and self.lost is None:
            await self._end(self._garbled)
        elif not enough():
            await self._end(f"did not answer {self._why}")

    async def started(self) -> None:
        """The supervisor's first word: the agent runs (:attr:`pid` set), or :class:`LaunchFailed` saying why
        (also when it does not answer within :data:`START_ANSWER_SECONDS`, or says what no supervisor says: then
        it is ended)."""
        message = None
        with anyio.move_on_after(START_ANSWER_SECONDS) as scope:
            message = await self._next()
        if scope.cancelled_caught or self._garbled is not None:
            await self._end(
                self._garbled or f"did not answer within {START_ANSWER_SECONDS:g} s of its attempt"
            )
            raise LaunchFailed(f"lost: its supervisor {self.lost}")
        if message is not None and "started" in message:
            pid = message["started"]
            if type(pid) is int:
                self.pid = pid
                return
            self._garble(repr(message)[:60])
            await self._end(self._garbled or "")
            raise LaunchFailed(f"lost: its supervisor {self.lost}")
        await self.finished()
        if message is None:
            raise LaunchFailed(f"the supervisor of {self.name}'s process ended before it started")
        if "stale" in message:  # a spare of a template whose agent changed since: a new template runs it
            raise TemplateStale(str(message["stale"]))
        raise LaunchFailed(str(message.get("failed") or message))

    def _take(self, message: dict[str, Any] | None) -> None:
        """Take in one of the supervisor's messages (``None``: its channel closed); one of the wrong shape is
        what no supervisor says (:meth:`_garble`)."""
        try:
            self._apply(message)
        except (AttributeError, TypeError, ValueError):
            self._garble(repr(message)[:60])
            self._done = True

    def _apply(self, message: dict[str, Any] | None) -> None:
        if message is None:
            self._done = True
        elif "exited" in message:
            how = message["exited"]
            self.exit = AgentExit(code=how.get("code"), signal=how.get("signal"))
            self._due(self.grace + ANSWER_MARGIN_SECONDS, "its agent's exit")
        elif "done" in message:
            self._done = True
            done = message["done"]
            self.cpu_seconds = float(done.get("cpu_s") or 0.0)
            self.strays = int(done.get("strays") or 0)
            self.imported = [str(n) for n in done.get("imported") or ()]
            result = done.get("result")
            self.result = result if isinstance(result, str) else None
            self._waits = done.get("waits") is True
            left = int(done.get("left") or 0)
            if left:
                logger.warning("%d process(es) of %s could not be killed (uninterruptible)", left, self.name)
            if self.on_done is not None:
                self.on_done(self)

    async def wait(self) -> AgentExit:
        """Return once the agent's process exited (an :class:`AgentExit` that is ``lost`` if its supervisor
        vanished, or stopped answering once asked to stop: then it was ended, :attr:`lost` says why).
        Cancellation only stops the wait."""
        await self._read_until(lambda: self.exit is not None or self._done)
        return self.exit or AgentExit(why=self.lost)

    async def finished(self) -> float | None:
        """Return once no process of the attempt is left (or the supervisor, past its deadline, was ended with
        them: :attr:`lost`); the CPU seconds they used (their supervisor's too). Cancellation only stops the
        wait."""
        await self._read_until(lambda: self._done)
        waits, self._waits = self._waits, False
        if not (waits and self.lost is None and self.on_idle is not None and self.on_idle(self._waiting())):
            await self._close()
        return self.cpu_seconds

    def _waiting(self) -> SupervisedProcess:
        """This attempt's supervisor, now waiting for its next attempt (as a spare: :meth:`assign`)."""
        pidfd, self._pidfd = self._pidfd, None
        return SupervisedProcess(
            self.supervisor, self._channel, "a waiting supervisor", reader=self._reader, pidfd=pidfd
        )

    async def assign(self, request: Mapping[str, Any], stdin: int, output: int, name: str) -> None:
        """Give a spare supervisor (:meth:`Template.spare <aglverl.runners.template.Template.spare>`) its attempt:
        ``request`` (as :func:`~aglverl.runners.template.fork_request`'s), its stdin and output (this process's
        descriptors stay open: the caller's). :class:`TemplateGone` if the spare is gone, or does not take the
        request within :data:`START_ANSWER_SECONDS` (then it is ended): it was not given the attempt."""
        data = orjson.dumps(request) + b"\n"
        self.grace = float(request.get("grace", self.grace))
        with anyio.move_on_after(START_ANSWER_SECONDS) as scope:
            try:
                await self._channel.send_fds(data[:1], [stdin, output])
                await self._channel.send(data[1:])
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                await self._close()
                raise TemplateGone(f"the spare supervisor for {name}") from None
        if scope.cancelled_caught:
            await self._end(f"did not take its attempt within {START_ANSWER_SECONDS:g} s")
            raise TemplateGone(f"the spare supervisor for {name}: {self.lost}")
        self.name = name

    async def discard(self) -> None:
        """Close a spare supervisor's channel, unused: it exits."""
        await self._close()

    async def stop(self, grace: float) -> None:
        """Ask the supervisor to end the attempt's processes (``SIGTERM``, ``SIGKILL`` after ``grace``); from now
        on its answers are due within ``grace`` plus :data:`ANSWER_MARGIN_SECONDS`. Returns at once (a send
        that cannot be made by then is given up: the waits then end the supervisor)."""
        if self._done:
            return  # they are gone (and the supervisor may be another attempt's by now)
        self._due(grace + ANSWER_MARGIN_SECONDS, "the stop")
        with anyio.CancelScope(deadline=self._deadline):
            try:
                await self._channel.send(f"stop {grace:.3f}\n".encode())
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass  # already gone

    async def _end(self, why: str) -> None:
        """The supervisor did not answer in time (or something else spoke for it: ``why``): end it and every
        process of its attempt (shielded: in a worker thread, reading ``/proc``); the attempt is lost (:attr:`lost`
        says why)."""
        with anyio.CancelScope(shield=True):
            state = await anyio.to_thread.run_sync(end_unanswered, self.supervisor, self._pidfd)
            self.lost = (
                f"{why} ({state}); aglverl ended it and every process of the attempt (SIGCONT, then SIGKILL)"
            )
            logger.warning("the supervisor (pid %d) of %s %s", self.supervisor, self.name, self.lost)
            self._done = True
            await self._close()

    async def _close(self) -> None:
        pidfd, self._pidfd = self._pidfd, None
        if pidfd is not None:
            os.close(pidfd)
        await self._channel.aclose()


def end_unanswered(supervisor: int, pidfd: int | None) -> str:
    """End a supervisor that stopped answering, and every process of its attempt: ``SIGCONT`` then ``SIGKILL``
    to each process of its session (which holds the agent's process group) and of its tree (processes that left
    the session are still below it: it is their subreaper), swept again while new ones turn up, then to the
    supervisor (through its ``pidfd``: never another process that took its number). Returns what the supervisor
    was doing (stopped, traced by whom, running, gone). Blocking (``/proc``): for a worker thread."""
    state = describe(supervisor)
    if pidfd is None or _exited(pidfd):
        return "it was gone, its channel held open by another process"
    for _ in range(_SWEEPS):  # the supervisor is alive: its session id and its children are its attempt's
        processes = table()
        tree: dict[int, list[int]] = {}
        for pid, (_, parent, _, _) in processes.items():
            tree.setdefault(parent, []).append(pid)
        members = {pid for pid, (_, _, _, sid) in processes.items() if sid == supervisor}
        members.update(descendants(supervisor, tree))
        members.discard(supervisor)
        alive = [pid for pid in members if processes.get(pid, (b"Z",))[0] != b"Z"]
        if not alive:
            break
        for pid in alive:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            signal.pidfd_send_signal(pidfd, sig)
        except OSError:
            pass
    return state


def _exited(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` has exited (its pidfd is readable then)."""
    import select

    ready, _, _ = select.select([pidfd], [], [], 0)
    return bool(ready)


def describe(pid: int) -> str:
    """What ``/proc`` says ``pid`` is doing, in words: stopped, traced (by which process), running, gone.
    Blocking (``/proc``): for a worker thread."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            status = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
    except OSError:
        return "it was gone"
    state = status.get(b"State", b"").strip()[:1]
    tracer = int(status.get(b"TracerPid", b"0").strip() or 0)
    if tracer:
        return f"it was traced by process {tracer} (ptrace), state {state.decode()}"
    if state == b"T":
        return "it was stopped (SIGSTOP)"
    if state == b"Z":
        return "it had exited"
    return f"it was running (state {state.decode()}), its answers not coming"
