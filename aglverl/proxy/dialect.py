"""Backend dialects: everything the proxy must know about the inference server behind it, in one place.

The proxy speaks to its backends in OpenAI's chat / completions API plus a few extensions that differ from one
server to the next. :class:`Dialect` is that difference, as the proxy uses it; no other module names a field,
route or value of a backend's own wire:

- **token ids**: the fields a recorded call gets so that the answer carries its prompt and generated ids, and
  the sampled tokens' log-probs when asked (:meth:`Dialect.request_fields`), and where answers carry them
  (:attr:`Dialect.wire`: the ids' field names and the finish reason of a generation the engine aborted), read
  by the capture it makes (:meth:`Dialect.capture`), by the relay's look for an abort in a stream, and by the
  resumer (:meth:`Dialect.response_ids`);
- **continuing an aborted generation** token-exactly (:meth:`Dialect.continuation`: target and body, its answer
  a completion of this wire), and the request fields no continuation can carry on
  (:attr:`Dialect.unresumable_fields`);
- **token-in**: a chat call generated from given prompt ids, in one request (:meth:`Dialect.token_in`: the
  route, the body, and whether the answer comes as chat or as a completion the proxy spells back as chat,
  :mod:`~aglverl.proxy.reshape`), whether a refusal says the backend does not take them
  (:meth:`Dialect.refuses_prompt_ids`), and the render route a proxy without the model's tokenizer uses for a
  tail's ids (:attr:`Dialect.render_target`, :meth:`Dialect.render_body`, :meth:`Dialect.rendered_ids`,
  :meth:`Dialect.lacks_route`), with what to tell the operator when a piece is missing (:attr:`Dialect.advice`);
- **errors**: a refusal that says the prompt does not fit the context window (:meth:`Dialect.context_refusal`);
- **versions**: the weight version an answer's tokens came from (:meth:`Dialect.weight_version`);
- **the backend itself**: its health probe (:attr:`Dialect.health_path`), its model listing
  (:attr:`Dialect.models_path`), the context window and the tokenizer's location it tells
  (:meth:`Dialect.context_window`, :meth:`Dialect.tokenizer_source`).

Two dialects: :data:`VLLM` (vLLM 0.32's OpenAI server) and :data:`ENGINE` (aglverl's embedded engine, which
answers in vLLM's shapes by design, so it is the same wire with its own name, marker and advice). A third
backend (SGLang, another server) is one new class, registered by its listing's ``owned_by``
(:func:`register`): a subclass of :class:`VLLMDialect` that names its own :class:`~aglverl.proxy.capture.AnswerWire`
and overrides what its server does otherwise (``tests/test_dialect.py`` adds one whose ids have other names,
whose aborts end ``"cancelled"`` and which takes prompt ids on its completions route).

How the proxy learns a backend's dialect: **detected at first contact**. The first recorded call to a backend
(or the token-in part, or a continuation, whichever needs it first) reads its model listing once
(:meth:`~aglverl.proxy.pool.Pool.dialect`), and the cards' ``owned_by`` picks the dialect (:func:`detect`;
unknown markers keep :data:`DEFAULT`, vLLM's wire). A call is spelled in its backend's dialect when a try goes
there (:meth:`Call.prepare <aglverl.proxy.call.Call.prepare>`), so backends of different wires can share a
proxy.

Pure and synchronous: values and functions of their input, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import orjson
from multidict import MultiMapping

from .capture import VLLM_WIRE, AnswerWire, Capture

__all__ = [
    "CONTEXT_REFUSAL",
    "CONTINUED_FIELDS",
    "DEFAULT",
    "DIALECTS",
    "ENGINE",
    "VLLM",
    "WEIGHT_VERSION_HEADER",
    "Dialect",
    "TokenInRequest",
    "VLLMDialect",
    "detect",
    "register",
]

Kind = Literal["chat", "completion"]

#: What a backend's 4xx refusal says when the prompt (with the tokens asked for) does not fit its context
#: window: vLLM ("This model's maximum context length is ...", "... cannot be greater than max_model_len=...",
#: "The decoder prompt ... is longer than the maximum model length ..."), OpenAI (code
#: "context_length_exceeded"), SGLang ("... longer than the model's context length ...").
CONTEXT_REFUSAL = re.compile(
    r"context[ _]length|max_model_len|maximum model length|prompt is too long|too long and exceeds", re.I
)

#: The response header with the weight version an answer's tokens came from (the embedded engine sends it;
#: vLLM does not, and the proxy's own version is recorded then).
WEIGHT_VERSION_HEADER = "X-Weight-Version"

#: Request fields a continuation repeats; on ``/v1/completions`` each means what it meant on the call.
CONTINUED_FIELDS: tuple[str, ...] = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "bad_words",
    "allowed_token_ids",
    "cache_salt",
    "user",
    "stream_options",
)
#: Request fields that change how a conversation renders: a render for a tail carries them.
RENDER_FIELDS = ("model", "tools", "chat_template", "chat_template_kwargs", "documents")
_SEED_SPACE = 2**63
_PROMPT_IDS = b'"kv_transfer_params"'


@dataclass(frozen=True, slots=True)
class TokenInRequest:
    """A chat call made from prompt ids, as a dialect sends it (:meth:`Dialect.token_in`): the route
    (``None``: the call's own), the body, and the shape its answer comes in there."""

    target: str | None
    body: bytes
    answer: Kind


class Dialect(Protocol):
    """What the proxy needs to know about one kind of backend (see the module docstring)."""

    @property
    def name(self) -> str:
        """A short name for logs."""

    @property
    def owned_by(self) -> str:
        """The ``owned_by`` of its model listing's cards, by which it is detected."""

    @property
    def health_path(self) -> str:
        """``GET`` this; a 200 means the backend takes traffic."""

    @property
    def models_path(self) -> str:
        """``GET`` this for the model cards (OpenAI's ``{"data": [card, ...]}``)."""

    @property
    def continuation_target(self) -> str:
        """Where an aborted generation is continued (a POST)."""

    @property
    def render_target(self) -> str:
        """Where a proxy without the model's tokenizer renders a tail into ids (a POST)."""

    @property
    def wire(self) -> AnswerWire:
        """Where its answers carry prompt and generated ids, and the finish reason of a generation the engine
        aborted (a weight update): what the capture, the relay's look for an abort and the resumer read."""

    @property
    def abort_reason(self) -> str:
        """The finish reason of a generation the engine aborted (``wire.abort_reason``)."""

    @property
    def advice(self) -> Mapping[str, str]:
        """What the operator must do for token-in to work, by what is missing (``prompt_ids``, ``render``)."""

    @property
    def unresumable_fields(self) -> tuple[str, ...]:
        """Request fields whose state a continuation would start afresh (a grammar over the output)."""

    def ids_fields(self, kind: Kind) -> Mapping[str, Any]: ...
    def logprobs_field(self, kind: Kind) -> Any: ...
    def request_fields(self, kind: Kind, logprobs: bool) -> Mapping[str, Any]: ...
    def capture(self, kind: Kind, answers: bool = False) -> Capture: ...
    def response_ids(self, choice: Mapping[str, Any]) -> list[int] | None: ...
    def weight_version(self, headers: MultiMapping[str]) -> int | None: ...
    def context_refusal(self, status: int, message: str) -> bool: ...
    def continuation(
        self,
        request: Mapping[str, Any],
        kind: Kind,
        prompt: Sequence[int],
        ids: Sequence[int],
        left: int | None,
        stream: bool,
    ) -> bytes: ...
    def with_prompt_ids(self, body: bytes, request: Mapping[str, Any], ids: Sequence[int]) -> bytes: ...
    def token_in(self, body: bytes, request: Mapping[str, Any], ids: Sequence[int]) -> TokenInRequest: ...
    def refuses_prompt_ids(self, status: int, message: str) -> bool: ...
    def render_body(
        self, request: Mapping[str, Any], messages: Sequence[Any], generation_prompt: bool
    ) -> bytes: ...
    def rendered_ids(self, answer: Any) -> list[int] | None: ...
    def lacks_route(self, status: int, body: bytes) -> bool: ...
    def context_window(self, cards: Sequence[Any], model: str | None) -> int | None: ...
    def tokenizer_source(self, cards: Sequence[Any], model: str | None) -> str | None: ...


def _card(cards: Sequence[Any], model: str | None) -> Mapping[str, Any] | None:
    """The card of ``model`` (the only card, when there is one)."""
    dicts = [c for c in cards if isinstance(c, dict)]
    if len(dicts) == 1:
        return dicts[0]
    return next((c for c in dicts if c.get("id") == model), None)


@dataclass(frozen=True, slots=True)
class VLLMDialect:
    """vLLM's wire (0.32): ``return_token_ids`` answers (top-level ``prompt_token_ids``, ``choices[i].token_ids``,
    per chunk in streams), finish reason ``"abort"`` for a generation a weight update cut, continuations on
    ``/v1/completions`` with the prompt as ids, one-request token-in through
    ``kv_transfer_params["prompt_token_ids"]`` on the chat endpoint, the scale-out render route, ``GET /health``
    and ``GET /v1/models`` cards with ``max_model_len`` and ``root`` (the model's path or hub id).

    ``name``, ``owned_by`` and ``advice`` tell one server of this wire from another (the embedded engine
    speaks it too).
    """

    name: str = "vllm"
    owned_by: str = "vllm"
    advice: Mapping[str, str] = field(default_factory=dict)
    health_path: str = "/health"
    models_path: str = "/v1/models"
    continuation_target: str = "/v1/completions"
    render_target: str = "/v1/chat/completions/render"
    wire: AnswerWire = VLLM_WIRE
    unresumable_fields: tuple[str, ...] = (
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
        "prompt_logprobs",
    )

    @property
    def abort_reason(self) -> str:
        return self.wire.abort_reason

    # ------------------------------------------------------------------ token ids
    def ids_fields(self, kind: Kind) -> Mapping[str, Any]:
        """The fields that make an answer carry its prompt and generated ids."""
        return {"return_token_ids": True}

    def logprobs_field(self, kind: Kind) -> Any:
        """The ``logprobs`` value that asks for the sampled tokens' own log-probs (completions take a count of
        alternatives: 0)."""
        return True if kind == "chat" else 0

    def request_fields(self, kind: Kind, logprobs: bool) -> Mapping[str, Any]:
        """What a recorded call's body gets (each unless the agent set it): the ids fields and, with
        ``logprobs``, the field that asks for the sampled tokens' log-probs."""
        fields = self.ids_fields(kind)
        return {**fields, "logprobs": self.logprobs_field(kind)} if logprobs else fields

    def capture(self, kind: Kind, answers: bool = False) -> Capture:
        """A reader of this wire's answers and streams (ids, log-probs, finish reasons; chat answers too)."""
        return Capture(kind, answers, self.wire)

    def response_ids(self, choice: Mapping[str, Any]) -> list[int] | None:
        """A parsed choice's generated ids, in this wire's field (``None``: absent or not a list)."""
        ids = choice.get(self.wire.response_ids)
        return ids if type(ids) is list else None

    def weight_version(self, headers: MultiMapping[str]) -> int | None:
        """The weight version the backend reports for an answer, if it reports a valid one."""
        value = headers.get(WEIGHT_VERSION_HEADER)
        if value is None or not value.isdigit():
            return None
        return int(value)

    def context_refusal(self, status: int, message: str) -> bool:
        """Whether a refusal says the prompt (with the tokens asked for) does not fit the context window."""
        return 400 <= status < 500 and status != 429 and CONTEXT_REFUSAL.search(message) is not None

    # ------------------------------------------------------------------ continuing an aborted generation
    def continuation(
        self,
        request: Mapping[str, Any],
        kind: Kind,
        prompt: Sequence[int],
        ids: Sequence[int],
        left: int | None,
        stream: bool,
    ) -> bytes:
        """The ``/v1/completions`` body that continues a generation token-exactly: the call's ``prompt`` ids
        and the ``ids`` generated so far as the prompt, what is left of the call's limit (``None``: the
        backend's default), and the call's own sampling parameters, ``seed`` moved on by the ids generated
        (reproducible, and not the first tokens' random numbers over again) and ``min_tokens`` less them.

        Each part is sampled as the call asked, with two seams no completion can hide: a stop string split
        across an abort is not matched, and vLLM's presence / frequency penalties (off-policy parameters the
        trainer refuses or masks anyway) count only the part's own tokens."""
        generated = len(ids)
        body = {key: request[key] for key in CONTINUED_FIELDS if request.get(key) is not None}
        body["prompt"] = [*prompt, *ids]
        if left is not None:
            body["max_tokens"] = left
        min_tokens = request.get("min_tokens")
        if type(min_tokens) is int and min_tokens > generated:
            body["min_tokens"] = min_tokens - generated
        seed = request.get("seed")
        if type(seed) is int:
            body["seed"] = (seed + generated) % _SEED_SPACE
        if kind == "chat":
            if request.get("logprobs"):
                body["logprobs"] = request.get("top_logprobs") or 0
        elif request.get("logprobs") is not None:
            body["logprobs"] = request["logprobs"]
        body |= self.ids_fields("completion")
        if stream:
            body["stream"] = True
        else:
            body.pop("stream_options", None)
        return orjson.dumps(body)

    # ------------------------------------------------------------------ token-in
    def token_in(self, body: bytes, request: Mapping[str, Any], ids: Sequence[int]) -> TokenInRequest:
        """A chat call generated from ``ids``: where it goes (``None``: the call's own chat route), its body
        (:meth:`with_prompt_ids`), and the shape of the answer there (``"chat"``: as the agent expects it;
        ``"completion"``: a completion the proxy spells back as a chat answer)."""
        return TokenInRequest(None, self.with_prompt_ids(body, request, ids), "chat")

    def with_prompt_ids(self, body: bytes, request: Mapping[str, Any], ids: Sequence[int]) -> bytes:
        """The chat request ``body`` generated from ``ids`` instead of its rendered messages, in one request:
        ``kv_transfer_params["prompt_token_ids"]`` (vLLM skips templating and tokenization; ``messages`` and
        ``tools`` still drive tool-choice validation, its tool-call and reasoning parsers and the answer's
        shape). Every other byte of the agent's body is kept; a body that already has ``kv_transfer_params``
        is re-encoded with the ids added to them."""
        ids_json = orjson.dumps(list(ids))
        if _PROMPT_IDS not in body:
            start = body.index(b"{") + 1
            field = b'"kv_transfer_params":{"prompt_token_ids":' + ids_json + b"}"
            rest = body[start:].lstrip()
            return body[:start] + field + (b"," if rest[:1] != b"}" else b"") + body[start:]
        params = request.get("kv_transfer_params")
        merged = {**(params if isinstance(params, dict) else {}), "prompt_token_ids": list(ids)}
        return orjson.dumps({**request, "kv_transfer_params": merged})

    def refuses_prompt_ids(self, status: int, message: str) -> bool:
        """Whether a 4xx says the backend does not take prompt ids this way (a server that forbids the field),
        rather than that the request was wrong otherwise (vLLM names ``kv_transfer_params['prompt_token_ids']``
        for ids it refuses: out of vocabulary, malformed)."""
        return 400 <= status < 500 and "kv_transfer_params" in message and "prompt_token_ids" not in message

    def render_body(
        self, request: Mapping[str, Any], messages: Sequence[Any], generation_prompt: bool
    ) -> bytes:
        """``POST render_target`` of ``messages`` under the call's rendering context (tools, template and its
        arguments), with or without the generation prompt."""
        body = {key: request[key] for key in RENDER_FIELDS if request.get(key) is not None}
        body |= {"messages": list(messages), "add_generation_prompt": generation_prompt}
        return orjson.dumps(body)

    def rendered_ids(self, answer: Any) -> list[int] | None:
        """The prompt ids of a render answer (vLLM's ``GenerateRequest``: ``token_ids``)."""
        ids = answer.get("token_ids") if isinstance(answer, dict) else None
        return ids if type(ids) is list else None

    def lacks_route(self, status: int, body: bytes) -> bool:
        """A refusal that says the route is not served (404 / 405 without an OpenAI error: not a model the
        backend lacks) or is disabled (vLLM without ``--enable-scale-out``: 403)."""
        if status == 403:
            return b"disabled" in body or b"Scale-out" in body
        if status in (404, 405):
            try:
                parsed = orjson.loads(body)
            except orjson.JSONDecodeError:
                return True
            return not (isinstance(parsed, dict) and isinstance(parsed.get("error"), dict))
        return False

    # ------------------------------------------------------------------ the backend's facts
    def context_window(self, cards: Sequence[Any], model: str | None) -> int | None:
        """``max_model_len`` of the model's card (``None`` when it does not say)."""
        card = _card(cards, model)
        window = card.get("max_model_len") if card is not None else None
        return window if type(window) is int else None

    def tokenizer_source(self, cards: Sequence[Any], model: str | None) -> str | None:
        """Where the served model's tokenizer is: the card's ``root`` (the path or hub id it was loaded from)."""
        card = _card(cards, model)
        root = card.get("root") if card is not None else None
        return root if isinstance(root, str) and root else None


_VLLM_ADVICE = {
    "prompt_ids": "a vLLM that generates a chat completion from kv_transfer_params['prompt_token_ids'] "
    "(0.32 or later)",
    "render": "vllm serve ... --enable-scale-out (its /v1/chat/completions/render route)",
}
_ENGINE_ADVICE = {
    "prompt_ids": "an aglverl whose engine generates a chat completion from "
    "kv_transfer_params['prompt_token_ids']",
    "render": "an aglverl whose engine serves /v1/chat/completions/render",
}

#: vLLM's OpenAI server.
VLLM: Dialect = VLLMDialect(advice=_VLLM_ADVICE)
#: aglverl's embedded engine (``aglverl.engine``): vLLM's wire, sends ``X-Weight-Version``.
ENGINE: Dialect = VLLMDialect(name="aglverl-engine", owned_by="aglverl", advice=_ENGINE_ADVICE)
#: What a backend speaks until its model listing says otherwise.
DEFAULT: Dialect = VLLM
#: The known dialects by their model cards' ``owned_by``.
DIALECTS: dict[str, Dialect] = {d.owned_by: d for d in (VLLM, ENGINE)}


def register(dialect: Dialect) -> Dialect:
    """Make ``dialect`` known by its ``owned_by`` (a backend whose model cards say so speaks it); returns it."""
    DIALECTS[dialect.owned_by] = dialect
    return dialect


def detect(cards: Sequence[Any]) -> Dialect:
    """The dialect a model listing's cards speak (by ``owned_by``; :data:`DEFAULT` for an unknown one)."""
    for card in cards:
        if isinstance(card, dict) and (dialect := DIALECTS.get(str(card.get("owned_by")))) is not None:
            return dialect
    return DEFAULT
