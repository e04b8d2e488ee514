"""An Agent Lightning v1.0 setup trains unchanged: ``AsyncVERL`` with Agent Lightning's ``agentlightning:`` section,
its rollouts driven end to end by Agent Lightning's own controller (``python -m agentlightning.controller
runner_type=local``, from the tier's venv), whose agent processes call the model through the proxy path and
report their rewards as reward events. verl's V1 trainer on CPU, the tiny model; one Ray session for the module.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import ray
from conftest import agl_python

from aglverl.algorithm import AsyncVERL, compose_config, verl_runtime

pytestmark = [pytest.mark.anyio, pytest.mark.agl]

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

HELPERS = Path(__file__).parent / "helpers"
KEY = "agl-key"
#: Alternating rewards: with two prompts a step (in order), every step's rollouts average 0.5.
TRAIN = [{"prompt": "Say yes.", "reward": 0.25 if i % 2 == 0 else 0.75} for i in range(8)]


def _config(steps: int, agentlightning: dict[str, Any], **aglverl: Any) -> dict[str, Any]:
    return {
        "data": {"train_batch_size": 2, "max_prompt_length": 64, "max_response_length": 4, "shuffle": False},
        "actor_rollout_ref": {"rollout": {"n": 2}, "actor": {"ppo_mini_batch_size": 2}},
        "algorithm": {"adv_estimator": "grpo"},
        "aglverl": {"journal": None, "max_attempts": 2, **aglverl},
        "agentlightning": agentlightning,
        "trainer": {
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
    config, _ = compose_config({k: v for k, v in _config(1, {}).items() if k != "agentlightning"})
    with ExitStack() as stack:
        stack.enter_context(verl_runtime(config))
        yield


async def test_agent_lightnings_local_controller_drives_an_async_verl_run_whose_rewards_are_its_agents_events(
    shared_ray: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``aglverl.agents: 0`` starts no agent; Agent Lightning's controller, given the task server's URL and
    key, polls it, spawns one ``RewardAgent().run()`` per rollout (its own worker), patches the states; every
    step's reward is the mean of the reward events the agents posted (0.25 and 0.75: 0.5), none failed."""
    python = agl_python()
    assert python is not None
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HELPERS), os.environ.get("PYTHONPATH", "")]))
    section = {
        "agl_key": KEY,
        "rollout_timeout_seconds": 300,
        "local": {"agent_class": "agl_style_agents:RewardAgent", "env_map": {"TASK_REWARD": "input.reward"}},
    }
    algo = AsyncVERL(_config(2, section, agents=0), progress=False)
    assert algo.options.token == KEY and algo.options.processes.agent_class == "agl_style_agents:RewardAgent"
    controllers: list[subprocess.Popen[bytes]] = []
    log = tmp_path / "controller.log"

    def start_controller(daemon: Any) -> None:
        command = [
            python,
            "-m",
            "agentlightning.controller",
            "runner_type=local",
            f"agl_server.url={daemon.server_url}",
            f"agl_server.key={KEY}",
            "local_runner.poll_interval=1",
            "local_runner.maximum_size=4",
        ]
        with open(log, "wb") as out:
            controllers.append(subprocess.Popen(command, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT))

    async def stop_controller(daemon: Any) -> None:
        for controller in controllers:
            controller.send_signal(signal.SIGTERM)
            await anyio.to_thread.run_sync(controller.wait)

    steps: list[dict[str, float]] = []
    algo.on_serving.append(start_controller)
    algo.on_stopping.append(stop_controller)
    algo.on_step.append(lambda step, metrics: steps.append(dict(metrics)))
    try:
        await algo.run(TRAIN, None)
    finally:
        for controller in controllers:
            if controller.poll() is None:
                controller.kill()
                controller.wait()
    assert algo.process_runner is None  # agents: 0 -- the controller ran every agent
    assert len(steps) == 2, log.read_text()[-3000:]
    for metrics in steps:
        assert metrics["training/reward"] == pytest.approx(0.5), log.read_text()[-3000:]
        assert metrics["step/n_failed"] == 0 and metrics["step/n_completed"] == 4
    assert "Spawned rollout subprocess" in log.read_text()
