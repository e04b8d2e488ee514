"""One rollout as the store holds it (:class:`Entry`) and the journal records that write it down and read it back.

The journal's record kinds for a rollout: ``task`` (queued: input, mode, resources, owner), ``attempt`` (a claim
started an attempt), ``result`` (the winning attempt's result and calls) and ``failed`` (the error, the
reason and the last attempt's calls); the store adds ``resources`` and ``forget`` records of its own. Pure
data: nothing here awaits or touches another rollout.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio

from ..models import Mode, Rollout, Task, TerminationReason
from .errors import AttemptLost, UnknownAttempt
from .records import TERMINAL, TRANSITIONS, AttemptEvent, LLMCall, RolloutRecord, RolloutState

__all__ = ["Entry", "Group"]


@dataclass(slots=True, eq=False)
class Group:
    """A wait for several rollouts' ends: ``event`` is set when the last of ``remaining`` is done."""

    remaining: int = 0
    event: anyio.Event = field(default_factory=anyio.Event)

    def one_done(self) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self.event.set()


@dataclass(slots=True, eq=False)
class Entry:
    """A rollout in the store: its task, attempts, lease, result or error, and the calls recorded for it."""

    rollout_id: str
    input: Any
    mode: Mode | None
    resources_id: str | None
    metadata: dict[str, Any]
    create_time: float
    owner: str | None
    state: RolloutState = "queued"
    attempts: list[str] = field(default_factory=list)
    num_claims: int = 0
    requeues: int = 0
    last_claim_time: float | None = None
    lease_deadline: float = math.inf
    result: Rollout | None = None
    result_attempt: str | None = None
    error: str | None = None
    termination: TerminationReason | None = None
    calls: dict[str, list[LLMCall]] = field(default_factory=dict)
    groups: list[Group] = field(default_factory=list)
    done: anyio.Event | None = None
    since: float = 0.0  # monotonic: when queued, then when last claimed (for the latency histograms)
    lost: set[str] | None = None  # attempts whose proxy shard died: void
    settling: bool = False  # finished, its kept attempt's records still being taken from its shard

    @property
    def attempt_id(self) -> str | None:
        return self.attempts[-1] if self.attempts else None

    def move(self, to: RolloutState, event: AttemptEvent) -> None:
        """Change the rollout's state to ``to``, announced to its attempt as ``event``: the one place a state is
        written. A change :data:`~aglverl.store.records.TRANSITIONS` does not list is a bug in the store: a
        ``RuntimeError`` naming it, with nothing changed."""
        if event not in TRANSITIONS.get((self.state, to), ()):
            raise RuntimeError(
                f"rollout {self.rollout_id!r}: no transition {self.state} -> {to} ({event}) in the store's table"
            )
        self.state = to

    def require_attempt(self, attempt_id: str | None) -> None:
        """Raise :class:`UnknownAttempt` unless ``attempt_id`` is one of this rollout's attempts."""
        if attempt_id is None or attempt_id not in self.attempts:
            if not self.attempts:
                raise UnknownAttempt(f"rollout {self.rollout_id!r} has not been claimed yet")
            raise UnknownAttempt(f"unknown attempt id {attempt_id!r} for rollout {self.rollout_id!r}")

    def refuse_lost(self, attempt_id: str) -> None:
        """Raise :class:`AttemptLost` when ``attempt_id`` is void (its proxy shard died)."""
        if self.lost and attempt_id in self.lost:
            raise AttemptLost(
                f"attempt {attempt_id!r} of rollout {self.rollout_id!r} is void: the proxy shard that recorded "
                f"its LLM calls died, so the rollout was handed out again; this was ignored"
            )

    def void(self, attempt_id: str) -> None:
        """Make ``attempt_id`` void (its proxy shard died): its calls are dropped, its later result refused."""
        if self.lost is None:
            self.lost = set()
        self.lost.add(attempt_id)
        self.calls.pop(attempt_id, None)

    def keep_taken(self, attempt_id: str, calls: Sequence[LLMCall]) -> None:
        """Keep calls of ``attempt_id`` taken from its proxy shard, unless the attempt is unknown or void, or the
        rollout finished keeping another attempt's calls (this take came too late)."""
        if self.state in TERMINAL and attempt_id not in self.calls:
            return
        if attempt_id in self.attempts and not (self.lost and attempt_id in self.lost):
            self.calls.setdefault(attempt_id, []).extend(calls)

    def is_resend(self, attempt_id: str, result: Rollout) -> bool:
        """Whether ``result`` is the completed rollout's winning result posted again by its attempt (how the
        attempt was named, or the task echoed, aside)."""
        if self.state != "completed" or attempt_id != self.result_attempt or self.result is None:
            return False
        ignore = {"attempt_id", "task"}
        return result.model_dump(exclude=ignore) == self.result.model_dump(exclude=ignore)

    def finish(
        self,
        state: Literal["completed", "failed"],
        *,
        result: Rollout | None,
        attempt_id: str | None,
        error: str | None,
        termination: TerminationReason | None,
    ) -> str | None:
        """End this rollout: a completed one keeps the calls of ``attempt_id`` (the winner), a failed one its last
        attempt's, unless void. Returns the attempt whose calls are kept (``None``: none)."""
        kept = attempt_id if state == "completed" else self.attempt_id
        if kept and self.lost and kept in self.lost:
            kept = None
        self.calls = {kept: self.calls.get(kept, [])} if kept else {}
        self.error = error
        self.termination = result.declared_termination if result is not None else termination
        self.move(state, "ended")
        self.result = result
        self.result_attempt = attempt_id
        self.lease_deadline = math.inf
        return kept

    def notify(self) -> None:
        """Tell whoever waits for this rollout's end (groups of rollouts, a single waiter) that it came."""
        for group in self.groups:
            group.one_done()
        self.groups.clear()
        if self.done is not None:
            self.done.set()

    def as_result(self) -> Rollout:
        """The finished rollout's result as an Agent Lightning server hands it out (a failure as a failed one)."""
        if self.result is not None:
            return self.result
        return Rollout(rollout_id=self.rollout_id, status="failed", metadata={"error": self.error})

    def task(self) -> Task:
        return Task(
            rollout_id=self.rollout_id,
            input=self.input,
            mode=self.mode,
            resources_id=self.resources_id,
            create_time=self.create_time,
            last_claim_time=self.last_claim_time,
            num_claims=self.num_claims,
            metadata=self.metadata,
            attempt_id=self.attempt_id,
        )

    def snapshot(self) -> RolloutRecord:
        """The rollout as a trainer reads it; a finished one holds the calls of one attempt only (the winner's,
        or a failed rollout's last), in the order they were made."""
        calls = next(iter(self.calls.values()), []) if self.state in TERMINAL else []
        return RolloutRecord(
            rollout_id=self.rollout_id,
            state=self.state,
            input=self.input,
            metadata=self.metadata,
            num_claims=self.num_claims,
            requeues=self.requeues,
            result=self.result,
            attempt_id=self.result_attempt,
            calls=sorted(calls, key=lambda c: (c.seq, c.choice_index)),
            error=self.error,
            termination=self.termination,
        )

    @classmethod
    def adopted(cls, record: RolloutRecord, *, resources_id: str | None, owner: str | None) -> Entry:
        """A finished rollout of a previous run, from its record: its attempt is the record's (or its calls')."""
        attempt_id = record.attempt_id or (record.calls[0].attempt_id if record.calls else None)
        return cls(
            rollout_id=record.rollout_id,
            input=record.input,
            mode=None,
            resources_id=resources_id,
            metadata=dict(record.metadata),
            create_time=time.time(),
            owner=owner,
            state=record.state,
            attempts=[attempt_id] if attempt_id else [],
            num_claims=record.num_claims,
            requeues=record.requeues,
            result=record.result,
            result_attempt=record.attempt_id,
            error=record.error,
            termination=record.termination,
            calls={attempt_id: list(record.calls)} if attempt_id else {},
        )

    # ------------------------------------------------------------------ journal records
    def task_record(self) -> dict[str, Any]:
        return {
            "kind": "task",
            "rollout_id": self.rollout_id,
            "input": self.input,
            "mode": self.mode,
            "resources_id": self.resources_id,
            "metadata": self.metadata,
            "owner": self.owner,
            "create_time": self.create_time,
        }

    def attempt_record(self, attempt_id: str) -> dict[str, Any]:
        return {"kind": "attempt", "rollout_id": self.rollout_id, "attempt_id": attempt_id}

    def result_record(self, attempt_id: str, result: Rollout) -> dict[str, Any]:
        return {
            "kind": "result",
            "rollout_id": self.rollout_id,
            "attempt_id": attempt_id,
            "result": result.model_dump(mode="json"),
            "calls": self.calls.get(attempt_id, []),
        }

    def failed_record(self) -> dict[str, Any]:
        attempt_id = next(iter(self.calls), None)
        return {
            "kind": "failed",
            "rollout_id": self.rollout_id,
            "error": self.error,
            "termination": self.termination,
            "attempt_id": attempt_id,
            "calls": self.calls.get(attempt_id, []) if attempt_id else [],
        }

    def records(self) -> Iterator[dict[str, Any]]:
        """The records that rebuild this rollout as it is now (for a compacted journal)."""
        yield self.task_record()
        for attempt_id in self.attempts:
            yield self.attempt_record(attempt_id)
        if self.state == "completed" and self.result is not None:
            yield self.result_record(self.result_attempt or "", self.result)
        elif self.state == "failed":
            yield self.failed_record()

    @classmethod
    def from_task_record(cls, r: Mapping[str, Any], since: float) -> Entry:
        """A queued rollout from its ``task`` record (``since``: the monotonic time it counts as queued from)."""
        return cls(
            rollout_id=r["rollout_id"],
            input=r["input"],
            mode=r["mode"],
            resources_id=r["resources_id"],
            metadata=r["metadata"],
            create_time=r["create_time"],
            owner=r["owner"],
            since=since,
        )

    def apply(self, r: Mapping[str, Any]) -> None:
        """Replay one of this rollout's ``attempt``, ``result`` or ``failed`` records; other kinds are skipped."""
        kind = r.get("kind")
        if kind == "attempt":
            self.attempts.append(r["attempt_id"])
            self.num_claims += 1
        elif kind == "result":
            self.calls = {r["attempt_id"]: [LLMCall(**c) for c in r["calls"]]}
            self.move("completed", "ended")
            self.result_attempt = r["attempt_id"]
            self.result = Rollout.model_validate(r["result"])
            self.termination = self.result.declared_termination
        elif kind == "failed":
            self.move("failed", "ended")
            self.error = r["error"]
            # Journals written before reasons were recorded only ever failed for these two causes; which one
            # is lost, and an agent error is the one a trainer masks by default too.
            self.termination = r.get("termination") or "agent_error"
            attempt_id = r.get("attempt_id")
            self.calls = {attempt_id: [LLMCall(**c) for c in r.get("calls", ())]} if attempt_id else {}
