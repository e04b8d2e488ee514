"""Agent Lightning 0.2/0.3's program trains on aglverl: ``agl.Trainer(algorithm=VERL(config), n_runners=2).fit(agent)``
with the real agentlightning 0.3.0 (its Trainer, store, client-server execution strategy, forked runners,
tracer, ``@rollout``, ``LitAgent``, ``emit_reward``), verl's V1 trainer on CPU and the tiny model; one Ray
session for the module. Each run trains 2 steps of 2 prompts x 2 rollouts (the ``agl03`` tier, in .venv-agl03).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.agl03

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network: litellm's price list is local
agl = pytest.importorskip("agentlightning")

from aglverl.agent_lightning import VERL  # noqa: E402  (needs agentlightning)
from aglverl.algorithm import compose_config, verl_runtime  # noqa: E402
from aglverl.config_errors import ConfigError  # noqa: E402

HELPERS = Path(__file__).parent / "helpers"
sys.path.insert(0, str(HELPERS))
import seed_agents  # noqa: E402


def _config(steps: int = 2, *, width: int = 4, **aglverl: Any) -> dict[str, Any]:
    return {
        "data": {
            "train_batch_size": 2,
            "max_prompt_length": 64,
            "max_response_length": width,
            "shuffle": False,
        },
        "actor_rollout_ref": {"rollout": {"n": 2}, "actor": {"ppo_mini_batch_size": 2}},
        "algorithm": {"adv_estimator": "grpo"},
        "aglverl": {"journal": None, "max_attempts": 2, **aglverl},
        "trainer": {
            "total_training_steps": steps,
            "save_freq": -1,
            "test_freq": -1,
            "val_before_train": False,
            "logger": [],
        },
        "ray_kwargs": {"ray_init": {"log_to_driver": False}},
    }


def _rows(log: Path, n: int, split: str = "train", **extra: Any) -> list[dict[str, Any]]:
    """Alternating rewards 0.25 / 0.75: with two prompts a step (in order), each step's rollouts average 0.5."""
    return [
        {
            "prompt": "Say yes.",
            "reward": 0.25 if i % 2 == 0 else 0.75,
            "split": split,
            "log": str(log),
            **extra,
        }
        for i in range(n)
    ]


def _seen(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _fit(
    algo: Any, agent: Any, train: list[dict[str, Any]], val: list[dict[str, Any]] | None = None
) -> list[dict[str, float]]:
    """``Trainer(n_runners=2).fit``, as a program runs it; returns every step's metrics."""
    steps: list[dict[str, float]] = []
    algo.algorithm.on_step.append(lambda step, metrics: steps.append(dict(metrics)))
    trainer = agl.Trainer(algorithm=algo, n_runners=2, port=_free_port())  # its store server: loopback
    trainer.fit(agent, train_dataset=train, val_dataset=val)
    return steps


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _agl_rollouts(store: Any) -> list[Any]:
    return list(asyncio.run(store.query_rollouts()))


@pytest.fixture(scope="module")
def shared_ray(tiny_model: Path) -> Iterator[None]:
    config, _ = compose_config(_config())
    with ExitStack() as stack:
        stack.enter_context(verl_runtime(config))
        yield


def test_function_agent_returning_its_reward_trains_and_validates_at_temperature_0(
    shared_ray: None, tmp_path: Path
) -> None:
    """The docs' program: a sync ``@agl.rollout`` function returns its reward. Rewards reach training (each
    step's mean is 0.5, not 0); validation runs once per row before training and at the last step, at
    ``val_kwargs``' temperature 0, training at the rollout temperature; every row carries its ``data_id``; an
    agent that raises fails its rollout (aglverl retries it, then evicts its group) and training goes on."""
    log = tmp_path / "seen.jsonl"
    config = _config()
    config["trainer"].update(val_before_train=True, test_freq=2)
    train = _rows(log, 8)
    train[2]["raise"] = True  # step 2's first prompt: both its rollouts raise, twice each
    algo = VERL(config)
    steps = _fit(algo, seed_agents.function_agent, train, _rows(log, 2, "val"))

    assert len(steps) == 2
    assert steps[0]["training/reward"] == pytest.approx(0.5)
    assert steps[0]["training/n_rollouts"] == 4 and steps[0]["training/n_triplets"] == 4  # agl.VERL's names
    assert steps[1]["training/rollout_failure/evicted_samples"] > 0  # the raising group, replaced
    assert algo.metrics["val/reward"] == pytest.approx(0.5) and algo.metrics["val/n_rollouts"] == 2
    assert algo.metrics["val/n_rollouts_w_reward"] == 2
    seen = _seen(log)
    val = [s for s in seen if s["split"] == "val"]
    train_seen = [s for s in seen if s["split"] == "train"]
    assert len(val) == 4  # 2 rows, once each, before training and at step 2
    assert {s["sampling"]["temperature"] for s in val} == {0.0}
    assert {s["sampling"]["temperature"] for s in train_seen} == {1.0}
    assert all("/rollout/" in s["endpoint"] and s["data_id"] for s in seen)
    raised = [r for r in _agl_rollouts(algo.get_store()) if r.input.get("raise")]
    assert len(raised) == 4 and {r.status for r in raised} == {"failed"}  # 2 rollouts x aglverl.max_attempts


def test_litagent_with_emit_reward_trains_though_a_runner_is_killed_mid_rollout(
    shared_ray: None, tmp_path: Path
) -> None:
    """A ``LitAgent`` class resolves its ``main_llm`` (``get_base_url(rollout_id, attempt_id)``; reading
    ``llm.endpoint`` directly gives the same attempt's URL) and reports its reward with ``agl.emit_reward``: the
    reward reaches training through the tracer. Its first rollout kills its
    own runner process: Agent Lightning's store times that rollout out after ``aglverl.lease_seconds``, aglverl
    runs it again on the other runner, and training ends; ``fit`` then reports the killed runner, as Agent
    Lightning's execution strategy does for any runner that died."""
    log = tmp_path / "seen.jsonl"
    train = _rows(log, 8)
    train[0]["kill_once"] = str(tmp_path / "killed")
    algo = VERL(_config(lease_seconds=8))
    steps: list[dict[str, float]] = []
    with pytest.raises(RuntimeError, match=r"exitcode=-9"):
        steps = _fit(algo, seed_agents.EmittingAgent(), train)
    assert (tmp_path / "killed").exists()
    assert algo.metrics["step/n_completed"] == 4
    assert algo.metrics["training/reward"] == pytest.approx(0.5)
    assert not steps or all(m["training/reward"] == pytest.approx(0.5) for m in steps)
    seen = _seen(log)
    assert seen and all(s["direct"] == s["endpoint"] and "/rollout/" in s["endpoint"] for s in seen)
    timed_out = [r for r in _agl_rollouts(algo.get_store()) if r.status == "failed"]
    assert len(timed_out) == 1 and timed_out[0].input.get("kill_once")


def test_bad_config_is_an_error_at_construction_naming_the_key() -> None:
    """A misspelt ``agentlightning:`` key, a 1.0 key, ``trace_aggregator.debug`` and ``trainer_cls`` are refused
    when ``VERL`` is constructed, each naming what is wrong; the docs' example config constructs as it is."""
    with pytest.raises(ConfigError, match=r"'agentlightning.trace_aggregator.levl'.*did you mean 'level'"):
        VERL(_config() | {"agentlightning": {"trace_aggregator": {"levl": "trajectory"}}})
    with pytest.raises(
        ConfigError, match=r"agentlightning.rollout_timeout_seconds is a key of Agent Lightning 1.0"
    ):
        VERL(_config() | {"agentlightning": {"rollout_timeout_seconds": 60}})
    with pytest.raises(ConfigError, match=r"trace_aggregator.debug: True cannot be honoured"):
        VERL(_config() | {"agentlightning": {"trace_aggregator": {"debug": True}}})
    with pytest.raises(ConfigError, match=r"trainer_cls='MyTrainer'.*cannot be honoured"):
        VERL(_config(), trainer_cls=type("MyTrainer", (), {}))
    algo = VERL(_config() | {"agentlightning": {"port": 9999, "trace_aggregator": {"level": "transition"}}})
    assert algo.algorithm.options.port == 9999 and algo.algorithm.options.signal.trajectory == "per_call"
    assert isinstance(algo, agl.Algorithm) and algo.is_async()


def test_run_trains_when_called_synchronously_or_awaited() -> None:
    """``run`` called with no event loop (``Trainer.fit_v0``, a script) runs the training itself; inside a loop it
    returns the coroutine the Trainer awaits. Either way its errors reach the caller as themselves."""
    algo = VERL(_config())
    with pytest.raises(ConfigError, match="the training dataset is empty"):
        algo.run(train_dataset=[])

    async def awaited() -> None:
        await algo.run(train_dataset=[])

    with pytest.raises(ConfigError, match="the training dataset is empty"):
        asyncio.run(awaited())


def test_aglverl_fit_runs_the_unchanged_program_whose_async_multiturn_agent_trains_a_row_per_conversation(
    tiny_model: Path, tmp_path: Path
) -> None:
    """``aglverl fit SCRIPT ARGS``: a program written for ``agl.VERL`` (both import paths; not edited) trains 2
    steps and returns from ``fit``. Its agent is an ``async def`` ``@agl.rollout`` of three turns re-sending its
    history as text; its config is ``agl.VERL``'s documented trajectory aggregation (``data.max_response_length``
    4 for each call, ``trajectory_max_response_length`` 96 for the merged row): each conversation is one row."""
    log = tmp_path / "seen.jsonl"
    metrics = tmp_path / "metrics.jsonl"
    program = HELPERS / "seed_program_unchanged.py"
    aglverl = Path(sys.executable).with_name("aglverl")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HELPERS), os.environ.get("PYTHONPATH", "")]),
        "VERL_FILE_LOGGER_PATH": str(
            metrics
        ),  # verl's "file" logger, which the program's trainer.logger names
    }
    done = subprocess.run(
        [str(aglverl), "fit", str(program), "--log", str(log), "--steps", "2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {
        "fit_returned": True,
        "algorithm": "aglverl.agl03.verl.VERL",
        "same_class": True,
    }
    steps = [json.loads(line)["data"] for line in metrics.read_text().splitlines()]
    assert len(steps) == 2
    for step in steps:  # through verl's trainer.logger, as agl.VERL logs
        assert step["training/reward"] == pytest.approx(0.5)
        assert step["step/n_rollouts"] == 4 and step["step/n_rows"] == 4  # a row per conversation
        assert step["batch/n_calls"] == 12 and step["batch/n_calls_merged"] == 8
    seen = _seen(log)
    assert len(seen) == 8 and all(len(s["answers"]) == 3 and "/rollout/" in s["endpoint"] for s in seen)


def test_a_reward_not_finite_as_float32_returned_or_emitted_fails_its_rollout_and_training_goes_on(
    shared_ray: None, tmp_path: Path
) -> None:
    """Issue 50: 1e39 is a finite Python float and infinity in the float32 rows, where GRPO raised and the run
    ended. Returned by an ``@agl.rollout`` function or reported with ``agl.emit_reward`` (found in its spans by
    the bridge), it fails that rollout with an error naming the value, and both steps train."""
    train = _rows(tmp_path / "seen.jsonl", 12)
    train[0]["huge_once"] = str(tmp_path / "returned")  # one of its two rollouts returns 1e39
    train[1].update(huge_once=str(tmp_path / "emitted"), emit=True)  # one emits -1e39
    algo = VERL(_config(max_attempts=1))
    ended: list[Any] = []
    algo.algorithm.on_serving.append(lambda daemon: daemon.store.on_attempt(ended.append))
    steps = _fit(algo, seed_agents.reporting_agent, train)
    assert len(steps) == 2
    errors = [c.error or "" for c in ended if c.kind == "ended" and c.state == "failed"]
    returned = [e for e in errors if "reward 1e+39: not a finite float32 number" in e]
    emitted = [e for e in errors if "reward -1e+39: not a finite float32 number" in e]
    assert len(returned) == 1 and len(emitted) == 1, errors


# ---------------------------------------------------------------------------------------------- agent_match
EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "agl03"


def _example(name: str) -> Any:
    """``examples/agl03/<name>.py`` as a module (its classes and data makers, its ``main`` not run)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"agl03_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_agent_match_trains_exactly_the_matching_agents_calls_and_counts_the_others(
    shared_ray: None, tmp_path: Path, tiny_model: Path
) -> None:
    """The LangGraph example's three agents under ``Trainer(adapter={"agent_match": "write"})``: each call is tied
    to its agent by the LLM span's response id. Checked against what the calls themselves are (the journal's
    record of every call, its prompt decoded): every trained call is a writer's (``write_query`` /
    ``rewrite_query``), every recorded call left out a checker's, none lost; each step's ``batch/n_calls`` and
    ``batch/n_calls_unselected`` count them."""
    from transformers import AutoTokenizer

    from aglverl.models import TRAINED_CALLS_KEY
    from aglverl.store.journal import read_records

    sql = _example("langgraph_sql_agents")
    config = sql.config_fast()
    config["actor_rollout_ref"]["rollout"]["name"] = "aglverl"  # the embedded engine, as --rollout embedded
    config["aglverl"] = {"journal": str(tmp_path / "journal")}
    config["trainer"]["logger"] = []
    sql.make_database(tmp_path / "shop.sqlite")
    algo = VERL(config)
    steps: list[dict[str, float]] = []
    algo.algorithm.on_step.append(lambda step, metrics: steps.append(dict(metrics)))
    trainer = agl.Trainer(algorithm=algo, n_runners=2, port=_free_port(), adapter={"agent_match": "write"})
    trainer.fit(sql.LitSQLAgent(str(tmp_path / "shop.sqlite")), train_dataset=sql.make_questions(8))

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    results = [r for r in read_records(tmp_path / "journal") if r["kind"] == "result"]
    assert len(results) == 8  # 2 steps of 2 questions x 2 rollouts
    trained_agents, other_agents = [], []
    for result in results:
        trained = set(result["result"]["metadata"][TRAINED_CALLS_KEY])
        calls = {c["response_id"]: c for c in result["calls"]}
        assert trained and trained <= set(calls)  # every kept span is one recorded call
        for response_id, call in calls.items():
            prompt = tokenizer.decode(call["prompt_token_ids"])
            agent = "check" if "You check a SQLite query" in prompt else "write"
            assert ("You write one SQLite query" in prompt or "You rewrite a SQLite query" in prompt) == (
                agent == "write"
            )
            (trained_agents if response_id in trained else other_agents).append(agent)
    assert set(trained_agents) == {"write"} and set(other_agents) == {"check"}
    assert len(steps) == 2
    assert sum(s["batch/n_calls"] for s in steps) == len(trained_agents)
    assert sum(s["batch/n_calls_unselected"] for s in steps) == len(other_agents)
    assert algo.bridge is not None and algo.bridge.calls_selected == len(trained_agents)
    assert algo.bridge.spans_untied == 0 and algo.bridge.rollouts_untraced == 0


def test_an_adapter_that_cannot_be_honoured_is_refused_when_fit_starts_before_anything_runs(
    tmp_path: Path,
) -> None:
    """A trace adapter of the user's own (not ``TracerTraceToTriplet``'s choice of calls) is refused naming it
    when ``fit`` hands it to ``VERL``, before the daemon or Ray starts; so is an ``agent_match`` that is not a
    regular expression. ``LlmProxyTraceToTriplet`` (every call) and the default adapter choose nothing."""
    from aglverl.agl03.adapter import call_selector

    class OwnTriplets(agl.TracerTraceToTriplet):
        def adapt(self, source: Any) -> Any:
            return []

    with pytest.raises(ConfigError, match=r"Trainer\(adapter=OwnTriplets\(\.\.\.\)\) cannot be honoured"):
        call_selector(OwnTriplets())
    with pytest.raises(ConfigError, match=r"agent_match must be a regular expression, got '\(write'"):
        call_selector(agl.TracerTraceToTriplet(agent_match="(write"))
    assert call_selector(agl.TracerTraceToTriplet()) is None
    assert call_selector(agl.LlmProxyTraceToTriplet()) is None
    assert call_selector(agl.TracerTraceToTriplet(agent_match="write")) is not None
    algo = VERL(_config())
    trainer = agl.Trainer(algorithm=algo, n_runners=1, port=_free_port(), adapter=OwnTriplets())
    with pytest.raises(ConfigError, match=r"OwnTriplets"):
        trainer.fit(seed_agents.function_agent, train_dataset=_rows(tmp_path / "seen.jsonl", 4))
    assert algo.algorithm.daemon is None and not (tmp_path / "seen.jsonl").exists()  # nothing ran


def test_langgraph_example_trains_two_steps_under_aglverl_fit_with_the_embedded_engine(
    shared_ray: None, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``aglverl fit --rollout embedded examples/agl03/langgraph_sql_agents.py fast --active-agent write``: the
    program as written (its config names vLLM) trains its 2 steps; its last line counts the writers' calls that
    trained and the checker's that did not."""
    from aglverl.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AGL_SERVER_PORT", str(_free_port()))  # the Trainer's store server; else 4747
    script = str(EXAMPLES / "langgraph_sql_agents.py")
    assert main(["fit", "--rollout", "embedded", script, "fast", "--active-agent", "write"]) == 0
    out = capsys.readouterr().out
    assert "Adapter agent match acknowledged: write" in out
    final = re.search(r"calls trained: (\d+), calls of other agents: (\d+)", out)
    assert final is not None and int(final.group(1)) > 0 and int(final.group(2)) > 0, out[-2000:]


def test_openai_agents_example_continuing_responses_by_id_trains_two_steps_without_a_failed_rollout(
    shared_ray: None, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``aglverl fit --rollout embedded examples/agl03/openai_agents_calculator.py fast``: an openai-agents agent on
    the Responses API calls its tool, the SDK continues the run by ``previous_response_id`` and a follow-up
    question continues it again; 2 steps train, no rollout fails, and the calls that continued a conversation by
    id were merged into its row (``batch/n_calls_merged`` of the last step)."""
    from aglverl.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AGL_SERVER_PORT", str(_free_port()))  # the Trainer's store server; else 4747
    script = str(EXAMPLES / "openai_agents_calculator.py")
    assert main(["fit", "--rollout", "embedded", script, "fast"]) == 0
    out = capsys.readouterr().out
    final = re.search(r"rollouts failed: (\d+), rows: (\d+), calls continuing a conversation: (\d+)", out)
    assert final is not None, out[-2000:]
    failed, rows, continued = map(int, final.groups())
    assert failed == 0 and rows > 0 and continued > 0  # the calls after the tool's output: one row each time
