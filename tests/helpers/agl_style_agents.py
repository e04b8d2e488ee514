"""Agents written the way Agent Lightning v1.0's examples write them, and programs that act as agents.

Nothing here imports aglverl: these run in processes of their own (aglverl's built-in runner, or Agent
Lightning's controller from the ``.venv-agl`` venv), configured only by their environment.

- :class:`RewardAgent` / :class:`AsyncRewardAgent`: an Agent Lightning agent class; ``run()`` makes one chat call
  with the OpenAI SDK at ``AGL_OPENAI_BASE_URL`` and posts ``{"event_type": "reward", "data": {"value": x}}`` to
  ``AGL_EVENT_URL``, ``x`` being the task's ``reward`` field (read from ``TASK_REWARD``, an ``env_map`` entry).
- ``python agl_style_agents.py <program> ...``: programs for ``aglverl.processes.command`` (see ``main``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

# httpx and openai are imported where used: the programs that do not call them start in a few milliseconds


def _post_reward(value: float) -> None:
    import httpx

    key = os.environ.get("AGL_KEY") or ""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.post(
        os.environ["AGL_EVENT_URL"], json={"event_type": "reward", "data": {"value": value}}, headers=headers
    )
    response.raise_for_status()


def _ask(client: Any, prompt: str) -> str:
    reply = client.chat.completions.create(
        model="any-name-the-proxy-replaces", messages=[{"role": "user", "content": prompt}], max_tokens=4
    )
    return reply.choices[0].message.content or ""


class RewardAgent:
    """One chat call, then the task's reward as a reward event (a sync ``run``)."""

    def run(self) -> None:
        import openai

        client = openai.OpenAI(
            base_url=os.environ["AGL_OPENAI_BASE_URL"], api_key=os.environ.get("AGL_KEY") or "-", max_retries=0
        )
        _ask(client, os.environ.get("TASK_PROMPT", "Say yes."))
        _post_reward(float(os.environ["TASK_REWARD"]))


class AsyncRewardAgent:
    """The same with an ``async def run`` (awaited by the worker)."""

    async def run(self) -> None:
        import openai

        client = openai.AsyncOpenAI(
            base_url=os.environ["AGL_OPENAI_BASE_URL"], api_key=os.environ.get("AGL_KEY") or "-", max_retries=0
        )
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": os.environ.get("TASK_PROMPT", "Say yes.")}], max_tokens=4
        )
        await client.close()
        _post_reward(float(os.environ["TASK_REWARD"]))


def main(argv: list[str]) -> int:
    """Programs, by their first argument:

    - ``sdk``: reads the task input on stdin, calls the LLM with the OpenAI SDK's defaults (``OPENAI_BASE_URL``,
      ``OPENAI_API_KEY``), writes the input's ``reward`` to ``AGL_REWARD_FILE``, prints what it saw;
    - ``crash-first``: exits 3 (after a line of output) on a rollout's first attempt, else behaves as ``sdk``;
    - ``signal``: kills itself with SIGSEGV;
    - ``hang PIDFILE``: starts a child that sleeps, writes the child's pid to PIDFILE, then sleeps itself;
    - ``no-reward``: calls the LLM and exits 0 without a reward;
    - ``gate HOST PORT``: connects to a TCP server, reads one byte (the server releases it), writes reward 1.
    """
    program = argv[0]
    if program == "signal":
        os.kill(os.getpid(), 11)
    if program == "hang":
        child = subprocess.Popen(["sleep", "300"])
        with open(argv[1], "w") as f:
            f.write(str(child.pid))
        time.sleep(300)
        return 0
    if program == "gate":
        with socket.create_connection((argv[1], int(argv[2]))) as conn:
            conn.sendall(os.environ["AGL_ROLLOUT_ID"].encode() + b"\n")
            conn.recv(1)
        with open(os.environ["AGL_REWARD_FILE"], "w") as f:
            f.write("1")
        return 0
    task = json.load(sys.stdin)
    if program == "crash-first" and "-retry-" not in os.environ["AGL_ROLLOUT_ID"]:
        print("about to fail: no luck on a first attempt", flush=True)
        return 3
    import openai

    client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    answer = _ask(client, task.get("prompt", "Say yes."))
    seen = {k: os.environ.get(k) for k in ("AGL_MODE", "AGL_MODEL", "AGL_ROLLOUT_ID", "ANTHROPIC_BASE_URL")}
    print(json.dumps({"input": task, "answer": answer, "env": seen}), flush=True)
    if program == "no-reward":
        return 0
    with open(os.environ["AGL_REWARD_FILE"], "w") as f:
        f.write(str(task["reward"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
