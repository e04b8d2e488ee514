"""The rollout collector: turns a trainer's step (samples x n) into tasks, and finished rollouts into a batch.

A step goes: :meth:`RolloutCollector.submit` queues every sample ``n`` times under one GRPO data id and returns a
:class:`Step` at once; a task in the collector's task group awaits the step's completion event (no polling),
fails whatever is still unfinished at the step's deadline, assembles triplets (client-posted triplets win;
otherwise the proxy's recorded calls of the winning attempt, in call order), gathers why each rollout ended
(the store's, the agent's and the proxy's recorded reasons), builds the rows with the step's training-signal
controls (:class:`~aglverl.trajectory.signals.SignalConfig`) and pads them into a batch (in a worker thread
unless it is small) and sends it into the bounded batch stream. The batch may be empty (every group filtered out): it is sent all the same, with its metrics.
Validation steps produce metrics instead of a batch. Once a step's result is handed over (the trainer received
the batch) its rollouts are dropped from the store, so memory stays flat over a long run; until then the step
stays open in the journal.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream

from ..models import Mode
from ..store import RolloutRecord, TaskStore
from .batch import pad_rows
from .rollouts import (
    INLINE_BUILD_TOKENS,
    FinishedRollout,
    final_reward,
    finished_rollout,
    tokens_in,
    trajectory_of,
    turns_of,
)
from .rows import BatchConfig, WidthWarning, build_rows
from .signals import SignalConfig

__all__ = ["RolloutCollector", "Step", "StepReport", "TrainingBatch"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepReport:
    """What a finished step produced: counts and metrics (for validation steps, the metrics are the result)."""

    step: int
    mode: Mode
    metrics: dict[str, float]
    rollout_ids: list[str]
    seconds: float


@dataclass(frozen=True, slots=True)
class TrainingBatch:
    """One training step's batch, as received from the collector's stream.

    ``data`` is a verl ``DataProto`` (see :mod:`aglverl.trajectory.batch` for its fields).
    """

    step: int
    data: Any
    metrics: dict[str, float]
    report: StepReport


@dataclass(eq=False)
class Step:
    """Handle of a submitted step. ``await step.wait()`` returns its :class:`StepReport`.

    ``metadata`` is what the submitter attached (journaled with the step, so a recovered step has it too).
    Cancelling ``wait()`` only stops waiting; the step itself goes on.
    """

    number: int
    mode: Mode
    rollout_ids: list[str]
    submitted_at: float
    deadline: float
    metadata: dict[str, Any] = field(default_factory=dict)
    _done: anyio.Event = field(default_factory=anyio.Event, repr=False)
    _report: StepReport | None = field(default=None, repr=False)
    _error: BaseException | None = field(default=None, repr=False)

    async def wait(self) -> StepReport:
        await self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._report is not None
        return self._report

    @property
    def done(self) -> bool:
        return self._done.is_set()


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else 0.0


class RolloutCollector:
    """Runs steps over the store and feeds training batches into a bounded stream.

    Each finished batch waits in its step's task until the trainer receives it from :attr:`batches`; only then
    is the step marked done in the journal and its rollouts forgotten, so a process killed while batches wait
    recovers them. ``step_timeout`` (seconds, ``None`` for none) is the default deadline after which a step's
    unfinished rollouts are failed, counted and (by default) masked; without it leases and ``max_attempts``
    still bound every step. ``signal`` holds the training-signal controls applied to every training batch.
    """

    def __init__(
        self,
        store: TaskStore,
        *,
        batch: BatchConfig | None = None,
        signal: SignalConfig | None = None,
        step_timeout: float | None = None,
    ) -> None:
        self.store = store
        self.batch_config = batch or BatchConfig()
        self.signal = signal or SignalConfig()
        #: says once when merged conversations were left untrained for the width (naming BatchConfig's fields)
        self.width_warning = WidthWarning(self.batch_config)
        self.step_timeout = step_timeout
        # A rendezvous stream: a batch is handed over only when the trainer receives it, and the step's
        # rollouts are forgotten then, not before (a kill while a batch waits must lose nothing).
        self._send, self._receive = anyio.create_memory_object_stream[TrainingBatch](0)
        self._tg: TaskGroup | None = None
        self._next_number = 0
        self.steps: dict[int, Step] = {}
        self.recovered_steps: list[Step] = []
        r = store.registry
        self._m_steps = r.counter("aglverl_steps_total", "Steps finished.", ["mode"])
        self._m_turnaround = r.histogram(
            "aglverl_step_turnaround_seconds", "Last rollout of a step finished -> batch/metrics ready."
        )

    @property
    def batches(self) -> MemoryObjectReceiveStream[TrainingBatch]:
        """The receive side of the batch stream; ends when the collector shuts down."""
        return self._receive

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Host the steps' tasks until cancelled; then close the batch stream."""
        async with self._send, anyio.create_task_group() as tg:
            self._tg = tg
            for step in self.recovered_steps:
                tg.start_soon(self._run_step, step, name=f"aglverl step-{step.number} (recovered)")
            task_status.started()
            try:
                await anyio.sleep_forever()
            finally:
                self._tg = None

    async def submit(
        self,
        samples: Sequence[Any],
        *,
        n: int = 1,
        mode: Mode = "train",
        resources_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        deadline: float | None = None,
    ) -> Step:
        """Queue each sample ``n`` times (one GRPO group per sample) and return the step's handle at once.

        ``resources_id`` defaults to the latest published resources; ``deadline`` (seconds from now, after
        which unfinished rollouts are failed) to ``step_timeout``.
        Raises ``RuntimeError`` if the collector is not serving and ``ValueError`` for ``n < 1``.
        """
        if self._tg is None:
            raise RuntimeError("the collector is not serving (start the daemon first)")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        number = self._next_number
        self._next_number += 1
        owner = f"step-{number}"
        resources_id = resources_id or self.store.latest_resources_id
        deadline = self.step_timeout if deadline is None else deadline
        rollout_ids: list[str] = []
        for sample in samples:
            data_id = uuid.uuid4().hex
            meta = {**(metadata or {}), "data_id": data_id, "step": number, "is_train": mode == "train"}
            for _ in range(n):
                rollout_ids.append(
                    self.store.enqueue(
                        sample, mode=mode, resources_id=resources_id, metadata=meta, owner=owner
                    )
                )
        now = time.monotonic()
        step = Step(
            number,
            mode,
            rollout_ids,
            now,
            now + deadline if deadline is not None else math.inf,
            dict(metadata or {}),
        )
        self.steps[number] = step
        self.store.journal_write(self._step_record(step))
        self._tg.start_soon(self._run_step, step, name=f"aglverl {owner}")
        return step

    async def _run_step(self, step: Step) -> None:
        try:
            with anyio.move_on_after(step.deadline - time.monotonic()):
                await self.store.wait_terminal(step.rollout_ids)
            finished_at = time.monotonic()
            timed_out = self.store.fail(step.rollout_ids, "step deadline passed before the rollout finished")
            records = [self.store.record(rid) for rid in step.rollout_ids]
            if step.mode == "train":
                data, metrics = await self._build_off_loop(records)
            else:
                data, metrics = None, _validation_metrics(records, self.batch_config.reward_fill_value)
            metrics.update(_step_counts(records, timed_out))
            metrics["step/seconds"] = time.monotonic() - step.submitted_at
            report = StepReport(step.number, step.mode, metrics, step.rollout_ids, metrics["step/seconds"])
            self._m_turnaround.observe(time.monotonic() - finished_at)
            self._m_steps.inc(1, step.mode)
            step._report = report
            step._done.set()
            if data is not None:
                # The stream has no buffer: this returns once the trainer has received the batch. Until
                # then the step stays open in the journal, so a kill while the batch waits loses nothing.
                await self._send.send(TrainingBatch(step.number, data, metrics, report))
            self.steps.pop(step.number, None)  # no longer open: a journal compaction must not keep it
            self.store.journal_write({"kind": "step_done", "number": step.number})
            self.store.forget(step.rollout_ids)
        except BaseException as exc:
            if not step.done:
                step._error = exc
                step._done.set()
            raise
        finally:
            self.steps.pop(step.number, None)

    async def _build_off_loop(self, records: Sequence[RolloutRecord]) -> tuple[Any, dict[str, float]]:
        """Build the batch; in a worker thread unless it is small enough not to hold the loop up.

        Handing work to a thread costs up to the interpreter's switch interval (5 ms) while the loop is busy,
        more than building a small batch takes (~45 ns per token), so small batches are built right here.
        """
        if tokens_in(records) <= INLINE_BUILD_TOKENS:
            return self._build(records)
        return await anyio.to_thread.run_sync(self._build, records)

    @staticmethod
    def _step_record(step: Step) -> dict[str, Any]:
        remaining = step.deadline - time.monotonic()
        return {
            "kind": "step",
            "number": step.number,
            "mode": step.mode,
            "rollout_ids": step.rollout_ids,
            "deadline_wall": time.time() + remaining if math.isfinite(remaining) else None,
            "metadata": step.metadata,
        }

    def live_records(self) -> list[dict[str, Any]]:
        """Journal records describing the open steps (used to compact the journal)."""
        records: list[dict[str, Any]] = [{"kind": "steps", "next": self._next_number}]
        # a done step whose batch waits for the trainer is still open (it leaves self.steps once handed over)
        records += [self._step_record(step) for step in self.steps.values()]
        return records

    def restore(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Re-open the steps a previous run left unfinished (call before :meth:`serve`).

        Their rollouts must already be restored in the store; each recovered step's batch (or report) is
        produced as usual once its remaining rollouts finish, and step numbers continue after the old ones.
        """
        open_steps: dict[int, Mapping[str, Any]] = {}
        next_number = 0
        for r in records:
            kind = r.get("kind")
            if kind == "step":
                open_steps[r["number"]] = r
                next_number = max(next_number, r["number"] + 1)
            elif kind == "step_done":
                open_steps.pop(r["number"], None)
            elif kind == "steps":
                next_number = max(next_number, r["next"])
        self._next_number = next_number
        now_wall, now = time.time(), time.monotonic()
        for number, r in sorted(open_steps.items()):
            deadline = now + max(0.0, r["deadline_wall"] - now_wall) if r["deadline_wall"] else math.inf
            rollout_ids = [rid for rid in r["rollout_ids"] if self.store.knows(rid)]
            if len(rollout_ids) < len(r["rollout_ids"]):
                logger.warning(
                    "step %d: %d rollouts missing from the journal",
                    number,
                    len(r["rollout_ids"]) - len(rollout_ids),
                )
            step = Step(number, r["mode"], rollout_ids, now, deadline, dict(r.get("metadata") or {}))
            self.steps[number] = step
            self.recovered_steps.append(step)

    def _build(self, records: Sequence[RolloutRecord]) -> tuple[Any, dict[str, float]]:
        finished: list[FinishedRollout] = []
        sources = {"client": 0, "proxy": 0, "none": 0}
        skipped = unselected = 0
        rewards = []
        for record in records:
            trajectory = trajectory_of(record)
            rollout = finished_rollout(record, trajectory, str(record.metadata["data_id"]))
            if rollout.completed:
                sources[trajectory.source] += 1
                skipped += trajectory.n_skipped
                unselected += trajectory.n_unselected
                if rollout.reward is not None:
                    rewards.append(rollout.reward)
            finished.append(rollout)
        rows = build_rows(finished, self.batch_config, self.signal, padded=True)
        self.width_warning.note(rows)
        data, metrics = pad_rows(rows, self.batch_config), rows.metrics
        metrics.update(_weight_versions(records))
        metrics.update(
            {
                "training/reward": _mean(rewards),
                "step/n_rollouts_with_client_triplets": float(sources["client"]),
                "step/n_rollouts_with_proxy_triplets": float(sources["proxy"]),
                "step/n_rollouts_without_calls": float(sources["none"]),
                "step/n_calls_unusable": float(skipped),
                "step/n_calls_unselected": float(unselected),
            }
        )
        return data, metrics


def _weight_versions(records: Sequence[RolloutRecord]) -> dict[str, float]:
    """The oldest and newest weight version that generated the step's recorded calls (-1: no calls).

    A trainer compares them with the version it trains (staleness); on-policy steps have min = max. A call
    continued across a weight update counts with its first token's version and its last one's.
    """
    calls = [c for r in records for c in r.calls if c.status == "ok"]
    return {
        "step/call_weight_version_min": float(min((c.weight_version for c in calls), default=-1)),
        "step/call_weight_version_max": float(max((c.last_weight_version for c in calls), default=-1)),
    }


def _step_counts(records: Sequence[RolloutRecord], timed_out: int) -> dict[str, float]:
    completed = sum(r.state == "completed" for r in records)
    return {
        "step/n_queued": float(len(records)),
        "step/n_completed": float(completed),
        "step/n_failed": float(len(records) - completed),
        "step/n_timed_out": float(timed_out),
        "step/n_requeued": float(sum(r.requeues for r in records)),
    }


def _validation_metrics(records: Sequence[RolloutRecord], fill: float | None) -> dict[str, float]:
    rewards: list[float] = []
    with_reward = 0
    response_lengths: list[float] = []
    sum_lengths: list[float] = []
    turn_counts: list[float] = []
    for record in records:
        if record.state != "completed":
            continue
        reward = final_reward(record)
        with_reward += reward is not None
        if reward is None and fill is not None:
            reward = fill
        if reward is not None:
            rewards.append(reward)
        turns, _, _ = turns_of(record)
        if turns:
            lengths = [len(response) for _, response in turns]
            response_lengths.append(sum(lengths) / len(lengths))
            sum_lengths.append(float(sum(lengths)))
            turn_counts.append(float(len(turns)))
    return {
        "val/reward": _mean(rewards),
        "val/n_rollouts": float(len(records)),
        "val/n_rollouts_w_reward": float(with_reward),
        "val/n_rollouts_w_trace": float(len(turn_counts)),
        "val/mean_response_length": _mean(response_lengths),
        "val/sum_response_length": _mean(sum_lengths),
        "val/turn_count": _mean(turn_counts),
    }
