"""Token-in chat (``aglverl.proxy.tokenin``, ``aglverl.proxy.session``) over loopback against the vLLM-shaped mock.

Agents are ordinary SDK code that send their history back as text (the openai SDK's chat completions and
Responses API, the anthropic SDK's Messages), streamed or not. The mock's chat template renders an earlier
answer's text as other ids than the ones generated (its ids spell ``" t<id>"``), the way real templates drift,
and its ``think`` template renders a conversation's final assistant turn unlike an earlier one (Qwen3's
shape). What is checked: the backend is asked, for every later turn, for exactly the earlier turn's prompt +
generated ids followed by the new tail; the records chain so; the batch holds one row per conversation whose
unmasked ids are exactly the generated ones and whose masked ids are the tool / user turns; what does not
match is relayed as text and counted by cause; aborts are continued from the ids so far.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

import anyio
import orjson
import pytest
from helpers.tokenin import api_conversation, chat_turn, counts, extends
from test_translate import claim, finish, openai_sdk, proxied

from aglverl import LLM, AgentDaemon, BatchConfig, run_agents
from aglverl.proxy.session import Answer, Sessions, canonical_message
from aglverl.store.tasks import LLMCall
from aglverl.testing import MockVLLM, completion_token_ids, token_logprob, tool_arguments

pytestmark = pytest.mark.anyio

GENERATE = "/inference/v1/generate"
RENDER = "/v1/chat/completions/render"
DERENDER = "/v1/chat/completions/derender"
LOOKUP = {
    "type": "function",
    "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}},
}


def generated(mock: MockVLLM) -> list[dict[str, Any]]:
    """The bodies of the generate requests the mock got."""
    return [r.json for r in mock.requests if r.path == GENERATE]


def assert_chained(calls: Sequence[LLMCall]) -> None:
    """Every call's prompt ids start with exactly the previous call's prompt + response ids."""
    assert all(extends(earlier, later) for earlier, later in itertools.pairwise(calls))


async def chat(client: Any, messages: list[Any], stream: bool, **kwargs: Any) -> dict[str, Any]:
    """One chat completion on the mock as the agent sees it (4 tokens unless told)."""
    kwargs.setdefault("max_tokens", 4)
    return await chat_turn(client, messages, stream, model="mock", **kwargs)


def text_of(ids: Sequence[int]) -> str:
    return "".join(f" t{t}" for t in ids)


# ---------------------------------------------------------------------------------------------- sessions
def test_messages_match_canonicalised_and_ignore_what_agents_drop() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1, "b": [2]}'}}
    same_call = {"id": "other", "function": {"name": "f", "arguments": '{"b":[2],"a":1}'}}
    assert canonical_message({"role": "assistant", "content": "  hi \n"}) == canonical_message(
        {"role": "assistant", "content": [{"type": "text", "text": "hi"}], "reasoning_content": "hmm"}
    )
    assert canonical_message(
        {"role": "assistant", "content": None, "tool_calls": [call]}
    ) == canonical_message({"role": "assistant", "content": "", "tool_calls": [same_call], "reasoning": "x"})
    assert canonical_message({"role": "tool", "tool_call_id": "a", "content": "42"}) == canonical_message(
        {"role": "tool", "tool_call_id": "b", "name": "f", "content": "42"}
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
    assert match is not None and match.turn.response == [2]
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


# ---------------------------------------------------------------------------------------------- chat agents
@pytest.mark.parametrize("template", ["plain", "think"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_text_echoing_chat_agent_is_generated_from_the_earlier_turns_exact_ids(
    stream: bool, template: str
) -> None:
    async with (
        MockVLLM(template=template) as mock,
        proxied(mock.url, request_logprobs=True) as (proxy, store),
    ):  # type: ignore[arg-type]
        rid, aid, base = claim(proxy, store)
        messages: list[Any] = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hello"},
        ]
        answers = []
        async with openai_sdk(base) as client:
            for turn in range(3):
                answer = await chat(client, messages, stream)
                answers.append(answer)
                messages += [
                    {"role": "assistant", "content": answer["content"]},
                    {"role": "user", "content": f"more {turn}"},
                ]
        calls = finish(store, rid, aid)
    assert counts(proxy) == {"first_call": 1, "generated": 2}
    assert_chained(calls)
    asked = generated(mock)
    assert len(asked) == 2
    for call, body, answer in zip(calls[1:], asked, answers[1:], strict=True):
        # the engine was asked for the recorded prompt exactly, and generated the recorded ids
        assert body["token_ids"] == call.prompt_token_ids
        assert call.response_token_ids == completion_token_ids(body["token_ids"], 0, 4)
        assert answer["content"] == text_of(call.response_token_ids) and answer["finish_reason"] == "length"
        assert call.logprobs == [token_logprob(t) for t in call.response_token_ids]
        assert call.status == "ok" and call.finish_reason == "length" and call.limit == "max_tokens"
    # the tail after the earlier ids: the end of turn the length stop left out, then the user turn rendered
    first, second = calls[0], calls[1]
    assert first.prompt_token_ids is not None and first.response_token_ids is not None
    tail = second.prompt_token_ids[len(first.prompt_token_ids) + len(first.response_token_ids) :]  # type: ignore[index]
    assert bytes(tail) == b"\n<|user|>more 0\n<|assistant|>"
    # only the tail is rendered: the renders never carry the history
    renders = [r.json for r in mock.requests if r.path == RENDER]
    assert all(m["content"] != "hello" for body in renders for m in body["messages"])


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
            MockVLLM() as mock,
            AgentDaemon(backends=[mock.url], model="mock", batch=batch_config, token_in=token_in) as daemon,
        ):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: run_agents(daemon.server_url, agent, concurrency=4))
                await daemon.submit([{"q": 1}, {"q": 2}], n=2)
                with anyio.fail_after(30):
                    batch = await daemon.batches.receive()
                tg.cancel_scope.cancel()
            counters = daemon.proxy_counters()
        data, metrics = batch.data, batch.metrics
        rows[token_in] = len(data)
        assert metrics["batch/n_calls"] == 12
        if not token_in:
            assert metrics["batch/n_calls_drifted"] == 8 and len(data) == 12  # every later turn drifted
            assert "proxy/token_in_generated" not in counters
            continue
        assert counters["proxy/token_in_generated"] == 8 and counters["proxy/token_in_first_call"] == 4
        assert metrics["batch/n_calls_drifted"] == 0 and len(data) == 4
        answered = {
            tuple(b["token_ids"]): completion_token_ids(b["token_ids"], 0, 4) for b in generated(mock)
        }
        answered |= {tuple(p): r for r_ in mock.generation_requests() for p, r in mock.expected(r_.json)}
        responses, mask = data.batch["responses"], data.batch["response_mask"].bool()
        attention = data.batch["attention_mask"][:, 256:].bool()
        for i in range(len(data)):
            real = responses[i][attention[i]].tolist()
            kept = mask[i][attention[i]].tolist()
            prompt = data.batch["prompts"][i][data.batch["attention_mask"][i, :256].bool()].tolist()
            # the unmasked ids are the three answers as generated, each the answer to everything before it
            so_far, generated_ids, between = list(prompt), [], []
            k = 0
            while k < len(real):
                run_end = k
                while run_end < len(real) and kept[run_end] == kept[k]:
                    run_end += 1
                piece = real[k:run_end]
                if kept[k]:
                    assert answered[tuple(so_far)] == piece
                    generated_ids += piece
                else:
                    between.append(bytes(piece))
                so_far += piece
                k = run_end
            assert len(generated_ids) == 12
            assert between == [
                b"\n<|user|>tool result 0\n<|assistant|>",
                b"\n<|user|>tool result 1\n<|assistant|>",
            ]
    assert rows == {True: 4, False: 12}


async def test_tool_calls_the_backend_parsed_are_echoed_with_a_tool_result_and_continue_from_ids() -> None:
    async with MockVLLM(completion_tokens=3) as mock, proxied(mock.url) as (proxy, store):
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
    assert call2["function"]["name"] == "lookup"
    assert orjson.loads(call2["function"]["arguments"]) == orjson.loads(
        "".join(tool_arguments(calls[1].response_token_ids or []))
    )
    assert third["content"] == text_of(calls[2].response_token_ids or [])
    tail = calls[1].prompt_token_ids[len(calls[0].prompt_token_ids or []) + 3 :]  # type: ignore[index]
    assert bytes(tail) == b"\n<|tool|>x is 42\n<|assistant|>"
    # the backend's parser saw the agent's tools and tool_choice, never the history
    derenders = [r.json for r in mock.requests if r.path == DERENDER]
    derenders = [d for d in derenders if d.get("generate_response", {}).get("request_id") != "aglverl-probe"]
    assert all(
        d["chat_request"]["tools"] == [LOOKUP] and d["chat_request"]["messages"][0]["role"] == "tool"
        for d in derenders
    )


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_responses_and_messages_agents_are_generated_from_ids(api: str, stream: bool) -> None:
    async with MockVLLM(template="think") as mock, proxied(mock.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        texts = await api_conversation(api, base, stream, model="mock", max_tokens=4)
        calls = finish(store, rid, aid)
    assert counts(proxy) == {"first_call": 1, "generated": 2}
    assert_chained(calls)
    assert [t.strip() for t in texts] == [text_of(c.response_token_ids or []).strip() for c in calls]
    assert all(c.path == f"/v1/{api}" and c.status == "ok" for c in calls)


# ---------------------------------------------------------------------------------------------- what does not match
async def test_an_edited_history_another_system_prompt_or_other_tools_start_a_new_chain() -> None:
    async with MockVLLM() as mock, proxied(mock.url) as (proxy, store):
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
            await chat(client, [system, user, said, follow], False, tools=[LOOKUP])
            await chat(client, [system, user, said, follow], False, n=2)
            await chat(client, [system, user, said, follow], False)  # the one that extends
        calls = finish(store, rid, aid)
    assert counts(proxy) == {"first_call": 1, "no_match": 2, "context_changed": 1, "n": 1, "generated": 1}
    assert len(generated(mock)) == 1
    assert_chained([calls[0], calls[-1]])


@pytest.mark.parametrize("scale_out", [False, None], ids=["disabled", "absent"])
async def test_a_backend_without_token_in_is_warned_about_once_and_relayed_as_text(
    scale_out: bool | None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aglverl.proxy.tokenin")
    async with MockVLLM(scale_out=scale_out) as mock, proxied(mock.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        messages: list[Any] = [{"role": "user", "content": "q"}]
        async with openai_sdk(base) as client:
            for _ in range(3):
                answer = await chat(client, messages, False)
                messages += [
                    {"role": "assistant", "content": answer["content"]},
                    {"role": "user", "content": "and?"},
                ]
        calls = finish(store, rid, aid)
    assert counts(proxy) == {"first_call": 1, "no_backend": 2}
    [warning] = [r for r in caplog.records if "has no token-in chat" in r.message]
    assert "--enable-scale-out" in warning.message and mock.url in warning.message
    # detected at the first call that could go token-in (the anchor's two renders), never asked again
    assert len([r for r in mock.requests if r.path == RENDER]) == (2 if scale_out is False else 0)
    assert len(mock.generation_requests()) == 3 and all(c.status == "ok" for c in calls)


async def test_token_in_off_relays_every_call_as_text() -> None:
    async with MockVLLM() as mock, proxied(mock.url, token_in=False) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        messages: list[Any] = [{"role": "user", "content": "q"}]
        async with openai_sdk(base) as client:
            for _ in range(2):
                answer = await chat(client, messages, False)
                messages += [
                    {"role": "assistant", "content": answer["content"]},
                    {"role": "user", "content": "and?"},
                ]
        finish(store, rid, aid)
    assert proxy.token_in is None and len(mock.generation_requests()) == 2
    assert not [r for r in mock.requests if r.path in (RENDER, GENERATE, DERENDER)]


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


async def test_a_call_without_a_limit_gets_the_rest_of_the_context_window() -> None:
    async with MockVLLM(max_model_len=300, completion_tokens=4) as mock, proxied(mock.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        messages: list[Any] = [{"role": "user", "content": "q"}]
        async with openai_sdk(base) as client:
            answer = await chat(client, messages, False, max_tokens=None)
            messages += [
                {"role": "assistant", "content": answer["content"]},
                {"role": "user", "content": "and?"},
            ]
            await chat(client, messages, False, max_tokens=None)
        _, second = finish(store, rid, aid)
    [body] = generated(mock)
    assert body["sampling_params"]["max_tokens"] == 300 - len(second.prompt_token_ids or [])
    assert second.finish_reason == "stop" and second.limit is None


# ---------------------------------------------------------------------------------------------- aborts
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_generation_aborted_for_a_weight_update_during_a_hold_goes_on_from_the_ids_so_far(
    stream: bool,
) -> None:
    async with (
        MockVLLM(completion_tokens=6) as mock,
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
                    await mock.wait_until(lambda m: len(generated(m)) > 1)
                assert len(generated(mock)) == 1
                proxy.resume(1)
        calls = finish(store, rid, aid)
    first_part, rest = generated(mock)
    assert rest["token_ids"][: len(first_part["token_ids"])] == first_part["token_ids"]
    assert rest["sampling_params"]["max_tokens"] == 4  # what was left of the call's limit
    cut = completion_token_ids(first_part["token_ids"], 0, 6)[:2]
    assert rest["token_ids"] == first_part["token_ids"] + cut
    ids = cut + completion_token_ids(rest["token_ids"], 0, 4)
    second = calls[1]
    assert second.prompt_token_ids == first_part["token_ids"] and second.response_token_ids == ids
    assert results[0]["content"] == text_of(ids) and results[0]["finish_reason"] == "length"
    assert second.logprobs == [token_logprob(t) for t in ids]
    assert (second.weight_version, second.weight_version_end) == (0, 1)
    assert proxy.m_resumed.value() == 1 and proxy.m_continuations.value() == 1
    assert counts(proxy) == {"first_call": 1, "generated": 1}


async def test_an_aborted_call_under_structured_output_is_made_again_and_its_tool_call_parsed_whole() -> None:
    async with MockVLLM(completion_tokens=3) as mock, proxied(mock.url) as (proxy, store):
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
    aborted, again = generated(mock)
    assert again["token_ids"] == aborted["token_ids"]  # from the start: a grammar cannot be continued
    ids = completion_token_ids(again["token_ids"], 0, 3)
    assert calls[1].response_token_ids == ids and proxy.m_regenerated.value() == 1
    [call] = result["tool_calls"]
    assert orjson.loads(call["function"]["arguments"]) == orjson.loads("".join(tool_arguments(ids)))
