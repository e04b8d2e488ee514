"""The ``aglverl.processes`` section (:class:`ProcessOptions`), the agent's ``env_map`` (:func:`resolve_env_map`)
and how many agent processes run at once by default (:func:`default_concurrency`)."""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from ..models import check_reward

__all__ = [
    "AGENT_CLASS_SHIM",
    "DEFAULT_ENV_ALLOW",
    "FORKED_PER_CORE",
    "MEMORY_PER_AGENT",
    "MEMORY_PER_FORKED_AGENT",
    "PROCESSES_PER_CORE",
    "ProcessOptions",
    "default_concurrency",
    "resolve_env_map",
]

#: What a new Python runs for an agent class when it is spawned (the fork server imports it once instead); it
#: must not need aglverl: the agent's Python may not have it.
AGENT_CLASS_SHIM = """\
import asyncio, importlib, inspect, sys
spec = sys.argv[1]
module, sep, name = spec.partition(":")
if not sep:
    module, _, name = spec.rpartition(".")
cls = getattr(importlib.import_module(module), name)
if not isinstance(cls, type):
    raise TypeError(f"{spec} is not a class")
result = cls().run()
if inspect.isawaitable(result):
    asyncio.run(result)
"""

#: The variables an agent's process gets from the runner's environment unless ``env_allow`` says otherwise
#: (names, or shell patterns such as ``LC_*``): where programs are, who and where the user is, the locale, the
#: Python and library paths, the certificates to trust, and which hosts bypass a proxy. Nothing else: no API
#: key, token or proxy credential of the runner's (``WANDB_API_KEY``, ``HF_TOKEN``, ``AWS_*``, ``HTTP_PROXY``...)
#: reaches an agent unless named. The agent's own variables (``AGL_*``, the SDKs' endpoints and its key, the
#: ``env_map`` fields) come on top.
DEFAULT_ENV_ALLOW: tuple[str, ...] = (
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_*", "TZ", "TERM", "TMPDIR", "TMP", "TEMP",
    "PYTHONPATH", "PYTHONHOME", "PYTHONUNBUFFERED", "PYTHONIOENCODING", "PYTHONUTF8", "PYTHONDONTWRITEBYTECODE",
    "PYTHONWARNINGS", "VIRTUAL_ENV", "CONDA_PREFIX", "CONDA_DEFAULT_ENV", "LD_LIBRARY_PATH",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS",
    "NO_PROXY", "no_proxy",
)  # fmt: skip

#: The default concurrency's bounds: agent processes per core, and the memory one agent is counted for, when
#: each starts a new program or interpreter, and when it is a fork of a template that imported it (it costs a
#: few ms of CPU to start and shares the template's memory).
PROCESSES_PER_CORE = 4
MEMORY_PER_AGENT = 256 << 20
FORKED_PER_CORE = 16
MEMORY_PER_FORKED_AGENT = 64 << 20

_LIMIT_NAMES = frozenset({"as", "core", "cpu", "data", "fsize", "memlock", "nofile", "nproc", "stack"})
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def default_concurrency(rollouts: int, *, forked: bool = False) -> int:
    """How many agent processes run at once when ``aglverl.agents`` is not set: a step's ``rollouts``, but at most
    :data:`PROCESSES_PER_CORE` per core this process may use and one per :data:`MEMORY_PER_AGENT` of the memory
    available now, or, for agents the fork server forks (``forked``), :data:`FORKED_PER_CORE` and one per
    :data:`MEMORY_PER_FORKED_AGENT` (at least 1). On a 2-core machine with 19 GiB free: 8, or 32 forked."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    per_core, memory = (
        (FORKED_PER_CORE, MEMORY_PER_FORKED_AGENT) if forked else (PROCESSES_PER_CORE, MEMORY_PER_AGENT)
    )
    return max(1, min(rollouts, per_core * cores, _available_memory() // memory))


def _available_memory() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 40  # unknown: cores bound it


@dataclass(frozen=True)
class ProcessOptions:
    """The ``aglverl.processes`` section: what the built-in runner runs for each rollout attempt, and how.

    What to run:

    - ``agent_class``: an Agent Lightning v1.0 agent class, ``"module:Class"`` or ``"module.Class"``, importable
      by ``python`` from ``cwd`` or its ``PYTHONPATH``; or
    - ``command``: any program, a list of arguments or a string for ``/bin/sh -c``;
    - ``python``: the interpreter of an agent class (``None``: the one running aglverl);
    - ``env_map``: environment variables from the task input (Agent Lightning's ``local.env_map``).

    How:

    - ``fork_server`` (default on): a Python agent (an agent class, or a command ``python script.py``, ``python -m
      module``, ``python -c code``) is imported once by a template process that forks each attempt's process
      (milliseconds, nothing imported again); off, every attempt starts a new Python (Agent Lightning's way);
    - ``cwd``: the working directory of the agent's processes (``None``: the runner's);
    - ``env_allow``: the variables of the runner's environment an agent gets (names or shell patterns; default
      :data:`DEFAULT_ENV_ALLOW`, no secrets; ``["*"]``: all of them);
    - ``limits``: resource limits of each agent process (``{"as": bytes, "cpu": seconds, "nofile": n, ...}``,
      ``RLIMIT_<NAME>`` lower-cased; soft and hard);
    - ``timeout_seconds``: the attempt's deadline; ``kill_grace_seconds``: between the ``SIGTERM`` and the
      ``SIGKILL`` that end an attempt's processes (at its deadline, when it ends elsewhere, at shutdown);
    - ``reward_fillna_value``: the reward of a process that exits 0 without reporting one (``None``: it fails);
    - ``log_dir``: where each attempt's output goes (``None``: ``<trainer.default_local_dir>/agent_logs`` under
      ``AsyncVERL``); ``log_max_bytes``: the most of it kept per attempt (the rest is counted, not written).

    The runner starts only when ``agent_class`` or ``command`` is set (and ``aglverl.agents`` is not 0).
    """

    agent_class: str | None = None
    command: str | tuple[str, ...] | None = None
    env_map: Mapping[str, str] = field(default_factory=dict)
    timeout_seconds: float = 3600.0
    reward_fillna_value: float | None = None
    log_dir: str | None = None
    python: str | None = None
    fork_server: bool = True
    cwd: str | None = None
    env_allow: tuple[str, ...] = DEFAULT_ENV_ALLOW
    limits: Mapping[str, int] = field(default_factory=dict)
    kill_grace_seconds: float = 10.0
    log_max_bytes: int = 8 << 20

    @property
    def enabled(self) -> bool:
        """Whether there is something to run."""
        return self.agent_class is not None or self.command is not None

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> ProcessOptions:
        """Read the section; an unknown key or a bad value raises ``ValueError`` naming it."""
        values = dict(values or {})
        known = {f for f in cls.__dataclass_fields__}
        for key in values:
            if key not in known:
                raise ValueError(f"unknown key {key!r} (known: {', '.join(sorted(known))})")
        agent_class, command = values.get("agent_class"), values.get("command")
        if agent_class is not None and command is not None:
            raise ValueError("set agent_class or command, not both: each rollout runs one process")
        if agent_class is not None:
            _check_class_path(agent_class)
        if command is not None:
            values["command"] = _check_command(command)
        values["env_map"] = _check_env_map(values.get("env_map") or {})
        values["timeout_seconds"] = _seconds(
            values.get("timeout_seconds", 3600.0), "timeout_seconds", low=0.0
        )
        values["kill_grace_seconds"] = _seconds(
            values.get("kill_grace_seconds", 10.0), "kill_grace_seconds", low=None
        )
        fillna = values.get("reward_fillna_value")
        if fillna is not None:
            if isinstance(fillna, bool) or not isinstance(fillna, (int, float)):
                raise ValueError(f"reward_fillna_value must be a finite number or null, got {fillna!r}")
            try:
                check_reward(fillna, "reward_fillna_value")  # finite as float32, as every reward
            except ValueError as exc:
                raise ValueError(f"reward_fillna_value must be a finite number or null: {exc}") from None
        for key in ("log_dir", "python", "cwd"):
            value = values.get(key)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ValueError(f"{key} must be a path, got {value!r}")
            if value is not None:
                values[key] = os.fspath(value)
        if not isinstance(values.get("fork_server", True), bool):
            raise ValueError(f"fork_server must be true or false, got {values['fork_server']!r}")
        allow = values.get("env_allow", DEFAULT_ENV_ALLOW)
        if (
            isinstance(allow, str)
            or not isinstance(allow, Sequence)
            or not all(isinstance(a, str) and a for a in allow)
        ):
            raise ValueError(
                f"env_allow must be a list of variable names or patterns (such as 'LC_*'), got {allow!r}"
            )
        values["env_allow"] = tuple(allow)
        values["limits"] = _check_limits(values.get("limits") or {})
        size = values.get("log_max_bytes", 8 << 20)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"log_max_bytes must be an integer >= 0, got {size!r}")
        return cls(**values)

    def argv(self) -> list[str]:
        """The command line of one attempt's process when it is spawned (the agent class's Python, or the
        command)."""
        if self.agent_class is not None:
            return [self.python or sys.executable, "-c", AGENT_CLASS_SHIM, self.agent_class]
        if isinstance(self.command, str):
            return ["/bin/sh", "-c", self.command]
        if self.command:
            return list(self.command)
        raise ValueError("nothing to run: set agent_class or command")

    @property
    def what(self) -> str:
        """The agent, as the user named it (for messages)."""
        if self.agent_class is not None:
            return f"agent_class {self.agent_class!r}"
        return f"command {self.command!r}"


def _check_class_path(value: Any) -> None:
    if not isinstance(value, str):
        raise ValueError(f"agent_class must be 'module:Class' or 'module.Class', got {value!r}")
    module, sep, name = value.partition(":")
    if not sep:
        module, _, name = value.rpartition(".")
    if not module or not name.isidentifier() or not all(p.isidentifier() for p in module.split(".")):
        raise ValueError(f"agent_class must be 'module:Class' or 'module.Class', got {value!r}")


def _check_command(value: Any) -> str | tuple[str, ...]:
    if isinstance(value, str) and value.strip() and "\0" not in value:
        return value
    if (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and value
        and all(isinstance(a, str) and "\0" not in a for a in value)
        and value[0]
    ):
        return tuple(value)
    raise ValueError(f"command must be a list of arguments or a shell command string, got {value!r}")


def _check_env_map(env_map: Any) -> dict[str, str]:
    if not isinstance(env_map, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env_map.items()
    ):
        raise ValueError(
            f"env_map must map variable names to strings ('input', 'input.a.b' or a literal), got {env_map!r}"
        )
    for name in env_map:
        if not _ENV_NAME.fullmatch(name):
            raise ValueError(
                f"env_map: {name!r} is not an environment variable name (letters, digits and '_')"
            )
    return dict(env_map)


def _check_limits(limits: Any) -> dict[str, int]:
    if not isinstance(limits, Mapping):
        raise ValueError(
            f"limits must map resource names ({', '.join(sorted(_LIMIT_NAMES))}) to integers, got {limits!r}"
        )
    for name, value in limits.items():
        if name not in _LIMIT_NAMES:
            raise ValueError(f"limits: {name!r} is not one of {', '.join(sorted(_LIMIT_NAMES))}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"limits.{name} must be an integer >= 0, got {value!r}")
    return dict(limits)


def _seconds(value: Any, key: str, *, low: float | None) -> float:
    bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
    if bad or (low is not None and value <= low) or (low is None and value < 0):
        bound = f"> {low:g}" if low is not None else ">= 0"
        raise ValueError(f"{key} must be a number of seconds {bound}, got {value!r}")
    return float(value)


def resolve_env_map(task_input: Any, env_map: Mapping[str, str]) -> dict[str, str]:
    """Environment variables from the task input, as Agent Lightning's ``local.env_map`` reads them:
    ``input`` (the whole input), ``input.a.0`` (a key or a list index per part), or a literal. Raises
    ``ValueError`` naming a path the input does not have."""
    env: dict[str, str] = {}
    for name, path in env_map.items():
        value: Any
        if path == "input" or path.startswith("input."):
            value = task_input
            for part in path.split(".")[1:]:
                if isinstance(value, Mapping) and part in value:
                    value = value[part]
                elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
                    value = value[int(part)]
                else:
                    raise ValueError(f"env_map.{name}: the task input has no {path!r}")
        else:
            value = path
        env[name] = (
            value
            if isinstance(value, str)
            else orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY).decode()
        )
    return env
