"""What the store refuses: one exception per reason, each carrying the HTTP status the task server answers with.

Raising one of these never changes the store: every check happens before the first change.
"""

from __future__ import annotations

__all__ = [
    "AlreadyFinished",
    "AttemptLost",
    "InvalidResult",
    "NotQueued",
    "StepEnded",
    "StoreClosed",
    "StoreError",
    "UnknownAttempt",
    "UnknownRollout",
]


class StoreError(Exception):
    """A request the store refuses; ``status`` is the HTTP status the server answers with."""

    status = 400


class UnknownRollout(StoreError):
    status = 404


class UnknownAttempt(StoreError):
    status = 404


class StepEnded(StoreError):
    """The rollout's step already ended and its results were handed over; nothing can change it now."""

    status = 409


class AlreadyFinished(StoreError):
    """A different result for a rollout that already finished: ignored (an identical resend is acknowledged)."""

    status = 409


class InvalidResult(StoreError):
    status = 422


class AttemptLost(StoreError):
    """The attempt is void: the proxy shard that recorded its calls died (its rollout was retried)."""

    status = 409


class StoreClosed(StoreError):
    status = 503


class NotQueued(StoreError):
    """A rollout asked for by id (:meth:`TaskStore.claim_rollout`) is not waiting in the queue."""

    status = 409
