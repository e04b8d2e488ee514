"""The embedded inference server on loopback: vLLM's shapes, batching, sampling, weights, sleep, shutdown."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import openai
import orjson
import pytest
import torch

from aglverl import LLM, AgentDaemon, BatchConfig, run_agents
from aglverl.engine.server import SHUTDOWN_GRACE, InferenceServer
from aglverl.engine.thread import InferenceServerThread
from aglverl.testing import load_replay_cases

pytestmark = pytest.mark.anyio

FIXTURES = Path(__file__).parent / "fixtures" / "vllm"
CASES = load_replay_cases(FIXTURES)


@pytest.fixture
async def server(tiny_model: Path) -> AsyncIterator[InferenceServer]:
    async with InferenceServer(tiny_model, served_model_name="tiny", seed=0) as s:
        yield s


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def _post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    """Status and parsed answer: a JSON body, or for SSE the list of events (``"[DONE]"`` kept as a string)."""
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with http.post(url, data=data, headers={"Content-Type": "application/json"}) as resp:
        raw = await resp.read()
        if resp.content_type == "text/event-stream":
            return resp.status, _events(raw)
        return resp.status, orjson.loads(raw)


def _events(raw: bytes) -> list[Any]:
    out: list[Any] = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            payload = block.removeprefix("data: ")
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def _shape(value: Any, key: str | None = None) -> Any:
    """Keys, types and nesting of a JSON value; completions' token-keyed ``top_logprobs`` maps are one shape."""
    if isinstance(value, dict):
        if key == "top_logprobs[]":
            return {"<token>": "float"}
        return {k: _shape(v, k) for k, v in value.items()}
    if isinstance(value, list):
        inner = "top_logprobs[]" if key == "top_logprobs" else key
        shapes: list[Any] = []
        for item in value:
            s = _shape(item, inner)
            if s not in shapes:
                shapes.append(s)
        return shapes
    if value is None:
        return "null"
    return type(value).__name__


def _ours(case_name: str) -> tuple[str, dict[str, Any]]:
    case = CASES[case_name]
    body = dict(case.body)
    if case.status == 200:
        body["ignore_eos"] = (
            True  # the recorded answers all ran to max_tokens; ours must too, to compare chunks
        )
    return case.path, body


# ---------------------------------------------------------------------------------------------- vLLM shapes
@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c.status == 200))
async def test_answers_have_vllms_shape(
    server: InferenceServer, http: aiohttp.ClientSession, name: str
) -> None:
    case = CASES[name]
    path, body = _ours(name)
    status, ours = await _post(http, server.url + path, body)
    recorded = _events(case.response) if case.streamed else orjson.loads(case.response)
    assert status == 200
    if case.streamed:  # event by event: same count, order, keys and types
        assert [_shape(e) for e in ours] == [_shape(e) for e in recorded]
    else:
        assert _shape(ours) == _shape(recorded)
        assert [c["finish_reason"] for c in ours["choices"]] == [
            c["finish_reason"] for c in recorded["choices"]
        ]
        assert ours["usage"]["completion_tokens"] == recorded["usage"]["completion_tokens"]
        if body.get("return_token_ids"):
            assert all(len(c["token_ids"]) == body["max_tokens"] for c in ours["choices"])


async def test_chat_prompt_ids_are_the_chat_template_encoding(
    server: InferenceServer, http: aiohttp.ClientSession
) -> None:
    path, body = _ours("chat_plain")
    _, answer = await _post(http, server.url + path, body)
    text = server.tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
    assert answer["prompt_token_ids"] == server.tokenizer.encode(text, add_special_tokens=False)
    assert answer["usage"]["prompt_tokens"] == len(answer["prompt_token_ids"])
    assert answer["choices"][0]["message"]["content"] == server.tokenizer.decode(
        answer["choices"][0]["token_ids"]
    )


async def test_streamed_chunks_carry_each_tokens_id_and_add_up_to_the_plain_answer(
    server: InferenceServer, http: aiohttp.ClientSession
) -> None:
    body = {"model": "tiny", "prompt": "The answer is", "max_tokens": 12, "seed": 5, "ignore_eos": True}
    body |= {"return_token_ids": True, "logprobs": 2}
    _, plain = await _post(http, server.url + "/v1/completions", body)
    _, events = await _post(http, server.url + "/v1/completions", {**body, "stream": True})
    chunks = [e["choices"][0] for e in events[:-1]]
    assert events[-1] == "[DONE]"
    assert all(len(c["token_ids"]) == 1 for c in chunks)
    assert chunks[0]["prompt_token_ids"] == plain["choices"][0]["prompt_token_ids"]
    assert all(c["prompt_token_ids"] is None for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == plain["choices"][0]["token_ids"]
    assert "".join(c["text"] for c in chunks) == plain["choices"][0]["text"]
    lps = [v for c in chunks for v in c["logprobs"]["token_logprobs"]]
    assert lps == plain["choices"][0]["logprobs"]["token_logprobs"]


async def test_stream_n2_interleaves_choices_by_index(
    server: InferenceServer, http: aiohttp.ClientSession
) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Count."}], "max_tokens": 5, "n": 2}
    body |= {"stream": True, "return_token_ids": True, "seed": 1, "ignore_eos": True}
    _, events = await _post(http, server.url + "/v1/chat/completions", body)
    indices = [e["choices"][0]["index"] for e in events[:-1]]
    assert indices == [0, 1] * 6  # role chunks, then one chunk per token per choice
    ids = {
        i: [t for e in events[2:-1] if e["choices"][0]["index"] == i for t in e["choices"][0]["token_ids"]]
        for i in (0, 1)
    }
    assert ids[0] != ids[1]  # seeded choices draw from their own streams


async def test_top_logprobs_list_the_most_likely_alternatives(
    server: InferenceServer, http: aiohttp.ClientSession
) -> None:
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Say yes."}],
        "max_completion_tokens": 3,
    }
    chat |= {"logprobs": True, "top_logprobs": 3, "temperature": 0, "ignore_eos": True}
    _, answer = await _post(http, server.url + "/v1/chat/completions", chat)
    content = answer["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for entry in content:
        values = [alt["logprob"] for alt in entry["top_logprobs"]]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert entry["logprob"] == values[0]  # greedy took the most likely token
        assert entry["bytes"] == list(entry["token"].encode())
    completion = _greedy(max_tokens=3, logprobs=2, stream=True, stream_options={"include_usage": True})
    _, events = await _post(http, server.url + "/v1/completions", completion)
    assert events[-2]["usage"]["completion_tokens"] == 3 and events[-2]["choices"] == []
    tops = [e["choices"][0]["logprobs"]["top_logprobs"][0] for e in events[:-2]]
    assert all(1 <= len(t) <= 3 for t in tops)  # the sampled token plus the top 2 (it is one of them here)


@pytest.mark.parametrize("name", ["error_too_long", "error_unknown_model"])
async def test_errors_have_vllms_shape(
    server: InferenceServer, http: aiohttp.ClientSession, name: str
) -> None:
    case = CASES[name]
    status, ours = await _post(http, server.url + case.path, case.body)
    recorded = orjson.loads(case.response)
    assert status == case.status
    assert _shape(ours) == _shape(recorded)
    assert {k: ours["error"][k] for k in ("type", "param", "code")} == {
        k: recorded["error"][k] for k in ("type", "param", "code")
    }
    if name == "error_unknown_model":
        assert ours == recorded  # same served name, so the same message


async def test_token_ids_only_when_asked(server: InferenceServer, http: aiohttp.ClientSession) -> None:
    _, answer = await _post(http, server.url + "/v1/chat/completions", CASES["chat_no_token_ids"].body)
    assert answer["prompt_token_ids"] is None and answer["choices"][0]["token_ids"] is None
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    _, events = await _post(http, server.url + "/v1/chat/completions", body)
    assert all("prompt_token_ids" not in e and "token_ids" not in e["choices"][0] for e in events[:-1])


async def test_models_health_and_metrics(server: InferenceServer, http: aiohttp.ClientSession) -> None:
    async with http.get(server.url + "/v1/models") as resp:
        models = await resp.json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == 1024
    async with http.get(server.url + "/health") as resp:
        health = await resp.json()
    assert resp.status == 200 and health["status"] == "ok" and health["weight_version"] == 0
    async with http.get(server.url + "/metrics") as resp:
        assert "aglverl_inference_generated_tokens" in await resp.text()


# ---------------------------------------------------------------------------------------------- bad input
BAD_REQUESTS = [
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [', "body"),
    ("/v1/chat/completions", b"[1, 2]", "body"),
    ("/v1/chat/completions", {"model": "tiny"}, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": "2"}, "n"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
        "temperature",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "temperature": -1},
        "temperature",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2.5},
        "max_tokens",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": [1]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "seed": "s"}, "seed"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        "top_logprobs",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, "a"]}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": []}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [5, 512]}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [5, -1]}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "echo": True}, "echo"),
    ("/v1/completions", {"model": "tiny", "prompt": [5] * 1024}, "input_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": [5] * 1000, "max_tokens": 30}, "max_tokens"),
]


@pytest.mark.parametrize(
    ("path", "body", "param"), BAD_REQUESTS, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD_REQUESTS)]
)
async def test_bad_requests_get_400_naming_the_field(
    server: InferenceServer, http: aiohttp.ClientSession, path: str, body: Any, param: str
) -> None:
    status, answer = await _post(http, server.url + path, body)
    assert status == 400
    error = answer["error"]
    assert error["param"] == param and error["type"] == "BadRequestError" and error["code"] == 400
    assert param in error["message"] or param == "body"
    assert server.stats().sequences == 0  # nothing reached the engine


async def test_a_body_over_the_limit_is_413(tiny_model: Path, http: aiohttp.ClientSession) -> None:
    async with InferenceServer(tiny_model, served_model_name="tiny", max_body_bytes=1000) as server:
        status, answer = await _post(http, server.url + "/v1/completions", {"prompt": "x" * 2000})
    assert status == 413 and answer["error"]["type"] == "RequestTooLargeError"


async def test_unknown_model_is_404_and_an_omitted_model_is_the_served_one(
    server: InferenceServer, http: aiohttp.ClientSession
) -> None:
    status, answer = await _post(http, server.url + "/v1/completions", {"model": "other", "prompt": "x"})
    assert status == 404 and answer["error"]["param"] == "model"
    status, answer = await _post(http, server.url + "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 200 and answer["model"] == "tiny"


# ---------------------------------------------------------------------------------------------- sampling
def _greedy(prompt: Any = "The answer is", max_tokens: int = 16, **extra: Any) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0}
    return body | {"return_token_ids": True, "ignore_eos": True} | extra


async def test_greedy_is_deterministic_alone_and_in_a_batch(
    server: InferenceServer, http: aiohttp.ClientSession
) -> None:
    url = server.url + "/v1/completions"
    _, first = await _post(http, url, _greedy())
    _, second = await _post(http, url, _greedy())
    answers: list[Any] = []

    async def one(body: dict[str, Any]) -> None:
        answers.append((body, (await _post(http, url, body))[1]))

    async with anyio.create_task_group() as tg:
        for i in range(5):
            tg.start_soon(one, _greedy())
            tg.start_soon(one, _greedy(prompt=list(range(3, 10 + i)), temperature=1.0, seed=i))
    ids = first["choices"][0]["token_ids"]
    assert second["choices"][0]["token_ids"] == ids
    assert [a["choices"][0]["token_ids"] for b, a in answers if b["temperature"] == 0] == [ids] * 5
    # Greedy picks the argmax and reports log_softmax(logits) there (temperature 0 counts as 1).
    top = first["choices"][0]["logprobs"]
    with torch.inference_mode():
        full = torch.tensor([first["choices"][0]["prompt_token_ids"] + ids])
        logits = server.model(full).logits[0, len(full[0]) - len(ids) - 1 : -1]
    assert logits.argmax(-1).tolist() == ids
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(top["token_logprobs"]), expected, atol=1e-4)


async def test_logprobs_are_log_softmax_of_logits_over_temperature(
    server: InferenceServer, http: aiohttp.ClientSession
) -> None:
    body = _greedy(temperature=0.7, seed=11, max_tokens=10)
    _, answer = await _post(http, server.url + "/v1/completions", body)
    choice = answer["choices"][0]
    ids = choice["token_ids"]
    with torch.inference_mode():
        full = torch.tensor([choice["prompt_token_ids"] + ids])
        logits = server.model(full).logits[0, -len(ids) - 1 : -1]
    expected = torch.log_softmax(logits / 0.7, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(choice["logprobs"]["token_logprobs"]), expected, atol=1e-4)


async def test_seed_makes_sampling_reproducible(server: InferenceServer, http: aiohttp.ClientSession) -> None:
    url = server.url + "/v1/chat/completions"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Say yes."}], "max_tokens": 12}
    body |= {"temperature": 1.0, "top_p": 0.9, "return_token_ids": True, "ignore_eos": True}
    runs = [
        (await _post(http, url, body | {"seed": seed}))[1]["choices"][0]["token_ids"] for seed in (1, 1, 2)
    ]
    assert runs[0] == runs[1] != runs[2]
    _, n2 = await _post(http, url, body | {"seed": 1, "n": 2})
    assert n2["choices"][0]["token_ids"] == runs[0]  # choice 0 of a seeded request = the n=1 answer
    assert n2["choices"][1]["token_ids"] != runs[0]


async def test_stop_string_truncates_text_and_keeps_the_completing_token(
    server: InferenceServer, http: aiohttp.ClientSession
) -> None:
    url = server.url + "/v1/completions"
    _, free = await _post(http, url, _greedy(max_tokens=24))
    text, ids = free["choices"][0]["text"], free["choices"][0]["token_ids"]
    pieces = [server.tokenizer.decode(ids[: k + 1]) for k in range(len(ids))]
    k = next(k for k in range(3, len(ids)) if pieces[k].isascii() and len(pieces[k]) > len(pieces[k - 1]) + 1)
    stop = pieces[k][len(pieces[k - 1]) - 1 : len(pieces[k - 1]) + 1]  # straddles tokens k-1 and k
    at = text.find(stop)
    for stream in (False, True):
        _, answer = await _post(http, url, _greedy(max_tokens=24, stop=[stop, "never-there"], stream=stream))
        if stream:
            chunks = [e["choices"][0] for e in answer[:-1]]
            got_text = "".join(c["text"] for c in chunks)
            got_ids = [t for c in chunks for t in c["token_ids"]]
            last = chunks[-1]
        else:
            last = answer["choices"][0]
            got_text, got_ids = last["text"], last["token_ids"]
        assert got_text == text[:at]
        assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop)
        ends = next(j for j in range(len(ids)) if stop in server.tokenizer.decode(ids[: j + 1]))
        assert got_ids == ids[: ends + 1]


async def test_stop_token_ends_with_its_id_in_token_ids_but_not_in_text(
    server: InferenceServer, http: aiohttp.ClientSession
) -> None:
    url = server.url + "/v1/completions"
    _, free = await _post(http, url, _greedy(max_tokens=12))
    ids = free["choices"][0]["token_ids"]
    stop_id = ids[4]
    first = ids.index(stop_id)
    for stream in (False, True):
        _, answer = await _post(http, url, _greedy(max_tokens=12, stop_token_ids=[stop_id], stream=stream))
        if stream:
            chunks = [e["choices"][0] for e in answer[:-1]]
            got = {
                "token_ids": [t for c in chunks for t in c["token_ids"]],
                "text": "".join(c["text"] for c in chunks),
            }
            got |= {k: chunks[-1][k] for k in ("finish_reason", "stop_reason")}
        else:
            got = answer["choices"][0]
        assert got["token_ids"] == ids[: first + 1]
        assert got["text"] == server.tokenizer.decode(ids[:first])
        assert (got["finish_reason"], got["stop_reason"]) == ("stop", stop_id)


async def test_eos_from_the_generation_config_ends_a_sequence_like_vllm(
    tiny_model: Path, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    async with InferenceServer(tiny_model, served_model_name="tiny") as plain:
        _, free = await _post(http, plain.url + "/v1/completions", _greedy(max_tokens=10, ignore_eos=False))
    ids = free["choices"][0]["token_ids"]
    eos = ids[3]
    model_dir = tmp_path / "eos"
    shutil.copytree(tiny_model, model_dir)
    config = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps(config | {"eos_token_id": [2, eos]}))
    async with InferenceServer(model_dir, served_model_name="tiny") as server:
        _, answer = await _post(
            http, server.url + "/v1/completions", _greedy(max_tokens=10, ignore_eos=False)
        )
        _, ignored = await _post(http, server.url + "/v1/completions", _greedy(max_tokens=10))
    choice = answer["choices"][0]
    end = ids.index(eos)
    assert choice["token_ids"] == ids[: end + 1]  # the EOS id is kept, as vLLM keeps it
    assert choice["text"] == server.tokenizer.decode(ids[:end])  # but it is no text
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
    assert len(choice["logprobs"]["token_logprobs"]) == end + 1
    assert ignored["choices"][0]["token_ids"] == ids  # ignore_eos generates through it


# ---------------------------------------------------------------------------------------------- batching
async def test_concurrent_requests_are_batched(tiny_model: Path, http: aiohttp.ClientSession) -> None:
    async with InferenceServer(tiny_model, served_model_name="tiny", batch_wait=0.05) as server:
        url = server.url + "/v1/chat/completions"
        body = {"model": "tiny", "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
        answers = []

        async def one(i: int) -> None:
            answers.append(
                (await _post(http, url, body | {"messages": [{"role": "user", "content": f"q{i}"}]}))[1]
            )

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(one, i)
        stats = server.stats()
        assert len(answers) == 8 and all(len(a["choices"][0]["token_ids"]) == 8 for a in answers)
        assert stats.requests == 8 and stats.sequences == 8 and stats.generated_tokens == 64
        assert stats.prefill_batches < 8 and stats.largest_batch >= 2
        assert stats.decode_steps < 8 * 7  # decode steps were shared
        # The n choices of one request are one prefill.
        _, answer = await _post(http, url, body | {"messages": [{"role": "user", "content": "n"}], "n": 4})
        after = server.stats()
        assert len(answer["choices"]) == 4
        assert (
            after.prefill_batches == stats.prefill_batches + 1
            and after.prompt_tokens - stats.prompt_tokens == len(answer["prompt_token_ids"])
        )
        assert after.decode_steps == stats.decode_steps + 7


async def test_a_request_arriving_mid_generation_joins_the_running_batch(
    server: InferenceServer, http: aiohttp.ClientSession
) -> None:
    url = server.url + "/v1/completions"
    long = _greedy(max_tokens=200, stream=True)
    async with http.post(url, json=long) as resp:
        await resp.content.readuntil(b"\n\n")  # the long one is generating
        started = server.stats().generation_runs
        _, short = await _post(http, url, _greedy(prompt=[7, 8, 9], max_tokens=4))
        _, single = await _post(http, url, _greedy(prompt=[7, 8], max_tokens=1))  # done at its prefill
        _, two = await _post(http, url, _greedy(prompt=[7], max_tokens=2, n=2))
        assert server.stats().generation_runs == started  # they joined instead of waiting for the next run
        assert server.stats().largest_batch == 3
        rest = _events(await resp.read())
    assert rest[-1] == "[DONE]" and len(rest) == 200
    assert len(short["choices"][0]["token_ids"]) == 4 and len(single["choices"][0]["token_ids"]) == 1
    assert [len(c["token_ids"]) for c in two["choices"]] == [2, 2]


# ---------------------------------------------------------------------------------------------- in-process API
async def test_generate_ids_matches_the_http_answer(
    server: InferenceServer, http: aiohttp.ClientSession
) -> None:
    prompt = [5, 17, 42, 99]
    ids, logprobs, finish = await server.generate_ids(
        prompt, {"temperature": 0, "max_tokens": 9, "ignore_eos": True, "logprobs": True, "top_k": -1}
    )
    _, answer = await _post(http, server.url + "/v1/completions", _greedy(prompt=prompt, max_tokens=9))
    assert ids == answer["choices"][0]["token_ids"] and finish == "length"
    assert logprobs == answer["choices"][0]["logprobs"]["token_logprobs"]
    ids2, none, _ = await server.generate_ids(prompt, {"temperature": 0, "max_tokens": 9, "ignore_eos": True})
    assert ids2 == ids and none is None
    with pytest.raises(ValueError, match="top_k"):
        await server.generate_ids(prompt, {"top_k": 5})
    with pytest.raises(ValueError, match="max_tokens"):
        await server.generate_ids(prompt, {"max_tokens": 5000})
    with pytest.raises(ValueError, match="prompt_ids"):
        await server.generate_ids([600], {})


# ---------------------------------------------------------------------------------------------- weights
def _scaled(server: InferenceServer, factor: float) -> list[tuple[str, torch.Tensor]]:
    """Every parameter under its Hugging Face name (tied embeddings under both names), times ``factor``."""
    return [
        (n, p.detach().clone() * factor) for n, p in server.model.named_parameters(remove_duplicate=False)
    ]


async def test_load_weights_changes_the_next_answer_and_bumps_the_version(
    server: InferenceServer, http: aiohttp.ClientSession
) -> None:
    url = server.url + "/v1/completions"
    _, before = await _post(http, url, _greedy())
    original = _scaled(server, 1.0)
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= {n for n, _ in original}
    # From another thread, as verl's worker calls it.
    count = await anyio.to_thread.run_sync(server.load_weights, _scaled(server, 1.5), 7)
    assert count == len(original) and server.weight_version == 7
    _, after = await _post(http, url, _greedy())
    assert after["choices"][0]["logprobs"] != before["choices"][0]["logprobs"]
    async with http.get(server.url + "/health") as resp:
        health = await resp.json()
    assert health["weight_version"] == 7 and health["weight_loads"] == 1
    assert await server.update_weights(original, 8) == len(original)
    _, restored = await _post(http, url, _greedy())
    assert restored["choices"][0] == before["choices"][0]
    with pytest.raises(KeyError, match="unknown parameter"):
        server.load_weights([("model.nope.weight", torch.zeros(1))], 9)
    with pytest.raises(ValueError, match="shape"):
        server.load_weights([("model.norm.weight", torch.zeros(3))], 9)
    assert server.weight_version == 8


async def test_load_weights_waits_for_the_running_generation(
    server: InferenceServer, http: aiohttp.ClientSession
) -> None:
    url = server.url + "/v1/completions"
    body = _greedy(max_tokens=150)
    _, reference = await _post(http, url, body)
    events: list[str] = []
    async with http.post(url, json=body | {"stream": True}) as resp:
        await resp.content.readuntil(b"\n\n")
        async with anyio.create_task_group() as tg:

            async def load() -> None:
                await server.update_weights(_scaled(server, 1.5), 1)
                events.append("loaded")

            tg.start_soon(load)
            streamed = _events(await resp.read())
            events.append("stream finished")
    assert events == ["stream finished", "loaded"]
    chunks = [e["choices"][0] for e in streamed[:-1]]
    ids = [t for c in chunks for t in c["token_ids"]]
    first = reference["choices"][0]
    assert ids == first["token_ids"][1:]  # (the first chunk was read before)
    lps = [v for c in chunks for v in c["logprobs"]["token_logprobs"]]
    assert lps == first["logprobs"]["token_logprobs"][1:]  # old weights to the last token


# ---------------------------------------------------------------------------------------------- sleep
async def test_requests_during_sleep_wait_for_wake_up(
    server: InferenceServer, http: aiohttp.ClientSession
) -> None:
    server.sleep()
    server.sleep()
    assert server.sleeping
    done = anyio.Event()
    answers: list[Any] = []

    async def ask() -> None:
        answers.append(await _post(http, server.url + "/v1/completions", _greedy(max_tokens=3)))
        done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(ask)
        with anyio.move_on_after(0.3):
            await done.wait()
        assert not done.is_set()  # parked, not failed
        async with http.get(server.url + "/health") as resp:
            health = await resp.json()
        assert health["sleeping"] and health["sleep_calls"] == 2 and health["pending_sequences"] == 1
        assert server.load_weights(_scaled(server, 1.0), 3) > 0  # weights load while asleep
        await anyio.to_thread.run_sync(server.wake_up)
    assert answers[0][0] == 200
    server.wake_up()
    stats = server.stats()
    assert (stats.sleeping, stats.sleep_calls, stats.wake_up_calls, stats.weight_version) == (False, 2, 2, 3)


# ---------------------------------------------------------------------------------------------- shutdown
def _our_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("aglverl-")]


async def test_leaving_the_block_cancels_in_flight_work_and_leaves_no_thread(
    tiny_model: Path, http: aiohttp.ClientSession
) -> None:
    assert _our_threads() == []
    errors: list[BaseException] = []
    async with anyio.create_task_group() as tg:
        server = InferenceServer(tiny_model, served_model_name="tiny")
        async with server:
            url = server.url
            assert "aglverl-generate" in _our_threads()

            async def in_process() -> None:
                try:
                    await server.generate_ids([5, 6], {"max_tokens": 1000, "ignore_eos": True})
                except RuntimeError as exc:
                    errors.append(exc)

            tg.start_soon(in_process)
            resp = await http.post(url + "/v1/completions", json=_greedy(max_tokens=1000, stream=True))
            await resp.content.readuntil(b"\n\n")
            left = time.monotonic()
        stopped_in = time.monotonic() - left
    assert stopped_in < SHUTDOWN_GRACE + 3
    with pytest.raises(aiohttp.ClientError):
        await resp.read()  # the stream was cut, not finished
    resp.release()
    assert len(errors) == 1 and "stopped" in str(errors[0])
    assert _our_threads() == []
    host, port = url.removeprefix("http://").split(":")
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=1).close()


def test_thread_runner_hosts_the_server_for_a_foreign_process(tiny_model: Path) -> None:
    server = InferenceServer(tiny_model, served_model_name="tiny")
    with InferenceServerThread(server) as runner:
        assert sorted(_our_threads()) == ["aglverl-generate", "aglverl-inference-loop"]

        async def use() -> tuple[int, Any]:
            async with aiohttp.ClientSession() as session:
                status = (await _post(session, runner.url + "/v1/completions", _greedy(max_tokens=4)))[0]
            return status, await server.generate_ids([5, 6, 7], {"max_tokens": 4, "temperature": 0})

        # Another event loop, in another thread, uses the server: HTTP and the in-process API.
        status, (ids, _, finish) = asyncio.run(use())
        assert status == 200 and len(ids) == 4 and finish == "length"
        server.sleep()
        server.load_weights(_scaled(server, 1.0), 5)
        server.wake_up()
        assert asyncio.run(server.generate_ids([5, 6, 7], {"max_tokens": 4, "temperature": 0}))[0] == ids
    assert _our_threads() == []
    assert server.weight_version == 5


def test_thread_runner_reports_a_failed_start(tiny_model: Path) -> None:
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    try:
        server = InferenceServer(tiny_model, port=blocker.getsockname()[1])
        with pytest.raises(RuntimeError, match="failed to start"):
            InferenceServerThread(server).start()
    finally:
        blocker.close()
    assert _our_threads() == []


# ---------------------------------------------------------------------------------------------- behind the daemon
def _sdk_agent(stream: bool, seen: list[dict[str, Any]]):
    """An agent using the official openai SDK on its rollout's proxy URL; notes what the server sent it."""

    async def agent(task_input: Any, llm: LLM) -> float:
        client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": f"Say {task_input['word']}."}]
        try:
            if stream:
                ids: list[int] = []
                prompt_ids = None
                parts = []
                async for chunk in await client.chat.completions.create(
                    model=llm.model, messages=messages, max_tokens=8, stream=True
                ):
                    extra = chunk.model_extra or {}
                    prompt_ids = prompt_ids or extra.get("prompt_token_ids")
                    for choice in chunk.choices:
                        ids += (choice.model_extra or {}).get("token_ids") or []
                        parts.append(choice.delta.content or "")
                content = "".join(parts)
            else:
                reply = await client.chat.completions.create(model=llm.model, messages=messages, max_tokens=8)
                prompt_ids = (reply.model_extra or {})["prompt_token_ids"]
                ids = (reply.choices[0].model_extra or {})["token_ids"]
                content = reply.choices[0].message.content or ""
        finally:
            await client.close()
        seen.append({"prompt": prompt_ids, "ids": ids, "content": content})
        return 1.0

    return agent


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_openai_sdk_through_the_daemon_yields_the_servers_ids(tiny_model: Path, stream: bool) -> None:
    batch_config = BatchConfig(max_prompt_length=64, max_response_length=8)
    seen: list[dict[str, Any]] = []
    async with (
        InferenceServer(tiny_model, served_model_name="tiny") as server,
        AgentDaemon(
            backends=[server.url],
            model=server.served_model_name,
            vocab_size=server.vocab_size,
            batch=batch_config,
        ) as daemon,
    ):
        assert daemon.main_llm().model == "tiny"
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run_agents(daemon.server_url, _sdk_agent(stream, seen), concurrency=4))
            await daemon.submit([{"word": "yes"}, {"word": "no"}], n=2)
            with anyio.fail_after(30):
                batch = await daemon.batches.receive()
            tg.cancel_scope.cancel()
        assert server.stats().sequences == 4
    data = batch.data
    assert len(data) == 4 and len(seen) == 4
    rows = []
    mask = data.batch["attention_mask"][:, : batch_config.max_prompt_length].bool()
    for row in range(len(data)):
        prompt = data.batch["prompts"][row][mask[row]].tolist()
        response = data.batch["responses"][row][: int(data.batch["response_mask"][row].sum())].tolist()
        rows.append((prompt, response))
    assert sorted(rows) == sorted((s["prompt"], s["ids"]) for s in seen)
    for s in seen:  # the ids are the server's own: they decode to the text the agent received
        assert server.tokenizer.decode(s["ids"], skip_special_tokens=True) == s["content"]
        assert 1 <= len(s["ids"]) <= 8


async def test_a_client_that_goes_away_frees_its_batch_row(
    server: InferenceServer, http: aiohttp.ClientSession
) -> None:
    resp = await http.post(server.url + "/v1/completions", json=_greedy(max_tokens=1000, stream=True))
    await resp.content.readuntil(b"\n\n")
    resp.close()  # the agent vanished mid-stream
    _, after = await _post(http, server.url + "/v1/completions", _greedy(max_tokens=2))
    assert after["choices"][0]["finish_reason"] == "length"
    assert server.stats().generated_tokens < 200  # the abandoned sequence stopped costing compute


# ---------------------------------------------------------------------------------------------- abort and resume
@pytest.fixture
async def paired(tiny_model: Path) -> AsyncIterator[InferenceServer]:
    """A server whose idle engine waits (up to a minute) for a second sequence before it starts a batch: two
    requests of one sequence each, or one request with ``n=2``, that reach it idle are admitted together. A
    streamed partner then tells when its companion is running: when the stream's first chunk arrives.

    Idle means between runs, which the answers of earlier requests do not tell: an answer goes out with its
    last token, before its run ends, and a request arriving meanwhile joins that run at its next step
    without waiting for company. A pair comes first, or after a call that returns with the engine between
    runs (:meth:`InferenceServer.load_weights`)."""
    async with InferenceServer(tiny_model, served_model_name="tiny", max_batch_size=2, batch_wait=60) as s:
        yield s


def _stream_ids(events: list[Any]) -> tuple[list[int], Any]:
    """A completions stream's ids and its last choice chunk (``finish_reason``)."""
    chunks = [e["choices"][0] for e in events if e != "[DONE]" and e["choices"]]
    return [t for c in chunks for t in c["token_ids"]], chunks[-1]


def _seeded(max_tokens: int, **extra: Any) -> dict[str, Any]:
    """Sampling with a seed: reproducible, and unlike the tiny model's greedy answer (one token over and over)
    its ids vary, so a prefix check sees an id lost or shifted."""
    return _greedy(max_tokens=max_tokens, temperature=1.0, seed=7, **extra)


async def test_abort_ends_running_generations_with_the_ids_generated_so_far(
    paired: InferenceServer, http: aiohttp.ClientSession
) -> None:
    url = paired.url + "/v1/completions"
    plain: list[Any] = []

    async def ask() -> None:
        plain.append(await _post(http, url, _seeded(1000, request_id="plain")))

    with anyio.fail_after(60):  # the pair is the server's first work: the idle engine admits the two together
        async with anyio.create_task_group() as tg:
            tg.start_soon(ask)
            async with http.post(url, json=_seeded(1000, stream=True, request_id="streamed")) as resp:
                first = await resp.content.readuntil(b"\n\n")  # both run: each has its first token
                ended = await anyio.to_thread.run_sync(paired.abort)
                events = _events(first + await resp.read())
    assert sorted(ended) == ["cmpl-plain", "cmpl-streamed"]
    assert paired.paused and paired.stats().aborted_sequences == 2
    status, body = plain[0]
    choice = body["choices"][0]
    assert status == 200 and body["id"] == "cmpl-plain"
    assert choice["finish_reason"] == "abort" and choice["stop_reason"] is None  # cut before its 1000 tokens
    ids, last = _stream_ids(events)
    assert events[-1] == "[DONE]" and last["finish_reason"] == "abort"
    paired.resume()
    # The ids so far resume the whole answer: the same request generated again after resume starts with them
    # (its choice 0 draws from the seed's stream; n=2 is the company the fixture's engine waits for).
    _, again = await _post(http, url, _seeded(max(len(ids), len(choice["token_ids"])), n=2))
    whole, so_far = again["choices"][0], choice["token_ids"]
    assert [c["finish_reason"] for c in again["choices"]] == ["length", "length"]
    assert 1 <= len(so_far) and so_far == whole["token_ids"][: len(so_far)]
    assert len(choice["logprobs"]["token_logprobs"]) == len(so_far)
    assert choice["text"] == paired.tokenizer.decode(so_far, skip_special_tokens=True)
    assert 1 <= len(ids) and ids == whole["token_ids"][: len(ids)]


async def test_abort_with_reject_answers_new_requests_at_once_until_resume(
    server: InferenceServer, http: aiohttp.ClientSession
) -> None:
    assert server.abort(reject=True) == []  # nothing was running
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    chat |= {"return_token_ids": True}
    with anyio.fail_after(10):  # answered at once, not parked
        _, plain = await _post(http, server.url + "/v1/completions", _greedy(max_tokens=5))
        _, streamed = await _post(http, server.url + "/v1/completions", _greedy(max_tokens=5, stream=True))
        _, chat_plain = await _post(http, server.url + "/v1/chat/completions", chat)
        _, chat_streamed = await _post(http, server.url + "/v1/chat/completions", chat | {"stream": True})
        refused = await server.generate_ids([5, 6], {"max_tokens": 5})
    for choice in (plain["choices"][0], chat_plain["choices"][0]):
        assert choice["finish_reason"] == "abort" and choice["token_ids"] == []
    assert chat_plain["choices"][0]["message"]["content"] == ""
    ids, last = _stream_ids(streamed)
    assert ids == [] and last["finish_reason"] == "abort" and streamed[-1] == "[DONE]"
    chat_chunks = [e["choices"][0] for e in chat_streamed[:-1]]
    assert chat_chunks[0]["delta"]["role"] == "assistant"
    assert chat_chunks[-1]["finish_reason"] == "abort" and chat_streamed[-1] == "[DONE]"
    assert refused == ([], None, "abort")
    stats = server.stats()
    assert stats.generation_paused and stats.abort_calls == 1 and stats.aborted_sequences == 5
    server.resume()
    server.resume()
    assert not server.paused
    _, answer = await _post(http, server.url + "/v1/completions", _greedy(max_tokens=5))
    assert answer["choices"][0]["finish_reason"] == "length" and len(answer["choices"][0]["token_ids"]) == 5


async def test_after_an_abort_new_requests_wait_for_resume(server: InferenceServer) -> None:
    server.abort()
    results: list[Any] = []

    async def ask() -> None:
        results.append(await server.generate_ids([5, 6, 7], {"max_tokens": 4, "ignore_eos": True}))

    async with anyio.create_task_group() as tg:
        tg.start_soon(ask)
        await anyio.wait_all_tasks_blocked()  # submitted and waiting
        assert results == [] and server.stats().pending_sequences == 1
        server.resume()
    assert len(results[0][0]) == 4 and results[0][2] == "length"


async def test_abort_ends_a_request_waiting_at_a_sleeping_server(server: InferenceServer) -> None:
    server.sleep()
    results: list[Any] = []

    async def ask() -> None:
        results.append(await server.generate_ids([5, 6, 7], {"max_tokens": 4}))

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(ask)
            await anyio.wait_all_tasks_blocked()
            assert server.stats().pending_sequences == 1  # parked by the sleep
            ended = server.abort()
    assert len(ended) == 1 and ended[0].startswith("cmpl-")
    assert results == [([], None, "abort")]
    server.wake_up()  # awake but still paused by the abort: requests wait for resume
    assert server.paused and not server.sleeping
    server.resume()
    ids, _, finish = await server.generate_ids([5, 6, 7], {"max_tokens": 4, "ignore_eos": True})
    assert len(ids) == 4 and finish == "length"


# ---------------------------------------------------------------------------------------------- weight version
async def test_answers_carry_the_weight_version_their_tokens_came_from(
    paired: InferenceServer, http: aiohttp.ClientSession
) -> None:
    url = paired.url + "/v1/completions"
    weights = _scaled(paired, 1.0)
    for stream in (False, True):
        async with http.post(url, json=_greedy(max_tokens=3, n=2, stream=stream)) as resp:
            assert resp.headers["X-Weight-Version"] == "0"
            await resp.read()
    paired.load_weights(weights, 3)  # returns between runs: the pair below reaches an idle engine
    plain: list[Any] = []

    async def ask() -> None:
        async with http.post(url, json=_greedy(max_tokens=40)) as resp:
            plain.append((resp.headers["X-Weight-Version"], await resp.json()))

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(ask)
            async with http.post(url, json=_greedy(max_tokens=40, stream=True)) as resp:
                await resp.content.readuntil(b"\n\n")  # both run under version 3
                # Swap with this loop blocked: the engine finishes both, then the new weights go in, and only
                # then does the loop build the answers. They must name the weights they ran under.
                assert paired.load_weights(weights, 4) > 0
                assert resp.headers["X-Weight-Version"] == "3"
                await resp.read()
    version, body = plain[0]
    assert version == "3" and len(body["choices"][0]["token_ids"]) == 40
    assert paired.weight_version == 4
    async with http.post(url, json=_greedy(max_tokens=3, n=2)) as resp:
        assert resp.headers["X-Weight-Version"] == "4"
