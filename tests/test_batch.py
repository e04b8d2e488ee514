"""Tests for aglverl.batch: hand-computed batches for small cases, and a property test against a per-row
Python-list reference built from the description in DESIGN.md."""

from __future__ import annotations

import pickle
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from verl import DataProto

from aglverl.batch import BatchConfig, FinishedRollout, MissingRewardError, build_batch
from aglverl.signals import SignalConfig

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


def reference_build(
    rollouts: Sequence[FinishedRollout], config: BatchConfig
) -> tuple[dict[str, torch.Tensor], dict[str, list[object]], dict[str, float]]:
    """DESIGN.md's batch rules, one row at a time, with plain Python lists."""
    P, R, pad = config.max_prompt_length, config.max_response_length, config.pad_token_id
    rows: dict[str, list] = {key: [] for key in TENSOR_DTYPES}
    lists: dict[str, list[object]] = {key: [] for key in NON_TENSOR_KEYS}
    rewards: list[float] = []
    prompt_lengths: list[int] = []
    response_lengths: list[int] = []
    n_filled = n_dropped = n_cut_responses = n_without_triplets = 0
    for r in rollouts:
        reward = r.reward
        if reward is None:
            if config.reward_fill_value is None:
                raise MissingRewardError(r.rollout_id)
            reward, n_filled = config.reward_fill_value, n_filled + 1
        rewards.append(reward)
        n_without_triplets += len(r.turns) == 0
        for turn_index, (prompt, response) in enumerate(r.turns):
            if len(response) == 0:
                n_dropped += 1
                continue
            rows["is_drop_mask"].append(len(prompt) > P)
            n_cut_responses += len(response) > R
            prompt, response = list(prompt)[-P:], list(response)[:R]
            prompt_lengths.append(len(prompt))
            response_lengths.append(len(response))
            prompt_mask = [0] * (P - len(prompt)) + [1] * len(prompt)
            response_mask = [1] * len(response) + [0] * (R - len(response))
            positions, seen = [], 0
            for m in prompt_mask + response_mask:
                seen += m
                positions.append(max(seen - 1, 0))
            scores = [0.0] * R
            scores[len(response) - 1] = reward
            rows["prompts"].append([pad] * (P - len(prompt)) + prompt)
            rows["responses"].append(response + [pad] * (R - len(response)))
            rows["input_ids"].append(rows["prompts"][-1] + rows["responses"][-1])
            rows["attention_mask"].append(prompt_mask + response_mask)
            rows["response_mask"].append(response_mask)
            rows["position_ids"].append(positions)
            rows["token_level_scores"].append(scores)
            for key, value in zip(
                NON_TENSOR_KEYS, (r.data_id, r.data_id, r.rollout_id, turn_index), strict=True
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
def rollout_batches(draw: st.DrawFn) -> tuple[list[FinishedRollout], BatchConfig]:
    config = BatchConfig(
        max_prompt_length=draw(st.integers(1, 5)),
        max_response_length=draw(st.integers(1, 5)),
        pad_token_id=draw(st.integers(0, 3)),
        reward_fill_value=draw(st.none() | st.floats(-1.0, 1.0)),
    )
    rollouts = [
        FinishedRollout(
            rollout_id=f"r{i}",
            data_id=f"g{draw(st.integers(0, 2))}",
            reward=draw(rewards),
            turns=draw(st.lists(st.tuples(token_ids, token_ids), max_size=4)),
        )
        for i in range(draw(st.integers(0, 5)))
    ]
    return rollouts, config


@settings(max_examples=150, deadline=None)
@given(rollout_batches())
def test_build_batch_matches_per_row_reference(case: tuple[list[FinishedRollout], BatchConfig]) -> None:
    rollouts, config = case
    try:
        expected_tensors, expected_lists, expected_metrics = reference_build(rollouts, config)
    except MissingRewardError as exc:
        with pytest.raises(MissingRewardError, match=exc.rollout_id):
            build_batch(rollouts, config)
        return

    batch, metrics = build_batch(rollouts, config)

    assert set(batch.batch.keys()) == set(TENSOR_DTYPES)
    for key, expected_tensor in expected_tensors.items():
        assert_tensor(tensor(batch, key), expected_tensor)
    for key, expected_list in expected_lists.items():
        assert column(batch, key) == expected_list
    assert metrics == pytest.approx(expected_metrics)


@settings(max_examples=100, deadline=None)
@given(rollout_batches())
def test_default_signal_config_builds_the_plain_batch(
    case: tuple[list[FinishedRollout], BatchConfig],
) -> None:
    """The collector always passes a SignalConfig; its defaults must not change a plain batch."""
    rollouts, config = case
    try:
        plain, plain_metrics = build_batch(rollouts, config)
    except MissingRewardError as exc:
        with pytest.raises(MissingRewardError, match=exc.rollout_id):
            build_batch(rollouts, config, SignalConfig())
        return

    batch, metrics = build_batch(rollouts, config, SignalConfig())

    assert set(batch.batch.keys()) == set(TENSOR_DTYPES) | {"advantage_weights", "group_weights"}
    for key in TENSOR_DTYPES:
        assert_tensor(tensor(batch, key), tensor(plain, key))
    for key in NON_TENSOR_KEYS:
        assert column(batch, key) == column(plain, key)
    assert tensor(batch, "advantage_weights").tolist() == [1.0] * len(batch)
    assert tensor(batch, "group_weights").tolist() == [1.0] * len(batch)
    assert {k: v for k, v in metrics.items() if k.startswith("batch/")} == plain_metrics
