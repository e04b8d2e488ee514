"""The examples run as written (the CPU ones; the cheapest to the end of its training, the others a couple of
steps), the README's ``AsyncVERL`` snippet as written (short) and again in the same directory, and the GPU recipe
is a valid verl config that stops at once without CUDA."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from aglverl.algorithm import compose_config
from aglverl.testing.readme import readme_snippet, with_steps

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

pytestmark = pytest.mark.usefixtures("tiny_model")  # the session's tiny model (AGLVERL_HOME) for the children


def _run(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``examples/<name>`` as a user would, in ``cwd``; fails with its stderr's tail unless it exits 0."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        cwd=cwd,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_one_word_example_trains_quietly(tmp_path: Path) -> None:
    """Three steps: the console shows the bar and a few lines; verl's ~200 metrics a step go to the log file,
    every step's metrics to metrics.jsonl. Its learning (0.9 within its 25 default steps) is the demo's: the same
    task and settings (``aglverl demo``; ``make demo`` in CI fails unless the reward reaches 0.9, and
    ``test_learning.py`` trains it 15 steps)."""
    done = _run("one_word.py", "--steps", "3", cwd=tmp_path)
    final = float(re.search(r"final training reward: (\d\.\d{3})", done.stdout).group(1))  # type: ignore[union-attr]
    assert 0.0 <= final <= 1.0, done.stdout
    out = tmp_path / "one_word-out"
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    assert "actor/pg_loss" in (out / "train.log").read_text()  # verl's console logger, off the console
    assert "actor/pg_loss" not in done.stdout + done.stderr and len(done.stdout.splitlines()) == 2


def _snippet(tmp_path: Path, steps: int) -> Path:
    script = tmp_path / "snippet.py"
    script.write_text(with_steps(readme_snippet(), steps))
    return script


def _run_snippet(script: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, script.name],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        cwd=script.parent,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_the_readme_snippet_runs_as_written_and_a_second_run_in_its_directory_resumes(tmp_path: Path) -> None:
    """The README's snippet (only its step count lowered): it trains, says it set the mini-batch verl's default
    made 16x too large, and checkpoints under the script's name. Run again in the same directory it trains
    nothing, says so and prints the same metrics; with one more step it announces the resume and trains it."""
    script = _snippet(tmp_path, 2)
    first = _run_snippet(script)
    printed = first.stdout.splitlines()[-1]  # after what verl prints (its console logger: the CPU default)
    assert re.fullmatch(r"training reward \d\.\d\d, validation reward \d\.\d\d", printed), first.stdout[
        -2000:
    ]
    assert "set actor_rollout_ref.actor.ppo_mini_batch_size = 16: verl's default (256)" in first.stderr
    checkpoints = tmp_path / "checkpoints" / "aglverl" / "snippet"
    assert (checkpoints / "global_step_2" / "aglverl_metrics.json").is_file()

    again = _run_snippet(script)
    assert (
        f"nothing left to train: the checkpoint {checkpoints / 'global_step_2'} is step 2 of 2"
        in again.stderr
    )
    assert "Started a local Ray instance" not in again.stderr  # decided before anything started
    assert again.stdout.splitlines() == [printed]  # the same metrics, saved beside the checkpoint

    longer = _run_snippet(_snippet(tmp_path, 3))
    assert f"resuming from step 2 of 3: {checkpoints / 'global_step_2'}" in longer.stderr
    assert (checkpoints / "global_step_3" / "aglverl_metrics.json").is_file()


def _final(out: str) -> dict[str, float]:
    """The numbers of an example's ``final: ...`` line, by name (``reward``, ``rows per rollout``, ...)."""
    line = next(line for line in out.splitlines() if line.startswith("final: "))
    return {name: float(value) for name, value in re.findall(r"([a-z][a-z ]*?) (\d+(?:\.\d+)?)", line[7:])}


def test_calculator_example_calls_its_tool_and_merges_each_conversation(tmp_path: Path) -> None:
    final = _final(_run("calculator.py", "--steps", "2", cwd=tmp_path).stdout)
    assert final["tool runs"] > 0  # the first call of every rollout is a tool call (tool_choice "required")
    # exactly one tool call (parallel_tool_calls false), always complete, then the answer: every rollout
    assert final["calls per rollout"] >= 2.0
    assert final["rows per rollout"] < final["calls per rollout"]  # token-in chat: the calls merged


def test_openai_agents_example_calls_its_tool_through_the_responses_api(tmp_path: Path) -> None:
    final = _final(_run("openai_agents_tool.py", "--steps", "2", cwd=tmp_path).stdout)
    assert final["tool runs"] > 0 and final["rows"] > 0  # every model call a row


def test_langgraph_example_calls_its_tool_and_merges_each_run_on_the_responses_api(tmp_path: Path) -> None:
    final = _final(_run("langgraph_tool.py", "--steps", "2", "--api", "responses", cwd=tmp_path).stdout)
    assert final["tool runs"] > 0 and final["calls per rollout"] >= 1.5
    assert final["rows per rollout"] < final["calls per rollout"]


def test_remote_agents_example_runs_its_agents_in_another_process_and_stops_them_first(
    tmp_path: Path,
) -> None:
    done = _run("remote_agents.py", "--steps", "2", "--concurrency", "16", cwd=tmp_path)
    assert re.search(r"agents: pid (\d+) -> (http://127\.0\.0\.1:\d+)", done.stderr), done.stderr[-2000:]
    assert "final training reward:" in done.stdout
    # the agents were stopped while the task server still answered: no line about it being unreachable
    assert "unreachable" not in done.stderr and "Connection refused" not in done.stderr, done.stderr[-2000:]


def _steps(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_agent_lightning_agent_class_example_trains_with_its_config_section(tmp_path: Path) -> None:
    """An Agent Lightning v1.0 agent class and Agent Lightning's config section, trained by one command: every
    rollout ran as its own process (its output in a log file each) and reported its reward."""
    done = _run("agl_agent.py", "--steps", "1", cwd=tmp_path)
    assert "final training reward:" in done.stdout
    out = tmp_path / "agl_agent-out"
    (step,) = _steps(out)
    assert step["step/n_completed"] == 128 and step["step/n_failed"] == 0
    assert len(list((out / "agent_logs").glob("*.log"))) == 128
    assert "Agent Lightning API and proxy path at http://127.0.0.1:" in done.stderr


@pytest.mark.skipif(
    not (shutil.which("curl") and shutil.which("jq")), reason="word_agent.sh needs curl and jq"
)
def test_command_example_trains_a_shell_script_agent(tmp_path: Path) -> None:
    done = _run("command_agent.py", "--steps", "1", cwd=tmp_path)
    out = tmp_path / "command_agent-out"
    (step,) = _steps(out)
    assert step["step/n_failed"] == 0 and step["step/n_completed"] == 64
    logs = sorted((out / "agent_logs").glob("*.log"))
    assert len(logs) == 64 and logs[0].read_text().startswith("reward ")
    assert "final training reward:" in done.stdout


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


def test_gpu_recipe_stops_at_once_without_cuda_saying_how_to_install(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_gpu.py"), "--model", "tiny", "--train", "train.parquet"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert "needs CUDA GPUs, and torch sees none" in done.stderr
    assert 'pip install -e ".[gpu]"' in done.stderr and "not on an index" in done.stderr
    assert "Ray" not in done.stderr  # nothing started


def test_gpu_recipe_makes_its_parquet_data_from_json_lines(tmp_path: Path) -> None:
    source = tmp_path / "gsm8k.jsonl"
    rows = [
        {"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = <<{2 * i}>>\n#### {2 * i:,}"}
        for i in range(600, 620)
    ]
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    train, val = tmp_path / "data" / "train.parquet", tmp_path / "data" / "test.parquet"
    command = ["--make-data", str(source), "--train", str(train), "--val", str(val)]
    done = _run("train_gpu.py", *command, cwd=tmp_path)
    assert '"train_rows": 18' in done.stdout and '"val_rows": 2' in done.stdout
    written = pq.read_table(train).to_pylist() + pq.read_table(val).to_pylist()
    assert sorted((r["question"], r["answer"]) for r in written) == [
        (f"What is {i} + {i}?", float(2 * i)) for i in range(600, 620)
    ]
