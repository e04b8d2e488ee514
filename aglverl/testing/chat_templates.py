"""Chat templates that re-render a history the way real ones do, and model directories that use them.

The tiny model's own template (ChatML, :data:`aglverl.engine.tiny.CHAT_TEMPLATE`) renders every message as it is.
Real templates do not: Llama 3's trims every message's content, Qwen3's drops the reasoning of earlier
assistant turns (and renders the last turn after the last user message unlike the others). Both make the ids
of a re-rendered history differ from the ids the engine generated, which is what token-in chat exists for;
these templates reproduce that over the tiny model's ChatML tokens, with a Hermes-style tool section (tools
listed in a system turn, calls as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, results as
``<tool_response>``), so that vLLM's ``hermes`` tool parser reads the calls:

- :data:`TRIM_TEMPLATE` — Llama 3's way: every message's content ``| trim``; tool results as ``tool`` turns.
- :data:`THINK_TEMPLATE` — Qwen3's way: the generation prompt opens a ``<think>`` block (``enable_thinking``
  false closes it at once); an earlier assistant turn keeps only what follows its ``</think>``; the last
  assistant turn after the last user message is rendered with its think block; tool results as user turns.
- :data:`MISTRAL_TEMPLATE` — Mistral-7B-Instruct-v0.3's way: the tool list and a leading system message are
  rendered with the LAST user turn, so an earlier user turn renders otherwise once a later one comes (not
  append-only: a conversation re-rendered is not its earlier rendering followed by the new turns).

:func:`with_chat_template` copies a model directory (the tiny model's, typically) and replaces its template,
for tests and benchmarks that need a model "the project never built".
"""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["MISTRAL_TEMPLATE", "TEMPLATES", "THINK_TEMPLATE", "TRIM_TEMPLATE", "with_chat_template"]

_TOOLS = (
    "{% if tools %}<|im_start|>system\nYou may call tools:{% for t in tools %} {{ t['function']['name'] }}"
    '{% endfor %}. Call one as <tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
)
_CALLS = (
    "{% for c in (m['tool_calls'] or []) %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] if c['function']['arguments'] is string "
    "else (c['function']['arguments'] | tojson) }}}\n</tool_call>{% endfor %}"
)
#: Llama 3's way (every message trimmed) over ChatML tokens, with a Hermes tool section.
TRIM_TEMPLATE = (
    _TOOLS + "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>tool\n<tool_response>\n{{ (m['content'] or '') | trim }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ (m['content'] or '') | trim }}"
    + _CALLS
    + "<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: Qwen3's way (earlier reasoning dropped, a pre-opened think block) over ChatML tokens, with a Hermes tool section.
THINK_TEMPLATE = (
    "{% set ns = namespace(last_query=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    + _TOOLS
    + "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}"
    "{% set content = m['content'] or '' %}{% set reasoning = '' %}"
    "{% if '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_query and (loop.last or reasoning) %}<think>\n{{ reasoning }}\n</think>\n\n{% endif %}"
    "{{ content }}" + _CALLS + "<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
    "{% if enable_thinking is defined and enable_thinking is false %}\n</think>\n\n{% endif %}{% endif %}"
)
#: Mistral-7B-Instruct-v0.3's way (the tool list and the system prompt on the last user turn) over ChatML tokens.
MISTRAL_TEMPLATE = (
    "{%- set ns = namespace(last=-1, system=none) %}"
    "{%- for m in messages %}{% if m['role'] == 'user' %}{% set ns.last = loop.index0 %}{% endif %}"
    "{% if loop.first and m['role'] == 'system' %}{% set ns.system = m['content'] %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and loop.first %}"
    "{% elif m['role'] == 'user' %}{% if loop.index0 == ns.last %}" + _TOOLS + "{% endif %}<|im_start|>user\n"
    "{% if loop.index0 == ns.last and ns.system %}{{ ns.system }}\n\n{% endif %}{{ m['content'] }}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>tool\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}" + _CALLS + "<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: By name: ``trim``, ``think`` and ``mistral``.
TEMPLATES = {"trim": TRIM_TEMPLATE, "think": THINK_TEMPLATE, "mistral": MISTRAL_TEMPLATE}


def with_chat_template(model_dir: str | Path, target: str | Path, template: str) -> Path:
    """A copy of ``model_dir`` at ``target`` whose tokenizer renders chats with ``template`` (a Jinja string);
    returns ``target``. Raises ``FileExistsError`` if ``target`` exists."""
    source, target = Path(model_dir), Path(target)
    shutil.copytree(source, target)
    (target / "chat_template.jinja").write_text(template)
    return target
