"""A LangGraph agent with a tool (langchain-openai's ChatOpenAI), trained with AsyncVERL.

    python examples/langgraph_tool.py --steps 5                  # ChatOpenAI's default: chat completions
    python examples/langgraph_tool.py --steps 5 --api responses  # ChatOpenAI(use_responses_api=True)

The graph is the usual tool loop: a model node whose ChatOpenAI has the tool bound, a ``ToolNode``, and
``tools_condition`` between them. Each rollout builds its ChatOpenAI on the rollout's proxy URL; every model call
of the run (the proxy records its exact token ids, on either API) becomes a training row with the run's reward.

The built-in tiny model is random: it never calls ``multiply`` and rarely answers right, so a finished answer
scores 0.1 and a right one 1 (the rows train either way). With a real instruction model served by vLLM with
tool calling on (``--enable-auto-tool-choice --tool-call-parser hermes`` for Qwen2.5), the model calls the tool
and the reward measures whether it used it well; pass ``--model /path/to/model`` on a GPU machine.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Awaitable, Callable

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
from aglverl.console import Console


@tool
def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    return a * b


# One HTTP connection pool for every rollout's ChatOpenAI (a client of its own would cost ~26 ms of CPU each).
HTTP = httpx.AsyncClient(timeout=600)


def build_graph(model: ChatOpenAI) -> CompiledStateGraph:
    """model -> (tool calls?) -> tools -> model ... -> end."""
    bound = model.bind_tools([multiply])

    async def call_model(state: MessagesState) -> dict:
        return {"messages": [await bound.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode([multiply]))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    return graph.compile()


def make_agent(use_responses_api: bool) -> Callable[[dict, LLM], Awaitable[float]]:
    """The agent function, on the Responses API or on chat completions."""

    async def agent(task: dict, llm: LLM) -> float:
        """One rollout: the graph's run through this rollout's proxy URL; its reward."""
        params = llm.sampling_parameters  # temperature, top_p, max_tokens from the trainer's config
        model = ChatOpenAI(
            model=llm.model,
            base_url=llm.endpoint,
            api_key="unused",
            max_retries=0,
            http_async_client=HTTP,
            use_responses_api=use_responses_api,
            temperature=params.get("temperature"),
            top_p=params.get("top_p"),
            max_tokens=params.get("max_tokens"),
        )
        question = f"What is {task['a']} times {task['b']}? Use the multiply tool."
        try:
            state = await build_graph(model).ainvoke(
                {"messages": [HumanMessage(question)]}, {"recursion_limit": 6}
            )
        except GraphRecursionError:  # the model kept calling tools
            return 0.0
        answer: AIMessage = state["messages"][-1]
        meta = answer.response_metadata
        if f"{task['a'] * task['b']:g}" in answer.text:
            return 1.0
        finished = meta.get("finish_reason") == "stop" or meta.get("status") == "completed"
        return 0.1 if finished else 0.0

    return agent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--api", choices=["chat", "responses"], default="chat")
    parser.add_argument("--model", default="tiny", help="'tiny' (built locally) or a Hugging Face model path")
    parser.add_argument("--out", default="langgraph_tool-out", help="directory for metrics.jsonl, train.log, reward.png")
    args = parser.parse_args()
    rng = random.Random(0)
    tasks = [{"a": rng.randint(2, 12), "b": rng.randint(2, 12)} for _ in range(64)]
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
    console = Console(args.out, title="langgraph_tool.py")
    summary = anyio.run(console.run, AsyncVERL(config, agent=make_agent(args.api == "responses")), tasks)
    print(console.describe(summary))
    print(f"final: reward {summary['final_reward']:.3f}, rows {summary['metrics'].get('step/n_rows', 0.0):.0f}")


if __name__ == "__main__":
    main()
