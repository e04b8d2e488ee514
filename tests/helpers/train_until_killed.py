"""A training process for the SIGKILL resume test: `python tests/helpers/train_until_killed.py DIR RUN`.

Trains the one-word task with ``AsyncVERL`` (verl's V1 sync trainer, a checkpoint every step, the daemon's
journal next to the checkpoints, ``resume_mode: auto``) for 4 steps of 2 samples x 2 rollouts, the samples in
dataset order (step k takes samples 2k-2 and 2k-1). Every answer an agent gives is appended to
``DIR/answers.jsonl`` (run, sample id, rollout id) before the agent returns it, and every trained step to
``DIR/steps.jsonl``.

``RUN=1`` dies mid-step: in step 3, the first two rollouts are answered; the third agent waits until those two
results are stored and journaled, then kills its own process with SIGKILL (the fourth never answers).
``RUN=2`` answers everything.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import anyio
import orjson

from aglverl import LLM, AsyncVERL
from aglverl.demo import demo_samples, one_word_agent

STEP_3_SAMPLES = {4, 5}


def config(directory: Path) -> dict[str, Any]:
    return {
        "data": {"train_batch_size": 2, "max_prompt_length": 64, "max_response_length": 4, "shuffle": False},
        "actor_rollout_ref": {"rollout": {"n": 2}, "actor": {"ppo_mini_batch_size": 2}},
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {
            "total_training_steps": 4,
            "save_freq": 1,
            "test_freq": -1,
            "val_before_train": False,
            "resume_mode": "auto",
            "default_local_dir": str(directory / "checkpoints"),
            "logger": [],
        },
        "ray_kwargs": {"ray_init": {"log_to_driver": False}},
        "aglverl": {"journal": "auto"},
    }


async def main(directory: Path, run: int) -> None:
    answers = (directory / "answers.jsonl").open("ab")
    steps = (directory / "steps.jsonl").open("ab")
    step_3: list[str] = []
    algo: AsyncVERL | None = None

    async def agent(task: dict[str, Any], llm: LLM) -> float:
        rollout_id = llm.endpoint.split("/rollout/", 1)[1].split("/", 1)[0]
        if run == 1 and task["id"] in STEP_3_SAMPLES:
            step_3.append(rollout_id)
            if len(step_3) == 3:  # two answered (or on their way): make sure they are stored, then die
                assert algo is not None and algo.daemon is not None
                await algo.daemon.store.wait_terminal(step_3[:2])
                await algo.daemon.store.commit()
                os.kill(os.getpid(), signal.SIGKILL)
            if len(step_3) > 3:
                await anyio.sleep_forever()
        reward = await one_word_agent(task, llm)
        answers.write(orjson.dumps({"run": run, "sample": task["id"], "rollout_id": rollout_id}) + b"\n")
        answers.flush()
        return reward

    def on_step(step: int, metrics: Any) -> None:
        row = {"run": run, "step": step, **{k: v for k, v in metrics.items() if k.startswith(("step/", "training/"))}}
        steps.write(orjson.dumps(row) + b"\n")
        steps.flush()

    algo = AsyncVERL(config(directory), agent=agent, progress=False)
    algo.on_step.append(on_step)
    await algo.run(train_dataset=demo_samples(8))


if __name__ == "__main__":
    anyio.run(main, Path(sys.argv[1]), int(sys.argv[2]))
