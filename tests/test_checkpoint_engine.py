"""aglverl's CPU checkpoint engine (backend ``aglverl_cpu``) between verl's live actor and a standalone replica.

One Ray session, one V1 trainer and one standalone embedded replica for the whole module (start-up ~30 s
here). The actor workers build the engine from the config (``rollout.checkpoint_engine.backend``), so does the
replica's ``CheckpointEngineWorker``, and verl's own ``CheckpointEngineManager`` drives the syncs.
"""

from __future__ import annotations

import ipaddress
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
import ray
import torch
from helpers.v1 import live_trainer

from aglverl.verl_plugin.checkpoint import BACKEND, WeightTransferError, WeightTransferTimeout

pytestmark = pytest.mark.anyio

# The functions below run inside verl's worker processes (``__ray_call__``), which cannot import this module.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: The engine's bound on every wait, short so that the failure tests end soon (a sync here takes < 1 s).
TIMEOUT = 10.0
#: Bound on each whole step of a test (a sync, a verl call).
STEP_TIMEOUT = 120.0

#: A small sync-mode run whose actor builds this engine; no reference model (nothing here needs one).
CONFIG = {
    "actor_rollout_ref": {
        "actor": {"ppo_mini_batch_size": 2},
        "rollout": {
            "n": 2,
            "checkpoint_engine": {
                "backend": BACKEND,
                "engine_kwargs": {BACKEND: {"timeout_seconds": TIMEOUT}},
            },
        },
    },
    "algorithm": {"adv_estimator": "grpo"},
    "data": {"train_batch_size": 2, "max_prompt_length": 16, "max_response_length": 4},
    "trainer": {"total_training_steps": 1, "val_before_train": False, "save_freq": -1},
    "aglverl": {"journal": None},
    "ray_kwargs": {"ray_init": {"num_gpus": 2, "num_cpus": 16}},  # a second (fake) GPU: the replica's pool
}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def live(tiny_model: Path) -> AsyncIterator[tuple[Any, Any, Any]]:
    """``(trainer, replica, manager)``: the trainer, a standalone replica and verl's manager between them."""
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.utils.config import omega_conf_to_dataclass

    from aglverl.verl_plugin.rollout import EmbeddedReplica

    async with live_trainer(CONFIG, [{"q": i} for i in range(4)]) as (_, trainer, _runtime):
        config = trainer.config.actor_rollout_ref
        replica = EmbeddedReplica(1, config.rollout, config.model, gpus_per_node=1)
        with anyio.fail_after(STEP_TIMEOUT):
            await replica.init_standalone()
        try:
            manager = CheckpointEngineManager(
                config=omega_conf_to_dataclass(config.rollout.checkpoint_engine),
                actor_wg=trainer.actor_rollout_wg,
                replicas=[replica],
            )
            yield trainer, replica, manager
        finally:
            for actor in [*replica.workers, *replica.servers]:
                ray.kill(actor)
            for group in replica.resource_pool.pgs or []:
                ray.util.remove_placement_group(group)


# ---------------------------------------------------------------------------------------------- in the workers
def _engine(worker_dict: Any) -> Any:
    """Inside the actor worker (verl's fused ``WorkerDict``): the actor's training engine."""
    from verl.workers.engine_workers import ActorRolloutRefWorker

    workers = worker_dict.worker_dict.values()
    return next(w for w in workers if isinstance(w, ActorRolloutRefWorker)).actor.engine


def _actor_weights(worker_dict: Any) -> dict[str, torch.Tensor]:
    """Inside the actor worker: a copy of the full HF-named tensors verl's engine hands to ``send_weights``."""
    weights, _ = _engine(worker_dict).get_per_tensor_param()
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights}


def _perturb_actor(worker_dict: Any, seed: int) -> None:
    """Inside the actor worker: seeded noise added to every parameter in place (new weights, no update)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in _engine(worker_dict).module.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            local.add_(0.01 * torch.randn(local.shape, generator=generator, dtype=local.dtype))


def _compare_served(_worker: Any, expected: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Inside the rollout worker: the served parameters compared, those not ``torch.equal`` to ``expected``,
    and the served weight version."""
    from aglverl.verl_plugin.rollout import local_rollout

    server = local_rollout().server
    served = dict(server.model.named_parameters())
    unequal = [
        name for name, p in served.items() if name not in expected or not torch.equal(p, expected[name])
    ]
    return {
        "compared": sorted(name for name in served if name in expected),
        "unequal": sorted(unequal),
        "version": server.weight_version,
    }


def _open_inboxes(_worker: Any) -> int:
    """Inside the rollout worker: how many inboxes the engine holds open (finalize closes them)."""
    from aglverl.verl_plugin import checkpoint

    return len(checkpoint._INBOXES)


def _pid(_worker: Any) -> int:
    import os

    return os.getpid()


# ---------------------------------------------------------------------------------------------- helpers
async def _call(actor: Any, fn: Any, *args: Any) -> Any:
    with anyio.fail_after(STEP_TIMEOUT):
        return await actor.__ray_call__.remote(fn, *args)


async def _new_actor_weights(trainer: Any, seed: int) -> dict[str, torch.Tensor]:
    """Give the actor new weights and return them (as verl's engine reads them)."""
    actor = trainer.actor_rollout_wg.workers[0]
    await _call(actor, _perturb_actor, seed)
    return await _call(actor, _actor_weights)


async def _update(manager: Any, version: int) -> dict[str, float]:
    # verl's manager runs its coroutine itself outside an event loop and blocks in ray.get: call it from a thread
    with anyio.fail_after(STEP_TIMEOUT):
        return await anyio.to_thread.run_sync(manager.update_weights, version)


def _listeners_off_loopback(pids: set[int]) -> list[Any]:
    def loopback(ip: str) -> bool:
        address = ipaddress.ip_address(ip)
        mapped = getattr(address, "ipv4_mapped", None)  # "::ffff:127.0.0.1"
        return address.is_loopback or bool(mapped and mapped.is_loopback)

    sockets = psutil.net_connections(kind="inet")
    listening = [s for s in sockets if s.pid in pids and s.status == psutil.CONN_LISTEN]
    return [s.laddr for s in listening if not loopback(s.laddr.ip)]


def _rollout_group(replica: Any) -> Any:
    """The worker group verl's manager builds over a replica's workers for a sync."""
    from verl.checkpoint_engine.base import _worker_cls
    from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup

    return RayWorkerGroup(
        worker_handles=replica.workers, ray_cls_with_init=RayClassWithInitArgs(cls=_worker_cls)
    )


def _finalize(trainer: Any, rollout: Any) -> None:
    actor_wg = trainer.actor_rollout_wg
    ray.get(
        actor_wg.execute_checkpoint_engine(["finalize"] * actor_wg.world_size)
        + rollout.execute_checkpoint_engine(["finalize"] * rollout.world_size),
        timeout=STEP_TIMEOUT,
    )


# ---------------------------------------------------------------------------------------------- the tests
async def test_the_cpu_engine_delivers_weights_equal_to_the_actors_and_their_version(
    live: tuple[Any, Any, Any],
) -> None:
    trainer, replica, manager = live
    rollout_worker = replica.workers[0]
    first = await _new_actor_weights(trainer, seed=1)
    assert (await _call(rollout_worker, _compare_served, first))[
        "unequal"
    ]  # the replica serves other weights

    metrics = await _update(manager, 7)
    served = await _call(rollout_worker, _compare_served, first)
    assert served["unequal"] == [] and served["version"] == 7
    assert len(served["compared"]) >= 20  # every parameter of the tiny Qwen2 (embeddings tied)
    assert metrics[f"{BACKEND}/bytes"] == sum(t.numel() * t.element_size() for t in first.values())
    greedy = {"temperature": 0, "ignore_eos": True, "max_tokens": 2}
    with anyio.fail_after(STEP_TIMEOUT):
        out = await replica.server_handle.generate.remote(prompt_ids=[5, 6, 7], sampling_params=greedy)
    assert out.extra_fields["global_steps"] == 7 and len(out.token_ids) == 2

    second = await _new_actor_weights(trainer, seed=2)
    assert any(not torch.equal(second[name], first[name]) for name in first)
    await _update(manager, 8)
    served = await _call(rollout_worker, _compare_served, second)
    assert served["unequal"] == [] and served["version"] == 8
    assert await _call(rollout_worker, _open_inboxes) == 0  # verl's manager finalized the sync

    pids = {await _call(worker, _pid) for worker in [*trainer.actor_rollout_wg.workers, rollout_worker]}
    assert _listeners_off_loopback(pids) == []


async def test_a_rollout_waiting_for_a_version_nobody_sends_times_out_naming_it(
    live: tuple[Any, Any, Any],
) -> None:
    trainer, replica, manager = live
    version_before = (await _call(replica.workers[0], _compare_served, {}))["version"]
    rollout = _rollout_group(replica)
    with anyio.fail_after(STEP_TIMEOUT):
        await anyio.to_thread.run_sync(manager.build_process_group, rollout)
        # the trainer sends an older version than the rollout asks for: it is not taken, and nothing else comes
        sent = trainer.actor_rollout_wg.update_weights(global_steps=5, mode=BACKEND)
        await anyio.to_thread.run_sync(ray.get, sent)
        start = time.monotonic()
        with pytest.raises(WeightTransferTimeout, match=r"no weights of version 6 arrived within 10 s"):
            await anyio.to_thread.run_sync(ray.get, rollout.update_weights(global_steps=6))
        waited = time.monotonic() - start
        await anyio.to_thread.run_sync(_finalize, trainer, rollout)
    assert TIMEOUT - 1 <= waited < TIMEOUT + 30
    assert (await _call(replica.workers[0], _compare_served, {}))["version"] == version_before
    assert await _call(replica.workers[0], _open_inboxes) == 0


async def test_a_newer_version_fails_a_waiting_rollout_at_once_and_the_next_sync_goes_through(
    live: tuple[Any, Any, Any],
) -> None:
    trainer, replica, manager = live
    actor_wg = trainer.actor_rollout_wg
    rollout = _rollout_group(replica)
    with anyio.fail_after(STEP_TIMEOUT):
        await anyio.to_thread.run_sync(manager.build_process_group, rollout)
        start = time.monotonic()
        waiting = rollout.update_weights(global_steps=11)
        await anyio.to_thread.run_sync(ray.get, actor_wg.update_weights(global_steps=12, mode=BACKEND))
        with pytest.raises(
            WeightTransferError, match=r"waits for weights of version 11 but the trainer sent 12"
        ):
            await anyio.to_thread.run_sync(ray.get, waiting)
        assert time.monotonic() - start < TIMEOUT  # failed when version 12 arrived, not at the deadline
        await anyio.to_thread.run_sync(_finalize, trainer, rollout)

        # verl's steps again, the rollout asking first this time (the manager starts both sides at once)
        expected = await _new_actor_weights(trainer, seed=3)
        await anyio.to_thread.run_sync(manager.build_process_group, rollout)
        receiving = rollout.update_weights(global_steps=13)
        await anyio.to_thread.run_sync(
            ray.get, actor_wg.update_weights(global_steps=13, mode=BACKEND) + receiving
        )
        await anyio.to_thread.run_sync(_finalize, trainer, rollout)
    served = await _call(replica.workers[0], _compare_served, expected)
    assert served["unequal"] == [] and served["version"] == 13
