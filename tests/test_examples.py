"""The examples run as written (the CPU ones, a couple of steps each); the GPU recipe is a valid verl config."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from aglverl.algorithm import compose_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

pytestmark = pytest.mark.usefixtures("tiny_model")  # the session's tiny model (AGLVERL_HOME) for the children


def _run(name: str, *args: str) -> str:
    """Run ``examples/<name>`` as a user would; returns its stdout (fails with its stderr's tail)."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_one_word_example_trains_and_reports_its_reward() -> None:
    out = _run("one_word.py", "--steps", "2")
    assert re.search(r"final training reward: \d\.\d{3}", out), out[-2000:]


def test_calculator_example_trains_one_row_per_turn() -> None:
    out = _run("calculator.py", "--steps", "2")
    rows = float(re.search(r"rows per rollout (\d+\.\d+)", out).group(1))  # type: ignore[union-attr]
    assert 1.0 < rows <= 3.0  # the tiny model rarely answers at once: most rollouts take several turns


def test_openai_agents_example_trains_through_the_responses_api() -> None:
    out = _run("openai_agents_tool.py", "--steps", "2")
    rows = re.search(r"final: reward \d\.\d{3}, rows (\d+)", out)
    assert rows is not None and int(rows.group(1)) > 0, out[-2000:]  # every model call a row


def test_langgraph_example_trains_through_the_responses_api() -> None:
    out = _run("langgraph_tool.py", "--steps", "2", "--api", "responses")
    rows = re.search(r"final: reward \d\.\d{3}, rows (\d+)", out)
    assert rows is not None and int(rows.group(1)) > 0, out[-2000:]


def test_remote_agents_example_runs_its_agents_in_another_process() -> None:
    out = _run("remote_agents.py", "--steps", "2", "--concurrency", "8")
    agents = re.search(r"agents: pid (\d+) -> (http://127\.0\.0\.1:\d+)", out)
    assert agents is not None, out[-2000:]
    assert "final training reward:" in out


def test_gpu_recipe_is_a_valid_verl_config() -> None:
    spec = importlib.util.spec_from_file_location("train_gpu", EXAMPLES / "train_gpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config, options = compose_config(module.recipe("tiny", 8))
    assert config.actor_rollout_ref.rollout.name == "vllm"
    assert config.trainer.n_gpus_per_node == 8 and config.trainer.device == "cuda"
    assert options.platform == "gpu"
    # verl's GPU defaults for its vLLM rollout, none of the CPU platform's (aglverl.algorithm.VLLM_CPU_ROLLOUT)
    rollout = config.actor_rollout_ref.rollout
    assert "enable_sleep_mode" not in rollout  # verl's dataclass default, True, applies
    assert (rollout.free_cache_engine, rollout.enforce_eager) == (True, False)
    assert (rollout.gpu_memory_utilization, rollout.max_num_seqs, rollout.max_model_len) == (0.6, 256, None)
    assert rollout.mode == "async" and config.actor_rollout_ref.actor.strategy == "fsdp"
