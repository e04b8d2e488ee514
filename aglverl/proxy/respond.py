"""The agent's side of a call: writing its answer, whole or in pieces, and ending it, well or broken.

:class:`Responder` is what the relay, the resumer and the token-in part write to the agent through. Its
interface (every method awaits the agent's socket, and none raises for an agent that left: the call is failed
as ``cancelled`` instead, and the method says so where it matters):

- :meth:`Responder.send_whole` — a whole answer: the call is committed (recorded) first, then the response is
  prepared and ended; delivered unless the agent left.
- :meth:`Responder.forward` — a piece of a streamed answer (translated for a translated call); for a recorded
  stream, complete events whose ids are captured after the write (before it, when they may complete the
  stream: the call is committed before the agent can read ``[DONE]`` and report its rollout done). ``False``
  when the agent has gone.
- :meth:`Responder.close_stream` — the end of a streamed answer whose last event went out (a translated call's
  last bytes, then EOF): the call is delivered.
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

from aiohttp import web

from .call import Call, error_body
from .capture import Capture
from .inbound import InboundRequest
from .recorder import Recorder

logger = logging.getLogger(__name__)

__all__ = ["Responder"]


class Responder:
    """Writes answers to agents and ends them (see the module docstring)."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    async def send_whole(self, request: web.Request, call: Call, response: web.Response) -> None:
        """Commit the call, then send ``response``: the call is delivered unless the agent has gone."""
        self.recorder.commit(call)
        try:
            if isinstance(request, InboundRequest):  # read by the proxy's own HTTP code: written at once
                call.first_byte = time.monotonic()
                await request.send_whole(response)
            else:
                await response.prepare(request)
                call.first_byte = time.monotonic()
                await response.write_eof()
        except ConnectionError:
            call.fail("agent disconnected", "cancelled")
        else:
            call.delivered = True

    async def close_stream(self, call: Call, response: web.StreamResponse) -> None:
        """End a streamed answer whose last event went out: a translated call's last bytes, then EOF; the call
        is delivered unless the agent has gone (then it is failed as cancelled)."""
        try:
            if call.translator is not None and (last := call.translator.close()):
                await response.write(last)
            await response.write_eof()
        except ConnectionError:
            call.fail("agent disconnected", "cancelled")
        else:
            call.delivered = True

    async def forward(
        self, call: Call, response: web.StreamResponse, chunk: bytes, capture: Capture | None = None
    ) -> bool:
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
                await response.write(out)
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
        """End a response whose head already went out: a final SSE error event (for streams), then the agent's
        connection closed without the body's last chunk (:func:`_abort`).

        A call whose agent already has the whole answer (``[DONE]`` went out) just gets its EOF.
        """
        response = call.response
        assert response is not None
        if not call.delivered:
            call.upstream_end = time.monotonic()
            call.fail(message)
            logger.warning(
                "call %d on %s failed after its response started: %s", call.seq, call.path, message
            )
        try:
            if call.translator is not None and not call.delivered:
                await response.write(call.translator.abort(message))  # that API's own error ending
            elif call.sse and not call.delivered:
                # A blank line first ends any event the backend left half-sent.
                prefix = b"" if call.tail.endswith(b"\n\n") else b"\n\n"
                await response.write(prefix + b"data: " + error_body(status, message) + b"\n\n")
            if call.delivered:
                await response.write_eof()
            else:
                _abort(response)
        except ConnectionError:
            pass


def _abort(response: web.StreamResponse) -> None:
    """Close the agent's connection under ``response`` without its last chunk: a body cut short is never taken
    for a whole one (a chunked body then lacks its terminating chunk; the handler's end writes nothing more)."""
    transport = getattr(
        response._req, "transport", None
    )  # the request it was prepared for: aiohttp's or ours
    if transport is not None:
        transport.close()
