"""RolloutCollector over a real TaskStore: steps, GRPO groups, triplet sources, deadlines, the batch stream."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import anyio
import pytest
import torch

from aglverl.batch import BatchConfig
from aglverl.collector import RolloutCollector
from aglverl.models import Rollout, Triplet
from aglverl.store import LLMCall, TaskStore

pytestmark = pytest.mark.anyio

CONFIG = BatchConfig(max_prompt_length=4, max_response_length=3, pad_token_id=0)


@pytest.fixture
async def running() -> AsyncIterator[tuple[TaskStore, RolloutCollector]]:
    store = TaskStore(lease_seconds=30, max_attempts=2)
    collector = RolloutCollector(store, batch=CONFIG, max_buffered_batches=2)
    async with anyio.create_task_group() as tg:
        await tg.start(store.serve)
        await tg.start(collector.serve)
        yield store, collector
        tg.cancel_scope.cancel()


def _claim_all(store: TaskStore) -> dict[str, str]:
    attempts = {}
    while (task := store.try_claim()) is not None:
        attempts[task.rollout_id] = task.attempt_id or ""
    return attempts


def _triplet(prompt: list[int], response: list[int]) -> Triplet:
    return Triplet(prompt={"token_ids": prompt}, response={"token_ids": response})


async def test_each_sample_is_queued_n_times_under_one_group_id(running) -> None:
    store, collector = running
    step = await collector.submit([{"q": 1}, {"q": 2}], n=3)
    assert len(step.rollout_ids) == 6
    groups: dict[str, list] = {}
    for rid in step.rollout_ids:
        record = store.record(rid)
        groups.setdefault(record.metadata["data_id"], []).append(record.input)
    assert sorted(map(len, groups.values())) == [3, 3]
    assert sorted(inputs[0]["q"] for inputs in groups.values()) == [1, 2]
    assert all(len({str(i) for i in inputs}) == 1 for inputs in groups.values())


async def test_batch_reaches_the_stream_moments_after_the_last_result(running) -> None:
    store, collector = running
    step = await collector.submit([{"q": 1}], n=2)
    attempts = _claim_all(store)
    first, last = step.rollout_ids
    store.submit_result(Rollout(rollout_id=first, final_reward=1.0, triplets=[_triplet([1, 2], [3])]))
    await anyio.sleep(0.05)
    with pytest.raises(anyio.WouldBlock):
        collector.batches.receive_nowait()  # one rollout is still out: no batch yet
    posted_at = time.perf_counter()
    store.submit_result(
        Rollout(
            rollout_id=last, attempt_id=attempts[last], final_reward=0.0, triplets=[_triplet([4], [5, 6])]
        )
    )
    with anyio.fail_after(5):
        batch = await collector.batches.receive()
    turnaround = time.perf_counter() - posted_at
    assert turnaround < 0.5  # the old daemon slept 5 s between checks
    assert batch.step == step.number
    data = batch.data
    assert data.batch["responses"].tolist() == [[3, 0, 0], [5, 6, 0]]
    assert data.batch["token_level_scores"].tolist() == [[1.0, 0, 0], [0, 0.0, 0]]
    assert list(data.non_tensor_batch["rollout_id_list"]) == [first, last]
    assert len(set(data.non_tensor_batch["uid"])) == 1
    assert batch.metrics["step/n_completed"] == 2 and batch.metrics["step/n_failed"] == 0


async def test_recorded_calls_of_the_winning_attempt_become_triplets_in_call_order(running) -> None:
    store, collector = running
    step = await collector.submit(["multi-turn"], n=1)
    (rid,) = step.rollout_ids
    aid = _claim_all(store)[rid]
    calls = [
        LLMCall(rid, aid, seq, "chat/completions", "b", 0.0, prompt_token_ids=p, response_token_ids=r)
        for seq, p, r in [(7, [1, 2], [3]), (3, [9], [8, 7]), (5, [4], None)]
    ]
    store.record_calls(rid, aid, calls)
    store.submit_result(Rollout(rollout_id=rid, final_reward=0.5))
    with anyio.fail_after(5):
        batch = await collector.batches.receive()
    assert batch.data.batch["prompts"].tolist() == [[0, 0, 0, 9], [0, 0, 1, 2]]
    assert batch.data.batch["responses"].tolist() == [[8, 7, 0], [3, 0, 0]]
    assert list(batch.data.non_tensor_batch["turn_index_list"]) == [0, 1]
    assert batch.metrics["step/n_rollouts_with_proxy_triplets"] == 1
    assert batch.metrics["step/n_calls_unusable"] == 1  # the call that came back without ids


async def test_client_posted_triplets_win_over_recorded_calls(running) -> None:
    store, collector = running
    step = await collector.submit(["x"])
    (rid,) = step.rollout_ids
    aid = _claim_all(store)[rid]
    store.record_calls(
        rid, aid, [LLMCall(rid, aid, 1, "p", "b", 0.0, prompt_token_ids=[1], response_token_ids=[1])]
    )
    store.submit_result(Rollout(rollout_id=rid, final_reward=1.0, triplets=[_triplet([2, 2], [2])]))
    with anyio.fail_after(5):
        batch = await collector.batches.receive()
    assert batch.data.batch["prompts"].tolist() == [[0, 0, 2, 2]]
    assert batch.metrics["step/n_rollouts_with_client_triplets"] == 1


async def test_step_deadline_fails_unfinished_rollouts_and_counts_them(running) -> None:
    store, collector = running
    step = await collector.submit(["a", "b", "c"], deadline=0.2)
    _claim_all(store)
    store.submit_result(
        Rollout(rollout_id=step.rollout_ids[0], final_reward=1.0, triplets=[_triplet([1], [2])])
    )
    with anyio.fail_after(5):
        batch = await collector.batches.receive()
    m = batch.metrics
    assert (m["step/n_queued"], m["step/n_completed"], m["step/n_failed"], m["step/n_timed_out"]) == (
        3,
        1,
        2,
        2,
    )
    assert m["step/n_completed"] + m["step/n_failed"] == m["step/n_queued"]
    assert len(batch.data) == 1
    report = await step.wait()
    assert report.metrics["step/n_timed_out"] == 2


async def test_validation_step_returns_metrics_and_sends_no_batch(running) -> None:
    store, collector = running
    step = await collector.submit(["a", "b"], mode="val")
    _claim_all(store)
    store.submit_result(
        Rollout(
            rollout_id=step.rollout_ids[0],
            final_reward=1.0,
            triplets=[_triplet([1], [2, 3]), _triplet([1], [4])],
        )
    )
    store.submit_result(Rollout(rollout_id=step.rollout_ids[1], final_reward=None))
    with anyio.fail_after(5):
        report = await step.wait()
    m = report.metrics
    assert m["val/reward"] == 0.5  # the missing reward is filled with 0.0
    assert m["val/n_rollouts"] == 2 and m["val/n_rollouts_w_reward"] == 1
    assert m["val/turn_count"] == 2 and m["val/mean_response_length"] == 1.5
    with pytest.raises(anyio.WouldBlock):
        collector.batches.receive_nowait()


async def test_finished_steps_release_their_rollouts(running) -> None:
    store, collector = running
    step = await collector.submit(["a"])
    _claim_all(store)
    store.submit_result(
        Rollout(rollout_id=step.rollout_ids[0], final_reward=1.0, triplets=[_triplet([1], [2])])
    )
    with anyio.fail_after(5):
        await collector.batches.receive()
    assert store._entries == {}
    assert collector.steps == {}


async def test_empty_step_still_produces_a_batch(running) -> None:
    _, collector = running
    step = await collector.submit([])
    with anyio.fail_after(5):
        batch = await collector.batches.receive()
    assert batch.step == step.number and len(batch.data) == 0
    assert isinstance(batch.data.batch["input_ids"], torch.Tensor)
