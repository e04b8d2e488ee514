"""Chat requests to prompt token ids through a tokenizer's own chat template, as vLLM renders them.

:class:`ChatTemplate` is the one renderer of the embedded inference server (``/v1/chat/completions`` and
``/v1/chat/completions/render`` call it alike, so the two cannot disagree) and is usable alone, e.g. by a
proxy that renders only the tail of a conversation. What it does, as vLLM 0.32's renderer does:

- message ``content`` given as OpenAI parts keeps its text parts, joined with ``"\\n"``; ``null`` is ``""``;
- an assistant message's ``tool_calls[].function.arguments`` given as a JSON string is parsed into an object
  (templates render arguments with ``tojson``); an empty ``tool_calls`` list is dropped;
- ``tools`` go to the template as ``[{"type": "function", "function": {...}}]``; a template that never reads
  ``tools`` is refused (:class:`ChatTemplateError`, a 400 naming ``tools``) instead of silently dropping
  them;
- ``add_generation_prompt`` (default true), ``continue_final_message`` (not both) and
  ``chat_template_kwargs`` (e.g. ``enable_thinking``) are the template's;
- the text is encoded without adding special tokens (the template writes them).

Rendering is a pure function of its input: the same request gives the same ids. Its cost is the template's
over the messages it is given and nothing else (nothing is cached per conversation), so a caller that sends
a short tail pays for the tail.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["ChatTemplate", "ChatTemplateError", "normalize_messages", "normalize_tools"]


class ChatTemplateError(ValueError):
    """A request the template cannot render; ``param`` names the request field at fault (for a 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """The messages as the template receives them (see the module docstring); 400-worthy input raises."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"field 'messages.{i}': must be an object", "messages")
        role = message.get("role")
        if not isinstance(role, str):
            raise ChatTemplateError(f"field 'messages.{i}.role': must be a string", "messages")
        flat = dict(message)
        flat["content"] = _text_of(message.get("content"), i)
        if role == "assistant" and "tool_calls" in flat:
            calls = flat["tool_calls"]
            if calls is None or calls == []:
                flat.pop("tool_calls")
            else:
                flat["tool_calls"] = _tool_calls_of(calls, i)
        out.append(flat)
    return out


def _text_of(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text parts mean anything here
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                texts.append(part["text"])
        return "\n".join(texts)
    raise ChatTemplateError(f"field 'messages.{i}.content': must be a string or a list of parts", "messages")


def _tool_calls_of(calls: Any, i: int) -> list[dict[str, Any]]:
    where = f"messages.{i}.tool_calls"
    if not isinstance(calls, list):
        raise ChatTemplateError(f"field '{where}': must be a list", "messages")
    out = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatTemplateError(
                f"field '{where}.{k}': must be an object with 'function': {{'name', 'arguments'}}", "messages"
            )
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                raise ChatTemplateError(
                    f"field '{where}.{k}.function.arguments': not valid JSON", "messages"
                ) from None
        elif arguments is None:
            arguments = {}
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def normalize_tools(tools: Any) -> list[dict[str, Any]]:
    """``tools`` as a list of ``{"type": "function", "function": {"name", ...}}``; anything else raises."""
    if not isinstance(tools, list):
        raise ChatTemplateError("field 'tools': must be a list of tools", "tools")
    out = []
    for k, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise ChatTemplateError(
                f"field 'tools.{k}': only tools of type 'function' are supported", "tools"
            )
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatTemplateError(f"field 'tools.{k}.function.name': must be a string", "tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise ChatTemplateError(
                f"field 'tools.{k}.function.parameters': must be a JSON schema object", "tools"
            )
        out.append({"type": "function", "function": dict(function)})
    return out


class ChatTemplate:
    """A tokenizer's chat template as a renderer of chat requests to token ids (thread-safe, stateless).

    ``encode`` turns the rendered text into ids (default: the tokenizer without special tokens); the server
    passes its fast Rust encoder. Raises :class:`ChatTemplateError` for what a client got wrong (a 400) and
    when the tokenizer has no template at all.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, encode: Callable[[str], list[int]] | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self._encode = encode or (lambda text: list(tokenizer.encode(text, add_special_tokens=False)))

    @cached_property
    def source(self) -> str | None:
        """The Jinja source of the template, or ``None`` when the tokenizer has none."""
        template = getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, dict):  # named templates: the default one renders chats
            template = template.get("default")
        return template if isinstance(template, str) else None

    @cached_property
    def supports_tools(self) -> bool:
        """Whether the template reads the ``tools`` variable (a tool section); decided from its syntax tree."""
        if self.source is None:
            return False
        from jinja2 import Environment, meta

        try:
            names = meta.find_undeclared_variables(Environment().parse(self.source))
        except Exception:  # a template jinja2 alone cannot parse (extensions): look for the word
            return "tools" in self.source
        return "tools" in names

    def render_text(
        self,
        messages: Sequence[Any],
        *,
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for a chat request (see the module docstring for what is normalised)."""
        if self.source is None:
            raise ChatTemplateError("the model's tokenizer has no chat template", "messages")
        if not messages:
            raise ChatTemplateError("field 'messages': at least one message is required", "messages")
        flat, kwargs = self._prepared(
            messages, tools, add_generation_prompt, continue_final_message, chat_template_kwargs
        )
        try:
            text = self.tokenizer.apply_chat_template(
                flat,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **kwargs,
            )
        except ChatTemplateError:
            raise
        except Exception as exc:  # the template is user data: any error in it is a bad request
            raise ChatTemplateError(
                f"the chat template failed on these messages: {exc}", "messages"
            ) from None
        return str(text)

    def check(
        self,
        messages: Sequence[Any],
        *,
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """Validate a chat request as :meth:`render_text` would, without rendering it (a request that brings
        its prompt as ids): the same :class:`ChatTemplateError` for the same bad input, except that no
        message at all is allowed and the template itself is never run."""
        self._prepared(messages, tools, add_generation_prompt, continue_final_message, chat_template_kwargs)

    def _prepared(
        self,
        messages: Sequence[Any],
        tools: Sequence[Any] | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template_kwargs: Mapping[str, Any] | None,
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The messages and the template's keyword arguments (``tools`` included), checked."""
        if add_generation_prompt and continue_final_message:
            raise ChatTemplateError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                "continue_final_message",
            )
        flat = normalize_messages(messages)
        kwargs = dict(chat_template_kwargs or {})
        for reserved in ("messages", "tools", "add_generation_prompt", "continue_final_message", "tokenize"):
            if reserved in kwargs:
                raise ChatTemplateError(
                    f"field 'chat_template_kwargs.{reserved}': set it as a request field instead",
                    "chat_template_kwargs",
                )
        if tools:
            tool_list = normalize_tools(list(tools))
            if not self.supports_tools:
                raise ChatTemplateError(
                    "field 'tools': this model's chat template has no tool section (it never reads `tools`), "
                    "so the tools would be silently dropped from the prompt; use a model whose template "
                    "renders tools (e.g. a Qwen2.5/Hermes-style template, as the built-in tiny model's) or "
                    "send no tools",
                    "tools",
                )
            kwargs["tools"] = tool_list
        return flat, kwargs

    def render(
        self,
        messages: Sequence[Any],
        *,
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The prompt token ids for a chat request: :meth:`render_text`, encoded."""
        text = self.render_text(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
        )
        return self._encode(text)
