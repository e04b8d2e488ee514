"""What the store keeps and hands out: the proxy's record of one LLM call (:class:`LLMCall`) and a rollout's
snapshot as a trainer reads it (:class:`RolloutRecord`). Plain data, no behaviour beyond a few derived fields."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..models import Rollout, TerminationReason
from .errors import InvalidResult

__all__ = [
    "TERMINAL",
    "TRANSITIONS",
    "AttemptChange",
    "AttemptEvent",
    "LLMCall",
    "RolloutRecord",
    "RolloutState",
    "check_token_ids",
]

#: Where a rollout is in its life (see :mod:`aglverl.store.tasks`).
RolloutState = Literal["queued", "claimed", "completed", "failed"]
#: The states a rollout never leaves.
TERMINAL: frozenset[str] = frozenset({"completed", "failed"})
#: What happens to an attempt when its rollout changes state (:attr:`AttemptChange.kind`).
AttemptEvent = Literal["queued", "claimed", "released", "ended"]
#: Every change of a rollout's state the store makes, and the attempt events that may announce it: the one
#: table :meth:`Entry.move <aglverl.store.entry.Entry.move>`, the only place a state is written, checks. A
#: rollout is created ``queued`` (announced ``queued``); a claim starts an attempt; a claimed rollout goes back
#: to the queue when its claim is undone before the task reached an agent (``released``: no attempt used) or its
#: attempt failed and it is retried (``ended``); it finishes from the queue too (a step's deadline, or the result
#: of an earlier attempt arriving after a requeue). A finished rollout never changes again.
TRANSITIONS: Mapping[tuple[RolloutState, RolloutState], frozenset[AttemptEvent]] = {
    ("queued", "claimed"): frozenset({"claimed"}),
    ("claimed", "queued"): frozenset({"released", "ended"}),
    ("claimed", "completed"): frozenset({"ended"}),
    ("claimed", "failed"): frozenset({"ended"}),
    ("queued", "completed"): frozenset({"ended"}),
    ("queued", "failed"): frozenset({"ended"}),
}


@dataclass(slots=True)
class LLMCall:
    """One LLM call (one choice of it) recorded by the proxy under a rollout attempt.

    ``prompt_token_ids``/``response_token_ids`` are exactly what the backend returned; ``None`` when the
    backend sent none (the call is kept and counted, never given invented ids). ``logprobs`` are the engine's,
    one per response id, or ``None``. ``limit`` is the limit that ended the response, as the proxy decided
    it: ``"max_tokens"`` (the engine stopped at the request's ``max_tokens``), ``"context"`` (the backend
    refused the prompt as too long, or stopped at its context window); ``None`` when the model ended the
    response itself or the call failed for another reason. ``sampling`` holds the sampling parameters the call
    was made with after the proxy filled in the trainer's (``None``: the proxy did not check them);
    ``off_policy`` is true when the agent set different ones and the proxy kept the call (its row must not
    train). ``weight_version`` is the version of the weights the response's first token was generated under,
    ``weight_version_end`` that of its last token: they differ when a backend aborted the generation for a
    weight update and the proxy continued it under the new weights. Both are the backend's own report
    (``X-Weight-Version``) when it sends one, else the proxy's version when the call (or its continuation) was
    sent. ``weight_version_end`` left ``None`` (records journaled before it existed) becomes
    ``weight_version``. ``response_id`` is the answer's ``id`` as the agent got it (the backend's
    ``chatcmpl-...``, or the ``resp_...`` / ``msg_...`` of a translated API; every choice of a call has its
    call's; ``None``: the answer had none): what an agent's trace names the call by.
    """

    rollout_id: str | None
    attempt_id: str | None
    seq: int
    path: str
    backend: str
    started_at: float
    latency: float = 0.0
    status: Literal["ok", "failed"] = "ok"
    error: str | None = None
    choice_index: int = 0
    model: str | None = None
    weight_version: int = 0
    prompt_token_ids: list[int] | None = None
    response_token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    limit: Literal["max_tokens", "context"] | None = None
    sampling: dict[str, float] | None = None
    off_policy: bool = False
    weight_version_end: int | None = None
    response_id: str | None = None

    def __post_init__(self) -> None:
        if self.weight_version_end is None:
            self.weight_version_end = self.weight_version

    @property
    def has_token_ids(self) -> bool:
        return self.prompt_token_ids is not None and self.response_token_ids is not None

    @property
    def last_weight_version(self) -> int:
        """The weight version of the response's last token (``weight_version_end``, always set)."""
        return self.weight_version if self.weight_version_end is None else self.weight_version_end


@dataclass(slots=True, frozen=True)
class RolloutRecord:
    """A terminal rollout as the collector sees it: the result (if any) and the winning attempt's calls.

    ``calls`` of a failed rollout are its last attempt's. ``termination`` is why the rollout ended as the store
    decided it (``agent_error``, ``lease_expired``, ``step_timeout`` for a failed rollout) or the agent
    declared it with its result; ``None`` for a result that simply finished.
    """

    rollout_id: str
    state: RolloutState
    input: Any
    metadata: dict[str, Any]
    num_claims: int
    requeues: int
    result: Rollout | None
    attempt_id: str | None
    calls: list[LLMCall]
    error: str | None
    termination: TerminationReason | None = None


def check_token_ids(rollout: Rollout, vocab_size: int | None) -> None:
    """Raise :class:`~aglverl.store.errors.InvalidResult` (naming the triplet and side) when a posted triplet
    holds a token id at or above ``vocab_size``; nothing to check without one."""
    if vocab_size is None or not rollout.triplets:
        return
    for i, t in enumerate(rollout.triplets):
        for side, ids in (("prompt", t.prompt.token_ids), ("response", t.response.token_ids)):
            if ids and max(ids) >= vocab_size:
                raise InvalidResult(
                    f"triplets[{i}].{side}.token_ids has id {max(ids)} >= vocabulary size {vocab_size}"
                )


@dataclass(slots=True, frozen=True)
class AttemptChange:
    """What :meth:`TaskStore.on_attempt <aglverl.store.tasks.TaskStore.on_attempt>` listeners hear, on the
    store's loop, as it happens.

    ``kind``: ``"queued"`` (a new rollout), ``"claimed"`` (attempt ``attempt_id`` started), ``"released"``
    (that claim was undone: its task never reached an agent), ``"ended"`` (attempt ``attempt_id`` ended, or,
    with ``attempt_id`` ``None``, a rollout that was never claimed was failed). ``claims`` is the rollout's
    number of claims after the change, ``state`` its state after it (an ``"ended"`` attempt whose rollout is
    ``"queued"`` again is retried); ``error`` why it ended, when it failed. ``resources_id``: for a claim, the
    resources its task names (with proxy shards, the attempt's shard's copy).
    """

    kind: AttemptEvent
    rollout_id: str
    attempt_id: str | None
    claims: int
    state: RolloutState
    error: str | None = None
    resources_id: str | None = None
