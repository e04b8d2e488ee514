"""Tests for aglverl.trajectory.batch: hand-computed batches for small cases, and property tests against a per-row
Python-list reference built from the description in DESIGN.md and the README: a rollout's calls as a tree of
prefixes (its chains), each chain cut into rows by trying every cut."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import pickle
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from helpers.conversations import conversation
from hypothesis import given, settings
from hypothesis import strategies as st
from verl import DataProto

from aglverl.trajectory.batch import BatchConfig, FinishedRollout, MissingRewardError, build_batch, pad_rows
from aglverl.trajectory.rows import WidthWarning, build_rows
from aglverl.trajectory.signals import SignalConfig

TENSOR_DTYPES = {
    "prompts": torch.int64,
    "responses": torch.int64,
    "input_ids": torch.int64,
    "attention_mask": torch.int64,
    "response_mask": torch.int64,
    "position_ids": torch.int64,
    "is_drop_mask": torch.bool,
    "token_level_scores": torch.float32,
}
NON_TENSOR_KEYS = ("data_id_list", "uid", "rollout_id_list", "turn_index_list")

SMALL = BatchConfig(max_prompt_length=4, max_response_length=3, pad_token_id=0)


def rollout(
    rollout_id: str,
    *turns: tuple[Sequence[int], Sequence[int]],
    reward: float | None = 1.0,
    data_id: str = "g0",
) -> FinishedRollout:
    return FinishedRollout(rollout_id=rollout_id, data_id=data_id, reward=reward, turns=turns)


def tensor(batch: DataProto, key: str) -> torch.Tensor:
    return batch.batch[key]


def column(batch: DataProto, key: str) -> list[object]:
    return batch.non_tensor_batch[key].tolist()


def assert_tensor(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.equal(actual, expected), f"\n{actual}\n!=\n{expected}"


# --- hand-computed cases -------------------------------------------------------------------------------


def test_short_prompt_and_response_are_padded_left_and_right_with_pad_id() -> None:
    config = BatchConfig(max_prompt_length=4, max_response_length=3, pad_token_id=9)
    batch, metrics = build_batch([rollout("r0", ([5, 6], [7, 8]), ([2], [3]))], config)

    assert_tensor(tensor(batch, "prompts"), torch.tensor([[9, 9, 5, 6], [9, 9, 9, 2]]))
    assert_tensor(tensor(batch, "responses"), torch.tensor([[7, 8, 9], [3, 9, 9]]))
    assert_tensor(tensor(batch, "input_ids"), torch.tensor([[9, 9, 5, 6, 7, 8, 9], [9, 9, 9, 2, 3, 9, 9]]))
    assert_tensor(tensor(batch, "is_drop_mask"), torch.tensor([False, False]))
    assert metrics["batch/n_prompts_truncated"] == 0.0
    assert metrics["batch/n_responses_truncated"] == 0.0


def test_long_prompt_keeps_last_ids_and_is_marked_for_drop() -> None:
    batch, metrics = build_batch([rollout("r0", ([1, 2, 3, 4, 5, 6], [7]), ([1, 2, 3, 4], [7]))], SMALL)

    assert_tensor(tensor(batch, "prompts"), torch.tensor([[3, 4, 5, 6], [1, 2, 3, 4]]))
    assert_tensor(tensor(batch, "input_ids"), torch.tensor([[3, 4, 5, 6, 7, 0, 0], [1, 2, 3, 4, 7, 0, 0]]))
    assert_tensor(tensor(batch, "is_drop_mask"), torch.tensor([True, False]))  # exactly P ids is not too long
    assert metrics["batch/n_prompts_truncated"] == 1.0
    assert metrics["batch/prompt_length_mean"] == 4.0


def test_long_response_keeps_first_ids_and_is_counted_truncated() -> None:
    batch, metrics = build_batch([rollout("r0", ([1], [7, 8, 9, 10, 11]), ([1], [7, 8, 9]))], SMALL)

    assert_tensor(tensor(batch, "responses"), torch.tensor([[7, 8, 9], [7, 8, 9]]))
    assert_tensor(tensor(batch, "response_mask"), torch.tensor([[1, 1, 1], [1, 1, 1]]))
    assert_tensor(tensor(batch, "is_drop_mask"), torch.tensor([False, False]))  # responses never drop a row
    assert metrics["batch/n_responses_truncated"] == 1.0
    assert metrics["batch/response_length_mean"] == 3.0


def test_reward_sits_on_last_real_response_token_even_after_truncation() -> None:
    batch, _ = build_batch(
        [
            rollout("r0", ([5], [7]), reward=0.5),
            rollout("r1", ([5], [7, 8]), reward=-2.0),
            rollout("r2", ([5], [7, 8, 9, 10]), reward=3.25),
        ],
        SMALL,
    )

    assert_tensor(
        tensor(batch, "token_level_scores"),
        torch.tensor([[0.5, 0.0, 0.0], [0.0, -2.0, 0.0], [0.0, 0.0, 3.25]]),
    )


def test_rollout_reward_is_broadcast_to_every_turn() -> None:
    batch, _ = build_batch(
        [
            rollout("r0", ([1], [7, 8]), ([1, 2], [7]), ([1, 2, 3], [7, 8, 9]), reward=0.75),
            rollout("r1", ([1], [7]), reward=-1.0),
        ],
        SMALL,
    )

    assert_tensor(
        tensor(batch, "token_level_scores"),
        torch.tensor([[0.0, 0.75, 0.0], [0.75, 0.0, 0.0], [0.0, 0.0, 0.75], [-1.0, 0.0, 0.0]]),
    )


def test_position_ids_count_real_tokens_from_zero_and_repeat_over_pads() -> None:
    batch, _ = build_batch(
        [rollout("r0", ([5, 6], [7, 8]), ([1, 2, 3, 4, 5], [7, 8, 9, 10]), ([], [7]), ([2], [3]))], SMALL
    )

    assert_tensor(
        tensor(batch, "position_ids"),
        torch.tensor(
            [
                [0, 0, 0, 1, 2, 3, 3],
                [0, 1, 2, 3, 4, 5, 6],
                [0, 0, 0, 0, 0, 0, 0],
                [0, 0, 0, 0, 1, 1, 1],
            ]
        ),
    )


def test_attention_and_response_masks_cover_real_tokens_only() -> None:
    batch, _ = build_batch(
        [rollout("r0", ([5, 6], [7, 8]), ([1, 2, 3, 4, 5], [7, 8, 9, 10]), ([], [7]), ([2], [3]))], SMALL
    )

    assert_tensor(
        tensor(batch, "attention_mask"),
        torch.tensor(
            [
                [0, 0, 1, 1, 1, 1, 0],
                [1, 1, 1, 1, 1, 1, 1],
                [0, 0, 0, 0, 1, 0, 0],
                [0, 0, 0, 1, 1, 0, 0],
            ]
        ),
    )
    assert_tensor(tensor(batch, "response_mask"), torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 0, 0]]))


def test_group_rollout_and_turn_lists_follow_the_rows() -> None:
    batch, _ = build_batch(
        [
            rollout("r0", ([1], [7]), ([1], [8]), data_id="g0"),
            rollout("r1", ([1], [7]), data_id="g0"),
            rollout("r2", ([1], [7]), ([1], [8]), data_id="g1"),
        ],
        SMALL,
    )

    assert column(batch, "data_id_list") == ["g0", "g0", "g0", "g1", "g1"]
    assert column(batch, "uid") == ["g0", "g0", "g0", "g1", "g1"]
    assert column(batch, "rollout_id_list") == ["r0", "r0", "r1", "r2", "r2"]
    assert column(batch, "turn_index_list") == [0, 1, 0, 0, 1]
    for key in NON_TENSOR_KEYS:
        assert batch.non_tensor_batch[key].dtype == object
    assert all(type(i) is int for i in column(batch, "turn_index_list"))


def test_empty_response_turn_is_dropped_counted_and_its_index_skipped() -> None:
    batch, metrics = build_batch(
        [rollout("r0", ([1], [7]), ([1, 2], []), ([1, 2, 3], [9]), reward=2.0)], SMALL
    )

    assert len(batch) == 2
    assert_tensor(tensor(batch, "input_ids"), torch.tensor([[0, 0, 0, 1, 7, 0, 0], [0, 1, 2, 3, 9, 0, 0]]))
    assert_tensor(tensor(batch, "token_level_scores"), torch.tensor([[2.0, 0.0, 0.0], [2.0, 0.0, 0.0]]))
    assert column(batch, "turn_index_list") == [0, 2]
    assert metrics["batch/n_empty_responses_dropped"] == 1.0
    assert metrics["batch/n_triplets"] == 2.0


def test_rollout_without_triplets_is_counted_and_adds_no_rows() -> None:
    batch, metrics = build_batch([rollout("r0", reward=0.0), rollout("r1", ([1], [7]), reward=1.0)], SMALL)

    assert column(batch, "rollout_id_list") == ["r1"]
    assert metrics["batch/n_rollouts"] == 2.0
    assert metrics["batch/n_rollouts_without_triplets"] == 1.0
    assert metrics["batch/reward_mean"] == 0.5  # over rollouts, including the one without triplets


def test_missing_reward_is_filled_and_counted() -> None:
    config = BatchConfig(max_prompt_length=4, max_response_length=3, reward_fill_value=-0.5)
    batch, metrics = build_batch(
        [rollout("r0", ([1], [7, 8]), reward=None), rollout("r1", ([1], [7]), reward=1.5)], config
    )

    assert_tensor(tensor(batch, "token_level_scores"), torch.tensor([[0.0, -0.5, 0.0], [1.5, 0.0, 0.0]]))
    assert metrics["batch/n_rewards_filled"] == 1.0
    assert metrics["batch/reward_mean"] == 0.5


def test_missing_reward_raises_naming_the_rollout_when_fill_value_is_none() -> None:
    config = BatchConfig(max_prompt_length=4, max_response_length=3, reward_fill_value=None)
    rollouts = [rollout("fine", ([1], [7])), rollout("no-reward-here", ([1], [7]), reward=None)]

    with pytest.raises(MissingRewardError, match="no-reward-here") as info:
        build_batch(rollouts, config)
    assert isinstance(info.value, ValueError)
    assert info.value.rollout_id == "no-reward-here"


def test_missing_reward_in_rollout_without_triplets_still_raises_when_fill_value_is_none() -> None:
    config = BatchConfig(max_prompt_length=4, max_response_length=3, reward_fill_value=None)

    with pytest.raises(MissingRewardError, match="'empty'"):
        build_batch([rollout("empty", reward=None)], config)


@pytest.mark.parametrize(
    "rollouts",
    [[], [rollout("r0")], [rollout("r0", ([1, 2], []), ([], []))]],
    ids=["no-rollouts", "no-triplets", "only-empty-responses"],
)
def test_zero_rows_gives_zero_length_tensors_not_none(rollouts: list[FinishedRollout]) -> None:
    batch, metrics = build_batch(rollouts, SMALL)

    assert len(batch) == 0
    for key, dtype in TENSOR_DTYPES.items():
        assert tensor(batch, key).dtype == dtype
    assert tensor(batch, "input_ids").shape == (0, 7)
    assert tensor(batch, "prompts").shape == (0, 4)
    assert tensor(batch, "token_level_scores").shape == (0, 3)
    assert tensor(batch, "is_drop_mask").shape == (0,)
    for key in NON_TENSOR_KEYS:
        assert batch.non_tensor_batch[key].shape == (0,)
    assert metrics["batch/n_triplets"] == 0.0
    assert metrics["batch/prompt_length_mean"] == 0.0
    assert metrics["batch/response_length_mean"] == 0.0


def test_no_rollouts_gives_zero_reward_mean() -> None:
    _, metrics = build_batch([], SMALL)

    assert metrics["batch/reward_mean"] == 0.0
    assert metrics["batch/n_rollouts"] == 0.0


def test_metrics_of_a_mixed_batch() -> None:
    config = BatchConfig(max_prompt_length=4, max_response_length=3, reward_fill_value=0.0)
    _, metrics = build_batch(
        [
            rollout("r0", ([1, 2, 3, 4, 5], [7, 8, 9, 10]), ([1], []), reward=1.0),
            rollout("r1", ([1, 2], [7]), reward=None),
            rollout("r2", reward=2.0),
        ],
        config,
    )

    assert metrics == {
        "batch/n_rollouts": 3.0,
        "batch/n_rollouts_without_triplets": 1.0,
        "batch/n_triplets": 2.0,
        "batch/n_rows": 2.0,
        "batch/n_calls": 2.0,
        "batch/n_calls_merged": 0.0,
        "batch/n_chains_split_width": 0.0,
        "batch/n_calls_untrained_width": 0.0,
        "batch/n_generated_untrained_width": 0.0,
        "batch/n_calls_drifted": 0.0,
        "batch/n_trainer_tokens": 4.0 + 3 + 2 + 1,
        "batch/n_trainer_tokens_per_call": 4.0 + 3 + 2 + 1,
        "batch/n_empty_responses_dropped": 1.0,
        "batch/n_prompts_truncated": 1.0,
        "batch/n_rows_off_policy": 0.0,
        "batch/n_responses_truncated": 1.0,
        "batch/n_rewards_filled": 1.0,
        "batch/reward_mean": 1.0,
        "batch/prompt_length_mean": 3.0,
        "batch/response_length_mean": 2.0,
    }
    assert all(type(v) is float for v in metrics.values())


def test_tensors_have_verl_dtypes_and_independent_storage() -> None:
    batch, _ = build_batch([rollout("r0", ([5, 6], [7, 8]))], SMALL)

    for key, dtype in TENSOR_DTYPES.items():
        assert tensor(batch, key).dtype == dtype, key
        assert tensor(batch, key).is_contiguous(), key
    tensor(batch, "prompts")[0, 0] = 42
    tensor(batch, "attention_mask")[0, -1] = 42
    assert tensor(batch, "input_ids")[0, 0] == 0
    assert tensor(batch, "response_mask")[0, -1] == 0


def test_token_ids_may_be_tuples_or_numpy_arrays_and_inputs_are_not_modified() -> None:
    prompt, response = np.array([1, 2, 3, 4, 5], dtype=np.int32), (7, 8, 9, 10)
    batch, _ = build_batch([rollout("r0", (prompt, response))], SMALL)  # type: ignore[arg-type]

    assert_tensor(tensor(batch, "input_ids"), torch.tensor([[2, 3, 4, 5, 7, 8, 9]]))
    assert prompt.tolist() == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("bad_id", [1.5, "7", None, 2**63])
def test_token_id_that_is_not_an_int64_integer_raises_naming_the_turn(bad_id: object) -> None:
    rollouts = [rollout("r0", ([1], [7])), rollout("r1", ([1], [7]), ([1, bad_id], [7]))]  # type: ignore[list-item]

    with pytest.raises(ValueError, match=r"rollout 'r1' turn 1: prompt token ids"):
        build_batch(rollouts, SMALL)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_prompt_length", 0),
        ("max_prompt_length", -3),
        ("max_response_length", 0),
        ("pad_token_id", -1),
        ("reward_fill_value", float("nan")),
        ("reward_fill_value", float("inf")),
        ("reward_fill_value", 1e39),  # finite as a Python float, infinity as the rows' float32
    ],
)
def test_config_rejects_bad_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"BatchConfig.{field}"):
        BatchConfig(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_prompt_length", 2.0),
        ("max_response_length", True),
        ("pad_token_id", "0"),
        ("reward_fill_value", "0"),
    ],
)
def test_config_rejects_wrong_types_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(TypeError, match=f"BatchConfig.{field}"):
        BatchConfig(**{field: value})  # type: ignore[arg-type]


def test_batch_survives_pickling_and_groups_by_uid_in_verl_grpo_advantage() -> None:
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    batch, _ = build_batch(
        [
            rollout("a", ([1], [7, 8]), ([1, 2], [9]), data_id="g0", reward=1.0),
            rollout("b", ([1], [7]), data_id="g0", reward=0.0),
            rollout("c", ([1], [7]), data_id="g1", reward=0.5),
            rollout("d", ([1], [7, 8, 9]), data_id="g1", reward=0.5),
        ],
        SMALL,
    )
    batch = pickle.loads(pickle.dumps(batch))

    advantages, _ = compute_grpo_outcome_advantage(
        token_level_rewards=tensor(batch, "token_level_scores"),
        response_mask=tensor(batch, "response_mask"),
        index=batch.non_tensor_batch["uid"],
    )
    # Group g0 holds the rows of a (twice) and b: scores (1, 1, 0); g1's equal scores normalise to 0.
    std = float(np.std([1.0, 1.0, 0.0], ddof=1))
    high, low = (1 - 2 / 3) / std, (0 - 2 / 3) / std
    expected = torch.tensor(
        [[high, high, 0.0], [high, 0.0, 0.0], [low, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    )
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=1e-5)


# --- property test against a per-row reference -------------------------------------------------------


def prefix_tree(
    turns: Sequence[tuple[Sequence[int], Sequence[int]]],
) -> tuple[list[list[int]], dict[int, int], set[int]]:
    """DESIGN.md's chains, formulated as a tree of prefixes: each call with a response hangs under the latest
    earlier call that nothing hangs under yet and whose prompt + response begin its prompt; a call under none
    is a root, and drifted when it begins with such a call's prompt but not with its response. Returns the
    chains (root-to-leaf paths, each a list of turn indices), each call's parent, and the drifted roots."""
    parent: dict[int, int] = {}
    children: dict[int, int] = {}
    drifted: set[int] = set()
    called = [t for t, (_, response) in enumerate(turns) if len(response)]
    for k, turn in enumerate(called):
        prompt = list(turns[turn][0])
        leaves = [a for a in called[:k] if a not in children]
        whole = [
            a for a in leaves if prompt[: len(turns[a][0]) + len(turns[a][1])] == [*turns[a][0], *turns[a][1]]
        ]
        if whole:
            parent[turn], children[max(whole)] = max(whole), turn
        elif any(
            len(prompt) > len(turns[a][0]) and prompt[: len(turns[a][0])] == list(turns[a][0]) for a in leaves
        ):
            drifted.add(turn)
    roots = [t for t in called if t not in parent]
    chains = []
    for root in roots:
        path = [root]
        while path[-1] in children:
            path.append(children[path[-1]])
        chains.append(path)
    return chains, parent, drifted


def cut_by_search(
    turns: Sequence[tuple[Sequence[int], Sequence[int]]], chain: list[int], P: int, R: int
) -> tuple[list[list[int]], list[int]]:
    """The rows of one chain by trying every cut: the one that trains the most generated ids, then has the
    fewest rows, then the latest row starts. A row continuing past its first call must fit ``R``; a later
    row whose prompt is longer than ``P`` trains nothing and is no row (its calls are returned as untrained).
    Returns (rows as lists of turn indices, untrained turn indices)."""

    def added(i: int) -> int:  # what chain[i] adds to a row it continues: the ids between, then its response
        before = turns[chain[i - 1]]
        return len(turns[chain[i]][0]) - len(before[0]) - len(before[1]) + len(turns[chain[i]][1])

    best: tuple[int, int, list[int]] | None = None
    for cuts in itertools.product([False, True], repeat=len(chain) - 1):
        starts = [0] + [i + 1 for i, cut in enumerate(cuts) if cut]
        trained, valid = 0, True
        for start, end in zip(starts, [*starts[1:], len(chain)], strict=True):
            prompt, first = turns[chain[start]]
            if start > 0 and len(prompt) > P:
                continue  # untrained: no row, so no width either
            width = len(first) + sum(added(i) for i in range(start + 1, end))
            if end - start > 1 and width > R:
                valid = False
                break
            if start == 0 and len(prompt) > P:
                continue  # the conversation's first prompt is cut: a row, marked is_drop_mask
            trained += (
                min(width, R) if end - start == 1 else sum(len(turns[chain[i]][1]) for i in range(start, end))
            )
        key = (trained, -len(starts), starts)
        if valid and (best is None or key > best):
            best = key
    assert best is not None
    starts = best[2]
    rows, untrained = [], []
    for start, end in zip(starts, [*starts[1:], len(chain)], strict=True):
        calls = chain[start:end]
        if start > 0 and len(turns[chain[start]][0]) > P:
            untrained += calls
        else:
            rows.append(calls)
    return rows, untrained


def reference_rows(
    turns: Sequence[tuple[Sequence[int], Sequence[int]]], P: int, R: int, merge: bool
) -> tuple[list[tuple[list[int], list[tuple[int, list[int], list[int]]]]], dict[str, int]]:
    """The rows of one rollout as (prompt, [(turn, ids between, response)]), by first call, and the counts
    (merged, split for width, drifted, untrained calls and generated ids)."""
    chains, parent, drifted = prefix_tree(turns)
    counts = {"merged": 0, "split": 0, "drifted": len(drifted), "untrained": 0, "untrained_ids": 0}
    rows = []
    for chain in chains:
        cut = cut_by_search(turns, chain, P, R) if merge else ([[t] for t in chain], [])
        counts["untrained"] += len(cut[1])
        counts["untrained_ids"] += sum(len(turns[t][1]) for t in cut[1])
        for k, calls in enumerate(cut[0]):
            counts["split"] += merge and k > 0
            counts["merged"] += len(calls) - 1
            pieces = [(calls[0], [], list(turns[calls[0]][1]))]
            for turn in calls[1:]:
                before = turns[parent[turn]]
                between = list(turns[turn][0][len(before[0]) + len(before[1]) :])
                pieces.append((turn, between, list(turns[turn][1])))
            rows.append((list(turns[calls[0]][0]), pieces))
    rows.sort(key=lambda row: row[1][0][0])
    return rows, counts


def reference_build(
    rollouts: Sequence[FinishedRollout], config: BatchConfig, merge: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, list[object]], dict[str, float]]:
    """DESIGN.md's batch rules, one row at a time, with plain Python lists (``merge``: chains of calls)."""
    P, R, pad = config.max_prompt_length, config.max_response_length, config.pad_token_id
    rows: dict[str, list] = {key: [] for key in TENSOR_DTYPES}
    lists: dict[str, list[object]] = {key: [] for key in NON_TENSOR_KEYS}
    rewards: list[float] = []
    prompt_lengths: list[int] = []
    response_lengths: list[int] = []
    n_filled = n_dropped = n_cut_responses = n_without_triplets = n_calls = per_call_tokens = 0
    totals = {"merged": 0, "split": 0, "drifted": 0, "untrained": 0, "untrained_ids": 0}
    for r in rollouts:
        reward = r.reward
        if reward is None:
            if config.reward_fill_value is None:
                raise MissingRewardError(r.rollout_id)
            reward, n_filled = config.reward_fill_value, n_filled + 1
        rewards.append(reward)
        n_without_triplets += len(r.turns) == 0
        n_dropped += sum(len(response) == 0 for _, response in r.turns)
        chained, counts = reference_rows(r.turns, P, R, merge)
        totals = {k: totals[k] + counts[k] for k in totals}
        for prompt, pieces in chained:
            response, generated = [], []
            for _, between, ids in pieces:
                response += between + ids
                generated += [0] * len(between) + [1] * len(ids)
                n_calls += 1
            per_call_tokens += sum(min(len(r.turns[t][0]), P) + min(len(ids), R) for t, _, ids in pieces)
            rows["is_drop_mask"].append(len(prompt) > P)
            n_cut_responses += len(response) > R
            prompt, response, generated = prompt[-P:], response[:R], generated[:R]
            prompt_lengths.append(len(prompt))
            response_lengths.append(len(response))
            prompt_mask = [0] * (P - len(prompt)) + [1] * len(prompt)
            real = [1] * len(response) + [0] * (R - len(response))
            positions, seen = [], 0
            for m in prompt_mask + real:
                seen += m
                positions.append(max(seen - 1, 0))
            scores = [0.0] * R
            scores[len(response) - 1] = reward
            rows["prompts"].append([pad] * (P - len(prompt)) + prompt)
            rows["responses"].append(response + [pad] * (R - len(response)))
            rows["input_ids"].append(rows["prompts"][-1] + rows["responses"][-1])
            rows["attention_mask"].append(prompt_mask + real)
            rows["response_mask"].append(generated + [0] * (R - len(generated)))
            rows["position_ids"].append(positions)
            rows["token_level_scores"].append(scores)
            for key, value in zip(
                NON_TENSOR_KEYS, (r.data_id, r.data_id, r.rollout_id, pieces[0][0]), strict=True
            ):
                lists[key].append(value)
    row_shape: dict[str, tuple[int, ...]] = {
        "prompts": (P,),
        "responses": (R,),
        "response_mask": (R,),
        "token_level_scores": (R,),
    }
    row_shape |= {
        "input_ids": (P + R,),
        "attention_mask": (P + R,),
        "position_ids": (P + R,),
        "is_drop_mask": (),
    }
    tensors = {
        key: torch.tensor(rows[key], dtype=dtype).reshape(-1, *row_shape[key])
        for key, dtype in TENSOR_DTYPES.items()
    }
    metrics = {
        "batch/n_rollouts": float(len(rollouts)),
        "batch/n_rollouts_without_triplets": float(n_without_triplets),
        "batch/n_triplets": float(len(prompt_lengths)),
        "batch/n_rows": float(len(prompt_lengths)),
        "batch/n_calls": float(n_calls),
        "batch/n_calls_merged": float(totals["merged"]),
        "batch/n_chains_split_width": float(totals["split"]),
        "batch/n_calls_untrained_width": float(totals["untrained"]),
        "batch/n_generated_untrained_width": float(totals["untrained_ids"]),
        "batch/n_calls_drifted": float(totals["drifted"]),
        "batch/n_trainer_tokens": float(sum(prompt_lengths) + sum(response_lengths)),
        "batch/n_trainer_tokens_per_call": float(per_call_tokens),
        "batch/n_empty_responses_dropped": float(n_dropped),
        "batch/n_prompts_truncated": float(sum(rows["is_drop_mask"])),
        "batch/n_rows_off_policy": 0.0,
        "batch/n_responses_truncated": float(n_cut_responses),
        "batch/n_rewards_filled": float(n_filled),
        "batch/reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        "batch/prompt_length_mean": sum(prompt_lengths) / len(prompt_lengths) if prompt_lengths else 0.0,
        "batch/response_length_mean": sum(response_lengths) / len(response_lengths)
        if response_lengths
        else 0.0,
    }
    return tensors, lists, metrics


token_ids = st.lists(st.integers(0, 1_000), max_size=7)
rewards = st.none() | st.floats(-10.0, 10.0, allow_nan=False)


@st.composite
def rollout_batches(draw: st.DrawFn, chained: bool = False) -> tuple[list[FinishedRollout], BatchConfig]:
    config = BatchConfig(
        max_prompt_length=draw(st.integers(1, 5)),
        max_response_length=draw(st.integers(1, 5 if not chained else 9)),
        pad_token_id=draw(st.integers(0, 3)),
        reward_fill_value=draw(st.none() | st.floats(-1.0, 1.0)),
    )
    turns = conversation() if chained else st.lists(st.tuples(token_ids, token_ids), max_size=4)
    rollouts = [
        FinishedRollout(
            rollout_id=f"r{i}",
            data_id=f"g{draw(st.integers(0, 2))}",
            reward=draw(rewards),
            turns=draw(turns),
        )
        for i in range(draw(st.integers(0, 5)))
    ]
    return rollouts, config


def check_against_reference(
    case: tuple[list[FinishedRollout], BatchConfig], signal: SignalConfig | None, merge: bool
) -> None:
    rollouts, config = case
    try:
        expected_tensors, expected_lists, expected_metrics = reference_build(rollouts, config, merge)
    except MissingRewardError as exc:
        with pytest.raises(MissingRewardError, match=exc.rollout_id):
            build_batch(rollouts, config, signal)
        return

    batch, metrics = build_batch(rollouts, config, signal)

    extra = set() if signal is None else {"advantage_weights", "group_weights"}
    assert set(batch.batch.keys()) == set(TENSOR_DTYPES) | extra
    for key, expected_tensor in expected_tensors.items():
        assert_tensor(tensor(batch, key), expected_tensor)
    for key, expected_list in expected_lists.items():
        assert column(batch, key) == expected_list
    assert {k: v for k, v in metrics.items() if k.startswith("batch/")} == pytest.approx(expected_metrics)
    if signal is not None:
        assert tensor(batch, "advantage_weights").tolist() == [1.0] * len(batch)
        # a rollout is one member of its group: its k rows weigh 1/k each
        owners = expected_lists["rollout_id_list"]
        expected_weights = [1.0 / owners.count(owner) for owner in owners]
        assert tensor(batch, "group_weights").tolist() == pytest.approx(expected_weights)


@settings(max_examples=150, deadline=None)
@given(rollout_batches())
def test_build_batch_matches_per_row_reference(case: tuple[list[FinishedRollout], BatchConfig]) -> None:
    check_against_reference(case, None, merge=False)


@settings(max_examples=100, deadline=None)
@given(rollout_batches(chained=True))
def test_per_call_signal_config_builds_the_plain_batch(
    case: tuple[list[FinishedRollout], BatchConfig],
) -> None:
    """``trajectory="per_call"`` is the plain batch (one row per call), whatever the calls' prefixes."""
    check_against_reference(case, SignalConfig(trajectory="per_call"), merge=False)


@settings(max_examples=200, deadline=None)
@given(rollout_batches(chained=True))
def test_merged_batch_matches_the_chain_reference(case: tuple[list[FinishedRollout], BatchConfig]) -> None:
    """The default config merges chains: rows, masks, positions, scores and counts as the plain-Python chains
    give them, for conversations that extend, branch, drift and outgrow the width."""
    check_against_reference(case, SignalConfig(), merge=True)


@settings(max_examples=100, deadline=None)
@given(rollout_batches(chained=True), st.sampled_from(["merge", "per_call"]))
def test_rows_padded_to_the_widths_are_the_jagged_rows_and_pad_to_the_same_batch(
    case: tuple[list[FinishedRollout], BatchConfig], trajectory: str
) -> None:
    """The collector's layout (``padded=True``: each row at a stride of the widths, pads of ``pad_token_id``)
    holds the same rows as the producer's (end to end), and both pad to the same batch."""
    rollouts, config = case
    rollouts = [
        dataclasses.replace(r, reward=0.5, logprobs=[[-0.5] * len(resp) for _, resp in r.turns])
        for r in rollouts
    ]
    signal = SignalConfig(trajectory=trajectory)  # type: ignore[arg-type]
    jagged = build_rows(rollouts, config, signal)
    padded = build_rows(rollouts, config, signal, padded=True)

    n = len(jagged)
    assert len(padded) == n
    assert padded.is_padded(config)
    assert padded.prompt_ids.size == n * config.max_prompt_length
    assert padded.response_ids.size == n * config.max_response_length
    assert jagged.prompt_ids.size == int(jagged.prompt_len.sum())
    for i in range(n):
        assert padded.prompt(i).tolist() == jagged.prompt(i).tolist()
        assert padded.response(i).tolist() == jagged.response(i).tolist()
        assert padded.mask(i).tolist() == jagged.mask(i).tolist()
        lp_padded, lp_jagged = padded.row_logprobs(i), jagged.row_logprobs(i)
        assert (lp_padded is None) == (lp_jagged is None)
        assert lp_padded is None or lp_jagged is None or lp_padded.tolist() == lp_jagged.tolist()
    assert padded.metrics == jagged.metrics and padded.row_calls == jagged.row_calls

    from_jagged, from_padded = pad_rows(jagged, config), pad_rows(padded, config)
    assert set(from_jagged.batch.keys()) == set(from_padded.batch.keys())
    for key in from_jagged.batch.keys():
        assert_tensor(tensor(from_padded, key), tensor(from_jagged, key))
    for key in NON_TENSOR_KEYS:
        assert column(from_padded, key) == column(from_jagged, key)
    pointers = [t.untyped_storage().data_ptr() for t in from_padded.batch.values() if t.numel()]
    assert len(set(pointers)) == len(pointers)  # no two tensors share storage


@settings(max_examples=100, deadline=None)
@given(rollout_batches(chained=True))
def test_every_generated_id_is_trained_exactly_once_in_call_order_or_counted(
    case: tuple[list[FinishedRollout], BatchConfig],
) -> None:
    """Merged or not, the ids under ``response_mask`` of a rollout's rows are its calls' responses (each cut to
    the width only when it alone is longer), each once, in call order; a call in no row is counted untrained
    for the width, and the widths the batch names as needed would have trained every call."""
    rollouts, config = case
    rollouts = [dataclasses.replace(r, reward=0.0) for r in rollouts]
    built = build_rows(rollouts, config, SignalConfig())
    seen: dict[int, list[int]] = {}
    for i, (rollout_index, calls) in enumerate(zip(built.row_rollout.tolist(), built.row_calls, strict=True)):
        assert calls == sorted(calls) and calls[0] == built.turn_index[i]
        turns = rollouts[rollout_index].turns
        expected = [t for c in calls for t in list(turns[c][1])][: config.max_response_length]
        assert built.response(i)[built.mask(i) == 1].tolist() == expected
        seen.setdefault(rollout_index, []).extend(calls)
    untrained = 0
    for i, r in enumerate(rollouts):
        called = [t for t, (_, resp) in enumerate(r.turns) if len(resp)]
        assert set(seen.get(i, [])) <= set(called) and len(seen.get(i, [])) == len(set(seen.get(i, [])))
        untrained += len(called) - len(seen.get(i, []))
    assert built.metrics["batch/n_calls_untrained_width"] == untrained
    assert (built.untrained_needs == (0, 0)) == (untrained == 0)
    if untrained:
        P, R = built.untrained_needs
        for wider in (
            dataclasses.replace(config, max_prompt_length=P),
            dataclasses.replace(config, max_response_length=R),
        ):
            assert build_rows(rollouts, wider, SignalConfig()).metrics["batch/n_calls_untrained_width"] == 0


# --- merged trajectories: hand-built call chains ----------------------------------------------------------

WIDE = BatchConfig(max_prompt_length=4, max_response_length=8, pad_token_id=0)


def merged(
    *rollouts: FinishedRollout, config: BatchConfig = WIDE, **signal: object
) -> tuple[DataProto, dict]:
    return build_batch(list(rollouts), config, SignalConfig(**signal))  # type: ignore[arg-type]


def test_linear_chain_is_one_row_with_the_ids_between_calls_masked() -> None:
    # call 2's prompt = call 1's prompt + response + a tool result [9]; call 3 adds [8, 8] after call 2
    r = FinishedRollout(
        "r0",
        "g0",
        0.5,
        [([1, 2], [3, 4]), ([1, 2, 3, 4, 9], [5]), ([1, 2, 3, 4, 9, 5, 8, 8], [6, 7])],
        logprobs=[[-0.1, -0.2], [-0.3], [-0.4, -0.5]],
    )
    batch, metrics = merged(r)

    assert_tensor(tensor(batch, "prompts"), torch.tensor([[0, 0, 1, 2]]))
    assert_tensor(tensor(batch, "responses"), torch.tensor([[3, 4, 9, 5, 8, 8, 6, 7]]))
    assert_tensor(tensor(batch, "response_mask"), torch.tensor([[1, 1, 0, 1, 0, 0, 1, 1]]))
    assert_tensor(tensor(batch, "attention_mask"), torch.tensor([[0, 0] + [1] * 10]))
    assert_tensor(tensor(batch, "position_ids"), torch.tensor([[0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]]))
    assert_tensor(tensor(batch, "token_level_scores"), torch.tensor([[0.0] * 7 + [0.5]]))
    assert_tensor(
        tensor(batch, "rollout_log_probs"),
        torch.tensor([[-0.1, -0.2, 0.0, -0.3, 0.0, 0.0, -0.4, -0.5]], dtype=torch.float32),
    )
    assert_tensor(tensor(batch, "is_drop_mask"), torch.tensor([False]))
    assert column(batch, "turn_index_list") == [0]
    assert metrics["batch/n_calls"] == 3.0 and metrics["batch/n_rows"] == 1.0
    assert metrics["batch/n_calls_merged"] == 2.0 and metrics["batch/n_calls_drifted"] == 0.0
    assert metrics["batch/n_trainer_tokens"] == 2 + 8
    assert metrics["batch/n_trainer_tokens_per_call"] == (2 + 2) + (4 + 1) + (4 + 2)  # prompts cut to 4


def test_branch_starts_a_new_chain_and_a_later_call_continues_its_own_chain() -> None:
    # calls 0 and 1 are parallel (same history, different questions); call 2 continues call 0, call 3 call 1
    r = rollout(
        "r0",
        ([1], [5]),
        ([2], [6]),
        ([1, 5, 9], [7]),
        ([2, 6, 9], [8]),
        reward=1.0,
    )
    batch, metrics = merged(r)

    assert_tensor(tensor(batch, "prompts"), torch.tensor([[0, 0, 0, 1], [0, 0, 0, 2]]))
    assert_tensor(
        tensor(batch, "responses"), torch.tensor([[5, 9, 7, 0, 0, 0, 0, 0], [6, 9, 8, 0, 0, 0, 0, 0]])
    )
    assert_tensor(
        tensor(batch, "response_mask"), torch.tensor([[1, 0, 1, 0, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0, 0, 0]])
    )
    assert tensor(batch, "token_level_scores")[:, 2].tolist() == [1.0, 1.0]
    assert column(batch, "turn_index_list") == [0, 1]
    assert column(batch, "uid") == ["g0", "g0"]  # still one GRPO member per rollout's group
    assert metrics["batch/n_calls_merged"] == 2.0 and metrics["batch/n_calls_drifted"] == 0.0


def test_drifted_call_starts_a_new_row_and_is_counted() -> None:
    # call 2's prompt starts with call 1's prompt, but the answer was re-rendered: [4, 3] instead of [3, 4]
    r = rollout("r0", ([1, 2], [3, 4]), ([1, 2, 4, 3, 9], [5]), reward=1.0)
    batch, metrics = merged(r)

    assert_tensor(tensor(batch, "prompts"), torch.tensor([[0, 0, 1, 2], [2, 4, 3, 9]]))
    assert_tensor(tensor(batch, "responses"), torch.tensor([[3, 4] + [0] * 6, [5] + [0] * 7]))
    assert_tensor(tensor(batch, "response_mask"), torch.tensor([[1, 1] + [0] * 6, [1] + [0] * 7]))
    assert tensor(batch, "is_drop_mask").tolist() == [False, True]  # the new row's prompt was cut to 4
    assert metrics["batch/n_calls_drifted"] == 1.0 and metrics["batch/n_calls_merged"] == 0.0


def test_chain_wider_than_the_response_width_splits_at_a_call_boundary() -> None:
    config = BatchConfig(max_prompt_length=8, max_response_length=4)
    # merged, call 2 would make [3, 4, 9, 5, 6] (5 > 4): it starts a row with its own full prompt;
    # call 3 continues that row; call 4 (alone longer than the width) is the only one truncated
    r = rollout(
        "r0",
        ([1], [3, 4]),
        ([1, 3, 4, 9], [5, 6]),
        ([1, 3, 4, 9, 5, 6], [7]),
        ([1, 3, 4, 9, 5, 6, 7], [1, 2, 3, 4, 5]),
        reward=2.0,
    )
    batch, metrics = merged(r, config=config)

    assert_tensor(
        tensor(batch, "prompts"),
        torch.tensor([[0, 0, 0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 1, 3, 4, 9], [0, 1, 3, 4, 9, 5, 6, 7]]),
    )
    assert_tensor(tensor(batch, "responses"), torch.tensor([[3, 4, 0, 0], [5, 6, 7, 0], [1, 2, 3, 4]]))
    assert_tensor(tensor(batch, "response_mask"), torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]))
    assert_tensor(
        tensor(batch, "token_level_scores"), torch.tensor([[0, 2.0, 0, 0], [0, 0, 2.0, 0], [0, 0, 0, 2.0]])
    )
    assert column(batch, "turn_index_list") == [0, 1, 3]
    assert metrics["batch/n_chains_split_width"] == 2.0 and metrics["batch/n_calls_merged"] == 1.0
    assert metrics["batch/n_responses_truncated"] == 1.0
    assert metrics["batch/n_calls_untrained_width"] == 0.0  # every later prompt fits 8


def test_a_later_row_whose_prompt_does_not_fit_is_counted_untrained_and_named_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The conversation [1] -> [3, 4], then (+ [9]) -> [5, 6] is 5 ids wide, the row 3: the second call would
    start a row whose prompt, the 4 ids before it, is longer than 3. Cut to its last 3 ids it is a context the
    model never saw: no row, counted, and the settings that would train it are named once."""
    config = BatchConfig(max_prompt_length=3, max_response_length=3)
    r = rollout("r0", ([1], [3, 4]), ([1, 3, 4, 9], [5, 6]), reward=1.0)
    built = build_rows([r, dataclasses.replace(r, rollout_id="r1")], config, SignalConfig())
    batch = pad_rows(built, config)

    assert_tensor(tensor(batch, "prompts"), torch.tensor([[0, 0, 1], [0, 0, 1]]))
    assert_tensor(tensor(batch, "responses"), torch.tensor([[3, 4, 0], [3, 4, 0]]))
    assert tensor(batch, "is_drop_mask").tolist() == [False, False]
    assert tensor(batch, "group_weights").tolist() == [1.0, 1.0]  # each rollout: one row
    assert built.row_calls == [[0], [0]]
    metrics = built.metrics
    assert metrics["batch/n_calls"] == 2.0 and metrics["batch/n_chains_split_width"] == 0.0
    assert metrics["batch/n_calls_untrained_width"] == 2.0
    assert metrics["batch/n_generated_untrained_width"] == 4.0
    assert metrics["batch/n_prompts_truncated"] == 0.0
    # prompts of 4 (the second call starts its own row) or responses of 5 (one row) would train it
    assert built.untrained_needs == (4, 5)

    warning = WidthWarning(config, ("data.max_prompt_length", "data.max_response_length"))
    with caplog.at_level(logging.WARNING, logger="aglverl.trajectory.rows"):
        warning.note(built)
        warning.note(built)
    (record,) = caplog.records
    message = record.getMessage()
    assert message.startswith("2 calls (4 generated tokens) of merged conversations are not trained")
    assert "data.max_prompt_length >= 4" in message and "data.max_response_length >= 5" in message
    assert "batch/n_calls_untrained_width" in message


def test_the_cut_that_trains_the_most_generated_ids_is_taken() -> None:
    """[1] -> [2, 3]; + [9] -> [4]; + [9] -> [5]. Row width 4: going on while the calls fit gives [2, 3, 9, 4]
    and leaves the third call to a row whose prompt (6 ids) is longer than 5. Cutting after the first call
    instead trains all four ids: the second call's prompt (4 ids) fits, and so does [4, 9, 5]."""
    config = BatchConfig(max_prompt_length=5, max_response_length=4)
    r = rollout("r0", ([1], [2, 3]), ([1, 2, 3, 9], [4]), ([1, 2, 3, 9, 4, 9], [5]), reward=1.0)
    built = build_rows([r], config, SignalConfig())
    batch = pad_rows(built, config)

    assert_tensor(tensor(batch, "prompts"), torch.tensor([[0, 0, 0, 0, 1], [0, 1, 2, 3, 9]]))
    assert_tensor(tensor(batch, "responses"), torch.tensor([[2, 3, 0, 0], [4, 9, 5, 0]]))
    assert_tensor(tensor(batch, "response_mask"), torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]]))
    assert built.row_calls == [[0], [1, 2]]
    assert built.metrics["batch/n_calls_untrained_width"] == 0.0 and built.untrained_needs == (0, 0)
    assert built.metrics["batch/n_chains_split_width"] == 1.0 and built.metrics["batch/n_calls_merged"] == 1.0


def test_a_conversation_whose_first_prompt_is_cut_keeps_one_row_marked_and_counts_the_rest() -> None:
    config = BatchConfig(max_prompt_length=2, max_response_length=3)
    r = rollout("r0", ([1, 2, 3], [4]), ([1, 2, 3, 4, 9], [5, 6]), reward=1.0)
    built = build_rows([r], config, SignalConfig())

    assert_tensor(tensor(pad_rows(built, config), "prompts"), torch.tensor([[2, 3]]))
    assert built.is_drop.tolist() == [True]
    assert built.metrics["batch/n_prompts_truncated"] == 1.0
    assert built.metrics["batch/n_calls_untrained_width"] == 1.0
    assert built.untrained_needs == (5, 4)


def test_masked_call_in_the_middle_keeps_its_place_with_response_mask_zero() -> None:
    r = FinishedRollout(
        "r0",
        "g0",
        1.0,
        [([1], [3]), ([1, 3, 9], [4, 4]), ([1, 3, 9, 4, 4, 9], [5])],
        logprobs=[[-0.1], [-0.2, -0.3], [-0.4]],
        off_policy=[False, True, False],
    )
    batch, metrics = merged(r)

    assert_tensor(tensor(batch, "responses"), torch.tensor([[3, 9, 4, 4, 9, 5, 0, 0]]))
    assert_tensor(tensor(batch, "response_mask"), torch.tensor([[1, 0, 0, 0, 0, 1, 0, 0]]))
    assert_tensor(tensor(batch, "attention_mask")[:, 4:], torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]]))
    assert tensor(batch, "is_drop_mask").tolist() == [False]
    assert metrics["batch/n_rows_off_policy"] == 0.0
    # a row whose every call is off-policy must not train at all
    alone = dataclasses.replace(r, off_policy=[True, True, True])
    assert tensor(merged(alone)[0], "is_drop_mask").tolist() == [True]


def test_a_row_lacking_one_calls_logprobs_has_none_and_the_key_is_left_out() -> None:
    r = FinishedRollout("r0", "g0", 1.0, [([1], [3]), ([1, 3, 9], [4])], logprobs=[[-0.1], None])
    built = build_rows([r], WIDE, SignalConfig())
    assert "rollout_log_probs" not in pad_rows(built, WIDE).batch.keys()
    assert built.row_logprobs(0) is None and built.row_calls == [[0, 1]]
    assert built.metrics["logprobs/n_rows_missing"] == 1.0


def test_per_rollout_weighting_counts_merged_rows_not_calls() -> None:
    linear = rollout("r0", ([1], [3]), ([1, 3, 9], [4]), reward=1.0)
    branched = rollout("r1", ([1], [3]), ([2], [4]), reward=0.0)
    batch, _ = merged(linear, branched, turn_weighting="per_rollout")
    assert tensor(batch, "advantage_weights").tolist() == [1.0, 0.5, 0.5]
    assert tensor(batch, "group_weights").tolist() == [1.0, 0.5, 0.5]


def test_per_step_advantage_needs_per_call_rows() -> None:
    with pytest.raises(ValueError, match="trajectory='per_call'"):
        SignalConfig(advantage="per_step")
    assert SignalConfig(advantage="per_step", trajectory="per_call").trajectory == "per_call"
    with pytest.raises(ValueError, match="trajectory"):
        SignalConfig(trajectory="chains")  # type: ignore[arg-type]
