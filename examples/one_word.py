"""Teach a model to answer with one given word: the smallest complete aglverl training, on CPU or GPU.

    python examples/one_word.py                 # 25 GRPO steps of the tiny model on CPU (~2 min)
    python examples/one_word.py --steps 5 --word no

The agent is ordinary ``openai`` SDK code pointed at the rollout's proxy URL; aglverl records the token ids of
every call and turns each finished rollout into training rows for verl's PPO trainer. The reward is the share
of the answer's words that are the word: the built-in tiny model (random weights) starts near 0.0 and passes
0.9 within the 25 default steps (16 prompts x 8 answers a step).

The console shows a progress bar (step, reward, generated tokens/s) and a last line with the final reward;
every step's metrics go to ``one_word-out/metrics.jsonl``, what verl and Ray print to
``one_word-out/train.log``, the reward curve to ``one_word-out/reward.png`` (``--out`` to change).
``aglverl demo`` runs this same task.
"""

from __future__ import annotations

import argparse
import re

import anyio
import openai

from aglverl import LLM
from aglverl.algorithm import AsyncVERL
from aglverl.cli.console import Console


def reward(answer: str, word: str) -> float:
    """The share of the answer's words that are ``word``."""
    words = re.findall(r"[a-z0-9']+", answer.lower())
    return sum(w == word for w in words) / len(words) if words else 0.0


# One client for every rollout: each rollout only changes the base URL (a new client costs ~26 ms of CPU).
CLIENT = openai.AsyncOpenAI(api_key="unused", max_retries=0)


async def agent(task: dict, llm: LLM) -> float:
    """One rollout: ask through this rollout's proxy URL, read the answer, return its reward."""
    reply = await CLIENT.with_options(base_url=llm.endpoint).chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": task["prompt"]}],
        **llm.sampling_parameters,  # temperature, top_p, max_tokens from the trainer's config
    )
    return reward(reply.choices[0].message.content or "", task["word"])


def make_tasks(word: str, count: int = 64) -> list[dict]:
    """The task inputs: a prompt asking for ``word``, and the word."""
    return [{"prompt": f"Answer with one word: {word}.", "word": word} for _ in range(count)]


def make_config(steps: int, model: str = "tiny") -> dict:
    """GRPO, 16 prompts x 8 answers a step (one actor update), answers of at most 8 tokens."""
    return {
        "actor_rollout_ref": {
            "model": {"path": model},
            "rollout": {"n": 8},
            "actor": {"ppo_mini_batch_size": 16, "optim": {"lr": 5e-3}},
        },
        "data": {"train_batch_size": 16, "max_prompt_length": 64, "max_response_length": 8},
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"total_training_steps": steps, "val_before_train": False},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--word", default="yes")
    parser.add_argument("--model", default="tiny", help="'tiny' (built locally) or a Hugging Face model path")
    parser.add_argument(
        "--out", default="one_word-out", help="directory for metrics.jsonl, train.log, reward.png"
    )
    args = parser.parse_args()

    console = Console(args.out, title=f"one_word.py: answer {args.word!r}")
    algo = AsyncVERL(make_config(args.steps, args.model), agent=agent)
    summary = anyio.run(console.run, algo, make_tasks(args.word))
    print(console.describe(summary))
    print(f"final training reward: {summary['final_reward']:.3f}")


if __name__ == "__main__":
    main()
