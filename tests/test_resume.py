"""A training process killed with SIGKILL mid-step and started again: it resumes from verl's checkpoint and the
daemon's journal, trains the remaining steps, and over both runs every sample is answered exactly ``n`` times
(the killed step's finished rollouts are reused, its unfinished ones redone under their own rollout ids)."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import orjson
import pytest

from aglverl.testing.resumable import end_session

HELPER = Path(__file__).parent / "helpers" / "train_until_killed.py"


def _run(directory: Path, run: int, mode: str = "sync", *extra: str, helper: Path = HELPER) -> int:
    """Run the helper in a session of its own; whatever it leaves behind (Ray's processes) is ended."""
    process = subprocess.Popen(
        [sys.executable, str(helper), str(directory), str(run), mode, *extra],
        start_new_session=True,
        stdout=(directory / f"run{run}.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        return process.wait(timeout=900)
    finally:
        end_session(process.pid)


def _lines(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


def test_a_run_killed_mid_step_resumes_without_losing_or_repeating_a_rollout(
    tmp_path: Path, tiny_model: Path
) -> None:
    assert _run(tmp_path, 1) == -signal.SIGKILL, (tmp_path / "run1.log").read_text()[-3000:]
    trained = [(row["run"], row["step"]) for row in _lines(tmp_path / "steps.jsonl")]
    assert trained == [(1, 1), (1, 2)]  # killed during step 3, after checkpoint 2
    assert _run(tmp_path, 2) == 0, (tmp_path / "run2.log").read_text()[-3000:]

    steps = _lines(tmp_path / "steps.jsonl")
    assert [(row["run"], row["step"]) for row in steps] == [
        (1, 1),
        (1, 2),
        (2, 3),
        (2, 4),
    ]  # none trained twice
    assert all(row["step/n_completed"] == 4 and row["step/n_rows"] == 4 for row in steps)

    answers = _lines(tmp_path / "answers.jsonl")
    per_rollout = Counter(a["rollout_id"] for a in answers)
    assert max(per_rollout.values()) == 1, "a rollout was answered twice"
    rollouts_of: dict[int, set[str]] = defaultdict(set)
    runs_of: dict[int, Counter[int]] = defaultdict(Counter)
    for a in answers:
        rollouts_of[a["sample"]].add(a["rollout_id"])
        runs_of[a["sample"]][a["run"]] += 1
    assert {sample: len(ids) for sample, ids in rollouts_of.items()} == {sample: 2 for sample in range(8)}
    # step 3's samples: two rollouts answered before the kill were reused, the two others redone after it
    assert runs_of[4] + runs_of[5] == Counter({1: 2, 2: 2})
    assert sum(runs_of[s][1] for s in range(4)) == 8 and sum(runs_of[s][2] for s in range(6, 8)) == 4


def test_an_asynchronous_run_killed_mid_rollout_resumes_without_losing_or_repeating_a_rollout(
    tmp_path: Path, tiny_model: Path
) -> None:
    """colocate_async: rollouts run ahead of the trainer, so groups of later steps are in flight when the
    process dies. verl restores TransferQueue from its checkpoint and re-issues the in-flight prompts under
    their uids; the daemon's journal gives back what their agents had already answered."""
    assert _run(tmp_path, 1, "colocate_async") == -signal.SIGKILL, (tmp_path / "run1.log").read_text()[-3000:]
    first = [row["step"] for row in _lines(tmp_path / "steps.jsonl")]
    latest = tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt"
    checkpointed = int(latest.read_text()) if latest.exists() else 0
    # verl saves a step's checkpoint before it logs the step: the kill may fall between the two, and then the
    # step was trained (and saved) without its line.
    assert first in (list(range(1, checkpointed + 1)), list(range(1, checkpointed)))
    assert _run(tmp_path, 2, "colocate_async") == 0, (tmp_path / "run2.log").read_text()[-3000:]
    steps = _lines(tmp_path / "steps.jsonl")
    trained = [(row["run"], row["step"]) for row in steps]
    assert [step for run, step in trained if run == 1] == first
    # resumed after the last checkpoint: no step trained twice, none left out
    assert [step for run, step in trained if run == 2] == list(range(checkpointed + 1, 5))
    answers = _lines(tmp_path / "answers.jsonl")
    assert max(Counter(a["rollout_id"] for a in answers).values()) == 1, "a rollout was answered twice"
    rollouts_of: dict[int, set[str]] = defaultdict(set)
    runs_of: dict[int, set[int]] = defaultdict(set)
    for a in answers:
        rollouts_of[a["sample"]].add(a["rollout_id"])
        runs_of[a["sample"]].add(a["run"])
    assert max(len(ids) for ids in rollouts_of.values()) == 2  # no sample answered more than rollout.n times
    # the group caught half answered by the kill was finished in the second run, its first answer reused
    assert any(runs == {1, 2} and len(rollouts_of[s]) == 2 for s, runs in runs_of.items())
    for (
        row
    ) in steps:  # a step's groups: answered in this process (counted), or restored from verl's checkpoint
        restored = row["step/n_groups_restored"]
        assert row["step/n_completed"] == 2 * (2 - restored)


@pytest.fixture(autouse=True)
def _no_ray_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # each run starts (and ends) a Ray of its own


KILL_LOOP = Path(__file__).parent / "helpers" / "train_kill_loop.py"


def test_a_run_killed_at_three_random_moments_trains_every_step_once_and_every_sample_n_times(
    tmp_path: Path, tiny_model: Path
) -> None:
    """In a mode drawn with the moments (colocate_async or sync, each about 3.5 minutes here: one per run keeps
    CI in its budget; the seed in a failure's message names both), 10 steps, a checkpoint every 3 (colocate_async: rollouts run ahead of the trainer, across steps and
    checkpoints; sync: a restart replays up to two steps since its checkpoint), SIGKILL at a random agent
    answer, in the middle of a checkpoint save, and at another random answer; restarted each time with
    resume_mode: auto. Over the final lineage (each run continues from the checkpoint it found), every step is
    trained once and every trained sample was answered exactly n = 2 times (by rollouts that were answered once
    each: reused across a kill, never redone after an answer)."""
    import random

    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    mode = rng.choice(["colocate_async", "sync"])
    moments = [f"answer:{rng.randint(6, 24)}", "save", f"answer:{rng.randint(4, 16)}", "none"]
    for run, moment in enumerate(moments, 1):
        if moment == "save":  # the next checkpoint this run will save
            resumed = (
                int(latest.read_text())
                if (latest := tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").exists()
                else 0
            )
            moment = f"save:{resumed + 3}"
        code = _run(tmp_path, run, mode, moment, helper=KILL_LOOP)
        log = (tmp_path / f"run{run}.log").read_text()[-3000:]
        assert code == (0 if moment == "none" else -signal.SIGKILL), (
            f"{mode}, seed {seed}, run {run} ({moment}):\n{log}"
        )

    runs = {row["run"]: row for row in _lines(tmp_path / "runs.jsonl")}
    steps = _lines(tmp_path / "steps.jsonl")
    groups = {row["uid"]: row["rollout_ids"] for row in _lines(tmp_path / "groups.jsonl")}
    answers = _lines(tmp_path / "answers.jsonl")
    context = f"{mode}, seed {seed}, moments {moments}, runs {runs}"
    assert max(Counter(a["rollout_id"] for a in answers).values()) == 1, (
        f"a rollout was answered twice ({context})"
    )
    sample_of = {a["rollout_id"]: a["sample"] for a in answers}

    # The final lineage: the last run's steps after the checkpoint it resumed from, and before that, the steps
    # of the run that saved that checkpoint, back to the checkpoint that run resumed from, and so on.
    lineage: dict[int, dict] = {}
    end, run = 10, len(moments)
    while end > 0:
        start = runs[run]["resumed_from"]
        trained = [row for row in steps if row["run"] == run]
        numbers = [row["step"] for row in trained]
        assert numbers == sorted(set(numbers)), f"run {run} trained a step twice: {numbers} ({context})"
        mine = {row["step"]: row for row in trained if start < row["step"] <= end}
        # verl saves a step's checkpoint before logging it: a kill between the two leaves its last step unlogged
        assert set(mine) in ({*range(start + 1, end + 1)}, {*range(start + 1, end)}), (
            run,
            sorted(mine),
            context,
        )
        lineage.update(mine)
        if start == 0:
            break
        # the run that saved checkpoint `start`: the latest earlier run that resumed before it and got there
        run = max(
            r
            for r in range(1, run)
            if runs[r]["resumed_from"] < start
            and any(row["run"] == r and row["step"] >= start - 1 for row in steps)
        )
        end = start
    answered_in: Counter[int] = Counter()
    for number, row in sorted(lineage.items()):
        for uid in row["uids"]:
            for rollout_id in groups[uid]:
                assert rollout_id in sample_of, f"step {number} trained an unanswered rollout ({context})"
                answered_in[sample_of[rollout_id]] += 1
    assert answered_in and set(answered_in.values()) == {2}, (answered_in, context)
    samples = [sample_of[groups[uid][0]] for row in lineage.values() for uid in row["uids"]]
    assert len(samples) == len(set(samples)), f"a sample was trained in two steps ({context})"
