"""Agent Lightning v1.0's server API, served by aglverl's task server at its base URL.

Routes (Agent Lightning's paths, bodies and answers: :mod:`.wire`; errors are ``{"detail": "..."}``):

- ``POST /api/rollouts`` (a list of ``RolloutCreate``; 201; a known ``rollout_id`` is returned unchanged),
  ``GET /api/rollouts?state_in=...&limit=500``, ``GET /api/rollouts/terminal?after=&limit=`` (the append-only
  cursor: reading it deletes nothing), ``GET|PATCH|DELETE /api/rollouts/{id}`` (the state machine: any other transition is a 409);
- ``POST /api/rollouts/{id}/attempt/{attempt}/events`` (bounded in count and bytes: 413; a ``reward`` whose value is
  not finite as float32 is a 422 and fails the attempt; a ``reward`` for an ended rollout a 409),
  ``GET /api/rollouts/{id}/events?event_type=&format=triplet`` (``model_request`` events are the calls aglverl's
  proxy recorded);
- ``POST /api/models`` / ``DELETE /api/models`` (the proxy's backends), ``POST /proxy/pause``,
  ``POST /proxy/resume``, ``GET /proxy/state`` (aglverl's gate: a pause holds new calls until the resume);
- the proxy path, ``/proxy/rollout/{id}/attempt/{attempt}/mode/{mode}/openai/v1/...`` (:mod:`.hop`).

The rollouts are a view of aglverl's store (:mod:`.rollouts`, which says how aglverl's attempts and retries
map onto Agent Lightning's rollouts). Authentication: with a token, every route needs it as
``Authorization: Bearer <token>`` or ``x-api-key: <token>`` (401 otherwise), as Agent Lightning's key (its
controllers' shared ``AGL_KEY``). An agent process aglverl's runner starts gets a key of its own instead
(:meth:`~.rollouts.AgentLightningRollouts.grant_key`): it opens its rollout's event and proxy paths and reads of
that rollout, and any other route answers it 403; and once a rollout has such an agent, its event and proxy
paths and its ``PATCH`` need that key (or the token) even on a daemon without a token, so one agent cannot post
to another's rollout.

``POST /api/rollouts`` on a trainer's daemon answers 403 unless its settings accept outside work
(``accept_rollouts``): the run's agents would run any input a caller sends them.

When a trainer runs the daemon (``AsyncVERL``), the models and the gate are the trainer's: it starts the
inference replicas and holds the calls around its weight updates; ``POST /api/models``, ``DELETE /api/models``,
``/proxy/pause`` and ``/proxy/resume`` then answer 409 saying so, and ``/proxy/state`` reports the trainer's gate.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import anyio
import orjson
from anyio.abc import TaskStatus
from pydantic import TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from ..proxy.control import ProxyControl
from ..server import validation_message
from ..store import StoreError, TaskStore
from .config import AgentLightningSettings
from .hop import ProxyHop
from .http import Refused, json_response, read_body
from .rollouts import AgentLightningRollouts
from .wire import (
    EventCreate,
    Model,
    PauseRequest,
    PauseState,
    RolloutCreate,
    RolloutPatch,
)

__all__ = ["AgentLightningAPI", "DaemonPort"]

logger = logging.getLogger(__name__)

_STATES = ("queuing", "running", "succeeded", "failed")
_CREATES = TypeAdapter(list[RolloutCreate])
_MODELS = TypeAdapter(list[Model])


class DaemonPort(Protocol):
    """What the routes need of the daemon that mounts them (:class:`~aglverl.daemon.AgentDaemon` is one): its
    store, its proxy, the backends the proxy sends calls to, and its gate."""

    store: TaskStore
    proxy: ProxyControl

    def set_backends(self, backends: Sequence[str]) -> None: ...

    async def hold_calls(self) -> None: ...

    async def resume_calls(self, weight_version: int | None = None) -> None: ...


class AgentLightningAPI:
    """Agent Lightning's routes over a daemon's store, proxy and gate (see the module docstring).

    Made by :class:`~aglverl.daemon.AgentDaemon`, which mounts :meth:`routes` on its task server and serves
    :meth:`serve` in its task group. ``settings`` (:class:`~aglverl.agl10.config.AgentLightningSettings`)
    carries what an ``agentlightning:`` config section says: the config of the rollouts the run queues, the
    reward of an attempt without a reward event, and whether a trainer owns models and gate.
    """

    def __init__(
        self, daemon: DaemonPort, *, token: str | None, settings: AgentLightningSettings, max_body_bytes: int
    ) -> None:
        self.daemon = daemon
        self.settings = settings
        self.rollouts = AgentLightningRollouts(
            daemon.store,
            default_config=settings.rollout_config,
            reward_fillna_value=settings.reward_fillna_value,
            max_finished_rollouts=settings.max_finished_rollouts,
            terminal_grace_seconds=settings.terminal_grace_seconds,
            max_events_per_rollout=settings.max_events_per_rollout,
            max_event_bytes_per_rollout=settings.max_event_bytes_per_rollout,
            max_event_bytes=settings.max_event_bytes,
        )
        self.hop = ProxyHop(
            daemon.store,
            self.rollouts,
            token=token,
            max_body_bytes=max_body_bytes,
            served_model=lambda: self._served_model,
        )
        self.max_body_bytes = max_body_bytes
        #: Agent Lightning's key (``AGL_KEY``): aglverl's token.
        self.token = token
        self._key = token.encode() if token else None
        self._models: dict[tuple[str, str], Model] = {}
        self._served_model: str | None = None
        self._pause: PauseRequest | None = None

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Take in the rollouts the store holds (a journal's), then hold the hop's connections until cancelled."""
        self.rollouts.sync()
        await self.hop.serve(task_status=task_status)

    def routes(self) -> list[BaseRoute]:
        """The routes, to mount on the task server (Starlette)."""
        g = self._guard
        return [
            Route("/api/rollouts", g(self.create), methods=["POST"]),
            Route("/api/rollouts", g(self.list_rollouts), methods=["GET"]),
            Route("/api/rollouts/terminal", g(self.terminal), methods=["GET"]),
            Route("/api/rollouts/{rollout_id}", g(self.get_rollout, scoped=True), methods=["GET"]),
            Route(
                "/api/rollouts/{rollout_id}",
                g(self.patch_rollout, scoped=True, write=True),
                methods=["PATCH"],
            ),
            Route("/api/rollouts/{rollout_id}", g(self.delete_rollout), methods=["DELETE"]),
            Route(
                "/api/rollouts/{rollout_id}/attempt/{attempt_id}/events",
                g(self.post_event, scoped=True, write=True),
                methods=["POST"],
            ),
            Route("/api/rollouts/{rollout_id}/events", g(self.get_events, scoped=True), methods=["GET"]),
            Route("/api/models", g(self.register_models), methods=["POST"]),
            Route("/api/models", g(self.delete_models), methods=["DELETE"]),
            Route("/proxy/pause", g(self.pause), methods=["POST"]),
            Route("/proxy/resume", g(self.resume), methods=["POST"]),
            Route("/proxy/state", g(self.state), methods=["GET"]),
            Route(
                "/proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/{mode}/openai/v1/{path:path}",
                g(self.hop.handle, scoped=True, write=True),
                methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
            ),
        ]

    # ------------------------------------------------------------------ plumbing
    def _guard(
        self, handler: Callable[[Request], Awaitable[Response]], *, scoped: bool = False, write: bool = False
    ) -> Callable[[Request], Awaitable[Response]]:
        """Authentication (``scoped``: a route of one rollout, which its agent's key opens; ``write``: one that
        changes it) and the mapping of refusals to ``{"detail": ...}`` answers."""

        async def endpoint(request: Request) -> Response:
            refused = self._refusal(request, scoped=scoped, write=write)
            if refused is not None:
                return json_response({"detail": refused[1]}, refused[0])
            try:
                return await handler(request)
            except Refused as exc:
                return json_response({"detail": exc.detail}, exc.status)
            except StoreError as exc:
                return json_response({"detail": str(exc)}, exc.status)

        return endpoint

    def _refusal(self, request: Request, *, scoped: bool, write: bool) -> tuple[int, str] | None:
        """``None`` when the request's key opens the route, else the status and message to answer."""
        keys = _presented_keys(request)
        if self._key is not None and any(hmac.compare_digest(k.encode(), self._key) for k in keys):
            return None
        target = request.path_params.get("rollout_id")
        owner = next((o for k in keys if (o := self.rollouts.key_owner(k)) is not None), None)
        if owner is not None:
            if scoped and target == owner:
                return None
            return 403, (
                f"this key is the agent key of rollout {owner}: it opens only that rollout's event and proxy "
                "paths and reads of it"
            )
        if self._key is not None:
            return 401, "Invalid or missing API key"
        if scoped and write and target is not None and self.rollouts.needs_key(target):
            return 401, (
                f"rollout {target} is run by aglverl's runner: its event and proxy paths need its agent's key "
                "(AGL_KEY)"
            )
        return None

    async def _body(self, request: Request) -> Any:
        body = await read_body(request, self.max_body_bytes)
        try:
            return orjson.loads(body) if body else None
        except orjson.JSONDecodeError as exc:
            raise Refused(400, f"request body is not valid JSON: {exc}") from None

    @staticmethod
    def _parse(adapter: Any, data: Any, what: str) -> Any:
        try:
            return (
                adapter.validate_python(data)
                if isinstance(adapter, TypeAdapter)
                else adapter.model_validate(data)
            )
        except ValidationError as exc:
            raise Refused(422, f"invalid {what}: {validation_message(exc)}") from None

    @staticmethod
    def _int_query(request: Request, name: str, default: int) -> int:
        raw = request.query_params.get(name)
        if raw is None:
            return default
        try:
            return int(raw)
        except ValueError:
            raise Refused(422, f"query parameter {name!r} must be an integer, got {raw!r}") from None

    def _trainer_owns(self, what: str) -> None:
        if self.settings.trainer_owns_gate:
            raise Refused(
                409,
                f"{what} belongs to the trainer of this run (it starts the inference replicas and "
                "holds the calls around its weight updates); nothing was changed",
            )

    # ------------------------------------------------------------------ rollouts
    async def create(self, request: Request) -> Response:
        if not self.settings.accept_rollouts:
            raise Refused(
                403,
                "this daemon's rollouts are its trainer's: it does not take rollouts over HTTP (the run's agents "
                "would run whatever input a caller sends; set aglverl.accept_outside_rollouts: true to allow it)",
            )
        requests = self._parse(_CREATES, await self._body(request), "rollouts")
        created = self.rollouts.create(requests)
        await self.daemon.store.commit()  # durable (by the journal's policy) before the caller hears of them
        return json_response(created, 201)

    async def list_rollouts(self, request: Request) -> Response:
        states = request.query_params.getlist("state_in")
        if not states:
            raise Refused(
                422, f"query parameter 'state_in' is required (one or more of {', '.join(_STATES)})"
            )
        wrong = [s for s in states if s not in _STATES]
        if wrong:
            raise Refused(422, f"query parameter 'state_in': {wrong[0]!r} is not one of {', '.join(_STATES)}")
        limit = self._int_query(request, "limit", 500)
        return json_response(self.rollouts.listed(set(states), limit))

    async def terminal(self, request: Request) -> Response:
        page = self.rollouts.terminal_page(
            self._int_query(request, "after", 0), self._int_query(request, "limit", 1000)
        )
        return json_response(page)

    async def get_rollout(self, request: Request) -> Response:
        return json_response(self.rollouts.detail(request.path_params["rollout_id"]))

    async def patch_rollout(self, request: Request) -> Response:
        patch = self._parse(RolloutPatch, await self._body(request), "patch")
        rollout_id = request.path_params["rollout_id"]
        if patch.status is None:
            return json_response(self.rollouts.wire(self.rollouts.slot(rollout_id)))
        return json_response(await self.rollouts.patch(rollout_id, patch.status))

    async def delete_rollout(self, request: Request) -> Response:
        self.rollouts.delete(request.path_params["rollout_id"])
        return Response(status_code=204)

    async def post_event(self, request: Request) -> Response:
        event = self._parse(EventCreate, await self._body(request), "event")
        params = request.path_params
        return json_response(
            self.rollouts.add_event(params["rollout_id"], params["attempt_id"], event.event_type, event.data)
        )

    async def get_events(self, request: Request) -> Response:
        query = request.query_params
        events = self.rollouts.events(
            request.path_params["rollout_id"],
            event_type=query.get("event_type"),
            triplet=query.get("format") == "triplet",
        )
        if query.get("include_routed_experts", "true").lower() == "false":  # aglverl records no expert routes
            events = [e for e in events if "routed_experts" not in e.data]
        return json_response(events)

    # ------------------------------------------------------------------ models and gate
    async def register_models(self, request: Request) -> Response:
        self._trainer_owns("the model servers")
        models: list[Model] = self._parse(_MODELS, await self._body(request), "models")
        backends = [m.endpoint.rstrip("/").removesuffix("/v1") for m in models]
        try:
            self.daemon.set_backends(
                [m.endpoint.rstrip("/").removesuffix("/v1") for m in self._models.values()] + backends
            )
        except ValueError as exc:
            raise Refused(422, f"invalid model endpoint: {exc}") from None
        for model in models:
            self._models[(model.model, model.endpoint)] = model
        self._served_model = models[-1].model if models else self._served_model
        if self._models:
            self.daemon.proxy.weight_version = max(m.version for m in self._models.values())
        return json_response(models, 201)

    async def delete_models(self, request: Request) -> Response:
        self._trainer_owns("the model servers")
        self._models.clear()
        self._served_model = None
        self.daemon.set_backends([])
        return json_response({"status": "ok"})

    async def pause(self, request: Request) -> Response:
        self._trainer_owns("the proxy's gate")
        body = await self._body(request)
        pause = self._parse(PauseRequest, body if body is not None else {}, "pause request")
        await self.daemon.hold_calls()
        self._pause = pause
        return json_response(self._state())

    async def resume(self, request: Request) -> Response:
        self._trainer_owns("the proxy's gate")
        if self._pause is not None:
            await self.daemon.resume_calls(self.daemon.proxy.weight_version)
            self._pause = None
        return json_response(self._state())

    async def state(self, request: Request) -> Response:
        return json_response(self._state())

    def _state(self) -> PauseState:
        proxy = self.daemon.proxy
        gate_closed = bool(getattr(proxy, "paused", False) or getattr(proxy, "held", False))
        if self._pause is not None:
            reason, retry = self._pause.reason, self._pause.retry_after_seconds
        else:
            reason, retry = ("the trainer is updating the weights" if gate_closed else None), 5
        return PauseState(
            paused=self._pause is not None or gate_closed,
            retry_after_seconds=retry,
            reason=reason,
            inflight=int(getattr(proxy, "in_flight", 0)),
        )


def _presented_keys(request: Request) -> list[str]:
    """The keys a request carries: ``Authorization: Bearer <key>`` and ``x-api-key``."""
    keys = []
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and given.strip():
        keys.append(given.strip())
    if request.headers.get("x-api-key"):
        keys.append(request.headers["x-api-key"])
    return keys
