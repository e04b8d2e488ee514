"""A training process for the kill-loop test: `python tests/helpers/train_kill_loop.py DIR RUN MODE MOMENT`.

Trains the one-word task with ``AsyncVERL`` (verl's V1 trainer in ``MODE``; 10 steps of 2 samples x 2
rollouts, a checkpoint every 3 steps, the daemon's journal next to the checkpoints, ``resume_mode: auto``) and
kills itself with SIGKILL at ``MOMENT``:

- ``answer:K``: when this run's K-th agent is about to answer (every answer written before is stored and
  journaled first, and no other answer is written after: the answers file lists exactly what the journal has);
- ``save:S``: in the middle of verl's checkpoint save of step S (after the actor's state is written, before
  the data loader's state and ``latest_checkpointed_iteration.txt``);
- ``none``: runs to the end.

What the test checks is written as JSON lines: ``runs.jsonl`` (the checkpoint each run resumed from),
``answers.jsonl`` (run, sample, rollout id: every answer stored), ``groups.jsonl`` (each dispatched training
group's uid and rollout ids) and ``steps.jsonl`` (each trained step, the uids of its groups, its metrics). The
producer's ``dispatch`` and ``take_stats`` are observed (wrapped to log their arguments and results), not
changed.
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

STEPS = 10
SAVE_FREQ = 3


def config(directory: Path, mode: str) -> dict[str, Any]:
    return resumable_config(directory, mode=mode, steps=STEPS, save_freq=SAVE_FREQ)


def _log(file: Any, record: dict[str, Any]) -> None:
    file.write(orjson.dumps(record) + b"\n")
    file.flush()


async def main(directory: Path, run: int, mode: str, moment: str) -> None:
    logs = {name: (directory / f"{name}.jsonl").open("ab") for name in ("runs", "answers", "groups", "steps")}
    latest = directory / "checkpoints" / "latest_checkpointed_iteration.txt"
    _log(
        logs["runs"],
        {
            "run": run,
            "mode": mode,
            "moment": moment,
            "resumed_from": int(latest.read_text()) if latest.exists() else 0,
        },
    )
    kind, _, value = moment.partition(":")
    target = int(value) if value else 0
    answered: list[str] = []
    dying = False
    algo: AsyncVERL | None = None

    async def die() -> None:
        nonlocal dying
        dying = True  # no answer is written from now on
        assert algo is not None and algo.daemon is not None
        store = algo.daemon.store
        await store.wait_terminal([rid for rid in answered if store.knows(rid)])
        await store.commit()
        os.kill(os.getpid(), signal.SIGKILL)

    async def agent(task: dict[str, Any], llm: LLM) -> float:
        rollout_id = llm.endpoint.split("/rollout/", 1)[1].split("/", 1)[0]
        reward = await one_word_agent(task, llm)
        if kind == "answer" and len(answered) + 1 >= target and not dying:
            await die()
        if dying:
            await anyio.sleep_forever()
        answered.append(rollout_id)
        _log(logs["answers"], {"run": run, "sample": task["id"], "rollout_id": rollout_id})
        return reward

    def observe(daemon: Any) -> None:
        producer = daemon.producer
        dispatch, take_stats = producer.dispatch, producer.take_stats

        def logged_dispatch(prompts: Any, **kwargs: Any) -> None:
            dispatch(prompts, **kwargs)
            for prompt in prompts:
                if prompt.partition == "train":
                    ids = producer._groups[prompt.uid].rollout_ids
                    _log(logs["groups"], {"run": run, "uid": prompt.uid, "rollout_ids": ids})

        def logged_take_stats(uids: Any) -> Any:
            # the step's groups: aglverl.verl_v1 leaves verl's padding rows out (tagged is_padding, keyed
            # pad{hex}_{i}_0), so every uid here is a dispatched group's
            _log(
                logs["steps"], {"run": run, "step": int(algo.trainer.global_steps), "uids": sorted(set(uids))}
            )
            return take_stats(uids)

        producer.dispatch, producer.take_stats = logged_dispatch, logged_take_stats
        if kind == "save":
            trainer = algo.trainer
            loader = trainer.train_dataloader
            state_dict = loader.state_dict

            def killed_mid_save() -> Any:  # verl saves the actor, then the data loader's state, then "latest"
                if int(trainer.global_steps) == target:
                    os.kill(os.getpid(), signal.SIGKILL)
                return state_dict()

            loader.state_dict = killed_mid_save

    algo = AsyncVERL(config(directory, mode), agent=agent, progress=False)
    algo.on_serving.append(observe)
    await algo.run(train_dataset=demo_samples(64))


if __name__ == "__main__":
    anyio.run(main, Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
