"""The demo's task trained for 15 steps on CPU (verl's V1 trainer, the embedded engine, agents over HTTP): the
reward ends far above where it started, a bound no untrained model meets (it answers "yes" about 1% of the
time) and that a learning run clears with room to spare (it passes 0.5 around step 11 and 0.9 around 15)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aglverl.demo import run_demo

pytestmark = pytest.mark.anyio


async def test_the_demo_task_learns_in_fifteen_steps(tmp_path: Path, tiny_model: Path) -> None:
    summary = await run_demo(steps=15, out=tmp_path, json_lines=True)
    rewards = [row["reward"] for row in _rows(tmp_path / "metrics.jsonl")]
    assert len(rewards) == 15
    start, end = max(rewards[:2]), sum(rewards[-3:]) / 3
    assert start < 0.1, rewards
    assert end > 0.4, rewards
    assert summary["final_reward"] == rewards[-1]
    assert (tmp_path / "reward.png").stat().st_size > 0


def _rows(path: Path) -> list[dict]:
    import orjson

    return [orjson.loads(line) for line in path.read_bytes().splitlines()]
