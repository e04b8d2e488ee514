"""The plain spawn (:class:`Spawner`): every attempt's program is started anew, a command as it is, an agent class
in a new Python (Agent Lightning's local controller's way).

The program is exec'd by the attempt's process, forked from a supervisor that a small stdlib-only template
forks (:mod:`aglverl.runners._template`: ``python -I -S``, nothing imported). So even a spawned program runs under
a supervisor that is a child subreaper: what it starts stays in the attempt's tree and is ended with it, even
after ``setsid`` or a double fork.

A supervisor outlives its attempt: once every process of the attempt is gone (none could not be killed), it says
so and waits on the same channel for the next one, and the spawner keeps it (up to :data:`KEPT_MAX`). Each
attempt starts with one message to a waiting supervisor and its ``posix_spawn``: in a steady run no process is
forked but the programs themselves (a fork and an exit of a supervisor cost more CPU than ``sh -c true``).
Before the first attempts end, the spawner keeps :data:`SPARES` supervisors forked ahead; when none is waiting
(a burst of starts), an attempt's supervisor is forked for it. What one attempt did is not seen by the next:
the supervisor's children are all gone, and each attempt has its own process group, environment, directory,
streams and channel messages.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

import anyio
import anyio.abc
from anyio.abc import TaskStatus

from .environment import inherited
from .seam import AgentProcess, Launch, LaunchFailed
from .supervised import SupervisedProcess, TemplateGone
from .template import Template, TemplateHolder, fork_request

__all__ = ["AHEAD_MAX", "KEPT_MAX", "SPARES", "Spawner"]

#: How many supervisors a spawner keeps forked ahead of its attempts when none is waiting (once it has started one).
SPARES = 2
#: The most supervisors a spawner forks before its first attempts (``ahead``: a runner asks for its concurrency).
AHEAD_MAX = 16
#: The most supervisors a spawner keeps waiting between attempts (one per attempt running at once, at most; a
#: waiting one is a small Python process, its memory mostly shared with the template's).
KEPT_MAX = 64


class Spawner:
    """The plain spawn launcher (see the module docstring).

    ``env_allow``: the runner's variables each agent gets (:func:`~aglverl.runners.environment.inherited`);
    ``ahead``: how many supervisors to fork once the template runs, before any attempt (at most
    :data:`AHEAD_MAX`: the first attempts then start with one message each, none waits for a fork). Serve it
    with ``await tg.start(spawner.serve)``.
    """

    def __init__(self, *, env_allow: Sequence[str], ahead: int = 0) -> None:
        self.env_allow = tuple(env_allow)
        self.ahead = max(0, min(ahead, AHEAD_MAX))
        self._holder = TemplateHolder(self._template)
        self._tg: anyio.abc.TaskGroup | None = None
        self._spares: list[SupervisedProcess] = []
        self._refilling = False

    @property
    def waiting(self) -> int:
        """How many supervisors wait for an attempt (forked ahead, or kept from an attempt that ended)."""
        return len(self._spares)

    def _template(self) -> Template:
        return Template(
            [sys.executable, "-I", "-S"],
            "bare",
            [],
            env=self.environment({}),
            cwd="/",
            name="the spawner",
        )

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start the template, then hold it until cancelled (it is closed then; attempts keep running under their
        supervisors until the runner stops them)."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            try:
                await self._holder.get(tg)
                if self.ahead:  # before it says it can start: its first attempts find them waiting
                    self._refilling = True
                    await self._refill(self.ahead)
                task_status.started()
                await anyio.sleep_forever()
            finally:
                self._tg = None
                with anyio.CancelScope(shield=True):
                    spares, self._spares = self._spares, []
                    for spare in spares:
                        await spare.discard()
                await self._holder.aclose()
                tg.cancel_scope.cancel()

    def environment(self, agent: Mapping[str, str]) -> dict[str, str]:
        """The allowed variables of the runner's environment, then the agent's own."""
        return {**inherited(self.env_allow), **agent}

    async def start(self, launch: Launch) -> AgentProcess:
        """Have a supervisor exec ``launch.argv`` (a spare one if ready, else one forked now); :class:`LaunchFailed`
        when the program cannot run."""
        process = await self._take_spare(launch)
        if process is None:
            process = await self.fork(launch, exec_=True)
        process.on_idle = self._keep
        await process.started()
        return process

    def _keep(self, supervisor: SupervisedProcess) -> bool:
        """Keep a supervisor whose attempt is done for the next attempt (False: it is closed and exits)."""
        if self._tg is None or len(self._spares) >= KEPT_MAX:
            return False
        self._spares.append(supervisor)
        return True

    async def _take_spare(self, launch: Launch) -> SupervisedProcess | None:
        """A spare supervisor given ``launch`` (``None`` when none is ready); more are forked meanwhile."""
        process = None
        while self._spares and process is None:
            spare = self._spares.pop()  # the one that waited least
            try:
                await spare.assign(fork_request(launch, exec_=True), launch.stdin, launch.output, launch.name)
                process = spare
            except TemplateGone:
                pass  # it died (killed from outside): the next one, or a fork
        if not self._refilling and self._tg is not None:
            self._refilling = True
            self._tg.start_soon(self._refill, name="spawner: spare supervisors")
        return process

    async def _refill(self, spares: int = SPARES) -> None:
        """Fork spare supervisors up to ``spares`` (stops at the first failure: attempts then fork their own)."""
        try:
            while len(self._spares) < spares and self._tg is not None:
                template = await self._holder.get(self._tg)
                try:
                    spare = await template.spare()
                except TemplateGone:
                    self._holder.forget(template)
                    return
                if self._tg is None:  # the spawner stopped meanwhile
                    await spare.discard()
                    return
                self._spares.append(spare)
        except LaunchFailed:
            return
        finally:
            self._refilling = False

    async def fork(self, launch: Launch, *, exec_: bool) -> SupervisedProcess:
        if self._tg is None:
            raise LaunchFailed("the spawner is not serving")
        for _ in range(3):  # a template that died is started again
            template = await self._holder.get(self._tg)
            try:
                return await template.fork(
                    fork_request(launch, exec_=exec_), launch.stdin, launch.output, launch.name
                )
            except TemplateGone:
                self._holder.forget(template)
        raise LaunchFailed("the spawner's template process keeps dying (its output is on standard error)")

    async def stop(self, process: AgentProcess, grace: float) -> None:
        assert isinstance(process, SupervisedProcess)
        await process.stop(grace)

    def cpu_seconds(self) -> float:
        """The template's own CPU seconds so far."""
        template = self._holder.current
        return template.cpu_seconds() if template is not None else 0.0
