"""A third backend is one class: a dialect with other field names, another abort reason and prompt ids taken on its
completions route, registered by its model cards' ``owned_by``, against a loopback backend that speaks it.

The backend (:class:`ToyBackend`) is the vLLM-shaped mock behind a front that speaks the toy wire: it asks for
ids with ``return_output_ids``, answers them as ``input_ids`` / ``output_ids``, ends an engine-aborted
generation with ``"cancelled"``, takes prompt ids only on ``/v1/completions`` (``prompt``; a chat request with
``kv_transfer_params`` is refused) and names itself ``owned_by: "toy"``. What is checked, through the proxy with
the real openai SDK: calls are recorded with their ids, a conversation that re-sends its history as text is made
from ids on the completions route (one row; the agent still gets chat answers, whole and streamed), and an
aborted generation is continued token-exactly, whole and streamed.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from helpers.tokenin import extends
from test_tokenin import conversation
from test_translate import claim, finish, openai_sdk, proxied

from aglverl._net import HttpListener
from aglverl.proxy import register
from aglverl.proxy.capture import AnswerWire
from aglverl.proxy.dialect import DIALECTS, TokenInRequest, VLLMDialect
from aglverl.testing import MockVLLM
from aglverl.testing.mock_vllm import completion_token_ids

pytestmark = pytest.mark.anyio

TOY_WIRE = AnswerWire(prompt_ids="input_ids", response_ids="output_ids", abort_reason="cancelled")


# ---------------------------------------------------------------------------------------------- the new class
@dataclass(frozen=True, slots=True)
class ToyDialect(VLLMDialect):
    """The toy server's wire: its own field names and abort reason; prompt ids go to its completions route,
    whose answer is a completion (the proxy spells it back as chat)."""

    name: str = "toy"
    owned_by: str = "toy"
    wire: AnswerWire = TOY_WIRE
    advice: Mapping[str, str] = field(default_factory=dict)

    def ids_fields(self, kind: Any) -> Mapping[str, Any]:
        return {"return_output_ids": True}

    def token_in(self, body: bytes, request: Mapping[str, Any], ids: Sequence[int]) -> TokenInRequest:
        limit = request.get("max_completion_tokens") or request.get("max_tokens")
        stream = bool(request.get("stream"))
        made = self.continuation(request, "chat", list(ids), [], limit, stream)
        return TokenInRequest(self.continuation_target, made, "completion")


@pytest.fixture
def toy() -> Iterator[ToyDialect]:
    dialect = register(ToyDialect())
    try:
        yield dialect  # type: ignore[misc]
    finally:
        del DIALECTS[dialect.owned_by]


# ---------------------------------------------------------------------------------------------- the backend
_RENAMES = {
    b'"token_ids"': b'"output_ids"',
    b'"prompt_token_ids"': b'"input_ids"',
    b'"abort"': b'"cancelled"',
}


def _toy(raw: bytes) -> bytes:
    for old, new in _RENAMES.items():
        raw = raw.replace(old, new)
    return raw


class ToyBackend:
    """The toy wire in front of a :class:`MockVLLM` (see the module docstring); records what it was sent."""

    def __init__(self, mock: MockVLLM) -> None:
        self.mock = mock
        self.seen: list[tuple[str, Any]] = []
        self._http: HttpListener | None = None
        self._session: aiohttp.ClientSession | None = None
        self.url = ""

    async def _relay(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        body = await request.read()
        if request.method == "POST":
            obj = orjson.loads(body)
            self.seen.append((request.path, dict(obj)))
            if "kv_transfer_params" in obj:
                return web.json_response(
                    {"error": {"message": "kv_transfer_params: unknown field"}}, status=400
                )
            if obj.pop("return_output_ids", None):
                obj["return_token_ids"] = True
            body = orjson.dumps(obj)
        url = self.mock.url + request.path_qs
        async with self._session.request(request.method, url, data=body or None) as upstream:
            if request.path == "/v1/models":
                listing = await upstream.json()
                for card in listing["data"]:
                    card["owned_by"] = "toy"
                return web.json_response(listing)
            content_type = upstream.headers.get("Content-Type", "application/json")
            generation = request.path in ("/v1/chat/completions", "/v1/completions")
            spell = _toy if generation else bytes
            if not content_type.startswith("text/event-stream"):
                body = spell(await upstream.read())
                return web.Response(status=upstream.status, body=body, headers={"Content-Type": content_type})
            response = web.StreamResponse(status=upstream.status, headers={"Content-Type": content_type})
            await response.prepare(request)
            async for line in upstream.content:  # an SSE stream, line by line
                await response.write(spell(line))
            await response.write_eof()
            return response

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[ToyBackend]:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._relay)
        async with aiohttp.ClientSession() as session:
            self._session = session
            http = HttpListener(app, "127.0.0.1", 0, shutdown_timeout=1.0)
            self.url = await http.start()
            try:
                yield self
            finally:
                await http.stop(set(), grace=0.5, cancel_wait=0.5)


@asynccontextmanager
async def toy_backend(**mock: Any) -> AsyncIterator[tuple[ToyBackend, MockVLLM]]:
    async with MockVLLM(**mock) as vllm, ToyBackend(vllm).serving() as front:
        yield front, vllm


def generations(front: ToyBackend) -> list[tuple[str, Any]]:
    return [(path, body) for path, body in front.seen if path in ("/v1/chat/completions", "/v1/completions")]


# ---------------------------------------------------------------------------------------------- the checks
@pytest.mark.parametrize("stream", [False, True])
async def test_a_third_dialect_records_ids_and_makes_later_turns_from_ids_on_its_completions_route(
    toy: ToyDialect, stream: bool
) -> None:
    async with toy_backend() as (front, _), proxied(front.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        answers = await conversation(base, stream, turns=3)
        calls = finish(store, rid, aid)
        [backend] = proxy._pool._backends
    assert backend.dialect is toy
    assert all(a["content"] and a["finish_reason"] in ("stop", "length") for a in answers)  # chat, as asked
    assert len(calls) == 3 and all(c.status == "ok" and c.response_token_ids for c in calls)
    assert all(extends(earlier, later) for earlier, later in itertools.pairwise(calls))  # one row
    sent = generations(front)
    assert [path for path, _ in sent] == ["/v1/chat/completions", "/v1/completions", "/v1/completions"]
    assert sent[0][1]["return_output_ids"] is True and "return_token_ids" not in sent[0][1]
    for (_, body), call in zip(sent[1:], calls[1:], strict=True):
        assert body["prompt"] == call.prompt_token_ids  # exactly the ids it was made from
    for call in calls:  # what the engine generated from those ids
        assert call.prompt_token_ids is not None
        assert call.response_token_ids == completion_token_ids(call.prompt_token_ids, 0, 4)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_third_dialects_abort_is_continued_token_exactly(toy: ToyDialect, stream: bool) -> None:
    async with toy_backend(completion_tokens=6) as (front, mock), proxied(front.url) as (proxy, store):
        rid, aid, base = claim(proxy, store)
        mock.abort_next(after_tokens=2)
        messages = [{"role": "user", "content": "hi"}]
        async with openai_sdk(base) as client:
            if stream:
                text = ""
                async for chunk in await client.chat.completions.create(
                    model="mock", messages=messages, max_tokens=6, stream=True
                ):
                    text += "".join(c.delta.content or "" for c in chunk.choices)
            else:
                reply = await client.chat.completions.create(model="mock", messages=messages, max_tokens=6)
                text = reply.choices[0].message.content or ""
        [call] = finish(store, rid, aid)
        resumed = proxy.m_resumed.value()
    sent = generations(front)
    assert [path for path, _ in sent] == ["/v1/chat/completions", "/v1/completions"]  # the continuation
    assert call.prompt_token_ids is not None and resumed == 1 and call.status == "ok"
    prompt = call.prompt_token_ids
    cut = completion_token_ids(prompt, 0, 6)[:2]  # what was generated before the abort
    continuation = sent[1][1]
    assert continuation["return_output_ids"] is True and continuation["prompt"] == prompt + cut
    assert continuation["max_tokens"] == 4  # what was left of the call's limit
    expected = cut + completion_token_ids(prompt + cut, 0, 4)
    assert call.response_token_ids == expected
    assert text == "".join(f" t{t}" for t in expected)
