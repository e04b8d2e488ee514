"""An OpenAI-compatible, vLLM-shaped inference server over a Hugging Face causal LM, for CPUs and tests.

:class:`InferenceServer` answers the routes agents and the proxy use, shaped exactly like vLLM's answers with
``"return_token_ids": true`` (recorded examples: ``tests/fixtures/vllm/``):

- ``POST /v1/chat/completions`` — top-level ``prompt_token_ids``, ``choices[i].token_ids``; streamed, a first
  chunk per choice with an empty ``role`` delta and ``prompt_token_ids``, then one chunk per token with that
  token's ``token_ids`` (``n > 1`` interleaves by ``index``), ``stream_options.include_usage``, ``[DONE]``.
- ``POST /v1/completions`` — a text prompt, a token-id prompt, or a list of either; ``prompt_token_ids`` inside
  each choice (streamed: in each choice's first chunk).
- ``GET /v1/models``, ``GET /health`` (JSON: weight version, sleep state, counters), ``GET /metrics``.

Token ids are sent only when the request says ``return_token_ids: true`` (the fields are ``null``
otherwise), as vLLM does. A sequence that ends on EOS keeps the EOS id in ``token_ids`` (and its log-prob) but
not in the text; a stop string truncates the text, the ids keep the token that completed it. Log-probs are
``log_softmax(logits / temperature)`` of the sampled token, what verl's actor recomputes (see
:mod:`aglverl.engine.generation`). Errors are ``{"error": {"message", "type", "param", "code"}}``: 400 for malformed
JSON, wrong types or values (``param`` names the field) and requests longer than the context, 404 for an
unknown model (vLLM's message).

Generation: a continuous-batching engine on its own thread (:class:`aglverl.engine.generation.Engine`); concurrent
requests and the ``n`` choices of one request share forward passes. Weights are swapped between generations
by :meth:`InferenceServer.load_weights` (from any thread); :meth:`~InferenceServer.sleep` /
:meth:`~InferenceServer.wake_up` park the engine (requests wait rather than fail).

Weight version: every generation answer carries the header ``X-Weight-Version``, the version of the weights
its tokens were generated under (recorded by the engine when the sequence started, so a swap racing the
request cannot mislead it; for a stream the header goes out with the first tokens, once every choice has
started). A request body may name itself with ``request_id`` (vLLM's field); the answer's ``id`` is then
``cmpl-<request_id>`` / ``chatcmpl-<request_id>``.

Abort (verl's partial rollouts): :meth:`~InferenceServer.abort` ends every queued and running generation
at once with ``finish_reason: "abort"`` and the ids generated so far (JSON and streams alike, as vLLM's
OpenAI server does), so a client can resume from ``prompt + ids`` (each choice's text is decoded from the
prompt's last ids on, as vLLM's detokenizer is primed, so the resumed text completes a character the aborted
one ended inside: the aborted text's trailing U+FFFD are those bytes); new requests then wait for
:meth:`~InferenceServer.resume`, or with ``reject=True`` are answered at once as aborted with no tokens.

Use ``async with InferenceServer("tiny") as server:`` or ``await tg.start(server.serve)`` on an asyncio loop,
or :class:`InferenceServerThread` to host it on a thread of its own (inside a process whose loop is not ours).
Constructing the server loads the model: a blocking call of a few seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import anyio
import orjson
import torch
from aiohttp import web
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .. import __version__
from .._net import bind_listener, url_of
from .chat_parser import ChatParser, ParsedMessage, ParseSession, ToolRequest
from .chat_template import ChatTemplate, ChatTemplateError
from .constrained import ConstraintCompiler, ConstraintError, TokenConstraint, hermes_structural_tag
from .generation import THREAD_NAME as ENGINE_THREAD_NAME
from .generation import Engine, GenSequence, SamplingParams
from .tiny import TINY_NAME, quiet_progress_bars, resolve_model
from .token_routes import (
    NEUTRAL_SAMPLING,
    DerenderRequest,
    GenerateRequest,
    derender_state,
    generate_logprobs,
    render_sampling_params,
    weight_versions,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "ENGINE_THREAD_NAME",
    "LOOP_THREAD_NAME",
    "WEIGHT_VERSION_HEADER",
    "InferenceServer",
    "InferenceServerThread",
    "InferenceStats",
    "SamplingParams",
]

logger = logging.getLogger(__name__)

#: Name of :class:`InferenceServerThread`'s event-loop thread.
LOOP_THREAD_NAME = "aglverl-inference-loop"
#: Largest ``n`` accepted (each choice is a row of the running batch).
MAX_N = 128
#: Largest ``top_logprobs`` / completions ``logprobs`` accepted (OpenAI's limit).
MAX_TOP_LOGPROBS = 20
#: vLLM runs on uvicorn, whose idle keep-alive is 5 s; the proxy's pool is tuned to close before that.
KEEPALIVE_SECONDS = 5.0
#: Response header with the weight version a generation answer's tokens came from.
WEIGHT_VERSION_HEADER = "X-Weight-Version"
#: Prompt ids the detokenizer of each choice starts from (vLLM primes its own with the prompt's last ids): a
#: UTF-8 character is at most 4 bytes, so this covers one split across the prompt/output boundary twice over.
DETOKENIZER_LEAD = 8
#: How long stopping lets in-flight requests finish before cancelling them.
SHUTDOWN_GRACE = 1.0
#: Keys of ``generate_ids`` sampling dicts (verl's) that are accepted only at their neutral value.
_NEUTRAL_SAMPLING = {"top_k": (-1, 0, None), "repetition_penalty": (1.0, None), "min_p": (0.0, None)}
_SSE_TYPE = "text/event-stream; charset=utf-8"
_DONE = b"data: [DONE]\n\n"
_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


# ---------------------------------------------------------------------------------------------- errors
class _ApiError(Exception):
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


def _validation_error(exc: ValidationError) -> _ApiError:
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
    return _ApiError(400, message, next(iter(fields)))


# ---------------------------------------------------------------------------------------------- requests
class _StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool | None = False


class _Request(BaseModel):
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
    stream_options: _StreamOptions | None = None
    return_token_ids: bool | None = None
    ignore_eos: bool | None = False
    request_id: str | None = Field(default=None, min_length=1, max_length=256)


class _ChatRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
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


class _CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False


@dataclass(frozen=True, slots=True)
class _Plan:
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


# ---------------------------------------------------------------------------------------------- results
@dataclass(slots=True)
class _Delta:
    """What one choice gained since its last delta."""

    ids: list[int]
    logprobs: list[float]
    tops: list[list[tuple[int, float]]]
    text: str
    finish_reason: str | None
    #: The choice's first delta (completions streams send ``prompt_token_ids`` in it).
    first: bool
    #: Where ``text`` starts in the choice's text (completions logprobs' ``text_offset``).
    offset: int


class _Choice:
    """One choice of a request on the owner's loop: turns the engine's tokens into text and deltas.

    Incremental choices (streams, stop strings) detokenize token by token, look for stop strings in the
    new text (a match truncates the text, finishes the choice and aborts the engine sequence) and, while
    stop strings are possible, hold back the last ``longest stop - 1`` characters of a stream so a stop
    string is never half sent.
    """

    def __init__(
        self, job: _Job, index: int, prompt: list[int], seq: GenSequence, session: ParseSession | None = None
    ) -> None:
        self.job, self.index, self.prompt, self.seq = job, index, prompt, seq
        #: The choice's parse (chat with a tool / reasoning parser), shared by its body or its chunks.
        self.session = session
        skip = job.plan.skip_special
        self.decode: Callable[[Sequence[int]], str] = lambda ids: job.server._decode(ids, skip)
        self.consumed = 0
        self.text = ""
        self.sent = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.counted = False  # the job has counted this choice as finished
        self._parsed: ParsedMessage | None = None
        # Detokenization starts from the prompt's last ids, as vLLM's does: a generation resumed from prompt +
        # the ids of an aborted one then renders a character split across that boundary whole. The window
        # counts in "lead + output" positions: ids[_prefix:_read] is already text.
        self._lead, self._read = _lead_of(self.decode, prompt)
        self._lead_text = self.decode(self._lead[: self._read])
        self._prefix = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.seq.error is not None

    def message(self) -> tuple[dict[str, Any], str | None]:
        """The whole answer's assistant message (vLLM's key order) and its chat ``finish_reason``."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text, "refusal": None, "annotations": None}
        message |= {"audio": None, "function_call": None}
        if self.session is None:
            return message | {"reasoning": None}, self.finish_reason
        if self._parsed is None:
            self._parsed = self.session.parse(self.text)
        parsed = self._parsed
        message["content"] = parsed.content
        if parsed.tool_calls:
            message["tool_calls"] = [call.to_json() for call in parsed.tool_calls]
        message["reasoning"] = parsed.reasoning
        return message, self.session.finish_reason(parsed, self.finish_reason)

    def delta(self, d: _Delta) -> tuple[dict[str, Any] | None, str | None]:
        """A streamed delta's JSON (``None``: the parser has nothing to send yet) and its chat finish reason."""
        if self.session is None:
            return {"content": d.text}, d.finish_reason
        message = self.session.delta(d.text, d.ids, finished=d.finish_reason is not None)
        finish = self.session.finish_reason(self.session.tools_streamed, d.finish_reason)
        return (message.to_json() if message is not None else None), finish

    def take(self, count: int) -> _Delta | None:
        """Process tokens up to ``count`` (the engine's notified length); ``None`` if nothing is new."""
        if self.done:
            return None  # finished by a stop string already; later tokens are not ours
        seq = self.seq
        start = self.consumed
        final = seq.finished and count == len(seq.token_ids)
        # An EOS or stop token ends the sequence and stays in its ids, but is no text (as in vLLM).
        text_end = count - 1 if final and seq.finish_reason == "stop" else count
        end = self._scan(start, text_end) if seq.incremental else text_end
        if self.finish_reason is None:  # no stop string matched
            end = count
            if final:
                self.finish_reason, self.stop_reason = seq.finish_reason, seq.stop_reason
                self._final_text(text_end)
        self.consumed = end
        hold = 0 if self.finish_reason is not None else self.job.holdback
        offset = self.sent
        text = self.text[offset : max(offset, len(self.text) - hold)]
        self.sent += len(text)
        return _Delta(
            seq.token_ids[start:end],
            seq.logprobs[start:end],
            seq.top_logprobs[start:end] if seq.params.top_logprobs else [],
            text,
            self.finish_reason,
            start == 0,
            offset,
        )

    def _scan(self, start: int, count: int) -> int:
        """Detokenize ``[start, count)`` one token at a time; stops at a stop string. Returns the new end."""
        stops = self.job.plan.stops
        for i in range(start, count):
            before = len(self.text)
            self.text += self._piece(i + 1)
            if stops and (hit := self._find_stop(before)) is not None:
                cut, stop = hit
                self.text = self.text[:cut]
                self.finish_reason, self.stop_reason = "stop", stop
                self.seq.cancelled = True
                return i + 1
        return count

    def _piece(self, upto: int) -> str:
        """New text once token ``upto - 1`` is added (empty while it ends inside a UTF-8 character)."""
        decode = self.decode
        upto += len(self._lead)
        prefix = decode(self._ids(self._prefix, self._read))
        full = decode(self._ids(self._prefix, upto))
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix, self._read = self._read, upto
            return full[len(prefix) :]
        return ""

    def _ids(self, start: int, end: int) -> list[int]:
        """Ids ``[start, end)`` of the lead followed by the output."""
        lead, n = self._lead, len(self._lead)
        if start >= n:
            return self.seq.token_ids[start - n : end - n]
        return lead[start:end] + self.seq.token_ids[: max(0, end - n)]

    def _find_stop(self, before: int) -> tuple[int, str] | None:
        """The earliest stop string that ends in the text added after ``before``."""
        best: tuple[int, str] | None = None
        for stop in self.job.plan.stops:
            at = self.text.find(stop, max(0, before - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        return best

    def _final_text(self, text_end: int) -> None:
        decode = self.decode
        full = decode(self._ids(0, len(self._lead) + text_end))
        if full.startswith(self._lead_text):
            full = full[len(self._lead_text) :]
        else:  # a tokenizer whose decode is not additive; the output alone is the best reading then
            full = decode(self.seq.token_ids[:text_end])
        if not self.seq.incremental or full.startswith(self.text):
            self.text = full  # flushes characters an incremental decode was still holding back


def _lead_of(decode: Callable[[Sequence[int]], str], prompt: Sequence[int]) -> tuple[list[int], int]:
    """The prompt ids a choice's detokenizer starts from, and how many of them are text already.

    The last ``DETOKENIZER_LEAD`` prompt ids; those at the end that render as U+FFFD (bytes of a character the
    output may complete, like the ids of an aborted generation a resumed one is prompted with) are read
    again with the output, which is what vLLM's incremental detokenizer does with the prompt it is primed with.
    """
    lead = list(prompt[-DETOKENIZER_LEAD:])
    read = len(lead)
    while read and decode(lead[:read]).endswith("\ufffd"):
        read -= 1
    return lead, read


class _Job:
    """One request in flight: its choices, and how their news reaches whoever awaits it.

    Streams get every delta through an unbounded memory stream (one item per choice per step); others wait
    for :attr:`done`. :meth:`cancel` tells the engine to drop the request's sequences (client gone).
    """

    def __init__(
        self, server: InferenceServer, plan: _Plan, outputs: Sequence[GenSequence] | None = None
    ) -> None:
        self.server = server
        self.plan = plan
        self.id = _request_id(plan.kind, plan.request_id)
        self.created = int(time.time())
        self.done = anyio.Event()
        self.choices: list[_Choice] = []
        self.holdback = max((len(s) for s in plan.stops), default=1) - 1 if plan.stream else 0
        self._left = 0
        self.cancelled = False
        self._send: MemoryObjectSendStream[tuple[_Choice, _Delta]] | None = None
        self.updates: MemoryObjectReceiveStream[tuple[_Choice, _Delta]] | None = None
        if plan.stream:
            self._send, self.updates = anyio.create_memory_object_stream[tuple[_Choice, _Delta]](float("inf"))
        loop = asyncio.get_running_loop()
        parser = server.chat_parser
        for p, prompt in enumerate(plan.prompts):
            for j in range(plan.n):
                k = p * plan.n + j
                if outputs is not None:  # a derender: the tokens exist already, nothing is generated
                    session = parser.session(plan.parse, prompt) if plan.parse is not None else None
                    self.choices.append(_Choice(self, k, prompt, outputs[k], session))
                    continue
                seq = GenSequence(
                    prompt,
                    plan.params,
                    loop=loop,
                    notify=self._notify,
                    incremental=plan.stream or bool(plan.stops),
                    choice=j,
                    request_id=self.id,
                    constraint=plan.constraints[k] if plan.constraints else None,
                )
                session = parser.session(plan.parse, prompt) if plan.parse is not None else None
                self.choices.append(_Choice(self, k, prompt, seq, session))
        self._by_seq = {id(c.seq): c for c in self.choices}
        self._left = len(self.choices)

    @property
    def error(self) -> BaseException | None:
        return next((c.seq.error for c in self.choices if c.seq.error is not None), None)

    @property
    def weight_version(self) -> int:
        """The oldest weight version any choice started under (the current one if none started)."""
        versions = [c.seq.weight_version for c in self.choices if c.seq.weight_version is not None]
        return min(versions) if versions else self.server.weight_version

    def _notify(self, seq: GenSequence, count: int) -> None:
        if self.cancelled:
            return  # news the engine sent before it saw the cancellation
        choice = self._by_seq[id(seq)]
        delta = choice.take(count)
        if delta is not None and self._send is not None:
            self._send.send_nowait((choice, delta))
        if choice.done and not choice.counted:
            choice.counted = True
            self._left -= 1
            if self._left == 0:
                self.done.set()
                if self._send is not None:
                    self._send.close()

    def cancel(self) -> None:
        """Drop the request's sequences from the engine (at its next step); no more news is taken."""
        self.cancelled = True
        for choice in self.choices:
            choice.seq.cancelled = True
        if self._send is not None:
            self._send.close()

    def usage(self, details: bool) -> dict[str, Any]:
        prompt = sum(len(p) for p in self.plan.prompts)
        completion = sum(len(c.seq.token_ids[: c.consumed]) for c in self.choices)
        usage: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion}
        usage["completion_tokens"] = completion
        if details:
            usage |= {"prompt_tokens_details": None, "completion_tokens_details": None}
        return usage


# ---------------------------------------------------------------------------------------------- statistics
@dataclass(frozen=True, slots=True)
class InferenceStats:
    """A snapshot of the server's counters (see :class:`aglverl.engine.generation.EngineStats` for the engine's)."""

    weight_version: int
    weight_loads: int
    sleeping: bool
    sleep_calls: int
    wake_up_calls: int
    requests: int
    rejected_requests: int
    #: :meth:`InferenceServer.abort` closed admission (until :meth:`InferenceServer.resume`).
    generation_paused: bool
    abort_calls: int
    #: Sequences ended by an abort, or refused while an abort rejects new requests.
    aborted_sequences: int
    pending_sequences: int
    generation_runs: int
    prefill_batches: int
    decode_steps: int
    sequences: int
    prompt_tokens: int
    generated_tokens: int
    largest_batch: int
    busy_seconds: float
    failures: int


# ---------------------------------------------------------------------------------------------- server
class InferenceServer:
    """OpenAI-compatible server over one causal LM; see the module docstring. Keyword-only after ``model``.

    - ``model``: ``"tiny"`` (the built-in model, :mod:`aglverl.engine.tiny`), a local Hugging Face directory, or an
      already loaded ``PreTrainedModel`` (then ``tokenizer`` is required). Nothing is ever downloaded.
    - ``tokenizer``: a directory or a loaded tokenizer; default: the model's directory.
    - ``served_model_name``: the name requests must use (default: ``model`` as given, like ``vllm serve``).
    - ``host``/``port``: where to listen (``127.0.0.1``; port 0 picks a free one, see :attr:`url`).
    - ``max_batch_size``: rows (choices) generated together; ``batch_wait``: how long an idle engine waits
      for concurrent requests to join the first forward pass.
    - ``max_model_len``: context length (default: the config's ``max_position_embeddings``).
    - ``weight_version``: the version of the weights loaded now. ``seed``: seeds unseeded sampling.
    - ``torch_threads``: if set, ``torch.set_num_threads`` (process-wide) at construction.
    - ``dtype``: the dtype to load the weights in (``"auto"``: the checkpoint's).
    - ``tool_parser``: how tool calls are read out of generated text: ``"hermes"`` (``<tool_call>`` JSON
      blocks, vLLM's parser of that name), ``None`` (requests with ``tools`` are refused), or ``"auto"``
      (default): ``"hermes"`` when the chat template renders ``tools`` in the Hermes / Qwen style (it mentions
      ``<tool_call>``), else ``None``. A template with no tool section always refuses ``tools`` (400).
    - ``reasoning_parser``: ``"qwen3"`` / ``"deepseek_r1"`` (``<think>...</think>`` split into ``reasoning``,
      vLLM's parsers of those names; needs the markers to be single tokens), ``None``, or ``"auto"`` (default):
      ``"qwen3"`` when the template mentions ``<think>`` and the tokenizer has the markers, else ``None``. The
      built-in tiny model gets ``hermes`` and no reasoning parser.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | PreTrainedModel = TINY_NAME,
        *,
        tokenizer: str | os.PathLike[str] | PreTrainedTokenizerBase | None = None,
        served_model_name: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_batch_size: int = 64,
        batch_wait: float = 0.002,
        max_model_len: int | None = None,
        weight_version: int = 0,
        seed: int | None = None,
        torch_threads: int | None = None,
        dtype: str | torch.dtype = "auto",
        max_body_bytes: int = 32 << 20,
        tool_parser: str | None = "auto",
        reasoning_parser: str | None = "auto",
    ) -> None:
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        self.model, self.tokenizer, self.model_path = _load(model, tokenizer, dtype)
        self.served_model_name = served_model_name or (
            str(model)
            if isinstance(model, (str, os.PathLike))
            else str(self.model.config.name_or_path or "model")
        )
        config = self.model.config
        self.vocab_size: int = int(config.vocab_size)
        self.max_model_len: int = max_model_len or int(
            getattr(config, "max_position_embeddings", None) or 2048
        )
        self.host, self.port, self.max_body_bytes = host, port, max_body_bytes
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        self._backend = backend
        eos = _eos_ids(self.model, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.engine = Engine(
            self.model,
            eos_token_ids=eos,
            pad_token_id=pad if pad is not None else 0,
            max_batch_size=max_batch_size,
            batch_wait=batch_wait,
            seed=seed,
            weight_version=weight_version,
        )
        #: The chat template as a renderer (``/v1/chat/completions`` and ``.../render`` share it).
        self.chat_template = ChatTemplate(self.tokenizer, lambda text: self._encode(text, special=False))
        vocab = self.tokenizer.get_vocab()
        self.chat_parser = ChatParser(
            tool_parser=_default_tool_parser(self.chat_template) if tool_parser == "auto" else tool_parser,
            reasoning_parser=(
                _default_reasoning_parser(self.chat_template, vocab) if reasoning_parser == "auto" else reasoning_parser
            ),
            vocab=vocab,
        )
        self.constraints = ConstraintCompiler(self.tokenizer, self.vocab_size, eos)
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        self._weights_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._sleeping = False
        self._counts = {"sleep": 0, "wake_up": 0, "weight_loads": 0, "requests": 0, "rejected": 0, "abort": 0}
        self._token_texts: dict[int, str] = {}
        self._url: str | None = None
        self._serving = False
        self._stack: AsyncExitStack | None = None
        self._handlers: set[asyncio.Task[Any]] = set()  # generation requests being answered

    # ------------------------------------------------------------------ properties
    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` (no ``/v1``) once serving."""
        if self._url is None:
            raise RuntimeError("the inference server is not serving")
        return self._url

    @property
    def weight_version(self) -> int:
        """The version of the weights served now (answers report the version they ran under)."""
        return self.engine.weight_version

    @property
    def sleeping(self) -> bool:
        return self._sleeping

    def stats(self) -> InferenceStats:
        """The counters now (readable from any thread)."""
        e = self.engine.stats
        c = self._counts
        return InferenceStats(
            weight_version=self.engine.weight_version,
            weight_loads=c["weight_loads"],
            sleeping=self._sleeping,
            sleep_calls=c["sleep"],
            wake_up_calls=c["wake_up"],
            requests=c["requests"],
            rejected_requests=c["rejected"],
            generation_paused=self.engine.paused,
            abort_calls=c["abort"],
            aborted_sequences=e.aborted_sequences,
            pending_sequences=self.engine.pending,
            generation_runs=e.generation_runs,
            prefill_batches=e.prefill_batches,
            decode_steps=e.decode_steps,
            sequences=e.sequences,
            prompt_tokens=e.prompt_tokens,
            generated_tokens=e.generated_tokens,
            largest_batch=e.largest_batch,
            busy_seconds=e.busy_seconds,
            failures=e.failures,
        )

    # ------------------------------------------------------------------ weights and sleep (any thread)
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """Copy full tensors (Hugging Face parameter names) into the model; returns how many were copied.

        Blocking and thread-safe: waits for the running generation to finish (new requests wait meanwhile),
        copies between generations, never mid-batch, then serves ``version``. Tied weights may come under
        both names (``model.embed_tokens.weight`` and ``lm_head.weight``). Concurrent calls run one at a time.
        Raises ``KeyError`` for an unknown name and ``ValueError`` for a shape mismatch; tensors before the bad
        one are already copied then, and the version is not changed. Calling it on the server's own event
        loop blocks that loop: use :meth:`update_weights` there.
        """
        with self._weights_lock, self.engine.idle():
            count = 0
            with torch.no_grad():
                for name, tensor in named_tensors:
                    self._copy_param(name, tensor)
                    count += 1
            self.engine.weight_version = version  # the engine is idle: no sequence can start meanwhile
            self._counts["weight_loads"] += 1
        logger.info("loaded %d tensors, serving weight version %d", count, version)
        return count

    def _copy_param(self, name: str, tensor: torch.Tensor) -> None:
        target = self._params.get(name)
        if target is None and name.startswith("module."):
            target = self._params.get(name.removeprefix("module."))
        if target is None:
            raise KeyError(
                f"unknown parameter {name!r} (expected Hugging Face names such as {next(iter(self._params))!r})"
            )
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"parameter {name!r} has shape {tuple(target.shape)}, got {tuple(tensor.shape)}")
        target.data.copy_(tensor)

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """:meth:`load_weights` in a worker thread; the loop keeps serving (new requests wait for the swap).

        Cancelling the await does not interrupt the copy: it is deferred until the load is complete.
        """
        return await anyio.to_thread.run_sync(self.load_weights, named_tensors, version)

    def sleep(self, level: int = 1) -> None:
        """Park the engine (vLLM's ``sleep``): blocks until the running generation finishes; thread-safe.

        On CPU there is no KV cache pool to free, so this records the state; requests that arrive meanwhile
        wait for :meth:`wake_up` instead of failing, and :meth:`load_weights` still works. ``level`` is
        accepted for vLLM compatibility. Repeated calls are counted and otherwise no-ops.
        """
        with self._state_lock:
            self._counts["sleep"] += 1
            if self._sleeping:
                return
            self.engine.hold()
            self._sleeping = True

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Resume generation after :meth:`sleep` (waiting requests start); thread-safe, counted, idempotent."""
        with self._state_lock:
            self._counts["wake_up"] += 1
            if not self._sleeping:
                return
            self._sleeping = False
            self.engine.release()

    def abort(self, *, reject: bool = False) -> list[str]:
        """End every queued and running generation now; returns the ids of the requests it ended (any thread).

        vLLM's ``abort_all_requests``: each ended choice answers with ``finish_reason`` ``"abort"`` and the ids
        generated so far (requests waiting at a sleeping server end too). Admission then stays closed until
        :meth:`resume`: new requests wait (``reject=False``) or are answered at once as aborted with no tokens
        (``reject=True``; each call re-declares it). Blocks for at most one decode step (the running batch is
        cut at the next step boundary), so calling it on the server's own loop stalls that loop that long.
        Request ids are the answers' ``id`` (``cmpl-...`` / ``chatcmpl-...``), in the order they were ended.
        """
        with self._state_lock:
            self._counts["abort"] += 1
        ended = self.engine.abort(reject=reject)
        return list(dict.fromkeys(seq.request_id for seq in ended))

    def resume(self) -> None:
        """Open admission after :meth:`abort` (vLLM's ``resume_generation``): waiting requests start.

        Thread-safe and idempotent; it does not wake a sleeping server (:meth:`wake_up` does).
        """
        self.engine.resume()

    @property
    def paused(self) -> bool:
        """Whether :meth:`abort` closed admission (until :meth:`resume`)."""
        return self.engine.paused

    # ------------------------------------------------------------------ in-process generation
    async def generate_ids(
        self, prompt_ids: Sequence[int], sampling: Mapping[str, Any] | None = None
    ) -> tuple[list[int], list[float] | None, str]:
        """Generate from token ids through the same batcher: ``(token_ids, logprobs or None, finish_reason)``.

        ``sampling`` takes ``temperature``, ``top_p``, ``max_tokens`` (default: the rest of the context),
        ``seed``, ``stop_token_ids``, ``ignore_eos`` and ``logprobs`` (truthy: return the log-probs); verl's
        ``top_k``/``repetition_penalty``/``min_p`` are accepted at their neutral values. Callable from any
        asyncio loop in any thread while the server is serving (results are delivered to the caller's loop).
        An :meth:`abort` ends it with ``finish_reason`` ``"abort"`` and the ids generated so far.
        Raises ``ValueError`` for bad input, ``RuntimeError`` if the server stops or generation fails; if
        the caller is cancelled the sequence is dropped from the batch.
        """
        plan = self._ids_plan(list(prompt_ids), dict(sampling or {}))
        job = _Job(self, plan)
        self._counts["requests"] += 1
        try:
            self.engine.submit([c.seq for c in job.choices])
            await job.done.wait()
        finally:
            if not job.done.is_set():
                job.cancel()
        choice = job.choices[0]
        if choice.seq.error is not None:
            raise RuntimeError(f"generation failed: {choice.seq.error}") from choice.seq.error
        ids = choice.seq.token_ids[: choice.consumed]
        logprobs = choice.seq.logprobs[: choice.consumed] if plan.logprobs else None
        return ids, logprobs, choice.finish_reason or "length"

    def _ids_plan(self, prompt: list[int], sampling: dict[str, Any]) -> _Plan:
        for key, neutral in _NEUTRAL_SAMPLING.items():
            if sampling.pop(key, None) not in neutral:
                raise ValueError(f"sampling parameter {key!r} is not supported (only its neutral value)")
        want_logprobs = bool(sampling.pop("logprobs", False))
        known = {"temperature", "top_p", "max_tokens", "seed", "stop_token_ids", "ignore_eos"}
        if unknown := sorted(set(sampling) - known):
            raise ValueError(f"unknown sampling parameters {unknown}")
        try:
            req = _Request.model_validate(sampling)
            self._check_prompt_ids(prompt, "prompt_ids")
            params = self._sampling(req, [prompt], req.max_tokens, 0)
        except ValidationError as exc:
            raise ValueError(_validation_error(exc).message) from None
        except _ApiError as exc:
            raise ValueError(exc.message) from None
        return _Plan("completion", [prompt], 1, params, (), False, False, True, want_logprobs)

    # ------------------------------------------------------------------ life cycle
    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; ``task_status.started()`` once connections are accepted.

        Stopping (cancellation; shielded): stop accepting, give in-flight requests ``SHUTDOWN_GRACE``
        seconds, cancel the rest (their sequences leave the batch), close every socket, then stop the engine
        thread (in-process :meth:`generate_ids` callers get ``RuntimeError``) and join it: no thread is left.
        """
        if self._serving:
            raise RuntimeError("this InferenceServer is already serving")
        self._serving = True
        loop = asyncio.get_running_loop()
        engine_gone = anyio.Event()
        self.engine.start(on_exit=lambda: _call_soon(loop, engine_gone.set))
        try:
            runner = await self._start_http()
            try:
                task_status.started()
                await anyio.sleep_forever()
            finally:
                with anyio.CancelScope(shield=True):
                    await self._stop_http(runner)
        finally:
            with anyio.CancelScope(shield=True):
                self.engine.request_stop()
                await engine_gone.wait()
                self.engine.join()
                self._serving = False

    async def _start_http(self) -> web.AppRunner:
        sock = bind_listener(self.host, self.port)
        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions/render", self._render)
        app.router.add_post("/inference/v1/generate", self._generate_tokens)
        app.router.add_post("/v1/chat/completions/derender", self._derender)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(
            app,
            handler_cancellation=True,
            access_log=None,
            keepalive_timeout=KEEPALIVE_SECONDS,
            shutdown_timeout=SHUTDOWN_GRACE,
        )
        try:
            await runner.setup()
            await web.SockSite(runner, sock).start()
        except BaseException:
            sock.close()
            with anyio.CancelScope(shield=True):
                await runner.cleanup()
            raise
        self._url = url_of(sock)
        logger.info("inference server for %r listening on %s", self.served_model_name, self._url)
        return runner

    async def _stop_http(self, runner: web.AppRunner) -> None:
        """Stop accepting, let handlers finish for ``SHUTDOWN_GRACE`` s, cancel the rest, close connections.

        (aiohttp's own graceful shutdown never cancels a streaming handler; it only stops waiting for it.)
        """
        for site in list(runner.sites):
            await site.stop()
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=SHUTDOWN_GRACE)
        for task in self._handlers:
            task.cancel()  # their jobs abort: the sequences leave the batch
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=SHUTDOWN_GRACE)
        await runner.cleanup()
        self._url = None

    async def __aenter__(self) -> InferenceServer:
        stack = AsyncExitStack()
        tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tg.cancel_scope.cancel)
        try:
            await tg.start(self.serve)
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        stack, self._stack = self._stack, None
        assert stack is not None, "__aexit__ without __aenter__"
        return await stack.__aexit__(*exc_info)

    # ------------------------------------------------------------------ tokens and text
    def _decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of ``ids``; the Rust tokenizer directly when there is one (a few µs, no Python wrapper)."""
        if self._backend is not None:
            return str(self._backend.decode(list(ids), skip_special_tokens=skip_special))
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special))

    def _token_text(self, token: int) -> str:
        """A token's own text (special tokens spelled out), as vLLM reports it in logprobs."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self._decode([token], skip_special=False)
        return text

    def _encode(self, text: str, *, special: bool) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=special).ids
        return list(self.tokenizer.encode(text, add_special_tokens=special))

    def _chat_prompt(self, req: _ChatRequest) -> list[int]:
        """The request's prompt ids through the chat template (400 naming the field on bad input)."""
        add_generation_prompt = req.add_generation_prompt
        if add_generation_prompt is None:  # vLLM's default, unless the last message is to be continued
            add_generation_prompt = not req.continue_final_message
        try:
            return self.chat_template.render(
                req.messages,
                tools=req.tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=bool(req.continue_final_message),
                chat_template_kwargs=req.chat_template_kwargs,
            )
        except ChatTemplateError as exc:
            raise _ApiError(400, str(exc), exc.param) from None

    def _check_prompt_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise _ApiError(400, f"field '{param}': the prompt is empty", param)
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise _ApiError(400, f"field '{param}': token ids must be in [0, {self.vocab_size})", param)

    # ------------------------------------------------------------------ request validation
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise _ApiError(
                404, f"The model `{model}` does not exist. Valid aliases: {self.served_model_name}.", "model"
            )

    def _sampling(
        self, req: _Request, prompts: list[list[int]], max_tokens: int | None, top: int
    ) -> SamplingParams:
        """Sampling parameters, after vLLM's context checks (400 naming ``max_tokens`` / ``input_tokens``)."""
        limit = self.max_model_len
        if max_tokens is not None and max_tokens > limit:
            raise _ApiError(
                400,
                f"max_tokens={max_tokens} cannot be greater than max_model_len={limit}. Please request fewer "
                f"output tokens. (parameter=max_tokens, value={max_tokens})",
                "max_tokens",
            )
        longest = max(len(p) for p in prompts)
        if longest >= limit:
            raise _ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your request has {longest} "
                f"input tokens. Please reduce the length of the input messages. "
                f"(parameter=input_tokens, value={longest})",
                "input_tokens",
            )
        if max_tokens is not None and longest + max_tokens > limit:
            raise _ApiError(
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

    def _plan_chat(self, body: Any) -> _Plan:
        req = _ChatRequest.model_validate(body)
        self._check_model(req.model)
        if req.top_logprobs and not req.logprobs:
            raise _ApiError(400, "field 'top_logprobs': requires 'logprobs' to be true", "top_logprobs")
        self._check_tools(req)
        prompt = self._chat_prompt(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self._sampling(req, [prompt], max_tokens, (req.top_logprobs or 0) if req.logprobs else 0)
        plan = self._plan("chat", req, [prompt], params, bool(req.logprobs))
        parse = ToolRequest.from_request(req.model_dump(include={"tools", "tool_choice", "chat_template_kwargs", "include_reasoning"}))
        uses_parser = self.chat_parser.reasoning_parser is not None or (
            self.chat_parser.tool_parser is not None and parse.has_tools and parse.tool_choice != "none"
        )
        structured = req.structured_outputs
        if parse.forced:
            tag = hermes_structural_tag(req.tools or [], req.tool_choice, parallel_tool_calls=req.parallel_tool_calls)
            structured = _structured_outputs(tag)
        return dataclasses.replace(
            plan,
            parse=parse if uses_parser else None,  # a request the parsers have nothing to do with: plain text
            skip_special=not uses_parser,
            structured_outputs=structured,
        )

    def _check_tools(self, req: _ChatRequest) -> None:
        """vLLM's checks of ``tools`` / ``tool_choice`` (its messages), plus: tools need a tool parser."""
        if req.tools == []:
            raise _ApiError(
                400,
                "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
                "tools",
            )
        choice = req.tool_choice
        if choice is None or choice == "none":
            return
        if not req.tools:
            raise _ApiError(400, "When using `tool_choice`, `tools` must be set.", "tool_choice")
        if isinstance(choice, str) and choice not in ("auto", "required"):
            raise _ApiError(
                400,
                f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or "required" '
                "are supported.",
                "tool_choice",
            )
        if isinstance(choice, dict):
            function = choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            if not isinstance(name, str) or not name:
                raise _ApiError(
                    400,
                    'field \'tool_choice\': expected {"type": "function", "function": {"name": "my_function"}}',
                    "tool_choice",
                )
            names = [t.get("function", {}).get("name") for t in req.tools if isinstance(t, dict)]
            if name not in names:
                raise _ApiError(
                    400,
                    f"The tool specified in `tool_choice` ({name!r}) does not match any of the specified `tools`",
                    "tool_choice",
                )
        if self.chat_parser.tool_parser is None and self.chat_template.supports_tools:
            raise _ApiError(
                400,
                f"field 'tool_choice': {choice!r} needs a tool-call parser, and this server has none "
                '(start it with tool_parser="hermes")',
                "tool_choice",
            )

    async def _with_constraints(self, plan: _Plan) -> _Plan:
        """The plan with one compiled grammar per choice when it asks for one (compiled in a worker thread)."""
        if not plan.structured_outputs:
            return plan
        gate = None
        if self.chat_parser.think_ids is not None and plan.parse is not None and plan.parse.thinking:
            gate = self.chat_parser.think_ids[1]  # vLLM constrains only after the reasoning ends
            if any(_reasoning_closed(self.chat_parser.think_ids, p) for p in plan.prompts):
                gate = None
        count = len(plan.prompts) * plan.n

        def compile_all() -> tuple[TokenConstraint, ...] | None:
            first = self.constraints.constraint(plan.structured_outputs or {}, gate)
            if first is None:
                return None
            rest = [self.constraints.constraint(plan.structured_outputs or {}, gate) for _ in range(count - 1)]
            return (first, *[c for c in rest if c is not None])

        try:
            constraints = await anyio.to_thread.run_sync(compile_all)
        except ConstraintError as exc:
            raise _ApiError(400, str(exc), exc.param) from None
        return dataclasses.replace(plan, constraints=constraints)

    def _plan_completion(self, body: Any) -> _Plan:
        req = _CompletionRequest.model_validate(body)
        self._check_model(req.model)
        if req.echo:
            raise _ApiError(400, "field 'echo': echoing the prompt is not supported", "echo")
        prompts = self._completion_prompts(req.prompt)
        params = self._sampling(req, prompts, req.max_tokens, req.logprobs or 0)
        return self._plan("completion", req, prompts, params, req.logprobs is not None)

    def _completion_prompts(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[list[int]]:
        if isinstance(prompt, str):
            items: list[str | list[int]] = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [prompt]  # type: ignore[list-item]
        else:
            items = list(prompt)  # type: ignore[arg-type]
        if not items:
            raise _ApiError(400, "field 'prompt': the prompt is empty", "prompt")
        out = []
        for item in items:
            ids = self._encode(item, special=True) if isinstance(item, str) else list(item)
            self._check_prompt_ids(ids, "prompt")
            out.append(ids)
        return out

    def _plan(
        self,
        kind: Literal["chat", "completion", "generate"],
        req: _Request,
        prompts: list[list[int]],
        params: SamplingParams,
        logprobs: bool,
    ) -> _Plan:
        stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        return _Plan(
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

    # ------------------------------------------------------------------ HTTP handlers
    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, self._plan_chat)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, self._plan_completion)

    async def _generate(self, request: web.Request, planner: Any) -> web.StreamResponse:
        try:
            plan = await self._with_constraints(planner(await self._read_json(request)))
        except ValidationError as exc:
            self._counts["rejected"] += 1
            return _validation_error(exc).response()
        except _ApiError as exc:
            self._counts["rejected"] += 1
            return exc.response()
        self._counts["requests"] += 1
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)  # so that stopping can wait for it, then cancel it
        try:
            return await self._answer(request, plan)
        finally:
            self._handlers.discard(task)

    async def _answer(self, request: web.Request, plan: _Plan) -> web.StreamResponse:
        """Generate for ``plan``; a client that goes away (cancellation, reset) frees its batch rows."""
        job = _Job(self, plan)
        try:
            try:
                self.engine.submit([c.seq for c in job.choices])
            except RuntimeError as exc:  # stopping
                return _ApiError(503, str(exc)).response()
            if plan.stream:
                return await self._stream(request, job)
            await job.done.wait()
        finally:
            if not job.done.is_set():
                job.cancel()  # the client went away or we are stopping: free the batch rows
        if job.error is not None:
            return _ApiError(500, f"generation failed: {job.error}").response()
        shape = {"chat": _chat_body, "completion": _completion_body, "generate": _generate_body}[plan.kind]
        return web.Response(
            body=orjson.dumps(shape(self, job)),
            content_type="application/json",
            headers={WEIGHT_VERSION_HEADER: str(job.weight_version)},
        )

    async def _stream(self, request: web.Request, job: _Job) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": _SSE_TYPE, "Cache-Control": "no-cache"})
        try:
            await self._stream_events(request, response, job)
        except ConnectionResetError:
            pass  # the client is gone; the caller cancels the job
        return response

    async def _stream_events(self, request: web.Request, response: web.StreamResponse, job: _Job) -> None:
        """The SSE body: role chunks (chat), a chunk per token and choice, usage if asked, ``[DONE]``.

        Nothing is sent before every choice has started (or ended), as vLLM sends its first chunk with the
        first tokens: the headers then carry the weight version the tokens come from.
        """
        updates = job.updates
        assert updates is not None
        with updates:
            early: list[tuple[_Choice, _Delta]] = []
            started: set[int] = set()
            async for item in updates:
                early.append(item)
                started.add(item[0].index)
                if len(started) == len(job.choices):
                    break
            response.headers[WEIGHT_VERSION_HEADER] = str(job.weight_version)
            await response.prepare(request)
            rid = job.id
            chunk = {"chat": _chat_chunk, "completion": _completion_chunk, "generate": _generate_chunk}[
                job.plan.kind
            ]
            roles = [_sse(_chat_role_chunk(self, job, rid, c)) for c in job.choices] if job.plan.kind == "chat" else []
            await response.write(b"".join(roles + _events_of(chunk(self, job, rid, c, d) for c, d in early)))
            async for choice, delta in updates:
                items = [chunk(self, job, rid, choice, delta)]
                while True:  # everything already delivered goes out in one write
                    try:
                        choice, delta = updates.receive_nowait()
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                    items.append(chunk(self, job, rid, choice, delta))
                if events := _events_of(items):
                    await response.write(b"".join(events))
        tail = []
        if job.error is not None:
            tail.append(_sse(_ApiError(500, f"generation failed: {job.error}").body()))
        elif job.plan.include_usage and job.plan.kind == "generate":
            tail.append(_sse({"request_id": rid, "usage": job.usage(True), "output_mode": "tokens", "choices": []}))
        elif job.plan.include_usage:
            head = _head(
                self, job, rid, "chat.completion.chunk" if job.plan.kind == "chat" else "text_completion"
            )
            tail.append(
                _sse({**head, "choices": [], "usage": job.usage(False), "system_fingerprint": _fingerprint()})
            )
        tail.append(_DONE)
        await response.write(b"".join(tail))
        await response.write_eof()

    # ------------------------------------------------------------------ token-in (vLLM's scale-out routes)
    async def _render(self, request: web.Request) -> web.Response:
        """``POST /v1/chat/completions/render``: the chat request as vLLM's ``GenerateRequest`` (no generation)."""
        try:
            body = await self._read_json(request)
            plan = self._plan_chat(body)
            req = _ChatRequest.model_validate(body)
            if plan.structured_outputs is not None:  # the constraint must compile: fail here, not at generate
                await self._with_constraints(dataclasses.replace(plan, n=1))
        except ValidationError as exc:
            return _validation_error(exc).response()
        except _ApiError as exc:
            return exc.response()
        params = plan.params
        think = self.chat_parser.think_ids
        answer = {
            "request_id": f"chatcmpl-{req.request_id or secrets.token_hex(8)}",
            "token_ids": plan.prompts[0],
            "token_offsets": None,
            "features": None,
            "content_parts": None,
            "sampling_params": render_sampling_params(
                temperature=params.temperature,
                top_p=params.top_p,
                max_tokens=params.max_tokens,
                seed=params.seed,
                stop=plan.stops,
                stop_token_ids=params.stop_token_ids,
                logprobs=params.top_logprobs if plan.logprobs else None,
                ignore_eos=params.ignore_eos,
                skip_special_tokens=plan.skip_special,
                structured_outputs=plan.structured_outputs,
            ),
            "model": req.model,
            "reasoning_ended": _reasoning_closed(think, plan.prompts[0]) if think is not None else None,
            "reasoning_parser_kwargs": (
                {"chat_template_kwargs": dict(req.chat_template_kwargs or {})} if think is not None else None
            ),
            "return_token_ids": None,
            "output_mode": "tokens",
            "stream": bool(req.stream),
            "stream_options": req.stream_options.model_dump() if req.stream and req.stream_options else None,
            "cache_salt": None,
            "priority": 0,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
        }
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    def _plan_generate(self, body: Any) -> _Plan:
        req = GenerateRequest.model_validate(body)
        self._check_model(req.model)
        if req.output_mode != "tokens":
            raise _ApiError(400, "field 'output_mode': only 'tokens' is supported", "output_mode")
        sp = dict(req.sampling_params)
        for key, neutral in NEUTRAL_SAMPLING.items():
            if sp.get(key) not in neutral:
                raise _ApiError(
                    400, f"field 'sampling_params.{key}': only its neutral value is supported here", "sampling_params"
                )
        if sp.get("n", 1) not in (1, None):
            raise _ApiError(400, "field 'sampling_params.n': only 1 is supported", "sampling_params")
        fields = ("temperature", "top_p", "max_tokens", "stop", "stop_token_ids", "seed", "ignore_eos")
        shaped = {k: sp[k] for k in fields if sp.get(k) is not None}
        if isinstance(shaped.get("temperature"), int):
            shaped["temperature"] = float(shaped["temperature"])
        if isinstance(shaped.get("top_p"), int):
            shaped["top_p"] = float(shaped["top_p"])
        inner = _Request.model_validate({**shaped, "stream": req.stream, "request_id": req.request_id})
        logprobs = sp.get("logprobs")
        if logprobs is not None and (not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
            raise _ApiError(
                400, f"field 'sampling_params.logprobs': an integer in [0, {MAX_TOP_LOGPROBS}]", "sampling_params"
            )
        self._check_prompt_ids(req.token_ids, "token_ids")
        params = self._sampling(inner, [req.token_ids], inner.max_tokens, logprobs or 0)
        params = dataclasses.replace(params, ranks=logprobs is not None)
        plan = self._plan("generate", inner, [req.token_ids], params, logprobs is not None)
        structured = sp.get("structured_outputs")
        gate_parse = ToolRequest(thinking=True) if req.reasoning_ended is False else None
        return dataclasses.replace(
            plan,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            structured_outputs=structured if isinstance(structured, dict) else None,
            parse=gate_parse,
        )

    async def _generate_tokens(self, request: web.Request) -> web.StreamResponse:
        """``POST /inference/v1/generate``: token ids in, token ids (log-probs, versions) out; JSON or SSE."""
        return await self._generate(request, self._plan_generate)

    async def _derender(self, request: web.Request) -> web.Response:
        """``POST /v1/chat/completions/derender``: generated ids to the chat answer ``/v1/chat/completions``
        would have given for them (JSON), or one streamed chunk of it with the caller-threaded state."""
        try:
            req = DerenderRequest.model_validate(await self._read_json(request))
            self._check_model(req.model)
            answer = self._derender_stream(req) if req.stream else self._derender_whole(req)
        except ValidationError as exc:
            return _validation_error(exc).response()
        except _ApiError as exc:
            return exc.response()
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    def _derender_plan(self, req: DerenderRequest, prompt: list[int], n: int, logprobs: bool) -> _Plan:
        chat = dict(req.chat_request or {"messages": [{"role": "user", "content": ""}]})
        chat.setdefault("messages", [{"role": "user", "content": ""}])
        creq = _ChatRequest.model_validate(chat)
        parse = ToolRequest.from_request(chat)
        uses_parser = self.chat_parser.reasoning_parser is not None or (
            self.chat_parser.tool_parser is not None and parse.has_tools and parse.tool_choice != "none"
        )
        stops = (creq.stop,) if isinstance(creq.stop, str) else tuple(creq.stop or ())
        params = SamplingParams(max_tokens=self.max_model_len, top_logprobs=creq.top_logprobs or 0)
        return _Plan(
            kind="chat",
            prompts=[prompt],
            n=n,
            params=params,
            stops=tuple(x for x in stops if x),
            stream=bool(req.stream),
            include_usage=False,
            with_ids=creq.return_token_ids is True,
            logprobs=logprobs,
            parse=parse if uses_parser else None,
            skip_special=not uses_parser,
        )

    def _replayed(self, plan: _Plan, prompt: list[int], choice: Any, *, final: bool) -> GenSequence:
        """A finished (or, streaming, growing) sequence holding a generate answer's ids, for a derender."""
        seq = GenSequence(
            prompt, plan.params, loop=asyncio.get_running_loop(), notify=lambda s, n: None,
            incremental=plan.stream or bool(plan.stops), choice=choice.index,
        )
        ids = list(choice.token_ids or [])
        if any(t < 0 or t >= self.vocab_size for t in ids):
            raise _ApiError(400, f"field 'token_ids': ids must be in [0, {self.vocab_size})", "generate_response")
        seq.token_ids.extend(ids)
        content = (choice.logprobs or {}).get("content") or []
        seq.logprobs.extend(float(e.get("logprob", 0.0)) for e in content[: len(ids)])
        seq.logprobs.extend([0.0] * (len(ids) - len(seq.logprobs)))
        if final and choice.finish_reason is not None and not isinstance(choice.stop_reason, str):
            seq.finished, seq.finish_reason = True, choice.finish_reason
            seq.stop_reason = choice.stop_reason if isinstance(choice.stop_reason, int) else None
        return seq

    def _derender_whole(self, req: DerenderRequest) -> dict[str, Any]:
        gen = req.generate_response
        if gen is None or not gen.choices:
            raise _ApiError(400, "field 'generate_response': a generate answer with choices is required", "generate_response")
        prompt = list(req.prompt_token_ids or gen.prompt_token_ids or [])
        logprobs = any(c.logprobs is not None for c in gen.choices)
        plan = self._derender_plan(req, prompt, len(gen.choices), logprobs)
        seqs = [self._replayed(plan, prompt, c, final=True) for c in gen.choices]
        job = _Job(self, plan, seqs)
        for choice in job.choices:
            choice.take(len(choice.seq.token_ids))
            if choice.finish_reason is None:  # a stop string given as stop_reason that the text does not hold
                choice.finish_reason = gen.choices[choice.index].finish_reason
        job.id = gen.request_id
        body = _chat_body(self, job)
        completion = sum(len(c.token_ids or []) for c in gen.choices)
        prompt_tokens = req.prompt_tokens or 0
        body["usage"] = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion}
        body["usage"] |= {"completion_tokens": completion, "prompt_tokens_details": None, "completion_tokens_details": None}
        body["prompt_token_ids"] = None
        return body

    def _derender_stream(self, req: DerenderRequest) -> dict[str, Any]:
        chunk_in = req.generate_chunk
        if chunk_in is None:
            raise _ApiError(400, "field 'generate_chunk': required when 'stream' is true", "generate_chunk")
        if len(chunk_in.choices) > 1:
            raise _ApiError(400, "field 'generate_chunk': at most one choice per chunk", "generate_chunk")
        state = req.stream_state
        if state is not None and sum(state.output_chunk_lens) != len(state.output_token_ids):
            raise _ApiError(400, "field 'stream_state': output_chunk_lens must add up to output_token_ids", "stream_state")
        prompt = list(req.prompt_token_ids or chunk_in.prompt_token_ids or [])
        choice_in = chunk_in.choices[0] if chunk_in.choices else None
        logprobs = choice_in is not None and choice_in.logprobs is not None
        plan = self._derender_plan(req, prompt, 1, logprobs)
        seq = GenSequence(
            prompt, plan.params, loop=asyncio.get_running_loop(), notify=lambda s, n: None, incremental=True,
            choice=choice_in.index if choice_in else 0,
        )
        job = _Job(self, plan, [seq])
        job.id = chunk_in.request_id
        choice = job.choices[0]
        choice.index = seq_index = choice_in.index if choice_in else 0
        old = list(state.output_token_ids) if state else []
        start = 0
        for size in state.output_chunk_lens if state else []:  # replay: the parser's state cannot travel
            seq.token_ids.extend(old[start : start + size])
            seq.logprobs.extend([0.0] * size)
            start += size
            if (d := choice.take(len(seq.token_ids))) is not None:
                choice.delta(d)
        new_ids = list(choice_in.token_ids or []) if choice_in else []
        out_chunk: dict[str, Any] = {
            "id": chunk_in.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": req.model or self.served_model_name, "choices": [],
        }
        pinned = list(state.last_tool_call_ids) if state else []
        if choice_in is not None:
            replayed = self._replayed(plan, prompt, choice_in, final=True)
            seq.token_ids.extend(new_ids)
            seq.logprobs.extend(replayed.logprobs)
            seq.finished, seq.finish_reason, seq.stop_reason = replayed.finished, replayed.finish_reason, replayed.stop_reason
            d = choice.take(len(seq.token_ids))
            if d is not None and choice.finish_reason is None and choice_in.finish_reason is not None:
                d.finish_reason = choice.finish_reason = choice_in.finish_reason
            chunk = _chat_chunk(self, job, job.id, choice, d) if d is not None else None
            if chunk is None:
                chunk = {"choices": [{"index": seq_index, "delta": {}, "logprobs": None, "finish_reason": None}]}
            out = chunk["choices"][0]
            for call in out["delta"].get("tool_calls") or []:
                if "id" in call:
                    if call["index"] < len(pinned):
                        call["id"] = pinned[call["index"]]
                    else:
                        pinned.append(call["id"])
            if not (state and state.role_sent):
                out["delta"] = {"role": "assistant", **out["delta"]}
            out_chunk["choices"] = [out]
        if chunk_in.usage is not None:
            completion = int(chunk_in.usage.get("completion_tokens") or 0)
            prompt_tokens = req.prompt_tokens if req.prompt_tokens is not None else int(chunk_in.usage.get("prompt_tokens") or 0)
            out_chunk["usage"] = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion, "completion_tokens": completion}
        streamed = choice.session.tools_streamed if choice.session else False
        new_state = derender_state(state, new_ids, tools_streamed=streamed, tool_call_ids=pinned)
        if not choice_in:
            new_state["role_sent"] = bool(state and state.role_sent)
        return {"chunk": out_chunk, "stream_state": new_state}

    async def _read_json(self, request: web.Request) -> Any:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _ApiError(413, f"request body exceeds the limit of {self.max_body_bytes} bytes") from None
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise _ApiError(400, f"request body is not valid JSON: {exc}", "body") from None
        if not isinstance(body, dict):
            raise _ApiError(400, "request body must be a JSON object", "body")
        return body

    async def _models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "aglverl",
            "root": str(self.model_path) if self.model_path else self.served_model_name,
            "parent": None,
            "max_model_len": self.max_model_len,
        }
        return web.Response(
            body=orjson.dumps({"object": "list", "data": [card]}), content_type="application/json"
        )

    async def _health(self, request: web.Request) -> web.Response:
        stats = asdict(self.stats())
        body = {"status": "ok", "model": self.served_model_name, **stats}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def _metrics(self, request: web.Request) -> web.Response:
        lines = []
        for key, value in asdict(self.stats()).items():
            lines.append(f"aglverl_inference_{key} {float(value):g}")
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


# ---------------------------------------------------------------------------------------------- loading
def _load(
    model: str | os.PathLike[str] | PreTrainedModel,
    tokenizer: str | os.PathLike[str] | PreTrainedTokenizerBase | None,
    dtype: str | torch.dtype,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, Path | None]:
    """The model (eval mode, no grad) and tokenizer, from local files only (``local_files_only``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path: Path | None = None
    with quiet_progress_bars():
        if isinstance(model, (str, os.PathLike)):
            path = resolve_model(model)
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation="sdpa", local_files_only=True
            )
        elif tokenizer is None:
            raise ValueError("a loaded model needs its tokenizer: pass tokenizer=")
        if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = AutoTokenizer.from_pretrained(tokenizer or path, local_files_only=True)
    model.eval().requires_grad_(False)
    return model, tokenizer, path


def _default_tool_parser(template: ChatTemplate) -> str | None:
    """``"hermes"`` for a template that renders tools the Hermes / Qwen way, else ``None``."""
    return "hermes" if template.supports_tools and "<tool_call>" in (template.source or "") else None


def _default_reasoning_parser(template: ChatTemplate, vocab: Mapping[str, int]) -> str | None:
    """``"qwen3"`` for a template that writes ``<think>`` with a tokenizer that has the markers, else ``None``."""
    if "<think>" in (template.source or "") and "<think>" in vocab and "</think>" in vocab:
        return "qwen3"
    return None


def _structured_outputs(structural_tag: str | None) -> dict[str, Any] | None:
    """vLLM's ``StructuredOutputsParams`` dump carrying a structural tag (``None``: nothing constrained)."""
    if structural_tag is None:
        return None
    fields = ("json", "regex", "choice", "grammar", "json_object")
    out: dict[str, Any] = dict.fromkeys(fields)
    out |= {"disable_any_whitespace": False, "disable_additional_properties": False, "whitespace_pattern": None}
    out |= {"structural_tag": structural_tag, "_backend": None, "_backend_was_auto": False}
    return out


def _reasoning_closed(think_ids: tuple[int, int], prompt: Sequence[int]) -> bool:
    start, end = think_ids
    for token in reversed(prompt):
        if token in (start, end):
            return token == end
    return False


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """EOS ids from the generation config and the tokenizer (Qwen lists several)."""
    ids: set[int] = set()
    generation = getattr(model, "generation_config", None)
    for source in (getattr(generation, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return sorted(ids)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Any) -> None:
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:
        pass  # the loop is closed: nobody waits


# ---------------------------------------------------------------------------------------------- response shapes
def _request_id(kind: str, given: str | None = None) -> str:
    if kind == "generate":  # vLLM's generate answers name themselves after the request id they were given
        return f"generate-tokens-{given or secrets.token_hex(8)}"
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{given or secrets.token_hex(8)}"


def _fingerprint() -> str:
    return f"aglverl-{__version__}"


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _events_of(chunks: Iterable[dict[str, Any] | None]) -> list[bytes]:
    return [_sse(chunk) for chunk in chunks if chunk is not None]


def _head(server: InferenceServer, job: _Job, rid: str, obj: str) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": job.created, "model": server.served_model_name}


def _chat_logprobs(
    server: InferenceServer, ids: list[int], lps: list[float], tops: list[Any]
) -> dict[str, Any]:
    content = []
    for k, (token, lp) in enumerate(zip(ids, lps, strict=True)):
        text = server._token_text(token)
        alternatives = (
            [
                {"token": (t := server._token_text(i)), "logprob": v, "bytes": list(t.encode())}
                for i, v in tops[k]
            ]
            if tops
            else []
        )
        content.append(
            {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": alternatives}
        )
    return {"content": content}


def _completion_logprobs(
    server: InferenceServer, ids: list[int], lps: list[float], tops: list[Any], offset: int
) -> dict[str, Any]:
    tokens = [server._token_text(t) for t in ids]
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset))
    top = []
    for k, (token, lp) in enumerate(zip(tokens, lps, strict=True)):
        entry = {token: lp}
        for i, v in tops[k] if tops else ():
            entry.setdefault(server._token_text(i), v)
        top.append(entry)
    return {"text_offset": offsets, "token_logprobs": lps, "tokens": tokens, "top_logprobs": top}


def _usage_of(job: _Job) -> dict[str, Any]:
    return job.usage(True)


def _chat_body(server: InferenceServer, job: _Job) -> dict[str, Any]:
    with_ids = job.plan.with_ids
    choices = []
    for c in job.choices:
        ids, lps = c.seq.token_ids[: c.consumed], c.seq.logprobs[: c.consumed]
        tops = c.seq.top_logprobs[: c.consumed] if c.seq.params.top_logprobs else []
        message, finish_reason = c.message()
        choices.append(
            {
                "index": c.index,
                "message": message,
                "logprobs": _chat_logprobs(server, ids, lps, tops) if job.plan.logprobs else None,
                "finish_reason": finish_reason,
                "stop_reason": c.stop_reason,
                "token_ids": ids if with_ids else None,
                "routed_experts": None,
            }
        )
    body = _head(server, job, job.id, "chat.completion")
    body |= {"choices": choices, "service_tier": None, "system_fingerprint": _fingerprint()}
    body |= {"usage": _usage_of(job), "prompt_logprobs": None}
    body |= {"prompt_token_ids": job.plan.prompts[0] if with_ids else None, "prompt_text": None}
    body |= {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
    return body


def _completion_body(server: InferenceServer, job: _Job) -> dict[str, Any]:
    with_ids = job.plan.with_ids
    choices = []
    for c in job.choices:
        ids, lps = c.seq.token_ids[: c.consumed], c.seq.logprobs[: c.consumed]
        tops = c.seq.top_logprobs[: c.consumed] if c.seq.params.top_logprobs else []
        choices.append(
            {
                "index": c.index,
                "text": c.text,
                "logprobs": _completion_logprobs(server, ids, lps, tops, 0) if job.plan.logprobs else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "token_ids": ids if with_ids else None,
                "prompt_logprobs": None,
                "prompt_token_ids": c.prompt if with_ids else None,
                "routed_experts": None,
            }
        )
    body = _head(server, job, job.id, "text_completion")
    body |= {"choices": choices, "service_tier": None, "system_fingerprint": _fingerprint()}
    body |= {"usage": _usage_of(job), "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
    return body


def _generate_choice(server: InferenceServer, job: _Job, c: _Choice, ids: list[int], start: int) -> dict[str, Any]:
    seq = c.seq
    out: dict[str, Any] = {"index": c.index, "finish_reason": None, "stop_reason": None, "token_ids": ids}
    out |= {"routed_experts": None, "sampling_mask": None, "weight_versions": None}
    end = start + len(ids)
    if job.plan.logprobs:
        out["logprobs"] = generate_logprobs(
            ids, seq.logprobs[start:end], seq.ranks[start:end], seq.top_logprobs[start:end], seq.params.top_logprobs
        )
    else:
        out["logprobs"] = None
    return out


def _generate_body(server: InferenceServer, job: _Job) -> dict[str, Any]:
    choices = []
    for c in job.choices:
        ids = c.seq.token_ids[: c.consumed]
        choice = _generate_choice(server, job, c, ids, 0)
        choice |= {"finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        choice["weight_versions"] = weight_versions(c.seq.weight_version, len(ids))
        choices.append(choice)
    body: dict[str, Any] = {"request_id": job.id, "model": server.served_model_name, "created": job.created}
    body |= {"usage": job.usage(True), "prompt_logprobs": None, "prompt_token_id_logprobs": None}
    body |= {"prompt_token_ids": None, "mm_placeholders": None, "metrics": None, "kv_transfer_params": None}
    body |= {"ec_transfer_params": None, "output_mode": "tokens", "choices": choices}
    return body


def _generate_chunk(server: InferenceServer, job: _Job, rid: str, c: _Choice, d: _Delta) -> dict[str, Any] | None:
    if not d.ids and d.finish_reason is None:
        return None
    start = c.consumed - len(d.ids) if d.finish_reason is None else len(c.seq.token_ids[: c.consumed]) - len(d.ids)
    choice = _generate_choice(server, job, c, d.ids, start)
    if d.finish_reason is not None:
        choice |= {"finish_reason": d.finish_reason, "stop_reason": c.stop_reason}
        choice["weight_versions"] = weight_versions(c.seq.weight_version, c.consumed)
    return {"request_id": rid, "usage": None, "output_mode": "tokens", "choices": [choice]}


def _chat_role_chunk(server: InferenceServer, job: _Job, rid: str, c: _Choice) -> dict[str, Any]:
    choice = {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
    choice["finish_reason"] = None
    chunk = {**_head(server, job, rid, "chat.completion.chunk"), "choices": [choice]}
    if job.plan.with_ids:
        chunk |= {"prompt_token_ids": c.prompt, "prompt_text": None}
    return chunk


def _chat_chunk(
    server: InferenceServer, job: _Job, rid: str, c: _Choice, d: _Delta
) -> dict[str, Any] | None:
    """One choice's chunk; ``None`` when a parser holds the text back and nothing else must be sent."""
    delta, finish_reason = c.delta(d)
    if delta is None:
        if d.finish_reason is None and not job.plan.logprobs and not job.plan.with_ids:
            return None
        delta = {}
    choice: dict[str, Any] = {"index": c.index, "delta": delta}
    choice["logprobs"] = _chat_logprobs(server, d.ids, d.logprobs, d.tops) if job.plan.logprobs else None
    choice["finish_reason"] = finish_reason
    if d.finish_reason is not None:
        choice["stop_reason"] = c.stop_reason
    if job.plan.with_ids:
        choice["token_ids"] = d.ids
    chunk = {**_head(server, job, rid, "chat.completion.chunk"), "choices": [choice]}
    if d.finish_reason is not None and not job.plan.include_usage:  # else the usage chunk carries it
        chunk["system_fingerprint"] = _fingerprint()
    return chunk


def _completion_chunk(
    server: InferenceServer, job: _Job, rid: str, c: _Choice, d: _Delta
) -> dict[str, Any] | None:
    choice: dict[str, Any] = {"index": c.index, "text": d.text}
    choice["logprobs"] = (
        _completion_logprobs(server, d.ids, d.logprobs, d.tops, d.offset) if job.plan.logprobs else None
    )
    choice |= {"finish_reason": d.finish_reason, "stop_reason": c.stop_reason if d.finish_reason else None}
    with_ids = job.plan.with_ids
    choice["prompt_token_ids"] = c.prompt if with_ids and d.first else None
    choice["token_ids"] = d.ids if with_ids else None
    chunk = {**_head(server, job, rid, "text_completion"), "choices": [choice]}
    if d.finish_reason is not None and not job.plan.include_usage:  # else the usage chunk carries it
        chunk["system_fingerprint"] = _fingerprint()
    return chunk


# ---------------------------------------------------------------------------------------------- thread runner
class InferenceServerThread:
    """Hosts an :class:`InferenceServer` on a dedicated thread with its own asyncio loop.

    For processes whose event loop is not ours (verl's Ray worker): :meth:`start` returns once the server
    accepts connections (re-raising whatever stopped it from starting), :meth:`stop` shuts it down and joins
    the thread. The server's thread-safe methods (``load_weights``, ``sleep``, ``wake_up``, ``stats``) and
    ``generate_ids`` (from any asyncio loop) are used directly on :attr:`server`. Also a context manager.
    """

    def __init__(self, server: InferenceServer, *, name: str = LOOP_THREAD_NAME) -> None:
        self.server = server
        self.name = name
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return self.server.url

    def start(self, timeout: float = 60.0) -> str:
        """Start serving on the thread; returns the URL. Raises ``RuntimeError`` if it fails to start."""
        if self._thread is not None:
            raise RuntimeError("already started")
        self._ready.clear()
        self._error = None
        self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise RuntimeError(f"the inference server did not start within {timeout} s")
        if self._error is not None:
            self._thread.join()
            self._thread = None
            raise RuntimeError(f"the inference server failed to start: {self._error}") from self._error
        return self.server.url

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the server (in-flight requests get ``SHUTDOWN_GRACE`` seconds) and join the thread."""
        thread, loop, stop = self._thread, self._loop, self._stop
        if thread is None:
            return
        if loop is not None and stop is not None:
            _call_soon(loop, stop.set)
        thread.join(timeout)
        if thread.is_alive():
            raise RuntimeError(f"the inference server thread did not stop within {timeout} s")
        self._thread = self._loop = self._stop = None

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported to start(); a thread has nowhere else to raise
            self._error = exc
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with self.server:
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> InferenceServerThread:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
