"""The examples run as written (the CPU ones; the cheapest to the end of its training, the others a couple of
steps), the README's ``AsyncVERL`` snippet as written (short) and again in the same directory, and the GPU recipe
is a valid verl config that stops at once without CUDA."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
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
    ``test_learning.py`` trains it 20 steps)."""
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
    """One step of 64 rollouts, each a run of ``word_agent.sh``: every rollout completed, and the attempts are
    exactly the logs (one log per attempt, named by its Agent Lightning rollout id: ``<id>`` for the first,
    ``<id>-retry-<k>`` for the k-th retry): one per rollout, plus one per retry that followed an attempt which
    failed (its log has no reward line); every rollout's last attempt reported a reward. (A fresh-clone CI run
    once found 65 logs for 64 rollouts: the proxy, busy, had answered a first call 429, and the script did not
    retry it; ``curl --retry`` now waits it out as the SDKs do: ``test_word_agent_waits_out_a_429``.)"""
    done = _run("command_agent.py", "--steps", "1", cwd=tmp_path)
    out = tmp_path / "command_agent-out"
    (step,) = _steps(out)
    assert step["step/n_failed"] == 0 and step["step/n_completed"] == 64
    logs = {p.name.removesuffix(".log"): p.read_text() for p in (out / "agent_logs").glob("*.log")}
    rewarded = {name for name, text in logs.items() if re.search(r"^reward \S+$", text, re.MULTILINE)}
    attempts: dict[str, list[str]] = {}
    for name in sorted(logs, key=lambda n: (n.split("-retry-")[0], len(n), n)):
        attempts.setdefault(name.split("-retry-")[0], []).append(name)
    assert len(attempts) == 64
    for rollout, names in attempts.items():
        assert names == [rollout, *(f"{rollout}-retry-{k}" for k in range(1, len(names)))]
        assert names[-1] in rewarded and not rewarded & set(names[:-1]), {n: logs[n] for n in names}
    assert all(text.startswith("aglverl: AGL_SEED=") for text in logs.values())
    assert "final training reward:" in done.stdout


@pytest.mark.anyio
@pytest.mark.skipif(
    not (shutil.which("curl") and shutil.which("jq")), reason="word_agent.sh needs curl and jq"
)
async def test_word_agent_waits_out_a_429_and_writes_one_reward(tmp_path: Path) -> None:
    """The proxy answers a new conversation's first call 429 with ``Retry-After`` when its loop runs late (its
    overload protection; the SDKs wait and retry): ``word_agent.sh`` waits it out and retries too, and writes
    the reward of the one answer (without it, the attempt failed and was retried whole: the CI run's extra
    attempt). A loopback server answers the first call so, the second with a chat completion."""
    from aiohttp import web

    calls: list[str] = []

    async def chat(request: web.Request) -> web.Response:
        calls.append((await request.json())["messages"][0]["content"])
        if len(calls) == 1:
            error = {"error": {"message": "the proxy is overloaded", "type": "rate_limit_error"}}
            return web.json_response(error, status=429, headers={"Retry-After": "1"})
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": "Yes yes"}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        reward = tmp_path / "reward"
        env = {
            "PATH": os.environ["PATH"],
            "TASK_PROMPT": "Answer with one word: yes.",
            "TASK_WORD": "yes",
            "OPENAI_BASE_URL": f"http://127.0.0.1:{port}/v1",
            "OPENAI_API_KEY": "a-key",
            "AGL_REWARD_FILE": str(reward),
        }
        with anyio.fail_after(60):
            done = await anyio.run_process(["sh", str(EXAMPLES / "word_agent.sh")], env=env, check=False)
    finally:
        await runner.cleanup()
    assert done.returncode == 0, done.stderr.decode()
    assert calls == ["Answer with one word: yes."] * 2
    assert reward.read_text() == "1\n" and done.stdout.decode() == "reward 1\n"


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
