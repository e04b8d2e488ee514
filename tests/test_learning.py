"""The demo's task trained for 20 steps on CPU (verl's V1 trainer, the embedded engine, agents over HTTP): the
reward ends far above where it started, a bound no untrained model meets (it answers "yes" in about one answer
of 500) and that a learning run clears with room to spare (it passes 0.4 around step 10 and 0.9 around 14)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aglverl.cli.demo import run_demo

pytestmark = pytest.mark.anyio

#: The multi-turn task's run (8 prompts x 8 samples a step, to keep CI short): its steps, and a mean reward over
#: the last three that no untrained model meets (it answers "yes" about 1% of the time). Learning starts at the
#: first step with a "yes" in one of its 192 answers: usually step 1, but one run saw none until step 5 (and then
#: 0.065 at step 12), so the run has room for a late start.
MULTITURN_STEPS = 16
MULTITURN_END = 0.15


#: The one-word task's run: its steps, and a mean reward over the last three no untrained model meets. Learning
#: starts at the first step with a "yes" among its 128 answers: step 1 or 2 in five runs out of five (then 0.4
#: at steps 9-11), but about one step in three has none, and one CI run saw none until step 6 (then 0.24 at
#: step 15, four steps behind the others): 20 steps leave room for a start as late as step 10.
DEMO_STEPS = 20
DEMO_END = 0.4


async def test_the_demo_task_learns_in_twenty_steps(tmp_path: Path, tiny_model: Path) -> None:
    summary = await run_demo(steps=DEMO_STEPS, out=tmp_path, json_lines=True)
    rewards = [row["reward"] for row in _rows(tmp_path / "metrics.jsonl")]
    assert len(rewards) == DEMO_STEPS
    start, end = max(rewards[:2]), sum(rewards[-3:]) / 3
    assert start < 0.1, rewards
    assert end > DEMO_END, rewards
    assert summary["final_reward"] == rewards[-1]
    assert (tmp_path / "reward.png").stat().st_size > 0


def _rows(path: Path) -> list[dict]:
    import orjson

    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


async def test_the_multiturn_task_learns_with_merged_conversations(tmp_path: Path, tiny_model: Path) -> None:
    """``aglverl demo --task multiturn``: three calls per rollout, a tool message between them, the reward from
    every answer; each conversation trains as one merged row (fewer trainer tokens than one row per call)."""
    summary = await run_demo(
        steps=MULTITURN_STEPS, out=tmp_path, json_lines=True, task="multiturn", prompts=8
    )
    rows = _rows(tmp_path / "metrics.jsonl")
    rewards = [row["reward"] for row in rows]
    assert len(rewards) == MULTITURN_STEPS
    start, end = max(rewards[:2]), sum(rewards[-3:]) / 3
    assert start < 0.1, rewards
    assert end > MULTITURN_END, rewards
    assert summary["task"] == "multiturn" and summary["trajectory"] == "merge"
    for row in rows:
        assert 0 < row["batch/n_calls"] <= 3 * row["step/n_rollouts"]
        assert row["batch/n_rows"] < row["batch/n_calls"]  # conversations merged (a drifted call: a row more)
        assert row["step/trainer_tokens_per_rollout"] < row["step/trainer_tokens_per_rollout_per_call"]
