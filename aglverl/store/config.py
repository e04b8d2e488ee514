"""The store's settings, one frozen value (:class:`StoreConfig`) handed whole to :class:`~aglverl.store.tasks.TaskStore`.

Nothing here awaits or does I/O; a value out of range raises ``ValueError`` at construction, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

__all__ = ["StoreConfig", "StoreSettings"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreConfig:
    """How the store treats claims and results.

    ``lease_seconds``: how long a claim lasts without a heartbeat (> 0); ``max_attempts``: how many claims a
    rollout gets before it fails (>= 1); ``vocab_size`` (when known): posted token ids must be below it, and
    proxy shards bound the ids they record by it.
    """

    lease_seconds: float = 600.0
    max_attempts: int = 3
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if not self.lease_seconds > 0 or self.max_attempts < 1:
            raise ValueError("lease_seconds must be > 0 and max_attempts >= 1")


class StoreSettings(TypedDict, total=False):
    """:class:`StoreConfig`'s fields as keywords (``TaskStore(lease_seconds=...)``)."""

    lease_seconds: float
    max_attempts: int
    vocab_size: int | None
