"""Tests for aglverl.verl_v1.sink's rows: the producer files its jagged rows as they come, and TransferQueue gets
exactly what unpadding the collector's padded batch of the same rollouts gives (as the sink did when the
producer padded): the same ids, masks, scores, log-probs, keys and tags, for conversations that extend, branch,
drift, outgrow the width, hold off-policy calls and lack some log-probs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from helpers.conversations import conversation
from hypothesis import given, settings
from hypothesis import strategies as st

from aglverl.trajectory.batch import BatchConfig, FinishedRollout, build_batch
from aglverl.trajectory.groups import FinishedGroup, GroupStats, Prompt
from aglverl.trajectory.rows import build_rows
from aglverl.trajectory.signals import SignalConfig
from aglverl.verl_v1.sink import TransferQueueSink

logprob = st.floats(-5.0, 0.0) | st.just(math.nan)


@st.composite
def rollouts(draw: st.DrawFn, rollout_id: str) -> FinishedRollout:
    """A rollout whose calls continue earlier ones, re-render them (drift) or start afresh; each call maybe
    off-policy, with or without (aligned, finite) logprobs, generated under some weight versions."""
    turns = draw(conversation(max_calls=4))
    logprobs = [
        draw(st.none() | st.lists(logprob, min_size=len(r), max_size=len(r)) | st.just([-1.0] * (len(r) + 1)))
        for _, r in turns
    ]
    versions = draw(st.lists(st.integers(0, 3), min_size=len(turns), max_size=len(turns)))
    return FinishedRollout(
        rollout_id,
        "g",
        draw(st.floats(-1.0, 1.0)),
        turns,
        logprobs=logprobs,
        off_policy=draw(st.lists(st.booleans(), min_size=len(turns), max_size=len(turns))),
        versions=versions,
        end_versions=[v + draw(st.integers(0, 1)) for v in versions],
    )


def unpadded(
    batch: Any, group: FinishedGroup, rollouts: Sequence[FinishedRollout], config: BatchConfig
) -> tuple[list[str], list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows as the sink made them from the padded batch (each row cut back to its attention's lengths, its
    mask zeroed when it must not train), its logprobs taken from each call's own, its versions from its calls'."""
    P, tensors = config.max_prompt_length, batch.batch
    keys, fields, tags = [], [], []
    for i in range(len(batch)):
        plen = int(tensors["attention_mask"][i, :P].sum())
        rlen = int(tensors["attention_mask"][i, P:].sum())
        prompts, responses = tensors["prompts"][i, P - plen :], tensors["responses"][i, :rlen]
        mask = tensors["response_mask"][i, :rlen] * int(not tensors["is_drop_mask"][i])
        session, calls = int(group.rows.row_rollout[i]), group.rows.row_calls[i]
        rollout = rollouts[session]
        logprobs = [rollout.logprobs[c] if rollout.logprobs else None for c in calls]
        # only a lone call is ever cut to the width: the logprobs of the ids it loses are never read
        kept = rlen if len(calls) == 1 else None
        present = all(
            lp is not None and len(lp) == len(rollout.turns[c][1]) and all(map(math.isfinite, lp[:kept]))
            for c, lp in zip(calls, logprobs, strict=True)
        )
        versions = rollout.versions or [-1] * len(rollout.turns)
        ends = rollout.end_versions or versions
        keys.append(f"p_{session}_{calls[0]}")
        fields.append(
            {
                "prompts": prompts,
                "responses": responses,
                "response_mask": mask,
                "loss_mask": mask,
                "input_ids": torch.cat([prompts, responses]),
                "position_ids": torch.arange(plen + rlen),
                "rm_scores": tensors["token_level_scores"][i, :rlen],
                "advantage_weights": tensors["advantage_weights"][i],
                "weight_version": torch.tensor(versions[calls[0]]),
                "num_turns": 2 * len(calls),
                "uid": batch.non_tensor_batch["uid"][i],
                "rollout_log_probs_valid": torch.tensor(int(present)),
            }
            | (
                {"rollout_log_probs": tensors["rollout_log_probs"][i, :rlen]}
                if "rollout_log_probs" in tensors
                else {}
            )
        )
        tags.append(
            {
                "status": "success",
                "prompt_len": plen,
                "response_len": rlen,
                "seq_len": plen + rlen,
                "global_steps": 3,
                "min_global_steps": min(versions[c] for c in calls),
                "max_global_steps": max(ends[c] for c in calls),
            }
        )
    return keys, fields, tags


def _group(rollouts: Sequence[FinishedRollout], config: BatchConfig, signal: SignalConfig) -> FinishedGroup:
    rows = build_rows(rollouts, config, signal)
    stats = GroupStats(
        "p", "train", 3, len(rollouts), len(rollouts), 0, 0.0, len(rows), 0.0, rows.metrics, False, 0, 0
    )
    return FinishedGroup(Prompt("p", {}, max(len(rollouts), 1), global_steps=3), "finished", rows, stats, [])


@settings(max_examples=200, deadline=None)
@given(
    cases=st.integers(0, 4).flatmap(lambda n: st.tuples(*[rollouts(f"r{i}") for i in range(n)])),
    widths=st.tuples(st.integers(1, 5), st.integers(1, 9)),
    trajectory=st.sampled_from(["merge", "per_call"]),
)
def test_the_sinks_rows_are_the_padded_batchs_rows_unpadded(
    cases: tuple[FinishedRollout, ...], widths: tuple[int, int], trajectory: str
) -> None:
    config = BatchConfig(max_prompt_length=widths[0], max_response_length=widths[1], pad_token_id=7)
    signal = SignalConfig(trajectory=trajectory)  # type: ignore[arg-type]
    group = _group(cases, config, signal)
    batch, metrics = build_batch(cases, config, signal)
    assert group.rows.metrics == metrics

    keys, fields, tags = TransferQueueSink(logprobs=True).rows(group)
    want_keys, want_fields, want_tags = unpadded(batch, group, cases, config)
    assert keys == want_keys and tags == want_tags
    for got, want in zip(fields, want_fields, strict=True):
        logprobs, valid = got.pop("rollout_log_probs"), got["rollout_log_probs_valid"]
        assert logprobs.dtype == torch.float32 and len(logprobs) == len(got["responses"])
        if "rollout_log_probs" in want:  # every row has them: the padded batch carries them too
            assert torch.equal(logprobs, want.pop("rollout_log_probs"))
        elif not valid:
            assert not logprobs.any()
        assert got.keys() == want.keys()
        for name, value in got.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == want[name].dtype and torch.equal(value, want[name]), name
            else:
                assert value == want[name], name


def test_a_merged_row_with_an_off_policy_call_and_a_branch_is_filed_jagged() -> None:
    """[1] -> [3]; + [9] -> [4, 4] (off-policy); + [9] -> [5]; and a branch [2] -> [6]: two rows, each only as
    long as its ids; the off-policy call keeps its place under mask 0, the branch starts its own key."""
    r = FinishedRollout(
        "r0",
        "g",
        1.0,
        [([1], [3]), ([1, 3, 9], [4, 4]), ([1, 3, 9, 4, 4, 9], [5]), ([2], [6])],
        logprobs=[[-0.1], [-0.2, -0.3], [-0.4], None],
        off_policy=[False, True, False, False],
        versions=[1, 1, 2, 2],
        end_versions=[1, 2, 2, 2],
    )
    group = _group([r], BatchConfig(max_prompt_length=4, max_response_length=8), SignalConfig())
    keys, fields, tags = TransferQueueSink(logprobs=True).rows(group)

    assert keys == ["p_0_0", "p_0_3"]
    merged, branch = fields
    assert merged["prompts"].tolist() == [1] and merged["responses"].tolist() == [3, 9, 4, 4, 9, 5]
    assert merged["response_mask"].tolist() == [1, 0, 0, 0, 0, 1]
    assert merged["rm_scores"].tolist() == [0.0] * 5 + [1.0]
    np.testing.assert_allclose(merged["rollout_log_probs"].numpy(), [-0.1, 0, -0.2, -0.3, 0, -0.4], rtol=1e-6)
    assert merged["num_turns"] == 6 and merged["weight_version"].item() == 1
    assert (tags[0]["min_global_steps"], tags[0]["max_global_steps"]) == (1, 2)
    assert branch["input_ids"].tolist() == [2, 6] and branch["rollout_log_probs_valid"].item() == 0
    assert branch["advantage_weights"].item() == 1.0 and branch["uid"] == "g"
    assert tags[1]["seq_len"] == 2
