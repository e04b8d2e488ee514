"""verl's V1 trainer of the configured mode with aglverl's hooks and phases (see :func:`trainer_class`)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..metrics import overlap_shares
from ..proxy.control import GAUGES
from ..trajectory.groups import aggregate_stats
from .active_run import Run, current_run

logger = logging.getLogger(__name__)


def _base_trainer() -> type:
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    return PPOTrainer


PPOTrainerBase = _base_trainer()


# ---------------------------------------------------------------------------------------------- trainer
class Hooks:
    """What aglverl adds around verl's trainer of the configured mode (mixed in before it): the proxy held
    around sleeping replicas and weight updates, the journal trimmed at checkpoints, aglverl's metrics.
    While the proxy is held (up to ``aglverl.hold_timeout``) the store's lease clock is stopped, so an agent
    waiting for a held call keeps its task however long the trainer's update takes.

    ``sync``: at the end of sampling the proxy holds new calls and drains those in flight (nothing is left
    queued in an engine), then verl puts the replicas to sleep; calls go on after the weight update.
    ``colocate_async``: the proxy holds new calls but does not drain: verl aborts the engines' generations
    and the proxy continues each aborted one after the update (the agent sees one answer, generated across
    two weight versions). ``separate_async``: agents keep generating on the standalone replicas while the
    trainer trains; the proxy holds calls only around the weight update, which aborts and resumes as above.
    """

    _aglverl: Run

    def on_step_begin(self) -> None:
        self._step_started = time.monotonic()
        self._computing: list[tuple[float, float]] = []
        daemon = self._aglverl.daemon
        assert daemon is not None
        self._aglverl.await_on_loop(daemon.refresh_proxy_figures)  # proxy shards: their figures now
        self._tokens_before = self._aglverl.on_loop(daemon.generated_tokens)
        super().on_step_begin()  # type: ignore[misc]

    def on_sample_end(self) -> None:
        run = self._aglverl
        assert run.daemon is not None
        mode = self.trainer_mode  # type: ignore[attr-defined]
        if mode != "separate_async":
            # sync: drain while the engines still serve, then they sleep; colocate_async: verl aborts the
            # engines' generations next, and the proxy continues each after the update
            run.await_on_loop(functools.partial(run.daemon.hold_for_update, drain=mode == "sync"))
        # This step has asked for everything of it a previous run left in flight that it wants again (verl
        # re-issues its checkpoint's in-flight prompts before the first step; a replayed data loader asks a
        # step's prompts at that step): the previous run's groups of this step and before are dropped.
        run.on_loop(run.producer.end_recovery, int(self.global_steps))  # type: ignore[attr-defined]
        super().on_sample_end()  # type: ignore[misc]
        self._compute_from = time.monotonic()

    def on_step_end(self) -> None:
        run = self._aglverl
        assert run.daemon is not None
        if self.trainer_mode == "separate_async":  # type: ignore[attr-defined]
            # the update aborts the standalone engines' generations; the proxy continues each after it
            run.await_on_loop(functools.partial(run.daemon.hold_for_update, drain=False))
        try:
            super().on_step_end()  # type: ignore[misc]
        finally:
            run.await_on_loop(run.daemon.release_after_update, int(self.global_steps))  # type: ignore[attr-defined]
            self._computing.append((self._compute_from, time.monotonic()))

    def _save_checkpoint(self) -> None:
        run = self._aglverl
        assert run.daemon is not None
        # One step on the loop: the groups finished now go into TransferQueue before verl snapshots it, and
        # exactly those are journaled as covered (a group finishing between a flush and a separate look would
        # be covered without being in the snapshot, and answered again after a crash). Groups finishing during
        # the save (the async modes' agents go on) are not in it, and stay journaled. The record is written
        # before the save starts, so a kill at any moment of it never lets a restart reuse a group the
        # checkpoint may have trained.
        covered = run.await_on_loop(run.producer.covering, int(self.global_steps))  # type: ignore[attr-defined]
        run.await_on_loop(run.daemon.commit_journal)
        super()._save_checkpoint()  # type: ignore[misc]
        run.on_loop(run.producer.checkpointed, covered)

    def _validate(self) -> dict[str, float]:
        metrics = super()._validate()  # type: ignore[misc]
        run = self._aglverl
        stats = run.on_loop(run.producer.take_partition, "val")
        n = sum(s.n_rollouts for s in stats)
        metrics["val/reward"] = sum(s.reward_sum for s in stats) / n if n else 0.0
        metrics["val/n_rollouts"] = float(n)
        metrics["val/n_rollouts_w_reward"] = float(sum(s.n_completed for s in stats))  # agl.VERL's name
        return metrics

    def _compute_metrics(
        self, batch: Any, metrics: dict[str, Any], timing_raw: dict, global_steps: int, epoch: int
    ) -> None:
        super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)  # type: ignore[misc]
        run = self._aglverl
        uids = trained_uids(batch)
        metrics.update(_step_metrics(self, run, uids, timing_raw))
        if int(self.config.trainer.save_freq) <= 0:  # type: ignore[attr-defined]
            # Nothing checkpoints: a restart begins again at step 1, so a trained group is never needed
            # again; the journal keeps only the groups not trained yet (bounded by the work in flight).
            run.on_loop(run.producer.checkpointed, sorted(set(uids)))
        clean = {k: float(v) for k, v in metrics.items() if _finite_number(v)}
        if run.bar is not None:
            run.bar.set_postfix(
                reward=f"{clean.get('training/reward', 0.0):.3f}",
                tok_s=f"{clean.get('step/generated_tokens_per_s', 0.0):.0f}",
                refresh=False,
            )
        for callback in run.on_step:
            run.on_loop(callback, int(global_steps), clean)


class Phases(PPOTrainerBase):  # type: ignore[valid-type,misc]
    """verl's step phases where aglverl does them differently (placed right above verl's ``PPOTrainer`` in
    the trainer's class order, so a mode's own version of a phase, e.g. separate_async's version-aware old
    log-probs, still wraps aglverl's): advantages on whole groups, the engine's log-probs checked in one
    pass, no balancing with one rank, model workers reading only the columns they use."""

    def _compute_old_log_prob(self, batch: Any, metrics: dict[str, Any]) -> Any:
        rollout = self.config.actor_rollout_ref.rollout
        correction = self.config.algorithm.get("rollout_correction", None)
        if not rollout.calculate_log_probs:
            return super()._compute_old_log_prob(batch, metrics)
        if correction is not None and correction.get("bypass_mode", False):
            # verl's bypass copies rollout_log_probs into old_log_probs without reading which rows have them:
            # a row without the engine's log-probs would train against log-probs of 0. Such rows get the
            # trainer's first (as in the decoupled path), then verl copies.
            if _rows_missing_logprobs(batch):
                batch = _old_log_probs(self, batch, metrics)
            else:
                metrics["logprobs/n_rows_missing"] = 0.0
            return super()._compute_old_log_prob(batch, metrics)
        return _old_log_probs(self, batch, metrics)

    def _balance_batch(self, batch: Any, metrics: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        # verl pads the batch to whole mini-batches and then reorders it so that data-parallel ranks get equal
        # token loads; with one rank (or trainer.balance_batch off) there is nothing to balance (measured:
        # the partitioning costs ~100 ms a step here), so only the padding is done.
        from verl.trainer.ppo.padding_utils import upsample_batch_to_divisible_size

        group = self.actor_rollout_wg
        if "actor" not in group._dispatch_info:
            group._dispatch_info["actor"] = group._query_dispatch_info("actor")
        dp_size = max(group._dispatch_info["actor"]) + 1
        if dp_size > 1 and self.config.trainer.balance_batch:
            return super()._balance_batch(batch, metrics, *args, **kwargs)
        multiple = self._get_required_batch_multiple(dp_size)
        return upsample_batch_to_divisible_size(batch, multiple, self.tokenizer.eos_token_id)

    def _compute_advantage(self, batch: Any, metrics: dict[str, Any]) -> Any:
        return _advantages(self, batch, metrics)

    # verl's workers read every column of a batch from TransferQueue; these hand them only what a worker
    # reads (measured: ~2 ms per column of 128 rows on every worker call).
    def _compute_ref_log_prob(self, batch: Any, metrics: dict[str, Any]) -> Any:
        super()._compute_ref_log_prob(for_workers(batch), metrics)
        return batch

    def _compute_values(self, batch: Any, metrics: dict[str, Any]) -> Any:
        super()._compute_values(for_workers(batch), metrics)
        return batch

    def _update_critic(self, batch: Any, metrics: dict[str, Any]) -> Any:
        super()._update_critic(for_workers(batch), metrics)
        return batch

    def _update_actor(self, batch: Any, metrics: dict[str, Any]) -> Any:
        super()._update_actor(for_workers(batch), metrics)
        return batch


def _rows_missing_logprobs(batch: Any) -> bool:
    """Whether any row of the batch came without the engine's log-probs (``rollout_log_probs_valid = 0``)."""
    import transfer_queue as tq

    data = tq.kv_batch_get(
        keys=batch.keys, partition_id=batch.partition_id, select_fields=["rollout_log_probs_valid"]
    )
    return bool((data["rollout_log_probs_valid"] == 0).any())


def _old_log_probs(trainer: Any, batch: Any, metrics: dict[str, Any]) -> Any:
    """verl's ``_compute_old_log_prob`` with the engine's log-probs: one read and one write of TransferQueue,
    as verl's own; rows without the engine's log-probs (``rollout_log_probs_valid = 0``) get the trainer's
    first (on-policy by assumption), then the engine's are compared with the trainer's over the rest: verl's
    ``training/rollout_probs_diff_*`` and aglverl's ``logprobs/*`` (mean / max absolute difference, k3 KL,
    rows missing)."""
    import transfer_queue as tq
    from verl import DataProto
    from verl.trainer.ppo.core_algos import agg_loss
    from verl.utils.debug.metrics import calculate_debug_metrics
    from verl.workers.utils.padding import response_from_nested, response_to_nested

    from ..trajectory.signals import logprob_mismatch, stand_in_logprobs

    config = trainer.config
    batch.extra_info.update(
        {
            "calculate_entropy": True,
            "compute_loss": False,
            "temperature": config.actor_rollout_ref.rollout.temperature,
        }
    )
    output = trainer.actor_rollout_wg.compute_log_prob(for_workers(batch))
    assert len(output) == len(batch)
    fields = [
        "entropy",
        "log_probs",
        "response_mask",
        "responses",
        "rollout_log_probs",
        "rollout_log_probs_valid",
    ]
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
    response_mask = data["response_mask"]
    data["old_log_probs"] = response_from_nested(data.pop("log_probs"), response_mask)
    data["entropy"] = response_from_nested(data.pop("entropy"), response_mask)
    valid = data.pop("rollout_log_probs_valid") if "rollout_log_probs_valid" in data.keys() else None
    padded = DataProto(batch=data.to_padded_tensor())
    written = ["old_log_probs", "entropy"]
    missing = torch.zeros(len(batch), dtype=torch.bool)
    if valid is not None:
        missing = stand_in_logprobs(padded.batch["rollout_log_probs"], padded.batch["old_log_probs"], valid)
    if bool(missing.any()):
        data["rollout_log_probs"] = response_to_nested(padded.batch["rollout_log_probs"], response_mask)
        written.append("rollout_log_probs")
    batch = tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=data.select(*written))
    actor = config.actor_rollout_ref.actor
    entropy = agg_loss(
        loss_mat=padded.batch["entropy"],
        loss_mask=padded.batch["response_mask"],
        loss_agg_mode=actor.loss_agg_mode,
        loss_scale_factor=actor.loss_scale_factor,
    )
    metrics["actor/entropy"] = entropy.detach().item()
    if "rollout_log_probs" in padded.batch.keys():
        metrics.update(calculate_debug_metrics(padded))
        metrics.update(
            logprob_mismatch(
                padded.batch["old_log_probs"],
                padded.batch["rollout_log_probs"],
                padded.batch["response_mask"],
                rows=~missing,
            )
        )
    metrics["logprobs/n_rows_missing"] = float(missing.sum())
    return batch


def _finite_number(value: Any) -> bool:
    if isinstance(value, (bool, dict, str)) or value is None:
        return False
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _step_metrics(trainer: Any, run: Run, uids: list[str], timing: Mapping[str, float]) -> dict[str, float]:
    """aglverl's metrics of a step: its groups' (reward over every rollout, failures at their failure
    reward; rows, filters), the proxy's counts of the step (``proxy/*``: what it counted since the previous
    step's metrics, the first step's since the daemon started; the daemon's :meth:`proxy_counters` are the
    run's totals; a reading such as the loop's lag is the one now), generated tokens/s over every generated token, and how the step's wall time split between
    the engines generating and the trainer computing. Every figure is the step's own, none a running total."""
    daemon = run.daemon
    assert daemon is not None
    stop = time.monotonic()
    start = trainer._step_started

    def on_loop() -> tuple[list[Any], dict[str, float], list[tuple[float, float]], float]:
        producer = daemon.producer
        assert producer is not None
        stats = producer.take_stats(uids)
        return (
            stats,
            daemon.proxy_counters(),
            daemon.proxy_activity.busy_intervals(start, stop),
            daemon.generated_tokens(),
        )

    run.await_on_loop(daemon.refresh_proxy_figures)  # proxy shards: their figures now
    stats, counters, generating, tokens = run.on_loop(on_loop)
    metrics = aggregate_stats(stats)
    # groups a resumed run found in verl's TransferQueue checkpoint were answered by the previous process:
    # their stats died with it (verl's own critic/score/* still covers their rows)
    metrics["step/n_groups_restored"] = float(len(set(uids) - {s.uid for s in stats}))
    reported: Mapping[str, float] = getattr(trainer, "_proxy_reported", {})
    metrics.update(
        {
            name: total if name in GAUGES else total - reported.get(name, 0.0)
            for name, total in counters.items()
        }
    )
    trainer._proxy_reported = counters
    computing = [(max(a, start), min(b, stop)) for a, b in trainer._computing if b > start]
    shares = overlap_shares(start, stop, generating, computing)
    wall = stop - start
    metrics.update(
        {
            "step/wall_seconds": wall,
            "step/share_generating_only": shares["first_only"],
            "step/share_computing_only": shares["second_only"],
            "step/share_both": shares["both"],
            "step/share_neither": shares["neither"],
            "step/generated_tokens": tokens - trainer._tokens_before,
            "step/generated_tokens_per_s": (tokens - trainer._tokens_before) / wall if wall > 0 else 0.0,
            "step/weight_version": float(trainer.global_steps),
        }
    )
    low = metrics.get("step/call_weight_version_min")
    if low is not None:
        metrics["step/staleness"] = float(trainer.global_steps - 1 - low)
    metrics.update({agl: metrics[ours] for agl, ours in AGL_VERL_NAMES.items() if ours in metrics})
    return metrics


#: The names Agent Lightning's ``agl.VERL`` logs its step counts under, for aglverl's same figures (a program
#: moved from ``agl.VERL`` keeps its dashboards): ``training/reward``, ``val/reward``, ``training/global_step``
#: and ``training/epoch`` are already those names.
AGL_VERL_NAMES = {
    "training/n_rollouts": "step/n_rollouts",
    "training/n_rollouts_w_reward": "step/n_completed",
    "training/n_triplets": "batch/n_triplets",
    "training/n_truncated_triplets": "batch/n_responses_truncated",
    "training/n_triplets_prompt_too_long": "batch/n_prompts_truncated",
}


def _advantages(trainer: Any, batch: Any, metrics: dict[str, Any]) -> Any:
    """verl's ``_compute_advantage`` phases (KL in reward, rollout correction) with aglverl's advantages.

    GRPO groups are whole prompt groups (or, per_step, a prompt's turn): every rollout is one member, whatever
    its number of rows (each row weighs ``1/k`` in its group's mean and std), the turn weighting scales each
    row in the loss (``advantage_weights``), and rows the batch builder kept out of the loss still count in
    their group's statistics. Padding rows verl adds have no loss tokens and a group of their own.
    """
    import transfer_queue as tq
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import apply_kl_penalty
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
    from verl.workers.utils.padding import response_to_nested

    from ..trajectory.signals import ROWS_DROPPED, compute_advantage, per_rollout_weights

    config = trainer.config
    algorithm = config.algorithm
    correction = algorithm.get("rollout_correction", None)
    estimator = str(getattr(algorithm.adv_estimator, "value", algorithm.adv_estimator))
    # only what this step's advantages read (each column read costs ~2 ms per 128 rows here)
    fields = ["uid", "response_mask", "rm_scores", "advantage_weights"]
    if correction is not None and not correction.get("bypass_mode", False):
        fields += ["rollout_log_probs", "old_log_probs"]
    if algorithm.use_kl_in_reward:
        fields += ["old_log_probs", "ref_log_prob"]
    if estimator == "gae" or estimator not in _SCORE_ONLY_ESTIMATORS:
        fields += ["values", "rollout_log_probs", "old_log_probs", "ref_log_prob"]  # all verl itself reads
    raw = tq.kv_batch_get(
        keys=batch.keys, partition_id=batch.partition_id, select_fields=list(dict.fromkeys(fields))
    )
    response_mask = raw["response_mask"]
    data = DataProto(batch=raw.to_padded_tensor())
    data.batch["token_level_scores"] = data.batch["rm_scores"]
    data.non_tensor_batch["uid"] = np.array(data.batch.pop("uid").tolist(), dtype=object)
    # each row's rollout (``{uid}_{session}``): a GRPO group's members are counted, never summed from weights
    members = np.array([key.rsplit("_", 1)[0] for key in batch.keys], dtype=object)
    data.non_tensor_batch["rollout_id_list"] = members
    if algorithm.use_kl_in_reward:
        data, kl_metrics = apply_kl_penalty(
            data, kl_ctrl=trainer.kl_ctrl_in_reward, kl_penalty=algorithm.kl_penalty
        )
        metrics.update(kl_metrics)
    else:
        data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    corrected = (
        correction is not None
        and "rollout_log_probs" in data.batch
        and not correction.get("bypass_mode", False)
    )
    if corrected:
        data, correction_metrics = compute_rollout_correction_and_add_to_batch(data, correction)
        metrics.update(correction_metrics)
    if estimator in ("grpo", "grpo_vectorized") and trainer._aglverl.signal.advantage == "broadcast":
        data.batch["group_weights"] = per_rollout_weights(members)
    data = compute_advantage(
        data,
        adv_estimator=algorithm.adv_estimator,
        gamma=algorithm.gamma,
        lam=algorithm.lam,
        num_repeat=int(config.actor_rollout_ref.rollout.n),
        norm_adv_by_std_in_grpo=algorithm.get("norm_adv_by_std_in_grpo", True),
        config=algorithm,
    )
    metrics[ROWS_DROPPED] = float(data.meta_info.get(ROWS_DROPPED, 0))  # rows whose reward was not finite
    out = ["advantages", "returns"]
    if algorithm.use_kl_in_reward:
        out.append("token_level_rewards")
    if corrected:
        out.append("response_mask")
        if "rollout_is_weights" in data.batch.keys():
            out.append("rollout_is_weights")
    from tensordict import TensorDict

    nested = TensorDict(
        {k: response_to_nested(data.batch[k], response_mask) for k in out}, batch_size=len(batch)
    )
    return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=nested)


#: The columns of aglverl's rows a model worker reads (a batch fresh from the sampler names no columns).
WORKER_ROW_FIELDS = ("prompts", "responses", "response_mask", "loss_mask", "input_ids", "position_ids")
#: Columns no model worker reads: the scores (advantages are computed in the driver), group ids, turn counts,
#: aglverl's own bookkeeping.
DRIVER_ONLY_FIELDS = frozenset(
    {
        "uid",
        "num_turns",
        "rm_scores",
        "advantage_weights",
        "weight_version",
        "rollout_log_probs_valid",
        "data_source",
    }
)


def for_workers(batch: Any) -> Any:
    """The batch as a model worker gets it: the same rows, only the columns workers read."""
    if batch.fields is None:
        logprobs = current_run().config.actor_rollout_ref.rollout.calculate_log_probs
        fields = [*WORKER_ROW_FIELDS, "rollout_log_probs"] if logprobs else list(WORKER_ROW_FIELDS)
    else:
        fields = [f for f in batch.fields if f not in DRIVER_ONLY_FIELDS]
    return dataclasses.replace(batch, fields=fields)


#: verl's advantage estimators that read nothing but the scores, the mask and the group ids.
_SCORE_ONLY_ESTIMATORS = frozenset(
    {
        "grpo",
        "grpo_vectorized",
        "grpo_passk",
        "rloo",
        "rloo_vectorized",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "opo",
        "gpg",
    }
)


def trained_uids(batch: Any) -> list[str]:
    """The prompt uid of each row of a trainer's batch (``{uid}_{session}_{turn}`` keys) that is not one of
    the padding rows verl adds to fill whole mini-batches: those are tagged ``is_padding`` (their keys,
    ``pad{hex}_{i}_0``, name no prompt of ours; verl's ``padding_utils.upsample_batch_to_divisible_size``)."""
    return [
        key.split("_", 1)[0]
        for key, tag in zip(batch.keys, batch.tags, strict=True)
        if not (tag or {}).get("is_padding", False)
    ]


def trainer_class(trainer_mode: str) -> type:
    """verl's V1 trainer registered for ``trainer_mode``, with aglverl's hooks before it and aglverl's phases
    right above verl's base trainer (``[Hooks, <mode>, Phases, PPOTrainer]``)."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    base = get_trainer_cls(trainer_mode)
    return type(f"Aglverl{base.__name__}", (Hooks, base, Phases), {"__module__": __name__})
