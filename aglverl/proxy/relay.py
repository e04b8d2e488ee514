"""Relaying: a call's upstream tries, and the backend's answer passed to the agent, JSON or SSE.

:class:`Relay` is the ordinary path of a call (what is not generated from ids by the token-in part). Its
interface is one method, :meth:`Relay.attempts`, which answers the agent (the call's exchange):

- The retry loop: a backend from the pool per try; connection failures, 5xx and 429 are tried again elsewhere
  (with the retry policy's backoff, ``Retry-After`` honoured within the budget) while no byte has reached the
  agent; the last retryable answer is passed through when no try does better. No try at all answers raise
  :class:`~aglverl.proxy.call.ProxyError` (502), as do other failures before the answer started. A caller that
  can make the call otherwise (the token-in part) may ask for a 4xx refusal as :class:`Refused` instead of
  having it relayed: nothing has reached the agent then.
- Relaying passes the answer on with exactly the backend's status, body bytes and end-to-end headers. A body
  with a ``Content-Length`` is read whole (bounded by ``max_response_bytes``), captured once, and sent; an
  aborted one is first resumed or made again (:class:`~aglverl.proxy.resume.Resumer`). A stream goes out
  chunk by chunk as it arrives (a recorded SSE answer in whole events, so that an abort can be taken out before
  the agent has any of it), its ids captured incrementally after each write; a translated call's bytes go
  through its translator. The call is committed (recorded) before the agent can read ``[DONE]`` or the last
  byte of a JSON answer (:class:`~aglverl.proxy.respond.Responder`).

Disconnects and cancellation: an agent that leaves fails the call as ``cancelled`` (its connection cancels the
handler's task, which closes the upstream request). A stream that breaks after bytes went out,
overruns ``max_response_bytes`` or outlives ``request_timeout`` is ended with a final SSE error event and
recorded as failed. Holds the config, the pool, the gate (the weight version at the answer's head), the
recorder, the responder, the resumer and the meters (``retries``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio
import orjson
from multidict import CIMultiDict

from .api import TranslationError
from .call import (
    ERROR_BODY_LIMIT,
    JSON,
    SSE,
    Call,
    ProxyError,
    Unreachable,
    error_message,
    forward_headers,
)
from .config import ProxyConfig
from .gate import Gate
from .headers import RESPONSE_DROP
from .meters import Meters
from .pool import RETRY_STATUSES, Backend, Held, Pool
from .recorder import Recorder
from .respond import Responder
from .resume import Resumer, resume_blocker
from .sse import EventCut, may_abort
from .upstream import Response, UpstreamError

logger = logging.getLogger(__name__)


class Refused(Exception):
    """A backend refused the call with a 4xx (not 429) before anything reached the agent: ``status`` and the
    start of its body (:meth:`Relay.attempts` with ``refusals``)."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"backend answered {status}: {error_message(body)}")
        self.status = status
        self.body = body


class Relay:
    """Forwards calls and relays answers (see the module docstring)."""

    def __init__(
        self,
        config: ProxyConfig,
        pool: Pool,
        gate: Gate,
        recorder: Recorder,
        responder: Responder,
        resumer: Resumer,
        meters: Meters,
    ) -> None:
        self.config = config
        self.pool = pool
        self.gate = gate
        self.recorder = recorder
        self.responder = responder
        self.resumer = resumer
        self.meters = meters

    async def attempts(self, call: Call, *, refusals: bool = False) -> None:
        """Send ``call`` upstream (tries, see the module docstring) and relay the answer to its agent (the call's
        exchange). ``refusals``: a 4xx answer other than 429 raises :class:`Refused` (nothing sent to the agent)
        instead of being relayed."""
        policy = self.config.retry
        deadline = call.t0 + policy.total_timeout
        tried: list[Backend] = []
        failure: ProxyError | None = None
        held: Held | None = None
        for attempt in range(policy.attempts):
            backend = self.pool.pick(call.rollout_id, tried)
            if backend is None:
                raise ProxyError(503, "no backends are configured")
            if attempt:
                delay = max(policy.backoff(attempt), backend.not_before - time.monotonic())
                if time.monotonic() + delay > deadline:
                    break
                self.meters.retries.inc()
                if delay > 0:
                    await anyio.sleep(delay)
            tried.append(backend)
            if call.kind is not None:  # recorded: spelled in the backend's dialect
                dialect = backend.dialect if backend.facts is not None else await self.pool.dialect(backend)
                call.prepare(dialect, self.config.request_logprobs)
            backend.in_flight += 1
            try:
                upstream = await self.pool.send(backend, call)
                if upstream.status in RETRY_STATUSES and attempt + 1 < policy.attempts:
                    held = await self.pool.keep(backend, upstream)
                    continue
                if refusals and 400 <= upstream.status < 500 and upstream.status != 429:
                    raise Refused(upstream.status, await self._refusal(upstream))
                return await self._relay(call, upstream)
            except Unreachable as exc:  # raised only while nothing has been sent to the agent
                failure = ProxyError(502, str(exc))
            finally:
                backend.in_flight -= 1
        if held is not None:
            return await self._send_held(call, held)
        assert failure is not None
        tries = len(tried)
        raise ProxyError(502, f"{failure.message} (after {tries} {'try' if tries == 1 else 'tries'})")

    @staticmethod
    async def _refusal(upstream: Response) -> bytes:
        """The start of a refusal's body (bounded); closes ``upstream``."""
        try:
            return (await upstream.readany())[:ERROR_BODY_LIMIT]
        except (UpstreamError, OSError, TimeoutError):
            return b""
        finally:
            upstream.close()

    async def _send_held(self, call: Call, held: Held) -> None:
        call.upstream_end = time.monotonic()
        call.fail(f"backend answered {held.status}: {error_message(held.body)}", "upstream_error")
        body, headers = held.body, held.headers
        if call.translator is not None:
            body = call.translator.whole(held.status, body)
            headers["Content-Type"] = JSON
        await self.responder.send_whole(call, held.status, headers, body, held.reason)

    async def _relay(self, call: Call, upstream: Response) -> None:
        """Relay the backend's answer to the agent, capturing token ids on the way; closes ``upstream``."""
        try:
            headers = forward_headers(upstream.headers, RESPONSE_DROP)
            content_type = upstream.headers.get("Content-Type", "")
            call.sse = content_type.startswith(SSE)
            if call.capture is not None:
                # A backend that reports no version (vLLM): the proxy's when the answer's head arrives, not
                # when the call came in: a call admitted before a hold that reached a paused engine waited
                # there and was generated under the weights that came after.
                version = call.dialect.weight_version(upstream.headers)
                call.weight_version = self.gate.weight_version if version is None else version
            if call.sse or (
                upstream.content_length is None
                and upstream.status not in (204, 304)
                and call.method != "HEAD"
            ):
                return await self._relay_stream(call, upstream, headers)
            return await self._relay_whole(call, upstream, headers)
        finally:
            upstream.close()  # a no-op once the body was read to the end; otherwise drops the connection

    async def _relay_whole(self, call: Call, upstream: Response, headers: CIMultiDict[str]) -> None:
        length = upstream.content_length or 0
        if length > self.config.max_response_bytes:
            raise ProxyError(
                502,
                f"backend answered {length} bytes, over max_response_bytes={self.config.max_response_bytes}",
            )
        try:
            body = await upstream.read()
        except TimeoutError:
            raise ProxyError(504, self.pool.timed_out(call)) from None
        except (UpstreamError, OSError) as exc:
            # Nothing has reached the agent yet, so this is as retryable as a refused connection.
            raise Unreachable(f"backend {call.backend} broke off the response: {exc!r}") from exc
        call.upstream_end = time.monotonic()
        if call.reshape is not None:  # a call made from ids, answered as a completion: a chat answer again
            body = call.reshape.whole(upstream.status, body)
        captured = self.recorder.capture_body(call, upstream.status, body)
        if captured and call.capture is not None and call.capture.aborted:
            assert call.request is not None
            if resume_blocker(call.request, call.kind, call.dialect) is None:
                body = await self.resumer.resume_whole(call, orjson.loads(body))
            else:
                body = await self.resumer.regenerate_whole(call)
            call.upstream_end = time.monotonic()
        if call.translator is not None:
            try:
                body = call.translator.whole(upstream.status, body)
            except TranslationError as exc:
                raise ProxyError(exc.status, exc.message) from None
            headers["Content-Type"] = JSON
        await self.responder.send_whole(call, upstream.status, headers, body, upstream.reason)

    async def _relay_stream(self, call: Call, upstream: Response, headers: CIMultiDict[str]) -> None:
        status = upstream.status
        translator = call.translator
        if translator is not None:
            translator.open(status, call.sse)
        if not await self.responder.start_stream(call, status, headers, upstream.reason):
            return
        capture = call.capture if status < 400 else None
        whole = bytearray() if capture is not None and not call.sse else None
        # A recorded SSE answer goes out in whole events, so that an abort can be taken out of the stream
        # before the agent sees any of it (an event the agent has half of could not be taken back).
        events = capture is not None and call.sse
        cut: EventCut | None = EventCut() if events else None
        head: dict[str, Any] | None = None  # the aborting event's id, object, created and model
        refusal = bytearray()  # the start of an error body, to say what was refused
        limit, size = self.config.max_response_bytes, 0
        taker = capture if events else None  # what takes the ids of each piece of complete events
        abort_marker = call.dialect.wire.abort_marker  # the backend's (this try's), looked for in each read
        reshape = call.reshape  # a call made from ids, answered as a completion: chat events again
        if reshape is not None:
            reshape.open(status, call.sse)
        while True:
            try:
                chunk = await upstream.readany()
            except TimeoutError:
                await self.responder.end_broken(call, 504, self.pool.timed_out(call))
                return
            except (UpstreamError, OSError) as exc:
                await self.responder.end_broken(
                    call, 502, f"backend {call.backend} broke off the response: {exc!r}"
                )
                return
            if reshape is not None:
                if chunk:
                    chunk = reshape.feed(chunk)
                    if not chunk:
                        continue  # no complete event yet
                else:  # the end: what is left of an unfinished event goes as it came
                    chunk, reshape = reshape.rest(), None
            if not chunk:
                if cut is None or head is not None or not (chunk := cut.rest()):
                    break
                # The stream ended with an event that had no blank line after it: relayed, not dispatched
                # (as an SSE client drops it).
                cut = taker = None
            else:
                size += len(chunk)
            if size > limit:
                await self.responder.end_broken(
                    call, 502, f"backend response exceeds max_response_bytes={limit}"
                )
                return
            if head is not None:
                continue  # what follows an abort (usage, [DONE]) is read to free the connection, not sent
            if status >= 400 and len(refusal) < ERROR_BODY_LIMIT:
                refusal += chunk[: ERROR_BODY_LIMIT - len(refusal)]
            if events:
                if cut is not None:
                    chunk = cut.feed(chunk)
                if may_abort(chunk, abort_marker):
                    chunk, head = self.resumer.take_abort(call, chunk)
                if not chunk:
                    continue
            elif whole is not None:
                whole += chunk
            if not await self.responder.forward(call, chunk, taker):
                return
        if head is not None and not await self.resumer.resume_stream(call, head):
            return
        if not call.delivered:
            call.upstream_end = time.monotonic()
        if status >= 400:
            self.recorder.upstream_refused(call, status, bytes(refusal))
        elif whole is not None:
            # An abort in it went out already: not resumed.
            self.recorder.capture_body(call, status, bytes(whole))
        self.recorder.commit(call)
        await self.responder.close_stream(call)
