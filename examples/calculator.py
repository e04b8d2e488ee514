"""A multi-turn agent with a calculator tool (OpenAI function calling), trained with AsyncVERL.

    python examples/calculator.py                       # 20 GRPO steps of the tiny model on CPU (~6 min)
    python examples/calculator.py --questions varied    # any arithmetic: for a real model (a GPU)

The agent asks the model with ``tools=[calculate]`` and ``parallel_tool_calls: false`` (one calculation per
call); its first call insists on the tool (``tool_choice: "required"``: the engine's constrained decoding makes
the model write exactly one well-formed call whose ``expression`` matches the tool's schema), the agent runs the
tool and sends its result back as a ``tool`` message, and the model answers (``tool_choice: "auto"``; more tool
calls are run the same way, up to ``MAX_TURNS`` calls). The reward: 0.5 when a tool call computed the right
result, plus 0.5 times the share of the numbers in the final answer that are it.

Every call after the first re-sends the conversation as text (tool call and result included); aglverl's
proxy generates it from the exact token ids of the previous call plus the new messages (token-in chat), so a
rollout's calls merge into one training row: ``rows per rollout`` is printed, 1.00 when every conversation
merged.

The built-in tiny model is random and cannot read numbers yet: by default every question's answer is 12 (``3 *
4``, ``9 + 3``...), and the reward is half for a tool call worth the answer, half for an answer that is it, so
what it learns first, within the 20 default steps, is to write an expression worth 12: the reward rises from
~0.0 past 0.25 (0.48-0.50 at step 20 in three runs: nearly every tool call worth 12; answering with the tool's
result comes later). ``--questions varied`` asks random sums and products, which a real instruction model learns
(``--model PATH`` on a GPU; ``examples/train_gpu.py`` trains this agent on GSM8K).
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import random
import re
from typing import Any

import anyio
import openai

from aglverl import LLM
from aglverl.algorithm import AsyncVERL
from aglverl.cli.console import Console

#: Most LLM calls per rollout (the first one calls the tool, then each call may call it again or answer).
MAX_TURNS = 3
#: Tokens a call after the first may take: the answer is a number (the tool call needs ~55 on the tiny model).
ANSWER_TOKENS = 16
SYSTEM = "Use the calculate tool to compute, then reply with the resulting number only."


def tools(digits: int) -> list[dict[str, Any]]:
    """The calculator's OpenAI tool: ``calculate(expression)``, an expression of two numbers of at most
    ``digits`` digits (the schema's pattern, which the engine's constrained decoding follows)."""
    number = f"[0-9]{{1,{digits}}}"
    return [
        {
            "type": "function",
            "function": {
                "name": "calculate",
                "description": "Evaluate an arithmetic expression of two numbers, e.g. '3 * 4'.",
                "parameters": {
                    "type": "object",
                    "properties": {"expression": {"type": "string", "pattern": f"^{number} [-+*] {number}$"}},
                    "required": ["expression"],
                    "additionalProperties": False,
                },
            },
        }
    ]


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def calculate(expression: str) -> float:
    """Evaluate + - * / on numbers (no names, no calls); raises ValueError for anything else."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not arithmetic: {expression!r}")

    try:
        return value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ZeroDivisionError) as exc:
        raise ValueError(str(exc)) from exc


#: How many times the tool ran (what the final line reports: the model really calls it).
TOOL_RUNS = 0


def run_tool(arguments: str) -> tuple[str, float | None]:
    """The tool's answer to one call (its JSON arguments), as text for the model, and its value (``None``: an
    error, whose text the model gets instead)."""
    global TOOL_RUNS
    TOOL_RUNS += 1
    try:
        value = calculate(json.loads(arguments)["expression"])
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}", None
    return f"{value:g}", value


def score(answer: str, expected: float) -> float:
    """The share of the numbers in ``answer`` that are ``expected`` (0.0 when it has none)."""
    numbers = [float(n) for n in _NUMBER.findall(answer)]
    return sum(abs(n - expected) < 1e-6 for n in numbers) / len(numbers) if numbers else 0.0


CLIENT = openai.AsyncOpenAI(api_key="unused", max_retries=0)  # shared; each rollout sets its base URL


async def agent(task: dict, llm: LLM) -> float:
    """Tool first, then the answer (see the module docstring). The reward: half for a tool call that computed
    the right value, half for :func:`score` of the answer."""
    client = CLIENT.with_options(base_url=llm.endpoint)
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": task["question"]},
    ]
    expected = float(task["answer"])
    text, computed = "", False
    for turn in range(MAX_TURNS):
        params = dict(llm.sampling_parameters)  # the trainer's temperature, top_p, max_tokens
        if turn:
            params["max_tokens"] = min(params.get("max_tokens", ANSWER_TOKENS), ANSWER_TOKENS)
        reply = await client.chat.completions.create(
            model=llm.model,
            messages=messages,
            tools=tools(task.get("digits", 4)),
            tool_choice="required" if turn == 0 else "auto",
            parallel_tool_calls=False,  # one call: with more, a random model's forced call ran past max_tokens
            **params,
        )
        message = reply.choices[0].message
        text = message.content or ""
        messages.append(message.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio"}))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            result, value = run_tool(call.function.arguments)
            computed = computed or (value is not None and abs(value - expected) < 1e-6)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.5 * computed + 0.5 * score(text, expected)


#: Expressions whose value is 12: the default questions (see the module docstring).
TWELVE = ("3 * 4", "2 * 6", "6 + 6", "4 + 8", "9 + 3", "6 * 2", "4 * 3", "7 + 5")


def questions(count: int, kind: str = "twelve", seed: int = 0) -> list[dict]:
    """Task inputs ``{"question", "answer", "digits"}``: ``twelve`` (every answer 12, one-digit operands, so
    the tool takes one-digit numbers) or ``varied`` (random + - * of numbers up to 20)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        if kind == "twelve":
            expression = TWELVE[i % len(TWELVE)]
        else:
            expression = f"{rng.randint(2, 20)} {rng.choice('+-*')} {rng.randint(2, 20)}"
        digits = 1 if kind == "twelve" else 4
        out.append({"question": f"What is {expression}?", "answer": calculate(expression), "digits": digits})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", default="tiny", help="'tiny' (built locally) or a Hugging Face model path")
    parser.add_argument("--questions", choices=["twelve", "varied"], default="twelve")
    parser.add_argument(
        "--out", default="calculator-out", help="directory for metrics.jsonl, train.log, reward.png"
    )
    args = parser.parse_args()
    config = {
        "actor_rollout_ref": {
            "model": {"path": args.model},
            "rollout": {"n": 8},
            "actor": {"ppo_mini_batch_size": 8, "optim": {"lr": 5e-3}},
        },
        # the tool's JSON schema in the system turn makes prompts ~500 tokens; a call is ~55 tokens, an answer
        # a few, and a conversation's calls merge into one row (its response: calls and the messages between)
        "data": {"train_batch_size": 8, "max_prompt_length": 1024, "max_response_length": 128},
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"total_training_steps": args.steps, "val_before_train": False},
    }
    console = Console(args.out, title="calculator.py: tool, then the answer")
    summary = anyio.run(console.run, AsyncVERL(config, agent=agent), questions(64, args.questions))
    metrics = summary["metrics"]
    rollouts = metrics.get("step/n_rollouts", 0.0) or 1.0
    print(console.describe(summary))
    print(
        f"final: reward {summary['final_reward']:.3f}, rows per rollout {metrics.get('step/n_rows', 0.0) / rollouts:.2f}, "
        f"calls per rollout {metrics.get('batch/n_calls', 0.0) / rollouts:.2f}, tool runs {TOOL_RUNS}"
    )


if __name__ == "__main__":
    main()
