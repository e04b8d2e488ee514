"""A vLLM-shaped OpenAI-compatible backend on loopback, for tests and benchmarks.

:class:`MockVLLM` answers ``POST /v1/chat/completions`` and ``POST /v1/completions`` the way vLLM does with
``"return_token_ids": true`` (see ``tests/fixtures/vllm/``): top-level ``prompt_token_ids`` for chat, per-choice
``prompt_token_ids`` for completions, ``choices[i].token_ids``, logprobs when asked, ``usage``, SSE streams with
``n`` choices interleaved by ``index``, ``stream_options.include_usage`` and ``data: [DONE]``. Token ids are
deterministic functions of the request (:func:`prompt_token_ids`, :func:`completion_token_ids`), so a test can
compute what a proxy must have recorded without asking the mock.

It also serves ``GET /v1/models`` and ``GET /health``, injects faults on the next generation calls (500, 429
with ``Retry-After``, a stall that never answers, a connection closed mid-stream, an answer without token ids),
and records what it saw: every request with its body, and how many generation calls the client abandoned.
A chat request with ``tools`` whose ``tool_choice`` is ``"required"`` or names a function is answered the way
vLLM's tool parser answers it: one call in ``message.tool_calls`` (streams: ``delta.tool_calls``, the name
first, the arguments piece by piece, one piece per generated token) and finish reason ``"tool_calls"``; the
arguments are the JSON object ``{"value": "t<id> t<id> ..."}`` of the generated ids (:func:`tool_arguments`).

Token-in, as vLLM 0.32 serves it: a chat request with ``kv_transfer_params["prompt_token_ids"]`` is generated
from those ids (its messages still shape the answer: tool calls), malformed or out-of-vocabulary ids are a 400
naming the field, ``echo`` or content other than text renders the messages instead (``prompt_ids`` makes the
mock ignore or refuse the field instead, as older servers do); ``POST /v1/chat/completions/render`` answers the
prompt ids of a chat request (``scale_out``: ``False`` answers 403 as vLLM without ``--enable-scale-out``,
``None`` serves no such route). Its model card's ``root`` is the model's name, or with ``tokenizer`` a directory
holding a Hugging Face tokenizer and chat template that give exactly the mock's prompt ids (one byte, one id:
:func:`write_tokenizer`), as vLLM's names the model's path.

For soak runs it can also fail a random fraction of generation calls and add random latency, from a seeded
generator so a run can be repeated.

With ``replay_dir`` it serves recorded vLLM bytes instead: a request whose method, path and body match a
recorded case (ignoring ``return_token_ids``, which a proxy may add) gets that case's status, content type and
exact body; streams are written in small pieces so SSE events straddle network chunks.

Per-request CPU is kept low (one ``orjson.dumps`` per body or event, no per-request parsing beyond the body)
because the proxy benchmark uses this mock as its backend.

This module is the server (routes, faults, records); its parts are :mod:`.mock_tokens` (the prompt ids and
what the mock generates), :mod:`.mock_answers` (the JSON bodies and SSE events) and :mod:`.mock_replay` (the
recorded cases). The names tests import from here are re-exported.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import random
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anyio
import orjson
from aiohttp import web
from anyio.abc import TaskStatus
from multidict import CIMultiDict, CIMultiDictProxy

from .._net import HttpListener
from .mock_answers import Generation, error_body
from .mock_replay import ReplayCase, load_replay_cases, replay_key, send_case
from .mock_tokens import (
    JINJA_TEMPLATES,
    VOCAB_SIZE,
    Template,
    completion_token_ids,
    forced_tool,
    prompt_token_ids,
    render_chat,
    token_logprob,
    tool_arguments,
    write_tokenizer,
)

__all__ = [
    "DEFAULT_MODEL",
    "JINJA_TEMPLATES",
    "VOCAB_SIZE",
    "MockVLLM",
    "ReplayCase",
    "SeenRequest",
    "completion_token_ids",
    "load_replay_cases",
    "prompt_token_ids",
    "render_chat",
    "token_logprob",
    "tool_arguments",
    "write_tokenizer",
]

DEFAULT_MODEL = "mock"
#: vLLM runs on uvicorn, whose idle keep-alive timeout is 5 s; the mock mirrors it so a proxy's pool is tested
#: against the same server-side close.
KEEPALIVE_SECONDS = 5.0
#: How long stop() lets the aiohttp runner close idle connections.
_CLOSE_TIMEOUT = 1.0
_SSE_TYPE = "text/event-stream; charset=utf-8"
_JSON_TYPE = "application/json"

FaultKind = Literal["error", "throttle", "stall", "break", "no_ids", "abort"]


# ---------------------------------------------------------------------------------------------- records
@dataclass(frozen=True, slots=True)
class SeenRequest:
    """One request the mock received: what a test asserts the proxy forwarded."""

    method: str
    path: str
    query: str
    headers: CIMultiDictProxy[str]
    body: bytes
    json: Any


@dataclass(slots=True)
class _Fault:
    kind: FaultKind
    status: int = 500
    retry_after: float = 0.0
    after_events: int = 1  # "break": stream events sent first; "abort": tokens generated first
    release: anyio.Event | None = None  # "abort": a stream sends the abort once this is set


# ---------------------------------------------------------------------------------------------- the server
class MockVLLM:
    """A loopback vLLM look-alike; see the module docstring.

    ``latency`` is slept before each generation answer, ``chunk_latency`` between stream events (and between
    replayed pieces); ``completion_tokens`` is how many tokens each choice gets before it ends on its own
    (finish reason ``"stop"``), unless the request's ``max_tokens`` or ``max_model_len`` cuts it short
    (``"length"``). With ``max_model_len``, a prompt that with its ``max_tokens`` does not fit is refused with
    vLLM's 400, and a request without ``max_tokens`` may fill the rest of the window.
    ``record_requests=False`` keeps memory flat in long benchmarks. ``response_headers`` are added to every
    generation answer (e.g. hop-by-hop headers a proxy must not pass on). ``eof_delay`` is slept between a
    stream's last event and the end of its body, as a server that flushes ``[DONE]`` first may do.

    Random faults (all off by default): ``failure_rate`` is the probability that a generation call with no
    injected fault pending is answered at once with ``failure_status`` (an OpenAI-shaped error body);
    ``latency_jitter`` adds a uniform random ``[0, latency_jitter)`` seconds to ``latency``; both draw from
    ``random.Random(seed)``. :attr:`failed_randomly` counts the calls failed that way.

    Token-in (see the module docstring): ``prompt_ids`` is how a chat request's
    ``kv_transfer_params["prompt_token_ids"]`` is taken (``"use"``: generated from, as vLLM 0.32; ``"ignore"``:
    the messages rendered instead; ``"refuse"``: a 400 naming the field); ``scale_out`` serves the render route
    (``False``: 403, ``None``: absent); ``tokenizer`` writes the mock's tokenizer and template in a temporary
    directory while serving (:attr:`tokenizer_dir`) and names it as the model card's ``root``.

    Use ``async with MockVLLM() as mock:`` or ``await tg.start(mock.serve)``; ``mock.url`` is then
    ``http://127.0.0.1:PORT`` (no ``/v1``). It can be stopped and started again on the same port (pass
    ``port=``) to simulate a backend that goes away and comes back.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model: str = DEFAULT_MODEL,
        latency: float = 0.0,
        chunk_latency: float = 0.0,
        completion_tokens: int = 8,
        replay_dir: str | Path | None = None,
        record_requests: bool = True,
        response_headers: Mapping[str, str] | None = None,
        eof_delay: float = 0.0,
        failure_rate: float = 0.0,
        failure_status: int = 500,
        latency_jitter: float = 0.0,
        seed: int | None = None,
        max_model_len: int | None = None,
        template: Template = "plain",
        scale_out: bool | None = True,
        tokenizer: bool = False,
        prompt_ids: Literal["use", "ignore", "refuse"] = "use",
    ) -> None:
        if not 0.0 <= failure_rate <= 1.0:
            raise ValueError(f"failure_rate is a probability in [0, 1], got {failure_rate}")
        if latency_jitter < 0:
            raise ValueError(f"latency_jitter must be >= 0, got {latency_jitter}")
        self.host = host
        self.port = port
        self.model = model
        self.latency = latency
        self.chunk_latency = chunk_latency
        self.completion_tokens = completion_tokens
        self.max_model_len = max_model_len
        self.template: Template = template
        self.scale_out = scale_out
        self.tokenizer = tokenizer
        self.prompt_ids = prompt_ids
        #: The directory of the tokenizer the model card names (with ``tokenizer``, while serving).
        self.tokenizer_dir: Path | None = None
        self.record_requests = record_requests
        self.response_headers = dict(response_headers or {})
        self.eof_delay = eof_delay
        self.failure_rate = failure_rate
        self.failure_status = failure_status
        self.latency_jitter = latency_jitter
        self._rng = random.Random(seed)
        self.replay_cases = load_replay_cases(replay_dir) if replay_dir is not None else {}
        self._replay = {replay_key(c.method, c.path, c.body): c for c in self.replay_cases.values()}
        #: Every request received, in arrival order (when ``record_requests``).
        self.requests: list[SeenRequest] = []
        #: Generation calls the client abandoned (disconnected) before the mock finished answering.
        self.cancelled = 0
        #: Generation calls answered completely.
        self.completed = 0
        #: Generation calls whose connection the mock closed on purpose (``break_next``).
        self.broken = 0
        #: Generation calls being answered right now.
        self.active = 0
        #: Generation calls answered with ``failure_status`` by the random ``failure_rate``.
        self.failed_randomly = 0
        #: Streams holding their abort until the event given to :meth:`abort_next` is set.
        self.aborting = 0
        self._faults: deque[_Fault] = deque()
        self._ids = itertools.count()
        self._changed: anyio.Event | None = None  # exists while someone is in wait_until()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._http: HttpListener | None = None
        self._url: str | None = None
        self._stopping = False

    # ------------------------------------------------------------------ fault injection
    def fail_next(self, count: int = 1, *, status: int = 500) -> None:
        """The next ``count`` generation calls get ``status`` with an OpenAI-shaped error body."""
        self._faults.extend(_Fault("error", status=status) for _ in range(count))

    def throttle_next(self, count: int = 1, *, retry_after: float = 0.0) -> None:
        """The next ``count`` generation calls get 429 with ``Retry-After: retry_after`` (seconds)."""
        self._faults.extend(_Fault("throttle", status=429, retry_after=retry_after) for _ in range(count))

    def stall_next(self, count: int = 1) -> None:
        """The next ``count`` generation calls are never answered (until the client goes away)."""
        self._faults.extend(_Fault("stall") for _ in range(count))

    def break_next(self, count: int = 1, *, after_events: int = 1) -> None:
        """The next ``count`` calls lose their connection: streams after ``after_events`` events, others at once."""
        self._faults.extend(_Fault("break", after_events=after_events) for _ in range(count))

    def abort_next(
        self, count: int = 1, *, after_tokens: int = 2, release: anyio.Event | None = None
    ) -> None:
        """The next ``count`` generation calls are aborted (finish reason ``"abort"``, as an engine aborts them for
        a weight update) after ``after_tokens`` tokens. With ``release``, the abort goes out only once it is
        set: a stream's events before the aborting one first, a whole answer all of it (:attr:`aborting` counts
        the answers waiting so)."""
        self._faults.extend(_Fault("abort", after_events=after_tokens, release=release) for _ in range(count))

    def omit_ids_next(self, count: int = 1) -> None:
        """The next ``count`` generation calls are answered without token ids, as if not asked for them."""
        self._faults.extend(_Fault("no_ids") for _ in range(count))

    # ------------------------------------------------------------------ observation
    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("MockVLLM is not serving")
        return self._url

    def generation_requests(self) -> list[SeenRequest]:
        """The recorded POSTs to ``/v1/chat/completions`` and ``/v1/completions``."""
        return [r for r in self.requests if r.method == "POST" and r.path.endswith("completions")]

    def expected(self, body: Mapping[str, Any]) -> list[tuple[list[int], list[int]]]:
        """``(prompt_ids, response_ids)`` per choice, in index order, that this mock answers ``body`` with."""
        kind = "chat" if "messages" in body else "completion"
        prompt = self._given_prompt(body)[0] if kind == "chat" else None
        budget = functools.partial(self._budget, body)
        gen = Generation(kind, body, budget, True, self.model, self.template, prompt)
        return [(c.prompt, c.ids) for c in gen.choices]

    async def wait_until(self, predicate: Callable[[MockVLLM], bool]) -> None:
        """Return once ``predicate(self)`` holds; re-checked whenever a request starts or ends.

        Waits on an event, never polls; bound it with ``anyio.fail_after`` in tests.
        """
        while not predicate(self):
            if self._changed is None:
                self._changed = anyio.Event()
            await self._changed.wait()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    # ------------------------------------------------------------------ life cycle
    async def start(self) -> None:
        """Bind and start answering; returns once the listener accepts connections."""
        if self._http is not None:
            raise RuntimeError("MockVLLM is already serving")
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        if self.scale_out is not None:
            app.router.add_post("/v1/chat/completions/render", self._render)
        if self.tokenizer and self.tokenizer_dir is None:
            self.tokenizer_dir = write_tokenizer(tempfile.mkdtemp(prefix="mock-tokenizer-"), self.template)
        http = HttpListener(
            app, self.host, self.port, keepalive_timeout=KEEPALIVE_SECONDS, shutdown_timeout=_CLOSE_TIMEOUT
        )
        self._url = await http.start()
        self._http, self.port = http, http.port
        self._stopping = False

    async def stop(self) -> None:
        """Stop listening, abandon calls in progress (counted neither as cancelled nor completed), close all."""
        http, self._http = self._http, None
        if http is None:
            return
        self._stopping = True
        with anyio.CancelScope(shield=True):
            await http.stop(self._tasks, cancel_wait=_CLOSE_TIMEOUT)
        if self.tokenizer_dir is not None:
            shutil.rmtree(self.tokenizer_dir, ignore_errors=True)
            self.tokenizer_dir = None

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled, then :meth:`stop`; ``task_status.started()`` once accepting connections."""
        await self.start()
        task_status.started()
        try:
            await anyio.sleep_forever()
        finally:
            await self.stop()

    async def __aenter__(self) -> MockVLLM:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ handlers
    async def _health(self, request: web.Request) -> web.Response:
        self._seen(request, b"", None)
        return web.Response()

    async def _models(self, request: web.Request) -> web.Response:
        self._seen(request, b"", None)
        card = {"id": self.model, "object": "model", "created": int(time.time()), "owned_by": "vllm"}
        root = self.model if self.tokenizer_dir is None else str(self.tokenizer_dir)
        card |= {"root": root, "parent": None, "max_model_len": self.max_model_len or 4096}
        return web.Response(body=orjson.dumps({"object": "list", "data": [card]}), content_type=_JSON_TYPE)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    def _seen(self, request: web.Request, raw: bytes, body: Any) -> None:
        if self.record_requests:
            headers = CIMultiDictProxy(CIMultiDict(request.headers))
            self.requests.append(
                SeenRequest(request.method, request.path, request.query_string, headers, raw, body)
            )
        self._notify()

    @staticmethod
    def _max_tokens(body: Mapping[str, Any]) -> int | None:
        limit = body.get("max_tokens") or body.get("max_completion_tokens")
        return limit if isinstance(limit, int) else None

    def _budget(self, body: Mapping[str, Any], prompt: Sequence[int]) -> tuple[int, str]:
        """Tokens generated for ``prompt`` and the finish reason: "length" when ``max_tokens`` or the context
        window (``max_model_len``, which a request without ``max_tokens`` may fill) cut the answer short."""
        return self._budget_for(self._max_tokens(body), prompt)

    def _budget_for(self, limit: int | None, prompt: Sequence[int]) -> tuple[int, str]:
        if limit is None and self.max_model_len is not None:
            limit = self.max_model_len - len(prompt)  # vLLM's default: the rest of the window
        if limit is not None and limit <= self.completion_tokens:
            # The mock's model would say completion_tokens tokens and then end: a limit at or below that
            # stops it before its end-of-sequence token, as an engine reports it.
            return max(limit, 0), "length"
        return self.completion_tokens, "stop"

    def _too_long(self, body: Mapping[str, Any], given: list[int] | None = None) -> web.Response | None:
        """vLLM's 400 for a prompt that, with the tokens asked for, does not fit in ``max_model_len``."""
        if self.max_model_len is None:
            return None
        asked = self._max_tokens(body) or 0
        for prompt in [given] if given is not None else prompt_token_ids(body, self.template):
            if len(prompt) + asked > self.max_model_len or len(prompt) >= self.max_model_len:
                message = (
                    f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                    f"requested {len(prompt) + asked} tokens ({len(prompt)} in the messages, {asked} in the "
                    "completion). Please reduce the length of the messages or completion."
                )
                return _json_error(400, message, "BadRequestError")
        return None

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.active += 1
        fault = self._faults.popleft() if self._faults else self._random_fault()
        done = False
        try:
            response = await self._answer(request, kind, fault)
            done = True
            return response
        except asyncio.CancelledError:
            if fault is not None and fault.kind == "break":
                self.broken += 1
            elif not self._stopping:
                self.cancelled += 1
            raise
        finally:
            self._tasks.discard(task)
            self.active -= 1
            if done:
                self.completed += 1
            self._notify()

    def _random_fault(self) -> _Fault | None:
        if self.failure_rate > 0 and self._rng.random() < self.failure_rate:
            self.failed_randomly += 1
            return _Fault("error", status=self.failure_status)
        return None

    def _delay(self) -> float:
        if self.latency_jitter > 0:
            return self.latency + self._rng.uniform(0.0, self.latency_jitter)
        return self.latency

    async def _answer(self, request: web.Request, kind: str, fault: _Fault | None) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            self._seen(request, raw, None)
            return _json_error(400, f"invalid JSON body: {exc}", "BadRequestError")
        self._seen(request, raw, body)
        if fault is not None and fault.kind not in ("no_ids", "abort"):
            return await self._fault(request, fault, body)
        delay = self._delay()
        if delay > 0:
            await anyio.sleep(delay)
        if self._replay:
            return await self._replay_answer(request, body)
        if not isinstance(body, dict):
            return _json_error(400, "request body must be a JSON object", "BadRequestError")
        if body.get("model") != self.model:
            return _json_error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
        prompt: list[int] | None = None
        if kind == "chat":
            prompt, refusal = self._given_prompt(body)
            if refusal is not None:
                return refusal
        refusal = self._too_long(body, prompt)
        if refusal is not None:
            return refusal
        with_ids = body.get("return_token_ids") is True and (fault is None or fault.kind == "abort")
        budget = functools.partial(self._budget, body)
        gen = Generation(kind, body, budget, with_ids, self.model, self.template, prompt)
        release = None
        if fault is not None and fault.kind == "abort":
            gen.abort_after(fault.after_events)
            release = fault.release
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        request_id = f"{prefix}-mock{next(self._ids)}"
        if body.get("stream") is True:
            events = gen.events(request_id)
            held = None
            if release is not None:  # the aborting event waits for the release
                held = (next(i for i, e in enumerate(events) if b'"abort"' in e), release)
            return await self._stream(request, events, release=held)
        if release is not None:
            await self._held(release)
        headers = {**self.response_headers, "Content-Type": _JSON_TYPE}
        return web.Response(body=gen.response(request_id), headers=headers)

    async def _held(self, release: anyio.Event) -> None:
        """Wait for ``release`` as an answer holding its abort (counted in :attr:`aborting`)."""
        self.aborting += 1
        self._notify()
        try:
            await release.wait()
        finally:
            self.aborting -= 1

    def _given_prompt(self, body: Mapping[str, Any]) -> tuple[list[int] | None, web.Response | None]:
        """The prompt ids a chat request gives in ``kv_transfer_params["prompt_token_ids"]`` (``None``: render
        its messages), or vLLM's 400 for ids it refuses (see ``prompt_ids``)."""
        params = body.get("kv_transfer_params")
        if not isinstance(params, dict) or "prompt_token_ids" not in params:
            return None, None
        if self.prompt_ids == "refuse":
            message = "kv_transfer_params: Extra inputs are not permitted"
            return None, _json_error(400, message, "BadRequestError")
        messages = body.get("messages") or []
        non_text = any(
            isinstance(m, dict)
            and isinstance(m.get("content"), list)
            and any(not isinstance(p, dict) or p.get("type") != "text" for p in m["content"])
            for m in messages
        )
        if self.prompt_ids == "ignore" or body.get("echo") or non_text:
            return None, None
        ids = params["prompt_token_ids"]
        try:  # min / max in C: the mock stays cheap per call for the benchmarks
            valid = isinstance(ids, list) and bool(ids) and type(ids[0]) is int and 0 <= min(ids) <= max(ids) < VOCAB_SIZE  # fmt: skip
        except TypeError:
            valid = False
        if not valid:
            message = (
                "`kv_transfer_params['prompt_token_ids']` must be a non-empty list of token ids below the "
                f"vocabulary size ({VOCAB_SIZE})"
            )
            error = orjson.loads(error_body(400, message, "BadRequestError"))
            error["error"]["param"] = "kv_transfer_params.prompt_token_ids"
            return None, web.Response(status=400, body=orjson.dumps(error), content_type=_JSON_TYPE)
        return ids, None

    async def _stream(
        self,
        request: web.Request,
        events: Sequence[bytes],
        break_after: int = -1,
        release: tuple[int, anyio.Event] | None = None,
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={**self.response_headers, "Content-Type": _SSE_TYPE})
        await response.prepare(request)
        for i, event in enumerate(events):
            if i == break_after:
                await self._break(request)
            if release is not None and i == release[0]:
                await self._held(release[1])
            if i and self.chunk_latency > 0:
                await anyio.sleep(self.chunk_latency)
            await response.write(event)
        if self.eof_delay > 0:
            await anyio.sleep(self.eof_delay)
        await response.write_eof()
        return response

    async def _fault(self, request: web.Request, fault: _Fault, body: Any) -> web.StreamResponse:
        if fault.kind == "error":
            return _json_error(fault.status, f"injected failure ({fault.status})", "InternalServerError")
        if fault.kind == "throttle":
            response = _json_error(429, "injected rate limit", "RateLimitError")
            response.headers["Retry-After"] = f"{fault.retry_after:g}"
            return response
        if fault.kind == "stall":
            await anyio.sleep_forever()
        # "break": a stream loses its connection after some events, anything else before any answer.
        if isinstance(body, dict) and body.get("stream") is True:
            gen = Generation(
                "chat" if "messages" in body else "completion",
                body,
                functools.partial(self._budget, body),
                True,
                self.model,
            )
            return await self._stream(request, gen.events("broken"), break_after=fault.after_events)
        await self._break(request)
        raise AssertionError("unreachable")  # pragma: no cover

    @staticmethod
    async def _break(request: web.Request) -> None:
        """Close the connection without ending the response, then wait for aiohttp to cancel this handler.

        An orderly close (FIN) rather than a reset: the bytes already written still reach the client, which then
        sees a truncated chunked body (or no response at all), like a backend process that died.
        """
        transport = request.transport
        if transport is not None:
            transport.close()
        await anyio.sleep_forever()

    async def _replay_answer(self, request: web.Request, body: Any) -> web.StreamResponse:
        case = self._replay.get(replay_key(request.method, request.path, body))
        if case is None:
            return _json_error(404, "no recorded response matches this request", "NotFoundError")
        return await send_case(request, case, self.chunk_latency)

    # ------------------------------------------------------------------ the render route (vLLM --enable-scale-out)
    def _scale_out_refusal(self, request: web.Request) -> web.Response | None:
        if self.scale_out:
            return None
        self._seen(request, b"", None)
        message = (
            "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
        )
        return _json_error(403, message, "PermissionDeniedError")

    async def _read_json(self, request: web.Request) -> tuple[Any, web.Response | None]:
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            self._seen(request, raw, None)
            return None, _json_error(400, f"invalid JSON body: {exc}", "BadRequestError")
        self._seen(request, raw, body)
        if not isinstance(body, dict):
            return None, _json_error(400, "request body must be a JSON object", "BadRequestError")
        if body.get("model") not in (None, self.model):
            return None, _json_error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
        return body, None

    async def _render(self, request: web.Request) -> web.Response:
        """``POST /v1/chat/completions/render``: the chat request's prompt ids and sampling parameters."""
        if (refusal := self._scale_out_refusal(request)) is not None:
            return refusal
        body, error = await self._read_json(request)
        if error is not None:
            return error
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            return _json_error(400, "messages must be a non-empty list", "BadRequestError")
        [ids] = prompt_token_ids(body, self.template)
        limit = self._max_tokens(body)
        if limit is None and self.max_model_len is not None:
            limit = self.max_model_len - len(ids)
        logprobs = (body.get("top_logprobs") or 0) if body.get("logprobs") else None
        forced = forced_tool(body)
        sampling = {
            "n": 1,
            "temperature": body.get("temperature", 1.0),
            "top_p": body.get("top_p", 1.0),
            "top_k": body.get("top_k", 0),
            "seed": body.get("seed"),
            "max_tokens": limit if limit is not None else 16,
            "min_tokens": body.get("min_tokens", 0),
            "logprobs": logprobs,
            "stop": body.get("stop") or [],
            "structured_outputs": {"json": {"type": "array"}} if forced is not None else None,
        }
        answer = {
            "request_id": f"chatcmpl-mock{next(self._ids)}",
            "token_ids": ids,
            "features": None,
            "sampling_params": sampling,
            "model": body.get("model"),
            "stream": bool(body.get("stream")),
            "stream_options": body.get("stream_options") if body.get("stream") else None,
            "output_mode": "tokens",
            "cache_salt": None,
            "priority": 0,
        }
        return web.Response(body=orjson.dumps(answer), content_type=_JSON_TYPE)


def _json_error(status: int, message: str, type_: str) -> web.Response:
    return web.Response(
        status=status, body=error_body(status, message, type_), headers={"Content-Type": _JSON_TYPE}
    )
