"""An openai-agents SDK agent with its defaults (the Responses API) and a function tool, trained with AsyncVERL.

    python examples/openai_agents_tool.py                      # 10 GRPO steps of the tiny model on CPU (~4 min)
    python examples/openai_agents_tool.py --countries all      # five countries: for a real model (a GPU)

The agent is written as for OpenAI: an ``agents.Agent`` with a ``@function_tool``, run by ``Runner.run``, which
speaks the Responses API. Only the client changes: each rollout gives the SDK an ``openai`` client whose base URL
is the rollout's proxy URL. The proxy translates every Responses call into a chat completion toward the
inference server, records its exact token ids, and answers in the Responses API: the tool call the engine
parsed (vLLM's ``hermes`` format on the built-in tiny model) comes back as a ``function_call`` item.

The agent must use its tool (``ModelSettings(tool_choice="required")``: the engine's constrained decoding makes
the model write a well-formed call, its ``country`` one of the tool's five), and the tool's answer is the
agent's (``tool_use_behavior="stop_on_first_tool"``, the SDK's option for lookup tools). The reward is 1 when
that is the capital of the country asked about.

The built-in tiny model is random and cannot read the question yet: by default every question is about France,
so what it can learn within the 10 default steps is to call the tool with ``France``: the reward rises from
~0.2 (a random pick of five) past 0.6 (0.97 at step 10 in one run). ``--countries all`` asks about five countries, which a real instruction
model learns (``--model PATH`` on a GPU, with vLLM's tool parser for its family).
"""

from __future__ import annotations

import argparse
from typing import Literal

import anyio
import openai
from agents import Agent, ModelSettings, RunConfig, Runner, function_tool, set_tracing_disabled
from agents.models.openai_provider import OpenAIProvider

from aglverl import LLM
from aglverl.algorithm import AsyncVERL
from aglverl.cli.console import Console

set_tracing_disabled(True)  # the SDK would otherwise send its traces to OpenAI

CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Kenya": "Nairobi", "Peru": "Lima", "Canada": "Ottawa"}
Country = Literal["France", "Japan", "Kenya", "Peru", "Canada"]


#: How many times the tool ran (what the final line reports: the model really calls it).
TOOL_RUNS = 0


@function_tool
def capital_of(country: Country) -> str:
    """The capital city of a country."""
    global TOOL_RUNS
    TOOL_RUNS += 1
    return CAPITALS[country]


AGENT = Agent(
    name="geographer",
    instructions="Answer with the capital_of tool.",
    tools=[capital_of],
    model_settings=ModelSettings(tool_choice="required"),
    tool_use_behavior="stop_on_first_tool",
)
# One client for every rollout: each rollout only changes the base URL (a new client costs ~26 ms of CPU).
CLIENT = openai.AsyncOpenAI(api_key="unused", max_retries=0)


async def agent(task: dict, llm: LLM) -> float:
    """One rollout: the agent's whole run through this rollout's proxy URL; 1.0 for the right capital.

    An answer the engine cut at ``max_tokens`` before the call was complete is an incomplete response, which
    the SDK raises (``ModelBehaviorError``): the rollout fails with it and is kept out of the batch.
    """
    params = llm.sampling_parameters  # temperature, top_p, max_tokens from the trainer's config
    config = RunConfig(
        model=llm.model,
        model_provider=OpenAIProvider(openai_client=CLIENT.with_options(base_url=llm.endpoint)),
        model_settings=ModelSettings(
            temperature=params.get("temperature"),
            top_p=params.get("top_p"),
            max_tokens=params.get("max_tokens"),
        ),
    )
    result = await Runner.run(
        AGENT, f"What is the capital of {task['country']}?", run_config=config, max_turns=2
    )
    return 1.0 if str(result.final_output) == CAPITALS[task["country"]] else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--countries", choices=["France", "all"], default="France", help="what the questions ask"
    )
    parser.add_argument("--model", default="tiny", help="'tiny' (built locally) or a Hugging Face model path")
    parser.add_argument(
        "--out", default="openai_agents_tool-out", help="directory for metrics.jsonl, train.log, reward.png"
    )
    args = parser.parse_args()
    countries = list(CAPITALS) if args.countries == "all" else [args.countries]
    tasks = [{"country": country} for country in countries] * (64 // len(countries))
    config = {
        "actor_rollout_ref": {
            "model": {"path": args.model},
            "rollout": {"n": 8},
            "actor": {"ppo_mini_batch_size": 8, "optim": {"lr": 2e-3}},
        },
        # the tool's JSON schema in the system turn makes prompts ~560 tokens; a call is ~65 (at most 128)
        "data": {"train_batch_size": 8, "max_prompt_length": 1024, "max_response_length": 128},
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"total_training_steps": args.steps, "val_before_train": False},
    }
    console = Console(args.out, title="openai_agents_tool.py: capital_of")
    summary = anyio.run(console.run, AsyncVERL(config, agent=agent), tasks)
    metrics = summary["metrics"]
    print(console.describe(summary))
    print(
        f"final: reward {summary['final_reward']:.3f}, rows {metrics.get('step/n_rows', 0.0):.0f}, "
        f"failed rollouts {metrics.get('step/n_failed', 0.0):.0f}, tool runs {TOOL_RUNS}"
    )


if __name__ == "__main__":
    main()
