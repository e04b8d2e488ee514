"""The built-in runner (:class:`ProcessRunner`): a process per rollout attempt of the daemon's store, as Agent
Lightning's ``runner_type=local`` runs them (see :mod:`aglverl.runners` for what an attempt's process gets).

It claims attempts as they are queued (it waits in the store's claim, an event, like an agent's long-poll: no
polling), at most ``concurrency`` at once, and gives each to its :class:`~aglverl.runners.seam.Launcher` (the fork
server or the plain spawn). **Nothing an attempt does can stop the runner**: any error while starting, feeding or
ending an attempt fails that attempt alone, with a message naming the cause and the attempt's log, and the
store retries it while ``max_attempts`` allows.

An attempt's process ends:

- by itself: exit 0 with a reward (the attempt succeeds), or non-zero, a signal, no reward (it fails);
- at its deadline (``timeout_seconds``), or when its attempt ends elsewhere: ``DELETE`` through the Agent
  Lightning API, a step's or group's deadline, its proxy shard lost (the attempt is void and retried), its
  rollout completed by another attempt, or forgotten. Then it and every process it started get ``SIGTERM`` and,
  after ``kill_grace_seconds``, ``SIGKILL`` (:mod:`aglverl.runners._template`: each attempt under a supervisor, a child
  subreaper, so children that left the process group are ended too);
- when the runner is cancelled (the same, for every running attempt; cancellation waits for them).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import anyio.abc
import anyio.to_thread
import orjson
from anyio.abc import TaskStatus

from ..agl10.rollouts import CONTROLLER_GRACE_SECONDS, Slot
from ..agl10.wire import DEFAULT_ATTEMPT_ID
from ..models import Task, check_reward
from ..store import TERMINAL, AttemptChange, StoreError
from .checks import check_agent
from .environment import agent_variables, file_stem
from .forkserver import ForkServer
from .logs import AgentLog
from .options import ProcessOptions, resolve_env_map
from .seam import RESULT_MAX, AgentExit, AgentProcess, Launch, Launcher, LaunchFailed
from .spawn import AHEAD_MAX, Spawner
from .supervised import ANSWER_MARGIN_SECONDS
from .template import START_SECONDS

if TYPE_CHECKING:
    from ..daemon import AgentDaemon

__all__ = ["ProcessRunner"]

logger = logging.getLogger(__name__)

#: Up to how many bytes an attempt's files are written on the event loop (a mkdir and a few small files in the
#: local temporary folder: less than a thread hop costs); larger inputs are written by a worker thread.
_FILES_ON_LOOP = 64 << 10

#: How long the runner waits for an attempt's output to end once its processes are gone (a descendant it could
#: not kill may hold the pipe).
_OUTPUT_SECONDS = 5.0

#: The variable that gives each attempt a fresh seed (32 bits: every library takes it as it is), its log's first
#: line saying it.
SEED_VARIABLE = "AGL_SEED"


@dataclass(slots=True)
class _Outcome:
    succeeded: bool
    error: str | None = None
    reward: float | None = None


class _Attempt:
    """One attempt the runner runs: its task and Agent Lightning rollout, and how to stop it from elsewhere."""

    def __init__(self, task: Task, slot: Slot) -> None:
        self.task = task
        self.slot = slot
        self.ended: str | None = None  # why the attempt ended elsewhere
        self.scope: anyio.CancelScope | None = None
        self.files: tuple[AgentLog, str] | None = None  # its log and private directory, closed after its end

    def end(self, reason: str) -> None:
        if self.ended is None:
            self.ended = reason
            if self.scope is not None:
                self.scope.cancel()


class ProcessRunner:
    """Runs one process per rollout attempt of the daemon's store (see the module docstring).

    ``concurrency``: processes at once (>= 1). ``log_dir``: where the per-attempt logs go (created).
    ``launcher``: what starts and stops the processes (default: :class:`~aglverl.runners.forkserver.ForkServer`,
    or :class:`~aglverl.runners.spawn.Spawner` with ``fork_server: false``). Start it with ``await
    tg.start(runner.serve)`` once the daemon serves; :attr:`running` and :attr:`peak` say how many attempts run
    now and ran at most at once, :attr:`finished` how many ended, :attr:`cpu_seconds` the CPU their processes
    used (as their supervisors measured it).
    """

    def __init__(
        self,
        daemon: AgentDaemon,
        options: ProcessOptions,
        *,
        concurrency: int,
        log_dir: str | os.PathLike[str],
        launcher: Launcher | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        if not options.enabled:
            raise ValueError("ProcessOptions has nothing to run: set agent_class or command")
        self.daemon = daemon
        self.options = options
        self.concurrency = concurrency
        self.log_dir = Path(log_dir)
        ahead = min(concurrency, AHEAD_MAX)  # supervisors forked before the first attempts (spawned programs)
        self.launcher: Launcher = launcher or (
            ForkServer(options, ahead=ahead)
            if options.fork_server
            else Spawner(env_allow=options.env_allow, ahead=ahead)
        )
        self.running = 0
        self.peak = 0
        self.finished = 0
        self.cpu_seconds = 0.0
        self._attempts: dict[tuple[str, str], _Attempt] = {}
        self._scratch: str | None = None
        self._background: anyio.abc.TaskGroup | None = (
            None  # where attempts' files are closed, off their workers
        )
        daemon.store.on_attempt(self._changed)
        daemon.store.on_forget(self._forgotten)

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled (or until the store closes); ``task_status.started()`` once every worker waits
        for work. Raises :class:`~aglverl.config_errors.ConfigError` at once when the agent's program is not
        installed (:func:`~aglverl.runners.checks.check_agent`). Cancellation ends every running attempt's
        processes (``SIGTERM``, then ``SIGKILL`` after the grace period) and waits for them (shielded)."""
        await check_agent(self.options, deep=False)
        self._scratch = await anyio.to_thread.run_sync(self._make_dirs)
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self.launcher.serve)
                self._background = tg
                async with anyio.create_task_group() as workers:
                    for n in range(self.concurrency):
                        workers.start_soon(self._worker, name=f"aglverl process runner {n}")
                    task_status.started()
                tg.cancel_scope.cancel()  # the store closed: no more work
        finally:
            self._background = None
            scratch, self._scratch = self._scratch, None
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(lambda: shutil.rmtree(scratch, ignore_errors=True))

    def _make_dirs(self) -> str:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return tempfile.mkdtemp(prefix="aglverl-agents-")  # 0700: the attempts' inputs, rewards and fields

    async def _worker(self) -> None:
        await self.daemon.store.work(self._attempt)  # until the store closes

    # ------------------------------------------------------------------ attempts ending elsewhere
    def _changed(self, change: AttemptChange) -> None:
        """The store says an attempt ended (inside its method: only flags and cancel scopes here)."""
        if change.kind != "ended":
            return
        for (rollout_id, attempt_id), attempt in list(self._attempts.items()):
            if rollout_id != change.rollout_id:
                continue
            if change.state in TERMINAL:
                attempt.end(
                    "its rollout completed"
                    if change.state == "completed"
                    else f"its rollout failed: {change.error}"
                )
            elif change.attempt_id == attempt_id:
                attempt.end(f"the attempt ended (its rollout is queued again): {change.error}")

    def _forgotten(self, rollout_ids: Sequence[str]) -> None:
        dropped = set(rollout_ids)
        for (rollout_id, _), attempt in list(self._attempts.items()):
            if rollout_id in dropped:
                attempt.end("its rollout was dropped")

    # ------------------------------------------------------------------ one attempt
    async def _attempt(self, task: Task) -> None:
        rollouts = self.daemon.agent_lightning.rollouts
        attempt_id = task.attempt_id or ""
        try:
            slot = rollouts.slot_of(task.rollout_id, attempt_id)
        except StoreError as exc:
            logger.warning(
                "attempt %s of %s has no Agent Lightning rollout: %s", attempt_id, task.rollout_id, exc
            )
            return
        attempt = _Attempt(task, slot)
        try:
            await self._end(attempt, task, slot)
        finally:
            if (
                attempt.files is not None
            ):  # after the attempt's end is reported; its worker claims the next meanwhile
                if self._background is not None:
                    self._background.start_soon(_clean_up_shielded, *attempt.files)
                else:
                    await _clean_up_shielded(*attempt.files)

    async def _end(self, attempt: _Attempt, task: Task, slot: Slot) -> None:
        rollouts = self.daemon.agent_lightning.rollouts
        attempt_id = task.attempt_id or ""
        key = (task.rollout_id, attempt_id)
        self._attempts[key] = attempt
        try:
            outcome = await self._run(attempt)
        except StoreError as exc:  # the attempt ended meanwhile (a step's deadline): nothing to report
            logger.info("attempt %s of %s ended before its process did: %s", attempt_id, task.rollout_id, exc)
            return
        except Exception as exc:  # whatever it is, it fails this attempt alone
            logger.exception("aglverl's runner could not run %s", slot.agl_id)
            outcome = _Outcome(
                False,
                f"aglverl's runner could not run the agent for {slot.agl_id}: {type(exc).__name__}: {exc}",
            )
        finally:
            self._attempts.pop(key, None)
            rollouts.revoke_key(slot)
        if attempt.ended is not None:
            logger.info("%s's process was ended: %s", slot.agl_id, attempt.ended)
            self.finished += 1
            return
        try:
            await rollouts.finish(
                slot, succeeded=outcome.succeeded, error=outcome.error, reward=outcome.reward
            )
        except StoreError as exc:
            logger.info("the end of %s was not taken: %s", slot.agl_id, exc)
        finally:
            self.finished += 1

    async def _run(self, attempt: _Attempt) -> _Outcome:
        task, slot, options = attempt.task, attempt.slot, self.options
        slot.last_attempt_id = DEFAULT_ATTEMPT_ID
        grace = options.kill_grace_seconds
        self.daemon.store.heartbeat(
            task.rollout_id, task.attempt_id, seconds=START_SECONDS + self._lease_seconds(grace)
        )
        stem = file_stem(slot.agl_id)
        log = AgentLog(self.log_dir / f"{stem}.log", options.log_max_bytes)
        where = f"its output: {log.path}"
        assert self._scratch is not None
        scratch = os.path.join(self._scratch, f"{stem[:60]}.{secrets.token_hex(6)}")  # made with the files
        attempt.files = (log, scratch)
        try:
            fields = resolve_env_map(task.input, options.env_map)
        except ValueError as exc:
            await log.open(f"aglverl: not started: {exc}\n")
            return _Outcome(False, f"agent process for {slot.agl_id} not started: {exc} ({where})")
        input_path, reward_path = os.path.join(scratch, "input.json"), os.path.join(scratch, "reward")
        variables = agent_variables(self._variables(slot, task, input_path, reward_path), fields, scratch)
        seed = secrets.randbits(32)  # the attempt's own: forks of one template share their generators' states
        variables.env[SEED_VARIABLE] = str(seed)
        files = {input_path: orjson.dumps(task.input, option=orjson.OPT_SERIALIZE_NUMPY), **variables.files}
        log.notice = f"aglverl: {SEED_VARIABLE}={seed}\n{variables.notice}"
        if sum(map(len, files.values())) <= _FILES_ON_LOOP:  # a few small files in the local temporary folder
            stdin = _write_files(scratch, files, input_path)
        else:
            stdin = await anyio.to_thread.run_sync(_write_files, scratch, files, input_path)
        launch = Launch(
            argv=tuple(options.argv()),
            env=self.launcher.environment(variables.env),
            cwd=options.cwd or os.getcwd(),
            stdin=stdin,
            output=-1,
            name=slot.agl_id,
            limits=options.limits,
            grace=grace,
            result_file=reward_path,
        )
        exit, timed_out, failure, result = await self._launch_and_wait(attempt, launch, log)
        if exit is None:
            return _Outcome(False, f"agent process for {slot.agl_id} could not start: {failure} ({where})")
        return await self._outcome(slot, exit, timed_out, log, reward_path, result)

    async def _launch_and_wait(
        self, attempt: _Attempt, launch: Launch, log: AgentLog
    ) -> tuple[AgentExit | None, bool, str, str | None]:
        """Start the process with its output piped to ``log``, wait for it up to the deadline (or until the
        attempt ends elsewhere: then stop it), then for every process of the attempt to be gone. Returns its exit
        (``None``: it could not start), whether the deadline passed, why it could not start, and its result file
        as the launcher read it (:attr:`AgentProcess.result`)."""
        read, write = os.pipe()
        timed_out = False
        exit: AgentExit | None = None
        failure = ""
        result: str | None = None
        # counted from before its start: its agent may run (and be seen) before the launcher's answer is read
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(log.pump, read)
                try:
                    process: AgentProcess | None = await self.launcher.start(replace(launch, output=write))
                except LaunchFailed as exc:
                    failure, process = str(exc), None
                finally:
                    os.close(write)
                    os.close(launch.stdin)
                if process is not None:
                    exit, timed_out = await self._wait(attempt, process, launch.grace)
                    result = process.result
                tg.cancel_scope.deadline = anyio.current_time() + _OUTPUT_SECONDS
        finally:
            self.running -= 1
        return exit, timed_out, failure, result

    async def _wait(self, attempt: _Attempt, process: AgentProcess, grace: float) -> tuple[AgentExit, bool]:
        """Wait for the process up to the attempt's deadline (stop it past it, or when the attempt ends
        elsewhere, or when cancelled), then for every process of the attempt to be gone. Bounded past the
        deadline: a launcher's waits after a stop are (the grace period and a margin), shielded here."""
        exit: AgentExit | None = None
        self._renew(attempt, grace)
        deadline = anyio.move_on_after(self.options.timeout_seconds)
        try:
            with anyio.CancelScope() as attempt.scope, deadline:
                if attempt.ended is not None:
                    attempt.scope.cancel()
                exit = await process.wait()
        finally:
            with anyio.CancelScope(shield=True):
                if exit is None:  # deadline, ended elsewhere, or the runner cancelled
                    await self.launcher.stop(process, grace)
                    exit = await process.wait()
                self.cpu_seconds += await process.finished() or 0.0
        if process.lost is not None:
            exit = AgentExit(why=process.lost)
        assert exit is not None
        return exit, deadline.cancelled_caught

    def _lease_seconds(self, grace: float) -> float:
        """An attempt's lease once its process runs: its deadline, the grace period, the bound on its
        supervisor's answers after a stop, and Agent Lightning's controller grace. The runner ends the process
        itself by then: the lease only ends an attempt whose worker is stuck."""
        return self.options.timeout_seconds + 2 * grace + ANSWER_MARGIN_SECONDS + CONTROLLER_GRACE_SECONDS

    def _renew(self, attempt: _Attempt, grace: float) -> None:
        """The attempt's lease from now, its process running (the lease taken before its start also covered a
        template's start: :data:`~aglverl.runners.template.START_SECONDS`)."""
        task = attempt.task
        try:
            self.daemon.store.heartbeat(task.rollout_id, task.attempt_id, seconds=self._lease_seconds(grace))
        except StoreError:
            pass  # it ended meanwhile: the store's change ends the process (its attempt.end)

    async def _outcome(
        self,
        slot: Slot,
        exit: AgentExit,
        timed_out: bool,
        log: AgentLog,
        reward_path: str,
        result: str | None,
    ) -> _Outcome:
        where = f"its output: {log.path}"
        if exit.why is not None:
            after = f" past its deadline of {self.options.timeout_seconds:g} s" if timed_out else ""
            return _Outcome(
                False, f"agent process {slot.agl_id} lost{after}: its supervisor {exit.why} ({where})"
            )
        if timed_out:
            grace = self.options.kill_grace_seconds
            return _Outcome(
                False,
                (
                    f"agent process timed out after {self.options.timeout_seconds:g} s; it and every process it started "
                    f"were sent SIGTERM, then SIGKILL after {grace:g} s ({where})"
                ),
            )
        if exit.lost:
            return _Outcome(
                False, f"agent process {slot.agl_id}'s supervisor vanished; its end is unknown ({where})"
            )
        if exit.code != 0:
            tail = log.last_line()
            how = (
                f"was killed by {_signal_name(exit.signal)}"
                if exit.signal
                else f"exited with code {exit.code}"
            )
            said = f"; its last line: {tail!r}" if tail else ""
            return _Outcome(False, f"agent process {how}{said} ({where})")
        reward = self.daemon.agent_lightning.rollouts.reward(slot)
        if reward is None:  # the reward file: as the launcher read it, else read here
            reward = (
                _reward(result)
                if result is not None
                else await anyio.to_thread.run_sync(_reward_file, reward_path)
            )
            try:  # training keeps it as float32: 1e39 (finite here) would be infinite there
                reward = None if reward is None else check_reward(reward, "AGL_REWARD_FILE held the reward")
            except ValueError as exc:
                return _Outcome(False, f"{exc} ({where})")
        if reward is None:
            reward = self.options.reward_fillna_value
        if reward is None:
            return _Outcome(
                False,
                (
                    'agent process exited 0 without a reward (POST {"event_type": "reward", "data": {"value": x}} '
                    f"to AGL_EVENT_URL, or write x to AGL_REWARD_FILE; or set reward_fillna_value) ({where})"
                ),
            )
        return _Outcome(True, reward=reward)

    def _variables(self, slot: Slot, task: Task, input_path: str, reward_path: str) -> dict[str, str]:
        """Agent Lightning's contract, the SDKs' variables, the attempt's key. The OpenAI base URL is the
        attempt's own on the proxy when the proxy on this loop applies the hop's rules (no second HTTP exchange
        per call), else Agent Lightning's proxy path on the task server."""
        daemon = self.daemon
        server = daemon.server_url
        mode = "train" if (task.mode or "train") == "train" else "val"
        where = slot.url_id
        openai_url = daemon.agent_lightning.hop.direct_url(
            task.rollout_id, task.attempt_id or "", slot.resources_id or task.resources_id
        ) or (f"{server}/proxy/rollout/{where}/attempt/{DEFAULT_ATTEMPT_ID}/mode/{mode}/openai/v1")
        key = daemon.agent_lightning.rollouts.grant_key(slot) if slot.key is None else slot.key
        return {
            "AGL_KEY": key,
            "AGL_OPENAI_BASE_URL": openai_url,
            "AGL_EVENT_URL": f"{server}/api/rollouts/{where}/attempt/{DEFAULT_ATTEMPT_ID}/events",
            "AGL_ROLLOUT_ID": slot.agl_id,
            "AGL_ATTEMPT_ID": DEFAULT_ATTEMPT_ID,
            "AGL_MODE": mode,
            "AGL_MODEL": daemon.model,
            "AGL_INPUT_FILE": input_path,
            "AGL_REWARD_FILE": reward_path,
            "OPENAI_BASE_URL": openai_url,
            "OPENAI_API_KEY": key,
            "ANTHROPIC_BASE_URL": openai_url.removesuffix("/v1"),  # the Anthropic SDK adds /v1/messages
            "ANTHROPIC_API_KEY": key,
        }


def _write_files(scratch: str, files: dict[str, bytes], stdin_path: str) -> int:
    """The attempt's private directory (0700) and files (0600); returns a descriptor of its input for its standard
    input."""
    os.mkdir(scratch, 0o700)
    for path, data in files.items():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
    return os.open(stdin_path, os.O_RDONLY)


async def _clean_up_shielded(log: AgentLog, scratch: str) -> None:
    """:func:`_clean_up` in a worker thread, to its end even when cancelled."""
    with anyio.CancelScope(shield=True):
        await anyio.to_thread.run_sync(_clean_up, log, scratch)


def _clean_up(log: AgentLog, scratch: str) -> None:
    try:
        log.close_blocking()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _reward_file(path: str) -> float | None:
    """The number a program wrote to ``AGL_REWARD_FILE`` (``None``: no file, or not a number)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return _reward(f.read(RESULT_MAX))
    except OSError:
        return None


def _reward(text: str) -> float | None:
    """The number in a reward file's text, finite or not (``None``: not a number)."""
    try:
        return float(text.strip())
    except ValueError:
        return None


def _signal_name(number: int | None) -> str:
    try:
        return signal.Signals(number or 0).name
    except ValueError:
        return f"signal {number}"
