"""The agent's side of a call: writing its answer, whole or in pieces, and ending it, well or broken.

:class:`Responder` is what the relay, the resumer and the token-in part write to the agent through, on the
call's :class:`~aglverl.proxy.http.Exchange`. Its interface (every method awaits the agent's socket, and none
raises for an agent that left: the call is failed as ``cancelled`` instead, and the method says so where it
matters):

- :meth:`Responder.send_whole` — a whole answer: the call is committed (recorded) first, then the answer is
  written; delivered unless the agent left.
- :meth:`Responder.start_stream` — the head of a streamed answer; ``False`` when the agent has gone.
- :meth:`Responder.forward` — a piece of a streamed answer (translated for a translated call); for a recorded
  stream, complete events whose ids are captured after the write (before it, when they may complete the
  stream: the call is committed before the agent can read ``[DONE]`` and report its rollout done). ``False``
  when the agent has gone.
- :meth:`Responder.close_stream` — the end of a streamed answer whose last event went out (a translated call's
  last bytes, then the end): the call is delivered.
- :meth:`Responder.end_broken` — a response whose head already went out, broken off: a final SSE error event
  (or the translated API's own error ending), then the agent's connection is closed without the body's last
  chunk, so that its HTTP client sees the answer cut short, never whole; the call fails. An agent that already
  had its whole answer just gets the end of it.

Cancellation (the agent left, shutdown) interrupts a write; the caller's handler records the call as
cancelled. Holds the recorder (commits happen here, at the last moment before the agent sees the end).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from .call import Call, error_body
from .capture import Capture
from .recorder import Recorder

logger = logging.getLogger(__name__)

__all__ = ["Responder"]


class Responder:
    """Writes answers to agents and ends them (see the module docstring)."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    async def send_whole(
        self, call: Call, status: int, headers: Mapping[str, str], body: bytes, reason: str | None = None
    ) -> None:
        """Commit the call, then send the whole answer: the call is delivered unless the agent has gone."""
        self.recorder.commit(call)
        try:
            call.first_byte = time.monotonic()
            assert call.exchange is not None
            await call.exchange.send_whole(status, headers, body, reason)
        except ConnectionError:
            call.fail("agent disconnected", "cancelled")
        else:
            call.delivered = True

    async def start_stream(
        self, call: Call, status: int, headers: Mapping[str, str], reason: str | None = None
    ) -> bool:
        """Send the head of a streamed answer; ``False`` (the call failed as cancelled) when the agent has gone."""
        assert call.exchange is not None
        try:
            await call.exchange.start(status, headers, reason)
        except ConnectionError:
            call.fail("agent disconnected", "cancelled")
            return False
        call.first_byte = time.monotonic()
        return True

    async def close_stream(self, call: Call) -> None:
        """End a streamed answer whose last event went out: a translated call's last bytes, then the end; the call
        is delivered unless the agent has gone (then it is failed as cancelled)."""
        exchange = call.exchange
        assert exchange is not None
        try:
            last = call.translator.close() if call.translator is not None else b""
            await exchange.end(last or b"")
        except ConnectionError:
            call.fail("agent disconnected", "cancelled")
        else:
            call.delivered = True

    async def forward(self, call: Call, chunk: bytes, capture: Capture | None = None) -> bool:
        """Send a piece of a streamed answer to the agent (translated, for a translated call); ``False`` if the
        agent has gone (the call is then failed as cancelled).

        ``capture``: the piece is complete SSE events, whose ids it takes: after the write (the agent is not kept
        waiting for the parse), or before it when they may end the stream, so that the call is committed
        before the agent can read ``[DONE]`` and report its rollout done."""
        last = capture is not None and b"[DONE]" in chunk
        if last:
            capture.take_events(chunk)  # type: ignore[union-attr]
            if capture.done:  # type: ignore[union-attr]
                call.upstream_end = time.monotonic()
                self.recorder.commit(call)
        try:
            # A translated call's bytes go out translated, event by event, as they arrive.
            out = chunk if call.translator is None else call.translator.feed(chunk)
            if out:
                await call.exchange.write(out)  # type: ignore[union-attr]  # a stream has its agent
        except ConnectionError:
            call.fail("agent disconnected", "cancelled")
            return False
        call.tail = chunk
        if call.records is not None:
            call.delivered = True
        elif capture is not None and not last:
            capture.take_events(chunk)
        return True

    async def end_broken(self, call: Call, status: int, message: str) -> None:
        """End a response whose head already went out: a final SSE error event (for streams; a translated call's
        API's own error ending), then the agent's connection closed without the body's last chunk
        (:meth:`Exchange.abort <aglverl.proxy.http.Exchange.abort>`): its client sees the answer cut short,
        never whole.

        A call whose agent already has the whole answer (``[DONE]`` went out) just gets its end.
        """
        exchange = call.exchange
        assert exchange is not None and exchange.started
        try:
            if call.delivered:
                await exchange.end()
                return
            call.upstream_end = time.monotonic()
            call.fail(message)
            logger.warning(
                "call %d on %s failed after its response started: %s", call.seq, call.path, message
            )
            last = b""
            if call.translator is not None:
                last = call.translator.abort(message)
            elif call.sse:
                # A blank line first ends any event the backend left half-sent.
                prefix = b"" if call.tail.endswith(b"\n\n") else b"\n\n"
                last = prefix + b"data: " + error_body(status, message) + b"\n\n"
            await exchange.write(last)
            exchange.abort()
        except ConnectionError:
            pass
