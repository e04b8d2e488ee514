"""One call on its way through the proxy, the errors the proxy answers itself, and header forwarding.

The vocabulary every part of :mod:`aglverl.proxy` shares; it depends only on the pure modules (a call carries
its :mod:`~aglverl.proxy.capture`, its backend's :mod:`~aglverl.proxy.dialect` and its token-in
:mod:`~aglverl.proxy.session` plan):

- :class:`Call` — one agent request from admission to its records: what goes upstream (method, target,
  end-to-end headers, body, the parsed request), what came back (backend, weight versions, timings), how it
  ended (``outcome``, ``error``; :meth:`Call.fail` keeps the first error and never touches a call whose agent
  already has its whole answer).
- :class:`ProxyError` — an answer the proxy makes itself: an HTTP status and a message naming what was wrong,
  OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``) or in a translated call's own API.
  :class:`Unreachable` — an upstream try that got no response at all, raised only while nothing has reached
  the agent (so it is always safe to retry).
- :func:`forward_headers` — the end-to-end headers of a message (RFC 9110 hop-by-hop ones, ``Proxy-*``, those
  named in ``Connection`` and a ``drop`` set removed); :func:`error_message` — the message of an error body.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Literal

import orjson
from multidict import CIMultiDict, MultiMapping

from ..store import LLMCall
from .api import Translator
from .capture import Capture
from .dialect import DEFAULT, Dialect
from .http import Answer, Exchange
from .reshape import CompletionAsChat
from .session import Plan

#: Largest error body kept from a retried 5xx/429, to pass through if no retry succeeds.
ERROR_BODY_LIMIT = 64 << 10

SSE = "text/event-stream"
JSON = "application/json"

_ERROR_TYPES: Mapping[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    414: "URITooLongError",
    417: "ExpectationFailedError",
    429: "RateLimitError",
    431: "RequestHeaderFieldsTooLargeError",
    500: "InternalServerError",
    501: "NotImplementedError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
    505: "HTTPVersionNotSupportedError",
}

Outcome = Literal["ok", "upstream_error", "failed", "cancelled", "rejected"]
_JSON_HEADERS: Mapping[str, str] = {"Content-Type": JSON}


class ProxyError(Exception):
    """A call the proxy answers itself, with an HTTP ``status`` and a message naming what was wrong (and the
    offending request field, ``param``, when there is one; ``headers`` the answer carries, e.g. a 429's
    ``Retry-After``; ``code``, a translated API's own error code)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        *,
        headers: Mapping[str, str] | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers
        self.code = code

    def body(self, translator: Translator | None = None) -> bytes:
        """OpenAI-shaped, or in the API of a translated call."""
        if translator is not None:
            return translator.error(self.status, self.message, self.param, self.code)
        return error_body(self.status, self.message)

    def answer(self, translator: Translator | None = None) -> Answer:
        """The whole answer the agent gets: the body (:meth:`body`) as JSON, with :attr:`headers`."""
        headers = {"Content-Type": JSON, **self.headers} if self.headers else _JSON_HEADERS
        return Answer(self.status, self.body(translator), headers)

    async def send(self, exchange: Exchange, translator: Translator | None = None) -> None:
        """Write :meth:`answer` to the agent (``ConnectionResetError`` when it has gone)."""
        answer = self.answer(translator)
        await exchange.send_whole(answer.status, answer.headers, answer.body)


def error_body(status: int, message: str) -> bytes:
    error = {"message": message, "type": _ERROR_TYPES.get(status, "Error"), "param": None, "code": status}
    return orjson.dumps({"error": error})


class Unreachable(Exception):
    """An upstream try that got no response at all (connection refused, reset or closed before answering)."""


class Call:
    """One agent request on its way through the proxy."""

    __slots__ = (
        "attempt_id",
        "backend",
        "body",
        "capture",
        "delivered",
        "dialect",
        "error",
        "exchange",
        "fill",
        "first_byte",
        "given",
        "headers",
        "kind",
        "limit",
        "max_tokens",
        "method",
        "model",
        "off_policy",
        "outcome",
        "path",
        "prompt_ids",
        "records",
        "request",
        "reshape",
        "rewrite",
        "rollout_id",
        "sampling",
        "seq",
        "sse",
        "started_at",
        "t0",
        "tail",
        "target",
        "text",
        "tokenin",
        "translator",
        "upstream_end",
        "upstream_start",
        "weight_version",
        "weight_version_end",
        "wire",
    )

    def __init__(
        self,
        seq: int,
        t0: float,
        rollout_id: str | None,
        attempt_id: str | None,
        exchange: Exchange | None = None,
    ) -> None:
        self.seq = seq
        #: The agent's request and answer (what the proxy writes to the agent through; ``None``: a call made
        #: without an agent's request, as a part is tested alone).
        self.exchange = exchange
        self.t0 = t0
        self.started_at = time.time()
        self.rollout_id = rollout_id
        self.attempt_id = attempt_id
        self.method = "GET"
        self.path = ""
        self.target = ""
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.body = b""
        #: What its attempt's gateway rule sets on a JSON body once it is read (:mod:`~aglverl.proxy.gateway`:
        #: the hop's rewrite, for an agent aglverl's runner started); ``None``: the body goes as it came.
        self.rewrite: Mapping[str, Any] | None = None
        self.kind: Literal["chat", "completion"] | None = None
        self.model: str | None = None
        self.capture: Capture | None = None
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
        # A recorded call before its wire is chosen: the agent's body (translated) as it came, parsed, and the
        # trainer's sampling parameters it omitted; what prepare() spells in a backend's dialect.
        self.text = b""
        self.given: dict[str, Any] = {}
        self.fill: dict[str, Any] = {}
        self.wire: Dialect | None = None  # the dialect the body is spelled in (prepare)
        self.prompt_ids: list[int] | None = None  # token-in: the ids the call is made from
        self.reshape: CompletionAsChat | None = (
            None  # token-in answered as a completion: spelled back as chat
        )
        # The weight version of the call's first and last tokens: the backend's X-Weight-Version when it sends
        # one, else the proxy's version when the answer (or the continuation) was asked for.
        self.weight_version = 0
        self.weight_version_end: int | None = None
        self.backend = ""
        self.dialect: Dialect = DEFAULT  # the backend's, once a try went to one
        self.sse = False
        self.tail = b""
        self.first_byte = 0.0
        self.upstream_start = 0.0
        self.upstream_end = 0.0
        self.outcome: Outcome = "ok"
        self.error: str | None = None
        self.records: list[LLMCall] | None = None  # what was put in the store, once it was
        self.delivered = False  # the agent has the complete response: nothing can fail the call any more
        # Its attempt's token-in session: the turn it extends (generated from ids), and what to remember it by.
        self.tokenin: Plan | None = None

    def prepare(self, dialect: Dialect, logprobs: bool) -> None:
        """Spell a recorded call in ``dialect``'s wire, for a try to a backend that speaks it (once per dialect):
        its body gets the fields that make the answer carry ids (and, with ``logprobs``, the sampled tokens'
        log-probs), each unless the agent set it, spliced in as text so that every other byte of the agent's
        body reaches the backend untouched; a call made from prompt ids (:attr:`prompt_ids`) becomes the
        dialect's token-in request, on its route, its answer spelled back as chat when it comes as a
        completion. The capture reads the dialect's answers."""
        if self.wire is dialect or self.kind is None:
            return
        self.wire = dialect
        given = self.given
        fields = {k: v for k, v in dialect.request_fields(self.kind, logprobs).items() if k not in given}
        self.request = {**given, **self.fill, **fields}
        self.body = splice(self.text, given, {**self.fill, **fields})
        capture = self.capture
        if capture is not None and capture.wire is not dialect.wire:
            self.capture = dialect.capture(self.kind, capture.answers)
        self.reshape = None
        if self.prompt_ids is not None:
            made = dialect.token_in(self.body, self.request, self.prompt_ids)
            self.body = made.body
            if made.target is not None:
                self.target = made.target
            if made.answer == "completion":
                self.reshape = CompletionAsChat(dialect.wire, self.request)

    def fail(self, error: str, outcome: Outcome = "failed") -> None:
        """Mark the call failed with its first error; a call already delivered stays as it is."""
        if self.error is None and not self.delivered:
            self.error = error
            self.outcome = outcome


def splice(body: bytes, given: Mapping[str, Any], fill: dict[str, Any]) -> bytes:
    """``body`` (the JSON object ``given`` as the agent wrote it) with ``fill``'s fields added: spliced in as
    text after its opening brace, every other byte kept, or re-encoded when a field it fills was sent as
    ``null`` (replaced)."""
    if not fill:
        return body
    if any(key in given for key in fill):
        return orjson.dumps({**given, **fill})
    i = body.index(b"{") + 1
    added = orjson.dumps(fill)[1:-1]  # its members as one object spells them (field names are strings)
    return body[:i] + added + (b"," if given else b"") + body[i:]


def forward_headers(headers: MultiMapping[str], drop: frozenset[str]) -> CIMultiDict[str]:
    """The end-to-end headers of ``headers``: hop-by-hop ones, ``Proxy-*`` and those named in ``Connection``
    removed, as well as ``drop``."""
    named = headers.get("Connection")
    if named:
        drop = drop | {token.strip().lower() for token in named.split(",")}
    # One pass that keeps what goes on (hot path: twice a call): cheaper than a copy and a popall per name.
    out: CIMultiDict[str] = CIMultiDict()
    add = out.add
    for name, value in headers.items():
        lower = name.lower()
        if lower not in drop and lower[:6] != "proxy-":
            add(name, value)
    return out


def error_message(body: bytes, limit: int = 500) -> str:
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


def token_limit(request: Mapping[str, Any]) -> int | None:
    """The call's limit on generated tokens: ``max_completion_tokens``, else ``max_tokens`` (a ``null`` one
    counts as omitted, as the backend reads it); ``None`` when the call sets none."""
    limit = request.get("max_completion_tokens")
    if limit is None:
        limit = request.get("max_tokens")
    return limit if type(limit) is int else None
