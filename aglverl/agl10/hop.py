"""Agent Lightning's proxy path on the task server, relayed to aglverl's LLM proxy.

``/proxy/rollout/{rollout}/attempt/{attempt}/mode/{train|val}/openai/v1/{path}`` is where Agent Lightning's
controllers point an agent (``AGL_OPENAI_BASE_URL``), on the one server URL they are given. :class:`ProxyHop`
serves it on aglverl's task server and relays every call, any method and path, to aglverl's LLM proxy under the
rollout's aglverl attempt (``/rollout/{id}/attempt/{id}/v1/{path}``, on the attempt's proxy shard when there are
several), so it gets everything that proxy does: token ids recorded, streams relayed chunk by chunk, the
Responses and Anthropic Messages APIs, token-in chat, calls held (not refused) while the trainer updates the
weights, aborted generations continued. Before that it does to a JSON body what Agent Lightning's gateway does:
``model`` becomes the served model's name and ``temperature`` the rollout's mode's (the trainer's for
``train``, its validation setting for ``val``: the rollout's ``main_llm``); the other sampling parameters are
aglverl's proxy's to fill in or check.

A call on a ``queuing`` rollout starts it (its aglverl attempt is claimed): Agent Lightning's controllers spawn
the agent before they report it running (``runner_type=k8s`` only on its next poll), and the agent's first call
must not wait for that. A call on a finished rollout is a 409. The agent's credential (Agent Lightning's key,
``Authorization: Bearer`` or ``x-api-key``) is checked here and never forwarded (nor any header an agent's API
carries a key in: the proxy's one list); the hop sends aglverl's token. While the proxy on this loop is
overloaded, a new call (not one of a rollout attempt under way) may get its 429 here, before its body is read:
the proxy's own decision (``LLMProxy.refusal``), so that a turned-away call costs the loop once, not twice.

Cancellation: an agent that disconnects while its call is upstream (or held) cancels the relayed request, and
aglverl's proxy cancels the backend's; a stream the agent leaves is closed upstream the same way.

The hop's rule without the hop: an agent process aglverl's runner starts calls the proxy directly when the proxy
runs on this loop (:meth:`ProxyHop.direct_url`, once :meth:`ProxyHop.attach` gave the proxy the hop's rules),
and the proxy does what the hop would have: the attempt's key opens its calls, and :meth:`ProxyHop.rule` says
what a JSON body gets (:mod:`aglverl.proxy.gateway`). So the runner's agents get what they got through the hop,
without its second HTTP exchange; a rollout started by Agent Lightning's controllers goes through the hop.

A path with a ``.`` or ``..`` segment is refused (400): the HTTP client would resolve it, and a call made on one
rollout's path would reach (and be recorded under) another's. The path is sent upstream %-escaped as it came.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import aiohttp
import anyio
import orjson
from anyio.abc import TaskStatus
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ..models import LLM
from ..proxy.api import APIS, Translator
from ..proxy.call import ProxyError
from ..proxy.gateway import GatewayRule, rewrite_json
from ..proxy.headers import HOP_BY_HOP
from ..store import StoreError, TaskStore
from .errors import Conflict, NotFound
from .http import Refused, read_body
from .rollouts import AgentLightningRollouts

if TYPE_CHECKING:
    from ..proxy.app import LLMProxy

__all__ = ["ProxyHop"]

logger = logging.getLogger(__name__)

_RESPONSE_DROP = HOP_BY_HOP
#: What a path segment keeps unescaped (RFC 3986's ``pchar``), and ``/`` between segments.
_PATH_SAFE = "/-._~!$&'()*+,;=:@"
#: How long the hop waits to connect to aglverl's proxy (in this process, on loopback or a shard's node).
_CONNECT_SECONDS = 10.0


class ProxyHop:
    """Relays Agent Lightning's proxy path to aglverl's proxy (see the module docstring).

    ``token``: aglverl's proxy token, sent upstream. ``max_body_bytes`` bounds a request body (413 beyond it).
    Serve it with ``await tg.start(hop.serve)`` (it holds the upstream connection pool).
    """

    def __init__(
        self,
        store: TaskStore,
        rollouts: AgentLightningRollouts,
        *,
        token: str | None,
        max_body_bytes: int = 32 << 20,
        served_model: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.store = store
        self.rollouts = rollouts
        self.max_body_bytes = max_body_bytes
        self.served_model = served_model
        self._auth = f"Bearer {token}" if token else None
        self._session: aiohttp.ClientSession | None = None
        #: The proxy's overload decision for a call of a rollout attempt (``LLMProxy.refusal``, when the proxy
        #: runs on this loop): a new call it turns away gets its 429 here, before its body is read.
        self.refusal: Callable[[str, str], ProxyError | None] | None = None
        #: Whether the proxy on this loop applies the hop's rules (:meth:`attach`): the runner's agents then call
        #: it directly (:meth:`direct_url`).
        self.attached = False

    def attach(self, proxy: LLMProxy) -> None:
        """The proxy runs on this loop: take its overload decision before reading a body, and give it the hop's
        rules, so that the runner's agents can call it directly."""
        self.refusal = proxy.refusal
        proxy.gateway = self.rule
        self.attached = True

    def rule(self, rollout_id: str, attempt_id: str) -> GatewayRule | None:
        """What the proxy does for a call of this aglverl attempt in the hop's place: ``None`` unless aglverl's
        runner started its agent (its slot has a key); else the key (``None`` once revoked) and the fields a JSON
        body gets (:meth:`fields`)."""
        slot = self.rollouts.runner_slot(rollout_id, attempt_id)
        if slot is None:
            return None
        key = slot.key if slot.key is not None and self.rollouts.key_owner(slot.key) == slot.agl_id else None
        llm = self._llm_of(slot.resources_id, rollout_id)
        return GatewayRule(key, self.fields(llm) if llm is not None else {})

    def direct_url(self, rollout_id: str, attempt_id: str, resources_id: str | None) -> str | None:
        """The attempt's own OpenAI base URL on the proxy, for an agent aglverl's runner starts: when the proxy
        on this loop applies the hop's rules (else ``None``: the agent goes through the hop)."""
        if not self.attached:
            return None
        llm = self._llm_of(resources_id, rollout_id)
        return llm.get_base_url(rollout_id, attempt_id) if llm is not None else None

    def _llm_of(self, resources_id: str | None, rollout_id: str) -> LLM | None:
        """The rollout's ``main_llm`` (its attempt's task's resources), ``None`` when it has none (or the store
        no longer knows the rollout: the proxy then refuses the call as its attempt's)."""
        if resources_id is None:
            try:
                resources_id = self.store.task(rollout_id).resources_id
            except StoreError:
                return None
        update = self.store.resources(resources_id)
        llm = update.resources.get("main_llm") if update is not None else None
        return llm if isinstance(llm, LLM) else None

    def fields(self, llm: LLM) -> dict[str, Any]:
        """What Agent Lightning's gateway sets on a JSON body: the served model's name and the rollout's mode's
        temperature (when its ``main_llm`` names one)."""
        fields: dict[str, Any] = {"model": self.served_model() or llm.model}
        temperature = llm.sampling_parameters.get("temperature")
        if isinstance(temperature, (int, float)) and math.isfinite(temperature):
            fields["temperature"] = temperature
        return fields

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Hold the connection pool to aglverl's proxy until cancelled; then close it."""
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0),
            # no total bound: a call may be held for a whole weight update (aglverl's proxy bounds the wait)
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=_CONNECT_SECONDS),
            auto_decompress=False,
        )
        self._session = session
        try:
            task_status.started()
            await anyio.sleep_forever()
        finally:
            self._session = None
            with anyio.CancelScope(shield=True):
                await session.close()

    # ------------------------------------------------------------------ the route
    async def handle(self, request: Request) -> Response:
        """One call on the proxy path; the route's authentication has already passed."""
        try:
            return await self._relay(request)
        except Refused as exc:
            return Response(orjson.dumps({"detail": exc.detail}), exc.status, media_type="application/json")
        except (NotFound, Conflict) as exc:
            return Response(orjson.dumps({"detail": str(exc)}), exc.status, media_type="application/json")

    async def _relay(self, request: Request) -> Response:
        params = request.path_params
        mode = params["mode"]
        if mode not in ("train", "val"):
            raise Refused(404, f"Unsupported proxy mode: {mode} (train or val)")
        path = params["path"]
        if any(segment in (".", "..") for segment in path.split("/")):
            raise Refused(
                400, f"the proxy path {path!r} has a '.' or '..' segment; send the API's path as it is"
            )
        if self._session is None:
            raise Refused(503, "the Agent Lightning proxy path is not serving")
        slot = await self.rollouts.start(params["rollout_id"])
        assert slot.attempt_id is not None
        refused = self.refusal(slot.rollout_id, slot.attempt_id) if self.refusal is not None else None
        if refused is not None:  # the proxy's overload policy, decided before the body is read
            found = APIS.match(params["path"]) if request.method == "POST" else None
            body = refused.body(Translator(*found) if found is not None else None)
            return Response(body, 429, headers=dict(refused.headers or {}), media_type="application/json")
        body = await read_body(request, self.max_body_bytes)
        llm = self._llm_of(slot.resources_id, slot.rollout_id)
        if llm is None:
            raise Refused(503, f"rollout {slot.agl_id} has no main_llm resource to relay its calls to")
        url = f"{llm.get_base_url(slot.rollout_id, slot.attempt_id)}/{quote(path, safe=_PATH_SAFE)}"
        if request.url.query:
            url += f"?{request.url.query}"
        body = rewrite_json(body, self.fields(llm), request.headers.get("content-type", ""))
        drop = APIS.not_forwarded  # the agent's credential (in any header an API takes one in) stays here
        headers = {k: v for k, v in request.headers.items() if k.lower() not in drop}
        if self._auth is not None:
            headers["Authorization"] = self._auth
        elif (
            slot.key is not None
        ):  # the proxy asks a runner's agent for its key, token or not: the hop checked it
            headers["Authorization"] = f"Bearer {slot.key}"
        upstream = await self._send(request, request.method, url, headers, body)
        if upstream is None:
            return Response(status_code=499)  # the agent left; nobody reads this
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _RESPONSE_DROP}
        return StreamingResponse(_chunks(upstream), status_code=upstream.status, headers=out_headers)

    async def _send(
        self, request: Request, method: str, url: str, headers: Mapping[str, str], body: bytes
    ) -> aiohttp.ClientResponse | None:
        """The upstream answer's head, or ``None`` when the agent disconnected first (the request is then
        cancelled, which aglverl's proxy sees as its agent leaving)."""
        assert self._session is not None
        response: aiohttp.ClientResponse | None = None
        failure: str | None = None
        async with anyio.create_task_group() as tg:

            async def watch_disconnect() -> None:
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(watch_disconnect)
            try:
                response = await self._session.request(method, url, data=body or None, headers=headers)
            except aiohttp.ClientError as exc:
                failure = f"aglverl's LLM proxy could not be reached: {exc!r}"
            tg.cancel_scope.cancel()
        if failure is not None:
            raise Refused(502, failure)
        return response


async def _chunks(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The upstream body as it arrives; the connection is closed if the agent leaves before its end."""
    finished = False
    try:
        async for chunk in response.content.iter_any():
            yield chunk
        finished = True
    finally:
        if finished:
            response.release()
        else:
            response.close()
