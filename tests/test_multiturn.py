"""Merged trajectories end to end on loopback: a multi-turn agent (openai SDK) talks to the embedded inference
server over the proxy, with the tiny model's chat template rendering every call's history; the batch's rows hold
exactly the ids the engine generated, in call order, under ``response_mask`` 1."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest

from aglverl import LLM, AgentDaemon, BatchConfig, run_agents
from aglverl.engine.server import InferenceServer
from aglverl.trajectory.signals import SignalConfig

pytestmark = pytest.mark.anyio

BATCH = BatchConfig(max_prompt_length=256, max_response_length=256)
TURNS = 3
#: per rollout (from the per-rollout URL), each call's (prompt ids, response ids) as the proxy returned them
SEEN: dict[str, list[tuple[list[int], list[int]]]] = {}


async def tool_agent(task_input: dict[str, Any], llm: LLM) -> float:
    """Three calls, each one the previous history plus the model's answer plus a tool result."""
    rollout_id = llm.endpoint.split("/rollout/")[1].split("/")[0]
    seen = SEEN.setdefault(rollout_id, [])
    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key="unused", max_retries=0)
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You answer yes or no. Tools: lookup(x)."},
        {"role": "user", "content": f"question {task_input['q']}"},
    ]
    try:
        for turn in range(TURNS):
            reply = await client.chat.completions.create(
                model=llm.model,
                messages=messages,
                max_tokens=6,
                temperature=1.0,  # type: ignore[arg-type]
            )
            # the engine's ids, which the proxy asked for on the agent's behalf (vLLM's return_token_ids)
            seen.append((reply.model_extra["prompt_token_ids"], reply.choices[0].model_extra["token_ids"]))
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content or ""},
                {"role": "user", "content": f"tool result {turn}: 42"},
            ]
    finally:
        await client.close()
    return 1.0


@pytest.mark.parametrize("trajectory", ["merge", "per_call"])
async def test_a_multi_turn_agents_rows_hold_exactly_the_engines_ids_in_call_order(
    tiny_model: Path, trajectory: str
) -> None:
    signal = SignalConfig(trajectory=trajectory, request_logprobs=True)  # type: ignore[arg-type]
    async with (
        InferenceServer(tiny_model, served_model_name="tiny", seed=0) as engine,
        AgentDaemon(backends=[engine.url], model="tiny", batch=BATCH, signal=signal) as daemon,
    ):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run_agents(daemon.server_url, tool_agent, concurrency=4))
            step = await daemon.submit([{"q": 1}, {"q": 2}], n=2)
            with anyio.fail_after(120):
                batch = await daemon.batches.receive()
            tg.cancel_scope.cancel()
    calls = {rid: SEEN.pop(rid) for rid in step.rollout_ids}
    data, metrics = batch.data, batch.metrics
    assert all(len(c) == TURNS for c in calls.values())
    n_calls = TURNS * len(calls)
    assert metrics["batch/n_calls"] == n_calls
    responses, mask = data.batch["responses"], data.batch["response_mask"].bool()
    trained: dict[str, list[int]] = {}
    for i, rid in enumerate(data.non_tensor_batch["rollout_id_list"].tolist()):
        trained.setdefault(rid, []).extend(responses[i][mask[i]].tolist())
    for rid, recorded in calls.items():
        # the ids under the mask are the engine's, every call once, in the order the calls were made
        assert trained[rid] == [t for _, response in recorded for t in response]
    # Which calls drift, from the engine's own ids (not from the batch): call k + 1 extends call k when its
    # prompt begins with call k's prompt + response ids; otherwise the template re-rendered the answer (the
    # tiny random model's text does not always survive decode + encode), and only that may count as drift.
    drifted = 0
    for recorded in calls.values():
        for (prompt, response), (following, _) in itertools.pairwise(recorded):
            assert following[: len(prompt)] == prompt  # the history before an answer is never re-rendered
            drifted += following[: len(prompt) + len(response)] != prompt + response
    assert metrics["batch/n_calls_drifted"] == drifted
    if trajectory == "per_call":
        assert len(data) == n_calls and metrics["batch/n_calls_merged"] == 0
        assert data.batch["response_mask"].sum() == data.batch["attention_mask"][:, 256:].sum()
    else:
        # every call that did not drift continued its rollout's row
        assert metrics["batch/n_calls_merged"] == n_calls - len(calls) - drifted
        assert len(data) == len(calls) + drifted
        merged = metrics["batch/n_calls_merged"] > 0  # unless every later call drifted
        assert (metrics["batch/n_trainer_tokens"] < metrics["batch/n_trainer_tokens_per_call"]) == merged
        # a row is its last call's prompt + response: the ids between calls are exactly the next prompt's
        for i, rid in enumerate(data.non_tensor_batch["rollout_id_list"].tolist()):
            real = data.batch["attention_mask"][i].bool()
            row = data.batch["input_ids"][i][real].tolist()
            assert any(row == prompt + response for prompt, response in calls[rid])
        assert "rollout_log_probs" in data.batch.keys()
    assert metrics["logprobs/present"] == 1.0
