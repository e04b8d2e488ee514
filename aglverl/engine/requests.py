"""What a request to the embedded server asks for: the wire models, their validation errors, and the plan.

- :class:`ChatRequest` / :class:`CompletionRequest` (and :class:`GenerationRequest`, the fields both take):
  pydantic models of the bodies, strict types, unknown fields ignored (as vLLM ignores OpenAI SDK extras);
- :class:`ApiError` — an OpenAI-shaped error answer ``{"error": {"message", "type", "param", "code"}}``, and
  :func:`validation_error`, a pydantic error as one (400 naming every offending field);
- :class:`Plan` — a validated request: prompt ids, sampling, stop strings, the answer's shape, its parse and
  its grammars;
- :class:`RequestPlanner` — turns a chat, completions or in-process request into a :class:`Plan`, with vLLM's
  checks (context window, ``tools`` / ``tool_choice``, token ids) and its messages.

A chat request may bring its prompt as token ids in ``kv_transfer_params.prompt_token_ids`` (vLLM 0.32's
decode-side reuse, :meth:`RequestPlanner.given_prompt_ids`): the template is not rendered and the ids are the
prompt, while ``messages`` and ``tools`` are validated as for a render and still decide tool-choice checks,
parsing, constraints and the answer's shape. As in vLLM: the ids must be a non-empty list of non-negative
integers inside the vocabulary (else 400 naming ``kv_transfer_params.prompt_token_ids``); they are ignored
(the messages are rendered) when ``echo`` is set or a message has a non-text part; ``max_tokens`` is cut to
what the context has left (``Input length ... exceeds`` when the ids alone are longer than the context,
``max_tokens must be at least 1`` when they fill it).

Nothing here generates; planning a chat request with a constraint compiles it in a worker thread
(:meth:`RequestPlanner.with_constraints`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import orjson
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .chat_parser import ChatParser, ToolRequest
from .chat_template import ChatTemplate, ChatTemplateError
from .constrained import ConstraintCompiler, ConstraintError, TokenConstraint, hermes_structural_tag
from .generation import SamplingParams
from .tokens import TokenCodec

__all__ = [
    "MAX_N",
    "MAX_TOP_LOGPROBS",
    "PROMPT_IDS_PARAM",
    "ApiError",
    "ChatRequest",
    "CompletionRequest",
    "GenerationRequest",
    "Plan",
    "RequestPlanner",
    "StreamOptions",
    "read_json",
    "reasoning_closed",
    "validation_error",
]

#: Largest ``n`` accepted (each choice is a row of the running batch).
MAX_N = 128
#: Largest ``top_logprobs`` / completions ``logprobs`` accepted (OpenAI's limit).
MAX_TOP_LOGPROBS = 20
#: The field a chat request brings its prompt ids in (vLLM's name for it in errors).
PROMPT_IDS_PARAM = "kv_transfer_params.prompt_token_ids"
#: Content part types that carry only text (vLLM's); any other part makes a message non-text.
TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal", "thinking", "tool_reference"})
#: Keys that make a content part media, whatever its ``type`` says (vLLM's).
MEDIA_PART_KEYS = frozenset(
    {"input_image", "image_url", "image_embeds", "audio_embeds", "video_embeds", "prompt_embeds", "image_pil",
     "audio_url", "input_audio", "video_url"}
)  # fmt: skip
#: Keys of ``generate_ids`` sampling dicts (verl's) that are accepted only at their neutral value.
_NEUTRAL_SAMPLING = {"top_k": (-1, 0, None), "repetition_penalty": (1.0, None), "min_p": (0.0, None)}
_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


# ---------------------------------------------------------------------------------------------- errors
class ApiError(Exception):
    """An OpenAI-shaped error answer: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict[str, Any]:
        kind = _ERROR_TYPES.get(self.status, "Error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}

    def response(self) -> web.Response:
        return web.Response(
            status=self.status, body=orjson.dumps(self.body()), content_type="application/json"
        )


#: Messages for fields whose type is a union (pydantic reports one error per alternative).
_FIELD_HINTS = {
    "prompt": "must be a string, a list of token ids, or a list of strings or of token-id lists",
    "stop": "must be a string or a list of strings",
}


def validation_error(exc: ValidationError) -> ApiError:
    """400 naming every offending field (``param``: the first), one message per field."""
    fields: dict[str, str] = {}
    for err in exc.errors(include_url=False):
        loc = err["loc"]
        name = str(loc[0]) if loc else "body"
        if name in fields:
            continue
        if name in _FIELD_HINTS and len(loc) > 1 and not isinstance(loc[1], int):
            fields[name] = _FIELD_HINTS[name]
        else:
            where = ".".join(str(x) for x in loc) or "body"
            fields[name] = err["msg"] if where == name else f"{err['msg']} (at '{where}')"
    message = "; ".join(f"field '{name}': {msg}" for name, msg in fields.items())
    return ApiError(400, message, next(iter(fields)))


async def read_json(request: web.Request, limit: int) -> Any:
    """The request's body as a JSON object; 413 past ``limit`` bytes (the app's ``client_max_size``), 400
    for anything that is not a JSON object."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"request body exceeds the limit of {limit} bytes") from None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", "body") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", "body")
    return body


# ---------------------------------------------------------------------------------------------- requests
class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool | None = False


class GenerationRequest(BaseModel):
    """Fields both generation routes take; unknown fields are ignored (as OpenAI SDK extras are by vLLM)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    n: int | None = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None
    ignore_eos: bool | None = False
    request_id: str | None = Field(default=None, min_length=1, max_length=256)


class ChatRequest(GenerationRequest):
    #: Empty only with prompt ids given (a render needs a message; :class:`ChatTemplate` says so).
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = False
    include_reasoning: bool | None = True
    structured_outputs: dict[str, Any] | None = None
    #: vLLM's; only ``prompt_token_ids`` means anything here (the prompt, given as ids).
    kv_transfer_params: dict[str, Any] | None = None
    #: vLLM's; not implemented, but, as there, it makes given prompt ids ignored.
    echo: bool | None = False


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False


@dataclass(frozen=True, slots=True)
class Plan:
    """A validated generation request: what to generate and how to shape the answer."""

    kind: Literal["chat", "completion", "generate"]
    prompts: list[list[int]]
    n: int
    params: SamplingParams
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool
    with_ids: bool
    logprobs: bool
    #: The caller's name for the request (vLLM's ``request_id``), if it gave one.
    request_id: str | None = None
    #: Chat answers: how the text is split into reasoning / content / tool calls (``None``: plain text).
    parse: ToolRequest | None = None
    #: One grammar per choice (``tool_choice`` "required" / named, ``structured_outputs``), or ``None``.
    constraints: tuple[TokenConstraint, ...] | None = None
    #: Decode without special tokens (parsing reads markup, so it keeps them).
    skip_special: bool = True
    #: The vLLM ``structured_outputs`` the constraints come from (render answers carry it).
    structured_outputs: dict[str, Any] | None = None


# ---------------------------------------------------------------------------------------------- planning
class RequestPlanner:
    """Validates requests for one served model into :class:`Plan` s; raises :class:`ApiError` (or pydantic's
    ``ValidationError``, see :func:`validation_error`) naming what was wrong. Holds no state of its own."""

    def __init__(
        self,
        *,
        served_model_name: str,
        max_model_len: int,
        vocab_size: int,
        codec: TokenCodec,
        chat_template: ChatTemplate,
        chat_parser: ChatParser,
        constraints: ConstraintCompiler,
    ) -> None:
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.codec = codec
        self.chat_template = chat_template
        self.chat_parser = chat_parser
        self.constraints = constraints

    # ------------------------------------------------------------------ checks
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise ApiError(
                404, f"The model `{model}` does not exist. Valid aliases: {self.served_model_name}.", "model"
            )

    def check_prompt_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise ApiError(400, f"field '{param}': the prompt is empty", param)
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ApiError(400, f"field '{param}': token ids must be in [0, {self.vocab_size})", param)

    def sampling(
        self,
        req: GenerationRequest,
        prompts: list[list[int]],
        max_tokens: int | None,
        top: int,
        *,
        fit: bool = False,
    ) -> SamplingParams:
        """Sampling parameters, after vLLM's context checks (400 naming ``max_tokens`` / ``input_tokens``).

        ``fit``: the prompt ids were given (not rendered), and vLLM then cuts ``max_tokens`` to what the
        context has left instead of refusing a request that asks for more.
        """
        limit = self.max_model_len
        if max_tokens is not None and max_tokens > limit:
            raise ApiError(
                400,
                f"max_tokens={max_tokens} cannot be greater than max_model_len={limit}. Please request fewer "
                f"output tokens. (parameter=max_tokens, value={max_tokens})",
                "max_tokens",
            )
        longest = max(len(p) for p in prompts)
        if fit:
            max_tokens = self._fitted(longest, max_tokens)
        elif longest >= limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your request has {longest} "
                f"input tokens. Please reduce the length of the input messages. "
                f"(parameter=input_tokens, value={longest})",
                "input_tokens",
            )
        elif max_tokens is not None and longest + max_tokens > limit:
            raise ApiError(
                400,
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
                f"context length is {limit} tokens and your request has {longest} input tokens "
                f"({max_tokens} > {limit} - {longest}). (parameter=max_tokens, value={max_tokens})",
                "max_tokens",
            )
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else limit - longest,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=bool(req.ignore_eos),
            top_logprobs=top,
        )

    def _fitted(self, length: int, max_tokens: int | None) -> int:
        """``max_tokens`` for given prompt ids of ``length``: at most what the context has left (vLLM's)."""
        limit = self.max_model_len
        if length > limit:
            raise ApiError(400, f"Input length ({length}) exceeds model's maximum context length ({limit}).")
        room = limit - length
        if room == 0:
            raise ApiError(
                400, "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)", "max_tokens"
            )
        return room if max_tokens is None else min(max_tokens, room)

    def check_tools(self, req: ChatRequest) -> None:
        """vLLM's checks of ``tools`` / ``tool_choice`` (its messages), plus: tools need a tool parser."""
        if req.tools == []:
            raise ApiError(
                400,
                "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
                "tools",
            )
        choice = req.tool_choice
        if choice is None or choice == "none":
            return
        if not req.tools:
            raise ApiError(400, "When using `tool_choice`, `tools` must be set.", "tool_choice")
        if isinstance(choice, str) and choice not in ("auto", "required"):
            raise ApiError(
                400,
                f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or "required" '
                "are supported.",
                "tool_choice",
            )
        if isinstance(choice, dict):
            function = choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            if not isinstance(name, str) or not name:
                raise ApiError(
                    400,
                    'field \'tool_choice\': expected {"type": "function", "function": {"name": "my_function"}}',
                    "tool_choice",
                )
            names = [t.get("function", {}).get("name") for t in req.tools if isinstance(t, dict)]
            if name not in names:
                raise ApiError(
                    400,
                    f"The tool specified in `tool_choice` ({name!r}) does not match any of the specified `tools`",
                    "tool_choice",
                )
        if self.chat_parser.tool_parser is None and self.chat_template.supports_tools:
            raise ApiError(
                400,
                f"field 'tool_choice': {choice!r} needs a tool-call parser, and this server has none "
                '(start it with tool_parser="hermes")',
                "tool_choice",
            )

    # ------------------------------------------------------------------ chat
    def chat(self, body: Any) -> Plan:
        """A ``/v1/chat/completions`` body's plan (constraints not compiled yet: :meth:`with_constraints`)."""
        req = ChatRequest.model_validate(body)
        self.check_model(req.model)
        if req.top_logprobs and not req.logprobs:
            raise ApiError(400, "field 'top_logprobs': requires 'logprobs' to be true", "top_logprobs")
        self.check_tools(req)
        given = self.given_prompt_ids(req)
        prompt = self.chat_prompt(req) if given is None else given
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top = (req.top_logprobs or 0) if req.logprobs else 0
        params = self.sampling(req, [prompt], max_tokens, top, fit=given is not None)
        plan = self.plan("chat", req, [prompt], params, bool(req.logprobs))
        parse = ToolRequest.from_request(
            req.model_dump(include={"tools", "tool_choice", "chat_template_kwargs", "include_reasoning"})
        )
        uses_parser = self.chat_parser.reasoning_parser is not None or (
            self.chat_parser.tool_parser is not None and parse.has_tools and parse.tool_choice != "none"
        )
        structured = req.structured_outputs
        if parse.forced:
            tag = hermes_structural_tag(
                req.tools or [], req.tool_choice, parallel_tool_calls=req.parallel_tool_calls
            )
            structured = _structured_outputs(tag)
        return dataclasses.replace(
            plan,
            parse=parse if uses_parser else None,  # a request the parsers have nothing to do with: plain text
            skip_special=not uses_parser,
            structured_outputs=structured,
        )

    def chat_prompt(self, req: ChatRequest) -> list[int]:
        """The request's prompt ids through the chat template (400 naming the field on bad input)."""
        try:
            return self.chat_template.render(req.messages, tools=req.tools, **self._template_options(req))
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), exc.param) from None

    def given_prompt_ids(self, req: ChatRequest) -> list[int] | None:
        """The prompt ids the request brings in ``kv_transfer_params.prompt_token_ids``, checked as vLLM checks
        them, with its ``messages`` and ``tools`` validated as for a render; ``None`` when it brings none, or
        when vLLM would render anyway (``echo``, a non-text message part)."""
        ids = (req.kv_transfer_params or {}).get("prompt_token_ids")
        if ids is None or req.echo or _has_non_text_part(req.messages):
            return None
        if not isinstance(ids, list) or not ids or any(type(x) is not int or x < 0 for x in ids):
            raise ApiError(
                400,
                "`kv_transfer_params['prompt_token_ids']` must be a non-empty list of non-negative integers. "
                f"(parameter={PROMPT_IDS_PARAM})",
                PROMPT_IDS_PARAM,
            )
        if (top := max(ids)) >= self.vocab_size:
            raise ApiError(
                400, f"Token id {top} is out of vocabulary (parameter={PROMPT_IDS_PARAM})", PROMPT_IDS_PARAM
            )
        try:
            self.chat_template.check(req.messages, tools=req.tools, **self._template_options(req))
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), exc.param) from None
        return ids

    @staticmethod
    def _template_options(req: ChatRequest) -> dict[str, Any]:
        add_generation_prompt = req.add_generation_prompt
        if add_generation_prompt is None:  # vLLM's default, unless the last message is to be continued
            add_generation_prompt = not req.continue_final_message
        return {
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": bool(req.continue_final_message),
            "chat_template_kwargs": req.chat_template_kwargs,
        }

    async def with_constraints(self, plan: Plan) -> Plan:
        """The plan with one compiled grammar per choice when it asks for one (compiled in a worker thread)."""
        if not plan.structured_outputs:
            return plan
        gate = None
        think = self.chat_parser.think_ids
        if think is not None and plan.parse is not None and plan.parse.thinking:
            gate = think[1]  # vLLM constrains only after the reasoning ends
            if any(reasoning_closed(think, p) for p in plan.prompts):
                gate = None
        count = len(plan.prompts) * plan.n

        def compile_all() -> tuple[TokenConstraint, ...] | None:
            first = self.constraints.constraint(plan.structured_outputs or {}, gate)
            if first is None:
                return None
            rest = [
                self.constraints.constraint(plan.structured_outputs or {}, gate) for _ in range(count - 1)
            ]
            return (first, *[c for c in rest if c is not None])

        try:
            constraints = await anyio.to_thread.run_sync(compile_all)
        except ConstraintError as exc:
            raise ApiError(400, str(exc), exc.param) from None
        return dataclasses.replace(plan, constraints=constraints)

    # ------------------------------------------------------------------ completions and in-process
    def completion(self, body: Any) -> Plan:
        """A ``/v1/completions`` body's plan."""
        req = CompletionRequest.model_validate(body)
        self.check_model(req.model)
        if req.echo:
            raise ApiError(400, "field 'echo': echoing the prompt is not supported", "echo")
        prompts = self._completion_prompts(req.prompt)
        params = self.sampling(req, prompts, req.max_tokens, req.logprobs or 0)
        return self.plan("completion", req, prompts, params, req.logprobs is not None)

    def _completion_prompts(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[list[int]]:
        if isinstance(prompt, str):
            items: list[str | list[int]] = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [prompt]  # type: ignore[list-item]
        else:
            items = list(prompt)  # type: ignore[arg-type]
        if not items:
            raise ApiError(400, "field 'prompt': the prompt is empty", "prompt")
        out = []
        for item in items:
            ids = self.codec.encode(item, special=True) if isinstance(item, str) else list(item)
            self.check_prompt_ids(ids, "prompt")
            out.append(ids)
        return out

    def ids(self, prompt: list[int], sampling: dict[str, Any]) -> Plan:
        """The plan of an in-process generation from ids (``InferenceServer.generate_ids``); ``ValueError``."""
        for key, neutral in _NEUTRAL_SAMPLING.items():
            if sampling.pop(key, None) not in neutral:
                raise ValueError(f"sampling parameter {key!r} is not supported (only its neutral value)")
        want_logprobs = bool(sampling.pop("logprobs", False))
        known = {"temperature", "top_p", "max_tokens", "seed", "stop_token_ids", "ignore_eos"}
        if unknown := sorted(set(sampling) - known):
            raise ValueError(f"unknown sampling parameters {unknown}")
        try:
            req = GenerationRequest.model_validate(sampling)
            self.check_prompt_ids(prompt, "prompt_ids")
            params = self.sampling(req, [prompt], req.max_tokens, 0)
        except ValidationError as exc:
            raise ValueError(validation_error(exc).message) from None
        except ApiError as exc:
            raise ValueError(exc.message) from None
        return Plan("completion", [prompt], 1, params, (), False, False, True, want_logprobs)

    def plan(
        self,
        kind: Literal["chat", "completion", "generate"],
        req: GenerationRequest,
        prompts: list[list[int]],
        params: SamplingParams,
        logprobs: bool,
    ) -> Plan:
        """The plan's common fields from a validated request."""
        stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        return Plan(
            kind=kind,
            prompts=prompts,
            n=req.n or 1,
            params=params,
            stops=tuple(s for s in stops if s),
            stream=bool(req.stream),
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            with_ids=req.return_token_ids is True,
            logprobs=logprobs,
            request_id=req.request_id,
        )


# ---------------------------------------------------------------------------------------------- helpers
def reasoning_closed(think_ids: tuple[int, int], prompt: Sequence[int]) -> bool:
    """Whether the prompt's last think marker (``<think>`` / ``</think>`` ids) closes reasoning."""
    start, end = think_ids
    for token in reversed(prompt):
        if token in (start, end):
            return token == end
    return False


def _structured_outputs(structural_tag: str | None) -> dict[str, Any] | None:
    """vLLM's ``StructuredOutputsParams`` dump carrying a structural tag (``None``: nothing constrained)."""
    if structural_tag is None:
        return None
    fields = ("json", "regex", "choice", "grammar", "json_object")
    out: dict[str, Any] = dict.fromkeys(fields)
    out |= {
        "disable_any_whitespace": False,
        "disable_additional_properties": False,
        "whitespace_pattern": None,
    }
    out |= {"structural_tag": structural_tag, "_backend": None, "_backend_was_auto": False}
    return out


def _has_non_text_part(messages: Sequence[Any]) -> bool:
    """Whether a message's content holds a part that is not text (an image, audio...), as vLLM decides it."""
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, Mapping):
                continue
            kind = part.get("type", "text")
            if (
                not isinstance(kind, str)
                or kind not in TEXT_PART_TYPES
                or any(key in part for key in MEDIA_PART_KEYS)
            ):
                return True
    return False
