"""The seam between the attempts (:class:`~aglverl.runners.attempts.ProcessRunner`) and what starts an agent's
process for one of them: a :class:`Launcher`.

A launcher does four things: it holds whatever it needs while the runner serves (:meth:`Launcher.serve`: a fork
server's templates), says what environment an agent gets (:meth:`Launcher.environment`: the agent's own variables
plus what it passes on from the runner's environment), starts an attempt's process (:meth:`Launcher.start`) and
stops it (:meth:`Launcher.stop`). The two here are :class:`~aglverl.runners.spawn.Spawner` (the plain spawn: a
new program, or a new Python for an agent class, per attempt) and :class:`~aglverl.runners.forkserver.ForkServer`
(one template process per Python agent imports it once and forks per attempt). A container launcher would be
one more class: ``start`` runs the container with the attempt's environment, streams and limits, ``stop`` stops
it with the grace period, ``environment`` maps the endpoints and files into it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from anyio.abc import TaskStatus

__all__ = ["RESULT_MAX", "AgentExit", "AgentProcess", "Launch", "LaunchFailed", "Launcher"]

#: How much of :attr:`Launch.result_file` a launcher reads back.
RESULT_MAX = 256


class LaunchFailed(Exception):
    """The attempt's process could not be started (a program not found, an environment too large, a template
    that cannot import the agent...): the message says why, and the attempt fails with it."""


@dataclass(frozen=True, slots=True)
class Launch:
    """What to start for one attempt.

    ``argv``: the command line (for an agent class, the Python that runs it); ``env``: the whole environment
    (:meth:`Launcher.environment`'s); ``cwd``: its working directory; ``stdin`` / ``output``: descriptors for
    its standard input and for its standard output and error together (the launcher passes them on and never
    closes them: they are the caller's); ``limits``: resource limits (``{"as": bytes, "nofile": n, ...}``,
    ``RLIMIT_<NAME>`` lower-cased); ``grace``: seconds between ``SIGTERM`` and ``SIGKILL`` when the process
    tree is ended; ``name``: for messages and logs; ``result_file``: a file the launcher reads (its first
    :data:`RESULT_MAX` bytes) once no process of the attempt is left, for :attr:`AgentProcess.result` (the
    reward file: read where the processes were watched, the runner needs no thread of its own for it).
    """

    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str
    stdin: int
    output: int
    name: str
    limits: Mapping[str, int] = field(default_factory=dict)
    grace: float = 5.0
    result_file: str | None = None


@dataclass(frozen=True, slots=True)
class AgentExit:
    """How an agent's process ended: ``code`` (0 = success), or ``signal`` when a signal killed it, or neither
    when its supervisor vanished before it could say (``lost``); ``why``: why the launcher ended the attempt's
    processes itself, when it did (:attr:`AgentProcess.lost`)."""

    code: int | None = None
    signal: int | None = None
    why: str | None = None

    @property
    def lost(self) -> bool:
        return self.code is None and self.signal is None


class AgentProcess(Protocol):
    """One attempt's running process, as a launcher gives it back."""

    #: The agent's process id (what a process group, a log or ``ps`` names).
    pid: int
    #: The text of :attr:`Launch.result_file` once :meth:`finished` returned: ``""`` when there is no such regular
    #: file, ``None`` when the launcher does not read it (the runner reads it then).
    result: str | None
    #: Set when the launcher had to end the attempt's processes itself, saying why (what watched them stopped
    #: answering: a supervisor stopped or traced by its agent); the attempt is lost then.
    lost: str | None

    async def wait(self) -> AgentExit:
        """Return once the agent's process has exited (bounded once :meth:`Launcher.stop` was called: the grace
        period and a margin; past it the launcher ends the processes itself, :attr:`lost`). Cancellation only
        stops the wait."""
        ...

    async def finished(self) -> float | None:
        """Return once no process of the attempt is left (what the agent started included, each sent
        ``SIGTERM``, then ``SIGKILL`` after the grace period; bounded as :meth:`wait`); the CPU seconds they used,
        if known. Cancellation only stops the wait."""
        ...


class Launcher(Protocol):
    """Starts and stops the processes of attempts (see the module docstring)."""

    async def serve(self, *, task_status: TaskStatus[None]) -> None:
        """Hold what the launcher needs until cancelled (then release it); ``started()`` once it can start."""
        ...

    def environment(self, agent: Mapping[str, str]) -> dict[str, str]:
        """The whole environment of an attempt's process whose own variables are ``agent``."""
        ...

    async def start(self, launch: Launch) -> AgentProcess:
        """Start an attempt's process; :class:`LaunchFailed` saying why when it cannot be started."""
        ...

    async def stop(self, process: AgentProcess, grace: float) -> None:
        """End the attempt's process and every process it started: ``SIGTERM``, then ``SIGKILL`` after
        ``grace`` seconds. Returns at once; :meth:`AgentProcess.finished` says when they are gone."""
        ...
