"""Token capture: reading token ids, log-probs and stop reasons out of answers and streams.

:class:`_Capture` assembles one call's choices from a whole JSON body (``apply``) or from its SSE stream fed in
chunks cut anywhere (``feed``; each complete event is parsed once). Choices are kept by ``index`` (``n > 1``
streams interleave them). A choice's ids are reported only when complete: one piece of output without ids
(``ids_missing``) or one event that cannot be parsed (``broken``) makes them absent, never partial; log-probs
only when there is exactly one float per id. With ``answers``, each chat choice's answer as the agent gets it
(content, tool calls) is assembled too (:class:`~aglverl.proxy.session.Answer`, for token-in sessions).

Pure and synchronous: no I/O, no clock, nothing awaited. Bad input (an event that is not JSON, or not shaped
like an OpenAI answer) is never raised: it makes the capture ``broken``. What becomes of a capture (records in
the store) is :mod:`~aglverl.proxy.recorder`'s.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

import orjson
from multidict import CIMultiDictProxy

from .session import Answer

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
