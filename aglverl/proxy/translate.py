"""The Responses API and Anthropic Messages, spoken in front of any chat-completions backend.

Agents written for OpenAI's Responses API (``client.responses.create``, the openai-agents SDK's defaults) or
for Anthropic's Messages API (the ``anthropic`` SDK with ``base_url`` set) talk to the proxy on
``.../v1/responses`` and ``.../v1/messages``. vLLM (and the embedded inference server) return token ids only
on chat completions, so each such call is translated into a chat completion toward the backend (the proxy
then asks for ``return_token_ids`` and records the call like any chat call) and the backend's answer is
translated back into the agent's API: a whole JSON body, or an event stream translated event by event as it
arrives (nothing of a stream is held back beyond the SSE event being parsed).

One :class:`Translator` per call (:func:`new_translator`): :meth:`~Translator.request` validates the agent's
body and returns the chat body; then exactly one of :meth:`~Translator.whole` (a body with a length) or
:meth:`~Translator.open` + :meth:`~Translator.feed` ... + :meth:`~Translator.close` (a stream, or any body the
relay streams) turns the backend's bytes into the agent's, and :meth:`~Translator.abort` ends a stream that
broke after its head went out. Translators are pure (no I/O, no clock but ``created_at``), so they are
tested on bytes alone.

What is translated (field names are the APIs' own):

- Responses: ``input`` (a string, or items: messages with ``input_text``/``output_text``/``input_image``
  parts, ``function_call``, ``function_call_output``), ``instructions``, function ``tools``, ``tool_choice``,
  ``parallel_tool_calls``, ``max_output_tokens``, ``temperature``, ``top_p``, ``text.format``,
  ``reasoning.effort``, ``top_logprobs`` / ``include: ["message.output_text.logprobs"]``, ``stream``.
  Out: ``message`` and ``function_call`` output items; ``status`` ``incomplete`` (``max_output_tokens``) when
  the backend stopped on length; streams ``response.created``, ``response.in_progress``,
  ``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``,
  ``response.function_call_arguments.delta`` ... ``response.completed`` / ``response.incomplete`` with usage,
  and ``response.failed`` when the backend fails mid-stream.
- Messages: ``system``, ``messages`` with ``text`` / ``image`` / ``tool_use`` / ``tool_result`` blocks,
  ``max_tokens``, ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``tools``, ``tool_choice``,
  ``stream``. Out: ``text`` and ``tool_use`` blocks, ``stop_reason`` ``end_turn`` / ``max_tokens`` /
  ``stop_sequence`` / ``tool_use``; streams ``message_start``, ``content_block_start`` / ``_delta`` /
  ``_stop``, ``message_delta``, ``message_stop``, and an ``error`` event when the backend fails mid-stream.

Tool calls come from the backend's own tool parser (vLLM's ``--tool-call-parser``): its chat ``tool_calls``
become ``function_call`` items / ``tool_use`` blocks, and those the agent sends back become chat
``tool_calls`` and ``tool`` messages again. The chat tool call id is the ``call_id`` / ``tool_use`` id.

Bad input: a body the translation cannot express faithfully is refused with a 400 naming the field
(:class:`TranslationError`), never sent half-translated: server-side state these APIs can carry
(``previous_response_id``, ``store: true``, ``conversation``, ``background``, stored ``prompt`` templates,
Anthropic ``container`` / ``mcp_servers``), hosted tools, unknown fields and unknown item or block types.
A few vLLM sampling extensions (``top_k``, ``min_p``, ``seed``, ``repetition_penalty``, ...) an SDK may add
through ``extra_body`` pass to the chat body unchanged. Errors reach the agent in its API's shape
(:func:`error_body`): OpenAI's ``{"error": {"message", "type", "param", "code"}}`` for Responses, Anthropic's
``{"type": "error", "error": {"type", "message"}}`` for Messages.
"""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

__all__ = [
    "TRANSLATED_PATHS",
    "Api",
    "MessagesTranslator",
    "ResponsesTranslator",
    "TranslationError",
    "Translator",
    "error_body",
    "new_translator",
]

Api = Literal["responses", "messages"]
#: Paths (after ``/v1/``) that are translated, and the API each one speaks (POST only).
TRANSLATED_PATHS: Mapping[str, Api] = {"responses": "responses", "messages": "messages"}
#: Where a translated call goes on the backend.
CHAT_TARGET = "/v1/chat/completions"
#: vLLM sampling extensions either API may carry (an SDK's ``extra_body``); copied to the chat body as they are.
PASSTHROUGH: frozenset[str] = frozenset(
    {
        "top_k",
        "min_p",
        "seed",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "stop_token_ids",
        "min_tokens",
        "ignore_eos",
        "return_token_ids",
        "logprobs",
    }
)
#: Largest error body (bytes) kept to translate when a backend streams one.
ERROR_BODY_LIMIT = 64 << 10

_OPENAI_ERROR_TYPES: Mapping[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
_ANTHROPIC_ERROR_TYPES: Mapping[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


class TranslationError(Exception):
    """A body that cannot be translated: ``status`` (400 for the agent's, 502 for the backend's), a message
    naming what was wrong, and ``param``, the offending field's dotted path when there is one."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(api: Api, status: int, message: str, param: str | None = None) -> bytes:
    """The JSON error body ``api`` answers ``status`` with."""
    if api == "messages":
        kind = _ANTHROPIC_ERROR_TYPES.get(status, "api_error")
        return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})
    kind = _OPENAI_ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": None}})


def new_translator(api: Api) -> Translator:
    """A fresh translator for one call in ``api``."""
    return ResponsesTranslator() if api == "responses" else MessagesTranslator()


def _backend_error(body: bytes, status: int, limit: int = 2000) -> tuple[str, str | None]:
    """The message (and param) of a backend's OpenAI-shaped error body; the raw text otherwise."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        obj = None
    error = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        param = error.get("param")
        return error["message"][:limit], param if isinstance(param, str) else None
    text = body[:limit].decode("utf-8", "replace").strip()
    return text or f"backend answered {status}", None


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---------------------------------------------------------------------------------------------- validation
_TYPE_NAMES = {str: "a string", int: "an integer", bool: "a boolean", dict: "an object", list: "an array"}


class _Fields:
    """Reads the fields of one JSON object, naming the dotted path of any that is wrong."""

    __slots__ = ("obj", "unread", "where")

    def __init__(self, obj: Any, where: str) -> None:
        if not isinstance(obj, dict):
            raise _bad(where or "body", "must be a JSON object")
        self.obj: dict[str, Any] = obj
        self.where = where
        self.unread = set(obj)

    def path(self, key: str | int) -> str:
        return f"{self.where}.{key}" if self.where else str(key)

    def get(self, key: str, kind: type | tuple[type, ...] | None = None, *, required: bool = False) -> Any:
        """The field's value (``None`` when absent or null); raises when it is missing but required or of
        another JSON type than ``kind``."""
        self.unread.discard(key)
        value = self.obj.get(key)
        if value is None:
            if required:
                raise _bad(self.path(key), "is required")
            return None
        if kind is not None and not _is(value, kind):
            kinds = kind if isinstance(kind, tuple) else (kind,)
            raise _bad(
                self.path(key), "must be " + " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
            )
        return value

    def number(self, key: str, low: float, high: float | None = None) -> float | int | None:
        value = self.get(key, (int, float))
        if value is not None and (value < low or (high is not None and value > high)):
            bound = f"between {low:g} and {high:g}" if high is not None else f"at least {low:g}"
            raise _bad(self.path(key), f"must be {bound}, not {value}")
        return value

    def refuse(self, key: str, why: str, allowed: Any = None) -> None:
        """Refuse a field set to anything but ``allowed`` (absent, null or ``allowed`` pass)."""
        self.unread.discard(key)
        value = self.obj.get(key)
        if value is not None and value != allowed:
            raise _bad(self.path(key), why)

    def ignore(self, *keys: str) -> None:
        self.unread.difference_update(keys)

    def done(self, extras: dict[str, Any] | None = None) -> None:
        """Refuse fields nobody read; with ``extras``, vLLM's sampling extensions are copied there first."""
        if extras is not None:
            for key in sorted(self.unread & PASSTHROUGH):
                extras[key] = self.obj[key]
            self.unread -= PASSTHROUGH
        if self.unread:
            names = ", ".join(f"'{self.path(k)}'" for k in sorted(self.unread))
            raise TranslationError(400, f"unsupported field(s) {names}", self.path(min(self.unread)))


def _is(value: Any, kind: type | tuple[type, ...]) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool):
        return bool in kinds
    return isinstance(value, kinds)


def _bad(path: str, what: str) -> TranslationError:
    return TranslationError(400, f"field '{path}': {what}", path)


def _items(fields: _Fields, key: str, *, required: bool = False) -> list[tuple[_Fields | Any, str]]:
    """The elements of an array field with their paths."""
    values = fields.get(key, list, required=required) or []
    return [(v, fields.path(key) + f".{i}") for i, v in enumerate(values)]


def _text_of(parts: Any, where: str, kinds: frozenset[str]) -> str:
    """The text of a string or of a list of text parts whose ``type`` is in ``kinds``."""
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        raise _bad(where, "must be a string or an array of text parts")
    texts = []
    for i, part in enumerate(parts):
        p = _Fields(part, f"{where}.{i}")
        kind = p.get("type", str, required=True)
        if kind not in kinds:
            raise _bad(p.path("type"), f"'{kind}' is not supported here (only {', '.join(sorted(kinds))})")
        texts.append(p.get("text", str, required=True))
        p.ignore("annotations", "logprobs", "cache_control", "citations", "id")
        p.done()
    return "".join(texts)


# ---------------------------------------------------------------------------------------------- SSE
class _SSEDecoder:
    """Splits a byte stream into SSE ``data`` payloads (chunks cut anywhere; LF or CR LF line ends)."""

    __slots__ = ("_buf", "_data")

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf + chunk if self._buf else chunk
        out: list[bytes] = []
        start = 0
        while (end := buf.find(b"\n", start)) >= 0:
            line = buf[start:end].rstrip(b"\r")
            start = end + 1
            if not line:
                if self._data:
                    out.append(b"\n".join(self._data))
                    self._data = []
            elif line[:5] == b"data:":
                self._data.append(line[6:] if line[5:6] == b" " else line[5:])
        self._buf = buf[start:]
        return out


def _event(name: str, obj: Any) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


# ---------------------------------------------------------------------------------------------- base
@dataclass(slots=True)
class _Block:
    """One output item (Responses) / content block (Messages) being assembled from chat deltas."""

    kind: Literal["text", "tool"]
    index: int
    id: str
    text: str = ""  # text, or a tool call's arguments
    name: str = ""
    call_id: str = ""
    logprobs: list[Any] = field(default_factory=list)
    closed: bool = False


class Translator(ABC):
    """Translates one call between an agent's API and a chat completion (see the module docstring).

    Not reusable: one instance per call. Methods never raise on a backend's answer except
    :meth:`whole`, which raises :class:`TranslationError` (502) for a success body that is not a chat
    completion; a stream that turns out malformed is ended with the API's error ending instead.
    """

    api: Api

    def __init__(self) -> None:
        self.model: str | None = None
        self.stream = False
        self.logprobs = False  # the agent asked for them (the proxy may ask the backend for its own reasons)
        self.stops: list[str] = []
        self.created_at = int(time.time())
        # Response side.
        self._status = 200
        self._sse = False
        self._decoder = _SSEDecoder()
        self._buffer = bytearray()
        self._started = False
        self._ended = False
        self._blocks: list[_Block] = []
        self._open: _Block | None = None
        self._tools: dict[int, _Block] = {}  # chat tool-call index -> its block
        self._finish: str | None = None
        self._stop_reason: Any = None
        self._usage: dict[str, Any] | None = None
        self._prompt_tokens: int | None = None
        self._backend_model: str | None = None

    # ------------------------------------------------------------------ request
    def request(self, body: bytes) -> bytes:
        """The chat-completions body for the agent's ``body``; raises :class:`TranslationError` (400)."""
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise TranslationError(400, f"request body is not valid JSON: {exc}") from None
        chat = self._to_chat(_Fields(obj, ""))
        if self.stream:
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}  # usage for the final event
        return orjson.dumps(chat)

    @abstractmethod
    def _to_chat(self, body: _Fields) -> dict[str, Any]: ...

    def error(self, status: int, message: str, param: str | None = None) -> bytes:
        """This API's error body."""
        return error_body(self.api, status, message, param)

    # ------------------------------------------------------------------ whole answers
    def whole(self, status: int, body: bytes) -> bytes:
        """The agent's body for a backend's whole answer (an error body for ``status >= 400``)."""
        if status >= 400:
            return self.error(status, *_backend_error(body, status))
        try:
            chat = orjson.loads(body)
        except orjson.JSONDecodeError:
            chat = None
        choices = chat.get("choices") if isinstance(chat, dict) else None
        if not choices or not isinstance(choices[0], dict) or not isinstance(choices[0].get("message"), dict):
            raise TranslationError(502, f"the backend's answer to {self.api} is not a chat completion")
        assert isinstance(chat, dict)
        self._backend_model = chat.get("model") if isinstance(chat.get("model"), str) else None
        self._usage = chat.get("usage") if isinstance(chat.get("usage"), dict) else None
        choice = choices[0]
        message = choice["message"]
        self._finish, self._stop_reason = choice.get("finish_reason"), choice.get("stop_reason")
        content = message.get("content")
        if isinstance(content, str) and content:
            lps = (choice.get("logprobs") or {}).get("content") if self.logprobs else None
            self._blocks.append(_Block("text", 0, self._item_id("text"), content, logprobs=list(lps or ())))
        for tc in message.get("tool_calls") or ():
            function = tc.get("function") or {}
            block = _Block("tool", len(self._blocks), self._item_id("tool"), function.get("arguments") or "")
            block.name, block.call_id = function.get("name") or "", tc.get("id") or _new_id("call")
            self._blocks.append(block)
        return orjson.dumps(self._final())

    @abstractmethod
    def _final(self) -> dict[str, Any]:
        """The whole answer (Response / Message) from the blocks, finish reason and usage."""

    # ------------------------------------------------------------------ streams
    def open(self, status: int, sse: bool) -> None:
        """Start translating a streamed body: SSE chat chunks when ``sse``, else a body translated at close."""
        self._status, self._sse = status, sse and status < 400

    def feed(self, chunk: bytes) -> bytes:
        """The agent's bytes for the next piece of the backend's body (maybe empty)."""
        if self._ended:
            return b""
        if not self._sse:
            if self._status < 400 or len(self._buffer) < ERROR_BODY_LIMIT:
                self._buffer += chunk
            return b""
        out: list[bytes] = []
        for data in self._decoder.feed(chunk):
            if data == b"[DONE]":
                out += self._end()
                break
            try:
                event = orjson.loads(data)
            except orjson.JSONDecodeError:
                event = None
            if not isinstance(event, dict):
                out.append(self._fail("the backend sent an event that is not JSON"))
                break
            if isinstance(event.get("error"), dict):  # vLLM's (and our relay's) mid-stream error event
                out.append(self._fail(_backend_error(orjson.dumps(event), 500)[0]))
                break
            out += self._chunk(event)
        return b"".join(out)

    def close(self) -> bytes:
        """The agent's last bytes once the backend's body ended."""
        if self._ended:
            return b""
        if not self._sse:
            self._ended = True
            try:
                return self.whole(self._status, bytes(self._buffer))
            except TranslationError as exc:
                return self.error(exc.status, exc.message)
        if self._finish is not None:
            return b"".join(self._end())  # a backend that ended without "[DONE]" after finishing
        return self._fail("the backend ended the stream before the answer was finished")

    def abort(self, message: str) -> bytes:
        """End a stream that broke after its head went out, the way this API ends one on error."""
        if self._ended or not self._sse:
            return b""
        return self._fail(message)

    def _chunk(self, event: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if self._backend_model is None and isinstance(event.get("model"), str):
            self._backend_model = event["model"]
        ids = event.get("prompt_token_ids")
        if self._prompt_tokens is None and isinstance(ids, list):
            self._prompt_tokens = len(ids)
        if not self._started:
            self._started = True
            out += self._start()
        usage = event.get("usage")
        if isinstance(usage, dict):
            self._usage = usage
        for choice in event.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue  # the APIs have one answer; the chat body never asks for n > 1
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if text:
                lps = (choice.get("logprobs") or {}).get("content") if self.logprobs else None
                out += self._text(text, list(lps or ()))
            for tc in delta.get("tool_calls") or ():
                out += self._tool(tc)
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]
                self._stop_reason = choice.get("stop_reason")
        return out

    def _text(self, text: str, logprobs: list[Any]) -> list[bytes]:
        out: list[bytes] = []
        block = self._open
        if block is None or block.kind != "text":
            out += self._close_open()
            block = self._open = _Block("text", len(self._blocks), self._item_id("text"))
            self._blocks.append(block)
            out += self._block_start(block)
        block.text += text
        block.logprobs += logprobs
        out.append(self._text_delta(block, text, logprobs))
        return out

    def _tool(self, tc: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        index = tc.get("index", 0)
        function = tc.get("function") or {}
        block = self._tools.get(index)
        if block is None:
            out += self._close_open()
            block = self._open = self._tools[index] = _Block("tool", len(self._blocks), self._item_id("tool"))
            block.call_id, block.name = tc.get("id") or _new_id("call"), function.get("name") or ""
            self._blocks.append(block)
            out += self._block_start(block)
        elif function.get("name") and not block.name:
            block.name = function["name"]
        arguments = function.get("arguments")
        if arguments:
            block.text += arguments
            if (
                block is self._open
            ):  # parsers stream one call at a time; a late piece is only in the done event
                out.append(self._tool_delta(block, arguments))
        return out

    def _close_open(self) -> list[bytes]:
        block, self._open = self._open, None
        if block is None or block.closed:
            return []
        block.closed = True
        return self._block_stop(block)

    def _end(self) -> list[bytes]:
        self._ended = True
        out = [] if self._started else self._start()
        self._started = True
        out += self._close_open()
        return out + self._stream_end()

    def _fail(self, message: str) -> bytes:
        self._ended = True
        return self._stream_failed(message)

    def _output_tokens(self) -> int:
        usage = self._usage or {}
        return int(usage.get("completion_tokens") or 0)

    def _input_tokens(self) -> int:
        usage = self._usage or {}
        return int(usage.get("prompt_tokens") or self._prompt_tokens or 0)

    @abstractmethod
    def _item_id(self, kind: Literal["text", "tool"]) -> str: ...

    @abstractmethod
    def _start(self) -> list[bytes]: ...

    @abstractmethod
    def _block_start(self, block: _Block) -> list[bytes]: ...

    @abstractmethod
    def _text_delta(self, block: _Block, text: str, logprobs: list[Any]) -> bytes: ...

    @abstractmethod
    def _tool_delta(self, block: _Block, arguments: str) -> bytes: ...

    @abstractmethod
    def _block_stop(self, block: _Block) -> list[bytes]: ...

    @abstractmethod
    def _stream_end(self) -> list[bytes]: ...

    @abstractmethod
    def _stream_failed(self, message: str) -> bytes: ...


def _sampling(body: _Fields, chat: dict[str, Any], *, temperature_max: float) -> None:
    for key, high in (("temperature", temperature_max), ("top_p", 1.0)):
        value = body.number(key, 0.0, high)
        if value is not None:
            chat[key] = value


def _function_tool(name: Any, description: Any, parameters: Any, strict: Any = None) -> dict[str, Any]:
    function: dict[str, Any] = {
        "name": name,
        "parameters": parameters or {"type": "object", "properties": {}},
    }
    if description is not None:
        function["description"] = description
    if strict is not None:
        function["strict"] = strict
    return {"type": "function", "function": function}


def _tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# ---------------------------------------------------------------------------------------------- Responses
_RESPONSES_INCLUDES = frozenset({"message.output_text.logprobs", "reasoning.encrypted_content"})
_INPUT_TEXT = frozenset({"input_text", "output_text", "text"})


class ResponsesTranslator(Translator):
    """OpenAI's Responses API (``POST /v1/responses``) over chat completions."""

    api: Api = "responses"

    def __init__(self) -> None:
        super().__init__()
        self.id = _new_id("resp")
        self._echo: dict[str, Any] = {}
        self._seq = 0

    # ------------------------------------------------------------------ request
    def _to_chat(self, body: _Fields) -> dict[str, Any]:
        for key, why in (
            ("previous_response_id", "stored responses are not kept: send the whole conversation in 'input'"),
            ("conversation", "conversations are not kept: send the whole conversation in 'input'"),
            ("prompt", "stored prompt templates are not available: send 'instructions' and 'input'"),
            ("background_options", "background responses are not supported"),
            ("context_management", "server-side context management is not supported"),
        ):
            body.refuse(key, why)
        body.refuse("store", "responses are not stored: omit 'store' or set it to false", False)
        body.refuse("background", "background responses are not supported", False)
        body.refuse("truncation", "only 'disabled' truncation is supported", "disabled")
        body.ignore(
            "metadata", "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
            "prompt_cache_options", "service_tier", "stream_options", "max_tool_calls", "moderation",
        )  # fmt: skip
        chat: dict[str, Any] = {}
        self.model = body.get("model", str)
        if self.model is not None:
            chat["model"] = self.model
        self.stream = bool(body.get("stream", bool))
        messages: list[dict[str, Any]] = []
        instructions = body.get("instructions", (str, list))
        if instructions is not None:
            messages.append(
                {"role": "system", "content": _text_of(instructions, "instructions", _INPUT_TEXT)}
            )
        raw_input = body.get("input", (str, list), required=True)
        if isinstance(raw_input, str):
            messages.append({"role": "user", "content": raw_input})
        else:
            for item, where in _items(body, "input"):
                self._input_item(_Fields(item, where), messages)
        if not messages:
            raise _bad("input", "has no messages")
        chat["messages"] = messages
        limit = body.get("max_output_tokens", int)
        if limit is not None:
            if limit < 1:
                raise _bad("max_output_tokens", f"must be at least 1, not {limit}")
            chat["max_tokens"] = limit
        _sampling(body, chat, temperature_max=2.0)
        tools = [self._tool_param(_Fields(t, where)) for t, where in _items(body, "tools")]
        if tools:
            chat["tools"] = tools
        choice = body.get("tool_choice", (str, dict))
        if choice is not None:
            chat["tool_choice"] = self._tool_choice(choice)
        parallel = body.get("parallel_tool_calls", bool)
        if parallel is not None and tools:
            chat["parallel_tool_calls"] = parallel
        self._text_format(body, chat)
        self._reasoning(body, chat)
        self._logprob_options(body, chat)
        body.done(chat)
        self._echo = {
            "instructions": instructions,
            "max_output_tokens": limit,
            "metadata": body.obj.get("metadata") or {},
            "parallel_tool_calls": True if parallel is None else parallel,
            "temperature": chat.get("temperature"),
            "top_p": chat.get("top_p"),
            "tool_choice": choice if choice is not None else "auto",
            "tools": body.obj.get("tools") or [],
            "text": body.obj.get("text") or {"format": {"type": "text"}},
        }
        return chat

    def _input_item(self, item: _Fields, messages: list[dict[str, Any]]) -> None:
        kind = item.get("type", str) or "message"
        item.ignore("id", "status")
        if kind == "message":
            role = item.get("role", str, required=True)
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(item.path("role"), f"must be user, assistant, system or developer, not '{role}'")
            content = item.get("content", (str, list), required=True)
            if role == "user" and isinstance(content, list):
                message = {"role": "user", "content": self._user_parts(content, item.path("content"))}
            else:
                message = {"role": "system" if role == "developer" else role}
                message["content"] = _text_of(content, item.path("content"), _INPUT_TEXT | {"refusal"})
            messages.append(message)
        elif kind == "function_call":
            call = _tool_call(
                item.get("call_id", str, required=True),
                item.get("name", str, required=True),
                item.get("arguments", str, required=True),
            )
            last = messages[-1] if messages else None
            # Consecutive calls (and the text before them) are one assistant turn in chat completions.
            if last is not None and last["role"] == "assistant" and "tool_call_id" not in last:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", (str, list), required=True)
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id", str, required=True),
                    "content": _text_of(output, item.path("output"), _INPUT_TEXT),
                }
            )
        else:
            raise _bad(
                item.path("type"),
                f"input items of type '{kind}' are not supported (message, function_call, function_call_output)",
            )
        item.done()

    @staticmethod
    def _user_parts(content: list[Any], where: str) -> list[dict[str, Any]]:
        parts = []
        for i, raw in enumerate(content):
            part = _Fields(raw, f"{where}.{i}")
            kind = part.get("type", str, required=True)
            if kind in _INPUT_TEXT:
                parts.append({"type": "text", "text": part.get("text", str, required=True)})
            elif kind == "input_image":
                url = part.get("image_url", str)
                if url is None:
                    raise _bad(part.path("image_url"), "is required (uploaded file ids are not available)")
                image = {"url": url}
                if (detail := part.get("detail", str)) is not None:
                    image["detail"] = detail
                parts.append({"type": "image_url", "image_url": image})
            else:
                raise _bad(part.path("type"), f"'{kind}' parts are not supported (input_text, input_image)")
            part.done()
        return parts

    @staticmethod
    def _tool_param(tool: _Fields) -> dict[str, Any]:
        kind = tool.get("type", str, required=True)
        if kind != "function":
            raise _bad(tool.path("type"), f"hosted tools ('{kind}') are not available: only 'function' tools")
        out = _function_tool(
            tool.get("name", str, required=True),
            tool.get("description", str),
            tool.get("parameters", dict),
            tool.get("strict", bool),
        )
        tool.done()
        return out

    @staticmethod
    def _tool_choice(choice: str | dict[str, Any]) -> Any:
        if isinstance(choice, str):
            if choice not in ("auto", "none", "required"):
                raise _bad("tool_choice", f"must be auto, none, required or a function, not '{choice}'")
            return choice
        fields = _Fields(choice, "tool_choice")
        if fields.get("type", str, required=True) != "function":
            raise _bad("tool_choice.type", "only 'function' choices are supported")
        name = fields.get("name", str, required=True)
        fields.done()
        return {"type": "function", "function": {"name": name}}

    @staticmethod
    def _text_format(body: _Fields, chat: dict[str, Any]) -> None:
        text = body.get("text", dict)
        if text is None:
            return
        fields = _Fields(text, "text")
        fields.ignore("verbosity")
        fmt = fields.get("format", dict)
        fields.done()
        if fmt is None:
            return
        f = _Fields(fmt, "text.format")
        kind = f.get("type", str, required=True)
        if kind == "json_schema":
            schema: dict[str, Any] = {"name": f.get("name", str, required=True)}
            schema["schema"] = f.get("schema", dict, required=True)
            for key, kind_ in (("description", str), ("strict", bool)):
                if (value := f.get(key, kind_)) is not None:
                    schema[key] = value
            chat["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif kind == "json_object":
            chat["response_format"] = {"type": "json_object"}
        elif kind != "text":
            raise _bad("text.format.type", f"must be text, json_schema or json_object, not '{kind}'")
        f.done()

    @staticmethod
    def _reasoning(body: _Fields, chat: dict[str, Any]) -> None:
        reasoning = body.get("reasoning", dict)
        if reasoning is None:
            return
        fields = _Fields(reasoning, "reasoning")
        fields.ignore("summary", "generate_summary")
        effort = fields.get("effort", str)
        fields.done()
        if effort is not None:
            chat["reasoning_effort"] = effort

    def _logprob_options(self, body: _Fields, chat: dict[str, Any]) -> None:
        include = body.get("include", list) or []
        for i, value in enumerate(include):
            if value not in _RESPONSES_INCLUDES:
                raise _bad(f"include.{i}", f"'{value}' is not available (only {sorted(_RESPONSES_INCLUDES)})")
        top = body.number("top_logprobs", 0, 20)
        if "message.output_text.logprobs" in include or top is not None:
            self.logprobs = True
            chat["logprobs"] = True
            if top is not None:
                chat["top_logprobs"] = int(top)

    # ------------------------------------------------------------------ answers
    def _item_id(self, kind: Literal["text", "tool"]) -> str:
        return _new_id("msg" if kind == "text" else "fc")

    def _response(self, status: str, output: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": None,
            "model": self._backend_model or self.model or "",
            "output": output,
            "store": False,
            "truncation": "disabled",
            "usage": None,
            **self._echo,
            **extra,
        }

    def _item(self, block: _Block, status: str) -> dict[str, Any]:
        if block.kind == "tool":
            return {
                "id": block.id,
                "type": "function_call",
                "status": status,
                "call_id": block.call_id,
                "name": block.name,
                "arguments": block.text,
            }
        return {
            "id": block.id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [self._part(block)],
        }

    def _part(self, block: _Block) -> dict[str, Any]:
        part: dict[str, Any] = {"type": "output_text", "text": block.text, "annotations": []}
        if self.logprobs:
            part["logprobs"] = block.logprobs
        return part

    def _outcome(self) -> tuple[str, dict[str, Any] | None]:
        if self._finish == "length":
            return "incomplete", {"reason": "max_output_tokens"}
        if self._finish == "content_filter":
            return "incomplete", {"reason": "content_filter"}
        return "completed", None

    def _usage_out(self) -> dict[str, Any] | None:
        if self._usage is None:
            return None
        cached = (self._usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        input_tokens, output_tokens = self._input_tokens(), self._output_tokens()
        return {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        }

    def _final(self) -> dict[str, Any]:
        status, details = self._outcome()
        blocks = self._blocks or [
            _Block("text", 0, self._item_id("text"))
        ]  # an empty answer is an empty message
        item_status = "incomplete" if status == "incomplete" else "completed"
        output = [self._item(b, item_status) for b in blocks]
        return self._response(status, output, incomplete_details=details, usage=self._usage_out())

    # ------------------------------------------------------------------ events
    def _emit(self, kind: str, **fields: Any) -> bytes:
        obj = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return _event(kind, obj)

    def _start(self) -> list[bytes]:
        snapshot = self._response("in_progress", [])
        return [
            self._emit("response.created", response=snapshot),
            self._emit("response.in_progress", response=snapshot),
        ]

    def _block_start(self, block: _Block) -> list[bytes]:
        item = self._item(block, "in_progress")
        if block.kind == "tool":
            return [self._emit("response.output_item.added", output_index=block.index, item=item)]
        item["content"] = []
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self._emit("response.output_item.added", output_index=block.index, item=item),
            self._emit(
                "response.content_part.added",
                item_id=block.id,
                output_index=block.index,
                content_index=0,
                part=part,
            ),
        ]

    def _text_delta(self, block: _Block, text: str, logprobs: list[Any]) -> bytes:
        return self._emit(
            "response.output_text.delta",
            item_id=block.id,
            output_index=block.index,
            content_index=0,
            delta=text,
            logprobs=logprobs,
        )

    def _tool_delta(self, block: _Block, arguments: str) -> bytes:
        return self._emit(
            "response.function_call_arguments.delta",
            item_id=block.id,
            output_index=block.index,
            delta=arguments,
        )

    def _block_stop(self, block: _Block) -> list[bytes]:
        status = "incomplete" if self._outcome()[0] == "incomplete" else "completed"
        where = {"item_id": block.id, "output_index": block.index}
        if block.kind == "tool":
            done = self._emit(
                "response.function_call_arguments.done", **where, name=block.name, arguments=block.text
            )
            return [
                done,
                self._emit(
                    "response.output_item.done", output_index=block.index, item=self._item(block, status)
                ),
            ]
        return [
            self._emit(
                "response.output_text.done",
                **where,
                content_index=0,
                text=block.text,
                logprobs=block.logprobs,
            ),
            self._emit("response.content_part.done", **where, content_index=0, part=self._part(block)),
            self._emit("response.output_item.done", output_index=block.index, item=self._item(block, status)),
        ]

    def _stream_end(self) -> list[bytes]:
        out: list[bytes] = []
        if not self._blocks:  # an empty answer still has its (empty) message, as the whole answer does
            block = _Block("text", 0, self._item_id("text"), closed=True)
            self._blocks.append(block)
            out += self._block_start(block) + self._block_stop(block)
        final = self._final()
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return [*out, self._emit(kind, response=final)]

    def _stream_failed(self, message: str) -> bytes:
        status = "incomplete" if self._outcome()[0] == "incomplete" else "completed"
        output = [self._item(b, status if b.closed else "incomplete") for b in self._blocks]
        error = {"code": "server_error", "message": message}
        snapshot = self._response("failed", output, error=error, usage=self._usage_out())
        head = b"" if self._started else b"".join(self._start())
        self._started = True
        return head + self._emit("response.failed", response=snapshot)


# ---------------------------------------------------------------------------------------------- Messages
_STOP_REASONS: Mapping[str, str] = {
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
}


class MessagesTranslator(Translator):
    """Anthropic's Messages API (``POST /v1/messages``) over chat completions."""

    api: Api = "messages"

    def __init__(self) -> None:
        super().__init__()
        self.id = _new_id("msg")

    # ------------------------------------------------------------------ request
    def _to_chat(self, body: _Fields) -> dict[str, Any]:
        for key in ("container", "mcp_servers", "context_management"):
            body.refuse(key, f"'{key}' is not available: it needs Anthropic's servers")
        body.ignore("metadata", "service_tier", "cache_control", "inference_geo", "speed", "diagnostics")
        thinking = body.get("thinking", dict)
        if thinking is not None and thinking.get("type") != "disabled":
            raise _bad("thinking", "extended thinking is not supported: omit it or set type 'disabled'")
        chat: dict[str, Any] = {}
        self.model = body.get("model", str, required=True)
        chat["model"] = self.model
        self.stream = bool(body.get("stream", bool))
        limit = body.get("max_tokens", int, required=True)
        if limit < 1:
            raise _bad("max_tokens", f"must be at least 1, not {limit}")
        chat["max_tokens"] = limit
        messages: list[dict[str, Any]] = []
        system = body.get("system", (str, list))
        if system is not None:
            text = system if isinstance(system, str) else self._system_text(system)
            messages.append({"role": "system", "content": text})
        for message, where in _items(body, "messages", required=True):
            self._input_message(_Fields(message, where), messages)
        if not any(m["role"] != "system" for m in messages):
            raise _bad("messages", "must hold at least one message")
        chat["messages"] = messages
        stops = body.get("stop_sequences", list)
        if stops:
            if not all(isinstance(s, str) for s in stops):
                raise _bad("stop_sequences", "must be an array of strings")
            self.stops = list(stops)
            chat["stop"] = self.stops
        _sampling(body, chat, temperature_max=1.0)
        tools = [self._tool_param(_Fields(t, where)) for t, where in _items(body, "tools")]
        if tools:
            chat["tools"] = tools
        choice = body.get("tool_choice", dict)
        if choice is not None:
            self._tool_choice(_Fields(choice, "tool_choice"), chat)
        body.done(chat)
        return chat

    @staticmethod
    def _system_text(blocks: list[Any]) -> str:
        texts = []
        for i, raw in enumerate(blocks):
            block = _Fields(raw, f"system.{i}")
            if block.get("type", str, required=True) != "text":
                raise _bad(block.path("type"), "system blocks must be 'text'")
            texts.append(block.get("text", str, required=True))
            block.ignore("cache_control", "citations")
            block.done()
        return "\n".join(texts)

    def _input_message(self, message: _Fields, messages: list[dict[str, Any]]) -> None:
        role = message.get("role", str, required=True)
        if role not in ("user", "assistant"):
            raise _bad(message.path("role"), f"must be user or assistant, not '{role}'")
        content = message.get("content", (str, list), required=True)
        message.done()
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            return
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        for i, raw in enumerate(content):
            block = _Fields(raw, f"{message.path('content')}.{i}")
            block.ignore("cache_control", "citations")
            kind = block.get("type", str, required=True)
            if kind == "text":
                parts.append({"type": "text", "text": block.get("text", str, required=True)})
            elif kind == "image" and role == "user":
                parts.append(
                    self._image(_Fields(block.get("source", dict, required=True), block.path("source")))
                )
            elif kind == "tool_use" and role == "assistant":
                arguments = orjson.dumps(block.get("input", dict, required=True)).decode()
                name = block.get("name", str, required=True)
                calls.append(_tool_call(block.get("id", str, required=True), name, arguments))
            elif kind == "tool_result" and role == "user":
                # Chat completions wants tool answers as their own messages, right after the calls.
                content_ = block.get("content", (str, list)) or ""
                text = _text_of(content_, block.path("content"), frozenset({"text"}))
                block.ignore("is_error")
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": block.get("tool_use_id", str, required=True),
                        "content": text,
                    }
                )
            else:
                raise _bad(block.path("type"), f"'{kind}' blocks are not supported in {role} messages")
            block.done()
        if role == "assistant":
            text = "".join(p["text"] for p in parts)
            out: dict[str, Any] = {"role": "assistant", "content": text or None}
            if calls:
                out["tool_calls"] = calls
            messages.append(out)
        elif parts:
            only_text = all(p["type"] == "text" for p in parts)
            messages.append(
                {"role": "user", "content": "".join(p["text"] for p in parts) if only_text else parts}
            )

    @staticmethod
    def _image(source: _Fields) -> dict[str, Any]:
        kind = source.get("type", str, required=True)
        if kind == "base64":
            url = f"data:{source.get('media_type', str, required=True)};base64,{source.get('data', str, required=True)}"
        elif kind == "url":
            url = source.get("url", str, required=True)
        else:
            raise _bad(source.path("type"), f"image sources of type '{kind}' are not supported (base64, url)")
        source.done()
        return {"type": "image_url", "image_url": {"url": url}}

    @staticmethod
    def _tool_param(tool: _Fields) -> dict[str, Any]:
        kind = tool.get("type", str)
        if kind not in (None, "custom"):
            raise _bad(tool.path("type"), f"server tools ('{kind}') are not available: only client tools")
        tool.ignore("cache_control")
        out = _function_tool(
            tool.get("name", str, required=True),
            tool.get("description", str),
            tool.get("input_schema", dict, required=True),
            tool.get("strict", bool),
        )
        tool.done()
        return out

    @staticmethod
    def _tool_choice(choice: _Fields, chat: dict[str, Any]) -> None:
        kind = choice.get("type", str, required=True)
        if kind in ("auto", "none"):
            chat["tool_choice"] = kind
        elif kind == "any":
            chat["tool_choice"] = "required"
        elif kind == "tool":
            chat["tool_choice"] = {
                "type": "function",
                "function": {"name": choice.get("name", str, required=True)},
            }
        else:
            raise _bad("tool_choice.type", f"must be auto, any, tool or none, not '{kind}'")
        if choice.get("disable_parallel_tool_use", bool) and "tools" in chat:
            chat["parallel_tool_calls"] = False
        choice.done()

    # ------------------------------------------------------------------ answers
    def _item_id(self, kind: Literal["text", "tool"]) -> str:
        return "" if kind == "text" else _new_id("toolu")

    def _stop(self) -> tuple[str, str | None]:
        if self._finish != "length" and any(b.kind == "tool" for b in self._blocks):
            return "tool_use", None
        reason = self._stop_reason
        if self._finish == "stop" and isinstance(reason, str) and reason in self.stops:
            return "stop_sequence", reason
        return _STOP_REASONS.get(self._finish or "", "end_turn"), None

    def _usage_out(self) -> dict[str, int]:
        return {"input_tokens": self._input_tokens(), "output_tokens": self._output_tokens()}

    @staticmethod
    def _tool_input(arguments: str) -> dict[str, Any]:
        """A tool call's arguments as the object Anthropic's ``input`` must be; text that is not a JSON
        object (a model that wrote bad arguments) is kept whole under ``"arguments"``."""
        try:
            value = orjson.loads(arguments or "{}")
        except orjson.JSONDecodeError:
            value = None
        return value if isinstance(value, dict) else {"arguments": arguments}

    def _content(self, block: _Block) -> dict[str, Any]:
        if block.kind == "tool":
            return {
                "type": "tool_use",
                "id": block.call_id,
                "name": block.name,
                "input": self._tool_input(block.text),
            }
        return {"type": "text", "text": block.text}

    def _message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None]) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self._backend_model or self.model or "",
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": self._usage_out(),
        }

    def _final(self) -> dict[str, Any]:
        return self._message([self._content(b) for b in self._blocks], self._stop())

    # ------------------------------------------------------------------ events
    def _start(self) -> list[bytes]:
        message = self._message([], (None, None))
        message["usage"] = {"input_tokens": self._prompt_tokens or 0, "output_tokens": 0}
        return [_event("message_start", {"type": "message_start", "message": message})]

    def _block_start(self, block: _Block) -> list[bytes]:
        if block.kind == "tool":
            start = {"type": "tool_use", "id": block.call_id, "name": block.name, "input": {}}
        else:
            start = {"type": "text", "text": ""}
        return [
            _event(
                "content_block_start",
                {"type": "content_block_start", "index": block.index, "content_block": start},
            )
        ]

    def _delta(self, block: _Block, delta: dict[str, Any]) -> bytes:
        return _event(
            "content_block_delta", {"type": "content_block_delta", "index": block.index, "delta": delta}
        )

    def _text_delta(self, block: _Block, text: str, logprobs: list[Any]) -> bytes:
        return self._delta(block, {"type": "text_delta", "text": text})

    def _tool_delta(self, block: _Block, arguments: str) -> bytes:
        return self._delta(block, {"type": "input_json_delta", "partial_json": arguments})

    def _block_stop(self, block: _Block) -> list[bytes]:
        return [_event("content_block_stop", {"type": "content_block_stop", "index": block.index})]

    def _stream_end(self) -> list[bytes]:
        reason, sequence = self._stop()
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}}
        delta["usage"] = self._usage_out()
        return [_event("message_delta", delta), _event("message_stop", {"type": "message_stop"})]

    def _stream_failed(self, message: str) -> bytes:
        return _event("error", {"type": "error", "error": {"type": "api_error", "message": message}})
