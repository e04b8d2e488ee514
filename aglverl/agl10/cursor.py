"""Agent Lightning's terminal cursor (:class:`TerminalCursor`) and how long the rollouts created through its API
are kept once they ended (:class:`Retention`)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import islice
from typing import Any

__all__ = ["MAX_FINISHED_ROLLOUTS", "TERMINAL_GRACE_SECONDS", "Retention", "TerminalCursor"]

#: Ended rollouts created through ``POST /api/rollouts`` that are kept (the oldest dropped first past it).
MAX_FINISHED_ROLLOUTS = 10_000

#: How long an ended rollout created through the API is kept after a page of the cursor last listed it: time for
#: its reader (and any other) to fetch its events, and to read the page again after a failed request.
TERMINAL_GRACE_SECONDS = 300.0


class TerminalCursor:
    """The ids of rollouts in the order they ended, append-only: ``GET /api/rollouts/terminal?after=N`` reads
    from position ``N``. A forgotten rollout keeps its position (``None`` there), so every ``next_after`` a
    reader holds stays valid. With a journal the positions survive a restart (:meth:`restore`, :meth:`records`):
    those read back wait in :meth:`recovered` until the view meets their rollout again."""

    def __init__(self) -> None:
        self._ids: list[str | None] = []
        self._recovered: dict[str, tuple[int, str]] = {}  # journaled positions not yet matched to a slot

    def __len__(self) -> int:
        return len(self._ids)

    def append(self, agl_id: str) -> int:
        """Add a rollout that has just ended; returns its position."""
        self._ids.append(agl_id)
        return len(self._ids) - 1

    def clear(self, position: int) -> None:
        """The rollout at ``position`` is gone: it is skipped from now on, its position stays taken."""
        self._ids[position] = None

    def page(self, after: int, limit: int) -> list[str | None]:
        """The ids at positions ``after`` to ``after + limit`` (``None`` where a rollout is gone)."""
        return self._ids[after : after + limit]

    def recovered(self, agl_id: str) -> tuple[int, str] | None:
        """The journaled position and state of a rollout that ended before a restart (taken: asked once)."""
        return self._recovered.pop(agl_id, None)

    def drop_recovered(self) -> None:
        """Forget the journaled positions no rollout has claimed (their rollouts are no longer held)."""
        for position, _ in self._recovered.values():
            self._ids[position] = None
        self._recovered.clear()

    def restore(self, records: Iterable[Mapping[str, Any]]) -> None:
        """The positions from a journal's records (``agl_terminal``, ``agl_cursor``; others are skipped)."""
        total = 0
        for r in records:
            kind = r.get("kind")
            if kind == "agl_terminal":
                position = int(r["position"])
                self._recovered[str(r["agl_id"])] = (position, str(r["state"]))
                total = max(total, position + 1)
            elif kind == "agl_cursor":
                total = max(total, int(r["total"]))
        self._ids = [None] * total
        for agl_id, (position, _) in self._recovered.items():
            self._ids[position] = agl_id

    def records(self, ended: Iterable[tuple[int, str, str]]) -> Iterator[dict[str, Any]]:
        """What rebuilds the cursor: its length, the ``(position, id, state)`` of the rollouts held that ended,
        and the positions read back from the journal that no rollout has claimed yet (the journal is compacted
        when it opens, before they are matched: without them a second restart would lose them)."""
        yield {"kind": "agl_cursor", "total": len(self._ids)}
        for position, agl_id, state in ended:
            yield {"kind": "agl_terminal", "position": position, "agl_id": agl_id, "state": state}
        for agl_id, (position, state) in self._recovered.items():
            yield {"kind": "agl_terminal", "position": position, "agl_id": agl_id, "state": state}


class Retention:
    """Which ended rollouts created through the API may be dropped (a trainer's go when it has their step).

    Reading never deletes: a rollout goes when a caller acknowledges it (``DELETE``, not here), once
    ``grace_seconds`` have passed since a page of the cursor last listed it (every attempt it had, the cursor
    having passed it: what ``after`` a caller sends decides nothing), or, past ``limit`` ended ones, the oldest
    first, read or not. ``clock``: seconds, monotonic.
    """

    def __init__(
        self, *, limit: int, grace_seconds: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limit = limit
        self.grace_seconds = grace_seconds
        self._clock = clock
        self._ended: OrderedDict[str, None] = OrderedDict()  # in the order they ended
        self._read: OrderedDict[str, float] = OrderedDict()  # listed in full, by when they last were

    def __contains__(self, rollout_id: str) -> bool:
        return rollout_id in self._ended

    def ended(self, rollout_id: str) -> None:
        """An API rollout has ended (again: its place stays)."""
        self._ended.setdefault(rollout_id, None)

    def read(self, rollout_id: str) -> None:
        """A page of the cursor has just listed the ended rollout in full: its grace starts again."""
        if rollout_id in self._ended:
            self._read[rollout_id] = self._clock()
            self._read.move_to_end(rollout_id)

    def forget(self, rollout_id: str) -> None:
        self._ended.pop(rollout_id, None)
        self._read.pop(rollout_id, None)

    def due(self) -> list[str]:
        """The rollouts to drop now: the oldest past :attr:`limit`, and those whose grace has passed."""
        over = len(self._ended) - self.limit
        gone = dict.fromkeys(islice(self._ended, max(over, 0)))
        now = self._clock()
        for rollout_id, when in self._read.items():
            if now - when < self.grace_seconds:
                break  # in the order they were read: the ones after it were read later
            gone[rollout_id] = None
        return list(gone)
