"""An Agent Lightning 0.3 program whose agent is built with the openai-agents SDK on the Responses API, as OpenAI's
docs write one: a calculator tool, the run's turns chained by ``previous_response_id``
(``auto_previous_response_id``), and a follow-up question continuing the conversation from the run's last
response (``previous_response_id=result.last_response_id``). Written for ``agl.VERL`` and a GPU cluster
(``rollout.name: vllm``), as microsoft/agent-framework's math sample is.

    make venv-agl03
    .venv-agl03/bin/aglverl fit --rollout embedded examples/agl03/openai_agents_calculator.py fast
    .venv-agl03/bin/aglverl fit examples/agl03/openai_agents_calculator.py qwen        # with GPUs

The Responses API keeps each response (``store`` is true unless the caller says otherwise) so that a later call
can continue it by id, sending only what is new (a tool's output, the next question); aglverl's proxy keeps them
per rollout attempt, and a continued conversation trains as one sequence. The agent must call its tool first
(``tool_choice="required"``, one call at a time: the engine's constrained decoding makes even the built-in tiny
model write a well-formed call, its arguments among the tool's; the SDK then lets the model answer), and the
reward is 1 when its last answer holds the result (an answer cut at ``max_tokens`` is an incomplete response,
which the SDK raises: it scores 0). On this machine (``--rollout embedded``: the built-in tiny model, random
weights) the reward stays near 0; the ``fast`` config trains 2 steps. The questions are made at start.
"""

from __future__ import annotations

import argparse
import operator
import random
import re
from copy import deepcopy
from typing import Any, Literal

import agentlightning as agl
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
from openai import AsyncOpenAI

# The SDK would send its own traces to OpenAI; Agent Lightning's tracer records the calls.
set_tracing_disabled(True)

Digit = Literal[2, 3, 4, 5, 6, 7, 8, 9]
Operation = Literal["+", "-", "*"]
_OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@function_tool
def calculate(a: Digit, operation: Operation, b: Digit) -> str:
    """Apply an arithmetic operation to two numbers."""
    return str(_OPERATIONS[operation](a, b))


def make_questions(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, op = rng.randint(2, 9), rng.randint(2, 9), rng.choice(sorted(_OPERATIONS))
        rows.append({"question": f"What is {a} {op} {b}?", "answer": _OPERATIONS[op](a, b)})
    return rows


@agl.rollout
async def calculator_agent(task: dict[str, Any], llm: agl.LLM) -> float:
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "unused", max_retries=0)
    agent = Agent(
        name="calculator",
        instructions="Compute the answer with the calculate tool, then state it.",
        tools=[calculate],
        model=OpenAIResponsesModel(model=llm.model, openai_client=client),
        model_settings=ModelSettings(
            tool_choice="required",
            parallel_tool_calls=False,  # one call, then the answer
            temperature=llm.sampling_parameters.get("temperature"),
            max_tokens=llm.sampling_parameters.get("max_tokens"),
        ),
    )
    try:
        first = await Runner.run(agent, task["question"], max_turns=4, auto_previous_response_id=True)
        follow_up = await Runner.run(
            agent, "Give only the final number.", previous_response_id=first.last_response_id, max_turns=4
        )
    except (MaxTurnsExceeded, ModelBehaviorError):  # no answer within its turns, or one cut at max_tokens
        return 0.0
    finally:
        await client.close()
    numbers = re.findall(r"-?\d+", str(follow_up.final_output))
    return 1.0 if numbers and int(numbers[-1]) == task["answer"] else 0.0


CONFIG: dict[str, Any] = {
    "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
    "data": {"train_batch_size": 32, "max_prompt_length": 2048, "max_response_length": 1024},
    # agl.VERL's trajectory aggregation: each conversation one row of these widths, each call bounded by data's
    "agentlightning": {
        "trace_aggregator": {
            "level": "trajectory",
            "trajectory_max_prompt_length": 4096,
            "trajectory_max_response_length": 8192,
        }
    },
    "actor_rollout_ref": {
        "rollout": {
            "name": "vllm",
            "n": 4,
            "gpu_memory_utilization": 0.7,
            "multi_turn": {"format": "hermes"},
        },
        "actor": {"ppo_mini_batch_size": 32, "optim": {"lr": 1e-6}, "use_kl_loss": False, "entropy_coeff": 0},
        "model": {"path": "Qwen/Qwen2.5-1.5B-Instruct"},
    },
    "trainer": {
        "n_gpus_per_node": 1,
        "val_before_train": True,
        "logger": ["console"],
        "project_name": "AgentLightning",
        "experiment_name": "openai_agents_calculator",
        "test_freq": 16,
        "total_epochs": 2,
        "save_freq": -1,
    },
}


def config_fast() -> dict[str, Any]:
    """Fitted to a CPU and the built-in tiny model: 2 steps of 2 questions x 2 rollouts, short answers."""
    config = deepcopy(CONFIG)
    config["data"].update(train_batch_size=2, max_prompt_length=1024, max_response_length=96)
    config["agentlightning"]["trace_aggregator"].update(
        trajectory_max_prompt_length=1024, trajectory_max_response_length=256
    )
    config["actor_rollout_ref"]["rollout"]["n"] = 2
    config["actor_rollout_ref"]["actor"].update(ppo_mini_batch_size=2, optim={"lr": 1e-3})
    config["actor_rollout_ref"]["model"] = {"path": "tiny"}
    config["trainer"].update(val_before_train=False, test_freq=-1, total_training_steps=2)
    return config


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", choices=["fast", "qwen"])
    parser.add_argument("--runners", type=int, default=2)
    args = parser.parse_args()

    questions = make_questions(64)
    algorithm = agl.VERL(config_fast() if args.config == "fast" else deepcopy(CONFIG))
    trainer = agl.Trainer(n_runners=args.runners, algorithm=algorithm)
    trainer.fit(calculator_agent, train_dataset=questions[:56], val_dataset=questions[56:])
    metrics = getattr(algorithm, "metrics", {})  # aglverl's VERL keeps the last step's metrics
    print(
        f"final training reward: {metrics.get('training/reward', float('nan')):.3f}, "
        f"rollouts failed: {metrics.get('step/n_failed', 0):.0f}, rows: {metrics.get('step/n_rows', 0):.0f}, "
        f"calls continuing a conversation: {metrics.get('batch/n_calls_merged', 0):.0f}"
    )


if __name__ == "__main__":
    main()
