"""RolloutCollector over a real TaskStore: steps, GRPO groups, triplet sources, deadlines, the batch stream;
and, over real loopback HTTP (agents -> task server and proxy -> MockVLLM), the training-signal controls fed by
the reasons the store and the proxy record."""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import openai
import pytest
import torch

from aglverl import AgentDaemon, SignalConfig, run_agents
from aglverl.client import AgentClient, AgentFn
from aglverl.models import LLM, Rollout, Triplet
from aglverl.store import LLMCall, TaskStore
from aglverl.testing import MockVLLM, prompt_token_ids, token_logprob
from aglverl.trajectory.batch import BatchConfig
from aglverl.trajectory.steps import RolloutCollector, TrainingBatch

pytestmark = pytest.mark.anyio

CONFIG = BatchConfig(max_prompt_length=4, max_response_length=3, pad_token_id=0)


@pytest.fixture
async def running() -> AsyncIterator[tuple[TaskStore, RolloutCollector]]:
    store = TaskStore(lease_seconds=30, max_attempts=2)
    collector = RolloutCollector(store, batch=CONFIG)
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


# --- training-signal controls over loopback HTTP ---------------------------------------------------------

HTTP_BATCH = BatchConfig(max_prompt_length=64, max_response_length=6)
SHORT = [{"role": "user", "content": "hi"}]
#: A window with room for 20 tokens after SHORT: the mock model's 8-token answers fit, longer prompts do not.
WINDOW = len(prompt_token_ids({"messages": SHORT})[0]) + 20
LONGER = [{"role": "user", "content": "hi" + "x" * 15}]  # 5 tokens of room left


@asynccontextmanager
async def agents(daemon: AgentDaemon, fn: AgentFn, concurrency: int = 4) -> AsyncIterator[None]:
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(run_agents, daemon.server_url, fn, concurrency=concurrency))
        yield
        tg.cancel_scope.cancel()


async def next_batch(daemon: AgentDaemon) -> TrainingBatch:
    with anyio.fail_after(20):
        return await daemon.batches.receive()


async def chat(llm: LLM, messages: Any = SHORT, **kwargs: Any) -> Any:
    async with openai.AsyncOpenAI(base_url=llm.endpoint, api_key="-", max_retries=0) as client:
        return await client.chat.completions.create(model=llm.model, messages=messages, **kwargs)


@pytest.mark.parametrize("masked", [True, False], ids=["masked", "trained"])
async def test_agent_error_after_the_last_attempt_is_masked_or_trained_with_the_failure_reward(
    masked: bool,
) -> None:
    async def crashes(task_input: Any, llm: LLM) -> float:
        await chat(llm, max_tokens=16)
        raise RuntimeError("tool crashed")

    signal = SignalConfig(mask_agent_error=masked, failure_reward=-1.0)
    async with (
        MockVLLM() as mock,
        AgentDaemon(
            backends=[mock.url], model="mock", batch=HTTP_BATCH, max_attempts=1, signal=signal
        ) as daemon,
        agents(daemon, crashes),
    ):
        await daemon.submit([{"q": 0}])
        batch = await next_batch(daemon)
    m = batch.metrics
    assert (m["step/n_failed"], m["filter/n_agent_error"], m["filter/n_masked"]) == (1, 1, float(masked))
    if masked:
        assert len(batch.data) == 0  # delivered all the same, with its metrics
    else:
        assert batch.data.batch["token_level_scores"].sum(-1).tolist() == [-1.0]  # the recorded call's row
        assert m["filter/n_failed_trained"] == 1


async def test_lease_expiry_on_the_last_attempt_trains_its_recorded_calls_when_unmasked() -> None:
    async def vanishes(task_input: Any, llm: LLM) -> float:
        await chat(llm, max_tokens=16)
        await anyio.sleep_forever()  # never reports: the lease runs out
        raise AssertionError("unreachable")

    signal = SignalConfig(mask_lease_expired=False, failure_reward=-0.5)
    async with (
        MockVLLM() as mock,
        AgentDaemon(
            backends=[mock.url],
            model="mock",
            batch=HTTP_BATCH,
            lease_seconds=0.3,
            max_attempts=1,
            signal=signal,
        ) as daemon,
        agents(daemon, vanishes),
    ):
        await daemon.submit([{"q": 0}])
        batch = await next_batch(daemon)
    assert batch.metrics["filter/n_lease_expired"] == 1 and batch.metrics["filter/n_masked"] == 0
    assert batch.data.batch["token_level_scores"].sum(-1).tolist() == [-0.5]


async def test_step_timeout_is_masked_by_default_and_counted() -> None:
    async def hangs(task_input: Any, llm: LLM) -> float:
        await chat(llm, max_tokens=16)
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async with (
        MockVLLM() as mock,
        AgentDaemon(backends=[mock.url], model="mock", batch=HTTP_BATCH) as daemon,
        agents(daemon, hangs),
    ):
        await daemon.submit([{"q": 0}, {"q": 1}], deadline=0.3)
        batch = await next_batch(daemon)
    m = batch.metrics
    assert len(batch.data) == 0
    assert (
        m["step/n_timed_out"],
        m["filter/n_step_timeout"],
        m["filter/n_masked"],
        m["filter/n_rows_masked"],
    ) == (
        2,
        2,
        2,
        2,
    )


async def test_context_window_reasons_decided_by_the_proxy_mask_their_rollouts() -> None:
    async def agent(task_input: Any, llm: LLM) -> float:
        if task_input == "refused":  # prompt + max_tokens over the window: the backend answers 400
            with pytest.raises(openai.BadRequestError, match="maximum context length"):
                await chat(llm, LONGER, max_tokens=8)
            return 0.0
        if task_input == "filled":  # no max_tokens: the engine stops when the window is full
            reply = await chat(llm, LONGER)
            assert reply.choices[0].finish_reason == "length"
            return 0.0
        await chat(llm, max_tokens=16)  # the model ends by itself
        return 1.0

    signal = SignalConfig(mask_context_exceeded=True)
    async with (
        MockVLLM(max_model_len=WINDOW) as mock,
        AgentDaemon(backends=[mock.url], model="mock", batch=HTTP_BATCH, signal=signal) as daemon,
        agents(daemon, agent),
    ):
        await daemon.submit(["refused", "filled", "fine"])
        batch = await next_batch(daemon)
    assert batch.data.non_tensor_batch["rollout_id_list"].tolist() == [batch.report.rollout_ids[2]]
    assert batch.metrics["filter/n_context_exceeded"] == 2 and batch.metrics["filter/n_masked"] == 2
    assert batch.metrics["step/n_completed"] == 3


async def test_truncation_and_declared_max_turns_mask_their_rollouts() -> None:
    async def agent(client: AgentClient) -> None:
        while (task := await client.next_task(wait=5)) is not None:
            llm = await client.llm_for(task)
            reply = await chat(llm, max_tokens=4 if task.input == "cut" else 16)  # the model says 5 tokens
            rollout = Rollout(rollout_id=task.rollout_id, attempt_id=task.attempt_id, final_reward=1.0)
            if task.input == "long":  # its own triplet, 8 response ids: over max_response_length=6
                long = Triplet(prompt={"token_ids": [1]}, response={"token_ids": [2] * 8})
                rollout = rollout.model_copy(update={"triplets": [long]})
            elif task.input == "turns":
                rollout = rollout.model_copy(update={"metadata": {"termination_reason": "max_turns"}})
            assert reply.choices[0].finish_reason == ("length" if task.input == "cut" else "stop")
            await client.post_rollout(rollout)

    signal = SignalConfig(mask_truncated=True, mask_max_turns=True)
    async with (
        MockVLLM(completion_tokens=5) as mock,
        AgentDaemon(backends=[mock.url], model="mock", batch=HTTP_BATCH, signal=signal) as daemon,
        AgentClient(daemon.server_url) as client,
        anyio.create_task_group() as tg,
    ):
        step = await daemon.submit(["cut", "long", "turns", "fine"])
        tg.start_soon(agent, client)
        batch = await next_batch(daemon)
        tg.cancel_scope.cancel()
    assert batch.data.non_tensor_batch["rollout_id_list"].tolist() == [step.rollout_ids[3]]
    assert batch.metrics["filter/n_truncated"] == 2 and batch.metrics["filter/n_max_turns"] == 1
    assert batch.metrics["filter/n_masked"] == 3


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("request_logprobs", [True, False], ids=["asked", "not-asked"])
async def test_behaviour_logprobs_reach_the_batch_when_the_proxy_asks_for_them(
    request_logprobs: bool, stream: bool
) -> None:
    async def two_turns(task_input: Any, llm: LLM) -> float:
        messages = list(SHORT)
        for _ in range(2):
            reply = await chat(llm, messages, max_tokens=16, stream=stream)
            if stream:
                content = "".join([c.choices[0].delta.content or "" async for c in reply if c.choices])
            else:
                content = reply.choices[0].message.content or ""
            messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "again"}]
        return 1.0

    signal = SignalConfig(request_logprobs=request_logprobs)
    async with (
        MockVLLM(completion_tokens=4) as mock,
        AgentDaemon(backends=[mock.url], model="mock", batch=HTTP_BATCH, signal=signal) as daemon,
        agents(daemon, two_turns),
    ):
        await daemon.submit([{"q": 0}], n=2)
        batch = await next_batch(daemon)
    data, m = batch.data, batch.metrics
    assert len(data) == 4
    if not request_logprobs:
        assert "rollout_log_probs" not in data.batch.keys()
        assert (m["logprobs/present"], m["logprobs/n_rows_missing"]) == (0.0, 4.0)
        return
    mask = data.batch["response_mask"].bool()
    expected = torch.zeros(data.batch["responses"].shape)
    expected[mask] = torch.tensor([token_logprob(t) for t in data.batch["responses"][mask].tolist()])
    assert torch.equal(data.batch["rollout_log_probs"], expected)
    assert m["logprobs/present"] == 1.0


async def test_rejection_sampling_delivers_an_empty_batch_with_its_metrics() -> None:
    async def always_solves(task_input: Any, llm: LLM) -> float:
        await chat(llm, max_tokens=16)
        return 1.0

    async with (
        MockVLLM() as mock,
        AgentDaemon(
            backends=[mock.url], model="mock", batch=HTTP_BATCH, signal=SignalConfig(rejection_sampling=True)
        ) as daemon,
        agents(daemon, always_solves),
    ):
        await daemon.submit([{"q": 0}, {"q": 1}], n=2)
        batch = await next_batch(daemon)
    assert len(batch.data) == 0 and batch.metrics["batch/n_triplets"] == 0
    assert batch.metrics["rejection/solve_all_rate"] == 1.0 and batch.metrics["rejection/n_rows_dropped"] == 4
    assert batch.metrics["training/reward"] == 1.0
