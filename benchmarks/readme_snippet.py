"""The README's ``AsyncVERL`` snippet, as written, against ``examples/one_word.py``: seconds and trainer tokens per
step, in one run. Prints JSON.

Issue 28 measured the snippet at 48-55 s a step against one_word's 1.3-5.7 s (verl's default
``ppo_mini_batch_size``, 256, made verl pad each 16-prompt step with 1,920 rows of no loss: 249,500 trainer
tokens against 3,705). Target: the snippet within 1.5x of one_word's median step time. Both run ``--steps``
steps (only ``total_training_steps`` changes; the snippet keeps its validation and checkpoints, in a scratch
directory), one after the other in this process, each with its own Ray; the first step of each (compilation,
warm-up) is left out of the medians.

    python benchmarks/readme_snippet.py --steps 10
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

from _common import run_loop

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _common import emit, machine_info

from aglverl.algorithm import AsyncVERL
from aglverl.testing.readme import load_snippet, readme_snippet, with_steps

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _one_word() -> Any:
    spec = importlib.util.spec_from_file_location("one_word", EXAMPLES / "one_word.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def timed(name: str, config: Mapping[str, Any], agent: Any, train: Any, val: Any) -> dict[str, Any]:
    """One training run in a scratch directory: per-step seconds and trainer tokens, the rewards."""
    steps: list[Mapping[str, float]] = []
    started = time.monotonic()
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix=f"aglverl-{name}-") as scratch:
        os.chdir(scratch)  # the snippet's checkpoints land here, not beside a previous run's
        try:
            algo = AsyncVERL(config, agent=agent, progress=False)
            algo.on_step.append(lambda step, metrics: steps.append(dict(metrics)))
            await algo.run(train, val)
        finally:
            os.chdir(cwd)
    later = steps[1:] or steps
    return {
        "steps": len(steps),
        "wall_s": round(time.monotonic() - started, 1),
        "seconds_per_step_median": round(statistics.median(m["timing_s/step"] for m in later), 3),
        "trainer_tokens_per_step": round(statistics.mean(m["perf/total_num_tokens"] for m in later)),
        "update_actor_s_median": round(statistics.median(m["timing_s/update_actor"] for m in later), 3),
        "ppo_mini_batch_size": int(algo.config.actor_rollout_ref.actor.ppo_mini_batch_size),
        "first_reward": round(steps[0]["training/reward"], 4),
        "final_reward": round(steps[-1]["training/reward"], 4),
    }


async def main(steps: int) -> None:
    snippet = load_snippet(with_steps(readme_snippet(), steps))
    one_word = _one_word()
    with redirect_stdout(sys.stderr):  # what verl prints (its console logger), off the JSON line
        readme = await timed("readme", snippet.config, snippet.agent, snippet.train_tasks, snippet.val_tasks)
        example = await timed(
            "one_word", one_word.make_config(steps), one_word.agent, one_word.make_tasks("yes"), None
        )
    ratio = readme["seconds_per_step_median"] / example["seconds_per_step_median"]
    emit(
        {
            "benchmark": "readme_snippet",
            "steps": steps,
            "readme_snippet": readme,
            "one_word": example,
            "step_time_ratio": round(ratio, 2),
            "target": "readme snippet's median step time <= 1.5x one_word's",
            "met": ratio <= 1.5,
            "machine": machine_info(),
        }
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10)
    run_loop(main, parser.parse_args().steps)
