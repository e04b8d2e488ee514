"""What every translated API shares: the call's :class:`Translator`, the field checks, the errors.

A :class:`Translator` carries one agent call between the agent's API and a chat completion. It holds the API's
own part (an :class:`AgentApi`: :class:`~aglverl.proxy.api.responses.ResponsesApi`,
:class:`~aglverl.proxy.api.messages.MessagesApi`), which knows that API's request fields and the shapes of its
answers, and the :class:`Exchange` both of them read: what the call asked for and what the backend answered so
far. The translator does what is the same for every API: the request read as JSON and handed to the API's part
as :class:`Fields`, the backend's answer read (a whole chat completion, or an SSE stream of chat chunks cut
anywhere) into output blocks (text, tool calls) that the API's part renders, and the endings (done, failed,
broken off).

One translator per call: :meth:`Translator.request` validates the agent's body and returns the chat body; then
exactly one of :meth:`~Translator.whole` (a body with a length) or :meth:`~Translator.open` +
:meth:`~Translator.feed` ... + :meth:`~Translator.close` (a stream, or any body the relay streams) turns the
backend's bytes into the agent's, and :meth:`~Translator.abort` ends a stream that broke after its head went
out. Nothing here does I/O or awaits anything (no clock but ``created_at``), so it is tested on bytes alone.

Bad input: :class:`Fields` reads one JSON object and names the dotted path of the field that is wrong
(:func:`bad_field`); fields nobody read are refused, except vLLM's sampling extensions (:data:`PASSTHROUGH`),
which pass to the chat body unchanged. A refusal is a :class:`TranslationError` (400 for the agent's body,
502 for a backend's answer that is not a chat completion), which the proxy answers in the agent's API
(:meth:`Translator.error`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

import orjson

from ..sse import EventCut, payloads
from .response_store import UNATTRIBUTED, AttemptKey, ResponseStore

__all__ = [
    "CHAT_TARGET",
    "ERROR_BODY_LIMIT",
    "PASSTHROUGH",
    "AgentApi",
    "Block",
    "Exchange",
    "Fields",
    "Route",
    "TranslationError",
    "Translator",
    "backend_error",
    "bad_field",
    "copy_sampling",
    "function_tool",
    "items_of",
    "new_id",
    "text_of",
    "tool_call",
]

#: Where a translated call goes on the backend.
CHAT_TARGET = "/v1/chat/completions"
#: vLLM sampling extensions any API may carry (an SDK's ``extra_body``); copied to the chat body as they are.
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


@dataclass(frozen=True, slots=True)
class Route:
    """Where an API is served and where its call's model and stream flag come from.

    ``pattern``: the path after ``/v1/``, its ``{name}`` parts path parameters (one path segment each,
    ``models/{model}:generateContent``); the call's parameters reach its :class:`AgentApi` as
    :attr:`Exchange.params`. ``method``: the HTTP method it is served on. ``model``: the path parameter that names
    the model (``None``: the body's ``model`` field). ``stream``: whether the route streams its answer (``None``:
    the body's ``stream`` field says). ``answer``: for a route the proxy answers itself from what it keeps (a
    stored response read back), never forwarded: its ``(status, JSON body)`` for the call's :class:`Exchange`
    (its path parameters, query string and the attempt's stored responses); ``None``: a call translated into
    a chat completion.
    """

    pattern: str
    model: str | None = None
    stream: bool | None = None
    method: str = "POST"
    answer: Callable[[Exchange], tuple[int, bytes]] | None = None


class TranslationError(Exception):
    """A body that cannot be translated: ``status`` (400 for the agent's, 502 for the backend's), a message
    naming what was wrong, ``param``, the offending field's dotted path when there is one, and ``code``, the
    API's own error code when it has one (OpenAI's ``previous_response_not_found``)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code  # the API's machine-readable error code, when it has one


def backend_error(body: bytes, status: int, limit: int = 2000) -> tuple[str, str | None]:
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


def new_id(prefix: str) -> str:
    """A fresh id for an answer or an output item (``resp_...``, ``msg_...``, ``toolu_...``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


# ---------------------------------------------------------------------------------------------- field checks
_TYPE_NAMES = {str: "a string", int: "an integer", bool: "a boolean", dict: "an object", list: "an array"}


class Fields:
    """Reads the fields of one JSON object, naming the dotted path of any that is wrong."""

    __slots__ = ("obj", "unread", "where")

    def __init__(self, obj: Any, where: str) -> None:
        if not isinstance(obj, dict):
            raise bad_field(where or "body", "must be a JSON object")
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
                raise bad_field(self.path(key), "is required")
            return None
        if kind is not None and not _is(value, kind):
            kinds = kind if isinstance(kind, tuple) else (kind,)
            raise bad_field(
                self.path(key), "must be " + " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
            )
        return value

    def number(self, key: str, low: float, high: float | None = None) -> float | int | None:
        value = self.get(key, (int, float))
        if value is not None and (value < low or (high is not None and value > high)):
            bound = f"between {low:g} and {high:g}" if high is not None else f"at least {low:g}"
            raise bad_field(self.path(key), f"must be {bound}, not {value}")
        return value

    def refuse(self, key: str, why: str, allowed: Any = None) -> None:
        """Refuse a field set to anything but ``allowed`` (absent, null or ``allowed`` pass)."""
        self.unread.discard(key)
        value = self.obj.get(key)
        if value is not None and value != allowed:
            raise bad_field(self.path(key), why)

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


def bad_field(path: str, what: str) -> TranslationError:
    """The 400 for the field at ``path`` (dotted), saying what is wrong with it."""
    return TranslationError(400, f"field '{path}': {what}", path)


def items_of(fields: Fields, key: str, *, required: bool = False) -> list[tuple[Fields | Any, str]]:
    """The elements of an array field with their paths."""
    values = fields.get(key, list, required=required) or []
    return [(v, fields.path(key) + f".{i}") for i, v in enumerate(values)]


def text_of(parts: Any, where: str, kinds: frozenset[str]) -> str:
    """The text of a string or of a list of text parts whose ``type`` is in ``kinds``."""
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        raise bad_field(where, "must be a string or an array of text parts")
    texts = []
    for i, part in enumerate(parts):
        p = Fields(part, f"{where}.{i}")
        kind = p.get("type", str, required=True)
        if kind not in kinds:
            raise bad_field(
                p.path("type"), f"'{kind}' is not supported here (only {', '.join(sorted(kinds))})"
            )
        texts.append(p.get("text", str, required=True))
        p.ignore("annotations", "logprobs", "cache_control", "citations", "id")
        p.done()
    return "".join(texts)


def copy_sampling(body: Fields, chat: dict[str, Any], *, temperature_max: float) -> None:
    """``temperature`` (up to ``temperature_max``) and ``top_p``, checked, into the chat body."""
    for key, high in (("temperature", temperature_max), ("top_p", 1.0)):
        value = body.number(key, 0.0, high)
        if value is not None:
            chat[key] = value


def function_tool(name: Any, description: Any, parameters: Any, strict: Any = None) -> dict[str, Any]:
    """A chat ``tools`` entry."""
    function: dict[str, Any] = {
        "name": name,
        "parameters": parameters or {"type": "object", "properties": {}},
    }
    if description is not None:
        function["description"] = description
    if strict is not None:
        function["strict"] = strict
    return {"type": "function", "function": function}


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A chat assistant message's ``tool_calls`` entry."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# ---------------------------------------------------------------------------------------------- the exchange
@dataclass(slots=True)
class Block:
    """One output item (Responses) / content block (Messages) being assembled from chat deltas."""

    kind: Literal["text", "tool"]
    index: int
    id: str
    text: str = ""  # text, or a tool call's arguments
    name: str = ""
    call_id: str = ""
    logprobs: list[Any] = field(default_factory=list)
    closed: bool = False


@dataclass(slots=True, eq=False)
class Exchange:
    """One translated call as its API's part renders it: what the agent asked for (the API's part fills that
    in while it reads the request) and what the backend answered so far (the translator fills that in)."""

    # the request
    params: dict[str, str] = field(default_factory=dict)  # the route's path parameters
    model: str | None = None
    stream: bool = False
    logprobs: bool = False  # the agent asked for them (the proxy may ask the backend for its own reasons)
    stops: list[str] = field(default_factory=list)
    created_at: int = field(default_factory=lambda: int(time.time()))
    query: str = ""  # the raw query string (a route the proxy answers itself reads it)
    # what the proxy keeps for the call's attempt (the Responses API's stored responses; None: nothing kept)
    responses: ResponseStore | None = None
    attempt: AttemptKey = UNATTRIBUTED
    # the answer
    blocks: list[Block] = field(default_factory=list)
    finish: str | None = None
    stop_reason: Any = None
    usage: dict[str, Any] | None = None
    prompt_tokens: int | None = None
    backend_model: str | None = None

    def output_tokens(self) -> int:
        return int((self.usage or {}).get("completion_tokens") or 0)

    def input_tokens(self) -> int:
        return int((self.usage or {}).get("prompt_tokens") or self.prompt_tokens or 0)


class AgentApi(Protocol):
    """An API an agent speaks, over chat completions: one instance per call, made on that call's
    :class:`Exchange`. It reads the request and renders the answer; the :class:`Translator` holding it does
    the rest. Everything the proxy needs of it is declared here, in its module: registered in
    :data:`aglverl.proxy.api.APIS` by its :attr:`routes`. An API whose answers carry an id of their own
    (``resp_...``, ``msg_...``) has it as the instance's ``id``: the proxy records it as the call's
    ``response_id`` (what an agent's trace names the call by); without one, the backend's id is recorded."""

    #: The API's name, in messages.
    name: ClassVar[str]
    #: Where it is served (path parameters included), with where each route's model and stream flag come from.
    routes: ClassVar[tuple[Route, ...]]
    #: The header its SDKs send their key in, when not ``Authorization`` (Anthropic's ``x-api-key``): accepted
    #: as the proxy's token, and never forwarded to a backend.
    credential_header: ClassVar[str | None]

    def __init__(self, exchange: Exchange) -> None: ...

    @staticmethod
    def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
        """The JSON body this API answers ``status`` with (``code``: the API's error code; an API without codes
        may leave the parameter out)."""
        ...

    def to_chat(self, body: Fields) -> dict[str, Any]:
        """The chat body for the agent's (raises :class:`TranslationError`); fills in the exchange's request."""
        ...

    def item_id(self, kind: Literal["text", "tool"]) -> str:
        """The id of a new output block of ``kind``."""
        ...

    def final(self) -> dict[str, Any]:
        """The whole answer (a Response, a Message) from the exchange's blocks, finish reason and usage."""
        ...

    def start(self) -> list[bytes]:
        """The events that open a stream."""
        ...

    def block_start(self, block: Block) -> list[bytes]: ...

    def text_delta(self, block: Block, text: str, logprobs: list[Any]) -> bytes: ...

    def tool_delta(self, block: Block, arguments: str) -> bytes: ...

    def block_stop(self, block: Block) -> list[bytes]: ...

    def stream_end(self) -> list[bytes]:
        """The events that close a stream that finished."""
        ...

    def stream_failed(self, message: str, started: bool) -> bytes:
        """The API's error ending of a stream; ``started``: whether the stream's opening events went out (an
        API whose error ending needs them sends them first)."""
        ...


# ---------------------------------------------------------------------------------------------- the translator
class Translator:
    """Translates one call between an agent's API and a chat completion (see the module docstring).

    Not reusable: one instance per call, made with the API's class (``Translator(ResponsesApi)``). Methods
    never raise on a backend's answer except :meth:`whole`, which raises :class:`TranslationError` (502) for
    a success body that is not a chat completion; a stream that turns out malformed is ended with the API's
    error ending instead.
    """

    __slots__ = (
        "_buffer",
        "_cut",
        "_ended",
        "_open",
        "_route",
        "_sse",
        "_started",
        "_status",
        "_tools",
        "api",
        "exchange",
    )

    def __init__(
        self, api: type[AgentApi], route: Route | None = None, params: dict[str, str] | None = None
    ) -> None:
        self.exchange = Exchange(params=params or {})
        if route is not None and route.model is not None:
            self.exchange.model = self.exchange.params.get(route.model)
        self._route = route
        self.api: AgentApi = api(self.exchange)
        self._status = 200
        self._sse = False
        self._cut = EventCut()
        self._buffer = bytearray()
        self._ended = False
        self._open: Block | None = None
        self._tools: dict[int, Block] = {}  # chat tool-call index -> its block
        self._started = False

    # ------------------------------------------------------------------ request
    def request(self, body: bytes) -> bytes:
        """The chat-completions body for the agent's ``body``; raises :class:`TranslationError` (400)."""
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise TranslationError(400, f"request body is not valid JSON: {exc}") from None
        chat = self.api.to_chat(Fields(obj, ""))
        if self._route is not None and self._route.stream is not None:
            self.exchange.stream = self._route.stream  # the route says, whatever the body does
        if self.exchange.stream:
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}  # usage for the final event
        return orjson.dumps(chat)

    def error(self, status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
        """This API's error body (an API without error codes is never handed one)."""
        if code is None:
            return self.api.error_body(status, message, param)
        return self.api.error_body(status, message, param, code)

    @property
    def local(self) -> bool:
        """Whether the call's route is answered by the proxy itself (:attr:`Route.answer`), never forwarded."""
        return self._route is not None and self._route.answer is not None

    def answer(self) -> tuple[int, bytes]:
        """The ``(status, JSON body)`` of a call whose route the proxy answers itself (:attr:`local`)."""
        assert self._route is not None and self._route.answer is not None
        return self._route.answer(self.exchange)

    # ------------------------------------------------------------------ whole answers
    def whole(self, status: int, body: bytes) -> bytes:
        """The agent's body for a backend's whole answer (an error body for ``status >= 400``)."""
        if status >= 400:
            return self.error(status, *backend_error(body, status))
        try:
            chat = orjson.loads(body)
        except orjson.JSONDecodeError:
            chat = None
        choices = chat.get("choices") if isinstance(chat, dict) else None
        if not choices or not isinstance(choices[0], dict) or not isinstance(choices[0].get("message"), dict):
            raise TranslationError(502, f"the backend's answer to {self.api.name} is not a chat completion")
        assert isinstance(chat, dict)
        ex = self.exchange
        ex.backend_model = chat.get("model") if isinstance(chat.get("model"), str) else None
        ex.usage = chat.get("usage") if isinstance(chat.get("usage"), dict) else None
        choice = choices[0]
        message = choice["message"]
        ex.finish, ex.stop_reason = choice.get("finish_reason"), choice.get("stop_reason")
        content = message.get("content")
        if isinstance(content, str) and content:
            lps = (choice.get("logprobs") or {}).get("content") if ex.logprobs else None
            ex.blocks.append(Block("text", 0, self.api.item_id("text"), content, logprobs=list(lps or ())))
        for tc in message.get("tool_calls") or ():
            function = tc.get("function") or {}
            block = Block("tool", len(ex.blocks), self.api.item_id("tool"), function.get("arguments") or "")
            block.name, block.call_id = function.get("name") or "", tc.get("id") or new_id("call")
            ex.blocks.append(block)
        return orjson.dumps(self.api.final())

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
        for data in payloads(self._cut.feed(chunk)):
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
                out.append(self._fail(backend_error(orjson.dumps(event), 500)[0]))
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
        if self.exchange.finish is not None:
            return b"".join(self._end())  # a backend that ended without "[DONE]" after finishing
        return self._fail("the backend ended the stream before the answer was finished")

    def abort(self, message: str) -> bytes:
        """End a stream that broke after its head went out, the way this API ends one on error."""
        if self._ended or not self._sse:
            return b""
        return self._fail(message)

    def _chunk(self, event: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        ex = self.exchange
        if ex.backend_model is None and isinstance(event.get("model"), str):
            ex.backend_model = event["model"]
        ids = event.get("prompt_token_ids")
        if ex.prompt_tokens is None and isinstance(ids, list):
            ex.prompt_tokens = len(ids)
        if not self._started:
            self._started = True
            out += self.api.start()
        usage = event.get("usage")
        if isinstance(usage, dict):
            ex.usage = usage
        for choice in event.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue  # the APIs have one answer; the chat body never asks for n > 1
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if text:
                lps = (choice.get("logprobs") or {}).get("content") if ex.logprobs else None
                out += self._text(text, list(lps or ()))
            for tc in delta.get("tool_calls") or ():
                out += self._tool(tc)
            if choice.get("finish_reason") is not None:
                ex.finish = choice["finish_reason"]
                ex.stop_reason = choice.get("stop_reason")
        return out

    def _text(self, text: str, logprobs: list[Any]) -> list[bytes]:
        out: list[bytes] = []
        block = self._open
        if block is None or block.kind != "text":
            out += self._close_open()
            block = self._open = Block("text", len(self.exchange.blocks), self.api.item_id("text"))
            self.exchange.blocks.append(block)
            out += self.api.block_start(block)
        block.text += text
        block.logprobs += logprobs
        out.append(self.api.text_delta(block, text, logprobs))
        return out

    def _tool(self, tc: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        index = tc.get("index", 0)
        function = tc.get("function") or {}
        block = self._tools.get(index)
        if block is None:
            out += self._close_open()
            blocks = self.exchange.blocks
            block = self._open = self._tools[index] = Block("tool", len(blocks), self.api.item_id("tool"))
            block.call_id, block.name = tc.get("id") or new_id("call"), function.get("name") or ""
            blocks.append(block)
            out += self.api.block_start(block)
        elif function.get("name") and not block.name:
            block.name = function["name"]
        arguments = function.get("arguments")
        if arguments:
            block.text += arguments
            if (
                block is self._open
            ):  # parsers stream one call at a time; a late piece is only in the done event
                out.append(self.api.tool_delta(block, arguments))
        return out

    def _close_open(self) -> list[bytes]:
        block, self._open = self._open, None
        if block is None or block.closed:
            return []
        block.closed = True
        return self.api.block_stop(block)

    def _end(self) -> list[bytes]:
        self._ended = True
        out = [] if self._started else self.api.start()
        self._started = True
        out += self._close_open()
        return out + self.api.stream_end()

    def _fail(self, message: str) -> bytes:
        self._ended = True
        out = self.api.stream_failed(message, self._started)
        self._started = True
        return out
