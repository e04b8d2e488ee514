"""Finished rollouts become jagged training rows, each only as long as its ids: pure, vectorised, no I/O.

Both trajectory paths start here: the producer (:mod:`.groups`) hands a finished group's :class:`Rows` to its sink
as they are (TransferQueue stores rows jagged), and the collector (:mod:`.steps`) pads them into a verl
``DataProto`` with :func:`aglverl.trajectory.batch.pad_rows`. Nothing here imports verl.

Rows are chains of calls (``SignalConfig.trajectory``, ``"merge"`` by default; which calls chain, how a chain
is cut to the width and what drifts: :mod:`.chains`). A chain is one row in verl's own agent-loop layout: its
prompt is its first call's prompt, its response is ``r1 + d2 + r2 + ... + rk`` where ``r_i`` are the ids the
engine generated (response mask 1, their logprobs kept) and ``d_i`` the ids between two calls (tool results,
user turns, template tokens: mask 0, logprob 0), and the reward sits on the last response id.

The width: a row whose prompt is longer than ``max_prompt_length`` keeps its last ids and is marked
``is_drop`` (only a chain's first row can be one: a later row whose prompt does not fit is no row, see
:mod:`.chains`; its calls are counted in ``batch/n_calls_untrained_width`` and
``batch/n_generated_untrained_width``, with the widths that would train them in :attr:`Rows.untrained_needs`,
logged once per run by :class:`WidthWarning`). A single call longer than ``max_response_length`` keeps its
first ids (the only generated ids a row loses to the width). Every other call with a response is in exactly
one row.

A call recorded off-policy (its sampling parameters were masked) keeps its place with response mask 0; a row
with no on-policy call is marked ``is_drop``. ``trajectory="per_call"`` (and no
:class:`~aglverl.trajectory.signals.SignalConfig` at all) makes every call its own row, as batches always
were; an off-policy call's row then keeps its response mask and is marked ``is_drop``. A triplet with an
empty response has no id to carry its reward, so it is dropped and counted (a merged chain continues past
it).

Given a :class:`~aglverl.trajectory.signals.SignalConfig` (the collector and the producer always pass one),
the training-signal controls decide which rollouts and turns become rows, each row's score and ``uid`` (see
:func:`aglverl.trajectory.signals.plan_rows`), its ``advantage_weights`` and ``group_weights``, and each
row carries the engine's logprobs when every call of it brought them.

No Python code runs per token. The steps of :func:`build_rows`, each a small function below: lay every turn
out flat (:func:`_turns_of`), chain the calls (:func:`~aglverl.trajectory.chains.find_chains`), plan the rows
(:func:`_plan`), order the kept calls row by row (:func:`_kept_calls`), find where each call's ids go in its
row (:func:`_spans`), then pack the ids, the response mask, the logprobs and the weight versions
(:func:`_prompt_ids`, :func:`_response_ids`, :func:`_response_mask`, :func:`_logprobs`, :func:`_versions`)
and count (:func:`_metrics`). The only Python-level loops run once per rollout or per call: reading rewards
and lengths, finding the chains, and unboxing each call's ids, which ``struct`` packs in C straight to their
offset in the flat arrays; masks and offsets are whole-batch numpy index arithmetic.

The flat arrays are laid out one of two ways, and each row says where its ids start: end to end (the
producer's, each row as long as its ids), or ``padded=True`` (the collector's): each row at a stride of the
width, a prompt right-aligned in its ``max_prompt_length`` and a response left-aligned in its
``max_response_length``, the rest ``pad_token_id`` (0 in the mask and logprobs). The padded layout is a
reshape away from verl's rectangles, so the collector's ids are packed once, straight to their padded places.
"""

from __future__ import annotations

import itertools
import logging
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np

from ..models import check_reward
from .chains import Chains, find_chains
from .rollouts import (
    FinishedRollout,
    check_per_turn,
    final_rewards,
    per_turn,
    termination_flags,
    turn_logprobs,
    turn_rewards,
)
from .signals import RowPlan, SignalConfig, plan_rows, turn_layout

__all__ = ["BatchConfig", "Rows", "WidthWarning", "build_rows"]

logger = logging.getLogger(__name__)

_ID_BYTES = 8  # int64 (and float64, for logprobs)


@dataclass(frozen=True, slots=True)
class BatchConfig:
    """How rollouts are shaped into rows and batches.

    ``max_prompt_length`` / ``max_response_length`` are the widths P and R (a padded batch's, and the longest
    prompt and response a row keeps); ``pad_token_id`` fills a padded batch's pads; ``reward_fill_value``
    replaces a missing final reward (``None``: a rollout without a reward is an error,
    :class:`~aglverl.trajectory.rollouts.MissingRewardError`).

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
            check_reward(fill, "BatchConfig.reward_fill_value")


@dataclass(frozen=True, slots=True, eq=False)
class Rows:
    """A batch's training rows, jagged: each row only as long as its ids (see the module docstring).

    ``B`` rows, in the order of the rollouts given and, within a rollout, of their first calls. The ids are
    in flat arrays, laid end to end or padded to the widths (:meth:`is_padded`): row ``i``'s prompt is
    ``prompt_ids[prompt_start[i]:][:prompt_len[i]]`` (a prompt longer
    than ``max_prompt_length``: its last ids), its response (``r1 + d2 + r2 + ...``, a single call longer than
    ``max_response_length``: its first ids) ``response_ids[response_start[i]:][:response_len[i]]``, aligned
    with ``response_mask`` (int64: 1 on the ids the engine generated for a call that trains, 0 between calls)
    and ``logprobs`` (float32, the engine's on generated ids, 0 elsewhere; ``None`` without a signal config;
    a row's are only meaningful where ``logprobs_present``: every call of it brought one finite logprob per
    response id). :meth:`prompt`, :meth:`response`, :meth:`mask` and :meth:`row_logprobs` give one row's.

    Per row: ``scores`` (float32, the score on its last response id), ``is_drop`` (it must not train: its
    prompt was cut, or none of its calls is on-policy), ``advantage_weights`` / ``group_weights`` (float32,
    its weight in the loss and in its group's mean/std; ``None`` without a signal config), ``uid`` (its GRPO
    group), ``data_id``, ``rollout_id``, ``row_rollout`` (index into the rollouts given), ``row_calls`` (the
    turn indices of its calls, in order; the first is ``turn_index``), ``version`` (its first call's weight
    version), ``min_version`` / ``max_version`` (the oldest first-token and newest last-token version of its
    calls; -1 where unknown).

    ``metrics`` are the ``batch/*`` (and with a signal config ``filter/*``, ``rejection/*``, ``logprobs/*``)
    figures, ``masked`` each rollout's :data:`~aglverl.trajectory.signals.REASON_BITS` that masked it (0 if
    none), ``untrained_needs`` the ``max_prompt_length`` / ``max_response_length`` that would have trained
    every call the width left untrained ((0, 0) when none was).
    """

    prompt_ids: np.ndarray
    prompt_start: np.ndarray
    prompt_len: np.ndarray
    response_ids: np.ndarray
    response_start: np.ndarray
    response_len: np.ndarray
    response_mask: np.ndarray
    logprobs: np.ndarray | None
    logprobs_present: np.ndarray
    scores: np.ndarray
    is_drop: np.ndarray
    advantage_weights: np.ndarray | None
    group_weights: np.ndarray | None
    uid: np.ndarray
    data_id: np.ndarray
    rollout_id: np.ndarray
    turn_index: np.ndarray
    row_rollout: np.ndarray
    row_calls: list[list[int]]
    version: np.ndarray
    min_version: np.ndarray
    max_version: np.ndarray
    metrics: dict[str, float]
    masked: np.ndarray
    untrained_needs: tuple[int, int]

    def __len__(self) -> int:
        return len(self.prompt_len)

    @property
    def n_calls(self) -> np.ndarray:
        """Per row, how many calls it holds."""
        return np.fromiter(map(len, self.row_calls), np.int64, count=len(self.row_calls))

    def is_padded(self, config: BatchConfig) -> bool:
        """Whether the flat arrays are ``config``'s padded rectangles, raveled (``build_rows(padded=True)``,
        or rows that each fill both widths, which lay out the same either way)."""
        n = len(self)
        return (
            self.prompt_ids.size == n * config.max_prompt_length
            and self.response_ids.size == n * config.max_response_length
        )

    def prompt(self, i: int) -> np.ndarray:
        start = int(self.prompt_start[i])
        return self.prompt_ids[start : start + int(self.prompt_len[i])]

    def response(self, i: int) -> np.ndarray:
        start = int(self.response_start[i])
        return self.response_ids[start : start + int(self.response_len[i])]

    def mask(self, i: int) -> np.ndarray:
        start = int(self.response_start[i])
        return self.response_mask[start : start + int(self.response_len[i])]

    def row_logprobs(self, i: int) -> np.ndarray | None:
        """Row ``i``'s engine logprobs (float32, as long as its response), ``None`` unless every call of it
        brought them."""
        if self.logprobs is None or not self.logprobs_present[i]:
            return None
        start = int(self.response_start[i])
        return self.logprobs[start : start + int(self.response_len[i])]


class WidthWarning:
    """Says once (one per run: the collector and the producer each hold one) that calls of merged
    conversations were left untrained for the width, naming the settings that would train them.

    ``names``: how the widths are set where the run is configured (``BatchConfig``'s fields by default,
    ``data.max_prompt_length`` / ``data.max_response_length`` under ``AsyncVERL``).
    """

    def __init__(
        self,
        config: BatchConfig,
        names: tuple[str, str] = ("BatchConfig.max_prompt_length", "BatchConfig.max_response_length"),
    ) -> None:
        self.config = config
        self.names = names
        self.warned = False

    def note(self, rows: Rows) -> None:
        if self.warned or rows.untrained_needs == (0, 0):
            return
        self.warned = True
        (prompt_name, response_name), (prompt_need, response_need) = self.names, rows.untrained_needs
        metrics = rows.metrics
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
    rollouts: Sequence[FinishedRollout],
    config: BatchConfig,
    signal: SignalConfig | None = None,
    *,
    padded: bool = False,
) -> Rows:
    """The training rows of ``rollouts`` (one per chain of calls, see the module docstring) and their metrics.
    ``padded``: lay the ids out at a stride of the widths (see the module docstring; :meth:`Rows.is_padded`)
    rather than end to end.

    Triplets with an empty response are dropped (``batch/n_empty_responses_dropped``); a rollout without
    triplets contributes no rows (``batch/n_rollouts_without_triplets``); a missing reward is replaced by
    ``config.reward_fill_value`` (``batch/n_rewards_filled``) or, when that is ``None``, raises
    :class:`~aglverl.trajectory.rollouts.MissingRewardError` naming the first such rollout. A token id that is
    not an integer in the int64 range (a logprob that is not a number) raises ``ValueError`` naming the
    rollout and turn; per-turn lists of another length than the turns raise ``ValueError`` naming the rollout.
    The inputs are never modified.

    Metrics (floats): counts of completed rollouts, those without triplets, rows (``n_triplets`` and
    ``n_rows``), the calls in them (``n_calls``), calls that continued a row (``n_calls_merged``), rows started
    at a call boundary for the width (``n_chains_split_width``), calls the width left untrained and their
    generated ids (``n_calls_untrained_width``, ``n_generated_untrained_width``: of rollouts not masked),
    calls that drifted (``n_calls_drifted``, counted in either mode), the trainer ids of the rows
    (``n_trainer_tokens``: prompt + response, after truncation) and what one row per call would have cost
    (``n_trainer_tokens_per_call``), dropped empty responses, truncated prompts and responses, off-policy rows
    (those two are the rows marked ``is_drop``), filled rewards; the mean final reward over completed
    rollouts after filling; mean prompt / response length of the rows after truncation (each 0.0 when there
    is nothing to average).

    Without ``signal``, failed rollouts (``completed=False``) are left out and every other turn with a
    response is a row of its own, as plain GRPO batches always were. With it,
    :func:`aglverl.trajectory.signals.plan_rows` picks the rows, scores and groups (its ``filter/*`` and
    ``rejection/*`` metrics are added), rows carry ``advantage_weights`` and ``group_weights`` (a rollout of k
    rows: 1/k each in its group, one member) and the engine's logprobs (``logprobs/present``: every row has
    them; ``logprobs/n_rows_missing``).
    """
    if signal is None:
        rollouts = [r for r in rollouts if r.completed]
    else:
        check_per_turn(rollouts)
    merge = signal is not None and signal.trajectory == "merge"
    turns = _turns_of(rollouts)
    failure_reward = None if signal is None else signal.failure_reward
    rewards, n_filled = final_rewards(rollouts, config.reward_fill_value, failure_reward)
    chains = find_chains(
        [r.turns for r in rollouts], config.max_prompt_length, config.max_response_length, merge
    )
    plan = _plan(rollouts, turns, rewards, chains, config, signal)
    kept = _kept_calls(plan, chains)
    spans = _spans(kept, turns, chains, config, padded)
    where = _namer(rollouts, turns)
    prompt_ids = _prompt_ids(turns, kept, spans, where)
    response_ids = _response_ids(turns, chains, kept, spans, where)

    off_policy = per_turn(rollouts, lambda r: r.off_policy, False, bool)[kept.calls]
    on_policy_rows = np.bincount(kept.row_of[~off_policy], minlength=kept.n_rows) > 0
    # per_call rows keep an off-policy call's mask (the row is dropped whole); merged rows mask the call only
    generated = ~off_policy if merge else np.ones(len(kept.calls), bool)
    metrics = dict(plan.metrics)
    logprobs, present = None, np.zeros(kept.n_rows, bool)
    if signal is not None:
        logprobs, present = _logprobs(rollouts, turns, kept, spans, where)
        metrics["logprobs/n_rows_missing"] = float(kept.n_rows - np.count_nonzero(present))
        metrics["logprobs/present"] = float(bool(kept.n_rows) and bool(present.all()))
    unmasked = plan.masked[turns.rollout] == 0
    metrics |= _metrics(
        rollouts, turns, chains, kept, spans, on_policy_rows, unmasked, rewards, n_filled, config
    )
    rollout_ids = np.fromiter((r.rollout_id for r in rollouts), object, count=len(rollouts))
    data_ids = np.fromiter((r.data_id for r in rollouts), object, count=len(rollouts))
    row_rollout = turns.rollout[kept.heads]
    version, min_version, max_version = _versions(rollouts, kept)
    per_row = kept.order[kept.first]  # each row's entry in the plan's arrays (its first call's)
    return Rows(
        prompt_ids=prompt_ids,
        prompt_start=spans.prompt_start,
        prompt_len=spans.prompt_len,
        response_ids=response_ids,
        response_start=spans.row_start,
        response_len=spans.response_len,
        response_mask=_response_mask(spans, generated),
        logprobs=logprobs,
        logprobs_present=present,
        scores=plan.scores[per_row].astype(np.float32),
        is_drop=spans.prompt_cut | ~on_policy_rows,
        advantage_weights=plan.advantage_weights[per_row] if signal is not None else None,
        group_weights=plan.group_weights[per_row] if signal is not None else None,
        uid=plan.uid[per_row].astype(object),
        data_id=data_ids[row_rollout],
        rollout_id=rollout_ids[row_rollout],
        turn_index=turns.position[kept.heads],
        row_rollout=row_rollout,
        row_calls=_row_calls(turns, kept),
        version=version,
        min_version=min_version,
        max_version=max_version,
        metrics=metrics,
        masked=plan.masked.astype(np.int64) if signal is not None else np.zeros(len(rollouts), np.int64),
        untrained_needs=chains.needs if np.any(unmasked & chains.untrained) else (0, 0),
    )


# ---------------------------------------------------------------------------------------------- the steps
class _Turns(NamedTuple):
    """Every turn of the batch laid out flat, rollout-major: its ids and lengths, its rollout and its index
    in that rollout (``position``); ``n_turns`` per rollout."""

    prompts: list[Sequence[int]]
    responses: list[Sequence[int]]
    prompt_len: np.ndarray
    response_len: np.ndarray
    rollout: np.ndarray
    position: np.ndarray
    n_turns: np.ndarray


def _turns_of(rollouts: Sequence[FinishedRollout]) -> _Turns:
    n_turns = np.fromiter((len(r.turns) for r in rollouts), np.int64, count=len(rollouts))
    turns = list(itertools.chain.from_iterable(r.turns for r in rollouts))
    prompts = [t[0] for t in turns]
    responses = [t[1] for t in turns]
    turn_rollout, turn_index = turn_layout(n_turns)
    return _Turns(
        prompts,
        responses,
        np.fromiter(map(len, prompts), np.int64, count=len(turns)),
        np.fromiter(map(len, responses), np.int64, count=len(turns)),
        turn_rollout,
        turn_index,
        n_turns,
    )


def _plan(
    rollouts: Sequence[FinishedRollout],
    turns: _Turns,
    rewards: np.ndarray,
    chains: Chains,
    config: BatchConfig,
    signal: SignalConfig | None,
) -> RowPlan:
    """Which calls become rows, with what score, group and weights: every call with a response (no signal
    config), or what the training-signal controls decide."""
    data_ids = np.fromiter((r.data_id for r in rollouts), object, count=len(rollouts))
    if signal is None:
        kept = np.flatnonzero(turns.response_len > 0)
        completed = np.fromiter((r.completed for r in rollouts), bool, count=len(rollouts))
        no_rows = np.zeros(0, np.float32)
        owner = turns.rollout[kept]
        return RowPlan(kept, rewards[owner], data_ids[owner], no_rows, no_rows, ~completed, {})
    return plan_rows(
        data_ids=data_ids,
        rewards=rewards,
        flags=termination_flags(rollouts),
        n_turns=turns.n_turns,
        response_len=turns.response_len,
        turn_rewards=turn_rewards(rollouts),
        max_response_length=config.max_response_length,
        config=signal,
        row_starts=chains.head,
        in_rows=~chains.untrained,
    )


class _Kept(NamedTuple):
    """The kept calls, row-major (rows in the order of their first calls, a row's calls in call order):
    ``calls`` (turn indices), each one's row (``row_of``) and whether it starts it (``first``), the rows'
    first calls (``heads``), how many rows, and where each call sits in the plan's arrays (``order``)."""

    calls: np.ndarray
    row_of: np.ndarray
    first: np.ndarray
    heads: np.ndarray
    n_rows: int
    order: np.ndarray


def _kept_calls(plan: RowPlan, chains: Chains) -> _Kept:
    # A merged row's calls are kept or dropped together: masking and group sizes act on whole rollouts, and
    # rejection on whole groups, which are rollouts' (per_step's per-turn groups only exist with per_call rows).
    order = np.argsort(chains.row[plan.rows], kind="stable")
    calls = plan.rows[order]
    row_of = np.unique(chains.row[calls], return_inverse=True)[1].reshape(-1)
    n_rows = int(row_of[-1]) + 1 if len(calls) else 0
    first = np.ones(len(calls), bool)
    first[1:] = row_of[1:] != row_of[:-1]
    return _Kept(calls, row_of, first, calls[first], n_rows, order)


class _Spans(NamedTuple):
    """Where each kept call's ids go in its row, and each row's lengths.

    Per call: ``gap`` (the ids between the row's previous call and it, taken from its prompt; 0 for a row's
    first call), where that gap starts in the row (``gap_at``), where its response starts (``response_at``,
    both offsets in the flat response ids) and how many of its response ids the row keeps (``kept``).
    Per row: prompt and response lengths after truncation, whether each was cut, and where the row's
    prompt and response start in the flat ids (``prompt_start``, ``row_start``). The flat arrays' sizes
    (``prompt_size``, ``response_size``) and the value between rows (``pad``) go with the layout: end to end,
    or padded to the widths.
    """

    gap: np.ndarray
    gap_at: np.ndarray
    response_at: np.ndarray
    kept: np.ndarray
    prompt_len: np.ndarray
    response_len: np.ndarray
    prompt_cut: np.ndarray
    response_cut: np.ndarray
    prompt_start: np.ndarray
    row_start: np.ndarray
    prompt_size: int
    response_size: int
    pad: int


def _spans(kept: _Kept, turns: _Turns, chains: Chains, config: BatchConfig, padded: bool) -> _Spans:
    P, R = config.max_prompt_length, config.max_response_length
    calls, row_of, first = kept.calls, kept.row_of, kept.first
    # Each call adds the ids between it and the row's previous call (none for a row's first call) and its
    # response; a lone call longer than the width is the only thing ever truncated.
    gap = np.where(first, 0, turns.prompt_len[calls] - chains.gap_from[calls])
    full_piece = gap + turns.response_len[calls]
    full_response_len = np.bincount(row_of, weights=full_piece, minlength=kept.n_rows).astype(np.int64)
    # where each call's gap starts in its row: its offset in all rows' pieces laid end to end, less its row's
    starts = np.cumsum(full_piece) - full_piece
    offset_in_row = starts - starts[first][row_of]
    response_in_row = offset_in_row + gap
    full_prompt_len = turns.prompt_len[kept.heads]
    prompt_len, response_len = np.minimum(full_prompt_len, P), np.minimum(full_response_len, R)
    if padded:
        strides = np.arange(kept.n_rows, dtype=np.int64)
        prompt_start, row_start = strides * P + (P - prompt_len), strides * R
        prompt_size, response_size, pad = kept.n_rows * P, kept.n_rows * R, config.pad_token_id
    else:
        prompt_start, row_start = _starts(prompt_len), _starts(response_len)
        prompt_size, response_size, pad = int(prompt_len.sum()), int(response_len.sum()), 0
    return _Spans(
        gap=gap,
        gap_at=row_start[row_of] + offset_in_row,
        response_at=row_start[row_of] + response_in_row,
        kept=np.minimum(turns.response_len[calls], R - response_in_row),
        prompt_len=prompt_len,
        response_len=response_len,
        prompt_cut=full_prompt_len > P,
        response_cut=full_response_len > R,
        prompt_start=prompt_start,
        row_start=row_start,
        prompt_size=prompt_size,
        response_size=response_size,
        pad=pad,
    )


def _prompt_ids(turns: _Turns, kept: _Kept, spans: _Spans, where: Callable[[int], str]) -> np.ndarray:
    """Every row's prompt (its first call's; a longer one keeps its last ids), in the spans' layout."""
    out = _buffer(spans.prompt_size, spans.pad, np.int64)
    lengths = spans.prompt_len
    full = turns.prompt_len[kept.heads]
    _place(
        out,
        turns.prompts,
        kept.heads,
        full - lengths,
        lengths,
        spans.prompt_start,
        where,
        "prompt token ids must be int64 integers",
    )
    return out


def _response_ids(
    turns: _Turns, chains: Chains, kept: _Kept, spans: _Spans, where: Callable[[int], str]
) -> np.ndarray:
    """Every row's response (its calls' responses with the ids between them), in the spans' layout."""
    out = _buffer(spans.response_size, spans.pad, np.int64)
    gap_calls = np.flatnonzero(spans.gap > 0)
    _place(
        out,
        turns.prompts,
        kept.calls[gap_calls],
        chains.gap_from[kept.calls[gap_calls]],
        spans.gap[gap_calls],
        spans.gap_at[gap_calls],
        where,
        "prompt token ids must be int64 integers",
    )
    _place(
        out,
        turns.responses,
        kept.calls,
        np.zeros(len(kept.calls), np.int64),
        spans.kept,
        spans.response_at,
        where,
        "response token ids must be int64 integers",
    )
    return out


def _response_mask(spans: _Spans, generated: np.ndarray) -> np.ndarray:
    """1 (int64) on the response ids of the calls that train (``generated``), 0 elsewhere, aligned with the
    response ids."""
    out = np.zeros(spans.response_size, np.int64)
    starts, lengths = spans.response_at[generated], spans.kept[generated]
    out[np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))] = 1
    return out


def _logprobs(
    rollouts: Sequence[FinishedRollout],
    turns: _Turns,
    kept: _Kept,
    spans: _Spans,
    where: Callable[[int], str],
) -> tuple[np.ndarray, np.ndarray]:
    """The engine's logprobs of the rows' generated ids (float32, zeros elsewhere), aligned with the response
    ids, and per row whether every call of it brought finite logprobs aligned with its response (only aligned
    calls' values are converted)."""
    logprobs = turn_logprobs(rollouts)
    calls = kept.calls
    aligned = np.fromiter(
        (
            logprobs[call] is not None and len(logprobs[call]) == n
            for call, n in zip(calls.tolist(), turns.response_len[calls].tolist(), strict=True)
        ),
        bool,
        count=len(calls),
    )
    values = np.zeros(spans.response_size, np.float64)
    at = np.flatnonzero(aligned)
    _place(
        values,
        logprobs,
        calls[at],
        np.zeros(len(at), np.int64),
        spans.kept[at],
        spans.response_at[at],
        where,
        "logprobs must be numbers",
        "d",
    )
    not_finite = np.flatnonzero(~np.isfinite(values))
    bad_rows = np.searchsorted(spans.row_start, not_finite, side="right") - 1
    present = (np.bincount(kept.row_of[~aligned], minlength=kept.n_rows) == 0) & (
        np.bincount(bad_rows, minlength=kept.n_rows) == 0
    )
    return values.astype(np.float32), present


def _row_calls(turns: _Turns, kept: _Kept) -> list[list[int]]:
    """Each row's calls, as turn indices of its rollout (slicing one list: ~10x faster than ``np.split``)."""
    indices = turns.position[kept.calls].tolist()
    bounds = [*np.flatnonzero(kept.first).tolist(), len(indices)]
    return [indices[a:b] for a, b in itertools.pairwise(bounds)]


def _versions(rollouts: Sequence[FinishedRollout], kept: _Kept) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: its first call's weight version, the oldest first-token version and the newest last-token
    version of its calls (-1 where a rollout's versions are unknown)."""
    first = per_turn(rollouts, lambda r: r.versions, -1, np.int64)
    last = per_turn(
        rollouts, lambda r: r.versions if r.end_versions is None else r.end_versions, -1, np.int64
    )
    if not kept.n_rows:
        empty = np.zeros(0, np.int64)
        return empty, empty.copy(), empty.copy()
    bounds = np.flatnonzero(kept.first)
    return (
        first[kept.heads],
        np.minimum.reduceat(first[kept.calls], bounds),
        np.maximum.reduceat(last[kept.calls], bounds),
    )


def _metrics(
    rollouts: Sequence[FinishedRollout],
    turns: _Turns,
    chains: Chains,
    kept: _Kept,
    spans: _Spans,
    on_policy_rows: np.ndarray,
    unmasked: np.ndarray,
    rewards: np.ndarray,
    n_filled: int,
    config: BatchConfig,
) -> dict[str, float]:
    """The ``batch/*`` figures (see :func:`build_rows`)."""
    P, R = config.max_prompt_length, config.max_response_length
    calls = kept.calls
    completed = np.fromiter((r.completed for r in rollouts), bool, count=len(rollouts))
    untrained = unmasked & chains.untrained
    per_call_tokens = np.minimum(turns.prompt_len[calls], P) + np.minimum(turns.response_len[calls], R)
    return {
        "batch/n_rollouts": float(np.count_nonzero(completed)),
        "batch/n_rollouts_without_triplets": float(np.count_nonzero(completed & (turns.n_turns == 0))),
        "batch/n_triplets": float(kept.n_rows),
        "batch/n_rows": float(kept.n_rows),
        "batch/n_calls": float(len(calls)),
        "batch/n_calls_merged": float(np.count_nonzero(~kept.first)),
        "batch/n_chains_split_width": float(np.count_nonzero(chains.split[calls])),
        "batch/n_calls_untrained_width": float(np.count_nonzero(untrained)),
        "batch/n_generated_untrained_width": float(turns.response_len[untrained].sum()),
        "batch/n_calls_drifted": float(np.count_nonzero(chains.drifted[calls])),
        "batch/n_trainer_tokens": float(spans.prompt_len.sum() + spans.response_len.sum()),
        "batch/n_trainer_tokens_per_call": float(per_call_tokens.sum()),
        "batch/n_empty_responses_dropped": float(np.count_nonzero(unmasked & (turns.response_len == 0))),
        "batch/n_prompts_truncated": float(np.count_nonzero(spans.prompt_cut)),
        "batch/n_rows_off_policy": float(np.count_nonzero(~on_policy_rows)),
        "batch/n_responses_truncated": float(np.count_nonzero(spans.response_cut)),
        "batch/n_rewards_filled": float(n_filled),
        "batch/reward_mean": _mean(rewards[completed]),
        "batch/prompt_length_mean": _mean(spans.prompt_len),
        "batch/response_length_mean": _mean(spans.response_len),
    }


def _namer(rollouts: Sequence[FinishedRollout], turns: _Turns) -> Callable[[int], str]:
    """How an error names a turn (by its flat index): its rollout and its index there."""

    def where(turn: int) -> str:
        return f"rollout {rollouts[turns.rollout[turn]].rollout_id!r} turn {turns.position[turn]}"

    return where


# ---------------------------------------------------------------------------------------------- packing
def _starts(lengths: np.ndarray) -> np.ndarray:
    """Where each of consecutive pieces of these lengths starts."""
    return np.cumsum(lengths) - lengths


def _buffer(size: int, pad: int, dtype: type) -> np.ndarray:
    return np.zeros(size, dtype) if pad == 0 else np.full(size, pad, dtype)


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
    """Copy ``seqs[calls[i]][src_start[i]:][:lengths[i]]`` to offset ``flat_dst[i]`` of ``out`` (1-D, int64
    for ``"q"``, float64 for ``"d"``). Raises ``ValueError`` naming the turn and ``what`` was wrong.

    The one unavoidable per-call loop: unboxing Python ints. ``struct`` packs a list straight into its place
    (destinations computed for the whole batch), about 1.5x faster than ``np.fromiter`` into a scratch array
    that must then be scattered; the values a sequence loses to truncation are never converted.
    """
    buffer = out.view(np.uint8).data
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


def _mean(values: np.ndarray) -> float:
    return float(values.mean()) if len(values) else 0.0
