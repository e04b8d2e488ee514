"""Any program as an agent: a shell script (``examples/word_agent.sh``, curl + jq) run once per rollout.

    python examples/command_agent.py             # 30 GRPO steps of the tiny model on CPU
    python examples/command_agent.py --steps 2

``aglverl.processes.command`` names the program (a list of arguments, or a string for ``/bin/sh -c``): a CLI
coding agent, a script, a binary. aglverl's built-in runner starts it for each rollout attempt, up to
``aglverl.agents`` at once, with the rollout's LLM endpoint in ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` (and
``ANTHROPIC_BASE_URL`` / ``ANTHROPIC_API_KEY``, Agent Lightning's ``AGL_*``), the task's fields in the variables
``env_map`` names, the task input on its standard input; it reports the reward in the file ``AGL_REWARD_FILE`` or
as a reward event (``AGL_EVENT_URL``). Every
LLM call it makes is recorded with its token ids, like any agent's. A process that exits non-zero, runs past
``timeout_seconds`` (it and every process it started get SIGTERM, then SIGKILL) or reports no reward fails its
attempt, which is retried (``aglverl.max_attempts``); the error names the log file with its output.

The task is ``one_word.py``'s (answer "yes"), with half its rollouts a step (8 prompts x 8 answers): what a rollout
costs here is the script's own processes (a ``curl``, a ``jq``, a ``sed`` and a ``tr``: ~35 ms of CPU), so a step
of 128 would spend ~3 s of a 2-core machine in them alone. Half the answers a step make its reward noisier from
step to step: the tiny model passes reward 0.9 at step 14-18 (once not within 25: 0.86 there), where ``aglverl
demo`` passes it around 14 of its 25, so it runs 30 steps by default. 32 processes run at once. Metrics go to
``command_agent-out/``, each process's output to ``command_agent-out/agent_logs/<rollout id>.log``.
"""

from __future__ import annotations

import argparse
import os
import shutil

import anyio

from aglverl.algorithm import AsyncVERL
from aglverl.cli.console import Console

AGENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "word_agent.sh")


def make_config(steps: int, agents: int, out: str) -> dict:
    """``one_word.py``'s training with half its prompts a step (GRPO, 8 prompts x 8 answers, answers of at most 8
    tokens), its agents the script, ``agents`` processes at once."""
    return {
        "actor_rollout_ref": {
            "rollout": {"n": 8},
            "actor": {"ppo_mini_batch_size": 8, "optim": {"lr": 5e-3}},
        },
        "data": {"train_batch_size": 8, "max_prompt_length": 64, "max_response_length": 8},
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"total_training_steps": steps, "val_before_train": False},
        "aglverl": {
            "agents": agents,
            "max_attempts": 2,
            "processes": {
                "command": ["sh", AGENT],
                "env_map": {"TASK_PROMPT": "input.prompt", "TASK_WORD": "input.word"},
                "timeout_seconds": 60,
                "log_dir": os.path.join(out, "agent_logs"),
            },
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--agents", type=int, default=32, help="agent processes at once")
    parser.add_argument(
        "--out", default="command_agent-out", help="directory for metrics, logs and the agents' output"
    )
    args = parser.parse_args()
    missing = [tool for tool in ("curl", "jq") if shutil.which(tool) is None]
    if missing:
        parser.exit(2, f"examples/word_agent.sh needs {' and '.join(missing)} on PATH\n")
    console = Console(args.out, title="command_agent.py: a shell script answers 'yes'")
    algo = AsyncVERL(make_config(args.steps, args.agents, args.out))
    tasks = [{"prompt": "Answer with one word: yes.", "word": "yes"} for _ in range(64)]
    summary = anyio.run(console.run, algo, tasks)
    print(console.describe(summary))
    print(f"final training reward: {summary['final_reward']:.3f}")


if __name__ == "__main__":
    main()
