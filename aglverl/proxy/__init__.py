"""The LLM proxy: agents' OpenAI calls go through it to the inference backends, and it records their token ids.

:class:`LLMProxy` is served by its own HTTP/1.1 server on llhttp (:mod:`~aglverl.proxy.http`) inside the caller's
anyio task group. Two route families (:mod:`~aglverl.proxy.routes`), every HTTP method:

- ``/rollout/{rollout_id}/attempt/{attempt_id}/v1/{path}`` — attributed calls. The attempt is checked against
  the store first (unknown: 404, finished rollout: 409, never forwarded); an attempt whose agent aglverl's runner
  started and handed this URL directly is opened by its own key (or the proxy's token) and no other, and its
  JSON bodies get what Agent Lightning's hop set (the served model, the rollout's temperature:
  :mod:`~aglverl.proxy.gateway`). ``POST chat/completions`` and
  ``POST completions`` get the backend dialect's ids fields added (vLLM's ``"return_token_ids": true``) unless the
  client set them and, with
  ``request_logprobs``, ``"logprobs"`` too (``true`` for chat, ``0`` for completions: the sampled tokens' own
  logprobs), and are recorded in the store as :class:`~aglverl.store.LLMCall` rows, one per choice: exact
  prompt/response ids, logprobs, finish reason, the limit that ended the response (``max_tokens`` or the
  backend's context window, told apart by the request's ``max_tokens``; a prompt refused as too long is a
  ``context`` limit too), weight version, backend, latency.
- ``/v1/{path}`` — unattributed calls: forwarded verbatim and counted, never recorded.

Sampling parameters (attributed calls, when the rollout's ``main_llm`` resource names them, as a trainer's
does): a parameter the call omits is filled in with the trainer's value (``temperature``, ``top_p``,
``top_k``; and ``max_tokens`` when the call sets no limit), so the tokens are drawn from the distribution the
trainer recomputes log-probs for. A call that sets a different value (or a non-neutral ``min_p``,
``repetition_penalty``, ``presence_penalty``, ``frequency_penalty`` or ``logit_bias``) is off-policy; the
``sampling_mismatch`` rule decides: ``"refuse"`` answers 400 naming the parameter and both values,
``"mask"`` forwards it and records it ``off_policy`` (its rows are kept out of the loss). Every call records
the values it used; ``aglverl_proxy_sampling_total{action}`` counts fills, refusals and masked calls.

Token-in chat (``token_in``, on by default): a black-box agent sends its history back as text, and re-rendered
its ids drift from the ids the engine generated. Per rollout attempt the proxy keeps every recorded chat call's
messages, its answer as the agent got it and the exact prompt + generated ids
(:mod:`~aglverl.proxy.session`); a chat call whose messages extend a recorded call's messages + answer
(compared as the template renders them: system, user and tool messages verbatim, an echoed answer loosely since
its generated ids stand for it) under the same tools, template arguments and model is sent as ONE chat
completion carrying that call's ids + the ids of the new tail alone in ``kv_transfer_params["prompt_token_ids"]``
(:mod:`~aglverl.proxy.tokenin`; the tail rendered by the served model's own tokenizer and template in the proxy,
off the event loop, or by the backend's render route where the proxy has no tokenizer), so its recorded prompt
extends the earlier call's prompt + response exactly and the conversation trains as one row. The answer is the
backend's own chat answer (its tool-call and reasoning parsers), JSON or SSE, in the agent's API. What matches
nothing (a first call, an edited history, another system prompt or tool list, ``n > 1``), a template that does
not append for that shape of conversation (generated from its whole rendering), or a backend that takes no
prompt ids (warned about once) is relayed as text and starts a new chain;
``aglverl_proxy_token_in_total{outcome}`` counts each call by how it was made. What a backend speaks (vLLM, the
embedded engine, ...) is its :mod:`~aglverl.proxy.dialect`, detected from its model listing.

``POST responses`` (OpenAI's Responses API) and ``POST messages`` (Anthropic's Messages API), on either route
family, are translated by :mod:`aglverl.proxy.api` (one module per API, each declaring its routes, path
parameters included, and its key header, behind one registry): the body becomes a
chat completion before anything else looks at it (so an attributed one is prepared, relayed and recorded exactly like a chat call, under the
agent's path), and the answer goes back in the agent's API, streams event by event. Every error such a call
gets, the proxy's own included, is in that API's shape; an API's key header (Anthropic's ``x-api-key``) is
accepted as the token and, like ``Authorization``, never forwarded (:attr:`~aglverl.proxy.api.Apis.credential_headers`).
The Responses API's responses are kept per attempt (:mod:`~aglverl.proxy.api.response_store`, bounded, freed
when the attempt can make no more calls): ``previous_response_id`` puts the kept conversation first, and
``GET`` / ``DELETE responses/{id}`` and ``GET responses/{id}/input_items`` are routes the proxy answers itself
(:attr:`Route.answer <aglverl.proxy.api.Route>`), never forwarded.

The agent receives exactly the backend's status, body bytes and end-to-end headers. Streams (SSE or any
chunked body) are relayed chunk by chunk as they arrive while token ids are assembled incrementally from the
SSE events; bodies with a ``Content-Length`` are read whole (bounded), parsed once and sent unchanged.

Routing: every call of a rollout goes to the backend its first call went to while that backend is healthy
(vLLM's prefix cache then holds the conversation); a new rollout goes to the healthy backend with the fewest
calls in flight. Before any byte has reached the agent, connection failures, 5xx and 429 are retried on
another backend with capped exponential backoff and jitter (:class:`RetryPolicy`; ``Retry-After`` honoured
within the budget). A backend that refuses connections is ejected for ``eject_seconds`` and then probed
(``GET /health``) by a task that sleeps until that deadline; it takes traffic again only once a probe passes.

Weight updates: :meth:`LLMProxy.pause` holds new calls and drains those in flight (lockstep training);
:meth:`LLMProxy.hold` holds new calls and lets those in flight go on (verl's asynchronous modes, which abort
the engines' generations to swap weights); :meth:`LLMProxy.resume` ends either. An agent never sees an
abort: when a backend answers a recorded call with ``finish_reason: "abort"`` (a JSON body, or an SSE choice
that ends so), the proxy keeps the partial output, waits while it is held (at once when it is not), and
continues the generation token-exactly on the rollout's backend with a token-in ``/v1/completions`` call:
the prompt ids and the ids so far as ``prompt``, what is left of the call's ``max_tokens``, the call's own
sampling parameters (``seed`` moved on by the tokens generated), ``return_token_ids``, logprobs if the call
had them; a continuation aborted in its turn is continued again. The agent gets one answer: a JSON body
covering the whole generation (text, ``token_ids``, logprobs, finish reason, usage), or a stream that goes
on in its own chunk shape (same ``id``) to its final chunk, usage and ``[DONE]``; a Responses / Messages call
gets the same through its translator. The call is recorded once, with all its ids and the weight versions
of its first and last tokens (each the backend's ``X-Weight-Version`` when it sends one, else the proxy's
version). A token-in call is a chat call with its prompt ids, continued the same way from them. A backend that
keeps aborting (or refusing) a continuation, or a hold longer than
``pause_timeout`` after the last token, ends the call with a 503 error saying so (an SSE error event once
the stream started), recorded as failed. Calls with ``n > 1``, tools, a ``response_format``, vLLM guided
decoding or ``prompt_logprobs`` are not continued (a completion cannot carry their state on): a JSON answer
of theirs, which the agent has not seen, is made again from the start under the new weights
(``proxy/regenerated``); a stream of theirs, already partly sent, ends the same way as above, with the
reason. Unattributed ``/v1`` calls are relayed as they are, abort included.

Overload (:mod:`~aglverl.proxy.overload`): the proxy measures how late its event loop runs (a probe every 50 ms
while calls are in flight, averaged over 0.5 s; ``proxy.overload.lag``, ``aglverl_proxy_loop_lag_seconds``, ``proxy/loop_lag_seconds``) and,
past :class:`OverloadPolicy`'s ``max_lag`` (0.1 s) with at least ``min_in_flight`` calls in flight, answers a
share of the first calls of new conversations, all of them at twice the limit, with a 429 and ``Retry-After`` in
the agent's API (the openai and anthropic SDKs wait and retry); a call of a rollout attempt under way (one of
its calls was let in) is never turned away, and calls already admitted always run to their end. The decision is
made as soon as a request's head is in, before a byte of its body is read (:mod:`~aglverl.proxy.admission`, called
by the HTTP server, :mod:`~aglverl.proxy.http`). The proxy's ``overload`` setting
(``OverloadPolicy(refuse=False)``) turns the refusals off (the lag is still measured).

Resource handling: one :class:`~aglverl.proxy.upstream.Upstream` (the proxy's own HTTP/1.1 client, its
connections kept per backend) per :meth:`LLMProxy.serve`; its idle keep-alive (4 s) is shorter than the
backends' (uvicorn's 5 s) so the pool never reuses a connection the server is about to close. Cancelling
``serve`` stops accepting, lets in-flight calls finish for ``shutdown_grace`` seconds, cancels the rest (each
cancelled upstream request closes its connection), then closes the server and the upstream connections: no
task, socket or connection is left.

Error handling: errors the proxy produces itself are OpenAI-shaped JSON, ``{"error": {"message", "type",
"param": null, "code"}}``, with a message naming what was wrong. An agent that disconnects cancels its upstream
request at once (its connection cancels the call's task); the call is recorded as failed. A stream that breaks
after bytes went out ends with a final SSE ``data: {"error": ...}`` event (the OpenAI SDK raises it as
``APIError``; a translated API's own error ending), then the agent's connection closes without the body's last
chunk, so that its HTTP client sees the answer cut short, never whole; the call is recorded as failed. A
backend's answer that is not well-formed HTTP/1.1 (or is cut before its head was relayed) is a 502 naming the
backend.

The package: the proxy composed of parts, each a class handed what it uses by its constructor (no part is
built from another's class, nothing shares ``self``), each module's docstring stating its part's contract: what
it is for, what it awaits, cancellation, errors. :class:`LLMProxy` builds them and holds them; they hold each
other downward only, so the imports run one way (``tests/test_proxy_parts.py`` checks that the package has no
import circle):

::

    LLMProxy ─┬─▶ Admission ─▶ TokenIn ─▶ Relay ─▶ Resumer ─▶ Responder ─▶ Recorder ─┬─▶ ProxyStore
              │   └─▶ Overload (made by it)                                        └─▶ Sessions
              └─▶ Relay (the same)
    and, each as it needs them: Pool (backends, each with its Dialect), Gate (pause / hold / resume),
    ProxyConfig, Meters                                    (an arrow: holds, handed by the constructor)

- :mod:`~aglverl.proxy.app` — :class:`LLMProxy`: builds the parts, the public API, life cycle.
- :mod:`~aglverl.proxy.http` — the proxy's HTTP/1.1 server, one per socket (llhttp parses; each connection's
  protocol, one request and its answer as an :class:`~aglverl.proxy.http.Exchange`, flow control, limits, errors
  as types); :mod:`~aglverl.proxy.handler` — :class:`~aglverl.proxy.handler.Handler`, the proxy as its service:
  routes (:mod:`~aglverl.proxy.routes`), a call admitted at its head, its task, always ending recorded and counted.
- :mod:`~aglverl.proxy.admission` — :class:`~aglverl.proxy.admission.Admission`: at the head, the API's route,
  auth (the proxy's token, or an attempt's own key: :mod:`~aglverl.proxy.gateway`), the attempt against the
  store, the path, the proxy's load (its :class:`~aglverl.proxy.overload.Overload`: the loop's lag, the 429);
  then the body, the gateway's rewrite, translation, the capture request, sampling reconciliation, the gate's
  wait.
- :mod:`~aglverl.proxy.relay` — :class:`~aglverl.proxy.relay.Relay`: the retry loop and relaying answers
  (JSON, SSE), disconnects, broken streams.
- :mod:`~aglverl.proxy.resume` — :class:`~aglverl.proxy.resume.Resumer`: aborted generations: continued
  token-exactly, or made again.
- :mod:`~aglverl.proxy.tokenin` — :class:`~aglverl.proxy.tokenin.TokenIn`: calls that extend a recorded turn,
  sent with its ids in one chat request; :mod:`~aglverl.proxy.session` — the attempts' recorded turns and the
  message matching (pure).
- :mod:`~aglverl.proxy.respond` — :class:`~aglverl.proxy.respond.Responder`: writing to the agent, whole or in
  pieces, ending a stream well or broken; the call committed before the agent sees its end.
- :mod:`~aglverl.proxy.recorder` — :class:`~aglverl.proxy.recorder.Recorder`: captures into
  :class:`~aglverl.store.LLMCall` records through :class:`~aglverl.proxy.store_view.ProxyStore` (the only way
  the proxy reaches the store), turns into token-in sessions, every call counted once.
- :mod:`~aglverl.proxy.pool` — :class:`~aglverl.proxy.pool.Pool`: backends: picking, ejection, probes, sending
  a try, the upstream client's errors caught by type; :mod:`~aglverl.proxy.upstream` — that client: HTTP/1.1 to
  the backends, keep-alive connections, each answer parsed by llhttp (``httptools.HttpResponseParser``) as the
  socket's reads come, a connection's state one enum, its errors types (connect, read, remote protocol).
- :mod:`~aglverl.proxy.gate` — :class:`~aglverl.proxy.gate.Gate`: pause / hold / resume, the weight version,
  the calls in flight and the drain, every wait at the gate.
- :mod:`~aglverl.proxy.control` — :class:`~aglverl.proxy.control.ProxyControl`, what the daemon needs of a proxy:
  :class:`LLMProxy` and the shards' driver (:class:`~aglverl.proxy.shards.ProxyShards`) both implement it.
- The vocabulary below them (no part of theirs): :mod:`~aglverl.proxy.config` (the settings as one frozen
  :class:`~aglverl.proxy.config.ProxyConfig` every part holds, :class:`RetryPolicy`),
  :mod:`~aglverl.proxy.meters` (the series), :mod:`~aglverl.proxy.call` (the call, :class:`ProxyError`, header
  forwarding), :mod:`~aglverl.proxy.dialect` (what a backend speaks: ids, aborts, continuations, prompt ids,
  the render route, errors, versions, health and model listing; vLLM and the embedded engine, pure),
  :mod:`~aglverl.proxy.capture` (token ids, log-probs and stop reasons out of answers and streams, pure),
  :mod:`~aglverl.proxy.reshape` (a completion answered to a chat call, spelled back as chat, pure),
  :mod:`~aglverl.proxy.sse` (SSE framing), :mod:`~aglverl.proxy.headers` (what is never forwarded), :mod:`~aglverl.proxy.api` (the agents' other APIs as chat
  completions: the :class:`~aglverl.proxy.api.translator.Translator` a call holds, and one module per API,
  pure).
"""

from __future__ import annotations

from .app import LLMProxy
from .config import ProxyConfig, RetryPolicy, SamplingMismatch
from .control import ProxyControl
from .dialect import Dialect, register
from .overload import LagStatistics, Overload, OverloadPolicy

# What a user of the proxy names: the proxy, its settings and their policies, what the daemon drives, what a
# new backend implements (and registers); every other name is imported from the module that defines it.
__all__ = [
    "Dialect",
    "LLMProxy",
    "LagStatistics",
    "Overload",
    "OverloadPolicy",
    "ProxyConfig",
    "ProxyControl",
    "RetryPolicy",
    "SamplingMismatch",
    "register",
]
