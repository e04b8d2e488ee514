"""Time :func:`aglverl.trajectory.batch.build_batch` against a per-row Python-list reference, like the old daemon's.

The reference pads every row as a Python list, converts the nested lists with ``torch.LongTensor`` and finds
the reward position with ``argmax`` over ``position_ids * attention_mask``, as Agent Lightning 0.1's
``AgentModeDaemon`` did (with this project's semantics: long prompts keep their last ids, empty responses
are dropped). Both timings start from the same Python lists and end with a ``DataProto``; the script checks
the two batches are identical and prints one JSON object to stdout.

    .venv/bin/python benchmarks/batch_build.py [--triplets 1024] [--repeats 7] [--seed 0] [--against DIR]

``--against DIR`` adds ``versus``: the ``build_batch`` of the aglverl package in ``DIR`` (``git archive <rev>
aglverl | tar -x -C DIR``; loaded under another name beside this tree's, from the same rollouts), timed
interleaved with this tree's, and whether both batches are identical.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from verl import DataProto

# A script's own directory is what Python puts on sys.path; the package lives one level up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from aglverl.trajectory.batch import BatchConfig, FinishedRollout, MissingRewardError, build_batch

TARGET_SPEEDUP = 10
VOCAB = 151_000
#: Lengths are drawn up to this multiple of the limit, so roughly 1 in 11 rows is truncated on each side.
OVERSHOOT = 1.1


def make_rollouts(
    n_triplets: int, group_size: int, max_turns: int, config: BatchConfig, seed: int
) -> list[FinishedRollout]:
    """Random rollouts totalling ``n_triplets`` triplets; token ids are plain Python lists, as from JSON."""
    rng = np.random.default_rng(seed)
    rollouts: list[FinishedRollout] = []
    left = n_triplets
    while left > 0:
        data_id = f"sample-{len(rollouts) // group_size}"
        n_turns = min(left, int(rng.integers(1, max_turns + 1)))
        left -= n_turns
        turns = []
        for _ in range(n_turns):
            p_len = int(rng.integers(1, int(config.max_prompt_length * OVERSHOOT) + 1))
            r_len = int(rng.integers(1, int(config.max_response_length * OVERSHOOT) + 1))
            turns.append((rng.integers(0, VOCAB, p_len).tolist(), rng.integers(0, VOCAB, r_len).tolist()))
        reward = float(rng.random())
        rollouts.append(FinishedRollout(f"ro-{len(rollouts)}", data_id, reward, turns))
    return rollouts


def reference_build(rollouts: Sequence[FinishedRollout], config: BatchConfig) -> DataProto:
    """Per-row list padding, then one tensor conversion per field: the old daemon's shape."""
    P, R, pad = config.max_prompt_length, config.max_response_length, config.pad_token_id
    prompt_rows: list[list[int]] = []
    prompt_masks: list[list[int]] = []
    response_rows: list[list[int]] = []
    response_masks: list[list[int]] = []
    rewards: list[float] = []
    drops: list[bool] = []
    data_ids: list[str] = []
    rollout_ids: list[str] = []
    turn_indices: list[int] = []
    for rollout in rollouts:
        reward = rollout.reward if rollout.reward is not None else config.reward_fill_value
        if reward is None:
            raise MissingRewardError(rollout.rollout_id)
        for turn_index, (prompt, response) in enumerate(rollout.turns):
            if len(response) == 0:
                continue
            drops.append(len(prompt) > P)
            prompt = list(prompt)[-P:]
            response = list(response)[:R]
            prompt_rows.append([pad] * (P - len(prompt)) + prompt)
            prompt_masks.append([0] * (P - len(prompt)) + [1] * len(prompt))
            response_rows.append(response + [pad] * (R - len(response)))
            response_masks.append([1] * len(response) + [0] * (R - len(response)))
            rewards.append(reward)
            data_ids.append(rollout.data_id)
            rollout_ids.append(rollout.rollout_id)
            turn_indices.append(turn_index)
    prompts = torch.LongTensor(prompt_rows)
    responses = torch.LongTensor(response_rows)
    attention_mask = torch.cat([torch.LongTensor(prompt_masks), torch.LongTensor(response_masks)], dim=-1)
    position_ids = torch.clamp(torch.cumsum(attention_mask, dim=-1) - 1, min=0)
    last_token = torch.argmax(position_ids * attention_mask, dim=-1)
    full_scores = torch.zeros(attention_mask.shape, dtype=torch.float32)
    full_scores[torch.arange(len(rewards)), last_token] = torch.tensor(rewards, dtype=torch.float32)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=-1),
        "attention_mask": attention_mask,
        "response_mask": attention_mask[:, P:].contiguous(),
        "position_ids": position_ids,
        "is_drop_mask": torch.BoolTensor(drops),
        "token_level_scores": full_scores[:, P:].contiguous(),
    }
    non_tensors = {
        "data_id_list": np.array(data_ids, dtype=object),
        "uid": np.array(data_ids, dtype=object),
        "rollout_id_list": np.array(rollout_ids, dtype=object),
        "turn_index_list": np.array(turn_indices, dtype=object),
    }
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info={})


def identical(a: DataProto, b: DataProto) -> bool:
    """Same keys, dtypes, shapes and values in both the tensor and the non-tensor batch."""
    if set(a.batch.keys()) != set(b.batch.keys()) or set(a.non_tensor_batch) != set(b.non_tensor_batch):
        return False
    for key in a.batch.keys():
        x, y = a.batch[key], b.batch[key]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            return False
    return all(a.non_tensor_batch[k].tolist() == b.non_tensor_batch[k].tolist() for k in a.non_tensor_batch)


def median_seconds(fns: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    """Median wall time of each function; runs are interleaved so load drift hits both, GC off like timeit."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, samples in zip(fns, times, strict=True):
            gc.collect()
            gc.disable()
            try:
                start = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - start)
            finally:
                gc.enable()
    return [statistics.median(samples) for samples in times]


def against(directory: str) -> Any:
    """The ``build_batch`` module of the aglverl package in ``directory``, imported as ``aglverl_against``
    (its imports within the package are relative, so it runs beside this tree's)."""
    root = Path(directory) / "aglverl"
    spec = importlib.util.spec_from_file_location(
        "aglverl_against", root / "__init__.py", submodule_search_locations=[str(root)]
    )
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules["aglverl_against"] = package
    spec.loader.exec_module(package)
    for name in ("aglverl_against.trajectory.batch", "aglverl_against.batch"):  # the house, or before it
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise SystemExit(
        f"--against {directory}: no build_batch in aglverl/trajectory/batch.py or aglverl/batch.py"
    )


def _fields(value: Any, into: type) -> dict[str, Any]:
    """``value``'s fields that the dataclass ``into`` also has (the benchmark's rollouts set no newer one)."""
    names = {f.name for f in dataclasses.fields(into)}
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.name in names}


def versus(
    rollouts: Sequence[FinishedRollout], config: BatchConfig, directory: str, repeats: int
) -> dict[str, Any]:
    """This tree's ``build_batch`` against the one in ``directory``, interleaved, from the same rollouts."""
    old = against(directory)
    old_config = old.BatchConfig(**_fields(config, old.BatchConfig))
    old_rollouts = [old.FinishedRollout(**_fields(r, old.FinishedRollout)) for r in rollouts]
    ours, _ = build_batch(rollouts, config)
    theirs, _ = old.build_batch(old_rollouts, old_config)
    old_s, new_s = median_seconds(
        [lambda: old.build_batch(old_rollouts, old_config), lambda: build_batch(rollouts, config)], repeats
    )
    return {
        "against": directory,
        "against_s": round(old_s, 4),
        "aglverl_s": round(new_s, 4),
        "change_pct": round(100 * (new_s / old_s - 1), 1),
        "identical": identical(ours, theirs),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--triplets", type=int, default=1024)
    parser.add_argument("--max-prompt-length", type=int, default=2048)
    parser.add_argument("--max-response-length", type=int, default=1024)
    parser.add_argument("--group-size", type=int, default=4, help="rollouts per data id (GRPO n)")
    parser.add_argument("--max-turns", type=int, default=4, help="triplets per rollout are 1..this")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--against", metavar="DIR", help="also time the build_batch of the aglverl in DIR")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="64 triplets, short rows, one repeat; the target not judged (a smoke run)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.triplets, args.repeats, args.max_prompt_length, args.max_response_length = 64, 1, 128, 64

    config = BatchConfig(
        max_prompt_length=args.max_prompt_length, max_response_length=args.max_response_length
    )
    rollouts = make_rollouts(args.triplets, args.group_size, args.max_turns, config, args.seed)
    # The first calls double as warm-up: first-call allocator and dispatcher costs are not the steady state.
    ours, metrics = build_batch(rollouts, config)
    same = identical(reference_build(rollouts, config), ours)
    reference_s, aglverl_s = median_seconds(
        [lambda: reference_build(rollouts, config), lambda: build_batch(rollouts, config)], args.repeats
    )
    speedup = reference_s / aglverl_s
    result = {
        "benchmark": "batch_build",
        "triplets": args.triplets,
        "rollouts": len(rollouts),
        "rows": len(ours),
        "real_tokens": int(ours.batch["attention_mask"].sum()),
        "prompts_truncated": int(metrics["batch/n_prompts_truncated"]),
        "responses_truncated": int(metrics["batch/n_responses_truncated"]),
        "max_prompt_length": args.max_prompt_length,
        "max_response_length": args.max_response_length,
        "repeats": args.repeats,
        "reference_s": round(reference_s, 4),
        "aglverl_s": round(aglverl_s, 4),
        "speedup": round(speedup, 1),
        "identical": same,
        "target_speedup": TARGET_SPEEDUP,
        "meets_target": same and speedup >= TARGET_SPEEDUP,
    }
    if args.against:
        result["versus"] = versus(rollouts, config, args.against, args.repeats)
    print(json.dumps(result))
    return 0 if result["meets_target"] or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
