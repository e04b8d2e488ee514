"""Token-in chat: a call that extends a recorded turn is generated from that turn's exact ids.

A black-box agent sends its history back as text; re-rendered and re-tokenized, the history's ids drift from
the ids the engine generated, and a conversation never merges into one training row. :class:`TokenIn` keeps
the attempt's :class:`~aglverl.proxy.session.Sessions` and, for a chat call whose messages extend a recorded
turn's messages + answer (:class:`~aglverl.proxy.session.Match`), makes the generation itself on the
backend's token-in endpoints (vLLM ``--enable-scale-out``; the embedded engine serves the same):

1. **The tail's ids, alone.** ``POST /v1/chat/completions/render`` renders a tiny fixed conversation (user
   ``"a"``, assistant ``"b"``: the *anchor*) followed by the tail (tool / user messages, the generation
   prompt) under the call's tools and template arguments. The anchor rendered alone (no generation prompt;
   cached per backend x rendering context, with an assistant ``"c"`` variant) gives the template's end-of-turn
   id (the first id after the assistant's content) and the *glue* after it (ChatML's ``"\\n"``). When the
   anchor's ids are a prefix of the rendering, the tail's ids are the rest; a template that renders a final
   assistant turn differently from an earlier one (Qwen3 adds an empty think block) is read by rendering the
   tail after both anchor variants and keeping their common suffix instead (remembered per context, so later
   calls send both renders at once). The prompt is then ``turn.prompt + turn.response + [end of turn, when
   the answer did not end with it (a length stop)] + glue + tail``: every earlier id exactly as generated
   (reasoning a template would drop included), so the model at inference sees what the trainer will, and
   the call's prompt extends the turn's prompt + response by construction. The render's answer also gives
   the call's sampling parameters (vLLM's own reading of the request); ``max_tokens`` is the call's limit,
   or what is left of the backend's context window (``max_model_len`` of its ``/v1/models``, read once).
2. **Generation from ids.** ``POST /inference/v1/generate``, streamed or not as the agent asked, logprobs
   when the call has them. A generation the backend aborts (a weight update) is continued from the prompt +
   the ids so far by another generate call once the proxy is no longer held (a hold does not spend the
   ``pause_timeout`` budget; refusals are retried with the retry policy's backoff until it is spent); a
   whole answer under structured output (``tool_choice`` required or named, a ``response_format``), whose
   grammar a continuation would restart, is made again from the start, a stream of one ends with a 503.
3. **The answer the chat endpoint would give.** ``POST /v1/chat/completions/derender`` turns the generated
   ids into a chat completion through the backend's own tool-call and reasoning parsers (the whole output at
   once, so tool calls survive a continuation), with the tail's ids as ``prompt_token_ids`` and the agent's
   request (its messages replaced by the tail) as ``chat_request``. A stream is derendered chunk by chunk,
   one derender in flight per stream: the generate chunks that arrived meanwhile go as one, so the round trips
   per token shrink when the backend outpaces the derender. The agent gets ordinary ``chat.completion``
   JSON or ``chat.completion.chunk`` events, usage when asked, ``[DONE]``; a Responses / Messages call gets
   them through its translator. vLLM 0.32's derender differs from its chat endpoint in four ways, each put
   right here: with a parser configured it writes the text of the token a generation stopped on (a probe
   derender per backend x context finds out; such a token is then not derendered, its logprob entry kept),
   it leaves ``finish_reason`` ``stop`` on a whole answer with tool calls (``tool_calls`` unless the call
   named the function), its tool-call ids lack the ``chatcmpl-tool-`` prefix, and its stream deltas carry null
   fields (dropped). The record's finish reason is the one the agent gets.

The record: prompt ids = the ids generated from, response ids = the generated ids (all continuations), the
engine's logprobs, finish reason, weight versions (the backend's ``X-Weight-Version``, else digit labels of
vLLM's ``weight_versions``, else the proxy's version), sampling as admitted.

Falling back: nothing of the answer has reached the agent until the derender of its first piece, so until
then any failure relays the call as text instead (the proxy's ordinary path, a new chain), counted by cause in
``aglverl_proxy_token_in_total{outcome}``: ``no_backend`` (render answered 404 / 403 "Scale-out endpoints are
disabled": detected once per backend and warned about once, naming what is missing), ``render_error``,
``anchor_mismatch`` (a template whose anchor cannot be read), ``generate_refused``, ``derender_error``; a call
generated from ids counts ``generated``, and the calls never matched count their
:data:`~aglverl.proxy.session.MISSES` cause. Past that point a failure ends the answer the way the relay ends
a broken stream. Cancellation (the agent left, shutdown) closes every upstream request of the call.

Its interface, as the proxy uses it: :meth:`TokenIn.admit` (synchronous: read a recorded chat call against its
attempt's session), :meth:`TokenIn.run` (make a matched call from ids and answer the agent; ``None``: relay it
as text), :meth:`TokenIn.forget` (the rollouts the store forgets); the recorder remembers each recorded turn in
the same :class:`~aglverl.proxy.session.Sessions`. It holds the config, the pool (picking, the session, the
context window), the gate (continuations wait there; the weight version), the recorder (commit before the last
byte), the responder (writing to the agent) and the meters; it keeps per backend whether it has token-in, its
context window and its anchors.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
import anyio
import orjson
from aiohttp import web
from multidict import CIMultiDictProxy
from yarl import URL

from .api import TranslationError
from .call import JSON, Call, ProxyError, Unreachable, error_message, token_limit
from .capture import Capture, ChoiceCapture, reported_version
from .config import ProxyConfig
from .gate import Gate
from .meters import Meters
from .pool import RETRY_STATUSES, Backend, BoundedEvents, Pool, read_bounded
from .recorder import Recorder
from .respond import Responder
from .session import MISSES, Answer, Match, Plan, Sessions
from .sse import DONE_EVENT, choices_of, drain, json_object, sse_event

logger = logging.getLogger(__name__)

RENDER_TARGET = "/v1/chat/completions/render"
GENERATE_TARGET = "/inference/v1/generate"
DERENDER_TARGET = "/v1/chat/completions/derender"
#: How a call ended up: generated from ids, or relayed as text for one of these reasons.
OUTCOMES: tuple[str, ...] = (
    "generated",
    *MISSES,
    "no_backend",
    "render_error",
    "anchor_mismatch",
    "generate_refused",
    "derender_error",
)
#: The anchor: a conversation ending with an assistant turn, in two variants that differ in one token.
ANCHOR_USER: Mapping[str, str] = {"role": "user", "content": "a"}
ANCHOR_ANSWERS = ("b", "c")
#: The request fields the anchor alone is rendered with (the rendering context).
_ANCHOR_FIELDS = ("model", "tools", "chat_template", "chat_template_kwargs", "documents")
_SEED_SPACE = 2**63
_TOOL_CALL_PREFIX = "chatcmpl-tool-"
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


class _Fallback(Exception):
    """Relay the call as text instead; nothing of it has reached the agent. ``outcome`` says why."""

    def __init__(self, outcome: str) -> None:
        super().__init__(outcome)
        self.outcome = outcome


class _Anchor:
    """The anchor as one backend renders it under one rendering context."""

    __slots__ = ("alone", "eot", "glue", "keeps_stop", "prefix")

    def __init__(self, alone: list[int], eot: int, glue: list[int]) -> None:
        self.alone = alone  # the anchor's ids (variant "b"), ending with the end of turn and the glue
        self.eot = eot
        self.glue = glue
        self.prefix: bool | None = None  # whether the anchor renders as a prefix of anchor + tail
        # Whether the backend's derender writes the text of the token a generation stopped on (vLLM 0.32 does
        # when a parser is configured; its chat endpoint never does): then that token is not derendered.
        self.keeps_stop = False


class _BackendState:
    __slots__ = ("anchors", "supported", "window", "window_read")

    def __init__(self) -> None:
        self.supported: bool | None = None
        self.anchors: dict[bytes, _Anchor] = {}
        self.window: int | None = None
        self.window_read = False


def _common_suffix(a: Sequence[int], b: Sequence[int]) -> int:
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def _as_chat(message: dict[str, Any], choice: dict[str, Any], call: Call) -> dict[str, Any]:
    """A derendered message (or stream delta) as the backend's chat endpoint writes it: no null fields in a
    delta, tool-call ids with vLLM's ``chatcmpl-tool-`` prefix, and finish reason ``tool_calls`` for an answer
    with tool calls unless the call named the function (vLLM 0.32's derender differs on these three)."""
    calls = message.get("tool_calls")
    for tool_call in calls or ():
        if isinstance(tool_call, dict) and isinstance(tool_call.get("id"), str):
            if not tool_call["id"].startswith(_TOOL_CALL_PREFIX):
                tool_call["id"] = _TOOL_CALL_PREFIX + tool_call["id"]
    if "delta" in choice:
        message = {key: value for key, value in message.items() if value is not None and value != []}
    elif calls and choice.get("finish_reason") == "stop":
        request = call.request or {}
        if not isinstance(request.get("tool_choice"), dict):
            choice["finish_reason"] = "tool_calls"
    return message


def _label(version: Any) -> int | None:
    return int(version) if isinstance(version, str) and version.isdigit() else None


class _Generation:
    """One token-in call's generation: the prompt, what the render said, and what came back so far."""

    __slots__ = (
        "backend",
        "base",
        "deadline",
        "entries",
        "finish",
        "ids",
        "keeps_stop",
        "limit",
        "prompt",
        "ready",
        "refusals",
        "request_id",
        "requests",
        "segment",
        "started",
        "stop_reason",
        "structured",
        "window",
    )

    def __init__(
        self,
        backend: Backend,
        render: dict[str, Any],
        prompt: list[int],
        segment: list[int],
        limit: int | None,
        window: int | None,
    ) -> None:
        self.backend = backend
        self.keeps_stop = False
        self.base = render
        sampling = render["sampling_params"]
        self.structured = bool(sampling.get("structured_outputs") or sampling.get("guided_decoding"))
        self.request_id = str(render.get("request_id") or "chatcmpl-tokenin")
        self.prompt = prompt
        self.segment = segment  # the prompt's ids after the turn's: end of turn, glue, tail
        self.limit = limit
        self.window = window
        self.ids: list[int] = []
        self.entries: list[Any] | None = [] if sampling.get("logprobs") is not None else None
        self.finish: str | None = None
        self.stop_reason: Any = None
        self.requests = 0  # generate requests sent
        self.started = 0  # ids there were when the current request was sent
        self.refusals = 0  # continuations in a row that brought no token
        self.deadline = 0.0
        self.ready = 0.0

    def left(self) -> int | None:
        """Tokens the call may still generate (``None``: the backend's default, the rest of its window)."""
        if self.limit is not None:
            return max(0, self.limit - len(self.ids))
        if self.window is not None and self.window > len(self.prompt) + len(self.ids):
            return self.window - len(self.prompt) - len(self.ids)
        return None

    def body(self, stream: bool) -> bytes:
        """The next generate request: from the prompt and the ids so far, for what is left of the limit."""
        sampling = dict(self.base["sampling_params"])
        done = len(self.ids)
        left = self.left()
        if left is None:
            sampling.pop("max_tokens", None)
        else:
            sampling["max_tokens"] = left
        if done:
            seed = sampling.get("seed")
            if type(seed) is int:  # reproducible, and not the first tokens' random numbers over again
                sampling["seed"] = (seed + done) % _SEED_SPACE
            least = sampling.get("min_tokens")
            if type(least) is int and least:
                sampling["min_tokens"] = max(0, least - done)
        body = {key: value for key, value in self.base.items() if key not in ("token_offsets", "features")}
        body |= {
            "request_id": f"{self.request_id}-{self.requests}",
            "token_ids": self.prompt + self.ids,
            "sampling_params": sampling,
            "stream": stream,
            "stream_options": None,
            "return_token_ids": None,
        }
        self.requests += 1
        self.started = done
        return orjson.dumps(body)

    def restart(self) -> None:
        self.ids = []
        if self.entries is not None:
            self.entries = []

    def logprobs(self) -> dict[str, Any] | None:
        return None if self.entries is None else {"content": self.entries}

    def stopped_on_token(self, finish: str | None, stop_reason: Any) -> bool:
        """Whether a generation that ended so stopped on a token (its end of sequence, or one of
        ``stop_token_ids``) whose text the chat endpoint leaves out of the answer."""
        return (
            finish == "stop"
            and not isinstance(stop_reason, str)
            and not self.base["sampling_params"].get("include_stop_str_in_output")
        )


class _Chunks:
    """Generated pieces between the generation and the derender of a stream: what came since the last take."""

    __slots__ = ("closed", "entries", "error", "event", "finish", "ids", "stop_reason")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.entries: list[Any] | None = None
        self.finish: str | None = None
        self.stop_reason: Any = None
        self.closed = False
        self.error: ProxyError | None = None
        self.event = anyio.Event()

    def put(self, ids: list[int], entries: list[Any] | None, finish: str | None, stop_reason: Any) -> None:
        self.ids += ids
        if entries is not None:
            self.entries = (self.entries or []) + entries
        if finish is not None:
            self.finish, self.stop_reason = finish, stop_reason
        self.event.set()

    def close(self, error: ProxyError | None = None) -> None:
        self.closed, self.error = True, error
        self.event.set()

    async def take(self) -> tuple[list[int], list[Any] | None, str | None, Any] | None:
        """Everything put since the last take (``None`` once closed with nothing left); raises the error the
        generation ended with."""
        while not (self.ids or self.finish is not None or self.closed):
            await self.event.wait()
            self.event = anyio.Event()
        if self.ids or self.finish is not None:
            piece = (self.ids, self.entries, self.finish, self.stop_reason)
            self.ids, self.entries, self.finish, self.stop_reason = [], None, None, None
            return piece
        if self.error is not None:
            raise self.error
        return None


class TokenIn:
    """Token-in chat for a proxy (see the module docstring): sessions, and generation from ids.

    The proxy calls :meth:`admit` for every attributed chat call once it is read, :meth:`run` to make a
    matched call (``None``: relay it as text) and :meth:`forget` for rollouts the store forgets; the recorder
    remembers each recorded call's turn in :attr:`sessions`.
    """

    def __init__(
        self,
        config: ProxyConfig,
        pool: Pool,
        gate: Gate,
        recorder: Recorder,
        responder: Responder,
        meters: Meters,
        sessions: Sessions,
    ) -> None:
        self.config = config
        self.pool = pool
        self.gate = gate
        self.recorder = recorder
        self.responder = responder
        self.meters = meters
        #: The attempts' recorded turns (the recorder remembers a turn once its call is recorded).
        self.sessions = sessions
        self._backends: dict[str, _BackendState] = {}
        self.m_calls = meters.registry.counter(
            "aglverl_proxy_token_in_total",
            "Recorded chat calls by how they were made: generated from the session's ids (generated), or "
            "relayed as text for the reason named.",
            ["outcome"],
        )

    # ------------------------------------------------------------------ the session
    def admit(self, call: Call) -> None:
        """Read a recorded chat call against its attempt's session; count it now unless it matched."""
        assert call.rollout_id is not None and call.attempt_id is not None and call.request is not None
        pending, match, miss = self.sessions.consider(call.rollout_id, call.attempt_id, call.request)
        call.tokenin = Plan(pending, match)
        if call.capture is not None and pending is not None:
            call.capture.answers = True
        if miss is not None:
            self.m_calls.inc(1, miss)

    def forget(self, rollout_ids: Sequence[str]) -> None:
        self.sessions.forget(rollout_ids)

    # ------------------------------------------------------------------ making a call from ids
    async def run(self, request: web.Request, call: Call) -> web.StreamResponse | None:
        """Make a matched call from ids and answer the agent; ``None`` when it must be relayed as text instead
        (nothing has reached the agent). Raises :class:`ProxyError` for a call that failed before its answer
        started; cancellation closes the call's upstream requests."""
        plan = call.tokenin
        assert plan is not None and plan.match is not None and call.request is not None
        backend = self.pool.pick(call.rollout_id, ())
        if backend is None:
            return None  # the relay answers 503
        state = self._state(backend)
        if state.supported is False:
            self.m_calls.inc(1, "no_backend")
            return None
        outcome = "generated"
        backend.in_flight += 1
        try:
            gen = await self._prepare(backend, call, plan.match)
            call.backend = backend.url
            if call.request.get("stream") is True:
                return await self._stream(request, call, plan, gen)
            return await self._whole(request, call, plan, gen)
        except _Fallback as exc:
            outcome = exc.outcome
            call.capture = Capture("chat", answers=True)  # the relay starts afresh
            return None
        finally:
            backend.in_flight -= 1
            self.m_calls.inc(1, outcome)

    def _state(self, backend: Backend) -> _BackendState:
        state = self._backends.get(backend.url)
        if state is None:
            state = self._backends[backend.url] = _BackendState()
        return state

    # ------------------------------------------------------------------ the tail's ids
    async def _prepare(self, backend: Backend, call: Call, match: Match) -> _Generation:
        """The call's prompt (the turn's ids and the tail's) and the render's answer; raises :class:`_Fallback`."""
        anchor = await self._anchor(backend, call, match.turn.context)
        conversation = [dict(ANCHOR_USER), {"role": "assistant", "content": ANCHOR_ANSWERS[0]}, *match.tail]
        other = [dict(ANCHOR_USER), {"role": "assistant", "content": ANCHOR_ANSWERS[1]}, *match.tail]
        if anchor.prefix is False:
            (ids, render), (ids_other, _) = await self._render_both(backend, call, conversation, other)
            rest = self._by_suffix(anchor, ids, ids_other)
        else:
            ids, render = await self._render(backend, call, conversation, full=True)
            if ids[: len(anchor.alone)] == anchor.alone:
                anchor.prefix = True
                rest = anchor.glue + ids[len(anchor.alone) :]
            else:
                anchor.prefix = False
                ids_other, _ = await self._render(backend, call, other, full=True)
                rest = self._by_suffix(anchor, ids, ids_other)
        turn = match.turn
        segment = rest if turn.response[-1:] == [anchor.eot] else [anchor.eot, *rest]
        assert call.request is not None
        limit = token_limit(call.request)
        window = None if limit is not None else await self._window(backend, call.model)
        gen = _Generation(backend, render, turn.prompt + turn.response + segment, segment, limit, window)
        gen.keeps_stop = anchor.keeps_stop
        return gen

    @staticmethod
    def _by_suffix(anchor: _Anchor, ids: list[int], other: list[int]) -> list[int]:
        """The ids after the anchor's end of turn: what two renderings that differ in the anchor's answer
        alone have in common at their end, less that end of turn."""
        n = _common_suffix(ids, other)
        if n == 0 or n >= min(len(ids), len(other)) or ids[-n] != anchor.eot:
            raise _Fallback("anchor_mismatch")
        return ids[len(ids) - n + 1 :]

    async def _anchor(self, backend: Backend, call: Call, context: bytes) -> _Anchor:
        state = self._state(backend)
        anchor = state.anchors.get(context)
        if anchor is not None:
            return anchor
        pair = [[dict(ANCHOR_USER), {"role": "assistant", "content": text}] for text in ANCHOR_ANSWERS]
        (alone, _), (other, _) = await self._render_both(backend, call, *pair, full=False)
        n = _common_suffix(alone, other)
        if n == 0 or n >= min(len(alone), len(other)):
            logger.warning(
                "backend %s renders the anchor conversation with no end-of-turn id after the assistant's "
                "answer; its multi-turn calls are relayed as text",
                backend.url,
            )
            raise _Fallback("anchor_mismatch")
        anchor = _Anchor(alone, alone[-n], alone[len(alone) - n + 1 :])
        anchor.keeps_stop = await self._keeps_stop(backend, call, alone[len(alone) - n - 1])
        state.anchors[context] = anchor
        return anchor

    async def _keeps_stop(self, backend: Backend, call: Call, answer_id: int) -> bool:
        """Whether the backend's derender writes the text of the token a generation stopped on: a probe
        derenders the anchor's answer id twice as a generation that stopped on its last token (``"b"``: the
        chat endpoint's text, ``"bb"``: the stop token written too)."""
        request = call.request
        assert request is not None
        chat = {key: request[key] for key in _ANCHOR_FIELDS if request.get(key) is not None}
        chat["messages"] = [dict(ANCHOR_USER)]
        choice = {
            "index": 0,
            "token_ids": [answer_id, answer_id],
            "finish_reason": "stop",
            "stop_reason": None,
        }
        body = {
            "model": call.model,
            "generate_response": {"request_id": "aglverl-probe", "choices": [choice]},
            "prompt_tokens": 0,
            "chat_request": chat,
        }
        try:
            status, _, raw = await self._post(backend, DERENDER_TARGET, orjson.dumps(body))
        except (Unreachable, ProxyError):
            return False
        choices = choices_of(json_object(raw)) if status == 200 else []
        message = choices[0].get("message") if choices else None
        content = message.get("content") if isinstance(message, dict) else None
        return isinstance(content, str) and content.strip() == ANCHOR_ANSWERS[0] * 2

    async def _render_both(
        self, backend: Backend, call: Call, first: list[Any], second: list[Any], *, full: bool = True
    ) -> tuple[tuple[list[int], dict[str, Any]], tuple[list[int], dict[str, Any]]]:
        results: list[Any] = [None, None]
        failure: _Fallback | None = None

        async def one(i: int, messages: list[Any]) -> None:
            nonlocal failure
            try:
                results[i] = await self._render(backend, call, messages, full=full)
            except _Fallback as exc:
                failure = failure or exc

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, 0, first)
            tg.start_soon(one, 1, second)
        if failure is not None:
            raise failure
        return results[0], results[1]

    async def _render(
        self, backend: Backend, call: Call, messages: list[Any], *, full: bool
    ) -> tuple[list[int], dict[str, Any]]:
        """``POST /v1/chat/completions/render`` of ``messages``: the call's request (``full``; with the
        generation prompt) or its rendering context alone (no generation prompt). Returns the ids and the
        answer; raises :class:`_Fallback`."""
        request = call.request
        assert request is not None
        if full:
            body = {**request, "messages": messages}
        else:
            body = {key: request[key] for key in _ANCHOR_FIELDS if request.get(key) is not None}
            body |= {"messages": messages, "add_generation_prompt": False}
        try:
            status, _, raw = await self._post(backend, RENDER_TARGET, orjson.dumps(body))
        except (Unreachable, ProxyError) as exc:
            logger.debug("render on %s failed: %s", backend.url, exc)
            raise _Fallback("render_error") from None
        if status >= 400:
            if self._lacks_token_in(status, raw):
                self._unsupported(backend, status, raw)
                raise _Fallback("no_backend")
            logger.debug("render on %s answered %d: %s", backend.url, status, error_message(raw))
            raise _Fallback("render_error")
        answer = json_object(raw)
        ids = answer.get("token_ids") if answer is not None else None
        if answer is None or type(ids) is not list or not isinstance(answer.get("sampling_params"), dict):
            raise _Fallback("render_error")
        self._state(backend).supported = True
        return ids, answer

    @staticmethod
    def _lacks_token_in(status: int, raw: bytes) -> bool:
        """A refusal that says the route is not served (404 / 405 without an OpenAI error: not a model the
        backend lacks) or is disabled (vLLM without ``--enable-scale-out``: 403)."""
        if status == 403:
            return b"disabled" in raw or b"Scale-out" in raw
        if status in (404, 405):
            body = json_object(raw)
            return body is None or not isinstance(body.get("error"), dict)
        return False

    def _unsupported(self, backend: Backend, status: int, raw: bytes) -> None:
        state = self._state(backend)
        if state.supported is False:
            return
        state.supported = False
        logger.warning(
            "backend %s has no token-in chat (POST %s answered %d: %s): start vLLM with --enable-scale-out "
            "(a backend must serve %s, %s and %s); until then its multi-turn calls are relayed as text, and "
            "each one whose history the chat template re-renders differently from the generated ids starts a "
            "new training row",
            backend.url,
            RENDER_TARGET,
            status,
            error_message(raw, 200),
            RENDER_TARGET,
            GENERATE_TARGET,
            DERENDER_TARGET,
        )

    async def _window(self, backend: Backend, model: str | None) -> int | None:
        """The backend's context window (``max_model_len`` of its ``/v1/models``), read once per backend."""
        state = self._state(backend)
        if state.window_read:
            return state.window
        try:
            state.window = await self.pool.context_window(backend, model)
        except Unreachable as exc:
            logger.debug("GET /v1/models on %s failed: %s", backend.url, exc)
            return None  # read again next time
        state.window_read = True
        return state.window

    # ------------------------------------------------------------------ HTTP
    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": JSON}
        if self.config.backend_auth is not None:
            headers["Authorization"] = self.config.backend_auth
        return headers

    async def _open(self, backend: Backend, target: str, body: bytes) -> aiohttp.ClientResponse:
        """Send a POST and return its response head (the caller closes it); :class:`Unreachable` if none came."""
        session = self.pool.session
        try:
            return await session.post(
                URL(backend.url + target, encoded=True), data=body, headers=self._headers()
            )
        except TimeoutError:
            raise Unreachable(f"backend {backend.url} did not answer {target} in time") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise Unreachable(f"backend {backend.url} did not answer {target}: {exc!r}") from exc

    async def _post(
        self, backend: Backend, target: str, body: bytes
    ) -> tuple[int, CIMultiDictProxy[str], bytes]:
        """A whole POST: ``(status, headers, body)``; :class:`Unreachable` or :class:`ProxyError` (too big)."""
        upstream = await self._open(backend, target, body)
        try:
            raw = await read_bounded(upstream, self.config.max_response_bytes, f"backend answer to {target}")
        except TimeoutError:
            raise Unreachable(f"backend {backend.url} did not finish answering {target} in time") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise Unreachable(f"backend {backend.url} broke off its answer to {target}: {exc!r}") from exc
        finally:
            upstream.close()
        return upstream.status, upstream.headers, raw

    # ------------------------------------------------------------------ generation
    def _progress(
        self,
        call: Call,
        gen: _Generation,
        ids: list[int],
        entries: Any,
        aborted: bool,
        version: int,
        spans: Any,
    ) -> None:
        """Note generated ids: the call's weight versions (vLLM's ``weight_versions`` spans when their labels
        are numbers, else ``version``), the refusal budget renewed, the resume latency."""
        labels = [_label(span.get("version")) for span in spans or () if isinstance(span, dict)]
        if labels and None not in labels:  # the spans cover this request's whole output
            if gen.started == 0:
                call.weight_version = labels[0]  # type: ignore[assignment]
            call.weight_version_end = labels[-1]
        if not ids:
            gen.refusals += aborted
            return
        if not gen.ids:
            call.weight_version = version
        if not labels:
            call.weight_version_end = version
        gen.ids += ids
        if gen.entries is not None:
            gen.entries += entries if isinstance(entries, list) else [{"logprob": None}] * len(ids)
        now = time.monotonic()
        if gen.ready:
            self.meters.resume_latency.observe(now - gen.ready)
            gen.ready = 0.0
        gen.refusals = 0
        gen.deadline = now + self.config.pause_timeout

    def _version(self, headers: CIMultiDictProxy[str]) -> int:
        reported = reported_version(headers)
        return self.gate.weight_version if reported is None else reported

    async def _next_backend(self, call: Call, gen: _Generation) -> Backend:
        """Where the next continuation goes, once the proxy is no longer held and any refusal's backoff is
        over; :class:`ProxyError` (503) once ``pause_timeout`` passed without a token outside holds."""
        config = self.config
        gen.deadline = await self.gate.clear_to_retry(  # the budget moved on by the time held: never spent
            gen.deadline,
            gen.refusals,
            f"an aborted generation waited to continue for over hold_timeout={config.hold_timeout:g}s "
            "while the proxy was held",
            f"the backend aborted the generation and refused to continue it for pause_timeout="
            f"{config.pause_timeout:g}s ({gen.refusals} continuations refused or aborted at once)",
        )
        backend = self.pool.pick(call.rollout_id, ())
        if backend is None:
            raise ProxyError(503, "no backends are configured")
        gen.ready = time.monotonic()
        self.meters.continuations.inc()
        return backend

    def _aborted(self, call: Call, gen: _Generation) -> None:
        """A generation the backend aborted: it is continued (or, under structured output, made again)."""
        if not gen.deadline:  # aborted before its first token
            gen.deadline = time.monotonic() + self.config.pause_timeout
        if gen.structured:
            if call.sse:
                self.meters.resume_failed.inc(1, "unsupported")
                raise ProxyError(
                    503,
                    "the backend aborted the generation (a weight update), and a stream under structured "
                    "output (tool_choice required or named, a response_format) is not resumed",
                )
            gen.restart()  # nobody has seen it: made again from the start under the new weights
            self.meters.regenerated.inc()

    async def _generate_whole(self, call: Call, gen: _Generation) -> None:
        """Generate to the end (not streamed), continuing aborted generations; the first refusal is a
        :class:`_Fallback`, later ones are retried (see :meth:`_next_backend`)."""
        backend = gen.backend
        call.upstream_start = time.monotonic()
        while True:
            if gen.requests:
                if gen.left() == 0:  # cut exactly at the limit: nothing is left to generate
                    gen.finish = "length"
                    return
                backend = await self._next_backend(call, gen)
            first = gen.requests == 0
            try:
                status, headers, raw = await self._post(backend, GENERATE_TARGET, gen.body(False))
            except Unreachable:
                if first:
                    raise _Fallback("generate_refused") from None
                gen.refusals += 1
                continue
            if status >= 400:
                if first:
                    logger.debug("generate on %s answered %d: %s", backend.url, status, error_message(raw))
                    raise _Fallback("generate_refused")
                if status in RETRY_STATUSES:
                    gen.refusals += 1
                    continue
                raise ProxyError(502, f"backend {backend.url} refused to continue the generation: {status}: {error_message(raw)}")  # fmt: skip
            choices = choices_of(json_object(raw))
            if not choices or type(choices[0].get("token_ids")) is not list:
                raise ProxyError(502, f"backend {backend.url} answered generate without token ids")
            choice = choices[0]
            finish = choice.get("finish_reason")
            aborted = finish == "abort"
            entries = (choice.get("logprobs") or {}).get("content")
            self._progress(call, gen, choice["token_ids"], entries, aborted, self._version(headers), choice.get("weight_versions"))  # fmt: skip
            if not aborted:
                gen.finish, gen.stop_reason = finish, choice.get("stop_reason")
                if gen.requests > 1:
                    self.meters.resumed.inc()
                return
            self._aborted(call, gen)

    async def _open_stream(
        self, call: Call, gen: _Generation, backend: Backend
    ) -> aiohttp.ClientResponse | None:
        """The head of the next streamed generate request; ``None`` for a refusal worth retrying. The first
        request's refusal is a :class:`_Fallback`."""
        first = gen.requests == 0
        try:
            upstream = await self._open(backend, GENERATE_TARGET, gen.body(True))
        except Unreachable:
            if first:
                raise _Fallback("generate_refused") from None
            return None
        if upstream.status < 400:
            return upstream
        try:
            raw = await upstream.content.read(64 << 10)
        except (aiohttp.ClientError, OSError, TimeoutError):
            raw = b""
        finally:
            upstream.close()
        if first:
            logger.debug("generate on %s answered %d: %s", backend.url, upstream.status, error_message(raw))
            raise _Fallback("generate_refused")
        if upstream.status in RETRY_STATUSES:
            return None
        message = error_message(raw)
        raise ProxyError(
            502, f"backend {backend.url} refused to continue the generation: {upstream.status}: {message}"
        )

    async def _produce(
        self, call: Call, gen: _Generation, upstream: aiohttp.ClientResponse, chunks: _Chunks
    ) -> None:
        """Read the generation's stream into ``chunks``, continuing it after aborts; ends by closing ``chunks``
        (with the error that ended the generation, if one did)."""
        try:
            while True:
                try:
                    aborted = await self._read_stream(call, gen, upstream, chunks)
                finally:
                    upstream.close()
                if not aborted:
                    break
                self._aborted(call, gen)
                next_head = None
                while next_head is None:
                    if gen.left() == 0:
                        chunks.put([], None, "length", None)
                        break
                    next_head = await self._open_stream(call, gen, await self._next_backend(call, gen))
                    if next_head is None:
                        gen.refusals += 1
                if next_head is None:
                    break
                upstream = next_head
            if gen.requests > 1:
                self.meters.resumed.inc()
            chunks.close()
        except ProxyError as exc:
            chunks.close(exc)
        except _Fallback as exc:  # only the first request falls back, and it was sent before this task
            chunks.close(ProxyError(502, f"token-in generation failed: {exc.outcome}"))

    async def _read_stream(
        self, call: Call, gen: _Generation, upstream: aiohttp.ClientResponse, chunks: _Chunks
    ) -> bool:
        """Relay one generate stream into ``chunks``: ``True`` if the backend aborted it, ``False`` once it
        finished; :class:`ProxyError` if it broke."""
        version = self._version(upstream.headers)
        reads = BoundedEvents(
            upstream,
            gen.backend.url,
            "generation",
            self.config.max_response_bytes,
            lambda: self.pool.timed_out(call),
        )
        finished = False
        content = upstream.content
        while (payloads := await reads.next()) is not None:
            for data in payloads:
                if data == b"[DONE]":
                    continue
                event = json_object(data)
                if event is None:
                    raise ProxyError(502, "the backend sent a generate event that is not JSON")
                if isinstance(event.get("error"), dict):
                    raise ProxyError(502, f"backend failed while generating: {error_message(data)}")
                for choice in choices_of(event):
                    ids = choice.get("token_ids") or []
                    if type(ids) is not list:
                        raise ProxyError(502, "the backend sent a generate event without token ids")
                    finish = choice.get("finish_reason")
                    entries = (choice.get("logprobs") or {}).get("content")
                    aborted = finish == "abort"
                    self._progress(call, gen, ids, entries, aborted, version, choice.get("weight_versions"))
                    if aborted:
                        if ids:
                            chunks.put(ids, entries if gen.entries is not None else None, None, None)
                        await drain(content)
                        return True
                    chunks.put(
                        ids, entries if gen.entries is not None else None, finish, choice.get("stop_reason")
                    )
                    if finish is not None:
                        gen.finish, gen.stop_reason = finish, choice.get("stop_reason")
                        finished = True
        if not finished:
            raise ProxyError(502, "the backend ended the generation stream before it finished")
        return False

    # ------------------------------------------------------------------ answers
    def _chat_request(self, call: Call, match: Match) -> dict[str, Any]:
        """The request the backend's parsers read: the agent's, its messages replaced by the tail (the parsers
        look at tools, tool_choice, reasoning switches; the history would only cost transport)."""
        assert call.request is not None
        return {**call.request, "messages": match.tail}

    def _record(self, call: Call, gen: _Generation) -> None:
        """The call's capture: the ids generated from, the generated ids, logprobs, finish reason."""
        capture = Capture("chat")
        capture.prompt_ids = gen.prompt
        capture.model = call.model
        choice = ChoiceCapture()
        choice.ids = gen.ids
        if gen.entries is not None and all(isinstance(e, dict) for e in gen.entries):
            values = [e.get("logprob") for e in gen.entries]
            if all(type(v) is float or type(v) is int for v in values):
                choice.logprobs = [float(v) for v in values]
        choice.finish_reason = gen.finish
        capture.choices[0] = choice
        call.capture = capture
        call.upstream_end = time.monotonic()

    async def _whole(
        self, request: web.Request, call: Call, plan: Plan, gen: _Generation
    ) -> web.StreamResponse:
        assert plan.match is not None and call.request is not None
        await self._generate_whole(call, gen)
        answer = await self._derender_whole(call, plan.match, gen)
        choices = choices_of(answer)
        if choices and isinstance(choices[0].get("finish_reason"), str):
            gen.finish = choices[0]["finish_reason"]  # recorded as the agent gets it (e.g. "tool_calls")
        self._record(call, gen)
        plan.answer = Answer()
        if choices and isinstance(choices[0].get("message"), dict):
            plan.answer.set_message(choices[0]["message"])
        if call.request.get("return_token_ids"):
            answer["prompt_token_ids"] = gen.prompt
        body = orjson.dumps(answer)
        if call.translator is not None:
            try:
                body = call.translator.whole(200, body)
            except TranslationError as exc:
                raise ProxyError(exc.status, exc.message) from None
        response = web.Response(status=200, body=body, content_type=JSON)
        await self.responder.send_whole(request, call, response)
        return response

    async def _derender_whole(self, call: Call, match: Match, gen: _Generation) -> dict[str, Any]:
        """The chat completion of the whole generation; :class:`_Fallback` when the backend cannot make it."""
        usage = {"prompt_tokens": len(gen.prompt), "completion_tokens": len(gen.ids)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        ids = gen.ids
        if gen.keeps_stop and ids and gen.stopped_on_token(gen.finish, gen.stop_reason):
            ids = ids[:-1]  # its text is not the answer's (its logprob entry stays)
        choice = {
            "index": 0,
            "token_ids": ids,
            "finish_reason": gen.finish,
            "stop_reason": gen.stop_reason,
            "logprobs": gen.logprobs(),
        }
        if not ids:  # nothing to parse (derender refuses an empty output)
            message = {"role": "assistant", "content": ""}
            chat_choice = {**choice, "message": message, "logprobs": None}
            del chat_choice["token_ids"]
            return {
                "id": gen.request_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": call.model,
                "choices": [chat_choice],
                "usage": usage,
            }
        body = {
            "model": call.model,
            "generate_response": {
                "request_id": gen.request_id,
                "choices": [choice],
                "prompt_token_ids": gen.segment,
            },
            "prompt_token_ids": gen.segment,
            "prompt_tokens": len(gen.prompt),
            "chat_request": self._chat_request(call, match),
        }
        try:
            status, _, raw = await self._post(gen.backend, DERENDER_TARGET, orjson.dumps(body))
        except Unreachable as exc:
            logger.warning("derender on %s failed: %s", gen.backend.url, exc)
            raise _Fallback("derender_error") from None
        answer = json_object(raw) if status < 400 else None
        if answer is None or not choices_of(answer):
            logger.warning("derender on %s answered %d: %s", gen.backend.url, status, error_message(raw))
            raise _Fallback("derender_error")
        for choice_ in choices_of(answer):
            said = choice_.get("message")
            if isinstance(said, dict):
                _as_chat(said, choice_, call)
        return answer

    async def _stream(
        self, request: web.Request, call: Call, plan: Plan, gen: _Generation
    ) -> web.StreamResponse:
        call.sse = True
        call.upstream_start = time.monotonic()
        upstream = await self._open_stream(call, gen, gen.backend)
        assert upstream is not None  # a refused first request is a fallback
        chunks = _Chunks()
        failure: ProxyError | _Fallback | None = None
        response: web.StreamResponse | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._produce, call, gen, upstream, chunks)
            try:
                response = await self._relay_chunks(request, call, plan, gen, chunks)
            except (ProxyError, _Fallback) as exc:
                failure = exc
            tg.cancel_scope.cancel()
        if isinstance(failure, _Fallback):
            raise failure
        if failure is not None:
            if call.response is None:
                raise failure
            await self.responder.end_broken(call, failure.status, failure.message)
            return call.response
        assert response is not None
        return response

    async def _relay_chunks(
        self, request: web.Request, call: Call, plan: Plan, gen: _Generation, chunks: _Chunks
    ) -> web.StreamResponse:
        """Derender the generation's pieces as they come (one derender in flight) and send them to the agent;
        the agent's response starts with the first derendered piece."""
        assert plan.match is not None and call.request is not None
        answer = plan.answer = Answer()
        prefix = (
            b'{"stream":true,"model":'
            + orjson.dumps(call.model)
            + b',"prompt_token_ids":'
            + orjson.dumps(gen.segment)
            + b',"prompt_tokens":'
            + str(len(gen.prompt)).encode()
            + b',"chat_request":'
            + orjson.dumps(self._chat_request(call, plan.match))
            + b',"generate_chunk":'
        )
        usage = bool((call.request.get("stream_options") or {}).get("include_usage"))
        ids_back = bool(call.request.get("return_token_ids"))
        state: Any = None
        head: dict[str, Any] | None = None
        while True:
            piece = await chunks.take()
            if piece is None:
                raise ProxyError(502, "the generation ended without a finish reason")
            ids, entries, finish, stop_reason = piece
            if gen.keeps_stop and ids and gen.stopped_on_token(finish, stop_reason):
                ids = ids[:-1]
            generate_chunk = {
                "request_id": gen.request_id,
                "choices": [
                    {
                        "index": 0,
                        "token_ids": ids,
                        "finish_reason": finish,
                        "stop_reason": stop_reason,
                        "logprobs": None if entries is None else {"content": entries},
                    }
                ],
            }
            body = prefix + orjson.dumps(generate_chunk) + b',"stream_state":' + orjson.dumps(state) + b"}"
            chunk, state = await self._derender_chunk(call, gen, body)
            for choice in choices_of(chunk):
                delta = choice.get("delta")
                if isinstance(delta, dict):
                    choice["delta"] = _as_chat(delta, choice, call)
                    answer.add_delta(choice["delta"])
            for key in [key for key, value in chunk.items() if value is None]:
                del chunk[key]
            if head is None:
                head = {key: chunk.get(key) for key in ("id", "object", "created", "model")}
                if ids_back:
                    chunk["prompt_token_ids"] = gen.prompt
            else:
                chunk["created"] = head["created"]
            out = sse_event(chunk)
            if finish is not None:
                for choice in choices_of(chunk):
                    if isinstance(choice.get("finish_reason"), str):
                        gen.finish = choice["finish_reason"]  # recorded as the agent gets it
                self._record(call, gen)
                self.recorder.commit(call)  # before the agent can read [DONE] and report its rollout done
                if usage:
                    counts = {"prompt_tokens": len(gen.prompt), "completion_tokens": len(gen.ids)}
                    counts["total_tokens"] = counts["prompt_tokens"] + counts["completion_tokens"]
                    out += sse_event({**head, "choices": [], "usage": counts})
                out += DONE_EVENT
            if call.response is None:
                call.response = web.StreamResponse(status=200, headers=_SSE_HEADERS)
                if call.translator is not None:
                    call.translator.open(200, True)
                try:
                    await call.response.prepare(request)
                except ConnectionError:
                    call.fail("agent disconnected", "cancelled")
                    return call.response
                call.first_byte = time.monotonic()
            if not await self.responder.forward(call, call.response, out):
                return call.response
            if finish is not None:
                break
        await self.responder.close_stream(call, call.response)
        return call.response

    async def _derender_chunk(self, call: Call, gen: _Generation, body: bytes) -> tuple[dict[str, Any], Any]:
        """One streamed derender: ``(chat.completion.chunk, stream_state)``. Before the agent's response
        started a failure is a :class:`_Fallback`, after it a :class:`ProxyError`."""
        try:
            status, _, raw = await self._post(gen.backend, DERENDER_TARGET, body)
        except Unreachable as exc:
            status, raw = 0, str(exc).encode()
        answer = json_object(raw) if status == 200 else None
        chunk = answer.get("chunk") if answer is not None else None
        if answer is None or not isinstance(chunk, dict):
            message = error_message(raw)
            if call.response is None:
                logger.warning("derender on %s answered %d: %s", gen.backend.url, status, message)
                raise _Fallback("derender_error")
            raise ProxyError(
                502, f"backend {gen.backend.url} could not derender the generation: {status}: {message}"
            )
        return chunk, answer.get("stream_state")
