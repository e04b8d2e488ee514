"""Step turnaround: time from the last ``POST /rollout`` of a step to its batch arriving from the stream.

The real daemon (task server on uvicorn, collector, batch builder) runs in this process; the agents run in a
separate process (as they do in practice), long-polling ``GET /task`` and posting a rollout with one triplet.
Each agent notes ``time.monotonic()`` (one clock for every process on Linux) just before it sends a POST;
the latest of those per step is the step's last post, and turnaround is the time from it to
``await daemon.batches.receive()`` returning here. Prints one JSON object.

The old Agent Lightning daemon checked for finished rollouts every 5 s: its turnaround is >= 5,000 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from typing import Any

import anyio
import numpy as np
from _common import run_loop

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from aglverl import AgentClient, Rollout, Triplet


async def agents(server_url: str, count: int, total: int, think_ms: float) -> None:
    """The agent process: ``count`` agents handle ``total`` tasks, then print every post's (step, time).

    Each agent "works" a random 0..``think_ms`` ms on a task, as real agents do, so a step's rollouts do
    not all land in the same millisecond and the last post measures the daemon, not a burst queued before it.
    """
    posts: list[tuple[int, float]] = []
    rng = random.Random(0)
    async with AgentClient(server_url, connections=count + 4) as client, anyio.create_task_group() as tg:

        async def agent() -> None:
            while len(posts) < total:
                task = await client.next_task(wait=30)
                if task is None:
                    continue
                await anyio.sleep(rng.uniform(0, think_ms) / 1000)
                rollout = Rollout(
                    rollout_id=task.rollout_id,
                    attempt_id=task.attempt_id,
                    final_reward=1.0,
                    triplets=[
                        Triplet(prompt={"token_ids": list(range(1, 40))}, response={"token_ids": [7] * 20})
                    ],
                )
                posts.append((int(task.metadata["step"]), time.monotonic()))
                await client.post_rollout(rollout)
                if len(posts) >= total:
                    tg.cancel_scope.cancel()

        for _ in range(count):
            tg.start_soon(agent)
    print(json.dumps(posts), flush=True)


async def daemon_side(steps: int, rollouts: int, count: int, warmup: int, think_ms: float) -> dict:
    from aglverl import AgentDaemon, BatchConfig

    received: dict[int, float] = {}
    last_accept: dict[int, float] = {}
    async with AgentDaemon(batch=BatchConfig(max_prompt_length=64, max_response_length=32)) as daemon:
        accept = daemon.store.submit_result

        def timed_accept(rollout: Any) -> str:  # instrumentation only: notes when the store took a result
            message = accept(rollout)
            last_accept[current_step] = time.monotonic()
            return message

        daemon.store.submit_result = timed_accept  # type: ignore[method-assign]
        current_step = -1
        total = (steps + warmup) * rollouts
        cmd = [
            sys.executable,
            __file__,
            "--agent-process",
            daemon.server_url,
            str(count),
            str(total),
            str(think_ms),
        ]
        async with await anyio.open_process(cmd, stderr=None) as proc:
            for _ in range(warmup + steps):
                step = await daemon.submit([{"i": j} for j in range(rollouts)], n=1)
                current_step = step.number
                batch = await daemon.batches.receive()
                received[step.number] = time.monotonic()
                assert batch.step == step.number and len(batch.data) == rollouts
            assert proc.stdout is not None
            out = b"".join([chunk async for chunk in proc.stdout])
    last_post: dict[int, float] = {}
    for step_number, t in json.loads(out):
        last_post[step_number] = max(last_post.get(step_number, 0.0), t)
    measured = [s for s in sorted(received) if s >= warmup]
    ms = np.array([received[s] - last_post[s] for s in measured]) * 1000
    inside = np.array([received[s] - last_accept[s] for s in measured]) * 1000
    return {
        "benchmark": "turnaround",
        "steps": steps,
        "rollouts_per_step": rollouts,
        "agents": count,
        "agents_in": "separate process",
        "agent_think_ms": f"uniform 0..{think_ms:g}",
        "p50_ms": round(float(np.percentile(ms, 50)), 3),
        "p99_ms": round(float(np.percentile(ms, 99)), 3),
        "max_ms": round(float(ms.max()), 3),
        "daemon_side_ms": {
            "what": "last result accepted by the store -> batch received (same process, no HTTP or agent)",
            "p50": round(float(np.percentile(inside, 50)), 3),
            "p99": round(float(np.percentile(inside, 99)), 3),
        },
        "target_p99_ms": 5.0,
        "old_daemon_ms": ">= 5000",
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--agent-process":
        run_loop(agents, sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
        return
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rollouts", type=int, default=32, help="rollouts per step")
    p.add_argument("--agents", type=int, default=16)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--think-ms", type=float, default=20.0, help="agent work per task: uniform 0..THINK_MS ms")
    args = p.parse_args()
    result = run_loop(daemon_side, args.steps, args.rollouts, args.agents, args.warmup, args.think_ms)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
