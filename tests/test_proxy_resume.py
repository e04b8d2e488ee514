"""LLMProxy.hold and the resumption of aborted generations, against the real embedded inference server.

The trainer's asynchronous modes abort the engines' generations to swap weights; agents are black boxes behind
the proxy and must never see that. Each test drives the sequence a trainer drives (``proxy.hold()``,
``server.abort()``, weights loaded as a new version, ``server.resume()``, ``proxy.resume(version)``) at
points the test observes (a stream's first token, a batch that starts only with both of its requests), never
after a sleep; one bounded look for silence checks that a held continuation does not go early.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import aiohttp.web
import anyio
import orjson
import pytest
from helpers.raw_http import read_cut_short
from openai import AsyncOpenAI

from aglverl import AgentDaemon
from aglverl.engine.server import InferenceServer
from aglverl.metrics import Registry
from aglverl.models import Rollout
from aglverl.proxy import LLMProxy, RetryPolicy
from aglverl.store import LLMCall, TaskStore
from aglverl.trajectory.rollouts import trajectory_of

pytestmark = pytest.mark.anyio

#: Tokens each generation is asked for: long enough (about a second on CPU) to be cut well before its end.
LONG = 600
FAST_RETRY = RetryPolicy(attempts=3, total_timeout=5.0, backoff_initial=0.01, backoff_max=0.05)
CHAT: Any = [{"role": "user", "content": "Tell me everything."}]


@pytest.fixture
async def server(tiny_model: Path) -> AsyncIterator[InferenceServer]:
    async with InferenceServer(tiny_model, served_model_name="tiny", seed=0) as s:
        yield s


@pytest.fixture
async def paired(tiny_model: Path) -> AsyncIterator[InferenceServer]:
    """A server whose engine starts a batch only with two sequences (it waits up to a minute for the
    second): a streamed call's first token then says that its JSON companion is running too, and their two
    continuations run together again."""
    async with InferenceServer(tiny_model, served_model_name="tiny", max_batch_size=2, batch_wait=60) as s:
        yield s


@asynccontextmanager
async def proxying(server: InferenceServer, **kwargs: Any) -> AsyncIterator[tuple[LLMProxy, TaskStore]]:
    store = TaskStore(vocab_size=server.vocab_size)
    kwargs.setdefault("retry", FAST_RETRY)
    kwargs.setdefault("backends", [server.url])
    proxy = LLMProxy(store, registry=Registry(), **kwargs)
    async with anyio.create_task_group() as tg:
        await tg.start(proxy.serve)
        yield proxy, store
        tg.cancel_scope.cancel()


def claim(proxy: LLMProxy, store: TaskStore) -> tuple[str, str, str]:
    """A claimed rollout: its id, attempt id and proxy base URL (``.../v1``)."""
    rollout_id = store.enqueue({"q": "?"})
    task = store.try_claim()
    assert task is not None and task.attempt_id is not None
    return rollout_id, task.attempt_id, proxy.llm_resource("tiny").get_base_url(rollout_id, task.attempt_id)


def finish(store: TaskStore, rollout_id: str, attempt_id: str) -> list[LLMCall]:
    store.submit_result(Rollout(rollout_id=rollout_id, attempt_id=attempt_id, final_reward=1.0))
    return store.record(rollout_id).calls


async def reload(server: InferenceServer, version: int) -> None:
    """What a trainer's weight sync does to the server: the (here unchanged) tensors, served as ``version``."""
    params = [(name, p.detach().clone()) for name, p in server.model.named_parameters()]
    await anyio.to_thread.run_sync(server.load_weights, params, version)


def body(kind: str, stream: bool, **extra: Any) -> dict[str, Any]:
    """A long seeded generation (EOS ignored) of ``kind``, with logprobs and usage."""
    out: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": LONG,
        "ignore_eos": True,
        "seed": 11,
        "stream": stream,
    }
    if kind == "chat":
        out |= {"messages": CHAT, "logprobs": True}
    else:
        out |= {"prompt": [5, 17, 42, 99, 7], "logprobs": 0}
    if stream:
        out["stream_options"] = {"include_usage": True}
    return out | extra


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


async def tool_call(http: aiohttp.ClientSession, base: str, whole: list[Any]) -> None:
    """A long JSON chat call with tools (aborted, the proxy makes it again: a completion cannot continue a
    call whose output the backend parses as a whole); its status and answer go to ``whole``."""
    request = body("chat", stream=False, seed=12, tools=TOOLS, tool_choice="auto")
    async with http.post(base + "/chat/completions", json=request) as reply:
        whole.append((reply.status, await reply.json()))


class Stream:
    """An agent's SSE answer read event by event (the JSON of each event; ``"[DONE]"`` kept as a string)."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response
        self.events: list[Any] = []

    async def next(self) -> Any:
        block = await self.response.content.readuntil(b"\n\n")
        payload = block.strip().removeprefix(b"data: ")
        event = "[DONE]" if payload == b"[DONE]" else orjson.loads(payload)
        self.events.append(event)
        return event

    @property
    def tokens(self) -> int:
        """Token ids received so far."""
        return sum(len(c.get("token_ids") or ()) for e in self.events if e != "[DONE]" for c in e["choices"])

    async def until_first_token(self) -> None:
        await self.until_more_than(0)

    async def until_more_than(self, tokens: int) -> None:
        """Read until more than ``tokens`` token ids have come."""
        while self.tokens <= tokens:
            await self.next()

    async def rest(self, cut_short: bool = False) -> list[Any]:
        """The events to the stream's end; ``cut_short``: a stream the proxy broke off (its last event an
        error), which must end without its last chunk."""
        raw = await read_cut_short(self.response) if cut_short else await self.response.content.read()
        for block in raw.split(b"\n\n"):
            if payload := block.strip().removeprefix(b"data: "):
                self.events.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
        return self.events


def assert_whole_stream(events: list[Any], kind: str, server: InferenceServer, call: LLMCall) -> None:
    """One uninterrupted answer of ``LONG`` tokens: one id, no abort, its text the decode of the recorded ids."""
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    choices = [c for e in chunks for c in e["choices"]]
    assert len({e["id"] for e in chunks}) == 1
    assert [c["finish_reason"] for c in choices if c.get("finish_reason")] == ["length"]
    ids = [t for c in choices for t in c.get("token_ids") or ()]
    if kind == "chat":
        text = "".join(c["delta"].get("content") or "" for c in choices)
        logprobs = [e["logprob"] for c in choices if c.get("logprobs") for e in c["logprobs"]["content"]]
    else:
        text = "".join(c["text"] for c in choices)
        logprobs = [v for c in choices if c.get("logprobs") for v in c["logprobs"]["token_logprobs"]]
    assert ids == call.response_token_ids and len(ids) == LONG
    assert text == server.tokenizer.decode(ids, skip_special_tokens=True)
    assert logprobs == call.logprobs
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == LONG and usage["prompt_tokens"] == len(call.prompt_token_ids or ())


def assert_resumed(call: LLMCall, start: int, end: int) -> None:
    assert call.status == "ok" and call.error is None
    assert call.finish_reason == "length" and call.limit == "max_tokens"
    assert call.response_token_ids is not None and len(call.response_token_ids) == LONG
    assert call.logprobs is not None and len(call.logprobs) == LONG
    assert (call.weight_version, call.weight_version_end) == (start, end)


# ---------------------------------------------------------------------------------------------- held, aborted
@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_streamed_and_json_calls_aborted_during_a_hold_end_as_if_uninterrupted_under_the_new_version(
    paired: InferenceServer, kind: str
) -> None:
    path = "/chat/completions" if kind == "chat" else "/completions"
    async with proxying(paired) as (proxy, store), aiohttp.ClientSession() as http:
        rid, aid, base = claim(proxy, store)
        whole: list[Any] = []

        async def json_call() -> None:
            async with http.post(base + path, json=body(kind, stream=False, seed=12)) as reply:
                whole.append((reply.status, await reply.json()))

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(json_call)
                async with http.post(base + path, json=body(kind, stream=True)) as reply:
                    stream = Stream(reply)
                    await stream.until_first_token()  # both run now: the batch started with the two of them
                    proxy.hold()
                    assert len(await anyio.to_thread.run_sync(paired.abort)) == 2
                    await reload(paired, 1)
                    paired.resume()
                    proxy.resume(1)
                    events = await stream.rest()
        calls = finish(store, rid, aid)
    status, answer = whole[0]
    choice = answer["choices"][0]
    [json_record] = [c for c in calls if c.response_token_ids == choice["token_ids"]]
    [stream_record] = [c for c in calls if c is not json_record]
    assert_whole_stream(events, kind, paired, stream_record)
    assert status == 200 and choice["finish_reason"] == "length"
    text = choice["message"]["content"] if kind == "chat" else choice["text"]
    assert text == paired.tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    logprobs = choice["logprobs"]["content"] if kind == "chat" else choice["logprobs"]["token_logprobs"]
    values = [e["logprob"] for e in logprobs] if kind == "chat" else logprobs
    assert values == json_record.logprobs and len(values) == LONG
    assert answer["usage"]["completion_tokens"] == LONG
    for call in calls:
        assert_resumed(call, start=0, end=1)
    assert proxy.m_resumed.value() == 2 and proxy.m_continuations.value() == 2  # one each: none while held
    assert paired.stats().aborted_sequences == 2


async def test_responses_api_stream_goes_on_through_an_abort_during_a_hold(server: InferenceServer) -> None:
    async with proxying(server) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        send, receive = anyio.create_memory_object_stream[Any](float("inf"))

        async def agent() -> None:  # the SDK's stream, read to its end by the agent whatever the test does
            async with AsyncOpenAI(base_url=base, api_key="-", max_retries=0) as client, send:
                stream = await client.responses.create(
                    model="tiny",
                    input="Tell me everything.",
                    max_output_tokens=LONG,
                    stream=True,
                    extra_body={"ignore_eos": True, "seed": 3},
                )
                async for event in stream:
                    send.send_nowait(event)

        events: list[Any] = []
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg, receive:
                tg.start_soon(agent)
                while (event := await receive.receive()).type != "response.output_text.delta":
                    events.append(event)
                events.append(event)
                proxy.hold()
                await anyio.to_thread.run_sync(server.abort)
                server.resume()  # the engine takes requests again (old weights), but the proxy holds
                with anyio.move_on_after(0.3):  # so nothing may come: a bounded look for silence
                    events.append(await receive.receive())
                assert events[-1].type == "response.output_text.delta"
                await reload(server, 1)
                proxy.resume(1)
                events += [event async for event in receive]
        [call] = finish(store, rid, aid)
    kinds = [e.type for e in events]
    assert "response.failed" not in kinds and "error" not in kinds
    final = events[-1]
    assert final.type == "response.incomplete"  # what a length stop is in the Responses API, as uninterrupted
    assert final.response.incomplete_details is not None
    assert final.response.incomplete_details.reason == "max_output_tokens"
    assert final.response.usage is not None and final.response.usage.output_tokens == LONG
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.response.output_text
    assert call.response_token_ids is not None
    assert text == server.tokenizer.decode(call.response_token_ids, skip_special_tokens=True)
    assert call.path == "/v1/responses" and call.status == "ok" and len(call.response_token_ids) == LONG
    assert (call.weight_version, call.weight_version_end) == (0, 1)
    assert proxy.m_continuations.value() == 1


async def test_a_continuation_aborted_again_is_continued_again_and_the_resume_latency_is_measured(
    server: InferenceServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """Three weight updates during one call; each continuation is aborted in its turn. The gap the agent sees
    between ``proxy.resume()`` and its next token is what resuming adds to a hold (printed)."""
    gaps: list[float] = []
    async with proxying(server) as (proxy, store), aiohttp.ClientSession() as http:
        rid, aid, base = claim(proxy, store)
        with anyio.fail_after(60):
            async with http.post(base + "/chat/completions", json=body("chat", stream=True)) as reply:
                stream = Stream(reply)
                await stream.until_first_token()
                for version in (1, 2, 3):
                    proxy.hold()
                    await anyio.to_thread.run_sync(server.abort)
                    generated = server.stats().generated_tokens  # the engine is idle: all of this call's
                    await reload(server, version)
                    server.resume()
                    released = time.perf_counter()
                    proxy.resume(version)
                    await stream.until_more_than(generated)  # a token of this round's continuation
                    gaps.append(time.perf_counter() - released)
                events = await stream.rest()
            [call] = finish(store, rid, aid)
            # The floor: the first token of the same token-in request sent straight to the server.
            assert call.prompt_token_ids is not None and call.response_token_ids is not None
            # The last continuation's prompt, on a warm connection: best of three.
            prompt = call.prompt_token_ids + call.response_token_ids[:generated]
            direct = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": True}
            floors = []
            for _ in range(3):
                started = time.perf_counter()
                async with http.post(server.url + "/v1/completions", json=direct) as reply:
                    await reply.content.readuntil(b"\n\n")
                    floors.append(time.perf_counter() - started)
                    await reply.read()
            floor = min(floors)
    assert_whole_stream(events, "chat", server, call)
    assert_resumed(call, start=0, end=3)
    assert proxy.m_continuations.value() == 3 and proxy.m_resumed.value() == 1
    assert proxy.m_resume_latency.count == 3
    with capsys.disabled():
        print(
            f"\nresumed call: proxy.resume() to the agent's next token {[round(g * 1e3, 1) for g in gaps]} ms; "
            f"the same token-in request sent directly, first token {floor * 1e3:.1f} ms"
        )


# ---------------------------------------------------------------------------------------------- not held
async def test_an_abort_while_not_held_is_continued_at_once_and_the_sdk_sees_one_stream(
    server: InferenceServer,
) -> None:
    async with proxying(server) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        async with AsyncOpenAI(base_url=base, api_key="-", max_retries=0) as client:
            with anyio.fail_after(60):
                stream = await client.chat.completions.create(
                    model="tiny",
                    messages=CHAT,
                    max_tokens=LONG,
                    stream=True,
                    extra_body={"ignore_eos": True, "seed": 5},
                )
                chunks = []
                async for chunk in stream:
                    chunks.append(chunk)
                    if chunk.choices and chunk.choices[0].delta.content:
                        break
                await anyio.to_thread.run_sync(server.abort)  # an engine that pauses on its own
                server.resume()
                chunks += [chunk async for chunk in stream]
        [call] = finish(store, rid, aid)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["length"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert call.response_token_ids is not None and len(call.response_token_ids) == LONG
    assert text == server.tokenizer.decode(call.response_token_ids, skip_special_tokens=True)
    assert (call.weight_version, call.weight_version_end) == (0, 0)
    assert proxy.m_resumed.value() == 1 and proxy.m_held.value() == 0
    assert server.stats().aborted_sequences == 1


# ---------------------------------------------------------------------------------------------- not resumed
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_backend_that_keeps_aborting_ends_the_call_with_a_clear_error_after_pause_timeout(
    server: InferenceServer, stream: bool
) -> None:
    async with proxying(server, pause_timeout=0.5) as (proxy, store), aiohttp.ClientSession() as http:
        rid, aid, base = claim(proxy, store)
        server.abort(reject=True)  # every request is answered at once as aborted, without a token
        started = time.monotonic()
        with anyio.fail_after(10):
            async with http.post(base + "/chat/completions", json=body("chat", stream)) as reply:
                status = reply.status
                raw = await (read_cut_short(reply) if stream else reply.read())
        elapsed = time.monotonic() - started
        [call] = finish(store, rid, aid)
    if stream:
        assert status == 200 and raw.rstrip().endswith(b"}")  # an error event ends it, not [DONE]
        error = orjson.loads(raw.rstrip().rsplit(b"data: ", 1)[1])["error"]
        assert b'"abort"' not in raw
    else:
        assert status == 503
        error = orjson.loads(raw)["error"]
    assert "refused to continue it for pause_timeout=0.5s" in error["message"]
    assert call.status == "failed" and call.error == error["message"] and call.response_token_ids is None
    assert 0.5 <= elapsed < 5
    assert proxy.m_resume_failed.value("refused") == 1 and proxy.m_continuations.value() >= 2


async def test_a_continuation_held_longer_than_pause_timeout_ends_with_a_clear_error(
    server: InferenceServer,
) -> None:
    async with proxying(server, pause_timeout=0.3) as (proxy, store), aiohttp.ClientSession() as http:
        rid, aid, base = claim(proxy, store)
        with anyio.fail_after(10):
            async with http.post(base + "/chat/completions", json=body("chat", stream=True)) as reply:
                stream = Stream(reply)
                await stream.until_first_token()
                proxy.hold()
                await anyio.to_thread.run_sync(server.abort)
                events = await stream.rest(cut_short=True)  # never resumed: given up after pause_timeout
        [call] = finish(store, rid, aid)
        proxy.resume()
    assert "over pause_timeout=0.3s while the proxy was held" in events[-1]["error"]["message"]
    assert call.status == "failed" and proxy.m_resume_failed.value("refused") == 1
    assert proxy.m_continuations.value() == 0


class RefusingFront:
    """A loopback HTTP hop in front of the real server that, once :meth:`arm`-ed, refuses the next generation
    request that ``matches``: with a 503 (``"503"``), or by having the engine abort it before its first token
    (``"abort"``: the engine rejects while it answers, then takes requests again). Everything else is forwarded
    as it is, streams chunk by chunk, with the server's ``X-Weight-Version``."""

    def __init__(self, server: InferenceServer) -> None:
        self.server = server
        self.how: str | None = None
        self.matches: Any = None
        self.refused = 0
        self.url = ""
        self._http: aiohttp.ClientSession | None = None

    def arm(self, how: str, matches: Any) -> None:
        self.how, self.matches = how, matches

    async def _forward(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        raw = await request.read()
        refuse = (
            self.how is not None
            and request.method == "POST"
            and self.matches(request.path, orjson.loads(raw))
        )
        how, self.how = (self.how, None) if refuse else (None, self.how)
        if how == "503":
            self.refused += 1
            return aiohttp.web.json_response({"error": {"message": "busy, try again"}}, status=503)
        if how == "abort":
            await anyio.to_thread.run_sync(lambda: self.server.abort(reject=True))
        assert self._http is not None
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        try:
            async with self._http.request(
                request.method, self.server.url + request.path_qs, data=raw, headers=headers
            ) as upstream:
                kept = {
                    name: upstream.headers[name]
                    for name in ("Content-Type", "X-Weight-Version")
                    if name in upstream.headers
                }
                if not kept.get("Content-Type", "").startswith("text/event-stream"):  # whole, with its length
                    return aiohttp.web.Response(
                        status=upstream.status, body=await upstream.read(), headers=kept
                    )
                response = aiohttp.web.StreamResponse(status=upstream.status, headers=kept)
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        finally:
            if how == "abort":
                self.refused += 1
                self.server.resume()

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[RefusingFront]:
        app = aiohttp.web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        runner = aiohttp.web.AppRunner(app)
        await runner.setup()
        site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        async with aiohttp.ClientSession() as self._http:
            try:
                yield self
            finally:
                await runner.cleanup()


@pytest.mark.parametrize("refusal", ["503", "abort"])
async def test_a_generation_held_past_pause_timeout_still_has_its_whole_budget_for_refusals(
    tiny_model: Path, refusal: str
) -> None:
    """An update longer than ``pause_timeout`` (hold_timeout lets the continuation wait for it): the first
    continuation after it is refused (a 503, or the engine aborting it again before its first token). The
    wait for the hold spent none of the budget, so the refusal is retried and the agent sees one whole stream
    (before the fix: a 503 error event, the budget having run out during the hold)."""
    async with (
        InferenceServer(tiny_model, served_model_name="tiny", seed=0) as server,
        RefusingFront(server).serving() as front,
    ):
        held_long = proxying(server, backends=[front.url], pause_timeout=0.3, hold_timeout=60)
        async with held_long as (proxy, store), aiohttp.ClientSession() as http:
            rid, aid, base = claim(proxy, store)
            with anyio.fail_after(60):
                async with http.post(base + "/chat/completions", json=body("chat", stream=True)) as reply:
                    stream = Stream(reply)
                    await stream.until_first_token()
                    proxy.hold()
                    await anyio.to_thread.run_sync(server.abort)
                    with anyio.move_on_after(3 * proxy.pause_timeout):  # the update outlasts pause_timeout
                        await reply.content.wait_eof()
                    assert not reply.content.at_eof()  # a bounded look: the proxy did not give up meanwhile
                    await reload(server, 1)
                    server.resume()
                    front.arm(refusal, lambda path, request: path == "/v1/completions")
                    proxy.resume(1)
                    events = await stream.rest()
            [call] = finish(store, rid, aid)
    assert front.refused == 1
    assert_whole_stream(events, "chat", server, call)
    assert_resumed(call, start=0, end=1)
    assert proxy.m_continuations.value() == 2 and proxy.m_resume_failed.value("refused") == 0


async def test_a_call_made_again_after_a_hold_past_pause_timeout_still_has_its_whole_budget(
    tiny_model: Path,
) -> None:
    """The same for a JSON call with tools (made again from the start after the hold, not continued): the
    first try after the hold is refused with a 503 and retried. The engine starts a batch only with two
    sequences, so the JSON call is running at the engine when the stream beside it has its first token."""
    async with (
        InferenceServer(tiny_model, served_model_name="tiny", max_batch_size=2, batch_wait=60) as server,
        RefusingFront(server).serving() as front,
    ):
        whole: list[Any] = []
        answered = anyio.Event()
        held_long = proxying(server, backends=[front.url], pause_timeout=0.3, hold_timeout=60)
        async with held_long as (proxy, store), aiohttp.ClientSession() as http:
            rid, aid, base = claim(proxy, store)

            async def ask() -> None:
                await tool_call(http, base, whole)
                answered.set()

            with anyio.fail_after(60):
                async with anyio.create_task_group() as calls:
                    calls.start_soon(ask)
                    async with http.post(base + "/chat/completions", json=body("chat", stream=True)) as reply:
                        stream = Stream(reply)
                        await (
                            stream.until_first_token()
                        )  # both run now: the batch started with the two of them
                        proxy.hold()
                        assert len(await anyio.to_thread.run_sync(server.abort)) == 2
                        with anyio.move_on_after(
                            3 * proxy.pause_timeout
                        ):  # the update outlasts pause_timeout
                            await reply.content.wait_eof()
                        assert not reply.content.at_eof() and not whole  # both wait for the hold's end
                        await reload(server, 1)
                        server.resume()
                        front.arm("503", lambda path, request: bool(request.get("tools")))
                        proxy.resume(1)
                        await answered.wait()
                        assert whole[0][0] == 200, whole  # before the fix: 503, the budget spent by the hold
                        await stream.rest()
            calls_recorded = finish(store, rid, aid)
    status, answer = whole[0]
    assert front.refused == 1
    assert status == 200 and answer["choices"][0]["finish_reason"] == "length"  # before the fix: 503
    [record] = [c for c in calls_recorded if c.response_token_ids == answer["choices"][0]["token_ids"]]
    assert (record.weight_version, record.weight_version_end) == (1, 1)
    assert proxy.m_regenerated.value() == 1 and proxy.m_resume_failed.value("refused") == 0


async def test_an_aborted_stream_with_n_above_1_is_refused_with_a_recorded_error_never_an_abort(
    server: InferenceServer,
) -> None:
    async with proxying(server) as (proxy, store), aiohttp.ClientSession() as http:
        rid, aid, base = claim(proxy, store)
        server.abort(reject=True)
        async with http.post(base + "/chat/completions", json=body("chat", True, n=2)) as reply:
            status, raw = reply.status, await read_cut_short(reply)
        calls = finish(store, rid, aid)
    assert b'"abort"' not in raw and b"n > 1 is not resumed" in raw
    assert status == 200  # the stream had begun: it ends with an error event, cut short
    assert calls and all(c.status == "failed" and "n > 1 is not resumed" in (c.error or "") for c in calls)
    assert proxy.m_resume_failed.value("unsupported") == 1 and proxy.m_continuations.value() == 0


async def test_an_aborted_json_call_with_n_above_1_is_made_again_and_a_refusing_backend_ends_it_clearly(
    server: InferenceServer,
) -> None:
    async with proxying(server, pause_timeout=0.5) as (proxy, store), aiohttp.ClientSession() as http:
        rid, aid, base = claim(proxy, store)
        server.abort(reject=True)  # every answer, the first and those made again, comes back aborted
        async with http.post(base + "/chat/completions", json=body("chat", False, n=2)) as reply:
            status, raw = reply.status, await reply.read()
        calls = finish(store, rid, aid)
    assert status == 503 and b'"abort"' not in raw and b"kept aborting" in raw
    assert calls and all(c.status == "failed" for c in calls)
    assert proxy.m_resume_failed.value("refused") == 1 and proxy.m_regenerated.value() == 0


async def test_an_aborted_json_call_with_tools_is_made_again_under_the_new_weights(
    paired: InferenceServer,
) -> None:
    """A completion cannot continue a call whose output the backend parses as a whole (tool calls): the
    agent has seen none of a JSON answer, so the proxy makes the call again once the hold ends."""
    async with proxying(paired) as (proxy, store), aiohttp.ClientSession() as http:
        rid, aid, base = claim(proxy, store)
        whole: list[Any] = []
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(tool_call, http, base, whole)
                async with http.post(base + "/chat/completions", json=body("chat", stream=True)) as reply:
                    stream = Stream(reply)
                    await stream.until_first_token()  # both run now: the batch started with the two of them
                    proxy.hold()
                    assert len(await anyio.to_thread.run_sync(paired.abort)) == 2
                    await reload(paired, 1)
                    paired.resume()
                    proxy.resume(1)
                    await stream.rest()
        calls = finish(store, rid, aid)
    status, answer = whole[0]
    choice = answer["choices"][0]
    assert status == 200 and choice["finish_reason"] == "length" and len(choice["token_ids"]) == LONG
    [record] = [c for c in calls if c.response_token_ids == choice["token_ids"]]
    assert (record.weight_version, record.weight_version_end) == (1, 1)  # all of it under the new weights
    assert proxy.m_regenerated.value() == 1 and proxy.m_resume_failed.value("unsupported") == 0


# ---------------------------------------------------------------------------------------------- hold
async def test_hold_lets_calls_in_flight_go_on_and_makes_new_calls_wait_for_resume(
    server: InferenceServer,
) -> None:
    async with proxying(server) as (proxy, store), aiohttp.ClientSession() as http:
        rid, aid, base = claim(proxy, store)
        url = base + "/chat/completions"
        later: list[Any] = []

        async def new_call() -> None:
            async with http.post(url, json=body("chat", stream=False, max_tokens=3)) as reply:
                later.append(await reply.json())

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                async with http.post(url, json=body("chat", stream=True)) as reply:
                    stream = Stream(reply)
                    await stream.until_first_token()
                    proxy.hold()  # returns at once: nothing is drained
                    assert proxy.held and not proxy.paused and proxy.in_flight == 1
                    tg.start_soon(new_call)
                    events = await stream.rest()  # the call in flight goes on to its end while held
                requests = server.stats().requests
                assert later == [] and requests == 1  # the new call waits at the proxy
                proxy.resume(4)
        calls = finish(store, rid, aid)
    assert events[-1] == "[DONE]" and later[0]["choices"][0]["finish_reason"] == "length"
    assert [(c.weight_version, c.weight_version_end) for c in sorted(calls, key=lambda c: c.seq)] == [
        (0, 0),
        (
            0,
            0,
        ),  # the embedded server reports the version it generated with, whatever the proxy's counter says
    ]
    assert proxy.m_held.value() == 1 and proxy.m_continuations.value() == 0


async def test_recorded_version_is_the_one_the_backend_reports(server: InferenceServer) -> None:
    await reload(server, 3)
    async with proxying(server) as (proxy, store), aiohttp.ClientSession() as http:
        rid, aid, base = claim(proxy, store)
        for stream in (False, True):
            async with http.post(
                base + "/chat/completions", json=body("chat", stream, max_tokens=4)
            ) as reply:
                assert reply.headers["X-Weight-Version"] == "3"
                await reply.read()
        calls = finish(store, rid, aid)
    assert proxy.weight_version == 0
    assert [(c.weight_version, c.weight_version_end) for c in calls] == [(3, 3), (3, 3)]


async def test_daemon_holding_calls_resumes_aborted_generations_and_counts_them(
    server: InferenceServer,
) -> None:
    async with (
        AgentDaemon(backends=[server.url], model="tiny", vocab_size=server.vocab_size) as daemon,
        aiohttp.ClientSession() as http,
    ):
        rid, aid, base = claim(daemon.proxy, daemon.store)
        with anyio.fail_after(60):
            async with http.post(base + "/chat/completions", json=body("chat", stream=True)) as reply:
                stream = Stream(reply)
                await stream.until_first_token()
                async with daemon.holding_calls(weight_version=1):
                    await anyio.to_thread.run_sync(server.abort)
                    await reload(server, 1)
                    server.resume()
                events = await stream.rest()
        [call] = finish(daemon.store, rid, aid)
        counters = daemon.proxy_counters()
        trajectory = trajectory_of(daemon.store.record(rid))
    assert_whole_stream(events, "chat", server, call)
    assert_resumed(call, start=0, end=1)
    assert trajectory.versions == [0] and trajectory.end_versions == [1]
    assert counters["proxy/resumed"] == 1 and counters["proxy/continuations"] == 1
    assert (
        counters["proxy/resume_failures_refused"] == 0 and counters["proxy/resume_failures_unsupported"] == 0
    )


# ---------------------------------------------------------------------------------------------- records
def test_calls_journaled_before_weight_version_end_existed_load_with_it_equal_to_weight_version() -> None:
    old = {"rollout_id": "r", "attempt_id": "a", "seq": 0, "path": "/v1/chat/completions", "backend": "b"}
    call = LLMCall(**old, started_at=0.0, weight_version=5)
    assert call.weight_version_end == 5 and call.last_weight_version == 5
    resumed = LLMCall(**old, started_at=0.0, weight_version=5, weight_version_end=6)
    assert (resumed.weight_version, resumed.last_weight_version) == (5, 6)


async def test_the_embedded_server_reads_a_prompt_ending_inside_a_character_with_its_output(
    server: InferenceServer,
) -> None:
    """What resuming relies on: prompted with ids that end inside a UTF-8 character (an output cut there), a
    completion renders those bytes with its own, as vLLM's primed detokenizer does; so the cut text without
    its trailing U+FFFD, followed by the continued text, is the decode of all the ids."""
    tokenizer = server.tokenizer
    first_byte = tokenizer.convert_tokens_to_ids("\u00c3")  # byte 0xC3 (the first of "é") in byte-level BPE
    assert tokenizer.decode([first_byte]) == "\ufffd"
    async with aiohttp.ClientSession() as http:
        for seed in range(6):  # outputs that complete the character and outputs that do not
            request = {"model": "tiny", "prompt": [5, 17, first_byte], "max_tokens": 3, "seed": seed}
            async with http.post(
                server.url + "/v1/completions", json=request | {"return_token_ids": True}
            ) as r:
                choice = (await r.json())["choices"][0]
            assert choice["text"] == tokenizer.decode(
                [first_byte, *choice["token_ids"]], skip_special_tokens=True
            )


# ---------------------------------------------------------------------------------------------- size bounds
class _AbortingThenFlooding:
    """A backend whose first answer is aborted after two tokens and whose next answer (the continuation, or
    the call made again) comes in chunks with no declared length and never fits ``max_response_bytes``."""

    FLOOD = 64 << 10

    def __init__(self) -> None:
        self.paths: list[str] = []

    async def answer(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        from aiohttp import web

        self.paths.append(request.path)
        if len(self.paths) == 1:
            return web.json_response(
                {
                    "id": "chatcmpl-1",
                    "object": "chat.completion",
                    "model": "tiny",
                    "prompt_token_ids": [1, 2, 3],
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "ab"},
                            "finish_reason": "abort",
                            "token_ids": [5, 6],
                        }
                    ],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
                }
            )
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(b'{"id": "x", "choices": [{"index": 0, "text": "')
        for _ in range(self.FLOOD // 1024):
            await response.write(b"a" * 1024)
        await response.write(b'", "finish_reason": "length", "token_ids": [7]}]}')
        await response.write_eof()
        return response


@pytest.mark.parametrize("tools", [False, True], ids=["continued", "made-again"])
async def test_a_chunked_answer_read_whole_after_an_abort_is_bounded_by_max_response_bytes(
    tools: bool,
) -> None:
    from aiohttp import web

    backend = _AbortingThenFlooding()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", backend.answer)
    app.router.add_post("/v1/completions", backend.answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    store = TaskStore(vocab_size=1000)
    proxy = LLMProxy(store, backends=[url], registry=Registry(), retry=FAST_RETRY, max_response_bytes=8 << 10)
    try:
        async with anyio.create_task_group() as tg, aiohttp.ClientSession() as http:
            await tg.start(proxy.serve)
            rid, aid, base = claim(proxy, store)
            request: dict[str, Any] = {"model": "tiny", "messages": CHAT, "max_tokens": 50}
            if tools:  # a completion cannot continue it token-exactly: the whole call is made again
                request["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
            with anyio.fail_after(10):
                async with http.post(base + "/chat/completions", json=request) as reply:
                    status, raw = reply.status, await reply.read()
            [call] = finish(store, rid, aid)
            tg.cancel_scope.cancel()
    finally:
        await runner.cleanup()
    assert len(backend.paths) == 2
    assert status == 502, raw[:200]
    message = orjson.loads(raw)["error"]["message"]
    assert "exceeds max_response_bytes=8192" in message
    assert call.status == "failed" and call.error == message
