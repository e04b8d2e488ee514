"""AsyncVERL end to end on CPU: verl's V1 trainer (fsdp2 actor on gloo, reference, critic) fed by agents over HTTP.

One Ray session for the module; two runs: the first trains two steps and checkpoints, the second resumes.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
import ray

from aglverl import LLM
from aglverl.algorithm import AsyncVERL, compose_config, verl_runtime
from aglverl.cli.demo import one_word_agent

pytestmark = pytest.mark.anyio

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

TRAIN = [{"prompt": "Say yes.", "word": "yes", "id": i} for i in range(6)]
VAL = [{"prompt": "Say yes.", "word": "yes", "id": 100 + i, "data_source": "toy"} for i in range(2)]


def _config(steps: int, checkpoints: Path) -> dict[str, Any]:
    return {
        "data": {"train_batch_size": 2, "max_prompt_length": 64, "max_response_length": 8, "shuffle": False},
        "actor_rollout_ref": {
            "rollout": {"n": 2},
            # many epochs make the update slow enough (seconds) to watch the task server during it
            "actor": {"ppo_mini_batch_size": 2, "use_kl_loss": True, "ppo_epochs": 30, "optim": {"lr": 1e-2}},
        },
        "critic": {"ppo_epochs": 2},
        # the engine's log-probs ride along in the batch and verl's rollout correction consumes them
        "algorithm": {"adv_estimator": "gae", "rollout_correction": {"rollout_is": "token"}},
        "aglverl": {"signal": {"request_logprobs": True}},
        "trainer": {
            "total_training_steps": steps,
            "save_freq": 1,
            "test_freq": 2,
            "val_before_train": True,
            "default_local_dir": str(checkpoints),
            "logger": ["console"],
        },
    }


@pytest.fixture(scope="module")
def shared_ray(tiny_model: Path) -> Iterator[None]:
    """One Ray session for both runs (each run joins it instead of starting its own)."""
    # two (fake) GPUs: separate_async's standalone rollout pool takes the second
    config, _ = compose_config({**_config(1, Path("/tmp")), "ray_kwargs": {"ray_init": {"num_gpus": 2}}})
    with ExitStack() as stack:
        stack.enter_context(verl_runtime(config))
        yield


class Recorder:
    """Runs the toy agent and remembers which task inputs it was given."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    async def agent(self, task: Mapping[str, Any], llm: LLM) -> float:
        self.seen.append(int(task["id"]))
        return await one_word_agent(task, llm)


def _served_checksum(_worker: Any) -> tuple[int, float]:
    from aglverl.verl_plugin.rollout import local_rollout

    server = local_rollout().server
    return server.weight_version, sum(float(p.detach().double().sum()) for p in server.model.parameters())


async def _healthz_latencies(url: str, out: list[float]) -> None:
    """Probe the task server continuously (a measurement, not a wait for work) until it stops serving."""
    async with aiohttp.ClientSession() as session:
        while True:
            start = time.perf_counter()
            try:
                async with session.get(f"{url}/healthz") as response:
                    assert response.status == 200
            except aiohttp.ClientConnectionError:
                return  # the run ended
            out.append(time.perf_counter() - start)
            await anyio.sleep(0.02)


@pytest.fixture(scope="module")
async def first_run(shared_ray: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    checkpoints = tmp_path_factory.mktemp("checkpoints")
    recorder = Recorder()
    algo = AsyncVERL(_config(2, checkpoints), agent=recorder.agent)
    steps: dict[int, dict[str, Any]] = {}
    latencies: list[float] = []

    def on_step(step: int, metrics: Mapping[str, float]) -> None:
        worker = algo.trainer.actor_rollout_wg.workers[0]
        steps[step] = {
            "metrics": dict(metrics),
            "served": ray.get(worker.__ray_call__.remote(_served_checksum)),
        }

    algo.on_step.append(on_step)
    async with anyio.create_task_group() as tg:
        algo.on_serving.append(lambda daemon: tg.start_soon(_healthz_latencies, daemon.server_url, latencies))
        final = await algo.run(TRAIN, VAL)
        tg.cancel_scope.cancel()
    totals = algo.daemon.proxy_counters()  # the run's, from the daemon (its proxy ran in this process)
    overload = algo.daemon.proxy.overload  # type: ignore[attr-defined]
    return {
        "overload": (overload.policy.refuse, overload.statistics()),
        "final": final,
        "steps": steps,
        "seen": recorder.seen,
        "latencies": latencies,
        "dir": checkpoints,
        "totals": totals,
    }


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


async def test_two_full_steps_run_through_verls_actor_reference_and_critic(first_run: dict[str, Any]) -> None:
    steps = first_run["steps"]
    assert sorted(steps) == [1, 2]
    for record in steps.values():
        metrics = record["metrics"]
        assert metrics["step/n_completed"] == 4 and metrics["step/n_rows"] == 4
        assert "actor/pg_loss" in metrics and "actor/kl_loss" in metrics  # actor + reference
        assert "critic/vf_loss" in metrics and "critic/values/mean" in metrics  # critic (GAE)
        assert metrics["actor/grad_norm"] > 0
        # where the step's wall time went: the four shares add up
        shares = [
            metrics[f"step/share_{k}"] for k in ("generating_only", "computing_only", "both", "neither")
        ]
        assert sum(shares) == pytest.approx(1.0, abs=1e-6) and metrics["step/share_computing_only"] > 0
        assert metrics["step/generated_tokens"] > 0
    final = first_run["final"]
    assert "val/reward" in final and final["val/n_rollouts"] == 2  # 2 samples x val_kwargs.n 1
    assert any(key.startswith("val-core/toy/reward/") for key in final)  # verl's own, per data source
    assert set(first_run["seen"]) >= {0, 1, 2, 3, 100, 101}


async def test_verl_consumes_the_engines_log_probs_and_on_policy_they_match(
    first_run: dict[str, Any],
) -> None:
    metrics = first_run["steps"][1]["metrics"]
    assert metrics["logprobs/n_rows_missing"] == 0.0
    assert metrics["logprobs/n_tokens"] > 0
    assert metrics["training/rollout_probs_diff_valid"] == 1  # verl's own comparison ran on them too
    # the embedded server samples with the weights the actor has: its log-probs are the actor's recomputation
    assert metrics["logprobs/abs_diff_mean"] < 1e-3, metrics["logprobs/abs_diff_mean"]
    assert abs(metrics["logprobs/k3_kl"]) < 1e-4
    # verl's rollout correction read rollout_log_probs: token-level IS weights, all ~1 on-policy
    assert "rollout_corr/rollout_is_mean" in metrics, sorted(
        k for k in metrics if k.startswith("rollout_corr")
    )
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-2)


async def test_served_weights_change_after_each_update_and_calls_carry_the_new_version(
    first_run: dict[str, Any],
) -> None:
    steps = first_run["steps"]
    (v1, sum1), (v2, sum2) = steps[1]["served"], steps[2]["served"]
    assert (v1, v2) == (1, 2)
    assert sum1 != sum2
    # step k's rollouts were generated by the weights synced at the end of step k-1
    assert steps[1]["metrics"]["step/call_weight_version_min"] == 0
    assert steps[2]["metrics"]["step/call_weight_version_min"] == 1
    assert steps[2]["metrics"]["step/call_weight_version_max"] == 1


async def test_a_steps_proxy_counts_are_that_steps_calls_not_the_runs_running_totals(
    first_run: dict[str, Any],
) -> None:
    """``proxy/*`` in a step's metrics (and so in a console's metrics.jsonl) count what the proxy did since the
    previous step's metrics: step 2's calls are its batch's plus validation's (2 samples before step 1 and at
    step 2), not step 1's as well; the steps' counts add up to the run's totals."""
    steps = [first_run["steps"][k]["metrics"] for k in (1, 2)]
    validation_calls = 2
    for metrics in steps:
        assert 0 < metrics["proxy/calls_ok"] <= metrics["batch/n_calls"] + validation_calls
    totals = first_run["totals"]
    # The agents ran on the proxy's loop: its lag was measured, and no call was turned away for it.
    refuse, lag = first_run["overload"]
    assert refuse is False and lag.probes > 0 and lag.shed == 0 and totals["proxy/calls_shed"] == 0
    assert sum(m["proxy/calls_ok"] for m in steps) == totals["proxy/calls_ok"]
    assert sum(m["proxy/retries"] for m in steps) == totals["proxy/retries"]


async def test_the_task_server_answers_in_milliseconds_while_an_update_runs(
    first_run: dict[str, Any],
) -> None:
    update = max(r["metrics"]["timing_s/update_actor"] for r in first_run["steps"].values())
    # a loop blocked by the update would answer one probe after the whole update: the bound is half of it (and
    # 0.5 s at most), however quick the machine makes the update
    bound = min(0.5, update / 2)
    assert update > 0.2, update
    latencies = first_run["latencies"]
    assert len(latencies) > 50
    assert max(latencies) < bound, (update, sorted(latencies)[-5:])
    print(f"healthz during training: n={len(latencies)} max={max(latencies) * 1000:.1f} ms")


async def test_a_second_run_resumes_from_the_checkpoint_without_retraining_a_step(
    first_run: dict[str, Any],
) -> None:
    checkpoints: Path = first_run["dir"]
    assert (checkpoints / "global_step_2" / "actor").is_dir()
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text() == "2"
    recorder = Recorder()
    algo = AsyncVERL({**_config(3, checkpoints), "trainer.val_before_train": False}, agent=recorder.agent)
    trained: list[int] = []
    algo.on_step.append(lambda step, metrics: trained.append(step))
    final = await algo.run(TRAIN, VAL)
    assert trained == [3]
    assert final["training/global_step"] == 3
    # the data loader resumed too: step 3 takes the third pair of samples (no shuffling), then validation
    assert sorted(set(recorder.seen) - {100, 101}) == [4, 5]


async def test_rejection_sampling_replaces_uniform_groups_with_fresh_prompts(
    first_run: dict[str, Any], tmp_path: Path
) -> None:
    """aglverl's rejection sampling on V1 is verl's DAPO group filter on the daemon's scores: a group whose
    rewards are all equal is evicted and a fresh prompt replaces it, so every trained group has signal."""
    answered: dict[int, int] = {}

    async def agent(task: Mapping[str, Any], llm: LLM) -> float:
        await one_word_agent(task, llm)  # a real call through the proxy, so the group has rows
        i = int(task["id"])
        answered[i] = answered.get(i, 0) + 1
        return 1.0 if i % 2 == 0 else float(answered[i] % 2)  # even ids: uniform groups; odd: (1, 0)

    overrides = {
        **_config(2, tmp_path),
        "trainer.save_freq": -1,
        "trainer.val_before_train": False,
        "trainer.test_freq": -1,
        "aglverl": {"signal": {"rejection_sampling": True}, "journal": None},
        "algorithm": {"adv_estimator": "grpo"},
    }
    algo = AsyncVERL(overrides, agent=agent)
    steps: list[dict[str, float]] = []
    algo.on_step.append(lambda step, metrics: steps.append(dict(metrics)))
    await algo.run(TRAIN, None)
    assert len(steps) == 2
    assert sum(m.get("training/filter_groups/evicted_samples", 0.0) for m in steps) >= 1
    for metrics in steps:
        assert metrics["critic/score/mean"] == pytest.approx(0.5)  # only the (1, 0) groups were trained
    assert any(i % 2 == 0 for i in answered) and any(i % 2 == 1 for i in answered)


async def test_two_separate_async_runs_in_one_caller_started_ray_session_both_train(
    shared_ray: None, tmp_path: Path
) -> None:
    """A run leaves nothing behind in a Ray session the caller keeps: the standalone rollout replica's workers
    and placement group go too, or the second run would wait for their (fake) GPU forever."""
    overrides = {
        **_config(1, tmp_path),
        "trainer.save_freq": -1,
        "trainer.val_before_train": False,
        "trainer.test_freq": -1,
        "trainer.v1.trainer_mode": "separate_async",
        "algorithm": {"adv_estimator": "grpo"},
        "aglverl": {"journal": None},
    }
    trained: list[list[int]] = []
    for run in range(2):
        algo = AsyncVERL(overrides, agent=one_word_agent)
        trained.append([])
        algo.on_step.append(lambda step, metrics, run=run: trained[run].append(step))
        with anyio.fail_after(300):
            await algo.run(TRAIN, None)
    assert trained == [[1], [1]]
    assert ray.is_initialized()  # the caller's session, still up
    assert ray.available_resources().get("GPU", 0) == 2  # every bundle given back
