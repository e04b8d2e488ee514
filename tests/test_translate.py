"""Responses API and Anthropic Messages through the proxy: the translation alone (bytes in, bytes out, checked
against the SDKs' own models), then the real SDK clients over loopback HTTP against recorded vLLM bytes, the
vLLM-shaped mock (tool calls, faults) and the embedded inference server, down to the training batch."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, ClassVar, Literal

import aiohttp
import anthropic
import anyio
import openai
import orjson
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from aglverl import AgentDaemon, BatchConfig, InferenceServer, Rollout, run_agents
from aglverl.metrics import Registry
from aglverl.models import LLM
from aglverl.proxy import LLMProxy, RetryPolicy
from aglverl.proxy.api import APIS, Route, TranslationError, Translator, error_body, new_translator
from aglverl.proxy.api.translator import Block, Exchange, Fields, items_of
from aglverl.proxy.sse import sse_event
from aglverl.store import LLMCall, TaskStore
from aglverl.testing import MockVLLM, load_replay_cases, tool_arguments

pytestmark = pytest.mark.anyio

FIXTURES = Path(__file__).parent / "fixtures" / "vllm"
CASES = load_replay_cases(FIXTURES)
FAST_RETRY = RetryPolicy(attempts=3, total_timeout=5.0, backoff_initial=0.01, backoff_max=0.05)
RESPONSE_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
MESSAGE_EVENT: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
LOOKUP_RESPONSES = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}
LOOKUP_MESSAGES = {"name": "lookup", "description": "Look up.", "input_schema": {"type": "object"}}


# ---------------------------------------------------------------------------------------------- helpers
def sse_events(raw: bytes) -> list[tuple[str | None, Any]]:
    """``(event name, parsed data)`` of every SSE event in ``raw``."""
    out = []
    for block in raw.decode().split("\n\n"):
        name, data = None, None
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        if data is not None:
            out.append((name, data if data == "[DONE]" else orjson.loads(data)))
    return out


def fixture_answer(name: str) -> tuple[list[int], list[int], str]:
    """Prompt ids, response ids and text of choice 0 of a recorded vLLM answer, read from its bytes."""
    case = CASES[name]
    if not case.streamed:
        body = orjson.loads(case.response)
        choice = body["choices"][0]
        return body["prompt_token_ids"], choice["token_ids"], choice["message"]["content"]
    prompt: list[int] = []
    ids: list[int] = []
    text = ""
    for _, event in sse_events(case.response):
        if event == "[DONE]":
            continue
        prompt = prompt or event.get("prompt_token_ids") or []
        for choice in event["choices"]:
            ids += choice.get("token_ids") or []
            text += choice["delta"].get("content") or ""
    return prompt, ids, text


def translate_stream(translator: Translator, raw: bytes, cuts: Sequence[int] = ()) -> bytes:
    translator.open(200, True)
    bounds = [0, *sorted(cuts), len(raw)]
    out = b"".join(translator.feed(raw[a:b]) for a, b in itertools.pairwise(bounds))
    return out + translator.close()


def stream_body(api: str) -> dict[str, Any]:
    """A streamed request in ``api`` that translates to the recorded ``chat_stream`` case's shape."""
    if api == "responses":
        return {"model": "tiny", "input": "x", "stream": True}
    return {"model": "tiny", "max_tokens": 10, "messages": [{"role": "user", "content": "x"}], "stream": True}


def requested(api: str, body: dict[str, Any]) -> Translator:
    translator = new_translator(api)
    translator.request(orjson.dumps(body))
    return translator


def chat_of(api: str, body: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = orjson.loads(new_translator(api).request(orjson.dumps(body)))
    return result


@asynccontextmanager
async def proxied(backend: str, **kwargs: Any) -> AsyncIterator[tuple[LLMProxy, TaskStore]]:
    store = TaskStore()
    proxy = LLMProxy(store, backends=[backend], registry=Registry(), retry=FAST_RETRY, **kwargs)
    async with anyio.create_task_group() as tg:
        await tg.start(proxy.serve)
        yield proxy, store
        tg.cancel_scope.cancel()


def claim(proxy: LLMProxy, store: TaskStore) -> tuple[str, str, str]:
    """A claimed rollout: its id, attempt id and proxy base URL (``.../v1``)."""
    store.enqueue({"q": 1})
    task = store.try_claim()
    assert task is not None and task.attempt_id is not None
    return (
        task.rollout_id,
        task.attempt_id,
        proxy.llm_resource("m").get_base_url(task.rollout_id, task.attempt_id),
    )


def finish(store: TaskStore, rollout_id: str, attempt_id: str) -> list[LLMCall]:
    store.submit_result(Rollout(rollout_id=rollout_id, attempt_id=attempt_id, final_reward=1.0))
    return store.record(rollout_id).calls


def openai_sdk(base: str, **kwargs: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base, api_key=kwargs.pop("api_key", "unused"), max_retries=0, **kwargs)


def anthropic_sdk(base: str, **kwargs: Any) -> anthropic.AsyncAnthropic:
    # The SDK appends /v1/messages itself: its base URL is the proxy's without /v1.
    key = kwargs.pop("api_key", "unused")
    return anthropic.AsyncAnthropic(base_url=base.removesuffix("/v1"), api_key=key, max_retries=0, **kwargs)


# ---------------------------------------------------------------------------------------------- requests
def test_responses_request_becomes_the_equivalent_chat_completion() -> None:
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Look up x."}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "lookup",
                "arguments": '{"k": 1}',
                "id": "fc_1",
            },
            {"type": "function_call", "call_id": "c2", "name": "lookup", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "two"}],
            },
            {"role": "developer", "content": "Answer now."},
        ],
        "tools": [LOOKUP_RESPONSES | {"strict": True, "description": "Look up."}],
        "tool_choice": {"type": "function", "name": "lookup"},
        "parallel_tool_calls": False,
        "max_output_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "store": False,
        "include": [],
        "metadata": {"k": "v"},
        "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}}},
        "top_k": 5,
    }
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"k": 1}'}},
        {"id": "c2", "type": "function", "function": {"name": "lookup", "arguments": "{}"}},
    ]
    assert chat_of("responses", body) == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Look up x."}]},
            {
                "role": "assistant",
                "content": "Sure.",
                "tool_calls": calls,
            },  # one assistant turn, as chat has it
            {"role": "tool", "tool_call_id": "c1", "content": "one"},
            {"role": "tool", "tool_call_id": "c2", "content": "two"},
            {"role": "system", "content": "Answer now."},
        ],
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "lookup",
                    "parameters": {"type": "object", "properties": {}},
                    "description": "Look up.",
                    "strict": True,
                },
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "lookup"}},
        "parallel_tool_calls": False,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "out", "schema": {"type": "object"}},
        },
        "top_k": 5,
    }
    assert chat_of("responses", {"model": "m", "input": "hi", "stream": True}) == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},  # the final event's usage
    }


def test_messages_request_becomes_the_equivalent_chat_completion() -> None:
    body = {
        "model": "m",
        "max_tokens": 9,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "Look up x."},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Sure."},
                    {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"k": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "one"}],
                    },
                    {"type": "text", "text": "And now?"},
                ],
            },
        ],
        "stop_sequences": ["END"],
        "temperature": 0.3,
        "top_k": 4,
        "tools": [LOOKUP_MESSAGES],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "metadata": {"user_id": "u"},
        "stream": True,
    }
    assert chat_of("messages", body) == {
        "model": "m",
        "max_tokens": 9,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Look up x."},
            {
                "role": "assistant",
                "content": "Sure.",
                "tool_calls": [
                    {
                        "id": "toolu_1",
                        "type": "function",
                        "function": {"name": "lookup", "arguments": '{"k":1}'},
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": "toolu_1",
                "content": "one",
            },  # tool answers first, then the text
            {"role": "user", "content": "And now?"},
        ],
        "stop": ["END"],
        "temperature": 0.3,
        "tools": [
            {
                "type": "function",
                "function": {"name": "lookup", "parameters": {"type": "object"}, "description": "Look up."},
            }
        ],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "top_k": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@pytest.mark.parametrize(
    ("api", "body", "field"),
    [
        ("responses", {"model": "m", "input": "x", "previous_response_id": 1}, "previous_response_id"),
        ("responses", {"model": "m", "input": "x", "store": "yes"}, "store"),
        ("responses", {"model": "m", "input": "x", "conversation": "conv_1"}, "conversation"),
        ("responses", {"model": "m", "input": "x", "background": True}, "background"),
        ("responses", {"model": "m", "input": "x", "truncation": "auto"}, "truncation"),
        ("responses", {"model": "m"}, "input"),
        ("responses", {"model": "m", "input": [{"type": "reasoning", "summary": []}]}, "input.0.type"),
        ("responses", {"model": "m", "input": [{"role": "user"}]}, "input.0.content"),
        (
            "responses",
            {"model": "m", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input.0.call_id",
        ),
        ("responses", {"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ("responses", {"model": "m", "input": "x", "max_output_tokens": "8"}, "max_output_tokens"),
        ("responses", {"model": "m", "input": "x", "temperature": 3}, "temperature"),
        ("responses", {"model": "m", "input": "x", "tool_choice": "sometimes"}, "tool_choice"),
        ("responses", {"model": "m", "input": "x", "include": ["reasoning.everything"]}, "include.0"),
        ("responses", {"model": "m", "input": "x", "frobnicate": 1}, "frobnicate"),
        ("messages", {"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ("messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}, "model"),
        ("messages", {"model": "m", "max_tokens": 4, "messages": []}, "messages"),
        (
            "messages",
            {"model": "m", "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]},
            "messages.0.role",
        ),
        (
            "messages",
            {
                "model": "m",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "document"}]}],
            },
            "messages.0.content.0.type",
        ),
        (
            "messages",
            {
                "model": "m",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"name": "t"}],
            },
            "tools.0.input_schema",
        ),
        (
            "messages",
            {
                "model": "m",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "x"}],
                "thinking": {"type": "enabled"},
            },
            "thinking",
        ),
        (
            "messages",
            {
                "model": "m",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "x"}],
                "mcp_servers": [{}],
            },
            "mcp_servers",
        ),
        (
            "messages",
            {
                "model": "m",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "x"}],
                "stop_sequences": [1],
            },
            "stop_sequences",
        ),
    ],
)
def test_a_request_the_translation_cannot_carry_is_refused_naming_the_field(
    api: str, body: dict[str, Any], field: str
) -> None:
    with pytest.raises(TranslationError) as caught:
        new_translator(api).request(orjson.dumps(body))
    assert caught.value.status == 400 and caught.value.param == field
    assert f"'{field}'" in caught.value.message


def test_error_bodies_have_each_apis_shape() -> None:
    assert orjson.loads(error_body("responses", 400, "bad", "input")) == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "input", "code": None}
    }
    assert orjson.loads(error_body("messages", 529, "busy")) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "busy"},
    }
    assert orjson.loads(error_body("messages", 401, "who?"))["error"]["type"] == "authentication_error"


# ---------------------------------------------------------------------------------------------- answers
def test_whole_answers_are_valid_sdk_objects_with_the_backends_text() -> None:
    _, ids, text = fixture_answer("chat_plain")
    response = Response.model_validate(
        orjson.loads(
            requested("responses", {"model": "tiny", "input": "x"}).whole(200, CASES["chat_plain"].response)
        )
    )
    assert response.output_text == text and response.status == "incomplete"  # vLLM stopped on "length"
    assert (
        response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    )
    assert response.usage is not None and response.usage.output_tokens == len(ids)
    body = {"model": "tiny", "max_tokens": 12, "messages": [{"role": "user", "content": "x"}]}
    message = Message.model_validate(
        orjson.loads(requested("messages", body).whole(200, CASES["chat_plain"].response))
    )
    assert [b.text for b in message.content if b.type == "text"] == [text]
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == len(ids)  # vLLM: "length"


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_streams_are_valid_sdk_events_and_carry_the_backends_text(api: str) -> None:
    _, ids, text = fixture_answer("chat_stream")
    body = stream_body(api)
    events = sse_events(translate_stream(requested(api, body), CASES["chat_stream"].response))
    for name, data in events:
        assert name == data["type"]  # Anthropic's SDK reads the event name; OpenAI's the data's type
        (RESPONSE_EVENT if api == "responses" else MESSAGE_EVENT).validate_python(data)
    kinds = [name for name, _ in events]
    if api == "responses":
        assert kinds[:4] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        assert kinds[-4:] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete",
        ]
        assert "".join(d["delta"] for n, d in events if n == "response.output_text.delta") == text
        final = Response.model_validate(events[-1][1]["response"])
        assert final.output_text == text and final.usage is not None and final.usage.output_tokens == len(ids)
        assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    else:
        assert kinds[:2] == ["message_start", "content_block_start"]
        assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
        assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == text
        assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"
        assert events[-2][1]["usage"]["output_tokens"] == len(ids)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_stream_translation_does_not_depend_on_where_the_bytes_are_cut(data: st.DataObject) -> None:
    raw = CASES["chat_stream"].response
    api = data.draw(st.sampled_from(["responses", "messages"]))
    cuts = data.draw(st.lists(st.integers(0, len(raw)), max_size=30))
    body = stream_body(api)

    def shape(out: bytes) -> list[Any]:  # everything but the random ids
        return [
            (n, {k: v for k, v in d.items() if k not in ("response", "message", "item", "item_id")})
            for n, d in sse_events(out)
        ]

    assert shape(translate_stream(requested(api, body), raw, cuts)) == shape(
        translate_stream(requested(api, body), raw)
    )


def test_stream_ended_before_finishing_ends_with_the_apis_error() -> None:
    events = CASES["chat_stream"].response.split(b"\n\n")
    cut = b"\n\n".join(events[:3]) + b"\n\n"  # a few tokens, no finish reason, no [DONE]
    responses = sse_events(
        translate_stream(requested("responses", {"model": "t", "input": "x", "stream": True}), cut)
    )
    assert responses[-1][0] == "response.failed"
    assert responses[-1][1]["response"]["error"]["code"] == "server_error"
    body = {"model": "t", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "stream": True}
    messages = sse_events(translate_stream(requested("messages", body), cut))
    assert messages[-1] == (
        "error",
        {"type": "error", "error": {"type": "api_error", "message": messages[-1][1]["error"]["message"]}},
    )
    assert "before the answer was finished" in messages[-1][1]["error"]["message"]


def test_a_tool_call_that_is_not_a_json_object_keeps_its_text() -> None:
    chat = {
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}
                    ],
                },
            }
        ]
    }
    body = {"model": "t", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    message = Message.model_validate(orjson.loads(requested("messages", body).whole(200, orjson.dumps(chat))))
    assert message.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "input", None)) for b in message.content] == [
        ("tool_use", {"arguments": "not json"})
    ]


def test_an_answer_that_is_not_a_chat_completion_is_a_502() -> None:
    for translator in (new_translator("responses"), new_translator("messages")):
        with pytest.raises(TranslationError) as caught:
            translator.whole(200, b'{"object": "list"}')
        assert caught.value.status == 502


# ---------------------------------------------------------------------------------------------- SDKs, recorded vLLM
async def sdk_call(api: str, base: str, case: str, stream: bool) -> str:
    """Ask, through the real SDK, what the recorded ``case`` answers; returns the text the agent got."""
    request = CASES[case].body
    system = [m["content"] for m in request["messages"] if m["role"] == "system"]
    user = next(m["content"] for m in request["messages"] if m["role"] == "user")
    sampling = {"temperature": request["temperature"]}
    if api == "responses":
        async with openai_sdk(base) as client:
            kwargs: dict[str, Any] = dict(
                model="tiny", input=user, max_output_tokens=request["max_tokens"], **sampling
            )
            if system:
                kwargs["instructions"] = system[0]
            if not stream:
                response = await client.responses.create(**kwargs, extra_body={"seed": request["seed"]})
                return response.output_text
            events = [
                e
                async for e in await client.responses.create(
                    **kwargs, stream=True, extra_body={"seed": request["seed"]}
                )
            ]
            assert events[-1].type == "response.incomplete"  # vLLM stopped at max_tokens
            return "".join(e.delta for e in events if e.type == "response.output_text.delta")
    async with anthropic_sdk(base) as client:
        kwargs = dict(
            model="tiny", max_tokens=request["max_tokens"], messages=[{"role": "user", "content": user}]
        )
        kwargs |= {"system": system[0]} if system else {}
        extra = {"seed": request["seed"]} | sampling  # this SDK release has no sampling arguments of its own
        if not stream:
            message = await client.messages.create(**kwargs, extra_body=extra)
            assert message.stop_reason == "max_tokens"
            return "".join(b.text for b in message.content if b.type == "text")
        async with client.messages.stream(**kwargs, extra_body=extra) as events:
            text = "".join([t async for t in events.text_stream])
            assert (await events.get_final_message()).stop_reason == "max_tokens"
            return text


@pytest.mark.parametrize("api", ["responses", "messages"])
@pytest.mark.parametrize("case", ["chat_plain", "chat_stream"])
async def test_sdks_over_recorded_vllm_get_its_text_and_record_its_exact_ids(api: str, case: str) -> None:
    prompt, ids, text = fixture_answer(case)
    async with (
        MockVLLM(replay_dir=FIXTURES, chunk_latency=0.0005) as vllm,
        proxied(vllm.url) as (proxy, store),
    ):
        rid, aid, base = claim(proxy, store)
        got = await sdk_call(api, base, case, stream=CASES[case].streamed)
        calls = finish(store, rid, aid)
    assert got == text
    [call] = calls
    assert (call.prompt_token_ids, call.response_token_ids) == (prompt, ids)
    assert call.status == "ok" and call.finish_reason == "length" and call.limit == "max_tokens"
    assert call.path == f"/v1/{api}" and call.model == "tiny"


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_a_backend_refusal_reaches_the_sdk_in_its_apis_shape(api: str) -> None:
    async with MockVLLM(replay_dir=FIXTURES) as vllm, proxied(vllm.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        if api == "responses":
            async with openai_sdk(base) as client:
                with pytest.raises(openai.BadRequestError) as caught:
                    await client.responses.create(model="tiny", input="x", max_output_tokens=100000)
            assert caught.value.body["param"] == "max_tokens"  # type: ignore[index]
        else:
            async with anthropic_sdk(base) as client:
                with pytest.raises(anthropic.BadRequestError) as caught_:
                    await client.messages.create(  # with a timeout: the SDK refuses such max_tokens without
                        model="tiny",
                        max_tokens=100000,
                        messages=[{"role": "user", "content": "x"}],
                        timeout=30,
                    )
            assert caught_.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
            caught = caught_  # type: ignore[assignment]
        [call] = finish(store, rid, aid)
    assert "max_model_len=512" in str(caught.value)
    # Recorded as a chat call refused for its context window would be.
    assert call.status == "failed" and call.limit == "context"


# ---------------------------------------------------------------------------------------------- SDKs, vLLM-shaped mock
async def test_responses_tool_call_round_trips_through_the_backends_tool_calls() -> None:
    # Relayed as text (token_in=False): the chat body the backend gets is the translation of the echoed items.
    async with MockVLLM(completion_tokens=3) as vllm, proxied(vllm.url, token_in=False) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        async with openai_sdk(base) as client:
            first = await client.responses.create(
                model="mock", input="Look x up.", tools=[LOOKUP_RESPONSES], tool_choice="required"
            )
            [call] = first.output
            assert call.type == "function_call" and call.name == "lookup"
            history: list[Any] = [
                {"role": "user", "content": "Look x up."},
                call.model_dump(exclude_none=True),
            ]
            history.append({"type": "function_call_output", "call_id": call.call_id, "output": "x is 42"})
            events = [
                e
                async for e in await client.responses.create(
                    model="mock", input=history, tools=[LOOKUP_RESPONSES], stream=True
                )
            ]
        calls = finish(store, rid, aid)
    seen = [r.json for r in vllm.generation_requests()]
    chat_call = {
        "id": call.call_id,
        "type": "function",
        "function": {"name": "lookup", "arguments": call.arguments},
    }
    assert seen[1]["messages"][1:] == [
        {"role": "assistant", "content": None, "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "x is 42"},
    ]
    [(_, first_ids)] = vllm.expected(seen[0])
    assert call.arguments == "".join(tool_arguments(first_ids))
    assert events[-1].type == "response.completed"
    assert [(c.prompt_token_ids, c.response_token_ids) for c in calls] == [vllm.expected(b)[0] for b in seen]
    assert [c.finish_reason for c in calls] == ["tool_calls", "stop"]


async def test_messages_tool_use_round_trips_streamed_through_the_backends_tool_calls() -> None:
    async with MockVLLM(completion_tokens=3) as vllm, proxied(vllm.url, token_in=False) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        async with anthropic_sdk(base) as client:
            messages: list[Any] = [{"role": "user", "content": "Look x up."}]
            kwargs: dict[str, Any] = dict(model="mock", max_tokens=8, tools=[LOOKUP_MESSAGES])
            async with client.messages.stream(
                **kwargs, messages=messages, tool_choice={"type": "any"}
            ) as stream:
                first = await stream.get_final_message()
            [use] = first.content
            assert use.type == "tool_use" and first.stop_reason == "tool_use"
            messages += [
                {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "x is 42"}],
                },
            ]
            second = await client.messages.create(**kwargs, messages=messages)
        calls = finish(store, rid, aid)
    seen = [r.json for r in vllm.generation_requests()]
    [(_, first_ids)] = vllm.expected(seen[0])
    assert use.input == orjson.loads("".join(tool_arguments(first_ids)))
    [tool_call] = seen[1]["messages"][1]["tool_calls"]
    assert (tool_call["id"], orjson.loads(tool_call["function"]["arguments"])) == (use.id, use.input)
    assert seen[1]["messages"][2] == {"role": "tool", "tool_call_id": use.id, "content": "x is 42"}
    assert second.stop_reason == "end_turn" and second.content[0].type == "text"
    assert [(c.prompt_token_ids, c.response_token_ids) for c in calls] == [vllm.expected(b)[0] for b in seen]


async def lookup_run(client: openai.AsyncOpenAI, **kwargs: Any) -> Any:
    """An openai-agents run, with its defaults, of an agent that must call its one tool (``lookup``) first,
    through ``client``; ``kwargs`` go to ``Runner.run``."""
    from agents import Agent, ModelSettings, RunConfig, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_provider import OpenAIProvider

    set_tracing_disabled(True)

    @function_tool
    def lookup(key: str) -> str:
        """Look a key up."""
        return f"{key} is 42"

    agent = Agent(
        name="a",
        instructions="Be brief.",
        tools=[lookup],
        model_settings=ModelSettings(tool_choice="required"),
    )
    config = RunConfig(model="mock", model_provider=OpenAIProvider(openai_client=client))
    return await Runner.run(agent, "Look x up.", run_config=config, **kwargs)


async def test_openai_agents_runner_with_its_defaults_records_every_call_of_a_tool_run() -> None:
    async with MockVLLM(completion_tokens=3) as vllm, proxied(vllm.url, token_in=False) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        async with openai_sdk(base) as client:
            result = await lookup_run(client)
        calls = finish(store, rid, aid)
    seen = [r.json for r in vllm.generation_requests()]
    # The tool ran and its answer went back.
    assert len(seen) == 2 and seen[1]["messages"][-1]["role"] == "tool"
    assert result.final_output == " t".join(["", *map(str, vllm.expected(seen[1])[0][1])])
    assert [(c.prompt_token_ids, c.response_token_ids) for c in calls] == [vllm.expected(b)[0] for b in seen]
    assert all(c.path == "/v1/responses" and c.status == "ok" for c in calls)


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_backend_dying_mid_stream_ends_the_stream_the_way_the_api_does(api: str) -> None:
    async with MockVLLM(completion_tokens=6) as vllm, proxied(vllm.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        vllm.break_next(after_events=3)
        if api == "responses":
            events = []
            async with openai_sdk(base) as client:
                stream = await client.responses.create(model="mock", input="x", stream=True)
                with pytest.raises(openai.APIConnectionError):  # then the answer is cut short: never whole
                    async for event in stream:
                        events.append(event)
            assert events[-1].type == "response.failed"
            assert events[-1].response.error is not None and "broke off" in events[-1].response.error.message
            assert any(e.type == "response.output_text.delta" for e in events)  # what came first
        else:
            async with anthropic_sdk(base) as client:
                stream = await client.messages.create(
                    model="mock", max_tokens=8, messages=[{"role": "user", "content": "x"}], stream=True
                )
                kinds = []
                with pytest.raises(anthropic.APIStatusError) as caught:
                    async for event in stream:
                        kinds.append(event.type)
            assert kinds[0] == "message_start" and "content_block_delta" in kinds
            assert caught.value.body["error"]["type"] == "api_error"  # type: ignore[index]
        [call] = finish(store, rid, aid)
    assert call.status == "failed" and call.response_token_ids is None


# ---------------------------------------------------------------------------------------------- the proxy's own errors
async def test_proxy_refusals_are_in_the_apis_shape_and_reach_no_backend() -> None:
    async with MockVLLM() as vllm, proxied(vllm.url, token="secret", pause_timeout=0.05) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        async with openai_sdk(base, api_key="wrong") as bad, openai_sdk(base, api_key="secret") as good:
            with pytest.raises(openai.AuthenticationError):
                await bad.responses.create(model="mock", input="x")
            with pytest.raises(openai.BadRequestError) as bad_field:
                await good.responses.create(model="mock", input="x", background=True)
            assert bad_field.value.body["param"] == "background"  # type: ignore[index]
            with pytest.raises(openai.NotFoundError) as unknown:
                await good.with_options(base_url=base.replace(aid, "nope")).responses.create(
                    model="mock", input="x"
                )
            assert unknown.value.body["type"] == "invalid_request_error"  # type: ignore[index]
        async with anthropic_sdk(base, api_key="wrong") as bad, anthropic_sdk(base, api_key="secret") as good:
            kwargs: dict[str, Any] = dict(
                model="mock", max_tokens=4, messages=[{"role": "user", "content": "x"}]
            )
            with pytest.raises(anthropic.AuthenticationError) as who:
                await bad.messages.create(**kwargs)
            assert who.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
            with pytest.raises(anthropic.BadRequestError) as bad_block:
                await good.messages.create(
                    **(kwargs | {"messages": [{"role": "user", "content": [{"type": "document"}]}]})
                )
            assert "messages.0.content.0.type" in bad_block.value.message
            await proxy.pause()
            with pytest.raises(anthropic.InternalServerError) as paused:  # 503: the SDK's 5xx error
                await good.messages.create(**kwargs)
            proxy.resume()
            assert (
                paused.value.status_code == 503 and paused.value.body["error"]["type"] == "overloaded_error"
            )  # type: ignore[index]
            reply = await good.messages.create(**kwargs)  # x-api-key is the proxy token; never forwarded
        calls = finish(store, rid, aid)
    [seen] = vllm.generation_requests()
    assert "x-api-key" not in seen.headers and "authorization" not in seen.headers
    assert reply.content and [c.path for c in calls] == ["/v1/messages"]  # refused calls are not recorded


async def test_unattributed_calls_are_translated_but_not_recorded() -> None:
    async with MockVLLM(completion_tokens=3) as vllm, proxied(vllm.url) as (proxy, _store):
        async with openai_sdk(f"{proxy.url}/v1") as client:
            response = await client.responses.create(model="mock", input="x")
        async with anthropic_sdk(f"{proxy.url}/v1") as client_:
            message = await client_.messages.create(
                model="mock", max_tokens=3, messages=[{"role": "user", "content": "x"}]
            )
    bodies = [r.json for r in vllm.generation_requests()]
    assert all("return_token_ids" not in b for b in bodies)  # forwarded as translated, nothing added
    [(_, ids)] = vllm.expected(bodies[0])
    assert response.output_text == "".join(f" t{t}" for t in ids)
    assert message.content[0].type == "text" and message.stop_reason == "max_tokens"
    assert proxy.m_calls.value("ok") == 2 and proxy.m_unrecorded.value() == 0


# ---------------------------------------------------------------------------------------------- embedded server
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_sdks_through_the_proxy_to_the_embedded_server_record_the_ids_it_generated(
    api: str, stream: bool, tiny_model: Path
) -> None:
    seed, limit = 7, 6
    async with (
        InferenceServer(tiny_model, served_model_name="tiny") as server,
        proxied(server.url) as (proxy, store),
        aiohttp.ClientSession() as http,
    ):
        rid, aid, base = claim(proxy, store)
        extra = {"seed": seed, "temperature": 1.0}
        if api == "responses":
            async with openai_sdk(base) as client:
                kwargs: dict[str, Any] = dict(
                    model="tiny", input="Say yes.", max_output_tokens=limit, extra_body=extra
                )
                if stream:
                    events = [e async for e in await client.responses.create(**kwargs, stream=True)]
                    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
                else:
                    text = (await client.responses.create(**kwargs)).output_text
        else:
            async with anthropic_sdk(base) as client_:
                kwargs = dict(
                    model="tiny", max_tokens=limit, messages=[{"role": "user", "content": "Say yes."}]
                )
                if stream:
                    async with client_.messages.stream(**kwargs, extra_body=extra) as events_:
                        text = "".join([t async for t in events_.text_stream])
                else:
                    message = await client_.messages.create(**kwargs, extra_body=extra)
                    text = "".join(b.text for b in message.content if b.type == "text")
        # The same generation asked for directly, as a chat completion with the same seed.
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Say yes."}], "max_tokens": limit}
        chat |= extra | {"return_token_ids": True}
        async with http.post(f"{server.url}/v1/chat/completions", json=chat) as reply:
            direct = await reply.json()
        calls = finish(store, rid, aid)
    [call] = calls
    assert call.prompt_token_ids == direct["prompt_token_ids"]
    assert call.response_token_ids == direct["choices"][0]["token_ids"] and call.response_token_ids
    assert text == direct["choices"][0]["message"]["content"]
    assert call.status == "ok" and call.path == f"/v1/{api}"


# ---------------------------------------------------------------------------------------------- training batch
def api_agent(api: str):  # type: ignore[no-untyped-def]
    """An agent on ``api`` that holds two turns through its rollout's proxy URL."""

    async def agent(task: dict[str, Any], llm: LLM) -> float:
        if api == "responses":
            async with openai_sdk(llm.endpoint) as client:
                history: list[Any] = [{"role": "user", "content": f"question {task['q']}"}]
                for _ in range(2):
                    reply = await client.responses.create(model=llm.model, input=history, max_output_tokens=4)
                    history += [o.model_dump(exclude_none=True) for o in reply.output]
                    history.append({"role": "user", "content": "again"})
        else:
            async with anthropic_sdk(llm.endpoint) as client_:
                messages: list[Any] = [{"role": "user", "content": f"question {task['q']}"}]
                for _ in range(2):
                    message = await client_.messages.create(model=llm.model, max_tokens=4, messages=messages)
                    messages += [
                        {
                            "role": "assistant",
                            "content": [b.model_dump(exclude_none=True) for b in message.content],
                        },
                        {"role": "user", "content": "again"},
                    ]
        return float(task["q"] % 2)

    return agent


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_a_step_of_translated_agents_trains_on_the_backends_ids(api: str) -> None:
    config = BatchConfig(max_prompt_length=256, max_response_length=16)
    async with (
        MockVLLM(completion_tokens=4) as vllm,
        AgentDaemon(backends=[vllm.url], model="mock", batch=config, token_in=False) as daemon,
    ):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run_agents(daemon.server_url, api_agent(api), concurrency=4))
            await daemon.submit([{"q": 1}, {"q": 2}], n=2)
            with anyio.fail_after(30):
                batch = await daemon.batches.receive()
            tg.cancel_scope.cancel()
    data = batch.data
    assert len(data) == 8  # 2 samples x n=2 x 2 turns relayed as text: every call a row (the ids drift)
    answered = {}
    for seen in vllm.generation_requests():
        [(prompt, response)] = vllm.expected(seen.json)
        answered[tuple(prompt)] = response
    mask = data.batch["attention_mask"][:, : config.max_prompt_length].bool()
    for row in range(len(data)):
        prompt = data.batch["prompts"][row][mask[row]].tolist()
        response = data.batch["responses"][row][: int(data.batch["response_mask"][row].sum())].tolist()
        assert answered[tuple(prompt)] == response


# ---------------------------------------------------------------------------------------------- a new API
class ContentsApi:
    """A toy API in one class (Gemini's shape, trimmed): the model in the path, a route that streams and one
    that does not, ``contents`` in, ``candidates`` out, its key in ``x-goog-api-key``."""

    name: ClassVar[str] = "contents"
    routes: ClassVar[tuple[Route, ...]] = (
        Route("models/{model}:generateContent", model="model", stream=False),
        Route("models/{model}:streamGenerateContent", model="model", stream=True),
    )
    credential_header: ClassVar[str | None] = "x-goog-api-key"

    def __init__(self, exchange: Exchange) -> None:
        self.ex = exchange

    @staticmethod
    def error_body(status: int, message: str, param: str | None = None) -> bytes:
        return orjson.dumps({"error": {"code": status, "message": message, "status": "TOY_ERROR"}})

    def to_chat(self, body: Fields) -> dict[str, Any]:
        messages = []
        for content, where in items_of(body, "contents", required=True):
            fields = Fields(content, where)
            role = "assistant" if fields.get("role", str) == "model" else "user"
            parts = [
                Fields(part, f"{where}.parts.{i}")
                for i, part in enumerate(fields.get("parts", list, required=True))
            ]
            messages.append(
                {"role": role, "content": "".join(p.get("text", str, required=True) for p in parts)}
            )
            for part in parts:
                part.done()
            fields.done()
        config = Fields(body.get("generationConfig", dict) or {}, "generationConfig")
        chat = {
            "model": self.ex.model,
            "messages": messages,
            "max_tokens": config.get("maxOutputTokens", int),
        }
        config.done()
        body.done(chat)
        return chat

    def item_id(self, kind: Literal["text", "tool"]) -> str:
        return ""

    def _candidate(self, text: str, finish: str | None) -> dict[str, Any]:
        candidate: dict[str, Any] = {"content": {"role": "model", "parts": [{"text": text}]}}
        if finish is not None:
            candidate["finishReason"] = "MAX_TOKENS" if finish == "length" else "STOP"
        return {"candidates": [candidate], "modelVersion": self.ex.backend_model}

    def final(self) -> dict[str, Any]:
        return self._candidate("".join(b.text for b in self.ex.blocks), self.ex.finish)

    def start(self) -> list[bytes]:
        return []

    def block_start(self, block: Block) -> list[bytes]:
        return []

    def text_delta(self, block: Block, text: str, logprobs: list[Any]) -> bytes:
        return sse_event(self._candidate(text, None))

    def tool_delta(self, block: Block, arguments: str) -> bytes:
        return b""

    def block_stop(self, block: Block) -> list[bytes]:
        return []

    def stream_end(self) -> list[bytes]:
        return [sse_event(self._candidate("", self.ex.finish))]

    def stream_failed(self, message: str, started: bool) -> bytes:
        return sse_event(orjson.loads(self.error_body(502, message)))


@pytest.fixture
def contents_api() -> Iterator[type[ContentsApi]]:
    APIS.register(ContentsApi)  # type: ignore[arg-type]
    try:
        yield ContentsApi
    finally:
        APIS.unregister(ContentsApi)  # type: ignore[arg-type]


async def test_a_new_api_in_one_class_with_its_model_in_the_path_and_its_own_key_header(
    contents_api: type[ContentsApi],
) -> None:
    body = {
        "contents": [{"role": "user", "parts": [{"text": "hi"}]}],
        "generationConfig": {"maxOutputTokens": 4},
    }
    async with (
        MockVLLM() as mock,
        proxied(mock.url, token="s3cret") as (proxy, store),
        aiohttp.ClientSession() as http,
    ):
        rid, aid, base = claim(proxy, store)
        key = {"x-goog-api-key": "s3cret"}
        async with http.post(f"{base}/models/mock:generateContent", json=body, headers=key) as r:
            whole = (r.status, await r.json())
        async with http.post(f"{base}/models/mock:streamGenerateContent", json=body, headers=key) as r:
            events = sse_events(await r.read())
        async with http.post(
            f"{base}/models/mock:generateContent", json=body, headers={"x-goog-api-key": "no"}
        ) as r:
            refused = (r.status, await r.json())
        calls = finish(store, rid, aid)
    status, answer = whole
    assert status == 200 and answer["candidates"][0]["finishReason"] == "MAX_TOKENS"
    text = answer["candidates"][0]["content"]["parts"][0]["text"]
    streamed = "".join(e["candidates"][0]["content"]["parts"][0]["text"] for _, e in events)
    assert streamed == text and text == "".join(f" t{t}" for t in calls[0].response_token_ids or [])
    assert (
        refused[0] == 401 and refused[1]["error"]["status"] == "TOY_ERROR"
    )  # the proxy's error, in its shape
    assert len(calls) == 2 and all(c.prompt_token_ids and c.response_token_ids for c in calls)
    generations = [r for r in mock.requests if r.path == "/v1/chat/completions"]
    assert [r.json["model"] for r in generations] == ["mock", "mock"]  # from the path
    assert [r.json.get("stream", False) for r in generations] == [False, True]  # from the route
    assert all("x-goog-api-key" not in r.headers for r in generations)  # the key stays with the proxy
    assert "x-goog-api-key" in APIS.credential_headers
