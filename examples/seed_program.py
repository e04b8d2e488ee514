"""Agent Lightning 0.2/0.3's ``agl.VERL`` program, as its docs write it, with one line changed: the import of VERL.

    make venv-agl03                                        # aglverl + agentlightning==0.3.0, once
    .venv-agl03/bin/python examples/seed_program.py        # 25 GRPO steps of the tiny model on CPU
    .venv-agl03/bin/python examples/seed_program.py --steps 5 --runners 4

The agent is the docs' ``@agl.rollout`` function: it gets ``llm`` (this rollout's ``main_llm``, already at its
own URL), asks the model with the ``openai`` SDK and returns its reward, the share of the answer's words that
are the task's word. Agent Lightning's ``Trainer`` runs it in ``--runners`` forked runner processes against its
own store; aglverl's ``VERL`` trains with verl's V1 trainer, and its proxy records the token ids of every call.
The built-in tiny model (random weights) starts near reward 0.0 and passes 0.8 within the 25 default steps
(``val/reward``, validated at temperature 0 before training and every 5 steps, follows).

Without the changed line, ``.venv-agl03/bin/aglverl fit examples/seed_program.py`` trains the same program.
"""

from __future__ import annotations

import argparse
import logging
import re

import agentlightning as agl
import openai

from aglverl.agent_lightning import VERL  # the one line: was `from agentlightning.algorithm.verl import VERL`


def reward(answer: str, word: str) -> float:
    """The share of the answer's words that are ``word``."""
    words = re.findall(r"[a-z0-9']+", answer.lower())
    return sum(w == word for w in words) / len(words) if words else 0.0


@agl.rollout
def one_word_agent(task: dict, llm: agl.LLM) -> float:
    client = openai.OpenAI(base_url=llm.endpoint, api_key=llm.api_key or "unused")
    reply = client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": task["prompt"]}],
        temperature=llm.sampling_parameters.get("temperature", 1.0),
    )
    return reward(reply.choices[0].message.content or "", task["word"])


def make_config(steps: int) -> dict:
    """The docs' config, fitted to a CPU and the tiny model: GRPO, 16 prompts x 8 answers a step."""
    return {
        "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
        "data": {"train_batch_size": 16, "max_prompt_length": 64, "max_response_length": 8},
        "actor_rollout_ref": {
            "rollout": {"n": 8, "multi_turn": {"format": "hermes"}},
            "actor": {
                "ppo_mini_batch_size": 16,
                "optim": {"lr": 5e-3},
                "use_kl_loss": False,
                "entropy_coeff": 0,
            },
            "model": {"path": "tiny"},
        },
        "trainer": {
            "val_before_train": True,
            "test_freq": 5,
            "logger": ["console"],
            "project_name": "AgentLightning",
            "experiment_name": "seed_program",
            "total_training_steps": steps,
            "save_freq": -1,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument(
        "--runners", type=int, default=8, help="Agent Lightning's runner processes (n_runners)"
    )
    parser.add_argument("--word", default="yes")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    train = [{"prompt": f"Answer with one word: {args.word}.", "word": args.word} for _ in range(64)]
    val = train[:8]
    algorithm = VERL(make_config(args.steps))
    trainer = agl.Trainer(algorithm=algorithm, n_runners=args.runners)
    trainer.fit(one_word_agent, train_dataset=train, val_dataset=val)
    metrics = getattr(algorithm, "metrics", {})  # aglverl's VERL keeps the last step's metrics
    print(
        f"final training reward: {metrics.get('training/reward', float('nan')):.3f}, "
        f"validation reward: {metrics.get('val/reward', float('nan')):.3f}"
    )


if __name__ == "__main__":
    main()
