"""A multi-turn agent with a tool: the model may call a calculator by a text protocol before it answers.

    python examples/calculator.py --steps 5

Each turn is one LLM call, and aglverl turns each call into one training row (triplet): the prompt the model
saw at that turn (the whole conversation so far, tool results included) and the tokens it generated. All turns
of a rollout share the rollout's final reward (1 for a correct answer). The protocol::

    model:  CALC: 12 * 7          ->  tool:  RESULT: 84
    model:  ANSWER: 84            ->  done

A tiny random model rarely follows it, so the agent nudges it and gives up after ``MAX_TURNS``; with a real
instruction model (``--model /path/to/Qwen2.5-0.5B-Instruct``, on a GPU) this is a classic tool-use task.
"""

from __future__ import annotations

import argparse
import ast
import operator
import random
import re

import anyio
import openai

from aglverl import LLM
from aglverl.algorithm import AsyncVERL
from aglverl.console import Console

MAX_TURNS = 3
SYSTEM = (
    "You can use a calculator. To compute, write one line 'CALC: <expression>' and you will get "
    "'RESULT: <value>'. When you know the answer, write 'ANSWER: <number>'."
)
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


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


CLIENT = openai.AsyncOpenAI(api_key="unused", max_retries=0)  # shared; each rollout sets its base URL


async def agent(task: dict, llm: LLM) -> float:
    """Up to MAX_TURNS calls; tool results go back as user turns; reward 1.0 for the right answer."""
    client = CLIENT.with_options(base_url=llm.endpoint)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}]
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model=llm.model, messages=messages, **llm.sampling_parameters)
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        if answer := re.search(r"ANSWER:\s*(-?[\d.]+)", text):
            return float(abs(float(answer.group(1)) - task["answer"]) < 1e-6)
        if call := re.search(r"CALC:\s*([^\n]+)", text):
            try:
                result = f"RESULT: {calculate(call.group(1)):g}"
            except ValueError as exc:
                result = f"RESULT: error ({exc})"
            messages.append({"role": "user", "content": result})
        else:
            messages.append({"role": "user", "content": "Use 'CALC: <expression>' or 'ANSWER: <number>'."})
    return 0.0


def questions(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        op = rng.choice("+-*")
        out.append({"question": f"What is {a} {op} {b}?", "answer": calculate(f"{a} {op} {b}")})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--out", default="calculator-out", help="directory for metrics.jsonl, train.log, reward.png")
    args = parser.parse_args()
    config = {
        "actor_rollout_ref": {
            "model": {"path": args.model},
            "rollout": {"n": 4},
            "actor": {"ppo_mini_batch_size": 8, "optim": {"lr": 1e-3}},
        },
        "data": {"train_batch_size": 8, "max_prompt_length": 512, "max_response_length": 16},
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"total_training_steps": args.steps, "val_before_train": False},
    }
    console = Console(args.out, title="calculator.py")
    summary = anyio.run(console.run, AsyncVERL(config, agent=agent), questions(64))
    metrics = summary["metrics"]
    print(console.describe(summary))
    print(f"final: reward {summary['final_reward']:.3f}, rows per rollout {metrics.get('step/n_rows', 0.0) / 32:.2f}")


if __name__ == "__main__":
    main()
