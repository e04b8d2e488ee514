"""Jagged training rows padded into one verl :class:`~verl.DataProto`: the collector's batches. Pure, no I/O.

:func:`build_batch` is :func:`aglverl.trajectory.rows.build_rows` (which calls make each row, what it carries:
the rules are there) followed by :func:`pad_rows`; only this path pads (the producer's sink files the rows as
they are). It asks for rows laid out padded to the widths (``padded=True``: each id packed once, straight to
its padded place), so its prompts, responses and masks are reshapes; jagged rows are scattered into place. The rows of a batch of ``B`` rows, with ``P``/``R`` the config's ``max_prompt_length`` /
``max_response_length``::

    prompts         [B, P]    left-padded; a longer prompt keeps its LAST P ids and is marked is_drop_mask
    responses       [B, R]    right-padded; r1 + d2 + r2 + ... (a single longer call keeps its FIRST R ids)
    input_ids       [B, P+R]  cat(prompts, responses)
    attention_mask  [B, P+R]  1 on real tokens, 0 on pads
    response_mask   [B, R]    1 on the ids the engine generated for calls that train, 0 between calls and on pads
    position_ids    [B, P+R]  clamp(cumsum(attention_mask) - 1, min=0)
    is_drop_mask    [B]       bool: the row must not train (its prompt was cut, or no call of it is on-policy)
    token_level_scores [B, R] float32: the row's score on its last real response token

and the non-tensor batch carries ``data_id_list`` / ``uid`` (the GRPO group), ``rollout_id_list`` and
``turn_index_list`` (the row's first call). Given a :class:`~aglverl.trajectory.signals.SignalConfig` (the
collector always passes one) the batch also carries::

    advantage_weights  [B]     float32: the row's weight in the loss (1, or 1/k for a k-row rollout with
                               turn_weighting="per_rollout")
    group_weights      [B]     float32: the row's weight in its group's mean/std (1/k for a k-row rollout:
                               one member of its group; 1 in per_step's per-turn groups)
    rollout_log_probs  [B, R]  float32: the engine's logprob of each response token, 0 on pads; only when
                               every row has them (``logprobs/present``), the key verl's rollout correction reads

Padding is whole-batch numpy: each row is a window, shifted by its length, of one template row (masks and
positions in one gather each), jagged ids go to their places with one boolean-mask assignment per array,
and the tensors are ``torch.from_numpy`` views of arrays of their own (no copies, no two sharing storage).
Importing this module imports verl (about 4 s), which is why the daemon imports it when it starts rather
than on the first batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view
from verl import DataProto

from .rollouts import FinishedRollout, MissingRewardError
from .rows import BatchConfig, Rows, build_rows
from .signals import SignalConfig

__all__ = ["BatchConfig", "FinishedRollout", "MissingRewardError", "build_batch", "pad_rows"]


def build_batch(
    rollouts: Sequence[FinishedRollout], config: BatchConfig, signal: SignalConfig | None = None
) -> tuple[DataProto, dict[str, float]]:
    """Build the training batch for ``rollouts`` (one row per chain of calls, see
    :func:`aglverl.trajectory.rows.build_rows` for the rows, their errors and metrics) and its metrics.

    Rows follow the order of ``rollouts`` and, within a rollout, of their first calls. When no row is left the
    DataProto still has every tensor, with a leading dimension of 0. The inputs are never modified; every
    tensor has its own storage.
    """
    rows = build_rows(rollouts, config, signal, padded=True)
    return pad_rows(rows, config), rows.metrics


def pad_rows(rows: Rows, config: BatchConfig) -> DataProto:
    """``rows`` as one padded ``DataProto`` of ``config``'s widths (see the module docstring); ``rows`` must
    have been built with the same widths (no row is longer). Rows built ``padded=True`` with the same
    ``config`` lend their arrays to the batch's tensors (the batch owns them from then on)."""
    P, R, pad = config.max_prompt_length, config.max_response_length, config.pad_token_id
    prompt_mask, real_response, position_ids = _layout(rows.prompt_len, rows.response_len, P, R)
    if rows.is_padded(config):
        B = len(rows)
        prompts, responses = rows.prompt_ids.reshape(B, P), rows.response_ids.reshape(B, R)
        response_mask = rows.response_mask.reshape(B, R)
        logprobs = None if rows.logprobs is None else rows.logprobs.reshape(B, R)
    else:
        prompts = _padded(rows.prompt_ids, prompt_mask, pad, np.int64)
        responses = _padded(rows.response_ids, real_response, pad, np.int64)
        response_mask = _padded(rows.response_mask, real_response, 0, np.int64)
        logprobs = None if rows.logprobs is None else _padded(rows.logprobs, real_response, 0, np.float32)
    scores = np.zeros((len(rows), R), np.float32)
    scores[np.arange(len(rows)), rows.response_len - 1] = rows.scores
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": np.concatenate([prompts, responses], axis=1),
        "attention_mask": np.concatenate([prompt_mask, real_response], axis=1, dtype=np.int64),
        "response_mask": response_mask,
        "position_ids": position_ids,
        "is_drop_mask": rows.is_drop.copy(),
        "token_level_scores": scores,
    }
    if rows.advantage_weights is not None and rows.group_weights is not None:
        tensors["advantage_weights"] = rows.advantage_weights.copy()
        tensors["group_weights"] = rows.group_weights.copy()
    if logprobs is not None and rows.metrics.get("logprobs/present"):
        tensors["rollout_log_probs"] = logprobs
    non_tensors = {
        "data_id_list": rows.data_id,
        "uid": rows.uid,
        "rollout_id_list": rows.rollout_id,
        "turn_index_list": rows.turn_index.astype(object),
    }
    return DataProto.from_dict(
        tensors={k: torch.from_numpy(v) for k, v in tensors.items()}, non_tensors=non_tensors, meta_info={}
    )


def _padded(flat: np.ndarray, real: np.ndarray, pad: int, dtype: type) -> np.ndarray:
    """The jagged ``flat`` values in a padded array shaped like ``real``, at its true places (row-major: each
    row's values in order), ``pad`` elsewhere."""
    out: np.ndarray = np.zeros(real.shape, dtype) if pad == 0 else np.full(real.shape, pad, dtype)
    out[real] = flat
    return out


def _layout(
    prompt_len: np.ndarray, response_len: np.ndarray, P: int, R: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prompt mask, response mask (both bool: the real ids' places) and position ids of rows with these
    (truncated) lengths.

    Every response length must be at least 1 (rows have a response).

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
