"""Which calls make each row: a rollout's calls as chains that extend each other, each cut to the width.

Pure (numpy, no I/O); :func:`aglverl.trajectory.rows.build_rows` calls :func:`find_chains` once per batch.

A rollout's calls, in the order they were made, form chains: call b continues a chain whose last call is a when
b's prompt ids start with exactly a's prompt ids + a's response ids (the most recently continued chain, if
several do). A call that continues no chain (a branch, a parallel call, a rewritten history) starts a new one;
one whose prompt starts with a chain's last prompt but not with its exact response ids (retokenization drift)
too, and is counted as drifted. A chain whose merged response would be longer than ``max_response_length`` is
cut at call boundaries into several rows (:func:`cut_chain`); a row whose prompt, the conversation before it,
is longer than ``max_prompt_length`` is no row, and its calls (and the chain's calls after it) are left
untrained. Calls without a response are in no row.

One Python iteration per call and open chain of its rollout, each a C-level comparison of id lists; cutting a
chain is one pass over its calls, and a search over them only when a later row's prompt would not fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

__all__ = ["Chains", "cut_chain", "find_chains"]

Turn = tuple[Sequence[int], Sequence[int]]


class Chains(NamedTuple):
    """Per turn (rollout-major): whether it starts a row (``head``), its row (``row``, -1: in none: no
    response, or left untrained for the width), where in its prompt the ids after the previous call of its
    chain begin (``gap_from``), whether it continued a chain but started a row for the width (``split``),
    whether it drifted (began with a chain's last prompt, but not with that call's exact response ids), whether
    the width left it untrained. ``needs``: the ``max_prompt_length`` and ``max_response_length`` that would
    train every untrained call (0: none)."""

    head: np.ndarray
    row: np.ndarray
    gap_from: np.ndarray
    split: np.ndarray
    drifted: np.ndarray
    untrained: np.ndarray
    needs: tuple[int, int] = (0, 0)


def find_chains(
    rollouts_turns: Sequence[Sequence[Turn]], max_prompt_length: int, max_response_length: int, merge: bool
) -> Chains:
    """Which row each call (with a response) goes to, for every rollout's turns (see the module docstring);
    with ``merge`` off every call with a response is a row of its own (drift is still counted)."""
    n = sum(len(turns) for turns in rollouts_turns)
    chains = Chains(
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
    for turns in rollouts_turns:
        # per open chain, most recently continued last: its last call's prompt and response ids, and its calls
        open_chains: list[tuple[list[int], list[int], list[int]]] = []
        members: list[list[int]] = []
        for prompt, response in turns:
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
        first_turn = call - len(turns)
        for calls in members:
            if merge:
                P, R = max_prompt_length, max_response_length
                _mark_rows(chains, head_of, calls, turns, first_turn, P, R, needs)
            else:
                chains.head[calls] = True
                head_of[calls] = calls
    in_row = head_of >= 0
    chains.row[in_row] = (np.cumsum(chains.head) - 1)[head_of[in_row]]
    return chains._replace(needs=(needs[0], needs[1]))


def _mark_rows(
    chains: Chains,
    head_of: np.ndarray,
    calls: list[int],
    turns: Sequence[Turn],
    first_turn: int,
    P: int,
    R: int,
    needs: list[int],
) -> None:
    """Cut one chain (its calls' turn indices, in order) into rows (:func:`cut_chain`) and mark them."""
    prompt_len = np.fromiter((len(turns[c - first_turn][0]) for c in calls), np.int64, len(calls))
    response_len = np.fromiter((len(turns[c - first_turn][1]) for c in calls), np.int64, len(calls))
    piece = response_len.copy()
    piece[1:] += prompt_len[1:] - chains.gap_from[calls[1:]]  # the ids between a call and the one before
    starts, dropped, need = cut_chain(prompt_len, response_len, piece, P, R)
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


def cut_chain(
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


def _ids(seq: Sequence[int]) -> list[int]:
    """Ids as a list, so prefixes compare in C whatever sequence type they came in."""
    if type(seq) is list:
        return seq
    return seq.tolist() if isinstance(seq, np.ndarray) else list(seq)
