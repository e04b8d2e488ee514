"""The demo's seconds per step, this tree against another aglverl tree, in interleaved pairs.

Each pair runs ``aglverl demo --steps N`` once with the package in ``--against DIR`` first on ``PYTHONPATH``
(``git archive <rev> aglverl | tar -x -C DIR``) and once with this tree's, one after the other, so load drift
on a shared machine hits both. Per run it reads the demo's ``metrics.jsonl`` and keeps the medians, over the
steps after the first (the first pays for warm-up), of verl's phase timings. Prints ONE JSON object: the runs,
and per version the median over runs of each figure.

    .venv/bin/python benchmarks/demo_against.py --against /tmp/old046 [--pairs 3] [--steps 12]

Both versions must reach the demo's reward; a run that fails (or writes no metrics) is reported with its exit
status and leaves the summary without it.
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PHASES = {
    "step_s": "timing_s/step",
    "gen_s": "timing_s/gen",
    "old_log_prob_s": "timing_s/old_log_prob",
    "update_actor_s": "timing_s/update_actor",
    "adv_s": "timing_s/adv",
}


def run_demo(version: str, against: str, steps: int, out: Path) -> dict[str, Any]:
    """One demo run of ``version`` ("against" or "this"), its phase medians after the first step."""
    env = dict(os.environ)
    cwd = ROOT
    if version == "against":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (against, env.get("PYTHONPATH", "")) if p)
        cwd = out.parent  # not this tree, whose aglverl would be found first from the working directory
    command = [
        sys.executable,
        "-m",
        "aglverl.cli",
        "demo",
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--json",
    ]
    start = time.monotonic()
    done = subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    result: dict[str, Any] = {"version": version, "wall_s": round(time.monotonic() - start, 1)}
    metrics_file = out / "metrics.jsonl"
    if done.returncode != 0 or not metrics_file.exists():
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-3:]
        return result | {"error": f"exit {done.returncode}", "stderr_tail": tail}
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    later = rows[1:] or rows
    for name, key in PHASES.items():
        result[name] = round(statistics.median(r[key] for r in later), 3)
    result["first_step_s"] = round(rows[0]["timing_s/step"], 2)
    result["last_reward"] = round(rows[-1]["reward"], 3)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--against", required=True, metavar="DIR", help="a directory holding another aglverl/"
    )
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args(argv)
    if not (Path(args.against) / "aglverl" / "__init__.py").exists():
        parser.error(f"--against {args.against}: no aglverl/__init__.py there")
    runs = []
    with tempfile.TemporaryDirectory(prefix="demo-against-") as scratch:
        for pair in range(args.pairs):
            for version in ("against", "this"):
                out = Path(scratch) / f"{version}-{pair}"
                runs.append({"pair": pair} | run_demo(version, args.against, args.steps, out))
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    summary: dict[str, dict[str, float]] = {}
    for version in ("against", "this"):
        ok = [r for r in runs if r["version"] == version and "error" not in r]
        if ok:
            summary[version] = {name: round(statistics.median(r[name] for r in ok), 3) for name in PHASES}
    if len(summary) == 2:
        summary["change_pct"] = {
            name: round(100 * (summary["this"][name] / summary["against"][name] - 1), 1) for name in PHASES
        }
    print(
        json.dumps(
            {
                "benchmark": "demo_against",
                "against": args.against,
                "steps": args.steps,
                "pairs": args.pairs,
                "median_of_runs": summary,
                "runs": runs,
            }
        )
    )
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
