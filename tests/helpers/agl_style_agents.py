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
import signal
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
            base_url=os.environ["AGL_OPENAI_BASE_URL"],
            api_key=os.environ.get("AGL_KEY") or "-",
            max_retries=0,
        )
        _ask(client, os.environ.get("TASK_PROMPT", "Say yes."))
        _post_reward(float(os.environ["TASK_REWARD"]))


class AsyncRewardAgent:
    """The same with an ``async def run`` (awaited by the worker)."""

    async def run(self) -> None:
        import openai

        client = openai.AsyncOpenAI(
            base_url=os.environ["AGL_OPENAI_BASE_URL"],
            api_key=os.environ.get("AGL_KEY") or "-",
            max_retries=0,
        )
        await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": os.environ.get("TASK_PROMPT", "Say yes.")}],
            max_tokens=4,
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
    - ``gate HOST PORT``: connects to a TCP server, reads one byte (the server releases it), writes reward 1;
    - ``fields``: prints which of ``TASK`` / ``TASK_FILE`` it got and their sizes, writes reward 1;
    - ``flood N``: writes N bytes of output, then reward 1;
    - ``leave-daemon PIDFILE``: starts a daemon that left its session (double fork, ``setsid``), writes its pid,
      writes reward 1 and exits;
    - ``hold HOST PORT``: starts a daemon (as ``leave-daemon``) that ignores SIGTERM, connects to a TCP server
      and sends ``<rollout id> <its pid> <the daemon's pid>``, then waits; on SIGTERM it sends ``TERM`` and exits;
    - ``probe``: with the task's ``peer`` (another rollout), tries to post a reward to the peer's rollout with its
      own key and with none, reads the list of rollouts, prints the statuses and its environment's names, then
      posts its own reward;
    - ``gateway``: the same chat call (another model's name, ``temperature`` 0.3) at ``OPENAI_BASE_URL`` with its
      key, without it, and at Agent Lightning's proxy path on the task server with its key, then at the task's
      ``peer_llm`` (another attempt's base URL) with its key; prints the statuses, its key and base URL; reward 1.
    """
    program = argv[0]
    if program in ("fields", "flood", "leave-daemon", "hold", "probe", "gateway"):
        return _more(program, argv[1:])
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
    seen = {
        k: os.environ.get(k)
        for k in ("AGL_MODE", "AGL_MODEL", "AGL_ROLLOUT_ID", "AGL_SEED", "ANTHROPIC_BASE_URL")
    }
    print(json.dumps({"input": task, "answer": answer, "env": seen}), flush=True)
    if program == "no-reward":
        return 0
    with open(os.environ["AGL_REWARD_FILE"], "w") as f:
        f.write(str(task["reward"]))
    return 0


def _daemon(ignore_term: bool) -> int:
    """A process that left the agent's session and process group (double fork + setsid); returns its pid."""
    read, write = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            if ignore_term:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            os.write(write, str(os.getpid()).encode())
            time.sleep(300)
            os._exit(0)
        os._exit(0)
    os.close(write)
    pid = int(os.read(read, 32))
    os.wait()
    return pid


def _http(method: str, url: str, key: str | None, body: dict | None = None) -> int:
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(
        url, data=json.dumps(body).encode() if body is not None else None, headers=headers, method=method
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _reward_file(value: float = 1.0) -> None:
    with open(os.environ["AGL_REWARD_FILE"], "w") as f:
        f.write(str(value))


def _more(program: str, args: list[str]) -> int:
    if program == "fields":
        path = os.environ.get("TASK_FILE")
        print(
            json.dumps(
                {
                    "TASK": len(os.environ["TASK"]) if "TASK" in os.environ else None,
                    "TASK_FILE": os.path.getsize(path) if path else None,
                    "same": open(path, "rb").read() == json.dumps(json.load(sys.stdin)["text"]).encode()[1:-1]
                    if path
                    else None,
                }
            ),
            flush=True,
        )
    elif program == "flood":
        chunk = b"x" * 1023 + b"\n"
        for _ in range(int(args[0]) // 1024):
            os.write(1, chunk)
        print("the last line of the flood", flush=True)
    elif program == "leave-daemon":
        with open(args[0], "w") as f:
            f.write(str(_daemon(ignore_term=False)))
    elif program == "hold":
        stray = _daemon(ignore_term=True)
        conn = socket.create_connection((args[0], int(args[1])))

        def on_term(signum: int, frame: Any) -> None:
            conn.sendall(b"TERM\n")
            os._exit(0)

        signal.signal(signal.SIGTERM, on_term)
        conn.sendall(f"{os.environ['AGL_ROLLOUT_ID']} {os.getpid()} {stray}\n".encode())
        while True:
            conn.recv(1)
    elif program == "gateway":
        key, base = os.environ["AGL_KEY"], os.environ["OPENAI_BASE_URL"]
        task = json.load(sys.stdin)
        server = os.environ["AGL_EVENT_URL"].split("/api/")[0]
        hop = f"{server}/proxy/rollout/{os.environ['AGL_ROLLOUT_ID']}/attempt/0/mode/train/openai/v1"
        chat = {"model": "gpt-4o", "messages": [{"role": "user", "content": "Say yes."}], "max_tokens": 4}
        chat["temperature"] = 0.3
        seen = {
            "own": _http("POST", f"{base}/chat/completions", key, chat),
            "own_without_key": _http("POST", f"{base}/chat/completions", None, chat),
            "hop": _http("POST", f"{hop}/chat/completions", key, chat),
            "peer_with_own_key": _http("POST", f"{task['peer_llm']}/chat/completions", key, chat),
            "key": key,
            "base": base,
        }
        print(json.dumps(seen), flush=True)
        _reward_file()
    elif program == "probe":
        task = json.load(sys.stdin)
        key = os.environ["AGL_KEY"]
        peer_events = os.environ["AGL_EVENT_URL"].replace(os.environ["AGL_ROLLOUT_ID"], task["peer"])
        server = os.environ["AGL_EVENT_URL"].split("/api/")[0]
        reward = {"event_type": "reward", "data": {"value": 1.0}}
        seen = {
            "peer_with_own_key": _http("POST", peer_events, key, reward),
            "peer_without_key": _http("POST", peer_events, None, reward),
            "list_with_own_key": _http("GET", f"{server}/api/rollouts?state_in=running", key),
            "own_without_key": _http("POST", os.environ["AGL_EVENT_URL"], None, reward),
            "own": _http(
                "POST", os.environ["AGL_EVENT_URL"], key, {"event_type": "reward", "data": {"value": 0.5}}
            ),
            "env": sorted(os.environ),
        }
        print(json.dumps(seen), flush=True)
        return 0
    _reward_file()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
