"""Agents parked in a long-poll (:class:`Waiters`): a queued task goes straight to the one that has waited
longest, and a task handed to a waiter that is going away is given back, never lost.

Single loop, no locks; only :meth:`Waiters.park` awaits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import anyio.lowlevel

from ..models import Task

__all__ = ["Waiters"]


@dataclass(slots=True, eq=False)
class _Waiter:
    event: anyio.Event = field(default_factory=anyio.Event)
    task: Task | None = None


class Waiters:
    """The parked agents, oldest first (an insertion-ordered set: O(1) to add, take the oldest, or remove)."""

    def __init__(self) -> None:
        self._parked: dict[_Waiter, None] = {}

    def __len__(self) -> int:
        return len(self._parked)

    def hand_out(self, available: Callable[[], int], claim_next: Callable[[], Task | None]) -> None:
        """While tasks are ``available()``, give the oldest waiter the task ``claim_next()`` claims for it."""
        while self._parked and available():
            waiter = next(iter(self._parked))
            del self._parked[waiter]
            waiter.task = claim_next()
            waiter.event.set()

    async def park(self, wait: float, give_back: Callable[[Task], object]) -> Task | None:
        """Wait up to ``wait`` seconds to be handed a task; ``None`` if none came (or :meth:`close` was called).

        Cancellation: a task handed to this waiter in the same loop turn as it was cancelled is not returned
        (its caller is going away): ``give_back(task)`` puts it back, and the cancellation goes on.
        """
        waiter = _Waiter()
        self._parked[waiter] = None
        delivered = False
        try:
            with anyio.move_on_after(wait):
                await waiter.event.wait()
            await anyio.lowlevel.checkpoint_if_cancelled()
            delivered = True
            return waiter.task
        finally:
            self._parked.pop(waiter, None)
            if not delivered and waiter.task is not None:
                give_back(waiter.task)

    def close(self) -> None:
        """Wake every parked agent with no task."""
        for waiter in self._parked:
            waiter.event.set()
        self._parked.clear()
