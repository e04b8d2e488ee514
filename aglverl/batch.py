"""Turn finished rollouts into one padded verl :class:`~verl.DataProto`: pure, vectorised, no I/O.

Each triplet (one LLM call) of a rollout becomes one row::

    prompts         [B, P]    left-padded; a longer prompt keeps its LAST P ids and is marked is_drop_mask
    responses       [B, R]    right-padded; a longer response keeps its FIRST R ids
    input_ids       [B, P+R]  cat(prompts, responses)
    attention_mask  [B, P+R]  1 on real tokens, 0 on pads            response_mask [B, R]: its response part
    position_ids    [B, P+R]  clamp(cumsum(attention_mask) - 1, min=0)
    is_drop_mask    [B]       bool
    token_level_scores [B, R] float32: the rollout's final reward on the last real response token

and the non-tensor batch carries ``data_id_list`` / ``uid`` (the GRPO group), ``rollout_id_list`` and
``turn_index_list``. A triplet with an empty response has no token to carry its reward, so it is dropped and
counted rather than silently losing the reward.

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

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view
from verl import DataProto

__all__ = ["BatchConfig", "FinishedRollout", "MissingRewardError", "build_batch"]

_ID_BYTES = 8  # int64


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
    """

    rollout_id: str
    data_id: str
    reward: float | None
    turns: Sequence[tuple[Sequence[int], Sequence[int]]]


def build_batch(
    rollouts: Sequence[FinishedRollout], config: BatchConfig
) -> tuple[DataProto, dict[str, float]]:
    """Build the training batch for ``rollouts`` (one row per triplet) and its ``batch/*`` metrics.

    Rows follow the order of ``rollouts`` and, within a rollout, of its turns. Triplets with an empty
    response are dropped (``batch/n_empty_responses_dropped``); a rollout without triplets contributes no
    rows (``batch/n_rollouts_without_triplets``); a missing reward is replaced by
    ``config.reward_fill_value`` (``batch/n_rewards_filled``) or raises :class:`MissingRewardError` naming
    the first such rollout when that is ``None``. A token id that is not an integer in the int64 range
    raises ``ValueError`` naming the rollout and turn. When no row is left the DataProto still has every
    tensor, with a leading dimension of 0. The inputs are never modified; every tensor has its own storage.

    Metrics (floats): counts of rollouts, rollouts without triplets, rows (``n_triplets``), dropped empty
    responses, truncated prompts (= rows with ``is_drop_mask``) and responses, filled rewards; the mean final
    reward over rollouts after filling; mean prompt / response length of the rows after truncation (each
    0.0 when there is nothing to average).
    """
    P, R = config.max_prompt_length, config.max_response_length
    rewards, n_filled = _final_rewards(rollouts, config.reward_fill_value)
    n_turns = np.fromiter((len(r.turns) for r in rollouts), np.int64, count=len(rollouts))
    turns = list(itertools.chain.from_iterable(r.turns for r in rollouts))
    prompts = [t[0] for t in turns]
    responses = [t[1] for t in turns]
    prompt_len = np.fromiter(map(len, prompts), np.int64, count=len(turns))
    response_len = np.fromiter(map(len, responses), np.int64, count=len(turns))

    kept = np.flatnonzero(response_len > 0)
    turn_rollout = np.repeat(np.arange(len(rollouts)), n_turns)
    turn_index = np.arange(len(turns)) - np.repeat(np.cumsum(n_turns) - n_turns, n_turns)
    row_rollout, row_turn = turn_rollout[kept], turn_index[kept]
    prompt_len, response_len = prompt_len[kept], response_len[kept]
    prompt_cut, response_cut = prompt_len > P, response_len > R
    prompt_len, response_len = np.minimum(prompt_len, P), np.minimum(response_len, R)

    def where(turn: int) -> str:
        return f"rollout {rollouts[turn_rollout[turn]].rollout_id!r} turn {turn_index[turn]}"

    pad = config.pad_token_id
    prompt_ids = _pack(prompts, kept, prompt_len, P, pad, keep_last=True, where=where)
    response_ids = _pack(responses, kept, response_len, R, pad, keep_last=False, where=where)
    prompt_mask, response_mask, position_ids = _layout(prompt_len, response_len, P, R)
    scores = np.zeros((len(kept), R), np.float32)
    scores[np.arange(len(kept)), response_len - 1] = rewards[row_rollout]

    tensors = {
        "prompts": prompt_ids,
        "responses": response_ids,
        "input_ids": np.concatenate([prompt_ids, response_ids], axis=1),
        "attention_mask": np.concatenate([prompt_mask, response_mask], axis=1, dtype=np.int64),
        "response_mask": response_mask.astype(np.int64),
        "position_ids": position_ids,
        "is_drop_mask": prompt_cut,
        "token_level_scores": scores,
    }
    data_ids = np.fromiter((r.data_id for r in rollouts), object, count=len(rollouts))[row_rollout]
    rollout_ids = np.fromiter((r.rollout_id for r in rollouts), object, count=len(rollouts))[row_rollout]
    non_tensors = {
        "data_id_list": data_ids,
        "uid": data_ids.copy(),
        "rollout_id_list": rollout_ids,
        "turn_index_list": row_turn.astype(object),
    }
    metrics = {
        "batch/n_rollouts": float(len(rollouts)),
        "batch/n_rollouts_without_triplets": float(np.count_nonzero(n_turns == 0)),
        "batch/n_triplets": float(len(kept)),
        "batch/n_empty_responses_dropped": float(len(turns) - len(kept)),
        "batch/n_prompts_truncated": float(np.count_nonzero(prompt_cut)),
        "batch/n_responses_truncated": float(np.count_nonzero(response_cut)),
        "batch/n_rewards_filled": float(n_filled),
        "batch/reward_mean": _mean(rewards),
        "batch/prompt_length_mean": _mean(prompt_len),
        "batch/response_length_mean": _mean(response_len),
    }
    batch = DataProto.from_dict(
        tensors={k: torch.from_numpy(v) for k, v in tensors.items()}, non_tensors=non_tensors, meta_info={}
    )
    return batch, metrics


def _final_rewards(rollouts: Sequence[FinishedRollout], fill: float | None) -> tuple[np.ndarray, int]:
    rewards = np.empty(len(rollouts), np.float64)
    n_filled = 0
    for i, rollout in enumerate(rollouts):
        if rollout.reward is not None:
            rewards[i] = rollout.reward
        elif fill is None:
            raise MissingRewardError(rollout.rollout_id)
        else:
            rewards[i] = fill
            n_filled += 1
    return rewards, n_filled


def _pack(
    seqs: Sequence[Sequence[int]],
    rows: np.ndarray,
    lengths: np.ndarray,
    width: int,
    pad: int,
    *,
    keep_last: bool,
    where: Callable[[int], str],
) -> np.ndarray:
    """``seqs[rows]`` as int64 rows of ``width``: left-padded when ``keep_last``, else right-padded.

    ``lengths`` are the already truncated lengths; a longer sequence keeps its last (``keep_last``) or first
    ``lengths[i]`` ids, and the ids it loses are never converted. Raises ``ValueError`` naming the turn (via
    ``where``) when an id is not an integer in the int64 range.
    """
    out = np.zeros((len(rows), width), np.int64) if pad == 0 else np.full((len(rows), width), pad, np.int64)
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
            struct.pack_into(f"{n_ids}q", buffer, offset, *seq)
        except struct.error as exc:
            side = "prompt" if keep_last else "response"
            raise ValueError(f"{where(row)}: {side} token ids must be int64 integers ({exc})") from None
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
