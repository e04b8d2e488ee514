"""LLMProxy over real loopback HTTP: agents (raw aiohttp or the official openai SDK) -> proxy -> MockVLLM."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

import aiohttp
import anyio
import openai
import orjson
import pytest
from aiohttp import web
from helpers.raw_http import read_cut_short
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai import AsyncOpenAI
from yarl import URL

from aglverl._net import HttpListener, bind_listener
from aglverl.metrics import Registry
from aglverl.models import Rollout
from aglverl.proxy import LLMProxy, RetryPolicy
from aglverl.proxy.capture import Capture
from aglverl.proxy.http import Exchange
from aglverl.store import LLMCall, TaskStore
from aglverl.testing import MockVLLM, ReplayCase, load_replay_cases, prompt_token_ids, token_logprob
from aglverl.trajectory.rollouts import termination_of

pytestmark = pytest.mark.anyio

FIXTURES = Path(__file__).parent / "fixtures" / "vllm"
CASES = load_replay_cases(FIXTURES)
#: Fast retries so fault tests stay quick; the budget is still generous.
FAST_RETRY = RetryPolicy(attempts=3, total_timeout=5.0, backoff_initial=0.01, backoff_max=0.05)
CHAT: Any = [{"role": "user", "content": "Say yes."}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@asynccontextmanager
async def serving(*components: Any) -> AsyncIterator[None]:
    """Start each component with ``tg.start(c.serve)``; cancel them all on exit."""
    async with anyio.create_task_group() as tg:
        for component in components:
            await tg.start(component.serve)
        yield
        tg.cancel_scope.cancel()


def make_proxy(store: TaskStore, backends: Sequence[str], **kwargs: Any) -> LLMProxy:
    kwargs.setdefault("retry", FAST_RETRY)
    return LLMProxy(store, backends=backends, registry=Registry(), **kwargs)


def claim(store: TaskStore) -> tuple[str, str]:
    rollout_id = store.enqueue({"question": "?"})
    task = store.try_claim()
    assert task is not None and task.rollout_id == rollout_id and task.attempt_id is not None
    return rollout_id, task.attempt_id


def finish(store: TaskStore, rollout_id: str, attempt_id: str) -> list[LLMCall]:
    """Complete the rollout and return the calls the store kept for it (the winning attempt's)."""
    store.submit_result(Rollout(rollout_id=rollout_id, attempt_id=attempt_id, final_reward=1.0))
    return store.record(rollout_id).calls


def base_url(proxy: LLMProxy, rollout_id: str, attempt_id: str) -> str:
    return proxy.llm_resource("mock").get_base_url(rollout_id, attempt_id)


def sdk(url: str, api_key: str = "unused") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url, api_key=api_key, max_retries=0)


def chat_body(content: str = "Say yes.", **extra: Any) -> dict[str, Any]:
    return {"model": "mock", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


# ---------------------------------------------------------------------------------------------- fidelity
async def test_openai_sdk_chat_through_proxy_matches_direct_call_and_records_mock_ids() -> None:
    store = TaskStore()
    async with MockVLLM() as mock:
        proxy = make_proxy(store, [mock.url])
        async with serving(proxy):
            rid, aid = claim(store)
            kwargs: dict[str, Any] = dict(model="mock", messages=CHAT, max_tokens=5, logprobs=True, n=2)
            async with sdk(f"{mock.url}/v1") as direct, sdk(base_url(proxy, rid, aid)) as proxied:
                # Direct, asking for ids as the proxy does for the agent: the answers must then be the same.
                want = await direct.chat.completions.create(**kwargs, extra_body={"return_token_ids": True})
                got = await proxied.chat.completions.create(**kwargs)
            calls = finish(store, rid, aid)
    volatile = {"id", "created"}
    assert got.model_dump(exclude=volatile) == want.model_dump(exclude=volatile)
    expected = mock.expected(chat_body(messages=CHAT, max_tokens=5, n=2))
    assert [(c.prompt_token_ids, c.response_token_ids) for c in calls] == expected
    assert [c.choice_index for c in calls] == [0, 1]
    assert all(c.status == "ok" and c.finish_reason == "length" and c.backend == mock.url for c in calls)
    assert got.choices[0].logprobs is not None and got.choices[0].logprobs.content is not None
    assert calls[0].logprobs == [lp.logprob for lp in got.choices[0].logprobs.content]
    assert calls[0].model == "mock" and calls[0].path == "/v1/chat/completions"


async def test_openai_sdk_stream_through_proxy_matches_direct_call_and_records_mock_ids() -> None:
    store = TaskStore()
    async with MockVLLM() as mock:
        proxy = make_proxy(store, [mock.url])
        async with serving(proxy):
            rid, aid = claim(store)
            kwargs: dict[str, Any] = dict(
                model="mock", messages=CHAT, max_tokens=6, stream=True, stream_options={"include_usage": True}
            )
            async with sdk(f"{mock.url}/v1") as direct, sdk(base_url(proxy, rid, aid)) as proxied:
                ask_ids = {"return_token_ids": True}
                want = [c async for c in await direct.chat.completions.create(**kwargs, extra_body=ask_ids)]
                got = [c async for c in await proxied.chat.completions.create(**kwargs)]
            calls = finish(store, rid, aid)
    volatile = {"id", "created"}
    assert [c.model_dump(exclude=volatile) for c in got] == [c.model_dump(exclude=volatile) for c in want]
    assert got[-1].usage is not None and got[-1].usage.completion_tokens == 6
    [call] = calls
    [(prompt, response)] = mock.expected(chat_body(messages=CHAT, max_tokens=6))
    assert (call.prompt_token_ids, call.response_token_ids) == (prompt, response)
    assert call.status == "ok" and call.finish_reason == "length"


async def test_each_call_is_recorded_with_the_id_of_the_answer_the_agent_got() -> None:
    """The id an agent's trace names a call by: a chat answer's ``id`` (each choice's record carries it), a
    stream's, and a Responses answer's own ``resp_...`` (the proxy's translation, not the backend's id)."""
    store = TaskStore()
    async with MockVLLM() as mock:
        proxy = make_proxy(store, [mock.url])
        async with serving(proxy):
            rid, aid = claim(store)
            async with sdk(base_url(proxy, rid, aid)) as client:
                whole = await client.chat.completions.create(model="mock", messages=CHAT, max_tokens=3, n=2)
                chunks = [
                    c
                    async for c in await client.chat.completions.create(
                        model="mock", messages=CHAT, max_tokens=3, stream=True
                    )
                ]
                response = await client.responses.create(model="mock", input="Say yes.", max_output_tokens=3)
            calls = finish(store, rid, aid)
    assert [c.response_id for c in calls] == [whole.id, whole.id, chunks[0].id, response.id]
    assert len({whole.id, chunks[0].id, response.id}) == 3 and response.id.startswith("resp_")


async def test_openai_sdk_completions_through_proxy_record_per_choice_prompts_and_logprobs() -> None:
    store = TaskStore()
    async with MockVLLM() as mock:
        proxy = make_proxy(store, [mock.url])
        async with serving(proxy):
            rid, aid = claim(store)
            async with sdk(base_url(proxy, rid, aid)) as client:
                got = await client.completions.create(
                    model="mock", prompt=["ab", "cd"], max_tokens=3, logprobs=1
                )
            calls = finish(store, rid, aid)
    body = {"model": "mock", "prompt": ["ab", "cd"], "max_tokens": 3}
    assert [(c.prompt_token_ids, c.response_token_ids) for c in calls] == mock.expected(body)
    assert [c.logprobs for c in calls] == [ch.logprobs.token_logprobs for ch in got.choices]  # type: ignore[union-attr]


@pytest.mark.parametrize("name", sorted(CASES))
async def test_replayed_vllm_bytes_reach_agent_unchanged_and_ids_captured_exactly(
    name: str, http: aiohttp.ClientSession
) -> None:
    case = CASES[name]
    store = TaskStore()
    # Small pieces with a pause between them: SSE events reach the proxy split across network reads.
    async with MockVLLM(replay_dir=FIXTURES, chunk_latency=0.0005) as mock:
        proxy = make_proxy(store, [mock.url])
        async with serving(proxy):
            rid, aid = claim(store)
            url = base_url(proxy, rid, aid) + case.path.removeprefix("/v1")
            async with http.post(url, json=case.body) as response:
                body = await response.read()
                assert response.status == case.status
                assert response.headers["Content-Type"] == case.content_type
            calls = finish(store, rid, aid)
    assert body == case.response
    expected = ids_in_fixture(case)
    if case.status != 200:
        [call] = calls
        assert call.status == "failed" and call.response_token_ids is None
        assert call.error is not None and str(case.status) in call.error
        # vLLM's refusal of max_tokens beyond max_model_len is a context-window limit; an unknown model is not.
        assert call.limit == ("context" if name == "error_too_long" else None)
        return
    assert [c.choice_index for c in calls] == sorted(expected)
    for call in calls:
        want = expected[call.choice_index]
        assert call.status == "ok"
        assert call.prompt_token_ids == want["prompt"]
        assert call.response_token_ids == want["ids"]
        assert call.logprobs == want["logprobs"]
        assert call.finish_reason == want["finish"]
    if name == "chat_no_token_ids":
        assert calls[0].response_token_ids is None and calls[0].prompt_token_ids is None
        assert proxy.m_no_ids.value() == 1


def ids_in_fixture(case: ReplayCase) -> dict[int, dict[str, Any]]:
    """What a recording must hold, read straight from the fixture bytes (independently of the proxy)."""
    if case.status != 200:
        return {}
    if case.streamed:
        lines = case.response.decode().splitlines()
        events = [orjson.loads(line[6:]) for line in lines if line.startswith("data: {")]
    else:
        events = [orjson.loads(case.response)]
    top_prompt = next((e["prompt_token_ids"] for e in events if e.get("prompt_token_ids")), None)
    out: dict[int, dict[str, Any]] = {}
    for event in events:
        for ch in event["choices"]:
            d = out.setdefault(ch["index"], {"prompt": top_prompt, "ids": None, "lps": [], "finish": None})
            if ch.get("prompt_token_ids"):
                d["prompt"] = d["prompt"] or ch["prompt_token_ids"]
            if ch.get("token_ids") is not None:
                d["ids"] = (d["ids"] or []) + ch["token_ids"]
            lp = ch.get("logprobs")
            if lp:
                d["lps"] += [e["logprob"] for e in lp["content"]] if "content" in lp else lp["token_logprobs"]
            d["finish"] = ch.get("finish_reason") or d["finish"]
    for d in out.values():
        d["logprobs"] = d.pop("lps") or None
    return out


def test_fixture_expectations_cover_the_interesting_shapes() -> None:
    """Guards the independent parser above: n=2 interleaving with logprobs and a token prompt are real."""
    n2 = ids_in_fixture(CASES["chat_stream_n2_logprobs"])
    assert sorted(n2) == [0, 1] and all(
        d["ids"] == [326] * 6 and d["logprobs"] == [0.0] * 6 for d in n2.values()
    )
    assert ids_in_fixture(CASES["completion_token_prompt"])[0]["prompt"] == [5, 17, 42, 99]
    assert ids_in_fixture(CASES["completion_stream"])[0]["ids"] == [34, 119, 326, 326, 326, 326, 326, 326]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_capture_assembles_same_ids_wherever_the_stream_is_cut(data: st.DataObject) -> None:
    case = CASES[data.draw(st.sampled_from(["chat_stream", "chat_stream_n2_logprobs", "completion_stream"]))]
    raw = case.response
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=40)))
    kind: Literal["chat", "completion"] = "chat" if "chat" in case.path else "completion"
    whole, pieces = Capture(kind), Capture(kind)
    whole.feed(raw)
    for start, end in zip([0, *cuts], [*cuts, len(raw)], strict=True):
        pieces.feed(raw[start:end])
    assert pieces.done and not pieces.broken
    assert [(i, c.prompt_ids, ids, lps) for i, c, ids, lps in pieces.result()] == [
        (i, c.prompt_ids, ids, lps) for i, c, ids, lps in whole.result()
    ]


async def test_explicit_return_token_ids_false_is_respected_and_counted_as_missing(
    http: aiohttp.ClientSession,
) -> None:
    store = TaskStore()
    async with MockVLLM() as mock:
        proxy = make_proxy(store, [mock.url])
        async with serving(proxy):
            rid, aid = claim(store)
            url = base_url(proxy, rid, aid) + "/chat/completions"
            async with http.post(url, json=chat_body(return_token_ids=False)) as response:
                assert response.status == 200
            async with http.post(url, json=chat_body()) as response:
                assert response.status == 200
            [seen_false, seen_default] = mock.generation_requests()
            calls = finish(store, rid, aid)
    assert seen_false.json["return_token_ids"] is False and seen_default.json["return_token_ids"] is True
    assert (
        calls[0].status == "ok" and calls[0].response_token_ids is None and calls[0].prompt_token_ids is None
    )
    assert calls[1].response_token_ids is not None
    assert proxy.m_no_ids.value() == 1


async def test_unattributed_calls_are_forwarded_verbatim_and_counted_but_not_recorded(
    http: aiohttp.ClientSession,
) -> None:
    store = TaskStore()
    async with MockVLLM() as mock:
        proxy = make_proxy(store, [mock.url])
        async with serving(proxy):
            rid, aid = claim(store)
            raw = b'{ "model": "mock", "messages": [] }'
            headers = {"Content-Type": "application/json"}
            async with http.post(f"{proxy.url}/v1/chat/completions", data=raw, headers=headers) as response:
                assert response.status == 200
            async with http.get(f"{proxy.url}/v1/models?x=1") as response:
                models = await response.json()
    [seen, listing] = mock.requests
    assert seen.body == raw
    assert listing.path == "/v1/models" and listing.query == "x=1" and models["data"][0]["id"] == "mock"
    assert proxy.m_calls.value("ok") == 2
    assert finish(store, rid, aid) == []


async def test_calls_of_one_rollout_are_recorded_in_call_order() -> None:
    store = TaskStore()
    async with MockVLLM() as mock:
        proxy = make_proxy(store, [mock.url])
        async with serving(proxy):
            rid, aid = claim(store)
            async with sdk(base_url(proxy, rid, aid)) as client:
                for turn in range(4):
                    messages: Any = [{"role": "user", "content": f"turn {turn}"}]
                    await client.chat.completions.create(model="mock", messages=messages, max_tokens=2)
            calls = finish(store, rid, aid)
    assert [c.seq for c in calls] == sorted(c.seq for c in calls)
    assert [bytes(c.prompt_token_ids or []).decode() for c in calls] == [
        f"<|user|>turn {t}\n<|assistant|>" for t in range(4)
    ]


# ---------------------------------------------------------------------------------------------- routing
async def test_rollout_sticks_to_its_backend_and_new_rollouts_take_the_least_loaded(
    http: aiohttp.ClientSession,
) -> None:
    store = TaskStore()
    async with MockVLLM() as m1, MockVLLM() as m2, MockVLLM() as m3:
        proxy = make_proxy(store, [m1.url, m2.url, m3.url])
        m1.stall_next()
        m2.stall_next()
        async with serving(proxy), anyio.create_task_group() as agents:
            (r1, a1), (r2, a2), (r3, a3) = claim(store), claim(store), claim(store)

            async def call(rid: str, aid: str) -> None:
                async with http.post(base_url(proxy, rid, aid) + "/chat/completions", json=chat_body()) as r:
                    assert r.status == 200

            agents.start_soon(call, r1, a1)
            with anyio.fail_after(2):
                await m1.wait_until(lambda m: m.active == 1)
            agents.start_soon(call, r2, a2)
            with anyio.fail_after(2):
                await m2.wait_until(lambda m: m.active == 1)
            await call(r3, a3)  # m1 and m2 each hold a call: the new rollout goes to idle m3
            for _ in range(3):
                await call(r1, a1)  # r1 stays on m1 although m1 is the busiest
            assert m3.completed == 1 and m1.completed == 3 and m2.completed == 0
            agents.cancel_scope.cancel()
        calls = {rid: finish(store, rid, aid) for rid, aid in ((r1, a1), (r2, a2), (r3, a3))}
    assert {c.backend for c in calls[r1]} == {m1.url} and len(calls[r1]) == 4
    assert [c.backend for c in calls[r2]] == [m2.url] and [c.backend for c in calls[r3]] == [m3.url]


async def test_refused_backend_is_retried_elsewhere_ejected_and_probed_back(
    http: aiohttp.ClientSession,
) -> None:
    store = TaskStore()
    sock = bind_listener("127.0.0.1", 0)
    dead_port = sock.getsockname()[1]
    sock.close()  # nothing listens there now: connections are refused
    dead_url = f"http://127.0.0.1:{dead_port}"
    async with MockVLLM() as live:
        proxy = make_proxy(store, [dead_url, live.url], eject_seconds=0.2)
        async with serving(proxy):
            rid, aid = claim(store)
            async with http.post(base_url(proxy, rid, aid) + "/chat/completions", json=chat_body()) as r:
                assert r.status == 200
            assert proxy.healthy_backends == [live.url]
            assert proxy.m_ejections.value() == 1
            assert proxy.m_retries.value() == 1
            rid2, aid2 = claim(store)  # a new rollout while the dead backend is out: no connection tried
            async with http.post(base_url(proxy, rid2, aid2) + "/chat/completions", json=chat_body()) as r:
                assert r.status == 200
            assert proxy.m_retries.value() == 1
            async with MockVLLM(port=dead_port) as revived:
                with anyio.fail_after(3):
                    await revived.wait_until(lambda m: any(r.path == "/health" for r in m.requests))
                    # The probe's answer is read a few loop turns later; the proxy exposes no event for it.
                    while dead_url not in proxy.healthy_backends:  # noqa: ASYNC110
                        await anyio.sleep(0.01)
                assert revived.generation_requests() == []  # back in rotation by the probe alone
        [call] = finish(store, rid, aid)
    assert call.backend == live.url and call.status == "ok"


async def test_set_backends_moves_pinned_rollouts_and_backends_get_only_the_configured_key(
    http: aiohttp.ClientSession,
) -> None:
    store = TaskStore()
    async with MockVLLM() as old, MockVLLM() as new:
        proxy = make_proxy(store, [old.url], backend_api_key="backend-secret", token="agent-secret")
        async with serving(proxy):
            rid, aid = claim(store)
            url = base_url(proxy, rid, aid) + "/chat/completions"
            auth = {"Authorization": "Bearer agent-secret"}
            async with http.post(url, json=chat_body(), headers=auth) as r:
                assert r.status == 200
            proxy.set_backends([new.url + "/"])  # between steps; a trailing slash is fine
            assert proxy.backends == [new.url]
            async with http.post(url, json=chat_body(), headers=auth) as r:
                assert r.status == 200
            calls = finish(store, rid, aid)
    assert [c.backend for c in calls] == [old.url, new.url]
    for seen in old.requests + new.requests:
        assert seen.headers["Authorization"] == "Bearer backend-secret"


async def test_unreachable_backends_give_502_after_every_try(http: aiohttp.ClientSession) -> None:
    store = TaskStore()
    sock = bind_listener("127.0.0.1", 0)
    dead_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()
    proxy = make_proxy(store, [dead_url])
    async with serving(proxy):
        rid, aid = claim(store)
        async with http.post(base_url(proxy, rid, aid) + "/chat/completions", json=chat_body()) as r:
            assert r.status == 502
            assert_openai_error(await r.json(), 502, "unreachable", "after 3 tries")
        [call] = finish(store, rid, aid)
    assert call.status == "failed" and call.backend == dead_url and call.response_token_ids is None


async def test_oversize_backend_response_is_refused_or_cut_off(http: aiohttp.ClientSession) -> None:
    store = TaskStore()
    async with MockVLLM(completion_tokens=200) as mock:
        proxy = make_proxy(store, [mock.url], max_response_bytes=2000)
        async with serving(proxy):
            rid, aid = claim(store)
            url = base_url(proxy, rid, aid) + "/chat/completions"
            async with http.post(url, json=chat_body(max_tokens=200)) as r:
                assert r.status == 502
                assert_openai_error(await r.json(), 502, "max_response_bytes")
            async with http.post(url, json=chat_body(max_tokens=200, stream=True)) as r:
                data = await read_cut_short(r)
            calls = finish(store, rid, aid)
    assert b"max_response_bytes" in data and len(data) < 3000
    assert [c.status for c in calls] == ["failed", "failed"]


async def test_backend_500_is_retried_on_another_backend(http: aiohttp.ClientSession) -> None:
    store = TaskStore()
    async with MockVLLM() as m1, MockVLLM() as m2:
        proxy = make_proxy(store, [m1.url, m2.url])
        m1.fail_next(1, status=500)
        async with serving(proxy):
            rid, aid = claim(store)
            async with http.post(base_url(proxy, rid, aid) + "/chat/completions", json=chat_body()) as r:
                assert r.status == 200
            [call] = finish(store, rid, aid)
    assert len(m1.generation_requests()) == 1 and len(m2.generation_requests()) == 1
    assert call.backend == m2.url and call.status == "ok" and call.response_token_ids is not None
    assert proxy.m_retries.value() == 1


async def test_backend_errors_on_every_try_reach_the_agent_as_the_backends_answer(
    http: aiohttp.ClientSession,
) -> None:
    store = TaskStore()
    async with MockVLLM() as mock:
        proxy = make_proxy(store, [mock.url])
        mock.fail_next(3, status=503)
        async with serving(proxy):
            rid, aid = claim(store)
            async with http.post(base_url(proxy, rid, aid) + "/chat/completions", json=chat_body()) as r:
                assert r.status == 503
                assert (await r.json())["error"]["message"] == "injected failure (503)"
            [call] = finish(store, rid, aid)
    assert len(mock.generation_requests()) == 3
    assert call.status == "failed" and call.error is not None and "503" in call.error


async def test_connection_closed_before_answer_is_retried(http: aiohttp.ClientSession) -> None:
    store = TaskStore()
    async with MockVLLM() as mock:
        proxy = make_proxy(store, [mock.url])
        mock.break_next()
        async with serving(proxy):
            rid, aid = claim(store)
            async with http.post(base_url(proxy, rid, aid) + "/chat/completions", json=chat_body()) as r:
                assert r.status == 200
            [call] = finish(store, rid, aid)
    assert mock.broken == 1 and call.status == "ok"
    assert proxy.m_ejections.value() == 0


async def test_429_retry_after_is_honoured_within_the_budget(http: aiohttp.ClientSession) -> None:
    store = TaskStore()
    async with MockVLLM() as mock:
        proxy = make_proxy(store, [mock.url])
        mock.throttle_next(1, retry_after=0.3)
        async with serving(proxy):
            rid, aid = claim(store)
            started = time.monotonic()
            async with http.post(base_url(proxy, rid, aid) + "/chat/completions", json=chat_body()) as r:
                assert r.status == 200
            assert time.monotonic() - started >= 0.3
    assert len(mock.generation_requests()) == 2


async def test_429_asking_past_the_budget_is_passed_through_at_once(http: aiohttp.ClientSession) -> None:
    store = TaskStore()
    async with MockVLLM() as mock:
        retry = RetryPolicy(attempts=3, total_timeout=0.5, backoff_initial=0.01)
        proxy = make_proxy(store, [mock.url], retry=retry)
        mock.throttle_next(1, retry_after=30)
        async with serving(proxy):
            rid, aid = claim(store)
            started = time.monotonic()
            async with http.post(base_url(proxy, rid, aid) + "/chat/completions", json=chat_body()) as r:
                assert r.status == 429 and r.headers["Retry-After"] == "30"
            assert time.monotonic() - started < 0.5
    assert len(mock.generation_requests()) == 1


async def test_no_backend_gives_503_and_bad_backend_urls_are_refused(http: aiohttp.ClientSession) -> None:
    store = TaskStore()
    proxy = make_proxy(store, [])
    with pytest.raises(ValueError, match="no path"):
        proxy.set_backends(["http://127.0.0.1:8000/v1"])
    async with serving(proxy):
        rid, aid = claim(store)
        async with http.post(base_url(proxy, rid, aid) + "/chat/completions", json=chat_body()) as r:
            assert r.status == 503
            assert "no backends" in (await r.json())["error"]["message"]


# ---------------------------------------------------------------------------------------------- failures
async def test_backend_dying_mid_stream_ends_the_agents_stream_with_an_error_event_cut_short_and_records_a_failed_call(
    http: aiohttp.ClientSession,
) -> None:
    store = TaskStore()
    async with MockVLLM(completion_tokens=8) as mock:
        proxy = make_proxy(store, [mock.url])
        mock.break_next(1, after_events=3)
        mock.break_next(1, after_events=3)
        async with serving(proxy):
            rid, aid = claim(store)
            url = base_url(proxy, rid, aid)
            async with http.post(url + "/chat/completions", json=chat_body(stream=True)) as r:
                body = await read_cut_short(r)  # never a whole answer: no terminating chunk
            async with sdk(url) as client:
                stream = await client.chat.completions.create(model="mock", messages=CHAT, stream=True)
                with pytest.raises(openai.APIError, match="broke off"):
                    async for _ in stream:
                        pass
            calls = finish(store, rid, aid)
    events = [e for e in body.split(b"\n\n") if e]
    assert len(events) == 4 and b"[DONE]" not in body
    error = orjson.loads(events[-1].removeprefix(b"data: "))["error"]
    assert error["code"] == 502 and "broke off" in error["message"]
    assert [c.status for c in calls] == ["failed", "failed"]
    assert calls[0].prompt_token_ids == mock.expected(chat_body(stream=True))[0][0]
    assert calls[0].response_token_ids is None and calls[0].error is not None


async def test_agent_disconnect_cancels_the_upstream_request(http: aiohttp.ClientSession) -> None:
    store = TaskStore()
    async with MockVLLM(completion_tokens=200, chunk_latency=0.02) as mock:
        proxy = make_proxy(store, [mock.url])
        mock.stall_next()
        async with serving(proxy):
            rid, aid = claim(store)
            url = base_url(proxy, rid, aid) + "/chat/completions"

            async def waiting_agent() -> None:
                async with http.post(url, json=chat_body()) as r:  # an answer that never comes
                    await r.read()

            async with anyio.create_task_group() as agent:
                agent.start_soon(waiting_agent)
                with anyio.fail_after(2):
                    await mock.wait_until(lambda m: m.active == 1)
                agent.cancel_scope.cancel()  # the agent gives up: its connection closes
            with anyio.fail_after(2):
                await mock.wait_until(lambda m: m.cancelled == 1)
            async with http.post(url, json=chat_body(stream=True)) as r:  # and in the middle of a stream
                await r.content.readany()
                r.close()
            with anyio.fail_after(2):
                await mock.wait_until(lambda m: m.cancelled == 2)
            assert proxy.in_flight == 0
            calls = finish(store, rid, aid)
    assert [(c.status, c.error) for c in calls] == [("failed", "agent disconnected")] * 2
    assert proxy.m_calls.value("cancelled") == 2


async def test_request_timeout_gives_504_and_cancels_the_upstream_request(
    http: aiohttp.ClientSession,
) -> None:
    store = TaskStore()
    async with MockVLLM() as mock:
        proxy = make_proxy(store, [mock.url], request_timeout=0.3)
        mock.stall_next()
        async with serving(proxy):
            rid, aid = claim(store)
            async with http.post(base_url(proxy, rid, aid) + "/chat/completions", json=chat_body()) as r:
                assert r.status == 504
                assert "request_timeout" in (await r.json())["error"]["message"]
            with anyio.fail_after(2):
                await mock.wait_until(lambda m: m.cancelled == 1)


async def test_stream_outliving_request_timeout_ends_with_a_504_event_and_a_failed_record(
    http: aiohttp.ClientSession,
) -> None:
    store = TaskStore()
    async with MockVLLM(completion_tokens=50, chunk_latency=0.05) as mock:
        proxy = make_proxy(store, [mock.url], request_timeout=0.4)
        async with serving(proxy):
            rid, aid = claim(store)
            body = chat_body(stream=True, max_tokens=50)
            async with http.post(base_url(proxy, rid, aid) + "/chat/completions", json=body) as r:
                data = await read_cut_short(r)
            with anyio.fail_after(2):
                await mock.wait_until(lambda m: m.cancelled == 1)
            [call] = finish(store, rid, aid)
    last = orjson.loads(data.rstrip(b"\n").rsplit(b"\n\n", 1)[1].removeprefix(b"data: "))
    assert last["error"]["code"] == 504 and "request_timeout" in last["error"]["message"]
    assert call.status == "failed" and call.response_token_ids is None


@pytest.mark.parametrize("stream", [False, True])
async def test_call_is_recorded_before_the_agent_can_see_the_end_of_its_answer(
    stream: bool, http: aiohttp.ClientSession
) -> None:
    """An agent that reports its rollout the instant it has its answer must not lose that call's ids."""
    store = TaskStore()
    async with MockVLLM(eof_delay=0.1) as mock:  # [DONE] reaches the agent well before the body ends
        proxy = make_proxy(store, [mock.url])
        async with serving(proxy):
            rid, aid = claim(store)
            async with http.post(
                base_url(proxy, rid, aid) + "/chat/completions", json=chat_body(stream=stream)
            ) as r:
                seen = b""
                while not (b"[DONE]" in seen if stream else len(seen) == r.content_length):
                    seen += await r.content.readany()
                calls = finish(store, rid, aid)  # no await between the last byte and the report
    [call] = calls
    assert call.status == "ok" and call.response_token_ids == mock.expected(chat_body())[0][1]


# ---------------------------------------------------------------------------------------------- pause / resume
async def test_pause_drains_in_flight_calls_holds_new_ones_and_resume_sets_the_weight_version(
    http: aiohttp.ClientSession,
) -> None:
    store = TaskStore()
    async with MockVLLM(latency=0.2) as mock:
        proxy = make_proxy(store, [mock.url])
        async with serving(proxy), anyio.create_task_group() as tg:
            rid, aid = claim(store)
            url = base_url(proxy, rid, aid) + "/chat/completions"
            finished: list[str] = []

            async def call(tag: str) -> None:
                async with http.post(url, json=chat_body(tag)) as r:
                    assert r.status == 200
                finished.append(tag)

            tg.start_soon(call, "before")
            with anyio.fail_after(2):
                await mock.wait_until(lambda m: m.active == 1)
            await proxy.pause()
            assert mock.completed == 1 and proxy.in_flight == 0  # pause returned once the call was done
            tg.start_soon(call, "during")
            await anyio.sleep(0.1)
            assert len(mock.generation_requests()) == 1 and finished == ["before"]  # held at the proxy
            proxy.resume(weight_version=7)
            with anyio.fail_after(2):
                await mock.wait_until(lambda m: m.completed == 2)
        calls = finish(store, rid, aid)
    assert [c.weight_version for c in calls] == [0, 7]
    assert finished == ["before", "during"]


async def test_call_held_longer_than_pause_timeout_gets_503(http: aiohttp.ClientSession) -> None:
    store = TaskStore()
    async with MockVLLM() as mock:
        proxy = make_proxy(store, [mock.url], pause_timeout=0.1)
        async with serving(proxy):
            await proxy.pause()
            rid, aid = claim(store)
            async with http.post(base_url(proxy, rid, aid) + "/chat/completions", json=chat_body()) as r:
                assert r.status == 503 and "paused" in (await r.json())["error"]["message"]
            proxy.resume()
            assert proxy.weight_version == 1
    assert mock.generation_requests() == []


async def test_a_call_held_by_the_trainer_waits_up_to_hold_timeout_not_pause_timeout(
    http: aiohttp.ClientSession,
) -> None:
    store = TaskStore()
    async with MockVLLM() as mock:
        proxy = make_proxy(store, [mock.url], pause_timeout=0.1, hold_timeout=60)
        async with serving(proxy), anyio.create_task_group() as tg:
            proxy.hold()
            rid, aid = claim(store)
            statuses: list[int] = []

            async def call() -> None:
                async with http.post(base_url(proxy, rid, aid) + "/chat/completions", json=chat_body()) as r:
                    statuses.append(r.status)
                    await r.read()

            tg.start_soon(call)
            await anyio.sleep(0.5)  # the trainer's update: five times pause_timeout
            assert statuses == [] and proxy.held
            proxy.resume()
        assert statuses == [200]
        finish(store, rid, aid)


# ---------------------------------------------------------------------------------------------- rejections
def assert_openai_error(payload: dict[str, Any], status: int, *words: str) -> None:
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["param"] is None
    for word in words:
        assert word in error["message"]


async def test_unknown_rollout_or_attempt_is_404_and_finished_rollout_is_409(
    http: aiohttp.ClientSession,
) -> None:
    store = TaskStore()
    async with MockVLLM() as mock:
        proxy = make_proxy(store, [mock.url])
        async with serving(proxy):
            rid, aid = claim(store)
            for r_id, a_id, status, word in [
                ("rollout-nope", aid, 404, "rollout-nope"),
                (rid, "attempt-nope", 404, "attempt-nope"),
            ]:
                async with http.post(
                    base_url(proxy, r_id, a_id) + "/chat/completions", json=chat_body()
                ) as r:
                    assert r.status == status
                    assert_openai_error(await r.json(), status, word)
            finish(store, rid, aid)
            async with http.post(base_url(proxy, rid, aid) + "/chat/completions", json=chat_body()) as r:
                assert r.status == 409
                assert_openai_error(await r.json(), 409, rid)
    assert mock.requests == []
    assert proxy.m_calls.value("rejected") == 3


async def test_malformed_json_body_is_400_and_not_forwarded(http: aiohttp.ClientSession) -> None:
    store = TaskStore()
    async with MockVLLM() as mock:
        proxy = make_proxy(store, [mock.url])
        async with serving(proxy):
            rid, aid = claim(store)
            url = base_url(proxy, rid, aid)
            async with http.post(url + "/chat/completions", data=b'{"model": "mock",') as r:
                assert r.status == 400
                assert_openai_error(await r.json(), 400, "not valid JSON")
            async with http.post(url + "/completions", data=b"[1, 2]") as r:
                assert r.status == 400
                assert_openai_error(await r.json(), 400, "JSON object")
    assert mock.requests == []


async def test_oversize_body_is_413(http: aiohttp.ClientSession) -> None:
    store = TaskStore()
    async with MockVLLM() as mock:
        proxy = make_proxy(store, [mock.url], max_request_bytes=1000)
        async with serving(proxy):
            rid, aid = claim(store)
            big = chat_body("x" * 2000)
            async with http.post(base_url(proxy, rid, aid) + "/chat/completions", json=big) as r:
                assert r.status == 413
                assert_openai_error(await r.json(), 413, "1000 bytes")

            async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: caught while reading
                for _ in range(4):
                    yield b" " * 400

            async with http.post(f"{proxy.url}/v1/completions", data=chunks()) as r:
                assert r.status == 413
    assert mock.requests == []


async def test_token_is_required_when_configured_and_never_forwarded(http: aiohttp.ClientSession) -> None:
    store = TaskStore()
    async with MockVLLM() as mock:
        proxy = make_proxy(store, [mock.url], token="s3cret")
        async with serving(proxy):
            rid, aid = claim(store)
            url = base_url(proxy, rid, aid)
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                async with http.post(url + "/chat/completions", json=chat_body(), headers=headers) as r:
                    assert r.status == 401
                    assert_openai_error(await r.json(), 401, "token")
            async with sdk(url, api_key="s3cret") as client:
                await client.chat.completions.create(model="mock", messages=CHAT, max_tokens=1)
    [listing, seen] = mock.requests  # the model listing, read once (the backend's dialect), then the call
    assert listing.path == "/v1/models" and "Authorization" not in seen.headers


async def test_path_escaping_v1_is_refused(http: aiohttp.ClientSession) -> None:
    store = TaskStore()
    async with MockVLLM() as mock:
        proxy = make_proxy(store, [mock.url])
        async with serving(proxy):
            for path in ("/v1/../health", "/v1/%2e%2e/health", "/v1/models/..%2F..%2Fhealth"):
                async with http.get(URL(proxy.url + path, encoded=True)) as r:  # sent as written
                    assert r.status == 400
    assert mock.requests == []


async def test_hop_by_hop_headers_are_dropped_both_ways(http: aiohttp.ClientSession) -> None:
    store = TaskStore()
    hop_response = {"Connection": "X-Hop", "X-Hop": "1", "Keep-Alive": "timeout=5", "Proxy-Foo": "x"}
    async with MockVLLM(response_headers={**hop_response, "X-End-To-End": "kept"}) as mock:
        proxy = make_proxy(store, [mock.url])
        async with serving(proxy):
            rid, aid = claim(store)
            headers = {
                "Connection": "keep-alive, X-Agent-Hop",
                "X-Agent-Hop": "1",
                "Keep-Alive": "timeout=30",
                "TE": "trailers",
                "Proxy-Authorization": "Basic Zm9vOmJhcg==",
                "X-Agent-Header": "kept",
            }
            for stream in (False, True):
                url = base_url(proxy, rid, aid) + "/chat/completions"
                async with http.post(url, json=chat_body(stream=stream), headers=headers) as r:
                    await r.read()
                    assert r.headers["X-End-To-End"] == "kept"
                    assert not {"X-Hop", "Keep-Alive", "Proxy-Foo"} & set(r.headers)
                    assert r.headers.get("Connection", "keep-alive").lower() == "keep-alive"
    for seen in mock.generation_requests():
        assert seen.headers["X-Agent-Header"] == "kept"
        assert not {"X-Agent-Hop", "Keep-Alive", "TE", "Proxy-Authorization"} & set(seen.headers)
        assert seen.headers.get("Connection", "keep-alive").lower() == "keep-alive"
        assert seen.headers["Accept-Encoding"] == "identity"
        assert seen.headers["Host"] == mock.url.removeprefix("http://")


# ---------------------------------------------------------------------------------------------- life cycle
async def test_shutdown_cancels_leftover_calls_and_leaves_no_task_socket_or_connection(
    http: aiohttp.ClientSession,
) -> None:
    store = TaskStore()
    agent_errors: list[BaseException] = []
    async with MockVLLM() as mock:
        proxy = make_proxy(store, [mock.url], shutdown_grace=0.2)
        rid, aid = claim(store)
        before = asyncio.all_tasks()
        async with anyio.create_task_group() as agents:
            async with anyio.create_task_group() as tg:
                await tg.start(proxy.serve)
                port = int(proxy.url.rsplit(":", 1)[1])
                url = base_url(proxy, rid, aid) + "/chat/completions"
                async with http.post(url, json=chat_body(max_tokens=1)) as r:
                    assert r.status == 200  # leaves a pooled upstream connection

                async def stalled_agent() -> None:
                    try:
                        async with http.post(url, json=chat_body()) as r:
                            await r.read()
                    except aiohttp.ClientError as exc:
                        agent_errors.append(exc)

                mock.stall_next()
                agents.start_soon(stalled_agent)
                with anyio.fail_after(2):
                    await mock.wait_until(lambda m: m.active == 1)
                started = time.monotonic()
                tg.cancel_scope.cancel()
        assert time.monotonic() - started < 2.0  # grace (0.2 s) plus closing
        assert len(agent_errors) == 1  # the agent saw its connection close
        with anyio.fail_after(2):
            await mock.wait_until(lambda m: m.cancelled == 1)  # the upstream request was cancelled
        with pytest.raises(OSError):
            await anyio.connect_tcp("127.0.0.1", port)
        # The mock keeps an idle connection's task for 5 s; they end at once only if the proxy closed its pool.
        with anyio.fail_after(1):
            while asyncio.all_tasks() - before:  # noqa: ASYNC110 - nothing to wait on but the tasks' end
                await anyio.sleep(0.01)
        calls = finish(store, rid, aid)
    assert [c.status for c in calls] == ["ok", "failed"] and calls[1].error == "proxy shutting down"


# ---------------------------------------------------------------------------------------- limits and logprobs
def without_max_tokens(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != "max_tokens"}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_the_limit_that_ended_each_response_is_recorded(
    stream: bool, http: aiohttp.ClientSession
) -> None:
    store = TaskStore()
    longer = "hi" + "x" * 15
    window = len(prompt_token_ids(chat_body("hi"))[0]) + 20  # the mock model says 8 tokens, then ends
    bodies = [
        chat_body("hi", max_tokens=4),  # cut at the agent's max_tokens
        without_max_tokens(chat_body("hi")),  # the rest of the window is 20 tokens: the model ends first
        without_max_tokens(chat_body(longer)),  # 5 tokens left in the window: it fills up
        chat_body(longer, max_tokens=8),  # prompt + max_tokens over the window: refused with a 400
    ]
    async with MockVLLM(completion_tokens=8, max_model_len=window) as mock:
        proxy = make_proxy(store, [mock.url])
        async with serving(proxy):
            rid, aid = claim(store)
            statuses = []
            for body in bodies:
                async with http.post(
                    base_url(proxy, rid, aid) + "/chat/completions", json={**body, "stream": stream}
                ) as r:
                    await r.read()
                    statuses.append(r.status)
            calls = finish(store, rid, aid)
    assert statuses == [200, 200, 200, 400]
    assert [(c.status, c.finish_reason, c.limit) for c in calls] == [
        ("ok", "length", "max_tokens"),
        ("ok", "stop", None),
        ("ok", "length", "context"),
        ("failed", None, "context"),
    ]
    assert [len(c.response_token_ids or ()) for c in calls] == [4, 8, 5, 0]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_stop_at_the_max_tokens_the_proxy_filled_in_is_truncated_not_a_full_context(
    stream: bool, http: aiohttp.ClientSession
) -> None:
    """Under AsyncVERL the proxy fills the trainer's max_tokens into calls that omit it: a length stop there
    is the call's limit (``truncated``), not the context window (``context_exceeded``)."""
    store = TaskStore()
    body = without_max_tokens(chat_body("hi"))
    window = len(prompt_token_ids(body)[0]) + 100  # far from full: the mock model would say 8 tokens
    async with MockVLLM(completion_tokens=8, max_model_len=window) as mock:
        proxy = make_proxy(
            store, [mock.url], sampling_of=lambda rollout_id: {"temperature": 1.0, "max_tokens": 4}
        )
        async with serving(proxy):
            rid, aid = claim(store)
            async with http.post(
                base_url(proxy, rid, aid) + "/chat/completions", json={**body, "stream": stream}
            ) as r:
                assert r.status == 200
                await r.read()
            [call] = finish(store, rid, aid)
    assert mock.generation_requests()[0].json["max_tokens"] == 4
    assert (call.status, call.finish_reason, call.limit) == (
        "ok",
        "length",
        "max_tokens",
    )  # before: "context"
    assert termination_of(store.record(rid)) == frozenset({"truncated"})


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("path", ["chat/completions", "completions"])
async def test_request_logprobs_asks_the_backend_unless_the_agent_decided(
    path: str, stream: bool, http: aiohttp.ClientSession
) -> None:
    store = TaskStore()
    ask = (
        chat_body("hi") if path == "chat/completions" else {"model": "mock", "prompt": "hi", "max_tokens": 4}
    )
    async with MockVLLM() as mock:
        proxy = make_proxy(store, [mock.url], request_logprobs=True)
        async with serving(proxy):
            rid, aid = claim(store)
            for body in ({**ask, "stream": stream}, {**ask, "stream": stream, "logprobs": False}):
                async with http.post(f"{base_url(proxy, rid, aid)}/{path}", json=body) as r:
                    assert r.status == 200
                    await r.read()
            calls = finish(store, rid, aid)
    asked, declined = (seen.json for seen in mock.generation_requests())
    assert asked["logprobs"] == (True if path == "chat/completions" else 0) and declined["logprobs"] is False
    assert calls[0].response_token_ids is not None
    assert calls[0].logprobs == [token_logprob(t) for t in calls[0].response_token_ids]
    assert calls[1].logprobs is None and calls[1].response_token_ids is not None


async def test_a_stream_goes_to_the_agent_in_one_write_per_upstream_read(
    http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend that sends its events in bursts (eight per write, a pause between): each burst the proxy reads
    at once goes to the agent in one write, however many events it holds, recorded stream or not."""
    bursts, per_burst = 6, 8

    async def bursty(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        ids = itertools.count(1)
        for _ in range(bursts):
            events = b"".join(
                b"data: "
                + orjson.dumps(
                    {"choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [next(ids)]}]}
                )
                + b"\n\n"
                for _ in range(per_burst)
            )
            await response.write(events)
            await anyio.sleep(0.05)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", bursty)
    backend = HttpListener(app, "127.0.0.1", 0)
    url = await backend.start()
    writes: list[int] = []
    original = Exchange.write  # what the proxy writes a streamed answer's pieces with

    async def counted(self: Exchange, data: bytes) -> None:
        if data:
            writes.append(data.count(b"data: "))
        await original(self, data)

    try:
        store = TaskStore()
        proxy = make_proxy(store, [url])
        async with serving(proxy):
            rid, aid = claim(store)
            monkeypatch.setattr(Exchange, "write", counted)
            async with http.post(
                base_url(proxy, rid, aid) + "/chat/completions", json=chat_body(stream=True)
            ) as r:
                assert r.status == 200
                await r.read()
            monkeypatch.undo()
            [record] = finish(store, rid, aid)
    finally:
        await backend.stop()
    assert sum(writes) == bursts * per_burst + 1 and len(writes) <= bursts + 1  # a write per burst read
    assert record.response_token_ids == list(range(1, bursts * per_burst + 1))
