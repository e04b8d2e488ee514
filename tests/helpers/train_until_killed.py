"""A training process for the SIGKILL resume tests: `python tests/helpers/train_until_killed.py DIR RUN [MODE]`.

Trains the one-word task with ``AsyncVERL`` (verl's V1 trainer in ``MODE``, default ``sync``; a checkpoint
every step, the daemon's journal next to the checkpoints, ``resume_mode: auto``) for 4 steps of 2 samples x 2
rollouts, the samples in dataset order. Every answer an agent gives is appended to ``DIR/answers.jsonl`` (run,
sample id, rollout id) before the agent returns it, and every trained step to ``DIR/steps.jsonl``.

``RUN=1`` dies mid-step. ``sync``: in step 3 (samples 4 and 5), the first two rollouts are answered; the third
agent waits until those two results are stored and journaled, then kills its own process with SIGKILL (the
fourth never answers). An asynchronous mode (rollouts run ahead of the trainer, across steps): the tenth
agent to answer waits until the nine before it are stored and journaled, then kills the process — so a group
is caught half answered. ``RUN=2`` answers everything.
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
from aglverl.cli.demo import demo_samples, one_word_agent
from aglverl.testing.resumable import resumable_config

STEP_3_SAMPLES = {4, 5}


def config(directory: Path, mode: str = "sync") -> dict[str, Any]:
    return resumable_config(directory, mode=mode)


async def main(directory: Path, run: int, mode: str) -> None:
    answers = (directory / "answers.jsonl").open("ab")
    steps = (directory / "steps.jsonl").open("ab")
    watched: list[str] = []
    kill_at = 3 if mode == "sync" else 10
    algo: AsyncVERL | None = None

    async def agent(task: dict[str, Any], llm: LLM) -> float:
        rollout_id = llm.endpoint.split("/rollout/", 1)[1].split("/", 1)[0]
        if run == 1 and (mode != "sync" or task["id"] in STEP_3_SAMPLES):
            watched.append(rollout_id)
            if len(watched) == kill_at:  # the ones before answered (or on their way): stored, then die
                assert algo is not None and algo.daemon is not None
                store = algo.daemon.store
                # those no longer held were finished and covered by a checkpoint already
                await store.wait_terminal([rid for rid in watched[: kill_at - 1] if store.knows(rid)])
                await algo.daemon.store.commit()
                os.kill(os.getpid(), signal.SIGKILL)
            if len(watched) > kill_at:
                await anyio.sleep_forever()
        reward = await one_word_agent(task, llm)
        answers.write(orjson.dumps({"run": run, "sample": task["id"], "rollout_id": rollout_id}) + b"\n")
        answers.flush()
        return reward

    def on_step(step: int, metrics: Any) -> None:
        row = {
            "run": run,
            "step": step,
            **{k: v for k, v in metrics.items() if k.startswith(("step/", "training/"))},
        }
        steps.write(orjson.dumps(row) + b"\n")
        steps.flush()

    algo = AsyncVERL(config(directory, mode), agent=agent, progress=False)
    algo.on_step.append(on_step)
    await algo.run(train_dataset=demo_samples(8 if mode == "sync" else 32))


if __name__ == "__main__":
    anyio.run(main, Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "sync")
