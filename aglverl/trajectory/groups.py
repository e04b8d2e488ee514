"""The trajectory producer: a trainer's prompts become GRPO groups answered by agents; finished groups, rows.

verl's V1 trainer asks for trajectories prompt by prompt and samples finished groups from a store of its own
(TransferQueue). :class:`TrajectoryProducer` is the daemon's side of that contract, and knows nothing of verl::

    dispatch(prompts)   each prompt queued n times in the store (one GRPO group); sink.started(prompts)
    a group's rollouts all terminal  ->  jagged rows (aglverl.trajectory.rows, with the training-signal
                        controls)  ->  sink.finished(group)  ->  version bumped: whoever waits for groups wakes

The sink (:mod:`aglverl.verl_v1` writes TransferQueue) decides where rows go. A sampler waits for the next
finished group with :meth:`TrajectoryProducer.wait_changed` (an event, never a poll). Each finished group
leaves :class:`GroupStats` behind for the trainer's metrics (:meth:`TrajectoryProducer.take_stats`).

Restart: with a journal, a training group's dispatch is journaled next to its rollouts' records and stays
there until a checkpoint covers the group: the finished groups a checkpoint save will contain are filed with the
sink and journaled as covered in one step before it starts (:meth:`TrajectoryProducer.covering`: a group
finishing meanwhile is never covered without being filed) and dropped once it is done
(:meth:`TrajectoryProducer.checkpointed`); groups finishing during the save stay. A producer started on
that journal holds the groups that were in flight (:meth:`TrajectoryProducer.restore`), hands none of their
tasks out, and adopts one when the trainer dispatches the same prompt again: by its uid (verl re-issues
in-flight prompts of its checkpoint under their uid) or by dataset index and input, the same step first (a
replayed data loader) — never a covered group for a prompt of a later step than its checkpoint (that save
completed, so the group may be trained already). Its finished rollouts are reused as they are; its unfinished ones are queued again under their own
rollout ids with the live resources (this run's proxy URL), so no sample is answered more often than ``n``
times. Groups no dispatch adopts are dropped by :meth:`TrajectoryProducer.end_recovery`.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import anyio
import numpy as np
from anyio.abc import TaskGroup, TaskStatus

from ..metrics import Registry
from ..models import Mode
from ..store import TERMINAL, RolloutRecord, TaskStore
from .rollouts import INLINE_BUILD_TOKENS, finished_rollout, tokens_in, trajectory_of
from .rows import BatchConfig, Rows, WidthWarning, build_rows
from .signals import REASON_BITS, SignalConfig

__all__ = [
    "AgentsFailing",
    "FinishedGroup",
    "GroupSink",
    "GroupStats",
    "Prompt",
    "TrajectoryProducer",
    "aggregate_stats",
    "rollout_error",
]

logger = logging.getLogger(__name__)

#: Owner prefix of the store's tasks that belong to producer groups.
OWNER_PREFIX = "group:"
GroupStatus = Literal["finished", "failure"]
_ATTEMPT_SUFFIX = re.compile(r" \(attempt \d+ of \d+\)$")


class AgentsFailing(RuntimeError):
    """Agents keep failing: so many training groups in a row had no rollout left to train that training stops.

    The message says how many groups and rollouts there were and the most frequent reasons: the agents' errors,
    or the training-signal option that masked rollouts the agents completed (then that option is what to look
    at); ``errors`` holds ``(reason, count)`` pairs, most frequent first.
    """

    def __init__(self, groups: int, rollouts: int, errors: Counter[str]) -> None:
        self.groups, self.rollouts, self.errors = groups, rollouts, errors.most_common()
        top = "; ".join(f"{count}x {error}" for error, count in self.errors[:3]) or "no error recorded"
        super().__init__(
            f"agents keep failing: no rollout of the last {groups} training groups left a row to train "
            f"({rollouts} rollouts); most frequent reasons: {top}. Fix the agent (or the option named), or "
            f"raise aglverl.max_failed_groups (0: never stop)"
        )


#: What a masked termination reason means, for :func:`rollout_error`.
_MASKED_MEANING: Mapping[str, str] = {
    "truncated": "a response was cut at its max_tokens or at data.max_response_length",
    "context_exceeded": "the context window filled",
    "max_turns": "the agent declared max_turns",
}


def rollout_error(record: RolloutRecord, masked: int = 0, group_too_small: int = 0) -> str:
    """Why a rollout left no row to train, as one line: the agent's error (its type and message) when it
    posted one, else the store's reason (lease expired, deadline passed); for a completed rollout, the
    training-signal option that masked it (``masked``: its :data:`~aglverl.trajectory.signals.REASON_BITS` that did),
    its group's ``min_group_size`` (``group_too_small``), or that it had no trainable turn."""
    if record.state == "completed":
        reasons = [reason for reason, bit in REASON_BITS.items() if masked & bit]
        if reasons:
            return "; ".join(
                f"completed, but masked by aglverl.signal.mask_{reason}=true: it ended {reason} "
                f"({_MASKED_MEANING.get(reason, 'recorded for it')})"
                for reason in reasons
            )
        if group_too_small:
            return (
                f"completed, but its group had fewer usable rollouts than aglverl.signal.min_group_size="
                f"{group_too_small}"
            )
        return "completed without a trainable turn (no recorded call with token ids, no triplets)"
    error = _ATTEMPT_SUFFIX.sub("", record.error or "failed without a recorded error")
    return error.removeprefix("agent reported failure: ")


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt a trainer wants answered ``n`` times (one GRPO group).

    ``uid`` names the group (the trainer's; it may not contain ``_``), ``input`` is what agents get as the
    task input, ``partition`` is ``"train"`` or ``"val"``, ``global_steps`` the trainer step that asked,
    ``index`` the prompt's position in its dataset (matches a replayed prompt after a restart), ``fields``
    dataset fields a sink carries into every row of the group.
    """

    uid: str
    input: Any
    n: int
    partition: str = "train"
    global_steps: int = 0
    index: int | None = None
    fields: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.uid or "_" in self.uid:
            raise ValueError(f"a prompt uid must be non-empty and contain no '_', got {self.uid!r}")
        if self.n < 1:
            raise ValueError(f"prompt {self.uid}: n must be >= 1, got {self.n}")


@dataclass(frozen=True, slots=True)
class GroupStats:
    """What a finished group contributes to a step's metrics (sums, so groups add up)."""

    uid: str
    partition: str
    global_steps: int
    n_rollouts: int
    n_completed: int
    n_timed_out: int
    #: Sum of the rollouts' final rewards, a failed rollout counting its failure reward.
    reward_sum: float
    n_rows: int
    seconds: float
    #: The batch builder's counts for this group (``batch/*``, ``filter/*``, ``rejection/*``, ``logprobs/*``).
    counts: Mapping[str, float]
    #: Every GRPO group of this prompt has equal scores (its advantages are all zero).
    uniform: bool
    #: Oldest / newest weight version that generated the group's rows.
    min_version: int
    max_version: int


@dataclass(frozen=True, slots=True)
class FinishedGroup:
    """A group whose rollouts are all terminal: its rows (jagged, built by
    :func:`aglverl.trajectory.rows.build_rows`: one row per chain of calls, or per call with
    ``trajectory="per_call"``, in session then first-call order, each carrying its ids, response mask, calls,
    weight versions, logprobs and score) and what a sink needs besides: the records, the stats, and per
    rollout (session order) the reasons that masked it."""

    prompt: Prompt
    status: GroupStatus
    rows: Rows
    stats: GroupStats
    records: list[RolloutRecord]

    @property
    def sessions(self) -> np.ndarray:
        """Each row's session (its rollout's place in the group: rollouts are built in session order)."""
        return self.rows.row_rollout.astype(np.int64)

    @property
    def n_calls(self) -> np.ndarray:
        """Each row's number of calls."""
        return self.rows.n_calls

    @property
    def masked(self) -> np.ndarray:
        """Per rollout (session order), the reasons (:data:`~aglverl.trajectory.signals.REASON_BITS`) that
        masked it, 0 if none."""
        return self.rows.masked


class GroupSink(Protocol):
    """Where a producer's groups go (TransferQueue, for verl's V1 trainer). A sink may file lazily: what it was
    given must be readable once :meth:`flush` returns."""

    async def started(self, prompts: Sequence[Prompt]) -> None:
        """The prompts' groups were queued for agents (verl's ``running`` status)."""

    async def finished(self, group: FinishedGroup) -> None:
        """The group's rollouts are all terminal: file its rows and its status."""

    async def flush(self) -> None:
        """Everything given so far is filed when this returns."""


@dataclass(eq=False)
class _Group:
    prompt: Prompt
    rollout_ids: list[str]
    dispatched_at: float
    started: anyio.Event
    journaled: bool
    finished: bool = False
    #: the trainer step whose checkpoint save began once this group was finished (it may be in that checkpoint)
    covered_at: int | None = None


@dataclass(eq=False)
class _Recovered:
    """A training group a previous run left in flight (from the journal), waiting to be adopted."""

    record: Mapping[str, Any]
    raw: list[Mapping[str, Any]]
    rollouts: dict[str, RolloutRecord | None]  # rollout id -> terminal record, or None (redo it)
    input: Any
    covered_at: int | None = None  # see _Group.covered_at


def aggregate_stats(stats: Sequence[GroupStats]) -> dict[str, float]:
    """A step's aglverl metrics from its groups: rollouts, failures, reward over every finished rollout
    (failures at their failure reward; absent without a rollout), rows, the batch builder's counts summed,
    and the version span."""
    n = sum(s.n_rollouts for s in stats)
    counts: dict[str, float] = defaultdict(float)
    for s in stats:
        for key, value in s.counts.items():
            counts[key] += value
    # The producer drops nothing (rejection sampling is the sampler's: verl counts its evictions as
    # ``training/filter_groups/evicted_samples``), so the batch builder's ``rejection/*_dropped`` are left out.
    metrics = {
        key: value
        for key, value in counts.items()
        if "/n_" in key and not (key.startswith("rejection/") and key.endswith("_dropped"))
    }
    if n:
        metrics["training/reward"] = sum(s.reward_sum for s in stats) / n
        # what the trainer reads per rollout: merged rows, and what one row per call would have cost
        metrics["step/trainer_tokens_per_rollout"] = counts.get("batch/n_trainer_tokens", 0.0) / n
        metrics["step/trainer_tokens_per_rollout_per_call"] = (
            counts.get("batch/n_trainer_tokens_per_call", 0.0) / n
        )
    metrics.update(
        {
            "step/n_groups": float(len(stats)),
            "step/n_groups_uniform": float(sum(s.uniform for s in stats)),
            "step/n_rollouts": float(n),
            "step/n_completed": float(sum(s.n_completed for s in stats)),
            "step/n_failed": float(n - sum(s.n_completed for s in stats)),
            "step/n_timed_out": float(sum(s.n_timed_out for s in stats)),
            "step/n_rows": float(sum(s.n_rows for s in stats)),
            "step/group_seconds_max": max((s.seconds for s in stats), default=0.0),
        }
    )
    if stats:
        metrics["step/call_weight_version_min"] = float(min(s.min_version for s in stats))
        metrics["step/call_weight_version_max"] = float(max(s.max_version for s in stats))
    return metrics


class TrajectoryProducer:
    """Runs prompt groups over the store and hands each finished group to ``sink`` (see the module docstring).

    ``batch`` and ``signal`` shape the rows (rejection sampling is left to the sampler, which gets the
    groups' ``uniform`` flag: rows are always written). ``group_timeout``: seconds after dispatch at which a
    group's unfinished rollouts are failed (``None``: leases and attempts alone bound it). ``weight_version``
    tells the version served now (for rows whose calls the proxy did not see). ``journal``: training groups
    stay in the store's journal until :meth:`checkpointed`. ``max_failed_groups``: after this many training
    groups in a row whose every rollout failed, :meth:`check_agents` raises :class:`AgentsFailing` (0: never).
    """

    def __init__(
        self,
        store: TaskStore,
        sink: GroupSink,
        *,
        batch: BatchConfig,
        signal: SignalConfig,
        group_timeout: float | None = None,
        weight_version: Callable[[], int] = lambda: 0,
        journal: bool = False,
        registry: Registry | None = None,
        max_failed_groups: int = 0,
    ) -> None:
        self.store = store
        self.sink = sink
        self.batch_config = batch
        #: says once when merged conversations were left untrained for the width; its ``names`` are how the
        #: trainer sets the widths (``data.*`` under AsyncVERL)
        self.width_warning = WidthWarning(batch)
        # Rejection is the sampler's decision (an evicted group is replaced); rows of every group are written.
        self.signal = signal
        self._build_signal = SignalConfig.from_dict({**signal.to_dict(), "rejection_sampling": False})
        self.group_timeout = group_timeout
        self.weight_version = weight_version
        self.journal = journal
        self._groups: dict[str, _Group] = {}
        self._recovered: dict[str, _Recovered] = {}
        self._stats: dict[str, GroupStats] = {}
        self._evicted: list[GroupStats] = []
        self._version = 0
        self._changed = anyio.Event()
        self._tg: TaskGroup | None = None
        self.max_failed_groups = max_failed_groups
        self._failed_streak = 0  # training groups in a row whose every rollout failed
        self._failed_rollouts = 0
        self._failed_errors: Counter[str] = Counter()
        self.failed_groups_total = 0
        r = registry or Registry()
        self._m_groups = r.counter("aglverl_groups_total", "Prompt groups finished.", ["status"])
        r.gauge("aglverl_groups_in_flight", "Prompt groups dispatched and not finished.", self.in_flight)

    # ------------------------------------------------------------------ life cycle
    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Host the groups' tasks until cancelled."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            try:
                await anyio.sleep_forever()
            finally:
                self._tg = None

    def in_flight(self) -> int:
        return sum(not g.finished for g in self._groups.values())

    def progress(self, partition: str) -> tuple[int, int]:
        """``(version, groups of partition still in flight)``, read together."""
        in_flight = sum(not g.finished and g.prompt.partition == partition for g in self._groups.values())
        return self._version, in_flight

    @property
    def version(self) -> int:
        """How many groups have finished so far (it only grows)."""
        return self._version

    async def flush(self) -> int:
        """Have the sink file every group finished so far; returns the :attr:`version` they make up."""
        version = self._version
        await self.sink.flush()
        return version

    async def wait_changed(self, seen: int, count: int = 1) -> int:
        """Return the moment :attr:`version` reaches ``seen + count`` (``count`` more groups finished since a
        look at ``seen``; at once if that already happened). Cancelling the wait changes nothing."""
        while self._version < seen + count:
            await self._changed.wait()
        return self._version

    def uniform(self, uid: str) -> bool:
        """Whether the finished group ``uid`` has equal scores in every GRPO group (false if unknown)."""
        stats = self._stats.get(uid)
        return stats is not None and stats.uniform

    def uniform_scores(self, uids: Sequence[str]) -> dict[str, float]:
        """Of the finished groups ``uids``, those whose scores are all equal, with their mean reward."""
        return {
            uid: round(stats.reward_sum / stats.n_rollouts, 6)
            for uid in uids
            if (stats := self._stats.get(uid)) is not None and stats.uniform and stats.n_rollouts
        }

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, prompts: Sequence[Prompt], *, resources_id: str | None, mode: Mode = "train") -> None:
        """Queue every prompt's group and return at once (call on the event loop).

        Raises ``RuntimeError`` if the producer is not serving and ``ValueError`` for a uid already in flight;
        nothing is queued then.
        """
        if self._tg is None:
            raise RuntimeError("the trajectory producer is not serving (start the daemon first)")
        for prompt in prompts:
            if prompt.uid in self._groups:
                raise ValueError(f"prompt uid {prompt.uid!r} is already dispatched")
        started = anyio.Event()
        for prompt in prompts:
            group = self._queue(prompt, resources_id, mode, started)
            self._tg.start_soon(self._run, group, name=f"aglverl group {prompt.uid}")
        self._tg.start_soon(self._mark_started, list(prompts), started, name="aglverl groups started")

    def _queue(self, prompt: Prompt, resources_id: str | None, mode: Mode, started: anyio.Event) -> _Group:
        recovered = self._adopt(prompt)
        owner = OWNER_PREFIX + prompt.uid
        rollout_ids: list[str] = []
        for session in range(prompt.n):
            metadata = {
                "data_id": prompt.uid,
                "session": session,
                "global_steps": prompt.global_steps,
                "partition": prompt.partition,
                "is_train": prompt.partition == "train",
            }
            previous = list(recovered.rollouts)[session] if recovered is not None else None
            record = recovered.rollouts[previous] if recovered is not None and previous is not None else None
            if record is not None:
                self.store.adopt(record, resources_id=resources_id, owner=owner)
                rollout_ids.append(record.rollout_id)
            else:
                rollout_ids.append(
                    self.store.enqueue(
                        prompt.input,
                        mode=mode,
                        resources_id=resources_id,
                        metadata=metadata,
                        owner=owner,
                        rollout_id=previous,
                    )
                )
        journaled = self.journal and prompt.partition == "train"
        if journaled:
            self.store.journal_write(_group_record(prompt, rollout_ids, None))
        group = _Group(prompt, rollout_ids, time.monotonic(), started, journaled)
        self._groups[prompt.uid] = group
        return group

    async def _mark_started(self, prompts: list[Prompt], started: anyio.Event) -> None:
        try:
            await self.sink.started(prompts)
        finally:
            started.set()

    # ------------------------------------------------------------------ a group's life
    async def _run(self, group: _Group) -> None:
        prompt = group.prompt
        deadline = math.inf if self.group_timeout is None else group.dispatched_at + self.group_timeout
        with anyio.move_on_after(deadline - time.monotonic()):
            await self.store.wait_terminal(group.rollout_ids)
        timed_out = self.store.fail(
            group.rollout_ids, "the group's deadline passed before the rollout finished"
        )
        records = [self.store.record(rid) for rid in group.rollout_ids]
        if tokens_in(records) <= INLINE_BUILD_TOKENS:
            finished = self._build(group, records, timed_out)
        else:
            finished = await anyio.to_thread.run_sync(self._build, group, records, timed_out)
        await group.started.wait()
        await self.sink.finished(finished)
        self._m_groups.inc(1, finished.status)
        group.finished = True
        self._stats[prompt.uid] = finished.stats
        if prompt.partition == "train":
            self._count_failures(finished)
        if not group.journaled:
            self._forget(group)
        self._version += 1
        self._changed.set()
        self._changed = anyio.Event()

    def _build(self, group: _Group, records: list[RolloutRecord], timed_out: int) -> FinishedGroup:
        prompt = group.prompt
        now = self.weight_version()  # a call whose version was not recorded (a posted triplet): the one now
        trajectories = [trajectory_of(r) for r in records]
        rollouts = [
            finished_rollout(r, t, prompt.uid, version_now=now)
            for r, t in zip(records, trajectories, strict=True)
        ]
        rows = build_rows(rollouts, self.batch_config, self._build_signal)
        self.width_warning.note(rows)
        # recorded calls their results left out of training (agent_match: another agent's), beside batch/n_calls
        counts = {
            **rows.metrics,
            "batch/n_calls_unselected": float(sum(t.n_unselected for t in trajectories)),
        }
        n_completed = sum(r.state == "completed" for r in records)
        reward_sum = sum(
            (r.reward if r.reward is not None else self.batch_config.reward_fill_value or 0.0)
            if r.completed
            else self.signal.failure_reward
            for r in rollouts
        )
        n_groups = counts.get("rejection/n_groups", 0.0)
        stats = GroupStats(
            uid=prompt.uid,
            partition=prompt.partition,
            global_steps=prompt.global_steps,
            n_rollouts=len(records),
            n_completed=n_completed,
            n_timed_out=timed_out,
            reward_sum=float(reward_sum),
            n_rows=len(rows),
            seconds=time.monotonic() - group.dispatched_at,
            counts=counts,
            uniform=n_groups > 0 and counts.get("rejection/n_groups_uniform", 0.0) == n_groups,
            # over every call of the group, in a row or not (a rollout without calls: the version now)
            min_version=min((min(r.versions or (now,)) for r in rollouts), default=now),
            max_version=max((max(r.end_versions or (now,)) for r in rollouts), default=now),
        )
        return FinishedGroup(prompt, "finished" if len(rows) else "failure", rows, stats, records)

    def _count_failures(self, group: FinishedGroup) -> None:
        """Keep the streak of training groups whose every rollout failed (or left no trainable row)."""
        if group.stats.n_completed and len(group.rows):
            self._failed_streak, self._failed_rollouts = 0, 0
            self._failed_errors.clear()
            return
        self.failed_groups_total += 1
        self._failed_streak += 1
        self._failed_rollouts += len(group.records)
        too_small = (
            self.signal.min_group_size if group.stats.counts.get("rejection/n_samples_too_small") else 0
        )
        masked = group.masked.tolist() if len(group.masked) else [0] * len(group.records)
        self._failed_errors.update(
            rollout_error(r, bits, too_small) for r, bits in zip(group.records, masked, strict=True)
        )

    def check_agents(self) -> None:
        """Raise :class:`AgentsFailing` once ``max_failed_groups`` training groups in a row failed entirely."""
        if self.max_failed_groups > 0 and self._failed_streak >= self.max_failed_groups:
            raise self.agents_error()

    def agents_error(self) -> AgentsFailing:
        """The :class:`AgentsFailing` describing the current streak of failed training groups."""
        return AgentsFailing(self._failed_streak, self._failed_rollouts, self._failed_errors)

    def _forget(self, group: _Group) -> None:
        self._groups.pop(group.prompt.uid, None)
        if group.journaled:
            self.store.journal_write({"kind": "group_done", "uid": group.prompt.uid})
        self.store.forget(group.rollout_ids)

    # ------------------------------------------------------------------ metrics
    def take_stats(self, uids: Sequence[str]) -> list[GroupStats]:
        """The stats of the finished groups ``uids`` (a trainer step's groups), removed from the producer,
        plus those of every group evicted since the last call (:meth:`evicted`)."""
        taken = [s for uid in dict.fromkeys(uids) if (s := self._stats.pop(uid, None)) is not None]
        taken += self._evicted
        self._evicted = []
        return taken

    def take_partition(self, partition: str) -> list[GroupStats]:
        """Every finished group's stats of ``partition`` (e.g. a validation's), removed from the producer."""
        uids = [uid for uid, s in self._stats.items() if s.partition == partition]
        return [self._stats.pop(uid) for uid in uids]

    def evicted(self, uids: Sequence[str]) -> None:
        """The sampler dropped these finished groups (stale, rejected, failed): their stats go to the next
        :meth:`take_stats`; their rows will never be read."""
        for uid in uids:
            stats = self._stats.pop(uid, None)
            if stats is not None:
                self._evicted.append(stats)

    # ------------------------------------------------------------------ journal and restart
    async def covering(self, global_steps: int) -> list[str]:
        """The trainer is about to save the checkpoint of ``global_steps``: file the finished groups with the
        sink (:meth:`flush`) and journal them as covered by that checkpoint; returns their uids, for
        :meth:`checkpointed` once the save is done.

        Exactly the groups finished when this is called are covered: the flush files them (and perhaps groups
        finishing while it writes, which stay uncovered and journaled: a group covered must be in the
        snapshot, a group in it need not be covered). The record is journaled before the save starts, so after
        a kill at any moment of the save a recovered group is never attached to a prompt of a step the
        checkpoint covers (it may already be trained). Cancelled during the flush: nothing is journaled.
        """
        ready = [
            uid for uid, g in self._groups.items() if g.finished and g.journaled and g.covered_at is None
        ]
        await self.sink.flush()
        uids = [uid for uid in ready if (g := self._groups.get(uid)) is not None and g.covered_at is None]
        for uid in uids:
            self._groups[uid].covered_at = global_steps
        if uids:
            self.store.journal_write({"kind": "covered", "global_steps": global_steps, "uids": uids})
        return uids

    def checkpointed(self, uids: Sequence[str] | None = None) -> int:
        """A trainer checkpoint now covers these finished groups (default: every finished group): drop them
        from the journal; returns how many. Groups that finished after :meth:`covering` are not in the
        checkpoint (a mode's sampler went on during the save): they stay."""
        if uids is None:
            done = [g for g in self._groups.values() if g.finished]
        else:
            done = [g for uid in uids if (g := self._groups.get(uid)) is not None and g.finished]
        for group in done:
            self._forget(group)
        return len(done)

    def restore(self, records: Sequence[Mapping[str, Any]]) -> set[str]:
        """Hold the training groups a previous run left in flight (call before serving).

        Returns the rollout ids of every producer task in ``records`` (the store must not restore those:
        their tasks would be handed out with the previous run's resources).
        """
        groups = {r["uid"]: r for r in records if r.get("kind") == "group"}
        covered: dict[str, int] = {
            uid: r["covered_at"] for uid, r in groups.items() if r.get("covered_at") is not None
        }
        for r in records:
            if r.get("kind") == "group_done":
                groups.pop(r["uid"], None)
            elif r.get("kind") == "covered":
                covered.update(dict.fromkeys(r["uids"], r["global_steps"]))
        owned = {
            r["rollout_id"]
            for r in records
            if r.get("kind") == "task" and str(r.get("owner") or "").startswith(OWNER_PREFIX)
        }
        wanted = {rid for g in groups.values() for rid in g["rollout_ids"]}
        mine = [r for r in records if r.get("rollout_id") in wanted and r.get("kind") != "group"]
        scratch = TaskStore(lease_seconds=self.store.lease_seconds, registry=Registry())
        scratch.restore(mine)
        for uid, record in groups.items():
            rollouts: dict[str, RolloutRecord | None] = {}
            inputs = []
            for rid in record["rollout_ids"]:
                known = scratch.knows(rid)
                snapshot = scratch.record(rid) if known else None
                if snapshot is not None:
                    inputs.append(snapshot.input)
                rollouts[rid] = snapshot if snapshot is not None and snapshot.state in TERMINAL else None
            raw = [r for r in mine if r.get("rollout_id") in rollouts]
            self._recovered[uid] = _Recovered(
                record, raw, rollouts, inputs[0] if inputs else None, covered.get(uid)
            )
        if self._recovered:
            n_done = sum(r is not None for g in self._recovered.values() for r in g.rollouts.values())
            logger.info(
                "journal: %d training groups were in flight (%d of their rollouts finished)",
                len(self._recovered),
                n_done,
            )
        return owned | wanted

    def _adopt(self, prompt: Prompt) -> _Recovered | None:
        recovered = self._recovered.pop(prompt.uid, None)
        if recovered is None and prompt.index is not None:
            # A replayed data loader asks for the same sample again under a new uid, at the same step in
            # lockstep training, possibly at another one when rollouts run ahead: the same step wins.
            same = [
                uid
                for uid, candidate in self._recovered.items()
                if candidate.record["partition"] == prompt.partition
                and candidate.record["index"] == prompt.index
                and candidate.input == prompt.input
            ]
            same.sort(key=lambda uid: self._recovered[uid].record["global_steps"] != prompt.global_steps)
            if same:
                recovered = self._recovered.pop(same[0])
        if recovered is None:
            return None
        if recovered.covered_at is not None and prompt.global_steps > recovered.covered_at:
            # The group was finished when the checkpoint of step covered_at was being saved. verl resumed from
            # a checkpoint k asks at steps k + 1 and later (trainer_base.fit increments global_steps before any
            # dispatch), so a prompt of a later step means that save completed: the group may be trained in
            # it (or filed in its TransferQueue snapshot). Redo it rather than train it twice.
            logger.info(
                "prompt %s: the journal's group %s may be in the checkpoint of step %d; redone, not reused",
                prompt.uid,
                recovered.record["uid"],
                recovered.covered_at,
            )
            return None
        if len(recovered.rollouts) != prompt.n:
            logger.warning(
                "prompt %s: the journal's group has %d rollouts, the trainer asks for %d; not reused",
                prompt.uid,
                len(recovered.rollouts),
                prompt.n,
            )
            return None
        done = sum(r is not None for r in recovered.rollouts.values())
        logger.info(
            "prompt %s: reusing %d finished rollouts from the journal, redoing %d",
            prompt.uid,
            done,
            prompt.n - done,
        )
        return recovered

    @property
    def recovered(self) -> int:
        """Groups from a previous run still waiting to be adopted."""
        return len(self._recovered)

    def end_recovery(self, global_steps: int | None = None) -> int:
        """Drop the previous run's groups no dispatch adopted and none will: those the previous run dispatched
        for a step up to ``global_steps``, whose sampling the trainer has just ended (``None``: every one);
        returns how many. A group of a later step stays until then: a trainer resumed from a checkpoint
        several steps back (``save_freq > 1``) replays its data loader and asks for that step's prompts again
        at that step, and the group's finished rollouts are reused then, not answered again."""
        dropped = [
            uid
            for uid, group in self._recovered.items()
            if global_steps is None or int(group.record.get("global_steps") or 0) <= global_steps
        ]
        for uid in dropped:
            del self._recovered[uid]
        if dropped:
            logger.info(
                "journal: %d groups of the previous run were not asked for again; dropped", len(dropped)
            )
        return len(dropped)

    def live_records(self) -> Iterator[dict[str, Any]]:
        """Journal records of the groups still needed (for compaction): live training groups and recovered
        groups not yet adopted (their rollouts' records with them)."""
        for group in self._groups.values():
            if group.journaled:
                yield _group_record(group.prompt, group.rollout_ids, group.covered_at)
        for recovered in self._recovered.values():
            yield {**recovered.record, "covered_at": recovered.covered_at}
            yield from (dict(r) for r in recovered.raw)


def _group_record(prompt: Prompt, rollout_ids: list[str], covered_at: int | None) -> dict[str, Any]:
    return {
        "covered_at": covered_at,
        "kind": "group",
        "uid": prompt.uid,
        "partition": prompt.partition,
        "global_steps": prompt.global_steps,
        "index": prompt.index,
        "n": prompt.n,
        "rollout_ids": rollout_ids,
    }
