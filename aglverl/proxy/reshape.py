"""A completion answered to a chat call, spelled back as the chat answer the call expects.

A backend that takes prompt ids only on its completions route (SGLang's ``/v1/completions``, and any
:class:`~aglverl.proxy.dialect.Dialect` whose :meth:`~aglverl.proxy.dialect.Dialect.token_in` says its answer is
a ``"completion"``) answers a chat call made from ids with a completion: ``choices[i].text``, completions
log-probs, ``text_completion`` objects. :class:`CompletionAsChat` turns that answer, a whole JSON body or an SSE
stream cut anywhere, into a chat completion (``message`` / ``delta`` with the text as ``content``, chat
log-probs, ``chat.completion`` / ``chat.completion.chunk`` objects, the prompt's ids at the top level) before
anything else of the proxy reads it, so the capture, the resumer, the translators and the agent see a chat
answer; every other field of a choice (its ids, in the wire's own names, the finish and stop reasons) is kept.
Such a backend parses no tool calls out of the text: the answer's content is the text as generated.

Pure and synchronous: bytes in, bytes out, no I/O. An error answer (status >= 400), a body that is not JSON, or
an event that is not a JSON object is passed on unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from .capture import AnswerWire
from .sse import EVENT_END, EventCut, event_json

__all__ = ["CompletionAsChat", "chat_logprobs"]


def chat_logprobs(logprobs: Any, top: int) -> list[dict[str, Any]]:
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


class CompletionAsChat:
    """Re-spells one call's completion answer as a chat answer (see the module docstring).

    ``wire``: the backend's field names (the prompt's ids move from the first choice to the top level, as a chat
    answer carries them); ``request``: the chat call, whose ``logprobs`` / ``top_logprobs`` say whether and how
    the answer's log-probs are wanted. One per call: :meth:`whole` for a body with a length, or :meth:`feed` for
    each piece of a stream and :meth:`rest` at its end.
    """

    __slots__ = ("_body", "_cut", "_logprobs", "_prompt", "_sse", "_started", "_status", "_top", "wire")

    def __init__(self, wire: AnswerWire, request: Mapping[str, Any]) -> None:
        self.wire = wire
        self._logprobs = bool(request.get("logprobs"))
        self._top = int(request.get("top_logprobs") or 0)
        self._cut = EventCut()
        self._started: set[Any] = set()  # the choices whose first delta went out (it names the role)
        self._status = 200
        self._sse = True
        self._body = bytearray()  # a body streamed without events: spelled anew at its end
        self._prompt = True  # the prompt's ids still to be put at the top level (the first event's)

    def whole(self, status: int, body: bytes) -> bytes:
        """A whole completion body as a chat completion body (unchanged when it is an error or not JSON)."""
        try:
            answer = orjson.loads(body) if status < 400 else None
        except orjson.JSONDecodeError:
            answer = None
        if not isinstance(answer, dict):
            return body
        return orjson.dumps(self._answer(answer, "chat.completion", "message"))

    def open(self, status: int, sse: bool) -> None:
        """A body sent in pieces starts, answered with ``status`` (an error's body is passed on unchanged): an
        SSE stream (``sse``), or a JSON body without a length, re-spelled whole at its end."""
        self._status, self._sse = status, sse

    def feed(self, chunk: bytes) -> bytes:
        """The chat events of a stream's next piece (complete events only; the rest waits for more)."""
        if not self._sse:
            self._body += chunk
            return b""
        events = self._cut.feed(chunk)
        if self._status >= 400 or not events:
            return events
        return b"".join(self._event(raw) for raw in EVENT_END.split(events) if raw.strip())

    def rest(self) -> bytes:
        """At the body's end: what was kept of an event the stream ended in the middle of (passed on as it is),
        or a body without events, re-spelled whole."""
        if not self._sse:
            return self.whole(self._status, bytes(self._body))
        return self._cut.rest()

    def _event(self, raw: bytes) -> bytes:
        event = event_json(raw)
        if event is None:  # [DONE], or not a JSON object: as it came
            return raw + b"\n\n"
        return b"data: " + orjson.dumps(self._answer(event, "chat.completion.chunk", "delta")) + b"\n\n"

    def _answer(self, answer: dict[str, Any], kind: str, holder: str) -> dict[str, Any]:
        choices = answer.get("choices")
        out = {**answer, "object": kind}
        if not isinstance(choices, list):
            return out
        field = self.wire.prompt_ids
        chat = []
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            prompt = choice.get(field)
            if prompt is not None and self._prompt:
                out[field] = prompt
            c = {key: value for key, value in choice.items() if key not in ("text", "logprobs", field)}
            text = choice.get("text") or ""
            if holder == "message":
                c["message"] = {"role": "assistant", "content": text}
            else:
                first = choice.get("index", 0) not in self._started
                self._started.add(choice.get("index", 0))
                c["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
            c["logprobs"] = (
                {"content": chat_logprobs(choice.get("logprobs"), self._top)} if self._logprobs else None
            )
            chat.append(c)
        if chat and field in out:
            self._prompt = False
        out["choices"] = chat
        return out
