"""Server-sent events as the proxy handles them: cutting a stream into whole events, reading their data,
writing events (the relay, the resumption and the API translators all read and write SSE through here).

Pure functions on bytes, no state beyond :class:`EventCut`'s unfinished tail. Events end with a blank line,
LF or CR LF; an event's ``data`` is its ``data:`` lines joined. :func:`may_abort` and :func:`_may_end_stream`
are cheap looks (a substring search where the word can be) that decide whether a chunk is worth parsing: a
``True`` may be wrong (the word was text), a ``False`` never is.
"""

from __future__ import annotations

import re
from typing import Any

import orjson


def _may_end_stream(tail: bytes, chunk: bytes) -> bool:
    """Whether ``chunk`` (after ``tail``, the previous chunk) may complete an SSE ``data: [DONE]`` line."""
    return b"[DONE]" in chunk or (bool(tail) and b"[DONE]" in tail[-6:] + chunk[:6])


#: Chunks up to this size are searched whole for an abort (a search costs about what finding the tail does).
_ABORT_SCAN_WHOLE = 1024
EVENT_END = re.compile(rb"\r?\n\r?\n")
DONE_EVENT = b"data: [DONE]\n\n"


class EventCut:
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


def may_abort(events: bytes, marker: bytes = b'"abort"') -> bool:
    """Whether complete SSE events may hold an aborted choice (a cheap look: ``marker``, the backend's abort
    reason as JSON spells it, vLLM's ``"abort"``, where it can be).

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
    return events.find(marker, start) >= 0


def _event_data(raw: bytes) -> bytes:
    """The ``data`` of one SSE event (its lines joined)."""
    lines = [line[5:].removeprefix(b" ") for line in raw.splitlines() if line[:5] == b"data:"]
    return lines[0] if len(lines) == 1 else b"\n".join(lines)


def payloads(events: bytes) -> list[bytes]:
    """The ``data`` of each of some complete SSE events."""
    return [data for raw in EVENT_END.split(events) if raw and (data := _event_data(raw))]


def json_object(data: bytes) -> dict[str, Any] | None:
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def event_json(raw: bytes) -> dict[str, Any] | None:
    return json_object(_event_data(raw))


def choices_of(event: dict[str, Any] | None) -> list[dict[str, Any]]:
    choices = event.get("choices") if event is not None else None
    return [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []


def sse_event(obj: Any, name: str | None = None) -> bytes:
    """One SSE event whose data is ``obj`` as JSON, named ``name`` (an ``event:`` line) when given."""
    data = b"data: " + orjson.dumps(obj) + b"\n\n"
    return data if name is None else b"event: " + name.encode() + b"\n" + data
