"""A vLLM-shaped OpenAI-compatible backend on loopback, for tests and benchmarks.

:class:`MockVLLM` answers ``POST /v1/chat/completions`` and ``POST /v1/completions`` the way vLLM does with
``"return_token_ids": true`` (see ``tests/fixtures/vllm/``): top-level ``prompt_token_ids`` for chat, per-choice
``prompt_token_ids`` for completions, ``choices[i].token_ids``, logprobs when asked, ``usage``, SSE streams with
``n`` choices interleaved by ``index``, ``stream_options.include_usage`` and ``data: [DONE]``. Token ids are
deterministic functions of the request (:func:`prompt_token_ids`, :func:`completion_token_ids`), so a test can
compute what a proxy must have recorded without asking the mock.

It also serves ``GET /v1/models`` and ``GET /health``, injects faults on the next generation calls (500, 429
with ``Retry-After``, a stall that never answers, a connection closed mid-stream, an answer without token ids),
and records what it saw: every request with its body, and how many generation calls the client abandoned.
A chat request with ``tools`` whose ``tool_choice`` is ``"required"`` or names a function is answered the way
vLLM's tool parser answers it: one call in ``message.tool_calls`` (streams: ``delta.tool_calls``, the name
first, the arguments piece by piece, one piece per generated token) and finish reason ``"tool_calls"``; the
arguments are the JSON object ``{"value": "t<id> t<id> ..."}`` of the generated ids (:func:`tool_arguments`).

Token-in, as vLLM 0.32 serves it: a chat request with ``kv_transfer_params["prompt_token_ids"]`` is generated
from those ids (its messages still shape the answer: tool calls), malformed or out-of-vocabulary ids are a 400
naming the field, ``echo`` or content other than text renders the messages instead (``prompt_ids`` makes the
mock ignore or refuse the field instead, as older servers do); ``POST /v1/chat/completions/render`` answers the
prompt ids of a chat request (``scale_out``: ``False`` answers 403 as vLLM without ``--enable-scale-out``,
``None`` serves no such route). Its model card's ``root`` is the model's name, or with ``tokenizer`` a directory
holding a Hugging Face tokenizer and chat template that give exactly the mock's prompt ids (one byte, one id:
:func:`write_tokenizer`), as vLLM's names the model's path.

For soak runs it can also fail a random fraction of generation calls and add random latency, from a seeded
generator so a run can be repeated.

With ``replay_dir`` it serves recorded vLLM bytes instead: a request whose method, path and body match a
recorded case (ignoring ``return_token_ids``, which a proxy may add) gets that case's status, content type and
exact body; streams are written in small pieces so SSE events straddle network chunks.

Per-request CPU is kept low (one ``orjson.dumps`` per body or event, no per-request parsing beyond the body)
because the proxy benchmark uses this mock as its backend.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import random
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anyio
import orjson
from aiohttp import web
from anyio.abc import TaskStatus
from multidict import CIMultiDict, CIMultiDictProxy

from .._net import HttpListener

__all__ = [
    "DEFAULT_MODEL",
    "JINJA_TEMPLATES",
    "VOCAB_SIZE",
    "MockVLLM",
    "ReplayCase",
    "SeenRequest",
    "completion_token_ids",
    "load_replay_cases",
    "prompt_token_ids",
    "render_chat",
    "token_logprob",
    "tool_arguments",
    "write_tokenizer",
]

#: Token ids the mock produces are in ``range(VOCAB_SIZE)``.
VOCAB_SIZE = 50_000
DEFAULT_MODEL = "mock"
#: vLLM runs on uvicorn, whose idle keep-alive timeout is 5 s; the mock mirrors it so a proxy's pool is tested
#: against the same server-side close.
KEEPALIVE_SECONDS = 5.0
#: Bytes per write when replaying a recorded stream: smaller than one event, so events split across chunks.
REPLAY_PIECE = 64
#: How long stop() lets the aiohttp runner close idle connections.
_CLOSE_TIMEOUT = 1.0
_SSE_TYPE = "text/event-stream; charset=utf-8"
_JSON_TYPE = "application/json"
_DONE = b"data: [DONE]\n\n"

FaultKind = Literal["error", "throttle", "stall", "break", "no_ids", "abort"]


# ---------------------------------------------------------------------------------------------- token ids
#: The mock's chat templates: ``plain`` renders every message alike; ``think`` renders a conversation's final
#: assistant message (no generation prompt after it) with an empty ``<think></think>`` block before its content,
#: the way Qwen3's template renders a last assistant turn differently from earlier ones; ``mistral`` renders the
#: tool list before, and a leading system message inside, the LAST user turn (Mistral-7B-Instruct-v0.3's way:
#: not append-only, an earlier user turn renders otherwise once a later one comes).
Template = Literal["plain", "think", "mistral"]


def _tool_call_text(call: Any) -> str:
    """A tool call as the template writes it: its name and its arguments as a JSON object (parsed from the
    string the agent sent, written as Jinja's ``tojson`` writes it)."""
    function = call.get("function") if isinstance(call, dict) else None
    function = function if isinstance(function, dict) else {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass
    spelled = {"name": function.get("name"), "arguments": {} if arguments is None else arguments}
    return "<tool_call>" + json.dumps(spelled, ensure_ascii=False) + "</tool_call>"


def _content_text(content: Any) -> str:
    """A message's content as vLLM hands it to a template: text parts joined with ``"\n"``."""
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Any = None,
    template: Template = "plain",
) -> str:
    """The prompt text the mock "tokenizes" for chat messages (one byte = one token id): the tools' names, then
    ``<|role|>content`` + tool calls + ``"\n"`` per message (``"\n"`` ends a turn), then ``<|assistant|>``
    when ``add_generation_prompt``. :data:`JINJA_TEMPLATES` renders the same text."""
    parts = []
    listed = ""
    if isinstance(tools, list) and tools:
        names = [str((t.get("function") or {}).get("name", "")) for t in tools if isinstance(t, dict)]
        listed = f"<|tools|>{','.join(names)}\n"
    system, last_user = None, -1
    if template == "mistral":
        if messages and messages[0].get("role") == "system":
            system = _content_text(messages[0].get("content"))
        last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    else:
        parts.append(listed)
    last = len(messages) - 1
    for i, message in enumerate(messages):
        content = _content_text(message.get("content"))
        role = message.get("role", "")
        if system is not None and i == 0:
            continue  # on the last user turn
        if i == last_user:
            parts.append(listed)
            content = (f"{system}\n\n" if system is not None else "") + content
        calls = "".join(_tool_call_text(c) for c in message.get("tool_calls") or ())
        final = template == "think" and role == "assistant" and i == last and not add_generation_prompt
        parts.append(f"<|{role}|>{'<think></think>' if final else ''}{content}{calls}\n")
    if add_generation_prompt:
        parts.append("<|assistant|>")
    return "".join(parts)


def _jinja(template: Template) -> str:
    final = (
        "{% if loop.last and m['role'] == 'assistant' and not add_generation_prompt %}<think></think>{% endif %}"
        if template == "think"
        else ""
    )
    listed = (
        "{% if tools %}<|tools|>{% for t in tools %}{% if not loop.first %},{% endif %}"
        "{{ t['function']['name'] }}{% endfor %}{{ '\\n' }}{% endif %}"
    )
    head, system, last = listed, "", ""
    if template == "mistral":  # the tool list and the system prompt go with the last user turn
        head = (
            "{%- set ns = namespace(last=-1, system=none) %}"
            "{%- for m in messages %}{% if m['role'] == 'user' %}{% set ns.last = loop.index0 %}{% endif %}"
            "{%- if loop.first and m['role'] == 'system' %}{% set ns.system = m.get('content') or '' %}{% endif %}"
            "{%- endfor %}"
        )
        system = (
            "{%- if not (loop.first and ns.system is not none) %}{% if loop.index0 == ns.last %}"
            + listed
            + "{% endif %}"
        )
        last = (
            "{% if loop.index0 == ns.last and ns.system is not none %}{{ ns.system ~ '\\n\\n' }}{% endif %}"
        )
    return (
        head
        + "{%- for m in messages %}"
        + system
        + "{{ '<|' ~ m['role'] ~ '|>' }}"
        + final
        + last
        + "{{ m.get('content') or '' }}"
        "{%- for c in (m.get('tool_calls') or []) %}<tool_call>"
        "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}</tool_call>"
        "{%- endfor %}{{ '\\n' }}" + ("{% endif %}" if template == "mistral" else "") + "{% endfor %}"
        "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
    )


#: The mock's templates in Jinja, as a Hugging Face tokenizer renders them (:func:`write_tokenizer`).
JINJA_TEMPLATES: Mapping[str, str] = {name: _jinja(name) for name in ("plain", "think", "mistral")}


def _byte_chars() -> list[str]:
    """The printable character byte-level tokenizers write each byte as (the GPT-2 convention)."""
    kept = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), 256),
    }
    chars, shifted = [], 0
    for byte in range(256):
        if byte in kept:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


def write_tokenizer(target: str | Path, template: Template = "plain") -> Path:
    """A Hugging Face tokenizer at ``target`` (a directory, made if missing) that tokenizes text as the mock
    does (one UTF-8 byte, one id: the byte's value) and whose chat template renders as :func:`render_chat`;
    returns ``target``. Written with ``tokenizers`` alone; ``transformers.AutoTokenizer`` loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    root = Path(target)
    root.mkdir(parents=True, exist_ok=True)
    vocab = {char: byte for byte, char in enumerate(_byte_chars())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(root / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20}
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    (root / "chat_template.jinja").write_text(JINJA_TEMPLATES[template])
    return root


def prompt_token_ids(body: Mapping[str, Any], template: Template = "plain") -> list[list[int]]:
    """The prompt ids the mock assigns to a request: one list per prompt (chat has exactly one).

    Text is tokenized as its UTF-8 bytes; a completions prompt given as token ids is taken as it is.
    """
    if "messages" in body:
        text = render_chat(
            body["messages"],
            add_generation_prompt=body.get("add_generation_prompt") is not False,
            tools=body.get("tools"),
            template=template,
        )
        return [list(text.encode())]
    prompt = body.get("prompt", "")
    if isinstance(prompt, str):
        return [list(prompt.encode())]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    return [list(p.encode()) if isinstance(p, str) else list(p) for p in prompt]


def completion_token_ids(prompt_ids: Sequence[int], index: int, count: int) -> list[int]:
    """The ids the mock generates for choice ``index`` of a prompt: a fixed function of both."""
    base = (sum(prompt_ids) + 7919 * index) % VOCAB_SIZE
    return [(base + 104_729 * (k + 1)) % VOCAB_SIZE for k in range(count)]


def token_logprob(token_id: int) -> float:
    """The logprob the mock reports for a generated token (a fixed function of the id)."""
    return -((token_id % 97) + 1) / 100


def _text(token_id: int) -> str:
    return f" t{token_id}"


def tool_arguments(ids: Sequence[int]) -> list[str]:
    """The pieces, one per generated id, of the arguments of a tool call the mock makes; joined, a JSON object."""
    if not ids:
        return ['{"value": ""}']
    pieces = ['{"value": "' + f"t{ids[0]}", *(f" t{t}" for t in ids[1:])]
    pieces[-1] += '"}'
    return pieces


def _forced_tool(body: Mapping[str, Any]) -> str | None:
    """The function a chat request makes the model call: ``tool_choice`` "required" (the first tool) or named."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not isinstance(tools, list) or not tools:
        return None
    if choice == "required":
        return str(tools[0].get("function", {}).get("name", ""))
    if isinstance(choice, dict):
        return str(choice.get("function", {}).get("name", ""))
    return None


# ---------------------------------------------------------------------------------------------- records
@dataclass(frozen=True, slots=True)
class SeenRequest:
    """One request the mock received: what a test asserts the proxy forwarded."""

    method: str
    path: str
    query: str
    headers: CIMultiDictProxy[str]
    body: bytes
    json: Any


@dataclass(slots=True)
class _Fault:
    kind: FaultKind
    status: int = 500
    retry_after: float = 0.0
    after_events: int = 1  # "break": stream events sent first; "abort": tokens generated first
    release: anyio.Event | None = None  # "abort": a stream sends the abort once this is set


@dataclass(frozen=True, slots=True)
class ReplayCase:
    """One recorded vLLM exchange (``NAME.request.json`` + ``NAME.response.*`` + ``NAME.meta.json``)."""

    name: str
    method: str
    path: str
    body: dict[str, Any]
    status: int
    content_type: str
    response: bytes

    @property
    def streamed(self) -> bool:
        return self.content_type.startswith("text/event-stream")


def load_replay_cases(directory: str | Path) -> dict[str, ReplayCase]:
    """Every recorded case in ``directory``, by name. Raises ``FileNotFoundError`` for a missing directory."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"replay directory {root} does not exist")
    cases = {}
    for request_file in sorted(root.glob("*.request.json")):
        name = request_file.name.removesuffix(".request.json")
        request = orjson.loads(request_file.read_bytes())
        meta = orjson.loads((root / f"{name}.meta.json").read_bytes())
        [response_file] = [p for p in root.glob(f"{name}.response.*")]
        cases[name] = ReplayCase(
            name=name,
            method=request["method"],
            path=request["path"],
            body=request["body"],
            status=int(meta["status"]),
            content_type=meta["content_type"],
            response=response_file.read_bytes(),
        )
    return cases


def _replay_key(method: str, path: str, body: Any) -> tuple[str, str, bytes]:
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if k != "return_token_ids"}
    return method, path, orjson.dumps(body, option=orjson.OPT_SORT_KEYS)


def _error_body(status: int, message: str, type_: str) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": None, "code": status}})


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


# ---------------------------------------------------------------------------------------------- generation
@dataclass(slots=True)
class _Choice:
    index: int
    prompt: list[int]
    ids: list[int]
    finish: str
    stop_reason: int | None = (
        None  # the stop token id the choice ended on (kept in its ids, as vLLM keeps it)
    )


#: How many tokens a choice gets for its prompt, and why it stopped ("stop" or "length").
Budget = Callable[[Sequence[int]], tuple[int, str]]


class _Generation:
    """What one generation request asks for and the deterministic answer to it."""

    def __init__(
        self,
        kind: str,
        body: Mapping[str, Any],
        budget: Budget,
        with_ids: bool,
        model: str,
        template: Template = "plain",
        prompt: list[int] | None = None,
    ) -> None:
        self.kind = kind
        self.body = body
        self.with_ids = with_ids
        self.model = model
        self.created = int(time.time())
        n = int(body.get("n") or 1)
        prompts = [prompt] if prompt is not None else prompt_token_ids(body, template)
        self.prompts = prompts
        self.choices = []
        for p, prompt in enumerate(prompts):
            count, finish = budget(prompt)
            self.choices += [
                _Choice(p * n + j, prompt, completion_token_ids(prompt, p * n + j, count), finish)
                for j in range(n)
            ]
        stops = body.get("stop_token_ids")
        if isinstance(stops, list) and stops:  # as vLLM: the first stop id ends the choice, kept in its ids
            for c in self.choices:
                at = next((k for k, t in enumerate(c.ids) if t in stops), None)
                if at is not None:
                    c.ids, c.finish, c.stop_reason = c.ids[: at + 1], "stop", c.ids[at]
        raw_lp = body.get("logprobs")
        self.logprobs = bool(raw_lp) if kind == "chat" else raw_lp is not None and raw_lp is not False
        stream_options = body.get("stream_options") or {}
        self.include_usage = bool(stream_options.get("include_usage"))
        self.tool = _forced_tool(body) if kind == "chat" else None
        if self.tool is not None:
            for c in self.choices:
                c.finish = "tool_calls" if c.finish == "stop" else c.finish

    def abort_after(self, tokens: int) -> None:
        """Every choice cut after ``tokens`` ids with finish reason ``"abort"`` (a weight update)."""
        for c in self.choices:
            c.ids, c.finish = c.ids[:tokens], "abort"

    def _call_id(self, c: _Choice) -> str:
        return f"chatcmpl-tool-{c.index}{sum(c.prompt) % 10**8:08d}"

    def usage(self) -> dict[str, int]:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.ids) for c in self.choices)
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}

    def _chat_logprobs(self, ids: Sequence[int]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        content = []
        for t in ids:
            text = _text(t)
            content.append(
                {"token": text, "logprob": token_logprob(t), "bytes": list(text.encode()), "top_logprobs": []}
            )
        return {"content": content}

    def _completion_logprobs(self, ids: Sequence[int], offset: int) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        tokens = [_text(t) for t in ids]
        offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset))
        lps = [token_logprob(t) for t in ids]
        return {
            "text_offset": offsets,
            "token_logprobs": lps,
            "tokens": tokens,
            "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, lps, strict=False)],
        }

    # ------------------------------------------------------------------ whole responses
    def response(self, request_id: str) -> bytes:
        choices = [
            self._chat_choice(c) if self.kind == "chat" else self._completion_choice(c) for c in self.choices
        ]
        obj: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }
        if self.kind == "chat":
            obj["prompt_token_ids"] = self.prompts[0] if self.with_ids else None
        return orjson.dumps(obj)

    def _chat_choice(self, c: _Choice) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(map(_text, c.ids))}
        if self.tool is not None:
            function = {"name": self.tool, "arguments": "".join(tool_arguments(c.ids))}
            message = {"role": "assistant", "content": None}
            message["tool_calls"] = [{"id": self._call_id(c), "type": "function", "function": function}]
        return {
            "index": c.index,
            "message": message,
            "logprobs": self._chat_logprobs(c.ids),
            "finish_reason": c.finish,
            "stop_reason": c.stop_reason,
            "token_ids": c.ids if self.with_ids else None,
        }

    def _completion_choice(self, c: _Choice) -> dict[str, Any]:
        return {
            "index": c.index,
            "text": "".join(map(_text, c.ids)),
            "logprobs": self._completion_logprobs(c.ids, 0),
            "finish_reason": c.finish,
            "stop_reason": c.stop_reason,
            "token_ids": c.ids if self.with_ids else None,
            "prompt_token_ids": c.prompt if self.with_ids else None,
        }

    # ------------------------------------------------------------------ streams
    def events(self, request_id: str) -> list[bytes]:
        """Every SSE event of the streamed answer, ``[DONE]`` included, in the order vLLM sends them."""
        head: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
        }
        events = []
        if self.kind == "chat":
            for c in self.choices:
                first = {"index": c.index, "delta": {"role": "assistant", "content": ""}}
                first |= {"logprobs": None, "finish_reason": None}
                obj = {**head, "choices": [first]}
                if self.with_ids:
                    obj["prompt_token_ids"] = c.prompt
                events.append(_sse(obj))
        steps = max((len(c.ids) for c in self.choices), default=0)
        offsets = [0] * len(self.choices)
        for k in range(steps):
            for i, c in enumerate(self.choices):
                if k < len(c.ids):
                    last = k == len(c.ids) - 1
                    choice = self._chunk_choice(c, k, last, offsets[i])
                    offsets[i] += len(_text(c.ids[k]))
                    events.append(_sse({**head, "choices": [choice]}))
        if self.include_usage:
            events.append(_sse({**head, "choices": [], "usage": self.usage()}))
        events.append(_DONE)
        return events

    def _tool_delta(self, c: _Choice, k: int) -> dict[str, Any]:
        call: dict[str, Any] = {"index": 0, "function": {"arguments": tool_arguments(c.ids)[k]}}
        if k == 0:  # the first piece also names the call, as vLLM's parsers send it
            call |= {"id": self._call_id(c), "type": "function"}
            call["function"] = {"name": self.tool, **call["function"]}
        return {"tool_calls": [call]}

    def _chunk_choice(self, c: _Choice, k: int, last: bool, offset: int) -> dict[str, Any]:
        t = c.ids[k]
        choice: dict[str, Any] = {"index": c.index}
        if self.kind == "chat":
            choice["delta"] = {"content": _text(t)} if self.tool is None else self._tool_delta(c, k)
            choice["logprobs"] = self._chat_logprobs([t])
        else:
            choice["text"] = _text(t)
            choice["logprobs"] = self._completion_logprobs([t], offset)
        choice["finish_reason"] = c.finish if last else None
        choice["stop_reason"] = c.stop_reason if last else None
        if self.with_ids:
            if self.kind == "completion":
                choice["prompt_token_ids"] = c.prompt if k == 0 else None
            choice["token_ids"] = [t]
        return choice


# ---------------------------------------------------------------------------------------------- the server
class MockVLLM:
    """A loopback vLLM look-alike; see the module docstring.

    ``latency`` is slept before each generation answer, ``chunk_latency`` between stream events (and between
    replayed pieces); ``completion_tokens`` is how many tokens each choice gets before it ends on its own
    (finish reason ``"stop"``), unless the request's ``max_tokens`` or ``max_model_len`` cuts it short
    (``"length"``). With ``max_model_len``, a prompt that with its ``max_tokens`` does not fit is refused with
    vLLM's 400, and a request without ``max_tokens`` may fill the rest of the window.
    ``record_requests=False`` keeps memory flat in long benchmarks. ``response_headers`` are added to every
    generation answer (e.g. hop-by-hop headers a proxy must not pass on). ``eof_delay`` is slept between a
    stream's last event and the end of its body, as a server that flushes ``[DONE]`` first may do.

    Random faults (all off by default): ``failure_rate`` is the probability that a generation call with no
    injected fault pending is answered at once with ``failure_status`` (an OpenAI-shaped error body);
    ``latency_jitter`` adds a uniform random ``[0, latency_jitter)`` seconds to ``latency``; both draw from
    ``random.Random(seed)``. :attr:`failed_randomly` counts the calls failed that way.

    Token-in (see the module docstring): ``prompt_ids`` is how a chat request's
    ``kv_transfer_params["prompt_token_ids"]`` is taken (``"use"``: generated from, as vLLM 0.32; ``"ignore"``:
    the messages rendered instead; ``"refuse"``: a 400 naming the field); ``scale_out`` serves the render route
    (``False``: 403, ``None``: absent); ``tokenizer`` writes the mock's tokenizer and template in a temporary
    directory while serving (:attr:`tokenizer_dir`) and names it as the model card's ``root``.

    Use ``async with MockVLLM() as mock:`` or ``await tg.start(mock.serve)``; ``mock.url`` is then
    ``http://127.0.0.1:PORT`` (no ``/v1``). It can be stopped and started again on the same port (pass
    ``port=``) to simulate a backend that goes away and comes back.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model: str = DEFAULT_MODEL,
        latency: float = 0.0,
        chunk_latency: float = 0.0,
        completion_tokens: int = 8,
        replay_dir: str | Path | None = None,
        record_requests: bool = True,
        response_headers: Mapping[str, str] | None = None,
        eof_delay: float = 0.0,
        failure_rate: float = 0.0,
        failure_status: int = 500,
        latency_jitter: float = 0.0,
        seed: int | None = None,
        max_model_len: int | None = None,
        template: Template = "plain",
        scale_out: bool | None = True,
        tokenizer: bool = False,
        prompt_ids: Literal["use", "ignore", "refuse"] = "use",
    ) -> None:
        if not 0.0 <= failure_rate <= 1.0:
            raise ValueError(f"failure_rate is a probability in [0, 1], got {failure_rate}")
        if latency_jitter < 0:
            raise ValueError(f"latency_jitter must be >= 0, got {latency_jitter}")
        self.host = host
        self.port = port
        self.model = model
        self.latency = latency
        self.chunk_latency = chunk_latency
        self.completion_tokens = completion_tokens
        self.max_model_len = max_model_len
        self.template: Template = template
        self.scale_out = scale_out
        self.tokenizer = tokenizer
        self.prompt_ids = prompt_ids
        #: The directory of the tokenizer the model card names (with ``tokenizer``, while serving).
        self.tokenizer_dir: Path | None = None
        self.record_requests = record_requests
        self.response_headers = dict(response_headers or {})
        self.eof_delay = eof_delay
        self.failure_rate = failure_rate
        self.failure_status = failure_status
        self.latency_jitter = latency_jitter
        self._rng = random.Random(seed)
        self.replay_cases = load_replay_cases(replay_dir) if replay_dir is not None else {}
        self._replay = {_replay_key(c.method, c.path, c.body): c for c in self.replay_cases.values()}
        #: Every request received, in arrival order (when ``record_requests``).
        self.requests: list[SeenRequest] = []
        #: Generation calls the client abandoned (disconnected) before the mock finished answering.
        self.cancelled = 0
        #: Generation calls answered completely.
        self.completed = 0
        #: Generation calls whose connection the mock closed on purpose (``break_next``).
        self.broken = 0
        #: Generation calls being answered right now.
        self.active = 0
        #: Generation calls answered with ``failure_status`` by the random ``failure_rate``.
        self.failed_randomly = 0
        #: Streams holding their abort until the event given to :meth:`abort_next` is set.
        self.aborting = 0
        self._faults: deque[_Fault] = deque()
        self._ids = itertools.count()
        self._changed: anyio.Event | None = None  # exists while someone is in wait_until()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._http: HttpListener | None = None
        self._url: str | None = None
        self._stopping = False

    # ------------------------------------------------------------------ fault injection
    def fail_next(self, count: int = 1, *, status: int = 500) -> None:
        """The next ``count`` generation calls get ``status`` with an OpenAI-shaped error body."""
        self._faults.extend(_Fault("error", status=status) for _ in range(count))

    def throttle_next(self, count: int = 1, *, retry_after: float = 0.0) -> None:
        """The next ``count`` generation calls get 429 with ``Retry-After: retry_after`` (seconds)."""
        self._faults.extend(_Fault("throttle", status=429, retry_after=retry_after) for _ in range(count))

    def stall_next(self, count: int = 1) -> None:
        """The next ``count`` generation calls are never answered (until the client goes away)."""
        self._faults.extend(_Fault("stall") for _ in range(count))

    def break_next(self, count: int = 1, *, after_events: int = 1) -> None:
        """The next ``count`` calls lose their connection: streams after ``after_events`` events, others at once."""
        self._faults.extend(_Fault("break", after_events=after_events) for _ in range(count))

    def abort_next(
        self, count: int = 1, *, after_tokens: int = 2, release: anyio.Event | None = None
    ) -> None:
        """The next ``count`` generation calls are aborted (finish reason ``"abort"``, as an engine aborts them for
        a weight update) after ``after_tokens`` tokens. With ``release``, the abort goes out only once it is
        set: a stream's events before the aborting one first, a whole answer all of it (:attr:`aborting` counts
        the answers waiting so)."""
        self._faults.extend(_Fault("abort", after_events=after_tokens, release=release) for _ in range(count))

    def omit_ids_next(self, count: int = 1) -> None:
        """The next ``count`` generation calls are answered without token ids, as if not asked for them."""
        self._faults.extend(_Fault("no_ids") for _ in range(count))

    # ------------------------------------------------------------------ observation
    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("MockVLLM is not serving")
        return self._url

    def generation_requests(self) -> list[SeenRequest]:
        """The recorded POSTs to ``/v1/chat/completions`` and ``/v1/completions``."""
        return [r for r in self.requests if r.method == "POST" and r.path.endswith("completions")]

    def expected(self, body: Mapping[str, Any]) -> list[tuple[list[int], list[int]]]:
        """``(prompt_ids, response_ids)`` per choice, in index order, that this mock answers ``body`` with."""
        kind = "chat" if "messages" in body else "completion"
        prompt = self._given_prompt(body)[0] if kind == "chat" else None
        budget = functools.partial(self._budget, body)
        gen = _Generation(kind, body, budget, True, self.model, self.template, prompt)
        return [(c.prompt, c.ids) for c in gen.choices]

    async def wait_until(self, predicate: Callable[[MockVLLM], bool]) -> None:
        """Return once ``predicate(self)`` holds; re-checked whenever a request starts or ends.

        Waits on an event, never polls; bound it with ``anyio.fail_after`` in tests.
        """
        while not predicate(self):
            if self._changed is None:
                self._changed = anyio.Event()
            await self._changed.wait()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    # ------------------------------------------------------------------ life cycle
    async def start(self) -> None:
        """Bind and start answering; returns once the listener accepts connections."""
        if self._http is not None:
            raise RuntimeError("MockVLLM is already serving")
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        if self.scale_out is not None:
            app.router.add_post("/v1/chat/completions/render", self._render)
        if self.tokenizer and self.tokenizer_dir is None:
            self.tokenizer_dir = write_tokenizer(tempfile.mkdtemp(prefix="mock-tokenizer-"), self.template)
        http = HttpListener(
            app, self.host, self.port, keepalive_timeout=KEEPALIVE_SECONDS, shutdown_timeout=_CLOSE_TIMEOUT
        )
        self._url = await http.start()
        self._http, self.port = http, http.port
        self._stopping = False

    async def stop(self) -> None:
        """Stop listening, abandon calls in progress (counted neither as cancelled nor completed), close all."""
        http, self._http = self._http, None
        if http is None:
            return
        self._stopping = True
        with anyio.CancelScope(shield=True):
            await http.stop(self._tasks, cancel_wait=_CLOSE_TIMEOUT)
        if self.tokenizer_dir is not None:
            shutil.rmtree(self.tokenizer_dir, ignore_errors=True)
            self.tokenizer_dir = None

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled, then :meth:`stop`; ``task_status.started()`` once accepting connections."""
        await self.start()
        task_status.started()
        try:
            await anyio.sleep_forever()
        finally:
            await self.stop()

    async def __aenter__(self) -> MockVLLM:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ handlers
    async def _health(self, request: web.Request) -> web.Response:
        self._seen(request, b"", None)
        return web.Response()

    async def _models(self, request: web.Request) -> web.Response:
        self._seen(request, b"", None)
        card = {"id": self.model, "object": "model", "created": int(time.time()), "owned_by": "vllm"}
        root = self.model if self.tokenizer_dir is None else str(self.tokenizer_dir)
        card |= {"root": root, "parent": None, "max_model_len": self.max_model_len or 4096}
        return web.Response(body=orjson.dumps({"object": "list", "data": [card]}), content_type=_JSON_TYPE)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    def _seen(self, request: web.Request, raw: bytes, body: Any) -> None:
        if self.record_requests:
            headers = CIMultiDictProxy(CIMultiDict(request.headers))
            self.requests.append(
                SeenRequest(request.method, request.path, request.query_string, headers, raw, body)
            )
        self._notify()

    @staticmethod
    def _max_tokens(body: Mapping[str, Any]) -> int | None:
        limit = body.get("max_tokens") or body.get("max_completion_tokens")
        return limit if isinstance(limit, int) else None

    def _budget(self, body: Mapping[str, Any], prompt: Sequence[int]) -> tuple[int, str]:
        """Tokens generated for ``prompt`` and the finish reason: "length" when ``max_tokens`` or the context
        window (``max_model_len``, which a request without ``max_tokens`` may fill) cut the answer short."""
        return self._budget_for(self._max_tokens(body), prompt)

    def _budget_for(self, limit: int | None, prompt: Sequence[int]) -> tuple[int, str]:
        if limit is None and self.max_model_len is not None:
            limit = self.max_model_len - len(prompt)  # vLLM's default: the rest of the window
        if limit is not None and limit <= self.completion_tokens:
            # The mock's model would say completion_tokens tokens and then end: a limit at or below that
            # stops it before its end-of-sequence token, as an engine reports it.
            return max(limit, 0), "length"
        return self.completion_tokens, "stop"

    def _too_long(self, body: Mapping[str, Any], given: list[int] | None = None) -> web.Response | None:
        """vLLM's 400 for a prompt that, with the tokens asked for, does not fit in ``max_model_len``."""
        if self.max_model_len is None:
            return None
        asked = self._max_tokens(body) or 0
        for prompt in [given] if given is not None else prompt_token_ids(body, self.template):
            if len(prompt) + asked > self.max_model_len or len(prompt) >= self.max_model_len:
                message = (
                    f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                    f"requested {len(prompt) + asked} tokens ({len(prompt)} in the messages, {asked} in the "
                    "completion). Please reduce the length of the messages or completion."
                )
                return _json_error(400, message, "BadRequestError")
        return None

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.active += 1
        fault = self._faults.popleft() if self._faults else self._random_fault()
        done = False
        try:
            response = await self._answer(request, kind, fault)
            done = True
            return response
        except asyncio.CancelledError:
            if fault is not None and fault.kind == "break":
                self.broken += 1
            elif not self._stopping:
                self.cancelled += 1
            raise
        finally:
            self._tasks.discard(task)
            self.active -= 1
            if done:
                self.completed += 1
            self._notify()

    def _random_fault(self) -> _Fault | None:
        if self.failure_rate > 0 and self._rng.random() < self.failure_rate:
            self.failed_randomly += 1
            return _Fault("error", status=self.failure_status)
        return None

    def _delay(self) -> float:
        if self.latency_jitter > 0:
            return self.latency + self._rng.uniform(0.0, self.latency_jitter)
        return self.latency

    async def _answer(self, request: web.Request, kind: str, fault: _Fault | None) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            self._seen(request, raw, None)
            return _json_error(400, f"invalid JSON body: {exc}", "BadRequestError")
        self._seen(request, raw, body)
        if fault is not None and fault.kind not in ("no_ids", "abort"):
            return await self._fault(request, fault, body)
        delay = self._delay()
        if delay > 0:
            await anyio.sleep(delay)
        if self._replay:
            return await self._replay_answer(request, body)
        if not isinstance(body, dict):
            return _json_error(400, "request body must be a JSON object", "BadRequestError")
        if body.get("model") != self.model:
            return _json_error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
        prompt: list[int] | None = None
        if kind == "chat":
            prompt, refusal = self._given_prompt(body)
            if refusal is not None:
                return refusal
        refusal = self._too_long(body, prompt)
        if refusal is not None:
            return refusal
        with_ids = body.get("return_token_ids") is True and (fault is None or fault.kind == "abort")
        budget = functools.partial(self._budget, body)
        gen = _Generation(kind, body, budget, with_ids, self.model, self.template, prompt)
        release = None
        if fault is not None and fault.kind == "abort":
            gen.abort_after(fault.after_events)
            release = fault.release
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        request_id = f"{prefix}-mock{next(self._ids)}"
        if body.get("stream") is True:
            events = gen.events(request_id)
            held = None
            if release is not None:  # the aborting event waits for the release
                held = (next(i for i, e in enumerate(events) if b'"abort"' in e), release)
            return await self._stream(request, events, release=held)
        if release is not None:
            await self._held(release)
        headers = {**self.response_headers, "Content-Type": _JSON_TYPE}
        return web.Response(body=gen.response(request_id), headers=headers)

    async def _held(self, release: anyio.Event) -> None:
        """Wait for ``release`` as an answer holding its abort (counted in :attr:`aborting`)."""
        self.aborting += 1
        self._notify()
        try:
            await release.wait()
        finally:
            self.aborting -= 1

    def _given_prompt(self, body: Mapping[str, Any]) -> tuple[list[int] | None, web.Response | None]:
        """The prompt ids a chat request gives in ``kv_transfer_params["prompt_token_ids"]`` (``None``: render
        its messages), or vLLM's 400 for ids it refuses (see ``prompt_ids``)."""
        params = body.get("kv_transfer_params")
        if not isinstance(params, dict) or "prompt_token_ids" not in params:
            return None, None
        if self.prompt_ids == "refuse":
            message = "kv_transfer_params: Extra inputs are not permitted"
            return None, _json_error(400, message, "BadRequestError")
        messages = body.get("messages") or []
        non_text = any(
            isinstance(m, dict)
            and isinstance(m.get("content"), list)
            and any(not isinstance(p, dict) or p.get("type") != "text" for p in m["content"])
            for m in messages
        )
        if self.prompt_ids == "ignore" or body.get("echo") or non_text:
            return None, None
        ids = params["prompt_token_ids"]
        try:  # min / max in C: the mock stays cheap per call for the benchmarks
            valid = isinstance(ids, list) and bool(ids) and type(ids[0]) is int and 0 <= min(ids) <= max(ids) < VOCAB_SIZE  # fmt: skip
        except TypeError:
            valid = False
        if not valid:
            message = (
                "`kv_transfer_params['prompt_token_ids']` must be a non-empty list of token ids below the "
                f"vocabulary size ({VOCAB_SIZE})"
            )
            error = orjson.loads(_error_body(400, message, "BadRequestError"))
            error["error"]["param"] = "kv_transfer_params.prompt_token_ids"
            return None, web.Response(status=400, body=orjson.dumps(error), content_type=_JSON_TYPE)
        return ids, None

    async def _stream(
        self,
        request: web.Request,
        events: Sequence[bytes],
        break_after: int = -1,
        release: tuple[int, anyio.Event] | None = None,
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={**self.response_headers, "Content-Type": _SSE_TYPE})
        await response.prepare(request)
        for i, event in enumerate(events):
            if i == break_after:
                await self._break(request)
            if release is not None and i == release[0]:
                await self._held(release[1])
            if i and self.chunk_latency > 0:
                await anyio.sleep(self.chunk_latency)
            await response.write(event)
        if self.eof_delay > 0:
            await anyio.sleep(self.eof_delay)
        await response.write_eof()
        return response

    async def _fault(self, request: web.Request, fault: _Fault, body: Any) -> web.StreamResponse:
        if fault.kind == "error":
            return _json_error(fault.status, f"injected failure ({fault.status})", "InternalServerError")
        if fault.kind == "throttle":
            response = _json_error(429, "injected rate limit", "RateLimitError")
            response.headers["Retry-After"] = f"{fault.retry_after:g}"
            return response
        if fault.kind == "stall":
            await anyio.sleep_forever()
        # "break": a stream loses its connection after some events, anything else before any answer.
        if isinstance(body, dict) and body.get("stream") is True:
            gen = _Generation(
                "chat" if "messages" in body else "completion",
                body,
                functools.partial(self._budget, body),
                True,
                self.model,
            )
            return await self._stream(request, gen.events("broken"), break_after=fault.after_events)
        await self._break(request)
        raise AssertionError("unreachable")  # pragma: no cover

    @staticmethod
    async def _break(request: web.Request) -> None:
        """Close the connection without ending the response, then wait for aiohttp to cancel this handler.

        An orderly close (FIN) rather than a reset: the bytes already written still reach the client, which then
        sees a truncated chunked body (or no response at all), like a backend process that died.
        """
        transport = request.transport
        if transport is not None:
            transport.close()
        await anyio.sleep_forever()

    async def _replay_answer(self, request: web.Request, body: Any) -> web.StreamResponse:
        case = self._replay.get(_replay_key(request.method, request.path, body))
        if case is None:
            return _json_error(404, "no recorded response matches this request", "NotFoundError")
        headers = {"Content-Type": case.content_type}
        if not case.streamed:
            return web.Response(status=case.status, body=case.response, headers=headers)
        data = case.response
        pieces = [data[i : i + REPLAY_PIECE] for i in range(0, len(data), REPLAY_PIECE)]
        response = web.StreamResponse(status=case.status, headers=headers)
        await response.prepare(request)
        for i, piece in enumerate(pieces):
            if i and self.chunk_latency > 0:
                await anyio.sleep(self.chunk_latency)
            await response.write(piece)
        await response.write_eof()
        return response

    # ------------------------------------------------------------------ the render route (vLLM --enable-scale-out)
    def _scale_out_refusal(self, request: web.Request) -> web.Response | None:
        if self.scale_out:
            return None
        self._seen(request, b"", None)
        message = (
            "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
        )
        return _json_error(403, message, "PermissionDeniedError")

    async def _read_json(self, request: web.Request) -> tuple[Any, web.Response | None]:
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            self._seen(request, raw, None)
            return None, _json_error(400, f"invalid JSON body: {exc}", "BadRequestError")
        self._seen(request, raw, body)
        if not isinstance(body, dict):
            return None, _json_error(400, "request body must be a JSON object", "BadRequestError")
        if body.get("model") not in (None, self.model):
            return None, _json_error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
        return body, None

    async def _render(self, request: web.Request) -> web.Response:
        """``POST /v1/chat/completions/render``: the chat request's prompt ids and sampling parameters."""
        if (refusal := self._scale_out_refusal(request)) is not None:
            return refusal
        body, error = await self._read_json(request)
        if error is not None:
            return error
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            return _json_error(400, "messages must be a non-empty list", "BadRequestError")
        [ids] = prompt_token_ids(body, self.template)
        limit = self._max_tokens(body)
        if limit is None and self.max_model_len is not None:
            limit = self.max_model_len - len(ids)
        logprobs = (body.get("top_logprobs") or 0) if body.get("logprobs") else None
        forced = _forced_tool(body)
        sampling = {
            "n": 1,
            "temperature": body.get("temperature", 1.0),
            "top_p": body.get("top_p", 1.0),
            "top_k": body.get("top_k", 0),
            "seed": body.get("seed"),
            "max_tokens": limit if limit is not None else 16,
            "min_tokens": body.get("min_tokens", 0),
            "logprobs": logprobs,
            "stop": body.get("stop") or [],
            "structured_outputs": {"json": {"type": "array"}} if forced is not None else None,
        }
        answer = {
            "request_id": f"chatcmpl-mock{next(self._ids)}",
            "token_ids": ids,
            "features": None,
            "sampling_params": sampling,
            "model": body.get("model"),
            "stream": bool(body.get("stream")),
            "stream_options": body.get("stream_options") if body.get("stream") else None,
            "output_mode": "tokens",
            "cache_salt": None,
            "priority": 0,
        }
        return web.Response(body=orjson.dumps(answer), content_type=_JSON_TYPE)


def _json_error(status: int, message: str, type_: str) -> web.Response:
    return web.Response(
        status=status, body=_error_body(status, message, type_), headers={"Content-Type": _JSON_TYPE}
    )
