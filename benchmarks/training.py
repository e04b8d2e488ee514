"""The demo's training work on verl's V1 trainer next to the legacy path (commit 501e9c1). Prints one JSON object.

Each run is a child process that trains the demo task (``aglverl demo``'s config: GRPO, 16 prompts x 8
samples, 8-token answers, the tiny model on CPU, 128 agents in the process) for ``--steps`` steps with
``AsyncVERL`` and reports every step. Implementations:

- ``v1`` — this checkout: verl's V1 trainer (``trainer.v1.trainer_mode``, ``sync`` by default), the daemon as
  its trajectory producer through TransferQueue;
- ``legacy`` — the code as it was at commit ``501e9c1`` (``git archive 501e9c1 aglverl``, put first on the
  child's ``PYTHONPATH``, Ray's workers included): verl's legacy ``RayPPOTrainer`` subclass.

Runs alternate between implementations (``--runs`` each) so that a drifting machine affects both alike. Per
implementation (median over runs): seconds per step (median over the steps after ``--warmup``), start-up
(process start to the first step's start), time to reward 0.9 (from the first step's start, and from process
start), and how the steps' wall time split between the engine generating (its own busy counter, read in
verl's worker after every step), the trainer computing (verl's timed phases: log-probs, reference, values,
advantages, updates, weight sync, checkpoints), both, and neither. For ``v1`` the daemon's own split (calls in
flight at the proxy against the trainer's compute) is reported too. The target: ``v1`` at most 15% slower to
reward 0.9 than ``legacy``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _common import emit, machine_info  # noqa: E402

LEGACY_COMMIT = "501e9c1"
COMPUTE_PHASES = ("old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "update_weights", "save_checkpoint")
TARGET_RATIO = 1.15


# ---------------------------------------------------------------------------------------------- child
def _engine_busy(_worker: Any) -> tuple[float, int]:
    from aglverl.verl_plugin.rollout import local_rollout

    stats = local_rollout().server.stats()
    return stats.busy_seconds, stats.generated_tokens


def child(steps: int, mode: str, impl: str) -> None:
    """Train the demo task; one JSON line per step on stdout, then ``{"done": ...}``."""
    import anyio
    import ray

    from aglverl.algorithm import AsyncVERL
    from aglverl.demo import demo_config, demo_samples, one_word_agent

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    started = time.monotonic()
    config = demo_config(steps)
    if impl == "v1":
        config["trainer"]["v1"] = {"trainer_mode": mode}
    algo = AsyncVERL(config, agent=one_word_agent, progress=False)
    _start_ray(algo.config, impl)

    def on_step(step: int, metrics: dict[str, float]) -> None:
        worker = algo.trainer.actor_rollout_wg.workers[0]
        busy, tokens = ray.get(worker.__ray_call__.remote(_engine_busy))
        row = {"step": step, "end": time.monotonic() - started, "busy": busy, "tokens": tokens, "metrics": metrics}
        sys.stdout.buffer.write(orjson.dumps(row, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
        sys.stdout.flush()

    algo.on_step.append(on_step)
    anyio.run(algo.run, demo_samples(64))
    sys.stdout.buffer.write(orjson.dumps({"done": time.monotonic() - started}) + b"\n")


def _start_ray(config: Any, impl: str) -> None:
    """Start Ray here (AsyncVERL then joins it) the same way for both implementations, with the plugin's
    environment for every process Ray starts and, for ``legacy``, its source first on their ``PYTHONPATH``
    (a Ray started by AsyncVERL would give its workers the installed package, this checkout)."""
    import ray
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    from aglverl import algorithm
    from aglverl.verl_plugin.patches import loopback_only_ray

    runtime_env = get_ppo_ray_runtime_env(config)
    env = runtime_env.setdefault("env_vars", {})
    env.update(algorithm.PLATFORM_ENV)
    if hasattr(algorithm, "_transfer_queue_threads"):
        env.update(algorithm._transfer_queue_threads())
    if impl == "legacy":
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    loopback_only_ray()
    ray.init(num_cpus=16, num_gpus=1, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env)


# ---------------------------------------------------------------------------------------------- parent
def legacy_source(directory: Path) -> Path:
    """The ``aglverl`` package as it was at :data:`LEGACY_COMMIT`, extracted under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", LEGACY_COMMIT, "aglverl"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(directory)], input=archive, check=True)
    return directory


def run_child(impl: str, steps: int, mode: str, legacy: Path | None, log: Path) -> list[dict[str, Any]]:
    env = dict(os.environ)
    if impl == "legacy":
        assert legacy is not None
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(legacy), env.get("PYTHONPATH")]))
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--impl", impl, "--steps", str(steps), "--mode", mode]
    # Ray puts the driver's working directory first on its workers' sys.path: never this checkout's root
    with log.open("wb") as stderr:
        out = subprocess.run(
            command, env=env, cwd=log.parent, stdout=subprocess.PIPE, stderr=stderr, check=False, timeout=1800
        )
    rows = [orjson.loads(line) for line in out.stdout.splitlines() if line.startswith(b"{")]
    if out.returncode != 0 or not rows or "done" not in rows[-1]:
        raise RuntimeError(f"{impl} run failed (exit {out.returncode}); see {log}")
    return rows[:-1]


def summarize_run(rows: list[dict[str, Any]], warmup: int, impl: str) -> dict[str, Any]:
    first_start = rows[0]["end"] - rows[0]["metrics"]["timing_s/step"]
    measured = rows[warmup:]
    seconds = [b["end"] - a["end"] for a, b in zip(rows[warmup - 1 : -1], measured, strict=True)] if warmup else []
    start = rows[warmup - 1]["end"] if warmup else first_start
    wall = measured[-1]["end"] - start
    busy = measured[-1]["busy"] - (rows[warmup - 1]["busy"] if warmup else 0.0)
    compute = sum(r["metrics"].get(f"timing_s/{p}", 0.0) for r in measured for p in COMPUTE_PHASES)
    reach = next((r for r in rows if r["metrics"].get("training/reward", 0.0) >= 0.9), None)
    tokens = measured[-1]["tokens"] - (rows[warmup - 1]["tokens"] if warmup else 0)
    result: dict[str, Any] = {
        "steps": len(rows),
        "startup_s": round(first_start, 2),
        "seconds_per_step_median": round(statistics.median(seconds), 3) if seconds else None,
        "seconds_per_step_mean": round(wall / len(measured), 3),
        "step_reaching_0.9": reach["step"] if reach else None,
        "time_to_0.9_training_s": round(reach["end"] - first_start, 2) if reach else None,
        "time_to_0.9_total_s": round(reach["end"], 2) if reach else None,
        "final_reward": rows[-1]["metrics"].get("training/reward"),
        "engine_tokens_per_s": round(tokens / wall, 1),
        # lockstep: the engine's busy time and the trainer's phases do not overlap, so "both" is ~0
        "shares_engine_counter": {
            "generating": round(busy / wall, 4),
            "computing": round(compute / wall, 4),
            "neither": round(max(0.0, 1 - (busy + compute) / wall), 4),
        },
        "phases_s_per_step": {
            key.removeprefix("timing_s/"): round(statistics.mean(r["metrics"].get(key, 0.0) for r in measured), 4)
            for key in sorted({k for r in measured for k in r["metrics"] if k.startswith("timing_s/")})
        },
    }
    if impl == "v1":
        result["shares_daemon"] = {
            name: round(statistics.mean(r["metrics"][f"step/share_{name}"] for r in measured), 4)
            for name in ("generating_only", "computing_only", "both", "neither")
        }
    return result


def median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.median(values), 3) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impls", default="legacy,v1", help="comma-separated: legacy, v1")
    parser.add_argument("--mode", default="sync", help="the v1 trainer mode (trainer.v1.trainer_mode)")
    parser.add_argument("--runs", type=int, default=2, help="runs per implementation, alternating")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the per-step figures")
    parser.add_argument("--logs", default=None, help="directory for the children's stderr (default: a temp dir)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", default="v1", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.steps, args.mode, args.impl)
        return

    impls = [impl.strip() for impl in args.impls.split(",") if impl.strip()]
    scratch = Path(tempfile.mkdtemp(prefix="aglverl-bench-"))
    logs = Path(args.logs) if args.logs else scratch
    logs.mkdir(parents=True, exist_ok=True)
    try:
        legacy = legacy_source(scratch / "legacy") if "legacy" in impls else None
        runs: dict[str, list[dict[str, Any]]] = {impl: [] for impl in impls}
        for i in range(args.runs):
            for impl in impls:
                rows = run_child(impl, args.steps, args.mode, legacy, logs / f"{impl}-{i}.log")
                runs[impl].append(summarize_run(rows, args.warmup, impl))
                print(f"{impl} run {i}: {orjson.dumps(runs[impl][-1]).decode()}", file=sys.stderr, flush=True)
    finally:
        if not args.logs:
            shutil.rmtree(scratch, ignore_errors=True)
    summary = {
        impl: {
            key: median_of(impl_runs, key)
            for key in (
                "startup_s",
                "seconds_per_step_median",
                "seconds_per_step_mean",
                "step_reaching_0.9",
                "time_to_0.9_training_s",
                "time_to_0.9_total_s",
                "engine_tokens_per_s",
            )
        }
        for impl, impl_runs in runs.items()
    }
    result: dict[str, Any] = {"benchmark": "training", "mode": args.mode, "steps": args.steps, "summary": summary, "runs": runs}
    if {"legacy", "v1"} <= set(runs):
        ratios = {}
        for key in ("time_to_0.9_training_s", "time_to_0.9_total_s", "seconds_per_step_median"):
            a, b = summary["v1"][key], summary["legacy"][key]
            ratios[key] = round(a / b, 3) if a and b else None
        result["v1_over_legacy"] = ratios
        result["target"] = f"v1 time to 0.9 <= {TARGET_RATIO} x legacy"
        ratio = ratios["time_to_0.9_training_s"]
        result["met"] = ratio is not None and ratio <= TARGET_RATIO
    emit({**result, "machine": machine_info()})


if __name__ == "__main__":
    main()
