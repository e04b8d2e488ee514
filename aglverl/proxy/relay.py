"""Relaying: a call's upstream tries, and the backend's answer passed to the agent, JSON or SSE.

:meth:`_Relay._attempts` is the retry loop: a backend from the pool per try; connection failures, 5xx and 429
are tried again elsewhere (with the retry policy's backoff, ``Retry-After`` honoured within the budget) while
no byte has reached the agent; the last retryable answer is passed through when no try does better.

:meth:`_Relay._relay` passes the answer on with exactly the backend's status, body bytes and end-to-end
headers. A body with a ``Content-Length`` (:meth:`_Relay._relay_whole`) is read whole (bounded by
``max_response_bytes``), captured once, and sent; an aborted one is first resumed or made again
(:mod:`~aglverl.proxy.resume`). A stream (:meth:`_Relay._relay_stream`) goes out chunk by chunk as it arrives
(a recorded SSE answer in whole events, so that an abort can be taken out before the agent has any of it), its
ids captured incrementally after each write; a translated call's bytes go through its translator. The call is
committed (recorded) before the agent can read ``[DONE]`` or the last byte of a JSON answer.

Disconnects: an agent that leaves fails the call as ``cancelled`` (aiohttp's handler cancellation closes the
upstream request). A stream that breaks after bytes went out, overruns ``max_response_bytes`` or outlives
``request_timeout`` is ended with a final SSE error event (:meth:`_Relay._end_broken`) and recorded as
failed. Everything here sits on :mod:`~aglverl.proxy.resume` (and through it on capture and pool).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import anyio
from aiohttp import web
from multidict import CIMultiDict

from ..metrics import Counter
from ..translate import TranslationError
from .call import (
    _JSON,
    _RESPONSE_DROP,
    _SSE,
    ERROR_BODY_LIMIT,
    ProxyError,
    _Call,
    _error_body,
    _error_message,
    _forward_headers,
    _Unreachable,
)
from .capture import _Capture, _reported_version
from .pool import RETRY_STATUSES, _Backend, _Held
from .resume import _resume_blocker, _StreamResumer
from .sse import _EventCut, _may_abort, _may_end_stream

logger = logging.getLogger(__name__)


class _Relay(_StreamResumer):
    """Forwards calls and relays answers (see the module docstring); a part of
    :class:`~aglverl.proxy.LLMProxy`."""

    if TYPE_CHECKING:  # the host's state (set by LLMProxy.__init__)
        m_retries: Counter
        weight_version: int

    async def _attempts(self, request: web.Request, call: _Call) -> web.StreamResponse:
        policy = self.retry
        deadline = call.t0 + policy.total_timeout
        tried: list[_Backend] = []
        failure: ProxyError | None = None
        held: _Held | None = None
        for attempt in range(policy.attempts):
            backend = self._pick(call.rollout_id, tried)
            if backend is None:
                raise ProxyError(503, "no backends are configured")
            if attempt:
                delay = max(policy.backoff(attempt), backend.not_before - time.monotonic())
                if time.monotonic() + delay > deadline:
                    break
                self.m_retries.inc()
                if delay > 0:
                    await anyio.sleep(delay)
            tried.append(backend)
            backend.in_flight += 1
            try:
                upstream = await self._send(backend, call)
                if upstream.status in RETRY_STATUSES and attempt + 1 < policy.attempts:
                    held = await self._hold(backend, upstream)
                    continue
                return await self._relay(request, call, upstream)
            except _Unreachable as exc:  # raised only while nothing has been sent to the agent
                failure = ProxyError(502, str(exc))
            finally:
                backend.in_flight -= 1
        if held is not None:
            return await self._send_held(request, call, held)
        assert failure is not None
        tries = len(tried)
        raise ProxyError(502, f"{failure.message} (after {tries} {'try' if tries == 1 else 'tries'})")

    async def _send_held(self, request: web.Request, call: _Call, held: _Held) -> web.StreamResponse:
        call.upstream_end = time.monotonic()
        call.fail(f"backend answered {held.status}: {_error_message(held.body)}", "upstream_error")
        body, headers = held.body, held.headers
        if call.translator is not None:
            body = call.translator.whole(held.status, body)
            headers["Content-Type"] = _JSON
        response = web.Response(status=held.status, reason=held.reason, body=body, headers=headers)
        await self._send_whole(request, call, response)
        return response

    async def _relay(
        self, request: web.Request, call: _Call, upstream: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        """Relay the backend's answer to the agent, capturing token ids on the way; closes ``upstream``."""
        try:
            headers = _forward_headers(upstream.headers, _RESPONSE_DROP)
            content_type = upstream.headers.get("Content-Type", "")
            call.sse = content_type.startswith(_SSE)
            if call.capture is not None:
                # A backend that reports no version (vLLM): the proxy's when the answer's head arrives, not
                # when the call came in: a call admitted before a hold that reached a paused engine waited
                # there and was generated under the weights that came after.
                version = _reported_version(upstream.headers)
                call.weight_version = self.weight_version if version is None else version
            if call.sse or (
                upstream.content_length is None
                and upstream.status not in (204, 304)
                and call.method != "HEAD"
            ):
                return await self._relay_stream(request, call, upstream, headers)
            return await self._relay_whole(request, call, upstream, headers)
        finally:
            upstream.close()  # a no-op once the body was read to the end; otherwise drops the connection

    async def _relay_whole(
        self, request: web.Request, call: _Call, upstream: aiohttp.ClientResponse, headers: CIMultiDict[str]
    ) -> web.StreamResponse:
        length = upstream.content_length or 0
        if length > self.max_response_bytes:
            raise ProxyError(
                502, f"backend answered {length} bytes, over max_response_bytes={self.max_response_bytes}"
            )
        try:
            body = await upstream.read()
        except TimeoutError:
            raise ProxyError(504, self._timed_out(call)) from None
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            # Nothing has reached the agent yet, so this is as retryable as a refused connection.
            raise _Unreachable(f"backend {call.backend} broke off the response: {exc!r}") from exc
        call.upstream_end = time.monotonic()
        answer = self._capture_body(call, upstream.status, body)
        if answer is not None and call.capture is not None and call.capture.aborted:
            assert call.request is not None
            if _resume_blocker(call.request, call.kind) is None:
                body = await self._resume_whole(call, answer)
            else:
                body = await self._regenerate_whole(call)
            call.upstream_end = time.monotonic()
        if call.translator is not None:
            try:
                body = call.translator.whole(upstream.status, body)
            except TranslationError as exc:
                raise ProxyError(exc.status, exc.message) from None
            headers["Content-Type"] = _JSON
        response = web.Response(status=upstream.status, reason=upstream.reason, body=body, headers=headers)
        await self._send_whole(request, call, response)
        return response

    async def _send_whole(self, request: web.Request, call: _Call, response: web.Response) -> None:
        self._commit(call)
        try:
            await response.prepare(request)
            call.first_byte = time.monotonic()
            await response.write_eof()
        except ConnectionError:
            call.fail("agent disconnected", "cancelled")
        else:
            call.delivered = True

    async def _relay_stream(
        self, request: web.Request, call: _Call, upstream: aiohttp.ClientResponse, headers: CIMultiDict[str]
    ) -> web.StreamResponse:
        status = upstream.status
        translator = call.translator
        if translator is not None:
            translator.open(status, call.sse)
        response = web.StreamResponse(status=status, reason=upstream.reason, headers=headers)
        call.response = response
        try:
            await response.prepare(request)
        except ConnectionError:
            call.fail("agent disconnected", "cancelled")
            return response
        call.first_byte = time.monotonic()
        capture = call.capture if status < 400 else None
        whole = bytearray() if capture is not None and not call.sse else None
        # A recorded SSE answer goes out in whole events, so that an abort can be taken out of the stream
        # before the agent sees any of it (an event the agent has half of could not be taken back).
        events = capture is not None and call.sse
        cut: _EventCut | None = _EventCut() if events else None
        head: dict[str, Any] | None = None  # the aborting event's id, object, created and model
        refusal = bytearray()  # the start of an error body, to say what was refused
        limit, size = self.max_response_bytes, 0
        content = upstream.content
        while True:
            try:
                chunk = await content.readany()
            except TimeoutError:
                await self._end_broken(call, 504, self._timed_out(call))
                return response
            except (aiohttp.ClientError, OSError) as exc:
                await self._end_broken(call, 502, f"backend {call.backend} broke off the response: {exc!r}")
                return response
            if not chunk:
                if cut is None or head is not None or not (chunk := cut.rest()):
                    break
                cut = None  # the stream ended with an event that had no blank line after it
            else:
                size += len(chunk)
            if size > limit:
                await self._end_broken(call, 502, f"backend response exceeds max_response_bytes={limit}")
                return response
            if head is not None:
                continue  # what follows an abort (usage, [DONE]) is read to free the connection, not sent
            if status >= 400 and len(refusal) < ERROR_BODY_LIMIT:
                refusal += chunk[: ERROR_BODY_LIMIT - len(refusal)]
            if events:
                if cut is not None:
                    chunk = cut.feed(chunk)
                if _may_abort(chunk):
                    chunk, head = self._take_abort(call, chunk)
                if not chunk:
                    continue
            if not await self._forward(call, response, chunk, capture, whole):
                return response
        if head is not None and not await self._resume_stream(call, response, head):
            return response
        if not call.delivered:
            call.upstream_end = time.monotonic()
        if status >= 400:
            self._upstream_refused(call, status, bytes(refusal))
        elif whole is not None:
            self._capture_body(call, status, bytes(whole))  # an abort in it went out already: not resumed
        self._commit(call)
        await self._close_stream(call, response)
        return response

    async def _close_stream(self, call: _Call, response: web.StreamResponse) -> None:
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

    async def _forward(
        self,
        call: _Call,
        response: web.StreamResponse,
        chunk: bytes,
        capture: _Capture | None,
        whole: bytearray | None,
    ) -> bool:
        """Send a piece of a streamed answer to the agent (translated, for a translated call) and capture its
        ids; ``False`` if the agent has gone (the call is then failed as cancelled)."""
        parse_after = capture is not None
        if whole is not None:
            whole += chunk
            parse_after = False
        elif capture is not None and _may_end_stream(call.tail, chunk):
            parse_after = False
            capture.feed(chunk)
            if capture.done:  # record before the agent can read [DONE] and report its rollout done
                call.upstream_end = time.monotonic()
                self._commit(call)
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
        elif parse_after:
            capture.feed(chunk)  # type: ignore[union-attr]  # parsed once the agent has the bytes
        return True

    async def _end_broken(self, call: _Call, status: int, message: str) -> None:
        """End a response whose head already went out: a final SSE error event (for streams), then EOF.

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
                await response.write(prefix + b"data: " + _error_body(status, message) + b"\n\n")
            await response.write_eof()
        except ConnectionError:
            pass
