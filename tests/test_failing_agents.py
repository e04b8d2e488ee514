"""Agents that fail never stop training by themselves: a group whose every rollout failed is replaced by a fresh
prompt (verl's refill, in every mode), and agents that keep failing stop the run with their own error named.

AsyncVERL end to end on CPU (verl's V1 trainer, the toy task); one Ray session for the module.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import ray

from aglverl import LLM
from aglverl.algorithm import AsyncVERL, compose_config, verl_runtime
from aglverl.cli.demo import one_word_agent
from aglverl.store import AttemptChange
from aglverl.store.journal import read_records
from aglverl.trajectory.groups import AgentsFailing

pytestmark = pytest.mark.anyio

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

TRAIN = [{"prompt": "Say yes.", "word": "yes", "id": i} for i in range(12)]
HELPERS = Path(__file__).parent / "helpers"


class ModelBehaviorError(Exception):
    """What the openai-agents SDK raises on an answer cut at max_output_tokens (its name, for the message)."""


def _config(mode: str, steps: int, **aglverl: Any) -> dict[str, Any]:
    return {
        "data": {"train_batch_size": 2, "max_prompt_length": 64, "max_response_length": 4, "shuffle": False},
        "actor_rollout_ref": {"rollout": {"n": 2}, "actor": {"ppo_mini_batch_size": 2}},
        "algorithm": {"adv_estimator": "grpo"},
        "aglverl": {"journal": None, "max_attempts": 1, **aglverl},
        "trainer": {
            "v1": {"trainer_mode": mode},
            "total_training_steps": steps,
            "save_freq": -1,
            "test_freq": -1,
            "val_before_train": False,
            "logger": [],
        },
        "ray_kwargs": {"ray_init": {"log_to_driver": False}},
    }


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def shared_ray(tiny_model: Path) -> Iterator[None]:
    config, _ = compose_config(_config("sync", 1))
    with ExitStack() as stack:
        stack.enter_context(verl_runtime(config))
        yield


async def test_a_step_whose_every_rollout_raises_is_replaced_by_fresh_prompts_sync(
    shared_ray: None, tmp_path: Path
) -> None:
    """Step 1's two samples (ids 0 and 1) fail in every rollout; verl's sync sampler would stop with its own
    'no materializable trajectories'. Their groups are evicted, fresh prompts replace them, training goes on.
    An explicit journal with nothing checkpointing (save_freq -1) keeps no trained or evicted group."""
    answered: list[int] = []

    async def agent(task: Mapping[str, Any], llm: LLM) -> float:
        if int(task["id"]) < 2:
            raise ModelBehaviorError("Max output tokens reached")
        answered.append(int(task["id"]))
        return await one_word_agent(task, llm)

    journal = tmp_path / "run.journal"
    algo = AsyncVERL(_config("sync", 2, max_failed_groups=3, journal=str(journal)), agent=agent)
    steps: list[dict[str, float]] = []
    algo.on_step.append(lambda step, metrics: steps.append(dict(metrics)))
    await algo.run(TRAIN, None)
    assert len(steps) == 2
    assert sum(m.get("training/rollout_failure/evicted_samples", 0.0) for m in steps) == 2  # counted
    # the evicted groups' rollouts are counted as failed (in the step that evicted them), never trained
    assert sum(m["step/n_completed"] for m in steps) == 8 and sum(m["step/n_failed"] for m in steps) == 4
    assert 0 not in answered and 1 not in answered and len(answered) == 8
    records = list(read_records(journal))
    dispatched = {r["uid"] for r in records if r["kind"] == "group"}
    assert len(dispatched) >= 6  # 2 failed + 4 trained
    assert dispatched == {r["uid"] for r in records if r["kind"] == "group_done"}  # none left in the journal


@pytest.mark.parametrize("mode", ["sync", "colocate_async"])
async def test_agents_that_keep_failing_stop_the_run_with_their_error_named(
    shared_ray: None, mode: str
) -> None:
    calls = 0

    async def agent(task: Mapping[str, Any], llm: LLM) -> float:
        nonlocal calls
        calls += 1
        if calls % 5 == 0:
            raise RuntimeError("connection reset by tool")
        raise ModelBehaviorError("Max output tokens reached")

    algo = AsyncVERL(_config(mode, 3), agent=agent)  # default bound: train_batch_size (2) groups in a row
    steps: list[int] = []
    algo.on_step.append(lambda step, metrics: steps.append(step))
    with pytest.raises(AgentsFailing) as caught:  # itself, not wrapped in the task groups it crossed
        await algo.run(TRAIN, None)
    error = caught.value
    assert steps == []
    assert error.groups >= 2 and error.rollouts >= 4
    message = str(error)
    assert "ModelBehaviorError: Max output tokens reached" in message
    assert error.errors[0][0].endswith("ModelBehaviorError: Max output tokens reached")  # the most frequent
    assert "materializable" not in message


async def test_an_agent_that_forgets_its_reward_stops_the_run_saying_so(shared_ray: None) -> None:
    """The agent returns None: every rollout fails with that reason (nothing trains on a made-up 0), and the
    run stops with the reason named once a batch's worth of groups failed."""

    async def agent(task: Mapping[str, Any], llm: LLM) -> float:
        await one_word_agent(task, llm)  # the reward is computed... and not returned

    algo = AsyncVERL(_config("sync", 2), agent=agent)  # type: ignore[arg-type]
    with pytest.raises(AgentsFailing) as caught:
        await algo.run(TRAIN, None)
    assert caught.value.errors[0][0] == (
        "aglverl.client.AgentResultError: the agent returned None: return a float reward or a Rollout"
    )


async def test_an_agent_process_cannot_stop_training_with_a_huge_reward_a_frozen_supervisor_or_a_late_reward(
    shared_ray: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 50's acceptance: two steps with the built-in runner (Agent Lightning agent classes, forked) in which
    one agent writes 1e39 to its reward file, one stops its supervisor with SIGSTOP, and one posts a reward after
    ending its own rollout. Both steps train; the three attempts fail or are refused, each with its reason; the
    run's shutdown takes less than 30 s. (tests/helpers/hostile_agents.py: one attempt of each kind misbehaves.)"""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HELPERS), os.environ.get("PYTHONPATH", "")]))
    kinds = ["huge", "freeze", "late", "good"]
    processes = {
        "agent_class": "hostile_agents:HostileAgent",
        "env_map": {"TASK_KIND": "input.kind", "HOSTILE_DIR": str(tmp_path)},
        "timeout_seconds": 15,
        "kill_grace_seconds": 2,
        "log_dir": str(tmp_path / "logs"),
    }
    algo = AsyncVERL(_config("sync", 2, agents=4, processes=processes))
    ended: list[AttemptChange] = []
    algo.on_serving.append(lambda daemon: daemon.store.on_attempt(ended.append))
    steps: list[int] = []
    algo.on_step.append(lambda step, metrics: steps.append(step))
    stopping: list[float] = []
    algo.on_stopping.append(lambda daemon: stopping.append(time.monotonic()))
    await algo.run([{**task, "kind": kind} for task, kind in zip(TRAIN, kinds, strict=False)], None)
    shutdown = time.monotonic() - stopping[0]
    assert steps == [1, 2]
    errors = [c.error or "" for c in ended if c.kind == "ended" and c.state == "failed"]
    assert any("AGL_REWARD_FILE held the reward 1e+39: not a finite float32 number" in e for e in errors), (
        errors
    )
    assert any("supervisor" in e for e in errors), errors  # the runner ended the frozen one (runners' fix)
    logs = "\n".join(p.read_text() for p in (tmp_path / "logs").iterdir())
    assert "late reward: 409 rollout" in logs and "a reward posted after its end is refused" in logs, logs
    assert "reward events kept: [0.5]" in logs
    assert shutdown < 30, shutdown
