"""The mock's tokens: how a request becomes prompt ids, and the ids, text and log-probs it generates.

Text is "tokenized" as its UTF-8 bytes (one byte, one id). A chat is first rendered by one of the mock's chat
templates (:func:`render_chat`; :data:`JINJA_TEMPLATES` are the same in Jinja, and :func:`write_tokenizer`
writes a Hugging Face tokenizer and template that give exactly these ids). What the mock generates is a fixed
function of the prompt (:func:`completion_token_ids`), each token written ``" t<id>"`` (:func:`token_text`) with
a fixed log-prob (:func:`token_logprob`); a forced tool call (:func:`forced_tool`) carries the generated ids as
its arguments (:func:`tool_arguments`). A test computes from these what a proxy must have recorded without
asking the mock.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "JINJA_TEMPLATES",
    "VOCAB_SIZE",
    "Template",
    "completion_token_ids",
    "forced_tool",
    "prompt_token_ids",
    "render_chat",
    "token_logprob",
    "token_text",
    "tool_arguments",
    "write_tokenizer",
]

#: Token ids the mock produces are in ``range(VOCAB_SIZE)``.
VOCAB_SIZE = 50_000

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


def token_text(token_id: int) -> str:
    """A generated token as the mock writes it: ``" t<id>"``."""
    return f" t{token_id}"


def tool_arguments(ids: Sequence[int]) -> list[str]:
    """The pieces, one per generated id, of the arguments of a tool call the mock makes; joined, a JSON object."""
    if not ids:
        return ['{"value": ""}']
    pieces = ['{"value": "' + f"t{ids[0]}", *(f" t{t}" for t in ids[1:])]
    pieces[-1] += '"}'
    return pieces


def forced_tool(body: Mapping[str, Any]) -> str | None:
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
