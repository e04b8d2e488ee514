"""MockVLLM: the vLLM look-alike the proxy tests and benchmark rely on."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import anyio
import orjson
import pytest

from aglverl.testing import MockVLLM, completion_token_ids, load_replay_cases, prompt_token_ids

pytestmark = pytest.mark.anyio

FIXTURES = Path(__file__).parent / "fixtures" / "vllm"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_answers_are_vllm_shaped_with_ids_only_when_asked() -> None:
    body = {"model": "mock", "prompt": [5, 6, 7], "max_tokens": 3, "n": 2, "logprobs": 1}
    async with MockVLLM() as mock, aiohttp.ClientSession() as http:
        async with http.post(f"{mock.url}/v1/completions", json={**body, "return_token_ids": True}) as r:
            with_ids = await r.json()
        async with http.post(f"{mock.url}/v1/completions", json=body) as r:
            without = await r.json()
    for i, choice in enumerate(with_ids["choices"]):
        assert choice["prompt_token_ids"] == [5, 6, 7] == prompt_token_ids(body)[0]
        assert choice["token_ids"] == completion_token_ids([5, 6, 7], i, 3)
        assert len(choice["logprobs"]["token_logprobs"]) == 3
    assert all(c["token_ids"] is None and c["prompt_token_ids"] is None for c in without["choices"])
    assert with_ids["usage"] == {"prompt_tokens": 3, "total_tokens": 9, "completion_tokens": 6}


async def test_stream_interleaves_choices_and_ends_with_usage_and_done() -> None:
    body = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 2}
    body |= {"stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    async with MockVLLM() as mock, aiohttp.ClientSession() as http:
        async with http.post(f"{mock.url}/v1/chat/completions", json=body) as r:
            assert r.headers["Content-Type"] == "text/event-stream; charset=utf-8"
            raw = await r.read()
    events = raw.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    chunks = [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    assert [c["choices"][0]["index"] for c in chunks[:-1]] == [0, 1, 0, 1, 0, 1]
    assert chunks[0]["prompt_token_ids"] == prompt_token_ids(body)[0]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


async def test_replay_serves_recorded_bytes_whatever_return_token_ids_says() -> None:
    cases = load_replay_cases(FIXTURES)
    case = cases["chat_no_token_ids"]
    async with MockVLLM(replay_dir=FIXTURES) as mock, aiohttp.ClientSession() as http:
        async with http.post(mock.url + case.path, json={**case.body, "return_token_ids": True}) as r:
            assert r.status == case.status and await r.read() == case.response
        async with http.post(mock.url + case.path, json={"model": "other"}) as r:
            assert r.status == 404


async def test_faults_apply_to_the_next_calls_in_order() -> None:
    body = {"model": "mock", "prompt": "x", "max_tokens": 1}
    async with MockVLLM() as mock, aiohttp.ClientSession() as http:
        mock.fail_next(1, status=503)
        mock.throttle_next(1, retry_after=2)
        statuses = []
        for _ in range(3):
            async with http.post(f"{mock.url}/v1/completions", json=body) as r:
                statuses.append((r.status, r.headers.get("Retry-After")))
        assert statuses == [(503, None), (429, "2"), (200, None)]
        mock.stall_next()

        async def stalled() -> None:
            async with http.post(f"{mock.url}/v1/completions", json=body) as r:
                await r.read()

        async with anyio.create_task_group() as tg:
            tg.start_soon(stalled)
            with anyio.fail_after(2):
                await mock.wait_until(lambda m: m.active == 1)
            tg.cancel_scope.cancel()
        with anyio.fail_after(2):
            await mock.wait_until(lambda m: m.cancelled == 1)


async def test_models_and_health_answer_and_a_stopped_mock_restarts_on_its_port() -> None:
    mock = MockVLLM(model="tiny")
    async with mock, aiohttp.ClientSession() as http:
        port = mock.port
        async with http.get(f"{mock.url}/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == "tiny"
    with pytest.raises(OSError):
        await anyio.connect_tcp("127.0.0.1", port)
    async with MockVLLM(port=port) as again, aiohttp.ClientSession() as http:
        async with http.get(f"{again.url}/health") as r:
            assert r.status == 200
