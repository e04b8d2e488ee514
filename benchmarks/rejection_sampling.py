"""The demo with and without rejection sampling: wall time until the training reward reaches 0.9. Prints JSON.

Runs ``aglverl demo`` (:func:`aglverl.cli.demo.run_demo`, the tiny model on CPU) ``--repeats`` times each way,
alternating, and reports for each run the step and the wall time (from the start of the run, Ray start-up
included) at which the mean training reward first reached ``--target``, the steps that were skipped because
every GRPO group was uniform, and the rows trained per step. ``--plot PATH`` draws every run's reward against
wall time. Target (issue 10): with rejection sampling, 0.9 in no more wall time than without.

On verl's V1 trainer rejection sampling is verl's DAPO group filter: a uniform group is evicted and a fresh
prompt is dispatched in its place (up to ``max_num_gen_batches`` batches a step), so a step generates more
rows than it trains (``rows_generated_per_step``, ``groups_evicted_per_step``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import run_loop

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _common import emit, machine_info

from aglverl.cli.demo import run_demo


async def one_run(steps: int, rejection_sampling: bool, target: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="aglverl-rs-") as out:
        await run_demo(steps=steps, out=Path(out), rejection_sampling=rejection_sampling)
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    hit = next((r for r in rows if r["reward"] >= target), None)
    return {
        "rejection_sampling": rejection_sampling,
        "step_reaching_target": hit["step"] if hit else None,
        "wall_s_reaching_target": round(hit["wall_s"], 2) if hit else None,
        "steps_skipped": int(sum(r.get("step/skipped", 0.0) for r in rows)),
        # Rows the agents generated, rejected groups' included (verl's DAPO refill dispatches fresh prompts
        # for every evicted group, up to max_num_gen_batches batches a step).
        "rows_generated_per_step": round(statistics.mean(r.get("step/n_rows", 0.0) for r in rows), 1),
        "groups_evicted_per_step": round(
            statistics.mean(r.get("training/filter_groups/evicted_samples", 0.0) for r in rows), 1
        ),
        "seconds_per_step": round((rows[-1]["wall_s"] - rows[0]["wall_s"]) / max(1, len(rows) - 1), 3),
        "curve": [(round(r["wall_s"], 2), round(r["reward"], 4)) for r in rows],
    }


def plot(runs: list[dict[str, Any]], path: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8), dpi=100)
    for run in runs:
        xs, ys = zip(*run["curve"], strict=True)
        with_rs = run["rejection_sampling"]
        ax.plot(
            xs,
            ys,
            color="tab:orange" if with_rs else "tab:blue",
            alpha=0.8,
            marker="o",
            markersize=2.5,
            label="rejection sampling" if with_rs else "plain GRPO",
        )
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys())
    ax.axhline(target, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel("wall time since start (s, Ray start-up included)")
    ax.set_ylabel("mean training reward")
    ax.set_title("aglverl demo on CPU: with and without rejection sampling")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    runs = []
    for _ in range(args.repeats):
        for rejection_sampling in (False, True):
            runs.append(await one_run(args.steps, rejection_sampling, args.target))
    if args.plot:
        plot(runs, Path(args.plot), args.target)
    summary = {}
    for name, flag in (("plain", False), ("rejection_sampling", True)):
        times = [r["wall_s_reaching_target"] for r in runs if r["rejection_sampling"] is flag]
        summary[name] = {
            "wall_s_reaching_target": times,
            "mean": round(statistics.mean(t for t in times if t is not None), 2) if any(times) else None,
        }
    met = None not in summary["rejection_sampling"]["wall_s_reaching_target"] and (
        summary["rejection_sampling"]["mean"] <= summary["plain"]["mean"]
    )
    return {
        "benchmark": "rejection_sampling",
        "target_reward": args.target,
        "summary": summary,
        "met": met,
        "runs": [{k: v for k, v in r.items() if k != "curve"} for r in runs],
        "curves": [r["curve"] for r in runs],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--plot", default=None, help="write the reward-vs-wall-time curves here (PNG)")
    arguments = parser.parse_args()
    emit({**run_loop(main, arguments), "machine": machine_info()})
