"""Token-in chat (``aglverl.proxy.tokenin``, ``aglverl.proxy.session``) over loopback against the vLLM-shaped mock.

Agents are ordinary SDK code that send their history back as text (the openai SDK's chat completions and
Responses API, the anthropic SDK's Messages), streamed or not. The mock's chat template renders an earlier
answer's text as other ids than the ones generated (its ids spell ``" t<id>"``), the way real templates drift;
its ``think`` template renders a conversation's final assistant turn unlike an earlier one (Qwen3's shape) and
its ``mistral`` template puts the tool list and the system prompt on the last user turn (not append-only). With
``tokenizer`` its model card names a directory holding a real Hugging Face tokenizer of its ids and template,
as vLLM's names the model's path. What is checked: every later turn reaches the backend as ONE chat completion
carrying exactly the earlier turn's prompt + generated ids + the new tail's ids in
``kv_transfer_params["prompt_token_ids"]`` (no render without a tokenizer in the proxy: one render more); the
records chain so; the batch holds one row per conversation; what does not match, or cannot be made true to the
template, is relayed as text and counted by cause; aborts are continued from the ids so far; the template
cache stays bounded.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

import aiohttp
import anyio
import orjson
import pytest
from helpers.tokenin import a_step, api_conversation, chat_turn, counts, extends
from test_translate import claim, finish, openai_sdk, proxied

from aglverl import LLM, AgentDaemon, BatchConfig
from aglverl.proxy import tokenin
from aglverl.proxy.dialect import DEFAULT, ENGINE, VLLM, detect
from aglverl.proxy.session import Answer, Sessions, canonical_message
from aglverl.proxy.tokenin import TEMPLATES_KEPT
from aglverl.store import LLMCall
from aglverl.testing import MockVLLM, completion_token_ids, token_logprob, tool_arguments
from aglverl.testing.mock_vllm import JINJA_TEMPLATES, SeenRequest, render_chat

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RENDER = "/v1/chat/completions/render"
LOOKUP = {
    "type": "function",
    "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}},
}


def upstream(mock: MockVLLM) -> list[SeenRequest]:
    """What reached the backend for the calls (the model listing, read once per backend, aside)."""
    return [r for r in mock.requests if r.path != "/v1/models"]


def sent_ids(seen: SeenRequest) -> list[int] | None:
    """The prompt ids a chat request carried (``None``: a call relayed as text)."""
    params = seen.json.get("kv_transfer_params") if isinstance(seen.json, dict) else None
    return params.get("prompt_token_ids") if isinstance(params, dict) else None


def from_ids(mock: MockVLLM) -> list[dict[str, Any]]:
    """The bodies of the chat requests sent with prompt ids."""
    return [r.json for r in mock.requests if r.path == CHAT and sent_ids(r) is not None]


def assert_chained(calls: Sequence[LLMCall]) -> None:
    """Every call's prompt ids start with exactly the previous call's prompt + response ids."""
    assert all(extends(earlier, later) for earlier, later in itertools.pairwise(calls))


async def chat(client: Any, messages: list[Any], stream: bool, **kwargs: Any) -> dict[str, Any]:
    """One chat completion on the mock as the agent sees it (4 tokens unless told)."""
    kwargs.setdefault("max_tokens", 4)
    return await chat_turn(client, messages, stream, model="mock", **kwargs)


async def conversation(base: str, stream: bool, turns: int = 3, **kwargs: Any) -> list[dict[str, Any]]:
    """A text-echoing agent's ``turns`` calls (a system prompt, then a user turn after each answer)."""
    messages: list[Any] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    answers = []
    async with openai_sdk(base) as client:
        for turn in range(turns):
            answer = await chat(client, messages, stream, **kwargs)
            answers.append(answer)
            messages += [
                {"role": "assistant", "content": answer["content"]},
                {"role": "user", "content": f"more {turn}"},
            ]
    return answers


def text_of(ids: Sequence[int]) -> str:
    return "".join(f" t{t}" for t in ids)


# ---------------------------------------------------------------------------------------------- sessions
def test_messages_are_compared_as_the_template_renders_them() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1, "b": [2]}'}}
    same_call = {"id": "other", "function": {"name": "f", "arguments": '{"b":[2],"a":1}'}}
    # an answer: the generated ids stand for it, so its echo is compared loosely
    assert canonical_message({"role": "assistant", "content": "  hi \n"}) == canonical_message(
        {"role": "assistant", "content": [{"type": "text", "text": "hi"}], "reasoning_content": "hmm"}
    )
    assert canonical_message(
        {"role": "assistant", "content": None, "tool_calls": [call]}
    ) == canonical_message({"role": "assistant", "content": "", "tool_calls": [same_call], "reasoning": "x"})
    # anything else: what the template gets, verbatim (text parts joined with "\n", as vLLM joins them)
    assert canonical_message({"role": "user", "content": "hi"}) != canonical_message(
        {"role": "user", "content": "hi "}
    )
    assert canonical_message({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}) == canonical_message({"role": "user", "content": "a\nb"})  # fmt: skip
    assert canonical_message({"role": "tool", "tool_call_id": "a", "content": "42"}) != canonical_message(
        {"role": "tool", "tool_call_id": "b", "content": "42"}
    )
    assert canonical_message({"role": "user", "content": "hi"}) != canonical_message(
        {"role": "system", "content": "hi"}
    )
    assert (
        canonical_message({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]})
        is None
    )
    answer = Answer()
    for delta in ({"role": "assistant", "content": " h"}, {"content": "i "}, {"tool_calls": [{"index": 0, "id": "z", "function": {"name": "f", "arguments": '{"b": [2], '}}]}, {"tool_calls": [{"index": 0, "function": {"arguments": '"a": 1}'}}]}):  # fmt: skip
        answer.add_delta(delta)
    assert answer.canonical() == canonical_message(
        {"role": "assistant", "content": "hi", "tool_calls": [call]}
    )


def test_an_edited_history_is_not_generated_from_the_old_ids() -> None:
    """Defect 3 of issue 33: text parts were joined with "" and stripped, so "Say" + "yes." re-sent as "Sayyes."
    (or "hello" as " hello") matched and was generated from the ids of another conversation."""
    sessions = Sessions()
    parts = {"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "yes."}]}
    request = {"model": "m", "messages": [{"role": "system", "content": "hello"}, parts]}
    pending, _, _ = sessions.consider("r", "a", request)
    assert pending is not None
    answer = Answer()
    answer.set_message({"role": "assistant", "content": "ok"})
    sessions.remember(pending, answer, [1, 2], [3])
    said, more = {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}
    kept = {"model": "m", "messages": [*request["messages"], said, more]}
    assert sessions.consider("r", "a", kept)[1] is not None  # the same conversation goes on
    joined = {"role": "user", "content": "Sayyes."}
    for edited in (
        [request["messages"][0], joined, said, more],
        [{"role": "system", "content": " hello"}, parts, said, more],
        [request["messages"][0], {"role": "user", "content": "Say\nyes. "}, said, more],
    ):
        assert sessions.consider("r", "a", {"model": "m", "messages": edited})[1:] == (None, "no_match")


def test_the_longest_recorded_prefix_under_the_same_rendering_context_matches() -> None:
    sessions = Sessions()
    system, user = {"role": "system", "content": "s"}, {"role": "user", "content": "q"}
    first = {"model": "m", "messages": [system, user]}
    pending, match, miss = sessions.consider("r", "a", first)
    assert pending is not None and match is None and miss == "first_call"
    answer = Answer()
    answer.set_message({"role": "assistant", "content": "yes"})
    sessions.remember(pending, answer, [1, 2], [3, 4])
    tail = [{"role": "user", "content": "again"}]
    extended = {"model": "m", "messages": [system, user, {"role": "assistant", "content": "yes "}, *tail]}
    pending2, match, miss = sessions.consider("r", "a", extended)
    assert match is not None and match.tail == tail and match.turn.prompt == [1, 2] and miss is None
    assert (match.history, match.start) == (2, 3)
    answer2 = Answer()
    answer2.set_message({"role": "assistant", "content": "no"})
    assert pending2 is not None
    sessions.remember(pending2, answer2, [1, 2, 3, 4, 9], [5])
    longer = {**extended, "messages": [*extended["messages"], {"role": "assistant", "content": "no"}, *tail]}
    _, match, _ = sessions.consider("r", "a", longer)
    assert match is not None and match.turn.prompt == [1, 2, 3, 4, 9]  # the longest wins
    edited = {"model": "m", "messages": [system, user, {"role": "assistant", "content": "maybe"}, *tail]}
    assert sessions.consider("r", "a", edited)[2] == "no_match"
    other_tools = {**extended, "tools": [LOOKUP]}
    assert sessions.consider("r", "a", other_tools)[2] == "context_changed"
    assert sessions.consider("r", "a", extended)[2] is None
    assert sessions.consider("r", "other-attempt", extended)[2] == "first_call"
    assert sessions.consider("r", "a", {**extended, "n": 2})[:2] == (None, None)
    assert sessions.consider("r", "a", {**extended, "n": 2})[2] == "n"
    assert sessions.consider("r", "a", {**extended, "continue_final_message": True})[2] == "unsupported"
    sessions.forget(["r"])
    assert len(sessions) == 0 and sessions.consider("r", "a", extended)[2] == "first_call"


def test_an_empty_answer_the_agent_leaves_out_still_matches() -> None:
    sessions = Sessions()
    request = {"model": "m", "messages": [{"role": "user", "content": "q"}]}
    pending, _, _ = sessions.consider("r", "a", request)
    assert pending is not None
    sessions.remember(pending, Answer(), [1], [2])  # the model said nothing (an end of turn)
    later = {
        "model": "m",
        "messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "well?"}],
    }
    _, match, _ = sessions.consider("r", "a", later)
    assert match is not None and match.turn.response == [2] and (match.history, match.start) == (1, 1)
    # an agent that kept it (and then edited the history after it) matches the turn it kept, not this one
    kept = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "x"},
    ]
    _, match, _ = sessions.consider("r", "a", {"model": "m", "messages": kept})
    assert match is not None and match.tail == kept[2:]
    edited = [*kept[:1], {"role": "assistant", "content": "changed"}, kept[2]]
    assert sessions.consider("r", "a", {"model": "m", "messages": edited})[2] == "no_match"


# ---------------------------------------------------------------------------------------------- dialects
def test_a_backend_is_known_by_its_model_listing_and_the_prompt_ids_go_in_the_agents_own_body() -> None:
    assert detect([{"id": "m", "owned_by": "vllm"}]) is VLLM
    assert detect([{"id": "m", "owned_by": "aglverl"}]) is ENGINE
    assert detect([{"id": "m", "owned_by": "someone"}]) is DEFAULT and detect([]) is DEFAULT
    cards = [{"id": "a", "root": "/models/a", "max_model_len": 8}, {"id": "b", "root": "/models/b"}]
    assert (VLLM.tokenizer_source(cards, "b"), VLLM.context_window(cards, "a")) == ("/models/b", 8)
    # every other byte of the agent's body kept; prompt ids spliced in, or merged with its own params
    body = b'{"model": "m",  "messages": [], "x": 1.50}'
    sent = VLLM.with_prompt_ids(body, orjson.loads(body), [1, 2])
    assert sent.endswith(b'"model": "m",  "messages": [], "x": 1.50}')
    assert orjson.loads(sent)["kv_transfer_params"] == {"prompt_token_ids": [1, 2]}
    assert orjson.loads(VLLM.with_prompt_ids(b"{}", {}, [3])) == {
        "kv_transfer_params": {"prompt_token_ids": [3]}
    }
    own = {"model": "m", "kv_transfer_params": {"do_remote_prefill": True}}
    merged = orjson.loads(VLLM.with_prompt_ids(orjson.dumps(own), own, [4]))
    assert merged["kv_transfer_params"] == {"do_remote_prefill": True, "prompt_token_ids": [4]}
    # a server that forbids the field, not ids it refuses, means no prompt ids there
    assert VLLM.refuses_prompt_ids(400, "kv_transfer_params: Extra inputs are not permitted")
    assert not VLLM.refuses_prompt_ids(400, "kv_transfer_params['prompt_token_ids'] must be below 151936")
    assert VLLM.lacks_route(403, b"Scale-out endpoints are disabled") and VLLM.lacks_route(404, b"Not Found")
    assert not VLLM.lacks_route(404, b'{"error": {"message": "The model `x` does not exist."}}')


# ---------------------------------------------------------------------------------------------- one request
@pytest.mark.parametrize("template", ["plain", "think"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_each_later_call_is_one_chat_request_carrying_the_earlier_turns_exact_ids(
    stream: bool, template: str
) -> None:
    async with (
        MockVLLM(template=template, tokenizer=True) as mock,  # type: ignore[arg-type]
        proxied(mock.url, request_logprobs=True) as (proxy, store),
    ):
        rid, aid, base = claim(proxy, store)
        answers = await conversation(base, stream)
        calls = finish(store, rid, aid)
    assert counts(proxy) == {"first_call": 1, "generated": 2}
    assert_chained(calls)
    # one request per call: the chat endpoint, each later one with its exact prompt ids (no render, no hop)
    sent = upstream(mock)
    assert [r.path for r in sent] == [CHAT] * 3 and sent_ids(sent[0]) is None
    for call, seen, answer in zip(calls[1:], sent[1:], answers[1:], strict=True):
        assert sent_ids(seen) == call.prompt_token_ids
        assert call.response_token_ids == completion_token_ids(call.prompt_token_ids or [], 0, 4)
        assert answer["content"] == text_of(call.response_token_ids) and answer["finish_reason"] == "length"
        assert call.logprobs == [token_logprob(t) for t in call.response_token_ids]
        assert call.status == "ok" and call.finish_reason == "length" and call.limit == "max_tokens"
        # the backend's parsers get the agent's request as it sent it (its messages, tools, switches)
        assert seen.json["messages"][0] == {"role": "system", "content": "Be brief."}
    # the tail after the earlier ids: the end of turn the length stop left out, then the user turn rendered
    first, second = calls[0], calls[1]
    assert first.prompt_token_ids is not None and first.response_token_ids is not None
    tail = second.prompt_token_ids[len(first.prompt_token_ids) + len(first.response_token_ids) :]  # type: ignore[index]
    assert bytes(tail) == b"\n<|user|>more 0\n<|assistant|>"


async def test_without_the_models_tokenizer_a_later_call_first_renders_its_tail_on_the_backend(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="aglverl.proxy.tokenin")
    async with MockVLLM(template="think") as mock, proxied(mock.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        await conversation(base, False, turns=4)
        renders_before = len([r for r in mock.requests if r.path == RENDER])
        async with openai_sdk(base) as client:  # one more conversation of the same shape
            await chat(client, [{"role": "user", "content": "q"}], False)
        calls = finish(store, rid, aid)
    assert counts(proxy) == {"first_call": 1, "generated": 3, "no_match": 1}
    assert_chained(calls[:4])
    sent = upstream(mock)
    # the first later call reads the template once (anchors, the shape check), later ones render their tail
    later = [r.path for r in sent[sent.index(next(r for r in sent if sent_ids(r))) + 1 :]]
    assert later == [RENDER, CHAT, RENDER, CHAT, CHAT]
    assert renders_before == len([r for r in mock.requests if r.path == RENDER])
    renders = [r.json for r in mock.requests if r.path == RENDER]
    assert all(m["content"] != "hello" for body in renders[-2:] for m in body["messages"])  # tails alone
    [warning] = [r for r in caplog.records if "no tokenizer for model" in r.message]
    assert mock.url in warning.message and "one request more per call" in warning.message


@pytest.mark.parametrize("scale_out", [False, None], ids=["disabled", "absent"])
async def test_a_backend_without_a_tokenizer_nor_a_render_route_is_warned_about_once_and_relayed_as_text(
    scale_out: bool | None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aglverl.proxy.tokenin")
    async with MockVLLM(scale_out=scale_out) as mock, proxied(mock.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        await conversation(base, False)
        calls = finish(store, rid, aid)
    assert counts(proxy) == {"first_call": 1, "no_backend": 2}
    [warning] = [r for r in caplog.records if "has no token-in chat" in r.message]
    assert "--enable-scale-out" in warning.message and mock.url in warning.message
    assert not from_ids(mock) and all(c.status == "ok" for c in calls)
    # found out at the first call that could go token-in, never asked again
    assert len([r for r in mock.requests if r.path == RENDER]) <= (4 if scale_out is False else 0)


@pytest.mark.parametrize("behaviour", ["ignore", "refuse"])
async def test_a_backend_that_does_not_take_prompt_ids_is_found_out_once_and_relayed_as_text(
    behaviour: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aglverl.proxy.tokenin")
    async with (
        MockVLLM(tokenizer=True, prompt_ids=behaviour) as mock,  # type: ignore[arg-type]
        proxied(mock.url) as (proxy, store),
    ):
        rid, aid, base = claim(proxy, store)
        answers = await conversation(base, True)
        calls = finish(store, rid, aid)
    found = "ids_ignored" if behaviour == "ignore" else "refused"
    assert counts(proxy) == {"first_call": 1, found: 1, "no_backend": 1}
    [warning] = [r for r in caplog.records if "does not generate chat calls from prompt ids" in r.message]
    assert mock.url in warning.message and "0.32" in warning.message
    # every call answered and recorded as the backend generated it: from its own rendering of the messages
    assert all(c.status == "ok" for c in calls) and all(a["finish_reason"] == "length" for a in answers)
    answered = [
        r.json for r in mock.requests if r.path == CHAT and (behaviour == "ignore" or not sent_ids(r))
    ]
    assert len(answered) == 3
    assert [c.prompt_token_ids for c in calls] == [
        list(render_chat(b["messages"]).encode()) for b in answered
    ]


async def test_a_template_the_backend_renders_otherwise_is_found_out_and_its_tails_rendered_there(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="aglverl.proxy.tokenin")
    async with MockVLLM(tokenizer=True) as mock, proxied(mock.url) as (proxy, store):
        # the tokenizer the model card names has another generation prompt than the template the backend uses
        # (vllm serve --chat-template ...): the proxy's renders would give the tail other ids
        assert mock.tokenizer_dir is not None
        other = JINJA_TEMPLATES["plain"].replace("<|assistant|>{% endif %}", "<|assistant|>\n{% endif %}")
        (mock.tokenizer_dir / "chat_template.jinja").write_text(other)
        directory = str(mock.tokenizer_dir)
        rid, aid, base = claim(proxy, store)
        await conversation(base, False)
        calls = finish(store, rid, aid)
    assert counts(proxy) == {"first_call": 1, "generated": 2}
    assert_chained(calls)
    [warning] = [r for r in caplog.records if "renders a conversation otherwise" in r.message]
    assert directory in warning.message
    # the backend's own renders made the tails: its generation prompt, not the proxy's
    assert [bytes((c.prompt_token_ids or [])[-14:]) for c in calls[1:]] == [b"\n<|assistant|>"] * 2
    assert any(r.path == RENDER for r in mock.requests)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_responses_and_messages_agents_are_one_request_per_call_too(api: str, stream: bool) -> None:
    async with MockVLLM(template="think", tokenizer=True) as mock, proxied(mock.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        texts = await api_conversation(api, base, stream, model="mock", max_tokens=4)
        calls = finish(store, rid, aid)
    assert counts(proxy) == {"first_call": 1, "generated": 2}
    assert_chained(calls)
    assert [r.path for r in upstream(mock)] == [CHAT] * 3
    assert [sent_ids(r) for r in upstream(mock)[1:]] == [c.prompt_token_ids for c in calls[1:]]
    assert [t.strip() for t in texts] == [text_of(c.response_token_ids or []).strip() for c in calls]
    assert all(c.path == f"/v1/{api}" and c.status == "ok" for c in calls)


async def test_tool_calls_the_backend_parsed_are_echoed_with_a_tool_result_and_continue_from_ids() -> None:
    async with MockVLLM(completion_tokens=3, tokenizer=True) as mock, proxied(mock.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        messages: list[Any] = [{"role": "user", "content": "Look x up."}]
        async with openai_sdk(base) as client:
            first = await chat(client, messages, False, tools=[LOOKUP], tool_choice="required")
            [call] = first["tool_calls"]
            messages += [
                {"role": "assistant", "content": first["content"], "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": "x is 42"},
            ]
            second = await chat(client, messages, True, tools=[LOOKUP], tool_choice="required")
            [call2] = second["tool_calls"]
            messages += [
                {"role": "assistant", "content": None, "tool_calls": [call2]},
                {"role": "tool", "tool_call_id": call2["id"], "content": "y is 7"},
            ]
            third = await chat(client, messages, False, tools=[LOOKUP])
        calls = finish(store, rid, aid)
    assert counts(proxy) == {"first_call": 1, "generated": 2}
    assert_chained(calls)
    assert (
        first["finish_reason"] == second["finish_reason"] == "tool_calls" and third["finish_reason"] == "stop"
    )
    assert call2["function"]["name"] == "lookup" and calls[1].finish_reason == "tool_calls"
    assert orjson.loads(call2["function"]["arguments"]) == orjson.loads(
        "".join(tool_arguments(calls[1].response_token_ids or []))
    )
    assert third["content"] == text_of(calls[2].response_token_ids or [])
    tail = calls[1].prompt_token_ids[len(calls[0].prompt_token_ids or []) + 3 :]  # type: ignore[index]
    assert bytes(tail) == b"\n<|tool|>x is 42\n<|assistant|>"
    # the backend's parser read the agent's tools and tool_choice off the request sent with the ids
    assert [b["tools"] for b in from_ids(mock)] == [[LOOKUP]] * 2
    assert [b.get("tool_choice") for b in from_ids(mock)] == ["required", None]


async def test_each_conversation_trains_as_one_row_of_the_ids_the_engine_generated() -> None:
    """Through the daemon's batches: token-in makes one row per conversation, text re-rendered one per call."""

    async def agent(task: dict[str, Any], llm: LLM) -> float:
        messages: list[Any] = [{"role": "user", "content": f"question {task['q']}"}]
        async with openai_sdk(llm.endpoint) as client:
            for turn in range(3):
                answer = await chat(client, messages, task["q"] % 2 == 0)
                messages += [
                    {"role": "assistant", "content": answer["content"]},
                    {"role": "user", "content": f"tool result {turn}"},
                ]
        return 1.0

    rows = {}
    for token_in in (True, False):
        batch_config = BatchConfig(max_prompt_length=256, max_response_length=256)
        async with (
            MockVLLM(tokenizer=True) as mock,
            AgentDaemon(backends=[mock.url], model="mock", batch=batch_config, token_in=token_in) as daemon,
        ):
            batch, counters = await a_step(daemon, agent)
        data, metrics = batch.data, batch.metrics
        rows[token_in] = len(data)
        assert metrics["batch/n_calls"] == 12
        if not token_in:
            assert metrics["batch/n_calls_drifted"] == 8 and len(data) == 12  # every later turn drifted
            assert "proxy/token_in_generated" not in counters
            continue
        assert counters["proxy/token_in_generated"] == 8 and counters["proxy/token_in_first_call"] == 4
        assert metrics["batch/n_calls_drifted"] == 0 and len(data) == 4
        assert len(upstream(mock)) == 12 and len(from_ids(mock)) == 8  # one request per call
        answered = {tuple(p): r for r_ in mock.generation_requests() for p, r in mock.expected(r_.json)}
        responses, mask = data.batch["responses"], data.batch["response_mask"].bool()
        attention = data.batch["attention_mask"][:, 256:].bool()
        for i in range(len(data)):
            real = responses[i][attention[i]].tolist()
            kept = mask[i][attention[i]].tolist()
            prompt = data.batch["prompts"][i][data.batch["attention_mask"][i, :256].bool()].tolist()
            # the unmasked ids are the three answers as generated, each the answer to everything before it
            so_far, generated_ids, between = list(prompt), [], []
            for is_kept, group in itertools.groupby(zip(kept, real, strict=True), key=lambda kt: kt[0]):
                piece = [t for _, t in group]
                if is_kept:
                    assert answered[tuple(so_far)] == piece
                    generated_ids += piece
                else:
                    between.append(bytes(piece))
                so_far += piece
            assert len(generated_ids) == 12
            assert between == [
                b"\n<|user|>tool result 0\n<|assistant|>",
                b"\n<|user|>tool result 1\n<|assistant|>",
            ]
    assert rows == {True: 4, False: 12}


# ---------------------------------------------------------------------------------------------- what does not match
async def test_an_edited_history_another_system_prompt_or_other_tools_start_a_new_chain() -> None:
    async with MockVLLM(tokenizer=True) as mock, proxied(mock.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        system, user = {"role": "system", "content": "s"}, {"role": "user", "content": "q"}
        async with openai_sdk(base) as client:
            first = await chat(client, [system, user], False)
            said = {"role": "assistant", "content": first["content"]}
            follow = {"role": "user", "content": "and?"}
            await chat(
                client,
                [system, user, {"role": "assistant", "content": "I said something else"}, follow],
                False,
            )
            await chat(client, [{"role": "system", "content": "a sub-agent"}, user, said, follow], False)
            await chat(client, [system, {"role": "user", "content": "q "}, said, follow], False)  # edited
            await chat(client, [system, user, said, follow], False, tools=[LOOKUP])
            await chat(client, [system, user, said, follow], False, n=2)
            await chat(client, [system, user, said, follow], False)  # the one that extends
        calls = finish(store, rid, aid)
    assert counts(proxy) == {"first_call": 1, "no_match": 3, "context_changed": 1, "n": 1, "generated": 1}
    assert len(from_ids(mock)) == 1
    assert_chained([calls[0], calls[-1]])


async def test_token_in_off_relays_every_call_as_text() -> None:
    async with MockVLLM(tokenizer=True) as mock, proxied(mock.url, token_in=False) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        await conversation(base, False, turns=2)
        finish(store, rid, aid)
    assert proxy.token_in is None and [r.path for r in upstream(mock)] == [CHAT, CHAT]
    assert not from_ids(mock)


async def test_sessions_are_forgotten_with_their_rollouts() -> None:
    async with MockVLLM() as mock, proxied(mock.url) as (proxy, store):
        store.on_forget(proxy.forget)  # as AgentDaemon wires them
        rid, aid, base = claim(proxy, store)
        async with openai_sdk(base) as client:
            await chat(client, [{"role": "user", "content": "q"}], False)
        finish(store, rid, aid)
        assert proxy.token_in is not None and len(proxy.token_in.sessions) == 1
        store.forget([rid])
        assert len(proxy.token_in.sessions) == 0


# ---------------------------------------------------------------------------------------------- true to the template
async def test_a_template_that_is_not_append_only_is_generated_from_its_whole_rendering(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Defect 1 of issue 33: Mistral-7B-Instruct-v0.3's template puts the tool list and the system prompt on
    the LAST user turn; an anchored tail repeated them on every user turn and left the system prompt on the
    first. Such a conversation is now made from the template's rendering of the whole conversation."""
    caplog.set_level(logging.WARNING, logger="aglverl.proxy.tokenin")
    async with MockVLLM(template="mistral", tokenizer=True) as mock, proxied(mock.url) as (proxy, store):
        directory = str(mock.tokenizer_dir)
        rid, aid, base = claim(proxy, store)
        answers = await conversation(base, False, tools=[LOOKUP])  # a system prompt and tools
        with_system = finish(store, rid, aid)
        rid, aid, base = claim(proxy, store)
        messages: list[Any] = [{"role": "user", "content": "hello"}]
        async with openai_sdk(base) as client:  # neither: the template appends
            for turn in range(3):
                answer = await chat(client, messages, False)
                messages += [{"role": "assistant", "content": answer["content"]}, {"role": "user", "content": f"{turn}"}]  # fmt: skip
        plain = finish(store, rid, aid)
    assert counts(proxy) == {"first_call": 2, "not_append_only": 2, "generated": 2}
    [warning] = [
        r for r in caplog.records if "does not render a conversation as its earlier turn" in r.message
    ]
    assert directory in warning.message
    # never from a prompt the template would not produce: the whole conversation as the template renders it
    history: list[Any] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    for turn, (call, answer) in enumerate(zip(with_system, answers, strict=True)):
        whole = render_chat(history, tools=[LOOKUP], template="mistral").encode()
        assert call.prompt_token_ids == list(whole) and whole.count(b"<|tools|>") == 1
        assert (
            whole.count(b"Be brief.") == 1
            and b"<|user|>Be brief.\n\n" + history[-1]["content"].encode() in whole
        )
        history += [{"role": "assistant", "content": answer["content"]}, {"role": "user", "content": f"more {turn}"}]  # fmt: skip
    assert_chained(plain)


@pytest.mark.parametrize("tools", [False, True], ids=["resumed", "made_again"])
async def test_a_relayed_answer_aborted_by_a_weight_update_keeps_its_turn(tools: bool) -> None:
    """Defect 2 of issue 33: a whole (JSON) answer aborted and resumed (or made again) was recorded without the
    answer the agent got, so the conversation's next call started a new chain."""
    extra = {"tools": [LOOKUP]} if tools else {}  # a call with tools is made again, not continued
    async with MockVLLM(completion_tokens=6, tokenizer=True) as mock, proxied(mock.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        messages: list[Any] = [{"role": "user", "content": "q"}]
        async with openai_sdk(base) as client:
            mock.abort_next(after_tokens=2)
            first = await chat(client, messages, False, max_tokens=6, **extra)
            messages += [
                {"role": "assistant", "content": first["content"]},
                {"role": "user", "content": "and?"},
            ]
            await chat(client, messages, False, **extra)
        calls = finish(store, rid, aid)
    assert (proxy.m_resumed.value(), proxy.m_regenerated.value()) == ((0, 1) if tools else (1, 0))
    assert first["content"] == text_of(calls[0].response_token_ids or [])
    assert counts(proxy) == {"first_call": 1, "generated": 1}
    assert_chained(calls)


async def test_the_template_cache_stays_bounded_over_many_rollouts_with_their_own_tools() -> None:
    """Defect 4 of issue 33: one anchor per rendering context was kept for the whole run."""
    rollouts = TEMPLATES_KEPT + 8
    async with (
        MockVLLM(completion_tokens=1, tokenizer=True) as mock,
        proxied(mock.url) as (proxy, store),
        aiohttp.ClientSession() as http,
    ):
        store.on_forget(proxy.forget)
        assert proxy.token_in is not None
        for i in range(rollouts):
            rid, aid, base = claim(proxy, store)
            tool = {"type": "function", "function": {"name": f"tool_{i}", "parameters": {"type": "object"}}}
            body: dict[str, Any] = {"model": "mock", "max_tokens": 1, "tools": [tool]}
            messages: list[Any] = [{"role": "user", "content": "q"}]
            for _ in range(2):
                async with http.post(f"{base}/chat/completions", json={**body, "messages": messages}) as r:
                    answer = (await r.json())["choices"][0]["message"]
                messages += [answer, {"role": "user", "content": "and?"}]
            finish(store, rid, aid)
            store.forget([rid])
        assert proxy.token_in.templates_kept() == TEMPLATES_KEPT
    assert counts(proxy) == {"first_call": rollouts, "generated": rollouts}


# ---------------------------------------------------------------------------------------------- aborts
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_generation_aborted_for_a_weight_update_during_a_hold_goes_on_from_the_ids_so_far(
    stream: bool,
) -> None:
    async with (
        MockVLLM(completion_tokens=6, tokenizer=True) as mock,
        proxied(mock.url, request_logprobs=True) as (proxy, store),
    ):
        rid, aid, base = claim(proxy, store)
        messages: list[Any] = [{"role": "user", "content": "q"}]
        async with openai_sdk(base) as client:
            answer = await chat(client, messages, stream, max_tokens=6)
            messages += [
                {"role": "assistant", "content": answer["content"]},
                {"role": "user", "content": "and?"},
            ]
            release = anyio.Event()
            mock.abort_next(after_tokens=2, release=release)
            results: list[dict[str, Any]] = []
            async with anyio.create_task_group() as tg:

                async def second() -> None:
                    results.append(await chat(client, messages, stream, max_tokens=6))

                tg.start_soon(second)
                with anyio.fail_after(10):
                    await mock.wait_until(lambda m: m.aborting == 1)  # two tokens made, the abort held back
                proxy.hold()  # the trainer's update starts: new calls and continuations wait
                release.set()
                with anyio.move_on_after(0.3):  # one bounded look: the continuation waits for the update
                    await mock.wait_until(lambda m: any(r.path == COMPLETIONS for r in m.requests))
                assert not any(r.path == COMPLETIONS for r in mock.requests)
                proxy.resume(1)
        calls = finish(store, rid, aid)
    [asked] = from_ids(mock)
    [rest] = [r.json for r in mock.requests if r.path == COMPLETIONS]
    prompt = asked["kv_transfer_params"]["prompt_token_ids"]
    cut = completion_token_ids(prompt, 0, 6)[:2]
    assert rest["prompt"] == prompt + cut and rest["max_tokens"] == 4  # what was left of the call's limit
    ids = cut + completion_token_ids(rest["prompt"], 0, 4)
    second = calls[1]
    assert second.prompt_token_ids == prompt and second.response_token_ids == ids
    assert results[0]["content"] == text_of(ids) and results[0]["finish_reason"] == "length"
    assert second.logprobs == [token_logprob(t) for t in ids]
    assert (second.weight_version, second.weight_version_end) == (0, 1)
    assert proxy.m_resumed.value() == 1 and proxy.m_continuations.value() == 1
    assert counts(proxy) == {"first_call": 1, "generated": 1}
    assert_chained(calls)


async def test_an_aborted_answer_with_tools_is_made_again_from_its_prompt_ids() -> None:
    async with MockVLLM(completion_tokens=3, tokenizer=True) as mock, proxied(mock.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        messages: list[Any] = [{"role": "user", "content": "q"}]
        async with openai_sdk(base) as client:
            answer = await chat(client, messages, False, tools=[LOOKUP])  # the model answers in text
            messages += [
                {"role": "assistant", "content": answer["content"]},
                {"role": "user", "content": "look it up"},
            ]
            mock.abort_next(after_tokens=1)
            result = await chat(client, messages, False, tools=[LOOKUP], tool_choice="required")
        calls = finish(store, rid, aid)
    aborted, again = from_ids(mock)
    assert again == aborted  # the same request, from the same prompt ids, under the new weights
    ids = completion_token_ids(sent_ids_of(again), 0, 3)
    assert calls[1].response_token_ids == ids and proxy.m_regenerated.value() == 1
    [call] = result["tool_calls"]
    assert orjson.loads(call["function"]["arguments"]) == orjson.loads("".join(tool_arguments(ids)))
    assert counts(proxy) == {"first_call": 1, "generated": 1}


def sent_ids_of(body: dict[str, Any]) -> list[int]:
    ids = body["kv_transfer_params"]["prompt_token_ids"]
    assert isinstance(ids, list)
    return ids


# ---------------------------------------------------------------------------------------------- round 3 (issue 41)
@pytest.mark.parametrize("case", ["few_shot", "forgotten"])
async def test_a_template_the_backend_renders_otherwise_is_found_out_whatever_the_first_call_held(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check of the proxy's template against the backend's was skipped when the first call held an
    assistant message (few-shot) and once the cache had forgotten the verdict (the turns after it were made
    from ids, none of them rendered by the backend): the proxy then rendered tails with its own generation
    prompt (``<|assistant|>\\n`` where the backend renders ``\\n<|assistant|>``)."""
    if case == "forgotten":
        monkeypatch.setattr(tokenin, "TEMPLATES_KEPT", 1)  # a run of one conversation keeps two contexts
    async with (
        MockVLLM(tokenizer=True) as mock,
        proxied(mock.url) as (proxy, store),
        aiohttp.ClientSession() as http,
    ):
        assert mock.tokenizer_dir is not None
        other = JINJA_TEMPLATES["plain"].replace("<|assistant|>{% endif %}", "<|assistant|>\n{% endif %}")
        (mock.tokenizer_dir / "chat_template.jinja").write_text(other)
        rid, aid, base = claim(proxy, store)
        messages: list[Any] = [{"role": "user", "content": "hello"}]
        if case == "few_shot":
            messages = [
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": " 4  "},
                *messages,
            ]
        turns = 2 if case == "few_shot" else 4
        for turn in range(turns):
            if (
                case == "forgotten" and turn == 2
            ):  # other conversations with their own tools, then this one again
                for i in range(2):
                    _, _, other_base = claim(proxy, store)
                    tool = {
                        "type": "function",
                        "function": {"name": f"f{i}", "parameters": {"type": "object"}},
                    }
                    chat: list[Any] = [{"role": "user", "content": "q"}]
                    for _ in range(2):
                        body = {"model": "mock", "max_tokens": 2, "tools": [tool], "messages": chat}
                        async with http.post(f"{other_base}/chat/completions", json=body) as r:
                            chat += [
                                (await r.json())["choices"][0]["message"],
                                {"role": "user", "content": "and?"},
                            ]
            body = {"model": "mock", "max_tokens": 4, "messages": messages}
            async with http.post(f"{base}/chat/completions", json=body) as r:
                answer = (await r.json())["choices"][0]["message"]
            messages += [answer, {"role": "user", "content": f"more {turn}"}]
        calls = finish(store, rid, aid)
    assert_chained(calls)
    # every tail the proxy made was rendered by the backend: its generation prompt, not the proxy's
    assert [bytes((c.prompt_token_ids or [])[-14:]) for c in calls[1:]] == [b"\n<|assistant|>"] * (turns - 1)


async def test_an_answer_that_ended_on_another_stop_token_gets_no_second_end_of_turn() -> None:
    """An answer the engine stopped on one of the model's other stop tokens (Qwen2.5's ``<|endoftext|>``, Llama
    3.1's ``<|eom_id|>``: vLLM keeps it in the ids and reports it as ``stop_reason``) has ended its turn: the
    next call's ids go on with the glue, not with the template's end of turn after it."""
    async with (
        MockVLLM(tokenizer=True) as mock,
        proxied(mock.url) as (proxy, store),
        aiohttp.ClientSession() as http,
    ):
        rid, aid, base = claim(proxy, store)
        messages: list[Any] = [{"role": "user", "content": "hello"}]
        async with http.post(f"{base}/chat/completions", json={"model": "mock", "messages": messages}) as r:
            prompt = (await r.json())["prompt_token_ids"]
        stop = completion_token_ids(prompt, 0, 4)[
            2
        ]  # the third token the engine will generate is a stop token
        finish(store, rid, aid)
        rid, aid, base = claim(proxy, store)
        calls_made = []
        for turn in range(2):
            body = {"model": "mock", "max_tokens": 4, "messages": messages, "stop_token_ids": [stop]}
            async with http.post(f"{base}/chat/completions", json=body) as r:
                answer = (await r.json())["choices"][0]
            calls_made.append(answer)
            messages += [answer["message"], {"role": "user", "content": f"more {turn}"}]
        first, second = finish(store, rid, aid)
    assert calls_made[0]["finish_reason"] == "stop" and calls_made[0]["stop_reason"] == stop
    assert first.response_token_ids is not None and first.response_token_ids[-1] == stop
    assert first.prompt_token_ids is not None and second.prompt_token_ids is not None
    head = first.prompt_token_ids + first.response_token_ids
    assert second.prompt_token_ids[: len(head)] == head
    # the mock's template ends a turn with "\n" (its end of turn) and has no glue: the next turn follows the stop
    # token at once (before: "\n<|user|>...", a second end of turn after the one the engine generated)
    assert bytes(second.prompt_token_ids[len(head) :]) == b"<|user|>more 0\n<|assistant|>"


async def test_the_template_cache_holds_the_runs_conversations() -> None:
    """More conversations alive at once than the cache's floor, each with its own tool list: the cache is
    sized from the run (twice the attempts with a session), so none of them has its template read again."""
    rollouts = TEMPLATES_KEPT + 44
    async with (
        MockVLLM(completion_tokens=1, tokenizer=True) as mock,
        proxied(mock.url) as (proxy, store),
        aiohttp.ClientSession() as http,
    ):
        assert proxy.token_in is not None
        conversations = []
        for i in range(rollouts):
            _, _, base = claim(proxy, store)
            tool = {"type": "function", "function": {"name": f"tool_{i}", "parameters": {"type": "object"}}}
            conversations.append(
                (
                    base,
                    {"model": "mock", "max_tokens": 1, "tools": [tool]},
                    [{"role": "user", "content": "q"}],
                )
            )
        for _ in range(2):  # every conversation's first call, then every second one (a context each)
            for base, body, messages in conversations:
                async with http.post(f"{base}/chat/completions", json={**body, "messages": messages}) as r:
                    answer = (await r.json())["choices"][0]["message"]
                messages += [answer, {"role": "user", "content": "and?"}]
        kept = proxy.token_in.templates_kept()
    assert kept == rollouts and counts(proxy) == {"first_call": rollouts, "generated": rollouts}
