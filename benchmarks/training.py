"""Where a training run's time goes: the demo's work on verl's trainer, split into phases. Prints one JSON object.

Runs :class:`aglverl.algorithm.AsyncVERL` on the demo task (``aglverl demo``'s config: GRPO, 16 prompts x 8
samples per step, the tiny model on CPU, agents in this process) for ``--steps`` steps and reports, over the
steps after the first (``--warmup``) ones:

- ``steps_per_s``, ``rollouts_per_s``, ``generated_tokens_per_s`` (response tokens over the run's wall time);
- ``shares`` of that wall time: ``generation`` (the embedded engine busy generating), ``generation_other``
  (the rest of the generation phase: agents, proxy, task hand-out, the engine waiting for work), the compute
  phases verl timed (``old_log_prob``, ``ref``, ``values``, ``adv``, ``update_critic``, ``update_actor``),
  ``weight_sync``, ``checkpoint``, ``validation``, and ``dead``: time in no phase at all (neither generating nor
  computing: batch hand-over, trimming, metric computation, logging). The old daemon spent at least 5 s of
  every step polling; the target here is ``dead`` below 5% of wall time.

The engine's busy time comes from the server's own counters, read inside verl's worker after every step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import anyio
import ray

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _common import emit, machine_info

from aglverl.algorithm import AsyncVERL
from aglverl.demo import demo_config, demo_samples, one_word_agent

COMPUTE_PHASES = ("old_log_prob", "ref", "values", "adv", "update_critic", "update_actor")


def _engine_busy(_worker: Any) -> tuple[float, int]:
    from aglverl.verl_plugin.rollout import local_rollout

    stats = local_rollout().server.stats()
    return stats.busy_seconds, stats.generated_tokens


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


async def run(steps: int, warmup: int, rejection_sampling: bool) -> dict[str, Any]:
    config = demo_config(steps, rejection_sampling=rejection_sampling)
    algo = AsyncVERL(config, agent=one_word_agent)
    records: list[dict[str, Any]] = []
    started = time.monotonic()

    def on_step(step: int, metrics: dict[str, float]) -> None:
        worker = algo.trainer.actor_rollout_wg.workers[0]
        busy, tokens = ray.get(worker.__ray_call__.remote(_engine_busy))
        records.append({"end": time.monotonic(), "metrics": dict(metrics), "busy": busy, "tokens": tokens})

    algo.on_step.append(on_step)
    await algo.run(train_dataset=demo_samples(64))
    return summarize(records, warmup, started)


def summarize(records: list[dict[str, Any]], warmup: int, started: float) -> dict[str, Any]:
    measured = records[warmup:]
    first = records[warmup - 1] if warmup else None
    start = first["end"] if first else measured[0]["end"] - measured[0]["metrics"]["timing_s/step"]
    wall = measured[-1]["end"] - start
    busy = measured[-1]["busy"] - (first["busy"] if first else 0.0)
    phases: dict[str, float] = {}
    for record in measured:
        for key, value in record["metrics"].items():
            if key.startswith("timing_s/"):
                phases[key.removeprefix("timing_s/")] = phases.get(key.removeprefix("timing_s/"), 0.0) + value
    gen = phases.get("gen", 0.0)
    shares = {
        "generation": busy / wall,
        "generation_other": (gen - busy) / wall,
        **{name: phases.get(name, 0.0) / wall for name in COMPUTE_PHASES},
        "weight_sync": phases.get("update_weights", 0.0) / wall,
        "checkpoint": phases.get("save_checkpoint", 0.0) / wall,
        "validation": phases.get("testing", 0.0) / wall,
    }
    shares["dead"] = 1.0 - sum(shares.values())
    rollouts = sum(r["metrics"]["step/n_completed"] for r in measured)
    response_tokens = sum(r["metrics"]["response_length/mean"] * r["metrics"]["step/n_rows"] for r in measured)
    return {
        "benchmark": "training",
        "steps_measured": len(measured),
        "warmup_steps": warmup,
        "startup_s": round(records[0]["end"] - records[0]["metrics"]["timing_s/step"] - started, 2),
        "wall_s": round(wall, 3),
        "steps_per_s": round(len(measured) / wall, 3),
        "rollouts_per_s": round(rollouts / wall, 1),
        "generated_tokens_per_s": round(response_tokens / wall, 1),
        "seconds_per_step": {name: round(value / len(measured), 4) for name, value in sorted(phases.items())},
        "shares": {name: round(value, 4) for name, value in shares.items()},
        "target_dead_share": 0.05,
        "met": shares["dead"] < 0.05,
        "first_reward": records[0]["metrics"]["training/reward"],
        "final_reward": records[-1]["metrics"]["training/reward"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out (compilation, warm caches)")
    parser.add_argument("--rejection-sampling", action="store_true")
    args = parser.parse_args()
    result = anyio.run(run, args.steps, args.warmup, args.rejection_sampling)
    emit({**result, "machine": machine_info()})


if __name__ == "__main__":
    main()
