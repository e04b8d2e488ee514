"""What the events agents post to Agent Lightning's API cost the daemon's memory, and where it stops them.

    .venv/bin/python benchmarks/agl_events.py
    .venv/bin/python benchmarks/agl_events.py --against /tmp/old019     # git archive 019ee6f aglverl | tar -x -C DIR

Each tree (``PYTHONPATH=DIR`` for ``--against``) runs three phases, each in a child process of its own with a
daemon of its own (no trainer, a backend nobody calls) whose Agent Lightning API takes rollouts, over loopback
HTTP; each reports the events accepted and refused (with the first refusal's status and message) and the child's
RSS growth while it posted them:

- ``one_rollout``: 24 events of 8 MB to one rollout (issue 50: "grew the trainer by 206 MB");
- ``many_rollouts``: events of 8 MB to ``--rollouts`` rollouts in turn, ``--posts`` in all (the bound over all
  rollouts);
- ``small_events``: ``--small`` events of 1 KiB of small keys (60 keys of ``[int, float, str]``) to rollouts of
  their own, 2,000 each (parsed, such data takes many times its bytes).

Prints one JSON object: per tree, each phase's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

import anyio
import httpx

BIG = 8_000_000
PHASES = ("one_rollout", "many_rollouts", "small_events")


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


async def _phase(client: httpx.AsyncClient, posts: list[tuple[str, bytes]]) -> dict[str, Any]:
    """Post each ``(rollout id, body)``; what was accepted, the first refusal, and the RSS growth."""
    before = _rss_mb()
    accepted, refused, first = 0, 0, None
    for rollout_id, body in posts:
        answer = await client.post(
            f"/api/rollouts/{rollout_id}/attempt/0/events",
            content=body,
            headers={"content-type": "application/json"},
        )
        if answer.is_success:
            accepted += 1
        else:
            refused += 1
            first = first or {"status": answer.status_code, "detail": answer.json().get("detail")}
    return {
        "accepted": accepted,
        "refused": refused,
        "first_refusal": first,
        "rss_growth_mb": _rss_mb() - before,
    }


def _posts(phase: str, args: argparse.Namespace) -> list[tuple[str, bytes]]:
    if phase == "small_events":
        small = json.dumps(
            {"event_type": "trace", "data": {f"k{i}": [i, 0.5, "v"] for i in range(60)}}
        ).encode()
        return [(f"r{i // 2000}", small) for i in range(args.small)]
    big = json.dumps({"event_type": "trace", "data": {"blob": "x" * BIG}}).encode()
    if phase == "one_rollout":
        return [("r0", big)] * 24
    return [(f"r{i % args.rollouts}", big) for i in range(args.posts)]


async def _child(args: argparse.Namespace) -> dict[str, Any]:
    from aglverl import AgentDaemon

    posts = _posts(args.phase, args)
    ids = list(dict.fromkeys(rollout_id for rollout_id, _ in posts))
    async with (
        AgentDaemon(backends=["http://127.0.0.1:9"], model="m") as daemon,
        httpx.AsyncClient(base_url=daemon.server_url, timeout=300) as client,
    ):
        created = await client.post("/api/rollouts", json=[{"input": {}, "rollout_id": i} for i in ids])
        assert created.status_code == 201, created.text
        return await _phase(client, posts)


def _run_tree(tree: str | None, args: argparse.Namespace) -> dict[str, Any]:
    """Each phase in a child process of its own, on a daemon of its own."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([tree, env.get("PYTHONPATH", "")])
    out = {}
    for phase in PHASES:
        command = [sys.executable, __file__, "--child", phase, "--rollouts", str(args.rollouts)]
        command += ["--posts", str(args.posts), "--small", str(args.small)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        out[phase] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--against", help="another tree of aglverl (a directory holding its aglverl/)")
    parser.add_argument("--rollouts", type=int, default=40)
    parser.add_argument("--posts", type=int, default=96, help="8 MB events over --rollouts rollouts")
    parser.add_argument("--small", type=int, default=40_000, help="1 KiB events")
    parser.add_argument("--child", dest="phase", choices=PHASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(anyio.run(_child, args)))
        return
    result = {"this_tree": _run_tree(None, args)}
    if args.against:
        result["against"] = _run_tree(os.path.abspath(args.against), args)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
