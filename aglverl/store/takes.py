"""Taking attempts' recorded calls from their proxy shards into the store's rollouts, one take per attempt.

With proxy shards (:class:`~aglverl.store.ports.AttemptPinning`) an attempt's LLM calls are recorded in the
shard's process; the store takes them when the attempt's result comes in, or when its rollout failed
(:meth:`Takes.settle`). :class:`Takes` asks the shard once per attempt: a take of an attempt already being taken
waits for that one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import anyio

from .entry import Entry
from .errors import AttemptLost
from .ports import AttemptPinning

logger = logging.getLogger(__name__)

__all__ = ["Takes"]


class Takes:
    """The takes under way, per ``(rollout_id, attempt_id)``; the calls taken go to the rollout in ``entries``
    (the store's own mapping, read when a take ends)."""

    def __init__(self, entries: Mapping[str, Entry]) -> None:
        self._entries = entries
        self._pending: dict[tuple[str, str], anyio.Event] = {}

    async def take(self, pinning: AttemptPinning, rollout_id: str, attempt_id: str) -> None:
        """Move the attempt's records from its shard into its rollout (see :meth:`Entry.keep_taken`), or wait
        for the take of it under way. The round trip is shielded from cancellation: records the shard has
        handed over are never dropped on the way. Raises what ``pinning.take`` raises (e.g.
        :class:`~aglverl.store.errors.AttemptLost` when the shard died); a waiter returns without error then.
        """
        key = (rollout_id, attempt_id)
        pending = self._pending.get(key)
        if pending is not None:
            await pending.wait()
            return
        done = self._pending[key] = anyio.Event()
        try:
            with anyio.CancelScope(shield=True):
                calls = await pinning.take(rollout_id, attempt_id)
            entry = self._entries.get(rollout_id)
            if calls and entry is not None:
                entry.keep_taken(attempt_id, calls)
        finally:
            del self._pending[key]
            done.set()

    async def settle(
        self,
        pinning: AttemptPinning,
        entry: Entry,
        kept: str,
        journal: Callable[[Mapping[str, Any]], None],
    ) -> None:
        """A failed rollout's last attempt (``kept``): its records taken from its shard (none, whatever the take
        ran into: the rollout stays failed), its pins dropped, its end journaled; then its waiters hear of it.
        Run in the store's task group, which cancels it only when the store stops."""
        try:
            await self.take(pinning, entry.rollout_id, kept)
        except AttemptLost:
            entry.calls = {}
        except Exception:
            logger.exception(
                "the records of failed rollout %s could not be taken from its shard", entry.rollout_id
            )
            entry.calls = {}
        finally:
            entry.settling = False
            if entry.lost and kept in entry.lost:
                entry.calls = {}
            pinning.unpin(entry.rollout_id, entry.attempts)
            journal(entry.failed_record())
            entry.notify()
