"""What vLLM 0.32's ``/v1/chat/completions`` does that the embedded engine copies, as checks either server runs.

:class:`ChatFacts` holds them as tests; ``tests/test_vllm_chat.py`` runs them against a real ``vllm serve`` (the
tiny model, ``--enable-auto-tool-choice --tool-call-parser hermes``, a context of :data:`MAX_MODEL_LEN`),
``tests/test_engine_chat.py`` against the embedded engine on the same model (each module gives the ``chat``
fixture): the same assertions hold on both, so the engine answers as vLLM does.

- The one-request token-in path: a chat request bringing its prompt as ids in
  ``kv_transfer_params.prompt_token_ids`` is generated from exactly those ids (the answer's
  ``prompt_token_ids``, its usage, and the same tokens as a call whose messages render to them), JSON and SSE,
  with ``return_token_ids`` or not, log-probs and ``n``; ``tools`` still decide tool-choice checks, parsing and
  constrained decoding; malformed ids are refused with vLLM's message; ids that do not fit the context are
  refused, ``max_tokens`` past its end is cut to what is left.
- A forced tool call (``tool_choice`` "required" or named) cut by ``max_tokens``: the JSON answer holds the raw
  text as ``content`` and no ``tool_calls`` (the Hermes parser finds no complete call), the stream has already
  sent the call's name and the arguments so far as tool-call deltas; ``finish_reason`` is ``"length"`` in both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest

#: The context both servers are given (the tiny model's own ``max_position_embeddings``).
MAX_MODEL_LEN = 1024
MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
#: A different conversation: its rendered ids are sent with :data:`MESSAGES`.
OTHER: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Something else entirely, please."},
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
#: A tool whose arguments cannot be complete within a few dozen tokens (vLLM constrains strict tools only).
WRITE = {
    "type": "function",
    "function": {
        "name": "write",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string", "minLength": 200}},
            "required": ["text"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
PARAM = "kv_transfer_params.prompt_token_ids"
#: Malformed prompt ids and the message each gets (vLLM's), given the vocabulary size.
BAD_IDS: dict[str, tuple[Any, str]] = {
    "not_a_list": ("12 13", "must be a non-empty list of non-negative integers"),
    "empty": ([], "must be a non-empty list of non-negative integers"),
    "negative": ([1, -1], "must be a non-empty list of non-negative integers"),
    "booleans": ([True, 1], "must be a non-empty list of non-negative integers"),
    "floats": ([1.0, 2], "must be a non-empty list of non-negative integers"),
    "nested": ([[1, 2]], "must be a non-empty list of non-negative integers"),
    "out_of_vocabulary": ([1, 10**9], "Token id 1000000000 is out of vocabulary"),
}


@dataclass
class Chat:
    """A chat server under test: its base URL (no ``/v1``), an HTTP session, and the model's tokenizer."""

    http: aiohttp.ClientSession
    url: str
    tokenizer: Any

    async def post(self, body: dict[str, Any]) -> tuple[int, Any]:
        """Status and answer: the JSON body, or a stream's events (``"[DONE]"`` dropped)."""
        body = {"model": "tiny", **body}
        headers = {"Content-Type": "application/json"}
        async with self.http.post(
            self.url + "/v1/chat/completions", data=orjson.dumps(body), headers=headers
        ) as resp:
            raw = await resp.read()
            if resp.content_type == "text/event-stream":
                blocks = raw.decode().split("\n\n")
                return resp.status, [json.loads(b[6:]) for b in blocks if b.startswith("data: {")]
            return resp.status, orjson.loads(raw)

    def blanks(self) -> list[int]:
        """The ids of the tokens that are whitespace only."""
        texts = ((i, self.tokenizer.decode([i])) for i in range(len(self.tokenizer)))
        return [i for i, text in texts if text and not text.strip()]

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The ids the model's chat template gives ``messages`` (with the generation prompt)."""
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def with_ids(ids: Any, **body: Any) -> dict[str, Any]:
    """A chat body for :data:`MESSAGES` that brings ``ids`` as its prompt."""
    return {"messages": MESSAGES, "kv_transfer_params": {"prompt_token_ids": ids}, **body}


def streamed(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per choice index: the ids, content, tool calls (name, arguments) and finish reason a stream sent."""
    out: dict[int, dict[str, Any]] = {}
    for event in events:
        for choice in event["choices"]:
            entry = out.setdefault(choice["index"], {"ids": [], "content": "", "calls": {}, "finish": None})
            entry["ids"] += choice.get("token_ids") or []
            delta = choice["delta"]
            entry["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                name, arguments = entry["calls"].get(call["index"], ("", ""))
                function = call.get("function") or {}
                entry["calls"][call["index"]] = (
                    name + (function.get("name") or ""),
                    arguments + (function.get("arguments") or ""),
                )
            entry["finish"] = choice["finish_reason"] or entry["finish"]
    return out


# ---------------------------------------------------------------------------------------------- prompt ids
GREEDY = {"temperature": 0.0, "seed": 0, "return_token_ids": True}


async def given_ids_are_the_prompt(chat: Chat) -> None:
    """JSON: the answer is generated from the given ids (those of another conversation), not from the
    messages: its ``prompt_token_ids``, usage and tokens are those of a call whose messages render to them."""
    ids = chat.render(OTHER)
    status, answer = await chat.post(with_ids(ids, max_tokens=6, **GREEDY))
    _, rendered = await chat.post({"messages": OTHER, "max_tokens": 6, **GREEDY})
    assert status == 200, answer
    assert answer["prompt_token_ids"] == ids == rendered["prompt_token_ids"]
    assert answer["usage"] == rendered["usage"] and answer["usage"]["prompt_tokens"] == len(ids)
    assert answer["choices"][0]["token_ids"] == rendered["choices"][0]["token_ids"]
    assert answer["choices"][0]["message"] == rendered["choices"][0]["message"]
    assert answer["kv_transfer_params"] is None
    _, quiet = await chat.post(with_ids(ids, max_tokens=6, temperature=0.0, seed=0))
    assert quiet["prompt_token_ids"] is None and quiet["usage"]["prompt_tokens"] == len(ids)
    assert quiet["choices"][0]["token_ids"] is None


async def given_ids_stream(chat: Chat) -> None:
    """SSE: each choice's first chunk carries the given ids; the tokens, log-probs and usage are the JSON
    answer's; ``n`` choices all start from them."""
    ids = chat.render(OTHER)
    body = with_ids(ids, max_tokens=5, logprobs=True, top_logprobs=2, **GREEDY)
    _, whole = await chat.post(body)
    status, events = await chat.post({**body, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200
    assert events[0]["prompt_token_ids"] == ids
    assert streamed(events)[0]["ids"] == whole["choices"][0]["token_ids"]
    lps = [
        e["logprob"]
        for ev in events
        for c in ev["choices"]
        for e in (c["logprobs"] or {}).get("content") or []
    ]
    assert lps == [e["logprob"] for e in whole["choices"][0]["logprobs"]["content"]]
    assert events[-1]["usage"]["prompt_tokens"] == len(ids) and events[-1]["choices"] == []
    two = with_ids(ids, max_tokens=4, n=2, temperature=1.0, seed=3, ignore_eos=True, return_token_ids=True)
    _, answer = await chat.post(two)
    assert [c["index"] for c in answer["choices"]] == [0, 1] and answer["prompt_token_ids"] == ids
    assert answer["usage"]["prompt_tokens"] == len(ids) and answer["usage"]["completion_tokens"] == 8
    _, events = await chat.post({**two, "stream": True})
    starts = [e for e in events if "prompt_token_ids" in e]
    assert len(starts) == 2 and all(e["prompt_token_ids"] == ids for e in starts)


async def given_ids_with_tools(chat: Chat) -> None:
    """``tools`` still decide: tool-choice checks (400), and a forced call (constrained) is parsed into
    ``tool_calls``, JSON and SSE, from the given ids (another conversation rendered with the tool)."""
    ids = chat.render(OTHER, [WEATHER])
    named = {"type": "function", "function": {"name": "get_weather"}}
    # One call, then the end (a random model would call on and on); JSON without whitespace, as the engine's
    # grammar writes it (vLLM's lets a random model run on in blanks; the engine has no logit_bias).
    one = {"parallel_tool_calls": False, "logit_bias": {str(t): -100 for t in chat.blanks()}}
    for choice, finish in (("required", "tool_calls"), (named, "stop")):
        body = with_ids(ids, tools=[WEATHER], tool_choice=choice, max_tokens=160, **one, **GREEDY)
        status, answer = await chat.post(body)
        assert status == 200, answer
        assert answer["prompt_token_ids"] == ids
        calls = answer["choices"][0]["message"].get("tool_calls") or []
        assert [c["function"]["name"] for c in calls] == ["get_weather"], answer["choices"][0]
        assert json.loads(calls[0]["function"]["arguments"])["city"] in ("Paris", "Rome")
        assert answer["choices"][0]["finish_reason"] == finish
        _, events = await chat.post({**body, "stream": True})
        sent = streamed(events)[0]
        assert events[0]["prompt_token_ids"] == ids and sent["finish"] == finish
        assert [name for name, _ in sent["calls"].values()] == ["get_weather"]
    status, answer = await chat.post(with_ids(ids, tools=[WEATHER], max_tokens=4, **GREEDY))
    assert status == 200 and answer["prompt_token_ids"] == ids  # "auto": parsed, here plain text
    status, answer = await chat.post(with_ids(ids, tool_choice="required", max_tokens=4))
    assert status == 400 and answer["error"]["param"] == "tool_choice"
    bad_name = {"type": "function", "function": {"name": "nope"}}
    status, answer = await chat.post(with_ids(ids, tools=[WEATHER], tool_choice=bad_name, max_tokens=4))
    assert status == 400 and answer["error"]["param"] == "tool_choice"


async def bad_ids_are_refused(chat: Chat, case: str, stream: bool) -> None:
    """Malformed ids: 400 naming ``kv_transfer_params.prompt_token_ids`` with vLLM's message, before any
    stream starts."""
    ids, message = BAD_IDS[case]
    status, answer = await chat.post(with_ids(ids, max_tokens=4, stream=stream))
    assert status == 400, answer
    error = answer["error"]
    assert error["param"] == PARAM and error["type"] == "BadRequestError" and error["code"] == 400
    assert message in error["message"] and f"(parameter={PARAM})" in error["message"]


async def ids_and_the_context(chat: Chat) -> None:
    """Ids longer than the context, or filling it: 400 (vLLM's messages); ``max_tokens`` past the context's
    end: cut to what is left; no ``max_tokens``: to the end of the context; more than the context: 400."""
    ids = (chat.render(OTHER) * 40)[: MAX_MODEL_LEN + 5]
    for stream in (False, True):
        status, answer = await chat.post(with_ids(ids, max_tokens=4, stream=stream))
        assert status == 400 and answer["error"]["param"] is None
        assert answer["error"]["message"] == (
            f"Input length ({len(ids)}) exceeds model's maximum context length ({MAX_MODEL_LEN})."
        )
    status, answer = await chat.post(with_ids(ids[:MAX_MODEL_LEN], max_tokens=4))
    assert status == 400 and answer["error"]["param"] == "max_tokens"
    assert (
        answer["error"]["message"] == "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"
    )
    near = ids[: MAX_MODEL_LEN - 3]
    for body in (with_ids(near, max_tokens=20, ignore_eos=True), with_ids(near, ignore_eos=True)):
        status, answer = await chat.post(body)
        assert status == 200, answer
        assert answer["usage"]["completion_tokens"] == 3 and answer["choices"][0]["finish_reason"] == "length"
    status, answer = await chat.post(with_ids(near, max_tokens=MAX_MODEL_LEN + 1))
    assert status == 400 and answer["error"]["param"] == "max_tokens"


async def ids_left_aside(chat: Chat) -> None:
    """The messages are rendered when the ids are ``null``, or with ``echo``; an empty ``messages`` is fine
    when ids are given."""
    ids = chat.render(OTHER)
    rendered = chat.render(MESSAGES)
    for body in (with_ids(None, max_tokens=2, **GREEDY), with_ids(ids, echo=True, max_tokens=2, **GREEDY)):
        status, answer = await chat.post(body)
        assert status == 200 and answer["prompt_token_ids"] == rendered
    status, answer = await chat.post({**with_ids(ids, max_tokens=2, **GREEDY), "messages": []})
    assert status == 200 and answer["prompt_token_ids"] == ids


# ---------------------------------------------------------------------------------------------- forced calls
async def forced_call_cut_by_max_tokens(chat: Chat, choice: Any) -> None:
    """A forced call cut by ``max_tokens`` is raw ``content`` without ``tool_calls`` in JSON, and tool-call
    deltas (the name, the arguments so far) without content in SSE: vLLM's Hermes parser reads the whole text
    only as complete calls, the streaming one as they come."""
    body = {"messages": MESSAGES, "tools": [WRITE], "tool_choice": choice, "max_tokens": 48, **GREEDY}
    status, answer = await chat.post(body)
    assert status == 200, answer
    out = answer["choices"][0]
    assert out["finish_reason"] == "length" and not out["message"].get("tool_calls")
    assert out["message"]["content"].startswith("<tool_call>")
    assert '"name": "write"' in out["message"]["content"]
    _, events = await chat.post({**body, "stream": True})
    sent = streamed(events)[0]
    assert sent["finish"] == "length" and sent["content"] == ""
    assert [name for name, _ in sent["calls"].values()] == ["write"]
    assert sent["ids"] == out["token_ids"]  # the same tokens, read two ways


# ---------------------------------------------------------------------------------------------- as tests
class ChatFacts:
    """The checks above as tests, for a test class of a module that gives the ``chat`` fixture."""

    async def test_given_prompt_ids_are_the_prompt(self, chat: Chat) -> None:
        await given_ids_are_the_prompt(chat)

    async def test_given_prompt_ids_stream_with_logprobs_and_n(self, chat: Chat) -> None:
        await given_ids_stream(chat)

    async def test_given_prompt_ids_with_tools_are_checked_parsed_and_constrained(self, chat: Chat) -> None:
        await given_ids_with_tools(chat)

    @pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
    @pytest.mark.parametrize("case", sorted(BAD_IDS))
    async def test_malformed_prompt_ids_are_400_naming_the_field(
        self, chat: Chat, case: str, stream: bool
    ) -> None:
        await bad_ids_are_refused(chat, case, stream)

    async def test_prompt_ids_and_the_context_window(self, chat: Chat) -> None:
        await ids_and_the_context(chat)

    async def test_prompt_ids_left_aside_for_the_messages(self, chat: Chat) -> None:
        await ids_left_aside(chat)

    @pytest.mark.parametrize(
        "choice", ["required", {"type": "function", "function": {"name": "write"}}], ids=["required", "named"]
    )
    async def test_a_forced_call_cut_by_max_tokens_is_text_whole_and_tool_calls_streamed(
        self, chat: Chat, choice: Any
    ) -> None:
        await forced_call_cut_by_max_tokens(chat, choice)
