"""The embedded engine's chat route answers as vLLM 0.32's does, over loopback HTTP with the real tiny model.

The checks are :class:`helpers.chat_facts.ChatFacts` (the vLLM tier runs the same ones against ``vllm serve``:
``tests/test_vllm_chat.py``): the one-request token-in path (prompt ids in
``kv_transfer_params.prompt_token_ids``: JSON and SSE, ``return_token_ids``, log-probs, ``n``, tools auto /
required / named, malformed ids, ids and the context window), and a forced tool call cut by ``max_tokens``.
Beside them, what only the engine can show: refused ids never reach the batch, and ids beside a non-text
message part are left aside for the messages (as vLLM does; vLLM then refuses the part, the engine drops it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from helpers.chat_facts import MAX_MODEL_LEN, MESSAGES, OTHER, Chat, ChatFacts, bad_ids_are_refused, with_ids

from aglverl.engine.server import InferenceServer

pytestmark = pytest.mark.anyio


@pytest.fixture
async def server(tiny_model: Path) -> AsyncIterator[InferenceServer]:
    async with InferenceServer(tiny_model, served_model_name="tiny", seed=0) as s:
        assert s.max_model_len == MAX_MODEL_LEN
        yield s


@pytest.fixture
async def chat(server: InferenceServer) -> AsyncIterator[Chat]:
    async with aiohttp.ClientSession() as http:
        yield Chat(http, server.url, server.tokenizer)


class TestTheEngineAnswersAsVllm(ChatFacts):
    """:class:`ChatFacts` on the embedded engine."""


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_refused_prompt_ids_never_reach_the_batch(
    server: InferenceServer, chat: Chat, stream: bool
) -> None:
    await bad_ids_are_refused(chat, "out_of_vocabulary", stream)
    assert server.stats().sequences == 0 and server.stats().rejected_requests == 1


async def test_prompt_ids_beside_a_non_text_part_are_left_aside(chat: Chat) -> None:
    image: dict[str, Any] = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}, image]}]
    body = {**with_ids(chat.render(OTHER), max_tokens=2, return_token_ids=True), "messages": messages}
    status, answer = await chat.post(body)
    assert status == 200 and answer["prompt_token_ids"] == chat.render(MESSAGES)
