"""What Agent Lightning's API refuses: one :class:`~aglverl.store.StoreError` per reason, each carrying the HTTP
status its routes answer with (``{"detail": message}``). Raising one never changes anything: every check happens
before the first change."""

from __future__ import annotations

from ..store import StoreError

__all__ = ["BadReward", "Conflict", "InvalidId", "NotFound", "TooMany"]


class NotFound(StoreError):
    status = 404


class InvalidId(StoreError):
    """A rollout id a caller chose that aglverl refuses (see :func:`~aglverl.agl10.slot.check_rollout_id`)."""

    status = 422


class BadReward(StoreError):
    """A reward event whose value training cannot use: a number not finite as float32 (the attempt fails)."""

    status = 422


class TooMany(StoreError):
    """An event past one of the bounds on events (per rollout: a count and bytes; bytes of all rollouts)."""

    status = 413


class Conflict(StoreError):
    """A transition the state machine does not allow, a change to a rollout that is not this API's, or a reward
    for a rollout that has ended."""

    status = 409
