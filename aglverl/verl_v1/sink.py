"""The producer's sink: each finished group's rows filed in TransferQueue as verl's agent loop files them."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import torch

from ..trajectory.groups import FinishedGroup, Prompt

if TYPE_CHECKING:

    pass


logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- sink
@dataclasses.dataclass(eq=False)
class _Write:
    """One group's rows (or a status change) waiting for the next TransferQueue write."""

    partition: str
    keys: list[str]
    fields: list[dict[str, Any]]
    tags: list[dict[str, Any]]
    statuses: dict[str, str]
    done: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    error: BaseException | None = None


class TransferQueueSink:
    """Files finished groups in TransferQueue as verl's ``AgentLoopWorkerTQ`` does (see the module docstring).

    Writes happen when someone is about to look (:meth:`flush`: the replay buffer before it reads
    TransferQueue's tags, the trainer before a checkpoint snapshots it): the groups that finished since the
    last look go in one write, rows first and then the groups' statuses, so whoever sees a group's terminal
    status finds its rows. Nothing is written while agents are busy (measured: per-group writes, in a worker
    thread, slowed the agents' event loop down by ~15% of the generation phase). A failed write raises in
    :meth:`flush`.

    Rows carry verl's fields (``prompts``, ``responses``, ``response_mask`` = ``loss_mask``: 1 on generated
    ids, 0 between a merged row's calls, ``input_ids``, ``position_ids``, ``rm_scores``, ``num_turns`` as
    verl's tool agent loop counts them, ``uid``) and aglverl's (``advantage_weights``, the ``weight_version`` of
    the row's first call); validation rows also ``data_source``. ``logprobs``: every row carries
    ``rollout_log_probs``, so the column stays whole; a row one of whose calls came back without the engine's
    logprobs (or whose agent posted triplets without them) is marked ``rollout_log_probs_valid = 0`` and the
    trainer counts it as on-policy (its recomputed log-probs stand in, see ``_compute_old_log_prob``).
    """

    def __init__(self, *, logprobs: bool) -> None:
        self.logprobs = logprobs
        self._queue: list[_Write] = []
        self._writing = False

    async def started(self, prompts: Sequence[Prompt]) -> None:
        self._queue += [_Write(p.partition, [], [], [], {p.uid: "running"}) for p in prompts]

    async def finished(self, group: FinishedGroup) -> None:
        keys, fields, tags = self.rows(group)
        prompt = group.prompt
        self._queue.append(_Write(prompt.partition, keys, fields, tags, {prompt.uid: group.status}))

    async def flush(self) -> None:
        """Write everything queued so far; return once it is in TransferQueue (also what a concurrent flush
        was writing). The first caller while no write runs writes for everyone; a failed write raises in every
        caller it held."""
        if not self._queue and not self._writing:
            return
        if self._writing:
            marker = _Write("", [], [], [], {})
            self._queue.append(marker)  # done once everything queued before it is written
            await marker.done.wait()
            if marker.error is not None:
                raise marker.error
            return
        self._writing = True
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                try:
                    await anyio.to_thread.run_sync(_write_batch, batch)
                except BaseException as exc:
                    for item in batch:
                        item.error = exc
                    raise
                finally:
                    for item in batch:
                        item.done.set()
        finally:
            self._writing = False

    def rows(self, group: FinishedGroup) -> tuple[list[str], list[dict[str, Any]], list[dict[str, Any]]]:
        """Keys, fields and tags of the group's rows (jagged: each row only as long as its tokens)."""
        data, prompt = group.data, group.prompt
        if not len(data):
            return [], [], []
        batch = data.batch
        width = batch["prompts"].shape[1]
        prompt_len = batch["attention_mask"][:, :width].sum(-1).tolist()
        # a merged row's response holds the ids between its calls too: its length is its attention's
        response_len = batch["attention_mask"][:, width:].sum(-1).tolist()
        trains = (~batch["is_drop_mask"]).tolist()
        uids = data.non_tensor_batch["uid"].tolist()
        weights = batch["advantage_weights"].tolist() if "advantage_weights" in batch.keys() else None
        validation = prompt.partition == "val"
        keys, fields, tags = [], [], []
        for i in range(len(data)):
            plen, rlen = prompt_len[i], response_len[i]
            session, turn = int(group.sessions[i]), int(group.turns[i])
            prompts = batch["prompts"][i, width - plen :]
            responses = batch["responses"][i, :rlen]
            # 1 on the ids the engine generated for on-policy calls, 0 between calls (verl's agent-loop layout)
            mask = batch["response_mask"][i, :rlen] * int(trains[i])
            row: dict[str, Any] = {
                "prompts": prompts.clone(),
                "responses": responses.clone(),
                "response_mask": mask,
                "loss_mask": mask.clone(),
                "input_ids": torch.cat([prompts, responses]),
                "position_ids": torch.arange(plen + rlen, dtype=torch.int64),
                "rm_scores": batch["token_level_scores"][i, :rlen].clone(),
                "advantage_weights": torch.tensor(weights[i] if weights is not None else 1.0),
                "weight_version": torch.tensor(int(group.versions[i])),
                # an int, as verl's tool agent loop counts: the first prompt, then each call and each message
                # between two calls (2 for one call; verl's padding rows put 0)
                "num_turns": 2 * int(group.n_calls[i]),
                "uid": uids[i],
            }
            if validation:
                row["data_source"] = str(prompt.fields.get("data_source", "aglverl"))
            if self.logprobs:
                logprobs = group.logprobs[i]
                present = logprobs is not None
                row["rollout_log_probs"] = torch.from_numpy(logprobs) if present else torch.zeros(rlen)
                row["rollout_log_probs_valid"] = torch.tensor(int(present))
            keys.append(f"{prompt.uid}_{session}_{turn}")
            fields.append(row)
            tags.append(
                {
                    "status": "success",
                    "prompt_len": plen,
                    "response_len": rlen,
                    "seq_len": plen + rlen,
                    "global_steps": prompt.global_steps,
                    "min_global_steps": int(group.row_min_versions[i]),
                    "max_global_steps": int(group.row_max_versions[i]),
                }
            )
        return keys, fields, tags


def _write_batch(batch: Sequence[_Write]) -> None:
    """Rows of every queued write, one put per partition; then every status change, one put per partition."""
    import transfer_queue as tq
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    partitions = dict.fromkeys(item.partition for item in batch if item.partition)
    for partition in partitions:
        items = [item for item in batch if item.partition == partition and item.keys]
        if items:
            tq.kv_batch_put(
                keys=[key for item in items for key in item.keys],
                partition_id=partition,
                fields=list_of_dict_to_tensordict([row for item in items for row in item.fields]),
                tags=[tag for item in items for tag in item.tags],
            )
    for partition in partitions:
        statuses = {
            uid: s for item in batch if item.partition == partition for uid, s in item.statuses.items()
        }
        if statuses:
            tq.kv_batch_put(
                keys=list(statuses), partition_id=partition, tags=[{"status": s} for s in statuses.values()]
            )
