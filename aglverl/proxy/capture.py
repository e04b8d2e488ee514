"""Token capture: reading token ids, log-probs and stop reasons out of answers and streams, into records.

:class:`_Capture` assembles one call's choices from a whole JSON body (``apply``) or from its SSE stream fed in
chunks cut anywhere (``feed``; each complete event is parsed once). Choices are kept by ``index`` (``n > 1``
streams interleave them). A choice's ids are reported only when complete: one piece of output without ids
(``ids_missing``) or one event that cannot be parsed (``broken``) makes them absent, never partial; log-probs
only when there is exactly one float per id.

:class:`_Recorder` (a part of :class:`~aglverl.proxy.LLMProxy`) turns a call into
:class:`~aglverl.store.LLMCall` rows, one per choice, and puts them in the store: :meth:`_Recorder._commit`
once, as soon as the outcome is known and before the agent can see the end of its answer (an agent that
reports its rollout done on its last byte must find its last call recorded); :meth:`_Recorder._finish` counts
every call once and, if the delivery failed after the commit, turns its records into failed ones. Ids that are
not valid int64 ids below the store's vocabulary size are recorded as absent; a failed call's partial output is
never recorded as a response; an abort nobody resumed fails the call. It reads the host's ``store`` and
metrics, and nothing of the relay or the resumption.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

import orjson
from multidict import CIMultiDictProxy

from ..metrics import Counter, Histogram
from ..models import checked_token_ids
from ..store import LLMCall
from .call import _Call, _error_message
from .session import Answer
from .store_view import ProxyStore

#: Paths (after ``/v1/``) whose token ids are captured, and the response shape each one has.
CAPTURED_PATHS: Mapping[str, Literal["chat", "completion"]] = {
    "chat/completions": "chat",
    "completions": "completion",
}

#: What a backend's 4xx refusal says when the prompt (with the tokens asked for) does not fit its context
#: window: vLLM ("This model's maximum context length is ...", "... cannot be greater than max_model_len=...",
#: "The decoder prompt ... is longer than the maximum model length ..."), OpenAI (code
#: "context_length_exceeded"), SGLang ("... longer than the model's context length ...").
CONTEXT_REFUSAL = re.compile(
    r"context[ _]length|max_model_len|maximum model length|prompt is too long|too long and exceeds", re.I
)

#: embedded server sends it; vLLM does not, and the proxy's own version is recorded then).
WEIGHT_VERSION_HEADER = "X-Weight-Version"


class _ChoiceCapture:
    __slots__ = (
        "answer",
        "chars",
        "finish_reason",
        "ids",
        "ids_missing",
        "logprobs",
        "logprobs_bad",
        "prompt_ids",
    )

    def __init__(self) -> None:
        self.answer: Answer | None = None  # the chat answer as the agent gets it (for token-in sessions)
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

    __slots__ = (
        "_buf",
        "_crlf",
        "_data",
        "answers",
        "broken",
        "choices",
        "done",
        "kind",
        "model",
        "prompt_ids",
    )

    def __init__(self, kind: Literal["chat", "completion"], answers: bool = False) -> None:
        self.kind = kind
        #: Also assemble each chat choice's answer (content, tool calls) as the agent gets it.
        self.answers = answers
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
                if self.answers:
                    c.answer = Answer()
            if c.answer is not None:
                if (delta := ch.get("delta")) is not None:
                    c.answer.add_delta(delta)
                elif (message := ch.get("message")) is not None:
                    c.answer.set_message(message)
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


def _reported_version(headers: CIMultiDictProxy[str]) -> int | None:
    """The weight version a backend reports for an answer, if it reports a valid one."""
    value = headers.get(WEIGHT_VERSION_HEADER)
    if value is None or not value.isdigit():
        return None
    return int(value)


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


# ---------------------------------------------------------------------------------------------- recording
class _TurnKeeper(Protocol):
    """What keeps recorded calls' turns for token-in chat (:class:`~aglverl.proxy.tokenin.TokenIn`)."""

    def remember(self, call: _Call) -> None: ...


class _Recorder:
    """Records and counts calls (see the module docstring); a part of :class:`~aglverl.proxy.LLMProxy`."""

    if TYPE_CHECKING:  # the host's state (set by LLMProxy.__init__)
        store: ProxyStore
        m_calls: Counter
        m_no_ids: Counter
        m_unrecorded: Counter
        m_generated: Counter
        m_resume_failed: Counter
        token_in: _TurnKeeper | None
        m_upstream: Histogram
        m_first_byte: Histogram
        m_added: Histogram

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

    @staticmethod
    def _upstream_refused(call: _Call, status: int, body: bytes) -> None:
        """Fail a call the backend answered with an error; note a prompt refused for the context window."""
        message = _error_message(body)
        if 400 <= status < 500 and status != 429 and CONTEXT_REFUSAL.search(message):
            call.limit = "context"
        call.fail(f"backend answered {status}: {message}", "upstream_error")

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
        elif call.tokenin is not None and self.token_in is not None:
            self.token_in.remember(call)

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
