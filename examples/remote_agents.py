"""Agents in their own OS process (or on another machine), talking to the trainer only over HTTP.

    python examples/remote_agents.py --steps 5                 # trains, and starts the agents as a child process
    python examples/remote_agents.py --server http://HOST:PORT # agents only: point them at a running trainer

Without ``--server`` this script runs the trainer (``AsyncVERL`` without ``agent=``: it logs the task server
URL and waits for agents) and launches ``python examples/remote_agents.py --server <that URL>`` as a separate
process, which it stops when training ends. With ``--server`` it is just the agents: ``aglverl.run_agents``
long-polls the task server for tasks, calls the model through each rollout's proxy URL and posts rewards. The
agent process never imports torch, Ray or verl.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys

import anyio
import openai

from aglverl import LLM, run_agents

CLIENT = openai.AsyncOpenAI(api_key="unused", max_retries=0)  # shared; each rollout sets its base URL


async def agent(task: dict, llm: LLM) -> float:
    reply = await CLIENT.with_options(base_url=llm.endpoint).chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["prompt"]}], **llm.sampling_parameters
    )
    words = (reply.choices[0].message.content or "").lower().split()
    return sum(w.strip(".,!?") == task["word"] for w in words) / len(words) if words else 0.0


def serve_agents(server: str, concurrency: int) -> None:
    """Run agent loops against ``server`` until SIGTERM / Ctrl-C."""

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run_agents(server, agent, concurrency=concurrency))
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    return

    anyio.run(main)


def train(steps: int, concurrency: int) -> None:
    """Train with agents in a child process started once the task server's URL is known."""
    from aglverl.algorithm import AsyncVERL

    config = {
        "actor_rollout_ref": {"rollout": {"n": 4}, "actor": {"ppo_mini_batch_size": 8, "optim": {"lr": 5e-3}}},
        "data": {"train_batch_size": 8, "max_prompt_length": 64, "max_response_length": 8},
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"total_training_steps": steps, "val_before_train": False, "logger": ["console"]},
    }
    algo = AsyncVERL(config)  # no agent=: agents connect from elsewhere
    children: list[subprocess.Popen[bytes]] = []

    def start_agents(daemon: object) -> None:
        command = [sys.executable, __file__, "--server", daemon.server_url, "--concurrency", str(concurrency)]
        children.append(subprocess.Popen(command))
        print(f"agents: pid {children[-1].pid} -> {daemon.server_url}", flush=True)

    algo.on_serving.append(start_agents)
    tasks = [{"prompt": "Answer with one word: yes.", "word": "yes"} for _ in range(32)]
    try:
        metrics = anyio.run(algo.run, tasks)
    finally:
        for child in children:
            child.terminate()
            child.wait(timeout=30)
    print(f"final training reward: {metrics['training/reward']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", help="task server URL: run only the agents, against it")
    parser.add_argument("--concurrency", type=int, default=32, help="agent loops")
    parser.add_argument("--steps", type=int, default=10, help="training steps (trainer mode)")
    args = parser.parse_args()
    if args.server:
        serve_agents(args.server, args.concurrency)
    else:
        train(args.steps, args.concurrency)


if __name__ == "__main__":
    main()
