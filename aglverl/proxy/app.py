"""The proxy's application: the parts put together, the routes, and the life cycle.

:class:`LLMProxy` builds its parts, each handed what it uses by its constructor (nothing shares ``self``):

- :class:`~aglverl.proxy.config.ProxyConfig` (the settings every part reads as it goes) and
  :class:`~aglverl.proxy.meters.Meters` (the series every part counts into);
- :class:`~aglverl.proxy.gate.Gate` (pause / hold / resume, the calls in flight, every wait on the gate);
- :class:`~aglverl.proxy.pool.Pool` (backends, picking, ejection, probes, sending a try);
- :class:`~aglverl.proxy.recorder.Recorder` (captures into records, through the store view; token-in turns);
- :class:`~aglverl.proxy.respond.Responder` (writing to the agent; commits before the last byte);
- :class:`~aglverl.proxy.resume.Resumer` (aborted generations) and :class:`~aglverl.proxy.relay.Relay` (tries,
  JSON / SSE relaying), :class:`~aglverl.proxy.tokenin.TokenIn` (calls generated from ids; optional);
- :class:`~aglverl.proxy.admission.Admission` (a request checked at its head and read into its call);
- :class:`~aglverl.proxy.handler.Handler` (the HTTP server's service: routes, admission at the head, the call's
  task that always ends with the call recorded and counted).

Here: the public API (which hands on to the parts), and the life cycle: :meth:`LLMProxy.serve` serves the handler
on the proxy's socket with its own HTTP server (:class:`~aglverl.proxy.http.HttpServer`, under the config's
limits) until cancelled, then stops accepting, gives in-flight calls ``shutdown_grace`` seconds, cancels the rest
and closes server and pool.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Unpack, get_args

import anyio
from anyio.abc import TaskStatus

from ..metrics import ActivityTimeline, Counter, Histogram, Registry
from ..models import ProxyLLM
from ..store import TERMINAL, AttemptChange
from .admission import Admission
from .api.response_store import ResponseStore
from .call import Outcome, ProxyError
from .config import (
    ProxyConfig,
    ProxySettings,
    RetryPolicy,
    SamplingMismatch,
    SamplingOf,
    _Setting,
    with_aliases,
)
from .control import APPLIED, Applied
from .gate import Gate
from .gateway import GatewayRules
from .handler import Handler
from .http import HttpServer
from .meters import Meters
from .overload import Overload
from .pool import Pool
from .recorder import Recorder
from .relay import Relay
from .respond import Responder
from .resume import Resumer
from .session import Sessions
from .store_view import ProxyStore
from .tokenin import OUTCOMES as TOKEN_IN_OUTCOMES
from .tokenin import TokenIn

logger = logging.getLogger(__name__)

#: Bound on each closing step (server, runner, session) after the grace period.
_CLOSE_TIMEOUT = 1.0


class LLMProxy:
    """Token-recording reverse proxy in front of OpenAI-compatible backends (see :mod:`aglverl.proxy`).

    Serve it with ``await tg.start(proxy.serve)``; :attr:`url` is valid once ``start`` returns. Its settings
    come as ``config`` (a :class:`~aglverl.proxy.config.ProxyConfig`, handed whole to every part) or as that
    value's fields in keywords (``LLMProxy(store, pause_timeout=30)``), not both. ``token``: when set, every request needs ``Authorization: Bearer <token>`` (an OpenAI client's
    ``api_key``); it is never logged nor forwarded. ``backend_api_key``: sent to the backends as a bearer token
    (they never see the agents' credentials). ``max_body_bytes`` (``max_request_bytes``, its old name)/``max_response_bytes`` bound bodies;
    ``request_timeout`` bounds each upstream try, body included (then a 504, or a stream ended with an error
    event); ``connect_timeout`` a TCP connect; ``pause_timeout`` how long a call waits while paused or held,
    and how long an aborted generation may go without a new token (held, or refused) before it gives up;
    ``hold_timeout`` (default: ``pause_timeout``) bounds instead how long a call, or an aborted generation,
    waits while the proxy is paused or held (a trainer's update: minutes to hours on GPUs);
    ``shutdown_grace`` how long in-flight calls may finish on shutdown. ``upstream_keepalive``: seconds an idle
    pooled connection to a backend is kept; it must stay below the backends' own keep-alive (vLLM's
    ``--timeout-keep-alive``, 5 s by default). Raise both together to keep connections warm across trainer
    updates longer than that (each step otherwise starts by opening new connections). ``request_logprobs``:
    ask the backend for the sampled tokens' logprobs on every recorded call whose agent did not set
    ``logprobs`` itself (a trainer's behaviour log-probs); the agent then receives them in its answers too.
    ``sampling_of(rollout_id)``: the sampling parameters the rollout's trainer expects (``None``: unchecked);
    ``sampling_mismatch``: what happens to a call that sets other ones (see :mod:`aglverl.proxy`).
    ``token_in`` (default on): a recorded chat call whose messages extend an earlier call's messages + answer
    is generated from that call's exact ids (:mod:`~aglverl.proxy.tokenin`); off, every call is relayed as
    text (and multi-turn rows drift wherever the chat template re-renders the history differently). The HTTP
    server's bounds (:class:`~aglverl.proxy.http.Limits`): ``max_header_lines`` header lines and
    ``max_line_bytes`` per head line (431, or 414 for the target), ``head_timeout`` seconds for a head to arrive
    whole (408), ``idle_timeout`` seconds a kept-alive connection waits for its next request, ``max_connections``
    open at once (503 past it). ``responses_per_attempt`` / ``response_bytes_per_attempt`` bound the Responses
    API's responses kept per attempt (:attr:`responses`; the least recently used dropped past them).
    :attr:`activity` is the timeline of when at least one call was in flight (the backends were busy).

    Each setting is also a read-only attribute (``proxy.pause_timeout``); :meth:`reconfigure` hands every part
    a new config at once (assigning an attribute raises ``AttributeError`` saying so). The proxy implements
    :class:`~aglverl.proxy.control.ProxyControl`, as its shards' driver does.
    """

    host = _Setting[str]()
    port = _Setting[int]()
    retry = _Setting[RetryPolicy]()
    request_timeout = _Setting[float]()
    connect_timeout = _Setting[float]()
    max_body_bytes = _Setting[int]()
    max_request_bytes = _Setting[int]()  # the old name of max_body_bytes
    max_response_bytes = _Setting[int]()
    eject_seconds = _Setting[float]()
    pause_timeout = _Setting[float]()
    hold_timeout = _Setting[float]()
    shutdown_grace = _Setting[float]()
    upstream_keepalive = _Setting[float]()
    request_logprobs = _Setting[bool]()
    sampling_mismatch = _Setting[SamplingMismatch]()
    max_header_lines = _Setting[int]()
    max_line_bytes = _Setting[int]()
    head_timeout = _Setting[float]()
    idle_timeout = _Setting[float]()
    max_connections = _Setting[int]()
    responses_per_attempt = _Setting[int]()
    response_bytes_per_attempt = _Setting[int]()

    def __init__(
        self,
        store: ProxyStore,
        config: ProxyConfig | None = None,
        *,
        backends: Sequence[str] = (),
        registry: Registry | None = None,
        sampling_of: SamplingOf | None = None,
        **settings: Unpack[ProxySettings],
    ) -> None:
        if config is not None and settings:
            raise TypeError(
                f"LLMProxy takes config or its settings as keywords, not both: {', '.join(settings)}"
            )
        config = self._config = config if config is not None else ProxyConfig.from_settings(**settings)
        self._sampling_of = sampling_of
        self._store = store
        self.registry = registry or Registry()
        meters = self._meters = Meters(self.registry)
        # The parts, each holding what it uses.
        gate = self._gate = Gate(config, meters)
        pool = self._pool = Pool(config, meters, backends)
        sessions = Sessions() if config.token_in else None
        recorder = self._recorder = Recorder(store, meters, sessions)
        responder = Responder(recorder)
        resumer = Resumer(config, pool, gate, recorder, responder, meters)
        self._relay = Relay(config, pool, gate, recorder, responder, resumer, meters)
        #: Token-in chat (:mod:`~aglverl.proxy.tokenin`): calls that extend a recorded turn are generated from
        #: its exact ids; ``None`` when turned off (every call relayed as text).
        self.token_in: TokenIn | None = (
            None if sessions is None else TokenIn(config, pool, self._relay, meters, sessions)
        )
        #: The Responses API's stored responses, per attempt (:mod:`~aglverl.proxy.api.response_store`).
        self.responses = responses = ResponseStore(config)
        self.registry.gauge(
            "aglverl_proxy_stored_responses", "Responses API responses kept.", responses.__len__
        )
        self.registry.gauge(
            "aglverl_proxy_stored_response_bytes",
            "What the kept Responses API responses hold, in bytes of JSON (as their bounds count them).",
            responses.total_bytes,
        )
        self._admission = Admission(config, store, gate, meters, self.token_in, sampling_of, responses)
        self._handler = Handler(self._admission, gate, self._relay, self.token_in, recorder, meters)
        # every part that holds the config, for reconfigure()
        parts = (gate, pool, resumer, self._relay, self.token_in, self._admission, responses)
        self._parts: tuple[Any, ...] = tuple(p for p in parts if p is not None)
        # The series, under the names the daemon and tests read them by.
        self.m_calls: Counter = meters.calls
        self.m_retries: Counter = meters.retries
        self.m_ejections: Counter = meters.ejections
        self.m_no_ids: Counter = meters.no_ids
        self.m_unrecorded: Counter = meters.unrecorded
        self.m_upstream: Histogram = meters.upstream
        self.m_first_byte: Histogram = meters.first_byte
        self.m_added: Histogram = meters.added
        self.m_sampling: Counter = meters.sampling
        self.m_generated: Counter = meters.generated
        self.m_held: Counter = meters.held
        self.m_resumed: Counter = meters.resumed
        self.m_continuations: Counter = meters.continuations
        self.m_regenerated: Counter = meters.regenerated
        self.m_resume_failed: Counter = meters.resume_failed
        self.m_resume_latency: Histogram = meters.resume_latency
        self._url: str | None = None
        self._http: HttpServer | None = None  # while serving
        self.registry.gauge(
            "aglverl_proxy_connections", "Agents' connections open to the proxy.", lambda: self.connections
        )

    # ------------------------------------------------------------------ public API
    @property
    def config(self) -> ProxyConfig:
        """The settings every part reads when it uses one (each is also an attribute: ``proxy.pause_timeout``)."""
        return self._config

    def reconfigure(self, **changes: Any) -> ProxyConfig:
        """Run on other settings from now on (``proxy.reconfigure(pause_timeout=1.0)``): a new
        :class:`ProxyConfig` with ``changes`` goes to every part at once; returns it.

        A setting holds from its next use: a wait already running keeps its deadline, and what the proxy reads
        when it starts serving (``host``, ``port``, the HTTP server's limits, ``max_body_bytes`` among them, the
        upstream session's ``request_timeout``, ``connect_timeout`` and ``upstream_keepalive``) holds from its
        next :meth:`serve`.
        An unknown name is a ``TypeError``; ``token_in``, read when the proxy is built, cannot change
        (``ValueError``).
        """
        config = dataclasses.replace(self._config, **with_aliases(changes))
        if config.token_in != self._config.token_in:
            raise ValueError("token_in is read when the proxy is built: make a new LLMProxy to change it")
        self._config = config
        for part in self._parts:
            part.config = config
        return config

    @property
    def sampling_of(self) -> SamplingOf | None:
        """``sampling_of(rollout_id)``: the sampling parameters the rollout's trainer expects (``None``: none)."""
        return self._sampling_of

    @property
    def store(self) -> ProxyStore:
        """The store the proxy admits calls against and records them in."""
        return self._store

    @property
    def url(self) -> str:
        """``http://host:port`` of the proxy; valid once :meth:`serve` has started."""
        if self._url is None:
            raise RuntimeError("LLMProxy is not serving yet")
        return self._url

    @property
    def serving(self) -> bool:
        """Whether the proxy has started serving (its :attr:`url` is known)."""
        return self._url is not None

    def llm_resource(self, model: str, sampling_parameters: Mapping[str, Any] | None = None) -> ProxyLLM:
        """The resource agents get: ``endpoint`` templated with ``{rollout_id}`` and ``{attempt_id}``."""
        return ProxyLLM(
            endpoint=f"{self.url}/rollout/{{rollout_id}}/attempt/{{attempt_id}}/v1",
            model=model,
            sampling_parameters=dict(sampling_parameters or {}),
        )

    @property
    def backends(self) -> list[str]:
        """The configured backend URLs, in order."""
        return self._pool.backends

    @property
    def healthy_backends(self) -> list[str]:
        """The backends currently taking traffic (not ejected)."""
        return self._pool.healthy_backends

    def set_backends(self, urls: Sequence[str]) -> None:
        """Replace the backends (``http://host:port``, no ``/v1``); raises ``ValueError`` for anything else.

        A backend kept from the previous list keeps its health and load; calls already running on a removed
        backend finish there, and rollouts pinned to it move on their next call.
        """
        self._pool.set_backends(urls)

    async def pause(self) -> None:
        """Hold new calls (for a weight update) and return once every call in flight has finished.

        Held calls wait up to ``pause_timeout`` for :meth:`resume`, then get a 503. Cancelling ``pause``
        stops the wait for the drain but leaves the proxy paused: call :meth:`resume`. A call whose aborted
        generation waits to continue (see :meth:`hold`) is in flight: a drain waits for it, so a pause while
        backends abort generations returns once those calls ended (at the latest after ``pause_timeout``).
        """
        await self._gate.pause()

    def hold(self) -> Applied:
        """Hold new calls, without draining the calls in flight: they go on (the asynchronous trainer modes).

        From now until :meth:`resume`, a new call waits (up to ``pause_timeout``, then a 503) as during
        :meth:`pause`, and so does the continuation of a generation a backend aborts meanwhile (the trainer
        aborts the engines' generations to swap their weights): it continues under the new weights once
        :meth:`resume` is called, and its agent sees one uninterrupted answer. Idempotent; applied at once, and
        returns :data:`~aglverl.proxy.control.APPLIED` (awaitable, as :class:`ProxyControl` has it).
        """
        self._gate.hold()
        return APPLIED

    def resume(self, weight_version: int | None = None) -> Applied:
        """End a pause or a hold: waiting calls go on, and so do aborted generations waiting to continue.

        ``weight_version`` becomes the proxy's version (default: the current one + 1), recorded on calls whose
        backend reports none (``X-Weight-Version``). Applied at once; returns
        :data:`~aglverl.proxy.control.APPLIED`.
        """
        self._gate.resume(weight_version)
        return APPLIED

    def forget(self, rollout_ids: Sequence[str]) -> None:
        """Drop the routing state, the token-in sessions and the stored responses of rollouts that are over (the
        store calls this when it forgets them)."""
        self._pool.forget(rollout_ids)
        self._admission.overload.forget(rollout_ids)
        self.responses.forget(rollout_ids)
        if self.token_in is not None:
            self.token_in.forget(rollout_ids)

    def attempt_ended(self, rollout_id: str, attempt_id: str | None = None) -> None:
        """Free what the proxy keeps for an attempt that can make no more calls (``attempt_id`` ``None``: every
        attempt of the rollout): its stored Responses API responses. A proxy shard calls it when the store
        revokes an attempt there."""
        self.responses.end(rollout_id, attempt_id)

    def attempt_changed(self, change: AttemptChange) -> None:
        """A :meth:`TaskStore.on_attempt <aglverl.store.tasks.TaskStore.on_attempt>` listener: a rollout that
        finished makes no more calls (each of its attempts is refused from then on), so what its attempts keep
        goes (an attempt whose rollout is handed out again may still finish first: it keeps its responses)."""
        if change.kind == "ended" and change.state in TERMINAL:
            self.attempt_ended(change.rollout_id)

    @property
    def weight_version(self) -> int:
        """Model weights version recorded on every call whose backend reports none; set by :meth:`resume` (or
        directly, by a trainer that counts its own steps)."""
        return self._gate.weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self._gate.weight_version = version

    @property
    def activity(self) -> ActivityTimeline:
        """When calls were in flight: the backends' busy time as the proxy sees it."""
        return self._gate.activity

    async def refresh(self) -> None:
        """Nothing to fetch: the figures of a proxy in this process are always current (:class:`ProxyControl`)."""

    def counters(self) -> dict[str, float]:
        """The cumulative counters since start, under the ``proxy/*`` names a trainer logs, and the event loop's
        lag now (:data:`~aglverl.proxy.control.GAUGES`: a reading, not a count)."""
        counters = {f"proxy/calls_{outcome}": self.m_calls.value(outcome) for outcome in get_args(Outcome)}
        counters["proxy/retries"] = self.m_retries.value()
        counters["proxy/backend_ejections"] = self.m_ejections.value()
        counters["proxy/calls_without_token_ids"] = self.m_no_ids.value()
        counters["proxy/calls_unrecorded"] = self.m_unrecorded.value()
        counters["proxy/held_calls"] = self.m_held.value()
        counters["proxy/resumed"] = self.m_resumed.value()
        counters["proxy/continuations"] = self.m_continuations.value()
        counters["proxy/regenerated"] = self.m_regenerated.value()
        for reason in ("unsupported", "refused"):
            counters[f"proxy/resume_failures_{reason}"] = self.m_resume_failed.value(reason)
        overload = self.overload
        counters["proxy/calls_shed"] = overload.m_shed.value()
        counters["proxy/loop_overloaded_seconds"] = overload.m_overloaded.value()
        counters["proxy/loop_lag_seconds"] = overload.lag  # a reading (GAUGES), not a count
        if self.token_in is not None:
            for outcome in TOKEN_IN_OUTCOMES:
                counters[f"proxy/token_in_{outcome}"] = self.token_in.m_calls.value(outcome)
        return counters

    def generated_tokens(self) -> float:
        """Response token ids recorded since start."""
        return self.m_generated.value()

    @property
    def paused(self) -> bool:
        """Whether :meth:`pause` was called and :meth:`resume` not yet."""
        return self._gate.paused

    @property
    def held(self) -> bool:
        """Whether :meth:`hold` was called and :meth:`resume` not yet."""
        return self._gate.held

    @property
    def in_flight(self) -> int:
        """Calls admitted and not yet finished."""
        return self._gate.in_flight

    @property
    def connections(self) -> int:
        """Agents' connections open now (0 when not serving)."""
        return 0 if self._http is None else self._http.connections

    @property
    def gateway(self) -> GatewayRules | None:
        """The rules of rollout attempts whose agents call this proxy in place of Agent Lightning's hop (their
        key, their bodies' rewrite: :mod:`~aglverl.proxy.gateway`); ``None``: none. The daemon sets it."""
        return self._admission.gateway

    @gateway.setter
    def gateway(self, rules: GatewayRules | None) -> None:
        self._admission.gateway = rules

    def refusal(self, rollout_id: str, attempt_id: str) -> ProxyError | None:
        """The 429 a call of this rollout attempt gets now, or ``None`` when it is let in (its attempt is then
        under way: its later calls are never turned away): the proxy's overload decision, for a component that
        relays calls to it on the same loop and decides before it reads them (Agent Lightning's hop)."""
        try:
            self._admission.overload.admit(self._gate.in_flight, rollout_id, attempt_id)
        except ProxyError as exc:
            return exc
        return None

    @property
    def overload(self) -> Overload:
        """The event loop's lag (:attr:`Overload.lag <aglverl.proxy.overload.Overload.lag>`), measured while
        serving, and the policy past which new calls get a 429 (the ``overload`` setting; see
        :mod:`aglverl.proxy.overload`)."""
        return self._admission.overload

    # ------------------------------------------------------------------ life cycle
    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; ``task_status.started()`` once the listener accepts connections.

        On cancellation (shielded, bounded by ``shutdown_grace`` plus a few seconds): stop accepting, let
        in-flight calls finish within ``shutdown_grace``, cancel the rest, close the server and the pool.
        """
        if self._pool.is_open:
            raise RuntimeError("LLMProxy is already serving")
        config = self._config
        http = self._http = HttpServer(self._handler, config.host, config.port, config.limits())
        self._pool.open()
        self._handler.closing = False
        try:
            self._url = await http.start()
            self._admission.overload.start()
            async with anyio.create_task_group() as tg:
                self._pool.probes = tg
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._pool.probes = None
            self._admission.overload.stop()
            with anyio.CancelScope(shield=True):
                await self._close(http)
            self._http = None

    async def _close(self, http: HttpServer) -> None:
        self._handler.closing = True
        grace = self._config.shutdown_grace
        with anyio.move_on_after(grace + 4 * _CLOSE_TIMEOUT):
            await http.stop(grace=grace, cancel_wait=_CLOSE_TIMEOUT)
        await self._pool.close()
