"""``aglverl demo``: the embedded end-to-end run — verl's trainer on CPU teaches the tiny model to answer "yes".

The task is the toy example's (``examples/one_word.py``): every prompt asks for one word, and the reward is the
share of the answer's words that are that word. Agents are ordinary ``openai`` SDK code on each rollout's
proxy URL; the trainer is verl's V1 PPO trainer (GRPO, sync mode) through :class:`~aglverl.algorithm.AsyncVERL`; the
inference server is the embedded one inside verl's actor worker. Output, in ``--out DIR``:

- a progress bar on stderr (step, reward, generated tokens/s), through :class:`aglverl.cli.console.Console`;
- ``DIR/metrics.jsonl``: one JSON object per step (reward, response length, seconds per phase, all of verl's
  and aglverl's step metrics);
- ``DIR/reward.png``: the mean training reward per step; ``DIR/train.log``: what verl, Ray and TransferQueue
  printed;
- as the last line of stdout, a JSON summary ``{"first_reward", "final_reward", "steps", "wall_s", ...}``.

``--task multiturn`` is the same word over a conversation (:func:`multiturn_agent`): the agent asks, then after
each answer sends a tool result and asks again, three calls in all, and the reward is the mean of the three
answers' :func:`word_reward`. Each conversation trains as one merged row (``aglverl.signal.trajectory``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..models import LLM

__all__ = [
    "MODES",
    "MULTITURN_TURNS",
    "TARGET_WORD",
    "TASKS",
    "demo_config",
    "demo_samples",
    "multiturn_agent",
    "one_word_agent",
    "run_demo",
    "word_reward",
]

#: The word the model is taught to answer with.
TARGET_WORD = "yes"
_WORD = re.compile(r"[a-z0-9']+")
_PROMPTS = (
    "Answer with one word: {w}.",
    "Say {w}.",
    "Reply with the single word {w}.",
    "Just say {w}, nothing else.",
    "One word, please: {w}.",
    "What do you say? Answer {w}.",
    "Respond with {w}.",
    "Please answer {w}.",
)


def word_reward(answer: str, word: str = TARGET_WORD) -> float:
    """The share of the answer's words that are ``word`` (case and punctuation ignored); 0.0 for no words."""
    words = _WORD.findall(answer.lower())
    return sum(w == word for w in words) / len(words) if words else 0.0


def demo_samples(count: int, word: str = TARGET_WORD) -> list[dict[str, Any]]:
    """``count`` task inputs: a prompt asking for ``word`` (several phrasings) and the word itself."""
    return [
        {"prompt": _PROMPTS[i % len(_PROMPTS)].format(w=word), "word": word, "id": i} for i in range(count)
    ]


_CLIENT: tuple[Any, Any] | None = None  # (event loop, client)
#: Clients of event loops that have ended, kept for the life of the process: the connections of a client belong
#: to its loop, and a dropped ``openai`` client schedules its own closing on whatever loop runs at the time.
_RETIRED: list[Any] = []


def _openai_client() -> Any:
    """One ``openai`` client per event loop, shared by every rollout (a new client costs ~26 ms of CPU)."""
    import asyncio

    import openai

    global _CLIENT
    loop = asyncio.get_running_loop()
    if _CLIENT is None or _CLIENT[0] is not loop:
        if _CLIENT is not None:
            _RETIRED.append(_CLIENT)
        _CLIENT = (loop, openai.AsyncOpenAI(api_key="unused", max_retries=0))
    return _CLIENT[1]


async def one_word_agent(task: Mapping[str, Any], llm: LLM) -> float:
    """Ask the model through this rollout's proxy URL; the reward is :func:`word_reward` of its answer."""
    params = dict(llm.sampling_parameters)
    client = _openai_client().with_options(base_url=llm.endpoint)
    reply = await client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": task["prompt"]}],
        max_tokens=params.get("max_tokens", 8),
        temperature=params.get("temperature", 1.0),
        top_p=params.get("top_p", 1.0),
    )
    return word_reward(reply.choices[0].message.content or "", task["word"])


#: How many calls the multi-turn task's agent makes per rollout, and the tokens each answer may have.
MULTITURN_TURNS = 3
_MULTITURN_ANSWER_TOKENS = 8


async def multiturn_agent(task: Mapping[str, Any], llm: LLM) -> float:
    """The demo's word over a conversation: ask, then after each answer a tool message and the question again
    (:data:`MULTITURN_TURNS` calls, each with the whole history); the reward is the answers' mean
    :func:`word_reward`, so every turn counts."""
    params = dict(llm.sampling_parameters)
    client = _openai_client().with_options(base_url=llm.endpoint)
    messages: list[Any] = [{"role": "user", "content": task["prompt"]}]
    rewards = []
    for turn in range(MULTITURN_TURNS):
        reply = await client.chat.completions.create(
            model=llm.model,
            messages=messages,
            max_tokens=min(params.get("max_tokens", _MULTITURN_ANSWER_TOKENS), _MULTITURN_ANSWER_TOKENS),
            temperature=params.get("temperature", 1.0),
            top_p=params.get("top_p", 1.0),
        )
        answer = reply.choices[0].message.content or ""
        rewards.append(word_reward(answer, task["word"]))
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"Tool: noted {turn + 1}. {task['prompt']}"},
        ]
    return sum(rewards) / len(rewards)


#: The demo's tasks: the agent, and the prompt and response widths its rows need (a merged conversation's
#: response holds its three answers and the messages between them; a per-call row's prompt, the history).
TASKS: Mapping[str, tuple[Any, int, int]] = {
    "one_word": (one_word_agent, 64, 8),
    "multiturn": (multiturn_agent, 128, 128),
}

#: verl's V1 trainer modes the demo runs (``trainer.v1.trainer_mode``).
MODES = ("sync", "colocate_async", "separate_async")


def demo_config(
    steps: int,
    model: str = "tiny",
    agents: int | None = None,
    rejection_sampling: bool = False,
    mode: str = "sync",
    task: str = "one_word",
    trajectory: str = "merge",
    prompts: int = 16,
) -> dict[str, Any]:
    """The demo's ``AsyncVERL`` config: GRPO on the CPU defaults, ``prompts`` (16) prompts x 8 samples per step
    (one actor update), verl's trainer ``mode`` (the CPU defaults fill in what an asynchronous mode needs), the
    ``task``'s widths, ``trajectory`` (``aglverl.signal.trajectory``)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if task not in TASKS:
        raise ValueError(f"task must be one of {tuple(TASKS)}, got {task!r}")
    rollout: dict[str, Any] = {"n": 8, "temperature": 1.0}
    if mode == "sync":
        # on-policy lockstep training: the engine's log-probs would only feed a diagnostic (verl's default
        # computes and compares them on every row); the asynchronous modes need them for off-policy correction
        rollout["calculate_log_probs"] = False
    return {
        "data": {
            "train_batch_size": prompts,
            "max_prompt_length": TASKS[task][1],
            "max_response_length": TASKS[task][2],
        },
        "actor_rollout_ref": {
            "model": {"path": model},
            "rollout": rollout,
            "actor": {"ppo_mini_batch_size": prompts, "optim": {"lr": 5e-3}, "use_kl_loss": False},
        },
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {
            "v1": {"trainer_mode": mode},
            "total_training_steps": steps,
            "val_before_train": False,
            "test_freq": -1,
            "save_freq": -1,
            "resume_mode": "disable",  # every demo starts from the untrained model
            "logger": [],
            "project_name": "aglverl",
            "experiment_name": "demo",
        },
        "ray_kwargs": {"ray_init": {"log_to_driver": False}},
        "aglverl": {
            "journal": None,
            "agents": agents,
            "signal": {"rejection_sampling": rejection_sampling, "trajectory": trajectory},
        },
    }


async def run_demo(
    *,
    steps: int = 25,
    agents: int | None = None,
    out: Path = Path("demo-out"),
    model: str = "tiny",
    json_lines: bool = False,
    rejection_sampling: bool = False,
    mode: str = "sync",
    library_log: Path | None = None,
    task: str = "one_word",
    trajectory: str = "merge",
    prompts: int = 16,
) -> dict[str, Any]:
    """Run the demo through the quiet :class:`~aglverl.cli.console.Console`; returns its summary (also written as
    the last stdout line by the CLI), with the demo's ``mode``, ``task`` and ``trajectory``.

    ``library_log``: a file for everything verl, Ray and TransferQueue print or log in this process while
    the demo runs, so that the console shows only the progress bar (or the JSON lines) and the summary; a
    relative path is in ``out`` (as :class:`~aglverl.cli.console.Console` takes it).
    """
    from ..algorithm import AsyncVERL
    from .console import Console

    config = demo_config(steps, model, agents, rejection_sampling, mode, task, trajectory, prompts)
    algo = AsyncVERL(config, agent=TASKS[task][0])
    console = Console(
        out, json_lines=json_lines, title="aglverl demo: GRPO on the tiny model, verl on CPU", log=library_log
    )
    summary = await console.run(algo, demo_samples(64))
    summary.pop("metrics")
    return summary | {"mode": mode, "task": task, "trajectory": trajectory}
