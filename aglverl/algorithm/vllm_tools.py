"""Tool calling on verl's vLLM rollout: which ``--tool-call-parser`` a model's family needs (``aglverl.tool_call_parser``).

vLLM answers a chat call's ``tools`` only when started with ``--enable-auto-tool-choice`` and a
``--tool-call-parser`` for the model's output format; verl starts its vLLM servers from
``actor_rollout_ref.rollout.engine_kwargs.vllm`` (each key a ``--key`` of ``vllm serve``). With
``aglverl.tool_call_parser: auto`` (the default) aglverl picks the parser from the model's files
(:func:`pick_tool_call_parser`): its ``config.json`` (``model_type``, the vocabulary size) and chat template.

Families it knows (:data:`FAMILY_PARSERS`, ``model_type`` -> parser): Qwen2 / Qwen2.5 / QwQ / Qwen3 (dense and
MoE) ``hermes``, Qwen3-Coder (its template's ``<function=`` calls) ``qwen3_coder``, Llama 3.x (the 128k Llama 3
vocabulary) ``llama3_json``, Llama 4 ``llama4_pythonic``, Mistral / Mixtral ``mistral``, DeepSeek-V3
``deepseek_v3``, GLM-4.5 ``glm45``, gpt-oss ``openai``, Granite ``granite``, InternLM2 ``internlm``, Jamba
``jamba``, Kimi-K2 ``kimi_k2``, ERNIE 4.5 ``ernie45``, Seed-OSS ``seed_oss``; and any model whose chat template
writes Hermes ``<tool_call>`` blocks (Hermes 2/3, the tiny model) ``hermes``. A hub name whose files are not in
the local cache (verl downloads them later) is read by its name (``Qwen/...``, ``...Llama-3...``, ``...Mistral...``).
Others get none (a warning says so): name the parser, as vLLM's tool calling docs list them per model.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "FAMILY_PARSERS",
    "KNOWN_TOOL_PARSERS",
    "known_tool_parsers",
    "model_files",
    "pick_tool_call_parser",
]

logger = logging.getLogger(__name__)

#: The tool parsers vLLM 0.32 registers (``vllm/tool_parsers/__init__.py``): the names checked against when
#: the installed vLLM's own list cannot be read (vLLM not installed where the config is composed).
KNOWN_TOOL_PARSERS: tuple[str, ...] = (
    "apertus", "cohere_command3", "cohere_command4", "deepseek_v3", "deepseek_v31", "deepseek_v32",
    "deepseek_v4", "deepseek_v41", "dots", "ernie45", "functiongemma", "gemma4", "gigachat3", "glm45", "glm47",
    "granite", "granite-20b-fc", "granite4", "hermes", "hf", "hunyuan_a13b", "hy_v3", "hy_v4", "inkling",
    "internlm", "jamba", "k2_horizon", "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3_json", "llama4_json",
    "llama4_pythonic", "longcat", "mimo", "minicpm5", "minimax_m2", "minimax_m3", "mistral", "muse_glimmer",
    "olmo3", "openai", "phi4_mini_json", "plamo3", "poolside_v1", "pythonic", "qwen3_coder", "qwen3_json",
    "qwen3_xml", "seed_oss", "step3", "step3p5", "xlam",
)  # fmt: skip

#: ``config.json``'s ``model_type`` -> vLLM's tool parser for that family (``llama`` is decided by its
#: vocabulary and template, see :func:`pick_tool_call_parser`).
FAMILY_PARSERS: Mapping[str, str] = {
    "qwen2": "hermes",
    "qwen2_moe": "hermes",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "llama4": "llama4_pythonic",
    "mistral": "mistral",
    "mixtral": "mistral",
    "deepseek_v3": "deepseek_v3",
    "glm4_moe": "glm45",
    "gpt_oss": "openai",
    "granite": "granite",
    "internlm2": "internlm",
    "jamba": "jamba",
    "kimi_k2": "kimi_k2",
    "ernie4_5": "ernie45",
    "ernie4_5_moe": "ernie45",
    "seed_oss": "seed_oss",
}

#: Llama 3's vocabulary (128,256 ids); Llama 2's has 32,000 and no tool calls.
_LLAMA3_VOCAB = 128_000


def known_tool_parsers() -> tuple[str, ...]:
    """The tool parser names the installed vLLM registers, read without importing vLLM (its registry's source);
    :data:`KNOWN_TOOL_PARSERS` when vLLM is not installed or its registry cannot be read. Plugins'
    (``--tool-parser-plugin``) are not among them."""
    registry = sys.modules.get("vllm.tool_parsers")
    if registry is not None:  # vLLM already imported here: its live registry
        manager = getattr(registry, "ToolParserManager", None)
        try:
            return tuple(sorted(manager.list_registered()))  # type: ignore[union-attr]
        except Exception:  # another vLLM's API: fall back to reading its source
            pass
    return _registered_in_source() or KNOWN_TOOL_PARSERS


def _registered_in_source() -> tuple[str, ...]:
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return ()
    if spec is None or not spec.submodule_search_locations:
        return ()
    source = Path(next(iter(spec.submodule_search_locations))) / "tool_parsers" / "__init__.py"
    try:
        tree = ast.parse(source.read_text())
    except (OSError, SyntaxError, ValueError):
        return ()
    for node in tree.body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        value = getattr(node, "value", None)
        named = any(isinstance(t, ast.Name) and t.id == "_TOOL_PARSERS_TO_REGISTER" for t in targets)
        if named and isinstance(value, ast.Dict):
            names = [
                key.value
                for key in value.keys
                if isinstance(key, ast.Constant) and isinstance(key.value, str)
            ]
            return tuple(sorted(names))
    return ()


def model_files(path: str) -> tuple[dict[str, Any], str]:
    """A model's ``config.json`` and chat template source: from its directory, or, for a Hugging Face hub name,
    from the local hub cache only (nothing is downloaded); empty where missing."""
    local = Path(path).expanduser()
    if local.is_dir():
        read = lambda name: local / name if (local / name).is_file() else None  # noqa: E731
    else:
        read = lambda name: _hub_cached(path, name)  # noqa: E731
    config: dict[str, Any] = {}
    config_file = read("config.json")
    if config_file is not None:
        try:
            loaded = json.loads(Path(config_file).read_text())
            config = loaded if isinstance(loaded, dict) else {}
        except (OSError, ValueError):
            pass
    template = ""
    jinja = read("chat_template.jinja")
    if jinja is not None:
        try:
            template = Path(jinja).read_text()
        except OSError:
            pass
    tokenizer_config = read("tokenizer_config.json")
    if not template and tokenizer_config is not None:
        try:
            source = json.loads(Path(tokenizer_config).read_text()).get("chat_template") or ""
        except (OSError, ValueError, AttributeError):
            source = ""
        if isinstance(source, list):  # named templates: [{"name": "default", "template": "..."}, ...]
            source = "\n".join(str(t.get("template", "")) for t in source if isinstance(t, dict))
        template = source if isinstance(source, str) else ""
    return config, template


def _hub_cached(repo: str, filename: str) -> str | None:
    if repo.count("/") != 1:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo, filename)
    except Exception:  # not a valid repo id: nothing cached
        return None
    return found if isinstance(found, str) else None


def pick_tool_call_parser(path: str) -> tuple[str | None, str]:
    """vLLM's tool parser for the model at ``path`` (a directory or a cached hub name) and why, or ``None`` and
    why not (see the module's docstring for the families)."""
    config, template = model_files(path)
    hermes = "<tool_call>" in template
    if hermes and "<function=" in template:
        return "qwen3_coder", "its chat template writes Qwen3-Coder <tool_call><function=...> calls"
    model_type = config.get("model_type")
    if model_type == "llama":
        if hermes:
            return "hermes", "its chat template writes Hermes <tool_call> blocks"
        vocab = config.get("vocab_size")
        if isinstance(vocab, int) and vocab >= _LLAMA3_VOCAB:
            return "llama3_json", "a Llama 3 model (model_type llama, Llama 3's vocabulary)"
        return None, "a Llama model without Llama 3's vocabulary or a Hermes template"
    if isinstance(model_type, str) and model_type in FAMILY_PARSERS:
        return FAMILY_PARSERS[model_type], f"its family (model_type {model_type})"
    if hermes:
        return "hermes", "its chat template writes Hermes <tool_call> blocks"
    if not config:
        by_name = _by_name(path)
        if by_name is not None:
            return by_name, "its name (its config.json is not here: a hub name not in the local cache)"
        return None, "its config.json cannot be read here"
    return None, f"no parser known for its family (model_type {model_type})"


#: A hub name's family when its files are not at hand (read before verl downloads them): (words, parser),
#: the first whose words all appear in the lower-cased name.
_NAME_PARSERS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("qwen3", "coder"), "qwen3_coder"),
    (("qwen",), "hermes"),
    (("qwq",), "hermes"),
    (("hermes",), "hermes"),
    (("llama-4",), "llama4_pythonic"),
    (("llama-3",), "llama3_json"),
    (("llama3",), "llama3_json"),
    (("mistral",), "mistral"),
    (("mixtral",), "mistral"),
)


def _by_name(path: str) -> str | None:
    name = path.lower()
    for words, parser in _NAME_PARSERS:
        if all(word in name for word in words):
            return parser
    return None
