"""The proxy's application: routes, admission, authentication, body limits, the gate, and its life cycle.

:class:`LLMProxy` assembles the parts: :class:`_Admission` (here), :class:`~aglverl.proxy.relay._Relay`, and
below it :class:`~aglverl.proxy.resume._StreamResumer`, :class:`~aglverl.proxy.resume._Resumer`,
:class:`~aglverl.proxy.capture._Recorder` and :class:`~aglverl.proxy.pool._Pool`. It owns the state they share (set in ``__init__``), the metrics, and:

- Routes: ``/rollout/{rollout_id}/attempt/{attempt_id}/v1/{path}`` (attributed, recorded), ``/v1/{path}``
  (unattributed), anything else a 404. Every handler counts its call once and tracks it for shutdown.
- Admission (:meth:`_Admission._admit`): the agent's API (a translated one is known first, so that every
  refusal is in that API's shape), the token (``Authorization`` or ``x-api-key``, compared in constant time),
  the attempt against the store (unknown 404, finished 409: never forwarded), the path (no ``.``/``..``
  segments), the body (``max_request_bytes``: 413), the translation to a chat completion, and for a recorded
  call the capture request (``return_token_ids``, logprobs) and the sampling reconciliation
  (:func:`reconcile_sampling`; refused 400 or masked ``off_policy``).
- The gate: :meth:`LLMProxy.pause` and :meth:`LLMProxy.hold` close it, :meth:`LLMProxy.resume` opens it and
  sets the weight version; a new call waits at it up to ``pause_timeout`` (then 503), and so does an aborted
  generation's continuation (through :meth:`LLMProxy._released`). ``pause`` also waits for the calls in
  flight to drain.
- Life cycle: :meth:`LLMProxy.serve` binds, serves until cancelled, then stops accepting, gives in-flight
  calls ``shutdown_grace`` seconds, cancels the rest and closes server and session.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import aiohttp
import anyio
import orjson
from aiohttp import web
from anyio.abc import TaskGroup, TaskStatus

from .._net import bind_listener, url_of
from ..metrics import ActivityTimeline, Counter, Registry
from ..models import ProxyLLM
from ..store import StoreError
from ..translate import CHAT_TARGET, TRANSLATED_PATHS, TranslationError, Translator, new_translator
from .call import _JSON, _REQUEST_DROP, ProxyError, _Call, _forward_headers, _token_limit
from .capture import CAPTURED_PATHS, _Capture
from .pool import UPSTREAM_KEEPALIVE, RetryPolicy, _Backend
from .relay import _Relay
from .store_view import ProxyStore
from .tokenin import TokenIn

logger = logging.getLogger(__name__)

#: Bound on each closing step (server, runner, session) after the grace period.
_CLOSE_TIMEOUT = 1.0

SamplingMismatch = Literal["refuse", "mask"]
#: Sampling parameters that change the distribution tokens are drawn from, and each one's neutral value.
SAMPLING_NEUTRAL: Mapping[str, float | None] = {
    "temperature": None,  # no neutral value: the trainer always names one
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
#: Of those, the ones a trainer's ``main_llm`` names (and the proxy fills in when a call omits them).
TRAINER_SAMPLING = ("temperature", "top_p", "top_k")


def _same_value(key: str, a: Any, b: Any) -> bool:
    if key == "top_k":  # vLLM: -1 and 0 both mean "no top-k"
        a, b = (-1 if v in (0, -1, None) else v for v in (a, b))
    if a is None or b is None:
        return a is b
    return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-6)


def reconcile_sampling(
    request: Mapping[str, Any], expected: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, float], list[str]]:
    """Compare a call's sampling parameters with the trainer's ``expected`` ones.

    Returns ``(fill, used, mismatches)``: the parameters to add to the request (the trainer's values the call
    omits, and ``max_tokens`` when it sets no limit), the values the call is made with, and a description of
    each parameter it sets differently (``"temperature=0.7 (the trainer samples at 1.0)"``); ``used`` names the
    trainer's parameters and those the call sets. A ``null`` in the request counts as omitted; a parameter
    the trainer does not name must be at its neutral value.
    """
    fill: dict[str, Any] = {}
    used: dict[str, float] = {}
    mismatches: list[str] = []
    for key, neutral in SAMPLING_NEUTRAL.items():
        want = expected.get(key, neutral) if key in TRAINER_SAMPLING else neutral
        got = request.get(key)
        if got is None:
            if want is not None and key in expected:
                fill[key] = want
                used[key] = float(want)
            continue
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            continue  # the backend rejects a wrong type with its own 400
        used[key] = float(got)
        if want is not None and not _same_value(key, got, want):
            mismatches.append(f"{key}={got!r} (the trainer samples at {key}={want!r})")
    if request.get("logit_bias"):
        mismatches.append("logit_bias (the trainer samples without one)")
    limit = expected.get("max_tokens")
    if (
        limit is not None
        and request.get("max_tokens") is None
        and request.get("max_completion_tokens") is None
    ):
        fill["max_tokens"] = limit
    return fill, used, mismatches


# ---------------------------------------------------------------------------------------------- admission
class _Admission:
    """Checks and reads a request into its call (see the module docstring); a part of :class:`LLMProxy`."""

    if TYPE_CHECKING:  # the host's state, and the gate's wait (LLMProxy)
        store: ProxyStore
        max_request_bytes: int
        request_logprobs: bool
        sampling_of: Callable[[str], Mapping[str, Any] | None] | None
        sampling_mismatch: SamplingMismatch
        token_in: TokenIn | None
        _auth: bytes | None
        _backend_auth: str | None
        _gate: anyio.Event | None
        m_sampling: Counter

        async def _wait_resumed(self) -> None: ...

    async def _admit(self, request: web.Request, call: _Call, target: str) -> None:
        """Check and read the request into ``call``, then wait while paused; raises :class:`ProxyError`."""
        path = request.match_info["path"]
        api = TRANSLATED_PATHS.get(path) if request.method == "POST" else None
        if api is not None:  # known first, so that every refusal below is in the agent's API
            call.translator = new_translator(api)
        self._authorize(request)
        if call.rollout_id is not None:
            assert call.attempt_id is not None
            try:
                self.store.check_attempt(call.rollout_id, call.attempt_id)
            except StoreError as exc:
                raise ProxyError(exc.status, f"{exc}; the call was not forwarded") from None
        if "\\" in path or ("." in path and {".", ".."} & set(path.split("/"))):
            raise ProxyError(400, f"path 'v1/{path}' has '.' or '..' segments or backslashes; not forwarded")
        query = request.rel_url.raw_query_string
        call.method = request.method
        call.path = "/v1/" + path
        call.target = f"{target}?{query}" if query else target
        call.headers = _forward_headers(request.headers, _REQUEST_DROP)
        if self._backend_auth is not None:
            call.headers["Authorization"] = self._backend_auth
        call.body = await self._read_body(request)
        kind = CAPTURED_PATHS.get(path) if call.method == "POST" else None
        if call.translator is not None:
            kind = self._translate_request(call, call.translator)
        if kind is not None and call.rollout_id is not None:
            self._prepare_capture(call, kind)
            if kind == "chat" and self.token_in is not None:
                self.token_in.admit(call)
        if self._gate is not None:
            await self._wait_resumed()

    def _authorize(self, request: web.Request) -> None:
        if self._auth is None:
            return
        header = request.headers.get("Authorization")
        if header is None and "x-api-key" in request.headers:  # how Anthropic's SDK sends its api_key
            header = "Bearer " + request.headers["x-api-key"]
        given = (header or "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, self._auth):
            raise ProxyError(
                401, "missing or wrong proxy token: send 'Authorization: Bearer <token>' (or 'x-api-key')"
            )

    async def _read_body(self, request: web.Request) -> bytes:
        length = request.content_length
        limit = self.max_request_bytes
        if length is not None and length > limit:
            raise ProxyError(
                413, f"request body of {length} bytes exceeds the proxy's limit of {limit} bytes"
            )
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ProxyError(413, f"request body exceeds the proxy's limit of {limit} bytes") from None

    @staticmethod
    def _translate_request(call: _Call, translator: Translator) -> Literal["chat"]:
        """Turn a Responses / Messages body into the chat completion the backend gets (before any capture
        preparation, which then sees an ordinary chat call); a body that cannot be translated is a 400."""
        try:
            call.body = translator.request(call.body)
        except TranslationError as exc:
            raise ProxyError(exc.status, exc.message, exc.param) from None
        call.target = CHAT_TARGET  # the agent's query (e.g. the Anthropic SDK's ?beta=true) is its API's own
        call.headers["Content-Type"] = _JSON
        call.headers["Accept-Encoding"] = "identity"  # the answer is parsed to be translated
        return "chat"

    def _prepare_capture(self, call: _Call, kind: Literal["chat", "completion"]) -> None:
        """Validate the JSON body and make sure the backend is asked for token ids, in identity encoding."""
        try:
            obj = orjson.loads(call.body)
        except orjson.JSONDecodeError as exc:
            raise ProxyError(400, f"request body of {call.path} is not valid JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise ProxyError(
                400, f"request body of {call.path} must be a JSON object, not {type(obj).__name__}"
            )
        model = obj.get("model")
        call.model = model if isinstance(model, str) else None
        call.kind = kind
        call.capture = _Capture(kind)
        call.headers["Accept-Encoding"] = "identity"
        empty = not obj
        fill = self._reconcile_sampling(call, obj)
        if "return_token_ids" not in obj:
            fill["return_token_ids"] = True
        if self.request_logprobs and "logprobs" not in obj:
            # Completions take a count of alternatives: 0 asks for the sampled tokens' logprobs alone.
            fill["logprobs"] = True if kind == "chat" else 0
        if any(key in obj for key in fill):  # a parameter sent as null is replaced: re-encode the body
            call.body = orjson.dumps({**obj, **fill})
        elif fill:
            # Spliced in as text: every other byte of the agent's body reaches the backend untouched.
            i = call.body.index(b"{") + 1
            added = b",".join(orjson.dumps(key) + b":" + orjson.dumps(value) for key, value in fill.items())
            call.body = call.body[:i] + added + (b"" if empty else b",") + call.body[i:]
        obj.update(fill)
        call.request = obj
        # read after the fill: a max_tokens the proxy filled in is the call's limit, and a stop there is truncated
        call.max_tokens = _token_limit(obj)

    def _reconcile_sampling(self, call: _Call, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Check the call's sampling parameters against its trainer's; return the parameters to add.

        Raises :class:`ProxyError` (400) for an off-policy call under the ``"refuse"`` rule, marks it
        ``off_policy`` under ``"mask"``.
        """
        expected = (
            self.sampling_of(call.rollout_id) if self.sampling_of is not None and call.rollout_id else None
        )
        if not expected:
            return {}
        fill, call.sampling, mismatches = reconcile_sampling(obj, expected)
        if mismatches:
            if self.sampling_mismatch == "refuse":
                self.m_sampling.inc(1, "refused")
                raise ProxyError(
                    400,
                    f"{call.path}: {'; '.join(mismatches)}: this rollout trains on-policy, so its calls must "
                    "sample as the trainer does (omit the parameter to get the trainer's value, or start the "
                    "trainer with aglverl.sampling_mismatch: mask to keep such calls out of the loss)",
                )
            self.m_sampling.inc(1, "masked")
            call.off_policy = True
        if fill:
            self.m_sampling.inc(1, "filled")
        return fill


# ---------------------------------------------------------------------------------------------- the proxy


class LLMProxy(_Admission, _Relay):
    """Token-recording reverse proxy in front of OpenAI-compatible backends (see :mod:`aglverl.proxy`).

    Serve it with ``await tg.start(proxy.serve)``; :attr:`url` is valid once ``start`` returns.
    ``token``: when set, every request needs ``Authorization: Bearer <token>`` (an OpenAI client's
    ``api_key``); it is never logged nor forwarded. ``backend_api_key``: sent to the backends as a bearer token
    (they never see the agents' credentials). ``max_request_bytes``/``max_response_bytes`` bound bodies;
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
    text (and multi-turn rows drift wherever the chat template re-renders the history differently).
    :attr:`activity` is the timeline of when at least one call was in flight (the backends were busy).
    """

    def __init__(
        self,
        store: ProxyStore,
        *,
        backends: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int = 0,
        registry: Registry | None = None,
        retry: RetryPolicy = RetryPolicy(),  # noqa: B008  # frozen: one shared default instance is safe
        request_timeout: float = 600.0,
        connect_timeout: float = 5.0,
        token: str | None = None,
        max_request_bytes: int = 32 << 20,
        max_response_bytes: int = 256 << 20,
        eject_seconds: float = 5.0,
        pause_timeout: float = 600.0,
        hold_timeout: float | None = None,
        shutdown_grace: float = 5.0,
        backend_api_key: str | None = None,
        upstream_keepalive: float = UPSTREAM_KEEPALIVE,
        request_logprobs: bool = False,
        sampling_of: Callable[[str], Mapping[str, Any] | None] | None = None,
        sampling_mismatch: SamplingMismatch = "refuse",
        token_in: bool = True,
    ) -> None:
        if sampling_mismatch not in ("refuse", "mask"):
            raise ValueError(f"sampling_mismatch must be 'refuse' or 'mask', got {sampling_mismatch!r}")
        self.store = store
        self.host = host
        self.port = port
        self.retry = retry
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self.max_request_bytes = max_request_bytes
        self.max_response_bytes = max_response_bytes
        self.eject_seconds = eject_seconds
        self.pause_timeout = pause_timeout
        self.hold_timeout = pause_timeout if hold_timeout is None else hold_timeout
        self.shutdown_grace = shutdown_grace
        self.upstream_keepalive = upstream_keepalive
        self.request_logprobs = request_logprobs
        self.sampling_of = sampling_of
        self.sampling_mismatch = sampling_mismatch
        #: When calls were in flight: the backends' busy time as the proxy sees it.
        self.activity = ActivityTimeline()
        #: Model weights version recorded on every call; set or incremented by :meth:`resume`.
        self.weight_version = 0
        self._auth = f"Bearer {token}".encode() if token is not None else None
        self._backend_auth = f"Bearer {backend_api_key}" if backend_api_key is not None else None
        self._backends: list[_Backend] = []
        self._sticky: OrderedDict[str, _Backend] = OrderedDict()
        self._seq = itertools.count()
        self._in_flight = 0
        self._drained: anyio.Event | None = None  # created by a pause() waiting for in-flight calls
        self._paused = False
        self._held = False
        self._gate: anyio.Event | None = None  # exists while paused or held; set by resume()
        self._waiting = (
            0  # calls waiting for the gate now (at admission, or to continue an aborted generation)
        )
        self._handlers: set[asyncio.Task[Any]] = set()
        self._closing = False
        self._session: aiohttp.ClientSession | None = None
        self._tg: TaskGroup | None = None
        self._url: str | None = None
        self.set_backends(backends)
        self._register_metrics(registry or Registry())
        #: Token-in chat (:mod:`~aglverl.proxy.tokenin`): calls that extend a recorded turn are generated from
        #: its exact ids; ``None`` when turned off (every call relayed as text).
        self.token_in: TokenIn | None = TokenIn(self, self.registry) if token_in else None

    # ------------------------------------------------------------------ metrics
    def _register_metrics(self, r: Registry) -> None:
        self.registry = r
        self.m_calls = r.counter("aglverl_proxy_calls_total", "LLM calls handled by the proxy.", ["outcome"])
        self.m_retries = r.counter("aglverl_proxy_retries_total", "Upstream tries repeated after a failure.")
        self.m_ejections = r.counter(
            "aglverl_proxy_backend_ejections_total",
            "Backends taken out of rotation after failed connections.",
        )
        self.m_no_ids = r.counter(
            "aglverl_proxy_calls_without_token_ids_total",
            "Recorded calls (choices) the backend sent no ids for.",
        )
        self.m_unrecorded = r.counter(
            "aglverl_proxy_calls_unrecorded_total",
            "Attributed calls dropped because their rollout had ended.",
        )
        self.m_upstream = r.histogram(
            "aglverl_proxy_upstream_seconds", "Upstream request sent to last upstream byte (seconds)."
        )
        self.m_first_byte = r.histogram(
            "aglverl_proxy_first_byte_seconds", "Request arrival to first byte sent to the agent (seconds)."
        )
        self.m_added = r.histogram(
            "aglverl_proxy_added_seconds",
            "Time a call spent in the proxy beyond its last upstream try (seconds).",
        )
        self.m_sampling = r.counter(
            "aglverl_proxy_sampling_total",
            "Recorded calls whose sampling parameters were filled in, refused or masked as off-policy.",
            ["action"],
        )
        self.m_generated = r.counter(
            "aglverl_proxy_generated_tokens_total", "Response token ids recorded, over every recorded call."
        )
        r.gauge("aglverl_proxy_in_flight", "Calls being forwarded now.", lambda: self._in_flight)
        self.m_held = r.counter(
            "aglverl_proxy_held_calls_total",
            "Calls that arrived while the proxy was paused or held, and waited.",
        )
        r.gauge(
            "aglverl_proxy_waiting_calls",
            "Calls waiting now for a pause or hold to end (new calls, and aborted generations to continue).",
            lambda: self._waiting,
        )
        self.m_resumed = r.counter(
            "aglverl_proxy_resumed_total",
            "Recorded calls whose generation a backend aborted and the proxy continued to its end.",
        )
        self.m_continuations = r.counter(
            "aglverl_proxy_continuations_total",
            "Token-in continuation requests sent for aborted generations.",
        )
        self.m_regenerated = r.counter(
            "aglverl_proxy_regenerated_total",
            "Aborted whole answers that a completion cannot continue (tool calls, n > 1, structured output), "
            "made again from the start (the agent had seen none of them).",
        )
        self.m_resume_failed = r.counter(
            "aglverl_proxy_resume_failures_total",
            "Aborted generations not continued: calls the proxy does not resume (unsupported), or a backend "
            "that kept aborting or refusing for pause_timeout (refused).",
            ["reason"],
        )
        self.m_resume_latency = r.histogram(
            "aglverl_proxy_resume_seconds",
            "An aborted generation free to continue (not held) to its continuation's first token (seconds).",
        )

    # ------------------------------------------------------------------ public API
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

    async def pause(self) -> None:
        """Hold new calls (for a weight update) and return once every call in flight has finished.

        Held calls wait up to ``pause_timeout`` for :meth:`resume`, then get a 503. Cancelling ``pause``
        stops the wait for the drain but leaves the proxy paused: call :meth:`resume`. A call whose aborted
        generation waits to continue (see :meth:`hold`) is in flight: a drain waits for it, so a pause while
        backends abort generations returns once those calls ended (at the latest after ``pause_timeout``).
        """
        if not self._paused:
            self._paused = True
            self._close_gate()
        while self._in_flight:
            if self._drained is None:
                self._drained = anyio.Event()
            await self._drained.wait()

    def hold(self) -> None:
        """Hold new calls, without draining the calls in flight: they go on (the asynchronous trainer modes).

        From now until :meth:`resume`, a new call waits (up to ``pause_timeout``, then a 503) as during
        :meth:`pause`, and so does the continuation of a generation a backend aborts meanwhile (the trainer
        aborts the engines' generations to swap their weights): it continues under the new weights once
        :meth:`resume` is called, and its agent sees one uninterrupted answer. Idempotent; returns at once.
        """
        self._held = True
        self._close_gate()

    def resume(self, weight_version: int | None = None) -> None:
        """End a pause or a hold: waiting calls go on, and so do aborted generations waiting to continue.

        ``weight_version`` becomes the proxy's version (default: the current one + 1), recorded on calls whose
        backend reports none (``X-Weight-Version``).
        """
        self.weight_version = self.weight_version + 1 if weight_version is None else weight_version
        self._paused = self._held = False
        if self._gate is not None:
            self._gate.set()
            self._gate = None

    def forget(self, rollout_ids: Sequence[str]) -> None:
        """Drop the routing state and the token-in sessions of rollouts that are over (the store calls this
        when it forgets them)."""
        super().forget(rollout_ids)
        if self.token_in is not None:
            self.token_in.forget(rollout_ids)

    def _close_gate(self) -> None:
        if self._gate is None:
            self._gate = anyio.Event()

    @property
    def paused(self) -> bool:
        """Whether :meth:`pause` was called and :meth:`resume` not yet."""
        return self._paused

    @property
    def held(self) -> bool:
        """Whether :meth:`hold` was called and :meth:`resume` not yet."""
        return self._held

    @property
    def in_flight(self) -> int:
        """Calls admitted and not yet finished."""
        return self._in_flight

    # ------------------------------------------------------------------ life cycle
    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; ``task_status.started()`` once the listener accepts connections.

        On cancellation (shielded, bounded by ``shutdown_grace`` plus a few seconds): stop accepting, let
        in-flight calls finish within ``shutdown_grace``, cancel the rest, close the server and the session.
        """
        if self._session is not None:
            raise RuntimeError("LLMProxy is already serving")
        sock = bind_listener(self.host, self.port)
        app = self._make_app()
        runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=_CLOSE_TIMEOUT
        )
        self._session = self._make_session()
        self._closing = False
        site: web.SockSite | None = None
        try:
            await runner.setup()
            site = web.SockSite(runner, sock)
            await site.start()
            self._url = url_of(sock)
            async with anyio.create_task_group() as tg:
                self._tg = tg
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._tg = None
            with anyio.CancelScope(shield=True):
                await self._close(runner, site)
            sock.close()

    def _make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_request_bytes)
        app.router.add_route("*", "/v1/{path:.*}", self._unattributed)
        app.router.add_route("*", "/rollout/{rollout_id}/attempt/{attempt_id}/v1/{path:.*}", self._attributed)
        app.router.add_route("*", "/{tail:.*}", self._no_route)
        return app

    async def _close(self, runner: web.AppRunner, site: web.SockSite | None) -> None:
        self._closing = True
        with anyio.move_on_after(self.shutdown_grace + 4 * _CLOSE_TIMEOUT):
            if site is not None:
                await site.stop()
            if self._handlers:
                await asyncio.wait(set(self._handlers), timeout=self.shutdown_grace)
            for task in self._handlers:
                task.cancel()
            if self._handlers:
                await asyncio.wait(set(self._handlers), timeout=_CLOSE_TIMEOUT)
            await runner.cleanup()
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    # ------------------------------------------------------------------ handlers
    async def _no_route(self, request: web.Request) -> web.Response:
        try:
            self._authorize(request)
        except ProxyError as exc:
            return exc.response()
        message = f"no such route {request.path!r}: use /v1/... or /rollout/{{rollout_id}}/attempt/{{attempt_id}}/v1/..."
        return ProxyError(404, message).response()

    async def _unattributed(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, None, None, request.rel_url.raw_path)

    async def _attributed(self, request: web.Request) -> web.StreamResponse:
        info = request.match_info
        # The raw (still percent-encoded) path after the attempt segment is what goes upstream.
        target = "/" + request.rel_url.raw_path.split("/", 5)[5]
        return await self._handle(request, info["rollout_id"], info["attempt_id"], target)

    async def _handle(
        self, request: web.Request, rollout_id: str | None, attempt_id: str | None, target: str
    ) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        call = _Call(next(self._seq), time.monotonic(), rollout_id, attempt_id)
        try:
            try:
                await self._admit(request, call, target)
            except ProxyError as exc:
                self.m_calls.inc(1, "rejected")
                return exc.response(call.translator)
            except asyncio.CancelledError:  # the agent left while its body was read or while paused
                self.m_calls.inc(1, "cancelled")
                raise
            self._enter()
            try:
                return await self._run(request, call)
            finally:
                self._leave()
        finally:
            self._handlers.discard(task)

    async def _wait_resumed(self) -> None:
        self.m_held.inc()
        if not await self._released(time.monotonic() + self.pause_timeout):
            raise ProxyError(503, f"the proxy is paused for a weight update for over {self.hold_timeout:g}s")

    async def _released(self, deadline: float) -> bool:
        """Wait until the proxy is neither paused nor held; ``False`` if ``deadline`` (monotonic) came first.

        The trainer holds the proxy for as long as its update takes: while held, the wait lasts up to
        ``hold_timeout`` from now even when ``deadline`` (a ``pause_timeout`` bound) comes earlier."""
        self._waiting += 1
        if self._gate is not None:
            deadline = max(deadline, time.monotonic() + self.hold_timeout)
        try:
            with anyio.move_on_after(deadline - time.monotonic()):
                while self._gate is not None:  # a new hold may close a new gate before this task runs again
                    await self._gate.wait()
        finally:
            self._waiting -= 1
        return self._gate is None

    def _enter(self) -> None:
        self._in_flight += 1
        self.activity.begin()

    def _leave(self) -> None:
        self._in_flight -= 1
        self.activity.end()
        if self._in_flight == 0 and self._drained is not None:
            self._drained.set()
            self._drained = None

    # ------------------------------------------------------------------ forwarding
    async def _run(self, request: web.Request, call: _Call) -> web.StreamResponse:
        """Forward ``call`` (generated from ids when it extends a recorded turn, else relayed), always ending
        with it recorded and counted, whatever happens."""
        call.weight_version = self.weight_version
        try:
            if self.token_in is not None and call.tokenin is not None and call.tokenin.match is not None:
                response = await self.token_in.run(request, call)
                if response is not None:
                    return response
            return await self._attempts(request, call)
        except ProxyError as exc:
            call.fail(exc.message)
            return exc.response(call.translator)
        except asyncio.CancelledError:
            call.fail("proxy shutting down" if self._closing else "agent disconnected", "cancelled")
            raise
        except Exception as exc:
            logger.exception("proxy failure on %s", call.path)
            call.fail(f"internal proxy error: {exc!r}")
            if call.response is not None:
                return call.response
            return ProxyError(500, f"internal proxy error: {exc!r}").response(call.translator)
        finally:
            self._finish(call)
