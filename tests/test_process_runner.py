"""The built-in runner: one process per rollout attempt, with Agent Lightning's environment (no Agent Lightning
package needed). Real processes against a real daemon and a vLLM-shaped mock backend on loopback."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
from anyio.abc import SocketStream

from aglverl import AgentDaemon, BatchConfig
from aglverl.config_errors import ConfigError
from aglverl.process_runner import ProcessOptions, ProcessRunner, resolve_env_map
from aglverl.testing.mock_vllm import MockVLLM

pytestmark = pytest.mark.anyio

HELPERS = Path(__file__).parent / "helpers"
PROGRAM = [sys.executable, str(HELPERS / "agl_style_agents.py")]
BATCH = BatchConfig(max_prompt_length=256, max_response_length=16)
TOKEN = "s3cret"


@pytest.fixture(autouse=True)
def _agents_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent classes' module is importable by the processes (as a user's would be on PYTHONPATH)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HELPERS), os.environ.get("PYTHONPATH", "")]))


@asynccontextmanager
async def daemon_and_mock(**kwargs: Any) -> AsyncIterator[tuple[AgentDaemon, MockVLLM]]:
    """A daemon (the runner's settings of these tests, and ``kwargs``) in front of a mock backend."""
    async with (
        MockVLLM(completion_tokens=4) as mock,
        AgentDaemon(backends=[mock.url], model="mock", batch=BATCH, **{"token": TOKEN, **kwargs}) as daemon,
    ):
        yield daemon, mock


@asynccontextmanager
async def running(
    tmp_path: Path, options: Mapping[str, Any], *, concurrency: int = 2, max_attempts: int = 1
) -> AsyncIterator[tuple[AgentDaemon, ProcessRunner, MockVLLM]]:
    async with daemon_and_mock(max_attempts=max_attempts) as (daemon, mock):
        runner = ProcessRunner(
            daemon, ProcessOptions.from_mapping(options), concurrency=concurrency, log_dir=tmp_path / "logs"
        )
        async with anyio.create_task_group() as tg:
            await tg.start(runner.serve)
            yield daemon, runner, mock
            tg.cancel_scope.cancel()


async def finished(daemon: AgentDaemon, rollout_id: str) -> Any:
    with anyio.fail_after(60):
        await daemon.store.wait_terminal([rollout_id])
    return daemon.store.record(rollout_id)


@pytest.mark.parametrize("agent_class", ["RewardAgent", "AsyncRewardAgent"], ids=["sync-run", "async-run"])
async def test_an_agent_lightning_agent_class_trains_a_step_with_its_reward_events(
    tmp_path: Path, agent_class: str
) -> None:
    """Agent Lightning v1.0's contract, run by aglverl: the class's ``run()`` calls the OpenAI SDK at
    AGL_OPENAI_BASE_URL and posts a reward event to AGL_EVENT_URL; the step's batch carries exactly those rewards
    on the ids the backend generated for those calls."""
    options = {
        "agent_class": f"agl_style_agents:{agent_class}",
        "env_map": {"TASK_REWARD": "input.reward", "TASK_PROMPT": "input.prompt"},
        "timeout_seconds": 60,
    }
    async with running(tmp_path, options) as (daemon, runner, mock):
        await daemon.submit([{"prompt": "first", "reward": 0.25}, {"prompt": "second", "reward": 0.75}], n=2)
        with anyio.fail_after(90):
            batch = await daemon.batches.receive()
    data = batch.data
    assert len(data) == 4
    scores = data.batch["token_level_scores"].sum(-1).tolist()
    assert sorted(scores) == [0.25, 0.25, 0.75, 0.75]
    answered = {}
    for seen in mock.generation_requests():
        ((prompt, response),) = mock.expected(seen.json)
        answered[tuple(prompt)] = response
    mask = data.batch["attention_mask"][:, : BATCH.max_prompt_length].bool()
    for row in range(len(data)):
        prompt = data.batch["prompts"][row][mask[row]].tolist()
        response = data.batch["responses"][row][: int(data.batch["response_mask"][row].sum())].tolist()
        assert answered[tuple(prompt)] == response
    assert runner.finished == 4 and runner.peak <= 2
    logs = tmp_path / "logs"
    assert len(list(logs.glob("*.log"))) == 4 and len(list(logs.iterdir())) == 4  # the input files are gone


async def test_a_command_gets_the_endpoints_in_the_sdks_variables_its_input_on_stdin_and_its_output_logged(
    tmp_path: Path,
) -> None:
    """Any program: the OpenAI SDK's own defaults (OPENAI_BASE_URL / OPENAI_API_KEY) reach the rollout's proxy
    path, the input arrives on stdin, the reward comes from AGL_REWARD_FILE, and the output is in its log."""
    async with running(tmp_path, {"command": [*PROGRAM, "sdk"]}) as (daemon, _, mock):
        rollout_id = await daemon.queue_task({"prompt": "hello", "reward": 0.5})
        record = await finished(daemon, rollout_id)
        assert record.state == "completed" and record.result.final_reward == 0.5
        assert len(record.calls) == 1 and record.calls[0].response_token_ids
    seed, line = (tmp_path / "logs" / f"{rollout_id}.log").read_text().splitlines()
    seen = json.loads(line)
    assert (
        seed == f"aglverl: AGL_SEED={seen['env']['AGL_SEED']}"
    )  # the attempt's own seed, its log's first line
    assert seen["input"] == {"prompt": "hello", "reward": 0.5}
    assert seen["env"]["AGL_MODE"] == "train" and seen["env"]["AGL_MODEL"] == "mock"
    # the proxy on the daemon's loop: the attempt's own URL there (the Anthropic SDK adds /v1/messages)
    assert (
        seen["env"]["ANTHROPIC_BASE_URL"]
        == f"{daemon.proxy.url}/rollout/{rollout_id}/attempt/{record.attempt_id}"
    )
    assert [r.json["model"] for r in mock.generation_requests()] == ["mock"]  # the served name, forced


async def test_a_crashed_attempt_fails_naming_its_log_and_is_retried_as_a_new_agent_lightning_rollout(
    tmp_path: Path,
) -> None:
    """A non-zero exit is a failed attempt: its Agent Lightning rollout ends failed with the exit code, the
    last line of its output and its log file; aglverl's retry runs as ``<id>-retry-1`` and succeeds."""
    async with running(tmp_path, {"command": [*PROGRAM, "crash-first"]}, max_attempts=2) as (
        daemon,
        _,
        _mock,
    ):
        rollout_id = await daemon.queue_task({"prompt": "p", "reward": 1.0})
        record = await finished(daemon, rollout_id)
        view = daemon.agent_lightning.rollouts
        first, retry = view.slot(rollout_id), view.slot(f"{rollout_id}-retry-1")
        assert record.state == "completed" and record.result.final_reward == 1.0
        assert (first.state, retry.state) == ("failed", "succeeded")
    log = tmp_path / "logs" / f"{rollout_id}.log"
    assert "exited with code 3" in first.error_message
    assert "no luck on a first attempt" in first.error_message and str(log) in first.error_message
    assert f"retried as {rollout_id}-retry-1" in first.error_message
    assert "no luck" in log.read_text()


async def test_an_agent_killed_by_a_signal_fails_its_attempt(tmp_path: Path) -> None:
    async with running(tmp_path, {"command": [*PROGRAM, "signal"]}) as (daemon, _, _mock):
        record = await finished(daemon, await daemon.queue_task({"reward": 1.0}))
    assert record.state == "failed" and "was killed by SIGSEGV" in record.error


async def test_a_timeout_kills_the_agents_whole_process_group(tmp_path: Path) -> None:
    """Past ``timeout_seconds`` the process group is killed with SIGKILL: the agent and the child it started
    (which the agent starts at once: the deadline leaves it seconds to, on a busy machine)."""
    pidfile = tmp_path / "child.pid"
    options = {"command": [*PROGRAM, "hang", str(pidfile)], "timeout_seconds": 5.0}
    async with running(tmp_path, options) as (daemon, _, _mock):
        record = await finished(daemon, await daemon.queue_task({"reward": 1.0}))
    assert (
        record.state == "failed"
        and "timed out after 5 s; it and every process it started were sent SIGTERM" in record.error
    )
    await _exited(int(pidfile.read_text()))


async def _exited(pid: int) -> None:
    """Return once the process has exited (a pidfd becomes readable then: no polling)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        with anyio.fail_after(20):
            await anyio.wait_readable(fd)
    finally:
        os.close(fd)


async def test_an_exit_without_a_reward_fails_the_attempt(tmp_path: Path) -> None:
    async with running(tmp_path, {"command": [*PROGRAM, "no-reward"]}) as (daemon, _, _mock):
        record = await finished(daemon, await daemon.queue_task({"reward": 1.0}))
    assert record.state == "failed" and "exited 0 without a reward" in record.error
    assert "AGL_EVENT_URL" in record.error and "AGL_REWARD_FILE" in record.error


async def test_an_exit_without_a_reward_gets_reward_fillna_value_when_set(tmp_path: Path) -> None:
    options = {"command": [*PROGRAM, "no-reward"], "reward_fillna_value": 0.125}
    async with running(tmp_path, options) as (daemon, _, _mock):
        record = await finished(daemon, await daemon.queue_task({"reward": 1.0}))
    assert record.state == "completed" and record.result.final_reward == 0.125


async def test_consecutive_programs_get_their_own_reward_file_and_a_fifo_there_fails_its_attempt_alone(
    tmp_path: Path,
) -> None:
    """One worker runs three programs in turn (the later ones on the spawner's spare supervisors): each one's
    AGL_REWARD_FILE, read once its processes are gone, gives its own reward; a FIFO made there instead of a file
    fails that attempt for want of a reward (nothing waits on it), and the next one runs."""
    script = (
        'if [ "$TASK_KIND" = fifo ]; then mkfifo "$AGL_REWARD_FILE"; '
        'else printf "%s\\n" "$TASK_REWARD" > "$AGL_REWARD_FILE"; fi'
    )
    options = {
        "command": ["sh", "-c", script],
        "env_map": {"TASK_KIND": "input.kind", "TASK_REWARD": "input.reward"},
    }
    async with running(tmp_path, options, concurrency=1) as (daemon, _, _mock):
        ids = [
            await daemon.queue_task({"kind": kind, "reward": reward})
            for kind, reward in (("file", 0.25), ("fifo", 0.5), ("file", 0.75))
        ]
        first, fifo, last = [await finished(daemon, rollout_id) for rollout_id in ids]
    assert (first.state, first.result.final_reward) == ("completed", 0.25)
    assert fifo.state == "failed" and "exited 0 without a reward" in fifo.error
    assert (last.state, last.result.final_reward) == ("completed", 0.75)


async def test_a_reward_file_not_finite_as_float32_fails_its_attempt_naming_the_value(tmp_path: Path) -> None:
    """Issue 50: a reward of 1e39 (finite as a Python float, infinite in the rows' float32) was trained on, and its
    GRPO step raised. Written to AGL_REWARD_FILE, it (or inf, or nan) fails its attempt naming the value; the
    largest float32 still trains."""
    options = {
        "command": ["sh", "-c", 'printf "%s\\n" "$TASK_REWARD" > "$AGL_REWARD_FILE"'],
        "env_map": {"TASK_REWARD": "input.reward"},
    }
    written = ["1e39", "-1e39", "inf", "nan", "3.4028235e38"]
    async with running(tmp_path, options, concurrency=2) as (daemon, _, _mock):
        ids = [await daemon.queue_task({"reward": value}) for value in written]
        records = [await finished(daemon, rollout_id) for rollout_id in ids]
    for value, record in zip(written[:-1], records, strict=False):
        assert record.state == "failed", value
        assert (
            f"AGL_REWARD_FILE held the reward {float(value)!r}: not a finite float32 number" in record.error
        )
    assert (records[-1].state, records[-1].result.final_reward) == ("completed", 3.4028235e38)


async def test_no_more_than_concurrency_processes_run_at_once(tmp_path: Path) -> None:
    """Six rollouts, two processes at a time: each agent holds a connection to the test until released. While
    two are held, the runner runs two and four rollouts wait queued; releasing one starts exactly one more."""
    held: list[SocketStream] = []
    arrived = anyio.Event()

    async def gatekeeper(stream: SocketStream) -> None:
        nonlocal arrived
        await stream.receive()
        held.append(stream)
        arrived.set()
        await anyio.sleep_forever()

    async def arrivals(count: int) -> None:
        nonlocal arrived
        with anyio.fail_after(60):
            while len(held) < count:
                arrived = anyio.Event()
                await arrived.wait()

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    options = {"command": [*PROGRAM, "gate", "127.0.0.1", str(port)]}
    async with anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, gatekeeper)
        async with running(tmp_path, options, concurrency=2) as (daemon, runner, _mock):
            ids = [await daemon.queue_task({"n": i}) for i in range(6)]
            store = daemon.store
            for released in range(6):
                await arrivals(min(2 + released, 6))
                if released < 5:  # two held at once, the others queued
                    assert runner.running == 2
                    assert sum(store.state(r) == "queued" for r in ids) == max(0, 4 - released)
                await held[released].send(b"x")
            with anyio.fail_after(60):
                await store.wait_terminal(ids)
            assert all(store.state(r) == "completed" for r in ids)
            assert runner.peak == 2
        tg.cancel_scope.cancel()
    assert len(list((tmp_path / "logs").glob("*.log"))) == 6


def test_env_map_reads_the_input_as_agent_lightning_does() -> None:
    task = {"q": "why", "items": [{"id": 7}], "n": 3}
    env = resolve_env_map(
        task, {"ALL": "input", "Q": "input.q", "ID": "input.items.0.id", "N": "input.n", "LIT": "x"}
    )
    assert env == {
        "ALL": json.dumps(task, separators=(",", ":")),
        "Q": "why",
        "ID": "7",
        "N": "3",
        "LIT": "x",
    }
    with pytest.raises(ValueError, match=r"env_map\.Z: the task input has no 'input\.missing'"):
        resolve_env_map(task, {"Z": "input.missing"})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"agent_class": "a:B", "command": ["x"]}, "not both"),
        ({"agent_class": "not a class path"}, "agent_class must be"),
        ({"command": []}, "command must be"),
        ({"timeout_seconds": 0}, "timeout_seconds must be"),
        ({"reward_fillna_value": float("nan")}, "reward_fillna_value must be"),
        ({"reward_fillna_value": -1e39}, r"must be a finite number or null: .*-1e\+39: not a finite float32"),
        ({"env_map": {"A": 1}}, "env_map must map"),
        ({"commnd": "x"}, "unknown key 'commnd'"),
    ],
)
def test_bad_process_options_are_refused_naming_the_key(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ProcessOptions.from_mapping(options)


# ---------------------------------------------------------------------------------------------- issue 39
async def test_no_task_input_or_rollout_id_can_stop_the_runner(tmp_path: Path) -> None:
    """Issue 39, finding 1 (and 2: ids are never paths). A 1 MB field mapped into the environment (over the
    kernel's 128 KiB for one variable) and a field with a NUL byte go by file (``TASK_FILE``), saying so in the
    log; a rollout id with '/' or '..' (one journaled before ids were checked) names a log inside the log
    directory, %-escaped; and after all of them the runner still runs the next rollout."""
    options = {"command": [*PROGRAM, "fields"], "env_map": {"TASK": "input.text"}}
    async with running(tmp_path, options) as (daemon, _runner, _mock):
        big = await daemon.queue_task({"text": "y" * (1 << 20)})
        nul = await daemon.queue_task({"text": "a\0b"})
        hostile = [
            daemon.store.enqueue({"text": "ok"}, rollout_id=i) for i in ("a/b", "../../escaped", "/abs")
        ]
        records = [await finished(daemon, r) for r in [big, nul, *hostile]]
        after = await finished(daemon, await daemon.queue_task({"text": "small"}))
    assert [r.state for r in records] == ["completed"] * 5 and after.state == "completed"
    logs = tmp_path / "logs"
    seen = json.loads((logs / f"{big}.log").read_text().splitlines()[-1])
    assert seen == {"TASK": None, "TASK_FILE": 1 << 20, "same": True}
    notice = (logs / f"{big}.log").read_text().splitlines()[1]  # after the AGL_SEED line
    assert "TASK is 1,048,576 bytes, over the 131,066 one environment variable may hold" in notice
    assert "TASK_FILE" in notice
    assert json.loads((logs / f"{nul}.log").read_text().splitlines()[-1])["TASK_FILE"] == 3
    names = {p.name for p in logs.iterdir()}
    assert {"a%2Fb.log", "%2E%2E%2F%2E%2E%2Fescaped.log", "%2Fabs.log"} <= names
    assert not _anywhere_but(logs, tmp_path, "escaped.log") and not _anywhere_but(logs, Path("/"), "abs.log")
    assert json.loads((logs / f"{after.rollout_id}.log").read_text().splitlines()[-1])["TASK"] == 5


def _anywhere_but(logs: Path, root: Path, name: str) -> bool:
    return any(
        p.parent != logs for p in [root / name, logs.parent / name, logs.parent.parent / name] if p.exists()
    )


async def test_a_missing_program_is_named_before_the_runner_starts_and_later_fails_its_attempt_alone(
    tmp_path: Path,
) -> None:
    """Issue 39, finding 1: a command that is not installed is a ``ConfigError`` naming it when the runner
    starts (``AsyncVERL`` checks the same before Ray: ``test_async_verl_names_a_missing_agent_before_ray``); one
    that disappears later fails the attempt that finds it gone, with its error, and the next one runs."""
    async with AgentDaemon(model="mock") as daemon:
        options = ProcessOptions.from_mapping({"command": ["no-such-agent-39", "--x"]})
        with pytest.raises(
            ConfigError, match=r"'no-such-agent-39' is not installed: not found on the agents' PATH"
        ):
            with anyio.fail_after(30):  # serving without complaint is the defect
                await ProcessRunner(daemon, options, concurrency=1, log_dir=tmp_path / "logs").serve()
    script = tmp_path / "agent.sh"
    script.write_text('#!/bin/sh\necho 1 > "$AGL_REWARD_FILE"\n')
    script.chmod(0o755)
    async with running(tmp_path, {"command": [str(script)]}) as (daemon, _runner, _mock):
        assert (await finished(daemon, await daemon.queue_task({}))).state == "completed"
        script.unlink()
        gone = await finished(daemon, await daemon.queue_task({}))
        script.write_text('#!/bin/sh\necho 1 > "$AGL_REWARD_FILE"\n')
        script.chmod(0o755)
        again = await finished(daemon, await daemon.queue_task({}))
    assert gone.state == "failed" and f"cannot run '{script}': No such file or directory" in gone.error
    assert again.state == "completed"


async def test_an_attempt_that_ends_elsewhere_ends_its_processes_sigterm_first(tmp_path: Path) -> None:
    """Issue 39, finding 5: the agent of an attempt that ends elsewhere (its step's deadline, ``DELETE`` through
    the Agent Lightning API, its proxy shard lost: the attempt void and retried, its rollout forgotten) gets
    SIGTERM at once; the daemon it started outside its process group and session, which ignores SIGTERM, gets
    SIGKILL after the grace period. A lost attempt's retry is a new process, and the old one is gone."""
    agents: dict[str, tuple[SocketStream, list[int]]] = {}
    arrived = anyio.Event()

    async def hold(stream: SocketStream) -> None:
        nonlocal arrived
        rollout_id, *pids = (await stream.receive()).decode().split()
        agents[rollout_id] = (stream, [int(p) for p in pids])
        arrived.set()
        await anyio.sleep_forever()

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    options = {"command": [*PROGRAM, "hold", "127.0.0.1", str(port)], "kill_grace_seconds": 1.0}
    ways = ("deadline", "delete", "lost", "forget")
    async with anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, hold)
        async with running(tmp_path, options, concurrency=4, max_attempts=2) as (daemon, _runner, _mock):
            store, view = daemon.store, daemon.agent_lightning.rollouts
            for way in ways:
                store.enqueue({}, rollout_id=way)
            with anyio.fail_after(60):
                while len(agents) < len(ways):
                    arrived = anyio.Event()
                    await arrived.wait()
            (attempt,) = store.attempts("lost")
            store.fail(["deadline"], "the step's deadline passed")
            view.delete("delete")
            store.attempts_lost([("lost", attempt)], "proxy shard 0 died")
            store.fail(["forget"], "done with it")
            store.forget(["forget"])
            for way in ways:
                stream, pids = agents[way]
                with anyio.fail_after(20):
                    assert await stream.receive() == b"TERM\n"  # SIGTERM reached the agent first
                for pid in pids:
                    await _exited(pid)  # the agent, and the daemon that ignored SIGTERM: SIGKILL
            with anyio.fail_after(60):
                while "lost-retry-1" not in agents:  # the retry is a new process
                    arrived = anyio.Event()
                    await arrived.wait()
            assert store.attempts("lost")[-1] != attempt and view.slot("lost-retry-1").state == "running"
            store.fail(["lost"], "the test is over")
        tg.cancel_scope.cancel()


async def test_an_agent_gets_no_secret_of_the_runner_and_a_key_that_opens_only_its_own_rollout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 7, on a daemon without a token (the default): the runner's secrets stay out of the agent's
    environment; the agent's key opens its own rollout's paths only (403 on another's, and on the list of
    rollouts), and a rollout the runner runs takes writes only with its agent's key (401 without), so the
    agent cannot set another rollout's reward; its own reward is its own."""
    monkeypatch.setenv("WANDB_API_KEY", "a-secret-of-the-runner")
    waiting: list[SocketStream] = []
    arrived = anyio.Event()

    async def gate(stream: SocketStream) -> None:
        await stream.receive()
        waiting.append(stream)
        arrived.set()
        await anyio.sleep_forever()

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with (
        MockVLLM(completion_tokens=4) as mock,
        AgentDaemon(backends=[mock.url], model="mock", batch=BATCH, max_attempts=1) as daemon,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(listener.serve, gate)
        holder = ProcessRunner(
            daemon,
            ProcessOptions.from_mapping({"command": [*PROGRAM, "gate", "127.0.0.1", str(port)]}),
            concurrency=1,
            log_dir=tmp_path / "logs",
        )
        prober = ProcessRunner(
            daemon,
            ProcessOptions.from_mapping({"command": [*PROGRAM, "probe"]}),
            concurrency=1,
            log_dir=tmp_path / "logs",
        )
        await tg.start(holder.serve)
        victim = await daemon.queue_task({})  # the holder's agent runs it, and waits at the gate
        with anyio.fail_after(60):
            await arrived.wait()
        await tg.start(prober.serve)
        probe = await finished(daemon, await daemon.queue_task({"peer": victim}))
        await waiting[0].send(b"x")
        assert (await finished(daemon, victim)).result.final_reward == 1.0  # the gate's own reward
        tg.cancel_scope.cancel()
    seen = json.loads((tmp_path / "logs" / f"{probe.rollout_id}.log").read_text().splitlines()[-1])
    assert seen["peer_with_own_key"] == 403 and seen["peer_without_key"] == 401
    assert seen["list_with_own_key"] == 403 and seen["own_without_key"] == 401 and seen["own"] == 200
    assert "WANDB_API_KEY" not in seen["env"] and "PYTHONPATH" in seen["env"] and "AGL_KEY" in seen["env"]
    assert probe.state == "completed" and probe.result.final_reward == 0.5
    assert daemon.agent_lightning.rollouts.reward(daemon.agent_lightning.rollouts.slot(victim)) is None


@pytest.mark.parametrize("token", [TOKEN, None], ids=["daemon_token", "no_daemon_token"])
async def test_the_runners_agents_call_the_proxy_directly_and_get_what_the_hop_gave_them_under_their_own_key(
    tmp_path: Path, token: str | None
) -> None:
    """No second HTTP exchange: OPENAI_BASE_URL is the attempt's URL on the proxy, which does what Agent
    Lightning's hop did: the served model's name and the trainer's temperature forced (the backend gets the very
    body the hop sends it), the attempt's key required (none, or another attempt's URL with it: 401), and no
    longer opening anything once its process is gone. The hop's path still serves it, with or without a daemon
    token (the hop vouches for the key it checked)."""
    async with daemon_and_mock(sampling_parameters={"temperature": 0.7}, token=token) as (daemon, mock):
        store = daemon.store
        peer = await daemon.queue_task({})
        task = store.try_claim()  # claimed before the runner starts: an attempt no agent of its runs
        assert task is not None and task.rollout_id == peer and task.attempt_id is not None
        peer_llm = f"{daemon.proxy.url}/rollout/{peer}/attempt/{task.attempt_id}/v1"
        options = ProcessOptions.from_mapping({"command": [*PROGRAM, "gateway"]})
        runner = ProcessRunner(daemon, options, concurrency=1, log_dir=tmp_path / "logs")
        async with anyio.create_task_group() as tg:
            await tg.start(runner.serve)
            rollout_id = await daemon.queue_task({"peer_llm": peer_llm})
            record = await finished(daemon, rollout_id)
            tg.cancel_scope.cancel()
        seen = json.loads((tmp_path / "logs" / f"{rollout_id}.log").read_text().splitlines()[-1])
        async with aiohttp.ClientSession() as http:  # its process is gone: its key opens nothing
            headers = {"Authorization": f"Bearer {seen['key']}"}
            async with http.post(f"{seen['base']}/chat/completions", json={}, headers=headers) as late:
                assert late.status == 401
    assert seen["base"] == f"{daemon.proxy.url}/rollout/{rollout_id}/attempt/{record.attempt_id}/v1"
    # the peer's attempt is no runner's: without a daemon token anyone's call goes in (its temperature refused)
    assert (seen["own"], seen["own_without_key"], seen["hop"], seen["peer_with_own_key"]) == (
        200,
        401,
        200,
        401 if token else 400,
    )
    direct, through_hop = (r.json for r in mock.generation_requests())
    assert direct == through_hop and (direct["model"], direct["temperature"]) == ("mock", 0.7)
    assert record.state == "completed" and len(record.calls) == 2


async def test_an_agents_output_is_kept_up_to_log_max_bytes_and_a_daemon_it_left_dies_with_it(
    tmp_path: Path,
) -> None:
    """Finding 7: a log keeps the first ``log_max_bytes`` of the output (a last line counts the rest); a daemon
    the agent started outside its process group and session is ended when the attempt is (and the attempt is
    not failed for it)."""
    options = {"command": [*PROGRAM, "flood", str(3 << 20)], "log_max_bytes": 65536}
    async with running(tmp_path, options) as (daemon, _runner, _mock):
        flood = await finished(daemon, await daemon.queue_task({}))
    log = (tmp_path / "logs" / f"{flood.rollout_id}.log").read_bytes()
    assert flood.state == "completed" and 65536 < len(log) < 65536 + 300
    assert log.endswith(
        b"bytes of output were dropped: the log keeps the first 65,536 (aglverl.processes.log_max_bytes)\n"
    )
    pidfile = tmp_path / "daemon.pid"
    async with running(tmp_path, {"command": [*PROGRAM, "leave-daemon", str(pidfile)]}) as (
        daemon,
        _runner,
        _mock,
    ):
        left = await finished(daemon, await daemon.queue_task({}))
        await _exited(int(pidfile.read_text()))
    assert left.state == "completed"
