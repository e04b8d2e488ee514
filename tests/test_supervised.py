"""A supervisor its agent holds (issue 50): real agents that stop or trace their supervisor (``SIGSTOP`` on their
parent, ``ptrace`` attach or seize, a leftover child that stops it once the agent exited) cannot hold their
attempt's worker: past the grace period and a margin the runner ends the supervisor and every process of the
attempt itself, and the attempt fails as lost, saying how its supervisor was held; the runner's shutdown is
bounded the same way. Forked (an agent class) and spawned (a program) alike. Real processes against a real
daemon and a vLLM-shaped mock backend on loopback."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from aglverl import AgentDaemon
from aglverl.process_runner import ProcessOptions, ProcessRunner
from aglverl.runners.supervised import ANSWER_MARGIN_SECONDS
from aglverl.testing.mock_vllm import MockVLLM

pytestmark = pytest.mark.anyio

HELPERS = Path(__file__).parent / "helpers"
GRACE = 1.0
#: Past its deadline (a stop), what the runner may take to end a held attempt: the grace period, the margin, and
#: some seconds of a busy machine.
BOUND = GRACE + ANSWER_MARGIN_SECONDS + 8.0
AGENTS = {
    "forked": {"agent_class": "holding_agents:HoldingAgent"},
    "spawned": {"command": [sys.executable, str(HELPERS / "holding_agents.py")], "fork_server": False},
}


def _ptrace_allowed() -> bool:
    """Whether a process may trace its parent here (no Yama restriction, or root)."""
    try:
        scope = Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip()
    except OSError:
        return True
    return scope == "0" or os.geteuid() == 0


class Gate:
    """A loopback TCP server the holding agents report to: one line each, ``<pid> <supervisor pid> <how>``."""

    def __init__(self) -> None:
        self.lines: list[tuple[int, int, str]] = []
        self.address = ""
        self._arrived = anyio.Event()

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        self.address = f"127.0.0.1:{port}"
        task_status.started()
        await listener.serve(self._take)

    async def _take(self, stream: anyio.abc.SocketStream) -> None:
        async with stream:
            data = b""
            while not data.endswith(b"\n"):
                data += await stream.receive()
        pid, supervisor, how = data.decode().split()
        self.lines.append((int(pid), int(supervisor), how))
        self._arrived.set()
        self._arrived = anyio.Event()

    async def wait_for(self, count: int) -> None:
        while len(self.lines) < count:
            await self._arrived.wait()

    def release(self) -> None:
        """Free every supervisor still held and end the agents (whatever the runner did): no test leaves a
        stopped process behind."""
        for pid, supervisor, _ in self.lines:
            for target, sig in ((pid, signal.SIGKILL), (supervisor, signal.SIGCONT)):
                try:
                    os.kill(target, sig)
                except OSError:
                    pass


@asynccontextmanager
async def holding(
    tmp_path: Path, options: dict[str, Any], *, release_after: float
) -> AsyncIterator[tuple[AgentDaemon, ProcessRunner, Gate]]:
    """A daemon, a gate, and a runner of ``options`` (agents on PYTHONPATH) served in a task group. Past
    ``release_after`` seconds the held supervisors are freed whatever the runner did (a runner that waits for
    them forever, shielded, then fails its test instead of hanging it)."""
    gate = Gate()
    section = {
        "env_allow": ["PATH", "PYTHONPATH"],
        "env_map": {"HOLD": "input.hold", "HOLD_GATE": "input.gate"},
        "kill_grace_seconds": GRACE,
        **options,
    }
    async with (
        MockVLLM(completion_tokens=4) as mock,
        AgentDaemon(backends=[mock.url], model="mock", max_attempts=1) as daemon,
        anyio.create_task_group() as outer,
    ):
        await outer.start(gate.serve)
        outer.start_soon(_release_after, gate, release_after)
        runner = ProcessRunner(
            daemon, ProcessOptions.from_mapping(section), concurrency=5, log_dir=tmp_path / "logs"
        )
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(runner.serve)
                yield daemon, runner, gate
                tg.cancel_scope.cancel()
        finally:
            gate.release()
            outer.cancel_scope.cancel()


async def _release_after(gate: Gate, seconds: float) -> None:
    with anyio.move_on_after(seconds):
        await anyio.sleep_forever()
    gate.release()


async def _exited(pid: int) -> bool:
    """Whether ``pid`` exits within a few seconds (a pidfd becomes readable then: no polling)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        with anyio.move_on_after(10):
            await anyio.wait_readable(fd)
            return True
        return False
    finally:
        os.close(fd)


@pytest.fixture(autouse=True)
def _agents_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HELPERS), os.environ.get("PYTHONPATH", "")]))


@pytest.mark.parametrize("kind", ["forked", "spawned"])
async def test_an_agent_that_stops_or_traces_its_supervisor_is_ended_with_it_and_its_attempt_is_lost(
    tmp_path: Path, kind: str
) -> None:
    """Five agents at once, each holding its supervisor its way: ``SIGSTOP``, ``ptrace`` attach, ``ptrace`` seize
    (+ interrupt), a child that stops it once the agent exited 0 with a reward, and its channel taken
    (``pidfd_getfd``) and filled with lines no supervisor says. Each attempt ends within the
    grace period and the margin past its deadline (or past its agent's exit; or within the bound on its
    supervisor's first word, when the agent held it before it said the agent runs), failed as lost with how its
    supervisor was held; the supervisor and the agent's processes are gone."""
    holds = ["stop", "stop-after-exit", *(["attach", "seize", "flood"] if _ptrace_allowed() else [])]
    timeout = 5.0
    options = {**AGENTS[kind], "timeout_seconds": timeout}
    async with holding(tmp_path, options, release_after=timeout + 2 * BOUND) as (daemon, runner, gate):
        started = time.monotonic()
        ids = {how: await daemon.queue_task({"hold": how, "gate": gate.address}) for how in holds}
        with anyio.fail_after(timeout + BOUND):
            await daemon.store.wait_terminal(list(ids.values()))
        took = time.monotonic() - started
        records = {how: daemon.store.record(rollout_id) for how, rollout_id in ids.items()}
        assert runner.running == 0
    assert took < timeout + BOUND
    for how, record in records.items():
        assert record.state == "failed", (how, record.error)
        assert "lost" in record.error
        if how != "flood":
            assert "its supervisor did not answer within" in record.error
        assert "aglverl ended it and every process of the attempt (SIGCONT, then SIGKILL)" in record.error
    assert "of its agent's exit (it was stopped (SIGSTOP))" in records["stop-after-exit"].error
    if "flood" in records:  # at its first line, not at its deadline
        assert "its supervisor sent what no supervisor says on its channel, b'{}'" in records["flood"].error
    assert "(it was stopped (SIGSTOP))" in records["stop"].error
    held = {how: (pid, supervisor) for pid, supervisor, how in gate.lines}
    assert sorted(held) == sorted(holds)
    for how in ("attach", "seize"):
        if how in records:
            assert f"it was traced by process {held[how][0]} (ptrace)" in records[how].error
    for pid, supervisor in held.values():
        assert await _exited(pid) and await _exited(supervisor)


async def test_the_runners_shutdown_ends_an_attempt_whose_supervisor_is_stopped_within_the_bound(
    tmp_path: Path,
) -> None:
    """The runner cancelled while an agent holds its stopped supervisor (its deadline far off): the shutdown
    returns within the grace period and the margin, and the supervisor and the agent are gone."""
    options = {**AGENTS["forked"], "timeout_seconds": 600}
    async with holding(tmp_path, options, release_after=30 + 2 * BOUND) as (daemon, _, gate):
        await daemon.queue_task({"hold": "stop", "gate": gate.address})
        with anyio.fail_after(30):
            await gate.wait_for(1)
        started = time.monotonic()  # leaving the block cancels the runner: its shutdown is what is timed
    took = time.monotonic() - started
    assert took < BOUND, took
    ((pid, supervisor, _),) = gate.lines
    assert await _exited(pid) and await _exited(supervisor)


async def test_a_spare_supervisor_stopped_before_its_attempt_is_ended_and_the_attempt_not_started(
    tmp_path: Path,
) -> None:
    """A supervisor waiting for its attempt, stopped meanwhile (by a process of its user): given the attempt, it
    says nothing; within the bound on a supervisor's first word the runner ends it, and the start fails as lost
    saying so (the runner then fails the attempt, and retries it)."""
    from aglverl.runners.seam import Launch, LaunchFailed
    from aglverl.runners.supervised import START_ANSWER_SECONDS
    from aglverl.runners.template import Template, fork_request

    template = Template([sys.executable, "-I", "-S"], "bare", [], env={}, cwd="/", name="the spawner")
    read, write = os.pipe()
    stdin = os.open(os.devnull, os.O_RDONLY)
    async with anyio.create_task_group() as tg:
        await template.start(tg)
        spare = await template.spare()
        pidfd = os.pidfd_open(spare.supervisor)
        try:
            os.kill(spare.supervisor, signal.SIGSTOP)
            launch = Launch(
                argv=("true",),
                env={"PATH": os.environ["PATH"]},
                cwd="/",
                stdin=stdin,
                output=write,
                name="an attempt",
            )
            started = time.monotonic()
            with anyio.fail_after(START_ANSWER_SECONDS + 10):
                await spare.assign(fork_request(launch, exec_=True), stdin, write, launch.name)
                with pytest.raises(
                    LaunchFailed,
                    match=r"lost: its supervisor did not answer within 10 s of its attempt \(it was stopped \(SIGSTOP\)\)",
                ):
                    await spare.started()
                await anyio.wait_readable(pidfd)  # the supervisor is gone
            assert time.monotonic() - started < START_ANSWER_SECONDS + 5
        finally:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            for fd in (pidfd, read, write, stdin):
                os.close(fd)
        await template.aclose()
        tg.cancel_scope.cancel()
