"""Anthropic's Messages API (``POST /v1/messages``) over chat completions.

Agents written for Anthropic's SDK (``anthropic.Anthropic(base_url=...)``) call the proxy on
``.../v1/messages``; :class:`MessagesApi` is that API's part of the call's
:class:`~aglverl.proxy.api.translator.Translator`. What is translated (the API's own field names):

- In: ``system``, ``messages`` with ``text`` / ``image`` / ``tool_use`` / ``tool_result`` blocks, ``max_tokens``,
  ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``tools``, ``tool_choice``, ``stream``. A
  ``tool_result`` becomes a chat ``tool`` message; the chat tool call id is the ``tool_use`` id.
- Out: ``text`` and ``tool_use`` blocks, ``stop_reason`` ``end_turn`` / ``max_tokens`` / ``stop_sequence`` /
  ``tool_use``; streams ``message_start``, ``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``,
  ``message_stop``, and an ``error`` event when the backend fails mid-stream.

Refused with a 400 naming the field (:class:`~aglverl.proxy.api.translator.TranslationError`): what needs
Anthropic's servers (``container``, ``mcp_servers``, ``context_management``, server tools), extended
thinking, unknown fields and unknown block types. Errors are Anthropic-shaped: ``{"type": "error", "error":
{"type", "message"}}`` (a 503 or 529 is ``overloaded_error``, a 429 ``rate_limit_error``). The SDK's
``x-api-key`` is accepted as the proxy's token (:mod:`~aglverl.proxy.admission`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import orjson

from ..sse import sse_event
from .translator import (
    Block,
    Exchange,
    Fields,
    Route,
    bad_field,
    copy_sampling,
    function_tool,
    items_of,
    new_id,
    text_of,
    tool_call,
)

__all__ = ["MessagesApi"]

_ERROR_TYPES: Mapping[int, str] = {
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
_STOP_REASONS: Mapping[str, str] = {
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
}


class MessagesApi:
    """Anthropic's Messages API, one call's part (see the module docstring)."""

    name: ClassVar[str] = "messages"
    routes: ClassVar[tuple[Route, ...]] = (Route("messages"),)
    credential_header: ClassVar[str | None] = "x-api-key"

    def __init__(self, exchange: Exchange) -> None:
        self.ex = exchange
        self.id = new_id("msg")

    @staticmethod
    def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
        kind = _ERROR_TYPES.get(status, "api_error")  # Anthropic's errors name a type, no param nor code
        return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})

    # ------------------------------------------------------------------ request
    def to_chat(self, body: Fields) -> dict[str, Any]:
        for key in ("container", "mcp_servers", "context_management"):
            body.refuse(key, f"'{key}' is not available: it needs Anthropic's servers")
        body.ignore("metadata", "service_tier", "cache_control", "inference_geo", "speed", "diagnostics")
        thinking = body.get("thinking", dict)
        if thinking is not None and thinking.get("type") != "disabled":
            raise bad_field("thinking", "extended thinking is not supported: omit it or set type 'disabled'")
        chat: dict[str, Any] = {}
        self.ex.model = body.get("model", str, required=True)
        chat["model"] = self.ex.model
        self.ex.stream = bool(body.get("stream", bool))
        limit = body.get("max_tokens", int, required=True)
        if limit < 1:
            raise bad_field("max_tokens", f"must be at least 1, not {limit}")
        chat["max_tokens"] = limit
        messages: list[dict[str, Any]] = []
        system = body.get("system", (str, list))
        if system is not None:
            text = system if isinstance(system, str) else self._system_text(system)
            messages.append({"role": "system", "content": text})
        for message, where in items_of(body, "messages", required=True):
            self._input_message(Fields(message, where), messages)
        if not any(m["role"] != "system" for m in messages):
            raise bad_field("messages", "must hold at least one message")
        chat["messages"] = messages
        stops = body.get("stop_sequences", list)
        if stops:
            if not all(isinstance(s, str) for s in stops):
                raise bad_field("stop_sequences", "must be an array of strings")
            self.ex.stops = list(stops)
            chat["stop"] = self.ex.stops
        copy_sampling(body, chat, temperature_max=1.0)
        tools = [self._tool_param(Fields(t, where)) for t, where in items_of(body, "tools")]
        if tools:
            chat["tools"] = tools
        choice = body.get("tool_choice", dict)
        if choice is not None:
            self._tool_choice(Fields(choice, "tool_choice"), chat)
        body.done(chat)
        return chat

    @staticmethod
    def _system_text(blocks: list[Any]) -> str:
        texts = []
        for i, raw in enumerate(blocks):
            block = Fields(raw, f"system.{i}")
            if block.get("type", str, required=True) != "text":
                raise bad_field(block.path("type"), "system blocks must be 'text'")
            texts.append(block.get("text", str, required=True))
            block.ignore("cache_control", "citations")
            block.done()
        return "\n".join(texts)

    def _input_message(self, message: Fields, messages: list[dict[str, Any]]) -> None:
        role = message.get("role", str, required=True)
        if role not in ("user", "assistant"):
            raise bad_field(message.path("role"), f"must be user or assistant, not '{role}'")
        content = message.get("content", (str, list), required=True)
        message.done()
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            return
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        for i, raw in enumerate(content):
            block = Fields(raw, f"{message.path('content')}.{i}")
            block.ignore("cache_control", "citations")
            kind = block.get("type", str, required=True)
            if kind == "text":
                parts.append({"type": "text", "text": block.get("text", str, required=True)})
            elif kind == "image" and role == "user":
                parts.append(
                    self._image(Fields(block.get("source", dict, required=True), block.path("source")))
                )
            elif kind == "tool_use" and role == "assistant":
                arguments = orjson.dumps(block.get("input", dict, required=True)).decode()
                name = block.get("name", str, required=True)
                calls.append(tool_call(block.get("id", str, required=True), name, arguments))
            elif kind == "tool_result" and role == "user":
                # Chat completions wants tool answers as their own messages, right after the calls.
                content_ = block.get("content", (str, list)) or ""
                text = text_of(content_, block.path("content"), frozenset({"text"}))
                block.ignore("is_error")
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": block.get("tool_use_id", str, required=True),
                        "content": text,
                    }
                )
            else:
                raise bad_field(block.path("type"), f"'{kind}' blocks are not supported in {role} messages")
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
    def _image(source: Fields) -> dict[str, Any]:
        kind = source.get("type", str, required=True)
        if kind == "base64":
            url = f"data:{source.get('media_type', str, required=True)};base64,{source.get('data', str, required=True)}"
        elif kind == "url":
            url = source.get("url", str, required=True)
        else:
            raise bad_field(
                source.path("type"), f"image sources of type '{kind}' are not supported (base64, url)"
            )
        source.done()
        return {"type": "image_url", "image_url": {"url": url}}

    @staticmethod
    def _tool_param(tool: Fields) -> dict[str, Any]:
        kind = tool.get("type", str)
        if kind not in (None, "custom"):
            raise bad_field(
                tool.path("type"), f"server tools ('{kind}') are not available: only client tools"
            )
        tool.ignore("cache_control")
        out = function_tool(
            tool.get("name", str, required=True),
            tool.get("description", str),
            tool.get("input_schema", dict, required=True),
            tool.get("strict", bool),
        )
        tool.done()
        return out

    @staticmethod
    def _tool_choice(choice: Fields, chat: dict[str, Any]) -> None:
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
            raise bad_field("tool_choice.type", f"must be auto, any, tool or none, not '{kind}'")
        if choice.get("disable_parallel_tool_use", bool) and "tools" in chat:
            chat["parallel_tool_calls"] = False
        choice.done()

    # ------------------------------------------------------------------ answers
    def item_id(self, kind: Literal["text", "tool"]) -> str:
        return "" if kind == "text" else new_id("toolu")

    def _stop(self) -> tuple[str, str | None]:
        finish = self.ex.finish
        if finish != "length" and any(b.kind == "tool" for b in self.ex.blocks):
            return "tool_use", None
        reason = self.ex.stop_reason
        if finish == "stop" and isinstance(reason, str) and reason in self.ex.stops:
            return "stop_sequence", reason
        return _STOP_REASONS.get(finish or "", "end_turn"), None

    def _usage_out(self) -> dict[str, int]:
        return {"input_tokens": self.ex.input_tokens(), "output_tokens": self.ex.output_tokens()}

    @staticmethod
    def _tool_input(arguments: str) -> dict[str, Any]:
        """A tool call's arguments as the object Anthropic's ``input`` must be; text that is not a JSON
        object (a model that wrote bad arguments) is kept whole under ``"arguments"``."""
        try:
            value = orjson.loads(arguments or "{}")
        except orjson.JSONDecodeError:
            value = None
        return value if isinstance(value, dict) else {"arguments": arguments}

    def _content(self, block: Block) -> dict[str, Any]:
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
            "model": self.ex.backend_model or self.ex.model or "",
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": self._usage_out(),
        }

    def final(self) -> dict[str, Any]:
        return self._message([self._content(b) for b in self.ex.blocks], self._stop())

    # ------------------------------------------------------------------ events
    def start(self) -> list[bytes]:
        message = self._message([], (None, None))
        message["usage"] = {"input_tokens": self.ex.prompt_tokens or 0, "output_tokens": 0}
        return [sse_event({"type": "message_start", "message": message}, "message_start")]

    def block_start(self, block: Block) -> list[bytes]:
        if block.kind == "tool":
            start = {"type": "tool_use", "id": block.call_id, "name": block.name, "input": {}}
        else:
            start = {"type": "text", "text": ""}
        event = {"type": "content_block_start", "index": block.index, "content_block": start}
        return [sse_event(event, "content_block_start")]

    def _delta(self, block: Block, delta: dict[str, Any]) -> bytes:
        event = {"type": "content_block_delta", "index": block.index, "delta": delta}
        return sse_event(event, "content_block_delta")

    def text_delta(self, block: Block, text: str, logprobs: list[Any]) -> bytes:
        return self._delta(block, {"type": "text_delta", "text": text})

    def tool_delta(self, block: Block, arguments: str) -> bytes:
        return self._delta(block, {"type": "input_json_delta", "partial_json": arguments})

    def block_stop(self, block: Block) -> list[bytes]:
        return [sse_event({"type": "content_block_stop", "index": block.index}, "content_block_stop")]

    def stream_end(self) -> list[bytes]:
        reason, sequence = self._stop()
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}}
        delta["usage"] = self._usage_out()
        return [sse_event(delta, "message_delta"), sse_event({"type": "message_stop"}, "message_stop")]

    def stream_failed(self, message: str, started: bool) -> bytes:
        return sse_event({"type": "error", "error": {"type": "api_error", "message": message}}, "error")
