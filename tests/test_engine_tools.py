"""Tools on the embedded engine and its token-in endpoints, over loopback HTTP with the real tiny model.

Rendered (tools change the prompt and carry the schema), parsed (JSON and SSE, several calls, the same split
as a real vLLM's Hermes parser on recorded cases), forced ("required" / named: valid calls whose arguments
follow the schema, from a random-init model), refused without a template tool section; and render / generate
/ derender agreeing with the chat endpoint.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from aglverl.engine.chat_parser import ChatParser, ToolRequest
from aglverl.engine.constrained import hermes_structural_tag
from aglverl.engine.server import InferenceServer

pytestmark = pytest.mark.anyio

FIXTURES = Path(__file__).parent / "fixtures" / "vllm_chat"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"enum": ["Paris", "Rome"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {}}},
]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


@pytest.fixture
async def server(tiny_model: Path) -> AsyncIterator[InferenceServer]:
    async with InferenceServer(tiny_model, served_model_name="tiny", seed=0) as s:
        yield s


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def _post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with http.post(url, data=orjson.dumps(body), headers={"Content-Type": "application/json"}) as resp:
        raw = await resp.read()
        if resp.content_type == "text/event-stream":
            events = [b.removeprefix("data: ") for b in raw.decode().split("\n\n") if b.startswith("data: ")]
            return resp.status, [e if e == "[DONE]" else json.loads(e) for e in events]
        return resp.status, orjson.loads(raw)


def _valid_weather(arguments: str) -> bool:
    args = json.loads(arguments)
    return set(args) == {"city", "days"} and args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 7


# ---------------------------------------------------------------------------------------------- rendering
async def test_tools_are_rendered_through_the_template_with_their_schema(
    server: InferenceServer, http: aiohttp.ClientSession
) -> None:
    base = {"model": "tiny", "messages": MESSAGES}
    _, plain = await _post(http, server.url + "/v1/chat/completions/render", base)
    _, tooled = await _post(http, server.url + "/v1/chat/completions/render", {**base, "tools": TOOLS})
    assert plain["token_ids"] != tooled["token_ids"]
    text = server.tokenizer.decode(tooled["token_ids"])
    assert "<tools>" in text and json.dumps(TOOLS[0]) in text and "<tool_call>" in text
    assert server.tokenizer.decode(plain["token_ids"]).startswith("<|im_start|>user\nWeather in Paris?")


async def test_history_with_tool_calls_and_results_renders_as_qwen(
    server: InferenceServer, http: aiohttp.ClientSession
) -> None:
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]
    _, answer = await _post(
        http, server.url + "/v1/chat/completions/render", {"messages": history, "tools": TOOLS}
    )
    text = server.tokenizer.decode(answer["token_ids"])
    expected = (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert text.endswith(expected)


async def test_a_template_without_a_tool_section_refuses_tools(
    tmp_path: Path, tiny_model: Path, http: aiohttp.ClientSession
) -> None:
    import shutil

    model = tmp_path / "plain"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    async with InferenceServer(model, served_model_name="tiny") as s:
        assert s.chat_parser.tool_parser is None
        for path in ("/v1/chat/completions", "/v1/chat/completions/render"):
            status, body = await _post(
                http, s.url + path, {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 2}
            )
            assert status == 400 and body["error"]["param"] == "tools"
            assert "no tool section" in body["error"]["message"]
        status, _ = await _post(http, s.url + "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
        assert status == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": []}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools"),
    ],
)
async def test_bad_tool_fields_are_400_naming_the_field(
    server: InferenceServer, http: aiohttp.ClientSession, body: dict[str, Any], param: str
) -> None:
    status, answer = await _post(http, server.url + "/v1/chat/completions", {"messages": MESSAGES, **body})
    assert status == 400 and answer["error"]["param"] == param


# ---------------------------------------------------------------------------------------------- forced
@pytest.mark.parametrize("stream", [False, True])
async def test_required_and_named_always_give_calls_that_follow_the_schema(
    server: InferenceServer, http: aiohttp.ClientSession, stream: bool
) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(4):
        for choice in ("required", named):
            body = {
                "messages": MESSAGES,
                "tools": TOOLS,
                "tool_choice": choice,
                "max_tokens": 200,
                "seed": seed,
            }
            status, answer = await _post(
                http, server.url + "/v1/chat/completions", {**body, "stream": stream}
            )
            assert status == 200
            calls, finish = _calls_of(answer, stream)
            assert calls, answer
            assert finish == ("stop" if choice is named else "tool_calls")
            for name, arguments in calls:
                assert name in ("get_weather", "get_time")
                if choice is named:
                    assert name == "get_weather"
                if name == "get_weather":
                    assert _valid_weather(arguments)
                else:
                    assert json.loads(arguments) == {}


def _calls_of(answer: Any, stream: bool) -> tuple[list[tuple[str, str]], str | None]:
    if not stream:
        choice = answer["choices"][0]
        calls = choice["message"].get("tool_calls") or []
        return [(c["function"]["name"], c["function"]["arguments"]) for c in calls], choice["finish_reason"]
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    finish = None
    for event in answer[:-1]:
        for choice in event["choices"]:
            for call in choice["delta"].get("tool_calls") or []:
                if "name" in call["function"]:
                    assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
                    names[call["index"]] = call["function"]["name"]
                args[call["index"]] = args.get(call["index"], "") + call["function"].get("arguments", "")
            finish = choice["finish_reason"] or finish
    return [(names[i], args.get(i, "")) for i in sorted(names)], finish


async def test_constrained_log_probs_come_from_the_masked_distribution(
    server: InferenceServer, http: aiohttp.ClientSession
) -> None:
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200, "seed": 1}
    _, answer = await _post(http, server.url + "/v1/chat/completions", {**body, "logprobs": True})
    logprobs = [e["logprob"] for e in answer["choices"][0]["logprobs"]["content"]]
    # where the grammar leaves a single token (the fixed parts of the call), its probability is 1
    assert logprobs[0] == 0.0 or logprobs.count(0.0) > len(logprobs) // 4


def _forced_grammar_takes(server: InferenceServer, tools: list[dict[str, Any]], text: str) -> bool:
    """Whether the grammar of a forced call (``tool_choice`` "required") lets the engine write exactly ``text``."""
    constraint = server.constraints.constraint({"structural_tag": hermes_structural_tag(tools, "required")})
    assert constraint is not None
    ids = server.tokenizer.encode(text, add_special_tokens=False)
    return all(constraint.consume(t) for t in ids) and constraint.matcher.is_accepting()


def _tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


async def test_a_free_form_object_parameter_takes_any_members_as_json_schema_says(
    server: InferenceServer,
) -> None:
    """``{"type": "object"}`` (a bare ``dict``) is open; an object that lists its properties stays closed, as
    vLLM's grammar backends read it (tests/test_vllm_tools.py)."""
    put = _tool("put", {"type": "object", "properties": {"data": {"type": "object"}}, "required": ["data"]})
    call = '<tool_call>{"name": "put", "arguments": {"data": %s}}</tool_call>'
    assert _forced_grammar_takes(server, [put], call % '{"a": 1, "b": [true, "x"]}')
    assert _forced_grammar_takes(server, [put], call % "{}")
    assert not _forced_grammar_takes(
        server, [put], '<tool_call>{"name": "put", "arguments": {"data": {}, "x": 1}}</tool_call>'
    )
    whole = _tool("store", {"type": "object", "additionalProperties": True})  # what pydantic writes for dict
    assert _forced_grammar_takes(
        server, [whole], '<tool_call>{"name": "store", "arguments": {"k": "v"}}</tool_call>'
    )
    closed = _tool("get_weather", TOOLS[0]["function"]["parameters"])
    assert not _forced_grammar_takes(
        server,
        [closed],
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2, "x": 1}}</tool_call>',
    )
    named_properties = _tool("f", {"type": "object", "properties": {"properties": {"type": "object"}}})
    assert _forced_grammar_takes(
        server,
        [named_properties],
        '<tool_call>{"name": "f", "arguments": {"properties": {"a": 1}}}</tool_call>',
    )


# ---------------------------------------------------------------------------------------------- parsing
def _tiny_parser(server: InferenceServer) -> ChatParser:
    return server.chat_parser


@pytest.mark.parametrize("fixture", ["hermes.json"])
async def test_parsing_matches_a_real_vllm_on_recorded_outputs(
    server: InferenceServer, http: aiohttp.ClientSession, fixture: str
) -> None:
    """vLLM 0.32's Hermes parser, recorded through its derender route (tests/helpers/record_vllm_chat.py):
    the same content and tool calls; finish reasons as vLLM's chat endpoint gives them."""
    record = json.loads((FIXTURES / fixture).read_text())
    checked = 0
    for case in record["derender"]:
        if case["chat_request"] == "auto_no_thinking":
            continue
        extra = {
            "no_tools": {},
            "auto": {"tools": TOOLS},
            "none": {"tools": TOOLS, "tool_choice": "none"},
            "required": {"tools": TOOLS, "tool_choice": "required"},
            "named": {
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            },
        }[case["chat_request"]]
        chat = {"model": "tiny", "messages": MESSAGES, **extra}
        gen = {
            "request_id": "x",
            "choices": [{"index": 0, "token_ids": case["token_ids"], "finish_reason": case["finish_reason"]}],
        }
        status, ours = await _post(
            http,
            server.url + "/v1/chat/completions/derender",
            {"generate_response": gen, "prompt_token_ids": [1], "chat_request": chat},
        )
        assert status == 200
        theirs = dict(case["derender"]["message"])
        # vLLM's derender decodes with special tokens kept and leaks the EOS into the content; its chat
        # endpoint (and ours, for both routes) never puts the EOS in the text
        if isinstance(theirs["content"], str):
            theirs["content"] = theirs["content"].removesuffix("<|im_end|>")
        mine = ours["choices"][0]["message"]
        assert (mine["content"], mine["reasoning"]) == (theirs["content"], theirs["reasoning"]), case[
            "output"
        ]
        strip = [(c["function"]["name"], c["function"]["arguments"]) for c in theirs.get("tool_calls") or []]
        assert [
            (c["function"]["name"], c["function"]["arguments"]) for c in mine.get("tool_calls") or []
        ] == strip
        streamed_vllm = _reassemble([c["delta"] for c in case["stream"]])
        streamed_vllm["content"] = streamed_vllm["content"].removesuffix("<|im_end|>")
        streamed_ours = await _derender_stream(server, http, case["token_ids"], case["finish_reason"], chat)
        assert _reassemble([c["delta"] for c in streamed_ours]) == streamed_vllm, case["output"]
        checked += 1
    assert checked >= 40


def _reassemble(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    content, reasoning, calls = "", "", {}
    for delta in deltas:
        content += delta.get("content") or ""
        reasoning += delta.get("reasoning") or ""
        for call in delta.get("tool_calls") or []:
            entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
            entry["name"] += (call.get("function") or {}).get("name") or ""
            entry["arguments"] += (call.get("function") or {}).get("arguments") or ""
    return {"content": content, "reasoning": reasoning, "calls": [calls[i] for i in sorted(calls)]}


async def _derender_stream(
    server: InferenceServer,
    http: aiohttp.ClientSession,
    ids: list[int],
    finish: str,
    chat: dict[str, Any],
    prompt: list[int] | None = None,
) -> list[dict[str, Any]]:
    state = None
    out = []
    for k, token in enumerate(ids):
        last = k == len(ids) - 1
        chunk = {
            "request_id": "x",
            "choices": [{"index": 0, "token_ids": [token], "finish_reason": finish if last else None}],
        }
        status, answer = await _post(
            http,
            server.url + "/v1/chat/completions/derender",
            {
                "stream": True,
                "generate_chunk": chunk,
                "stream_state": state,
                "prompt_token_ids": prompt or [1],
                "chat_request": chat,
            },
        )
        assert status == 200, answer
        state = answer["stream_state"]
        out.append(answer["chunk"]["choices"][0])
    return out


async def test_reasoning_is_split_as_vllms_parsers_do(server: InferenceServer) -> None:
    parser = ChatParser(
        tool_parser="hermes", reasoning_parser="deepseek_r1", vocab=server.tokenizer.get_vocab()
    )
    request = ToolRequest.from_request({"tools": TOOLS})
    whole = parser.session(request).parse("<think>hmm</think>" + CALL)
    assert (
        whole.reasoning == "hmm"
        and whole.content is None
        and [c.name for c in whole.tool_calls] == ["get_weather"]
    )
    assert parser.session(request).parse("no end yet").reasoning == "no end yet"
    ids = server.tokenizer.encode("<think>hmm</think>The answer" + CALL, add_special_tokens=False)
    session = parser.session(request, [1])
    deltas = [
        session.delta(server.tokenizer.decode([t]), [t], finished=i == len(ids) - 1)
        for i, t in enumerate(ids)
    ]
    joined = _reassemble([d.to_json() for d in deltas if d is not None])
    assert joined["reasoning"] == "hmm" and joined["content"] == "The answer"
    assert joined["calls"] == [{"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}]


# ---------------------------------------------------------------------------------------------- token-in
@pytest.mark.parametrize("tool_choice", ["auto", "required"])
async def test_render_generate_derender_equal_the_chat_endpoint(
    server: InferenceServer, http: aiohttp.ClientSession, tool_choice: str
) -> None:
    chat = {
        "model": "tiny",
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "max_tokens": 160,
        "seed": 7,
        "logprobs": True,
    }
    _, direct = await _post(http, server.url + "/v1/chat/completions", {**chat, "return_token_ids": True})
    _, rendered = await _post(http, server.url + "/v1/chat/completions/render", chat)
    assert rendered["token_ids"] == direct["prompt_token_ids"]
    async with http.post(server.url + "/inference/v1/generate", json=rendered) as resp:
        assert resp.headers["X-Weight-Version"] == "0"
        generated = await resp.json()
    choice = generated["choices"][0]
    assert choice["token_ids"] == direct["choices"][0]["token_ids"]
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == pytest.approx(
        [e["logprob"] for e in direct["choices"][0]["logprobs"]["content"]]
    )
    assert choice["weight_versions"] == [{"version": "0", "start": 0, "end": len(choice["token_ids"])}]
    tail = rendered["token_ids"][-8:]  # a tail is enough
    body = {
        "generate_response": generated,
        "prompt_token_ids": tail,
        "prompt_tokens": len(rendered["token_ids"]),
        "chat_request": chat,
    }
    _, derendered = await _post(http, server.url + "/v1/chat/completions/derender", body)
    ours, theirs = derendered["choices"][0], direct["choices"][0]
    assert ours["finish_reason"] == theirs["finish_reason"]
    drop_ids = lambda m: {**m, "tool_calls": [c["function"] for c in m.get("tool_calls") or []]}  # noqa: E731
    assert drop_ids(ours["message"]) == drop_ids(theirs["message"])
    assert derendered["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
    assert derendered["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"]
    # streamed: the chat endpoint's stream and the chunk-by-chunk derender reassemble to the same message
    _, events = await _post(http, server.url + "/v1/chat/completions", {**chat, "stream": True})
    chat_deltas = [c["delta"] for e in events[:-1] for c in e["choices"]]
    stream = await _derender_stream(
        server, http, choice["token_ids"], choice["finish_reason"], chat, rendered["token_ids"]
    )
    assert _reassemble([c["delta"] for c in stream]) == _reassemble(chat_deltas)
    assert stream[-1]["finish_reason"] == [c for e in events[:-1] for c in e["choices"]][-1]["finish_reason"]


async def test_generate_streams_ids_and_answers_the_same_as_json(
    server: InferenceServer, http: aiohttp.ClientSession
) -> None:
    request = {
        "model": "tiny",
        "token_ids": [1, 333, 201],
        "sampling_params": {"max_tokens": 9, "seed": 3, "logprobs": 2},
    }
    _, whole = await _post(http, server.url + "/inference/v1/generate", request)
    _, events = await _post(http, server.url + "/inference/v1/generate", {**request, "stream": True})
    assert events[-1] == "[DONE]"
    ids = [t for e in events[:-1] for c in e["choices"] for t in c["token_ids"]]
    assert ids == whole["choices"][0]["token_ids"] and len(ids) == 9
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    top = whole["choices"][0]["logprobs"]["content"][0]
    assert top["top_logprobs"][0]["token_id"] == top["token_id"] and len(top["top_logprobs"]) == 2
    status, bad = await _post(
        http, server.url + "/inference/v1/generate", {**request, "sampling_params": {"top_k": 5}}
    )
    assert status == 400 and "top_k" in bad["error"]["message"]


async def test_generate_abort_answers_the_ids_so_far(
    server: InferenceServer, http: aiohttp.ClientSession
) -> None:
    import anyio

    request = {
        "token_ids": [1, 333, 201],
        "sampling_params": {"max_tokens": 900, "ignore_eos": True},
        "stream": True,
    }
    async with http.post(server.url + "/inference/v1/generate", json=request) as resp:
        first = await resp.content.readuntil(b"\n\n")
        assert json.loads(first.removeprefix(b"data: "))["choices"][0]["token_ids"]
        await anyio.to_thread.run_sync(server.abort)
        rest = (first + await resp.read()).decode()
    server.resume()
    events = [json.loads(b[6:]) for b in rest.split("\n\n") if b.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "abort"
    assert 0 < sum(len(e["choices"][0]["token_ids"]) for e in events) < 900


def _shape(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return "null" if value is None else type(value).__name__


async def test_token_in_answers_have_vllms_shape(
    server: InferenceServer, http: aiohttp.ClientSession
) -> None:
    record = json.loads((FIXTURES / "hermes.json").read_text())
    theirs = record["render"]["plain"]["answer"]["body"]
    _, ours = await _post(
        http, server.url + "/v1/chat/completions/render", record["render"]["plain"]["request"]
    )
    assert set(ours) == set(theirs)
    # (the recording added seed and logprobs to this answer's sampling_params before sending it to generate)
    assert set(ours["sampling_params"]) == set(theirs["sampling_params"]) - {"seed", "logprobs"}
    recorded = record["generate"][0]
    _, generated = await _post(http, server.url + "/inference/v1/generate", recorded["request"])
    assert _shape(generated) == _shape(recorded["answer"]["body"])
    _, events = await _post(
        http, server.url + "/inference/v1/generate", {**recorded["request"], "stream": True}
    )
    assert _shape(events[0]) == _shape(recorded["stream"][0])
    assert _shape(events[-2]) == _shape(recorded["stream"][-2])
    one_call = next(
        c for c in record["derender"] if c["output"] == "one_call" and c["chat_request"] == "auto"
    )
    chat = {"messages": MESSAGES, "tools": TOOLS}
    gen = {
        "request_id": "x",
        "choices": [{"index": 0, "token_ids": one_call["token_ids"], "finish_reason": "stop"}],
    }
    _, derendered = await _post(
        http,
        server.url + "/v1/chat/completions/derender",
        {"generate_response": gen, "prompt_token_ids": [1], "chat_request": chat},
    )
    assert sorted(derendered) == one_call["derender"]["keys"]
    assert sorted(derendered["choices"][0]) == one_call["derender"]["choice_keys"]
    assert list(derendered["choices"][0]["message"]) == list(one_call["derender"]["message"])


async def test_models_report_the_context_window(server: InferenceServer, http: aiohttp.ClientSession) -> None:
    async with http.get(server.url + "/v1/models") as resp:
        card = (await resp.json())["data"][0]
    assert card["max_model_len"] == server.max_model_len == 1024
