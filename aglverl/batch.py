"""Turn finished rollouts into one padded verl :class:`~verl.DataProto`: pure, vectorised, no I/O.

Each triplet (one LLM call) of a rollout becomes one row::

    prompts         [B, P]    left-padded; a longer prompt keeps its LAST P ids and is marked is_drop_mask
    responses       [B, R]    right-padded; a longer response keeps its FIRST R ids
    input_ids       [B, P+R]  cat(prompts, responses)
    attention_mask  [B, P+R]  1 on real tokens, 0 on pads            response_mask [B, R]: its response part
    position_ids    [B, P+R]  clamp(cumsum(attention_mask) - 1, min=0)
    is_drop_mask    [B]       bool: the row must not train (its prompt was cut, or its call was off-policy)
    token_level_scores [B, R] float32: the rollout's final reward on the last real response token

and the non-tensor batch carries ``data_id_list`` / ``uid`` (the GRPO group), ``rollout_id_list`` and
``turn_index_list``. A triplet with an empty response has no token to carry its reward, so it is dropped and
counted rather than silently losing the reward.

Given a :class:`~aglverl.signals.SignalConfig` (the collector always passes one), the training-signal controls
decide which rollouts and turns become rows, each row's score and ``uid`` (see :mod:`aglverl.signals`), and
the batch also carries::

    advantage_weights  [B]     float32: the row's weight in the loss (1, or 1/k for a k-row rollout)
    group_weights      [B]     float32: the row's weight in its group's mean/std (idem)
    rollout_log_probs  [B, R]  float32: the engine's logprob of each response token, 0 on pads; only when
                               every row has them (``logprobs/present``), the key verl's rollout correction reads

No Python code runs per token. The only Python-level loops run once per rollout or per triplet: reading
rewards and lengths, and unboxing each row's ids, which ``struct`` packs in C straight to the row's
destination offset (computed for the whole batch); padding, truncation lengths, masks, positions and reward
placement are whole-batch numpy index arithmetic, and the tensors are ``torch.from_numpy`` views (no copies).
Importing this module imports verl (about 4 s), which is why the daemon imports it when it starts rather
than on the first batch.
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view
from verl import DataProto

from .signals import FAILURE_REASONS, RowPlan, SignalConfig, plan_rows, reason_flags, turn_layout

__all__ = ["BatchConfig", "FinishedRollout", "MissingRewardError", "build_batch"]

_ID_BYTES = 8  # int64 (and float64, for logprobs)


@dataclass(frozen=True, slots=True)
class BatchConfig:
    """How rollouts are shaped into a batch.

    ``max_prompt_length`` / ``max_response_length`` are the padded widths P and R; ``pad_token_id`` fills
    the pads; ``reward_fill_value`` replaces a missing final reward (``None``: a rollout without a reward is
    an error, :class:`MissingRewardError`).

    Bad values raise at construction: ``TypeError`` for a wrong type, ``ValueError`` for a length that is not
    positive, a negative pad id or a non-finite fill value; both messages name the field.
    """

    max_prompt_length: int = 1024
    max_response_length: int = 1024
    pad_token_id: int = 0
    reward_fill_value: float | None = 0.0

    def __post_init__(self) -> None:
        for name in ("max_prompt_length", "max_response_length", "pad_token_id"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"BatchConfig.{name} must be an int, got {type(value).__name__}")
        if self.max_prompt_length <= 0:
            raise ValueError(f"BatchConfig.max_prompt_length must be positive, got {self.max_prompt_length}")
        if self.max_response_length <= 0:
            raise ValueError(
                f"BatchConfig.max_response_length must be positive, got {self.max_response_length}"
            )
        if self.pad_token_id < 0:
            raise ValueError(f"BatchConfig.pad_token_id must be >= 0, got {self.pad_token_id}")
        fill = self.reward_fill_value
        if fill is not None:
            if isinstance(fill, bool) or not isinstance(fill, (int, float)):
                raise TypeError(
                    f"BatchConfig.reward_fill_value must be a float or None, got {type(fill).__name__}"
                )
            if not math.isfinite(fill):
                raise ValueError(f"BatchConfig.reward_fill_value must be finite, got {fill}")


class MissingRewardError(ValueError):
    """A rollout has no final reward and ``BatchConfig.reward_fill_value`` is ``None``."""

    def __init__(self, rollout_id: str) -> None:
        super().__init__(
            f"rollout {rollout_id!r} has no final reward and BatchConfig.reward_fill_value is None"
        )
        self.rollout_id = rollout_id


@dataclass(frozen=True, slots=True)
class FinishedRollout:
    """One finished rollout as the collector hands it over.

    ``data_id`` is the GRPO group: all ``n`` rollouts of one sample share it. ``reward`` is the final
    reward (``None``: not reported). ``turns`` holds one ``(prompt token ids, response token ids)`` pair
    per triplet, in the order the calls were made; any sequences of ints (lists, tuples, numpy arrays).
    Values are trusted to be what the wire models validated (ids non-negative, rewards finite); an id that
    is not an integer in the int64 range makes :func:`build_batch` raise ``ValueError`` naming the turn.

    What the training-signal controls read (ignored without a :class:`~aglverl.signals.SignalConfig`):
    ``completed`` is false for a rollout that failed (its ``turns`` are its last attempt's calls, its reward is
    the config's ``failure_reward``); ``termination`` holds the reasons recorded for it (a failed rollout
    without a failure reason counts as ``agent_error``); ``turn_rewards`` the agent's reward per turn (``None``
    entries, or ``None`` for all: none given); ``logprobs`` the engine's logprobs per turn, aligned with the
    response ids (``None`` entries, or a length that differs from the response's: not available).
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


def build_batch(
    rollouts: Sequence[FinishedRollout], config: BatchConfig, signal: SignalConfig | None = None
) -> tuple[DataProto, dict[str, float]]:
    """Build the training batch for ``rollouts`` (one row per triplet) and its ``batch/*`` metrics.

    Rows follow the order of ``rollouts`` and, within a rollout, of its turns. Triplets with an empty
    response are dropped (``batch/n_empty_responses_dropped``); a rollout without triplets contributes no
    rows (``batch/n_rollouts_without_triplets``); a missing reward is replaced by
    ``config.reward_fill_value`` (``batch/n_rewards_filled``) or raises :class:`MissingRewardError` naming
    the first such rollout when that is ``None``. A token id that is not an integer in the int64 range
    raises ``ValueError`` naming the rollout and turn. When no row is left the DataProto still has every
    tensor, with a leading dimension of 0. The inputs are never modified; every tensor has its own storage.

    Metrics (floats): counts of completed rollouts, those without triplets, rows (``n_triplets``, always the
    batch's length), dropped empty responses, truncated prompts and responses, off-policy rows (those two
    are the rows marked ``is_drop_mask``), filled rewards; the mean final reward over completed rollouts after filling; mean prompt / response
    length of the rows after truncation (each 0.0 when there is nothing to average).

    Without ``signal``, failed rollouts (``completed=False``) are left out and every other turn with a
    response is a row, as plain GRPO batches always were. With it, :func:`aglverl.signals.plan_rows` picks the
    rows, scores and groups (its ``filter/*`` and ``rejection/*`` metrics are added), the batch gains
    ``advantage_weights`` and ``group_weights``, and ``rollout_log_probs`` when every row has the engine's
    logprobs (``logprobs/present``, ``logprobs/n_rows_missing``).
    """
    if signal is None:
        rollouts = [r for r in rollouts if r.completed]
    else:
        _check_per_turn(rollouts)
    P, R = config.max_prompt_length, config.max_response_length
    completed = np.fromiter((r.completed for r in rollouts), bool, count=len(rollouts))
    rewards, n_filled = _final_rewards(rollouts, config.reward_fill_value, signal)
    n_turns = np.fromiter((len(r.turns) for r in rollouts), np.int64, count=len(rollouts))
    turns = list(itertools.chain.from_iterable(r.turns for r in rollouts))
    prompts = [t[0] for t in turns]
    responses = [t[1] for t in turns]
    prompt_len = np.fromiter(map(len, prompts), np.int64, count=len(turns))
    response_len = np.fromiter(map(len, responses), np.int64, count=len(turns))
    turn_rollout, turn_index = turn_layout(n_turns)
    data_ids = np.fromiter((r.data_id for r in rollouts), object, count=len(rollouts))

    if signal is None:
        kept = np.flatnonzero(response_len > 0)
        no_rows = np.zeros(0, np.float32)
        plan = RowPlan(
            kept, rewards[turn_rollout[kept]], data_ids[turn_rollout[kept]], no_rows, no_rows, ~completed, {}
        )
    else:
        plan = plan_rows(
            data_ids=data_ids,
            rewards=rewards,
            flags=_reason_flags(rollouts),
            n_turns=n_turns,
            response_len=response_len,
            turn_rewards=_turn_rewards(rollouts, len(turns)),
            max_response_length=R,
            config=signal,
        )
    n_empty = np.count_nonzero(~plan.masked[turn_rollout] & (response_len == 0))
    kept = plan.rows
    row_rollout, row_turn = turn_rollout[kept], turn_index[kept]
    prompt_len, full_response_len = prompt_len[kept], response_len[kept]
    prompt_cut, response_cut = prompt_len > P, full_response_len > R
    off_policy = _off_policy(rollouts, len(turns))[kept]
    prompt_len, response_len = np.minimum(prompt_len, P), np.minimum(full_response_len, R)

    def where(turn: int) -> str:
        return f"rollout {rollouts[turn_rollout[turn]].rollout_id!r} turn {turn_index[turn]}"

    pad = config.pad_token_id
    prompt_ids = _pack(prompts, kept, prompt_len, P, pad, keep_last=True, where=where)
    response_ids = _pack(responses, kept, response_len, R, pad, keep_last=False, where=where)
    prompt_mask, response_mask, position_ids = _layout(prompt_len, response_len, P, R)
    scores = np.zeros((len(kept), R), np.float32)
    scores[np.arange(len(kept)), response_len - 1] = plan.scores

    tensors = {
        "prompts": prompt_ids,
        "responses": response_ids,
        "input_ids": np.concatenate([prompt_ids, response_ids], axis=1),
        "attention_mask": np.concatenate([prompt_mask, response_mask], axis=1, dtype=np.int64),
        "response_mask": response_mask.astype(np.int64),
        "position_ids": position_ids,
        "is_drop_mask": prompt_cut | off_policy,
        "token_level_scores": scores,
    }
    metrics = dict(plan.metrics)
    if signal is not None:
        tensors["advantage_weights"] = plan.advantage_weights
        tensors["group_weights"] = plan.group_weights
        turn_logprobs = list(itertools.chain.from_iterable(_logprobs_of(r) for r in rollouts))
        logprobs, metrics["logprobs/n_rows_missing"] = _rollout_log_probs(
            turn_logprobs, kept, full_response_len, response_len, R, where
        )
        metrics["logprobs/present"] = float(logprobs is not None)
        if logprobs is not None:
            tensors["rollout_log_probs"] = logprobs
    rollout_ids = np.fromiter((r.rollout_id for r in rollouts), object, count=len(rollouts))
    non_tensors = {
        "data_id_list": data_ids[row_rollout],
        "uid": plan.uid.astype(object),
        "rollout_id_list": rollout_ids[row_rollout],
        "turn_index_list": row_turn.astype(object),
    }
    metrics |= {
        "batch/n_rollouts": float(np.count_nonzero(completed)),
        "batch/n_rollouts_without_triplets": float(np.count_nonzero(completed & (n_turns == 0))),
        "batch/n_triplets": float(len(kept)),
        "batch/n_empty_responses_dropped": float(n_empty),
        "batch/n_prompts_truncated": float(np.count_nonzero(prompt_cut)),
        "batch/n_rows_off_policy": float(np.count_nonzero(off_policy)),
        "batch/n_responses_truncated": float(np.count_nonzero(response_cut)),
        "batch/n_rewards_filled": float(n_filled),
        "batch/reward_mean": _mean(rewards[completed]),
        "batch/prompt_length_mean": _mean(prompt_len),
        "batch/response_length_mean": _mean(response_len),
    }
    batch = DataProto.from_dict(
        tensors={k: torch.from_numpy(v) for k, v in tensors.items()}, non_tensors=non_tensors, meta_info={}
    )
    return batch, metrics


def _final_rewards(
    rollouts: Sequence[FinishedRollout], fill: float | None, signal: SignalConfig | None
) -> tuple[np.ndarray, int]:
    """Each rollout's final reward: its own, else ``fill`` (counted); a failed one's is the config's
    ``failure_reward``. Raises :class:`MissingRewardError` for a completed rollout without one if ``fill`` is
    ``None``."""
    rewards = np.empty(len(rollouts), np.float64)
    n_filled = 0
    for i, rollout in enumerate(rollouts):
        if not rollout.completed and signal is not None:
            rewards[i] = signal.failure_reward
        elif rollout.reward is not None:
            rewards[i] = rollout.reward
        elif fill is None:
            raise MissingRewardError(rollout.rollout_id)
        else:
            rewards[i] = fill
            n_filled += 1
    return rewards, n_filled


def _check_per_turn(rollouts: Sequence[FinishedRollout]) -> None:
    """Raise ``ValueError`` naming the first rollout whose per-turn rewards or logprobs are not one per turn."""
    for r in rollouts:
        for name, values in (("turn_rewards", r.turn_rewards), ("logprobs", r.logprobs), ("off_policy", r.off_policy)):
            if values is not None and len(values) != len(r.turns):
                raise ValueError(
                    f"rollout {r.rollout_id!r} has {len(r.turns)} turns but {len(values)} {name}"
                )


def _reason_flags(rollouts: Sequence[FinishedRollout]) -> np.ndarray:
    """The recorded reasons of each rollout as :data:`~aglverl.signals.REASON_BITS`; a failed rollout that
    names no failure reason counts as an agent error."""
    failure = reason_flags(FAILURE_REASONS)
    flags = np.fromiter((reason_flags(r.termination) for r in rollouts), np.int64, count=len(rollouts))
    completed = np.fromiter((r.completed for r in rollouts), bool, count=len(rollouts))
    unnamed = ~completed & ((flags & failure) == 0)
    flags[unnamed] |= reason_flags(("agent_error",))
    return flags


def _turn_rewards(rollouts: Sequence[FinishedRollout], n_turns: int) -> np.ndarray:
    """Every turn's own reward, NaN where the agent gave none."""
    per_turn = (
        (math.nan if v is None else v for v in r.turn_rewards)
        if r.turn_rewards is not None
        else (math.nan,) * len(r.turns)
        for r in rollouts
    )
    return np.fromiter(itertools.chain.from_iterable(per_turn), np.float64, count=n_turns)


def _off_policy(rollouts: Sequence[FinishedRollout], n_turns: int) -> np.ndarray:
    """Every turn's off-policy flag (False where none was given)."""
    flags = (r.off_policy if r.off_policy is not None else (False,) * len(r.turns) for r in rollouts)
    return np.fromiter(itertools.chain.from_iterable(flags), bool, count=n_turns)


def _logprobs_of(rollout: FinishedRollout) -> Sequence[Sequence[float] | None]:
    return rollout.logprobs if rollout.logprobs is not None else (None,) * len(rollout.turns)


def _rollout_log_probs(
    turn_logprobs: Sequence[Sequence[float] | None],
    rows: np.ndarray,
    full_len: np.ndarray,
    kept_len: np.ndarray,
    width: int,
    where: Callable[[int], str],
) -> tuple[np.ndarray | None, float]:
    """``rollout_log_probs`` for ``rows`` (float32, zeros on pads), or ``None`` unless every row has logprobs
    aligned with its response (and there is a row); and how many rows lack them."""
    aligned = np.fromiter(
        (
            turn_logprobs[row] is not None and len(turn_logprobs[row]) == n
            for row, n in zip(rows.tolist(), full_len.tolist(), strict=True)
        ),
        bool,
        count=len(rows),
    )
    missing = float(len(rows) - np.count_nonzero(aligned))
    if missing or not len(rows):
        return None, missing
    values = _pack(
        turn_logprobs,
        rows,
        kept_len,
        width,
        0,
        keep_last=False,
        where=where,
        fmt="d",
        what="logprobs must be numbers",
    )
    return values.astype(np.float32), missing


def _pack(
    seqs: Sequence[Any],
    rows: np.ndarray,
    lengths: np.ndarray,
    width: int,
    pad: int,
    *,
    keep_last: bool,
    where: Callable[[int], str],
    fmt: Literal["q", "d"] = "q",
    what: str | None = None,
) -> np.ndarray:
    """``seqs[rows]`` as int64 (``fmt="q"``) or float64 (``"d"``) rows of ``width``: left-padded when
    ``keep_last``, else right-padded.

    ``lengths`` are the already truncated lengths; a longer sequence keeps its last (``keep_last``) or first
    ``lengths[i]`` values, and the values it loses are never converted. Raises ``ValueError`` naming the turn
    (via ``where``) and ``what`` was wrong when a value is not an integer in the int64 range (not a number).
    """
    dtype = np.int64 if fmt == "q" else np.float64
    out = np.zeros((len(rows), width), dtype) if pad == 0 else np.full((len(rows), width), pad, dtype)
    offsets = np.arange(len(rows), dtype=np.int64) * width
    if keep_last:
        offsets += width - lengths
    # The one unavoidable per-row loop: unboxing Python ints. struct packs a list straight into its place
    # in the padded array (destinations computed above for the whole batch), about 1.5x faster than
    # np.fromiter into a flat array that must then be scattered.
    buffer, byte_offsets = out.reshape(-1).view(np.uint8).data, (offsets * _ID_BYTES).tolist()
    for row, n_ids, offset in zip(rows.tolist(), lengths.tolist(), byte_offsets, strict=True):
        seq = seqs[row]
        if len(seq) > n_ids:
            seq = seq[len(seq) - n_ids :] if keep_last else seq[:n_ids]
        try:
            struct.pack_into(f"{n_ids}{fmt}", buffer, offset, *seq)
        except struct.error as exc:
            what = what or f"{'prompt' if keep_last else 'response'} token ids must be int64 integers"
            raise ValueError(f"{where(row)}: {what} ({exc})") from None
    return out


def _layout(
    prompt_len: np.ndarray, response_len: np.ndarray, P: int, R: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prompt mask, response mask (both bool) and position ids of rows with these (truncated) lengths.

    Every response length must be at least 1 (rows with empty responses were dropped before).

    Each row is a window, shifted by the row's length, of one template row, so each array comes out of a
    single gather instead of several whole-batch arithmetic passes: the template stays in cache, and this
    measured about twice as fast as comparisons, or a cumsum, over the batch.
    """
    # Window k of [0]*P + [1]*P has P-k zeros then k ones; window k of [1]*R + [0]*R has R-k ones.
    prompt_mask = sliding_window_view(np.repeat(np.array([False, True]), P), P)[prompt_len]
    response_mask = sliding_window_view(np.repeat(np.array([True, False]), R), R)[R - response_len]
    # Window k of [0]*P + [0, 1, ..., P+R-1] is clamp(column - (P - k), min=0): the cumsum-minus-one of a
    # row whose prompt has k tokens, up to its last response token; the pads after it repeat that position.
    ramp = np.concatenate([np.zeros(P, np.int64), np.arange(P + R, dtype=np.int64)])
    position_ids = sliding_window_view(ramp, P + R)[prompt_len]
    np.minimum(position_ids[:, P:], (prompt_len + response_len - 1)[:, None], out=position_ids[:, P:])
    return prompt_mask, response_mask, position_ids


def _mean(values: np.ndarray) -> float:
    return float(values.mean()) if len(values) else 0.0
