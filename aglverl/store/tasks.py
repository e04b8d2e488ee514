"""The task store: the single source of truth for tasks, leases, attempts, results, LLM calls and resources.

Everything here runs on one event loop and every mutating method is synchronous, so each one is atomic with
respect to the others: no locks, no threads. The only awaits are the ones that wait for something to happen
(:meth:`TaskStore.claim` long-polls, :meth:`TaskStore.wait_terminal`, :meth:`TaskStore.wait_for_rollout`) and
the lease reaper started by :meth:`TaskStore.serve`, which sleeps until the earliest lease deadline.

Life of a rollout::

    enqueue ──▶ queued ──claim──▶ claimed(attempt k) ──result──▶ completed
                  ▲                  │ lease expired / agent reported failure / never delivered
                  └──── requeued ◀───┘ (new attempt id, same rollout id; after max_attempts: failed)

A result from any attempt the rollout has had is accepted while the rollout is unfinished (first finished
attempt wins); later results are acknowledged and ignored. The LLM calls the proxy recorded for the winning
attempt are kept, the others discarded; a failed rollout keeps its last attempt's calls (a trainer may still
learn from them, see ``SignalConfig``). Why a rollout failed (``agent_error``, ``lease_expired``,
``step_timeout``) is decided and recorded here, as is the reason an agent declares for a result.

With proxy shards (:attr:`TaskStore.pinning`) an attempt's calls are recorded in another process: see
:class:`~aglverl.store.ports.AttemptPinning`. The rollout's records, its journal records, the errors, the
leases, the parked agents, the resource versions, the metrics (:attr:`TaskStore.meters`) and the takes of
calls from proxy shards have modules of their own in this package.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, Unpack

import anyio
from anyio.abc import TaskGroup, TaskStatus

from ..metrics import Registry
from ..models import Mode, NamedResources, ResourcesUpdate, Rollout, Task, TerminationReason
from .config import StoreConfig, StoreSettings
from .entry import Entry, Group
from .errors import (
    AlreadyFinished,
    NotQueued,
    StepEnded,
    StoreClosed,
    UnknownAttempt,
    UnknownRollout,
)
from .leases import Leases
from .meters import StoreMeters
from .ports import AttemptPinning, Journal
from .records import (
    TERMINAL,
    AttemptChange,
    AttemptEvent,
    LLMCall,
    RolloutRecord,
    RolloutState,
    check_token_ids,
)
from .resources import ResourceVersions
from .takes import Takes
from .waiters import Waiters

__all__ = ["TaskStore"]

logger = logging.getLogger(__name__)

#: How many ids of released (handed-over) rollouts are remembered, to tell a late post from an unknown id.
_TOMBSTONES = 100_000
#: The termination reason of a rollout whose last attempt failed this way (keys: requeue metric labels).
_TERMINATION_OF: Mapping[str, TerminationReason] = {
    "agent_failed": "agent_error",
    "lease_expired": "lease_expired",
    "shard_lost": "lease_expired",  # the attempt's recorded calls vanished with their proxy shard
}
RetryReason = Literal["agent_failed", "lease_expired", "shard_lost"]


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class TaskStore:
    """In-memory store of tasks, attempts and results (see the module docstring for the life cycle).

    ``config`` (a :class:`~aglverl.store.config.StoreConfig`), or its fields as keywords
    (``TaskStore(lease_seconds=60)``), not both: how long a claim lasts without a heartbeat, how many claims a
    rollout gets, the vocabulary size posted ids must fit. :meth:`reconfigure` replaces it while running.
    """

    def __init__(
        self,
        config: StoreConfig | None = None,
        *,
        registry: Registry | None = None,
        journal: Journal | None = None,
        **settings: Unpack[StoreSettings],
    ) -> None:
        if config is not None and settings:
            raise TypeError(
                f"TaskStore takes config or its settings as keywords, not both: {', '.join(settings)}"
            )
        #: The settings every method reads when it uses one (a frozen value; see :meth:`reconfigure`).
        self.config = config if config is not None else StoreConfig(**settings)
        self.journal = journal
        self._entries: dict[str, Entry] = {}
        self._queue: deque[str] = deque()
        self._waiters = Waiters()
        self._leases = Leases(self._entries)
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        self._resources = ResourceVersions(self._journal)
        self._closed = False
        self._forget_listeners: list[Callable[[Sequence[str]], None]] = []
        self._attempt_listeners: list[Callable[[AttemptChange], None]] = []
        self._queued_count = 0
        self._claimed_count = 0
        #: Proxy shards that admit and record this store's attempts (``None``: the proxy is in this process).
        self.pinning: AttemptPinning | None = None
        self._takes = Takes(self._entries)
        self._tg: TaskGroup | None = None
        #: Where the store's series are registered (the task server and the collector add theirs).
        self.registry = registry or Registry()
        self.meters = StoreMeters(
            self.registry,
            tasks_queued=lambda: self._queued_count,
            tasks_claimed=lambda: self._claimed_count,
            agents_waiting=lambda: len(self._waiters),
            rollouts_held=lambda: len(self._entries),
        )

    @property
    def lease_seconds(self) -> float:
        return self.config.lease_seconds

    @property
    def max_attempts(self) -> int:
        return self.config.max_attempts

    @property
    def vocab_size(self) -> int | None:
        return self.config.vocab_size

    def reconfigure(self, **changes: Any) -> StoreConfig:
        """Replace settings (``store.reconfigure(lease_seconds=60)``): they hold from their next use on (a lease
        already running keeps its deadline). Returns the new config; an unknown name is a ``TypeError``."""
        self.config = dataclasses.replace(self.config, **changes)
        return self.config

    # ------------------------------------------------------------------ life cycle
    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run the lease reaper until cancelled; then close the store (parked long-polls return no task).

        The reaper sleeps until the earliest lease deadline and is re-armed when an earlier one appears; it
        never ticks on a fixed period.
        """
        task_status.started()
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg  # hosts the takes of failed rollouts' records from their proxy shards
                while True:
                    await self._leases.wait_due()
                    self._expire_due(time.monotonic())
        finally:
            self._tg = None
            self.close()

    def close(self) -> None:
        """Refuse new claims and wake every parked long-poll with no task."""
        self._closed = True
        self._waiters.close()

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ queueing
    def enqueue(
        self,
        input: Any,
        *,
        mode: Mode | None = None,
        resources_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        owner: str | None = None,
        rollout_id: str | None = None,
    ) -> str:
        """Queue a task and return its rollout id. ``owner`` is the collector step it belongs to, if any."""
        rollout_id = rollout_id or _new_id("rollout")
        if rollout_id in self._entries:
            raise ValueError(f"rollout id {rollout_id!r} is already queued")
        entry = Entry(
            rollout_id=rollout_id,
            input=input,
            mode=mode,
            resources_id=resources_id,
            metadata=dict(metadata or {}),
            create_time=time.time(),
            owner=owner,
            since=time.monotonic(),
        )
        self._entries[rollout_id] = entry
        self._journal(entry.task_record())
        self.meters.queued.inc()
        self._emit("queued", entry, None)
        self._push(entry, front=False)
        return rollout_id

    def _push(self, entry: Entry, *, front: bool) -> None:
        self._queued_count += 1
        if front:
            self._queue.appendleft(entry.rollout_id)
        else:
            self._queue.append(entry.rollout_id)
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand queued tasks straight to parked agents, oldest waiter first."""
        self._waiters.hand_out(lambda: self._queued_count, self._claim_next)

    def _claim_next(self) -> Task | None:
        while self._queue:
            entry = self._entries.get(self._queue.popleft())
            if entry is not None and entry.state == "queued":
                return self._start_attempt(entry)
        return None

    def _start_attempt(self, entry: Entry) -> Task:
        now = time.monotonic()
        if entry.num_claims == 0:
            self.meters.queue_wait.observe(now - entry.since)
        self._queued_count -= 1
        self._claimed_count += 1
        entry.move("claimed", "claimed")
        entry.num_claims += 1
        entry.attempts.append(_new_id("attempt"))
        entry.last_claim_time = time.time()
        entry.since = now
        self._journal(entry.attempt_record(entry.attempts[-1]))
        self._set_lease(entry, self._leases.now() + self.lease_seconds)
        self.meters.claimed.inc()
        task = entry.task()
        if self.pinning is not None:
            base = entry.resources_id or self._resources.latest_id
            task.resources_id = self.pinning.pin(entry.rollout_id, entry.attempts[-1], base) or base
        self._emit("claimed", entry, entry.attempt_id, resources_id=task.resources_id)
        return task

    def try_claim(self) -> Task | None:
        """Claim the next queued task, or return ``None`` at once.

        With proxy shards the attempt's admission may still be on its way to its shard: :meth:`claim` waits
        for it, and is what an agent's claim should go through.
        """
        if self._closed:
            return None
        return self._claim_next()

    async def claim(self, wait: float = 0.0) -> Task | None:
        """Claim the next task, waiting up to ``wait`` seconds for one to be queued.

        Returns as soon as a task is queued (it is handed to the longest-waiting agent), or ``None`` when the
        wait ends or the store closes. With proxy shards it returns once the attempt's shard admits it (one
        round trip, shared by the claims of a loop iteration); if that shard dies first, the attempt is void
        and the task is claimed again. Cancellation: a task already handed to this waiter when it is
        cancelled goes back to the front of the queue as if it had never been claimed, so a long-poll whose
        agent vanished never loses a task.
        """
        if self.pinning is None:
            return await self._claim(wait)
        deadline = time.monotonic() + wait
        while True:
            task = await self._claim(max(0.0, deadline - time.monotonic()))
            if task is None:
                return None
            attempt_id = task.attempt_id or ""
            try:
                if await self.pinning.admitted(task.rollout_id, attempt_id):
                    return task
            except BaseException:
                self.release(task.rollout_id, attempt_id)
                raise

    async def work(self, attempt: Callable[[Task], Awaitable[None]]) -> None:
        """Claim tasks as they are queued (parked in :meth:`claim`: no polling) and run ``attempt`` on each, one
        at a time, until the store closes: the loop of an in-process worker (the built-in runner's, the Agent
        Lightning bridge's)."""
        while (task := await self.claim(math.inf)) is not None:
            await attempt(task)

    async def _claim(self, wait: float) -> Task | None:
        task = self.try_claim()
        if task is not None or wait <= 0 or self._closed:
            return task
        return await self._waiters.park(
            wait, lambda task: self.release(task.rollout_id, task.attempt_id or "")
        )

    def release(self, rollout_id: str, attempt_id: str) -> bool:
        """Undo a claim whose task never reached its agent: back to the front of the queue, no attempt used."""
        entry = self._entries.get(rollout_id)
        if entry is None or entry.state != "claimed" or entry.attempt_id != attempt_id:
            return False
        entry.attempts.pop()
        if self.pinning is not None:
            self.pinning.unpin(rollout_id, [attempt_id])
        entry.num_claims -= 1
        entry.lease_deadline = math.inf
        self._claimed_count -= 1
        self.meters.released.inc()
        entry.move("queued", "released")
        self._emit("released", entry, attempt_id)
        self._push(entry, front=True)
        return True

    # ------------------------------------------------------------------ leases
    def _set_lease(self, entry: Entry, deadline: float) -> None:
        self._leases.set(entry, deadline, live=self._claimed_count)

    def heartbeat(
        self, rollout_id: str, attempt_id: str | None = None, *, seconds: float | None = None
    ) -> float:
        """Extend the current attempt's lease by ``lease_seconds`` (or ``seconds``); returns the seconds until it
        expires."""
        entry = self._require(rollout_id)
        attempt_id = attempt_id or entry.attempt_id
        entry.require_attempt(attempt_id)
        if entry.state in TERMINAL:
            raise StepEnded(f"rollout {rollout_id!r} is already {entry.state}; nothing to extend")
        if entry.state != "claimed" or attempt_id != entry.attempt_id:
            raise UnknownAttempt(
                f"attempt {attempt_id!r} of rollout {rollout_id!r} no longer holds the task "
                f"(current attempt: {entry.attempt_id!r}, state: {entry.state})"
            )
        lease = self.lease_seconds if seconds is None else seconds
        self._set_lease(entry, self._leases.now() + lease)
        return lease

    def freeze_leases(self) -> None:
        """Stop the lease clock: a trainer holds the agents' LLM calls for its update (minutes to hours), and
        time an agent spends waiting for a held call must not cost it its lease. Idempotent."""
        self._leases.freeze()

    def thaw_leases(self) -> float:
        """Restart the lease clock: every claimed lease keeps the time it had left when the clock stopped (a
        lease started or renewed during the freeze: ``lease_seconds``); returns how long it was stopped."""
        return self._leases.thaw(live=self._claimed_count)

    @property
    def leases_frozen(self) -> bool:
        return self._leases.frozen

    def _expire_due(self, now: float) -> None:
        for entry in self._leases.expired(now):
            self._retry_or_fail(entry, "lease_expired", f"lease expired after {self.lease_seconds:g}s")

    def _retry_or_fail(self, entry: Entry, reason: RetryReason, message: str) -> None:
        """Requeue after a failed attempt; after the last allowed one, fail the rollout for ``reason``."""
        self._claimed_count -= 1
        entry.lease_deadline = math.inf
        if entry.num_claims >= self.max_attempts:
            error = f"{message} (attempt {entry.num_claims} of {self.max_attempts})"
            self._finish(entry, "failed", error=error, termination=_TERMINATION_OF[reason])
            return
        self.meters.requeued.inc(1, reason)
        entry.requeues += 1
        logger.info("requeueing %s (%s, attempt %d)", entry.rollout_id, reason, entry.num_claims)
        entry.move("queued", "ended")
        self._emit("ended", entry, entry.attempt_id, message)
        self._push(entry, front=True)

    # ------------------------------------------------------------------ results
    def _require(self, rollout_id: str) -> Entry:
        entry = self._entries.get(rollout_id)
        if entry is not None:
            return entry
        if rollout_id in self._tombstones:
            raise StepEnded(f"rollout {rollout_id!r} belongs to a step that has already ended")
        raise UnknownRollout(f"unknown rollout id {rollout_id!r}")

    def check_attempt(self, rollout_id: str, attempt_id: str) -> None:
        """Raise unless ``attempt_id`` is an attempt of the unfinished rollout ``rollout_id``."""
        entry = self._require(rollout_id)
        entry.require_attempt(attempt_id)
        if entry.state in TERMINAL:
            raise StepEnded(f"rollout {rollout_id!r} is already {entry.state}")
        entry.refuse_lost(attempt_id)

    async def accept_result(self, rollout: Rollout) -> str:
        """:meth:`submit_result`, after taking the attempt's recorded calls from its proxy shard (with
        :attr:`pinning`; without, the same as :meth:`submit_result`).

        The take is one round trip to the shard; concurrent posts of one attempt share it, and it is shielded
        from cancellation (records the shard has handed over are never dropped on the way). Raises what
        :meth:`submit_result` raises, and :class:`AttemptLost` (409) when the attempt's shard died: the attempt
        is void (the rollout is retried elsewhere) and this result is ignored.
        """
        if self.pinning is not None:
            entry = self._require(rollout.rollout_id)
            attempt_id = rollout.effective_attempt_id or entry.attempt_id
            entry.require_attempt(attempt_id)
            assert attempt_id is not None
            if entry.state not in TERMINAL:
                entry.refuse_lost(attempt_id)
                await self._takes.take(self.pinning, entry.rollout_id, attempt_id)
        return self.submit_result(rollout)

    def attempts_lost(self, attempts: Iterable[tuple[str, str]], reason: str) -> int:
        """Void attempts whose recorded calls are gone (their proxy shard died); returns how many.

        Each one's records are dropped and its later result refused (:class:`AttemptLost`); a rollout whose
        current attempt it was is handed out again (a new attempt, as after a lease expiry) or, after its last
        allowed attempt, failed (``lease_expired``). Attempts of finished rollouts are left alone.
        """
        n = 0
        for rollout_id, attempt_id in attempts:
            entry = self._entries.get(rollout_id)
            if entry is None or entry.state in TERMINAL or attempt_id not in entry.attempts:
                continue
            entry.void(attempt_id)
            self.meters.lost.inc()
            n += 1
            if entry.state == "claimed" and entry.attempt_id == attempt_id:
                self._retry_or_fail(entry, "shard_lost", f"attempt {attempt_id} lost: {reason}")
        return n

    def submit_result(self, rollout: Rollout) -> str:
        """Accept an agent's result; returns a message for the agent.

        Raises :class:`UnknownRollout`/:class:`UnknownAttempt` (404), :class:`StepEnded` or
        :class:`AlreadyFinished` (409) or :class:`InvalidResult` (422) without changing anything. The winning
        attempt resending the same result (a retried POST) is acknowledged and ignored; any other result for a
        finished rollout is an :class:`AlreadyFinished`. With a journal, the result is written to it before
        this returns.
        """
        entry = self._require(rollout.rollout_id)
        attempt_id = rollout.effective_attempt_id or entry.attempt_id
        entry.require_attempt(attempt_id)
        assert attempt_id is not None
        check_token_ids(rollout, self.vocab_size)
        if entry.state not in TERMINAL:
            entry.refuse_lost(attempt_id)
        if entry.state in TERMINAL:
            if entry.is_resend(attempt_id, rollout):
                self.meters.ignored.inc(1, "resent")
                return f"rollout {rollout.rollout_id} was already received from this attempt; resend ignored"
            self.meters.ignored.inc(1, "already_finished")
            by = f" by attempt {entry.result_attempt}" if entry.result_attempt else ""
            raise AlreadyFinished(
                f"rollout {rollout.rollout_id} is already {entry.state}{by}; this result was ignored"
            )
        if rollout.status == "failed":
            return self._agent_failed(entry, attempt_id, rollout)
        self._journal(entry.result_record(attempt_id, rollout))
        if entry.state == "claimed":
            self._claimed_count -= 1
        elif entry.state == "queued":
            self._queued_count -= 1
        self.meters.rollout_latency.observe(time.monotonic() - entry.since)
        self._finish(entry, "completed", result=rollout, attempt_id=attempt_id)
        return f"rollout {rollout.rollout_id} received and stored"

    def _agent_failed(self, entry: Entry, attempt_id: str, rollout: Rollout) -> str:
        error = str(rollout.metadata.get("error", "agent reported failure"))
        if entry.state != "claimed" or attempt_id != entry.attempt_id:
            self.meters.ignored.inc(1, "stale_failure")
            return f"failure of superseded attempt {attempt_id} of {rollout.rollout_id} ignored"
        self._retry_or_fail(entry, "agent_failed", f"agent reported failure: {error}")
        return f"failure of rollout {rollout.rollout_id} recorded ({entry.state})"

    def _finish(
        self,
        entry: Entry,
        state: Literal["completed", "failed"],
        *,
        result: Rollout | None = None,
        attempt_id: str | None = None,
        error: str | None = None,
        termination: TerminationReason | None = None,
    ) -> None:
        """End a rollout. A completed one keeps the winning attempt's calls, a failed one its last attempt's.

        With proxy shards a failed rollout's last attempt still has its records on its shard: the rollout is
        finished at once (nothing more is accepted for it), and its waiters hear of it once those are taken.
        """
        kept = entry.finish(state, result=result, attempt_id=attempt_id, error=error, termination=termination)
        (self.meters.completed if state == "completed" else self.meters.failed).inc()
        self._emit("ended", entry, attempt_id if state == "completed" else entry.attempt_id, error)
        if self.pinning is not None:
            if state == "failed" and kept and self._tg is not None:
                entry.settling = True
                self._tg.start_soon(self._takes.settle, self.pinning, entry, kept, self._journal)
                return
            self.pinning.unpin(entry.rollout_id, entry.attempts)
        if state == "failed":
            self._journal(entry.failed_record())
        entry.notify()

    def fail(
        self,
        rollout_ids: Iterable[str],
        reason: str,
        *,
        termination: TerminationReason = "step_timeout",
    ) -> int:
        """Fail every unfinished rollout among ``rollout_ids``, for ``termination`` (by default: the step's
        deadline passed), with ``reason`` as the error message; returns how many."""
        n = 0
        for rollout_id in rollout_ids:
            entry = self._entries.get(rollout_id)
            if entry is None or entry.state in TERMINAL:
                continue
            if entry.state == "claimed":
                self._claimed_count -= 1
            else:
                self._queued_count -= 1
            self._finish(entry, "failed", error=reason, termination=termination)
            n += 1
        return n

    # ------------------------------------------------------------------ LLM calls
    def record_calls(self, rollout_id: str, attempt_id: str, calls: Sequence[LLMCall]) -> bool:
        """Keep calls the proxy made for an attempt; calls for finished or unknown rollouts are dropped."""
        entry = self._entries.get(rollout_id)
        if entry is None or entry.state in TERMINAL or attempt_id not in entry.attempts:
            return False
        entry.calls.setdefault(attempt_id, []).extend(calls)
        return True

    # ------------------------------------------------------------------ waiting for results
    async def wait_terminal(self, rollout_ids: Iterable[str]) -> None:
        """Return the moment every one of ``rollout_ids`` is completed or failed (no polling).

        Unknown ids raise :class:`UnknownRollout`. Cancelling the wait changes nothing in the store.
        """
        group = Group()
        for rollout_id in rollout_ids:
            entry = self._require(rollout_id)
            if entry.state not in TERMINAL or entry.settling:
                group.remaining += 1
                entry.groups.append(group)
        if group.remaining:
            await group.event.wait()

    def record(self, rollout_id: str) -> RolloutRecord:
        """A snapshot of a rollout (terminal or not)."""
        return self._require(rollout_id).snapshot()

    def forget(self, rollout_ids: Iterable[str]) -> None:
        """Drop finished rollouts from memory once their step was handed over; later posts get a 409."""
        rollout_ids = list(rollout_ids)
        for rollout_id in rollout_ids:
            entry = self._entries.pop(rollout_id, None)
            if entry is None:
                continue
            if entry.state not in TERMINAL:  # pragma: no cover - callers only forget terminal rollouts
                self._entries[rollout_id] = entry
                raise ValueError(f"rollout {rollout_id!r} is still {entry.state}")
            self._tombstones[rollout_id] = None
            if len(self._tombstones) > _TOMBSTONES:
                self._tombstones.popitem(last=False)
        if self.journal is not None and rollout_ids:
            self.journal.write({"kind": "forget", "rollout_ids": rollout_ids})
            self.journal.maybe_compact()
        for listener in self._forget_listeners:
            listener(rollout_ids)

    def on_forget(self, listener: Callable[[Sequence[str]], None]) -> None:
        """Call ``listener(rollout_ids)`` whenever rollouts are dropped (e.g. to drop per-rollout routing state)."""
        self._forget_listeners.append(listener)

    def on_attempt(self, listener: Callable[[AttemptChange], None]) -> None:
        """Call ``listener(change)`` whenever a rollout is queued, an attempt is claimed, released or ends
        (:class:`AttemptChange`), synchronously inside the store's method: a listener must not call back into
        the store. Rollouts rebuilt by :meth:`restore` or taken in by :meth:`adopt` are not announced."""
        self._attempt_listeners.append(listener)

    def _emit(
        self,
        kind: AttemptEvent,
        entry: Entry,
        attempt_id: str | None,
        error: str | None = None,
        *,
        resources_id: str | None = None,
    ) -> None:
        if self._attempt_listeners:
            change = AttemptChange(
                kind, entry.rollout_id, attempt_id, entry.num_claims, entry.state, error, resources_id
            )
            for listener in self._attempt_listeners:
                listener(change)

    # -------------------------------------------------- reading one rollout (for views of the store)
    def rollout_ids(self) -> list[str]:
        """The ids of every rollout held (queued, claimed, or finished and not yet forgotten), oldest first."""
        return list(self._entries)

    def task(self, rollout_id: str) -> Task:
        """The rollout's task as an agent would get it now (its current attempt, if claimed)."""
        return self._require(rollout_id).task()

    def owner(self, rollout_id: str) -> str | None:
        """Who queued the rollout: a collector step or producer group, or ``None`` (owner-less)."""
        return self._require(rollout_id).owner

    def attempts(self, rollout_id: str) -> list[str]:
        """The rollout's attempt ids, oldest first (a finished rollout's journal keeps only its last)."""
        return list(self._require(rollout_id).attempts)

    def calls_of(self, rollout_id: str, attempt_id: str) -> list[LLMCall]:
        """The LLM calls recorded for an attempt so far, in the order they were made (with proxy shards, only
        those taken from the attempt's shard: a finished attempt's)."""
        calls = self._require(rollout_id).calls.get(attempt_id, [])
        return sorted(calls, key=lambda c: (c.seq, c.choice_index))

    async def claim_rollout(self, rollout_id: str, *, lease_seconds: float | None = None) -> Task:
        """Claim this queued rollout (a runner that picks rollouts by id, e.g. an Agent Lightning controller),
        with a lease of ``lease_seconds`` (default: the store's); with proxy shards, returns once the attempt's
        shard admits it. Raises :class:`NotQueued` (409) when the rollout is not waiting in the queue, and
        :class:`StoreClosed` once the store is closed; changes nothing then."""
        entry = self._require(rollout_id)
        if self._closed:
            raise StoreClosed("the store is closed")
        if entry.state != "queued":
            raise NotQueued(f"rollout {rollout_id!r} is {entry.state}, not queued")
        task = self._start_attempt(entry)  # its stale place in the queue is skipped when reached
        if lease_seconds is not None:
            self._set_lease(entry, self._leases.now() + lease_seconds)
        if self.pinning is not None:
            attempt_id = task.attempt_id or ""
            try:
                admitted = await self.pinning.admitted(rollout_id, attempt_id)
            except BaseException:
                self.release(rollout_id, attempt_id)
                raise
            if not admitted:
                raise NotQueued(f"the proxy shard of rollout {rollout_id!r} died before admitting it; retry")
        return task

    def adopt(self, record: RolloutRecord, *, resources_id: str | None, owner: str | None) -> None:
        """Take in a rollout that finished under a previous run (recovered from its journal) as finished here.

        It keeps its id, input, result or error, reason and calls, and is journaled again (a second restart
        still has it); a late post for it gets the usual 409. Raises ``ValueError`` if the id is already held
        or the record is not terminal.
        """
        if record.rollout_id in self._entries:
            raise ValueError(f"rollout id {record.rollout_id!r} is already held")
        if record.state not in TERMINAL:
            raise ValueError(f"rollout {record.rollout_id!r} is {record.state}, not finished")
        entry = Entry.adopted(record, resources_id=resources_id, owner=owner)
        attempt_id = entry.attempt_id
        self._entries[record.rollout_id] = entry
        self._journal(entry.task_record())
        if attempt_id:
            self._journal(entry.attempt_record(attempt_id))
        if entry.state == "completed" and entry.result is not None:
            self._journal(entry.result_record(attempt_id or "", entry.result))
        else:
            self._journal(entry.failed_record())

    def resources_id_of(self, rollout_id: str) -> str | None:
        """The resources version the rollout's task names (``None`` for an unknown rollout or none)."""
        entry = self._entries.get(rollout_id)
        return entry.resources_id if entry is not None else None

    def knows(self, rollout_id: str) -> bool:
        """Whether the rollout is held (queued, claimed or finished and not yet forgotten)."""
        return rollout_id in self._entries

    def state(self, rollout_id: str) -> RolloutState:
        return self._require(rollout_id).state

    # -------------------------------------------------- Agent Lightning server verbs (owner-less rollouts)
    def pop_finished(self, rollout_id: str) -> Rollout | None:
        """The result of a finished owner-less rollout, removed from the store; ``None`` if unfinished."""
        entry = self._require(rollout_id)
        if entry.state not in TERMINAL or entry.settling:
            return None
        self.forget([rollout_id])
        return entry.as_result()

    async def wait_for_rollout(self, rollout_id: str, timeout: float | None = None) -> Rollout | None:  # noqa: ASYNC109
        """Await one rollout's end (an event, no polling); ``None`` if ``timeout`` passes first."""
        entry = self._require(rollout_id)
        if entry.state not in TERMINAL or entry.settling:
            if entry.done is None:
                entry.done = anyio.Event()
            with anyio.move_on_after(math.inf if timeout is None else timeout):
                await entry.done.wait()
        return self.pop_finished(rollout_id)

    def pop_all_finished(self) -> list[Rollout]:
        """Results of every finished owner-less rollout, removed from the store."""
        done = [
            e for e in self._entries.values() if e.owner is None and e.state in TERMINAL and not e.settling
        ]
        self.forget([e.rollout_id for e in done])
        return [e.as_result() for e in done]

    # ------------------------------------------------------------------ resources
    def add_resources(self, resources: NamedResources, resources_id: str | None = None) -> ResourcesUpdate:
        """Publish a new resources version and make it the latest."""
        return self._resources.add(resources, resources_id)

    def replace_resources(self, resources_id: str, resources: NamedResources) -> None:
        """Change a published resources version in place (the latest stays the latest); ``KeyError`` if unknown."""
        self._resources.replace(resources_id, resources)

    def all_resources(self) -> list[ResourcesUpdate]:
        """Every resources version held, oldest first."""
        return self._resources.all()

    def resources(self, resources_id: str | None = None) -> ResourcesUpdate | None:
        """A resources version by id, or the latest one when ``resources_id`` is ``None``."""
        rid = resources_id if resources_id is not None else self._resources.latest_id
        if rid is None:
            return None
        update = self._resources.get(rid)
        if update is None and self.pinning is not None:
            return self.pinning.resources(rid)  # a proxy shard's copy, named by a claimed task
        return update

    @property
    def latest_resources_id(self) -> str | None:
        return self._resources.latest_id

    # ------------------------------------------------------------------ journal
    def _journal(self, record: Mapping[str, Any]) -> None:
        if self.journal is not None:
            self.journal.write(record)

    def journal_write(self, record: Mapping[str, Any]) -> None:
        """Append a record of another component (e.g. a collector step) to the store's journal, if any."""
        self._journal(record)

    async def commit(self) -> None:
        """Return once everything accepted so far is durable by the journal's policy (at once without one)."""
        if self.journal is not None:
            await self.journal.commit()

    def live_records(self) -> Iterator[dict[str, Any]]:
        """Records that rebuild the current state (used to compact the journal)."""
        yield from self._resources.records()
        for entry in self._entries.values():
            yield from entry.records()

    def restore(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Rebuild state from journal records (before serving). Unfinished rollouts are queued again with
        their attempts remembered, so a late result from an agent of the previous run is still accepted;
        records of other components are skipped."""
        for r in records:
            kind = r.get("kind")
            if kind == "task":
                self._entries[r["rollout_id"]] = Entry.from_task_record(r, since=time.monotonic())
            elif kind == "forget":
                for rollout_id in r["rollout_ids"]:
                    if self._entries.pop(rollout_id, None) is not None:
                        self._tombstones[rollout_id] = None
            elif kind == "resources":
                self._resources.apply(r)
            elif (entry := self._entries.get(r.get("rollout_id", ""))) is not None:
                entry.apply(r)
        for entry in self._entries.values():
            if (
                entry.state not in TERMINAL
            ):  # replayed attempts leave a rollout queued: it is handed out again
                self._queued_count += 1
                self._queue.append(entry.rollout_id)
