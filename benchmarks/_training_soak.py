"""The training soak of ``benchmarks/soak.py --training``: ``AsyncVERL`` (verl's V1 trainer, CPU) for many
steps with agents that fail and hang, SIGKILLed and restarted every ``--kill-every`` steps.

Processes:

- ``trainer`` (this file run as a child, in a session of its own so its Ray processes can be ended with it):
  ``AsyncVERL`` on the one-word task, ``resume_mode: auto``, a checkpoint every ``--save-freq`` steps, the
  daemon's journal next to the checkpoints, short leases (``--lease-seconds``). Its agents fail
  (``--fail-rate``: the agent raises, the rollout is retried while attempts remain) or hang past their lease
  (``--hang-rate``: the lease expires, the task is requeued, the late answer loses to the new attempt's).
  After each trained step it prints one JSON line: the step, the uids of its groups, its metrics, the driver's
  RSS and the journal's size. It logs every training group's rollout ids when dispatched and every answer it
  gave (the producer's ``dispatch`` / ``take_stats`` are observed, not changed);
- this process: starts the trainer, reads its lines, SIGKILLs its whole session at a random moment of the
  step after the ``--kill-every``-th it trained, starts it again until ``--steps`` steps are trained, then works out the
  final lineage (each run continues from the checkpoint it found) and checks it.

Figures: steps trained in the final lineage (every step 1..steps exactly once), rollouts lost (a trained
group's rollout that was never answered nor failed), duplicated (a sample trained in two steps of the lineage,
or a rollout in two trained groups), trained groups no run dispatched (0: a padding row taken for a group
would show here), samples answered by more rollouts than a group has (finished work a restart redid instead
of reusing), journal bytes and driver RSS per step (their slope over the second half of each run, and the
maximum per run).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import orjson
from _common import run_loop
from anyio.streams.buffered import BufferedByteReceiveStream

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _common import machine_info, status_kib

from aglverl.testing.resumable import end_session, resumable_config

SCRIPT = os.path.abspath(__file__)


def trainer_config(directory: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    return resumable_config(
        directory,
        mode=cfg["mode"],
        steps=cfg["steps"],
        save_freq=cfg["save_freq"],
        aglverl={"lease_seconds": cfg["lease_seconds"], "max_attempts": 3},
    )


async def run_trainer(cfg: dict[str, Any]) -> None:
    from aglverl import LLM, AsyncVERL
    from aglverl.cli.demo import demo_samples, one_word_agent

    # verl and Ray print to stdout: the lines for the orchestrator get a descriptor of their own
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)

    def emit(record: dict[str, Any]) -> None:
        out.write(orjson.dumps(record) + b"\n")
        out.flush()

    directory = Path(cfg["dir"])
    run = cfg["run"]
    rng = random.Random(cfg["seed"] * 1000 + run)
    logs = {name: (directory / f"{name}.jsonl").open("ab") for name in ("answers", "groups")}
    latest = directory / "checkpoints" / "latest_checkpointed_iteration.txt"
    journal = directory / "checkpoints" / "aglverl.journal"
    emit({"kind": "start", "run": run, "resumed_from": int(latest.read_text()) if latest.exists() else 0})

    def log(name: str, record: dict[str, Any]) -> None:
        logs[name].write(orjson.dumps(record) + b"\n")
        logs[name].flush()

    async def agent(task: dict[str, Any], llm: LLM) -> float:
        rollout_id = llm.endpoint.split("/rollout/", 1)[1].split("/", 1)[0]
        draw = rng.random()
        if draw < cfg["fail_rate"]:
            raise RuntimeError("soak: the agent failed")
        reward = await one_word_agent(task, llm)
        if draw < cfg["fail_rate"] + cfg["hang_rate"]:
            await anyio.sleep(1.5 * cfg["lease_seconds"])  # hangs past its lease; its answer comes late
        log("answers", {"run": run, "sample": task["id"], "rollout_id": rollout_id})
        return reward

    algo: Any = None

    def observe(daemon: Any) -> None:
        producer = daemon.producer
        dispatch = producer.dispatch

        def logged_dispatch(prompts: Any, **kwargs: Any) -> None:
            dispatch(prompts, **kwargs)
            for prompt in prompts:
                if prompt.partition == "train":
                    log(
                        "groups",
                        {
                            "run": run,
                            "uid": prompt.uid,
                            "rollout_ids": producer._groups[prompt.uid].rollout_ids,
                        },
                    )

        producer.dispatch = logged_dispatch
        take_stats = producer.take_stats

        def logged_take_stats(uids: Any) -> Any:
            stats = take_stats(uids)
            emit(
                {
                    "kind": "step",
                    "run": run,
                    "step": int(algo.trainer.global_steps),
                    # aglverl.verl_v1 leaves verl's padding rows (tagged is_padding) out of a step's groups
                    "uids": sorted(set(uids)),
                    "failed": sum(s.n_rollouts - s.n_completed for s in stats),
                    "rss_kib": status_kib(os.getpid(), "VmRSS:"),
                    "journal_bytes": journal.stat().st_size if journal.exists() else 0,
                    "t": time.monotonic(),
                }
            )
            return stats

        producer.take_stats = logged_take_stats

    algo = AsyncVERL(trainer_config(directory, cfg), agent=agent, progress=False)
    algo.on_serving.append(observe)
    await algo.run(train_dataset=demo_samples(4 * cfg["steps"] + 64))
    emit({"kind": "done", "run": run})


def _lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


def _slope_per_step(values: list[float]) -> float:
    half = values[len(values) // 2 :]
    if len(half) < 3:
        return 0.0
    xs = range(len(half))
    mean_x, mean_y = sum(xs) / len(half), sum(half) / len(half)
    den = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, half, strict=True)) / den if den else 0.0


def prepare(args: argparse.Namespace) -> None:
    """A fresh working directory (a soak never resumes an earlier one's checkpoints)."""
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    args.dir = os.path.abspath(args.dir)


async def training_soak(args: argparse.Namespace) -> dict[str, Any]:
    directory = Path(args.dir)
    rng = random.Random(args.seed)
    cfg = {
        "dir": str(directory),
        "mode": args.mode,
        "steps": args.steps,
        "save_freq": args.save_freq,
        "lease_seconds": args.lease_seconds,
        "fail_rate": args.fail_rate,
        "hang_rate": args.hang_rate,
        "seed": args.seed,
    }
    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    run = 0
    start_failures = 0
    while True:
        run += 1
        command = [sys.executable, SCRIPT, orjson.dumps({**cfg, "run": run}).decode()]
        log_file = (directory / f"run{run}.log").open("wb")
        process = await anyio.open_process(command, stderr=log_file, start_new_session=True)
        assert process.stdout is not None
        lines = BufferedByteReceiveStream(process.stdout)
        info: dict[str, Any] = {"run": run, "killed_after_step": None, "steps": 0}
        finished = False

        async def kill_later(pid: int, delay: float) -> None:
            await anyio.sleep(delay)  # a random moment of the next step: the kill lands anywhere in it
            os.killpg(pid, signal.SIGKILL)

        try:
            with anyio.fail_after(max(60.0, args.max_seconds - (time.monotonic() - started))):
                async with anyio.create_task_group() as tg:
                    last = None
                    while True:  # every line the trainer wrote before it died is read
                        try:
                            line = orjson.loads(await lines.receive_until(b"\n", 1 << 24))
                        except (anyio.EndOfStream, anyio.IncompleteRead):
                            break
                        if line["kind"] == "start":
                            info["resumed_from"] = line["resumed_from"]
                        elif line["kind"] == "step":
                            steps.append(line)
                            info["steps"] += 1
                            progress = f"run {run} step {line['step']}: rss {line['rss_kib'] // 1024} MB"
                            print(
                                f"[soak] {progress}, journal {line['journal_bytes']} B",
                                file=sys.stderr,
                                flush=True,
                            )
                            took = line["t"] - last if last is not None else 2.0
                            last = line["t"]
                            # every kill_every steps this run trained (the step numbers repeat after a resume)
                            kill = info["steps"] % args.kill_every == 0 and line["step"] < args.steps
                            if kill and info["killed_after_step"] is None:
                                info["killed_after_step"] = line["step"]
                                tg.start_soon(kill_later, process.pid, rng.uniform(0.0, took))
                        elif line["kind"] == "done":
                            finished = True
                            break
                    tg.cancel_scope.cancel()
        finally:
            end_session(process.pid)
            await process.wait()
            log_file.close()
        runs.append(info)
        if finished or time.monotonic() - started > args.max_seconds:
            break
        if info["killed_after_step"] is None:
            if info["steps"] == 0 and start_failures < 3:  # e.g. Ray timed out starting on a loaded machine
                start_failures += 1
                info["start_failed"] = True
                continue
            raise RuntimeError(f"run {run} ended without finishing; see {directory / f'run{run}.log'}")
    return summarize(args, runs, steps, directory, time.monotonic() - started, finished)


def summarize(
    args: argparse.Namespace,
    runs: list[dict[str, Any]],
    steps: list[dict[str, Any]],
    directory: Path,
    elapsed: float,
    finished: bool,
) -> dict[str, Any]:
    groups: dict[str, list[str]] = {}
    for row in _lines(directory / "groups.jsonl"):
        groups[row["uid"]] = row["rollout_ids"]
    answers = _lines(directory / "answers.jsonl")
    sample_of = {a["rollout_id"]: a["sample"] for a in answers}
    # samples whose answers outnumber the group (rollout.n): work a restart redid instead of reusing it
    rollouts_of: dict[int, set[str]] = {}
    for a in answers:
        rollouts_of.setdefault(a["sample"], set()).add(a["rollout_id"])
    n = max((len(ids) for ids in groups.values()), default=0)
    answered_again = sum(len(ids) > n for ids in rollouts_of.values())
    resumed = {info["run"]: info.get("resumed_from", 0) for info in runs}
    # final lineage, newest run first: a run's steps after the checkpoint it resumed from, up to where the
    # next run of the lineage took over
    lineage: dict[int, dict[str, Any]] = {}
    end = args.steps
    for info in reversed([info for info in runs if not info.get("start_failed")]):
        start = resumed[info["run"]]
        for row in steps:
            if row["run"] == info["run"] and start < row["step"] <= end and row["step"] not in lineage:
                lineage[row["step"]] = row
        end = min(end, start)
        if end == 0:
            break
    trained = sorted(lineage)
    in_groups: Counter[str] = Counter()
    samples: Counter[int] = Counter()
    unanswered = 0
    for row in lineage.values():
        for uid in row["uids"]:
            ids = groups.get(uid, [])
            in_groups.update(ids)
            answered = [rid for rid in ids if rid in sample_of]
            if answered:
                samples[sample_of[answered[0]]] += 1
    failed = sum(row["failed"] for row in lineage.values())
    for row in lineage.values():
        for uid in row["uids"]:
            unanswered += sum(rid not in sample_of for rid in groups.get(uid, []))
    # a trained group no run dispatched (e.g. verl's padding taken for a group): the figures above would not see it
    undispatched = sorted({uid for row in lineage.values() for uid in row["uids"] if uid not in groups})
    lost = max(0, unanswered - failed)  # a trained group's rollout neither answered nor failed
    duplicated = sum(c - 1 for c in in_groups.values() if c > 1) + sum(
        c - 1 for c in samples.values() if c > 1
    )
    per_run = []
    for info in runs:
        mine = [s for s in steps if s["run"] == info["run"]]
        per_run.append(
            {
                **info,
                "rss_mb_max": round(max((s["rss_kib"] for s in mine), default=0) / 1024, 1),
                "rss_mb_slope_per_step_2nd_half": round(
                    _slope_per_step([s["rss_kib"] / 1024 for s in mine]), 3
                ),
                "journal_bytes_max": max((s["journal_bytes"] for s in mine), default=0),
                "journal_bytes_slope_per_step_2nd_half": round(
                    _slope_per_step([float(s["journal_bytes"]) for s in mine]), 1
                ),
            }
        )
    missing = [s for s in range(1, args.steps + 1) if s not in lineage]
    return {
        "benchmark": "training soak",
        "machine": machine_info(),
        "args": vars(args),
        "finished": finished,
        "elapsed_s": round(elapsed, 1),
        "steps_trained": len(trained),
        # a step saved by a run killed before it logged the step has no line of its own (verl logs after saving)
        "steps_missing_from_lineage": missing,
        "restarts": len(runs) - 1,
        "rollouts_lost": lost,
        "rollouts_duplicated": duplicated,
        "rollouts_failed_in_trained_steps": failed,
        "trained_groups_never_dispatched": undispatched,
        "samples_answered_more_than_n": answered_again,
        "runs": per_run,
        "journal_bytes_per_step": [s["journal_bytes"] for s in steps],
        "rss_mb_per_step": [round(s["rss_kib"] / 1024, 1) for s in steps],
        "ok": finished
        and lost == 0
        and duplicated == 0
        and not undispatched
        and len(missing) <= len(runs) - 1,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=200, help="training steps (the final lineage's)")
    p.add_argument(
        "--kill-every", type=int, default=50, help="SIGKILL the trainer in the step after its k-th"
    )
    p.add_argument("--save-freq", type=int, default=10, help="verl's trainer.save_freq")
    p.add_argument("--mode", default="colocate_async", choices=["sync", "colocate_async", "separate_async"])
    p.add_argument("--fail-rate", type=float, default=0.10, help="fraction of agent attempts that raise")
    p.add_argument(
        "--hang-rate", type=float, default=0.02, help="fraction of attempts that hang past their lease"
    )
    p.add_argument("--training-lease-seconds", dest="lease_seconds", type=float, default=5.0)
    p.add_argument("--dir", default="/tmp/aglverl-training-soak", help="checkpoints, journal and logs")


if __name__ == "__main__":
    run_loop(run_trainer, orjson.loads(sys.argv[1]))
