"""What is checked of the agent before a run starts (:func:`check_agent`): that its program exists, and, deeply,
that its agent class or module loads in the agent's Python. A run that cannot start an agent says so before
Ray and verl are started, not at its first rollout."""

from __future__ import annotations

import os
import shutil

import anyio
import anyio.to_thread

from ..config_errors import ConfigError
from .environment import inherited
from .forkserver import python_agent
from .options import ProcessOptions

__all__ = ["check_agent"]

#: Run by the agent's Python: loads an agent class (``class module:Class``) or finds a module (``module name``).
_CHECK = """\
import importlib, importlib.util, sys
kind, spec = sys.argv[1], sys.argv[2]
if kind == "module":
    if importlib.util.find_spec(spec) is None:
        raise SystemExit(f"No module named {spec!r}")
else:
    module, sep, name = spec.partition(":")
    if not sep:
        module, _, name = spec.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    if not isinstance(cls, type) or not callable(getattr(cls, "run", None)):
        raise SystemExit(f"{spec} is not a class with a run() method")
"""
_CHECK_SECONDS = 300.0


async def check_agent(options: ProcessOptions, *, deep: bool = True) -> None:
    """Raise :class:`~aglverl.config_errors.ConfigError` naming the agent and what is wrong when its process
    cannot start: a working directory that is not one, a program or a Python that is not installed (looked up on
    the ``PATH`` the agent gets), a script that does not exist; with ``deep``, an agent class (or ``-m``
    module) that its Python cannot load (that Python runs once, importing it: a second or two for a module that
    imports an SDK)."""
    if not options.enabled:
        return
    what = f"aglverl.processes ({options.what})"
    cwd = options.cwd or os.getcwd()
    env = inherited(options.env_allow)
    search = env.get("PATH", os.defpath)
    await anyio.to_thread.run_sync(_check_files, options, what, cwd, search)
    agent = python_agent(options)
    if not deep or agent is None or agent.kind not in ("class", "module"):
        return
    python = await anyio.to_thread.run_sync(_which, agent.command[0], search, cwd) or agent.command[0]
    with anyio.move_on_after(_CHECK_SECONDS):
        done = await anyio.run_process(
            [python, "-c", _CHECK, agent.kind, agent.spec[0]], env=env, cwd=cwd, check=False
        )
        if done.returncode != 0:
            lines = [line for line in done.stderr.decode(errors="replace").splitlines() if line.strip()]
            raise ConfigError(
                f"{what} cannot be loaded by {python}: {lines[-1].strip() if lines else done.returncode}"
            )


def _check_files(options: ProcessOptions, what: str, cwd: str, search: str) -> None:
    if not os.path.isdir(cwd):
        raise ConfigError(f"{what}: the working directory {cwd!r} (aglverl.processes.cwd) is not a directory")
    program = options.argv()[0]
    if _which(program, search, cwd) is None:
        where = (
            "no such executable file" if os.sep in program else f"not found on the agents' PATH ({search})"
        )
        raise ConfigError(f"{what}: {program!r} is not installed: {where}")
    agent = python_agent(options)
    if agent is not None and agent.kind == "script" and not os.path.isfile(os.path.join(cwd, agent.spec[0])):
        raise ConfigError(f"{what}: the script {agent.spec[0]!r} does not exist (in {cwd})")


def _which(program: str, search: str, cwd: str) -> str | None:
    if os.sep in program:
        path = os.path.join(cwd, program)
        return path if os.path.isfile(path) and os.access(path, os.X_OK) else None
    return shutil.which(program, path=search)
