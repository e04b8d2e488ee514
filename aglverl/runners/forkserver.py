"""The fork server (:class:`ForkServer`): a Python agent imported once, each attempt a fork.

For a Python agent (an Agent Lightning agent class, or a command ``python [flags] script.py ...``, ``python -m
module ...``, ``python -c code ...``) one template process, started by the agent's own Python with the command's
flags, imports the agent's module and what the agent class's body imports (or what the script imports at its
top level) (:mod:`aglverl.runners._template`). Each attempt is a fork of it: the agent runs in place in a process of its
own, with its own process group, environment, working directory, standard streams and resource limits, under
a supervisor that ends it exactly as a spawned one (``SIGTERM``, ``SIGKILL`` after the grace period, the whole
tree). Starting an attempt costs a fork (milliseconds) instead of an interpreter and its imports (an OpenAI SDK
agent: ~1.2 s of CPU).

- A template that dies is started again at the next attempt.
- The agent's own files (its module or script, and every module imported from outside the Python installation)
  are checked at each fork: a changed one makes the template exit, and the next attempt runs in a new one that
  imports the new code.
- What the agent imports as it runs (an SDK's lazy imports at its first call, say) is reported by each fork when
  it ends, and the template imports it before the next forks: from the second wave of attempts on, they find
  it imported. Only the Python installation's modules (files under its prefixes, site-packages or ``sysconfig``
  paths, not in the agent's folder or the working directory, not written since the template started): a module
  an attempt wrote and imported is never run in the template, nor found there by the next attempt. An import
  that leaves a thread running in the template is not made there again.
- A template never forks while threads run in it (forking a process with threads can deadlock the child, and
  the threads are not in it): if importing the agent started one, this agent's attempts are spawned instead (a
  new Python each), with a warning saying why.
- Anything that is not a Python agent (a shell script, a binary, a command string with shell syntax) is
  spawned (:class:`~aglverl.runners.spawn.Spawner`).
- Module-level code of the agent runs once, in the template, with the runner's allowed variables (not an
  attempt's): read an attempt's variables in ``run()``.
- Each fork draws its own random numbers: numpy's global generator and torch's default ones are reseeded from
  the OS before the agent runs (when imported; :func:`aglverl.runners._template.agent.reseed`), Python reseeds
  ``random``'s at every fork. Generator objects the agent's module made at import stay shared (seed them from
  ``AGL_SEED``, each attempt's own seed), and so does the hash seed.

``fork_server: false`` (``aglverl.processes``) turns it off: every attempt then starts a new Python.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
from anyio.abc import TaskStatus

from .options import ProcessOptions
from .seam import AgentProcess, Launch, LaunchFailed
from .spawn import AHEAD_MAX, SPARES, Spawner
from .supervised import SupervisedProcess, TemplateGone, TemplateStale
from .template import Template, TemplateHolder, TemplateThreaded, fork_request

__all__ = ["ForkServer", "PythonAgent", "python_agent"]

logger = logging.getLogger(__name__)

_PYTHON = re.compile(r"python(\d+(\.\d+)?)?")
_SHELL_SYNTAX = re.compile(r"[|&;<>()$`\\\"'*?\[\]#~=%{}\n!]")
_FLAG_WITH_VALUE = "WX"
#: The most module names a fork server learns to import beforehand.
_LEARNED_MAX = 20_000


@dataclass(frozen=True)
class PythonAgent:
    """What a template runs: ``command`` (the Python and its flags), ``kind`` / ``spec`` (the template's), and the
    ``argv`` the agent sees as ``sys.argv``."""

    command: tuple[str, ...]
    kind: str
    spec: tuple[str, ...]
    argv: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.kind} {' '.join(self.spec)[:80]}"


def python_agent(options: ProcessOptions) -> PythonAgent | None:
    """The Python agent ``options`` run, or ``None`` when the agent is not one (it is spawned then)."""
    if options.agent_class is not None:
        python = options.python or sys.executable
        return PythonAgent((python,), "class", (options.agent_class,), ("-c", options.agent_class))
    command = options.command
    if isinstance(command, str):
        if _SHELL_SYNTAX.search(command):
            return None
        command = tuple(shlex.split(command))
    if not command or not _is_python(command[0]):
        return None
    return _parse_python(command)


def _is_python(program: str) -> bool:
    return bool(_PYTHON.fullmatch(os.path.basename(program))) or os.path.abspath(program) == sys.executable


def _parse_python(argv: Sequence[str]) -> PythonAgent | None:
    """``python [flags] (script | -m module | -c code) args...`` as a template's run; ``None`` for anything else
    (no program, ``-`` for stdin, an option this does not know)."""
    flags: list[str] = []
    i = 1
    while i < len(argv):
        token = argv[i]
        if not token.startswith("-") or token == "-":
            break
        if token.startswith("--"):
            return None  # --version, --help, --check-hash-based-pycs...: not an agent run
        j = 1
        while j < len(token):
            letter = token[j]
            if letter in "mc":
                value = token[j + 1 :] or (argv[i + 1] if i + 1 < len(argv) else None)
                if value is None:
                    return None
                rest = argv[i + (1 if token[j + 1 :] else 2) :]
                command = (argv[0], *flags)
                if letter == "m":
                    return PythonAgent(command, "module", (value,), (value, *rest))
                return PythonAgent(command, "code", (value,), ("-c", *rest))
            if letter in _FLAG_WITH_VALUE:
                value = token[j + 1 :] or (argv[i + 1] if i + 1 < len(argv) else "")
                flags.extend([f"-{letter}", value])
                if not token[j + 1 :]:
                    i += 1
                break
            flags.append(f"-{letter}")
            j += 1
        i += 1
    if i >= len(argv) or argv[i] == "-":
        return None
    return PythonAgent((argv[0], *flags), "script", (argv[i],), tuple(argv[i:]))


class ForkServer:
    """The fork server launcher (see the module docstring): ``options`` say what the agent is; anything it cannot
    fork goes to ``spawner`` (made here if not given). Serve it with ``await tg.start(fork_server.serve)``."""

    def __init__(self, options: ProcessOptions, *, spawner: Spawner | None = None, ahead: int = 0) -> None:
        self.options = options
        self.agent = python_agent(options) if options.fork_server else None
        # ``ahead``: supervisors forked before the first attempts (the spawner's when it runs them: not a Python agent)
        self.spawner = spawner or Spawner(
            env_allow=options.env_allow, ahead=ahead if self.agent is None else 0
        )
        #: Why this agent's attempts are spawned rather than forked (``None`` while they are forked).
        self.off: str | None = (
            None if self.agent is not None else "not a Python agent, or the fork server is off"
        )
        self._holder = TemplateHolder(self._template)
        self._tg: anyio.abc.TaskGroup | None = None
        #: Modules the agent's forks imported beyond the template's: the template imports them before the next
        #: forks (an SDK's lazy imports at its first call); ``_refused``: those whose import started a thread, or
        #: that are not the Python installation's (the template left them out).
        self.learned: set[str] = set()
        self._refused: set[str] = set()
        self._preloading = anyio.Lock()  # one preload at a time: the attempts that waited for it find it done
        # supervisors forked ahead of their attempts, each with its template and how many preloads it had then
        self._spares: list[tuple[Template, int, SupervisedProcess]] = []
        self._refilling = False
        self.ahead = max(0, min(ahead, AHEAD_MAX))

    @property
    def starts(self) -> int:
        """How many templates were started (the first, and one per restart)."""
        return self._holder.starts

    def _template(self) -> Template:
        assert self.agent is not None
        return Template(
            self.agent.command,
            self.agent.kind,
            self.agent.spec,
            env=self.spawner.environment({}),
            cwd=self.options.cwd or os.getcwd(),
            name=self.options.what,
        )

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start the spawner and (at once, so its imports are done before the first attempt) the template; hold
        them until cancelled. A template that cannot start now is tried again by each attempt (which fails with
        its error meanwhile)."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            try:
                await tg.start(self.spawner.serve)
                if self.agent is not None:
                    try:
                        await self._ready(tg)
                        if self.ahead:  # before it says it can start: the first attempts find them waiting
                            self._refilling = True
                            await self._refill(self.ahead)
                    except LaunchFailed as exc:
                        logger.warning("%s", exc)
                    except (TemplateThreaded, TemplateGone):
                        pass  # said once, in _spawn_from_now; or tried again by the first attempt
                task_status.started()
                await anyio.sleep_forever()
            finally:
                self._tg = None
                await self._drop_spares()
                await self._holder.aclose()
                tg.cancel_scope.cancel()

    async def _ready(self, tg: anyio.abc.TaskGroup) -> Template:
        """The template, started if need be, with what earlier forks imported imported too."""
        while True:
            template = await self._holder.get(tg)
            threads = int(template.info.get("threads", 1))
            if threads > 1:
                self._spawn_from_now(template, threads)
                raise TemplateThreaded(threads)
            if not self.learned - template.preloaded:
                return template
            async with self._preloading:
                missing = self.learned - template.preloaded
                if not missing or not template.alive:
                    continue  # preloaded meanwhile (or the template died: the holder starts another)
                culprit = await template.preload(sorted(missing))
            self._refused.update(template.skipped)  # never the installation's: not asked again
            self.learned.difference_update(template.skipped)
            if culprit is None:
                return template
            logger.info(
                "aglverl's fork server: importing %s started a thread; the template no longer imports it "
                "before forking (a new template is started)",
                culprit,
            )
            self._refused.add(culprit)
            self.learned.discard(culprit)
            self._holder.forget(template)

    def _learn(self, process: SupervisedProcess) -> None:
        if len(self.learned) < _LEARNED_MAX:
            self.learned.update(n for n in process.imported if n not in self._refused)

    def _spawn_from_now(self, template: Template, threads: int) -> None:
        self.off = (
            f"importing {self.options.what} started {threads - 1} thread(s), and a process with threads must not "
            "fork (the child could deadlock on a lock a thread held): each attempt starts a new Python instead"
        )
        logger.warning("aglverl's fork server: %s", self.off)
        self._holder.forget(template)
        if self._tg is not None:
            self._tg.start_soon(template.aclose)

    def environment(self, agent: Mapping[str, str]) -> dict[str, str]:
        """The allowed variables of the runner's environment, then the agent's own (as the spawner's)."""
        return self.spawner.environment(agent)

    async def start(self, launch: Launch) -> AgentProcess:
        """Fork the attempt from the agent's template (spawn it when the agent cannot be forked)."""
        if self.off is not None or self.agent is None or self._tg is None:
            return await self.spawner.start(launch)
        for _ in range(3):
            try:
                template = await self._ready(self._tg)
            except TemplateThreaded:
                return await self.spawner.start(launch)
            except TemplateGone:
                continue
            request = fork_request(launch, exec_=False, argv=self.agent.argv)
            try:
                process = await self._take_spare(template, request, launch)
                if process is None:
                    process = await template.fork(request, launch.stdin, launch.output, launch.name)
                process.on_done = self._learn
                await process.started()
            except TemplateStale as exc:
                logger.info("aglverl's fork server: %s changed; a new template imports it", exc)
                self._holder.forget(template)
                await self._drop_spares()
                continue
            except TemplateGone:
                self._holder.forget(template)
                continue
            except TemplateThreaded as exc:
                self._spawn_from_now(template, exc.args[0])
                return await self.spawner.start(launch)
            return process
        raise LaunchFailed(
            f"the template of {self.options.what} keeps dying or changing (its output is on standard error)"
        )

    async def _take_spare(
        self, template: Template, request: Mapping[str, Any], launch: Launch
    ) -> SupervisedProcess | None:
        """A spare supervisor of ``template`` as it is now (its preloads done) given the attempt, or ``None``;
        spares of another template or of fewer preloads are closed; more are forked meanwhile."""
        process = None
        while self._spares and process is None:
            owner, preloads, spare = self._spares.pop()
            if owner is not template or preloads != template.preloads:
                await spare.discard()
                continue
            try:
                await spare.assign(request, launch.stdin, launch.output, launch.name)
                process = spare
            except TemplateGone:
                pass  # it died (killed from outside): the next one, or a fork
        if not self._refilling and self._tg is not None:
            self._refilling = True
            self._tg.start_soon(self._refill, SPARES, name="fork server: spare supervisors")
        return process

    async def _refill(self, count: int) -> None:
        """Fork spare supervisors of the current template up to ``count`` (stops at the first failure: attempts
        then have theirs forked)."""
        try:
            while len(self._spares) < count and self._tg is not None:
                template = self._holder.current
                if template is None or not template.alive:
                    return
                preloads = template.preloads
                try:
                    spare = await template.spare()
                except (TemplateGone, TemplateStale, TemplateThreaded, LaunchFailed):
                    return
                if self._tg is None or template is not self._holder.current:
                    await spare.discard()
                    return
                self._spares.append((template, preloads, spare))
        finally:
            self._refilling = False

    async def _drop_spares(self) -> None:
        with anyio.CancelScope(shield=True):
            spares, self._spares = self._spares, []
            for _, _, spare in spares:
                await spare.discard()

    async def stop(self, process: AgentProcess, grace: float) -> None:
        assert isinstance(process, SupervisedProcess)
        await process.stop(grace)

    def cpu_seconds(self) -> float:
        """The templates' own CPU seconds so far (the live ones')."""
        template = self._holder.current
        return self.spawner.cpu_seconds() + (template.cpu_seconds() if template is not None else 0.0)
