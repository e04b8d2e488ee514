"""Admission: a request checked at its head, then read into its call, before anything is forwarded.

:class:`Admission` has two entries. :meth:`Admission.check` runs as soon as a request's head is in, before a
byte of its body was read (the HTTP server's :meth:`~aglverl.proxy.http.Service.admit`), in order: the agent's
API (a translated one is known first, so that every refusal is in that API's shape), the token
(``Authorization``, or an API's key header such as Anthropic's ``x-api-key``:
:attr:`~aglverl.proxy.api.Apis.credential_headers`, compared in constant time; for an attempt whose agent
aglverl's runner started, its own key: :mod:`~aglverl.proxy.gateway`, a rule asked of :attr:`Admission.gateway`),
the attempt against the store
(:class:`~aglverl.proxy.store_view.ProxyStore`: unknown 404, finished 409: never forwarded), the path (no
``.``/``..`` segments; a route the proxy answers itself, a stored response read back or deleted, is let in there:
no overload check, no gate), the proxy's load (:class:`~aglverl.proxy.overload.Overload`: a 429 with ``Retry-After``
while its event loop runs too late; never for a call of an attempt under way). A refused request's body is never
read (and its length is the server's to bound: 413). :meth:`Admission.admit`, in the call's handler, then reads
the body (for a route the proxy answers itself, that is all), sets a gateway rule's fields on a JSON one (the
served model, the rollout's temperature), translates it to a chat completion, and for a recorded call makes the capture request (identity
encoding; the ids and log-probs fields are the dialect's of the backend a try goes to:
:meth:`~aglverl.proxy.call.Call.prepare`), reconciles its sampling parameters (:func:`reconcile_sampling`; refused
400 or masked ``off_policy``) and opens its token-in session (:meth:`~aglverl.proxy.tokenin.TokenIn.admit`);
last, it waits at the gate while it is closed (:meth:`~aglverl.proxy.gate.Gate.admit`).

Every refusal is a :class:`~aglverl.proxy.call.ProxyError` naming what was wrong; nothing of a refused call
was forwarded or stored. :meth:`Admission.admit` awaits the request body and the gate; cancelled (the agent
left), it stops there. Holds the config, the store, the gate, the meters (``sampling``) and the token-in part
(``None``: off); makes and holds the :class:`~aglverl.proxy.overload.Overload` part (:attr:`Admission.overload`).
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Mapping
from typing import Any, Literal

import orjson

from ..store import StoreError
from .api import APIS, CHAT_TARGET, TranslationError, Translator
from .api.response_store import ResponseStore
from .call import JSON, Call, ProxyError, forward_headers, token_limit
from .capture import CAPTURED_PATHS, Capture
from .config import ProxyConfig, SamplingOf
from .gate import Gate
from .gateway import GatewayRule, GatewayRules, rewrite_json
from .http import Exchange, HttpError
from .meters import Meters
from .overload import Overload
from .routes import Route
from .store_view import ProxyStore
from .tokenin import TokenIn

__all__ = ["SAMPLING_NEUTRAL", "TRAINER_SAMPLING", "Admission", "reconcile_sampling"]

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
class Admission:
    """Checks and reads a request into its call (see the module docstring)."""

    def __init__(
        self,
        config: ProxyConfig,
        store: ProxyStore,
        gate: Gate,
        meters: Meters,
        token_in: TokenIn | None,
        sampling_of: SamplingOf | None = None,
        responses: ResponseStore | None = None,
    ) -> None:
        #: The event loop's lag and the 429 for new calls while it is over its limit (``config.overload``).
        self.overload = Overload(meters.registry, config.overload, lambda: gate.in_flight)
        self.config = config
        self.sampling_of = sampling_of
        self.store = store
        self.gate = gate
        self.meters = meters
        self.token_in = token_in
        #: The rules of attempts whose agents call the proxy in place of Agent Lightning's hop (their key, their
        #: bodies' rewrite: :mod:`~aglverl.proxy.gateway`); ``None``: none.
        self.gateway: GatewayRules | None = None
        #: The Responses API's stored responses, per attempt (``None``: none kept).
        self.responses = responses

    @property
    def config(self) -> ProxyConfig:
        return self._config

    @config.setter
    def config(self, config: ProxyConfig) -> None:
        """A new config (the proxy's :meth:`~aglverl.proxy.LLMProxy.reconfigure`) brings its overload policy."""
        self._config = config
        self.overload.policy = config.overload

    def check(self, exchange: Exchange, call: Call, route: Route) -> None:
        """Check the head of the agent's request (``route``: its route) and fill in what goes upstream (method,
        path, target, end-to-end headers); raises :class:`ProxyError`. No byte of the body has been read. A call
        the proxy answers itself (:attr:`Translator.local <aglverl.proxy.api.Translator.local>`: a stored
        response read back or deleted) is checked up to its attempt and its path."""
        path = route.path
        api = APIS.match(path, exchange.method)
        if api is not None:  # known first, so that every refusal below is in the agent's API
            call.translator = translator = Translator(*api)
            exchanged = translator.exchange
            exchanged.responses, exchanged.attempt = self.responses, (call.rollout_id, call.attempt_id)
        rule = (
            self.gateway(call.rollout_id, call.attempt_id)
            if self.gateway is not None and call.rollout_id is not None and call.attempt_id is not None
            else None
        )
        self.authorize(exchange.headers, rule)
        if call.rollout_id is not None:
            assert call.attempt_id is not None
            try:
                self.store.check_attempt(call.rollout_id, call.attempt_id)
            except StoreError as exc:
                raise ProxyError(exc.status, f"{exc}; the call was not forwarded") from None
        if route.dotted:
            raise ProxyError(400, f"path 'v1/{path}' has '.' or '..' segments or backslashes; not forwarded")
        call.method = exchange.method
        call.path = "/v1/" + path
        if call.translator is not None and call.translator.local:
            call.translator.exchange.query = exchange.query
            return
        self.overload.admit(self.gate.in_flight, call.rollout_id, call.attempt_id)
        query = exchange.query
        call.target = f"{route.target}?{query}" if query else route.target
        call.headers = forward_headers(exchange.headers, APIS.not_forwarded)
        if self.config.backend_auth is not None:
            call.headers["Authorization"] = self.config.backend_auth
        if rule is not None:  # what Agent Lightning's hop would have done to its body, once it is read
            call.rewrite = rule.fields

    async def admit(self, call: Call) -> None:
        """Read the body of the call :meth:`check` let in, make it the backend's request, then wait while
        paused; raises :class:`ProxyError`. A call the proxy answers itself returns once its body is in (no
        translation, no wait). Cancelled (the agent left), it stops where it waits."""
        exchange = call.exchange
        assert exchange is not None
        try:
            call.body = await exchange.body()
        except HttpError as exc:  # a chunked body past max_body_bytes, refused by the parser, or stalled
            raise ProxyError(exc.status, exc.message) from None
        if call.translator is not None and call.translator.local:
            return
        if call.rewrite is not None:
            call.body = rewrite_json(call.body, call.rewrite, exchange.headers.get("Content-Type", ""))
        kind = CAPTURED_PATHS.get(call.path[4:]) if call.method == "POST" else None
        if call.translator is not None:
            kind = self._translate_request(call, call.translator)
        if kind is not None and call.rollout_id is not None:
            self._prepare_capture(call, kind)
            if kind == "chat" and self.token_in is not None:
                self.token_in.admit(call)
        await self.gate.admit()

    def authorize(self, headers: Mapping[str, str], rule: GatewayRule | None = None) -> None:
        """Check the agent's credential in ``headers``: the proxy's token, or for an attempt with a gateway
        ``rule`` its key (needed then even with no token); :class:`ProxyError` (401) when it is missing or
        wrong."""
        if self.config.auth is None and rule is None:
            return
        header = APIS.credential(headers)  # Authorization, or an API's key header (Anthropic's x-api-key)
        given = (header or "").encode("utf-8", "surrogateescape")
        if rule is not None:
            key = f"Bearer {rule.key}".encode() if rule.key is not None else None
            if key is not None and hmac.compare_digest(given, key):
                return
            if self.config.auth is None or not hmac.compare_digest(given, self.config.auth):
                raise ProxyError(
                    401,
                    "missing or wrong key: this rollout attempt's agent was started by aglverl's runner, and its "
                    "calls need its key (AGL_KEY, as OPENAI_API_KEY) or the proxy's token",
                )
            return
        assert self.config.auth is not None
        if not hmac.compare_digest(given, self.config.auth):
            others = " or ".join(f"'{name}'" for name in APIS.key_headers)
            raise ProxyError(
                401, f"missing or wrong proxy token: send 'Authorization: Bearer <token>' (or {others})"
            )

    @staticmethod
    def _translate_request(call: Call, translator: Translator) -> Literal["chat"]:
        """Turn a Responses / Messages body into the chat completion the backend gets (before any capture
        preparation, which then sees an ordinary chat call); a body that cannot be translated is a 400."""
        try:
            call.body = translator.request(call.body)
        except TranslationError as exc:
            raise ProxyError(exc.status, exc.message, exc.param, code=exc.code) from None
        call.target = CHAT_TARGET  # the agent's query (e.g. the Anthropic SDK's ?beta=true) is its API's own
        call.headers["Content-Type"] = JSON
        call.headers["Accept-Encoding"] = "identity"  # the answer is parsed to be translated
        return "chat"

    def _prepare_capture(self, call: Call, kind: Literal["chat", "completion"]) -> None:
        """Validate the JSON body, reconcile its sampling parameters, and mark the call to be captured in identity
        encoding; the fields that make the backend answer with ids are its dialect's, added when a backend is
        picked (:meth:`Call.prepare <aglverl.proxy.call.Call.prepare>`)."""
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
        call.capture = Capture(kind)
        call.headers["Accept-Encoding"] = "identity"
        fill = self._reconcile_sampling(call, obj)
        call.given, call.fill, call.text = obj, fill, call.body
        call.request = {**obj, **fill} if fill else obj
        # read after the fill: a max_tokens the proxy filled in is the call's limit, and a stop there is truncated
        call.max_tokens = token_limit(call.request)

    def _reconcile_sampling(self, call: Call, obj: Mapping[str, Any]) -> dict[str, Any]:
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
            if self.config.sampling_mismatch == "refuse":
                self.meters.sampling.inc(1, "refused")
                raise ProxyError(
                    400,
                    f"{call.path}: {'; '.join(mismatches)}: this rollout trains on-policy, so its calls must "
                    "sample as the trainer does (omit the parameter to get the trainer's value, or start the "
                    "trainer with aglverl.proxy.sampling_mismatch: mask to keep such calls out of the loss)",
                )
            self.meters.sampling.inc(1, "masked")
            call.off_policy = True
        if fill:
            self.meters.sampling.inc(1, "filled")
        return fill
