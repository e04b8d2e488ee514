"""aglverl under verl's asynchronous V1 modes, on one live colocate_async trainer and one Ray session: stale
trajectories evicted and counted, agents whose rollouts span a weight update."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import ray
from helpers.v1 import live_trainer

from aglverl import run_agents
from aglverl.models import Rollout, Triplet

pytestmark = pytest.mark.anyio

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

CONFIG = {
    "data": {"train_batch_size": 2, "max_prompt_length": 32, "max_response_length": 8, "shuffle": False},
    "actor_rollout_ref": {"rollout": {"n": 2}, "actor": {"ppo_mini_batch_size": 2}},
    "algorithm": {"adv_estimator": "grpo"},
    "trainer": {
        "total_training_steps": 4,
        "val_before_train": False,
        "test_freq": -1,
        "save_freq": -1,
        "v1": {"trainer_mode": "colocate_async", "sampler": {"max_off_policy_threshold": 2}},
    },
    "aglverl": {"journal": None},
}
TRAIN = [{"prompt": "Say yes.", "word": "yes", "id": i} for i in range(8)]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def live(tiny_model: Path) -> AsyncIterator[tuple[Any, Any]]:
    async with live_trainer(CONFIG, TRAIN) as (run, trainer, _):
        yield run, trainer


def _answer_all(store: Any, reward: float = 1.0) -> int:
    answered = 0
    while (task := store.try_claim()) is not None:
        session = task.metadata["session"]
        triplet = Triplet(prompt={"token_ids": [1, 2, 3]}, response={"token_ids": [4, 5 + session]})
        store.submit_result(
            Rollout(
                rollout_id=task.rollout_id,
                attempt_id=task.attempt_id,
                final_reward=reward * session,
                triplets=[triplet],
            )
        )
        answered += 1
    return answered


async def test_a_trajectory_older_than_the_staleness_bound_is_evicted_counted_and_never_trained(
    live: tuple[Any, Any],
) -> None:
    import transfer_queue as tq

    run, trainer = live
    store, producer = run.daemon.store, run.daemon.producer
    assert trainer.config.actor_rollout_ref.rollout.calculate_log_probs  # async modes: correction on by default
    assert trainer.config.algorithm.rollout_correction.rollout_is == "token"
    # two prompts dispatched at step 1 and answered: then the trainer is at step 9, far past the bound of 2
    trainer.global_steps = 1
    await anyio.to_thread.run_sync(trainer._add_prompts_to_generate, 2)
    assert _answer_all(store) == 4
    with anyio.fail_after(30):
        await producer.wait_changed(0, 2)
    stale = {uid for uid, tag in (await anyio.to_thread.run_sync(tq.kv_list, "train")).get("train", {}).items() if tag.get("is_prompt")}
    assert len(stale) == 2
    trainer.global_steps = 9

    async def agent(task: Any, llm: Any) -> Rollout:
        # verl replaces every evicted group with a fresh prompt (tagged with the current step): answer those
        triplet = Triplet(prompt={"token_ids": [1, 2, 3]}, response={"token_ids": [4, 5]})
        return Rollout(rollout_id="-", final_reward=float(task["id"] % 2), triplets=[triplet])

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: run_agents(run.daemon.server_url, agent, concurrency=4))
        with anyio.fail_after(60):
            batch, metrics = await anyio.to_thread.run_sync(trainer.replay_buffer.sample, 9, "train", 2)
        tg.cancel_scope.cancel()
    trained = {key.split("_")[0] for key in batch.keys}
    assert len(trained) == 2 and not trained & stale  # never trained
    assert metrics["training/off_policy/evicted_samples"] == 2  # counted (verl's metric)
    assert metrics["training/off_policy/evicted_samples_staleness/max"] == 9
    evicted = producer.take_stats(sorted(trained))  # the step's groups and, with them, the evicted ones
    assert {s.uid for s in evicted} == trained | stale
    await anyio.to_thread.run_sync(lambda: tq.kv_clear(keys=batch.keys, partition_id="train"))
