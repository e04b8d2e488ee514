"""Token-in chat against the embedded engine (``aglverl.engine``): a later turn is one chat completion with its
prompt ids, as vLLM serves it.

The built-in tiny model with its own template (ChatML, a Hermes tool section), and copies whose template trims
every message (Llama 3's way), drops earlier reasoning behind a pre-opened think block (Qwen3's way; the
engine's ``qwen3`` reasoning parser reads it) or puts the system prompt on the last user turn (Mistral's way,
not append-only). A recording hop between the proxy and the engine keeps what the engine was asked. Agents are
SDK code that echo the text they got. Checked: every later turn reaches the engine as ONE chat completion
carrying exactly the earlier turn's prompt + generated ids followed by the new tail in
``kv_transfer_params["prompt_token_ids"]`` and is generated from that and nothing else (greedy: the engine's
own completion of the recorded prompt gives the recorded ids); the proxy rendered the tail with the model's own
tokenizer (no render request); tool calls the engine's parser made go back with tool results and carry on; one
row per conversation; a not append-only template is generated from its whole rendering; a weight update in the
middle of a token-in stream, or of a whole answer, goes on from the ids so far under the new weights.

The engine's side of the one-request path (``kv_transfer_params.prompt_token_ids`` on its chat endpoint) comes
with the engine's own change; until it is in, an engine that ignores the field renders the messages itself and
the proxy counts those calls ``ids_ignored``.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import orjson
import pytest
from helpers.hop import Hop, recording_hop
from helpers.tokenin import GREEDY, a_step, api_conversation, completion, counts, extends, long_second_turn
from helpers.tokenin import greedy_turn as chat_turn
from test_proxy_resume import Stream, reload
from test_translate import claim, finish, openai_sdk, proxied

from aglverl import LLM, AgentDaemon, BatchConfig, InferenceServer
from aglverl.testing.chat_templates import TEMPLATES, with_chat_template

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string", "enum": ["x", "y"]}},
            "required": ["key"],
        },
    },
}


@asynccontextmanager
async def engine(
    tiny_model: Path, tmp_path: Path, template: str, **kwargs: Any
) -> AsyncIterator[tuple[InferenceServer, Hop]]:
    """The embedded engine on the tiny model, with ``template`` (``plain``: its own), behind a recording hop."""
    model = (
        tiny_model
        if template == "plain"
        else with_chat_template(tiny_model, tmp_path / template, TEMPLATES[template])
    )
    async with (
        InferenceServer(model, served_model_name="tiny", seed=0, **kwargs) as server,
        recording_hop(server.url) as hop,
    ):
        yield server, hop


def one_request_each(hop: Hop, calls: list[Any]) -> None:
    """Each call reached the engine as one chat completion; the later ones with exactly their recorded prompt."""
    assert hop.paths() == [CHAT] * len(calls)
    assert [b["kv_transfer_params"]["prompt_token_ids"] for b in hop.with_ids()] == [
        c.prompt_token_ids for c in calls[1:]
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("template", ["plain", "trim", "think"])
async def test_a_text_echoing_agent_is_one_request_per_call_generated_from_the_engines_ids(
    tiny_model: Path, tmp_path: Path, template: str, stream: bool
) -> None:
    async with engine(tiny_model, tmp_path, template) as (server, hop), proxied(hop.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        messages: list[Any] = [
            {"role": "system", "content": "Be brief. "},
            {"role": "user", "content": "hello "},
        ]
        answers = []
        async with openai_sdk(base) as client:
            for turn in range(3):
                answer = await chat_turn(client, messages, stream)
                answers.append(answer)
                messages += [
                    {"role": "assistant", "content": answer["content"]},
                    {"role": "user", "content": f" more {turn} "},
                ]
        calls = finish(store, rid, aid)
        references = [
            await completion(server.url, c.prompt_token_ids or [], len(c.response_token_ids or []))
            for c in calls[1:]
        ]
    assert counts(proxy) == {"first_call": 1, "generated": 2}
    one_request_each(hop, calls)
    for earlier, later, answer, reference in zip(calls, calls[1:], answers[1:], references, strict=False):
        assert extends(earlier, later) and later.status == "ok"
        assert later.response_token_ids == reference["token_ids"]  # generated from that prompt, nothing else
        said = server.tokenizer.decode(later.response_token_ids or [], skip_special_tokens=True)
        if template == "think":  # a pre-opened think block: the engine's reasoning parser reads it
            assert (answer["reasoning"] or "") + (answer["content"] or "") in (
                said,
                said.replace("</think>", ""),
            )
        else:
            assert answer["content"] == reference["text"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_tool_calls_the_engine_parsed_go_back_with_results_and_are_generated_from_ids(
    tiny_model: Path, tmp_path: Path, stream: bool
) -> None:
    async with engine(tiny_model, tmp_path, "plain") as (server, hop), proxied(hop.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        messages: list[Any] = [{"role": "user", "content": "Look x up."}]
        async with openai_sdk(base) as client:
            for turn in range(2):  # required: the engine's constrained decoding makes a call every time
                called = await chat_turn(
                    client,
                    messages,
                    stream,
                    tools=[LOOKUP],
                    tool_choice="required",
                    max_tokens=48,
                    parallel_tool_calls=False,
                )
                [call] = called["tool_calls"]
                assert called["finish_reason"] == "tool_calls" and call["id"].startswith("chatcmpl-tool-")
                assert (
                    call["function"]["name"] == "lookup"
                    and orjson.loads(call["function"]["arguments"])["key"] in "xy"
                )
                messages += [
                    {"role": "assistant", "content": called["content"], "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call["id"], "content": f"x is {42 + turn}"},
                ]
            await chat_turn(client, messages, stream, tools=[LOOKUP])
        calls = finish(store, rid, aid)
    assert counts(proxy) == {"first_call": 1, "generated": 2}
    one_request_each(hop, calls)
    assert all(extends(a, b) for a, b in itertools.pairwise(calls))
    assert [c.finish_reason for c in calls[:2]] == ["tool_calls", "tool_calls"]  # as the agent got it
    tail = server.tokenizer.decode((calls[2].prompt_token_ids or [])[len(calls[1].prompt_token_ids or []) :])
    assert "<tool_response>\nx is 43\n</tool_response>" in tail and "x is 42" not in tail  # only the new turn


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_responses_and_messages_agents_on_the_engine_are_one_request_per_call(
    tiny_model: Path, tmp_path: Path, api: str, stream: bool
) -> None:
    async with engine(tiny_model, tmp_path, "trim") as (_, hop), proxied(hop.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        await api_conversation(api, base, stream, model="tiny", max_tokens=6, extra=GREEDY)
        calls = finish(store, rid, aid)
    assert counts(proxy) == {"first_call": 1, "generated": 2}
    one_request_each(hop, calls)
    assert all(extends(a, b) for a, b in itertools.pairwise(calls))


async def test_a_template_that_is_not_append_only_is_generated_from_its_whole_rendering(
    tiny_model: Path, tmp_path: Path
) -> None:
    async with engine(tiny_model, tmp_path, "mistral") as (server, hop), proxied(hop.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        messages: list[Any] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
        async with openai_sdk(base) as client:
            for turn in range(3):
                answer = await chat_turn(client, messages, False)
                messages += [{"role": "assistant", "content": answer["content"]}, {"role": "user", "content": f"more {turn}"}]  # fmt: skip
        calls = finish(store, rid, aid)
    assert counts(proxy) == {"first_call": 1, "not_append_only": 2}
    assert not hop.with_ids()
    for call in calls:  # the system prompt once, on the last user turn: the template's own rendering
        text = server.tokenizer.decode(call.prompt_token_ids or [])
        assert text.count("Be brief.") == 1 and text.rindex("Be brief.") > text.rindex("<|im_start|>user")


async def test_every_conversation_is_one_row_of_the_engines_ids(tiny_model: Path, tmp_path: Path) -> None:
    async def agent(task: dict[str, Any], llm: LLM) -> float:
        messages: list[Any] = [{"role": "user", "content": f"question {task['q']}"}]
        async with openai_sdk(llm.endpoint) as client:
            for turn in range(3):
                answer = await client.chat.completions.create(
                    model=llm.model, messages=messages, max_tokens=6
                )
                messages += [
                    {"role": "assistant", "content": answer.choices[0].message.content},
                    {"role": "user", "content": f"tool result {turn}"},
                ]
        return 1.0

    config = BatchConfig(max_prompt_length=256, max_response_length=256)
    async with (
        engine(tiny_model, tmp_path, "trim") as (server, hop),
        AgentDaemon(backends=[hop.url], model="tiny", batch=config) as daemon,
    ):
        batch, counters = await a_step(daemon, agent, seconds=120)
    data, metrics = batch.data, batch.metrics
    assert len(data) == 4 and metrics["batch/n_calls"] == 12 and metrics["batch/n_calls_drifted"] == 0
    assert counters["proxy/token_in_generated"] == 8 and counters["proxy/token_in_first_call"] == 4
    assert hop.paths() == [CHAT] * 12 and len(hop.with_ids()) == 8
    for row in range(len(data)):
        real = data.batch["attention_mask"][row, 256:].bool()
        kept = data.batch["response_mask"][row][real].tolist()
        ids = data.batch["responses"][row][real].tolist()
        runs = [
            (bool(k), [t for _, t in g])
            for k, g in itertools.groupby(zip(kept, ids, strict=True), key=lambda kt: kt[0])
        ]
        assert [k for k, _ in runs] == [True, False, True, False, True]
        between = [server.tokenizer.decode(run) for generated, run in runs if not generated]
        assert ["tool result 0" in between[0], "tool result 1" in between[1]] == [True, True]


# ---------------------------------------------------------------------------------------------- weight updates
async def test_a_token_in_stream_aborted_for_a_weight_update_goes_on_from_the_ids_so_far(
    tiny_model: Path, tmp_path: Path
) -> None:
    long = 300
    async with (
        engine(tiny_model, tmp_path, "plain") as (server, hop),
        proxied(hop.url) as (proxy, store),
        aiohttp.ClientSession() as http,
    ):
        rid, aid, base = claim(proxy, store)
        body = await long_second_turn(base, long)
        async with http.post(f"{base}/chat/completions", json=body) as response:
            stream = Stream(response)
            await stream.until_first_token()
            proxy.hold()
            await anyio.to_thread.run_sync(server.abort)
            server.resume()  # the engine takes requests again, but the proxy holds the continuation
            await reload(server, 1)
            proxy.resume(1)
            events = await stream.rest()
        calls = finish(store, rid, aid)
        second = calls[1]
        reference = await completion(server.url, second.prompt_token_ids or [], long, ignore_eos=True)
    chunks = [e for e in events if e != "[DONE]"]
    assert events[-1] == "[DONE]" and len({c["id"] for c in chunks}) == 1
    assert [
        c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]
    ] == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == long
    assert second.response_token_ids == reference["token_ids"] and extends(calls[0], second)
    assert second.prompt_token_ids == hop.with_ids()[0]["kv_transfer_params"]["prompt_token_ids"]
    assert (
        "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        == reference["text"]
    )
    assert (second.weight_version, second.weight_version_end) == (0, 1)  # the engine's X-Weight-Version
    assert proxy.m_resumed.value() == 1 and counts(proxy) == {"first_call": 1, "generated": 1}


async def test_a_whole_token_in_answer_aborted_for_a_weight_update_is_continued_from_the_ids_so_far(
    tiny_model: Path, tmp_path: Path
) -> None:
    # The engine starts a batch only with two sequences: the streamed probe's first token says the JSON call
    # is being generated too.
    long = 300
    async with (
        engine(tiny_model, tmp_path, "plain", max_batch_size=2, batch_wait=60) as (server, hop),
        proxied(hop.url) as (proxy, store),
        aiohttp.ClientSession() as http,
    ):
        rid, aid, base = claim(proxy, store)
        messages: list[Any] = [{"role": "user", "content": "Tell me everything."}]
        async with openai_sdk(base) as client:
            async with anyio.create_task_group() as tg:  # the first call needs a companion in its batch too
                tg.start_soon(completion, server.url, [5, 6, 7], 2)
                first = await chat_turn(client, messages, False)
        messages += [{"role": "assistant", "content": first["content"]}, {"role": "user", "content": "More."}]
        body = {"model": "tiny", "messages": messages, "max_tokens": long, "ignore_eos": True, **GREEDY}
        answers: list[Any] = []
        async with anyio.create_task_group() as tg:

            async def call_json() -> None:
                async with http.post(f"{base}/chat/completions", json=body) as r:
                    answers.append(await r.json())

            tg.start_soon(call_json)
            probe = {
                "model": "tiny",
                "prompt": [5, 6, 7],
                "max_tokens": long,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
            }
            async with http.post(f"{server.url}/v1/completions", json=probe) as p:
                await Stream(p).until_first_token()
                proxy.hold()
                await anyio.to_thread.run_sync(server.abort)
                server.resume()
                await reload(server, 1)
                proxy.resume(1)
                tg.start_soon(
                    completion, server.url, [5, 6, 7], 2
                )  # the continuation's companion in its batch
        calls = finish(store, rid, aid)
        second = calls[1]
        async with anyio.create_task_group() as tg:
            tg.start_soon(completion, server.url, [5, 6, 7], 2)
            reference = await completion(server.url, second.prompt_token_ids or [], long, ignore_eos=True)
    assert proxy.m_resumed.value() == 1 and proxy.m_regenerated.value() == 0
    assert (
        second.response_token_ids == reference["token_ids"]
        and answers[0]["choices"][0]["finish_reason"] == "length"
    )
    assert answers[0]["choices"][0]["message"]["content"] == reference["text"]
    assert (second.weight_version, second.weight_version_end) == (0, 1)
    assert counts(proxy) == {"first_call": 1, "generated": 1}
