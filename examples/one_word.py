"""Teach a model to answer with one given word: the smallest complete aglverl training, on CPU or GPU.

    python examples/one_word.py                 # 25 GRPO steps of the tiny model on CPU (about 90 s)
    python examples/one_word.py --steps 5 --word no

The agent is ordinary ``openai`` SDK code pointed at the rollout's proxy URL; aglverl records the token ids of
every call and turns each finished rollout into training rows for verl's PPO trainer. ``aglverl demo`` runs
this same task with a progress bar and a reward plot.
"""

from __future__ import annotations

import argparse
import re

import anyio
import openai

from aglverl import LLM
from aglverl.algorithm import AsyncVERL


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--word", default="yes")
    parser.add_argument("--model", default="tiny", help="'tiny' (built locally) or a Hugging Face model path")
    args = parser.parse_args()

    tasks = [{"prompt": f"Answer with one word: {args.word}.", "word": args.word} for _ in range(64)]
    config = {
        "actor_rollout_ref": {
            "model": {"path": args.model},
            "rollout": {"n": 8},
            "actor": {"ppo_mini_batch_size": 16, "optim": {"lr": 5e-3}},
        },
        "data": {"train_batch_size": 16, "max_prompt_length": 64, "max_response_length": 8},
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"total_training_steps": args.steps, "val_before_train": False, "logger": ["console"]},
    }
    metrics = anyio.run(AsyncVERL(config, agent=agent).run, tasks)
    print(f"final training reward: {metrics['training/reward']:.3f}")


if __name__ == "__main__":
    main()
