"""Agent Lightning's rollouts, events and terminal cursor as a view of aglverl's :class:`~aglverl.store.tasks.TaskStore`.

**One Agent Lightning rollout is one attempt of an aglverl rollout.** Agent Lightning's state machine has no way
back (``queuing -> running -> succeeded | failed``, terminal states final), and both of its controllers key
their work by rollout id (``runner_type=local`` remembers each id it spawned; ``runner_type=k8s`` names the Job
``agl-rollout-<id>``), so a rollout that went back to ``queuing`` under the same id would never run again. So
aglverl's retries (a failed attempt requeued with a new attempt id while ``max_attempts`` allows) appear as new
rollouts: attempt 1 of aglverl rollout ``R`` is Agent Lightning rollout ``R``, attempt ``k`` is ``R-retry-<k-1>``
(a Kubernetes-safe name). Each obeys the state machine: the failed attempt's rollout ends ``failed`` (its error
says it was retried and as which id), and the retry is a fresh ``queuing`` rollout any controller picks up.
Agent Lightning's attempt id inside one such rollout (``"0"`` from its controllers) is a label: events are kept
per label as Agent Lightning keeps them, and every label's LLM calls go to the one aglverl attempt.

How the view follows the store (:meth:`TaskStore.on_attempt`, on the loop, no polling): a queued rollout is a
``queuing`` rollout; a claim (an aglverl agent's ``GET /task``, the built-in runner, a controller's ``PATCH
running``, or the first LLM call of an agent a controller spawned) makes it ``running``; the attempt's end makes
it ``succeeded`` or ``failed`` (and, when retried, queues the next one). Changes made through this API go through
the store the same way (``PATCH succeeded`` posts the attempt's result with the reward of its reward event), so
every path that can end an attempt (a controller, the built-in runner, an aglverl agent, a lease running out, a
step's deadline) shows up here once. Every transition into a terminal state is appended to the terminal cursor.

The view holds its parts: the terminal cursor and the retention of the ended rollouts created through the API
(:mod:`.cursor`: reading a page never deletes; such a rollout goes when a caller deletes it, a grace period after
a page last listed it, or past a bound, the oldest first), the bounds on posted events (:mod:`.events`, which
also makes the ``model_request`` events from aglverl's records), and each rollout's :class:`~.slot.Slot`.

Durability: with the daemon's journal, the cursor's positions and the configs of rollouts created through the
API are journaled (``agl_*`` records, compacted to what is still held), so a daemon restarted on its journal (a
resumed ``AsyncVERL`` run) continues the cursor where it stopped: a reader's ``next_after`` from before the
restart lists exactly what ended after it. Events posted by agents live in memory: after a restart a finished
rollout has its ``model_request`` events (the store keeps its calls) and a ``reward`` event made from its result.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import orjson

from ..models import Rollout, check_reward
from ..store import TERMINAL, AttemptChange, LLMCall, TaskStore
from .cursor import MAX_FINISHED_ROLLOUTS, TERMINAL_GRACE_SECONDS, Retention, TerminalCursor
from .errors import BadReward, Conflict, NotFound, TooMany
from .events import (
    MAX_EVENT_BYTES,
    MAX_EVENT_BYTES_PER_ROLLOUT,
    MAX_EVENTS_PER_ROLLOUT,
    EventBudget,
    PostedEvent,
    model_request_events,
    reward_problem,
    reward_value,
    triplet_events,
)
from .slot import ROLLOUT_ID_MAX, Slot, check_rollout_id, retry_id
from .wire import (
    TERMINAL_STATES,
    VALID_TRANSITIONS,
    AglRollout,
    Event,
    LifecycleStatus,
    RolloutConfig,
    RolloutCreate,
    RolloutDetail,
    RolloutMetadata,
    StatusPatch,
    TerminalItem,
    TerminalPage,
)

__all__ = [
    "CONTROLLER_GRACE_SECONDS",
    "MAX_EVENTS_PER_ROLLOUT",
    "MAX_EVENT_BYTES",
    "MAX_EVENT_BYTES_PER_ROLLOUT",
    "MAX_FINISHED_ROLLOUTS",
    "ROLLOUT_ID_MAX",
    "TERMINAL_GRACE_SECONDS",
    "AgentLightningRollouts",
    "BadReward",
    "Conflict",
    "NotFound",
    "Slot",
    "TooMany",
    "check_rollout_id",
    "retry_id",
]

logger = logging.getLogger(__name__)

#: How long past its ``timeout_seconds`` an attempt a controller started keeps its lease: the controller kills
#: the agent at the timeout and reports it within a poll or two; only a controller that died leaves the lease
#: to run out (then the attempt is retried like any whose agent vanished).
CONTROLLER_GRACE_SECONDS = 60.0


class AgentLightningRollouts:
    """The view (see the module docstring). Built on the store it follows; every method runs on its loop.

    ``default_config`` is the ``config`` of rollouts aglverl queued itself (a trainer's), what Agent Lightning's
    controllers read (``agentlightning.local`` / ``k8s`` / ``rollout_timeout_seconds``); rollouts created
    through ``POST /api/rollouts`` carry their own. ``reward_fillna_value``: the reward of an attempt that ended
    well without a reward event (``None``: such an attempt fails). The bounds: on the ended rollouts created
    through the API (:class:`~aglverl.agl10.cursor.Retention`: ``max_finished_rollouts``,
    ``terminal_grace_seconds``; ``clock`` its seconds), and on the events agents post
    (:class:`~aglverl.agl10.events.EventBudget`: ``max_events_per_rollout``, ``max_event_bytes_per_rollout``,
    ``max_event_bytes``).
    """

    def __init__(
        self,
        store: TaskStore,
        *,
        default_config: RolloutConfig | None = None,
        reward_fillna_value: float | None = None,
        max_finished_rollouts: int = MAX_FINISHED_ROLLOUTS,
        terminal_grace_seconds: float = TERMINAL_GRACE_SECONDS,
        max_events_per_rollout: int = MAX_EVENTS_PER_ROLLOUT,
        max_event_bytes_per_rollout: int = MAX_EVENT_BYTES_PER_ROLLOUT,
        max_event_bytes: int = MAX_EVENT_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.default_config = default_config or RolloutConfig()
        self.reward_fillna_value = reward_fillna_value
        self._slots: dict[str, Slot] = {}
        self._keys: dict[str, str] = {}  # attempt key -> the Agent Lightning id it opens
        self._of: dict[str, list[Slot]] = {}  # aglverl rollout id -> its slots, oldest first
        self._configs: dict[str, RolloutConfig] = {}  # rollouts created through the API
        #: The terminal cursor (its ids are Agent Lightning's).
        self.cursor = TerminalCursor()
        #: When the ended rollouts created through the API go.
        self.retention = Retention(
            limit=max_finished_rollouts, grace_seconds=terminal_grace_seconds, clock=clock
        )
        #: The bounds on the events agents post.
        self.budget = EventBudget(
            per_rollout=max_events_per_rollout,
            bytes_per_rollout=max_event_bytes_per_rollout,
            bytes_total=max_event_bytes,
        )
        store.on_attempt(self._changed)
        store.on_forget(self._forgotten)

    # ------------------------------------------------------------------ following the store
    def _new_slot(self, rollout_id: str, index: int) -> Slot:
        now = time.time()
        slot = Slot(retry_id(rollout_id, index), rollout_id, index, now, now)
        self._slots[slot.agl_id] = slot
        self._of.setdefault(rollout_id, []).append(slot)
        recovered = self.cursor.recovered(slot.agl_id)
        if recovered is not None:  # ended before a restart: same place in the cursor, same state
            slot.position, slot.state = recovered
        return slot

    def _move(self, slot: Slot, state: str, error: str | None = None) -> None:
        """A transition of the state machine (the store's change it follows is always one)."""
        if state not in VALID_TRANSITIONS[slot.state]:
            logger.warning(
                "agent lightning view: %s cannot go %s -> %s; ignored", slot.agl_id, slot.state, state
            )
            return
        slot.state = state
        slot.updated_at = time.time()
        slot.version += 1
        if error is not None:
            slot.error_message = error
        if state in TERMINAL_STATES:
            slot.position = self.cursor.append(slot.agl_id)
            self.store.journal_write(
                {"kind": "agl_terminal", "position": slot.position, "agl_id": slot.agl_id, "state": state}
            )

    def _changed(self, change: AttemptChange) -> None:
        slots = self._of.get(change.rollout_id)
        if slots is None:
            if change.kind == "queued":
                self._new_slot(change.rollout_id, 0)
            else:  # a rollout rebuilt from a journal, not seen yet: read as it is now
                self._sync_one(change.rollout_id)
            return
        current = slots[-1]
        if change.kind == "claimed":
            if current.state != "queuing":
                current = self._new_slot(change.rollout_id, len(slots))
            current.attempt_id, current.resources_id = change.attempt_id, change.resources_id
            self._move(current, "running")
        elif change.kind == "released" and current.state == "running":
            # the claim never reached an agent and is undone: not a transition, the attempt never was
            current.state, current.attempt_id, current.resources_id = "queuing", None, None
            current.updated_at, current.version = time.time(), current.version + 1
        elif change.kind == "ended":
            self._ended(change, slots)

    def _ended(self, change: AttemptChange, slots: list[Slot]) -> None:
        current = slots[-1]
        if change.state == "queued":  # retried: this attempt failed, the next one is a new rollout
            nxt = retry_id(change.rollout_id, len(slots))
            self._move(current, "failed", f"{change.error}; retried as {nxt}")
            self._new_slot(change.rollout_id, len(slots))
        elif change.state == "failed":
            if current.state not in TERMINAL_STATES:
                self._move(current, "failed", change.error)
        elif change.state == "completed":
            for slot in slots:
                if slot.state in TERMINAL_STATES:
                    continue
                if slot.attempt_id == change.attempt_id:
                    self._move(slot, "succeeded")
                else:
                    self._move(
                        slot, "failed", f"superseded: attempt {change.attempt_id}'s result was accepted"
                    )
        if change.state in TERMINAL and change.rollout_id in self._configs:
            self.retention.ended(change.rollout_id)  # dropped later, outside the store's method

    def _forgotten(self, rollout_ids: Sequence[str]) -> None:
        for rollout_id in rollout_ids:
            for slot in self._of.pop(rollout_id, ()):
                self._slots.pop(slot.agl_id, None)
                if slot.key is not None:
                    self._keys.pop(slot.key, None)
                if slot.position is not None:
                    self.cursor.clear(slot.position)
                self.budget.release(slot.events)
            self._configs.pop(rollout_id, None)
            self.retention.forget(rollout_id)

    def sync(self) -> None:
        """Take in every rollout the store holds that the view has not seen (a journal's, at start); drop the
        journaled cursor positions of rollouts the store no longer holds."""
        for rollout_id in self.store.rollout_ids():
            if rollout_id not in self._of:
                self._sync_one(rollout_id)
        self.cursor.drop_recovered()
        ended = [r for r in self._configs if self.store.knows(r) and self.store.state(r) in TERMINAL]
        last = {r: max((s.position or 0 for s in self._of.get(r, ())), default=0) for r in ended}
        for rollout_id in sorted(
            ended, key=last.__getitem__
        ):  # in the order they ended, as the retention keeps them
            self.retention.ended(rollout_id)

    def _sync_one(self, rollout_id: str) -> None:
        """A rollout's slots as its state says: its earlier attempts ended (failed, or as journaled), its last
        one queued, running or ended like the rollout."""
        store = self.store
        state = store.state(rollout_id)
        attempts = store.attempts(rollout_id)
        claims = int(store.task(rollout_id).num_claims or 0)
        count = max(1, claims + (1 if state == "queued" else 0))
        record = store.record(rollout_id) if state in TERMINAL else None
        for index in range(count):
            slot = self._new_slot(rollout_id, index)
            offset = index - (
                claims - len(attempts)
            )  # a finished rollout's journal keeps its last attempt only
            slot.attempt_id = attempts[offset] if 0 <= offset < len(attempts) else None
            if slot.position is not None:
                continue  # its end was journaled
            last = index == count - 1
            if not last:
                self._move(slot, "failed", "this attempt ended with a previous run of the daemon")
            elif state == "claimed":
                self._move(slot, "running")
            elif record is not None and record.state == "completed":
                self._move(slot, "running")
                self._move(slot, "succeeded" if record.attempt_id in (None, slot.attempt_id) else "failed")
            elif record is not None:
                self._move(slot, "failed", record.error)

    # ------------------------------------------------------------------ the journal
    def restore(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Take the cursor and the API's rollout configs back from a journal's records (before :meth:`sync`)."""
        records = list(records)
        self.cursor.restore(records)
        for r in records:
            if r.get("kind") == "agl_config":
                self._configs[str(r["rollout_id"])] = RolloutConfig.model_validate(r["config"])

    def live_records(self) -> Iterator[dict[str, Any]]:
        """What rebuilds the cursor and the configs (the journal's compaction keeps these)."""
        ended = ((s.position, s.agl_id, s.state) for s in self._slots.values() if s.position is not None)
        yield from self.cursor.records(ended)
        for rollout_id, config in self._configs.items():
            yield {"kind": "agl_config", "rollout_id": rollout_id, "config": config.model_dump(mode="json")}

    # ------------------------------------------------------------------ reading
    def slot(self, agl_id: str) -> Slot:
        """The rollout by its Agent Lightning id; :class:`NotFound` (404) when there is none."""
        slot = self._slots.get(agl_id)
        if slot is None and self.store.knows(agl_id) and agl_id not in self._of:
            self._sync_one(agl_id)  # taken in by the store without an announcement (a recovered group's)
            slot = self._slots.get(agl_id)
        if slot is None:
            raise NotFound(f"Rollout not found: {agl_id}")
        return slot

    def slot_of(self, rollout_id: str, attempt_id: str | None) -> Slot:
        """The Agent Lightning rollout of an aglverl attempt (the current one when ``attempt_id`` is None)."""
        slots = self._of.get(rollout_id)
        if slots is None:
            self._sync_one(rollout_id)
            slots = self._of[rollout_id]
        for slot in reversed(slots):
            if attempt_id is None or slot.attempt_id == attempt_id:
                return slot
        raise NotFound(f"no Agent Lightning rollout for attempt {attempt_id!r} of {rollout_id!r}")

    def runner_slot(self, rollout_id: str, attempt_id: str) -> Slot | None:
        """The rollout of an aglverl attempt whose agent aglverl's runner started (it has a key), else ``None``;
        a look-up only (nothing is taken in from the store)."""
        slot = next((s for s in self._of.get(rollout_id, ()) if s.attempt_id == attempt_id), None)
        return slot if slot is not None and slot.key is not None else None

    def config_of(self, rollout_id: str) -> RolloutConfig:
        return self._configs.get(rollout_id) or self.default_config

    def wire(self, slot: Slot) -> AglRollout:
        """The rollout as Agent Lightning's API shows it."""
        task = self.store.task(slot.rollout_id)
        metadata = dict(task.metadata or {})
        return AglRollout(
            rollout_id=slot.agl_id,
            input=task.input,
            is_train=_is_train(task.mode, metadata),
            config=self.config_of(slot.rollout_id),
            metadata=RolloutMetadata.model_validate(metadata)
            if _fits_metadata(metadata)
            else RolloutMetadata(),
            status=LifecycleStatus(
                state=slot.state,  # type: ignore[arg-type]
                k8s_job_name=slot.k8s_job_name,
                last_attempt_id=slot.last_attempt_id,
                error_message=slot.error_message,
                version=slot.version,
                created_at=slot.created_at,
                updated_at=slot.updated_at,
            ),
        )

    def listed(self, states: set[str], limit: int) -> list[AglRollout]:
        """``GET /api/rollouts``: rollouts in these states, oldest first, at most ``limit``."""
        out: list[AglRollout] = []
        for slot in self._slots.values():
            if len(out) >= limit:
                break
            if slot.state in states:
                out.append(self.wire(slot))
        return out

    def detail(self, agl_id: str) -> RolloutDetail:
        slot = self.slot(agl_id)
        return RolloutDetail(rollout=self.wire(slot), attempts=self._labels(slot))

    def _labels(self, slot: Slot) -> list[str]:
        """Attempt labels with events, by their first event's time."""
        firsts = {label: events[0].timestamp for label, events in slot.events.by_label.items() if events}
        calls = self._calls(slot)
        if calls:
            firsts[slot.label] = min(firsts.get(slot.label, math.inf), calls[0].started_at)
        return sorted(firsts, key=firsts.__getitem__)

    def terminal_page(self, after: int, limit: int) -> TerminalPage:
        """``GET /api/rollouts/terminal``: the cursor from ``after``, rollouts forgotten or deleted skipped. The
        page changes nothing but when the rollouts it lists may go (:meth:`_listed`): a second reader sees the
        same pages as the first, whatever ``after`` either sends."""
        after, limit = max(after, 0), max(limit, 1)
        self.evict()
        ids = self.cursor.page(after, limit)
        items = []
        for agl_id in ids:
            slot = self._slots.get(agl_id) if agl_id is not None else None
            if slot is None or not self.store.knows(slot.rollout_id):
                continue
            self._listed(slot)
            task = self.store.task(slot.rollout_id)
            items.append(
                TerminalItem(
                    rollout_id=agl_id,  # type: ignore[arg-type]
                    state=slot.state,  # type: ignore[arg-type]
                    data_id=_data_id(task.input, task.metadata),
                    is_train=_is_train(task.mode, task.metadata),
                )
            )
        return TerminalPage(items=items, next_after=after + len(ids), total_terminal=len(self.cursor))

    def _listed(self, slot: Slot) -> None:
        """A page listed the slot: once every attempt of an ended API rollout was listed, its grace starts."""
        slot.read = True
        rollout_id = slot.rollout_id
        if rollout_id in self.retention and all(
            s.read for s in self._of.get(rollout_id, ()) if s.position is not None
        ):
            self.retention.read(rollout_id)

    # ------------------------------------------------------------------ events
    def add_event(self, agl_id: str, label: str, event_type: str, data: dict[str, Any]) -> Event:
        """Append an event under an attempt label, in any state (Agent Lightning's algorithms post trace events
        on finished rollouts too), within the bounds (:class:`TooMany`, 413); its data is kept as JSON bytes.

        A ``reward`` event is refused for a rollout that has ended (:class:`Conflict`, 409: the reward it ended
        with stands), and when its value is a number not finite as float32 (:class:`BadReward`, 422: training
        keeps rewards as float32; the attempt then fails, naming the value). A refused event is not stored."""
        slot = self.slot(agl_id)
        if event_type == "reward":
            if slot.state in TERMINAL_STATES:
                raise Conflict(
                    f"rollout {agl_id} is {slot.state}: a reward posted after its end is refused and nothing "
                    "was changed (the reward it ended with stands)"
                )
            problem = reward_problem(data)
            if problem is not None:
                slot.refused_reward = f"{problem}; posted to rollout {agl_id}, the attempt fails"
                raise BadReward(slot.refused_reward)
        now = time.time()
        # a copy: the bytes orjson returns keep its whole write buffer (16 KiB for an event of 1 KiB, measured)
        kept = PostedEvent(event_type, now, memoryview(orjson.dumps(data)).tobytes())
        self.budget.add(slot.events, label, kept, where=f"rollout {agl_id}")
        return Event(event_type=event_type, rollout_id=agl_id, attempt_id=label, timestamp=now, data=data)

    # ------------------------------------------------------------------ the keys of aglverl's agents
    def grant_key(self, slot: Slot) -> str:
        """A new key for the agent process aglverl's runner starts for ``slot``: it opens that rollout's event and
        proxy paths and reads of it, nothing else; once a rollout has one, those paths need it (or the daemon's
        token)."""
        if slot.key is not None:
            self._keys.pop(slot.key, None)
        slot.key = secrets.token_urlsafe(24)
        self._keys[slot.key] = slot.agl_id
        return slot.key

    def revoke_key(self, slot: Slot) -> None:
        """The attempt's process is gone: its key opens nothing any more (its paths still need a key)."""
        if slot.key is not None:
            self._keys.pop(slot.key, None)

    def key_owner(self, key: str) -> str | None:
        """The Agent Lightning id whose agent holds ``key`` (a granted, unrevoked key), else ``None``."""
        return self._keys.get(key)

    def needs_key(self, agl_id: str) -> bool:
        """Whether the rollout's paths need its agent's key (aglverl's runner started an agent for it)."""
        slot = self._slots.get(agl_id)
        return slot is not None and slot.key is not None

    # ------------------------------------------------------------------ bounds
    def evict(self) -> int:
        """Drop the ended rollouts created through the API that :attr:`retention` says may go, from the store and
        the view; returns how many. (Rollouts the trainer queued go when it hands their step over.)"""
        gone = [r for r in self.retention.due() if self.store.knows(r) and self.store.state(r) in TERMINAL]
        if gone:
            self.store.forget(gone)  # the view follows (_forgotten)
        return len(gone)

    def _calls(self, slot: Slot) -> list[LLMCall]:
        if slot.attempt_id is None or not self.store.knows(slot.rollout_id):
            return []
        return self.store.calls_of(slot.rollout_id, slot.attempt_id)

    def events(self, agl_id: str, *, event_type: str | None = None, triplet: bool = False) -> list[Event]:
        """The events of the rollout's attempt label (the last a controller named, else ``"0"``): those posted,
        and one ``model_request`` per LLM call aglverl's proxy recorded for the attempt, in time order."""
        slot = self.slot(agl_id)
        label = slot.label
        events = [posted.wire(agl_id, label) for posted in slot.events.of(label)]
        events += model_request_events(agl_id, label, self._calls(slot))
        if not slot.events.of(label) and slot.state == "succeeded" and slot.attempt_id is not None:
            events += self._result_reward(slot, label)  # the agent's reward events went with a restart
        events.sort(key=lambda e: e.timestamp)
        if event_type is not None:
            events = [e for e in events if e.event_type == event_type]
        return triplet_events(events) if triplet else events

    def _result_reward(self, slot: Slot, label: str) -> list[Event]:
        record = self.store.record(slot.rollout_id) if self.store.knows(slot.rollout_id) else None
        if record is None or record.result is None or record.result.final_reward is None:
            return []
        data = {"value": record.result.final_reward, "source": "aglverl"}
        return [
            Event(
                event_type="reward",
                rollout_id=slot.agl_id,
                attempt_id=label,
                timestamp=slot.updated_at,
                data=data,
            )
        ]

    def reward(self, slot: Slot, label: str | None = None) -> float | None:
        """The value of the last valid ``reward`` event under ``label`` (default: the slot's)."""
        for event in reversed(slot.events.of(label or slot.label)):
            if event.event_type == "reward" and (value := reward_value(event.parsed())) is not None:
                return value
        return None

    # ------------------------------------------------------------------ changing
    def create(self, requests: Sequence[RolloutCreate]) -> list[AglRollout]:
        """``POST /api/rollouts``: queue each request in the store (an owner-less rollout with the latest
        resources); a request whose ``rollout_id`` exists gets that rollout back unchanged."""
        for request in requests:  # all or none: a refused id queues nothing
            if request.rollout_id is not None and request.rollout_id not in self._slots:
                check_rollout_id(request.rollout_id)
        out = []
        for request in requests:
            if request.rollout_id is not None and (
                request.rollout_id in self._slots or self.store.knows(request.rollout_id)
            ):
                out.append(self.wire(self.slot(request.rollout_id)))
                continue
            rollout_id = request.rollout_id or uuid.uuid4().hex
            metadata = request.metadata
            if isinstance(metadata, RolloutMetadata):
                metadata = metadata.model_dump()
            config = request.config or RolloutConfig()
            self._configs[rollout_id] = config
            self.store.journal_write(
                {"kind": "agl_config", "rollout_id": rollout_id, "config": config.model_dump(mode="json")}
            )
            self.store.enqueue(
                request.input,
                mode="train" if request.is_train else "val",
                resources_id=self.store.latest_resources_id,
                metadata=RolloutMetadata.model_validate(metadata or {}).model_dump(),
                rollout_id=rollout_id,
            )
            out.append(self.wire(self.slot(rollout_id)))
        self.evict()
        return out

    async def start(self, agl_id: str) -> Slot:
        """Make a ``queuing`` rollout ``running``: its aglverl attempt is claimed, with a lease of its config's
        ``timeout_seconds`` plus :data:`CONTROLLER_GRACE_SECONDS`. A ``running`` one is returned as it is;
        a finished one raises :class:`Conflict`."""
        slot = self.slot(agl_id)
        if slot.state == "queuing":
            timeout = float(self.config_of(slot.rollout_id).timeout_seconds)
            await self.store.claim_rollout(slot.rollout_id, lease_seconds=timeout + CONTROLLER_GRACE_SECONDS)
        if slot.state != "running":
            raise Conflict(f"Rollout {agl_id} is {slot.state}")
        return slot

    async def finish(
        self, slot: Slot, *, succeeded: bool, error: str | None = None, reward: float | None = None
    ) -> None:
        """End a ``running`` rollout's attempt: succeeded (with ``reward``, else its reward event's value, else
        ``reward_fillna_value``; with none of them the attempt fails) or failed with ``error``. A reward refused
        at its door (:meth:`add_event`), or one not finite as float32, fails it too, naming the value. A failed
        attempt is retried while the store's ``max_attempts`` allows (the retry is a new rollout)."""
        if slot.state != "running" or slot.attempt_id is None:
            raise Conflict(
                f"Rollout {slot.agl_id}: cannot transition {slot.state} -> "
                f"{'succeeded' if succeeded else 'failed'}"
            )
        if succeeded:
            error = slot.refused_reward or await self._succeed(slot, reward)
            if error is None:
                return
        failure = Rollout(
            rollout_id=slot.rollout_id,
            attempt_id=slot.attempt_id,
            status="failed",
            metadata={"error": error or "failed"},
        )
        await self.store.accept_result(failure)
        await self.store.commit()

    async def _succeed(self, slot: Slot, reward: float | None) -> str | None:
        """Post the attempt's result with its reward (see :meth:`finish`); else why it fails."""
        if reward is None:
            reward = self.reward(slot)
        if reward is None:
            reward = self.reward_fillna_value
        if reward is None:
            return (
                'the agent finished without a reward event (POST {"event_type": "reward", "data": '
                '{"value": <number>}} to its AGL_EVENT_URL; or set agentlightning.reward_fillna_value)'
            )
        try:
            reward = check_reward(reward, f"rollout {slot.agl_id}'s reward")
        except ValueError as exc:
            return str(exc)
        result = Rollout(rollout_id=slot.rollout_id, attempt_id=slot.attempt_id, final_reward=reward)
        await self.store.accept_result(result)
        await self.store.commit()
        return None

    async def patch(self, agl_id: str, patch: StatusPatch) -> AglRollout:
        """``PATCH /api/rollouts/{id}``: the state machine (409 otherwise), each transition done in the store."""
        slot = self.slot(agl_id)
        updates = patch.model_dump(exclude_unset=True)
        if not updates:
            return self.wire(slot)
        state = updates.pop("state", None)
        if state is not None and state not in VALID_TRANSITIONS[slot.state]:
            raise Conflict(f"Rollout {agl_id}: cannot transition {slot.state} -> {state}")
        if "last_attempt_id" in updates:
            slot.last_attempt_id = updates["last_attempt_id"]
        if "k8s_job_name" in updates:
            slot.k8s_job_name = updates["k8s_job_name"]
        version = slot.version
        if state == "running":
            await self.start(agl_id)
        elif state == "failed" and slot.state == "queuing":  # the controller could not start it at all
            self.store.fail(
                [slot.rollout_id],
                updates.get("error_message") or "failed before it started",
                termination="agent_error",
            )
        elif state in ("succeeded", "failed"):
            await self.finish(slot, succeeded=state == "succeeded", error=updates.get("error_message"))
        if "error_message" in updates and state is None:  # with a transition, the store's account of it
            slot.error_message = updates["error_message"]  # (which quotes the controller's) stands
        if slot.version == version:  # no transition happened (or none was asked): still one change
            slot.updated_at, slot.version = time.time(), slot.version + 1
        return self.wire(slot)

    def delete(self, agl_id: str) -> None:
        """``DELETE /api/rollouts/{id}`` (a missing id is not an error). A rollout created through this API (or
        any owner-less one) is ended and dropped from the store; a trainer's rollout is only dropped from this
        view once finished, and a running one is a :class:`Conflict` (its step needs it)."""
        slot = self._slots.get(agl_id)
        if slot is None:
            return
        rollout_id = slot.rollout_id
        if not self.store.knows(rollout_id):
            self._forgotten([rollout_id])
            return
        finished = self.store.state(rollout_id) in TERMINAL
        if self.store.owner(rollout_id) is not None:
            if not finished:
                raise Conflict(
                    f"Rollout {agl_id} belongs to a training step of this run; it cannot be deleted"
                )
            self._forgotten([rollout_id])
            return
        if not finished:
            self.store.fail(
                [rollout_id], "deleted through the Agent Lightning API", termination="agent_error"
            )
        self.store.forget([rollout_id])


# ---------------------------------------------------------------------------------------------- helpers
def _is_train(mode: str | None, metadata: Mapping[str, Any] | None) -> bool:
    if mode is not None:
        return mode == "train"
    return bool((metadata or {}).get("is_train", True))


def _data_id(value: Any, metadata: Mapping[str, Any] | None) -> str:
    """What Agent Lightning names a rollout's sample: ``input.data_id`` or ``input.instance_id``; aglverl's
    own rollouts name their GRPO group in ``metadata.data_id``."""
    if isinstance(value, Mapping) and (value.get("data_id") or value.get("instance_id")):
        return str(value.get("data_id") or value.get("instance_id"))
    return str((metadata or {}).get("data_id") or "")


def _fits_metadata(metadata: Mapping[str, Any]) -> bool:
    return all(
        metadata.get(k) is None or type(metadata.get(k)) is int for k in ("batch_idx", "sample_idx_in_batch")
    )
