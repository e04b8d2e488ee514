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
from helpers.v1 import assert_rows_are_the_engines_chains, live_trainer, multi_turn_agents

from aglverl import run_agents
from aglverl.models import Rollout, Triplet

pytestmark = pytest.mark.anyio

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

CONFIG = {
    "data": {"train_batch_size": 2, "max_prompt_length": 64, "max_response_length": 32, "shuffle": False},
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
    assert (
        trainer.config.actor_rollout_ref.rollout.calculate_log_probs
    )  # async modes: correction on by default
    assert trainer.config.algorithm.rollout_correction.rollout_is == "token"
    # two prompts dispatched at step 1 and answered: then the trainer is at step 9, far past the bound of 2
    trainer.global_steps = 1
    await anyio.to_thread.run_sync(trainer._add_prompts_to_generate, 2)
    assert _answer_all(store) == 4
    with anyio.fail_after(30):
        await producer.wait_changed(0, 2)
    stale = {
        uid
        for uid, tag in (await anyio.to_thread.run_sync(tq.kv_list, "train")).get("train", {}).items()
        if tag.get("is_prompt")
    }
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


async def test_an_agent_whose_rollout_spans_a_weight_update_finishes_and_its_rows_carry_two_versions(
    live: tuple[Any, Any],
) -> None:
    """Three calls: the first before the update, the second streaming when verl aborts the engines to update
    their weights (the proxy holds it and continues it under the new weights), the third after it."""
    import openai
    import transfer_queue as tq

    from aglverl.client import AgentClient
    from aglverl.trajectory.groups import Prompt

    run, trainer = live
    daemon, producer = run.daemon, run.daemon.producer
    before = producer.version
    producer.dispatch(
        [Prompt("span", {"prompt": "Say yes."}, 1, global_steps=2)], resources_id=run.resources["train"]
    )
    streaming, updated = anyio.Event(), anyio.Event()
    answers: list[str] = []

    async def agent() -> None:
        async with AgentClient(daemon.server_url) as client:
            task = await client.next_task(wait=10)
            assert task is not None
            llm = (await client.resources(task.resources_id)).resources["main_llm"]
            sdk = openai.AsyncOpenAI(
                base_url=llm.get_base_url(task.rollout_id, task.attempt_id), api_key="-", max_retries=0
            )
            messages = [{"role": "user", "content": "Say yes."}]
            first = await sdk.chat.completions.create(model=llm.model, messages=messages)
            answers.append(first.choices[0].finish_reason)
            parts = []
            # to the response length, never an early end of sequence: the stream must still be generating when the
            # update aborts the engine (a short answer can end before it: a race this test must not run)
            async for chunk in await sdk.chat.completions.create(
                model=llm.model, messages=messages, stream=True, extra_body={"ignore_eos": True}
            ):
                streaming.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    answers.append(chunk.choices[0].finish_reason)
                parts.append(chunk)
            await updated.wait()
            third = await sdk.chat.completions.create(model=llm.model, messages=messages)
            answers.append(third.choices[0].finish_reason)
            await sdk.close()
            await client.post_rollout(
                Rollout(rollout_id=task.rollout_id, attempt_id=task.attempt_id, final_reward=1.0)
            )

    async def update() -> None:
        await streaming.wait()
        trainer.global_steps = 2
        await anyio.to_thread.run_sync(trainer.on_step_begin)
        await anyio.to_thread.run_sync(trainer.on_sample_end)  # hold, abort, sleep
        await anyio.to_thread.run_sync(trainer.on_step_end)  # weights of step 2, generation resumed
        updated.set()

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            tg.start_soon(agent)
            tg.start_soon(update)
        await producer.wait_changed(before, 1)
        await producer.flush()
    assert len(answers) == 3 and set(answers) <= {"length", "stop"}  # the agent never saw an abort
    assert answers[1] == "length"  # the streamed call ran to the response length (ignore_eos)
    keys = [
        key
        for key, tag in (await anyio.to_thread.run_sync(tq.kv_list, "train")).get("train", {}).items()
        if key.startswith("span_")
    ]
    assert sorted(keys) == ["span_0_0", "span_0_1", "span_0_2"]
    data = await anyio.to_thread.run_sync(lambda: tq.kv_batch_get(keys=sorted(keys), partition_id="train"))
    versions = data["weight_version"].tolist()
    assert versions[0] == 0 and versions[2] == 2 and len(set(versions)) == 2  # generated under two versions
    tags = (await anyio.to_thread.run_sync(tq.kv_list, "train"))["train"]
    # the three calls are branches (the same messages each time): three rows, each over its own call's versions
    spans = {k: (tags[k]["min_global_steps"], tags[k]["max_global_steps"]) for k in keys}
    assert spans["span_0_0"] == (0, 0) and spans["span_0_2"] == (2, 2) and spans["span_0_1"][1] == 2
    assert daemon.proxy_counters()["proxy/held_calls"] + daemon.proxy_counters()["proxy/resumed"] >= 1
    await anyio.to_thread.run_sync(lambda: tq.kv_clear(keys=[*keys, "span"], partition_id="train"))
    producer.take_stats(["span"])


async def test_a_multi_turn_agents_chains_are_one_row_each_under_colocate_async(
    live: tuple[Any, Any],
) -> None:
    """Two agents chat two turns each through the proxy: each chain of calls is one TransferQueue row in verl's
    agent-loop layout, the ids between calls masked."""
    import transfer_queue as tq

    from aglverl.trajectory.groups import Prompt

    run, _ = live
    producer = run.daemon.producer
    before = producer.version
    producer.dispatch(
        [Prompt("chat", {"prompt": "Say yes."}, 2, global_steps=2)], resources_id=run.resources["train"]
    )
    with anyio.fail_after(120):
        seen = await multi_turn_agents(run, 2, 2)
        await producer.wait_changed(before, 1)
        await producer.flush()
    tags = (await anyio.to_thread.run_sync(tq.kv_list, "train")).get("train", {})
    keys = sorted(key for key in tags if key.startswith("chat_"))
    data = await anyio.to_thread.run_sync(lambda: tq.kv_batch_get(keys=keys, partition_id="train"))
    assert assert_rows_are_the_engines_chains(keys, data, seen) == 2 and len(keys) == 2  # a row per rollout
    assert all(tags[k]["seq_len"] == tags[k]["prompt_len"] + tags[k]["response_len"] for k in keys)
    await anyio.to_thread.run_sync(lambda: tq.kv_clear(keys=[*keys, "chat"], partition_id="train"))
    producer.take_stats(["chat"])


async def test_a_call_held_across_an_update_longer_than_the_old_limits_gets_its_answer_and_keeps_its_lease(
    live: tuple[Any, Any],
) -> None:
    """The update phase outlasts what a call could wait and what a lease lasted the old way (here shortened to
    1 s each); the held call waits for the trainer (up to aglverl.hold_timeout), and its lease did not run."""
    import openai

    from aglverl.client import AgentClient
    from aglverl.trajectory.groups import Prompt

    run, trainer = live
    daemon, producer = run.daemon, run.daemon.producer
    proxy, store = daemon.proxy, daemon.store
    assert proxy.config.hold_timeout == 4 * 3600.0  # AsyncVERL's default (aglverl.hold_timeout)
    old = (proxy.config.pause_timeout, store.lease_seconds)
    proxy.reconfigure(pause_timeout=1.0)
    store.reconfigure(lease_seconds=1.0)
    before = producer.version
    expired = store.meters.requeued.value("lease_expired") + store.meters.failed.value()
    producer.dispatch(
        [Prompt("held", {"prompt": "Say yes."}, 1, global_steps=3)], resources_id=run.resources["train"]
    )
    claimed, holding = anyio.Event(), anyio.Event()
    answers: list[str] = []
    try:

        async def agent() -> None:
            async with AgentClient(daemon.server_url) as client:
                task = await client.next_task(wait=10)
                assert task is not None
                claimed.set()
                await holding.wait()
                llm = (await client.resources(task.resources_id)).resources["main_llm"]
                sdk = openai.AsyncOpenAI(
                    base_url=llm.get_base_url(task.rollout_id, task.attempt_id), api_key="-", max_retries=0
                )
                answer = await sdk.chat.completions.create(
                    model=llm.model, messages=[{"role": "user", "content": "Say yes."}]
                )
                answers.append(answer.choices[0].finish_reason)
                await sdk.close()
                await client.post_rollout(
                    Rollout(rollout_id=task.rollout_id, attempt_id=task.attempt_id, final_reward=1.0)
                )

        async def update() -> None:
            await claimed.wait()
            trainer.global_steps = 3
            await anyio.to_thread.run_sync(trainer.on_step_begin)
            await anyio.to_thread.run_sync(trainer.on_sample_end)  # hold, abort, sleep
            holding.set()
            # the update phase (log-probs, actor, checkpoint save...) outlasting both old limits
            await anyio.sleep(3 * max(proxy.config.pause_timeout, store.lease_seconds))
            assert proxy.held and store.leases_frozen
            await anyio.to_thread.run_sync(trainer.on_step_end)  # weights of step 3, generation resumed
            assert not store.leases_frozen

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                tg.start_soon(agent)
                tg.start_soon(update)
            await producer.wait_changed(before, 1)
    finally:
        proxy.reconfigure(pause_timeout=old[0])
        store.reconfigure(lease_seconds=old[1])
    assert answers and answers[0] in {"length", "stop"}  # the agent got its answer, not a 503
    (stats,) = producer.take_stats(["held"])
    assert stats.n_completed == 1 and stats.n_rollouts == 1
    # the lease never expired
    assert store.meters.requeued.value("lease_expired") + store.meters.failed.value() == expired
    assert daemon.proxy_counters()["proxy/held_calls"] >= 1
