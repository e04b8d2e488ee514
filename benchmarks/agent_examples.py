"""The agents-as-processes examples against the demo, interleaved: do they learn like it, and at what pace?

    .venv/bin/python benchmarks/agent_examples.py                 # 1 round, each its default steps (~6 min on 2 cores)
    .venv/bin/python benchmarks/agent_examples.py --rounds 2 --steps 25

Each round runs, one after the other, ``aglverl demo`` (in-process ``openai`` agents), ``examples/agl_agent.py``
(an Agent Lightning agent class, a forked process per rollout) and ``examples/command_agent.py`` (a shell script
with curl and jq, a process per rollout), the same task and training (GRPO, 16 prompts x 8 answers a step, the
tiny model; ``command_agent.py`` with half the prompts a step), each as a user runs it: its own default steps
(25, 25, 30), or ``--steps`` for all. From each run's ``metrics.jsonl``: the median step time
(``timing_s/step``, the first step left out: it compiles and warms up), the median time of its rollouts
(``timing_s/gen``), the first step whose reward reached 0.9, the final reward; and the load average around it
(the machine may be shared). Prints one JSON object, with each example's median step over the demo's of the
same round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import emit, machine_info

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _runs(steps: int | None, out: Path) -> dict[str, list[str]]:
    """Each run's command: as written (its own default steps), or ``--steps steps`` for every one."""
    given = ["--steps", str(steps)] if steps is not None else []
    return {
        "demo": [str(BIN / "aglverl"), "demo", *given, "--out", str(out / "demo")],
        "agl_agent": [
            sys.executable,
            str(ROOT / "examples" / "agl_agent.py"),
            *given,
            "--out",
            str(out / "agl_agent"),
        ],
        "command_agent": [
            sys.executable,
            str(ROOT / "examples" / "command_agent.py"),
            *given,
            "--out",
            str(out / "command_agent"),
        ],
    }


def one_run(name: str, command: list[str], out: Path) -> dict[str, Any]:
    load = os.getloadavg()[0]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=out, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed: {done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r["timing_s/step"] for r in rows]
    first = next((i + 1 for i, r in enumerate(rows) if r["reward"] >= 0.9), None)
    return {
        "median_step_s": round(statistics.median(steps[1:] or steps), 2),
        "median_rollouts_s": round(statistics.median([r["timing_s/gen"] for r in rows][1:] or [0.0]), 2),
        "first_step_reaching_0.9": first,
        "first_reward": round(rows[0]["reward"], 3),
        "final_reward": round(rows[-1]["reward"], 3),
        "steps": len(rows),
        "wall_s": round(wall, 1),
        "loadavg_before_after": [round(load, 2), round(os.getloadavg()[0], 2)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="steps for every run (default: each its own, as written)"
    )
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    result: dict[str, Any] = {
        "machine": machine_info(),
        "command": " ".join(sys.argv),
        "steps": args.steps,
        "rounds": [],
    }
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="aglverl-examples-") as tmp:
            out = Path(tmp)
            runs = {name: one_run(name, command, out) for name, command in _runs(args.steps, out).items()}
        demo = runs["demo"]["median_step_s"]
        for name in ("agl_agent", "command_agent"):
            runs[name]["step_over_demo"] = round(runs[name]["median_step_s"] / demo, 2)
        result["rounds"].append(runs)
    result["machine_after"] = machine_info()["loadavg_1_5_15"]
    emit(result)


if __name__ == "__main__":
    main()
