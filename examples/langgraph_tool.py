"""A LangGraph agent with a tool (langchain-openai's ChatOpenAI), trained with AsyncVERL.

    python examples/langgraph_tool.py                  # ChatOpenAI's default: chat completions (~3 min on CPU)
    python examples/langgraph_tool.py --api responses  # ChatOpenAI(use_responses_api=True)
    python examples/langgraph_tool.py --questions varied   # any product: for a real model (a GPU)

The graph is the usual tool loop: a model node whose ChatOpenAI has the tool bound, a ``ToolNode``, and
``tools_condition`` between them, with one change: the first model call must use the tool (``bind_tools(...,
tool_choice="multiply")``: the engine's constrained decoding makes the model write a well-formed call, each
operand one of the tool's 2-9), and later calls may (``auto``) or answer. Each rollout builds its ChatOpenAI on
the rollout's proxy URL; every model call of the run is recorded with its exact token ids (on either API), and
the calls of one run merge into one training row (token-in chat: the proxy generates each call from the
previous call's ids plus the new messages).

The reward is for the tool call: half a point per operand of the question the model passed to ``multiply``.
The built-in tiny model is random and cannot read the question yet: by default every question is "6 times 7",
so what it can learn within the 10 default steps is to call ``multiply(6, 7)``: the reward rises from ~0.25
past 0.6. ``--questions varied`` asks other products, which a real instruction model learns (``--model PATH``
on a GPU, with vLLM's tool parser for its family).
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Awaitable, Callable
from typing import Literal

import anyio
import httpx
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from aglverl import LLM
from aglverl.algorithm import AsyncVERL
from aglverl.cli.console import Console

Digit = Literal[2, 3, 4, 5, 6, 7, 8, 9]
#: Tokens a model call after the first may take (the forced tool call needs ~60 on the tiny model).
ANSWER_TOKENS = 16


#: How many times the tool ran (what the final line reports: the model really calls it).
TOOL_RUNS = 0


@tool
def multiply(a: Digit, b: Digit) -> int:
    """Multiply two numbers from 2 to 9."""
    global TOOL_RUNS
    TOOL_RUNS += 1
    return a * b


# One HTTP connection pool for every rollout's ChatOpenAI (a client of its own would cost ~26 ms of CPU each).
HTTP = httpx.AsyncClient(timeout=600)


def build_graph(first: ChatOpenAI, then: ChatOpenAI) -> CompiledStateGraph:
    """first (must call multiply) -> tools -> then (tool calls?) -> tools -> then ... -> end."""
    forced = first.bind_tools([multiply], tool_choice="multiply")
    bound = then.bind_tools([multiply])

    async def call_first(state: MessagesState) -> dict:
        return {"messages": [await forced.ainvoke(state["messages"])]}

    async def call_model(state: MessagesState) -> dict:
        return {"messages": [await bound.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("first", call_first)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode([multiply]))
    graph.add_edge(START, "first")
    graph.add_conditional_edges("first", tools_condition)
    graph.add_edge("tools", "model")
    graph.add_conditional_edges("model", tools_condition)
    return graph.compile()


def tool_reward(messages: list, a: int, b: int) -> float:
    """Half a point per operand of ``a * b`` the first ``multiply`` call passed (in either order)."""
    for message in messages:
        if isinstance(message, AIMessage) and message.tool_calls:
            args = message.tool_calls[0]["args"]
            passed = [args.get("a"), args.get("b")]
            return sum(0.5 for wanted in {a, b} if wanted in passed) if a != b else 0.5 * passed.count(a)
    return 0.0


def make_agent(use_responses_api: bool) -> Callable[[dict, LLM], Awaitable[float]]:
    """The agent function, on the Responses API or on chat completions."""

    async def agent(task: dict, llm: LLM) -> float:
        """One rollout: the graph's run through this rollout's proxy URL; its reward (:func:`tool_reward`)."""
        params = llm.sampling_parameters  # temperature, top_p, max_tokens from the trainer's config

        def chat(max_tokens: int) -> ChatOpenAI:
            return ChatOpenAI(
                model=llm.model,
                base_url=llm.endpoint,
                api_key="unused",
                max_retries=0,
                http_async_client=HTTP,
                use_responses_api=use_responses_api,
                temperature=params.get("temperature"),
                top_p=params.get("top_p"),
                max_tokens=max_tokens,
            )

        graph = build_graph(chat(params["max_tokens"]), chat(min(params["max_tokens"], ANSWER_TOKENS)))
        question = f"What is {task['a']} times {task['b']}? Use the multiply tool."
        try:
            state = await graph.ainvoke({"messages": [HumanMessage(question)]}, {"recursion_limit": 6})
        except GraphRecursionError:  # the model kept calling tools
            return 0.0
        return tool_reward(state["messages"], task["a"], task["b"])

    return agent


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--api", choices=["chat", "responses"], default="chat")
    parser.add_argument("--questions", choices=["six-seven", "varied"], default="six-seven")
    parser.add_argument("--model", default="tiny", help="'tiny' (built locally) or a Hugging Face model path")
    parser.add_argument(
        "--out", default="langgraph_tool-out", help="directory for metrics.jsonl, train.log, reward.png"
    )
    args = parser.parse_args()
    rng = random.Random(0)
    if args.questions == "varied":
        tasks = [{"a": rng.randint(2, 9), "b": rng.randint(2, 9)} for _ in range(64)]
    else:
        tasks = [{"a": 6, "b": 7}] * 64
    config = {
        "actor_rollout_ref": {
            "model": {"path": args.model},
            "rollout": {"n": 8},
            "actor": {"ppo_mini_batch_size": 8, "optim": {"lr": 5e-3}},
        },
        # the tool's JSON schema in the system turn makes prompts ~550 tokens; a tool call is ~60, and a run's
        # calls merge into one row (its response: the calls and the tool results between them)
        "data": {"train_batch_size": 8, "max_prompt_length": 1024, "max_response_length": 192},
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"total_training_steps": args.steps, "val_before_train": False},
    }
    console = Console(args.out, title=f"langgraph_tool.py ({args.api}): multiply")
    summary = anyio.run(console.run, AsyncVERL(config, agent=make_agent(args.api == "responses")), tasks)
    metrics = summary["metrics"]
    rollouts = metrics.get("step/n_rollouts", 0.0) or 1.0
    print(console.describe(summary))
    print(
        f"final: reward {summary['final_reward']:.3f}, rows per rollout {metrics.get('step/n_rows', 0.0) / rollouts:.2f}, "
        f"calls per rollout {metrics.get('batch/n_calls', 0.0) / rollouts:.2f}, tool runs {TOOL_RUNS}"
    )


if __name__ == "__main__":
    main()
