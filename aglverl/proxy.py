"""The LLM proxy: agents' OpenAI calls go through it to the inference backends, and it records their token ids.

:class:`LLMProxy` is an aiohttp application served inside the caller's anyio task group. Two route families,
every HTTP method:

- ``/rollout/{rollout_id}/attempt/{attempt_id}/v1/{path}`` — attributed calls. The attempt is checked against
  the store first (unknown: 404, finished rollout: 409, never forwarded). ``POST chat/completions`` and
  ``POST completions`` get ``"return_token_ids": true`` added (unless the client set the key) and, with
  ``request_logprobs``, ``"logprobs"`` too (``true`` for chat, ``0`` for completions: the sampled tokens' own
  logprobs), and are recorded in the store as :class:`~aglverl.store.LLMCall` rows, one per choice: exact
  prompt/response ids, logprobs, finish reason, the limit that ended the response (``max_tokens`` or the
  backend's context window, told apart by the request's ``max_tokens``; a prompt refused as too long is a
  ``context`` limit too), weight version, backend, latency.
- ``/v1/{path}`` — unattributed calls: forwarded verbatim and counted, never recorded.

Sampling parameters (attributed calls, when the rollout's ``main_llm`` resource names them, as a trainer's
does): a parameter the call omits is filled in with the trainer's value (``temperature``, ``top_p``,
``top_k``; and ``max_tokens`` when the call sets no limit), so the tokens are drawn from the distribution the
trainer recomputes log-probs for. A call that sets a different value (or a non-neutral ``min_p``,
``repetition_penalty``, ``presence_penalty``, ``frequency_penalty`` or ``logit_bias``) is off-policy; the
``sampling_mismatch`` rule decides: ``"refuse"`` answers 400 naming the parameter and both values,
``"mask"`` forwards it and records it ``off_policy`` (its rows are kept out of the loss). Every call records
the values it used; ``aglverl_proxy_sampling_total{action}`` counts fills, refusals and masked calls.

``POST responses`` (OpenAI's Responses API) and ``POST messages`` (Anthropic's Messages API), on either route
family, are translated by :mod:`aglverl.translate`: the body becomes a chat completion before anything else
looks at it (so an attributed one is prepared, relayed and recorded exactly like a chat call, under the
agent's path), and the answer goes back in the agent's API, streams event by event. Every error such a call
gets, the proxy's own included, is in that API's shape; Anthropic's ``x-api-key`` is accepted as the token.

The agent receives exactly the backend's status, body bytes and end-to-end headers. Streams (SSE or any
chunked body) are relayed chunk by chunk as they arrive while token ids are assembled incrementally from the
SSE events; bodies with a ``Content-Length`` are read whole (bounded), parsed once and sent unchanged.

Routing: every call of a rollout goes to the backend its first call went to while that backend is healthy
(vLLM's prefix cache then holds the conversation); a new rollout goes to the healthy backend with the fewest
calls in flight. Before any byte has reached the agent, connection failures, 5xx and 429 are retried on
another backend with capped exponential backoff and jitter (:class:`RetryPolicy`; ``Retry-After`` honoured
within the budget). A backend that refuses connections is ejected for ``eject_seconds`` and then probed
(``GET /health``) by a task that sleeps until that deadline; it takes traffic again only once a probe passes.

Weight updates: :meth:`LLMProxy.pause` holds new calls and drains those in flight (lockstep training);
:meth:`LLMProxy.hold` holds new calls and lets those in flight go on (verl's asynchronous modes, which abort
the engines' generations to swap weights); :meth:`LLMProxy.resume` ends either. An agent never sees an
abort: when a backend answers a recorded call with ``finish_reason: "abort"`` (a JSON body, or an SSE choice
that ends so), the proxy keeps the partial output, waits while it is held (at once when it is not), and
continues the generation token-exactly on the rollout's backend with a token-in ``/v1/completions`` call:
the prompt ids and the ids so far as ``prompt``, what is left of the call's ``max_tokens``, the call's own
sampling parameters (``seed`` moved on by the tokens generated), ``return_token_ids``, logprobs if the call
had them; a continuation aborted in its turn is continued again. The agent gets one answer: a JSON body
covering the whole generation (text, ``token_ids``, logprobs, finish reason, usage), or a stream that goes
on in its own chunk shape (same ``id``) to its final chunk, usage and ``[DONE]``; a Responses / Messages call
gets the same through its translator. The call is recorded once, with all its ids and the weight versions
of its first and last tokens (each the backend's ``X-Weight-Version`` when it sends one, else the proxy's
version). A backend that keeps aborting (or refusing) a continuation, or a hold longer than
``pause_timeout`` after the last token, ends the call with a 503 error saying so (an SSE error event once
the stream started), recorded as failed. Calls with ``n > 1``, tools, a ``response_format``, vLLM guided
decoding or ``prompt_logprobs`` are not continued (a completion cannot carry their state on): a JSON answer
of theirs, which the agent has not seen, is made again from the start under the new weights
(``proxy/regenerated``); a stream of theirs, already partly sent, ends the same way as above, with the
reason. Unattributed ``/v1`` calls are relayed as they are, abort included.

Resource handling: one pooled :class:`aiohttp.ClientSession` per :meth:`LLMProxy.serve`; its idle keep-alive
(4 s) is shorter than the backends' (uvicorn's 5 s) so the pool never reuses a connection the server is about
to close. Cancelling ``serve`` stops accepting, lets in-flight calls finish for ``shutdown_grace`` seconds,
cancels the rest (each cancelled upstream request closes its connection), then closes the server and the
session: no task, socket or connection is left.

Error handling: errors the proxy produces itself are OpenAI-shaped JSON, ``{"error": {"message", "type",
"param": null, "code"}}``, with a message naming what was wrong. An agent that disconnects cancels its upstream
request at once (aiohttp's ``handler_cancellation``); the call is recorded as failed. A stream that breaks
after bytes went out is ended cleanly with a final SSE ``data: {"error": ...}`` event (the OpenAI SDK raises
it as ``APIError``) and recorded as failed.
"""

from __future__ import annotations

import asyncio
import email.utils
import hmac
import itertools
import logging
import math
import random
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import anyio
import orjson
from aiohttp import web
from anyio.abc import TaskGroup, TaskStatus
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from ._net import bind_listener, url_of
from .metrics import ActivityTimeline, Registry
from .models import ProxyLLM, checked_token_ids
from .store import LLMCall, StoreError, TaskStore
from .translate import CHAT_TARGET, TRANSLATED_PATHS, TranslationError, Translator, new_translator

__all__ = ["LLMProxy", "ProxyError", "RetryPolicy", "reconcile_sampling"]

logger = logging.getLogger(__name__)

#: RFC 9110 §7.6.1 connection-specific headers; never forwarded in either direction (``Proxy-*`` too).
HOP_BY_HOP: frozenset[str] = frozenset(
    {"connection", "keep-alive", "te", "trailer", "trailers", "transfer-encoding", "upgrade"}
)
#: Also dropped from requests: the backend's own Host and a recomputed length; the agent's credential (meant
#: for this proxy, never for the backend: OpenAI SDKs send ``Authorization``, Anthropic's ``x-api-key``);
#: ``Expect`` because the proxy has already read the whole body.
_REQUEST_DROP = HOP_BY_HOP | {"host", "content-length", "authorization", "x-api-key", "expect"}
#: Also dropped from responses: the length, recomputed for the body actually sent.
_RESPONSE_DROP = HOP_BY_HOP | {"content-length"}
#: Paths (after ``/v1/``) whose token ids are captured, and the response shape each one has.
CAPTURED_PATHS: Mapping[str, Literal["chat", "completion"]] = {
    "chat/completions": "chat",
    "completions": "completion",
}
#: Upstream statuses retried on another backend while no byte has reached the agent.
RETRY_STATUSES: frozenset[int] = frozenset({429, 500, 502, 503, 504})
#: What a backend's 4xx refusal says when the prompt (with the tokens asked for) does not fit its context
#: window: vLLM ("This model's maximum context length is ...", "... cannot be greater than max_model_len=...",
#: "The decoder prompt ... is longer than the maximum model length ..."), OpenAI (code
#: "context_length_exceeded"), SGLang ("... longer than the model's context length ...").
CONTEXT_REFUSAL = re.compile(
    r"context[ _]length|max_model_len|maximum model length|prompt is too long|too long and exceeds", re.I
)
#: Rollouts whose backend is remembered (LRU); far more than can be in flight at once.
STICKY_ROLLOUTS = 100_000
#: Consecutive calls that outlive ``request_timeout`` after which a backend is ejected (and probed).
EJECT_AFTER_TIMEOUTS = 3
#: Idle seconds a pooled upstream connection is kept: below uvicorn's (vLLM's) 5 s keep-alive, so the proxy
#: drops an idle connection before the server does and never sends a request into one being closed.
UPSTREAM_KEEPALIVE = 4.0
#: What an ejected backend must answer 200 to before it takes traffic again (vLLM and the mock serve it).
PROBE_PATH = "/health"
#: Seconds a probe may take on top of ``connect_timeout``.
PROBE_READ_TIMEOUT = 2.0
#: Largest error body kept from a retried 5xx/429, to pass through if no retry succeeds.
ERROR_BODY_LIMIT = 64 << 10
#: Bound on each closing step (server, runner, session) after the grace period.
_CLOSE_TIMEOUT = 1.0
_SSE = "text/event-stream"
_JSON = "application/json"

_ERROR_TYPES: Mapping[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}

Outcome = Literal["ok", "upstream_error", "failed", "cancelled", "rejected"]
SamplingMismatch = Literal["refuse", "mask"]
#: Sampling parameters that change the distribution tokens are drawn from, and each one's neutral value.
SAMPLING_NEUTRAL: Mapping[str, float | None] = {
    "temperature": None,  # no neutral value: the trainer always names one
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
#: Of those, the ones a trainer's ``main_llm`` names (and the proxy fills in when a call omits them).
TRAINER_SAMPLING = ("temperature", "top_p", "top_k")


def _same_value(key: str, a: Any, b: Any) -> bool:
    if key == "top_k":  # vLLM: -1 and 0 both mean "no top-k"
        a, b = (-1 if v in (0, -1, None) else v for v in (a, b))
    if a is None or b is None:
        return a is b
    return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-6)


def reconcile_sampling(
    request: Mapping[str, Any], expected: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, float], list[str]]:
    """Compare a call's sampling parameters with the trainer's ``expected`` ones.

    Returns ``(fill, used, mismatches)``: the parameters to add to the request (the trainer's values the call
    omits, and ``max_tokens`` when it sets no limit), the values the call is made with, and a description of
    each parameter it sets differently (``"temperature=0.7 (the trainer samples at 1.0)"``); ``used`` names the
    trainer's parameters and those the call sets. A ``null`` in the request counts as omitted; a parameter
    the trainer does not name must be at its neutral value.
    """
    fill: dict[str, Any] = {}
    used: dict[str, float] = {}
    mismatches: list[str] = []
    for key, neutral in SAMPLING_NEUTRAL.items():
        want = expected.get(key, neutral) if key in TRAINER_SAMPLING else neutral
        got = request.get(key)
        if got is None:
            if want is not None and key in expected:
                fill[key] = want
                used[key] = float(want)
            continue
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            continue  # the backend rejects a wrong type with its own 400
        used[key] = float(got)
        if want is not None and not _same_value(key, got, want):
            mismatches.append(f"{key}={got!r} (the trainer samples at {key}={want!r})")
    if request.get("logit_bias"):
        mismatches.append("logit_bias (the trainer samples without one)")
    limit = expected.get("max_tokens")
    if (
        limit is not None
        and request.get("max_tokens") is None
        and request.get("max_completion_tokens") is None
    ):
        fill["max_tokens"] = limit
    return fill, used, mismatches


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How hard the proxy tries before the first byte reaches the agent.

    ``attempts`` upstream tries per call, across backends. ``total_timeout`` is the budget, from the call's
    arrival, within which a retry may still start (a backoff or ``Retry-After`` that would end past it is not
    waited for: the last failure is returned instead); a single try is bounded by the proxy's
    ``request_timeout``, since a non-streamed generation sends nothing until it is done. Retry ``k`` (1-based)
    waits ``min(backoff_max, backoff_initial * 2**(k-1))`` reduced by a random fraction up to ``jitter``.
    """

    attempts: int = 3
    total_timeout: float = 30.0
    backoff_initial: float = 0.05
    backoff_max: float = 2.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.total_timeout < 0 or self.backoff_initial < 0 or self.backoff_max < 0:
            raise ValueError("RetryPolicy needs attempts >= 1 and non-negative times")
        if not 0 <= self.jitter <= 1:
            raise ValueError("RetryPolicy.jitter is a fraction in [0, 1]")

    def backoff(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1-based)."""
        delay = min(self.backoff_max, self.backoff_initial * 2 ** (retry - 1))
        return delay * (1.0 - self.jitter * random.random())


class ProxyError(Exception):
    """A call the proxy answers itself, with an HTTP ``status`` and a message naming what was wrong (and the
    offending request field, ``param``, when there is one)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self, translator: Translator | None = None) -> bytes:
        """OpenAI-shaped, or in the API of a translated call."""
        if translator is not None:
            return translator.error(self.status, self.message, self.param)
        return _error_body(self.status, self.message)

    def response(self, translator: Translator | None = None) -> web.Response:
        return web.Response(status=self.status, body=self.body(translator), content_type=_JSON)


def _error_body(status: int, message: str) -> bytes:
    error = {"message": message, "type": _ERROR_TYPES.get(status, "Error"), "param": None, "code": status}
    return orjson.dumps({"error": error})


class _Unreachable(Exception):
    """An upstream try that got no response at all (connection refused, reset or closed before answering)."""


# ---------------------------------------------------------------------------------------------- token capture
class _ChoiceCapture:
    __slots__ = ("chars", "finish_reason", "ids", "ids_missing", "logprobs", "logprobs_bad", "prompt_ids")

    def __init__(self) -> None:
        self.chars = 0  # completions: characters of text so far (where a continuation's text_offset starts)
        self.prompt_ids: list[int] | None = None
        self.ids: list[int] | None = None
        self.logprobs: list[float] | None = None
        self.finish_reason: str | None = None
        self.ids_missing = False
        self.logprobs_bad = False


class _Capture:
    """Token ids, logprobs and finish reasons of one call, assembled from its JSON body or its SSE events.

    ``feed`` takes a stream's bytes as they arrive, in chunks cut anywhere (partial lines are buffered), and
    parses each complete event once; ``apply`` takes one parsed body or event. Choices are kept by ``index``,
    so ``n > 1`` streams that interleave choices assemble correctly. An event that cannot be parsed makes the
    capture ``broken``: its response ids are then reported as absent rather than incomplete.
    """

    __slots__ = ("_buf", "_crlf", "_data", "broken", "choices", "done", "kind", "model", "prompt_ids")

    def __init__(self, kind: Literal["chat", "completion"]) -> None:
        self.kind = kind
        self.prompt_ids: list[int] | None = None
        self.model: str | None = None
        self.choices: dict[int, _ChoiceCapture] = {}
        self.done = False
        self.broken = False
        self._buf = b""
        self._data: list[bytes] = []
        self._crlf = False

    # ------------------------------------------------------------------ SSE framing
    def feed(self, chunk: bytes) -> None:
        buf = self._buf + chunk if self._buf else chunk
        if self._crlf or b"\r" in buf:
            self._crlf = True  # from now on the general line parser, which also takes CR LF line ends
            self._buf = self._feed_lines(buf)
            return
        # Fast path for the way vLLM frames events: "data: <json>" lines, events split by a blank line.
        start = 0
        while (end := buf.find(b"\n\n", start)) >= 0:
            block = buf[start:end]
            start = end + 2
            if block[:6] == b"data: " and b"\n" not in block:
                self._dispatch(block[6:])
            elif block:
                self._feed_lines(block + b"\n\n")
        self._buf = buf[start:]

    def _feed_lines(self, buf: bytes) -> bytes:
        """The general SSE line parser; returns the bytes of an unfinished last line."""
        start = 0
        while (end := buf.find(b"\n", start)) >= 0:
            line = buf[start:end]
            start = end + 1
            if line[-1:] == b"\r":
                line = line[:-1]
            if not line:
                if self._data:
                    data = self._data[0] if len(self._data) == 1 else b"\n".join(self._data)
                    self._data = []
                    self._dispatch(data)
            elif line[:5] == b"data:":
                value = line[5:]
                self._data.append(value[1:] if value[:1] == b" " else value)
            # Other SSE fields (event:, id:, retry:, comments) carry nothing the proxy records.
        return buf[start:]

    def _dispatch(self, data: bytes) -> None:
        if data == b"[DONE]":
            self.done = True
            return
        try:
            self._apply(orjson.loads(data))
        except (orjson.JSONDecodeError, AttributeError, TypeError, KeyError):
            self.broken = True  # not an OpenAI-shaped event: ids from this stream cannot be trusted

    # ------------------------------------------------------------------ bodies and events
    def apply(self, obj: Any) -> None:
        """Take one parsed JSON body (or event)."""
        try:
            self._apply(obj)
        except (AttributeError, TypeError, KeyError):
            self.broken = True

    def _apply(self, obj: dict[str, Any]) -> None:
        if self.model is None:
            model = obj.get("model")
            self.model = model if isinstance(model, str) else None
        if self.prompt_ids is None:
            self.prompt_ids = obj.get("prompt_token_ids")
        for ch in obj.get("choices") or ():
            idx = ch.get("index", 0)
            c = self.choices.get(idx)
            if c is None:
                c = self.choices[idx] = _ChoiceCapture()
            ids = ch.get("token_ids")
            if ids is not None:
                if c.ids is None:
                    c.ids = ids  # a fresh list from orjson: owned, extended in place by later events
                else:
                    c.ids.extend(ids)
            elif self._has_output(ch):
                c.ids_missing = True
            if self.kind == "completion":
                c.chars += len(ch.get("text") or "")
            if c.prompt_ids is None:
                c.prompt_ids = ch.get("prompt_token_ids")
            lp = ch.get("logprobs")
            if lp:
                self._add_logprobs(c, lp)
            finish = ch.get("finish_reason")
            if finish is not None:
                c.finish_reason = finish

    def _has_output(self, ch: dict[str, Any]) -> bool:
        if self.kind == "completion":
            return bool(ch.get("text"))
        delta = ch.get("delta") or ch.get("message") or {}
        return bool(delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"))

    def _add_logprobs(self, c: _ChoiceCapture, lp: dict[str, Any]) -> None:
        if self.kind == "chat":
            values = [entry["logprob"] for entry in lp.get("content") or ()]
        else:
            values = lp.get("token_logprobs") or []
        if not all(type(v) is float or type(v) is int for v in values):
            c.logprobs_bad = True  # e.g. None for an echoed first prompt token: not a per-response-token list
            return
        if c.logprobs is None:
            c.logprobs = [float(v) for v in values]
        else:
            c.logprobs.extend(float(v) for v in values)

    @property
    def aborted(self) -> bool:
        """Whether a choice ended with ``finish_reason`` ``"abort"`` (the engine cut it off)."""
        return any(c.finish_reason == "abort" for c in self.choices.values())

    def result(self) -> list[tuple[int, _ChoiceCapture, list[int] | None, list[float] | None]]:
        """``(index, choice, response_ids, logprobs)`` per choice in index order; ids ``None`` unless complete."""
        out = []
        for idx in sorted(self.choices):
            c = self.choices[idx]
            ids = None if (c.ids_missing or self.broken) else c.ids
            lps = c.logprobs
            if ids is None or lps is None or c.logprobs_bad or len(lps) != len(ids):
                lps = None
            out.append((idx, c, ids, lps))
        return out


# ---------------------------------------------------------------------------------------------- state
class _Backend:
    """One inference server and what routing needs to know about it."""

    __slots__ = (
        "ejected",
        "ejected_until",
        "in_flight",
        "not_before",
        "picks",
        "probing",
        "removed",
        "timeouts",
        "url",
    )

    def __init__(self, url: str) -> None:
        self.url = url
        self.in_flight = 0
        self.picks = 0
        self.ejected = False
        self.ejected_until = 0.0
        self.not_before = 0.0  # a 429's Retry-After: do not send before this (monotonic seconds)
        self.probing = False
        self.removed = False
        self.timeouts = 0  # calls in a row that outlived request_timeout


class _Call:
    """One agent request on its way through the proxy."""

    __slots__ = (
        "attempt_id",
        "backend",
        "body",
        "capture",
        "delivered",
        "error",
        "first_byte",
        "headers",
        "kind",
        "limit",
        "max_tokens",
        "method",
        "model",
        "off_policy",
        "outcome",
        "path",
        "records",
        "request",
        "response",
        "rollout_id",
        "sampling",
        "seq",
        "sse",
        "started_at",
        "t0",
        "tail",
        "target",
        "translator",
        "upstream_end",
        "upstream_start",
        "weight_version",
        "weight_version_end",
    )

    def __init__(self, seq: int, t0: float, rollout_id: str | None, attempt_id: str | None) -> None:
        self.seq = seq
        self.t0 = t0
        self.started_at = time.time()
        self.rollout_id = rollout_id
        self.attempt_id = attempt_id
        self.method = "GET"
        self.path = ""
        self.target = ""
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.body = b""
        self.kind: Literal["chat", "completion"] | None = None
        self.model: str | None = None
        self.capture: _Capture | None = None
        # A Responses / Anthropic Messages call, relayed as a chat completion and answered in its own API.
        self.translator: Translator | None = None
        # The request's max_tokens tells a stop at max_tokens from a full context window; ``limit`` is set
        # when the backend refuses the prompt as too long.
        self.max_tokens: int | None = None
        self.limit: Literal["context"] | None = None
        self.sampling: dict[str, float] | None = None
        self.off_policy = False
        # The request body as the backend got it (sampling parameters filled in): what a continuation repeats.
        self.request: dict[str, Any] | None = None
        # The weight version of the call's first and last tokens: the backend's X-Weight-Version when it sends
        # one, else the proxy's version when the answer (or the continuation) was asked for.
        self.weight_version = 0
        self.weight_version_end: int | None = None
        self.backend = ""
        self.response: web.StreamResponse | None = None
        self.sse = False
        self.tail = b""
        self.first_byte = 0.0
        self.upstream_start = 0.0
        self.upstream_end = 0.0
        self.outcome: Outcome = "ok"
        self.error: str | None = None
        self.records: list[LLMCall] | None = None  # what was put in the store, once it was
        self.delivered = False  # the agent has the complete response: nothing can fail the call any more

    def fail(self, error: str, outcome: Outcome = "failed") -> None:
        """Mark the call failed with its first error; a call already delivered stays as it is."""
        if self.error is None and not self.delivered:
            self.error = error
            self.outcome = outcome


@dataclass(frozen=True, slots=True)
class _Held:
    """A retryable upstream answer kept in case no retry does better."""

    status: int
    reason: str | None
    headers: CIMultiDict[str]
    body: bytes


def _forward_headers(headers: CIMultiDictProxy[str], drop: frozenset[str]) -> CIMultiDict[str]:
    """The end-to-end headers of ``headers``: hop-by-hop ones, ``Proxy-*`` and those named in ``Connection``
    removed, as well as ``drop``."""
    out: CIMultiDict[str] = CIMultiDict(headers)  # copied in C; removals are by set intersection (hot path)
    present = set(map(str.lower, headers.keys()))
    remove = set(drop.intersection(present))
    remove.update(name for name in present if name.startswith("proxy-"))
    named = headers.get("Connection")
    if named:
        remove.update(token.strip() for token in named.split(","))
    for name in remove:
        out.popall(name, None)
    return out


def _may_end_stream(tail: bytes, chunk: bytes) -> bool:
    """Whether ``chunk`` (after ``tail``, the previous chunk) may complete an SSE ``data: [DONE]`` line."""
    return b"[DONE]" in chunk or (bool(tail) and b"[DONE]" in tail[-6:] + chunk[:6])


#: Where an aborted generation is continued: token ids in, token ids out.
COMPLETIONS_TARGET = "/v1/completions"
#: The response header in which a backend reports the weight version an answer's tokens came from (aglverl's
#: embedded server sends it; vLLM does not, and the proxy's own version is recorded then).
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
#: vLLM fields whose state a continuation would start afresh (a grammar over the output, prompt logprobs).
_UNRESUMABLE_FIELDS = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "prompt_logprobs",
)
_SEED_SPACE = 2**63
#: Chunks up to this size are searched whole for an abort (a search costs about what finding the tail does).
_ABORT_SCAN_WHOLE = 1024
_EVENT_END = re.compile(rb"\r?\n\r?\n")
_DONE_EVENT = b"data: [DONE]\n\n"
#: The end of a generation aborted exactly at its limit (nothing is left to continue).
_LENGTH_END: Mapping[str, Any] = {
    "index": 0,
    "text": "",
    "logprobs": None,
    "finish_reason": "length",
    "stop_reason": None,
    "token_ids": [],
}


def _resume_blocker(request: Mapping[str, Any], kind: Literal["chat", "completion"] | None) -> str | None:
    """Why an aborted call cannot be continued token-exactly by a completion (``None``: it can)."""
    n, best_of = request.get("n"), request.get("best_of")
    if (type(n) is int and n > 1) or (type(best_of) is int and best_of > 1):
        return "a call with n > 1"
    if kind == "chat":
        if request.get("tools") and request.get("tool_choice") != "none":
            return "a call with tools (the backend parses tool calls out of the whole output)"
        response_format = request.get("response_format")
        if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
            return "a call with a response_format"
    elif request.get("echo"):
        return "a call with echo"
    for key in _UNRESUMABLE_FIELDS:
        if request.get(key) is not None:
            return f"a call with {key}"
    return None


def _token_limit(request: Mapping[str, Any]) -> int | None:
    """The call's limit on generated tokens: ``max_completion_tokens``, else ``max_tokens`` (a ``null`` one
    counts as omitted, as the backend reads it); ``None`` when the call sets none."""
    limit = request.get("max_completion_tokens")
    if limit is None:
        limit = request.get("max_tokens")
    return limit if type(limit) is int else None


def _reported_version(headers: CIMultiDictProxy[str]) -> int | None:
    """The weight version a backend reports for an answer, if it reports a valid one."""
    value = headers.get(WEIGHT_VERSION_HEADER)
    if value is None or not value.isdigit():
        return None
    return int(value)


class _EventCut:
    """Cuts a byte stream after its last complete SSE event (LF or CR LF line ends) and keeps the rest."""

    __slots__ = ("_rest",)

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, chunk: bytes) -> bytes:
        """The complete events of what came so far (maybe empty); an unfinished one is kept for later."""
        if not self._rest and chunk[-2:] == b"\n\n":
            return chunk  # the usual chunk: whole events (a server writes one or more events at a time)
        buf = self._rest + chunk if self._rest else chunk
        lf, crlf = buf.rfind(b"\n\n"), buf.rfind(b"\r\n\r\n")
        end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        self._rest = buf[end:]
        return buf[:end]

    def rest(self) -> bytes:
        """What was kept (the stream ended): an event with no blank line after it, or nothing."""
        rest, self._rest = self._rest, b""
        return rest


def _may_abort(events: bytes) -> bool:
    """Whether complete SSE events may hold an aborted choice (a cheap look: the word, where it can be).

    An abort is a stream's last choice event, followed at most by a usage event and ``[DONE]`` (with n > 1,
    the other choices' aborts come right before it), so the last three events of a long chunk are enough:
    scanning the whole of a chunk that bundles many events would cost more than the relay's own work.
    """
    start = 0
    if len(events) > _ABORT_SCAN_WHOLE:
        end = len(events) - 2
        for _ in range(3):
            end = events.rfind(b"\n\n", 0, end)
            if end < 0:
                break
        start = end + 2 if end >= 0 else 0
    return events.find(b'"abort"', start) >= 0


def _event_data(raw: bytes) -> bytes:
    """The ``data`` of one SSE event (its lines joined)."""
    lines = [line[5:].removeprefix(b" ") for line in raw.splitlines() if line[:5] == b"data:"]
    return lines[0] if len(lines) == 1 else b"\n".join(lines)


def _payloads(events: bytes) -> list[bytes]:
    """The ``data`` of each of some complete SSE events."""
    return [data for raw in _EVENT_END.split(events) if raw and (data := _event_data(raw))]


def _json_object(data: bytes) -> dict[str, Any] | None:
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _event_json(raw: bytes) -> dict[str, Any] | None:
    return _json_object(_event_data(raw))


def _choices_of(event: dict[str, Any] | None) -> list[dict[str, Any]]:
    choices = event.get("choices") if event is not None else None
    return [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []


def _text_of(choice: Mapping[str, Any], kind: Literal["chat", "completion"] | None) -> str:
    if kind == "completion":
        return choice.get("text") or ""
    return (choice.get("delta") or choice.get("message") or {}).get("content") or ""


def _unfinish(choice: dict[str, Any], kind: Literal["chat", "completion"] | None) -> None:
    """An aborted choice's last piece as an ordinary one: no finish reason, and no trailing U+FFFD.

    Those stand for the bytes of a character the output ended inside: the continuation, prompted with these
    ids, renders that character whole (vLLM's detokenizer, and the embedded server's, start from the prompt's
    last ids), so they must not also go out here.
    """
    choice["finish_reason"] = None
    choice["stop_reason"] = None
    if kind == "completion":
        choice["text"] = (choice.get("text") or "").rstrip("\ufffd")
        return
    holder = choice.get("delta") or choice.get("message")
    if isinstance(holder, dict) and isinstance(holder.get("content"), str):
        holder["content"] = holder["content"].rstrip("\ufffd")


def _sse_event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def _drain(content: aiohttp.StreamReader) -> None:
    """Read what is left of a body, so that its connection goes back to the pool; errors end the reading."""
    try:
        while await content.readany():
            pass
    except (aiohttp.ClientError, OSError, TimeoutError):
        pass


class _Resumption:
    """An aborted generation on its way to its end: what its continuations need and what they did."""

    __slots__ = ("chars", "context", "deadline", "head", "ids", "limit", "prompt", "ready", "refusals", "version")

    def __init__(
        self,
        prompt: list[int],
        ids: list[int],
        limit: int | None,
        deadline: float,
        head: dict[str, Any],
        chars: int,
    ) -> None:
        self.prompt = prompt  # the call's own prompt ids
        self.ids = ids  # every response id so far
        self.limit = limit  # the call's max_tokens (after filling); None: the rest of the context
        self.deadline = deadline  # give up when no token came by then (monotonic)
        self.head = head  # id, object, created, model of the call's stream
        self.chars = chars  # characters of text so far (completions' text_offset)
        self.refusals = 0  # continuations in a row that brought no token
        self.ready = 0.0  # when the current continuation was free to go (for the resume latency)
        self.version = 0  # the weight version of the current continuation
        self.context: int | None = None  # the backend's context window (max_model_len), for a call without a limit

    @property
    def left(self) -> int | None:
        """Tokens the call may still generate (``None``: up to a context window not known)."""
        if self.limit is not None:
            return max(0, self.limit - len(self.ids))
        if self.context is not None:
            return max(0, self.context - len(self.prompt) - len(self.ids))
        return None

    def usage(self, usage: Mapping[str, Any]) -> dict[str, Any]:
        """A backend's usage counts, for the call's own prompt and the whole generation."""
        prompt, completion = len(self.prompt), len(self.ids)
        counts = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        return {**usage, **counts}


def _continued_choice(raw: bytes) -> dict[str, Any]:
    """The choice of a whole continuation answer; :class:`ProxyError` (502) unless a completion with ids."""
    choices = _choices_of(_json_object(raw))
    if not choices or type(choices[0].get("token_ids")) is not list:
        raise ProxyError(502, "the backend's continuation is not a completion with token ids")
    return choices[0]


def _merged(call: _Call, answer: Any, pieces: Sequence[dict[str, Any]], state: _Resumption) -> Any:
    """A whole answer the backend aborted, extended by its continuations' ``pieces``: one body, in the call's
    shape, whose text, token ids, logprobs, finish reason and usage cover the whole generation."""
    choice = answer["choices"][0]
    chat = call.kind == "chat"
    if chat and not isinstance(choice.get("message"), dict):
        choice["message"] = {"role": "assistant", "content": ""}
    _unfinish(choice, call.kind)
    holder, key = (choice["message"], "content") if chat else (choice, "text")
    text = holder.get(key) or ""
    logprobs = choice.get("logprobs")
    top = (call.request or {}).get("top_logprobs") or 0
    for piece in pieces:
        if piece.get("finish_reason") == "abort":
            _unfinish(piece, "completion")
        if isinstance(logprobs, dict):
            if chat:
                logprobs.setdefault("content", []).extend(_chat_logprobs(piece.get("logprobs"), top))
            else:
                shifted = _offset_logprobs(piece.get("logprobs"), len(text)) or {}
                for field in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
                    logprobs.setdefault(field, []).extend(shifted.get(field) or ())
        text += piece.get("text") or ""
    holder[key] = text
    last = pieces[-1]
    choice["token_ids"] = state.ids
    choice["finish_reason"], choice["stop_reason"] = last.get("finish_reason"), last.get("stop_reason")
    if isinstance(answer.get("usage"), dict):
        answer["usage"] = state.usage(answer["usage"])
    return answer


def _chat_logprobs(logprobs: Any, top: int) -> list[dict[str, Any]]:
    """A completion's logprobs as chat ``logprobs.content`` entries, with at most ``top`` alternatives."""
    if not isinstance(logprobs, dict):
        return []
    tokens, values = logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or []
    out = []
    for i, (token, value) in enumerate(zip(tokens, values, strict=False)):
        alternatives = tops[i] if top and i < len(tops) and isinstance(tops[i], dict) else {}
        best = sorted(alternatives.items(), key=lambda item: -item[1])[:top]
        out.append(
            {
                "token": token,
                "logprob": value,
                "bytes": list(token.encode("utf-8", "replace")),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": list(t.encode("utf-8", "replace"))} for t, v in best
                ],
            }
        )
    return out


def _offset_logprobs(logprobs: Any, offset: int) -> Any:
    """Completions logprobs whose ``text_offset`` counts from ``offset`` characters further on."""
    if not isinstance(logprobs, dict) or not offset or not isinstance(logprobs.get("text_offset"), list):
        return logprobs
    return {**logprobs, "text_offset": [o + offset for o in logprobs["text_offset"]]}


def _stop_limit(
    finish_reason: str | None, ids: Sequence[int] | None, max_tokens: int | None
) -> Literal["max_tokens", "context"] | None:
    """Which limit ended a response that the backend says stopped on ``"length"``, if it did.

    An engine stops on length at the request's ``max_tokens`` or at its context window; a request without
    ``max_tokens`` gets the rest of the window (vLLM's default), so stopping short of ``max_tokens`` (or with
    none asked for) means the window was full.
    """
    if finish_reason != "length":
        return None
    if max_tokens is not None and (ids is None or len(ids) >= max_tokens):
        return "max_tokens"
    return "context"


def _retry_after(value: str | None) -> float:
    """Seconds asked by a ``Retry-After`` header (delta-seconds or HTTP date); 0 when absent or unreadable."""
    if not value:
        return 0.0
    try:
        seconds = float(value)
        return seconds if math.isfinite(seconds) and seconds > 0 else 0.0
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, IndexError, OverflowError):
        return 0.0


def _error_message(body: bytes, limit: int = 500) -> str:
    """The message of an OpenAI/vLLM error body, for the call record (bounded; the raw body otherwise)."""
    try:
        obj = orjson.loads(body)
        error = obj.get("error", obj) if isinstance(obj, dict) else obj
        message = error.get("message") if isinstance(error, dict) else None
        if isinstance(message, str):
            return message[:limit]
    except orjson.JSONDecodeError:
        pass
    return body[:limit].decode("utf-8", "replace")


def _normalise_backend(url: str) -> str:
    parsed = URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"backend {url!r} must be an absolute http(s) URL such as 'http://host:8000'")
    if parsed.path not in ("", "/") or parsed.query_string or parsed.fragment:
        raise ValueError(
            f"backend {url!r} must be 'http://host:port' with no path (no '/v1'), query or fragment"
        )
    return url.rstrip("/")


# ---------------------------------------------------------------------------------------------- the proxy
class LLMProxy:
    """Token-recording reverse proxy in front of OpenAI-compatible backends (see the module docstring).

    Serve it with ``await tg.start(proxy.serve)``; :attr:`url` is valid once ``start`` returns.
    ``token``: when set, every request needs ``Authorization: Bearer <token>`` (an OpenAI client's
    ``api_key``); it is never logged nor forwarded. ``backend_api_key``: sent to the backends as a bearer token
    (they never see the agents' credentials). ``max_request_bytes``/``max_response_bytes`` bound bodies;
    ``request_timeout`` bounds each upstream try, body included (then a 504, or a stream ended with an error
    event); ``connect_timeout`` a TCP connect; ``pause_timeout`` how long a call waits while paused or held,
    and how long an aborted generation may go without a new token (held, or refused) before it gives up;
    ``shutdown_grace`` how long in-flight calls may finish on shutdown. ``upstream_keepalive``: seconds an idle
    pooled connection to a backend is kept; it must stay below the backends' own keep-alive (vLLM's
    ``--timeout-keep-alive``, 5 s by default). Raise both together to keep connections warm across trainer
    updates longer than that (each step otherwise starts by opening new connections). ``request_logprobs``:
    ask the backend for the sampled tokens' logprobs on every recorded call whose agent did not set
    ``logprobs`` itself (a trainer's behaviour log-probs); the agent then receives them in its answers too.
    ``sampling_of(rollout_id)``: the sampling parameters the rollout's trainer expects (``None``: unchecked);
    ``sampling_mismatch``: what happens to a call that sets other ones (see the module docstring).
    :attr:`activity` is the timeline of when at least one call was in flight (the backends were busy).
    """

    def __init__(
        self,
        store: TaskStore,
        *,
        backends: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int = 0,
        registry: Registry | None = None,
        retry: RetryPolicy = RetryPolicy(),  # frozen: one shared default instance is safe
        request_timeout: float = 600.0,
        connect_timeout: float = 5.0,
        token: str | None = None,
        max_request_bytes: int = 32 << 20,
        max_response_bytes: int = 256 << 20,
        eject_seconds: float = 5.0,
        pause_timeout: float = 600.0,
        shutdown_grace: float = 5.0,
        backend_api_key: str | None = None,
        upstream_keepalive: float = UPSTREAM_KEEPALIVE,
        request_logprobs: bool = False,
        sampling_of: Callable[[str], Mapping[str, Any] | None] | None = None,
        sampling_mismatch: SamplingMismatch = "refuse",
    ) -> None:
        if sampling_mismatch not in ("refuse", "mask"):
            raise ValueError(f"sampling_mismatch must be 'refuse' or 'mask', got {sampling_mismatch!r}")
        self.store = store
        self.host = host
        self.port = port
        self.retry = retry
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self.max_request_bytes = max_request_bytes
        self.max_response_bytes = max_response_bytes
        self.eject_seconds = eject_seconds
        self.pause_timeout = pause_timeout
        self.shutdown_grace = shutdown_grace
        self.upstream_keepalive = upstream_keepalive
        self.request_logprobs = request_logprobs
        self.sampling_of = sampling_of
        self.sampling_mismatch = sampling_mismatch
        #: When calls were in flight: the backends' busy time as the proxy sees it.
        self.activity = ActivityTimeline()
        #: Model weights version recorded on every call; set or incremented by :meth:`resume`.
        self.weight_version = 0
        self._auth = f"Bearer {token}".encode() if token is not None else None
        self._backend_auth = f"Bearer {backend_api_key}" if backend_api_key is not None else None
        self._backends: list[_Backend] = []
        self._sticky: OrderedDict[str, _Backend] = OrderedDict()
        self._seq = itertools.count()
        self._in_flight = 0
        self._drained: anyio.Event | None = None  # created by a pause() waiting for in-flight calls
        self._paused = False
        self._held = False
        self._gate: anyio.Event | None = None  # exists while paused or held; set by resume()
        self._waiting = (
            0  # calls waiting for the gate now (at admission, or to continue an aborted generation)
        )
        self._handlers: set[asyncio.Task[Any]] = set()
        self._closing = False
        self._session: aiohttp.ClientSession | None = None
        self._tg: TaskGroup | None = None
        self._url: str | None = None
        self.set_backends(backends)
        self._register_metrics(registry or Registry())

    # ------------------------------------------------------------------ metrics
    def _register_metrics(self, r: Registry) -> None:
        self.registry = r
        self.m_calls = r.counter("aglverl_proxy_calls_total", "LLM calls handled by the proxy.", ["outcome"])
        self.m_retries = r.counter("aglverl_proxy_retries_total", "Upstream tries repeated after a failure.")
        self.m_ejections = r.counter(
            "aglverl_proxy_backend_ejections_total",
            "Backends taken out of rotation after failed connections.",
        )
        self.m_no_ids = r.counter(
            "aglverl_proxy_calls_without_token_ids_total",
            "Recorded calls (choices) the backend sent no ids for.",
        )
        self.m_unrecorded = r.counter(
            "aglverl_proxy_calls_unrecorded_total",
            "Attributed calls dropped because their rollout had ended.",
        )
        self.m_upstream = r.histogram(
            "aglverl_proxy_upstream_seconds", "Upstream request sent to last upstream byte (seconds)."
        )
        self.m_first_byte = r.histogram(
            "aglverl_proxy_first_byte_seconds", "Request arrival to first byte sent to the agent (seconds)."
        )
        self.m_added = r.histogram(
            "aglverl_proxy_added_seconds",
            "Time a call spent in the proxy beyond its last upstream try (seconds).",
        )
        self.m_sampling = r.counter(
            "aglverl_proxy_sampling_total",
            "Recorded calls whose sampling parameters were filled in, refused or masked as off-policy.",
            ["action"],
        )
        self.m_generated = r.counter(
            "aglverl_proxy_generated_tokens_total", "Response token ids recorded, over every recorded call."
        )
        r.gauge("aglverl_proxy_in_flight", "Calls being forwarded now.", lambda: self._in_flight)
        self.m_held = r.counter(
            "aglverl_proxy_held_calls_total",
            "Calls that arrived while the proxy was paused or held, and waited.",
        )
        r.gauge(
            "aglverl_proxy_waiting_calls",
            "Calls waiting now for a pause or hold to end (new calls, and aborted generations to continue).",
            lambda: self._waiting,
        )
        self.m_resumed = r.counter(
            "aglverl_proxy_resumed_total",
            "Recorded calls whose generation a backend aborted and the proxy continued to its end.",
        )
        self.m_continuations = r.counter(
            "aglverl_proxy_continuations_total",
            "Token-in continuation requests sent for aborted generations.",
        )
        self.m_regenerated = r.counter(
            "aglverl_proxy_regenerated_total",
            "Aborted whole answers that a completion cannot continue (tool calls, n > 1, structured output), "
            "made again from the start (the agent had seen none of them).",
        )
        self.m_resume_failed = r.counter(
            "aglverl_proxy_resume_failures_total",
            "Aborted generations not continued: calls the proxy does not resume (unsupported), or a backend "
            "that kept aborting or refusing for pause_timeout (refused).",
            ["reason"],
        )
        self.m_resume_latency = r.histogram(
            "aglverl_proxy_resume_seconds",
            "An aborted generation free to continue (not held) to its continuation's first token (seconds).",
        )

    # ------------------------------------------------------------------ public API
    @property
    def url(self) -> str:
        """``http://host:port`` of the proxy; valid once :meth:`serve` has started."""
        if self._url is None:
            raise RuntimeError("LLMProxy is not serving yet")
        return self._url

    @property
    def serving(self) -> bool:
        """Whether the proxy has started serving (its :attr:`url` is known)."""
        return self._url is not None

    @property
    def backends(self) -> list[str]:
        """The configured backend URLs, in order."""
        return [b.url for b in self._backends]

    @property
    def healthy_backends(self) -> list[str]:
        """The backends currently taking traffic (not ejected)."""
        return [b.url for b in self._backends if not b.ejected]

    def set_backends(self, urls: Sequence[str]) -> None:
        """Replace the backends (``http://host:port``, no ``/v1``); raises ``ValueError`` for anything else.

        A backend kept from the previous list keeps its health and load; calls already running on a removed
        backend finish there, and rollouts pinned to it move on their next call.
        """
        wanted = list(dict.fromkeys(_normalise_backend(u) for u in urls))
        old: dict[str, _Backend | None] = {b.url: b for b in self._backends}
        self._backends = [old.pop(url, None) or _Backend(url) for url in wanted]
        for gone in old.values():
            if gone is not None:
                gone.removed = True

    def forget(self, rollout_ids: Sequence[str]) -> None:
        """Drop the routing state of rollouts that are over (the store calls this when it forgets them)."""
        for rollout_id in rollout_ids:
            self._sticky.pop(rollout_id, None)

    def llm_resource(self, model: str, sampling_parameters: Mapping[str, Any] | None = None) -> ProxyLLM:
        """The resource agents get: ``endpoint`` templated with ``{rollout_id}`` and ``{attempt_id}``."""
        return ProxyLLM(
            endpoint=f"{self.url}/rollout/{{rollout_id}}/attempt/{{attempt_id}}/v1",
            model=model,
            sampling_parameters=dict(sampling_parameters or {}),
        )

    async def pause(self) -> None:
        """Hold new calls (for a weight update) and return once every call in flight has finished.

        Held calls wait up to ``pause_timeout`` for :meth:`resume`, then get a 503. Cancelling ``pause``
        stops the wait for the drain but leaves the proxy paused: call :meth:`resume`. A call whose aborted
        generation waits to continue (see :meth:`hold`) is in flight: a drain waits for it, so a pause while
        backends abort generations returns once those calls ended (at the latest after ``pause_timeout``).
        """
        if not self._paused:
            self._paused = True
            self._close_gate()
        while self._in_flight:
            if self._drained is None:
                self._drained = anyio.Event()
            await self._drained.wait()

    def hold(self) -> None:
        """Hold new calls, without draining the calls in flight: they go on (the asynchronous trainer modes).

        From now until :meth:`resume`, a new call waits (up to ``pause_timeout``, then a 503) as during
        :meth:`pause`, and so does the continuation of a generation a backend aborts meanwhile (the trainer
        aborts the engines' generations to swap their weights): it continues under the new weights once
        :meth:`resume` is called, and its agent sees one uninterrupted answer. Idempotent; returns at once.
        """
        self._held = True
        self._close_gate()

    def resume(self, weight_version: int | None = None) -> None:
        """End a pause or a hold: waiting calls go on, and so do aborted generations waiting to continue.

        ``weight_version`` becomes the proxy's version (default: the current one + 1), recorded on calls whose
        backend reports none (``X-Weight-Version``).
        """
        self.weight_version = self.weight_version + 1 if weight_version is None else weight_version
        self._paused = self._held = False
        if self._gate is not None:
            self._gate.set()
            self._gate = None

    def _close_gate(self) -> None:
        if self._gate is None:
            self._gate = anyio.Event()

    @property
    def paused(self) -> bool:
        """Whether :meth:`pause` was called and :meth:`resume` not yet."""
        return self._paused

    @property
    def held(self) -> bool:
        """Whether :meth:`hold` was called and :meth:`resume` not yet."""
        return self._held

    @property
    def in_flight(self) -> int:
        """Calls admitted and not yet finished."""
        return self._in_flight

    # ------------------------------------------------------------------ life cycle
    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; ``task_status.started()`` once the listener accepts connections.

        On cancellation (shielded, bounded by ``shutdown_grace`` plus a few seconds): stop accepting, let
        in-flight calls finish within ``shutdown_grace``, cancel the rest, close the server and the session.
        """
        if self._session is not None:
            raise RuntimeError("LLMProxy is already serving")
        sock = bind_listener(self.host, self.port)
        app = self._make_app()
        runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=_CLOSE_TIMEOUT
        )
        self._session = self._make_session()
        self._closing = False
        site: web.SockSite | None = None
        try:
            await runner.setup()
            site = web.SockSite(runner, sock)
            await site.start()
            self._url = url_of(sock)
            async with anyio.create_task_group() as tg:
                self._tg = tg
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._tg = None
            with anyio.CancelScope(shield=True):
                await self._close(runner, site)
            sock.close()

    def _make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_request_bytes)
        app.router.add_route("*", "/v1/{path:.*}", self._unattributed)
        app.router.add_route("*", "/rollout/{rollout_id}/attempt/{attempt_id}/v1/{path:.*}", self._attributed)
        app.router.add_route("*", "/{tail:.*}", self._no_route)
        return app

    def _make_session(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(
            limit=0,  # concurrency is bounded by the agents, and a pool cap would queue calls invisibly
            keepalive_timeout=self.upstream_keepalive,
        )
        return aiohttp.ClientSession(
            connector=connector,
            # request_timeout bounds each upstream try, body included; aiohttp arms one timer per request anyway.
            timeout=aiohttp.ClientTimeout(total=self.request_timeout, sock_connect=self.connect_timeout),
            auto_decompress=False,  # bodies are relayed byte for byte; captured calls ask for identity
            skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent"),  # forward the agent's, add none
            cookie_jar=aiohttp.DummyCookieJar(),  # a backend's cookie must not leak from one agent to another
            trust_env=False,  # nothing but the configured backends is ever contacted
        )

    async def _close(self, runner: web.AppRunner, site: web.SockSite | None) -> None:
        self._closing = True
        with anyio.move_on_after(self.shutdown_grace + 4 * _CLOSE_TIMEOUT):
            if site is not None:
                await site.stop()
            if self._handlers:
                await asyncio.wait(set(self._handlers), timeout=self.shutdown_grace)
            for task in self._handlers:
                task.cancel()
            if self._handlers:
                await asyncio.wait(set(self._handlers), timeout=_CLOSE_TIMEOUT)
            await runner.cleanup()
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    # ------------------------------------------------------------------ handlers
    async def _no_route(self, request: web.Request) -> web.Response:
        try:
            self._authorize(request)
        except ProxyError as exc:
            return exc.response()
        message = f"no such route {request.path!r}: use /v1/... or /rollout/{{rollout_id}}/attempt/{{attempt_id}}/v1/..."
        return ProxyError(404, message).response()

    async def _unattributed(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, None, None, request.rel_url.raw_path)

    async def _attributed(self, request: web.Request) -> web.StreamResponse:
        info = request.match_info
        # The raw (still percent-encoded) path after the attempt segment is what goes upstream.
        target = "/" + request.rel_url.raw_path.split("/", 5)[5]
        return await self._handle(request, info["rollout_id"], info["attempt_id"], target)

    async def _handle(
        self, request: web.Request, rollout_id: str | None, attempt_id: str | None, target: str
    ) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        call = _Call(next(self._seq), time.monotonic(), rollout_id, attempt_id)
        try:
            try:
                await self._admit(request, call, target)
            except ProxyError as exc:
                self.m_calls.inc(1, "rejected")
                return exc.response(call.translator)
            except asyncio.CancelledError:  # the agent left while its body was read or while paused
                self.m_calls.inc(1, "cancelled")
                raise
            self._enter()
            try:
                return await self._run(request, call)
            finally:
                self._leave()
        finally:
            self._handlers.discard(task)

    async def _admit(self, request: web.Request, call: _Call, target: str) -> None:
        """Check and read the request into ``call``, then wait while paused; raises :class:`ProxyError`."""
        path = request.match_info["path"]
        api = TRANSLATED_PATHS.get(path) if request.method == "POST" else None
        if api is not None:  # known first, so that every refusal below is in the agent's API
            call.translator = new_translator(api)
        self._authorize(request)
        if call.rollout_id is not None:
            assert call.attempt_id is not None
            try:
                self.store.check_attempt(call.rollout_id, call.attempt_id)
            except StoreError as exc:
                raise ProxyError(exc.status, f"{exc}; the call was not forwarded") from None
        if "\\" in path or ("." in path and {".", ".."} & set(path.split("/"))):
            raise ProxyError(400, f"path 'v1/{path}' has '.' or '..' segments or backslashes; not forwarded")
        query = request.rel_url.raw_query_string
        call.method = request.method
        call.path = "/v1/" + path
        call.target = f"{target}?{query}" if query else target
        call.headers = _forward_headers(request.headers, _REQUEST_DROP)
        if self._backend_auth is not None:
            call.headers["Authorization"] = self._backend_auth
        call.body = await self._read_body(request)
        kind = CAPTURED_PATHS.get(path) if call.method == "POST" else None
        if call.translator is not None:
            kind = self._translate_request(call, call.translator)
        if kind is not None and call.rollout_id is not None:
            self._prepare_capture(call, kind)
        if self._gate is not None:
            await self._wait_resumed()

    def _authorize(self, request: web.Request) -> None:
        if self._auth is None:
            return
        header = request.headers.get("Authorization")
        if header is None and "x-api-key" in request.headers:  # how Anthropic's SDK sends its api_key
            header = "Bearer " + request.headers["x-api-key"]
        given = (header or "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, self._auth):
            raise ProxyError(
                401, "missing or wrong proxy token: send 'Authorization: Bearer <token>' (or 'x-api-key')"
            )

    async def _read_body(self, request: web.Request) -> bytes:
        length = request.content_length
        limit = self.max_request_bytes
        if length is not None and length > limit:
            raise ProxyError(
                413, f"request body of {length} bytes exceeds the proxy's limit of {limit} bytes"
            )
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ProxyError(413, f"request body exceeds the proxy's limit of {limit} bytes") from None

    @staticmethod
    def _translate_request(call: _Call, translator: Translator) -> Literal["chat"]:
        """Turn a Responses / Messages body into the chat completion the backend gets (before any capture
        preparation, which then sees an ordinary chat call); a body that cannot be translated is a 400."""
        try:
            call.body = translator.request(call.body)
        except TranslationError as exc:
            raise ProxyError(exc.status, exc.message, exc.param) from None
        call.target = CHAT_TARGET  # the agent's query (e.g. the Anthropic SDK's ?beta=true) is its API's own
        call.headers["Content-Type"] = _JSON
        call.headers["Accept-Encoding"] = "identity"  # the answer is parsed to be translated
        return "chat"

    def _prepare_capture(self, call: _Call, kind: Literal["chat", "completion"]) -> None:
        """Validate the JSON body and make sure the backend is asked for token ids, in identity encoding."""
        try:
            obj = orjson.loads(call.body)
        except orjson.JSONDecodeError as exc:
            raise ProxyError(400, f"request body of {call.path} is not valid JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise ProxyError(
                400, f"request body of {call.path} must be a JSON object, not {type(obj).__name__}"
            )
        model = obj.get("model")
        call.model = model if isinstance(model, str) else None
        call.kind = kind
        call.capture = _Capture(kind)
        call.headers["Accept-Encoding"] = "identity"
        empty = not obj
        fill = self._reconcile_sampling(call, obj)
        call.max_tokens = _token_limit(obj)
        if "return_token_ids" not in obj:
            fill["return_token_ids"] = True
        if self.request_logprobs and "logprobs" not in obj:
            # Completions take a count of alternatives: 0 asks for the sampled tokens' logprobs alone.
            fill["logprobs"] = True if kind == "chat" else 0
        if any(key in obj for key in fill):  # a parameter sent as null is replaced: re-encode the body
            call.body = orjson.dumps({**obj, **fill})
        elif fill:
            # Spliced in as text: every other byte of the agent's body reaches the backend untouched.
            i = call.body.index(b"{") + 1
            added = b",".join(orjson.dumps(key) + b":" + orjson.dumps(value) for key, value in fill.items())
            call.body = call.body[:i] + added + (b"" if empty else b",") + call.body[i:]
        obj.update(fill)
        call.request = obj

    def _reconcile_sampling(self, call: _Call, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Check the call's sampling parameters against its trainer's; return the parameters to add.

        Raises :class:`ProxyError` (400) for an off-policy call under the ``"refuse"`` rule, marks it
        ``off_policy`` under ``"mask"``.
        """
        expected = (
            self.sampling_of(call.rollout_id) if self.sampling_of is not None and call.rollout_id else None
        )
        if not expected:
            return {}
        fill, call.sampling, mismatches = reconcile_sampling(obj, expected)
        if mismatches:
            if self.sampling_mismatch == "refuse":
                self.m_sampling.inc(1, "refused")
                raise ProxyError(
                    400,
                    f"{call.path}: {'; '.join(mismatches)}: this rollout trains on-policy, so its calls must "
                    "sample as the trainer does (omit the parameter to get the trainer's value, or start the "
                    "trainer with aglverl.sampling_mismatch: mask to keep such calls out of the loss)",
                )
            self.m_sampling.inc(1, "masked")
            call.off_policy = True
        if fill:
            self.m_sampling.inc(1, "filled")
        return fill

    async def _wait_resumed(self) -> None:
        self.m_held.inc()
        if not await self._released(time.monotonic() + self.pause_timeout):
            raise ProxyError(503, f"the proxy is paused for a weight update for over {self.pause_timeout:g}s")

    async def _released(self, deadline: float) -> bool:
        """Wait until the proxy is neither paused nor held; ``False`` if ``deadline`` (monotonic) came first."""
        self._waiting += 1
        try:
            with anyio.move_on_after(deadline - time.monotonic()):
                while self._gate is not None:  # a new hold may close a new gate before this task runs again
                    await self._gate.wait()
        finally:
            self._waiting -= 1
        return self._gate is None

    def _enter(self) -> None:
        self._in_flight += 1
        self.activity.begin()

    def _leave(self) -> None:
        self._in_flight -= 1
        self.activity.end()
        if self._in_flight == 0 and self._drained is not None:
            self._drained.set()
            self._drained = None

    # ------------------------------------------------------------------ forwarding
    async def _run(self, request: web.Request, call: _Call) -> web.StreamResponse:
        """Forward ``call``, always ending with it recorded and counted, whatever happens."""
        call.weight_version = self.weight_version
        try:
            return await self._attempts(request, call)
        except ProxyError as exc:
            call.fail(exc.message)
            return exc.response(call.translator)
        except asyncio.CancelledError:
            call.fail("proxy shutting down" if self._closing else "agent disconnected", "cancelled")
            raise
        except Exception as exc:
            logger.exception("proxy failure on %s", call.path)
            call.fail(f"internal proxy error: {exc!r}")
            if call.response is not None:
                return call.response
            return ProxyError(500, f"internal proxy error: {exc!r}").response(call.translator)
        finally:
            self._finish(call)

    def _timed_out(self, call: _Call) -> str:
        """Note a call that outlived ``request_timeout`` and describe it.

        The rollout is moved off that backend at once (its next call or attempt goes elsewhere), and a backend
        that times out ``EJECT_AFTER_TIMEOUTS`` calls in a row is ejected like one that refuses connections:
        a hung server must not hold on to the rollouts pinned to it while a healthy one idles.
        """
        backend = next((b for b in self._backends if b.url == call.backend), None)
        if backend is not None:
            backend.timeouts += 1
            if backend.timeouts >= EJECT_AFTER_TIMEOUTS:
                self._eject(backend, TimeoutError(f"{backend.timeouts} calls in a row timed out"))
            if call.rollout_id is not None and self._sticky.get(call.rollout_id) is backend:
                others = [b for b in self._backends if b is not backend and not (b.ejected or b.removed)]
                if others:
                    self._sticky[call.rollout_id] = min(others, key=lambda b: (b.in_flight, b.picks))
                else:
                    del self._sticky[call.rollout_id]
        return f"backend {call.backend} did not finish within request_timeout={self.request_timeout:g}s"

    async def _attempts(self, request: web.Request, call: _Call) -> web.StreamResponse:
        policy = self.retry
        deadline = call.t0 + policy.total_timeout
        tried: list[_Backend] = []
        failure: ProxyError | None = None
        held: _Held | None = None
        for attempt in range(policy.attempts):
            backend = self._pick(call.rollout_id, tried)
            if backend is None:
                raise ProxyError(503, "no backends are configured")
            if attempt:
                delay = max(policy.backoff(attempt), backend.not_before - time.monotonic())
                if time.monotonic() + delay > deadline:
                    break
                self.m_retries.inc()
                if delay > 0:
                    await anyio.sleep(delay)
            tried.append(backend)
            backend.in_flight += 1
            try:
                upstream = await self._send(backend, call)
                if upstream.status in RETRY_STATUSES and attempt + 1 < policy.attempts:
                    held = await self._hold(backend, upstream)
                    continue
                return await self._relay(request, call, upstream)
            except _Unreachable as exc:  # raised only while nothing has been sent to the agent
                failure = ProxyError(502, str(exc))
            finally:
                backend.in_flight -= 1
        if held is not None:
            return await self._send_held(request, call, held)
        assert failure is not None
        tries = len(tried)
        raise ProxyError(502, f"{failure.message} (after {tries} {'try' if tries == 1 else 'tries'})")

    def _pick(self, rollout_id: str | None, tried: Sequence[_Backend]) -> _Backend | None:
        """The backend for the next try: the rollout's own while healthy, else the least loaded healthy one."""
        if not self._backends:
            return None
        first = not tried and rollout_id is not None
        if first:
            sticky = self._sticky.get(rollout_id)  # type: ignore[arg-type]
            if sticky is not None and not (
                sticky.ejected or sticky.removed or sticky.not_before > time.monotonic()
            ):
                self._sticky.move_to_end(rollout_id)  # type: ignore[arg-type]
                return sticky
        now = time.monotonic()
        best = min(
            self._backends,
            key=lambda b: (b.ejected, b in tried, b.not_before > now, b.in_flight, b.picks),
        )
        best.picks += 1
        if first:
            self._sticky[rollout_id] = best  # type: ignore[index]
            self._sticky.move_to_end(rollout_id)  # type: ignore[arg-type]
            if len(self._sticky) > STICKY_ROLLOUTS:
                self._sticky.popitem(last=False)
        return best

    async def _send(
        self, backend: _Backend, call: _Call, continuation: bytes | None = None
    ) -> aiohttp.ClientResponse:
        """Send the request to ``backend`` and return its response head; :class:`_Unreachable` if none came.

        ``continuation``: send this ``/v1/completions`` body instead (an aborted generation's continuation).
        """
        assert self._session is not None
        call.backend = backend.url
        if continuation is None:
            call.upstream_start = time.monotonic()
            method, target, body = call.method, call.target, call.body or None
        else:
            method, target, body = "POST", COMPLETIONS_TARGET, continuation
        try:
            upstream = await self._session.request(
                method,
                URL(backend.url + target, encoded=True),
                headers=call.headers,
                data=body,
                allow_redirects=False,
            )
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            self._eject(backend, exc)
            raise _Unreachable(f"backend {backend.url} is unreachable: {exc}") from exc
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            # Typically a pooled connection the server closed just as it was reused: worth another try.
            raise _Unreachable(
                f"backend {backend.url} closed the connection without answering: {exc!r}"
            ) from exc
        except TimeoutError:  # request_timeout (aiohttp's total timeout) before the response head
            raise ProxyError(504, self._timed_out(call)) from None
        except aiohttp.ClientError as exc:  # e.g. a malformed response head: the backend is not speaking HTTP
            raise ProxyError(502, f"backend {backend.url} sent no valid HTTP response: {exc!r}") from exc
        backend.timeouts = 0
        if backend.ejected:
            self._restore(backend)
        return upstream

    async def _hold(self, backend: _Backend, upstream: aiohttp.ClientResponse) -> _Held:
        """Keep a retryable answer (bounded) and free its connection; note a 429's ``Retry-After``."""
        try:
            if upstream.status == 429:
                backend.not_before = time.monotonic() + _retry_after(upstream.headers.get("Retry-After"))
            length = upstream.content_length
            body = b""
            if length is not None and length <= ERROR_BODY_LIMIT:
                try:
                    body = await upstream.read()
                except (aiohttp.ClientError, TimeoutError):
                    body = b""
            headers = _forward_headers(upstream.headers, _RESPONSE_DROP)
            if not body:
                body = _error_body(upstream.status, f"backend {backend.url} answered {upstream.status}")
                headers["Content-Type"] = _JSON
            logger.debug("backend %s answered %d; retrying", backend.url, upstream.status)
            return _Held(upstream.status, upstream.reason, headers, body)
        finally:
            upstream.close()

    async def _send_held(self, request: web.Request, call: _Call, held: _Held) -> web.StreamResponse:
        call.upstream_end = time.monotonic()
        call.fail(f"backend answered {held.status}: {_error_message(held.body)}", "upstream_error")
        body, headers = held.body, held.headers
        if call.translator is not None:
            body = call.translator.whole(held.status, body)
            headers["Content-Type"] = _JSON
        response = web.Response(status=held.status, reason=held.reason, body=body, headers=headers)
        await self._send_whole(request, call, response)
        return response

    async def _relay(
        self, request: web.Request, call: _Call, upstream: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        """Relay the backend's answer to the agent, capturing token ids on the way; closes ``upstream``."""
        try:
            headers = _forward_headers(upstream.headers, _RESPONSE_DROP)
            content_type = upstream.headers.get("Content-Type", "")
            call.sse = content_type.startswith(_SSE)
            if call.capture is not None:
                # A backend that reports no version (vLLM): the proxy's when the answer's head arrives, not
                # when the call came in: a call admitted before a hold that reached a paused engine waited
                # there and was generated under the weights that came after.
                version = _reported_version(upstream.headers)
                call.weight_version = self.weight_version if version is None else version
            if call.sse or (
                upstream.content_length is None
                and upstream.status not in (204, 304)
                and call.method != "HEAD"
            ):
                return await self._relay_stream(request, call, upstream, headers)
            return await self._relay_whole(request, call, upstream, headers)
        finally:
            upstream.close()  # a no-op once the body was read to the end; otherwise drops the connection

    async def _relay_whole(
        self, request: web.Request, call: _Call, upstream: aiohttp.ClientResponse, headers: CIMultiDict[str]
    ) -> web.StreamResponse:
        length = upstream.content_length or 0
        if length > self.max_response_bytes:
            raise ProxyError(
                502, f"backend answered {length} bytes, over max_response_bytes={self.max_response_bytes}"
            )
        try:
            body = await upstream.read()
        except TimeoutError:
            raise ProxyError(504, self._timed_out(call)) from None
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            # Nothing has reached the agent yet, so this is as retryable as a refused connection.
            raise _Unreachable(f"backend {call.backend} broke off the response: {exc!r}") from exc
        call.upstream_end = time.monotonic()
        answer = self._capture_body(call, upstream.status, body)
        if answer is not None and call.capture is not None and call.capture.aborted:
            assert call.request is not None
            if _resume_blocker(call.request, call.kind) is None:
                body = await self._resume_whole(call, answer)
            else:
                body = await self._regenerate_whole(call)
            call.upstream_end = time.monotonic()
        if call.translator is not None:
            try:
                body = call.translator.whole(upstream.status, body)
            except TranslationError as exc:
                raise ProxyError(exc.status, exc.message) from None
            headers["Content-Type"] = _JSON
        response = web.Response(status=upstream.status, reason=upstream.reason, body=body, headers=headers)
        await self._send_whole(request, call, response)
        return response

    async def _send_whole(self, request: web.Request, call: _Call, response: web.Response) -> None:
        self._commit(call)
        try:
            await response.prepare(request)
            call.first_byte = time.monotonic()
            await response.write_eof()
        except ConnectionError:
            call.fail("agent disconnected", "cancelled")
        else:
            call.delivered = True

    def _capture_body(self, call: _Call, status: int, body: bytes) -> Any:
        """Capture a whole answer's ids; returns the parsed body (``None`` when nothing was captured)."""
        if status >= 400:
            self._upstream_refused(call, status, body)
            return None
        if call.capture is None:
            return None
        try:
            answer = orjson.loads(body)
        except orjson.JSONDecodeError:
            call.fail(f"backend answered {status} with a body that is not JSON")
            return None
        call.capture.apply(answer)
        return answer

    async def _relay_stream(
        self, request: web.Request, call: _Call, upstream: aiohttp.ClientResponse, headers: CIMultiDict[str]
    ) -> web.StreamResponse:
        status = upstream.status
        translator = call.translator
        if translator is not None:
            translator.open(status, call.sse)
        response = web.StreamResponse(status=status, reason=upstream.reason, headers=headers)
        call.response = response
        try:
            await response.prepare(request)
        except ConnectionError:
            call.fail("agent disconnected", "cancelled")
            return response
        call.first_byte = time.monotonic()
        capture = call.capture if status < 400 else None
        whole = bytearray() if capture is not None and not call.sse else None
        # A recorded SSE answer goes out in whole events, so that an abort can be taken out of the stream
        # before the agent sees any of it (an event the agent has half of could not be taken back).
        events = capture is not None and call.sse
        cut: _EventCut | None = _EventCut() if events else None
        head: dict[str, Any] | None = None  # the aborting event's id, object, created and model
        refusal = bytearray()  # the start of an error body, to say what was refused
        limit, size = self.max_response_bytes, 0
        content = upstream.content
        while True:
            try:
                chunk = await content.readany()
            except TimeoutError:
                await self._end_broken(call, 504, self._timed_out(call))
                return response
            except (aiohttp.ClientError, OSError) as exc:
                await self._end_broken(call, 502, f"backend {call.backend} broke off the response: {exc!r}")
                return response
            if not chunk:
                if cut is None or head is not None or not (chunk := cut.rest()):
                    break
                cut = None  # the stream ended with an event that had no blank line after it
            else:
                size += len(chunk)
            if size > limit:
                await self._end_broken(call, 502, f"backend response exceeds max_response_bytes={limit}")
                return response
            if head is not None:
                continue  # what follows an abort (usage, [DONE]) is read to free the connection, not sent
            if status >= 400 and len(refusal) < ERROR_BODY_LIMIT:
                refusal += chunk[: ERROR_BODY_LIMIT - len(refusal)]
            if events:
                if cut is not None:
                    chunk = cut.feed(chunk)
                if _may_abort(chunk):
                    chunk, head = self._take_abort(call, chunk)
                if not chunk:
                    continue
            if not await self._forward(call, response, chunk, capture, whole):
                return response
        if head is not None and not await self._resume_stream(call, response, head):
            return response
        if not call.delivered:
            call.upstream_end = time.monotonic()
        if status >= 400:
            self._upstream_refused(call, status, bytes(refusal))
        elif whole is not None:
            self._capture_body(call, status, bytes(whole))  # an abort in it went out already: not resumed
        self._commit(call)
        try:
            if translator is not None and (last := translator.close()):
                await response.write(last)
            await response.write_eof()
        except ConnectionError:
            call.fail("agent disconnected", "cancelled")
        else:
            call.delivered = True
        return response

    async def _forward(
        self,
        call: _Call,
        response: web.StreamResponse,
        chunk: bytes,
        capture: _Capture | None,
        whole: bytearray | None,
    ) -> bool:
        """Send a piece of a streamed answer to the agent (translated, for a translated call) and capture its
        ids; ``False`` if the agent has gone (the call is then failed as cancelled)."""
        parse_after = capture is not None
        if whole is not None:
            whole += chunk
            parse_after = False
        elif capture is not None and _may_end_stream(call.tail, chunk):
            parse_after = False
            capture.feed(chunk)
            if capture.done:  # record before the agent can read [DONE] and report its rollout done
                call.upstream_end = time.monotonic()
                self._commit(call)
        try:
            # A translated call's bytes go out translated, event by event, as they arrive.
            out = chunk if call.translator is None else call.translator.feed(chunk)
            if out:
                await response.write(out)
        except ConnectionError:
            call.fail("agent disconnected", "cancelled")
            return False
        call.tail = chunk
        if call.records is not None:
            call.delivered = True
        elif parse_after:
            capture.feed(chunk)  # type: ignore[union-attr]  # parsed once the agent has the bytes
        return True

    @staticmethod
    def _upstream_refused(call: _Call, status: int, body: bytes) -> None:
        """Fail a call the backend answered with an error; note a prompt refused for the context window."""
        message = _error_message(body)
        if 400 <= status < 500 and status != 429 and CONTEXT_REFUSAL.search(message):
            call.limit = "context"
        call.fail(f"backend answered {status}: {message}", "upstream_error")

    async def _end_broken(self, call: _Call, status: int, message: str) -> None:
        """End a response whose head already went out: a final SSE error event (for streams), then EOF.

        A call whose agent already has the whole answer (``[DONE]`` went out) just gets its EOF.
        """
        response = call.response
        assert response is not None
        if not call.delivered:
            call.upstream_end = time.monotonic()
            call.fail(message)
            logger.warning(
                "call %d on %s failed after its response started: %s", call.seq, call.path, message
            )
        try:
            if call.translator is not None and not call.delivered:
                await response.write(call.translator.abort(message))  # that API's own error ending
            elif call.sse and not call.delivered:
                # A blank line first ends any event the backend left half-sent.
                prefix = b"" if call.tail.endswith(b"\n\n") else b"\n\n"
                await response.write(prefix + b"data: " + _error_body(status, message) + b"\n\n")
            await response.write_eof()
        except ConnectionError:
            pass

    # ------------------------------------------------------------------ resuming aborted generations
    def _take_abort(self, call: _Call, chunk: bytes) -> tuple[bytes, dict[str, Any] | None]:
        """Take an abort out of complete SSE events: ``(what the agent gets, the aborting event's head)``.

        The head (``id``, ``object``, ``created``, ``model``) is ``None`` when no choice was aborted (the word
        was text). Events before the aborting one go out unchanged; the aborting one goes out without its
        finish reason when it carries the last tokens (dropped when it carries none); what follows it (usage,
        ``[DONE]``) is dropped: the rest of the answer comes from the continuation.
        """
        out: list[bytes] = []
        for raw in _EVENT_END.split(chunk):
            if not raw:
                continue
            event = _event_json(raw) if b'"abort"' in raw else None
            choices = _choices_of(event)
            ended = [c for c in choices if c.get("finish_reason") == "abort"]
            if not ended:
                out.append(raw + b"\n\n")
                continue
            assert event is not None
            for choice in ended:
                _unfinish(choice, call.kind)
            if any(c.get("token_ids") or _text_of(c, call.kind) for c in choices):
                out.append(_sse_event(event))
            head = {key: event.get(key) for key in ("id", "object", "created", "model")}
            return b"".join(out), head
        return chunk, None

    def _resumption(self, call: _Call, head: dict[str, Any] | None = None) -> _Resumption:
        """What the continuations of ``call``'s aborted answer need; :class:`ProxyError` (503) for a call the
        proxy does not resume (counted as ``unsupported``)."""
        capture, request = call.capture, call.request
        assert capture is not None and request is not None
        why = _resume_blocker(request, call.kind)
        choice = next(iter(capture.choices.values()), None)
        prompt = None if choice is None else choice.prompt_ids or capture.prompt_ids
        if why is None and len(capture.choices) != 1:
            why = "a call with several choices"
        if why is None and (choice is None or choice.ids_missing or capture.broken or prompt is None):
            why = "a call whose answer carries no token ids"
        if why is not None:
            self.m_resume_failed.inc(1, "unsupported")
            message = f"the backend aborted the generation (a weight update), and {why} is not resumed"
            raise ProxyError(503, message)
        assert choice is not None and prompt is not None
        limit = _token_limit(request)
        return _Resumption(
            list(prompt),
            list(
                choice.ids or ()
            ),  # no ids and no output (ids_missing unset): aborted before its first token
            limit,
            time.monotonic() + self.pause_timeout,
            head or {},
            choice.chars,
        )

    async def _resume_stream(self, call: _Call, response: web.StreamResponse, head: dict[str, Any]) -> bool:
        """Continue a streamed answer the backend aborted: the continuations' events go on in the agent's
        stream, in its chunk shape, until one ends otherwise than aborted.

        Returns ``True`` once that continuation's stream was relayed (its ``[DONE]`` included), ``False`` when
        the response was ended otherwise: an error event (a call not resumed, a backend that kept refusing for
        ``pause_timeout``, a broken continuation), or the agent left. Cancellation (the agent left, shutdown)
        closes the continuation's upstream request.
        """
        try:
            state = self._resumption(call, head)
            while True:
                if state.left == 0:  # cut exactly at the limit: nothing is left to generate
                    end = {"choices": [dict(_LENGTH_END)]}
                    events, _ = self._converted(call, state, end)
                    if not await self._forward(call, response, events + _DONE_EVENT, call.capture, None):
                        return False
                    break
                upstream = await self._continuation(call, state)
                try:
                    again = await self._relay_continuation(call, response, upstream, state)
                finally:
                    upstream.close()
                if again is None:
                    return False
                if not again:
                    break
        except ProxyError as exc:
            await self._end_broken(call, exc.status, exc.message)
            return False
        self.m_resumed.inc()
        return True

    async def _resume_whole(self, call: _Call, answer: Any) -> bytes:
        """Continue a whole (JSON) answer the backend aborted; returns the one body, in the call's shape,
        covering the whole generation (and captures it). Raises :class:`ProxyError` when it cannot be
        continued (see :meth:`_resume_stream`); cancellation closes the continuation's upstream request."""
        state = self._resumption(call)
        pieces: list[dict[str, Any]] = []
        while True:
            if state.left == 0:
                pieces.append(dict(_LENGTH_END))
                break
            upstream = await self._continuation(call, state)
            try:
                if (upstream.content_length or 0) > self.max_response_bytes:
                    limit = self.max_response_bytes
                    raise ProxyError(502, f"backend continuation exceeds max_response_bytes={limit}")
                raw = await upstream.read()
            except TimeoutError:
                raise ProxyError(504, self._timed_out(call)) from None
            except (aiohttp.ClientError, OSError) as exc:
                raise ProxyError(502, f"backend {call.backend} broke off the continuation: {exc!r}") from exc
            finally:
                upstream.close()
            piece = _continued_choice(raw)
            pieces.append(piece)
            aborted = piece.get("finish_reason") == "abort"
            self._progressed(call, state, piece["token_ids"], aborted)
            if not aborted:
                break
        merged = _merged(call, answer, pieces, state)
        call.capture = _Capture(call.kind or "chat")
        call.capture.apply(merged)
        self.m_resumed.inc()
        return orjson.dumps(merged)

    async def _regenerate_whole(self, call: _Call) -> bytes:
        """A whole (JSON) answer the backend aborted that a completion cannot continue token-exactly (tool
        calls, ``n > 1``, structured output: :func:`_resume_blocker`): the agent has seen none of it, so once
        the proxy is no longer held the call is made again from the start, and that answer (generated under
        the new weights) is the call's, recorded with its own ids and version. An answer aborted again is made
        again; :class:`ProxyError` (503) once ``pause_timeout`` passed without a whole answer, 502 for an
        error answer; cancellation closes the upstream request."""
        deadline = time.monotonic() + self.pause_timeout
        refusals = 0
        while True:
            if not await self._held_back(deadline):
                self.m_resume_failed.inc(1, "refused")
                raise ProxyError(
                    503, f"an aborted call waited to be made again for over {self.pause_timeout:g}s"
                )
            if refusals:
                await anyio.sleep(min(self.retry.backoff(refusals), max(0.0, deadline - time.monotonic())))
                if time.monotonic() >= deadline:
                    self.m_resume_failed.inc(1, "refused")
                    raise ProxyError(503, f"the backend kept aborting a call made again ({refusals} times)")
                if self._gate is not None:
                    continue
            backend = self._pick(call.rollout_id, ())
            if backend is None:
                raise ProxyError(503, "no backends are configured")
            try:
                upstream = await self._send(backend, call)
            except _Unreachable:
                refusals += 1
                continue
            try:
                if upstream.status in RETRY_STATUSES:
                    refusals += 1
                    continue
                if (upstream.content_length or 0) > self.max_response_bytes:
                    raise ProxyError(
                        502, f"backend answer exceeds max_response_bytes={self.max_response_bytes}"
                    )
                raw = await upstream.read()
                status, version = upstream.status, _reported_version(upstream.headers)
            except TimeoutError:
                raise ProxyError(504, self._timed_out(call)) from None
            except (aiohttp.ClientError, OSError) as exc:
                raise ProxyError(
                    502, f"backend {call.backend} broke off the call made again: {exc!r}"
                ) from exc
            finally:
                upstream.close()
            if status >= 400:
                raise ProxyError(
                    502, f"backend {backend.url} refused the call made again: {status}: {_error_message(raw)}"
                )
            call.capture = _Capture(call.kind or "chat")
            answer = self._capture_body(call, status, raw)
            if answer is not None and call.capture.aborted:
                refusals += 1
                continue
            # Made again wholly after the hold: the proxy's current version when the backend reports none.
            call.weight_version = call.weight_version_end = self.weight_version if version is None else version
            self.m_regenerated.inc()
            return raw

    async def _continuation(self, call: _Call, state: _Resumption) -> aiohttp.ClientResponse:
        """Send the next continuation of ``state`` and return its response head (status < 400).

        It goes once the proxy is neither paused nor held, to the rollout's backend (whose prefix cache holds
        the prompt and the partial output). A refusal (no connection, a 5xx or 429, or an answer aborted again
        without a token) is retried after the retry policy's backoff; :class:`ProxyError` (503) once
        ``pause_timeout`` has passed since the last token (held, or refused), 502/504 for other failures.
        """
        while True:
            if not await self._held_back(state.deadline):
                self.m_resume_failed.inc(1, "refused")
                raise ProxyError(
                    503,
                    f"an aborted generation waited to continue for over pause_timeout={self.pause_timeout:g}s "
                    "while the proxy was held",
                )
            if state.refusals:
                left = max(0.0, state.deadline - time.monotonic())
                await anyio.sleep(min(self.retry.backoff(state.refusals), left))
                if time.monotonic() >= state.deadline:
                    self.m_resume_failed.inc(1, "refused")
                    raise ProxyError(
                        503,
                        f"the backend aborted the generation and refused to continue it for pause_timeout="
                        f"{self.pause_timeout:g}s ({state.refusals} continuations refused or aborted at once)",
                    )
                if self._gate is not None:
                    continue  # held meanwhile: wait for the hold to end first
            backend = self._pick(call.rollout_id, ())
            if backend is None:
                raise ProxyError(503, "no backends are configured")
            if state.limit is None and state.context is None:
                # The call had the rest of the context; a completion without max_tokens (or with a null one)
                # gets vLLM's default of 16 tokens, so the continuation asks for the rest explicitly.
                state.context = await self._context_window(backend, call.model)
            state.ready = time.monotonic()
            state.version = self.weight_version
            self.m_continuations.inc()
            try:
                upstream = await self._send(backend, call, self._continuation_body(call, state))
            except _Unreachable:
                state.refusals += 1
                continue
            if upstream.status in RETRY_STATUSES:
                upstream.close()
                state.refusals += 1
                continue
            if upstream.status >= 400:
                try:
                    body = await upstream.content.read(ERROR_BODY_LIMIT)
                except (aiohttp.ClientError, OSError, TimeoutError):
                    body = b""
                finally:
                    upstream.close()
                message = _error_message(body)
                raise ProxyError(
                    502,
                    f"backend {backend.url} refused to continue the aborted generation: {upstream.status}: {message}",
                )
            reported = _reported_version(upstream.headers)
            if reported is not None:
                state.version = reported
            return upstream

    async def _context_window(self, backend: _Backend, model: str | None) -> int | None:
        """The backend's context window for ``model`` (``max_model_len`` of its ``/v1/models`` card, as vLLM
        and the embedded server report it); ``None`` (logged) when it does not say."""
        assert self._session is not None
        try:
            async with self._session.get(URL(backend.url + "/v1/models", encoded=True)) as response:
                cards = (await response.json(content_type=None)).get("data") or []
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, AttributeError) as exc:
            cards, error = [], repr(exc)
        else:
            error = "no max_model_len in its /v1/models"
        for card in cards:
            if not isinstance(card, dict) or (len(cards) > 1 and card.get("id") != model):
                continue
            window = card.get("max_model_len")
            if type(window) is int:
                return window
        logger.warning(
            "backend %s did not tell its context window (%s): the continuation of an aborted call without "
            "max_tokens gets the backend's default limit", backend.url, error
        )
        return None

    async def _held_back(self, deadline: float) -> bool:
        """:meth:`_released` for a call in flight: while it waits, it keeps no backend busy (``activity``)."""
        if self._gate is None:
            return True
        self.activity.end()
        try:
            return await self._released(deadline)
        finally:
            self.activity.begin()

    def _continuation_body(self, call: _Call, state: _Resumption) -> bytes:
        """The ``/v1/completions`` body that continues ``state`` token-exactly: the prompt ids and the ids so
        far as the prompt, what is left of the call's limit, and the call's own sampling parameters.

        Each part is sampled as the call asked, with two seams no completion can hide: a stop string split
        across an abort is not matched, and vLLM's presence / frequency penalties (off-policy parameters the
        trainer refuses or masks anyway) count only the part's own tokens.
        """
        request = call.request
        assert request is not None
        generated = len(state.ids)
        body = {key: request[key] for key in CONTINUED_FIELDS if request.get(key) is not None}
        body["prompt"] = state.prompt + state.ids
        if state.left is not None:  # a call without a limit: the rest of the context (see _continuation)
            body["max_tokens"] = state.left
        min_tokens = request.get("min_tokens")
        if type(min_tokens) is int and min_tokens > generated:
            body["min_tokens"] = min_tokens - generated
        seed = request.get("seed")
        if type(seed) is int:
            # Reproducible, and not the first tokens' random numbers over again (the same seed would replay them).
            body["seed"] = (seed + generated) % _SEED_SPACE
        if call.kind == "chat":
            if request.get("logprobs"):
                body["logprobs"] = request.get("top_logprobs") or 0
        elif request.get("logprobs") is not None:
            body["logprobs"] = request["logprobs"]
        body["return_token_ids"] = True
        if call.sse:
            body["stream"] = True
        else:
            body.pop("stream_options", None)
        return orjson.dumps(body)

    def _progressed(self, call: _Call, state: _Resumption, ids: list[int], aborted: bool) -> None:
        """Note a continuation's tokens: the call's versions, the refusal budget renewed, the resume latency.
        An answer aborted without a token counts as a refusal (an engine that still refuses)."""
        if not ids:
            state.refusals += aborted
            return
        if not state.ids:
            call.weight_version = state.version  # the aborted answer had no token: the first came from here
        call.weight_version_end = state.version
        state.ids.extend(ids)
        now = time.monotonic()
        if state.ready:
            self.m_resume_latency.observe(now - state.ready)
            state.ready = 0.0
        state.refusals = 0
        state.deadline = now + self.pause_timeout

    async def _relay_continuation(
        self, call: _Call, response: web.StreamResponse, upstream: aiohttp.ClientResponse, state: _Resumption
    ) -> bool | None:
        """Relay one continuation's stream in the call's chunk shape: ``True`` if it was aborted too (its
        tokens went out), ``False`` once it ended, ``None`` if the agent left; :class:`ProxyError` if it broke."""
        if not upstream.headers.get("Content-Type", "").startswith(_SSE):
            raise ProxyError(502, f"backend {call.backend} answered the streamed continuation with no stream")
        cut = _EventCut()
        content = upstream.content
        size, limit = 0, self.max_response_bytes
        while True:
            try:
                chunk = await content.readany()
            except TimeoutError:
                raise ProxyError(504, self._timed_out(call)) from None
            except (aiohttp.ClientError, OSError) as exc:
                raise ProxyError(502, f"backend {call.backend} broke off the continuation: {exc!r}") from exc
            if not chunk:
                rest = cut.rest()
                if not rest.strip():
                    return False
                chunk = rest + b"\n\n"  # a last event with no blank line after it
            size += len(chunk)
            if size > limit:
                raise ProxyError(502, f"backend continuation exceeds max_response_bytes={limit}")
            out: list[bytes] = []
            aborted = False
            for data in _payloads(cut.feed(chunk)):
                if data == b"[DONE]":
                    out.append(_DONE_EVENT)
                    continue
                event = _json_object(data)
                if event is None:
                    raise ProxyError(
                        502, f"backend {call.backend} sent a continuation event that is not JSON"
                    )
                if isinstance(event.get("error"), dict):
                    raise ProxyError(
                        502, f"backend failed while continuing: {_error_message(orjson.dumps(event))}"
                    )
                converted, aborted = self._converted(call, state, event)
                out.append(converted)
                if aborted:
                    break
            if out and not await self._forward(call, response, b"".join(out), call.capture, None):
                return None
            if aborted:
                await _drain(content)
                return True

    def _converted(self, call: _Call, state: _Resumption, event: dict[str, Any]) -> tuple[bytes, bool]:
        """A continuation's (completions) event as an event of the call's stream: ``(bytes, aborted)``.

        An aborted choice goes out without its finish reason (see :func:`_unfinish`); the usage chunk
        counts the call's own prompt and the whole generation.
        """
        head = state.head
        choices = _choices_of(event)
        if not choices:
            usage = event.get("usage")
            if not isinstance(usage, dict):
                return b"", False
            return _sse_event({**head, "choices": [], "usage": state.usage(usage)}), False
        c = choices[0]
        ids = c.get("token_ids")
        if type(ids) is not list:
            raise ProxyError(502, f"backend {call.backend} sent no token ids for the continuation")
        aborted = c.get("finish_reason") == "abort"
        if aborted:
            _unfinish(c, "completion")
        self._progressed(call, state, ids, aborted)
        text = c.get("text") or ""
        request = call.request or {}
        finish = c.get("finish_reason")
        if call.kind == "chat":
            logprobs = _chat_logprobs(c.get("logprobs"), request.get("top_logprobs") or 0)
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {"content": text},
                "logprobs": {"content": logprobs} if request.get("logprobs") else None,
                "finish_reason": finish,
            }
            if finish is not None:
                choice["stop_reason"] = c.get("stop_reason")
            choice["token_ids"] = ids
        else:
            choice = {**c, "index": 0, "prompt_token_ids": None}
            choice["logprobs"] = _offset_logprobs(c.get("logprobs"), state.chars)
            state.chars += len(text)
        return _sse_event({**head, "choices": [choice]}), aborted

    # ------------------------------------------------------------------ backend health
    def _eject(self, backend: _Backend, exc: BaseException) -> None:
        if backend.ejected or backend.removed:
            return
        backend.ejected = True
        backend.ejected_until = time.monotonic() + self.eject_seconds
        self.m_ejections.inc()
        logger.warning("backend %s ejected for %gs: %s", backend.url, self.eject_seconds, exc)
        if self._tg is not None and not backend.probing:
            backend.probing = True
            self._tg.start_soon(self._probe, backend)

    def _restore(self, backend: _Backend) -> None:
        if backend.ejected:
            backend.ejected = False
            logger.info("backend %s is back in rotation", backend.url)

    async def _probe(self, backend: _Backend) -> None:
        """Sleep until the ejection ends, probe; repeat until a probe passes or the backend is removed."""
        try:
            while backend.ejected and not backend.removed:
                await anyio.sleep(max(0.0, backend.ejected_until - time.monotonic()))
                if not backend.ejected or backend.removed:
                    break
                if await self._probe_once(backend):
                    self._restore(backend)
                else:
                    backend.ejected_until = time.monotonic() + self.eject_seconds
        finally:
            backend.probing = False

    async def _probe_once(self, backend: _Backend) -> bool:
        session = self._session
        if session is None:
            return False
        try:
            with anyio.fail_after(self.connect_timeout + PROBE_READ_TIMEOUT):
                async with session.get(URL(backend.url + PROBE_PATH), allow_redirects=False) as response:
                    await response.read()
                    return response.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False

    # ------------------------------------------------------------------ recording
    def _commit(self, call: _Call) -> None:
        """Put an attributed call in the store (once), as soon as its outcome is known.

        That is before the agent can see the end of the response: an agent that reports its rollout the
        moment it has its answer must not finish the rollout before its last call is recorded.
        """
        if call.records is not None or call.rollout_id is None or call.kind is None:
            return
        assert call.attempt_id is not None
        if call.capture is not None and call.capture.aborted and call.error is None:
            # An abort the proxy could not take out (a chunked JSON answer, an event it did not recognise):
            # a partial response must not be trained on as a whole one.
            self.m_resume_failed.inc(1, "unsupported")
            call.fail("the backend aborted the generation (finish_reason 'abort') and it was not resumed")
        call.records = self._records(call, time.monotonic() - call.t0)
        if not self.store.record_calls(call.rollout_id, call.attempt_id, call.records):
            self.m_unrecorded.inc()

    def _finish(self, call: _Call) -> None:
        """Count the call; record it if that has not happened, or mark its records failed if delivery failed."""
        end = time.monotonic()
        self.m_calls.inc(1, call.outcome)
        if call.upstream_end:
            upstream = call.upstream_end - call.upstream_start
            self.m_upstream.observe(upstream)
            self.m_added.observe(max(0.0, (end - call.t0) - upstream))
        if call.first_byte:
            self.m_first_byte.observe(call.first_byte - call.t0)
        if call.records is None:
            self._commit(call)
        elif call.error is not None:
            for record in call.records:  # recorded as answered, then the agent never got the answer
                if record.status == "ok":
                    record.status, record.error = "failed", call.error
                    record.response_token_ids = record.logprobs = record.finish_reason = record.limit = None

    def _records(self, call: _Call, latency: float) -> list[LLMCall]:
        capture = call.capture
        ok = call.error is None
        common: dict[str, Any] = {
            "rollout_id": call.rollout_id,
            "attempt_id": call.attempt_id,
            "seq": call.seq,
            "path": call.path,
            "backend": call.backend,
            "started_at": call.started_at,
            "latency": latency,
            "status": "ok" if ok else "failed",
            "error": call.error,
            "model": (capture.model if capture is not None else None) or call.model,
            "weight_version": call.weight_version,
            "weight_version_end": (
                call.weight_version if call.weight_version_end is None else call.weight_version_end
            ),
            "sampling": call.sampling,
            "off_policy": call.off_policy,
        }
        vocab = self.store.vocab_size
        choices = capture.result() if capture is not None else []
        if not choices:
            prompt = checked_token_ids(capture.prompt_ids, vocab) if capture is not None else None
            if ok:
                self.m_no_ids.inc()
            return [LLMCall(**common, prompt_token_ids=prompt, limit=call.limit)]
        records = []
        for idx, choice, ids, logprobs in choices:
            prompt = choice.prompt_ids if choice.prompt_ids is not None else capture.prompt_ids  # type: ignore[union-attr]
            # Whatever a backend sends as ids must be valid int64 ids below the vocabulary size, or it is
            # recorded as "no ids": one malformed answer must not reach (and break) a training batch.
            prompt, ids = checked_token_ids(prompt, vocab), checked_token_ids(ids, vocab)
            if ids is None:
                logprobs = None
            if not ok:
                ids = logprobs = None  # a broken call's partial output is never passed off as a response
            elif ids is None or prompt is None:
                self.m_no_ids.inc()
            if ids is not None:
                self.m_generated.inc(len(ids))
            records.append(
                LLMCall(
                    **common,
                    choice_index=idx,
                    prompt_token_ids=prompt,
                    response_token_ids=ids,
                    logprobs=logprobs,
                    finish_reason=choice.finish_reason if ok else None,
                    limit=_stop_limit(choice.finish_reason, ids, call.max_tokens) if ok else call.limit,
                )
            )
        return records
