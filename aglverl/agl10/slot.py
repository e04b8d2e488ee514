"""One Agent Lightning rollout as the view keeps it (:class:`Slot`: attempt ``k`` of an aglverl rollout), and the
ids: the retries' (:func:`retry_id`) and the ones a caller may choose (:func:`check_rollout_id`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import quote

from .errors import InvalidId
from .events import RolloutEvents
from .wire import DEFAULT_ATTEMPT_ID

__all__ = ["ROLLOUT_ID_MAX", "Slot", "check_rollout_id", "retry_id"]

#: The longest rollout id a caller may choose.
ROLLOUT_ID_MAX = 128

_ROLLOUT_ID = re.compile(rf"[A-Za-z0-9_~][A-Za-z0-9._~-]{{0,{ROLLOUT_ID_MAX - 1}}}")
_RETRY_FORM = re.compile(r"-retry-[0-9]+$")


def retry_id(rollout_id: str, index: int) -> str:
    """The Agent Lightning rollout id of attempt ``index + 1`` of aglverl rollout ``rollout_id``."""
    return rollout_id if index == 0 else f"{rollout_id}-retry-{index}"


def check_rollout_id(rollout_id: str) -> str:
    """A rollout id a caller chose, as it may be: 1 to :data:`ROLLOUT_ID_MAX` characters, URL-safe (letters,
    digits, ``.``, ``_``, ``~``, ``-``: no ``/``, no space, nothing to escape), not starting with ``.`` or ``-``,
    and not of the form ``<id>-retry-<k>`` that aglverl's retries take. :class:`InvalidId` (422) otherwise."""
    if not _ROLLOUT_ID.fullmatch(rollout_id):
        raise InvalidId(
            f"rollout_id {rollout_id[:200]!r} is not allowed: it must be 1-{ROLLOUT_ID_MAX} characters of letters, "
            "digits, '.', '_', '~' and '-', not starting with '.' or '-' (it names URLs and files)"
        )
    if _RETRY_FORM.search(rollout_id):
        raise InvalidId(
            f"rollout_id {rollout_id!r} is not allowed: ids ending in '-retry-<k>' are aglverl's retries' "
            "(attempt k+1 of rollout R is R-retry-k)"
        )
    return rollout_id


@dataclass(slots=True, eq=False)
class Slot:
    """One Agent Lightning rollout: attempt ``index + 1`` of aglverl rollout ``rollout_id``."""

    agl_id: str
    rollout_id: str
    index: int
    created_at: float
    updated_at: float
    state: str = "queuing"
    version: int = 1
    attempt_id: str | None = None  # aglverl's, once claimed
    resources_id: str | None = None  # what the claimed attempt's task names (its proxy shard's, with shards)
    last_attempt_id: str | None = None
    k8s_job_name: str | None = None
    error_message: str | None = None
    position: int | None = None  # in the terminal cursor, once terminal
    read: bool = False  # a page of the terminal cursor has listed it
    events: RolloutEvents = field(default_factory=RolloutEvents)  # those agents posted
    #: Why a reward event of this attempt was refused (its value was not finite as float32): the attempt fails.
    refused_reward: str | None = None
    #: The key of the agent process aglverl's runner started for it (its event and proxy paths need it).
    key: str | None = None

    @property
    def label(self) -> str:
        """The attempt label whose events count: the last one a controller named, else ``"0"``."""
        return self.last_attempt_id or DEFAULT_ATTEMPT_ID

    @property
    def url_id(self) -> str:
        """The id as a URL path segment (escaped: ids journaled before ids were checked may need it)."""
        return quote(self.agl_id, safe="")
