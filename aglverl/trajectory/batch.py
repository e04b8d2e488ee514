"""Turn finished rollouts into one padded verl :class:`~verl.DataProto`: pure, vectorised, no I/O.

Rows are chains of calls (``SignalConfig.trajectory``, ``"merge"`` by default): a rollout's calls, in the
order they were made, form chains; call b continues a chain whose last call is a when b's prompt ids start with
exactly a's prompt ids + a's response ids. A chain is one row in verl's own agent-loop layout: ``prompts`` is its
first call's prompt, ``responses`` is ``r1 + d2 + r2 + ... + rk`` where ``r_i`` are the ids the engine generated
(``response_mask`` 1, their logprobs in ``rollout_log_probs``) and ``d_i`` the ids between two calls (tool
results, user turns, template tokens: ``response_mask`` 0, logprob 0), and the reward sits on the last generated
token. A call continues the chain whose last call it extends (the most recently continued one, if several do);
one that continues no chain (a branch, a parallel call, a rewritten history) starts a new chain; one whose
prompt starts with a chain's last prompt but not with its exact response ids (retokenization drift: the chat
template re-rendered the answer, the agent edited it) too, and is counted as drifted.

The width: a chain whose merged response would be longer than ``max_response_length`` is cut at call
boundaries into several rows; a later row's prompt is the exact conversation before its first call. A row
whose prompt fits ``max_prompt_length`` trains every id its calls generated; one whose prompt does not cannot
be trained faithfully (a prompt cut to its last ids is a context the model never saw): it is no row, and its
calls (and the chain's calls after it: prompts only grow) are counted in ``batch/n_calls_untrained_width`` and
``batch/n_generated_untrained_width``, with the widths that would train them (:attr:`BuiltBatch.untrained_needs`,
logged once per run by :class:`WidthWarning`). Of the cuts, the one that trains the most generated ids is taken,
then the one with the fewest rows, then the one whose rows start latest: when every row's prompt fits, each row
simply goes on while its calls fit. A single call longer than the width is cut to its first ids (the only
generated ids lost to the width in a row), and a chain's first row keeps a prompt longer than
``max_prompt_length`` as its last ids, marked ``is_drop_mask`` (as a lone call's). Every other call with a
response is in exactly one row.

A call recorded off-policy (its sampling parameters were masked) keeps ``response_mask`` 0 on its tokens; a row
with no on-policy call is marked ``is_drop_mask``. ``trajectory="per_call"`` (and no :class:`~aglverl.trajectory.signals.SignalConfig` at all) makes every
call its own row, as batches always were: the layout below is then one call per row, and an off-policy call's
row keeps its response mask and is marked ``is_drop_mask``.

The rows::

    prompts         [B, P]    left-padded; a longer prompt keeps its LAST P ids and is marked is_drop_mask
    responses       [B, R]    right-padded; a longer response keeps its FIRST R ids
    input_ids       [B, P+R]  cat(prompts, responses)
    attention_mask  [B, P+R]  1 on real tokens, 0 on pads            response_mask [B, R]: its response part
    position_ids    [B, P+R]  clamp(cumsum(attention_mask) - 1, min=0)
    is_drop_mask    [B]       bool: the row must not train (its prompt was cut, or its call was off-policy)
    token_level_scores [B, R] float32: the rollout's final reward on the last real response token

and the non-tensor batch carries ``data_id_list`` / ``uid`` (the GRPO group), ``rollout_id_list`` and
``turn_index_list`` (the row's first call). A triplet with an empty response has no token to carry its reward,
so it is dropped and counted rather than silently losing the reward (a merged chain simply continues past it).

Given a :class:`~aglverl.trajectory.signals.SignalConfig` (the collector always passes one), the training-signal controls
decide which rollouts and turns become rows, each row's score and ``uid`` (see :mod:`aglverl.trajectory.signals`), and
the batch also carries::

    advantage_weights  [B]     float32: the row's weight in the loss (1, or 1/k for a k-row rollout with
                               turn_weighting="per_rollout")
    group_weights      [B]     float32: the row's weight in its group's mean/std (1/k for a k-row rollout:
                               one member of its group; 1 in per_step's per-turn groups)
    rollout_log_probs  [B, R]  float32: the engine's logprob of each response token, 0 on pads; only when
                               every row has them (``logprobs/present``), the key verl's rollout correction reads

No Python code runs per token. The only Python-level loops run once per rollout or per triplet: reading
rewards and lengths, finding the chains (one C-level prefix comparison per call and open chain), cutting them
to the width (one pass per chain; only when a later row's prompt would not fit, a search over the chain's
calls and, for each, the calls after it that fit one row with it), and unboxing
each call's ids, which ``struct`` packs in C straight to their destination offset in the row (computed for the
whole batch); padding, truncation lengths, masks, positions and reward placement are whole-batch numpy index
arithmetic, and the tensors are ``torch.from_numpy`` views (no copies).
Importing this module imports verl (about 4 s), which is why the daemon imports it when it starts rather
than on the first batch.
"""

from __future__ import annotations

import itertools
import logging
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view
from verl import DataProto

from .signals import FAILURE_REASONS, RowPlan, SignalConfig, plan_rows, reason_flags, turn_layout

__all__ = [
    "BatchConfig",
    "BuiltBatch",
    "FinishedRollout",
    "MissingRewardError",
    "WidthWarning",
    "build_batch",
    "build_rows",
]

logger = logging.getLogger(__name__)

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

    What the training-signal controls read (ignored without a :class:`~aglverl.trajectory.signals.SignalConfig`):
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


@dataclass(frozen=True, slots=True)
class BuiltBatch:
    """:func:`build_rows`' result: the batch, its metrics, and which calls make each row.

    Per row (batch order): ``row_rollout`` (index into the rollouts given), ``row_calls`` (the turn indices of
    the row's calls, in order; the first is the row's ``turn_index_list``), ``logprobs`` (the engine's
    logprobs over the row's response, float32, 0 between calls; ``None`` unless every call of the row brought
    one finite logprob per response id).
    """

    data: DataProto
    metrics: dict[str, float]
    row_rollout: np.ndarray
    row_calls: list[list[int]]
    logprobs: list[np.ndarray | None]
    #: Each rollout's reasons (:data:`~aglverl.trajectory.signals.REASON_BITS`) that masked it, 0 if none.
    masked: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: The ``max_prompt_length`` / ``max_response_length`` that would have trained every call the width left
    #: untrained (``batch/n_calls_untrained_width``); (0, 0) when none was.
    untrained_needs: tuple[int, int] = (0, 0)


def build_batch(
    rollouts: Sequence[FinishedRollout], config: BatchConfig, signal: SignalConfig | None = None
) -> tuple[DataProto, dict[str, float]]:
    """Build the training batch for ``rollouts`` (one row per chain of calls, see the module docstring) and
    its ``batch/*`` metrics.

    Rows follow the order of ``rollouts`` and, within a rollout, of their first calls. Triplets with an empty
    response are dropped (``batch/n_empty_responses_dropped``); a rollout without triplets contributes no
    rows (``batch/n_rollouts_without_triplets``); a missing reward is replaced by
    ``config.reward_fill_value`` (``batch/n_rewards_filled``) or raises :class:`MissingRewardError` naming
    the first such rollout when that is ``None``. A token id that is not an integer in the int64 range
    raises ``ValueError`` naming the rollout and turn. When no row is left the DataProto still has every
    tensor, with a leading dimension of 0. The inputs are never modified; every tensor has its own storage.

    Metrics (floats): counts of completed rollouts, those without triplets, rows (``n_triplets`` and
    ``n_rows``, always the batch's length), the calls in them (``n_calls``), calls that continued a row
    (``n_calls_merged``), rows started at a call boundary for the width (``n_chains_split_width``), calls the
    width left untrained and their generated ids (``n_calls_untrained_width``, ``n_generated_untrained_width``:
    see the module docstring; of rollouts not masked), calls that drifted (``n_calls_drifted``, counted in
    either mode), the trainer tokens of the rows
    (``n_trainer_tokens``: prompt + response, after truncation) and what one row per call would have cost
    (``n_trainer_tokens_per_call``), dropped empty responses, truncated prompts and responses, off-policy
    rows (those two are the rows marked ``is_drop_mask``), filled rewards; the mean final reward over
    completed rollouts after filling; mean prompt / response length of the rows after truncation (each 0.0
    when there is nothing to average).

    Without ``signal``, failed rollouts (``completed=False``) are left out and every other turn with a
    response is a row, as plain GRPO batches always were. With it, :func:`aglverl.trajectory.signals.plan_rows` picks the
    rows, scores and groups (its ``filter/*`` and ``rejection/*`` metrics are added), the batch gains
    ``advantage_weights`` and ``group_weights`` (a rollout of k rows: 1/k each in its group, one member) and the
    non-tensor ``rollout_id_list`` names each GRPO group's members, and ``rollout_log_probs`` when every row has
    the engine's logprobs (``logprobs/present``, ``logprobs/n_rows_missing``).
    """
    built = build_rows(rollouts, config, signal)
    return built.data, built.metrics


class WidthWarning:
    """Says once (one per run: the collector and the producer each hold one) that calls of merged
    conversations were left untrained for the width, naming the settings that would train them.

    ``names`` are how the user sets ``max_prompt_length`` / ``max_response_length``: ``BatchConfig(...)``'s
    fields for an embedder, verl's ``data.*`` keys under ``AsyncVERL``. :meth:`note` is cheap when nothing was
    left untrained; it logs a warning (``aglverl.trajectory.batch``) the first time something was, and never again.
    """

    def __init__(
        self,
        config: BatchConfig,
        names: tuple[str, str] = ("BatchConfig.max_prompt_length", "BatchConfig.max_response_length"),
    ) -> None:
        self.config = config
        self.names = names
        self.warned = False

    def note(self, built: BuiltBatch) -> None:
        if self.warned or built.untrained_needs == (0, 0):
            return
        self.warned = True
        (prompt_name, response_name), (prompt_need, response_need) = self.names, built.untrained_needs
        metrics = built.metrics
        logger.warning(
            "%d calls (%d generated tokens) of merged conversations are not trained: the conversation is "
            "wider than %s=%d, and the row its later calls would start has a prompt (the conversation before "
            "them) longer than %s=%d; a prompt cut to its last ids is a context the model never saw. Set %s "
            ">= %d (those calls then start rows of their own) or %s >= %d (the conversation fits one row) to "
            "train them; counted per step in batch/n_calls_untrained_width and "
            "batch/n_generated_untrained_width (this warning is logged once)",
            int(metrics["batch/n_calls_untrained_width"]),
            int(metrics["batch/n_generated_untrained_width"]),
            response_name,
            self.config.max_response_length,
            prompt_name,
            self.config.max_prompt_length,
            prompt_name,
            prompt_need,
            response_name,
            response_need,
        )


def build_rows(
    rollouts: Sequence[FinishedRollout], config: BatchConfig, signal: SignalConfig | None = None
) -> BuiltBatch:
    """:func:`build_batch`, and which calls make each row (what a sink filing rows one by one needs)."""
    if signal is None:
        rollouts = [r for r in rollouts if r.completed]
    else:
        _check_per_turn(rollouts)
    merge = signal is not None and signal.trajectory == "merge"
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
    chains = _chains(rollouts, config, merge)

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
            row_starts=chains.head,
            in_rows=~chains.untrained,
        )
    unmasked = plan.masked[turn_rollout] == 0
    n_empty = np.count_nonzero(unmasked & (response_len == 0))
    untrained = unmasked & chains.untrained

    # The kept calls, row-major: rows in the order of their first calls, a row's calls in call order. A merged
    # row's calls are kept or dropped together: masking and group sizes act on whole rollouts, and rejection on
    # whole groups, which are rollouts' (per_step's per-turn groups only exist with per_call rows).
    order = np.argsort(chains.row[plan.rows], kind="stable")
    calls = plan.rows[order]
    row_of = np.unique(chains.row[calls], return_inverse=True)[1].reshape(-1)
    n_rows = int(row_of[-1]) + 1 if len(calls) else 0
    first = np.ones(len(calls), bool)
    first[1:] = row_of[1:] != row_of[:-1]
    heads = calls[first]
    off_policy_call = _off_policy(rollouts, len(turns))[calls]
    on_policy_rows = np.bincount(row_of[~off_policy_call], minlength=n_rows) > 0

    # Each call adds the ids between it and the row's previous call (none for a row's first call) and its
    # response; a lone call longer than the width is the only thing ever truncated.
    gap = np.where(first, 0, prompt_len[calls] - chains.gap_from[calls])
    full_piece = gap + response_len[calls]
    full_response_len = np.bincount(row_of, weights=full_piece, minlength=n_rows).astype(np.int64)
    # where each call's gap starts in its row: its offset in all rows' pieces laid end to end, less its row's
    starts = np.cumsum(full_piece) - full_piece
    offset_in_row = starts - starts[first][row_of]
    response_start = offset_in_row + gap
    call_response_len = np.minimum(response_len[calls], R - response_start)

    call_prompt_len = prompt_len[calls]
    prompt_len = prompt_len[heads]
    prompt_cut, response_cut = prompt_len > P, full_response_len > R
    prompt_len, row_response_len = np.minimum(prompt_len, P), np.minimum(full_response_len, R)

    def where(turn: int) -> str:
        return f"rollout {rollouts[turn_rollout[turn]].rollout_id!r} turn {turn_index[turn]}"

    pad = config.pad_token_id
    prompt_ids = _pack(prompts, heads, prompt_len, P, pad, keep_last=True, where=where)
    row_base = row_of * R
    response_ids = np.full((n_rows, R), pad, np.int64)
    gap_calls = np.flatnonzero(gap > 0)
    _place(
        response_ids,
        prompts,
        calls[gap_calls],
        chains.gap_from[calls[gap_calls]],
        gap[gap_calls],
        row_base[gap_calls] + offset_in_row[gap_calls],
        where,
        "prompt token ids must be int64 integers",
    )
    _place(
        response_ids,
        responses,
        calls,
        np.zeros(len(calls), np.int64),
        call_response_len,
        row_base + response_start,
        where,
        "response token ids must be int64 integers",
    )
    prompt_mask, real_response, position_ids = _layout(prompt_len, row_response_len, P, R)
    generated = ~off_policy_call if merge else np.ones(len(calls), bool)
    response_mask = _runs((n_rows, R), (row_base + response_start)[generated], call_response_len[generated])
    scores = np.zeros((n_rows, R), np.float32)
    scores[np.arange(n_rows), row_response_len - 1] = plan.scores[order][first]
    off_policy = ~on_policy_rows

    tensors = {
        "prompts": prompt_ids,
        "responses": response_ids,
        "input_ids": np.concatenate([prompt_ids, response_ids], axis=1),
        "attention_mask": np.concatenate([prompt_mask, real_response], axis=1, dtype=np.int64),
        "response_mask": response_mask.astype(np.int64),
        "position_ids": position_ids,
        "is_drop_mask": prompt_cut | off_policy,
        "token_level_scores": scores,
    }
    metrics = dict(plan.metrics)
    row_logprobs: list[np.ndarray | None] = [None] * n_rows
    if signal is not None:
        tensors["advantage_weights"] = plan.advantage_weights[order][first]
        tensors["group_weights"] = plan.group_weights[order][first]
        turn_logprobs = list(itertools.chain.from_iterable(_logprobs_of(r) for r in rollouts))
        logprobs, aligned = _rollout_log_probs(
            turn_logprobs,
            calls,
            response_len[calls],
            call_response_len,
            row_base + response_start,
            (n_rows, R),
            row_of,
            where,
        )
        metrics["logprobs/n_rows_missing"] = float(n_rows - np.count_nonzero(aligned))
        metrics["logprobs/present"] = float(bool(n_rows) and bool(aligned.all()))
        if metrics["logprobs/present"]:
            tensors["rollout_log_probs"] = logprobs
        row_logprobs = [
            logprobs[i, :n] if ok else None
            for i, (n, ok) in enumerate(zip(row_response_len.tolist(), aligned.tolist(), strict=True))
        ]
    rollout_ids = np.fromiter((r.rollout_id for r in rollouts), object, count=len(rollouts))
    row_rollout = turn_rollout[heads]
    non_tensors = {
        "data_id_list": data_ids[row_rollout],
        "uid": plan.uid[order][first].astype(object),
        "rollout_id_list": rollout_ids[row_rollout],
        "turn_index_list": turn_index[heads].astype(object),
    }
    per_call_tokens = np.minimum(call_prompt_len, P) + np.minimum(response_len[calls], R)
    metrics |= {
        "batch/n_rollouts": float(np.count_nonzero(completed)),
        "batch/n_rollouts_without_triplets": float(np.count_nonzero(completed & (n_turns == 0))),
        "batch/n_triplets": float(n_rows),
        "batch/n_rows": float(n_rows),
        "batch/n_calls": float(len(calls)),
        "batch/n_calls_merged": float(np.count_nonzero(~first)),
        "batch/n_chains_split_width": float(np.count_nonzero(chains.split[calls])),
        "batch/n_calls_untrained_width": float(np.count_nonzero(untrained)),
        "batch/n_generated_untrained_width": float(response_len[untrained].sum()),
        "batch/n_calls_drifted": float(np.count_nonzero(chains.drifted[calls])),
        "batch/n_trainer_tokens": float(prompt_len.sum() + row_response_len.sum()),
        "batch/n_trainer_tokens_per_call": float(per_call_tokens.sum()),
        "batch/n_empty_responses_dropped": float(n_empty),
        "batch/n_prompts_truncated": float(np.count_nonzero(prompt_cut)),
        "batch/n_rows_off_policy": float(np.count_nonzero(off_policy)),
        "batch/n_responses_truncated": float(np.count_nonzero(response_cut)),
        "batch/n_rewards_filled": float(n_filled),
        "batch/reward_mean": _mean(rewards[completed]),
        "batch/prompt_length_mean": _mean(prompt_len),
        "batch/response_length_mean": _mean(row_response_len),
    }
    batch = DataProto.from_dict(
        tensors={k: torch.from_numpy(v) for k, v in tensors.items()}, non_tensors=non_tensors, meta_info={}
    )
    row_calls = np.split(turn_index[calls], np.flatnonzero(first)[1:]) if n_rows else []
    return BuiltBatch(
        batch,
        metrics,
        row_rollout,
        [c.tolist() for c in row_calls],
        row_logprobs,
        masked=plan.masked.astype(np.int64) if signal is not None else np.zeros(len(rollouts), np.int64),
        untrained_needs=chains.needs if np.any(untrained) else (0, 0),
    )


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
        for name, values in (
            ("turn_rewards", r.turn_rewards),
            ("logprobs", r.logprobs),
            ("off_policy", r.off_policy),
        ):
            if values is not None and len(values) != len(r.turns):
                raise ValueError(
                    f"rollout {r.rollout_id!r} has {len(r.turns)} turns but {len(values)} {name}"
                )


def _reason_flags(rollouts: Sequence[FinishedRollout]) -> np.ndarray:
    """The recorded reasons of each rollout as :data:`~aglverl.trajectory.signals.REASON_BITS`; a failed rollout that
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
    calls: np.ndarray,
    full_len: np.ndarray,
    kept_len: np.ndarray,
    flat_dst: np.ndarray,
    shape: tuple[int, int],
    row_of: np.ndarray,
    where: Callable[[int], str],
) -> tuple[np.ndarray, np.ndarray]:
    """The engine's logprobs of the rows' generated ids (float32, zeros elsewhere), and per row whether every
    call of it brought finite logprobs aligned with its response (only aligned calls' values are converted)."""
    aligned = np.fromiter(
        (
            turn_logprobs[call] is not None and len(turn_logprobs[call]) == n
            for call, n in zip(calls.tolist(), full_len.tolist(), strict=True)
        ),
        bool,
        count=len(calls),
    )
    values = np.zeros(shape, np.float64)
    at = np.flatnonzero(aligned)
    zero = np.zeros(len(at), np.int64)
    _place(
        values,
        turn_logprobs,
        calls[at],
        zero,
        kept_len[at],
        flat_dst[at],
        where,
        "logprobs must be numbers",
        "d",
    )
    rows_aligned = (np.bincount(row_of[~aligned], minlength=shape[0]) == 0) & np.isfinite(values).all(axis=1)
    return values.astype(np.float32), rows_aligned


def _chains(rollouts: Sequence[FinishedRollout], config: BatchConfig, merge: bool) -> _Chains:
    """Which row each call (with a response) goes to: see the module docstring. One Python iteration per call
    and open chain of its rollout, each a C-level comparison of id lists; a chain is then cut into rows by
    :func:`_segments` (one per call with ``merge`` off)."""
    n = sum(len(r.turns) for r in rollouts)
    chains = _Chains(
        head=np.zeros(n, bool),
        row=np.full(n, -1, np.int64),
        gap_from=np.zeros(n, np.int64),
        split=np.zeros(n, bool),
        drifted=np.zeros(n, bool),
        untrained=np.zeros(n, bool),
    )
    head_of = np.full(n, -1, np.int64)  # each call's row, as the turn index of the row's first call
    needs = [0, 0]
    call = 0
    for rollout in rollouts:
        # per open chain, most recently continued last: its last call's prompt and response ids, and its calls
        open_chains: list[tuple[list[int], list[int], list[int]]] = []
        members: list[list[int]] = []
        for prompt, response in rollout.turns:
            if len(response):
                prompt, response = _ids(prompt), _ids(response)
                chain, drift = None, False
                for at in range(len(open_chains) - 1, -1, -1):
                    last_prompt, last_response, calls = open_chains[at]
                    n_prompt = len(last_prompt)
                    if len(prompt) > n_prompt and prompt[:n_prompt] == last_prompt:
                        if prompt[n_prompt : n_prompt + len(last_response)] == last_response:
                            chain = calls
                            chains.gap_from[call] = n_prompt + len(last_response)
                            del open_chains[at]
                            break
                        drift = True
                if chain is None:
                    chains.drifted[call] = drift
                    chain = []
                    members.append(chain)
                chain.append(call)
                open_chains.append((prompt, response, chain))
            call += 1
        for calls in members:
            if merge:
                _segment(chains, head_of, calls, rollout, call - len(rollout.turns), config, needs)
            else:
                chains.head[calls] = True
                head_of[calls] = calls
    in_row = head_of >= 0
    chains.row[in_row] = (np.cumsum(chains.head) - 1)[head_of[in_row]]
    return chains._replace(needs=(needs[0], needs[1]))


def _segment(
    chains: _Chains,
    head_of: np.ndarray,
    calls: list[int],
    rollout: FinishedRollout,
    first_turn: int,
    config: BatchConfig,
    needs: list[int],
) -> None:
    """Cut one chain (its calls' turn indices, in order) into rows (:func:`_segments`) and mark them."""
    prompt_len = np.fromiter((len(rollout.turns[c - first_turn][0]) for c in calls), np.int64, len(calls))
    response_len = np.fromiter((len(rollout.turns[c - first_turn][1]) for c in calls), np.int64, len(calls))
    piece = response_len.copy()
    piece[1:] += prompt_len[1:] - chains.gap_from[calls[1:]]  # the ids between a call and the one before
    starts, dropped, need = _segments(
        prompt_len, response_len, piece, config.max_prompt_length, config.max_response_length
    )
    ends = [*starts[1:], len(calls)]
    for k, (start, end) in enumerate(zip(starts, ends, strict=True)):
        members = calls[start:end]
        if k == len(starts) - 1 and dropped:
            chains.untrained[members] = True
            needs[0] = max(needs[0], need)
            needs[1] = max(needs[1], int(piece.sum()))  # the whole conversation in one row
            continue
        chains.head[members[0]] = True
        chains.split[members[0]] = start > 0
        head_of[members] = members[0]


def _segments(
    prompt_len: np.ndarray, response_len: np.ndarray, piece: np.ndarray, P: int, R: int
) -> tuple[list[int], bool, int]:
    """Where a chain of calls is cut into rows: the first call of each row (indices into the chain), whether
    the last row is left untrained (its prompt, the conversation before it, is longer than ``P``), and the
    ``P`` that would train every row.

    A row continuing past its first call must fit ``R`` (``piece[i]``: what call ``i`` adds to a row it
    continues; a row's first call adds its response); a row's prompt is its first call's. A later row whose
    prompt is longer than ``P`` cannot be trained faithfully (a prompt cut to its last ids is a context the
    model never saw): it is no row, and since prompts only grow along a chain, neither is anything after it.
    Chosen: the cut that trains the most generated ids, then the fewest rows, then the longest first rows
    (extending each row as long as it fits when every row's prompt fits: the common case, in one pass).
    """
    n = len(piece)
    greedy, used = [0], int(response_len[0])
    for i in range(1, n):
        if used + piece[i] > R:
            greedy.append(i)
            used = int(response_len[i])
        else:
            used += int(piece[i])
    need = max(int(prompt_len[s]) for s in greedy)  # the prompt width that trains every row of this cut
    if all(prompt_len[s] <= P for s in greedy[1:]):
        return greedy, False, need
    # Otherwise a dynamic programme from the chain's end: best[i] = (ids trained, -rows, length of the first
    # row) over the ways to cut calls i.. with a row starting at i.
    best: list[tuple[int, int, int]] = [(0, 0, 0)] * (n + 1)
    for i in range(n - 1, -1, -1):
        if i > 0 and prompt_len[i] > P:
            best[i] = (0, -1, n - i)  # untrained from here on: one dropped "row"
            continue
        trains = i > 0 or prompt_len[0] <= P
        options = []
        size = int(response_len[i])
        options.append(_option(min(size, R) * trains, best, i + 1, 1))
        generated = size
        for e in range(i + 1, n):
            size += int(piece[e])
            if size > R:
                break
            generated += int(response_len[e])
            options.append(_option(generated * trains, best, e + 1, e - i + 1))
        best[i] = max(options)
    starts, i = [], 0
    while i < n:
        starts.append(i)
        if i > 0 and prompt_len[i] > P:
            return starts, True, need
        i += best[i][2]
    return starts, False, need


def _option(trained: int, best: list[tuple[int, int, int]], rest: int, length: int) -> tuple[int, int, int]:
    after = best[rest]
    return trained + after[0], after[1] - 1, length


class _Chains(NamedTuple):
    """Per turn (rollout-major): whether it starts a row, its row (-1: in none: no response, or left untrained
    for the width), where in its prompt the ids after the previous call of its chain begin, whether it
    continued a chain but started a row for the width, whether it drifted (began with a chain's last prompt,
    but not with that call's exact response ids), whether the width left it untrained. ``needs``: the
    ``max_prompt_length`` and ``max_response_length`` that would train every untrained call (0: none)."""

    head: np.ndarray
    row: np.ndarray
    gap_from: np.ndarray
    split: np.ndarray
    drifted: np.ndarray
    untrained: np.ndarray
    needs: tuple[int, int] = (0, 0)


def _ids(seq: Sequence[int]) -> list[int]:
    """Ids as a list, so prefixes compare in C whatever sequence type they came in."""
    if type(seq) is list:
        return seq
    return seq.tolist() if isinstance(seq, np.ndarray) else list(seq)


def _place(
    out: np.ndarray,
    seqs: Sequence[Any],
    calls: np.ndarray,
    src_start: np.ndarray,
    lengths: np.ndarray,
    flat_dst: np.ndarray,
    where: Callable[[int], str],
    what: str,
    fmt: Literal["q", "d"] = "q",
) -> None:
    """Copy ``seqs[calls[i]][src_start[i]:][:lengths[i]]`` to flat offset ``flat_dst[i]`` of ``out`` (C-contiguous,
    int64 for ``"q"``, float64 for ``"d"``). Raises ``ValueError`` naming the turn and ``what`` was wrong."""
    buffer = out.reshape(-1).view(np.uint8).data
    for call, start, n_ids, offset in zip(
        calls.tolist(), src_start.tolist(), lengths.tolist(), (flat_dst * _ID_BYTES).tolist(), strict=True
    ):
        seq = seqs[call]
        if start or len(seq) != n_ids:
            seq = seq[start : start + n_ids]
        try:
            struct.pack_into(f"{n_ids}{fmt}", buffer, offset, *seq)
        except struct.error as exc:
            raise ValueError(f"{where(call)}: {what} ({exc})") from None


def _runs(shape: tuple[int, int], starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """A bool array of ``shape`` that is true on ``lengths[i]`` elements from flat offset ``starts[i]``."""
    out = np.zeros(shape[0] * shape[1], bool)
    out[np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))] = True
    return out.reshape(shape)


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
