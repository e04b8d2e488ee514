"""OpenAI's Responses API (``POST /v1/responses``) over chat completions.

Agents written for the Responses API (``client.responses.create``, the openai-agents SDK's defaults) call the
proxy on ``.../v1/responses``; :class:`ResponsesApi` is that API's part of the call's
:class:`~aglverl.proxy.api.translator.Translator`. What is translated (the API's own field names):

- In: ``input`` (a string, or items: messages with ``input_text`` / ``output_text`` / ``input_image`` parts,
  ``function_call``, ``function_call_output``), ``instructions``, function ``tools``, ``tool_choice``,
  ``parallel_tool_calls``, ``max_output_tokens``, ``temperature``, ``top_p``, ``text.format``,
  ``reasoning.effort``, ``top_logprobs`` / ``include: ["message.output_text.logprobs"]``, ``stream``;
  ``previous_response_id`` (the stored response's conversation comes first: :mod:`.stored_responses`) and
  ``store``. The other ``include`` values OpenAI takes are ignored (they name what the proxy never produces:
  hosted tools' outputs, image URLs, encrypted reasoning); a value OpenAI does not take is refused.
- Out: ``message`` and ``function_call`` output items; ``status`` ``incomplete`` (``max_output_tokens``) when the
  backend stopped on length; streams ``response.created``, ``response.in_progress``,
  ``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``,
  ``response.function_call_arguments.delta`` ... ``response.completed`` / ``response.incomplete`` with usage,
  and ``response.failed`` when the backend fails mid-stream.

- Kept: every response made with ``store`` left out or true, per rollout attempt
  (:mod:`.response_store`); read back on ``GET /v1/responses/{response_id}``, ``DELETE`` and
  ``GET /v1/responses/{response_id}/input_items``, routes the proxy answers itself (:mod:`.stored_responses`).

Refused with a 400 naming the field (:class:`~aglverl.proxy.api.translator.TranslationError`): conversations
(``conversation``), ``background``, stored ``prompt`` templates, server-side context management, hosted tools,
unknown fields and unknown item types; an unknown ``previous_response_id`` as OpenAI refuses it (400,
``code: "previous_response_not_found"``). Errors are OpenAI-shaped: ``{"error": {"message", "type", "param",
"code"}}``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal

import orjson

from ..sse import sse_event
from .response_store import StoredResponse
from .stored_responses import (
    continued,
    delete,
    input_items,
    keep,
    listed_input,
    refuse_duplicates,
    retrieve,
)
from .translator import (
    Block,
    Exchange,
    Fields,
    Route,
    TranslationError,
    bad_field,
    copy_sampling,
    function_tool,
    items_of,
    new_id,
    text_of,
    tool_call,
)

__all__ = ["ResponsesApi"]

_ERROR_TYPES: Mapping[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
#: The ``include`` values OpenAI takes; only the logprobs one is honoured (the others name outputs the proxy
#: never produces, and are ignored).
_INCLUDES = frozenset(
    {
        "message.output_text.logprobs",
        "reasoning.encrypted_content",
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
    }
)
_INPUT_TEXT = frozenset({"input_text", "output_text", "text"})


def _answered(read: Callable[[Exchange], bytes]) -> Callable[[Exchange], tuple[int, bytes]]:
    """A route the proxy answers itself from the stored responses: ``read``'s body, or its refusal in the API's
    error shape."""

    def answer(ex: Exchange) -> tuple[int, bytes]:
        try:
            return 200, read(ex)
        except TranslationError as exc:
            return exc.status, ResponsesApi.error_body(exc.status, exc.message, exc.param, exc.code)

    return answer


class ResponsesApi:
    """OpenAI's Responses API, one call's part (see the module docstring)."""

    name: ClassVar[str] = "responses"
    routes: ClassVar[tuple[Route, ...]] = (
        Route("responses"),
        Route("responses/{response_id}", method="GET", answer=_answered(retrieve)),
        Route("responses/{response_id}", method="DELETE", answer=_answered(delete)),
        Route("responses/{response_id}/input_items", method="GET", answer=_answered(input_items)),
    )
    credential_header: ClassVar[str | None] = None

    def __init__(self, exchange: Exchange) -> None:
        self.ex = exchange
        self.id = new_id("resp")
        self._echo: dict[str, Any] = {}
        self._seq = 0
        self._store = False  # keep the response once whole
        self._previous: StoredResponse | None = None
        self._input: tuple[dict[str, Any], ...] = ()

    @staticmethod
    def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
        kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})

    # ------------------------------------------------------------------ request
    def to_chat(self, body: Fields) -> dict[str, Any]:
        for key, why in (
            (
                "conversation",
                "conversations are not kept: continue a response with 'previous_response_id', or send the "
                "whole conversation in 'input'",
            ),
            ("prompt", "stored prompt templates are not available: send 'instructions' and 'input'"),
            ("background_options", "background responses are not supported"),
            ("context_management", "server-side context management is not supported"),
        ):
            body.refuse(key, why)
        body.refuse("background", "background responses are not supported", False)
        previous_id = body.get("previous_response_id", str)
        self._store = body.get("store", bool) is not False and self.ex.responses is not None
        body.refuse("truncation", "only 'disabled' truncation is supported", "disabled")
        body.ignore(
            "metadata", "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
            "prompt_cache_options", "service_tier", "stream_options", "max_tool_calls", "moderation",
        )  # fmt: skip
        chat: dict[str, Any] = {}
        self.ex.model = body.get("model", str)
        if self.ex.model is not None:
            chat["model"] = self.ex.model
        self.ex.stream = bool(body.get("stream", bool))
        messages: list[dict[str, Any]] = []
        instructions = body.get("instructions", (str, list))
        if instructions is not None:
            messages.append({"role": "system", "content": text_of(instructions, "instructions", _INPUT_TEXT)})
        raw_input = body.get("input", (str, list), required=True)
        if previous_id is not None:  # its conversation first: earlier inputs and answers, as they were made
            self._previous = continued(self.ex, previous_id)
            refuse_duplicates(self._previous, raw_input)
            for earlier in self._previous.conversation():
                self._input_item(Fields(earlier, "previous_response_id"), messages)
        if isinstance(raw_input, str):
            messages.append({"role": "user", "content": raw_input})
        else:
            for item, where in items_of(body, "input"):
                self._input_item(Fields(item, where), messages)
        if not messages:
            raise bad_field("input", "has no messages")
        chat["messages"] = messages
        limit = body.get("max_output_tokens", int)
        if limit is not None:
            if limit < 1:
                raise bad_field("max_output_tokens", f"must be at least 1, not {limit}")
            chat["max_tokens"] = limit
        copy_sampling(body, chat, temperature_max=2.0)
        tools = [self._tool_param(Fields(t, where)) for t, where in items_of(body, "tools")]
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
        if self._store:
            self._input = listed_input(raw_input)
        self._echo = {
            "previous_response_id": previous_id,
            "store": self._store,
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

    def _input_item(self, item: Fields, messages: list[dict[str, Any]]) -> None:
        kind = item.get("type", str) or "message"
        item.get("id", str)  # an item's own id: listed back, never sent to the backend
        item.ignore("status")
        if kind == "message":
            role = item.get("role", str, required=True)
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_field(
                    item.path("role"), f"must be user, assistant, system or developer, not '{role}'"
                )
            content = item.get("content", (str, list), required=True)
            if role == "user" and isinstance(content, list):
                message = {"role": "user", "content": self._user_parts(content, item.path("content"))}
            else:
                message = {"role": "system" if role == "developer" else role}
                message["content"] = text_of(content, item.path("content"), _INPUT_TEXT | {"refusal"})
            messages.append(message)
        elif kind == "function_call":
            call = tool_call(
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
                    "content": text_of(output, item.path("output"), _INPUT_TEXT),
                }
            )
        else:
            raise bad_field(
                item.path("type"),
                f"input items of type '{kind}' are not supported (message, function_call, function_call_output)",
            )
        item.done()

    @staticmethod
    def _user_parts(content: list[Any], where: str) -> list[dict[str, Any]]:
        parts = []
        for i, raw in enumerate(content):
            part = Fields(raw, f"{where}.{i}")
            kind = part.get("type", str, required=True)
            if kind in _INPUT_TEXT:
                parts.append({"type": "text", "text": part.get("text", str, required=True)})
            elif kind == "input_image":
                url = part.get("image_url", str)
                if url is None:
                    raise bad_field(
                        part.path("image_url"), "is required (uploaded file ids are not available)"
                    )
                image = {"url": url}
                if (detail := part.get("detail", str)) is not None:
                    image["detail"] = detail
                parts.append({"type": "image_url", "image_url": image})
            else:
                raise bad_field(
                    part.path("type"), f"'{kind}' parts are not supported (input_text, input_image)"
                )
            part.done()
        return parts

    @staticmethod
    def _tool_param(tool: Fields) -> dict[str, Any]:
        kind = tool.get("type", str, required=True)
        if kind != "function":
            raise bad_field(
                tool.path("type"), f"hosted tools ('{kind}') are not available: only 'function' tools"
            )
        out = function_tool(
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
                raise bad_field("tool_choice", f"must be auto, none, required or a function, not '{choice}'")
            return choice
        fields = Fields(choice, "tool_choice")
        if fields.get("type", str, required=True) != "function":
            raise bad_field("tool_choice.type", "only 'function' choices are supported")
        name = fields.get("name", str, required=True)
        fields.done()
        return {"type": "function", "function": {"name": name}}

    @staticmethod
    def _text_format(body: Fields, chat: dict[str, Any]) -> None:
        text = body.get("text", dict)
        if text is None:
            return
        fields = Fields(text, "text")
        fields.ignore("verbosity")
        fmt = fields.get("format", dict)
        fields.done()
        if fmt is None:
            return
        f = Fields(fmt, "text.format")
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
            raise bad_field("text.format.type", f"must be text, json_schema or json_object, not '{kind}'")
        f.done()

    @staticmethod
    def _reasoning(body: Fields, chat: dict[str, Any]) -> None:
        reasoning = body.get("reasoning", dict)
        if reasoning is None:
            return
        fields = Fields(reasoning, "reasoning")
        fields.ignore("summary", "generate_summary")
        effort = fields.get("effort", str)
        fields.done()
        if effort is not None:
            chat["reasoning_effort"] = effort

    def _logprob_options(self, body: Fields, chat: dict[str, Any]) -> None:
        include = body.get("include", list) or []
        for i, value in enumerate(include):
            if value not in _INCLUDES:
                raise bad_field(f"include.{i}", f"'{value}' is not available (only {sorted(_INCLUDES)})")
        top = body.number("top_logprobs", 0, 20)
        if "message.output_text.logprobs" in include or top is not None:
            self.ex.logprobs = True
            chat["logprobs"] = True
            if top is not None:
                chat["top_logprobs"] = int(top)

    # ------------------------------------------------------------------ answers
    def item_id(self, kind: Literal["text", "tool"]) -> str:
        return new_id("msg" if kind == "text" else "fc")

    def _response(self, status: str, output: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.ex.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": None,
            "model": self.ex.backend_model or self.ex.model or "",
            "output": output,
            "truncation": "disabled",
            "usage": None,
            **self._echo,
            **extra,
        }

    def _item(self, block: Block, status: str) -> dict[str, Any]:
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

    def _part(self, block: Block) -> dict[str, Any]:
        part: dict[str, Any] = {"type": "output_text", "text": block.text, "annotations": []}
        if self.ex.logprobs:
            part["logprobs"] = block.logprobs
        return part

    def _outcome(self) -> tuple[str, dict[str, Any] | None]:
        if self.ex.finish == "length":
            return "incomplete", {"reason": "max_output_tokens"}
        if self.ex.finish == "content_filter":
            return "incomplete", {"reason": "content_filter"}
        return "completed", None

    def _usage_out(self) -> dict[str, Any] | None:
        usage = self.ex.usage
        if usage is None:
            return None
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        input_tokens, output_tokens = self.ex.input_tokens(), self.ex.output_tokens()
        return {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        }

    def final(self) -> dict[str, Any]:
        status, details = self._outcome()
        blocks = self.ex.blocks or [
            Block("text", 0, self.item_id("text"))
        ]  # an empty answer: an empty message
        item_status = "incomplete" if status == "incomplete" else "completed"
        output = [self._item(b, item_status) for b in blocks]
        response = self._response(status, output, incomplete_details=details, usage=self._usage_out())
        if self._store:  # whole now: a later call may continue it, the agent may read it back
            self._store = False
            keep(self.ex, response, self._input, self._previous)
        return response

    # ------------------------------------------------------------------ events
    def _emit(self, kind: str, **fields: Any) -> bytes:
        obj = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse_event(obj, kind)

    def start(self) -> list[bytes]:
        snapshot = self._response("in_progress", [])
        return [
            self._emit("response.created", response=snapshot),
            self._emit("response.in_progress", response=snapshot),
        ]

    def block_start(self, block: Block) -> list[bytes]:
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

    def text_delta(self, block: Block, text: str, logprobs: list[Any]) -> bytes:
        return self._emit(
            "response.output_text.delta",
            item_id=block.id,
            output_index=block.index,
            content_index=0,
            delta=text,
            logprobs=logprobs,
        )

    def tool_delta(self, block: Block, arguments: str) -> bytes:
        return self._emit(
            "response.function_call_arguments.delta",
            item_id=block.id,
            output_index=block.index,
            delta=arguments,
        )

    def block_stop(self, block: Block) -> list[bytes]:
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

    def stream_end(self) -> list[bytes]:
        out: list[bytes] = []
        if not self.ex.blocks:  # an empty answer still has its (empty) message, as the whole answer does
            block = Block("text", 0, self.item_id("text"), closed=True)
            self.ex.blocks.append(block)
            out += self.block_start(block) + self.block_stop(block)
        final = self.final()
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return [*out, self._emit(kind, response=final)]

    def stream_failed(self, message: str, started: bool) -> bytes:
        status = "incomplete" if self._outcome()[0] == "incomplete" else "completed"
        output = [self._item(b, status if b.closed else "incomplete") for b in self.ex.blocks]
        error = {"code": "server_error", "message": message}
        snapshot = self._response("failed", output, error=error, usage=self._usage_out())
        head = b"" if started else b"".join(self.start())
        return head + self._emit("response.failed", response=snapshot)
