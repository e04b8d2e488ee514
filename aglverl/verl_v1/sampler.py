"""verl's replay buffers (``trainer.v1.sampler.custom_sampler``), waking on the producer's events."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from .active_run import current_run

logger = logging.getLogger(__name__)


def sampler_name(trainer_mode: str) -> str:
    """The replay buffer class for a trainer mode (verl's sync buffer for ``sync``, its async one otherwise)."""
    return "EventReplayBuffer" if trainer_mode == "sync" else "EventReplayBufferAsync"


# ---------------------------------------------------------------------------------------------- sampler
def _replay_buffers() -> tuple[type, type]:
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

    return ReplayBuffer, ReplayBufferAsync


_ReplayBuffer, _ReplayBufferAsync = _replay_buffers()


class _EventWaits:
    """What aglverl's replay buffers change in verl's: waiting (an event, not a sleep) and which finished
    groups are filtered (aglverl's rejection sampling, through verl's DAPO group filter)."""

    def __init__(self, **kwargs: Any) -> None:
        run = current_run()
        config = run.config
        self._aglverl = run
        self._seen = -1
        self._want = 1
        self._rejection = run.signal.rejection_sampling
        filter_groups = config.algorithm.get("filter_groups", None)
        enabled = bool(filter_groups is not None and filter_groups.get("enable", False))
        metric = str(filter_groups.get("metric", "reward")) if enabled else None
        self._rejection_cap = int(filter_groups.get("max_num_gen_batches", 0) or 0) if enabled else 0
        self._rejected = 0
        sampler = config.trainer.v1.sampler
        extra: dict[str, Any] = {
            "filter_groups_metric": metric,
            "sync_refill_failed_groups": bool(sampler.get("sync_refill_failed_groups", False)),
        }
        if kwargs.get("trainer_mode") == "sync":
            train_batch_size = int(config.data.train_batch_size)
            gen = config.data.get("gen_batch_size", None) or train_batch_size
            extra.update(
                train_batch_size=train_batch_size,
                gen_batch_size=1 if metric is not None or extra["sync_refill_failed_groups"] else int(gen),
                max_inflight_gen_batches=int(filter_groups.get("max_inflight_gen_batches", 1))
                if enabled
                else 1,
            )
        super().__init__(**kwargs, **extra)

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> Any:
        self._rejected = 0
        self._want = batch_size
        if self.trainer_mode == "sync":  # type: ignore[attr-defined]
            # Lockstep: nothing of the step is terminal yet (the last step took or dropped every group), so the
            # first look waits until as many groups as it needs (or as are in flight) have finished.
            run = self._aglverl
            version, in_flight = run.on_loop(run.producer.progress, partition_id)
            if min(batch_size, in_flight):
                run.await_on_loop(run.producer.wait_changed, version, min(batch_size, in_flight))
        try:
            return super().sample(global_steps, partition_id, batch_size)  # type: ignore[misc]
        except RuntimeError as exc:
            if "no materializable trajectories" not in str(exc):
                raise
            # sync_refill_failed_groups turned off and a whole batch failed: say what the agents did
            raise self._aglverl.on_loop(self._aglverl.producer.agents_error) from None

    def wait_for_sampleable(self, global_steps: int, partition_id: str, target_count: int) -> Any:
        self._want = target_count
        return super().wait_for_sampleable(global_steps, partition_id, target_count)  # type: ignore[misc]

    def _sync_metadata_from_transfer_queue(self) -> None:
        # Every group counted in the version is written before the look; one finishing later wakes the next wait.
        self._seen = self._aglverl.await_on_loop(self._aglverl.producer.flush)
        # Failed groups are evicted and replaced (both modes); agents that fail every time stop the run here,
        # with their errors, instead of replacing prompts forever.
        self._aglverl.on_loop(self._aglverl.producer.check_agents)
        super()._sync_metadata_from_transfer_queue()  # type: ignore[misc]

    def _wait_for_next_poll(self, partition_id: str, last_debug_time: float) -> float:
        # Wake when as many more groups finished as are missing (or, draining, as are still in flight): no
        # look at TransferQueue could change the decision before that. Never more than are in flight.
        terminal = len(self.finished_keys[partition_id]) + len(self.failure_keys[partition_id])  # type: ignore[attr-defined]
        in_flight = len(self.pending_keys[partition_id]) + len(self.running_keys[partition_id])  # type: ignore[attr-defined]
        short = self._want - terminal
        draining = short <= 0 and self.trainer_mode == "sync"  # type: ignore[attr-defined]
        count = max(1, min(in_flight, short) if short > 0 else (in_flight if draining else 1))
        run = self._aglverl
        run.await_on_loop(run.producer.wait_changed, self._seen, count)
        return last_debug_time

    def _dapo_filtered_keys(self, partition_id: str) -> tuple[set[str], Counter]:
        if not self._rejection or partition_id == "val" or self.filter_groups_metric is None:  # type: ignore[attr-defined]
            return super()._dapo_filtered_keys(partition_id)  # type: ignore[misc]
        cap = self._rejection_cap * int(self._aglverl.config.data.train_batch_size)
        if cap and self._rejected >= cap:
            return set(), Counter()  # enough replaced this step: train on what is there
        finished = list(self.finished_keys[partition_id])  # type: ignore[attr-defined]
        producer = self._aglverl.producer
        uniform: dict[str, float] = self._aglverl.on_loop(producer.uniform_scores, finished)
        return set(uniform), Counter(uniform.values())

    def _evict_terminal_groups(self, global_steps: int, partition_id: str, reasons: Any) -> Any:
        evicted, stale, dapo, metrics = super()._evict_terminal_groups(global_steps, partition_id, reasons)  # type: ignore[misc]
        if evicted:
            self._rejected += dapo
            producer = self._aglverl.producer
            self._aglverl.on_loop(producer.evicted, sorted(evicted))
            if int(self._aglverl.config.trainer.save_freq) <= 0:  # never trained: out of the journal too
                self._aglverl.on_loop(producer.checkpointed, sorted(evicted))
        return evicted, stale, dapo, metrics


class EventReplayBuffer(_EventWaits, _ReplayBuffer):  # type: ignore[valid-type,misc]
    """verl's sync-mode replay buffer, waking on the producer's finished groups (see :class:`_EventWaits`)."""


class EventReplayBufferAsync(_EventWaits, _ReplayBufferAsync):  # type: ignore[valid-type,misc]
    """verl's async-mode replay buffer (staleness eviction), waking on the producer's finished groups."""
