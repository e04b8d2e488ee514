"""Agents as processes: one OS process per rollout attempt, as Agent Lightning's ``runner_type=local`` runs them.

:class:`ProcessRunner` claims rollout attempts from the daemon's store as they are queued (it waits in the
store's claim, an event, like an agent's long-poll: no polling) and runs up to ``concurrency`` processes at once:

- an **Agent Lightning v1.0 agent class** (``agent_class``, ``module:Class`` or ``module.Class``): a new Python
  (``python``, default this one) imports it and calls ``Class().run()``, awaiting it when it is a coroutine;
- **any program** (``command``: a list of arguments, or a string run by ``/bin/sh -c``): a CLI coding agent, a
  shell script, a binary.

Each process gets Agent Lightning's environment, on the task server's one base URL: ``AGL_OPENAI_BASE_URL``
(``{server}/proxy/rollout/{id}/attempt/0/mode/{train|val}/openai/v1``), ``AGL_EVENT_URL``
(``{server}/api/rollouts/{id}/attempt/0/events``), ``AGL_KEY``; the same endpoints in the variables the SDKs read
(``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``ANTHROPIC_BASE_URL``, ``ANTHROPIC_API_KEY``); ``AGL_ROLLOUT_ID``,
``AGL_ATTEMPT_ID``, ``AGL_MODE``, ``AGL_MODEL`` (the served model's name); the task input as JSON on its
standard input and in the file ``AGL_INPUT_FILE``; and the input's fields named by ``env_map`` (Agent
Lightning's ``local.env_map``: ``VAR: input`` is the whole input, ``VAR: input.a.0`` a field, anything else a
literal; strings as they are, other values as JSON). The ``{id}`` is the attempt's Agent Lightning rollout id
(:mod:`aglverl.agent_lightning.rollouts`: attempt ``k > 1`` of rollout ``R`` is ``R-retry-<k-1>``).

The reward: the value of the attempt's last ``reward`` event (``POST {"event_type": "reward", "data": {"value":
x}}`` to ``AGL_EVENT_URL``, as Agent Lightning's agents report it); or, for programs that cannot make an HTTP
request, a number written to the file ``AGL_REWARD_FILE``; or else ``reward_fillna_value`` when set (Agent
Lightning's key of that name). The process's standard output and error go to ``<log_dir>/<id>.log``.

An attempt fails, and the store retries it while ``max_attempts`` allows (the retry is a new process), when its
process exits non-zero or is killed by a signal (a crash), runs past ``timeout_seconds`` (its whole process
group is killed with ``SIGKILL``), or exits 0 without a reward; the failure's message names the log file and
quotes its last line. Whatever way a process ends, the rest of its process group is killed with it (an agent's
stray children never outlive its rollout). Cancelling :meth:`ProcessRunner.serve` kills every running process
group and waits for them to exit.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import orjson
from anyio.abc import TaskStatus

from .agent_lightning.rollouts import CONTROLLER_GRACE_SECONDS, Slot
from .agent_lightning.wire import DEFAULT_ATTEMPT_ID
from .models import Task
from .store import StoreError

if TYPE_CHECKING:
    from .daemon import AgentDaemon

__all__ = ["ProcessOptions", "ProcessRunner", "resolve_env_map"]

logger = logging.getLogger(__name__)

#: What a new Python runs for an agent class (it must not need aglverl: the agent's Python may not have it).
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

#: How much of a failed process's log its error message quotes (its last line, from this many final bytes).
_TAIL_BYTES = 4096


@dataclass(frozen=True)
class ProcessOptions:
    """The ``aglverl.processes`` section: what the built-in runner runs for each rollout attempt.

    - ``agent_class``: an Agent Lightning v1.0 agent class, ``"module:Class"`` or ``"module.Class"``, importable
      by ``python`` from the working directory or its ``PYTHONPATH``; or
    - ``command``: any program, a list of arguments or a string for ``/bin/sh -c``;
    - ``env_map``: environment variables from the task input (Agent Lightning's ``local.env_map``);
    - ``timeout_seconds``: the attempt's deadline (its process group is killed then);
    - ``reward_fillna_value``: the reward of a process that exits 0 without reporting one (``None``: it fails);
    - ``log_dir``: where each process's output goes (``None``: ``<trainer.default_local_dir>/agent_logs``
      under ``AsyncVERL``);
    - ``python``: the interpreter of an agent class (``None``: the one running aglverl).

    The runner starts only when ``agent_class`` or ``command`` is set (and ``aglverl.agents`` is not 0).
    """

    agent_class: str | None = None
    command: str | tuple[str, ...] | None = None
    env_map: Mapping[str, str] = field(default_factory=dict)
    timeout_seconds: float = 3600.0
    reward_fillna_value: float | None = None
    log_dir: str | None = None
    python: str | None = None

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
        env_map = values.get("env_map") or {}
        if not isinstance(env_map, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env_map.items()
        ):
            raise ValueError(f"env_map must map variable names to strings ('input', 'input.a.b' or a literal), got {env_map!r}")
        values["env_map"] = dict(env_map)
        timeout = values.get("timeout_seconds", 3600.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (0 < timeout < math.inf):
            raise ValueError(f"timeout_seconds must be a number of seconds > 0, got {timeout!r}")
        values["timeout_seconds"] = float(timeout)
        fillna = values.get("reward_fillna_value")
        if fillna is not None and (
            isinstance(fillna, bool) or not isinstance(fillna, (int, float)) or not math.isfinite(fillna)
        ):
            raise ValueError(f"reward_fillna_value must be a finite number or null, got {fillna!r}")
        for key in ("log_dir", "python"):
            value = values.get(key)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ValueError(f"{key} must be a path, got {value!r}")
            if value is not None:
                values[key] = os.fspath(value)
        return cls(**values)

    def argv(self) -> list[str]:
        """The command line of one attempt's process (the agent class's Python, or the command)."""
        if self.agent_class is not None:
            return [self.python or sys.executable, "-c", AGENT_CLASS_SHIM, self.agent_class]
        if isinstance(self.command, str):
            return ["/bin/sh", "-c", self.command]
        if self.command:
            return list(self.command)
        raise ValueError("nothing to run: set agent_class or command")


def _check_class_path(value: Any) -> None:
    if not isinstance(value, str):
        raise ValueError(f"agent_class must be 'module:Class' or 'module.Class', got {value!r}")
    module, sep, name = value.partition(":")
    if not sep:
        module, _, name = value.rpartition(".")
    if not module or not name.isidentifier() or not all(p.isidentifier() for p in module.split(".")):
        raise ValueError(f"agent_class must be 'module:Class' or 'module.Class', got {value!r}")


def _check_command(value: Any) -> str | tuple[str, ...]:
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, Sequence) and not isinstance(value, str) and value and all(isinstance(a, str) for a in value):
        return tuple(value)
    raise ValueError(f"command must be a list of arguments or a shell command string, got {value!r}")


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
        env[name] = value if isinstance(value, str) else orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY).decode()
    return env


@dataclass(slots=True)
class _Outcome:
    succeeded: bool
    error: str | None = None
    reward: float | None = None


class ProcessRunner:
    """Runs one process per rollout attempt of the daemon's store (see the module docstring).

    ``concurrency``: processes at once (>= 1). ``log_dir``: where the per-attempt logs go (created).
    Start it with ``await tg.start(runner.serve)`` once the daemon serves; :attr:`running` and :attr:`peak` say
    how many processes run now and ran at most at once, :attr:`finished` how many attempts ended.
    """

    def __init__(self, daemon: AgentDaemon, options: ProcessOptions, *, concurrency: int, log_dir: str | os.PathLike[str]) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        if not options.enabled:
            raise ValueError("ProcessOptions has nothing to run: set agent_class or command")
        self.daemon = daemon
        self.options = options
        self.concurrency = concurrency
        self.log_dir = Path(log_dir)
        self.running = 0
        self.peak = 0
        self.finished = 0

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled (or until the store closes); ``task_status.started()`` once every worker waits
        for work. Cancellation kills the running processes' groups (shielded) and waits for them."""
        await anyio.to_thread.run_sync(lambda: self.log_dir.mkdir(parents=True, exist_ok=True))
        async with anyio.create_task_group() as tg:
            for n in range(self.concurrency):
                tg.start_soon(self._worker, name=f"aglverl process runner {n}")
            task_status.started()

    async def _worker(self) -> None:
        store = self.daemon.store
        while True:
            task = await store.claim(math.inf)  # parked in the store until a task is queued: no polling
            if task is None:
                return  # the store closed
            await self._attempt(task)

    # ------------------------------------------------------------------ one attempt
    async def _attempt(self, task: Task) -> None:
        rollouts = self.daemon.agent_lightning.rollouts
        slot = rollouts.slot_of(task.rollout_id, task.attempt_id)
        slot.last_attempt_id = DEFAULT_ATTEMPT_ID
        try:
            self.daemon.store.heartbeat(
                task.rollout_id, task.attempt_id, seconds=self.options.timeout_seconds + CONTROLLER_GRACE_SECONDS
            )
            outcome = await self._run(slot, task)
        except StoreError as exc:  # the attempt ended meanwhile (a step's deadline): nothing to report
            logger.info("attempt %s of %s ended before its process did: %s", task.attempt_id, task.rollout_id, exc)
            return
        try:
            await rollouts.finish(slot, succeeded=outcome.succeeded, error=outcome.error, reward=outcome.reward)
        except StoreError as exc:
            logger.info("the end of %s was not taken: %s", slot.agl_id, exc)
        finally:
            self.finished += 1

    async def _run(self, slot: Slot, task: Task) -> _Outcome:
        base = self.log_dir / slot.agl_id
        log_path, input_path, reward_path = Path(f"{base}.log"), Path(f"{base}.input.json"), Path(f"{base}.reward")
        try:
            env = self._environment(slot, task, input_path, reward_path)
        except ValueError as exc:
            return _Outcome(False, f"agent process for {slot.agl_id} not started: {exc}")
        data = orjson.dumps(task.input, option=orjson.OPT_SERIALIZE_NUMPY)
        log, stdin = await anyio.to_thread.run_sync(_open_files, log_path, input_path, reward_path, data)
        try:
            code, timed_out = await self._spawn_and_wait(self.options.argv(), env, stdin, log)
            return await self._outcome(slot, code, timed_out, log_path, reward_path)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_close_and_remove, (log, stdin), (input_path, reward_path))

    async def _spawn_and_wait(self, argv: list[str], env: dict[str, str], stdin: IO[bytes], log: IO[bytes]) -> tuple[int, bool]:
        """Start the process in a session of its own, wait for it up to the timeout; its group is killed at
        the timeout, on cancellation, and after it exits (stray children). Returns (exit code, timed out)."""
        process = await anyio.open_process(argv, stdin=stdin, stdout=log, stderr=log, env=env, start_new_session=True)
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            with anyio.move_on_after(self.options.timeout_seconds) as deadline:
                await process.wait()
        finally:
            self.running -= 1
            with anyio.CancelScope(shield=True):
                _kill_group(process.pid)
                await process.wait()
        return int(process.returncode or 0), deadline.cancelled_caught

    async def _outcome(self, slot: Slot, code: int, timed_out: bool, log_path: Path, reward_path: Path) -> _Outcome:
        where = f"its output: {log_path}"
        if timed_out:
            return _Outcome(False, f"agent process timed out after {self.options.timeout_seconds:g} s; its process group "
                                   f"was killed ({where})")
        if code != 0:
            tail = await anyio.to_thread.run_sync(_last_line, log_path)
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            said = f"; its last line: {tail!r}" if tail else ""
            return _Outcome(False, f"agent process {how}{said} ({where})")
        reward = self.daemon.agent_lightning.rollouts.reward(slot)
        if reward is None:
            reward = await anyio.to_thread.run_sync(_reward_file, reward_path)
        if reward is None:
            reward = self.options.reward_fillna_value
        if reward is None:
            return _Outcome(False, (
                "agent process exited 0 without a reward (POST {\"event_type\": \"reward\", \"data\": {\"value\": x}} "
                f"to AGL_EVENT_URL, or write x to AGL_REWARD_FILE; or set reward_fillna_value) ({where})"
            ))
        return _Outcome(True, reward=reward)

    def _environment(self, slot: Slot, task: Task, input_path: Path, reward_path: Path) -> dict[str, str]:
        daemon = self.daemon
        server = daemon.server_url
        mode = "train" if (task.mode or "train") == "train" else "val"
        openai_url = f"{server}/proxy/rollout/{slot.agl_id}/attempt/{DEFAULT_ATTEMPT_ID}/mode/{mode}/openai/v1"
        key = daemon.agent_lightning.token or ""
        env = dict(os.environ)
        env.update(
            AGL_KEY=key,
            AGL_OPENAI_BASE_URL=openai_url,
            AGL_EVENT_URL=f"{server}/api/rollouts/{slot.agl_id}/attempt/{DEFAULT_ATTEMPT_ID}/events",
            AGL_ROLLOUT_ID=slot.agl_id,
            AGL_ATTEMPT_ID=DEFAULT_ATTEMPT_ID,
            AGL_MODE=mode,
            AGL_MODEL=daemon.model,
            AGL_INPUT_FILE=str(input_path),
            AGL_REWARD_FILE=str(reward_path),
            OPENAI_BASE_URL=openai_url,
            OPENAI_API_KEY=key or "aglverl",
            ANTHROPIC_BASE_URL=openai_url.removesuffix("/v1"),  # the Anthropic SDK adds /v1/messages
            ANTHROPIC_API_KEY=key or "aglverl",
        )
        env.update(resolve_env_map(task.input, self.options.env_map))
        return env


# ---------------------------------------------------------------------------------------------- files
def _open_files(log_path: Path, input_path: Path, reward_path: Path, data: bytes) -> tuple[IO[bytes], IO[bytes]]:
    reward_path.unlink(missing_ok=True)  # a retry must not read an earlier process's reward
    input_path.write_bytes(data)
    return open(log_path, "wb"), open(input_path, "rb")  # closed by _close_and_remove


def _close_and_remove(files: Sequence[IO[bytes]], scratch: Sequence[Path]) -> None:
    """Close an attempt's files; remove its input and reward files (the log stays)."""
    for f in files:
        f.close()
    for path in scratch:
        path.unlink(missing_ok=True)


def _last_line(path: Path) -> str:
    """The last non-empty line of a log, shortened."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - _TAIL_BYTES))
            lines = [line.strip() for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def _reward_file(path: Path) -> float | None:
    """The number a program wrote to ``AGL_REWARD_FILE`` (``None``: no file, or not a finite number)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
