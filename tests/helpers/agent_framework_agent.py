"""An agent written with Microsoft Agent Framework the way its lab sample ``train_math_agent.py`` writes one: an
``Agent`` on ``OpenAIChatClient`` (the Responses API client) built from the rollout's ``llm.model`` and
``llm.endpoint`` with a dummy key, its instructions and the trainer's temperature, one function tool, ``store``
left to its default. The one change: ``tool_choice="required"`` on the run, so that a model that only calls a tool
when it must (the tests' mock backend) calls it first; Agent Framework drops ``required`` once the tool has run and
lets the model answer, continuing its first response with ``previous_response_id`` and sending only the tool's
result. The tool takes ``value``, the argument the mock's tool calls carry.

Runs in the Python of a venv where agent-framework is installed beside aglverl (``helpers.overlay``):

- ``python agent_framework_agent.py serve SERVER_URL --tasks N``: aglverl's agent loop (``run_agents``) on the
  task server until ``N`` tasks are done, as a trained agent runs;
- ``python agent_framework_agent.py run --model M ENDPOINT...``: one run per endpoint (a proxy attempt's
  ``.../v1``), at once, as the sample's ``--debug`` runs its agent on one task.

Each run prints one JSON line: the question, the kinds of the contents of the agent's messages, and the last
Responses API answer as the client got it (its ``id``, ``previous_response_id`` and ``store``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from typing import Any

from agent_framework import Agent, AgentResponse, tool
from agent_framework.openai import OpenAIChatClient

from aglverl import LLM, run_agents

INSTRUCTIONS = "Look the value up with the lookup tool, then give the answer after three sharps (###)."


@tool
def lookup(value: str) -> str:
    """Look a value up."""
    return f"{value} is 42"


async def math_agent(task: dict[str, Any], llm: LLM) -> float:
    """One rollout: the agent answers the task's question; the reward is 1 when it used its tool and answered."""
    async with Agent(
        client=OpenAIChatClient(
            model=llm.model,
            api_key=os.getenv("OPENAI_API_KEY") or "dummy",
            base_url=llm.endpoint,
        ),
        name="MathAgent",
        instructions=INSTRUCTIONS,
        default_options={"temperature": llm.sampling_parameters.get("temperature", 0.0)},
    ) as agent:
        result = await agent.run(task["question"], tools=lookup, options={"tool_choice": "required"})
    contents = [[c.type for c in m.contents] for m in result.messages]
    print(json.dumps({"question": task["question"], "contents": contents, "answer": _last_answer(result)}))
    return float(["function_result"] in contents and bool(result.text))


def _last_answer(result: AgentResponse) -> dict[str, Any]:
    """The last Responses API answer of the run (the OpenAI SDK's ``Response`` under Agent Framework's wrappers)."""
    raw = result.raw_representation
    while raw is not None and not hasattr(raw, "previous_response_id"):
        raw = getattr(raw, "raw_representation", None)
    if raw is None:
        raise RuntimeError(f"no Responses API answer under {result.raw_representation!r}")
    return {"id": raw.id, "previous_response_id": raw.previous_response_id, "store": raw.store}


async def _run(model: str, endpoints: list[str]) -> None:
    tasks = [{"question": f"What is {i} + 42?"} for i in range(len(endpoints))]
    await asyncio.gather(
        *(math_agent(t, LLM(endpoint=e, model=model)) for t, e in zip(tasks, endpoints, strict=True))
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    modes = parser.add_subparsers(dest="mode", required=True)
    serve = modes.add_parser("serve")
    serve.add_argument("server_url")
    serve.add_argument("--tasks", type=int, required=True)
    run = modes.add_parser("run")
    run.add_argument("--model", required=True)
    run.add_argument("endpoints", nargs="+")
    args = parser.parse_args()
    if args.mode == "serve":
        asyncio.run(run_agents(args.server_url, math_agent, concurrency=args.tasks, max_tasks=args.tasks))
    else:
        asyncio.run(_run(args.model, args.endpoints))


if __name__ == "__main__":
    main()
