"""verl's own RayPPOTrainer on CPU through aglverl's plugin: workers, embedded servers, weight sync, sleep/wake,
the server handle verl's agent loops call (defaults, weight version, abort/resume) and a standalone replica.

One Ray session and one trainer (``init_workers`` takes ~20 s here) for the whole module.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import numpy as np
import psutil
import pytest
import ray
import torch

from aglverl.algorithm import VerlRuntime, compose_config, verl_runtime
from aglverl.batch import BatchConfig, FinishedRollout, build_batch
from aglverl.trainer import AgentPPOTrainer, _worker_group_class, build_trainer

pytestmark = pytest.mark.anyio

# The functions below run inside verl's worker process (``__ray_call__``), which cannot import this module.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

CONFIG = {
    "data": {"train_batch_size": 2, "max_prompt_length": 32, "max_response_length": 8},
    "actor_rollout_ref": {
        "rollout": {"n": 4},
        # a high learning rate so one update visibly moves every weight
        "actor": {"ppo_mini_batch_size": 2, "optim": {"lr": 1e-2}, "use_kl_loss": True},
    },
    "algorithm": {"adv_estimator": "grpo"},
    "trainer": {"total_training_steps": 2},
    # a second (fake) GPU for the standalone replica's resource pool
    "ray_kwargs": {"ray_init": {"num_gpus": 2, "num_cpus": 16}},
}


@pytest.fixture(scope="module")
def runtime(tiny_model: Path) -> Iterator[VerlRuntime]:
    config, _ = compose_config(CONFIG)
    with verl_runtime(config) as runtime:
        yield runtime


@pytest.fixture(scope="module")
def trainer(runtime: VerlRuntime) -> Iterator[AgentPPOTrainer]:
    config, _ = compose_config(CONFIG)
    with ExitStack() as stack:
        trainer = build_trainer(config, [{"q": i} for i in range(4)], None, runtime)
        stack.callback(trainer.close)
        trainer.init_workers()  # ends with the replicas asleep, as verl's fit() expects
        trainer.checkpoint_manager.update_weights(0)  # what a run does first: sync weights, wake the servers
        yield trainer


def _actor_worker(worker_dict: Any) -> Any:
    from verl.workers.engine_workers import ActorRolloutRefWorker

    return next(w for w in worker_dict.worker_dict.values() if isinstance(w, ActorRolloutRefWorker))


def _weight_gap(worker_dict: Any) -> tuple[float, dict[str, float]]:
    """Inside the worker: max |actor - served| over all weights, and a checksum of the served weights."""
    from aglverl.verl_plugin.rollout import local_rollout

    actor = _actor_worker(worker_dict)
    params, _ = actor.actor.engine.get_per_tensor_param()
    served = dict(local_rollout().server.model.named_parameters())
    gap = 0.0
    for name, tensor in params:
        if name in served:
            gap = max(gap, float((tensor.detach().cpu() - served[name].detach()).abs().max()))
    return gap, {name: float(p.detach().double().sum()) for name, p in served.items()}


def _server_state(worker_dict: Any) -> dict[str, Any]:
    import dataclasses

    from aglverl.verl_plugin.rollout import local_rollout

    return dataclasses.asdict(local_rollout().server.stats())


def _in_worker(trainer: AgentPPOTrainer, fn: Any) -> Any:
    return ray.get(trainer.actor_rollout_wg.workers[0].__ray_call__.remote(fn))


async def test_server_addresses_answer_openai_chat_with_token_ids(trainer: AgentPPOTrainer) -> None:
    addresses = trainer.llm_server_manager.get_addresses()
    assert len(addresses) == 1
    model = trainer.served_model_name()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async with session.post(
            f"http://{addresses[0]}/v1/chat/completions",
            json={
                "model": model,
                "messages": [{"role": "user", "content": "Say yes."}],
                "max_tokens": 4,
                "return_token_ids": True,
            },
        ) as response:
            assert response.status == 200, await response.text()
            body = await response.json()
    assert body["prompt_token_ids"] == trainer.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say yes."}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert 1 <= len(body["choices"][0]["token_ids"]) <= 4


def _batch(trainer: AgentPPOTrainer) -> Any:
    """A GRPO step's batch as the daemon builds it: 2 samples x 4 rollouts, rewards differing within groups."""
    rng = np.random.default_rng(0)
    rollouts = [
        FinishedRollout(
            f"r{i}", f"group{i // 4}", float(i % 2), [(rng.integers(3, 500, 12).tolist(), rng.integers(3, 500, 6).tolist())]
        )
        for i in range(8)
    ]
    data, _ = build_batch(rollouts, BatchConfig(max_prompt_length=32, max_response_length=8))
    return data


def test_after_an_actor_update_the_weight_sync_serves_the_actors_weights(trainer: AgentPPOTrainer) -> None:
    trainer.global_steps = 1
    trainer.checkpoint_manager.update_weights(0)
    gap, before = _in_worker(trainer, _weight_gap)
    assert gap == 0.0

    metrics: dict[str, float] = {}
    trainer.checkpoint_manager.sleep_replicas()
    assert trainer._update(_batch(trainer), metrics, {}) is not None
    # On-policy GRPO's first loss is ~0 (advantages are centred per group); its gradient is not.
    assert metrics["actor/grad_norm"] > 0.0 and "actor/kl_loss" in metrics  # the reference model ran too
    gap, still_served = _in_worker(trainer, _weight_gap)
    assert gap > 0.0 and still_served == before  # trained, not yet synced

    trainer.checkpoint_manager.update_weights(1)
    gap, after = _in_worker(trainer, _weight_gap)
    assert gap == 0.0
    assert after != before
    assert _in_worker(trainer, _server_state)["weight_version"] == 1


def test_sleep_and_wake_up_reach_the_embedded_server(trainer: AgentPPOTrainer) -> None:
    start = _in_worker(trainer, _server_state)
    trainer.checkpoint_manager.sleep_replicas()
    slept = _in_worker(trainer, _server_state)
    assert slept["sleeping"] and slept["sleep_calls"] == start["sleep_calls"] + 1
    trainer.checkpoint_manager.wake_up_replicas()
    woken = _in_worker(trainer, _server_state)
    assert not woken["sleeping"] and woken["wake_up_calls"] == start["wake_up_calls"] + 1


def _descendants() -> list[psutil.Process]:
    me = psutil.Process(os.getpid())
    return [me, *me.children(recursive=True)]


def _exposed_listeners() -> list[tuple[int, Any]]:
    """Listeners of this process tree not on loopback (asserts that Ray and some listeners are there)."""
    pids = {p.pid for p in _descendants()}
    assert len(pids) > 3  # Ray's GCS, raylet and verl's workers are running
    listeners = [
        c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in pids
    ]
    assert listeners
    return [(c.pid, c.laddr) for c in listeners if not _is_loopback(c.laddr.ip)]


def test_nothing_of_ours_or_rays_listens_off_loopback(trainer: AgentPPOTrainer) -> None:
    assert _exposed_listeners() == []


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)  # "::ffff:127.0.0.1" is loopback too
    return bool(address.is_loopback or (mapped is not None and mapped.is_loopback))


def test_worker_processes_run_on_the_cpu_platform(trainer: AgentPPOTrainer) -> None:
    def platform(_worker: Any) -> tuple[str, str, bool]:
        from verl.plugin.platform import get_platform

        pinned = torch.ones(2).pin_memory()  # a no-op without an accelerator, instead of an error
        return get_platform().device_name, torch.distributed.get_backend(), bool(pinned.sum() == 2)

    assert _in_worker(trainer, platform) == ("cpu", "gloo", True)


# ---------------------------------------------------------------------------------------------- the server handle
def _reload(_worker: Any, version: int) -> None:
    """Inside the worker: load the served weights again, as version ``version``."""
    from aglverl.verl_plugin.rollout import local_rollout

    server = local_rollout().server
    server.load_weights([(n, p.detach().clone()) for n, p in server.model.named_parameters()], version)


async def test_the_handle_applies_verls_defaults_and_reports_the_served_weight_version(
    trainer: AgentPPOTrainer,
) -> None:
    handle = trainer.llm_server_manager.server_handles[0]
    await trainer.actor_rollout_wg.workers[0].__ray_call__.remote(_reload, 3)
    greedy = {"temperature": 0, "ignore_eos": True, "logprobs": False}
    out = await handle.generate.remote(prompt_ids=list(range(5, 15)), sampling_params=greedy, request_id="a")
    # no max_tokens: the response length (8); log-probs were not asked for; vLLM's "completed" for a length stop
    assert len(out.token_ids) == 8 and out.log_probs is None and out.stop_reason == "completed"
    assert out.extra_fields["global_steps"] == 3
    near_end = await handle.generate.remote(prompt_ids=list(range(5, 40)), sampling_params=greedy | {"logprobs": True})
    assert len(near_end.token_ids) == 5 == len(near_end.log_probs)  # capped by the 40-token context


async def test_the_handle_aborts_a_parked_request_and_rejects_new_ones_until_resume(
    trainer: AgentPPOTrainer,
) -> None:
    handle = trainer.llm_server_manager.server_handles[0]
    sampling = {"max_tokens": 4, "ignore_eos": True}
    await handle.sleep.remote()
    try:
        parked = handle.generate.remote(prompt_ids=[5, 6, 7], sampling_params=sampling, request_id="parked")
        result = await handle.abort_all_requests.remote(reject_request=True)
        with anyio.fail_after(60):
            out = await parked  # ended by the abort, whether it was waiting at the sleeping server or refused
            refused = await handle.generate.remote(prompt_ids=[5, 6, 7], sampling_params=sampling)
        assert set(result) == {"aborted_count", "request_ids"}
        assert result["aborted_count"] == len(result["request_ids"]) and set(result["request_ids"]) <= {"cmpl-parked"}
        for ended in (out, refused):
            assert ended.stop_reason == "aborted" and ended.token_ids == []
            assert isinstance(ended.extra_fields["global_steps"], int)
        state = (await handle.state.remote())[0]
        assert state["generation_paused"] and state["sleeping"]
    finally:
        await handle.wake_up.remote()
        await handle.resume_generation.remote()
    with anyio.fail_after(60):
        out = await handle.generate.remote(prompt_ids=[5, 6, 7], sampling_params=sampling)
    assert len(out.token_ids) == 4 and out.stop_reason == "completed"
    assert not (await handle.state.remote())[0]["generation_paused"]


# ---------------------------------------------------------------------------------------------- standalone
def _load_from_async_generator(_worker: Any, version: int) -> bool:
    """Inside the worker: random weights through an async generator, as a checkpoint engine yields them."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from aglverl.verl_plugin.rollout import local_rollout

    rollout = local_rollout()
    target = {n: torch.randn_like(p) for n, p in rollout.server.model.named_parameters()}

    async def receive_weights() -> Any:
        for name, tensor in target.items():
            await asyncio.sleep(0)
            yield name, tensor

    with ThreadPoolExecutor(1) as pool:  # a loop of its own, whatever runs this worker's methods
        pool.submit(asyncio.run, rollout.update_weights(receive_weights(), global_steps=version)).result()
    served = dict(rollout.server.model.named_parameters())
    return all(torch.equal(served[n], t) for n, t in target.items())


def test_a_standalone_replica_serves_and_loads_weights_from_an_async_generator(
    trainer: AgentPPOTrainer, runtime: VerlRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    from verl.workers.rollout import replica as replica_module
    from verl.workers.rollout.replica import RolloutMode

    from aglverl.verl_plugin.rollout import EmbeddedReplica

    # verl builds the standalone pool's workers with its own RayWorkerGroup; ours keeps their rendezvous local
    monkeypatch.setattr(replica_module, "RayWorkerGroup", _worker_group_class(runtime.env, runtime.rendezvous_dir))
    rollout_config = trainer.config.actor_rollout_ref.rollout
    replica = EmbeddedReplica(1, rollout_config, trainer.config.actor_rollout_ref.model, gpus_per_node=1)
    asyncio.run(replica.init_standalone())
    try:
        assert replica.rollout_mode == RolloutMode.STANDALONE
        assert replica.server_address != trainer.llm_server_manager.server_addresses[0]
        handle = replica.server_handle
        greedy = {"temperature": 0, "ignore_eos": True}
        before = ray.get(handle.generate.remote(prompt_ids=[5, 6, 7], sampling_params=greedy))
        assert len(before.token_ids) == 8 and before.extra_fields["global_steps"] == 0
        assert ray.get(replica.workers[0].__ray_call__.remote(_load_from_async_generator, 7)) is True
        after = ray.get(handle.generate.remote(prompt_ids=[5, 6, 7], sampling_params=greedy))
        assert after.extra_fields["global_steps"] == 7 and after.token_ids != before.token_ids
        assert _exposed_listeners() == []
    finally:
        for actor in [*replica.workers, *replica.servers]:
            ray.kill(actor)
        for pg in replica.resource_pool.pgs or []:
            ray.util.remove_placement_group(pg)
