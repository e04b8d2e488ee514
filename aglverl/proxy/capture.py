"""Token capture: reading token ids, log-probs and stop reasons out of answers and streams.

:class:`Capture` assembles one call's choices from a whole JSON body (``take_body``) or from its SSE stream,
fed in chunks cut anywhere (``feed``) or in complete events (``take_events``). Each body or event is decoded
once, by a typed decoder (msgspec) that builds only what is recorded: the ids (one list per piece), each
token's log-prob value, finish reasons, and the answer's text and tool calls; a log-probs entry's token text,
bytes and alternatives are skipped, never built (a 256-token answer with log-probs is ~1,000 fewer Python
objects than a full parse), and the events of one read are decoded in one call. The decoder types the ids as
token ids (ints in int64's range, not negative) and the log-probs as numbers, so that the recorder's check of a
256-token answer is one ``max`` against the vocabulary instead of a pass over every id's type and value (~9 µs
a call); a piece it refuses is read again as it came (:attr:`Capture.typed` false), and checked as before.
Choices are kept by ``index`` (``n > 1`` streams interleave them). A choice's ids are reported only when
complete: one piece of output without ids (``ids_missing``) or one event that cannot be parsed (``broken``) makes them absent, never partial; log-probs
only when there is exactly one float per id. With ``answers``, each chat choice's answer as the agent gets it
(content, tool calls) is assembled too (:class:`~aglverl.proxy.session.Answer`, for token-in sessions).

Pure and synchronous: no I/O, no clock, nothing awaited. Bad input (an event that is not JSON, or not shaped
like an OpenAI answer) is never raised: it makes the capture ``broken``. What becomes of a capture (records in
the store) is :mod:`~aglverl.proxy.recorder`'s. Which fields hold the ids, and the abort's finish reason, are the
backend's wire (:class:`AnswerWire`, its :class:`~aglverl.proxy.dialect.Dialect`'s): vLLM's
(``prompt_token_ids``, ``token_ids``, ``"abort"``) unless told.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
import orjson

from ..models import TOKEN_ID_BOUND, checked_token_ids
from .session import Answer

#: Paths (after ``/v1/``) whose token ids are captured, and the response shape each one has.
CAPTURED_PATHS: Mapping[str, Literal["chat", "completion"]] = {
    "chat/completions": "chat",
    "completions": "completion",
}


class _Entry(msgspec.Struct, gc=False):
    """A chat log-probs entry, of which only the sampled token's log-prob is read (its token text, bytes and
    alternatives are skipped by the decoder, never built)."""

    logprob: Any  # required: an entry without one is not OpenAI-shaped


class _Logprobs(msgspec.Struct, gc=False):
    content: list[_Entry] | None = None  # chat
    token_logprobs: Any = None  # completions


class _FloatEntry(msgspec.Struct, gc=False):
    """:class:`_Entry` as the checked decoder reads it: the log-prob a number (an integer becomes a float)."""

    logprob: float


class _FloatLogprobs(msgspec.Struct, gc=False):
    content: list[_FloatEntry] | None = None
    token_logprobs: list[float] | None = None


#: A token id as the checked decoder reads it: an integer (not a bool, not a float) in int64's range, not
#: negative (what :func:`~aglverl.models.checked_token_ids` accepts, the vocabulary's bound aside).
_TokenId = Annotated[int, msgspec.Meta(ge=0, le=TOKEN_ID_BOUND - 1)]
_TokenIds = list[_TokenId] | None


@dataclass(frozen=True, slots=True)
class AnswerWire:
    """Where a backend's answers carry what capture reads, by the names its wire gives them: the prompt's ids
    (top-level in a chat answer, per choice in a completion), each choice's generated ids, and the finish
    reason of a generation the engine aborted. vLLM's (:data:`VLLM_WIRE`) by default; a backend's
    :class:`~aglverl.proxy.dialect.Dialect` names its own."""

    prompt_ids: str = "prompt_token_ids"
    response_ids: str = "token_ids"
    abort_reason: str = "abort"
    #: ``abort_reason`` as it stands in an answer's JSON (what a cheap look for an abort searches).
    abort_marker: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "abort_marker", orjson.dumps(self.abort_reason))


#: vLLM's answers (``return_token_ids``), which the embedded engine gives too.
VLLM_WIRE = AnswerWire()


class _Decoders:
    """The typed decoders of one wire: an answer (or event) and an array of them, reading only what capture
    records; the structs name the fields as the rest of this module does, the wire's names renamed in.

    Two of each: ``checked_one`` / ``checked_many`` type the ids as token ids and the log-probs as numbers, so
    that what they decode needs no check of its own afterwards (a pass over every id in Python, per call);
    ``one`` / ``many`` take those fields as they come (:class:`Capture` falls back to them for a piece the
    checked ones refuse, whose ids and log-probs :meth:`Capture.result` and the recorder then check)."""

    def __init__(self, wire: AnswerWire) -> None:
        self.one, self.many = self._pair(wire, Any, _Logprobs)
        self.checked_one, self.checked_many = self._pair(wire, _TokenIds, _FloatLogprobs)

    @staticmethod
    def _pair(
        wire: AnswerWire, ids: Any, logprobs: Any
    ) -> tuple[Callable[[bytes], Any], Callable[[bytes], Any]]:
        rename = {"token_ids": wire.response_ids, "prompt_token_ids": wire.prompt_ids}
        choice = msgspec.defstruct(
            "_PieceChoice",
            [
                ("index", Any, 0),
                ("token_ids", ids, None),
                ("prompt_token_ids", ids, None),
                ("logprobs", logprobs | None, None),
                ("finish_reason", Any, None),
                ("stop_reason", Any, None),  # vLLM: the stop token id (or string) that ended the choice
                ("text", Any, None),  # completions
                ("delta", Any, None),  # chat, streamed
                ("message", Any, None),  # chat, whole
            ],
            rename=rename,
            gc=False,
        )
        piece = msgspec.defstruct(
            "_Piece",
            [
                ("id", Any, None),
                ("model", Any, None),
                ("prompt_token_ids", ids, None),
                ("choices", list[choice] | None, None),  # type: ignore[valid-type]
            ],
            rename=rename,
            gc=False,
        )
        one = msgspec.json.Decoder(piece).decode
        many = msgspec.json.Decoder(list[piece]).decode  # type: ignore[valid-type]
        return one, many


@functools.cache
def _decoders(wire: AnswerWire) -> _Decoders:
    return _Decoders(wire)


_NUMBERS = frozenset({float, int})
_FLOAT = frozenset({float})


class ChoiceCapture:
    __slots__ = (
        "answer",
        "chars",
        "finish_reason",
        "ids",
        "ids_missing",
        "logprobs",
        "prompt_ids",
        "stop_reason",
    )

    def __init__(self) -> None:
        self.answer: Answer | None = None  # the chat answer as the agent gets it (for token-in sessions)
        self.chars = 0  # completions: characters of text so far (where a continuation's text_offset starts)
        self.prompt_ids: list[int] | None = None
        self.ids: list[int] | None = None
        self.logprobs: list[Any] | None = None  # as sent; checked to be one number per id by result()
        self.finish_reason: str | None = None
        self.stop_reason: Any = None  # what the backend says ended it (vLLM: a stop token id, or a string)
        self.ids_missing = False


class Capture:
    """Token ids, logprobs and finish reasons of one call, assembled from its JSON body or its SSE events.

    ``feed`` takes a stream's bytes as they arrive, in chunks cut anywhere (partial lines are buffered);
    ``take_events`` takes complete events (what the relay cuts a recorded stream into); ``take_body`` one whole
    JSON answer, ``apply`` one already parsed. Each event or body is decoded once, by a typed decoder that
    builds only what capture reads (ids, log-prob values, finish reasons, the answer's text and tool calls),
    never the per-token entries' texts, bytes and alternatives. Choices are kept by ``index``, so ``n > 1``
    streams that interleave choices assemble correctly. An event that cannot be parsed makes the capture
    ``broken``: its response ids are then reported as absent rather than incomplete.
    """

    __slots__ = (
        "_buf",
        "_crlf",
        "_data",
        "_decoders",
        "answers",
        "broken",
        "choices",
        "done",
        "kind",
        "model",
        "prompt_ids",
        "response_id",
        "typed",
        "wire",
    )

    def __init__(
        self, kind: Literal["chat", "completion"], answers: bool = False, wire: AnswerWire = VLLM_WIRE
    ) -> None:
        self.kind = kind
        #: The names the backend's answers give what is read (its dialect's).
        self.wire = wire
        self._decoders = _decoders(wire)
        #: Also assemble each chat choice's answer (content, tool calls) as the agent gets it.
        self.answers = answers
        self.prompt_ids: list[int] | None = None
        self.model: str | None = None
        #: The answer's ``id`` (its first piece's), as the agent gets it: what ties a call to the agent's trace.
        self.response_id: str | None = None
        self.choices: dict[Any, ChoiceCapture] = {}
        self.done = False
        self.broken = False
        #: Every piece so far was read by the checked decoders: its ids are token ids below int64's bound and
        #: its log-probs numbers (floats), with nothing left to check but the vocabulary's bound.
        self.typed = True
        self._buf = b""
        self._data: list[bytes] = []
        self._crlf = False

    # ------------------------------------------------------------------ SSE framing
    def feed(self, chunk: bytes) -> None:
        """Take a stream's next bytes, cut anywhere: each event they complete is decoded."""
        buf = self._buf + chunk if self._buf else chunk
        if self._crlf or b"\r" in buf:
            self._crlf = True  # from now on the general line parser, which also takes CR LF line ends
            self._buf = self._feed_lines(buf)
            return
        end = buf.rfind(b"\n\n") + 2  # the way vLLM frames events: LF line ends, a blank line after each
        if end < 2:
            self._buf = buf
            return
        self._buf = buf[end:]
        self._take_blocks(buf[:end] if end < len(buf) else buf)

    def take_events(self, events: bytes) -> None:
        """Take complete SSE events (each ended by a blank line), as the relay cuts a recorded stream."""
        if self._crlf or b"\r" in events:
            self._crlf = True
            self._buf = self._feed_lines(self._buf + events)
            return
        self._take_blocks(events)

    def _take_blocks(self, events: bytes) -> None:
        if events[:6] == b"data: " and events.find(b"\n") == len(events) - 2:  # one event: the usual read
            self._take_one(events[6:-2])
            return
        datas = []
        for block in events.split(b"\n\n"):
            if block[:6] == b"data: " and b"\n" not in block:
                datas.append(block[6:])
            elif block:
                datas.extend(_event_datas(block))
        self._dispatch(datas)

    def _feed_lines(self, buf: bytes) -> bytes:
        """The general SSE line parser; returns the bytes of an unfinished last line."""
        start = 0
        datas = []
        while (end := buf.find(b"\n", start)) >= 0:
            line = buf[start:end]
            start = end + 1
            if line[-1:] == b"\r":
                line = line[:-1]
            if not line:
                if self._data:
                    datas.append(self._data[0] if len(self._data) == 1 else b"\n".join(self._data))
                    self._data = []
            elif line[:5] == b"data:":
                value = line[5:]
                self._data.append(value[1:] if value[:1] == b" " else value)
            # Other SSE fields (event:, id:, retry:, comments) carry nothing the proxy records.
        self._dispatch(datas)
        return buf[start:]

    def _take_one(self, data: bytes) -> None:
        """Decode and take one event's data (what :meth:`_dispatch` does with one, without its lists: this is
        the per-event path of a recorded stream)."""
        if data == b"[DONE]":
            self.done = True
            return
        try:
            piece = self._decode(data)
        except msgspec.DecodeError:  # a ValidationError too: not an OpenAI-shaped event
            self.broken = True
            return
        try:
            self._take(piece)
        except (AttributeError, TypeError):
            self.broken = True

    def _dispatch(self, datas: list[bytes]) -> None:
        """Decode the events' data (those of one read at once) and take them in order."""
        if b"[DONE]" in datas:
            self.done = True
            datas = [data for data in datas if data != b"[DONE]"]
        if not datas:
            return
        try:
            pieces = [self._decode(datas[0])] if len(datas) == 1 else self._decode(_as_array(datas), True)
        except msgspec.DecodeError:
            pieces = None
        # Joined into one array, an event that is not one JSON value (``{...}, {...}``) would pass as several:
        # one piece per event, or each event is decoded alone.
        if pieces is None or len(pieces) != len(datas):
            self.broken = True  # not an OpenAI-shaped event: ids from this stream cannot be trusted
            pieces = [piece for data in datas if (piece := self._decoded_or_none(data)) is not None]
        for piece in pieces:
            try:
                self._take(piece)
            except (AttributeError, TypeError):
                self.broken = True

    # ------------------------------------------------------------------ bodies and events
    def take_body(self, body: bytes) -> bool:
        """Take one whole JSON answer; ``False`` when it is not JSON at all (a body that is JSON but not
        shaped like an answer makes the capture ``broken``)."""
        try:
            self._take(self._decode(body))
        except msgspec.ValidationError:
            self.broken = True
        except msgspec.DecodeError:
            return False
        except (AttributeError, TypeError):
            self.broken = True
        return True

    def apply(self, obj: Any) -> None:
        """Take one parsed JSON body (or event)."""
        self.take_body(orjson.dumps(obj))

    def _decoded_or_none(self, data: bytes) -> Any:
        try:
            return self._decode(data)
        except msgspec.DecodeError:
            return None

    def _decode(self, data: bytes, many: bool = False) -> Any:
        """One piece (``many``: a JSON array of pieces), by the checked decoder unless its ids or log-probs are
        not what it takes (then as they come, and the capture is no longer :attr:`typed`); raises
        ``msgspec.DecodeError``."""
        decoders = self._decoders
        if self.typed:
            try:
                return decoders.checked_many(data) if many else decoders.checked_one(data)
            except msgspec.ValidationError:
                self.typed = False
        return decoders.many(data) if many else decoders.one(data)

    def _take(self, piece: Any) -> None:
        if self.model is None:
            self.model = piece.model if isinstance(piece.model, str) else None
        if self.response_id is None and isinstance(piece.id, str):
            self.response_id = piece.id
        if self.prompt_ids is None:
            self.prompt_ids = piece.prompt_token_ids
        chat = self.kind == "chat"
        for ch in piece.choices or ():
            c = self.choices.get(ch.index)
            if c is None:
                c = self.choices[ch.index] = ChoiceCapture()
                if self.answers:
                    c.answer = Answer()
            if c.answer is not None:
                if ch.delta is not None:
                    c.answer.add_delta(ch.delta)
                elif ch.message is not None:
                    c.answer.set_message(ch.message)
            ids = ch.token_ids
            if ids is not None:
                if c.ids is None:
                    c.ids = ids  # a fresh list from the decoder: owned, extended in place by later events
                else:
                    c.ids.extend(ids)
            elif self._has_output(ch):
                c.ids_missing = True
            if not chat:
                c.chars += len(ch.text or "")
            if c.prompt_ids is None:
                c.prompt_ids = ch.prompt_token_ids
            lp = ch.logprobs
            if lp is not None:
                values = [e.logprob for e in lp.content or ()] if chat else (lp.token_logprobs or [])
                if c.logprobs is None:
                    c.logprobs = values if chat else list(values)
                else:
                    c.logprobs.extend(values)
            if ch.finish_reason is not None:
                c.finish_reason = ch.finish_reason
                c.stop_reason = ch.stop_reason

    def _has_output(self, ch: Any) -> bool:
        if self.kind == "completion":
            return bool(ch.text)
        delta = ch.delta or ch.message or {}
        return bool(delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"))

    @property
    def aborted(self) -> bool:
        """Whether a choice ended with the wire's abort reason (the engine cut it off: vLLM's ``"abort"``)."""
        reason = self.wire.abort_reason
        return any(c.finish_reason == reason for c in self.choices.values())

    def result(self) -> list[tuple[Any, ChoiceCapture, list[int] | None, list[float] | None]]:
        """``(index, choice, response_ids, logprobs)`` per choice in index order; ids ``None`` unless complete,
        logprobs ``None`` unless there is exactly one number per id (never ``None`` for an echoed prompt
        token, nor a boolean)."""
        out = []
        for idx in sorted(self.choices):
            c = self.choices[idx]
            ids = None if (c.ids_missing or self.broken) else c.ids
            lps: list[float] | None = None
            values = c.logprobs
            # (ids sent as anything but a list, an int say, are no ids: the recorder's check says so)
            if type(ids) is list and values is not None and len(values) == len(ids):
                if self.typed:
                    lps = values  # floats, every one (the checked decoder's)
                else:
                    kinds = set(map(type, values))
                    if kinds <= _NUMBERS:  # not None (an echoed prompt token's), nor a boolean
                        lps = values if kinds == _FLOAT else list(map(float, values))
            out.append((idx, c, ids, lps))
        return out

    def token_ids(self, ids: Any, vocab_size: int | None) -> list[int] | None:
        """``ids`` (a prompt's or a choice's, as captured) if they are token ids below ``vocab_size``, else
        ``None`` (:func:`~aglverl.models.checked_token_ids`). Ids the checked decoder read are ints in int64's
        range already: only their largest is compared with the vocabulary."""
        if not self.typed:
            return checked_token_ids(ids, vocab_size)
        if ids and vocab_size is not None and max(ids) >= vocab_size:
            return None
        return ids


def _as_array(datas: list[bytes]) -> bytes:
    return b"[" + b",".join(datas) + b"]"


def _event_datas(block: bytes) -> list[bytes]:
    """The data of one SSE event written otherwise than ``data: <json>`` on one line (several ``data:`` lines
    joined; other fields ignored); none for an event without data."""
    lines = [line[5:].removeprefix(b" ") for line in block.split(b"\n") if line[:5] == b"data:"]
    return [b"\n".join(lines)] if lines else []
