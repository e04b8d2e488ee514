"""The Agent Lightning 0.2/0.3 bridge (``aglverl.agl03.store_bridge``) with the real agentlightning 0.3.0: its
``Trainer`` (client-server strategy, a forked runner, its in-memory store behind its HTTP server) and aglverl's
daemon in front of a vLLM-shaped mock backend; no verl, no Ray (the ``agl03`` tier, in .venv-agl03)."""

from __future__ import annotations

import os
import signal
import socket
import time
from typing import Any

import pytest

pytestmark = pytest.mark.agl03

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network: litellm's price list is local
agl = pytest.importorskip("agentlightning")

import anyio  # noqa: E402
import openai  # noqa: E402

from aglverl import AgentDaemon  # noqa: E402
from aglverl.agl03.store_bridge import DequeueBell, LightningStoreBridge  # noqa: E402
from aglverl.testing.mock_vllm import MockVLLM  # noqa: E402

#: aglverl.lease_seconds, Agent Lightning's rollout timeout under the bridge.
LEASE = 3.0


@agl.rollout
def killing_agent(task: dict[str, Any], llm: agl.LLM) -> float:
    """One chat call, its reward returned; a task with ``kill`` kills this runner process after its call."""
    client = openai.OpenAI(base_url=llm.endpoint, api_key=llm.api_key or "unused", max_retries=0)
    client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": task["prompt"]}])
    if task.get("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    return 0.5


class _Bridged(agl.Algorithm):
    """What ``VERL.run`` runs around verl's trainer (the bridge and the bell on the Trainer's store), with the
    test's rollouts queued on aglverl's daemon in place of a trainer's steps."""

    def __init__(self, tasks: list[dict[str, Any]]) -> None:
        super().__init__()
        self.tasks = tasks
        self.records: list[Any] = []
        self.resources_left: list[int] = []
        self.ended_at: list[float] = []  # wall-clock time each rollout was seen terminal

    async def run(self, train_dataset: Any = None, val_dataset: Any = None) -> None:
        store = self.get_store()
        bell = DequeueBell()
        bell.install(store)
        try:
            async with (
                MockVLLM(completion_tokens=2) as mock,
                AgentDaemon(backends=[mock.url], model="mock", lease_seconds=LEASE, max_attempts=1) as daemon,
                anyio.create_task_group() as tg,
            ):
                bridge = LightningStoreBridge(daemon, store, concurrency=2, bell=bell)
                await tg.start(bridge.serve)
                for task in self.tasks:  # one at a time: the killing one last
                    rollout_id = await daemon.queue_task(task)
                    with anyio.fail_after(LEASE + 30):
                        await daemon.store.wait_terminal([rollout_id])
                    self.ended_at.append(time.time())
                    self.records.append(daemon.store.record(rollout_id))
                    self.resources_left.append(len(await store.query_resources()))
                tg.cancel_scope.cancel()
        finally:
            bell.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_killed_only_runner_has_its_attempt_ended_at_its_deadline_and_no_resources_stay() -> None:
    """Three rollouts run on the one runner, then the fourth's agent kills it after its LLM call. Nothing else
    calls the store (the runner is gone), so Agent Lightning's health check never runs; the bridge ends the
    attempt ``timeout`` at its deadline (``lease_seconds`` after the runner started it) and aglverl's attempt
    fails saying so. Each attempt's resources entry is gone from the store once it ended."""
    tasks = [{"prompt": "Say yes."} for _ in range(3)] + [{"prompt": "Say yes.", "kill": True}]
    algorithm = _Bridged(tasks)
    trainer = agl.Trainer(algorithm=algorithm, n_runners=1, port=_free_port())
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"exitcode=-9"):  # Agent Lightning reports the killed runner
        trainer.fit(killing_agent, train_dataset=[tasks[0]])
    elapsed = time.monotonic() - started

    states = [r.state for r in algorithm.records]
    assert states == ["completed", "completed", "completed", "failed"], [r.error for r in algorithm.records]
    killed = algorithm.records[-1]
    assert killed.calls and "ended failed (its attempt: timeout)" in (killed.error or "")
    assert algorithm.resources_left == [0, 0, 0, 0]  # one entry per attempt in flight, none left after
    (rollout,) = [r for r in _rollouts(algorithm.get_store()) if r.input.get("kill")]
    (attempt,) = _attempts(algorithm.get_store(), rollout.rollout_id)
    assert attempt.status == "timeout"
    ran = algorithm.ended_at[-1] - attempt.start_time  # from the runner's dequeue to aglverl's failed attempt
    assert LEASE <= ran < LEASE + 3.0  # at its deadline, not at a week's lease
    assert elapsed < 60


def _rollouts(store: Any) -> list[Any]:
    return list(anyio.run(store.query_rollouts))


def _attempts(store: Any, rollout_id: str) -> list[Any]:
    return list(anyio.run(store.query_attempts, rollout_id))
