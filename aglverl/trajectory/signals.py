"""Training-signal controls for multi-turn agents: which rows train, with what score, in which group, how much.

Pure, vectorised numpy/torch beside :mod:`aglverl.trajectory.rows`, which calls :func:`plan_rows` while it builds
rows (the collector and the producer hand it their :class:`SignalConfig`). Four controls, each off or today's
behaviour by default:

- **Compact filtering** — every rollout carries the reasons it ended the way it did (recorded where they were
  decided: the store, the proxy, the agent; the row builder adds ``truncated`` for a response longer than
  ``max_response_length``). A rollout with a reason whose ``mask_*`` switch is on contributes no row: it
  neither trains nor sits in its group's mean/std, but it is counted (``filter/*``). Failed rollouts (agent
  error, lease expired after the last attempt, step timeout) are masked by default, which is exactly how they
  were always excluded; switching a failure's mask off trains on the last attempt's recorded calls with
  ``failure_reward`` as the rollout's reward (e.g. to penalise timeouts).
- **Rejection sampling** — drops every GRPO group (rows sharing a ``uid``) whose scores are all equal: its
  advantages are all zero, so it only costs compute. A group with one member counts as uniform (it has no
  baseline). ``min_group_size`` also drops samples with fewer usable rollouts than that. The batch may end up
  empty; metrics (``rejection/*``) say what went and the solve-all / solve-none rates.
- **Step-wise advantage** — ``broadcast`` (default) puts the rollout's final reward on every turn's last token
  and groups by sample; ``per_step`` scores each turn with its discounted return ``G_t = r_t + gamma G_{t+1}``
  (``r_t`` the turn's own reward, the final reward on the last turn) and groups by (sample, turn index).
- **Group members and turn weighting** — in a ``broadcast`` GRPO group a rollout is one member whatever its
  number of rows: each of its ``k`` rows weighs ``1/k`` in the group's mean/std (``group_weights``), as under
  ``AsyncVERL``. ``turn_weighting`` weighs the loss: ``per_turn`` (default) every row 1, ``per_rollout`` each of
  a rollout's ``k`` rows ``1/k`` (``advantage_weights``). verl's stock GRPO cannot weight group members, so a
  trainer calls :func:`compute_advantage` here instead of verl's (it is verl's own for every other
  estimator, whose groups are rows).

The math a trainer runs on the rows, whichever path brought them: :func:`grpo_advantages` (weighted group
members) and :func:`compute_advantage` (verl's ``compute_advantage`` with it for GRPO), :func:`per_rollout_weights`
(a rollout's k rows at 1/k each, from the rows' rollouts); the behaviour log-probs, which the row builder packs,
compared with the trainer's recomputed old log-probs (:func:`logprob_mismatch`), and the trainer's standing in
for rows that came without them (:func:`stand_in_logprobs`). The reads and writes around it (TransferQueue,
verl's phases) stay in :mod:`aglverl.verl_v1.hooks`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from ..models import TERMINATION_REASONS, TerminationReason

if TYPE_CHECKING:
    from verl import DataProto

logger = logging.getLogger(__name__)

#: The key of a :func:`compute_advantage` result's ``meta_info`` that counts the rows it dropped (a step metric).
ROWS_DROPPED = "advantage/n_rows_dropped"

__all__ = [
    "FAILURE_REASONS",
    "REASON_BITS",
    "ROWS_DROPPED",
    "RowPlan",
    "SignalConfig",
    "compute_advantage",
    "grpo_advantages",
    "logprob_mismatch",
    "per_rollout_weights",
    "plan_rows",
    "reason_flags",
    "stand_in_logprobs",
    "turn_layout",
]

#: One bit per termination reason, so a batch's reasons are one int64 array and masking is one ``&``.
REASON_BITS: Mapping[str, int] = {reason: 1 << i for i, reason in enumerate(TERMINATION_REASONS)}
#: The reasons a rollout fails for (the store decides them); the others describe a delivered result.
FAILURE_REASONS: tuple[TerminationReason, ...] = ("agent_error", "step_timeout", "lease_expired")
#: verl's GRPO epsilon (``compute_grpo_outcome_advantage``), so the default mode reproduces its numbers.
GRPO_EPSILON = 1e-6

_CHOICES: Mapping[str, tuple[str, ...]] = {
    "advantage": ("broadcast", "per_step"),
    "turn_weighting": ("per_turn", "per_rollout"),
    "trajectory": ("merge", "per_call"),
}
_FLOATS = ("gamma", "solve_threshold", "failure_reward")


@dataclass(frozen=True, slots=True)
class SignalConfig:
    """The training-signal controls (see the module docstring); the defaults reproduce plain batches.

    - ``advantage``: ``"broadcast"`` or ``"per_step"``; ``gamma``: per_step's discount across turns, in [0, 1].
    - ``turn_weighting``: ``"per_turn"`` or ``"per_rollout"`` (a rollout's rows weigh ``1/k`` each in the loss).
    - ``trajectory``: ``"merge"`` (a chain of calls that extend each other is one row, see
      :mod:`aglverl.trajectory.chains`) or ``"per_call"`` (every call its own row). ``advantage="per_step"``
      groups rows by turn, which a merged row spans several of: it needs ``"per_call"`` (``ValueError``
      otherwise).
    - ``rejection_sampling``: drop GRPO groups whose scores are all equal. ``min_group_size``: drop samples
      with fewer usable rollouts (1: keep every sample). ``solve_threshold``: a rollout whose final reward is
      at least this counts as solved in the ``rejection/solve_*_rate`` metrics (reporting only).
    - ``mask_<reason>``: keep rollouts that ended for this reason out of the batch (see
      :data:`aglverl.models.TERMINATION_REASONS`); ``failure_reward``: the reward of a failed rollout whose
      reason is not masked.
    - ``request_logprobs``: have the proxy ask the backend for the sampled tokens' logprobs on every call
      whose agent did not set ``logprobs`` (so batches carry ``rollout_log_probs``).

    Bad values raise at construction, naming the field: ``TypeError`` for a wrong type (an int is taken for a
    float; a bool is never a number), ``ValueError`` for an unknown choice, a non-finite float, ``gamma``
    outside [0, 1] or ``min_group_size < 1``. :meth:`from_dict` builds one from an ``aglverl:`` config section.
    """

    advantage: Literal["broadcast", "per_step"] = "broadcast"
    gamma: float = 1.0
    turn_weighting: Literal["per_turn", "per_rollout"] = "per_turn"
    trajectory: Literal["merge", "per_call"] = "merge"
    rejection_sampling: bool = False
    min_group_size: int = 1
    solve_threshold: float = 1.0
    mask_agent_error: bool = True
    mask_step_timeout: bool = True
    mask_lease_expired: bool = True
    mask_truncated: bool = False
    mask_max_turns: bool = False
    mask_context_exceeded: bool = False
    failure_reward: float = 0.0
    request_logprobs: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _CHOICES:
                if value not in _CHOICES[f.name]:
                    raise ValueError(
                        f"SignalConfig.{f.name} must be one of {_CHOICES[f.name]}, got {value!r}"
                    )
            elif f.name in _FLOATS:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise TypeError(f"SignalConfig.{f.name} must be a float, got {type(value).__name__}")
                if not math.isfinite(value):
                    raise ValueError(f"SignalConfig.{f.name} must be finite, got {value}")
                object.__setattr__(self, f.name, float(value))
            elif f.name == "min_group_size":
                if isinstance(value, bool) or not isinstance(value, int):
                    raise TypeError(f"SignalConfig.min_group_size must be an int, got {type(value).__name__}")
                if value < 1:
                    raise ValueError(f"SignalConfig.min_group_size must be >= 1, got {value}")
            elif not isinstance(value, bool):
                raise TypeError(f"SignalConfig.{f.name} must be a bool, got {type(value).__name__}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"SignalConfig.gamma must be in [0, 1], got {self.gamma}")
        if self.advantage == "per_step" and self.trajectory != "per_call":
            raise ValueError(
                "SignalConfig.advantage='per_step' scores and groups every turn on its own, which a merged row "
                "(several turns) cannot carry: set trajectory='per_call' with it"
            )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> SignalConfig:
        """A config from plain data (an ``aglverl:`` YAML section); ``None`` or ``{}`` gives the defaults.

        Raises ``ValueError`` naming every unknown key (a typo must not silently leave a control off), and
        whatever the constructor raises for a bad value.
        """
        values = dict(values or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown SignalConfig option(s) {unknown}; known options: {sorted(known)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """Plain data that :meth:`from_dict` turns back into an equal config (for logging a run's setup)."""
        return asdict(self)

    @property
    def mask_bits(self) -> int:
        """The :data:`REASON_BITS` of the reasons this config masks, or-ed together."""
        return sum(bit for reason, bit in REASON_BITS.items() if getattr(self, f"mask_{reason}"))


def reason_flags(reasons: Iterable[str]) -> int:
    """The :data:`REASON_BITS` of ``reasons`` or-ed together; raises ``ValueError`` naming an unknown reason."""
    flags = 0
    for reason in reasons:
        bit = REASON_BITS.get(reason)
        if bit is None:
            raise ValueError(f"unknown termination reason {reason!r}; known: {TERMINATION_REASONS}")
        flags |= bit
    return flags


@dataclass(frozen=True, slots=True)
class RowPlan:
    """Which turns become rows, and what each row carries (all arrays have one entry per row, in batch order).

    ``rows`` index the flat list of turns; ``scores`` (float64) go on each row's last response token; ``uid``
    (object) is the row's GRPO group; ``advantage_weights`` / ``group_weights`` (float32) are the row's weight
    in the loss and in its group's mean/std. ``masked`` has one entry per rollout: the :data:`REASON_BITS` that
    kept it out (0: not masked).
    """

    rows: np.ndarray
    scores: np.ndarray
    uid: np.ndarray
    advantage_weights: np.ndarray
    group_weights: np.ndarray
    masked: np.ndarray
    metrics: dict[str, float]


def plan_rows(
    *,
    data_ids: np.ndarray,
    rewards: np.ndarray,
    flags: np.ndarray,
    n_turns: np.ndarray,
    response_len: np.ndarray,
    turn_rewards: np.ndarray,
    max_response_length: int,
    config: SignalConfig,
    row_starts: np.ndarray | None = None,
    in_rows: np.ndarray | None = None,
) -> RowPlan:
    """Apply compact filtering, the advantage mode, rejection sampling and turn weighting to a batch's turns.

    Per rollout (``N``): ``data_ids`` (its sample, object), ``rewards`` (final reward, float64, already
    filled), ``flags`` (int64 :data:`REASON_BITS` recorded for it), ``n_turns``. Per turn (``T = sum(n_turns)``,
    rollout-major): ``response_len`` (before truncation), ``turn_rewards`` (float64, NaN where the agent
    gave none), ``row_starts`` (bool: the turn starts a row, for merged trajectories; ``None``: every turn
    is a row of its own), which decides how many rows a rollout has (its weights), and ``in_rows`` (bool: the
    turn is in a row at all; ``None``: every turn with a response; a merged conversation's calls the width
    leaves untrained are in none). Plans are made per turn and keep or drop a rollout's turns together (so a
    merged row is whole). Returns the :class:`RowPlan` and its ``filter/*`` and ``rejection/*`` metrics. Turns
    with an empty response never become rows (the batch builder counts them). Nothing here loops per token;
    the only Python loop runs once per turn depth, for the discounted returns.
    """
    n_rollouts = len(n_turns)
    turn_rollout, turn_index = turn_layout(n_turns)
    trained = (response_len > 0) if in_rows is None else (response_len > 0) & in_rows
    cut = np.bincount(turn_rollout[trained & (response_len > max_response_length)], minlength=n_rollouts) > 0
    flags = flags | np.where(cut, REASON_BITS["truncated"], 0)
    masked = (flags & config.mask_bits) != 0
    candidate = np.flatnonzero(trained & ~masked[turn_rollout])
    starts = candidate if row_starts is None else candidate[row_starts[candidate]]
    rows_per_rollout = np.bincount(turn_rollout[starts], minlength=n_rollouts)

    if config.advantage == "broadcast":
        scores = rewards[turn_rollout[candidate]]
        uid = data_ids[turn_rollout[candidate]]
    else:
        scores = _discounted_returns(rewards, turn_rewards, turn_rollout, turn_index, n_turns, config.gamma)
        scores = scores[candidate]
        uid = _turn_uids(data_ids[turn_rollout[candidate]], turn_index[candidate])

    sample = np.unique(data_ids, return_inverse=True)[1].reshape(-1) if n_rollouts else np.zeros(0, np.int64)
    usable = rows_per_rollout > 0
    small = _small_samples(sample, usable, config.min_group_size)
    group = np.unique(uid, return_inverse=True)[1].reshape(-1) if len(uid) else np.zeros(0, np.int64)
    uniform = _uniform_groups(group, scores)
    drop = small[sample[turn_rollout[candidate]]]
    if config.rejection_sampling:
        drop |= uniform[group]
    keep = ~drop
    rows = candidate[keep]
    row_rollout = turn_rollout[rows]

    weight = (1.0 / np.maximum(rows_per_rollout, 1))[row_rollout].astype(np.float32)
    ones = np.ones(len(rows), np.float32)
    per_rollout = config.turn_weighting == "per_rollout"
    metrics = _filter_metrics(flags, masked, response_len, turn_rollout)
    metrics |= _rejection_metrics(
        sample, usable, small, group, uniform, drop, candidate, turn_rollout, rewards, config
    )
    return RowPlan(
        rows=rows,
        scores=scores[keep],
        uid=uid[keep],
        advantage_weights=weight if per_rollout else ones,
        # A broadcast group holds a rollout's k rows: one member, 1/k each (as AsyncVERL weighs them). In
        # per_step groups each rollout has one row per group already.
        group_weights=weight.copy() if config.advantage == "broadcast" else ones.copy(),
        masked=np.where(masked, flags & config.mask_bits, 0),
        metrics=metrics,
    )


def turn_layout(n_turns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For turns laid out rollout-major, each turn's rollout and its index within the rollout."""
    turn_rollout = np.repeat(np.arange(len(n_turns)), n_turns)
    turn_index = np.arange(len(turn_rollout)) - np.repeat(np.cumsum(n_turns) - n_turns, n_turns)
    return turn_rollout, turn_index


def _discounted_returns(
    rewards: np.ndarray,
    turn_rewards: np.ndarray,
    turn_rollout: np.ndarray,
    turn_index: np.ndarray,
    n_turns: np.ndarray,
    gamma: float,
) -> np.ndarray:
    """``G_t = r_t + gamma * G_{t+1}`` per turn: ``r_t`` the turn's own reward (0 when none), the rollout's
    final reward on its last turn. One vectorised pass per turn depth, deepest first."""
    last = turn_index == n_turns[turn_rollout] - 1
    returns = np.where(np.isnan(turn_rewards), 0.0, turn_rewards)
    returns[last] = rewards[turn_rollout[last]]
    if gamma == 0.0 or not len(returns):
        return returns
    by_depth = np.argsort(turn_index, kind="stable")
    bounds = np.searchsorted(turn_index[by_depth], np.arange(int(turn_index.max()) + 2))
    for depth in range(int(turn_index.max()) - 1, -1, -1):
        at = by_depth[bounds[depth] : bounds[depth + 1]]
        at = at[~last[at]]  # the turn after ``at`` is the same rollout's next turn (turns are rollout-major)
        returns[at] += gamma * returns[at + 1]
    return returns


def _turn_uids(data_ids: np.ndarray, turn_index: np.ndarray) -> np.ndarray:
    """``"<data_id>/<turn index>"`` per row: per_step's GRPO groups (as strings, like every uid verl sees)."""
    if not len(data_ids):
        return np.zeros(0, object)
    joined = np.char.add(np.char.add(data_ids.astype(str), "/"), turn_index.astype(str))
    return joined.astype(object)


def _small_samples(sample: np.ndarray, usable: np.ndarray, min_size: int) -> np.ndarray:
    """Per sample: whether it has usable rollouts, but fewer than ``min_size``."""
    count = np.bincount(sample[usable], minlength=int(sample.max()) + 1 if len(sample) else 0)
    return (count > 0) & (count < min_size)


def _uniform_groups(group: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """Per group: whether all its scores are equal (one member included)."""
    n_groups = int(group.max()) + 1 if len(group) else 0
    low, high = np.full(n_groups, np.inf), np.full(n_groups, -np.inf)
    np.minimum.at(low, group, scores)
    np.maximum.at(high, group, scores)
    return low == high


def _filter_metrics(
    flags: np.ndarray, masked: np.ndarray, response_len: np.ndarray, turn_rollout: np.ndarray
) -> dict[str, float]:
    failed = (flags & sum(REASON_BITS[r] for r in FAILURE_REASONS)) != 0
    metrics = {
        "filter/n_rollouts": float(len(flags)),
        "filter/n_masked": float(np.count_nonzero(masked)),
        "filter/n_rows_masked": float(np.count_nonzero(masked[turn_rollout] & (response_len > 0))),
        "filter/n_failed_trained": float(np.count_nonzero(failed & ~masked)),
    }
    for reason, bit in REASON_BITS.items():
        metrics[f"filter/n_{reason}"] = float(np.count_nonzero(flags & bit))
    return metrics


def _rejection_metrics(
    sample: np.ndarray,
    usable: np.ndarray,
    small: np.ndarray,
    group: np.ndarray,
    uniform: np.ndarray,
    drop: np.ndarray,
    candidate: np.ndarray,
    turn_rollout: np.ndarray,
    rewards: np.ndarray,
    config: SignalConfig,
) -> dict[str, float]:
    n_samples = int(sample.max()) + 1 if len(sample) else 0
    with_rows = np.bincount(sample[usable], minlength=n_samples)
    solved = np.bincount(sample[usable & (rewards >= config.solve_threshold)], minlength=n_samples)
    present = with_rows > 0
    n_present = int(np.count_nonzero(present))
    dropped_groups = np.zeros(len(uniform), bool)
    dropped_groups[group[drop]] = True
    kept_rollouts = np.bincount(turn_rollout[candidate[~drop]], minlength=len(usable)) > 0
    return {
        "rejection/n_samples": float(n_present),
        "rejection/n_samples_too_small": float(np.count_nonzero(small)),
        "rejection/solve_all_rate": _rate(np.count_nonzero(present & (solved == with_rows)), n_present),
        "rejection/solve_none_rate": _rate(np.count_nonzero(present & (solved == 0)), n_present),
        "rejection/n_groups": float(len(uniform)),
        "rejection/n_groups_uniform": float(np.count_nonzero(uniform)),
        "rejection/n_groups_dropped": float(np.count_nonzero(dropped_groups)),
        "rejection/n_rows_dropped": float(np.count_nonzero(drop)),
        "rejection/n_rollouts_dropped": float(np.count_nonzero(usable & ~kept_rollouts)),
    }


def _rate(count: int | np.integer, total: int) -> float:
    return float(count) / total if total else 0.0


# ---------------------------------------------------------------------------------------------- advantages
def grpo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    group_weights: torch.Tensor | None = None,
    advantage_weights: torch.Tensor | None = None,
    *,
    members: np.ndarray | None = None,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = GRPO_EPSILON,
) -> torch.Tensor:
    """GRPO outcome advantages with weighted group members; verl's ``compute_grpo_outcome_advantage`` when
    both weight tensors are all ones (or ``None``) and every row is a member of its own.

    Each row's score is the sum of its ``token_level_rewards``; rows are grouped by ``index`` (the ``uid``
    column). ``members`` names each row's member of its group (its rollout: a rollout's rows are one member;
    ``None``: every row is one). A group's mean and std use ``group_weights``: the weighted mean, and the
    weighted variance with Bessel's correction by its number of members ``n`` (``sum w (s - mean)^2 / sum w
    * n / (n - 1)``: verl's unbiased std when the weights are ones, and the std of the members' scores when
    each member's rows weigh 1/k). A group of one member has no baseline, so, as in verl, its mean is 0 and
    its std 1. Both are decided by counting members, never from the float sum of their rows' weights. The
    normalised score is multiplied by ``advantage_weights`` and spread over ``response_mask``. Returns
    float32 ``[B, R]``, always finite.

    One row's numbers never stop the step: a row whose score is not finite is dropped (out of its group's mean
    and std, advantage 0), and so is a row whose advantage would not be finite in float32; a warning names
    them (:func:`compute_advantage` counts them in the step's metrics). Raises ``ValueError`` naming the
    argument whose length is not ``B``, ``group_weights`` that are not positive and finite,
    ``advantage_weights`` that are not finite, and an ``epsilon`` that is not positive (aglverl's own inputs,
    never an agent's).
    """
    advantages, dropped = _grpo(
        token_level_rewards,
        response_mask,
        index,
        group_weights,
        advantage_weights,
        members=members,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        epsilon=epsilon,
    )
    _warn_dropped(dropped)
    return advantages


def _grpo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    group_weights: torch.Tensor | None,
    advantage_weights: torch.Tensor | None,
    *,
    members: np.ndarray | None,
    norm_adv_by_std_in_grpo: bool,
    epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`grpo_advantages` and the rows it dropped (bool ``[B]``)."""
    n_rows = token_level_rewards.shape[0]
    for name, value in (("response_mask", response_mask), ("index", index), ("members", members)):
        if value is not None and len(value) != n_rows:
            raise ValueError(f"{name} has {len(value)} rows, token_level_rewards has {n_rows}")
    if norm_adv_by_std_in_grpo and not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"epsilon must be positive and finite, got {epsilon}")
    scores = token_level_rewards.sum(dim=-1).double()
    weights = _row_weights(group_weights, n_rows, "group_weights")
    loss_weights = _row_weights(advantage_weights, n_rows, "advantage_weights")
    _check_rows(torch.isfinite(loss_weights), "advantage_weights must be finite")
    _check_rows(torch.isfinite(weights) & (weights > 0), "group_weights must be positive and finite")
    if not n_rows:
        return torch.zeros_like(token_level_rewards, dtype=torch.float32), torch.zeros(0, dtype=torch.bool)
    dropped = ~torch.isfinite(scores)
    scores = torch.where(dropped, 0.0, scores)
    weights = torch.where(dropped, 0.0, weights)  # out of their group's mean and std
    group_of = np.unique(index, return_inverse=True)[1].reshape(-1)
    group = torch.from_numpy(group_of)
    n_groups = int(group.max()) + 1
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, weights)
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, weights * scores) / total
    n_members = torch.from_numpy(_n_members(group_of, members, n_groups, (~dropped).numpy())).double()
    alone = n_members <= 1  # or none left: its mean (0/0) is never used
    mean = torch.where(alone, 0.0, mean)
    spread = torch.zeros(n_groups, dtype=torch.float64).index_add_(
        0, group, weights * (scores - mean[group]) ** 2
    )
    # Bessel's correction counts members: with fractional weights, "total - 1" may be 0 (a rollout's k rows
    # at 1/k each, no members named) and the variance NaN or infinite.
    bessel = n_members / torch.where(alone, 1.0, n_members - 1.0)
    std = torch.where(alone, 1.0, torch.sqrt(spread / torch.where(alone, 1.0, total) * bessel))
    advantages = scores - mean[group]
    if norm_adv_by_std_in_grpo:
        advantages = advantages / (std[group] + epsilon)
    advantages = ((advantages * loss_weights).unsqueeze(-1) * response_mask).to(torch.float32)
    dropped |= ~torch.isfinite(advantages).all(dim=-1)  # too large for float32 (or a non-finite mask)
    return advantages.masked_fill_(dropped.unsqueeze(-1), 0.0), dropped


def _warn_dropped(dropped: torch.Tensor) -> int:
    """Log the rows the advantage step dropped (a warning naming the first few); returns how many."""
    n = int(dropped.sum())
    if n:
        rows = torch.nonzero(dropped).reshape(-1)[:5].tolist()
        logger.warning(
            "the advantage step dropped %d row(s) (rows %s%s): a reward or advantage that is not finite; they "
            "train with advantage 0, outside their group's mean and std",
            n,
            rows,
            ", ..." if n > len(rows) else "",
        )
    return n


def per_rollout_weights(members: Sequence[str] | np.ndarray) -> torch.Tensor:
    """``1/k`` (float32) for each row of a member (its rollout) that has ``k`` rows: its weight in its GRPO
    group's mean and std, so that a rollout is one member whatever its number of rows."""
    names = np.asarray(members, dtype=object).astype(str)
    _, member, counts = np.unique(names, return_inverse=True, return_counts=True)
    return torch.from_numpy((1.0 / counts)[member.reshape(-1)].astype(np.float32))


def _n_members(group: np.ndarray, members: np.ndarray | None, n_groups: int, kept: np.ndarray) -> np.ndarray:
    """How many distinct members each group has among its ``kept`` rows (every row one when ``members`` is
    ``None``)."""
    if members is None:
        return np.bincount(group[kept], minlength=n_groups)
    member = np.unique(members.astype(str), return_inverse=True)[1].reshape(-1)
    pairs = np.unique((group * (int(member.max()) + 1) + member)[kept])
    return np.bincount(pairs // (int(member.max()) + 1), minlength=n_groups)


def _row_weights(weights: torch.Tensor | None, n_rows: int, name: str) -> torch.Tensor:
    if weights is None:
        return torch.ones(n_rows, dtype=torch.float64)
    if weights.shape != (n_rows,):
        raise ValueError(f"{name} must have shape ({n_rows},), got {tuple(weights.shape)}")
    return weights.double()


def _check_rows(ok: torch.Tensor, what: str) -> None:
    """Raise ``ValueError`` saying ``what`` and naming the first rows (of a bool ``[B]``) that are not ``ok``."""
    if not bool(ok.all()):
        rows = torch.nonzero(~ok).reshape(-1)[:5].tolist()
        raise ValueError(f"{what}; rows {rows} are not")


def compute_advantage(
    data: DataProto,
    adv_estimator: Any,
    gamma: float = 1.0,
    lam: float = 1.0,
    num_repeat: int = 1,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
) -> DataProto:
    """Drop-in for verl's ``ray_trainer.compute_advantage`` on aglverl batches: sets ``advantages``/``returns``.

    For GRPO (``grpo``, ``grpo_vectorized``) it runs :func:`grpo_advantages` with the batch's ``uid``,
    ``group_weights``, ``advantage_weights`` and its rows' rollouts (``rollout_id_list``) as the group members:
    a rollout is one member whatever its number of rows, as ``AsyncVERL`` computes them (verl's GRPO when
    every rollout has one row and the weights are ones). Any other estimator is verl's own, over rows (as
    under ``AsyncVERL``: verl's estimators cannot weight group members), whose advantages are then multiplied
    by ``advantage_weights``. A batch without the weight tensors (not built by aglverl) gets verl's result
    unchanged.

    One row's reward never stops the step: a row whose rewards or advantage are not finite is dropped (GRPO:
    out of its group's mean and std; verl's estimators: its reward read as 0), its advantage and return 0, with
    a warning; ``meta_info[ROWS_DROPPED]`` counts them (a step metric).
    """
    estimator = str(getattr(adv_estimator, "value", adv_estimator))
    batch = data.batch
    group_weights = batch["group_weights"] if "group_weights" in batch.keys() else None
    advantage_weights = batch["advantage_weights"] if "advantage_weights" in batch.keys() else None
    if estimator in ("grpo", "grpo_vectorized"):
        advantages, dropped = _grpo(
            batch["token_level_rewards"],
            batch["response_mask"],
            data.non_tensor_batch["uid"],
            group_weights,
            advantage_weights,
            members=data.non_tensor_batch.get("rollout_id_list"),
            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
            epsilon=GRPO_EPSILON,
        )
        batch["advantages"] = advantages
        batch["returns"] = advantages.clone()
    else:
        data, dropped = _verl_advantage(
            data, adv_estimator, gamma, lam, num_repeat, norm_adv_by_std_in_grpo, config
        )
    data.meta_info[ROWS_DROPPED] = _warn_dropped(dropped)
    return data


def _verl_advantage(
    data: DataProto,
    adv_estimator: Any,
    gamma: float,
    lam: float,
    num_repeat: int,
    norm_adv_by_std_in_grpo: bool,
    config: Any,
) -> tuple[DataProto, torch.Tensor]:
    """verl's own estimator (rows whose rewards are not finite read as 0), then ``advantage_weights``; the rows
    dropped (bool ``[B]``) have advantage and return 0."""
    from verl.trainer.ppo.ray_trainer import compute_advantage as verl_compute_advantage

    rewards = data.batch["token_level_rewards"]
    unusable = ~torch.isfinite(rewards).all(dim=-1)
    if bool(unusable.any()):
        data.batch["token_level_rewards"] = rewards.masked_fill(unusable.unsqueeze(-1), 0.0)
    data = verl_compute_advantage(
        data,
        adv_estimator=adv_estimator,
        gamma=gamma,
        lam=lam,
        num_repeat=num_repeat,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        config=config,
    )
    batch = data.batch
    if "advantage_weights" in batch.keys():
        batch["advantages"] = batch["advantages"] * batch["advantage_weights"].unsqueeze(-1)
    dropped = unusable | ~torch.isfinite(batch["advantages"]).all(dim=-1)
    if "returns" in batch.keys():
        dropped |= ~torch.isfinite(batch["returns"]).all(dim=-1)
        batch["returns"] = batch["returns"].masked_fill(dropped.unsqueeze(-1), 0.0)
    batch["advantages"] = batch["advantages"].masked_fill(dropped.unsqueeze(-1), 0.0)
    return data, dropped


# ---------------------------------------------------------------------------------------------- log-probs
def logprob_mismatch(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
) -> dict[str, float]:
    """How far the trainer's recomputed log-probs are from the engine's, over the response tokens (of the
    rows where ``rows``, a bool ``[B]``, is true; ``None``: every row).

    ``logprobs/abs_diff_mean`` and ``logprobs/abs_diff_max`` of ``old - rollout``; ``logprobs/k3_kl``, the k3
    estimator of KL(rollout || trainer), mean of ``exp(d) - d - 1`` with ``d = old - rollout`` (0 when they
    agree, always >= 0); ``logprobs/n_tokens`` counted. With no response token every value is 0.0. Raises
    ``ValueError`` naming the tensor whose shape differs from ``old_log_probs``'.
    """
    for name, value in (("rollout_log_probs", rollout_log_probs), ("response_mask", response_mask)):
        if value.shape != old_log_probs.shape:
            raise ValueError(
                f"{name} has shape {tuple(value.shape)}, old_log_probs {tuple(old_log_probs.shape)}"
            )
    mask = response_mask.bool()
    if rows is not None:
        if rows.shape != old_log_probs.shape[:1]:
            raise ValueError(
                f"rows has shape {tuple(rows.shape)}, old_log_probs {tuple(old_log_probs.shape)}"
            )
        mask = mask & rows.bool().unsqueeze(-1)
    diff = (old_log_probs.double() - rollout_log_probs.double())[mask]
    if not diff.numel():
        return {
            "logprobs/abs_diff_mean": 0.0,
            "logprobs/abs_diff_max": 0.0,
            "logprobs/k3_kl": 0.0,
            "logprobs/n_tokens": 0.0,
        }
    return {
        "logprobs/abs_diff_mean": float(diff.abs().mean()),
        "logprobs/abs_diff_max": float(diff.abs().max()),
        "logprobs/k3_kl": float((torch.expm1(diff) - diff).mean()),
        "logprobs/n_tokens": float(diff.numel()),
    }


def stand_in_logprobs(
    rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """Give the rows that came without the engine's log-probs (``valid`` 0) the trainer's ``old_log_probs`` as
    their ``rollout_log_probs``, in place: such a row counts as on-policy. Returns which rows (bool ``[B]``)."""
    missing = valid == 0
    if bool(missing.any()):
        rollout_log_probs[missing] = old_log_probs[missing]
    return missing
