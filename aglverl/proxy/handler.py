"""The proxy as its HTTP server's service: every request on the proxy's socket, admitted at its head, answered,
and its call always ended recorded and counted.

:class:`Handler` implements :class:`~aglverl.proxy.http.Service`:

- :meth:`Handler.admit` — the head is in, no byte of the body read: the route (:func:`~aglverl.proxy.routes.route`,
  on the URL parser's path: a query, a fragment or an escape cannot change it), then
  :meth:`Admission.check <aglverl.proxy.admission.Admission.check>` (token, attempt, path, overload). A refusal is
  an answer the server writes in its turn (the body never read; a 404 for a path that is no route, after the
  token); a call let in rides on the exchange (``exchange.state``).
- :meth:`Handler.respond` — the call's task: the body read and prepared (:meth:`Admission.admit
  <aglverl.proxy.admission.Admission.admit>`: translation, capture, sampling, token-in, the gate), then made from
  ids when it extends a recorded turn (:class:`~aglverl.proxy.tokenin.TokenIn`) or relayed
  (:class:`~aglverl.proxy.relay.Relay`), always ending with the call recorded and counted before the agent sees
  an error answer. A route the proxy answers itself (a Responses API's stored response read back or deleted:
  :attr:`Translator.local <aglverl.proxy.api.Translator.local>`) is answered from what it keeps, never forwarded,
  recorded nor counted as a call.
- :meth:`Handler.refusal` — the server's own refusals (a malformed head, a limit passed, a head too slow, a
  connection past the cap), in the API of the route they were sent to when it has one (Responses, Messages),
  else OpenAI's error shape; counted in ``aglverl_proxy_http_refused_total{status}``.

Cancellation: the agent leaving (or the proxy shutting down past its grace) cancels :meth:`Handler.respond`; the
call is failed as cancelled ("proxy shutting down" once :attr:`Handler.closing`) and recorded.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

from .admission import Admission
from .api import APIS
from .call import JSON, Call, ProxyError, error_body
from .gate import Gate
from .http import Answer, Exchange, HttpError
from .meters import Meters
from .recorder import Recorder
from .relay import Relay
from .routes import route
from .tokenin import TokenIn

__all__ = ["Handler"]

logger = logging.getLogger(__name__)

_JSON_HEADERS = {"Content-Type": JSON}
_NO_ROUTE = "no such route {!r}: use /v1/... or /rollout/{{rollout_id}}/attempt/{{attempt_id}}/v1/..."


class Handler:
    """The proxy's HTTP service (see the module docstring). Holds the admission, the gate, the relay, the token-in
    part (``None``: off), the recorder and the meters."""

    def __init__(
        self,
        admission: Admission,
        gate: Gate,
        relay: Relay,
        token_in: TokenIn | None,
        recorder: Recorder,
        meters: Meters,
    ) -> None:
        self.admission = admission
        self.gate = gate
        self.relay = relay
        self.token_in = token_in
        self.recorder = recorder
        self.meters = meters
        #: The proxy is shutting down: a call cancelled now failed for that, not for its agent.
        self.closing = False
        self._seq = itertools.count()

    def admit(self, exchange: Exchange) -> Answer | None:
        found = route(exchange.path)
        if found is None:
            try:
                self.admission.authorize(exchange.headers)
            except ProxyError as exc:
                return exc.answer()
            return ProxyError(404, _NO_ROUTE.format(exchange.path)).answer()
        call = Call(next(self._seq), time.monotonic(), found.rollout_id, found.attempt_id, exchange)
        try:
            self.admission.check(exchange, call, found)
        except ProxyError as exc:
            self.meters.calls.inc(1, "rejected")
            return exc.answer(call.translator)
        exchange.state = call
        return None

    async def respond(self, exchange: Exchange) -> None:
        call: Call = exchange.state
        # the call refers to its exchange: taken off it, the pair is no reference cycle, so both are freed as
        # soon as the call ends instead of waiting for the garbage collector
        exchange.state = None
        try:
            await self.admission.admit(call)
        except ProxyError as exc:
            self.meters.calls.inc(1, "rejected")
            await exc.send(exchange, call.translator)
            return
        except asyncio.CancelledError:  # the agent left while its body was read or while paused
            self.meters.calls.inc(1, "cancelled")
            raise
        translator = call.translator
        if translator is not None and translator.local:  # answered from what the proxy keeps: never forwarded
            status, body = translator.answer()
            try:
                await exchange.send_whole(status, _JSON_HEADERS, body)
            except ConnectionError:  # the agent left: nothing was changed for it but what it asked
                pass
            return
        self.gate.enter()
        try:
            await self._run(call)
        finally:
            self.gate.leave()

    async def _run(self, call: Call) -> None:
        """Forward ``call`` (generated from ids when it extends a recorded turn, else relayed), always ending
        with it recorded and counted, whatever happens; an error the agent has not had an answer for yet is
        answered once the call is recorded."""
        call.weight_version = self.gate.weight_version
        failure: ProxyError | None = None
        try:
            token_in = self.token_in
            plan = call.tokenin
            if token_in is None or plan is None or plan.match is None or not await token_in.run(call):
                await self.relay.attempts(call)
        except ProxyError as exc:
            call.fail(exc.message)
            failure = exc
        except asyncio.CancelledError:
            call.fail("proxy shutting down" if self.closing else "agent disconnected", "cancelled")
            raise
        except Exception as exc:
            logger.exception("proxy failure on %s", call.path)
            call.fail(f"internal proxy error: {exc!r}")
            failure = ProxyError(500, f"internal proxy error: {exc!r}")
        finally:
            self.recorder.finish(call)
        exchange = call.exchange
        assert exchange is not None
        if failure is not None and not exchange.started:
            try:
                await failure.send(exchange, call.translator)
            except ConnectionError:
                pass

    def refusal(self, error: HttpError, exchange: Exchange) -> Answer:
        self.meters.http_refused.inc(1, str(error.status))
        found = route(exchange.path) if exchange.path else None
        api = APIS.match(found.path, exchange.method) if found is not None else None
        if api is not None:
            body = api[0].error_body(error.status, error.message, None)
        else:
            body = error_body(error.status, error.message)
        return Answer(error.status, body, {"Content-Type": JSON, **error.headers})
