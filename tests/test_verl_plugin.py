"""verl's V1 trainer on CPU through aglverl's plugin: workers, embedded servers, sleep/wake, the platform, the
server handle verl's agent loops call (defaults, weight version, abort/resume) and a standalone replica.

One Ray session and one trainer (``init`` takes ~20 s here) for the whole module.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import psutil
import pytest
import ray
import torch
from helpers.v1 import live_trainer

from aglverl.verl_v1 import served_model_name

pytestmark = pytest.mark.anyio

# The functions below run inside verl's worker process (``__ray_call__``), which cannot import this module.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

CONFIG = {
    "data": {"train_batch_size": 2, "max_prompt_length": 32, "max_response_length": 8},
    "actor_rollout_ref": {"rollout": {"n": 4}, "actor": {"ppo_mini_batch_size": 2, "use_kl_loss": True}},
    "algorithm": {"adv_estimator": "grpo"},
    "trainer": {"total_training_steps": 2, "val_before_train": False, "save_freq": -1},
    "aglverl": {"journal": None},
    # a second (fake) GPU for the standalone replica's resource pool
    "ray_kwargs": {"ray_init": {"num_gpus": 2, "num_cpus": 16}},
}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def live(tiny_model: Path) -> AsyncIterator[tuple[Any, Any]]:
    async with live_trainer(CONFIG, [{"q": i} for i in range(4)]) as (_, trainer, runtime):
        yield trainer, runtime


@pytest.fixture
def trainer(live: tuple[Any, Any]) -> Any:
    return live[0]


def _server_state(worker_dict: Any) -> dict[str, Any]:
    import dataclasses

    from aglverl.verl_plugin.rollout import local_rollout

    return dataclasses.asdict(local_rollout().server.stats())


def _in_worker(trainer: Any, fn: Any) -> Any:
    return ray.get(trainer.actor_rollout_wg.workers[0].__ray_call__.remote(fn))


async def test_server_addresses_answer_openai_chat_with_token_ids(trainer: Any) -> None:
    addresses = trainer.llm_server_manager.get_addresses()
    assert len(addresses) == 1
    model = served_model_name(f"http://{addresses[0]}")
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
        [{"role": "user", "content": "Say yes."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert 1 <= len(body["choices"][0]["token_ids"]) <= 4


async def test_sleep_and_wake_up_reach_the_embedded_server(trainer: Any) -> None:
    start = _in_worker(trainer, _server_state)
    # verl's manager methods run their coroutine themselves only outside an event loop: call them from a thread
    await anyio.to_thread.run_sync(trainer.checkpoint_manager.sleep_replicas)
    slept = _in_worker(trainer, _server_state)
    assert slept["sleeping"] and slept["sleep_calls"] == start["sleep_calls"] + 1
    await anyio.to_thread.run_sync(trainer.checkpoint_manager.wake_up_replicas)
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


async def test_nothing_of_ours_or_rays_listens_off_loopback(trainer: Any) -> None:
    assert _exposed_listeners() == []


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)  # "::ffff:127.0.0.1" is loopback too
    return bool(address.is_loopback or (mapped is not None and mapped.is_loopback))


async def test_worker_processes_run_on_the_cpu_platform(trainer: Any) -> None:
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
    trainer: Any,
) -> None:
    handle = trainer.llm_server_manager.server_handles[0]
    await trainer.actor_rollout_wg.workers[0].__ray_call__.remote(_reload, 3)
    greedy = {"temperature": 0, "ignore_eos": True, "logprobs": False}
    out = await handle.generate.remote(prompt_ids=list(range(5, 15)), sampling_params=greedy, request_id="a")
    # no max_tokens: the response length (8); log-probs were not asked for; vLLM's "completed" for a length stop
    assert len(out.token_ids) == 8 and out.log_probs is None and out.stop_reason == "completed"
    assert out.extra_fields["global_steps"] == 3
    near_end = await handle.generate.remote(
        prompt_ids=list(range(5, 40)), sampling_params=greedy | {"logprobs": True}
    )
    assert len(near_end.token_ids) == 5 == len(near_end.log_probs)  # capped by the 40-token context


async def test_the_handle_aborts_a_parked_request_and_rejects_new_ones_until_resume(
    trainer: Any,
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
        assert result["aborted_count"] == len(result["request_ids"]) and set(result["request_ids"]) <= {
            "cmpl-parked"
        }
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


async def test_a_standalone_replica_serves_and_loads_weights_from_an_async_generator(trainer: Any) -> None:
    from verl.workers.rollout.replica import RolloutMode

    from aglverl.verl_plugin.rollout import EmbeddedReplica

    # verl builds the standalone pool's workers by the name RayWorkerGroup: the run installed aglverl's
    # (aglverl.verl_plugin.patches.use_worker_group), whose workers meet on a local rendezvous
    rollout_config = trainer.config.actor_rollout_ref.rollout
    replica = EmbeddedReplica(1, rollout_config, trainer.config.actor_rollout_ref.model, gpus_per_node=1)
    await replica.init_standalone()
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
