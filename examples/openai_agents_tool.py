"""An openai-agents SDK agent with its defaults (the Responses API) and a function tool, trained with AsyncVERL.

    python examples/openai_agents_tool.py --steps 5

The agent is written as for OpenAI: an ``agents.Agent`` with a ``@function_tool``, run by ``Runner.run``, which
speaks the Responses API. Only the client changes: each rollout gives the SDK an ``openai`` client whose base URL
is the rollout's proxy URL. The proxy translates every Responses call into a chat completion toward the
inference server, records its exact token ids, and answers in the Responses API (a tool call the backend's
tool parser found comes back as a ``function_call`` item, the tool's output goes back as a ``tool`` message):
each model call of the run becomes a training row with the run's reward.

The built-in tiny model is random, so it neither calls the tool nor names a capital; most answers are cut at
``max_tokens``, which the SDK reports as an incomplete response (``ModelBehaviorError``): such a run scores 0,
a run the model finished scores 0.1, a right answer 1. Its rows still train. With a real instruction model
served by vLLM with tool calling on (``--enable-auto-tool-choice --tool-call-parser hermes`` for Qwen2.5), the
model calls ``capital_of`` and the reward measures tool use; pass ``--model /path/to/model`` on a GPU machine.
"""

from __future__ import annotations

import argparse

import anyio
import openai
from agents import Agent, ModelSettings, RunConfig, Runner, function_tool, set_tracing_disabled
from agents.exceptions import AgentsException
from agents.models.openai_provider import OpenAIProvider

from aglverl import LLM
from aglverl.algorithm import AsyncVERL
from aglverl.console import Console

set_tracing_disabled(True)  # the SDK would otherwise send its traces to OpenAI

CAPITALS = {"france": "Paris", "japan": "Tokyo", "kenya": "Nairobi", "peru": "Lima", "canada": "Ottawa"}


@function_tool
def capital_of(country: str) -> str:
    """The capital city of a country."""
    return CAPITALS.get(country.strip().lower(), "unknown")


AGENT = Agent(
    name="geographer",
    instructions="Find the capital with the capital_of tool, then answer with the city's name only.",
    tools=[capital_of],
)
# One client for every rollout: each rollout only changes the base URL (a new client costs ~26 ms of CPU).
CLIENT = openai.AsyncOpenAI(api_key="unused", max_retries=0)


async def agent(task: dict, llm: LLM) -> float:
    """One rollout: the agent's whole run through this rollout's proxy URL; its reward."""
    params = llm.sampling_parameters  # temperature, top_p, max_tokens from the trainer's config
    config = RunConfig(
        model=llm.model,
        model_provider=OpenAIProvider(openai_client=CLIENT.with_options(base_url=llm.endpoint)),
        model_settings=ModelSettings(
            temperature=params.get("temperature"), top_p=params.get("top_p"), max_tokens=params.get("max_tokens")
        ),
    )
    try:
        result = await Runner.run(AGENT, f"What is the capital of {task['country']}?", run_config=config, max_turns=3)
    except AgentsException:  # an answer cut at max_tokens (incomplete), or too many turns
        return 0.0
    return 1.0 if task["capital"].lower() in str(result.final_output).lower() else 0.1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--model", default="tiny", help="'tiny' (built locally) or a Hugging Face model path")
    parser.add_argument("--out", default="openai_agents_tool-out", help="directory for metrics.jsonl, train.log, reward.png")
    args = parser.parse_args()
    tasks = [{"country": country.title(), "capital": capital} for country, capital in CAPITALS.items()] * 8
    config = {
        "actor_rollout_ref": {
            "model": {"path": args.model},
            "rollout": {"n": 4},
            "actor": {"ppo_mini_batch_size": 8, "optim": {"lr": 1e-3}},
        },
        "data": {"train_batch_size": 8, "max_prompt_length": 256, "max_response_length": 16},
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"total_training_steps": args.steps, "val_before_train": False},
    }
    console = Console(args.out, title="openai_agents_tool.py")
    summary = anyio.run(console.run, AsyncVERL(config, agent=agent), tasks)
    print(console.describe(summary))
    print(f"final: reward {summary['final_reward']:.3f}, rows {summary['metrics'].get('step/n_rows', 0.0):.0f}")


if __name__ == "__main__":
    main()
