"""Microsoft Agent Framework's own Responses API client (``OpenAIChatClient``) through aglverl's proxy, as its lab
sample ``train_math_agent.py`` uses it: an agent with one function tool, ``store`` left to its default, run as a
program (``helpers/agent_framework_agent.py``) in the Python of the ``agl03`` tier's overlay venv where
agent-framework is installed with the constraints file (the session's ``agent_framework`` fixture, shared with
``test_agl03_constraints.py``: one install per tier run).

The backend is the vLLM-shaped mock with a tokenizer (so token-in renders the new tail in the proxy), answering
the agent's first call with a tool call and the next with text. What is checked: Agent Framework continues its
first response by ``previous_response_id``, sending only the tool's result, and the proxy takes it as a
continuation of that attempt's stored response (``aglverl.proxy.api.stored_responses``): the backend gets one
chat call holding the whole conversation, generated from exactly the recorded turn's prompt + generated ids; a
step of such agents (aglverl's agent loop in that program, against a daemon) trains one row per conversation with
no failed rollout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
from helpers.overlay import Overlay
from helpers.tokenin import counts, extends
from test_stored_responses import sent_ids
from test_translate import claim, finish, proxied

from aglverl import AgentDaemon, BatchConfig
from aglverl.proxy import LLMProxy
from aglverl.testing import MockVLLM

pytestmark = [pytest.mark.agl03, pytest.mark.anyio]

PROGRAM = Path(__file__).parent / "helpers" / "agent_framework_agent.py"
#: What each run's agent said: its tool call, the tool's result, its answer.
CONTENTS = [["function_call"], ["function_result"], ["text"]]


async def agents(overlay: Overlay, runs: int, *args: str) -> list[dict[str, Any]]:
    """The agent program run to its end in the overlay's Python with ``args``: the reports of its ``runs`` runs
    (fewer, or an exit status, is a failure showing what it wrote to stderr: an agent's error, as Agent Framework
    raised it)."""
    assert overlay.installed, overlay.why_not()
    done = await anyio.run_process([overlay.python, str(PROGRAM), *args], check=False)
    reports = [json.loads(line) for line in done.stdout.decode().splitlines()]
    assert done.returncode == 0 and len(reports) == runs, done.stderr.decode()[-4000:]
    return reports


async def test_agent_frameworks_client_continues_its_tool_call_by_response_id_from_the_turns_exact_ids(
    agent_framework: Overlay,
) -> None:
    async with MockVLLM(completion_tokens=3, tokenizer=True) as mock, proxied(mock.url) as (proxy, store):
        attempts = [claim(proxy, store) for _ in range(2)]
        reports = await agents(agent_framework, 2, "run", "--model", "mock", *(base for *_, base in attempts))
        calls = [finish(store, rid, aid) for rid, aid, _ in attempts]
        stored = [
            proxy.responses.get((rid, aid), c[-1].response_id or "")
            for (rid, aid, _), c in zip(attempts, calls, strict=True)
        ]
    assert [r["contents"] for r in reports] == [CONTENTS] * 2
    assert counts(proxy) == {"first_call": 2, "generated": 2}
    answers = {r["answer"]["id"]: r["answer"] for r in reports}  # runs end in any order
    for (first, second), kept in zip(calls, stored, strict=True):
        assert (first.status, second.status) == ("ok", "ok") and extends(first, second)  # one chain
        # what reached the proxy: the second call named the first response and sent only the tool's result
        assert kept is not None and [r.id for r in kept.chain()] == [first.response_id, second.response_id]
        assert [item["type"] for item in kept.input] == ["function_call_output"]
        assert answers[second.response_id or ""] == {
            "id": second.response_id,
            "previous_response_id": first.response_id,
            "store": True,
        }
    # the backend got each continued call as one chat call with the whole conversation, from the turn's exact ids
    continued = [r.json for r in mock.generation_requests() if sent_ids(r.json) is not None]
    assert sorted(sent_ids(b) or [] for b in continued) == sorted(
        second.prompt_token_ids or [] for _, second in calls
    )
    assert all(
        [m["role"] for m in b["messages"]] == ["system", "user", "assistant", "tool"] for b in continued
    )


async def test_a_step_of_agent_framework_agents_trains_one_row_per_conversation_with_no_failed_rollout(
    agent_framework: Overlay,
) -> None:
    reports: list[dict[str, Any]] = []

    async def run_agents(server_url: str) -> None:
        reports.extend(await agents(agent_framework, 4, "serve", server_url, "--tasks", "4"))

    config = BatchConfig(max_prompt_length=512, max_response_length=256)
    async with (
        MockVLLM(completion_tokens=3, tokenizer=True) as mock,
        AgentDaemon(backends=[mock.url], model="mock", batch=config) as daemon,
    ):
        with anyio.fail_after(90):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run_agents, daemon.server_url)
                await daemon.submit([{"question": "What is 2 + 3?"}, {"question": "What is 4 * 5?"}], n=2)
                batch = await daemon.batches.receive()
            # the program ended by itself: its four tasks done
        counters = daemon.proxy_counters()
        assert isinstance(daemon.proxy, LLMProxy)
        kept = len(daemon.proxy.responses)
    metrics = batch.metrics
    assert metrics["filter/n_rollouts"] == 4 and metrics["filter/n_masked"] == 0  # no rollout failed
    assert metrics["batch/n_calls"] == 8 and len(batch.data) == 4  # one row per conversation
    assert metrics["batch/n_calls_merged"] == 4 and metrics["batch/n_calls_drifted"] == 0
    assert counters["proxy/token_in_generated"] == 4 and counters["proxy/token_in_first_call"] == 4
    assert metrics["training/reward"] == 1.0  # every agent used its tool and answered
    assert kept == 0  # every rollout finished: what its attempts kept is freed
    assert all(r["contents"] == CONTENTS for r in reports)
    for answer in (r["answer"] for r in reports):
        assert answer["store"] is True and answer["previous_response_id"].startswith("resp_")
        assert answer["previous_response_id"] != answer["id"]
