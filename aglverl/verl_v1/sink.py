"""The producer's sink: each finished group's jagged rows filed in TransferQueue as verl's agent loop files them."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import torch

from ..trajectory.groups import FinishedGroup, Prompt

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
        """Keys, fields and tags of the group's rows, filed as they come (jagged: each only as long as its ids)."""
        rows, prompt = group.rows, group.prompt
        if not len(rows):
            return [], [], []
        prompt_ids, response_ids = torch.from_numpy(rows.prompt_ids), torch.from_numpy(rows.response_ids)
        response_mask = torch.from_numpy(rows.response_mask)
        prompt_start, prompt_len = rows.prompt_start.tolist(), rows.prompt_len.tolist()
        # a merged row's response holds the ids between its calls too
        response_start, response_len = rows.response_start.tolist(), rows.response_len.tolist()
        trains = (~rows.is_drop).tolist()
        scores = rows.scores.tolist()
        weights = rows.advantage_weights.tolist() if rows.advantage_weights is not None else None
        sessions, turns, n_calls = group.sessions.tolist(), rows.turn_index.tolist(), rows.n_calls.tolist()
        versions, low, high = rows.version.tolist(), rows.min_version.tolist(), rows.max_version.tolist()
        uids = rows.uid.tolist()
        validation = prompt.partition == "val"
        keys, fields, tags = [], [], []
        for i in range(len(rows)):
            plen, rlen = prompt_len[i], response_len[i]
            prompts = prompt_ids[prompt_start[i] : prompt_start[i] + plen]
            responses = response_ids[response_start[i] : response_start[i] + rlen]
            # 1 on the ids the engine generated for on-policy calls, 0 between calls (verl's agent-loop layout);
            # TransferQueue has no drop flag: a row that must not train has no loss token
            mask = response_mask[response_start[i] : response_start[i] + rlen] * int(trains[i])
            rm_scores = torch.zeros(rlen, dtype=torch.float32)
            rm_scores[-1] = scores[i]
            row: dict[str, Any] = {
                "prompts": prompts.clone(),
                "responses": responses.clone(),
                "response_mask": mask,
                "loss_mask": mask.clone(),
                "input_ids": torch.cat([prompts, responses]),
                "position_ids": torch.arange(plen + rlen, dtype=torch.int64),
                "rm_scores": rm_scores,
                "advantage_weights": torch.tensor(weights[i] if weights is not None else 1.0),
                "weight_version": torch.tensor(versions[i]),
                # an int, as verl's tool agent loop counts: the first prompt, then each call and each message
                # between two calls (2 for one call; verl's padding rows put 0)
                "num_turns": 2 * n_calls[i],
                "uid": uids[i],
            }
            if validation:
                row["data_source"] = str(prompt.fields.get("data_source", "aglverl"))
            if self.logprobs:
                logprobs = rows.row_logprobs(i)
                present = logprobs is not None
                row["rollout_log_probs"] = torch.from_numpy(logprobs) if present else torch.zeros(rlen)
                row["rollout_log_probs_valid"] = torch.tensor(int(present))
            keys.append(f"{prompt.uid}_{sessions[i]}_{turns[i]}")
            fields.append(row)
            tags.append(
                {
                    "status": "success",
                    "prompt_len": plen,
                    "response_len": rlen,
                    "seq_len": plen + rlen,
                    "global_steps": prompt.global_steps,
                    "min_global_steps": low[i],
                    "max_global_steps": high[i],
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
