"""Aborted generations: holding them, continuing them token-exactly, or making them again.

A backend answers a recorded call with ``finish_reason: "abort"`` when the trainer swaps its weights. The agent
never sees that: :class:`Resumer` takes over from the relay, which calls it in four places:

- :meth:`Resumer.take_abort` (synchronous) takes the aborting event out of complete SSE events before the agent
  gets any of it (the events before it go out unchanged, its last tokens without the finish reason);
  :meth:`Resumer.resume_stream` then continues the stream in the agent's chunk shape (same ``id``) to its
  final chunk, usage and ``[DONE]``.
- :meth:`Resumer.resume_whole` continues a whole (JSON) answer into one body covering the whole generation
  (:func:`_merged`); :meth:`Resumer.regenerate_whole` makes a whole answer that no completion can carry on
  (:func:`resume_blocker`: ``n > 1``, tools, structured output...) again from the start once the hold ends.

How: :meth:`Resumer._resumption` collects what a continuation needs (:class:`Resumption`: the prompt and the
ids so far, the limit, the stream's head), or refuses a call no completion can carry on with a 503. Each
continuation waits at the gate (:meth:`~aglverl.proxy.gate.Gate.clear_to_retry`: a call waiting keeps no
backend busy, and a hold spends none of its budget), then sends the backend dialect's continuation
(:meth:`~aglverl.proxy.dialect.Dialect.continuation`: vLLM's a token-in ``/v1/completions`` call with the
call's own sampling parameters, ``seed`` moved on) to the rollout's backend; refusals are retried with the
retry policy's backoff until ``pause_timeout`` has passed without a new token. :meth:`Resumer._progressed`
moves the call's weight versions, the refusal budget and the resume latency: the one bookkeeping of
continuations in the proxy (token-in calls are chat calls, aborted and continued like any). A call resumed or
made again keeps assembling its answer as the agent gets it, so its turn stays in its token-in session.

Errors: a call not resumed, a backend that kept refusing, a broken continuation are a
:class:`~aglverl.proxy.call.ProxyError` (503, 502, 504) from the whole-answer methods; ``resume_stream`` ends
the stream with an error event instead and returns ``False`` (also when the agent left). Cancellation (the
agent left, shutdown) closes the continuation's upstream request. Holds the config, the pool (picking and
sending), the gate (waits, the weight version), the recorder (re-capturing a merged answer), the responder
(writing a stream's continuation) and the meters.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import orjson

from .call import ERROR_BODY_LIMIT, SSE, Call, ProxyError, Unreachable, error_message, token_limit
from .config import ProxyConfig
from .dialect import DEFAULT, Dialect
from .gate import Gate
from .meters import Meters
from .pool import RETRY_STATUSES, Backend, BoundedEvents, Pool, read_bounded
from .recorder import Recorder
from .reshape import chat_logprobs
from .respond import Responder
from .sse import (
    DONE_EVENT,
    EVENT_END,
    choices_of,
    event_json,
    json_object,
    sse_event,
)
from .upstream import Response, UpstreamError

logger = logging.getLogger(__name__)


def _length_end(dialect: Dialect) -> dict[str, Any]:
    """The end of a generation aborted exactly at its limit (nothing is left to continue), as a completion
    choice of ``dialect``'s wire."""
    ids = dialect.wire.response_ids
    return {"index": 0, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None, ids: []}


def resume_blocker(
    request: Mapping[str, Any], kind: Literal["chat", "completion"] | None, dialect: Dialect = DEFAULT
) -> str | None:
    """Why an aborted call cannot be continued token-exactly by a completion (``None``: it can); the
    backend's ``dialect`` names its own fields whose state a continuation would start afresh."""
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
    for key in dialect.unresumable_fields:
        if request.get(key) is not None:
            return f"a call with {key}"
    return None


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


class Resumption:
    """An aborted generation on its way to its end: what its continuations need and what they did."""

    __slots__ = (
        "chars",
        "context",
        "deadline",
        "head",
        "ids",
        "limit",
        "prompt",
        "ready",
        "refusals",
        "version",
    )

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
        self.context: int | None = None  # the backend's max_model_len, for a call without a limit

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


def _refused_message(pause_timeout: float, refusals: int) -> str:
    return (
        f"the backend aborted the generation and refused to continue it for pause_timeout={pause_timeout:g}s "
        f"({refusals} continuations refused or aborted at once)"
    )


def _continued_choice(raw: bytes, dialect: Dialect) -> tuple[dict[str, Any], list[int]]:
    """The choice of a whole continuation answer and its ids; :class:`ProxyError` (502) unless a completion
    with ids."""
    choices = choices_of(json_object(raw))
    ids = dialect.response_ids(choices[0]) if choices else None
    if ids is None:
        raise ProxyError(502, "the backend's continuation is not a completion with token ids")
    return choices[0], ids


def _merged(call: Call, answer: Any, pieces: Sequence[dict[str, Any]], state: Resumption) -> Any:
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
        if piece.get("finish_reason") == call.dialect.abort_reason:
            _unfinish(piece, "completion")
        if isinstance(logprobs, dict):
            if chat:
                logprobs.setdefault("content", []).extend(chat_logprobs(piece.get("logprobs"), top))
            else:
                shifted = _offset_logprobs(piece.get("logprobs"), len(text)) or {}
                for field in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
                    logprobs.setdefault(field, []).extend(shifted.get(field) or ())
        text += piece.get("text") or ""
    holder[key] = text
    last = pieces[-1]
    choice[call.dialect.wire.response_ids] = state.ids
    choice["finish_reason"], choice["stop_reason"] = last.get("finish_reason"), last.get("stop_reason")
    if isinstance(answer.get("usage"), dict):
        answer["usage"] = state.usage(answer["usage"])
    return answer


def _offset_logprobs(logprobs: Any, offset: int) -> Any:
    """Completions logprobs whose ``text_offset`` counts from ``offset`` characters further on."""
    if not isinstance(logprobs, dict) or not offset or not isinstance(logprobs.get("text_offset"), list):
        return logprobs
    return {**logprobs, "text_offset": [o + offset for o in logprobs["text_offset"]]}


# ---------------------------------------------------------------------------------------------- the resumer
class Resumer:
    """Carries aborted generations to their end (see the module docstring)."""

    def __init__(
        self,
        config: ProxyConfig,
        pool: Pool,
        gate: Gate,
        recorder: Recorder,
        responder: Responder,
        meters: Meters,
    ) -> None:
        self.config = config
        self.pool = pool
        self.gate = gate
        self.recorder = recorder
        self.responder = responder
        self.meters = meters

    def _resumption(self, call: Call, head: dict[str, Any] | None = None) -> Resumption:
        """What the continuations of ``call``'s aborted answer need; :class:`ProxyError` (503) for a call the
        proxy does not resume (counted as ``unsupported``)."""
        capture, request = call.capture, call.request
        assert capture is not None and request is not None
        why = resume_blocker(request, call.kind, call.dialect)
        choice = next(iter(capture.choices.values()), None)
        prompt = None if choice is None else choice.prompt_ids or capture.prompt_ids
        if why is None and len(capture.choices) != 1:
            why = "a call with several choices"
        if why is None and (choice is None or choice.ids_missing or capture.broken or prompt is None):
            why = "a call whose answer carries no token ids"
        if why is not None:
            self.meters.resume_failed.inc(1, "unsupported")
            message = f"the backend aborted the generation (a weight update), and {why} is not resumed"
            raise ProxyError(503, message)
        assert choice is not None and prompt is not None
        limit = token_limit(request)
        # No ids and no output (ids_missing unset): aborted before its first token.
        return Resumption(
            list(prompt),
            list(choice.ids or ()),
            limit,
            time.monotonic() + self.config.pause_timeout,
            head or {},
            choice.chars,
        )

    async def resume_whole(self, call: Call, answer: Any) -> bytes:
        """Continue a whole (JSON) answer the backend aborted; returns the one body, in the call's shape,
        covering the whole generation (and captures it). Raises :class:`ProxyError` when it cannot be
        continued (see :meth:`resume_stream`); cancellation closes the continuation's upstream request."""
        state = self._resumption(call)
        pieces: list[dict[str, Any]] = []
        while True:
            if state.left == 0:
                pieces.append(_length_end(call.dialect))
                break
            upstream = await self._continuation(call, state)
            try:
                raw = await read_bounded(upstream, self.config.max_response_bytes, "backend continuation")
            except TimeoutError:
                raise ProxyError(504, self.pool.timed_out(call)) from None
            except (UpstreamError, OSError) as exc:
                raise ProxyError(502, f"backend {call.backend} broke off the continuation: {exc!r}") from exc
            finally:
                upstream.close()
            piece, ids = _continued_choice(raw, call.dialect)
            pieces.append(piece)
            aborted = piece.get("finish_reason") == call.dialect.abort_reason
            self._progressed(call, state, ids, aborted)
            if not aborted:
                break
        merged = _merged(call, answer, pieces, state)
        assert call.capture is not None
        call.capture = call.dialect.capture(call.kind or "chat", call.capture.answers)
        call.capture.apply(merged)
        self.meters.resumed.inc()
        return orjson.dumps(merged)

    async def regenerate_whole(self, call: Call) -> bytes:
        """A whole (JSON) answer the backend aborted that a completion cannot continue token-exactly (tool
        calls, ``n > 1``, structured output: :func:`resume_blocker`): the agent has seen none of it, so once
        the proxy is no longer held the call is made again from the start, and that answer (generated under
        the new weights) is the call's, recorded with its own ids and version. An answer aborted again is made
        again; :class:`ProxyError` (503) once ``pause_timeout`` passed without a whole answer (time spent
        waiting for a hold not counted), 502 for an error answer; cancellation closes the upstream request."""
        deadline = time.monotonic() + self.config.pause_timeout
        refusals = 0
        while True:
            deadline = await self.gate.clear_to_retry(
                deadline,
                refusals,
                f"an aborted call waited to be made again for over {self.config.pause_timeout:g}s",
                f"the backend kept aborting a call made again ({refusals} times)",
            )
            backend = self.pool.pick(call.rollout_id, ())
            if backend is None:
                raise ProxyError(503, "no backends are configured")
            call.prepare(await self.pool.dialect(backend), self.config.request_logprobs)
            try:
                upstream = await self.pool.send(backend, call)
            except Unreachable:
                refusals += 1
                continue
            try:
                if upstream.status in RETRY_STATUSES:
                    refusals += 1
                    continue
                raw = await read_bounded(upstream, self.config.max_response_bytes, "backend answer")
                status, version = upstream.status, call.dialect.weight_version(upstream.headers)
            except TimeoutError:
                raise ProxyError(504, self.pool.timed_out(call)) from None
            except (UpstreamError, OSError) as exc:
                raise ProxyError(
                    502, f"backend {call.backend} broke off the call made again: {exc!r}"
                ) from exc
            finally:
                upstream.close()
            if status >= 400:
                raise ProxyError(
                    502, f"backend {backend.url} refused the call made again: {status}: {error_message(raw)}"
                )
            answers = call.capture is not None and call.capture.answers
            call.capture = call.dialect.capture(call.kind or "chat", answers)
            if self.recorder.capture_body(call, status, raw) and call.capture.aborted:
                refusals += 1
                continue
            # Made again wholly after the hold: the proxy's current version when the backend reports none.
            call.weight_version = call.weight_version_end = (
                self.gate.weight_version if version is None else version
            )
            self.meters.regenerated.inc()
            return raw

    async def _continuation(self, call: Call, state: Resumption) -> Response:
        """Send the next continuation of ``state`` and return its response head (status < 400).

        It goes once the proxy is neither paused nor held, to the rollout's backend (whose prefix cache holds
        the prompt and the partial output). A refusal (no connection, a 5xx or 429, or an answer aborted again
        without a token) is retried after the retry policy's backoff; :class:`ProxyError` (503) once
        ``pause_timeout`` has passed since the last token without a token, time spent waiting for a hold not
        counted (a hold is bounded by ``hold_timeout``), 502/504 for other failures.
        """
        while True:
            state.deadline = await self.gate.clear_to_retry(
                state.deadline,
                state.refusals,
                f"an aborted generation waited to continue for over pause_timeout={self.config.pause_timeout:g}s "
                "while the proxy was held",
                _refused_message(self.config.pause_timeout, state.refusals),
            )
            backend = self.pool.pick(call.rollout_id, ())
            if backend is None:
                raise ProxyError(503, "no backends are configured")
            if state.limit is None and state.context is None:
                # The call had the rest of the context; a completion without max_tokens (or with a null one)
                # gets vLLM's default of 16 tokens, so the continuation asks for the rest explicitly.
                state.context = await self._context_window(backend, call.model)
            state.ready = time.monotonic()
            state.version = self.gate.weight_version
            self.meters.continuations.inc()
            request = call.request
            assert request is not None
            kind = call.kind or "chat"
            body = backend.dialect.continuation(request, kind, state.prompt, state.ids, state.left, call.sse)
            try:
                upstream = await self.pool.send(backend, call, body)
            except Unreachable:
                state.refusals += 1
                continue
            if upstream.status in RETRY_STATUSES:
                upstream.close()
                state.refusals += 1
                continue
            if upstream.status >= 400:
                try:
                    body = (await upstream.readany())[:ERROR_BODY_LIMIT]
                except (UpstreamError, OSError, TimeoutError):
                    body = b""
                finally:
                    upstream.close()
                message = error_message(body)
                raise ProxyError(
                    502,
                    f"backend {backend.url} refused to continue the aborted generation: {upstream.status}: {message}",
                )
            reported = call.dialect.weight_version(upstream.headers)
            if reported is not None:
                state.version = reported
            return upstream

    async def _context_window(self, backend: Backend, model: str | None) -> int | None:
        """The backend's context window for ``model`` (:meth:`~aglverl.proxy.pool.Pool.context_window`);
        ``None`` (logged) when it does not say."""
        try:
            window = await self.pool.context_window(backend, model)
        except Unreachable as exc:
            window, error = None, str(exc)
        else:
            error = "no max_model_len in its /v1/models"
        if window is None:
            logger.warning(
                "backend %s did not tell its context window (%s): the continuation of an aborted call without "
                "max_tokens gets the backend's default limit",
                backend.url,
                error,
            )
        return window

    def _progressed(self, call: Call, state: Resumption, ids: list[int], aborted: bool) -> None:
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
            self.meters.resume_latency.observe(now - state.ready)
            state.ready = 0.0
        state.refusals = 0
        state.deadline = now + self.config.pause_timeout

    def take_abort(self, call: Call, chunk: bytes) -> tuple[bytes, dict[str, Any] | None]:
        """Take an abort out of complete SSE events: ``(what the agent gets, the aborting event's head)``.

        The head (``id``, ``object``, ``created``, ``model``) is ``None`` when no choice was aborted (the word
        was text). Events before the aborting one go out unchanged; the aborting one goes out without its
        finish reason when it carries the last tokens (dropped when it carries none); what follows it (usage,
        ``[DONE]``) is dropped: the rest of the answer comes from the continuation.
        """
        out: list[bytes] = []
        abort = call.dialect.wire.abort_marker
        for raw in EVENT_END.split(chunk):
            if not raw:
                continue
            event = event_json(raw) if abort in raw else None
            choices = choices_of(event)
            ended = [c for c in choices if c.get("finish_reason") == call.dialect.abort_reason]
            if not ended:
                out.append(raw + b"\n\n")
                continue
            assert event is not None
            for choice in ended:
                _unfinish(choice, call.kind)
            if any(call.dialect.response_ids(c) or _text_of(c, call.kind) for c in choices):
                out.append(sse_event(event))
            head = {key: event.get(key) for key in ("id", "object", "created", "model")}
            return b"".join(out), head
        return chunk, None

    async def resume_stream(self, call: Call, head: dict[str, Any]) -> bool:
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
                    end = {"choices": [_length_end(call.dialect)]}
                    events, _ = self._converted(call, state, end)
                    if not await self.responder.forward(call, events + DONE_EVENT, call.capture):
                        return False
                    break
                upstream = await self._continuation(call, state)
                try:
                    again = await self._relay_continuation(call, upstream, state)
                finally:
                    upstream.close()
                if again is None:
                    return False
                if not again:
                    break
        except ProxyError as exc:
            await self.responder.end_broken(call, exc.status, exc.message)
            return False
        self.meters.resumed.inc()
        return True

    async def _relay_continuation(self, call: Call, upstream: Response, state: Resumption) -> bool | None:
        """Relay one continuation's stream in the call's chunk shape: ``True`` if it was aborted too (its
        tokens went out), ``False`` once it ended, ``None`` if the agent left; :class:`ProxyError` if it broke."""
        if not upstream.headers.get("Content-Type", "").startswith(SSE):
            raise ProxyError(502, f"backend {call.backend} answered the streamed continuation with no stream")
        reads = BoundedEvents(
            upstream,
            call.backend,
            "continuation",
            self.config.max_response_bytes,
            lambda: self.pool.timed_out(call),
        )
        while (payloads := await reads.next()) is not None:
            out: list[bytes] = []
            aborted = False
            for data in payloads:
                if data == b"[DONE]":
                    out.append(DONE_EVENT)
                    continue
                event = json_object(data)
                if event is None:
                    raise ProxyError(
                        502, f"backend {call.backend} sent a continuation event that is not JSON"
                    )
                if isinstance(event.get("error"), dict):
                    raise ProxyError(
                        502, f"backend failed while continuing: {error_message(orjson.dumps(event))}"
                    )
                converted, aborted = self._converted(call, state, event)
                out.append(converted)
                if aborted:
                    break
            if out and not await self.responder.forward(call, b"".join(out), call.capture):
                return None
            if aborted:
                await upstream.drain()
                return True
        return False

    def _converted(self, call: Call, state: Resumption, event: dict[str, Any]) -> tuple[bytes, bool]:
        """A continuation's (completions) event as an event of the call's stream: ``(bytes, aborted)``.

        An aborted choice goes out without its finish reason (see :func:`_unfinish`); the usage chunk
        counts the call's own prompt and the whole generation.
        """
        head = state.head
        choices = choices_of(event)
        if not choices:
            usage = event.get("usage")
            if not isinstance(usage, dict):
                return b"", False
            return sse_event({**head, "choices": [], "usage": state.usage(usage)}), False
        c = choices[0]
        wire = call.dialect.wire
        ids = call.dialect.response_ids(c)
        if ids is None:
            raise ProxyError(502, f"backend {call.backend} sent no token ids for the continuation")
        aborted = c.get("finish_reason") == call.dialect.abort_reason
        if aborted:
            _unfinish(c, "completion")
        self._progressed(call, state, ids, aborted)
        text = c.get("text") or ""
        request = call.request or {}
        finish = c.get("finish_reason")
        if call.kind == "chat":
            logprobs = chat_logprobs(c.get("logprobs"), request.get("top_logprobs") or 0)
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {"content": text},
                "logprobs": {"content": logprobs} if request.get("logprobs") else None,
                "finish_reason": finish,
            }
            if finish is not None:
                choice["stop_reason"] = c.get("stop_reason")
            choice[wire.response_ids] = ids
        else:
            choice = {**c, "index": 0, wire.prompt_ids: None}
            choice["logprobs"] = _offset_logprobs(c.get("logprobs"), state.chars)
            state.chars += len(text)
        return sse_event({**head, "choices": [choice]}), aborted
