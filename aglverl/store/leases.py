"""The claims' lease deadlines: each claimed rollout's (``Entry.lease_deadline``, set by :meth:`Leases.set`), a heap
of ``(deadline, seq, rollout_id, attempt_id)`` to find the next one due, a clock that a trainer can stop
(:meth:`Leases.freeze`), and the reaper's wait for the earliest deadline (:meth:`Leases.wait_due`).

The heap may hold stale entries (a lease extended by a heartbeat, a claim that finished): an entry is current
while it is its rollout's claim's deadline (:meth:`Leases.expired` skips the others), and the stale ones are
dropped once they outnumber the live claims. Single loop, no locks; only :meth:`Leases.wait_due` awaits.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Iterator, Mapping

import anyio

from .entry import Entry

__all__ = ["LeaseItem", "Leases"]

#: Stale heap entries tolerated (beyond twice the live claims) before the heap is rebuilt.
_SLACK = 4096

#: ``(deadline, seq, rollout_id, attempt_id)``; ``seq`` keeps equal deadlines in push order.
LeaseItem = tuple[float, int, str, str]


class Leases:
    """Lease deadlines (monotonic seconds) of the claims of the rollouts in ``entries`` (the store's own
    mapping), and the clock they count on."""

    def __init__(self, entries: Mapping[str, Entry]) -> None:
        self._entries = entries
        self._heap: list[LeaseItem] = []
        self._seq = 0
        self._rearm = anyio.Event()
        self._frozen_at: float | None = None  # monotonic: since when the clock is stopped

    def __len__(self) -> int:
        """Deadlines in the heap: the live claims' and stale ones not yet dropped (bounded, see ``push``)."""
        return len(self._heap)

    def now(self) -> float:
        """What a lease counts from: now, or, while frozen, the moment the clock stopped (a lease started or
        renewed during a freeze counts from the freeze, so a thaw gives it exactly its length)."""
        return time.monotonic() if self._frozen_at is None else self._frozen_at

    def set(self, entry: Entry, deadline: float, *, live: int) -> None:
        """Make ``deadline`` the claimed rollout's lease (its current attempt's); wake the reaper when it is the
        earliest. ``live``: the claims running now (past twice as many stale heap entries, they are dropped)."""
        entry.lease_deadline = deadline
        self._seq += 1
        if len(self._heap) > 2 * live + _SLACK:
            self._heap = [item for item in self._heap if self._current(item)]
            heapq.heapify(self._heap)
        earliest = self._heap[0][0] if self._heap else math.inf
        heapq.heappush(self._heap, (deadline, self._seq, entry.rollout_id, entry.attempt_id or ""))
        if deadline < earliest:
            self._rearm.set()

    def _current(self, item: LeaseItem) -> bool:
        """Whether a heap entry is still its claim's deadline (not finished, superseded or extended)."""
        entry = self._entries.get(item[2])
        return (
            entry is not None
            and entry.state == "claimed"
            and entry.attempt_id == item[3]
            and entry.lease_deadline == item[0]
        )

    def expired(self, now: float) -> Iterator[Entry]:
        """The claimed rollouts whose lease ran out at or before ``now`` (none while frozen), earliest first."""
        for item in self._due(now):
            if self._current(item):
                yield self._entries[item[2]]

    def _due(self, now: float) -> Iterator[LeaseItem]:
        """Pop the entries whose deadline is at or before ``now`` (none while frozen), earliest first."""
        if self._frozen_at is not None:
            return
        while self._heap and self._heap[0][0] <= now:
            yield heapq.heappop(self._heap)

    async def wait_due(self) -> None:
        """Sleep until the earliest deadline, or until an earlier one is pushed or the clock thaws (then return
        at once: the caller looks at :meth:`due` and waits again). Never ticks on a fixed period."""
        self._rearm = anyio.Event()
        frozen = self._frozen_at is not None  # no lease expires: wait for thaw
        delay = self._heap[0][0] - time.monotonic() if self._heap and not frozen else math.inf
        if delay > 0:
            with anyio.move_on_after(delay):
                await self._rearm.wait()

    def freeze(self) -> None:
        """Stop the clock (idempotent)."""
        if self._frozen_at is None:
            self._frozen_at = time.monotonic()

    def thaw(self, *, live: int) -> float:
        """Restart the clock; returns how long it was stopped (0 if it was running). Every claimed lease keeps
        the time it had left when the clock stopped (``live``: the claims running now)."""
        if self._frozen_at is None:
            return 0.0
        frozen = time.monotonic() - self._frozen_at
        self._frozen_at = None
        self._rearm.set()
        for entry in self._entries.values():
            if entry.state == "claimed" and math.isfinite(entry.lease_deadline):
                self.set(entry, entry.lease_deadline + frozen, live=live)
        return frozen

    @property
    def frozen(self) -> bool:
        return self._frozen_at is not None
