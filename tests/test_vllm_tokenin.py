"""Token-in chat against a real vLLM (the vLLM tier: ``make test-vllm``): a later turn is ONE chat completion.

The tiny model, copied with a chat template that re-renders history the way real ones do (``trim``: Llama 3's
``| trim`` of every message; ``think``: Qwen3's dropped earlier reasoning and pre-opened think block;
``mistral``: Mistral-7B-Instruct-v0.3's system prompt and tool list on the last user turn, not append-only),
served by ``vllm serve --enable-auto-tool-choice --tool-call-parser hermes`` (and ``--enable-scale-out``, for
the render route a proxy without the model's tokenizer uses): one server per template, shared by the module's
tests. A recording hop between the proxy and vLLM keeps what vLLM was asked. Agents are ordinary SDK code that
echo the text they got. Checked: every later turn reaches vLLM as one chat completion carrying exactly the
earlier turn's prompt + generated ids followed by the new tail in ``kv_transfer_params["prompt_token_ids"]``,
and is generated from that and nothing else (greedy, vLLM's own completion of that prompt gives the same ids and
text); the answer is vLLM's own chat answer (its hermes parser's tool calls); a batch holds one row per
conversation; an edited history starts a new row; without the model's tokenizer the tail is rendered by vLLM
first; a not append-only template is generated from its whole rendering; a relayed answer aborted by a weight
update keeps its turn; a weight update in the middle of a token-in stream gives the agent one uninterrupted
answer, the same as vLLM's without the abort.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import orjson
import pytest
from helpers.hop import Hop, recording_hop
from helpers.tokenin import GREEDY, api_conversation, completion, counts, extends, long_second_turn
from helpers.tokenin import greedy_turn as chat_turn
from helpers.vllm_server import VllmOutput, vllm_server
from test_proxy_resume import Stream
from test_stored_responses import create
from test_translate import claim, finish, openai_sdk, proxied
from test_vllm_proxy import aborted_mid_answer
from transformers import AutoTokenizer

from aglverl import LLM, AgentDaemon, BatchConfig, run_agents
from aglverl.testing.chat_templates import TEMPLATES, with_chat_template

pytestmark = [pytest.mark.vllm, pytest.mark.anyio]

CHAT = "/v1/chat/completions"
RENDER = "/v1/chat/completions/render"
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string", "enum": ["x", "y"]}},
            "required": ["key"],
            "additionalProperties": False,
        },
    },
}


class Served:
    """The module's vLLM server (its template's name, the model directory, its output) behind a recording hop."""

    def __init__(self, url: str, template: str, model: Path, output: VllmOutput, hop: Hop) -> None:
        self.vllm = url
        self.template = template
        self.output = output
        self.tokenizer = AutoTokenizer.from_pretrained(str(model))
        self.hop = hop
        self.url = hop.url


@pytest.fixture(scope="module", params=["trim", "think"])
def vllm(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str, Path, VllmOutput]]:
    """A vLLM server for each template (its URL, the template's name, the model directory, its output)."""
    template = request.param
    root = tmp_path_factory.mktemp(template)
    model = with_chat_template(tiny_model, root / "model", TEMPLATES[template])
    args = ("--enable-scale-out", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    output = VllmOutput()
    with vllm_server(model, root / "vllm.log", *args, "--enable-log-requests", output=output) as url:
        yield url, template, model, output


@pytest.fixture
async def served(vllm: tuple[str, str, Path, VllmOutput]) -> AsyncIterator[Served]:
    """The server behind a loopback hop that records every request body (and streams answers through)."""
    async with recording_hop(vllm[0]) as hop:
        yield Served(*vllm, hop)


def one_request_each(served: Served, calls: list[Any]) -> None:
    """Each call reached vLLM as one chat completion; the later ones with exactly their recorded prompt."""
    assert served.hop.paths() == [CHAT] * len(calls)
    assert [b["kv_transfer_params"]["prompt_token_ids"] for b in served.hop.with_ids()] == [
        c.prompt_token_ids for c in calls[1:]
    ]


# ---------------------------------------------------------------------------------------------- chat agents
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_chat_agent_is_one_request_per_call_from_the_exact_ids_vllm_made(
    served: Served, stream: bool
) -> None:
    answers = []
    async with proxied(served.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        messages: list[Any] = [
            {"role": "system", "content": "Be brief. "},
            {"role": "user", "content": "hello "},
        ]
        async with openai_sdk(base) as client:
            for turn in range(3):
                answer = await chat_turn(client, messages, stream)
                answers.append(answer)
                messages += [
                    {"role": "assistant", "content": answer["content"]},
                    {"role": "user", "content": f" more {turn} "},
                ]
        calls = finish(store, rid, aid)
    assert counts(proxy) == {"first_call": 1, "generated": 2}
    one_request_each(served, calls)
    for earlier, later, answer in zip(calls, calls[1:], answers[1:], strict=False):
        assert extends(earlier, later)
        # generated from that prompt and nothing else: vLLM's own completion of it says the same
        reference = await completion(served.vllm, later.prompt_token_ids or [], 8)
        assert later.response_token_ids == reference["token_ids"]
        assert answer["content"] == reference["text"] and answer["finish_reason"] == "length"
        tail = served.tokenizer.decode(
            (later.prompt_token_ids or [])[len(earlier.prompt_token_ids or []) + 8 :]
        )
        assert tail.startswith("<|im_end|>\n") and "more" in tail  # the end of turn a length stop left out
    if served.template == "think":
        # relayed as text, the same conversation drifts: the template drops the think block it opened
        async with proxied(served.url, token_in=False) as (proxy, store):
            rid, aid, base = claim(proxy, store)
            async with openai_sdk(base) as client:
                replay: list[Any] = messages[:2]
                for turn in range(2):
                    answer = await chat_turn(client, replay, stream)
                    replay += [
                        {"role": "assistant", "content": answer["content"]},
                        {"role": "user", "content": f" more {turn} "},
                    ]
            first, second = finish(store, rid, aid)
        assert not extends(first, second)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_responses_and_messages_agents_are_one_request_per_call_too(
    served: Served, api: str, stream: bool
) -> None:
    async with proxied(served.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        await api_conversation(api, base, stream, model="tiny", max_tokens=6, extra=GREEDY)
        calls = finish(store, rid, aid)
    assert counts(proxy) == {"first_call": 1, "generated": 2}
    one_request_each(served, calls)
    assert all(extends(a, b) for a, b in itertools.pairwise(calls))
    assert all(c.path == f"/v1/{api}" and c.status == "ok" for c in calls)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_responses_agent_continuing_with_previous_response_id_is_one_request_per_call(
    served: Served, stream: bool
) -> None:
    """OpenAI's way: only the new input goes with ``previous_response_id``; the proxy puts the stored
    conversation first, and vLLM generates each later call from the earlier turn's exact ids + the new tail."""
    async with proxied(served.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        kwargs: dict[str, Any] = dict(
            model="tiny", instructions="Be brief.", max_output_tokens=6, extra_body=GREEDY
        )
        async with openai_sdk(base) as client:
            made = [await create(client, stream, input="hello ", **kwargs)]
            for text in (" more ", " again "):
                made.append(
                    await create(client, stream, input=text, previous_response_id=made[-1].id, **kwargs)
                )
            items = await client.responses.input_items.list(made[-1].id, order="asc")
        calls = finish(store, rid, aid)
    assert counts(proxy) == {"first_call": 1, "generated": 2}
    one_request_each(served, calls)
    assert [len(b["messages"]) for b in served.hop.asked()] == [2, 4, 6]  # the whole conversation each time
    for earlier, later, response in zip(calls, calls[1:], made[1:], strict=False):
        assert extends(earlier, later) and response.previous_response_id is not None
        reference = await completion(served.vllm, later.prompt_token_ids or [], 6)
        assert (
            later.response_token_ids == reference["token_ids"] and response.output_text == reference["text"]
        )
    assert [i.type for i in items.data] == ["message"] * 5 and not items.has_more


async def test_tool_calls_vllm_parsed_are_echoed_with_a_tool_result_and_carry_on(served: Served) -> None:
    async with proxied(served.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        messages: list[Any] = [{"role": "user", "content": "Look x up."}]
        named = {"type": "function", "function": {"name": "lookup"}}
        async with openai_sdk(base) as client:
            first = await chat_turn(client, messages, False, tools=[LOOKUP])  # text: the first call relays
            messages += [
                {"role": "assistant", "content": first["content"]},
                {"role": "user", "content": "Use the tool."},
            ]
            # vLLM constrains the call to the tool's grammar; a random model may not close it within the
            # limit, so the agent samples (seeded) until vLLM parses a whole call, as an agent retries
            for seed in range(16):
                extra = {"temperature": 1.0, "seed": seed}
                called = await chat_turn(
                    client,
                    messages,
                    seed % 2 == 1,
                    tools=[LOOKUP],
                    tool_choice=named,
                    max_tokens=96,
                    extra_body=extra,
                )
                if called["tool_calls"]:
                    break
            [call] = called["tool_calls"]
            assert call["function"]["name"] == "lookup" and call["id"].startswith("chatcmpl-tool-")
            assert orjson.loads(call["function"]["arguments"])["key"] in ("x", "y")
            messages += [
                {"role": "assistant", "content": called["content"], "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": "x is 42"},
            ]
            last = await chat_turn(client, messages, True, tools=[LOOKUP])
        calls = finish(store, rid, aid)
    tool_call_turn, final = calls[-2], calls[-1]
    assert extends(tool_call_turn, final) and final.status == "ok" and last["finish_reason"]
    tail = served.tokenizer.decode(
        (final.prompt_token_ids or [])[len(tool_call_turn.prompt_token_ids or []) :]
    )
    assert (
        "<tool_response>\nx is 42\n</tool_response>" in tail
    )  # the tool result, rendered after the call's ids
    assert counts(proxy)["generated"] == len(calls) - 1 and counts(proxy)["first_call"] == 1
    one_request_each(served, calls)
    # vLLM's hermes parser read the call off the request sent with the ids: the agent's tools and tool_choice
    assert all(body["tools"] == [LOOKUP] for body in served.hop.with_ids())


async def test_each_conversation_is_one_row_and_an_edited_history_starts_a_new_one(served: Served) -> None:
    async def agent(task: dict[str, Any], llm: LLM) -> float:
        messages: list[Any] = [{"role": "user", "content": f"question {task['q']}"}]
        async with openai_sdk(llm.endpoint) as client:
            for turn in range(3):
                answer = await chat_turn(client, messages, turn % 2 == 1, max_tokens=6)
                said = answer["content"] if not (task["edit"] and turn == 1) else "an edited answer"
                messages += [
                    {"role": "assistant", "content": said},
                    {"role": "user", "content": f"tool result {turn}"},
                ]
        return 1.0

    config = BatchConfig(max_prompt_length=256, max_response_length=256)
    async with AgentDaemon(backends=[served.url], model="tiny", batch=config) as daemon:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run_agents(daemon.server_url, agent, concurrency=2))
            await daemon.submit([{"q": 1, "edit": False}, {"q": 2, "edit": True}], n=1)
            with anyio.fail_after(120):
                batch = await daemon.batches.receive()
            tg.cancel_scope.cancel()
    data, metrics = batch.data, batch.metrics
    assert metrics["batch/n_calls"] == 6 and metrics["batch/n_calls_merged"] == 3 and len(data) == 3
    prompt_mask = data.batch["attention_mask"][:, :256].bool()
    rows: dict[str, list[int]] = {}
    for i in range(len(data)):
        question = served.tokenizer.decode(data.batch["prompts"][i][prompt_mask[i]].tolist())
        rows.setdefault("edited" if "question 2" in question else "whole", []).append(i)
    assert len(rows["whole"]) == 1 and len(rows["edited"]) == 2  # the edited history starts a new row
    (row,) = rows["whole"]
    prompt = data.batch["prompts"][row][prompt_mask[row]].tolist()
    real = data.batch["attention_mask"][row, 256:].bool()
    ids = data.batch["responses"][row][real].tolist()
    kept = data.batch["response_mask"][row][real].tolist()
    # unmasked: what vLLM generates from everything before it (greedy, so its own completion says the same);
    # masked: the rendered user turns between the answers
    runs = [
        (bool(k), [t for _, t in group])
        for k, group in itertools.groupby(zip(kept, ids, strict=True), key=lambda kt: kt[0])
    ]
    assert [k for k, _ in runs] == [True, False, True, False, True]
    so_far = list(prompt)
    for generated, run in runs:
        if generated:
            assert (await completion(served.vllm, so_far, len(run)))["token_ids"] == run
        else:
            assert "tool result" in served.tokenizer.decode(run)
        so_far += run


async def weight_update_mid_stream(served: Served, long: int) -> tuple[Any, list[Any], list[Any]] | None:
    """A conversation's streamed second call (``long`` tokens) through a fresh proxy, with a weight update once
    vLLM has generated 20 of its tokens: returns the proxy, the events the agent got and the calls the store
    recorded; None when vLLM had generated the whole answer before the update's abort reached it (a busy machine
    reads the 20th token late, or gets it in one event with the last), the state the test needs never reached."""
    async with proxied(served.url) as (proxy, store), aiohttp.ClientSession() as http:
        rid, aid, base = claim(proxy, store)
        body = await long_second_turn(base, long)
        served.hop.forget()
        async with http.post(f"{base}/chat/completions", json=body) as response:
            stream = Stream(response)
            with anyio.fail_after(60):
                await stream.until_first_token()
                await served.hop.midway.wait()  # vLLM has generated 20 of them and goes on (or has ended)
            if not served.hop.finishes:
                proxy.hold()  # what verl's trainer does around a weight update
                for action in ("pause?mode=abort", "resume"):
                    async with http.post(f"{served.vllm}/{action}") as r:
                        assert r.status == 200
                proxy.resume(1)
            events = await stream.rest()
        calls = finish(store, rid, aid)
    if served.hop.finishes[:1] != ["abort"]:  # the call's chat stream ended whole
        return None
    return proxy, events, calls


async def test_a_weight_update_in_the_middle_of_a_token_in_stream_continues_from_the_ids_so_far(
    served: Served,
) -> None:
    long = 400  # a generation still going long after the abort is asked for
    for _ in range(3):
        if made := await weight_update_mid_stream(served, long):
            break
    else:
        pytest.fail("vLLM generated the whole answer before the update's abort reached it, 3 times: too busy")
    proxy, events, calls = made
    second = calls[1]
    assert proxy.m_resumed.value() == 1 and counts(proxy) == {"first_call": 1, "generated": 1}
    [asked] = served.hop.with_ids()  # the call, sent with its prompt ids; then continued from the ids so far
    assert asked["kv_transfer_params"]["prompt_token_ids"] == second.prompt_token_ids
    [continuation, *_] = served.hop.asked("/v1/completions")
    assert continuation["prompt"][: len(second.prompt_token_ids or [])] == second.prompt_token_ids
    chunks = [e for e in events if e != "[DONE]"]
    assert events[-1] == "[DONE]" and len({c["id"] for c in chunks}) == 1
    assert [
        c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]
    ] == ["length"]
    reference = await completion(
        served.vllm, second.prompt_token_ids or [], long, ignore_eos=True, logprobs=0
    )
    assert second.response_token_ids == reference["token_ids"] and len(reference["token_ids"]) == long
    assert (
        "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        == reference["text"]
    )
    assert second.logprobs == pytest.approx(reference["logprobs"]["token_logprobs"], abs=1e-4)
    assert (second.weight_version, second.weight_version_end) == (0, 1) and extends(calls[0], second)


# The trimming template only: the think template re-renders the first turn without the think block it opened,
# so no chat prompt equals the token-in prompt.
@pytest.mark.parametrize("vllm", ["trim"], indirect=True)
@pytest.mark.parametrize("tools", [False, True], ids=["plain", "parser"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_token_in_answer_is_what_vllms_chat_endpoint_answers_for_the_same_ids(
    served: Served, stream: bool, tools: bool
) -> None:
    # The first answer is an end of turn at once, so the history re-renders as generated and vLLM's chat endpoint
    # is asked for the very prompt the token-in call is generated from.
    # The second answer ends on its end of sequence (min_tokens, then a bias towards it): with a parser configured
    # (tools), the text of that token is not the answer's (the old derender path wrote it).
    extra = {"tools": [LOOKUP]} if tools else {}
    ending = {"temperature": 0.0, "logit_bias": {"2": 100}}
    asked = {"max_tokens": 10, "min_tokens": 3, "logit_bias": {"2": 30}, "logprobs": True, "temperature": 0.0}
    async with proxied(served.url) as (proxy, store), aiohttp.ClientSession() as http:
        rid, aid, base = claim(proxy, store)
        messages: list[Any] = [{"role": "user", "content": "hello"}]
        async with openai_sdk(base) as client:
            first = await chat_turn(client, messages, False, max_tokens=4, extra_body=ending, **extra)
        assert first["content"] == "" and first["finish_reason"] == "stop"
        messages += [{"role": "assistant", "content": ""}, {"role": "user", "content": "again"}]
        body = {"model": "tiny", "messages": messages, "stream": stream, **asked, **extra}
        async with http.post(f"{base}/chat/completions", json=body) as r:
            raw = await r.read()
        direct = {**body, "stream": False, "return_token_ids": True}
        async with http.post(f"{served.vllm}/v1/chat/completions", json=direct) as r:
            reference = await r.json()
        calls = finish(store, rid, aid)
    assert counts(proxy) == {"first_call": 1, "generated": 1}
    second, expected = calls[1], reference["choices"][0]
    assert second.prompt_token_ids == reference["prompt_token_ids"]  # the same prompt, so the same answer
    assert second.response_token_ids == expected["token_ids"] and expected["token_ids"][-1] == 2
    assert second.finish_reason == expected["finish_reason"] == "stop"
    if not stream:
        answer = orjson.loads(raw)["choices"][0]
        assert answer["message"]["content"] == expected["message"]["content"]  # no "<|im_end|>" written
        assert answer["message"].get("tool_calls") in ([], None) and answer["finish_reason"] == "stop"
        got = [e["logprob"] for e in answer["logprobs"]["content"]]
        assert got == pytest.approx([e["logprob"] for e in expected["logprobs"]["content"]], abs=1e-4)
        return
    events = [orjson.loads(e[6:]) for e in raw.decode().split("\n\n") if e.startswith("data: {")]
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == expected["message"]["content"]
    assert all(None not in d.values() for d in deltas)  # as the chat endpoint writes deltas: no null fields
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["stop"]


async def test_without_the_models_tokenizer_a_later_call_first_asks_vllm_to_render_its_tail(
    served: Served,
) -> None:
    served.hop.root = "/nowhere/on/this/machine/tiny"  # the model is where the proxy cannot read it
    async with proxied(served.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        messages: list[Any] = [{"role": "user", "content": "hello "}]
        async with openai_sdk(base) as client:
            for turn in range(4):
                answer = await chat_turn(client, messages, turn % 2 == 1)
                messages += [{"role": "assistant", "content": answer["content"]}, {"role": "user", "content": f" more {turn} "}]  # fmt: skip
        calls = finish(store, rid, aid)
    assert counts(proxy) == {"first_call": 1, "generated": 3}
    assert all(extends(a, b) for a, b in itertools.pairwise(calls))
    paths = served.hop.paths()
    assert paths[0] == CHAT and paths[-4:] == [
        RENDER,
        CHAT,
        RENDER,
        CHAT,
    ]  # after the template's first reading
    for later in calls[1:]:
        reference = await completion(served.vllm, later.prompt_token_ids or [], 8)
        assert later.response_token_ids == reference["token_ids"]


@pytest.mark.parametrize("vllm", ["mistral"], indirect=True)
async def test_a_template_that_is_not_append_only_is_generated_from_vllms_rendering_of_the_whole(
    served: Served,
) -> None:
    """Defect 1 of issue 33 on a real vLLM: with a system prompt, Mistral v0.3's template renders it (and the
    tool list) on the last user turn; the calls are made from vLLM's rendering of the whole conversation."""
    async with proxied(served.url) as (proxy, store):
        for system in (True, False):
            rid, aid, base = claim(proxy, store)
            messages: list[Any] = [{"role": "user", "content": "hello"}]
            if system:
                messages.insert(0, {"role": "system", "content": "Be brief."})
            async with openai_sdk(base) as client:
                for turn in range(3):
                    extra = {"tools": [LOOKUP]} if system else {}
                    answer = await chat_turn(client, messages, turn == 1, **extra)
                    messages += [{"role": "assistant", "content": answer["content"]}, {"role": "user", "content": f"more {turn}"}]  # fmt: skip
            calls = finish(store, rid, aid)
            if system:
                for call in calls:  # the system prompt and the tools once, on the last user turn
                    text = served.tokenizer.decode(call.prompt_token_ids or [])
                    assert text.count("Be brief.") == 1 and text.count("You may call tools") == 1
                    assert text.rindex("Be brief.") > text.rindex("<|im_start|>user")
                assert not served.hop.with_ids()
            else:
                assert all(extends(a, b) for a, b in itertools.pairwise(calls))
                assert len(served.hop.with_ids()) == 2
    assert counts(proxy) == {"first_call": 2, "not_append_only": 2, "generated": 2}


async def test_a_relayed_answer_aborted_by_a_weight_update_keeps_its_turn(served: Served) -> None:
    """Defect 2 of issue 33 on a real vLLM: a conversation's first (relayed, whole) answer aborted by a weight
    update and resumed keeps its turn, so the next call is made from its ids."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me everything."}]}
    body |= {"max_tokens": 120, "ignore_eos": True, "temperature": 0.0}
    for _ in range(3):
        async with proxied(served.url) as (proxy, store), aiohttp.ClientSession() as http:
            rid, aid, base = claim(proxy, store)
            url = f"{base}/chat/completions"
            answer, in_time = await aborted_mid_answer(http, served.vllm, served.output, proxy, url, body)
            said = {"role": "assistant", "content": answer["choices"][0]["message"]["content"]}
            messages = [*body["messages"], said, {"role": "user", "content": "More."}]
            async with openai_sdk(base) as client:
                await chat_turn(client, messages, False)
            calls = finish(store, rid, aid)
        if in_time:
            break
    else:
        pytest.fail("vLLM generated the whole answer before the update's abort reached it, 3 times: too busy")
    assert proxy.m_resumed.value() == 1 and counts(proxy) == {"first_call": 1, "generated": 1}
    assert extends(calls[0], calls[1]) and len(calls[0].response_token_ids or []) == 120
