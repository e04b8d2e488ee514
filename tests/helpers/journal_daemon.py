"""A daemon process for the journal kill test: `python tests/helpers/journal_daemon.py JOURNAL N`.

Starts an AgentDaemon on the journal; submits a step of N samples unless the journal had an unfinished step
to recover; prints one JSON line with its URL and what it recovered, then one JSON line describing the batch.
"""

from __future__ import annotations

import sys

import anyio
import orjson

from aglverl import AgentDaemon, BatchConfig


async def main(journal: str, n: int) -> None:
    async with AgentDaemon(
        journal_path=journal, batch=BatchConfig(max_prompt_length=8, max_response_length=8)
    ) as d:
        recovered = [s.rollout_ids for s in d.recovered_steps]
        if not recovered:
            await d.submit([{"i": i} for i in range(n)])
        print(orjson.dumps({"server_url": d.server_url, "recovered": recovered}).decode(), flush=True)
        batch = await d.batches.receive()
        rows = batch.data.non_tensor_batch["rollout_id_list"].tolist()
        print(orjson.dumps({"rollout_ids": rows, "metrics": batch.metrics}).decode(), flush=True)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], int(sys.argv[2]))
