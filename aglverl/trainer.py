"""verl's ``RayPPOTrainer``, fed by the daemon: every version-specific call into verl 0.9.x lives here.

:class:`AgentPPOTrainer` is verl's legacy PPO trainer (``verl.trainer.ppo.ray_trainer.RayPPOTrainer``) with one
difference: a step's sequences come from agents, not from verl's own generation. A step is::

    submit the step's samples (rollout.n each, one GRPO group per sample) -> await the daemon's batch
    -> sleep the replicas -> drop is_drop_mask rows, round to whole mini-batches -> balance
    -> old log-probs -> reference log-probs -> values -> KL-in-reward -> rollout correction
    -> advantages (grouped by data id) -> critic update -> actor update (after the critic warm-up)
    -> save a checkpoint when due -> weight sync inside daemon.updating_weights(step) -> validate when due

using verl's own helpers for each phase (``_compute_old_log_prob``, ``_compute_ref_log_prob``,
``_compute_values``, ``compute_advantage``, ``_balance_batch``, the worker groups' ``update_actor`` /
``train_mini_batch``, the checkpoint engine's ``update_weights``, ``_save_checkpoint`` / ``_load_checkpoint``,
``Tracking``, verl's metric functions). Every blocking Ray or worker-group call runs in
``anyio.to_thread.run_sync``, so the event loop keeps serving agents while verl computes.

Rows are triplets (one per LLM call), so a step has ``train_batch_size * rollout.n`` rows only for one-call
agents; each update keeps the configured number of optimizer steps (``train_batch_size / ppo_mini_batch_size``
mini-batches) and rounds the rows to a whole number of equal mini-batches (dropping the fewest rows, chosen at
random). A step left with too few rows for that is skipped and counted (``step/skipped``), never an empty
update.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import torch
from torch.utils.data import Dataset
from tqdm import tqdm
from verl import DataProto
from verl.single_controller.ray import RayWorkerGroup
from verl.trainer.main_ppo_v0 import BaseTaskRunner
from verl.trainer.ppo import ray_trainer as verl_ray_trainer
from verl.trainer.ppo.metric_utils import (
    compute_data_metrics,
    compute_throughout_metrics,
    compute_timing_metrics,
)
from verl.trainer.ppo.ray_trainer import RayPPOTrainer, apply_kl_penalty
from verl.trainer.ppo.utils import create_rl_sampler
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.debug import marked_timer
from verl.utils.metric import reduce_metrics
from verl.utils.py_functional import rename_dict
from verl.utils.tracking import Tracking
from verl.workers.utils.padding import left_right_2_no_padding

from .signals import compute_advantage, logprob_mismatch

__all__ = ["AgentPPOTrainer", "SampleDataset", "build_trainer", "collate_samples"]

logger = logging.getLogger(__name__)

StepCallback = Callable[[int, Mapping[str, float]], None]


class SampleDataset(Dataset):
    """Task inputs (dicts) as a torch ``Dataset``, so verl's stateful data loader samples and checkpoints them."""

    def __init__(self, samples: Sequence[Mapping[str, Any]]) -> None:
        self.samples = list(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Mapping[str, Any]:
        return self.samples[index]


def collate_samples(items: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """A batch of task inputs stays a list: agents get each sample as it is."""
    return list(items)


def _worker_group_class(env: Mapping[str, str], rendezvous_dir: Path | None) -> type[RayWorkerGroup]:
    """verl's ``RayWorkerGroup`` whose workers get our plugin's environment and a rendezvous of their own.

    ``env`` (the plugin variables) reaches the workers even on a Ray started without them. With
    ``rendezvous_dir`` (a Ray this run started on one machine), workers meet through a fresh ``file://``
    rendezvous: verl's default is a torch ``TCPStore``, which listens on every interface
    (``verl/utils/distributed.py:98`` takes ``DIST_INIT_METHOD`` instead).
    """

    class AglverlWorkerGroup(RayWorkerGroup):
        def __init__(self, resource_pool: Any = None, ray_cls_with_init: Any = None, **kwargs: Any) -> None:
            if resource_pool is not None and "worker_env" not in kwargs:
                worker_env = dict(env)
                if rendezvous_dir is not None:
                    from .algorithm import fresh_init_method

                    worker_env["DIST_INIT_METHOD"] = fresh_init_method(rendezvous_dir)
                kwargs["worker_env"] = worker_env
            super().__init__(resource_pool=resource_pool, ray_cls_with_init=ray_cls_with_init, **kwargs)

    return AglverlWorkerGroup


def build_trainer(
    config: Any, train: Sequence[Mapping[str, Any]], val: Sequence[Mapping[str, Any]] | None, runtime: Any
) -> AgentPPOTrainer:
    """Build the trainer the way verl's task runner does (``main_ppo_v0.TaskRunner.run``); blocking.

    Roles and resource pools come from verl's own ``BaseTaskRunner`` helpers; the datasets are task inputs;
    ``runtime`` is the :class:`~aglverl.algorithm.VerlRuntime` of the run. Workers are not started yet
    (:meth:`AgentPPOTrainer.init_workers`).
    """
    runner = BaseTaskRunner()
    runner.add_actor_rollout_worker(config)
    runner.add_critic_worker(config)
    runner.add_reward_model_resource_pool(config)
    runner.add_teacher_model_resource_pool(config)
    model_config = omega_conf_to_dataclass(config.actor_rollout_ref.model)
    train_dataset = SampleDataset(train)
    # verl's constructor insists on a non-empty validation loader; without a validation set it is never used.
    val_dataset = SampleDataset(val or train)
    return AgentPPOTrainer(
        config=config,
        tokenizer=model_config.tokenizer,
        processor=model_config.processor,
        role_worker_mapping=runner.role_worker_mapping,
        resource_pool_manager=runner.init_resource_pool_mgr(config),
        ray_worker_group_cls=_worker_group_class(runtime.env, runtime.rendezvous_dir),
        train_dataset=train_dataset,
        val_dataset=val_dataset,
        collate_fn=collate_samples,
        train_sampler=create_rl_sampler(config.data, train_dataset),
        validation=list(val) if val else None,
    )


@contextmanager
def _timed(name: str, timing: dict[str, float]) -> Iterator[None]:
    """Wall time of a phase that awaits (verl's ``marked_timer`` is for blocking phases)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


class AgentPPOTrainer(RayPPOTrainer):
    """verl's ``RayPPOTrainer`` whose steps take batches from an :class:`~aglverl.daemon.AgentDaemon`.

    ``validation``: validation task inputs (``None``: no validation). Use :meth:`fit_async` (not verl's
    ``fit``, which generates by itself).
    """

    def __init__(self, *args: Any, validation: list[Mapping[str, Any]] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.validation_samples = validation
        self.rollout_config = self.config.actor_rollout_ref.rollout
        self.daemon: Any = None
        self._pending: dict[int, Any] = {}
        self._train_resources: str | None = None
        self._val_resources: str | None = None
        self._rng = np.random.default_rng(int(self.config.actor_rollout_ref.actor.data_loader_seed))

    # ------------------------------------------------------------------------------------ set-up
    @property
    def _checkpoints(self) -> Any:
        """verl's checkpoint-engine manager (weight sync, replica sleep/wake), set by ``init_workers``."""
        if self.checkpoint_manager is None:
            raise RuntimeError("init_workers() has not run")
        return self.checkpoint_manager

    @property
    def rollouts_per_step(self) -> int:
        return int(self.config.data.train_batch_size) * int(self.rollout_config.n)

    def sampling_parameters(self, *, validation: bool = False) -> dict[str, Any]:
        """The sampling parameters agents get in ``main_llm`` (verl's rollout / ``val_kwargs`` settings)."""
        source = self.rollout_config.val_kwargs if validation else self.rollout_config
        params: dict[str, Any] = {
            "temperature": float(source.temperature),
            "top_p": float(source.top_p),
            "max_tokens": int(self.config.data.max_response_length),
        }
        if validation and not source.do_sample:
            params["temperature"] = 0.0
        if int(source.top_k) > 0:
            params["top_k"] = int(source.top_k)
        return params

    def backend_urls(self) -> list[str]:
        """The inference servers verl started (one per rollout replica), as ``http://host:port``."""
        return [f"http://{address}" for address in self.llm_server_manager.get_addresses()]

    def served_model_name(self) -> str:
        """The model name the inference servers answer to (asked from the first one's ``/v1/models``)."""
        import json
        import urllib.request

        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via an HTTP(S)_PROXY
        with direct.open(f"{self.backend_urls()[0]}/v1/models", timeout=30) as response:
            return str(json.load(response)["data"][0]["id"])

    def daemon_kwargs(self, options: Any) -> dict[str, Any]:
        """Keyword arguments for the :class:`~aglverl.daemon.AgentDaemon` that feeds this trainer (blocking)."""
        from .batch import BatchConfig

        data = self.config.data
        pad = self.tokenizer.pad_token_id
        journal = options.journal
        if journal == "auto":
            saves = int(self.config.trainer.save_freq) > 0
            journal = os.path.join(self.config.trainer.default_local_dir, "aglverl.journal") if saves else None
        if journal is not None:
            os.makedirs(os.path.dirname(os.path.abspath(journal)), exist_ok=True)
            if self.config.trainer.resume_mode == "disable" and os.path.exists(journal):
                os.remove(journal)  # a fresh run must not recover another run's steps
        return {
            "host": options.host,
            "port": options.port,
            "proxy_port": options.proxy_port,
            "token": options.token,
            "backends": self.backend_urls(),
            "model": self.served_model_name(),
            "sampling_parameters": self.sampling_parameters(),
            "llm_resource": options.llm_resource,
            "lease_seconds": options.lease_seconds,
            "max_attempts": options.max_attempts,
            "step_timeout": options.step_timeout,
            "vocab_size": len(self.tokenizer),
            "journal_path": journal,
            "signal": options.signal,
            "batch": BatchConfig(
                max_prompt_length=int(data.max_prompt_length),
                max_response_length=int(data.max_response_length),
                pad_token_id=int(pad if pad is not None else 0),
            ),
        }

    def close(self) -> None:
        """Stop this trainer's Ray actors and free its placement groups (blocking; for a shared Ray session)."""
        import ray
        from ray.util import remove_placement_group

        actors: list[Any] = []
        for name in ("actor_rollout_wg", "critic_wg"):
            group = getattr(self, name, None)
            if group is not None:
                actors += list(group.workers)
        manager = getattr(self, "llm_server_manager", None)
        if manager is not None:
            actors += [h for replica in manager.get_replicas() for h in replica.servers]
            if getattr(manager, "global_load_balancer", None) is not None:
                actors.append(manager.global_load_balancer)
        actors += list(getattr(getattr(self, "async_rollout_manager", None), "agent_loop_workers", []) or [])
        actors += list(getattr(getattr(self, "reward_loop_manager", None), "reward_loop_workers", []) or [])
        for actor in actors:
            try:
                ray.kill(actor)
            except Exception as exc:  # already gone: nothing to stop
                logger.debug("ray.kill(%s): %s", actor, exc)
        for pool in self.resource_pool_manager.resource_pool_dict.values():
            for pg in getattr(pool, "pgs", None) or []:
                remove_placement_group(pg)

    # ------------------------------------------------------------------------------------ the loop
    async def fit_async(
        self, daemon: Any, *, on_step: Sequence[StepCallback] = (), progress: bool = True
    ) -> dict[str, float]:
        """Train until ``trainer.total_training_steps`` (or epochs) are done; returns the last step's metrics.

        ``daemon`` must be serving, with this trainer's servers as its backends. ``on_step(step, metrics)`` is
        called after each step's metrics are logged. ``progress``: a progress bar on stderr (step, reward,
        generated tokens/s). Cancellation stops after the Ray call in progress.
        """
        from omegaconf import OmegaConf

        self.daemon = daemon
        self._train_resources = daemon.update_resources({"main_llm": daemon.main_llm(self.sampling_parameters())})
        self._val_resources = daemon.update_resources(
            {"main_llm": daemon.main_llm(self.sampling_parameters(validation=True))}
        )
        tracker = Tracking(
            project_name=self.config.trainer.project_name,
            experiment_name=self.config.trainer.experiment_name,
            default_backend=self.config.trainer.logger,
            config=OmegaConf.to_container(self.config, resolve=True),
        )
        self.global_steps = 0
        await anyio.to_thread.run_sync(self._load_checkpoint)
        await self._sync_weights({})
        try:
            return await self._fit(tracker, on_step, progress)
        finally:
            tracker.finish()  # flushes wandb / tensorboard

    async def _fit(self, tracker: Tracking, on_step: Sequence[StepCallback], progress: bool) -> dict[str, float]:
        last: dict[str, float] = {}
        if self.validation_samples and self.config.trainer.get("val_before_train", True):
            last = await self.validate_async()
            tracker.log(data=last, step=self.global_steps)
        epoch0 = self.global_steps // len(self.train_dataloader)
        self.global_steps += 1
        recovered = self._resumable(self.daemon.recovered_steps)
        bar = tqdm(
            total=self.total_training_steps,
            initial=self.global_steps - 1,
            desc="aglverl training",
            unit="step",
            file=sys.stderr,
            disable=not progress,
        )
        with bar:
            for epoch in range(epoch0, int(self.config.trainer.total_epochs)):
                for samples in self.train_dataloader:
                    metrics = await self._step(samples, recovered, epoch)
                    tracker.log(data=metrics, step=self.global_steps)
                    for callback in on_step:
                        callback(self.global_steps, metrics)
                    bar.set_postfix(
                        reward=f"{metrics.get('training/reward', 0.0):.3f}",
                        tok_s=f"{metrics.get('step/generated_tokens_per_s', 0.0):.0f}",
                    )
                    bar.update(1)
                    last = metrics
                    if self.global_steps >= self.total_training_steps:
                        return last
                    self.global_steps += 1
        return last

    async def _step(self, samples: list[Mapping[str, Any]], recovered: list[Any], epoch: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        timing: dict[str, float] = {}
        is_last = self.global_steps >= self.total_training_steps
        with _timed("step", timing):
            with _timed("gen", timing):
                if recovered:
                    # A step the journal recovered is this step (the data loader replays its samples).
                    step = recovered.pop(0)
                else:
                    step = await self.daemon.submit(
                        samples,
                        n=int(self.rollout_config.n),
                        resources_id=self._train_resources,
                        metadata={"global_step": self.global_steps},
                    )
                training_batch = await self._batch_of(step.number)
            metrics.update(training_batch.metrics)
            oldest = metrics.get("step/call_weight_version_min", -1.0)
            if oldest >= 0:  # how many weight updates behind the oldest call of the batch was (0: on-policy)
                metrics["step/staleness"] = float(self.global_steps - 1 - oldest)
            await anyio.to_thread.run_sync(self._checkpoints.sleep_replicas)
            batch = await anyio.to_thread.run_sync(self._update, training_batch.data, metrics, timing)
            if int(self.config.trainer.save_freq) > 0 and (is_last or self._due(self.config.trainer.save_freq)):
                with _timed("save_checkpoint", timing):
                    await anyio.to_thread.run_sync(self._save_checkpoint)
            await self._sync_weights(timing)
        if self.validation_samples and (is_last or self._due(self.config.trainer.test_freq)):
            with _timed("testing", timing):
                metrics.update(await self.validate_async())
        metrics.update({"training/global_step": self.global_steps, "training/epoch": epoch})
        metrics.update(self._step_metrics(batch, timing))
        return metrics

    def _resumable(self, recovered: Sequence[Any]) -> list[Any]:
        """The journal's unfinished step that is this run's next step, if any; the others are abandoned.

        After a crash, the journal holds the step that was in flight. If it is the step after the checkpoint
        this run resumed from, its finished rollouts were generated by the checkpoint's weights and are kept
        (the data loader replays the same samples); a later step's rollouts came from weights the crash lost,
        and validation results are stale: those steps' unfinished rollouts are failed and their batches unused.
        """
        keep: list[Any] = []
        for step in recovered:
            if step.mode == "train" and step.metadata.get("global_step") == self.global_steps and not keep:
                keep.append(step)
                logger.info("resuming step %d with rollouts recovered from the journal", self.global_steps)
            else:
                self.daemon.abandon(step, f"not resumed: the trainer restarted at step {self.global_steps}")
        return keep

    def _due(self, frequency: int) -> bool:
        return int(frequency) > 0 and self.global_steps % int(frequency) == 0

    async def _batch_of(self, number: int) -> Any:
        """The daemon's batch for step ``number`` (batches of other steps are kept for their turn)."""
        while number not in self._pending:
            batch = await self.daemon.batches.receive()
            self._pending[batch.step] = batch
        return self._pending.pop(number)

    async def _sync_weights(self, timing: dict[str, float]) -> None:
        """Push the actor's weights to the rollout replicas while the proxy holds new LLM calls.

        Calls made afterwards are recorded with weight version ``global_steps``.
        """
        with _timed("update_weights", timing):
            async with self.daemon.updating_weights(self.global_steps):
                await anyio.to_thread.run_sync(self._checkpoints.update_weights, self.global_steps)

    # ------------------------------------------------------------------------------------ validation
    async def validate_async(self) -> dict[str, float]:
        """Run the validation samples through the agents (``val_kwargs`` sampling); ``val/reward`` per source.

        Samples with a ``data_source`` key are also reported per source (``val/reward/<source>``).
        """
        samples = self.validation_samples or []
        by_source: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
        for sample in samples:
            by_source[str(sample.get("data_source", ""))].append(sample)
        n = int(self.rollout_config.val_kwargs.n)
        steps = {
            source: await self.daemon.submit(group, n=n, mode="val", resources_id=self._val_resources)
            for source, group in by_source.items()
        }
        metrics: dict[str, float] = {}
        reward_sum = rollouts = 0.0
        for source, step in steps.items():
            report = (await step.wait()).metrics
            reward_sum += report["val/reward"] * report["val/n_rollouts"]
            rollouts += report["val/n_rollouts"]
            if source:
                metrics[f"val/reward/{source}"] = report["val/reward"]
            if len(steps) == 1:  # one group: its response lengths and turn counts are the whole set's
                metrics.update({k: v for k, v in report.items() if k.startswith("val/")})
        metrics["val/reward"] = reward_sum / rollouts if rollouts else 0.0
        metrics["val/n_rollouts"] = rollouts
        return metrics

    # ------------------------------------------------------------------------------------ the update
    def _update(self, data: DataProto, metrics: dict[str, float], timing: dict[str, float]) -> DataProto | None:
        """Everything after generation up to the actor update (blocking; runs in a worker thread)."""
        prepared = self._prepare(data, metrics)
        if prepared is None:
            return None
        batch = prepared
        with marked_timer("old_log_prob", timing):
            batch = self._with_old_log_probs(batch, metrics)
        if self.use_reference_policy:
            with marked_timer("ref", timing):
                batch = batch.union(self._compute_ref_log_prob(batch))
        if self.use_critic:
            with marked_timer("values", timing):
                batch = batch.union(self._compute_values(batch))
        with marked_timer("adv", timing):
            batch = self._with_advantages(batch, metrics)
        if self.use_critic:
            with marked_timer("update_critic", timing):
                output = self._update_critic(batch)
            metrics.update(reduce_metrics(output.meta_info["metrics"]))
        if int(self.config.trainer.critic_warmup) <= self.global_steps:
            with marked_timer("update_actor", timing):
                output = self._update_actor(batch)
            metrics.update(reduce_metrics(output.meta_info["metrics"]))
        return batch

    def _prepare(self, batch: DataProto, metrics: dict[str, float]) -> DataProto | None:
        """Drop ``is_drop_mask`` rows, round to whole mini-batches, balance, add verl's ``meta_info``."""
        n_rows = len(batch)
        keep = np.flatnonzero(~batch.batch["is_drop_mask"].numpy()) if n_rows else np.zeros(0, np.int64)
        unit = self._row_unit()
        rows = len(keep) // unit * unit
        metrics["step/n_rows"] = float(n_rows)
        metrics["step/n_rows_dropped_prompt_too_long"] = float(n_rows - len(keep))
        metrics["step/n_rows_trimmed_to_mini_batches"] = float(len(keep) - rows)
        metrics["step/skipped"] = float(rows == 0)
        if rows == 0:
            logger.warning(
                "step %d: %d usable rows, fewer than the %d one update needs (mini-batches x data-parallel "
                "ranks x micro-batch size); step skipped",
                self.global_steps,
                len(keep),
                unit,
            )
            return None
        if rows < len(keep):
            keep = np.sort(self._rng.choice(keep, size=rows, replace=False))
        batch = batch.select_idxs(keep) if len(keep) < n_rows else batch
        batch.meta_info["temperature"] = float(self.rollout_config.temperature)
        batch.meta_info["images_seqlens"] = []
        if self.config.trainer.balance_batch and self._get_dp_size(self.actor_rollout_wg, "actor") > 1:
            # Only data-parallel ranks have loads to balance; with one, verl's partitioning (~40 ms for 128
            # rows) would only reorder the batch.
            self._balance_batch(batch, metrics=metrics)
        batch.meta_info["global_token_num"] = torch.sum(batch.batch["attention_mask"], dim=-1).tolist()
        return batch

    def _mini_batches(self, ppo_mini_batch_size: int) -> int:
        """How many optimizer steps an update takes: verl's ``train_batch_size / ppo_mini_batch_size``."""
        return max(1, int(self.config.data.train_batch_size) // int(ppo_mini_batch_size))

    def _row_unit(self) -> int:
        """A step's rows are rounded down to a multiple of this.

        Every worker needs equal shares (data-parallel ranks), every update equal mini-batches, and, without
        ``use_dynamic_bsz``, every share a whole number of micro-batches (verl asserts it,
        ``workers/engine/utils.py:125``).
        """
        actor = self.config.actor_rollout_ref.actor
        dynamic = bool(actor.use_dynamic_bsz)
        factors = [self._mini_batches(actor.ppo_mini_batch_size) * (1 if dynamic else int(actor.ppo_micro_batch_size_per_gpu or 1))]
        if not dynamic:
            factors.append(int(self.rollout_config.log_prob_micro_batch_size_per_gpu or 1))
            if self.use_reference_policy:
                factors.append(int(self.config.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu or 1))
        if self.use_critic:
            critic = self.config.critic
            micro = 1 if critic.use_dynamic_bsz else int(critic.ppo_micro_batch_size_per_gpu or 1)
            factors.append(self._mini_batches(critic.ppo_mini_batch_size) * micro)
            if not critic.use_dynamic_bsz:
                factors.append(int(critic.forward_micro_batch_size_per_gpu or 1))
        return self._get_dp_size(self.actor_rollout_wg, "actor") * math.lcm(*factors)

    def _with_old_log_probs(self, batch: DataProto, metrics: dict[str, float]) -> DataProto:
        correction = self.config.algorithm.get("rollout_correction", None)
        if correction is not None and correction.get("bypass_mode", False) and "rollout_log_probs" in batch.batch:
            from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode

            apply_bypass_mode(
                batch=batch,
                rollout_corr_config=correction,
                policy_loss_config=self.config.actor_rollout_ref.actor.policy_loss,
            )
            return batch
        old_log_prob, mfu = self._compute_old_log_prob(batch)
        actor = self.config.actor_rollout_ref.actor
        entropy = verl_ray_trainer.agg_loss(
            loss_mat=old_log_prob.batch["entropys"],
            loss_mask=batch.batch["response_mask"],
            loss_agg_mode=actor.loss_agg_mode,
            loss_scale_factor=actor.loss_scale_factor,
        )
        metrics["actor/entropy"] = float(entropy.detach().item())
        metrics["perf/mfu/actor_infer"] = float(mfu)
        old_log_prob.batch.pop("entropys")
        batch = batch.union(old_log_prob)
        if "rollout_log_probs" in batch.batch:
            metrics.update(
                logprob_mismatch(
                    batch.batch["old_log_probs"], batch.batch["rollout_log_probs"], batch.batch["response_mask"]
                )
            )
        return batch

    def _with_advantages(self, batch: DataProto, metrics: dict[str, float]) -> DataProto:
        algorithm = self.config.algorithm
        if algorithm.use_kl_in_reward:
            batch, kl_metrics = apply_kl_penalty(batch, kl_ctrl=self.kl_ctrl_in_reward, kl_penalty=algorithm.kl_penalty)
            metrics.update(kl_metrics)
        else:
            batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
        correction = algorithm.get("rollout_correction", None)
        if correction is not None and "rollout_log_probs" in batch.batch and not correction.get("bypass_mode", False):
            from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

            batch, correction_metrics = compute_rollout_correction_and_add_to_batch(batch, correction)
            metrics.update(correction_metrics)
        # aglverl's drop-in for verl's compute_advantage: the same estimators, plus the signal controls' row and
        # group weights (identical to verl's when those are ones)
        return compute_advantage(
            batch,
            adv_estimator=algorithm.adv_estimator,
            gamma=algorithm.gamma,
            lam=algorithm.lam,
            num_repeat=int(self.rollout_config.n),
            norm_adv_by_std_in_grpo=algorithm.get("norm_adv_by_std_in_grpo", True),
            config=algorithm,
        )

    def _train_args(self, batch: DataProto, ppo_mini_batch_size: int, section: Any) -> Any:
        """The batch as verl's workers take it, split into this step's equal mini-batches."""
        batch_td = left_right_2_no_padding(batch.to_tensordict())
        mini_batch = len(batch) // self._mini_batches(ppo_mini_batch_size)
        tu.assign_non_tensor(
            batch_td,
            global_batch_size=mini_batch,
            mini_batch_size=mini_batch,
            epochs=int(section.ppo_epochs),
            seed=int(section.data_loader_seed),
            dataloader_kwargs={"shuffle": bool(section.shuffle)},
        )
        return batch_td

    def _update_actor(self, batch: DataProto) -> DataProto:
        """verl's ``_update_actor`` with this step's mini-batch size (rows, not prompts x n)."""
        actor = self.config.actor_rollout_ref.actor
        batch.meta_info["multi_turn"] = bool(self.rollout_config.multi_turn.enable)
        batch.meta_info["temperature"] = float(self.rollout_config.temperature)
        batch_td = self._train_args(batch, actor.ppo_mini_batch_size, actor)
        tu.assign_non_tensor(
            batch_td,
            calculate_entropy=bool(actor.calculate_entropy or actor.entropy_coeff != 0.0),
            distillation_use_topk=False,
            distillation_only=False,
            compute_loss=True,
        )
        output = tu.get(self.actor_rollout_wg.update_actor(batch_td), "metrics")
        output = rename_dict(output, "actor/")
        output["perf/mfu/actor"] = output.pop("actor/mfu")
        return DataProto.from_single_dict(data={}, meta_info={"metrics": output})

    def _update_critic(self, batch: DataProto) -> DataProto:
        """verl's ``_update_critic`` with this step's mini-batch size."""
        critic = self.config.critic
        batch_td = self._train_args(batch, critic.ppo_mini_batch_size, critic)
        output = tu.get(self.critic_wg.train_mini_batch(batch_td).get(), "metrics")
        output = rename_dict(output, "critic/")
        output["perf/mfu/critic"] = output.pop("critic/mfu")
        return DataProto.from_single_dict(data={}, meta_info={"metrics": output})

    # ------------------------------------------------------------------------------------ metrics
    def _step_metrics(self, batch: DataProto | None, timing: dict[str, float]) -> dict[str, float]:
        """verl's data / timing / throughput metrics plus aglverl's step, staleness and proxy counters."""
        metrics: dict[str, float] = {f"timing_s/{name}": seconds for name, seconds in timing.items()}
        if batch is not None:
            metrics.update(compute_data_metrics(batch=batch, use_critic=self.use_critic))
            metrics.update(compute_timing_metrics(batch=batch, timing_raw=timing))
            metrics.update(
                compute_throughout_metrics(
                    batch=batch, timing_raw=timing, n_gpus=self.resource_pool_manager.get_n_gpus()
                )
            )
            response_tokens = float(batch.batch["response_mask"].sum().item())
            metrics["step/generated_tokens_per_s"] = response_tokens / max(timing.get("gen", 0.0), 1e-9)
        metrics["step/weight_version"] = float(self.global_steps)
        metrics.update(self.daemon.proxy_counters())
        return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
