"""Generated text to an assistant message: reasoning, content and tool calls, as vLLM's parsers split it.

One :class:`ChatParser` per server holds the configuration (which tool-call format, which reasoning format,
the tokenizer's marker ids); one :class:`ParseSession` per generated choice does the work, whole
(:meth:`ParseSession.parse`) or delta by delta (:meth:`ParseSession.delta`). The embedded server's
``/v1/chat/completions`` (JSON and SSE) and its ``/v1/chat/completions/derender`` (JSON and streaming) all go
through these two methods, so the chat answer and the derendered answer for the same ids cannot disagree.

Formats (what vLLM 0.32 does with the same flags, mirrored step by step; written anew, not copied):

- tool calls, ``"hermes"`` (vLLM's ``--tool-call-parser hermes``; Hermes / Qwen2.5 / Qwen3-instruct
  ChatML templates): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, several allowed.
  Whole: the text before the first ``<tool_call>`` is the content (``None`` if empty or blank), every
  ``<tool_call>...</tool_call>`` (the last may be unclosed) must be JSON with ``name`` and ``arguments``, or
  nothing is a tool call and the whole text is content. Streamed: content up to the first ``<tool_call>``
  (holding back a suffix that may be the start of the tag), then per call a delta with its ``id``, ``type``
  and ``name`` once the name is complete, then the arguments' new text as it grows;
- reasoning, ``"deepseek_r1"`` (``<think>...</think>``, text before ``</think>`` is reasoning even without a
  ``<think>``, no ``</think>`` at all: everything is reasoning) and ``"qwen3"`` (the same markers; with
  ``chat_template_kwargs.enable_thinking: false`` nothing is reasoning). Both need ``<think>`` and
  ``</think>`` to be single tokens (as vLLM requires); whether the prompt left reasoning open is read from the
  prompt ids (the last of the two markers in it).

``tool_choice`` (see :class:`ToolRequest`): ``"none"`` or no tools: no tool parsing; ``"auto"``: parsed;
``"required"`` / a named function: parsed the same way (the output was constrained to the Hermes format, see
:mod:`aglverl.engine.constrained`), ``content`` is then ``""`` rather than ``None``. ``finish_reason`` becomes
``"tool_calls"`` when calls were found under ``"auto"``/``"required"`` and the sequence stopped (a named
function keeps ``"stop"``, as OpenAI and vLLM do).

Bad input never raises: text that is not a well-formed tool call is content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ChatParser",
    "DeltaMessage",
    "ParseSession",
    "ParsedMessage",
    "ToolCall",
    "ToolRequest",
    "make_tool_call_id",
]

TOOL_PARSERS = ("hermes",)
REASONING_PARSERS = ("qwen3", "deepseek_r1")

TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
THINK_START, THINK_END = "<think>", "</think>"
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')


def make_tool_call_id() -> str:
    """A fresh tool-call id, shaped as vLLM's (``chatcmpl-tool-`` + 16 hex digits)."""
    return f"chatcmpl-tool-{uuid.uuid4().int & (2**64 - 1):016x}"


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """What of a chat request the parser needs: its ``tools``' names, ``tool_choice`` and template flags.

    ``tool_choice`` is ``"none"``, ``"auto"``, ``"required"`` or the name of the forced function (the request's
    ``{"type": "function", "function": {"name": ...}}``). ``thinking`` is ``chat_template_kwargs.enable_thinking``
    (default true).
    """

    has_tools: bool = False
    tool_choice: str = "none"
    named: bool = False
    thinking: bool = True
    include_reasoning: bool = True

    @classmethod
    def from_request(cls, body: Mapping[str, Any]) -> ToolRequest:
        """From a (validated) chat request body: ``tools``, ``tool_choice``, ``chat_template_kwargs``."""
        tools = body.get("tools") or []
        choice = body.get("tool_choice")
        if choice is None:
            choice = "auto" if tools else "none"
        named = isinstance(choice, Mapping)
        name = str(choice["function"]["name"]) if isinstance(choice, Mapping) else str(choice)
        kwargs = body.get("chat_template_kwargs") or {}
        thinking = bool(kwargs.get("enable_thinking", True)) if isinstance(kwargs, Mapping) else True
        return cls(
            has_tools=bool(tools),
            tool_choice=name,
            named=named,
            thinking=thinking,
            include_reasoning=body.get("include_reasoning", True) is not False,
        )

    @property
    def forced(self) -> bool:
        """``"required"`` or a named function: the output was constrained to tool calls."""
        return self.named or self.tool_choice == "required"


@dataclass(slots=True)
class ToolCall:
    """One parsed call; ``arguments`` is a JSON string (``json.dumps`` of the parsed arguments)."""

    name: str
    arguments: str
    id: str = field(default_factory=make_tool_call_id)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class ParsedMessage:
    """A whole answer's split: ``reasoning`` and ``content`` may be ``None``; ``tool_calls`` may be empty."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


@dataclass(slots=True)
class DeltaMessage:
    """What one streamed chunk adds; fields left ``None`` are not sent (vLLM drops unset delta fields)."""

    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    #: ``content`` was set explicitly (to ``None`` too): sent even when null, as vLLM's delta does then.
    content_set: bool = False

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.content is not None or self.content_set:
            out["content"] = self.content
        if self.reasoning is not None:
            out["reasoning"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


class ChatParser:
    """A server's parsing configuration; :meth:`session` starts one choice's parse.

    ``tool_parser``: ``"hermes"`` or ``None`` (tools are then not parsed: the server refuses them); the
    ``reasoning_parser``: ``"qwen3"``, ``"deepseek_r1"`` or ``None``. ``vocab`` is the tokenizer's
    token -> id map; a reasoning parser needs ``<think>`` and ``</think>`` in it (``ValueError`` otherwise).
    """

    def __init__(
        self,
        *,
        tool_parser: str | None,
        reasoning_parser: str | None,
        vocab: Mapping[str, int],
    ) -> None:
        if tool_parser is not None and tool_parser not in TOOL_PARSERS:
            raise ValueError(f"unknown tool_parser {tool_parser!r}; known: {list(TOOL_PARSERS)}")
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning_parser {reasoning_parser!r}; known: {list(REASONING_PARSERS)}"
            )
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.think_ids: tuple[int, int] | None = None
        if reasoning_parser is not None:
            start, end = vocab.get(THINK_START), vocab.get(THINK_END)
            if start is None or end is None:
                raise ValueError(
                    f"reasoning_parser {reasoning_parser!r} needs {THINK_START!r} and {THINK_END!r} to be single "
                    "tokens of the tokenizer (as vLLM requires); this tokenizer has no such tokens"
                )
            self.think_ids = (start, end)

    def session(self, request: ToolRequest, prompt_ids: Sequence[int] | None = None) -> ParseSession:
        return ParseSession(self, request, prompt_ids)


class ParseSession:
    """One choice's parse, whole or streamed (never both on one session). Not thread-safe; cheap to create."""

    def __init__(self, parser: ChatParser, request: ToolRequest, prompt_ids: Sequence[int] | None) -> None:
        self.parser = parser
        self.request = request
        self._reasoning = parser.reasoning_parser is not None and (
            parser.reasoning_parser != "qwen3" or request.thinking
        )
        # Reasoning is open at the start unless the prompt's last think marker closed it (vLLM's
        # is_reasoning_end on the prompt); without prompt ids it is assumed open.
        self.reasoning_ended = not self._reasoning or _closes_reasoning(parser.think_ids, prompt_ids)
        self._tools = parser.tool_parser is not None and request.has_tools and request.tool_choice != "none"
        # streaming state
        self._text = ""
        self._ids: list[int] = []
        self._tool_text_started = False
        self._sent_content = 0
        self._calls: list[dict[str, str]] = []  # per call: name, arguments sent so far
        self.tools_streamed = False

    # ------------------------------------------------------------------ whole
    def parse(self, text: str) -> ParsedMessage:
        """Split a whole generated text (decoded with special tokens kept when parsing is enabled)."""
        reasoning, content = self._split_reasoning(text) if self._reasoning else (None, text)
        calls: list[ToolCall] = []
        if self._tools:
            calls, content = _hermes_calls(content or "")
            if calls and content is not None and not content.strip():
                content = None
            if not calls and self.request.forced and (content is None or not content.strip()):
                content = None
        if self.request.forced:
            content = content or ""
        if not self.request.include_reasoning:
            reasoning = None
        return ParsedMessage(reasoning, content, calls)

    def _split_reasoning(self, text: str) -> tuple[str | None, str | None]:
        head, start, rest = text.partition(THINK_START)
        text = rest if start else head
        if THINK_END not in text:
            return text, None
        reasoning, _, content = text.partition(THINK_END)
        return reasoning, content or None

    def finish_reason(
        self, message_or_streamed: ParsedMessage | bool, engine_reason: str | None
    ) -> str | None:
        """The chat ``finish_reason`` for an engine one, given the calls found (whole) or streamed."""
        called = (
            bool(message_or_streamed.tool_calls)
            if isinstance(message_or_streamed, ParsedMessage)
            else message_or_streamed
        )
        if engine_reason == "stop" and self._tools and not self.request.named:
            if called or (
                self.request.tool_choice == "required" and isinstance(message_or_streamed, ParsedMessage)
            ):
                return "tool_calls"
        return engine_reason

    # ------------------------------------------------------------------ streamed
    def delta(self, delta_text: str, delta_ids: Sequence[int], *, finished: bool) -> DeltaMessage | None:
        """What the chunk of ``delta_ids`` (decoded as ``delta_text``) adds; ``None``: nothing to send yet."""
        previous_text, previous_ids = self._text, self._ids
        current_text, current_ids = previous_text + delta_text, previous_ids + list(delta_ids)
        message: DeltaMessage | None = None
        transitioned = False
        if not self.reasoning_ended:
            message = self._reasoning_delta(previous_ids, delta_text, delta_ids)
            assert self.parser.think_ids is not None
            if self.parser.think_ids[1] in delta_ids:
                self.reasoning_ended = transitioned = True
                current_ids = _after(delta_ids, self.parser.think_ids[1])
                current_text = (message.content if message else None) or ""
                delta_text = current_text
        if self.parser.tool_parser is not None and self.reasoning_ended:
            if not self._tool_text_started:
                self._tool_text_started = True
                previous_text, previous_ids = "", []
                delta_text = current_text
            reasoning = message.reasoning if message else None
            message = self._tool_delta(current_text, delta_text)
            if reasoning:
                if message is None:
                    message = DeltaMessage(reasoning=reasoning)
                elif not message.reasoning:
                    message.reasoning = reasoning
            if message is not None and message.tool_calls:
                self.tools_streamed = True
        if message is None and not transitioned and self.reasoning_ended and self.parser.tool_parser is None:
            message = DeltaMessage(content=delta_text)
        self._text, self._ids = current_text, current_ids
        if finished and message is not None and message.tool_calls:
            self._flush_arguments(message)
        if message is not None and not self.request.include_reasoning:
            message.reasoning = None
            if not message.content and not message.tool_calls:
                message = None
        return message

    def _reasoning_delta(
        self, previous_ids: Sequence[int], delta_text: str, delta_ids: Sequence[int]
    ) -> DeltaMessage | None:
        assert self.parser.think_ids is not None
        start, end = self.parser.think_ids
        if len(delta_ids) == 1 and delta_ids[0] in (start, end):
            return None
        if start in previous_ids or start not in delta_ids:
            if end in delta_ids:
                cut = delta_text.find(THINK_END)
                content = delta_text[cut + len(THINK_END) :]
                return DeltaMessage(reasoning=delta_text[:cut], content=content or None, content_set=True)
            if end in previous_ids:
                return DeltaMessage(content=delta_text)
            return DeltaMessage(reasoning=delta_text)
        if end in delta_ids:  # both markers in this delta
            begin = delta_text.find(THINK_START) + len(THINK_START)
            cut = delta_text.find(THINK_END)
            content = delta_text[cut + len(THINK_END) :]
            return DeltaMessage(reasoning=delta_text[begin:cut], content=content or None, content_set=True)
        return DeltaMessage(reasoning=delta_text)

    def _tool_delta(self, current_text: str, delta_text: str) -> DeltaMessage | None:
        if not self._tools:
            return DeltaMessage(content=delta_text) if delta_text else None
        content = self._unsent_content(current_text)
        deltas: list[dict[str, Any]] = []
        for i, (body, complete) in enumerate(_tool_call_bodies(current_text)):
            if i >= len(self._calls):
                self._calls.append({})
            call = self._calls[i]
            if "name" not in call:
                match = _NAME.search(body)
                if not match:
                    break  # call i+1 cannot start before call i has its name
                call["name"], call["sent"] = match.group(1), ""
                deltas.append(
                    {
                        "id": make_tool_call_id(),
                        "type": "function",
                        "index": i,
                        "function": {"name": call["name"]},
                    }
                )
            arguments = _arguments_text(body, complete)
            if arguments is not None and len(arguments) > len(call["sent"]):
                piece = arguments[len(call["sent"]) :]
                call["sent"] = arguments
                deltas.append({"index": i, "function": {"arguments": piece}})
        if content or deltas:
            return DeltaMessage(content=content, tool_calls=deltas or None, content_set=True)
        return None

    def _unsent_content(self, text: str) -> str | None:
        at = text.find(TOOL_START)
        sendable = len(text) - _partial_overlap(text, TOOL_START) if at < 0 else at
        if sendable > self._sent_content:
            piece = text[self._sent_content : sendable]
            self._sent_content = sendable
            return piece
        return None

    def _flush_arguments(self, message: DeltaMessage) -> None:
        """At the end, whatever of the last call's arguments was parsed but not sent (vLLM's finalize)."""
        if not self._calls or not message.tool_calls:
            return
        last = self._calls[-1]
        expected = last.get("sent", "")
        if expected.startswith(last.get("sent", "")) and len(expected) > len(last.get("sent", "")):
            message.tool_calls[-1].setdefault("function", {})["arguments"] = expected


# ---------------------------------------------------------------------------------------------- helpers
def _closes_reasoning(think_ids: tuple[int, int] | None, prompt_ids: Sequence[int] | None) -> bool:
    if think_ids is None or not prompt_ids:
        return False
    start, end = think_ids
    for token in reversed(prompt_ids):
        if token == start:
            return False
        if token == end:
            return True
    return False


def _after(ids: Sequence[int], marker: int) -> list[int]:
    """The ids after ``marker`` in ``ids`` (none when it is the last one), as vLLM's content-id split."""
    if marker not in list(ids)[:-1]:
        return []
    return list(ids)[list(ids).index(marker) + 1 :]


def _hermes_calls(text: str) -> tuple[list[ToolCall], str | None]:
    """Whole-text Hermes parse: ``(calls, content)``; a malformed call makes everything content."""
    if TOOL_START not in text:
        return [], text
    try:
        calls = []
        for closed, unclosed in _TOOL_CALL.findall(text):
            raw = json.loads(closed if closed else unclosed)
            calls.append(
                ToolCall(name=raw["name"], arguments=json.dumps(raw["arguments"], ensure_ascii=False))
            )
    except Exception:  # not JSON, not an object, no name or arguments: it is text
        return [], text
    content = text[: text.find(TOOL_START)]
    return calls, content or None


def _tool_call_bodies(text: str) -> list[tuple[str, bool]]:
    """Each ``<tool_call>`` region's JSON text and whether it is complete (closed, or valid JSON already)."""
    out: list[tuple[str, bool]] = []
    pos = 0
    while (start := text.find(TOOL_START, pos)) >= 0:
        body_start = start + len(TOOL_START)
        end = text.find(TOOL_END, body_start)
        if end >= 0:
            out.append((text[body_start:end].strip(), True))
            pos = end + len(TOOL_END)
            continue
        raw = text[body_start:]
        if overlap := _partial_overlap(raw, TOOL_END):
            raw = raw[:-overlap]
        body = raw.strip()
        out.append((body, _is_json(body) if body else False))
        break
    return out


def _arguments_text(body: str, complete: bool) -> str | None:
    match = _ARGUMENTS.search(body)
    if not match:
        return None
    raw = body[match.end() :]
    if complete:
        raw = raw.rstrip()
        if raw.endswith("}"):
            raw = raw[:-1].rstrip()
    return raw


def _partial_overlap(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ``text`` ends with."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
