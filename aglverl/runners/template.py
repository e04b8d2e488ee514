"""The runner's side of a template process (:mod:`aglverl.runners._template`, run by the agent's Python):
:class:`Template` starts one, asks it to fork attempts, and knows when it died; what it forks is a
:class:`~aglverl.runners.supervised.SupervisedProcess`, one attempt's process as its supervisor reports it.

Protocol, over Unix sockets, newline-delimited JSON. The control socket (the template's fd, given on its command
line): the template says ``{"ready": ...}`` (or ``{"error": ...}`` and exits); a fork request is a JSON object
(``env``, ``cwd``, ``argv``, ``exec``, ``limits``, ``grace``, ``result_file``) whose first byte carries three descriptors (the
attempt's stdin, its output, the supervisor's end of the attempt's channel); the answer is ``{"forked": pid}``,
``{"stale": path}`` (the agent's file changed: the template has exited), ``{"threads": n}`` (it runs threads: it
must not fork) or ``{"error": ...}``. The attempt's channel: the supervisor says ``{"started": pid}`` or
``{"failed": why}``, ``{"exited": {"code"|"signal": n}}``, ``{"done": {"cpu_s": x, "result": text, ...}}``
(``result``: the request's ``result_file``'s first bytes, ``""`` without one; ``"waits": true`` from a bare
template's supervisor once every process of the attempt is gone: it waits on the same channel for its next
attempt, as a spare does); the runner may send ``stop <grace>``. Closing the control socket ends the template;
closing a channel ends its attempt (and a waiting supervisor).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import orjson
from anyio.streams.buffered import BufferedByteReceiveStream

from .channel import open_channel
from .seam import Launch, LaunchFailed
from .supervised import SupervisedProcess, TemplateGone, TemplateStale, describe, read_line

__all__ = ["BOOTSTRAP", "Template", "TemplateHolder", "TemplateThreaded", "fork_request"]

logger = logging.getLogger(__name__)

#: The template's program (:mod:`aglverl.runners._template`, stdlib only), as the agent's Python loads it: the
#: package's folder registered under a private name (nothing of aglverl imported, no agent module can shadow
#: it; nothing imported but what the template uses: no ``importlib.util``), then its ``main`` with the command
#: line's arguments. Its compiled files are those ``__pycache__`` keeps.
TEMPLATE_DIR = Path(__file__).with_name("_template")
BOOTSTRAP = (
    "import sys\n"
    "package = type(sys)('_aglverl_template', 'aglverl.runners._template, loaded by its folder')\n"
    f"package.__path__ = [{str(TEMPLATE_DIR)!r}]\n"
    "sys.modules[package.__name__] = package\n"
    "from _aglverl_template.main import main\n"
    "main(sys.argv[1:])\n"
)
#: How long a template may take to import its agent before it is given up (a model library can take a while).
START_SECONDS = 300.0


class TemplateThreaded(Exception):
    """The template runs threads (its imports started them): it must not fork."""


def fork_request(launch: Launch, *, exec_: bool, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """A fork request for ``launch``: exec its ``argv`` (``exec_``) or run the template's agent with ``argv``."""
    return {
        "env": dict(launch.env),
        "cwd": launch.cwd,
        "argv": list(argv if argv is not None else launch.argv),
        "exec": exec_,
        "limits": dict(launch.limits),
        "grace": launch.grace,
        "result_file": launch.result_file,
    }


class Template:
    """One template process: ``command`` (the Python and its flags), ``kind`` and ``spec`` (what it prepares),
    started in ``cwd`` with ``env``; what it prints (an import's warnings) goes to this process's standard
    error. :meth:`start` it in a task group (which watches it), :meth:`fork` attempts, :meth:`aclose` it."""

    def __init__(
        self,
        command: Sequence[str],
        kind: str,
        spec: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str,
        name: str,
        answer_seconds: float = START_SECONDS,
    ) -> None:
        self.command = list(command)
        #: How long it may take to answer a request (a fork, a preload's imports): past it, it is ended.
        self.answer_seconds = answer_seconds
        self.kind = kind
        self.spec = list(spec)
        self.env = dict(env)
        self.cwd = cwd
        self.name = name
        self.pid: int | None = None
        self.info: dict[str, Any] = {}
        #: Modules imported by :meth:`preload` (beyond what the template's agent imports itself).
        self.preloaded: set[str] = set()
        #: How many :meth:`preload` requests it answered.
        self.preloads = 0
        #: Modules :meth:`preload` left out: not the Python installation's (the agent's own, an attempt's).
        self.skipped: set[str] = set()
        self._process: anyio.abc.Process | None = None
        self._control: anyio.abc.UNIXSocketStream | None = None
        self._reader: BufferedByteReceiveStream | None = None
        # requests are pipelined (see _ask): sent one at a time, answered in order, each caller taking its own
        self._sending = anyio.Lock()
        self._reading = anyio.Lock()
        self._sent = 0
        self._read = 0
        self._answers: dict[int, dict[str, Any] | None] = {}
        self._abandoned: set[int] = set()
        self._gone = anyio.Event()

    @property
    def alive(self) -> bool:
        return self._control is not None and not self._gone.is_set()

    async def start(self, tg: anyio.abc.TaskGroup) -> dict[str, Any]:
        """Start the template and return its ``ready`` report; :class:`LaunchFailed` naming the agent and the
        error (an import error's last lines) when it cannot prepare it. ``tg`` watches the process."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            argv = [*self.command, "-c", BOOTSTRAP, str(theirs.fileno()), self.kind, *self.spec]
            try:
                process = await anyio.open_process(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=None,
                    stderr=None,
                    env=self.env,
                    cwd=self.cwd,
                    pass_fds=[theirs.fileno()],
                    start_new_session=True,
                )
            except OSError as exc:
                ours.close()
                raise LaunchFailed(
                    f"cannot start {self.command[0]!r} for {self.name}: {exc.strerror or exc}"
                ) from None
        finally:
            theirs.close()
        self._process, self.pid = process, process.pid
        self._control = await open_channel(ours)
        self._reader = BufferedByteReceiveStream(self._control)
        tg.start_soon(self._watch, process, name=f"template {self.name}")
        with anyio.move_on_after(START_SECONDS):
            ready = await read_line(self._reader)
            if ready is not None and "ready" in ready:
                self.info = ready["ready"]
                return self.info
            await self.aclose()
            if ready is None:
                raise LaunchFailed(
                    f"{self.name}: its template process ended before it was ready (its output is "
                    "on this process's standard error)"
                )
            raise LaunchFailed(
                f"{self.name} cannot be loaded: {ready.get('error')}\n{ready.get('traceback', '')}".rstrip()
            )
        await self.aclose()
        raise LaunchFailed(f"{self.name}: its template did not load it within {START_SECONDS:g} s")

    async def _watch(self, process: anyio.abc.Process) -> None:
        try:
            await process.wait()
        finally:
            self._gone.set()
            if self._control is not None:
                with anyio.CancelScope(shield=True):
                    await self._control.aclose()

    async def fork(self, request: Mapping[str, Any], stdin: int, output: int, name: str) -> SupervisedProcess:
        """Fork an attempt (its supervisor and process); returns it once its supervisor runs (not yet its agent:
        :meth:`SupervisedProcess.started`). Raises :class:`TemplateGone`, :class:`TemplateStale`,
        :class:`TemplateThreaded`, or :class:`LaunchFailed`."""
        return await self._fork(request, [stdin, output], name)

    async def spare(self) -> SupervisedProcess:
        """Fork a spare supervisor: one that has set itself up (its session, signals, subreaper) and waits on its
        channel for an attempt (:meth:`SupervisedProcess.assign`), so that starting an attempt costs one message to
        it, not a fork of the template and a round trip through it. A bare template's spare execs the program it
        is given; a Python template's forks the agent as the template imported it (then: its own files checked
        first, :class:`TemplateStale` from :meth:`SupervisedProcess.started` if one changed since). Raises as
        :meth:`fork`."""
        return await self._fork({"spare": True}, [], "a spare supervisor")

    async def _fork(self, request: Mapping[str, Any], fds: list[int], name: str) -> SupervisedProcess:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            answer = await self._ask(orjson.dumps(request) + b"\n", [*fds, theirs.fileno()])
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        if answer is None:
            ours.close()
            raise TemplateGone(self.name)
        if "forked" in answer:
            return SupervisedProcess(
                int(answer["forked"]),
                await open_channel(ours),
                name,
                grace=float(request.get("grace", 5.0)),
            )
        ours.close()
        if "stale" in answer:
            raise TemplateStale(str(answer["stale"]))
        if "threads" in answer:
            raise TemplateThreaded(int(answer["threads"]))
        raise LaunchFailed(f"{self.name}'s template refused a fork: {answer.get('error', answer)}")

    async def _ask(self, data: bytes, fds: Sequence[int]) -> dict[str, Any] | None:
        """Send one request (its first byte carrying ``fds``) and return its answer (``None``: the template is gone).
        Requests are pipelined: the next one is sent while the template still works on this one (a burst of
        forks waits for no round trip between them); the template answers in order, and each caller takes its
        own answer (one whose caller was cancelled is dropped). Raises :class:`TemplateGone` if it cannot send."""
        async with self._sending:
            if not self.alive or self._control is None or self._reader is None:
                raise TemplateGone(self.name)
            with anyio.move_on_after(self.answer_seconds) as sending:
                try:
                    if fds:
                        await self._control.send_fds(data[:1], fds)
                        await self._control.send(data[1:])
                    else:
                        await self._control.send(data)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    raise TemplateGone(self.name) from None
            if sending.cancelled_caught:
                await self._end_unanswering()
                raise TemplateGone(self.name)
            ticket, self._sent = self._sent, self._sent + 1
        try:
            async with self._reading:
                reader = self._reader
                while self._read <= ticket and reader is not None:
                    line = None
                    with anyio.move_on_after(self.answer_seconds) as waiting:
                        line = await read_line(reader)
                    if waiting.cancelled_caught:
                        await self._end_unanswering()  # the answers still due will not come: None each
                    if self._read not in self._abandoned:
                        self._answers[self._read] = line
                    self._abandoned.discard(self._read)
                    self._read += 1
        finally:
            answered = ticket in self._answers
            answer = self._answers.pop(ticket, None)
            if not answered and self._read <= ticket:
                self._abandoned.add(ticket)  # cancelled before its answer came: whoever reads it drops it
        return answer

    async def _end_unanswering(self) -> None:
        """The template did not answer within :attr:`answer_seconds` (stopped or traced by a process of its
        user, an agent say): kill it (``SIGCONT``, then ``SIGKILL``) and close its control socket; the attempts it
        forked run on under their supervisors, and the holder starts another template."""
        process = self._process
        if process is None or self._gone.is_set():
            return
        with anyio.CancelScope(shield=True):
            state = await anyio.to_thread.run_sync(describe, process.pid)
            logger.warning(
                "the template (pid %d) of %s did not answer within %g s (%s): it is ended, and another started",
                process.pid,
                self.name,
                self.answer_seconds,
                state,
            )
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    process.send_signal(sig)
                except ProcessLookupError:
                    pass
            control, self._control = self._control, None  # not alive from now on
            if control is not None:
                await control.aclose()

    async def preload(self, names: Sequence[str]) -> str | None:
        """Have the template import ``names`` (modules its agent's forks imported: their cost is then paid once),
        those of the Python installation (:attr:`skipped` gets the others); returns the module whose import left
        a thread running (the template has exited then), else ``None``. Raises :class:`TemplateGone`."""
        answer = await self._ask(orjson.dumps({"preload": list(names)}) + b"\n", [])
        if answer is None:
            raise TemplateGone(self.name)
        self.preloads += 1
        if "module" in answer:
            return str(answer["module"])
        skipped = {str(n) for n in answer.get("skipped") or ()}
        self.skipped.update(skipped)
        self.preloaded.update(n for n in names if n not in skipped)
        return None

    def cpu_seconds(self) -> float:
        """The template's own CPU seconds so far (0 once it has exited: the runner's children's time has it)."""
        if self.pid is None or self._gone.is_set():
            return 0.0
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return 0.0

    async def aclose(self) -> None:
        """End the template: its control socket closed (it exits), then its process waited for (killed if it
        has not exited within a few seconds). Attempts it forked run on under their supervisors."""
        with anyio.CancelScope(shield=True):
            if self._control is not None:
                await self._control.aclose()
            process = self._process
            if process is None:
                return
            with anyio.move_on_after(5):
                await process.wait()
                return
            try:
                process.kill()
            except ProcessLookupError:
                pass
            await process.wait()


class TemplateHolder:
    """One template kept running for a launcher: started on first use (or by :meth:`get` early), started again
    when it died or went stale; at most one start at a time."""

    def __init__(self, make: Callable[[], Template]) -> None:
        self._make = make
        self._template: Template | None = None
        self._lock = anyio.Lock()
        self.starts = 0

    async def get(self, tg: anyio.abc.TaskGroup) -> Template:
        """The running template (started now if there is none alive); :class:`LaunchFailed` if it cannot start."""
        async with self._lock:
            template = self._template
            if template is None or not template.alive:
                self._template = None
                template = self._make()
                self.starts += 1
                await template.start(tg)
                self._template = template
            return template

    def forget(self, template: Template) -> None:
        """``template`` is gone (or stale): the next :meth:`get` starts another."""
        if self._template is template:
            self._template = None

    @property
    def current(self) -> Template | None:
        return self._template

    async def aclose(self) -> None:
        template, self._template = self._template, None
        if template is not None:
            await template.aclose()
