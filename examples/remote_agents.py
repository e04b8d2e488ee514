"""Agents in their own OS process (or on another machine), talking to the trainer only over HTTP.

    python examples/remote_agents.py                           # trains; starts the agents as a child process
    python examples/remote_agents.py --server http://HOST:PORT # agents only: point them at a running trainer

Without ``--server`` this script runs the trainer (``AsyncVERL`` without ``agent=``: it serves the task server
and waits for agents) and launches ``python examples/remote_agents.py --server <that URL>`` as a separate
process; when training ends it stops that process before the task server goes away. With ``--server`` it is
just the agents: ``aglverl.run_agents`` long-polls the task server for tasks, calls the model through each
rollout's proxy URL and posts rewards; if the task server stays unreachable for ``--give-up-after`` seconds
(the trainer is gone), the agents stop with one line saying so. The agent process never imports torch, Ray or
verl.

The task is ``one_word.py``'s (answer "yes"): the reward starts near 0.0 and passes 0.9 within the 25 default
steps. The console shows the trainer's progress bar; metrics and verl's output go to ``remote_agents-out/``.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys

import anyio
import openai

from aglverl import LLM, run_agents

CLIENT = openai.AsyncOpenAI(api_key="unused", max_retries=0)  # shared; each rollout sets its base URL


def reward(answer: str, word: str) -> float:
    """The share of the answer's words that are ``word``."""
    words = re.findall(r"[a-z0-9']+", answer.lower())
    return sum(w == word for w in words) / len(words) if words else 0.0


async def agent(task: dict, llm: LLM) -> float:
    """One rollout: ask through this rollout's proxy URL, return the answer's reward."""
    reply = await CLIENT.with_options(base_url=llm.endpoint).chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["prompt"]}], **llm.sampling_parameters
    )
    return reward(reply.choices[0].message.content or "", task["word"])


def serve_agents(server: str, concurrency: int, give_up_after: float, token: str | None = None) -> None:
    """Run agent loops against ``server`` until SIGTERM / Ctrl-C, or until it has been gone ``give_up_after`` s.
    With ``token``, the task server's and the LLM proxy's bearer token (the SDK sends it as its API key)."""
    global CLIENT
    if token is not None:
        CLIENT = openai.AsyncOpenAI(api_key=token, max_retries=0)

    async def main() -> None:
        async with anyio.create_task_group() as tg:

            async def agents() -> None:
                await run_agents(
                    server, agent, concurrency=concurrency, give_up_after=give_up_after, token=token
                )
                tg.cancel_scope.cancel()

            tg.start_soon(agents)
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    return

    anyio.run(main)


def train(steps: int, concurrency: int, out: str) -> None:
    """Train with agents in a child process started once the task server's URL is known, and stopped (SIGTERM,
    then a wait) when training ends, while the task server still answers."""
    from aglverl.algorithm import AsyncVERL
    from aglverl.cli.console import Console

    config = {
        "actor_rollout_ref": {
            "rollout": {"n": 8},
            "actor": {"ppo_mini_batch_size": 16, "optim": {"lr": 5e-3}},
        },
        "data": {"train_batch_size": 16, "max_prompt_length": 64, "max_response_length": 8},
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"total_training_steps": steps, "val_before_train": False},
    }
    algo = AsyncVERL(config)  # no agent=: agents connect from elsewhere
    console = Console(out, title="remote_agents.py: answer 'yes'")
    children: list[subprocess.Popen[bytes]] = []

    def start_agents(daemon: object) -> None:
        url = daemon.server_url  # type: ignore[attr-defined]
        command = [sys.executable, __file__, "--server", url, "--concurrency", str(concurrency)]
        children.append(subprocess.Popen(command))
        console.say(f"agents: pid {children[-1].pid} -> {url}")

    async def stop_agents(daemon: object) -> None:
        for child in children:
            child.terminate()
        for child in children:
            await anyio.to_thread.run_sync(child.wait)

    algo.on_serving.append(start_agents)
    algo.on_stopping.append(stop_agents)
    tasks = [{"prompt": "Answer with one word: yes.", "word": "yes"} for _ in range(64)]
    try:
        summary = anyio.run(console.run, algo, tasks)
    finally:
        for child in children:  # training failed before on_stopping could run
            if child.poll() is None:
                child.kill()
                child.wait()
    print(console.describe(summary))
    print(f"final training reward: {summary['final_reward']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--server", help="task server URL: run only the agents, against it")
    parser.add_argument(
        "--concurrency", type=int, default=128, help="agent loops (default: a step's rollouts)"
    )
    parser.add_argument(
        "--give-up-after", type=float, default=60.0, help="seconds without a task server (agents)"
    )
    parser.add_argument("--token", default=None, help="the task server's bearer token (agents)")
    parser.add_argument("--steps", type=int, default=25, help="training steps (trainer mode)")
    parser.add_argument("--out", default="remote_agents-out", help="metrics and logs (trainer mode)")
    args = parser.parse_args()
    if args.server:
        serve_agents(args.server, args.concurrency, args.give_up_after, args.token)
    else:
        train(args.steps, args.concurrency, args.out)


if __name__ == "__main__":
    main()
