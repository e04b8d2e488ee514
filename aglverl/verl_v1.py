"""aglverl on verl's V1 trainer: the daemon as the trainer's trajectory producer. Every V1-specific call is here.

verl's V1 trainer (``verl/trainer/ppo/v1``, the default of verl's ``ppo_trainer.yaml``) runs its own loop,
modes (``trainer.v1.trainer_mode``: sync, colocate_async, separate_async), checkpoints and resume. aglverl
plugs into its extension points and adds what only it can (agents it does not control, over HTTP):

- :class:`DaemonAgentLoopManager` — what verl's trainer calls ``generate_sequences(prompts)`` on: the prompts
  go to the daemon's :class:`~aglverl.producer.TrajectoryProducer` (``n`` tasks each) and the call returns at
  once, as verl's ``AgentLoopManagerTQ`` does.
- :class:`TransferQueueSink` — the producer's sink: each finished group's rows go into TransferQueue the way
  verl's ``AgentLoopWorkerTQ`` files them (one key per row, ``{uid}_{session}_{turn}`` with the turn of the
  row's first call: a merged chain of calls is one row; verl's fields, the tags ``status``, lengths,
  ``global_steps``, ``min_global_steps`` / ``max_global_steps`` over the weight versions the proxy recorded for
  the row's calls), then the prompt's group status (``running`` at dispatch, ``finished`` / ``failure``).
- :class:`EventReplayBuffer` / :class:`EventReplayBufferAsync` — verl's replay buffers, installed through
  ``trainer.v1.sampler.custom_sampler``, that wait for the producer's next finished group (an event) where
  verl's sleep ``poll_interval`` seconds (``replay_buffer.py:144``); aglverl's rejection sampling is verl's
  DAPO group filter fed by the producer's classification.
- :func:`trainer_class` — verl's trainer for the configured mode with hooks: the proxy holds and drains the
  agents' calls before the replicas sleep and lets them on after the weights are updated (calls then carry
  the new weight version); advantages with aglverl's training-signal controls, on whole groups
  (``_compute_advantage``); aglverl's step metrics (``_compute_metrics``); the journal trimmed after every
  checkpoint (``_save_checkpoint``).
- :class:`SampleDataset` — task inputs as verl's dataset (``data.custom_cls``): verl's stateful data loader
  samples, shuffles and checkpoints them; each item's ``raw_prompt`` is the task input agents get.
- :func:`running` / :func:`train` — the run: TransferQueue, the trainer, the daemon (and agents), ``fit``.

verl's blocking calls run in a worker thread (``anyio.to_thread``); everything that touches the daemon goes
back to the event loop with ``anyio.from_thread`` and an explicit loop token. Checked against verl 0.9.1 and
TransferQueue 0.1.11 (:mod:`aglverl.verl_plugin.patches` refuses other releases).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import numpy as np
import torch
from torch.utils.data import Dataset

from .metrics import overlap_shares
from .producer import FinishedGroup, Prompt, aggregate_stats

if TYPE_CHECKING:
    from tensordict import TensorDict

    from .daemon import AgentDaemon
    from .signals import SignalConfig

__all__ = [
    "DaemonAgentLoopManager",
    "EventReplayBuffer",
    "EventReplayBufferAsync",
    "SampleDataset",
    "TransferQueueSink",
    "running",
    "sampler_name",
    "train",
    "trained_uids",
    "trainer_class",
]

logger = logging.getLogger(__name__)

#: ``data.train_files`` / ``data.val_files`` naming the task inputs of the current run (see SampleDataset).
TRAIN_FILES, VAL_FILES = "aglverl://train", "aglverl://val"
#: This module, as verl's ``load_module`` names one (``trainer.v1.sampler.custom_sampler.path``).
MODULE_PATH = f"pkg://{__name__}"
#: The dataset column that carries each task input (verl requires ``raw_prompt``: it counts prompts by it).
INPUT_KEY = "raw_prompt"


def sampler_name(trainer_mode: str) -> str:
    """The replay buffer class for a trainer mode (verl's sync buffer for ``sync``, its async one otherwise)."""
    return "EventReplayBuffer" if trainer_mode == "sync" else "EventReplayBufferAsync"


# ---------------------------------------------------------------------------------------------- the run
@dataclasses.dataclass
class _Run:
    """What verl's callbacks into this module need (verl builds our classes itself, from names)."""

    config: Any
    signal: SignalConfig
    datasets: dict[str, list[dict[str, Any]]]
    token: Any = None
    daemon: AgentDaemon | None = None
    resources: dict[str, str] = dataclasses.field(default_factory=dict)
    on_step: Sequence[Callable[[int, Mapping[str, float]], None]] = ()
    progress: Any = True  # a bool, or the text stream the bar goes to
    bar: Any = None

    def on_loop(self, func: Callable[..., Any], *args: Any) -> Any:
        """Run ``func(*args)`` on the daemon's event loop from verl's thread and return its result."""
        return anyio.from_thread.run_sync(func, *args, token=self.token)

    def await_on_loop(self, func: Callable[..., Any], *args: Any) -> Any:
        """Await ``func(*args)`` on the daemon's event loop from verl's thread (blocks this thread only)."""
        return anyio.from_thread.run(func, *args, token=self.token)

    @property
    def producer(self) -> Any:
        if self.daemon is None or self.daemon.producer is None:
            raise RuntimeError("the aglverl daemon is not serving yet")
        return self.daemon.producer


_RUN: _Run | None = None


def _run() -> _Run:
    if _RUN is None:
        raise RuntimeError("no aglverl training run is active in this process (use aglverl.AsyncVERL)")
    return _RUN


@contextmanager
def _active(run: _Run) -> Iterator[_Run]:
    global _RUN
    if _RUN is not None:
        raise RuntimeError("an aglverl training run is already active in this process")
    _RUN = run
    try:
        yield run
    finally:
        _RUN = None


# ---------------------------------------------------------------------------------------------- dataset
class SampleDataset(Dataset):
    """The run's task inputs as verl's dataset (``data.custom_cls``), built by verl's ``create_rl_dataset``.

    ``data_files`` is :data:`TRAIN_FILES` or :data:`VAL_FILES`; the samples are taken from the active run when
    the dataset is built, so the object pickles (data-loader workers) with them. Each item carries the task
    input under ``raw_prompt``, its position (``index``) and ``data_source`` (the sample's, or ``"aglverl"``).
    """

    def __init__(
        self,
        data_files: Any,
        tokenizer: Any = None,
        processor: Any = None,
        config: Any = None,
        max_samples: int = -1,
    ) -> None:
        name = data_files if isinstance(data_files, str) else next(iter(data_files))
        samples = _run().datasets.get(str(name))
        if samples is None:
            raise ValueError(f"{name!r} is not a dataset of the active aglverl run")
        self.samples = samples if max_samples is None or max_samples < 0 else samples[:max_samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = self.samples[index]
        source = sample.get("data_source") if isinstance(sample, Mapping) else None
        return {INPUT_KEY: sample, "index": index, "data_source": str(source or "aglverl")}


# ---------------------------------------------------------------------------------------------- manager
def _column(batch: TensorDict, key: str, size: int, default: Any = None) -> list[Any]:
    """One column of verl's prompt batch as a list (tensors, stacks of objects, or one value for all rows)."""
    from tensordict import NonTensorData, NonTensorStack

    if key not in batch.keys():
        return [default] * size
    value = batch.get(key)
    if isinstance(value, NonTensorData):
        return [value.data] * size
    if isinstance(value, NonTensorStack):
        return list(value.tolist())
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return list(value)


class DaemonAgentLoopManager:
    """verl's agent-loop manager contract, fulfilled by the daemon's agents: ``generate_sequences`` hands the
    prompts to the producer and returns at once (generation goes on; finished groups land in TransferQueue).

    Called from verl's trainer thread; the prompts reach the event loop through ``anyio.from_thread``.
    """

    def __init__(self, run: _Run) -> None:
        self._run = run
        rollout = run.config.actor_rollout_ref.rollout
        self._n = {"train": int(rollout.n), "val": int(rollout.val_kwargs.n)}

    def generate_sequences(self, prompts: TensorDict) -> None:
        from tensordict import NonTensorData

        size = len(prompts)
        flag = prompts.get("validate", None) if "validate" in prompts.keys() else None
        validate = bool(flag.data if isinstance(flag, NonTensorData) else flag)
        partition = "val" if validate else "train"
        steps = _column(prompts, "global_steps", size, 0)
        counts = _column(prompts, "__rollout_n__", size, None)
        batch = [
            Prompt(
                uid=str(uid),
                input=task,
                n=int(n) if n is not None else self._n[partition],
                partition=partition,
                global_steps=int(step),
                index=int(index) if index is not None else None,
                fields={"data_source": source or "aglverl"},
            )
            for uid, task, index, source, step, n in zip(
                _column(prompts, "uid", size),
                _column(prompts, INPUT_KEY, size),
                _column(prompts, "index", size),
                _column(prompts, "data_source", size),
                steps,
                counts,
                strict=True,
            )
        ]
        run = self._run
        run.on_loop(
            lambda: run.producer.dispatch(
                batch, resources_id=run.resources[partition], mode="val" if validate else "train"
            )
        )


# ---------------------------------------------------------------------------------------------- sink
@dataclasses.dataclass(eq=False)
class _Write:
    """One group's rows (or a status change) waiting for the next TransferQueue write."""

    partition: str
    keys: list[str]
    fields: list[dict[str, Any]]
    tags: list[dict[str, Any]]
    statuses: dict[str, str]
    done: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    error: BaseException | None = None


class TransferQueueSink:
    """Files finished groups in TransferQueue as verl's ``AgentLoopWorkerTQ`` does (see the module docstring).

    Writes happen when someone is about to look (:meth:`flush`: the replay buffer before it reads
    TransferQueue's tags, the trainer before a checkpoint snapshots it): the groups that finished since the
    last look go in one write, rows first and then the groups' statuses, so whoever sees a group's terminal
    status finds its rows. Nothing is written while agents are busy (measured: per-group writes, in a worker
    thread, slowed the agents' event loop down by ~15% of the generation phase). A failed write raises in
    :meth:`flush`.

    Rows carry verl's fields (``prompts``, ``responses``, ``response_mask`` = ``loss_mask``: 1 on generated
    ids, 0 between a merged row's calls, ``input_ids``, ``position_ids``, ``rm_scores``, ``num_turns`` as
    verl's tool agent loop counts them, ``uid``) and aglverl's (``advantage_weights``, the ``weight_version`` of
    the row's first call); validation rows also ``data_source``. ``logprobs``: every row carries
    ``rollout_log_probs``, so the column stays whole; a row one of whose calls came back without the engine's
    logprobs (or whose agent posted triplets without them) is marked ``rollout_log_probs_valid = 0`` and the
    trainer counts it as on-policy (its recomputed log-probs stand in, see ``_compute_old_log_prob``).
    """

    def __init__(self, *, logprobs: bool) -> None:
        self.logprobs = logprobs
        self._queue: list[_Write] = []
        self._writing = False

    async def started(self, prompts: Sequence[Prompt]) -> None:
        self._queue += [_Write(p.partition, [], [], [], {p.uid: "running"}) for p in prompts]

    async def finished(self, group: FinishedGroup) -> None:
        keys, fields, tags = self.rows(group)
        prompt = group.prompt
        self._queue.append(_Write(prompt.partition, keys, fields, tags, {prompt.uid: group.status}))

    async def flush(self) -> None:
        """Write everything queued so far; return once it is in TransferQueue (also what a concurrent flush
        was writing). The first caller while no write runs writes for everyone; a failed write raises in every
        caller it held."""
        if not self._queue and not self._writing:
            return
        if self._writing:
            marker = _Write("", [], [], [], {})
            self._queue.append(marker)  # done once everything queued before it is written
            await marker.done.wait()
            if marker.error is not None:
                raise marker.error
            return
        self._writing = True
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                try:
                    await anyio.to_thread.run_sync(_write_batch, batch)
                except BaseException as exc:
                    for item in batch:
                        item.error = exc
                    raise
                finally:
                    for item in batch:
                        item.done.set()
        finally:
            self._writing = False

    def rows(self, group: FinishedGroup) -> tuple[list[str], list[dict[str, Any]], list[dict[str, Any]]]:
        """Keys, fields and tags of the group's rows (jagged: each row only as long as its tokens)."""
        data, prompt = group.data, group.prompt
        if not len(data):
            return [], [], []
        batch = data.batch
        width = batch["prompts"].shape[1]
        prompt_len = batch["attention_mask"][:, :width].sum(-1).tolist()
        # a merged row's response holds the ids between its calls too: its length is its attention's
        response_len = batch["attention_mask"][:, width:].sum(-1).tolist()
        trains = (~batch["is_drop_mask"]).tolist()
        uids = data.non_tensor_batch["uid"].tolist()
        weights = batch["advantage_weights"].tolist() if "advantage_weights" in batch.keys() else None
        validation = prompt.partition == "val"
        keys, fields, tags = [], [], []
        for i in range(len(data)):
            plen, rlen = prompt_len[i], response_len[i]
            session, turn = int(group.sessions[i]), int(group.turns[i])
            prompts = batch["prompts"][i, width - plen :]
            responses = batch["responses"][i, :rlen]
            # 1 on the ids the engine generated for on-policy calls, 0 between calls (verl's agent-loop layout)
            mask = batch["response_mask"][i, :rlen] * int(trains[i])
            row: dict[str, Any] = {
                "prompts": prompts.clone(),
                "responses": responses.clone(),
                "response_mask": mask,
                "loss_mask": mask.clone(),
                "input_ids": torch.cat([prompts, responses]),
                "position_ids": torch.arange(plen + rlen, dtype=torch.int64),
                "rm_scores": batch["token_level_scores"][i, :rlen].clone(),
                "advantage_weights": torch.tensor(weights[i] if weights is not None else 1.0),
                "weight_version": torch.tensor(int(group.versions[i])),
                # an int, as verl's tool agent loop counts: the first prompt, then each call and each message
                # between two calls (2 for one call; verl's padding rows put 0)
                "num_turns": 2 * int(group.n_calls[i]),
                "uid": uids[i],
            }
            if validation:
                row["data_source"] = str(prompt.fields.get("data_source", "aglverl"))
            if self.logprobs:
                logprobs = group.logprobs[i]
                present = logprobs is not None
                row["rollout_log_probs"] = torch.from_numpy(logprobs) if present else torch.zeros(rlen)
                row["rollout_log_probs_valid"] = torch.tensor(int(present))
            keys.append(f"{prompt.uid}_{session}_{turn}")
            fields.append(row)
            tags.append(
                {
                    "status": "success",
                    "prompt_len": plen,
                    "response_len": rlen,
                    "seq_len": plen + rlen,
                    "global_steps": prompt.global_steps,
                    "min_global_steps": int(group.row_min_versions[i]),
                    "max_global_steps": int(group.row_max_versions[i]),
                }
            )
        return keys, fields, tags


def _write_batch(batch: Sequence[_Write]) -> None:
    """Rows of every queued write, one put per partition; then every status change, one put per partition."""
    import transfer_queue as tq
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    partitions = dict.fromkeys(item.partition for item in batch if item.partition)
    for partition in partitions:
        items = [item for item in batch if item.partition == partition and item.keys]
        if items:
            tq.kv_batch_put(
                keys=[key for item in items for key in item.keys],
                partition_id=partition,
                fields=list_of_dict_to_tensordict([row for item in items for row in item.fields]),
                tags=[tag for item in items for tag in item.tags],
            )
    for partition in partitions:
        statuses = {
            uid: s for item in batch if item.partition == partition for uid, s in item.statuses.items()
        }
        if statuses:
            tq.kv_batch_put(
                keys=list(statuses), partition_id=partition, tags=[{"status": s} for s in statuses.values()]
            )


# ---------------------------------------------------------------------------------------------- sampler
def _replay_buffers() -> tuple[type, type]:
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

    return ReplayBuffer, ReplayBufferAsync


_ReplayBuffer, _ReplayBufferAsync = _replay_buffers()


def _base_trainer() -> type:
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    return PPOTrainer


_PPOTrainer = _base_trainer()


class _EventWaits:
    """What aglverl's replay buffers change in verl's: waiting (an event, not a sleep) and which finished
    groups are filtered (aglverl's rejection sampling, through verl's DAPO group filter)."""

    def __init__(self, **kwargs: Any) -> None:
        run = _run()
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


# ---------------------------------------------------------------------------------------------- trainer
class _Hooks:
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

    _aglverl: _Run

    def on_step_begin(self) -> None:
        self._step_started = time.monotonic()
        self._computing: list[tuple[float, float]] = []
        daemon = self._aglverl.daemon
        assert daemon is not None
        self._tokens_before = self._aglverl.on_loop(daemon.proxy.m_generated.value)
        super().on_step_begin()  # type: ignore[misc]

    def on_sample_end(self) -> None:
        run = self._aglverl
        assert run.daemon is not None
        mode = self.trainer_mode  # type: ignore[attr-defined]
        if mode != "separate_async":
            run.on_loop(run.daemon.store.freeze_leases)  # an agent's held call must not cost it its lease
        if mode == "sync":
            run.await_on_loop(run.daemon.proxy.pause)  # drain while the engines still serve, then they sleep
        elif mode == "colocate_async":
            run.on_loop(run.daemon.proxy.hold)  # verl aborts next; the proxy resumes after the update
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
            run.on_loop(run.daemon.store.freeze_leases)
            run.on_loop(run.daemon.proxy.hold)  # the update aborts the standalone engines' generations
        try:
            super().on_step_end()  # type: ignore[misc]
        finally:
            version = int(self.global_steps)  # type: ignore[attr-defined]
            run.on_loop(run.daemon.proxy.resume, version)
            run.on_loop(run.daemon.store.thaw_leases)
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
        run.await_on_loop(run.daemon.store.commit)
        super()._save_checkpoint()  # type: ignore[misc]
        run.on_loop(run.producer.checkpointed, covered)

    def _validate(self) -> dict[str, float]:
        metrics = super()._validate()  # type: ignore[misc]
        run = self._aglverl
        stats = run.on_loop(run.producer.take_partition, "val")
        n = sum(s.n_rollouts for s in stats)
        metrics["val/reward"] = sum(s.reward_sum for s in stats) / n if n else 0.0
        metrics["val/n_rollouts"] = float(n)
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


class _Phases(_PPOTrainer):  # type: ignore[valid-type,misc]
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
        super()._compute_ref_log_prob(_for_workers(batch), metrics)
        return batch

    def _compute_values(self, batch: Any, metrics: dict[str, Any]) -> Any:
        super()._compute_values(_for_workers(batch), metrics)
        return batch

    def _update_critic(self, batch: Any, metrics: dict[str, Any]) -> Any:
        super()._update_critic(_for_workers(batch), metrics)
        return batch

    def _update_actor(self, batch: Any, metrics: dict[str, Any]) -> Any:
        super()._update_actor(_for_workers(batch), metrics)
        return batch


def _rows_missing_logprobs(batch: Any) -> bool:
    """Whether any row of the batch came without the engine's log-probs (``rollout_log_probs_valid = 0``)."""
    import transfer_queue as tq

    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["rollout_log_probs_valid"])
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

    from .signals import logprob_mismatch

    config = trainer.config
    batch.extra_info.update(
        {
            "calculate_entropy": True,
            "compute_loss": False,
            "temperature": config.actor_rollout_ref.rollout.temperature,
        }
    )
    output = trainer.actor_rollout_wg.compute_log_prob(_for_workers(batch))
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
    missing = (valid == 0) if valid is not None else torch.zeros(len(batch), dtype=torch.bool)
    if bool(missing.any()):
        padded.batch["rollout_log_probs"][missing] = padded.batch["old_log_probs"][missing]
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
        compared = padded.batch["response_mask"] * (~missing).unsqueeze(-1)
        metrics.update(
            logprob_mismatch(padded.batch["old_log_probs"], padded.batch["rollout_log_probs"], compared)
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


def _step_metrics(trainer: Any, run: _Run, uids: list[str], timing: Mapping[str, float]) -> dict[str, float]:
    """aglverl's metrics of a step: its groups' (reward over every rollout, failures at their failure
    reward; rows, filters), the proxy's counters, generated tokens/s over every generated token, and how the
    step's wall time split between the engines generating and the trainer computing."""
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
            daemon.proxy.activity.busy_intervals(start, stop),
            daemon.proxy.m_generated.value(),
        )

    stats, counters, generating, tokens = run.on_loop(on_loop)
    metrics = aggregate_stats(stats)
    # groups a resumed run found in verl's TransferQueue checkpoint were answered by the previous process:
    # their stats died with it (verl's own critic/score/* still covers their rows)
    metrics["step/n_groups_restored"] = float(len(set(uids) - {s.uid for s in stats}))
    metrics.update(counters)
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
    return metrics


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

    from .signals import compute_advantage

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
    data.non_tensor_batch["rollout_id_list"] = np.array([key.rsplit("_", 1)[0] for key in batch.keys], dtype=object)
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
        data.batch["group_weights"] = _per_rollout_weights(batch.keys)
    if "advantage_weights" not in data.batch.keys():
        data.batch["advantage_weights"] = torch.ones(len(data), dtype=torch.float32)
    data = compute_advantage(
        data,
        adv_estimator=algorithm.adv_estimator,
        gamma=algorithm.gamma,
        lam=algorithm.lam,
        num_repeat=int(config.actor_rollout_ref.rollout.n),
        norm_adv_by_std_in_grpo=algorithm.get("norm_adv_by_std_in_grpo", True),
        config=algorithm,
    )
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


def _for_workers(batch: Any) -> Any:
    """The batch as a model worker gets it: the same rows, only the columns workers read."""
    if batch.fields is None:
        logprobs = _run().config.actor_rollout_ref.rollout.calculate_log_probs
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


def _per_rollout_weights(keys: Sequence[str]) -> torch.Tensor:
    """``1/k`` for each row of a session (``{uid}_{session}_{turn}``) that has ``k`` rows in the batch."""
    sessions = [key.rsplit("_", 1)[0] for key in keys]
    counts = Counter(sessions)
    return torch.tensor([1.0 / counts[s] for s in sessions], dtype=torch.float32)


def trainer_class(trainer_mode: str) -> type:
    """verl's V1 trainer registered for ``trainer_mode``, with aglverl's hooks before it and aglverl's phases
    right above verl's base trainer (``[_Hooks, <mode>, _Phases, PPOTrainer]``)."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    base = get_trainer_cls(trainer_mode)
    return type(f"Aglverl{base.__name__}", (_Hooks, base, _Phases), {"__module__": __name__})


# ---------------------------------------------------------------------------------------------- running
def backend_urls(trainer: Any) -> list[str]:
    """The inference servers agents use, as ``http://host:port``: the rollout replicas verl started in its
    actor workers, or with ``separate_async`` its standalone replicas (those in the training workers sleep
    while the trainer trains)."""
    manager = getattr(trainer, "standalone_server_manager", None) or trainer.llm_server_manager
    return [f"http://{address}" for address in manager.get_addresses()]


def served_model_name(url: str) -> str:
    """The model name an OpenAI-compatible server answers to (its first ``/v1/models`` entry); blocking."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via an HTTP(S)_PROXY
    with direct.open(f"{url}/v1/models", timeout=30) as response:
        return str(json.load(response)["data"][0]["id"])


def sampling_parameters(config: Any, *, validation: bool = False) -> dict[str, Any]:
    """The sampling parameters agents get in ``main_llm`` (verl's rollout / ``val_kwargs`` settings); the proxy
    fills them into calls that omit them and checks the calls that set them."""
    rollout = config.actor_rollout_ref.rollout
    source = rollout.val_kwargs if validation else rollout
    params: dict[str, Any] = {
        "temperature": float(source.temperature),
        "top_p": float(source.top_p),
        "max_tokens": int(config.data.max_response_length),
    }
    if validation and not source.do_sample:
        params.update(temperature=0.0, top_p=1.0)
    if int(source.top_k) > 0:
        params["top_k"] = int(source.top_k)
    return params


def close_trainer(trainer: Any) -> None:
    """Stop the trainer's Ray actors and free its placement groups (blocking; for a shared Ray session).

    That is the trainer's worker groups, every rollout replica's servers and workers, and the pools of both:
    a standalone replica (separate_async's rollout pool) makes its own pool and worker group
    (``RolloutReplica.init_standalone``), which the trainer's ``resource_pool_manager`` does not list; left
    behind in a Ray session the caller keeps, they hold its resources and the next run waits for them forever.
    """
    import ray
    from ray.util import remove_placement_group

    actors: list[Any] = []
    for name in ("actor_rollout_wg", "critic_wg", "ref_policy_wg"):
        group = getattr(trainer, name, None)
        if group is not None:
            actors += list(group.workers)
    pools = list((getattr(getattr(trainer, "resource_pool_manager", None), "resource_pool_dict", {}) or {}).values())
    for manager_name in ("llm_server_manager", "standalone_server_manager"):
        manager = getattr(trainer, manager_name, None)
        if manager is None:
            continue
        for replica in manager.get_replicas():
            actors += list(replica.servers) + list(getattr(replica, "workers", None) or [])
            pools.append(getattr(replica, "resource_pool", None))
        if getattr(manager, "global_load_balancer", None) is not None:
            actors.append(manager.global_load_balancer)
    actors += list(
        getattr(getattr(trainer, "reward_loop_manager", None), "reward_loop_worker_handles", None) or []
    )
    for actor in dict.fromkeys(actors):
        try:
            ray.kill(actor)
        except Exception as exc:  # already gone: nothing to stop
            logger.debug("ray.kill(%s): %s", actor, exc)
    # a hybrid replica shares the trainer's pool: each placement group is removed once
    groups = {pg.id: pg for pool in pools if pool is not None for pg in getattr(pool, "pgs", None) or []}
    for pg in groups.values():
        remove_placement_group(pg)


@asynccontextmanager
async def running(
    config: Any,
    options: Any,
    train_samples: list[dict[str, Any]],
    val_samples: list[dict[str, Any]] | None,
    *,
    daemon_kwargs: Callable[[Any], dict[str, Any]],
    on_step: Sequence[Callable[[int, Mapping[str, float]], None]] = (),
    progress: Any = True,
) -> AsyncIterator[tuple[_Run, Any]]:
    """TransferQueue, verl's V1 trainer (initialised: workers, replicas, checkpoint loaded) and the daemon as
    its producer, serving; yields ``(run, trainer)`` ready for ``trainer.fit(DaemonAgentLoopManager(run))``.

    ``daemon_kwargs(trainer)`` gives the :class:`~aglverl.daemon.AgentDaemon`'s arguments once the trainer's
    servers are up (blocking; called in a worker thread). On exit (also on error or cancellation) the daemon,
    the trainer's Ray actors and TransferQueue are shut down.
    """
    import transfer_queue as tq

    from .daemon import AgentDaemon

    datasets = {TRAIN_FILES: train_samples, VAL_FILES: val_samples or train_samples}
    run = _Run(config=config, signal=options.signal, datasets=datasets, on_step=on_step, progress=progress)
    run.token = anyio.lowlevel.current_token()
    with _active(run), _progress_bar(run):
        await anyio.to_thread.run_sync(tq.init, config.transfer_queue)
        trainer: Any = None
        try:
            trainer = trainer_class(config.trainer.v1.trainer_mode)(config=config)
            trainer._aglverl = run
            await anyio.to_thread.run_sync(trainer.init)
            kwargs = await anyio.to_thread.run_sync(daemon_kwargs, trainer)
            kwargs["trajectory_sink"] = TransferQueueSink(logprobs=options.signal.request_logprobs)
            async with AgentDaemon(**kwargs) as daemon:
                run.daemon = daemon
                daemon.proxy.weight_version = int(trainer.global_steps)
                assert daemon.producer is not None
                bound = options.max_failed_groups  # default: a whole batch's worth of failed groups in a row
                daemon.producer.max_failed_groups = int(config.data.train_batch_size) if bound is None else bound
                daemon.producer.width_warning.names = ("data.max_prompt_length", "data.max_response_length")
                # validation's first, so that the latest resources (what agents get by default) are training's
                validation = sampling_parameters(config, validation=True)
                run.resources["val"] = daemon.update_resources({"main_llm": daemon.main_llm(validation)})
                training = sampling_parameters(config)
                run.resources["train"] = daemon.update_resources({"main_llm": daemon.main_llm(training)})
                yield run, trainer
        finally:
            run.daemon = None
            with anyio.CancelScope(shield=True):
                if trainer is not None:
                    await anyio.to_thread.run_sync(_finish_tracking, trainer)
                    await anyio.to_thread.run_sync(close_trainer, trainer)
                await anyio.to_thread.run_sync(tq.close)


async def train(
    config: Any,
    options: Any,
    train_samples: list[dict[str, Any]],
    val_samples: list[dict[str, Any]] | None,
    *,
    daemon_kwargs: Callable[[Any], dict[str, Any]],
    serve: Callable[[AgentDaemon], Any],
    on_step: Sequence[Callable[[int, Mapping[str, float]], None]] = (),
    progress: Any = True,
) -> None:
    """Run verl's V1 trainer (``fit``) with the daemon as its producer (see :func:`running`).

    ``serve(daemon)`` is an async context manager run around ``fit`` (the agents, the caller's callbacks).
    Cancellation stops after the blocking verl call in progress returns.
    """
    async with running(
        config,
        options,
        train_samples,
        val_samples,
        daemon_kwargs=daemon_kwargs,
        on_step=on_step,
        progress=progress,
    ) as (run, trainer):
        assert run.daemon is not None
        async with serve(run.daemon):
            await anyio.to_thread.run_sync(trainer.fit, DaemonAgentLoopManager(run))


@contextmanager
def _progress_bar(run: _Run) -> Iterator[None]:
    """verl's V1 loop draws its own ``tqdm`` bar (``trainer_base.py:434``); for the run it is aglverl's: named,
    on stderr, hidden without ``progress``, with the step's reward and generated tokens/s."""
    import sys

    import verl.trainer.ppo.v1.trainer_base as trainer_base
    from tqdm import tqdm

    def bar(*args: Any, **kwargs: Any) -> Any:
        stream = run.progress if hasattr(run.progress, "write") else sys.stderr
        kwargs.update(desc="aglverl training", unit="step", file=stream, disable=not run.progress)
        run.bar = tqdm(*args, **kwargs)
        return run.bar

    original = trainer_base.tqdm
    trainer_base.tqdm = bar
    try:
        yield
    finally:
        trainer_base.tqdm = original
        if run.bar is not None:
            run.bar.close()


def _finish_tracking(trainer: Any) -> None:
    tracking = getattr(trainer, "logger", None)
    if tracking is not None:
        try:
            tracking.finish()
        except Exception as exc:  # a logger backend failing to flush must not hide the run's own outcome
            logger.warning("verl's Tracking.finish failed: %s", exc)


def journal_path(config: Any, journal: str | None) -> str | None:
    """The daemon's journal for this run: ``"auto"`` puts it next to verl's checkpoints when they are saved."""
    if journal == "auto":
        saves = int(config.trainer.save_freq) > 0
        journal = os.path.join(config.trainer.default_local_dir, "aglverl.journal") if saves else None
    if journal is not None:
        os.makedirs(os.path.dirname(os.path.abspath(journal)), exist_ok=True)
        if config.trainer.resume_mode == "disable" and os.path.exists(journal):
            os.remove(journal)  # a fresh run must not recover another run's groups
    return journal
