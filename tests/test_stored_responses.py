"""Responses API agents that continue a stored response (``previous_response_id``), as OpenAI's docs write them,
through the real proxy to the vLLM-shaped mock (with a tokenizer, so token-in renders tails in the proxy) and to
the embedded engine (``aglverl.proxy.api.stored_responses``, ``aglverl.proxy.api.response_store``).

What is checked: the openai SDK agent calls a tool, sends only the tool's result with ``previous_response_id``
and goes on; each continued call reaches the backend as ONE chat completion carrying the whole conversation and
exactly the earlier turn's prompt + generated ids (token-in, no re-rendering of what came before); the records
chain, and a step of such agents trains one row per conversation with no failed rollout; an id of another
attempt or rollout, or of a response made with ``store: false``, is unknown as OpenAI answers an unknown id (400
``previous_response_not_found`` on a call, 404 on a read); ``GET`` / ``DELETE`` / ``input_items`` (OpenAI's
list, its ``order`` / ``after`` / ``limit``); the bounds; ``include`` values OpenAI takes; a duplicate item.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
from helpers.raw_http import Agent, request
from helpers.tokenin import GREEDY, a_step, counts, extends
from openai.types.responses import Response
from test_tokenin_engine import engine, one_request_each
from test_translate import claim, finish, lookup_run, openai_sdk, proxied

from aglverl import LLM, AgentDaemon, BatchConfig, Rollout
from aglverl.proxy import LLMProxy
from aglverl.proxy.shard import ProxyShard
from aglverl.store import TaskStore
from aglverl.testing import MockVLLM

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
LOOKUP = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}
KEYED = {  # the embedded engine's constrained decoding makes a call of this shape
    "type": "function",
    "name": "lookup",
    "parameters": {
        "type": "object",
        "properties": {"key": {"type": "string", "enum": ["x", "y"]}},
        "required": ["key"],
    },
}


async def create(client: openai.AsyncOpenAI, stream: bool, **kwargs: Any) -> Response:
    """One ``responses.create`` as the agent sees it: a stream's final response, or the whole one."""
    if not stream:
        return await client.responses.create(**kwargs)
    events = [e async for e in await client.responses.create(**kwargs, stream=True)]
    ends = ("response.completed", "response.incomplete")
    final: Response = next(e for e in events if e.type in ends).response
    return final


async def tool_conversation(
    client: openai.AsyncOpenAI,
    stream: bool,
    *,
    model: str = "mock",
    tool: dict[str, Any] = LOOKUP,
    **extra: Any,
) -> list[Response]:
    """An agent as OpenAI's docs write one: it asks, the model calls the tool, the agent sends only the tool's
    result with ``previous_response_id``, then a user turn the same way. Returns the three responses."""
    kwargs: dict[str, Any] = dict(model=model, instructions="Be brief.", tools=[tool], **extra)
    first = await create(client, stream, input="Look x up.", tool_choice="required", **kwargs)
    [call] = first.output
    assert call.type == "function_call" and call.name == "lookup"
    result = [{"type": "function_call_output", "call_id": call.call_id, "output": "x is 42"}]
    second = await create(client, stream, input=result, previous_response_id=first.id, **kwargs)
    third = await create(client, stream, input="Thanks.", previous_response_id=second.id, **kwargs)
    return [first, second, third]


def error_of(caught: pytest.ExceptionInfo[openai.APIStatusError]) -> dict[str, Any]:
    """The ``error`` object of an OpenAI-shaped error body the SDK raised for."""
    body = caught.value.body
    assert isinstance(body, dict)
    return body


def sent_ids(body: dict[str, Any]) -> list[int] | None:
    return (body.get("kv_transfer_params") or {}).get("prompt_token_ids")


# ---------------------------------------------------------------------------------------------- one conversation
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_tool_call_continued_with_previous_response_id_is_one_request_from_the_turns_exact_ids(
    stream: bool,
) -> None:
    async with MockVLLM(completion_tokens=3, tokenizer=True) as mock, proxied(mock.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        async with openai_sdk(base) as client:
            responses = await tool_conversation(client, stream)
        calls = finish(store, rid, aid)
    first, second, _ = responses
    assert counts(proxy) == {"first_call": 1, "generated": 2}
    assert all(extends(a, b) for a, b in itertools.pairwise(calls))  # one chain: one training row
    bodies = [r.json for r in mock.generation_requests()]
    assert len(bodies) == 3 and [sent_ids(b) for b in bodies[1:]] == [c.prompt_token_ids for c in calls[1:]]
    # the backend got the whole conversation (its parsers read it), the stored turn first
    [call] = first.output
    assert bodies[1]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Look x up."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "lookup", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "x is 42"},
    ]
    assert bodies[2]["messages"][-2:] == [
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Thanks."},
    ]
    # the new ids are the tail alone, rendered after the earlier turn's exact ids
    tail = calls[1].prompt_token_ids[len(calls[0].prompt_token_ids or []) + 3 :]  # type: ignore[index]
    assert bytes(tail) == b"\n<|tool|>x is 42\n<|assistant|>"
    assert [r.store for r in responses] == [True] * 3
    assert [r.previous_response_id for r in responses] == [None, first.id, second.id]
    assert all(c.status == "ok" and c.path == "/v1/responses" for c in calls)


async def test_on_the_embedded_engine_a_continued_tool_call_is_generated_from_the_engines_ids(
    tiny_model: Path, tmp_path: Path
) -> None:
    async with engine(tiny_model, tmp_path, "plain") as (server, hop), proxied(hop.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        async with openai_sdk(base) as client:
            await tool_conversation(
                client,
                True,
                model="tiny",
                tool=KEYED,
                max_output_tokens=48,
                parallel_tool_calls=False,
                extra_body=GREEDY,
            )
        calls = finish(store, rid, aid)
    assert counts(proxy) == {"first_call": 1, "generated": 2}
    one_request_each(hop, calls)
    assert all(extends(a, b) for a, b in itertools.pairwise(calls))
    tail = server.tokenizer.decode((calls[1].prompt_token_ids or [])[len(calls[0].prompt_token_ids or []) :])
    assert "<tool_response>\nx is 42\n</tool_response>" in tail


async def test_an_openai_agents_run_that_chains_its_calls_by_response_id_is_one_chain_from_ids() -> None:
    async with MockVLLM(completion_tokens=3, tokenizer=True) as mock, proxied(mock.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        async with openai_sdk(base) as client:
            result = await lookup_run(client, auto_previous_response_id=True)
        calls = finish(store, rid, aid)
    bodies = [r.json for r in mock.generation_requests()]
    assert len(bodies) == 2 and bodies[1]["messages"][-1]["role"] == "tool" and result.final_output
    assert counts(proxy) == {"first_call": 1, "generated": 1} and extends(calls[0], calls[1])
    assert sent_ids(bodies[1]) == calls[1].prompt_token_ids
    # the run's second call continued the first by its id (the SDK sent only the tool's result)
    first_id, second_id = (r.response_id for r in result.raw_responses)
    second = proxy.responses.get((rid, aid), second_id or "")
    assert second is not None and [r.id for r in second.chain()] == [first_id, second_id]
    assert [i["type"] for i in second.input] == ["function_call_output"]


async def test_the_requests_agent_frameworks_responses_client_sends_continue_as_one_chain() -> None:
    """The fields Microsoft Agent Framework's ``OpenAIChatClient`` (agent-framework-openai 1.17, its Responses
    client) sends, as its source makes them: the agent's system prompt as an input message of ``input_text``
    parts, ``include: ["reasoning.encrypted_content"]`` while no response is continued, then, in its tool loop,
    ``previous_response_id`` with only the ``function_call_output`` items (its function calls left out: the
    server has them) and no ``include``; ``store`` left out (OpenAI's default: true)."""
    system = {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Be brief."}]}
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Look x up."}]}
    async with MockVLLM(completion_tokens=3, tokenizer=True) as mock, proxied(mock.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        async with openai_sdk(base) as client:
            kwargs: dict[str, Any] = dict(model="mock", tools=[LOOKUP])
            first = await client.responses.create(
                **kwargs,
                input=[system, user],
                tool_choice="required",
                include=["reasoning.encrypted_content"],
            )
            [call] = first.output
            result = {"call_id": call.call_id, "type": "function_call_output", "output": "x is 42"}
            second = await client.responses.create(
                **kwargs, input=[result], tool_choice="auto", previous_response_id=first.id
            )
        calls = finish(store, rid, aid)
    assert second.status == "completed" and second.output_text
    assert counts(proxy) == {"first_call": 1, "generated": 1} and extends(calls[0], calls[1])
    [_, continued] = [r.json for r in mock.generation_requests()]
    assert [m["role"] for m in continued["messages"]] == ["system", "user", "assistant", "tool"]


# ---------------------------------------------------------------------------------------------- what is unknown
async def test_an_id_of_another_attempt_or_rollout_or_not_stored_is_unknown_as_openai_answers() -> None:
    async with MockVLLM(completion_tokens=2) as mock, proxied(mock.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        _, _, other_base = claim(proxy, store)
        async with openai_sdk(base) as client, openai_sdk(other_base) as other:
            kept = await client.responses.create(model="mock", input="x")
            unkept = await client.responses.create(model="mock", input="x", store=False)
            assert (kept.store, unkept.store) == (True, False)
            for who, response_id in ((other, kept.id), (client, unkept.id), (client, "resp_nope")):
                with pytest.raises(openai.BadRequestError) as refused:
                    await who.responses.create(model="mock", input="y", previous_response_id=response_id)
                error = error_of(refused)
                assert (error["code"], error["param"]) == (
                    "previous_response_not_found",
                    "previous_response_id",
                )
                assert error["type"] == "invalid_request_error"
                assert f"Previous response with id '{response_id}' not found" in error["message"]
                with pytest.raises(openai.NotFoundError) as unknown:
                    await who.responses.retrieve(response_id)
                assert error_of(unknown)["param"] == "response_id"
                assert f"Response with id '{response_id}' not found" in error_of(unknown)["message"]
            assert "another attempt or rollout" in error_of(refused)["message"]
            # another attempt of the SAME rollout (the first failed and was handed out again) has its own
            store.submit_result(Rollout(rollout_id=rid, attempt_id=aid, status="failed"))
            task = store.try_claim()
            assert task is not None and task.rollout_id == rid and task.attempt_id != aid
            retry_base = proxy.llm_resource("m").get_base_url(rid, task.attempt_id)
            async with openai_sdk(retry_base) as retry:
                with pytest.raises(openai.BadRequestError):
                    await retry.responses.create(model="mock", input="y", previous_response_id=kept.id)
            async with openai_sdk(f"{proxy.url}/v1") as unattributed:
                with pytest.raises(openai.NotFoundError):
                    await unattributed.responses.retrieve(kept.id)
    assert len(mock.generation_requests()) == 2  # nothing refused reached the backend


# ---------------------------------------------------------------------------------------------- reading back
async def test_get_delete_and_input_items_read_back_what_the_attempt_kept() -> None:
    async with MockVLLM(completion_tokens=3, tokenizer=True) as mock, proxied(mock.url) as (proxy, store):
        _, _, base = claim(proxy, store)
        async with openai_sdk(base) as client:
            first, second, third = await tool_conversation(client, False)
            got = await client.responses.retrieve(third.id)
            assert got.model_dump() == third.model_dump()
            # the items the third response was made from: the conversation so far, then its own input
            listed = await client.responses.input_items.list(third.id, order="asc", limit=100)
            kinds = [(i.type, getattr(i, "role", None)) for i in listed.data]
            assert kinds == [
                ("message", "user"),
                ("function_call", None),
                ("function_call_output", None),
                ("message", "assistant"),
                ("message", "user"),
            ]
            assert listed.data[1].id == first.output[0].id and listed.data[3].id == second.output[0].id
            assert listed.data[0].content[0].text == "Look x up." and not listed.has_more  # type: ignore[union-attr]
            assert (listed.first_id, listed.last_id) == (listed.data[0].id, listed.data[-1].id)
            ids = [i.id for i in listed.data]
            newest = await client.responses.input_items.list(third.id)  # OpenAI's default: newest first, 20
            assert [i.id for i in newest.data] == ids[::-1]
            pages, after = [], None
            while True:
                page = await client.responses.input_items.list(
                    third.id, order="asc", limit=2, **({"after": after} if after else {})
                )
                pages.append([i.id for i in page.data])
                if not page.has_more:
                    break
                after = page.last_id
            assert pages == [ids[:2], ids[2:4], ids[4:]]
            before = await client.responses.input_items.list(
                third.id, order="asc", limit=2, extra_query={"before": ids[3]}
            )
            assert [i.id for i in before.data] == ids[1:3] and before.has_more
            for bad, param in (
                (dict(limit=101), "limit"),
                (dict(order="up"), "order"),
                (dict(after="msg_x"), "after"),
                (dict(extra_query={"before": "msg_x"}), "before"),
            ):
                with pytest.raises(openai.BadRequestError) as refused:
                    await client.responses.input_items.list(third.id, **bad)  # type: ignore[arg-type]
                assert error_of(refused)["param"] == param
            with pytest.raises(openai.BadRequestError):
                await client.responses.retrieve(third.id, stream=True)
            # deleted: gone, and said so; the response that continued it keeps its conversation
            deleted = await client.with_raw_response.responses.delete(first.id)
            assert deleted.status_code == 200
            assert orjson.loads(deleted.content) == {"id": first.id, "object": "response", "deleted": True}
            with pytest.raises(openai.NotFoundError) as gone:
                await client.responses.delete(first.id)
            assert "deleted" in error_of(gone)["message"]
            fourth = await client.responses.create(
                model="mock",
                input="More.",
                previous_response_id=third.id,
                tools=[LOOKUP],
                instructions="Be brief.",
            )
            assert fourth.status == "completed"
    assert counts(proxy) == {"first_call": 1, "generated": 3}


async def test_a_read_or_delete_of_a_stored_response_is_admitted_at_its_head_and_keeps_its_connection() -> (
    None
):
    """The routes the proxy answers itself go through the same head as a call: without the token a 401 (the
    response neither read nor deleted), a finished attempt's a 409; let in, several on one kept connection. None
    reaches the backend."""
    async with MockVLLM(completion_tokens=2) as mock, proxied(mock.url, token="t") as (proxy, store):
        rid, aid, base = claim(proxy, store)
        async with openai_sdk(base, api_key="t") as client:
            kept = await client.responses.create(model="mock", input="x")
        path = f"/rollout/{rid}/attempt/{aid}/v1/responses/{kept.id}"
        token = ["Authorization: Bearer t"]
        async with Agent.connect(proxy.url) as agent:
            for method in ("GET", "DELETE"):
                refused = await agent.answer_after(request(path, method=method, length=False))
                assert refused is not None and refused.status == 401, refused
                assert "missing or wrong proxy token" in refused.json()["error"]["message"]
        async with Agent.connect(proxy.url) as agent:
            answers = [
                await agent.answer_after(request(path + tail, method=method, headers=token, length=False))
                for method, tail in (
                    ("GET", ""),
                    ("GET", "/input_items?limit=1"),
                    ("DELETE", ""),
                    ("GET", ""),
                )
            ]
        assert [a.status if a else None for a in answers] == [200, 200, 200, 404]
        assert answers[0] is not None and answers[0].json()["id"] == kept.id
        store.submit_result(Rollout(rollout_id=rid, attempt_id=aid, final_reward=1.0))
        async with Agent.connect(proxy.url) as agent:
            late = await agent.answer_after(request(path, method="GET", headers=token, length=False))
        assert late is not None and late.status == 409
    assert len(mock.generation_requests()) == 1


async def test_the_store_is_bounded_per_attempt_and_says_what_was_dropped() -> None:
    async with (
        MockVLLM(completion_tokens=2, tokenizer=True) as mock,
        proxied(mock.url, responses_per_attempt=2) as (proxy, store),
    ):
        rid, aid, base = claim(proxy, store)
        async with openai_sdk(base) as client:
            made = [await client.responses.create(model="mock", input="Turn 0.")]
            for turn in range(1, 4):
                made.append(
                    await client.responses.create(
                        model="mock", input=f"Turn {turn}.", previous_response_id=made[-1].id
                    )
                )
            assert proxy.responses.held_bytes((rid, aid)) > 0 and len(proxy.responses) == 2
            metrics = proxy.registry.render()
            assert "aglverl_proxy_stored_responses 2" in metrics
            assert f"aglverl_proxy_stored_response_bytes {proxy.responses.held_bytes((rid, aid))}" in metrics
            with pytest.raises(openai.BadRequestError) as dropped:
                await client.responses.create(model="mock", input="x", previous_response_id=made[0].id)
            message = error_of(dropped)["message"]
            assert "at most 2 responses" in message and "responses_per_attempt" in message
        calls = finish(store, rid, aid)
    # the kept responses hold their whole conversation: the chain goes on from its exact ids
    assert counts(proxy) == {"first_call": 1, "generated": 3}
    assert all(extends(a, b) for a, b in itertools.pairwise(calls))


async def test_include_values_openai_takes_are_accepted_and_a_duplicate_item_is_refused() -> None:
    async with MockVLLM(completion_tokens=3) as mock, proxied(mock.url) as (proxy, store):
        _, _, base = claim(proxy, store)
        async with openai_sdk(base) as client:
            first = await client.responses.create(
                model="mock",
                input="Look x up.",
                tools=[LOOKUP],
                tool_choice="required",
                include=[
                    "reasoning.encrypted_content",
                    "file_search_call.results",
                    "message.input_image.image_url",
                ],
            )
            with pytest.raises(openai.BadRequestError) as unknown:
                await client.responses.create(model="mock", input="x", include=["reasoning.everything"])  # type: ignore[list-item]
            assert error_of(unknown)["param"] == "include.0"
            [call] = first.output
            resent = [
                call.model_dump(exclude_none=True),
                {"type": "function_call_output", "call_id": call.call_id, "output": "42"},
            ]
            with pytest.raises(openai.BadRequestError) as duplicate:
                await client.responses.create(
                    model="mock", input=resent, previous_response_id=first.id, tools=[LOOKUP]
                )
            assert (
                error_of(duplicate)["param"] == "input.0.id" and "duplicate" in error_of(duplicate)["message"]
            )
    assert len(mock.generation_requests()) == 1


# ---------------------------------------------------------------------------------------------- training
async def test_a_step_of_agents_continuing_with_previous_response_id_trains_one_row_per_conversation() -> (
    None
):
    async def agent(task: dict[str, Any], llm: LLM) -> float:
        async with openai_sdk(llm.endpoint) as client:
            await tool_conversation(client, task["q"] % 2 == 0, model=llm.model, max_output_tokens=4)
        return float(task["q"] % 2)

    config = BatchConfig(max_prompt_length=256, max_response_length=256)
    async with (
        MockVLLM(completion_tokens=4, tokenizer=True) as mock,
        AgentDaemon(backends=[mock.url], model="mock", batch=config) as daemon,
    ):
        batch, counters = await a_step(daemon, agent)
        assert isinstance(daemon.proxy, LLMProxy)
        kept = len(daemon.proxy.responses)
    data, metrics = batch.data, batch.metrics
    assert metrics["filter/n_rollouts"] == 4 and metrics["filter/n_masked"] == 0  # no rollout failed
    assert metrics["batch/n_calls"] == 12 and len(data) == 4  # one row per conversation
    assert metrics["batch/n_calls_merged"] == 8 and metrics["batch/n_calls_drifted"] == 0
    assert counters["proxy/token_in_generated"] == 8 and counters["proxy/token_in_first_call"] == 4
    assert kept == 0  # every rollout finished: what its attempts kept is freed


async def test_a_finished_rollouts_responses_are_freed() -> None:
    async with MockVLLM(completion_tokens=2) as mock, proxied(mock.url) as (proxy, store):
        proxy_store: TaskStore = store
        proxy_store.on_attempt(proxy.attempt_changed)
        rid, aid, base = claim(proxy, store)
        _, _, other = claim(proxy, store)
        for url in (base, other):
            async with openai_sdk(url) as client:
                await client.responses.create(model="mock", input="x")
        assert proxy.responses.attempts == 2
        finish(store, rid, aid)
        assert proxy.responses.attempts == 1 and proxy.responses.held_bytes((rid, aid)) == 0


async def test_a_proxy_shard_frees_an_attempts_responses_when_the_store_revokes_it() -> None:
    async with MockVLLM(completion_tokens=2) as mock:
        shard = ProxyShard(0, host="127.0.0.1", freeze_gc=False)
        url, incarnation, _ = await shard.start()
        try:
            await shard.apply(
                incarnation, [("b", [mock.url]), ("a", "r1", "a1", None), ("a", "r1", "a2", None)]
            )
            for attempt in ("a1", "a2"):
                async with openai_sdk(f"{url}/rollout/r1/attempt/{attempt}/v1") as client:
                    await client.responses.create(model="mock", input="x")
            assert shard.proxy.responses.attempts == 2
            [call] = await shard.take(incarnation, "r1", "a1")  # the attempt posted: it ends here
            assert call.path == "/v1/responses"
            assert shard.proxy.responses.attempts == 1 and shard.proxy.responses.held_bytes(("r1", "a1")) == 0
            await shard.apply(incarnation, [("r", "r1", "a2")])  # its rollout ended
            assert shard.proxy.responses.attempts == 0
        finally:
            await shard.stop()
