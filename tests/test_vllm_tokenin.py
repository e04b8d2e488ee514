"""Token-in chat against a real vLLM (the vLLM tier: ``make test-vllm``).

The tiny model, copied with a chat template that re-renders history the way real ones do (``trim``: Llama 3's
``| trim`` of every message; ``think``: Qwen3's dropped earlier reasoning and pre-opened think block), served by
``vllm serve --enable-scale-out --enable-auto-tool-choice --tool-call-parser hermes``: one server per template,
shared by the module's tests. A recording hop between the proxy and vLLM keeps what vLLM was asked. Agents are
ordinary SDK code that echo the text they got. Checked: every later turn is generated from exactly the earlier
turn's prompt + generated ids followed by the new tail (the generate requests say so), and from nothing else
(greedy, vLLM's own completion of that prompt gives the same ids and text); a batch holds one row per
conversation, unmasked ids the generated ones, masked ids the rendered tool / user turns; tool calls vLLM's
parser made are echoed with a tool result and carry on; an edited history starts a new row; a weight update in
the middle of a token-in stream (hold, vLLM aborts, the proxy continues from the ids so far) gives the agent
one uninterrupted answer, the same as vLLM's without the abort.
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
from aiohttp import web
from helpers.tokenin import GREEDY, api_conversation, completion, counts, extends, long_second_turn
from helpers.tokenin import greedy_turn as chat_turn
from helpers.vllm_server import vllm_server
from test_proxy_resume import Stream
from test_translate import claim, finish, openai_sdk, proxied
from transformers import AutoTokenizer

from aglverl import LLM, AgentDaemon, BatchConfig, run_agents
from aglverl._net import bind_listener, url_of
from aglverl.testing.chat_templates import TEMPLATES, with_chat_template

pytestmark = [pytest.mark.vllm, pytest.mark.anyio]

GENERATE = "/inference/v1/generate"
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
    """The module's vLLM server (its template's name, the model directory) behind a recording hop."""

    def __init__(self, url: str, template: str, model: Path) -> None:
        self.vllm = url
        self.template = template
        self.tokenizer = AutoTokenizer.from_pretrained(str(model))
        self.url = ""  # the hop's, set when it serves
        self.seen: list[tuple[str, Any]] = []
        #: Set once a streamed generation has passed 20 tokens through the hop and not finished (vLLM is busy
        #: generating it; what the agent sees lags behind, by the derender), or has finished (a busy machine's
        #: vLLM may send many tokens in one event, the last ones with the finish): ``finishes`` tells which.
        self.midway = anyio.Event()
        #: The finish reason of each streamed generation the hop passed, in the order they ended.
        self.finishes: list[str] = []

    def forget(self) -> None:
        """Start recording afresh (a test that makes its setup again)."""
        self.seen.clear()
        self.finishes.clear()
        self.midway = anyio.Event()

    def asked(self, path: str = GENERATE) -> list[Any]:
        return [body for p, body in self.seen if p == path]


@pytest.fixture(scope="module", params=["trim", "think"])
def vllm(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str, Path]]:
    """A vLLM server for each template (its URL, the template's name, the model directory)."""
    template = request.param
    root = tmp_path_factory.mktemp(template)
    model = with_chat_template(tiny_model, root / "model", TEMPLATES[template])
    args = ("--enable-scale-out", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    with vllm_server(model, root / "vllm.log", *args) as url:
        yield url, template, model


@pytest.fixture
async def served(vllm: tuple[str, str, Path]) -> AsyncIterator[Served]:
    """The server behind a loopback hop that records every request body (and streams answers through)."""
    served = Served(*vllm)
    session = aiohttp.ClientSession()

    async def forward(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        served.seen.append((request.path, orjson.loads(raw) if raw else None))
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with session.request(
            request.method, served.vllm + request.path_qs, data=raw, headers=headers
        ) as answer:
            response = web.StreamResponse(status=answer.status, headers={"Content-Type": answer.content_type})
            await response.prepare(request)
            tokens, finished, pending = 0, False, b""
            async for piece in answer.content.iter_any():
                if request.path == GENERATE and answer.content_type == "text/event-stream":
                    *lines, pending = (pending + piece).split(b"\n")  # pieces may end inside a line
                    for line in lines:
                        if line.startswith(b"data: {"):
                            for choice in orjson.loads(line[6:]).get("choices") or ():
                                tokens += len(choice.get("token_ids") or ())
                                if choice.get("finish_reason") is not None:
                                    finished = True
                                    served.finishes.append(choice["finish_reason"])
                    if tokens > 20 or finished:
                        served.midway.set()
                await response.write(piece)
            await response.write_eof()
            return response

    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = bind_listener("127.0.0.1", 0)
    site = web.SockSite(runner, sock)
    await site.start()
    served.url = url_of(sock)
    try:
        yield served
    finally:
        await runner.cleanup()
        await session.close()


# ---------------------------------------------------------------------------------------------- chat agents
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_chat_agent_is_generated_from_the_exact_ids_vllm_made(served: Served, stream: bool) -> None:
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
    asked = served.asked()
    assert [body["token_ids"] for body in asked] == [c.prompt_token_ids for c in calls[1:]]
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
async def test_responses_and_messages_agents_are_generated_from_ids(
    served: Served, api: str, stream: bool
) -> None:
    async with proxied(served.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        await api_conversation(api, base, stream, model="tiny", max_tokens=6, extra=GREEDY)
        calls = finish(store, rid, aid)
    assert counts(proxy) == {"first_call": 1, "generated": 2}
    assert all(extends(a, b) for a, b in itertools.pairwise(calls))
    assert all(c.path == f"/v1/{api}" and c.status == "ok" for c in calls)


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
    served.forget()
    async with proxied(served.url) as (proxy, store), aiohttp.ClientSession() as http:
        rid, aid, base = claim(proxy, store)
        body = await long_second_turn(base, long)
        async with http.post(f"{base}/chat/completions", json=body) as response:
            stream = Stream(response)
            with anyio.fail_after(60):
                await stream.until_first_token()
                await served.midway.wait()  # vLLM has generated 20 of them and goes on (or has ended)
            if not served.finishes:
                proxy.hold()  # what verl's trainer does around a weight update
                for action in ("pause?mode=abort", "resume"):
                    async with http.post(f"{served.vllm}/{action}") as r:
                        assert r.status == 200
                proxy.resume(1)
            events = await stream.rest()
        calls = finish(store, rid, aid)
    if served.finishes[:1] != ["abort"]:  # the call's generation (the first streamed one) ended whole
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
    assert len(served.asked()) >= 2  # the generation and its continuation(s), from the ids so far
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
    # The second answer ends on its end of sequence (min_tokens, then a bias towards it): vLLM's derender would
    # write that token's text when a parser is configured (with tools), its chat endpoint never does.
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
