"""verl's agent-loop manager, fulfilled by the daemon: ``generate_sequences`` hands prompts to the producer."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from ..trajectory.groups import Prompt
from .active_run import INPUT_KEY, Run

if TYPE_CHECKING:
    from tensordict import TensorDict


logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- manager
def _column(batch: TensorDict, key: str, size: int, default: Any = None) -> list[Any]:
    """One column of verl's prompt batch as a list (tensors, stacks of objects, or one value for all rows)."""
    from tensordict import NonTensorData, NonTensorStack

    if key not in batch.keys():
        return [default] * size
    value = batch.get(key)
    if isinstance(value, NonTensorData):
        return [value.data] * size
    if isinstance(value, NonTensorStack):
        return list(value.tolist())
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return list(value)


class DaemonAgentLoopManager:
    """verl's agent-loop manager contract, fulfilled by the daemon's agents: ``generate_sequences`` hands the
    prompts to the producer and returns at once (generation goes on; finished groups land in TransferQueue).

    Called from verl's trainer thread; the prompts reach the event loop through ``anyio.from_thread``.
    """

    def __init__(self, run: Run) -> None:
        self._run = run
        rollout = run.config.actor_rollout_ref.rollout
        self._n = {"train": int(rollout.n), "val": int(rollout.val_kwargs.n)}

    def generate_sequences(self, prompts: TensorDict) -> None:
        from tensordict import NonTensorData

        size = len(prompts)
        flag = prompts.get("validate", None) if "validate" in prompts.keys() else None
        validate = bool(flag.data if isinstance(flag, NonTensorData) else flag)
        partition = "val" if validate else "train"
        steps = _column(prompts, "global_steps", size, 0)
        counts = _column(prompts, "__rollout_n__", size, None)
        batch = [
            Prompt(
                uid=str(uid),
                input=task,
                n=int(n) if n is not None else self._n[partition],
                partition=partition,
                global_steps=int(step),
                index=int(index) if index is not None else None,
                fields={"data_source": source or "aglverl"},
            )
            for uid, task, index, source, step, n in zip(
                _column(prompts, "uid", size),
                _column(prompts, INPUT_KEY, size),
                _column(prompts, "index", size),
                _column(prompts, "data_source", size),
                steps,
                counts,
                strict=True,
            )
        ]
        run = self._run
        run.on_loop(
            lambda: run.producer.dispatch(
                batch, resources_id=run.resources[partition], mode="val" if validate else "train"
            )
        )
