"""What the store calls out to, as protocols: its write-ahead journal (:class:`Journal`, implemented by
:class:`aglverl.store.journal.Journal`) and, with proxy shards, where attempts are admitted and their calls
recorded (:class:`AttemptPinning`, implemented by :class:`aglverl.proxy.shards.ProxyShards`). Both are called
on the store's loop.

With proxy shards (:attr:`TaskStore.pinning <aglverl.store.tasks.TaskStore.pinning>`) the calls of an attempt are
admitted and recorded in another process. Then a claim pins the attempt to a shard (the task's
``resources_id`` names that shard's copy of its resources) and :meth:`TaskStore.claim` returns the task once the
shard admits the attempt; :meth:`TaskStore.accept_result` takes the attempt's records from its shard before the
result is accepted; a rollout that fails keeps its last attempt's records, taken before its waiters hear of it;
an attempt whose shard died is void (:meth:`TaskStore.attempts_lost`: retried as after a lease expiry, its late
result refused with :class:`~aglverl.store.errors.AttemptLost`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from ..models import ResourcesUpdate
from .records import LLMCall

__all__ = ["AttemptPinning", "Journal"]


class Journal(Protocol):
    """Where accepted state changes are appended before they are acknowledged
    (:class:`aglverl.store.journal.Journal`)."""

    def write(self, record: Mapping[str, Any]) -> None: ...

    def maybe_compact(self) -> None: ...

    async def commit(self) -> None: ...


class AttemptPinning(Protocol):
    """Where attempts' calls are admitted and recorded when that is not in this process (proxy shards,
    :class:`aglverl.proxy.shards.ProxyShards`). Called on the store's loop."""

    def pin(self, rollout_id: str, attempt_id: str, resources_id: str | None) -> str | None:
        """Pin a new attempt to a shard (its admission is sent); return the resources id its task names."""
        ...

    async def admitted(self, rollout_id: str, attempt_id: str) -> bool:
        """Return once the attempt's shard admits it: ``True``, or ``False`` when that shard died first."""
        ...

    def unpin(self, rollout_id: str, attempt_ids: Iterable[str]) -> None:
        """The attempts ended: revoke them (their records not taken are dropped)."""
        ...

    async def take(self, rollout_id: str, attempt_id: str) -> list[LLMCall] | None:
        """The records of the attempt's calls so far (``None``: not pinned here); raises :class:`AttemptLost`
        when its shard died (after :meth:`TaskStore.attempts_lost` voided it)."""
        ...

    def resources(self, resources_id: str) -> ResourcesUpdate | None:
        """A shard's copy of a resources version, by the id :meth:`pin` gave (``None``: not one)."""
        ...
