"""An Agent Lightning v1.0 agent class, trained by aglverl with Agent Lightning's own config section.

    python examples/agl_agent.py                 # 25 GRPO steps of the tiny model on CPU, a process per rollout
    python examples/agl_agent.py --steps 2

``OneWordAgent`` is written the way Agent Lightning v1.0's examples write agents: a class whose ``run()`` reads
its rollout from the environment Agent Lightning's controllers give it (``AGL_OPENAI_BASE_URL``,
``AGL_EVENT_URL``, ``AGL_KEY``, and the task's fields named by ``local.env_map``), calls the model with the
OpenAI SDK and POSTs its reward as a ``reward`` event. It imports nothing of aglverl (nor of Agent Lightning):
the same class runs under Agent Lightning's ``python -m agentlightning.controller runner_type=local``.

The training config is verl's plus Agent Lightning's ``agentlightning:`` section, as an Agent Lightning user
writes it; ``AsyncVERL`` maps it onto aglverl's keys (README, "Coming from Agent Lightning") and its built-in
runner runs a process per rollout, ``aglverl.agents`` at a time (default: bounded by the machine's cores and
memory, 32 on a 2-core VM). Set ``aglverl.agents: 0`` (``--agents 0``) and point Agent Lightning's own controller
at the task server URL this prints to let it run them instead.

Each rollout's process is a fork of a template process that imported this module (and the OpenAI SDK) once, so
it starts in milliseconds instead of paying the SDK's import (~1.2 s of CPU) every rollout; the HTTP client made
at the module's top is made once, there, too. The task and the training are ``one_word.py``'s (answer "yes",
16 prompts x 8 answers a step): the tiny model (random weights) passes reward 0.9 within the 25 default steps,
as ``aglverl demo`` does, at about the demo's pace a step (README, "Coming from Agent Lightning", for the
figures). Metrics go to ``agl_agent-out/``, each agent process's output to
``agl_agent-out/agent_logs/<rollout id>.log``.
"""

from __future__ import annotations

import argparse
import os
import re

import httpx
import openai

#: One HTTP client for every rollout of this process. Under aglverl's fork server it is made once, in the template
#: that imports this module, and every rollout's process (a fork) starts with it: a new client would cost each
#: rollout ~30 ms of CPU (its TLS setup) twice, for the SDK's client and for the reward's post.
HTTP = httpx.Client(timeout=600)


def _warm_up() -> None:
    """One chat call answered in memory (no network): the SDK's first call builds its request and response
    parsers (~20 ms of CPU), here once, in the template, rather than in every rollout's process."""
    canned = {
        "id": "warm-up",
        "object": "chat.completion",
        "created": 0,
        "model": "warm-up",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "yes"}, "finish_reason": "stop"}
        ],
    }
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=canned))
    with httpx.Client(transport=transport) as offline:
        client = openai.OpenAI(base_url="http://warm-up/v1", api_key="-", http_client=offline, max_retries=0)
        client.chat.completions.create(model="warm-up", messages=[{"role": "user", "content": "warm up"}])


_warm_up()


class OneWordAgent:
    """One rollout: ask for the word, score the answer, report the score (Agent Lightning v1.0's contract)."""

    def run(self) -> None:
        key = os.environ.get("AGL_KEY") or ""
        client = openai.OpenAI(
            base_url=os.environ["AGL_OPENAI_BASE_URL"], api_key=key or "-", max_retries=0, http_client=HTTP
        )
        reply = client.chat.completions.create(
            model="served-model",  # the server puts the served model's name here
            messages=[{"role": "user", "content": os.environ["TASK_PROMPT"]}],
        )
        value = reward(reply.choices[0].message.content or "", os.environ["TASK_WORD"])
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        event = {"event_type": "reward", "data": {"value": value}}
        HTTP.post(os.environ["AGL_EVENT_URL"], json=event, headers=headers).raise_for_status()


def reward(answer: str, word: str) -> float:
    """The share of the answer's words that are ``word``."""
    words = re.findall(r"[a-z0-9']+", answer.lower())
    return sum(w == word for w in words) / len(words) if words else 0.0


def make_config(steps: int, agents: int | None, out: str) -> dict:
    """``one_word.py``'s training (GRPO, 16 prompts x 8 answers a step, answers of at most 8 tokens), its agents
    this class run by aglverl's runner (``agents`` processes at once; ``None``: the runner's default)."""
    return {
        "actor_rollout_ref": {
            "rollout": {"n": 8},
            "actor": {"ppo_mini_batch_size": 16, "optim": {"lr": 5e-3}},
        },
        "data": {"train_batch_size": 16, "max_prompt_length": 64, "max_response_length": 8},
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"total_training_steps": steps, "val_before_train": False},
        "aglverl": {"agents": agents, "processes": {"log_dir": os.path.join(out, "agent_logs")}},
        "agentlightning": {  # Agent Lightning v1.0's section, as in its verl config
            "rollout_timeout_seconds": 120,
            "local": {
                "agent_class": "agl_agent:OneWordAgent",
                "env_map": {"TASK_PROMPT": "input.prompt", "TASK_WORD": "input.word"},
            },
            "reward_fillna_value": None,  # an agent that reports no reward fails its attempt (it is retried)
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument(
        "--agents",
        type=int,
        default=None,
        help="agent processes at once (default: the runner's, bounded by cores and memory; 0: none, use a controller)",
    )
    parser.add_argument(
        "--out", default="agl_agent-out", help="directory for metrics, logs and the agents' output"
    )
    args = parser.parse_args()

    import anyio

    from aglverl.algorithm import AsyncVERL
    from aglverl.cli.console import Console

    # the agent processes import this file as the module ``agl_agent``
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    console = Console(args.out, title="agl_agent.py: an Agent Lightning agent class answers 'yes'")
    algo = AsyncVERL(make_config(args.steps, args.agents, args.out))
    algo.on_serving.append(
        lambda daemon: console.say(f"Agent Lightning API and proxy path at {daemon.server_url}")
    )
    tasks = [{"prompt": "Answer with one word: yes.", "word": "yes"} for _ in range(64)]
    summary = anyio.run(console.run, algo, tasks)
    print(console.describe(summary))
    print(f"final training reward: {summary['final_reward']:.3f}")


if __name__ == "__main__":
    main()
