"""Finished rollouts: what the row builder takes (:class:`FinishedRollout`), read from the store's records.

What the producer (:mod:`.groups`) and the collector (:mod:`.steps`) both read before they build rows:
:func:`trajectory_of` picks a terminal rollout's turns (client-posted triplets win; otherwise the proxy's
recorded calls of the winning attempt) with their rewards, logprobs and weight versions, :func:`finished_rollout`
makes the :class:`FinishedRollout` that :func:`~aglverl.trajectory.rows.build_rows` takes, and
:func:`tokens_in` says whether building is cheap enough to do on the event loop. The readers at the end lay a
batch of finished rollouts' values out as flat arrays, one entry per rollout or per turn (rollout-major), for
the row builder.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..models import TerminationReason, Triplet
from ..store import LLMCall, RolloutRecord
from .signals import FAILURE_REASONS, reason_flags

__all__ = [
    "INLINE_BUILD_TOKENS",
    "FinishedRollout",
    "MissingRewardError",
    "Trajectory",
    "check_per_turn",
    "final_reward",
    "final_rewards",
    "finished_rollout",
    "per_turn",
    "termination_flags",
    "termination_of",
    "tokens_in",
    "trajectory_of",
    "turn_logprobs",
    "turn_rewards",
    "turns_of",
]

#: Rows of at most this many token ids are built on the event loop (about 1.5 ms of work); larger ones in a
#: worker thread, so the loop keeps serving agents while, e.g., 1,024 x 3,072 ids (~70 ms) are packed.
INLINE_BUILD_TOKENS = 32_768

Turn = tuple[Sequence[int], Sequence[int]]


class MissingRewardError(ValueError):
    """A rollout has no final reward and ``BatchConfig.reward_fill_value`` is ``None``."""

    def __init__(self, rollout_id: str) -> None:
        super().__init__(
            f"rollout {rollout_id!r} has no final reward and BatchConfig.reward_fill_value is None"
        )
        self.rollout_id = rollout_id


@dataclass(frozen=True, slots=True)
class FinishedRollout:
    """One finished rollout, as the collector and the producer hand it over.

    ``data_id`` is the GRPO group: all ``n`` rollouts of one sample share it. ``reward`` is the final
    reward (``None``: not reported). ``turns`` holds one ``(prompt token ids, response token ids)`` pair
    per triplet, in the order the calls were made; any sequences of ints (lists, tuples, numpy arrays).
    Values are trusted to be what the wire models validated (ids non-negative, rewards finite); an id that
    is not an integer in the int64 range makes :func:`build_rows` raise ``ValueError`` naming the turn.

    What the training-signal controls read (ignored without a :class:`~aglverl.trajectory.signals.SignalConfig`):
    ``completed`` is false for a rollout that failed (its ``turns`` are its last attempt's calls, its reward is
    the config's ``failure_reward``); ``termination`` holds the reasons recorded for it (a failed rollout
    without a failure reason counts as ``agent_error``); ``turn_rewards`` the agent's reward per turn (``None``
    entries, or ``None`` for all: none given); ``logprobs`` the engine's logprobs per turn, aligned with the
    response ids (``None`` entries, or a length that differs from the response's: not available);
    ``off_policy`` per turn, whether its call's sampling parameters were masked.

    ``versions`` / ``end_versions``: per turn, the weight version that generated its first / last token (they
    differ when a weight update cut its generation; ``end_versions`` ``None``: the same as ``versions``;
    ``versions`` ``None``: unknown, the rows' versions are then -1).
    """

    rollout_id: str
    data_id: str
    reward: float | None
    turns: Sequence[tuple[Sequence[int], Sequence[int]]]
    completed: bool = True
    termination: frozenset[str] = frozenset()
    turn_rewards: Sequence[float | None] | None = None
    logprobs: Sequence[Sequence[float] | None] | None = None
    off_policy: Sequence[bool] | None = None
    versions: Sequence[int] | None = None
    end_versions: Sequence[int] | None = None


class Trajectory(NamedTuple):
    """A finished rollout's turns and what goes with each: the agent's reward (``rewards``, ``None`` when the
    turns came from the proxy), the engine's logprobs (one list per turn, ``None`` where missing), where the
    turns came from (``"client"``, ``"proxy"``, ``"none"``), how many recorded calls were unusable, and per
    turn the weight version that generated it and whether its call was off-policy (proxy turns; a posted
    triplet's version is unknown: ``None``).

    ``versions`` holds each turn's first token's version, ``end_versions`` its last token's: they differ
    for a turn whose generation was aborted by a weight update and continued under the new weights (verl's
    ``min_global_steps`` / ``max_global_steps`` of a row are the min of the one and the max of the other).
    ``n_unselected``: recorded calls the result left out of training (not named by its
    :data:`~aglverl.models.TRAINED_CALLS_KEY`: another agent's, under ``agent_match``).
    """

    turns: list[Turn]
    rewards: list[float | None] | None
    logprobs: list[list[float] | None]
    source: str
    n_skipped: int
    versions: list[int | None]
    off_policy: list[bool]
    end_versions: list[int | None]
    n_unselected: int = 0


def trajectory_of(record: RolloutRecord) -> Trajectory:
    """The turns of a finished rollout (see :class:`Trajectory`).

    Client-posted triplets win (their ``response.logprobs``, if the agent sent a list of finite numbers, one
    per response id, are the engine's logprobs); otherwise the proxy's recorded calls of the winning attempt
    (a failed rollout: its last attempt), in call order; only those the result names, when it names the calls
    that train (:attr:`~aglverl.models.Rollout.trained_calls`: the others are counted in ``n_unselected``). Calls
    that failed or came back without token ids cannot be trained on: they are skipped and counted.
    """
    result = record.result
    if result is not None and result.triplets:
        turns: list[Turn] = [(t.prompt.token_ids, t.response.token_ids) for t in result.triplets]
        rewards = [t.reward for t in result.triplets]
        logprobs = [_posted_logprobs(t) for t in result.triplets]
        n = len(turns)
        return Trajectory(turns, rewards, logprobs, "client", 0, [None] * n, [False] * n, [None] * n)
    trained = result.trained_calls if result is not None else None
    calls = record.calls if trained is None else [c for c in record.calls if c.response_id in trained]
    usable: list[LLMCall] = [c for c in calls if c.status == "ok" and c.has_token_ids]
    proxied: list[Turn] = [(c.prompt_token_ids or [], c.response_token_ids or []) for c in usable]
    return Trajectory(
        proxied,
        None,
        [c.logprobs for c in usable],
        "proxy" if usable else "none",
        len(calls) - len(usable),
        [c.weight_version for c in usable],
        [c.off_policy for c in usable],
        [c.last_weight_version for c in usable],
        len(record.calls) - len(calls),
    )


def finished_rollout(
    record: RolloutRecord, trajectory: Trajectory, data_id: str, *, version_now: int = -1
) -> FinishedRollout:
    """What :func:`aglverl.trajectory.rows.build_rows` takes for a terminal rollout (its turns from
    ``trajectory``). A turn whose weight version was not recorded (a posted triplet) counts as ``version_now``
    (the producer passes the version served now; -1: unknown)."""
    return FinishedRollout(
        record.rollout_id,
        data_id,
        final_reward(record),
        trajectory.turns,
        completed=record.state == "completed",
        termination=termination_of(record),
        turn_rewards=trajectory.rewards,
        logprobs=trajectory.logprobs,
        off_policy=trajectory.off_policy,
        versions=[version_now if v is None else v for v in trajectory.versions],
        end_versions=[version_now if v is None else v for v in trajectory.end_versions],
    )


def turns_of(record: RolloutRecord) -> tuple[list[Turn], str, int]:
    """The (prompt ids, response ids) turns of a finished rollout, where they came from, and calls skipped."""
    trajectory = trajectory_of(record)
    return trajectory.turns, trajectory.source, trajectory.n_skipped


def _posted_logprobs(triplet: Triplet) -> list[float] | None:
    values = (triplet.response.model_extra or {}).get("logprobs")
    if type(values) is not list or len(values) != len(triplet.response.token_ids):
        return None
    # One C-level pass over the types and one over the values: no per-token Python code.
    if not set(map(type, values)) <= {float, int} or not np.isfinite(np.asarray(values, np.float64)).all():
        return None
    return values


def termination_of(record: RolloutRecord) -> frozenset[TerminationReason]:
    """Why a finished rollout ended, from what was recorded where it was decided: the store's reason for a
    failure or the agent's declared one (``record.termination``), and the limits the proxy saw on the calls of
    its attempt (a ``context`` limit: ``context_exceeded``; a ``max_tokens`` stop: ``truncated``)."""
    reasons: set[TerminationReason] = {record.termination} if record.termination else set()
    limits = {call.limit for call in record.calls}
    if "context" in limits:
        reasons.add("context_exceeded")
    if "max_tokens" in limits:
        reasons.add("truncated")
    return frozenset(reasons)


def final_reward(record: RolloutRecord) -> float | None:
    """The rollout's reward: ``final_reward``, else the last triplet reward the agent gave, else ``None``."""
    result = record.result
    if result is None:
        return None
    if result.final_reward is not None:
        return result.final_reward
    for triplet in reversed(result.triplets or []):
        if triplet.reward is not None:
            return triplet.reward
    return None


def tokens_in(records: Sequence[RolloutRecord]) -> int:
    """Token ids rows built from ``records`` have to move (an upper bound on their building time)."""
    total = 0
    for record in records:
        if record.result is not None and record.result.triplets:
            total += sum(len(t.prompt.token_ids) + len(t.response.token_ids) for t in record.result.triplets)
        for call in record.calls:
            total += len(call.prompt_token_ids or ()) + len(call.response_token_ids or ())
    return total


# ---------------------------------------------------------------------------------------------- as arrays
def check_per_turn(rollouts: Sequence[FinishedRollout]) -> None:
    """Raise ``ValueError`` naming the first rollout whose per-turn lists are not one entry per turn."""
    for r in rollouts:
        for name, values in (
            ("turn_rewards", r.turn_rewards),
            ("logprobs", r.logprobs),
            ("off_policy", r.off_policy),
            ("versions", r.versions),
            ("end_versions", r.end_versions),
        ):
            if values is not None and len(values) != len(r.turns):
                raise ValueError(
                    f"rollout {r.rollout_id!r} has {len(r.turns)} turns but {len(values)} {name}"
                )


def final_rewards(
    rollouts: Sequence[FinishedRollout], fill: float | None, failure_reward: float | None
) -> tuple[np.ndarray, int]:
    """Each rollout's final reward (float64) and how many were filled: its own, else ``fill`` (counted); a failed
    one's is ``failure_reward`` when that is given. Raises :class:`MissingRewardError` for a rollout without one
    if ``fill`` is ``None``."""
    rewards = np.empty(len(rollouts), np.float64)
    n_filled = 0
    for i, rollout in enumerate(rollouts):
        if not rollout.completed and failure_reward is not None:
            rewards[i] = failure_reward
        elif rollout.reward is not None:
            rewards[i] = rollout.reward
        elif fill is None:
            raise MissingRewardError(rollout.rollout_id)
        else:
            rewards[i] = fill
            n_filled += 1
    return rewards, n_filled


def termination_flags(rollouts: Sequence[FinishedRollout]) -> np.ndarray:
    """The recorded reasons of each rollout as :data:`~aglverl.trajectory.signals.REASON_BITS` (int64); a
    failed rollout that names no failure reason counts as an agent error."""
    failure = reason_flags(FAILURE_REASONS)
    flags = np.fromiter((reason_flags(r.termination) for r in rollouts), np.int64, count=len(rollouts))
    completed = np.fromiter((r.completed for r in rollouts), bool, count=len(rollouts))
    unnamed = ~completed & ((flags & failure) == 0)
    flags[unnamed] |= reason_flags(("agent_error",))
    return flags


def per_turn(
    rollouts: Sequence[FinishedRollout],
    values: Callable[[FinishedRollout], Sequence[float] | None],
    missing: float,
    dtype: type,
) -> np.ndarray:
    """One value per turn of every rollout (rollout-major): ``values(rollout)``, or ``missing`` for each turn
    of a rollout without them."""
    n_turns = sum(len(r.turns) for r in rollouts)
    each = ((missing,) * len(r.turns) if (v := values(r)) is None else v for r in rollouts)
    return np.fromiter(itertools.chain.from_iterable(each), dtype, count=n_turns)


def turn_rewards(rollouts: Sequence[FinishedRollout]) -> np.ndarray:
    """Every turn's own reward (float64, rollout-major), NaN where the agent gave none."""
    return per_turn(
        rollouts,
        lambda r: None if r.turn_rewards is None else [math.nan if v is None else v for v in r.turn_rewards],
        math.nan,
        np.float64,
    )


def turn_logprobs(rollouts: Sequence[FinishedRollout]) -> list[Sequence[float] | None]:
    """Every turn's engine logprobs (rollout-major), ``None`` where not given."""
    each = (r.logprobs if r.logprobs is not None else (None,) * len(r.turns) for r in rollouts)
    return list(itertools.chain.from_iterable(each))
