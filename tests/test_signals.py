"""Tests for aglverl.trajectory.signals through build_batch: hand-computed rows, scores, groups, weights and metrics for
every filter and advantage mode, and the pure functions a trainer calls (advantages, log-prob mismatch)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from verl import DataProto
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, compute_rloo_outcome_advantage

from aglverl.trajectory.batch import BatchConfig, FinishedRollout, build_batch
from aglverl.trajectory.signals import (
    ROWS_DROPPED,
    SignalConfig,
    compute_advantage,
    grpo_advantages,
    logprob_mismatch,
    per_rollout_weights,
    stand_in_logprobs,
)

SMALL = BatchConfig(max_prompt_length=4, max_response_length=3, pad_token_id=0)
PLAIN_KEYS = {
    "prompts",
    "responses",
    "input_ids",
    "attention_mask",
    "response_mask",
    "position_ids",
    "is_drop_mask",
    "token_level_scores",
}
ROOT_HALF = 1 / math.sqrt(2)


def rollout(
    rollout_id: str,
    *turns: tuple[Sequence[int], Sequence[int]],
    reward: float | None = 1.0,
    data_id: str = "g0",
    completed: bool = True,
    reasons: tuple[str, ...] = (),
    turn_rewards: Sequence[float | None] | None = None,
    logprobs: Sequence[Sequence[float] | None] | None = None,
) -> FinishedRollout:
    return FinishedRollout(
        rollout_id,
        data_id,
        reward,
        turns,
        completed=completed,
        termination=frozenset(reasons),
        turn_rewards=turn_rewards,
        logprobs=logprobs,
    )


def rows(batch: DataProto, key: str = "rollout_id_list") -> list[object]:
    return batch.non_tensor_batch[key].tolist()


def assert_close(actual: torch.Tensor, expected: list) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=1e-5, rtol=1e-5)


def with_rewards(batch: DataProto) -> DataProto:
    """What the trainer does before computing advantages (no KL in the reward)."""
    batch.batch["token_level_rewards"] = batch.batch["token_level_scores"].clone()
    return batch


# --- the config ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("advantage", "per_turn", ValueError),
        ("turn_weighting", "once", ValueError),
        ("gamma", 1.5, ValueError),
        ("gamma", -0.1, ValueError),
        ("gamma", float("nan"), ValueError),
        ("gamma", True, TypeError),
        ("gamma", "0.9", TypeError),
        ("failure_reward", float("inf"), ValueError),
        ("min_group_size", 0, ValueError),
        ("min_group_size", 2.0, TypeError),
        ("rejection_sampling", 1, TypeError),
        ("mask_truncated", "yes", TypeError),
        ("request_logprobs", None, TypeError),
    ],
)
def test_config_rejects_bad_values_naming_the_field(field: str, value: object, error: type) -> None:
    with pytest.raises(error, match=f"SignalConfig.{field}"):
        SignalConfig(**{field: value})  # type: ignore[arg-type]


def test_config_from_dict_names_unknown_keys_and_takes_yaml_ints_for_floats() -> None:
    with pytest.raises(ValueError, match=r"\['mask_timeout', 'rejection'\]"):
        SignalConfig.from_dict({"rejection": True, "mask_timeout": False, "gamma": 0.5})
    config = SignalConfig.from_dict(
        {"gamma": 1, "failure_reward": -1, "advantage": "per_step", "trajectory": "per_call"}
    )
    assert config.gamma == 1.0 and type(config.gamma) is float and config.failure_reward == -1.0
    assert SignalConfig.from_dict(config.to_dict()) == config
    assert SignalConfig.from_dict(None) == SignalConfig() == SignalConfig.from_dict({})


# --- compact filtering ---------------------------------------------------------------------------------


def test_mixed_termination_reasons_mask_by_switch_and_stay_counted() -> None:
    config = SignalConfig(
        mask_truncated=True, mask_context_exceeded=True, mask_lease_expired=False, failure_reward=-1.0
    )
    batch, metrics = build_batch(
        [
            rollout("ok", ([1], [7]), reward=1.0),
            rollout("long", ([1], [7, 8, 9, 10]), reward=0.0),  # cut at R=3 by the batch builder
            rollout("turns", ([1], [7, 8]), reward=0.5, reasons=("max_turns",)),
            rollout("ctx", ([2], [7]), reward=0.0, data_id="g1", reasons=("context_exceeded",)),
            rollout("err", ([2], [8]), reward=None, data_id="g1", completed=False, reasons=("agent_error",)),
            rollout(
                "lease", ([2], [9, 9]), reward=None, data_id="g1", completed=False, reasons=("lease_expired",)
            ),
            rollout("late", reward=None, data_id="g1", completed=False, reasons=("step_timeout",)),
        ],
        SMALL,
        config,
    )

    assert rows(batch) == ["ok", "turns", "lease"]
    assert batch.batch["responses"].tolist() == [[7, 0, 0], [7, 8, 0], [9, 9, 0]]
    assert batch.batch["token_level_scores"].tolist() == [[1.0, 0, 0], [0, 0.5, 0], [0, -1.0, 0]]
    assert rows(batch, "uid") == ["g0", "g0", "g1"]
    assert {k: v for k, v in metrics.items() if k.startswith("filter/")} == {
        "filter/n_rollouts": 7.0,
        "filter/n_masked": 4.0,  # long, ctx, err, late
        "filter/n_rows_masked": 3.0,  # late had no turn
        "filter/n_failed_trained": 1.0,  # lease, with failure_reward
        "filter/n_agent_error": 1.0,
        "filter/n_step_timeout": 1.0,
        "filter/n_lease_expired": 1.0,
        "filter/n_truncated": 1.0,
        "filter/n_max_turns": 1.0,
        "filter/n_context_exceeded": 1.0,
    }
    # batch/* describe completed rollouts (ok, long, turns, ctx) and the rows actually in the batch.
    assert metrics["batch/n_rollouts"] == 4.0 and metrics["batch/reward_mean"] == 0.375
    assert metrics["batch/n_triplets"] == 3.0 == len(batch)
    assert metrics["batch/n_responses_truncated"] == 0.0


def test_masked_rollouts_leave_the_group_statistics() -> None:
    batch, _ = build_batch(
        [
            rollout("a", ([1], [7]), reward=1.0),
            rollout("b", ([1], [7]), reward=0.0),
            rollout("c", ([1], [7, 8, 9, 10]), reward=0.0),
        ],
        SMALL,
        SignalConfig(mask_truncated=True),
    )
    advantages = compute_advantage(with_rewards(batch), "grpo").batch["advantages"]

    # Group g0 is (1, 0) without the masked c: mean 0.5, std 1/sqrt(2).
    assert rows(batch) == ["a", "b"]
    assert_close(advantages, [[ROOT_HALF, 0, 0], [-ROOT_HALF, 0, 0]])


def test_failed_rollout_without_a_named_reason_counts_as_agent_error() -> None:
    batch, metrics = build_batch(
        [rollout("x", ([1], [7]), reward=None, completed=False)], SMALL, SignalConfig()
    )

    assert len(batch) == 0
    assert metrics["filter/n_agent_error"] == 1.0 and metrics["filter/n_masked"] == 1.0


def test_default_config_trains_on_truncated_responses_as_before() -> None:
    batch, metrics = build_batch([rollout("x", ([1], [7, 8, 9, 10]), reward=2.0)], SMALL, SignalConfig())

    assert batch.batch["token_level_scores"].tolist() == [[0, 0, 2.0]]
    assert metrics["filter/n_truncated"] == 1.0 and metrics["filter/n_masked"] == 0.0
    assert metrics["batch/n_responses_truncated"] == 1.0


# --- rejection sampling --------------------------------------------------------------------------------

GROUPS = [
    rollout("a1", ([1], [5]), reward=1.0, data_id="all"),
    rollout("a2", ([1], [6]), reward=1.0, data_id="all"),
    rollout("b1", ([1], [5]), reward=0.0, data_id="none"),
    rollout("b2", ([1], [6]), reward=0.0, data_id="none"),
    rollout("c1", ([1], [5]), ([1, 5, 2], [6]), reward=1.0, data_id="mixed"),
    rollout("c2", ([1], [7]), reward=0.0, data_id="mixed"),
    rollout("d1", ([1], [5]), reward=1.0, data_id="single"),
]


def test_rejection_sampling_drops_uniform_and_single_member_groups() -> None:
    batch, metrics = build_batch(GROUPS, SMALL, SignalConfig(rejection_sampling=True))

    assert rows(batch) == ["c1", "c2"]  # c1's second call continues its first: one merged row
    assert batch.batch["token_level_scores"].sum(-1).tolist() == [1.0, 0.0]
    assert {k: v for k, v in metrics.items() if k.startswith("rejection/")} == {
        "rejection/n_samples": 4.0,
        "rejection/n_samples_too_small": 0.0,
        "rejection/solve_all_rate": 0.5,  # all, single
        "rejection/solve_none_rate": 0.25,  # none
        "rejection/n_groups": 4.0,
        "rejection/n_groups_uniform": 3.0,
        "rejection/n_groups_dropped": 3.0,
        "rejection/n_rows_dropped": 5.0,
        "rejection/n_rollouts_dropped": 5.0,
    }
    assert metrics["batch/n_triplets"] == 2.0 and metrics["batch/n_rollouts"] == 7.0


def test_without_rejection_sampling_uniform_groups_are_counted_and_kept() -> None:
    batch, metrics = build_batch(GROUPS, SMALL, SignalConfig())

    assert len(batch) == 7
    assert metrics["rejection/n_groups_uniform"] == 3.0 and metrics["rejection/n_groups_dropped"] == 0.0
    assert metrics["rejection/solve_all_rate"] == 0.5


def test_min_group_size_counts_usable_rollouts_only() -> None:
    batch, metrics = build_batch(
        [
            rollout("x1", ([1], [5]), reward=1.0, data_id="g0"),
            rollout("x2", ([1], [5]), reward=None, data_id="g0", completed=False, reasons=("agent_error",)),
            rollout("y1", ([1], [5]), reward=1.0, data_id="g1"),
            rollout("y2", ([1], [6]), reward=0.0, data_id="g1"),
        ],
        SMALL,
        SignalConfig(min_group_size=2),
    )

    assert rows(batch) == ["y1", "y2"]
    assert metrics["rejection/n_samples_too_small"] == 1.0
    assert metrics["rejection/n_groups_dropped"] == 1.0 and metrics["rejection/n_rows_dropped"] == 1.0


@pytest.mark.parametrize(
    "rollouts",
    [[], [rollout("a", ([1], [5])), rollout("b", ([1], [6]))], [rollout("a", ([1], []), reward=0.0)]],
    ids=["empty-step", "all-uniform", "only-empty-responses"],
)
def test_nothing_left_gives_an_empty_batch_with_every_key(rollouts: list[FinishedRollout]) -> None:
    batch, metrics = build_batch(rollouts, SMALL, SignalConfig(rejection_sampling=True))

    assert len(batch) == 0
    assert set(batch.batch.keys()) == PLAIN_KEYS | {"advantage_weights", "group_weights"}
    assert batch.batch["input_ids"].shape == (0, 7) and batch.batch["token_level_scores"].shape == (0, 3)
    assert (
        batch.batch["advantage_weights"].shape == (0,)
        and batch.batch["advantage_weights"].dtype == torch.float32
    )
    assert all(batch.non_tensor_batch[k].shape == (0,) for k in ("uid", "data_id_list", "rollout_id_list"))
    assert metrics["batch/n_triplets"] == 0.0 and metrics["logprobs/present"] == 0.0
    assert all(math.isfinite(v) for v in metrics.values())


# --- advantage modes and turn weighting ----------------------------------------------------------------

TWO_AND_ONE = [
    rollout("a", ([1], [7]), ([1, 7, 2], [8, 9]), reward=1.0),
    rollout("b", ([1], [7]), reward=0.0),
]


def test_broadcast_counts_each_rollout_once_in_its_group_whatever_its_rows() -> None:
    """The default: a rollout is one member of its GRPO group (its k rows weigh 1/k in the mean and std, as
    AsyncVERL weighs them), and every row counts fully in the loss."""
    batch, _ = build_batch(TWO_AND_ONE, SMALL, SignalConfig())

    assert rows(batch) == ["a", "a", "b"]  # a's two calls do not fit one row of 3
    assert batch.batch["advantage_weights"].tolist() == [1.0, 1.0, 1.0]
    assert batch.batch["group_weights"].tolist() == [0.5, 0.5, 1.0]
    advantages = compute_advantage(with_rewards(batch), "grpo").batch["advantages"]
    # Rollouts (1, 0): mean 1/2, unbiased std 1/sqrt(2): a's rows +1/sqrt(2), b's -1/sqrt(2).
    assert_close(advantages, [[ROOT_HALF, 0, 0], [ROOT_HALF, ROOT_HALF, 0], [-ROOT_HALF, 0, 0]])


def test_one_row_per_rollout_is_verls_stock_grpo() -> None:
    batch, _ = build_batch(
        [
            rollout("a", ([1], [7]), reward=1.0),
            rollout("b", ([1], [8]), reward=0.0),
            rollout("c", ([1], [9])),
        ],
        SMALL,
        SignalConfig(),
    )
    batch = with_rewards(batch)
    expected, _ = compute_grpo_outcome_advantage(
        batch.batch["token_level_rewards"], batch.batch["response_mask"], batch.non_tensor_batch["uid"]
    )
    torch.testing.assert_close(compute_advantage(batch, "grpo").batch["advantages"], expected)


def test_broadcast_per_rollout_counts_each_rollout_once() -> None:
    batch, _ = build_batch(TWO_AND_ONE, SMALL, SignalConfig(turn_weighting="per_rollout"))

    assert batch.batch["advantage_weights"].tolist() == [0.5, 0.5, 1.0]
    assert batch.batch["group_weights"].tolist() == [0.5, 0.5, 1.0]
    advantages = compute_advantage(with_rewards(batch), "grpo").batch["advantages"]
    # Rollouts (1, 0): mean 1/2, std 1/sqrt(2): a +1/sqrt(2) spread over its 2 rows at 1/2 each; b -1/sqrt(2).
    half = ROOT_HALF / 2
    assert_close(advantages, [[half, 0, 0], [half, half, 0], [-ROOT_HALF, 0, 0]])


def _branches(rollout_id: str, k: int, reward: float) -> FinishedRollout:
    """A rollout of ``k`` calls none of which extends another (parallel calls): ``k`` rows."""
    return rollout(rollout_id, *[([10 + i], [7]) for i in range(k)], reward=reward)


@pytest.mark.parametrize("turn_weighting", ["per_turn", "per_rollout"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 7])
def test_a_group_left_with_one_rollout_has_no_baseline_whatever_its_number_of_rows(
    k: int, turn_weighting: str
) -> None:
    """Its other rollouts masked, the group has one member: mean 0 and std 1, as verl's GRPO treats a group of
    one, for every k (before the fix: decided from the float32 sum of k weights 1/k, so k = 3, 5, 6, 7 got
    advantage 0, and so did every k > 1 per_turn, whose rows were k members)."""
    batch, _ = build_batch(
        [_branches("a", k, 0.75), rollout("b", ([1], [7]), reward=0.0, completed=False)],
        SMALL,
        SignalConfig(turn_weighting=turn_weighting),  # type: ignore[arg-type]
    )
    assert rows(batch) == ["a"] * k
    advantages = compute_advantage(with_rewards(batch), "grpo").batch["advantages"]
    loss_weight = 1.0 / k if turn_weighting == "per_rollout" else 1.0
    assert_close(advantages[:, 0], [0.75 * loss_weight] * k)


def test_rollouts_of_three_five_and_one_rows_are_three_members_of_their_group() -> None:
    """Weights not exact in float32 (1/3, 1/5): members (1, 0.5, 0): mean 0.5, unbiased std 0.5."""
    batch, _ = build_batch(
        [_branches("a", 3, 1.0), _branches("c", 5, 0.5), _branches("b", 1, 0.0)], SMALL, SignalConfig()
    )
    weights = batch.batch["group_weights"]
    assert weights.tolist() == pytest.approx([1 / 3] * 3 + [1 / 5] * 5 + [1.0])
    assert weights[:3].double().sum().item() != 1.0  # three float32 thirds do not add up to one
    advantages = compute_advantage(with_rewards(batch), "grpo").batch["advantages"][:, 0]
    assert_close(advantages, [1.0] * 3 + [0.0] * 5 + [-1.0])


def test_both_training_paths_give_a_rollout_of_two_rows_the_advantage_of_one_member() -> None:
    """What tests/test_verl_v1.py checks for AsyncVERL's rows in TransferQueue (group "ga"), through the
    ``AgentDaemon.batches`` path: a merged row and a branch (two rows) is one member, and a row kept out of
    the loss for its prompt still counts in the statistics."""
    config = BatchConfig(max_prompt_length=64, max_response_length=48)
    long_prompt = list(range(1, 71))
    batch, _ = build_batch(
        [
            rollout("r0", ([1, 2], [3, 4]), ([1, 2, 3, 4, 5], [6]), ([7], [8]), reward=1.0),
            rollout("r1", ([1, 2], [7, 8, 9]), reward=0.0),
            rollout("r2", (long_prompt, [5]), reward=0.5),
        ],
        config,
        SignalConfig(),
    )
    assert rows(batch) == ["r0", "r0", "r1", "r2"] and batch.batch["is_drop_mask"].tolist()[-1]
    advantages = compute_advantage(with_rewards(batch), "grpo").batch["advantages"]
    # one member per rollout, scores (1, 0, 0.5): mean 0.5, unbiased std 0.5
    std = math.sqrt(((1 - 0.5) ** 2 + (0 - 0.5) ** 2) / 2)
    high, low = 0.5 / (std + 1e-6), -0.5 / (std + 1e-6)
    mask = batch.batch["response_mask"].bool()
    assert advantages[0][mask[0]].tolist() == pytest.approx([high] * 3, rel=1e-6)
    assert advantages[1][mask[1]].tolist() == pytest.approx([high], rel=1e-6)
    assert advantages[2][mask[2]].tolist() == pytest.approx([low] * 3, rel=1e-6)


def test_per_step_discounts_turn_rewards_and_groups_by_turn_index() -> None:
    config = SignalConfig(advantage="per_step", trajectory="per_call", gamma=0.5)
    batch, metrics = build_batch(
        [
            # G2 = 1.0 (final reward); G1 = 0.4 + 0.5 * 1.0 = 0.9 (empty response: no row); G0 = 0.2 + 0.5 * 0.9.
            rollout(
                "a", ([1], [5]), ([1, 5], []), ([1, 5, 6], [7]), reward=1.0, turn_rewards=[0.2, 0.4, None]
            ),
            # No turn rewards: G1 = 0.0 (final), G0 = 0.5 * 0.0.
            rollout("b", ([1], [6]), ([2], [8]), reward=0.0),
        ],
        SMALL,
        config,
    )

    assert rows(batch) == ["a", "a", "b", "b"]
    assert rows(batch, "turn_index_list") == [0, 2, 0, 1]
    assert rows(batch, "uid") == ["g0/0", "g0/2", "g0/0", "g0/1"]
    assert_close(batch.batch["token_level_scores"].sum(-1), [0.65, 1.0, 0.0, 0.0])
    advantages = compute_advantage(with_rewards(batch), "grpo").batch["advantages"]
    # g0/0 is (0.65, 0): +-1/sqrt(2); g0/2 and g0/1 have one member: verl's rule, mean 0 and std 1.
    assert_close(advantages, [[ROOT_HALF, 0, 0], [1.0, 0, 0], [-ROOT_HALF, 0, 0], [0.0, 0, 0]])
    assert metrics["rejection/n_groups"] == 3.0 and metrics["rejection/n_groups_uniform"] == 2.0


def test_per_step_rejection_drops_single_member_turn_groups() -> None:
    config = SignalConfig(advantage="per_step", trajectory="per_call", gamma=0.5, rejection_sampling=True)
    batch, metrics = build_batch(
        [
            rollout("a", ([1], [5]), ([1, 5, 6], [7]), reward=1.0, turn_rewards=[0.2, None]),
            rollout("b", ([1], [6]), reward=0.0),
        ],
        SMALL,
        config,
    )

    assert rows(batch, "uid") == ["g0/0", "g0/0"]
    assert_close(batch.batch["token_level_scores"].sum(-1), [0.7, 0.0])
    assert metrics["rejection/n_rows_dropped"] == 1.0 and metrics["rejection/n_rollouts_dropped"] == 0.0


def test_per_step_gamma_zero_scores_each_turn_with_its_own_reward() -> None:
    batch, _ = build_batch(
        [rollout("a", ([1], [5]), ([1], [6]), ([1], [7]), reward=1.0, turn_rewards=[0.25, None, 0.75])],
        SMALL,
        SignalConfig(advantage="per_step", trajectory="per_call", gamma=0.0),
    )

    # The last turn's score is the final reward, whatever its own triplet reward said.
    assert batch.batch["token_level_scores"].sum(-1).tolist() == [0.25, 0.0, 1.0]


def test_per_step_per_rollout_weights_the_loss_but_not_the_turn_groups() -> None:
    batch, _ = build_batch(
        TWO_AND_ONE,
        SMALL,
        SignalConfig(advantage="per_step", trajectory="per_call", turn_weighting="per_rollout"),
    )

    assert batch.batch["advantage_weights"].tolist() == [0.5, 0.5, 1.0]
    assert batch.batch["group_weights"].tolist() == [1.0, 1.0, 1.0]
    advantages = compute_advantage(with_rewards(batch), "grpo").batch["advantages"]
    # g0/0 is (1, 0): +-1/sqrt(2), a's half-weighted; g0/1 holds a alone: 1.0, half-weighted.
    assert_close(advantages, [[ROOT_HALF / 2, 0, 0], [0.5, 0.5, 0], [-ROOT_HALF, 0, 0]])


@pytest.mark.filterwarnings("ignore:.* engine is not available:UserWarning")  # verl's trainer import, on CPU
def test_other_estimators_are_verls_times_the_loss_weights() -> None:
    batch, _ = build_batch(
        TWO_AND_ONE,
        SMALL,
        SignalConfig(advantage="per_step", trajectory="per_call", turn_weighting="per_rollout"),
    )
    batch = with_rewards(batch)
    stock, _ = compute_rloo_outcome_advantage(
        batch.batch["token_level_rewards"], batch.batch["response_mask"], batch.non_tensor_batch["uid"]
    )

    advantages = compute_advantage(batch, "rloo").batch["advantages"]
    torch.testing.assert_close(advantages, stock * torch.tensor([[0.5], [0.5], [1.0]]))


@pytest.mark.filterwarnings("ignore:.* engine is not available:UserWarning")  # verl's trainer import, on CPU
def test_other_estimators_are_verls_over_rows_as_under_asyncverl() -> None:
    """verl's other estimators cannot weight group members: their groups are rows, on both training paths."""
    batch, _ = build_batch(TWO_AND_ONE, SMALL, SignalConfig(turn_weighting="per_rollout"))
    batch = with_rewards(batch)
    stock, _ = compute_rloo_outcome_advantage(
        batch.batch["token_level_rewards"], batch.batch["response_mask"], batch.non_tensor_batch["uid"]
    )

    advantages = compute_advantage(batch, "rloo").batch["advantages"]
    torch.testing.assert_close(advantages, stock * torch.tensor([[0.5], [0.5], [1.0]]))


@pytest.mark.filterwarnings("ignore:.* engine is not available:UserWarning")  # verl's trainer import, on CPU
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the rows' float32 cast
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN in the rejection checks
@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
@pytest.mark.parametrize("reward", [1e39, -math.exp(100), math.nan])
def test_a_row_whose_reward_is_not_finite_in_float32_is_dropped_and_counted_never_raised(
    estimator: str, reward: float, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 50: a reward of 1e39 becomes infinity in the float32 rows, and GRPO raised "token_level_rewards must
    be finite": one agent's number ended everyone's training. Now that row is dropped (advantage and return 0,
    out of its group's statistics: the others get what they would without it), a warning names it, and the
    result's ``meta_info`` counts it for the step's metrics."""
    good = [
        rollout("a", ([1], [7]), reward=1.0),
        rollout("b", ([1], [8]), reward=0.0),
        rollout("c", ([1], [9])),
    ]
    batch, _ = build_batch([*good, rollout("d", ([1], [6]), reward=reward)], SMALL, SignalConfig())
    batch = with_rewards(batch)
    assert not torch.isfinite(batch.batch["token_level_rewards"][3]).all()  # float32: 1e39 is inf
    with caplog.at_level("WARNING", logger="aglverl.trajectory.signals"):
        out = compute_advantage(batch, estimator)
    advantages = out.batch["advantages"]
    assert out.meta_info[ROWS_DROPPED] == 1 and "dropped 1 row(s) (rows [3])" in caplog.text
    assert torch.isfinite(advantages).all() and not advantages[3].any() and not out.batch["returns"][3].any()
    if estimator == "grpo":  # without the row: as if it had never been there
        alone, _ = build_batch(good, SMALL, SignalConfig())
        torch.testing.assert_close(
            advantages[:3], compute_advantage(with_rewards(alone), "grpo").batch["advantages"]
        )


def test_grpo_advantages_too_large_for_float32_drop_their_rows_not_the_step() -> None:
    """Scores at the float32 limit, without the std normalisation: a centred score past float32's range drops
    its row (advantage 0); the rows whose advantages fit keep them."""
    limit = 3.4e38
    rewards = torch.tensor([[limit], [-limit], [limit], [1.0], [0.0]])
    index = np.array(["g", "g", "g", "h", "h"], dtype=object)
    advantages = grpo_advantages(rewards, torch.ones(5, 1), index, norm_adv_by_std_in_grpo=False)
    mean = limit / 3
    torch.testing.assert_close(
        advantages, torch.tensor([[limit - mean], [0.0], [limit - mean], [0.5], [-0.5]], dtype=torch.float32)
    )


def test_grpo_without_std_normalisation_only_centres() -> None:
    batch, _ = build_batch(TWO_AND_ONE, SMALL, SignalConfig(turn_weighting="per_rollout"))
    advantages = compute_advantage(with_rewards(batch), "grpo", norm_adv_by_std_in_grpo=False)

    assert_close(advantages.batch["advantages"], [[0.25, 0, 0], [0.25, 0.25, 0], [-0.5, 0, 0]])
    assert torch.equal(advantages.batch["returns"], advantages.batch["advantages"])


@settings(max_examples=60, deadline=None)
@given(
    scores=st.lists(st.sampled_from([0.0, 0.5, 1.0, -2.0]), min_size=1, max_size=12),
    groups=st.lists(st.integers(0, 3), min_size=12, max_size=12),
    lengths=st.lists(st.integers(1, 3), min_size=12, max_size=12),
)
def test_unweighted_grpo_matches_verl(scores: list[float], groups: list[int], lengths: list[int]) -> None:
    n = len(scores)
    mask = (torch.arange(3)[None, :] < torch.tensor(lengths[:n])[:, None]).long()
    rewards = torch.zeros(n, 3)
    rewards[torch.arange(n), torch.tensor(lengths[:n]) - 1] = torch.tensor(scores)
    index = np.array([f"g{g}" for g in groups[:n]], dtype=object)

    expected, _ = compute_grpo_outcome_advantage(rewards, mask, index)
    torch.testing.assert_close(grpo_advantages(rewards, mask, index), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("k", [2, 3, 4, 5, 6, 8])
def test_one_rollouts_rows_at_one_kth_without_members_get_finite_advantages(k: int) -> None:
    """Issue 35, defect 9: a group holding one rollout's k rows at 1/k each, no members named (each row is
    one): the variance was divided by the weights' sum minus one, 0 here, so the advantages were NaN for
    k = 2, 4, 8 and, by float luck, 0 for odd k. Bessel's correction counts members: equal scores, advantage 0."""
    rewards = torch.zeros(k, 2)
    rewards[:, 1] = 0.75
    advantages = grpo_advantages(rewards, torch.ones(k, 2), np.array(["a"] * k), torch.full((k,), 1.0 / k))
    assert torch.isfinite(advantages).all()
    assert advantages.tolist() == [[0.0, 0.0]] * k


@settings(max_examples=100, deadline=None)
@given(
    scores=st.lists(st.sampled_from([0.0, 0.5, 1.0, -2.0]), min_size=1, max_size=12),
    groups=st.lists(st.integers(0, 3), min_size=12, max_size=12),
    scale=st.lists(st.floats(1e-3, 5.0), min_size=4, max_size=4),
)
def test_weights_equal_within_each_group_leave_verls_grpo_whatever_their_sum(
    scores: list[float], groups: list[int], scale: list[float]
) -> None:
    """Equal weights within a group cancel out of its weighted mean and std: the advantages are verl's, whether
    the group's weights add up to less than one, one, or more (before the fix: NaN, inf or other numbers)."""
    n = len(scores)
    rewards = torch.tensor(scores).reshape(n, 1)
    mask = torch.ones(n, 1)
    index = np.array([f"g{g}" for g in groups[:n]], dtype=object)
    weights = torch.tensor([scale[g] for g in groups[:n]], dtype=torch.float32)

    expected, _ = compute_grpo_outcome_advantage(rewards, mask, index)
    torch.testing.assert_close(grpo_advantages(rewards, mask, index, weights), expected, atol=1e-5, rtol=1e-5)


finite_or_not = st.floats(allow_nan=True, allow_infinity=True, width=32)


@settings(max_examples=300, deadline=None)
@given(
    data=st.integers(0, 8).flatmap(
        lambda n: st.tuples(
            st.lists(st.lists(finite_or_not, min_size=2, max_size=2), min_size=n, max_size=n),
            st.lists(st.integers(0, 2), min_size=n, max_size=n),
            st.none() | st.lists(finite_or_not, min_size=n, max_size=n),
            st.none() | st.lists(finite_or_not, min_size=n, max_size=n),
            st.none() | st.lists(st.integers(0, 3), min_size=n, max_size=n),
        )
    ),
    norm=st.booleans(),
)
def test_grpo_advantages_are_finite_or_refused_naming_the_input(
    data: tuple[list[list[float]], list[int], list[float] | None, list[float] | None, list[int] | None],
    norm: bool,
) -> None:
    """Whatever the scores, weights, groups and members: finite float32 advantages, or a ``ValueError`` saying
    which input was not usable; never NaN or infinity."""
    rewards, groups, group_weights, advantage_weights, members = data
    n = len(rewards)
    try:
        advantages = grpo_advantages(
            torch.tensor(rewards, dtype=torch.float32).reshape(n, 2),
            torch.ones(n, 2, dtype=torch.int64),
            np.array([f"g{g}" for g in groups], dtype=object),
            None if group_weights is None else torch.tensor(group_weights, dtype=torch.float32),
            None if advantage_weights is None else torch.tensor(advantage_weights, dtype=torch.float32),
            members=None if members is None else np.array([f"r{m}" for m in members], dtype=object),
            norm_adv_by_std_in_grpo=norm,
        )
    except ValueError as exc:  # aglverl's own weights: a row's scores never refuse the step (issue 50)
        assert "weights" in str(exc), exc
        return
    assert advantages.dtype == torch.float32 and advantages.shape == (n, 2)
    assert torch.isfinite(advantages).all()


# --- behaviour log-probs -------------------------------------------------------------------------------


def test_rollout_log_probs_are_aligned_with_responses_truncated_and_zero_padded() -> None:
    batch, metrics = build_batch(
        [
            rollout("a", ([1], [7, 8]), ([1], [7, 8, 9, 10]), logprobs=[[-0.5, -1.5], [-1, -2, -3, -4]]),
            rollout("b", ([1], [7]), ([1], []), reward=0.0, logprobs=[[-0.25], None]),  # empty turn: no row
        ],
        SMALL,
        SignalConfig(),
    )

    logprobs = batch.batch["rollout_log_probs"]
    assert logprobs.dtype == torch.float32 and logprobs.shape == batch.batch["responses"].shape
    assert logprobs.tolist() == [[-0.5, -1.5, 0.0], [-1.0, -2.0, -3.0], [-0.25, 0.0, 0.0]]
    assert metrics["logprobs/present"] == 1.0 and metrics["logprobs/n_rows_missing"] == 0.0


@pytest.mark.parametrize(
    "logprobs", [[[-0.5], None], [[-0.5], [-1.0, -2.0]], None], ids=["missing", "misaligned", "none-given"]
)
def test_one_row_without_aligned_logprobs_leaves_the_key_out(logprobs: list | None) -> None:
    batch, metrics = build_batch(
        [rollout("a", ([1], [7]), ([1], [8]), logprobs=logprobs)], SMALL, SignalConfig()
    )

    assert "rollout_log_probs" not in batch.batch.keys()
    assert metrics["logprobs/present"] == 0.0
    assert metrics["logprobs/n_rows_missing"] == (2.0 if logprobs is None else 1.0)


def test_only_rows_in_the_batch_need_logprobs() -> None:
    batch, metrics = build_batch(
        [
            rollout("a", ([1], [7]), logprobs=[[-0.5]]),
            rollout("b", ([1], [8, 9, 10, 11]), reward=0.0, logprobs=[None]),  # masked: truncated
        ],
        SMALL,
        SignalConfig(mask_truncated=True),
    )

    assert batch.batch["rollout_log_probs"].tolist() == [[-0.5, 0.0, 0.0]]
    assert metrics["logprobs/present"] == 1.0


def test_per_turn_lists_of_the_wrong_length_raise_naming_the_rollout() -> None:
    with pytest.raises(ValueError, match="rollout 'a' has 2 turns but 1 turn_rewards"):
        build_batch([rollout("a", ([1], [7]), ([1], [8]), turn_rewards=[1.0])], SMALL, SignalConfig())


def test_logprob_mismatch_over_response_tokens() -> None:
    old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    engine = torch.tensor([[-1.5, -2.0, 9.0], [-0.25, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])

    metrics = logprob_mismatch(old, engine, mask)
    # d = old - engine on the three response tokens: 0.5, 0.0, -0.25.
    k3 = (math.expm1(0.5) - 0.5 + 0.0 + math.expm1(-0.25) + 0.25) / 3
    assert metrics == pytest.approx(
        {
            "logprobs/abs_diff_mean": 0.25,
            "logprobs/abs_diff_max": 0.5,
            "logprobs/k3_kl": k3,
            "logprobs/n_tokens": 3.0,
        }
    )
    assert logprob_mismatch(old, old, mask)["logprobs/k3_kl"] == 0.0
    assert logprob_mismatch(old, engine, torch.zeros_like(mask))["logprobs/n_tokens"] == 0.0
    with pytest.raises(ValueError, match="rollout_log_probs has shape"):
        logprob_mismatch(old, engine[:, :2], mask)


def test_per_rollout_weights_give_each_of_a_rollouts_k_rows_one_kth() -> None:
    """What AsyncVERL's trainer puts in group_weights, from the rows' rollouts (their TransferQueue keys'
    ``{uid}_{session}``): a rollout is one member of its group whatever its number of rows."""
    weights = per_rollout_weights(["a_0", "a_1", "a_0", "a_0", "b_0", "pad1_0"])
    assert weights.dtype == torch.float32
    assert weights.tolist() == pytest.approx([1 / 3, 1.0, 1 / 3, 1 / 3, 1.0, 1.0])


def test_rows_without_the_engines_logprobs_take_the_trainers_and_leave_the_comparison() -> None:
    old = torch.tensor([[-1.0, -2.0], [-0.5, -0.25], [-3.0, -3.0]])
    engine = torch.tensor([[-1.5, -2.0], [0.0, 0.0], [-3.0, -2.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    missing = stand_in_logprobs(engine, old, torch.tensor([1, 0, 1]))

    assert missing.tolist() == [False, True, False]
    assert engine[1].tolist() == [-0.5, -0.25]  # on-policy by assumption: the trainer's own
    assert engine[0].tolist() == [-1.5, -2.0]
    metrics = logprob_mismatch(old, engine, mask, rows=~missing)
    assert metrics["logprobs/n_tokens"] == 3.0  # row 0's two tokens and row 2's first
    assert metrics["logprobs/abs_diff_max"] == 0.5
    with pytest.raises(ValueError, match="rows has shape"):
        logprob_mismatch(old, engine, mask, rows=torch.ones(2, dtype=torch.bool))


def test_verls_rollout_correction_reads_the_batchs_rollout_log_probs() -> None:
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

    batch, _ = build_batch(
        [rollout("a", ([1], [7, 8]), logprobs=[[-0.5, -1.0]]), rollout("b", ([1], [9]), logprobs=[[-2.0]])],
        SMALL,
        SignalConfig(),
    )
    mask = batch.batch["response_mask"]
    batch.batch["old_log_probs"] = (batch.batch["rollout_log_probs"] + 0.1) * mask

    batch, verl_metrics = compute_rollout_correction_and_add_to_batch(
        batch, {"rollout_is": "token", "rollout_is_threshold": 2.0}
    )
    ours = logprob_mismatch(batch.batch["old_log_probs"], batch.batch["rollout_log_probs"], mask)
    assert batch.batch["rollout_is_weights"].shape == mask.shape
    assert verl_metrics["rollout_corr/kl"] == pytest.approx(-0.1, abs=1e-6)
    assert verl_metrics["rollout_corr/k3_kl"] == pytest.approx(ours["logprobs/k3_kl"], abs=1e-6)
    assert ours["logprobs/abs_diff_mean"] == pytest.approx(0.1, abs=1e-6)
