"""The task server: Agent Lightning 0.1 routes over the :class:`~aglverl.store.tasks.TaskStore`, on uvicorn.

Routes (JSON via orjson; errors are ``{"detail": "..."}`` like the FastAPI server old clients talk to):

- ``GET /task[?wait=SECONDS]`` -> ``TaskIfAny``; with ``wait`` the request long-polls and returns the moment a
  task is queued. A task handed to an agent that has already disconnected goes back to the queue at once.
- ``GET /resources/latest``, ``GET /resources/{resources_id}`` -> ``ResourcesUpdate`` (404 when none).
- ``POST /rollout`` with a ``Rollout`` body -> ``{"status": "ok", "message": ...}``.
- ``POST /rollout/{rollout_id}/heartbeat`` (body ``{"attempt_id": ...}`` optional) extends the claim's lease.
- ``POST /tasks`` with ``{"inputs": [<task input>, ...], "mode": "train"|"val"|"test"|null, "metadata": {}}``
  queues one task per input (with the latest resources) -> ``{"status": "ok", "rollout_ids": [...]}``, in the
  inputs' order. Only on a server made with ``accept_tasks=True`` (``aglverl serve``; a trainer's daemon queues
  its own tasks and answers 403); :attr:`TaskServer.on_tasks_queued` hears of every batch queued.
- ``GET /healthz`` (never needs the token, reveals nothing) and ``GET /metrics`` (Prometheus text).

Every answer carries ``X-Aglverl-Instance``, an id drawn when the server is made: a daemon restarted on the same
address (its journal recovered) answers with a new one, which tells agents that resources they cached may have
been rebound to the new daemon's proxy (:class:`~aglverl.client.AgentClient` drops its cache then).

Bad input gets a 4xx whose message names what was wrong (400 malformed JSON or query, 401 token, 404 unknown
id, 409 step already ended, 413 body too large, 422 invalid field); a rejected request changes nothing.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import orjson
import uvicorn
from anyio.abc import TaskStatus
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ._net import bind_listener, url_of
from .models import INSTANCE_HEADER, GenericResponse, Mode, Rollout, TaskIfAny, dumps
from .store import StoreError, TaskStore

__all__ = ["MAX_TASKS_PER_POST", "TaskBatch", "TaskServer", "validation_message"]

logger = logging.getLogger(__name__)

#: Longest long-poll a client may ask for; longer asks are clamped, not refused.
MAX_WAIT_SECONDS = 300.0
#: Idle keep-alive kept longer than common clients' own (aiohttp 15 s, httpx 5 s), so a client never reuses
#: a connection the server has just closed.
KEEP_ALIVE_SECONDS = 120
#: How long shutdown waits for in-flight requests (e.g. a rollout post) before closing their connections.
SHUTDOWN_GRACE_SECONDS = 5.0
#: Most task inputs one ``POST /tasks`` may queue (the body limit bounds their size).
MAX_TASKS_PER_POST = 100_000


class TaskBatch(BaseModel):
    """The body of ``POST /tasks``: task inputs (any JSON value each, as ``Task.input``), queued in order with
    the same ``mode`` and ``metadata``."""

    model_config = ConfigDict(extra="forbid")

    inputs: list[Any] = Field(min_length=1, max_length=MAX_TASKS_PER_POST)
    mode: Mode | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


def validation_message(exc: ValidationError) -> str:
    """One line per offending field: ``field 'triplets.0.prompt.token_ids.3': Input should be ...``."""
    parts = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"field '{loc}': {err['msg']}")
    return "; ".join(parts)


def _json(data: Any, status: int = 200) -> Response:
    body = dumps(data) if isinstance(data, BaseModel) else orjson.dumps(data)
    return Response(body, status_code=status, media_type="application/json")


def _error(status: int, detail: str) -> Response:
    return _json({"detail": detail}, status)


class _HttpError(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


class _InFlight:
    """ASGI wrapper counting HTTP requests in flight, so shutdown can wait for them on an event."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.count = 0
        self.idle: anyio.Event | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.count -= 1
            if self.count == 0 and self.idle is not None:
                self.idle.set()

    async def wait_idle(self) -> None:
        if self.count:
            self.idle = anyio.Event()
            await self.idle.wait()


class _OneWritePerTurn:
    """Transport wrapper: bytes written during one event-loop turn leave in one ``send``.

    uvicorn writes a response's status line and headers, then its body, with two ``transport.write`` calls:
    two syscalls and two packets for every small JSON answer. Joining the writes of a turn halves both (the
    agent's loop is also woken once instead of twice), and adds no delay: the flush runs in the next turn.
    Everything else is the wrapped transport's.
    """

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(data)

    def _flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _HttpProtocol(HttpToolsProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_OneWritePerTurn(transport))  # type: ignore[arg-type]


class TaskServer:
    """Serves the store to agents over HTTP; start it with ``await tg.start(server.serve)``.

    ``token``: when set, every route but ``/healthz`` requires ``Authorization: Bearer <token>``.
    ``max_body_bytes`` bounds a posted rollout or task batch (413 beyond it). ``accept_tasks``: whether
    ``POST /tasks`` queues tasks (a daemon without a trainer: ``aglverl serve``) or answers 403.
    """

    def __init__(
        self,
        store: TaskStore,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        max_body_bytes: int = 64 << 20,
        accept_tasks: bool = False,
    ) -> None:
        self.store = store
        self.accept_tasks = accept_tasks
        #: Called with ``(rollout_ids, inputs)`` after each ``POST /tasks`` queued its tasks (on the loop).
        self.on_tasks_queued: list[Callable[[list[str], list[Any]], None]] = []
        self.host = host
        self.port = port
        self.max_body_bytes = max_body_bytes
        self._token = token.encode() if token else None
        self._url: str | None = None
        self.instance_id = uuid.uuid4().hex
        r = store.registry
        self._requests = r.counter(
            "aglverl_http_requests_total", "Task server requests.", ["route", "status"]
        )
        self._post_latency = r.histogram("aglverl_rollout_post_seconds", "Time to accept a POST /rollout.")
        routes = [
            Route("/task", self._guard("task", self.get_task), methods=["GET"]),
            Route("/resources/latest", self._guard("resources", self.get_latest_resources), methods=["GET"]),
            Route("/resources/{resources_id}", self._guard("resources", self.get_resources), methods=["GET"]),
            Route("/rollout", self._guard("rollout", self.post_rollout), methods=["POST"]),
            Route(
                "/rollout/{rollout_id}/heartbeat",
                self._guard("heartbeat", self.post_heartbeat),
                methods=["POST"],
            ),
            Route("/tasks", self._guard("tasks", self.post_tasks), methods=["POST"]),
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/metrics", self._guard("metrics", self.metrics), methods=["GET"]),
        ]
        self._starlette = Starlette(routes=routes)
        self._inflight = _InFlight(self._starlette)
        self.app: ASGIApp = self._inflight
        #: More Prometheus text for ``/metrics``, fetched on each scrape (the proxy shards' registries).
        self.metrics_sources: list[Callable[[], Awaitable[str]]] = []

    def add_routes(self, routes: Sequence[BaseRoute]) -> None:
        """Serve more routes beside the task routes (another API on the same address, e.g.
        :mod:`aglverl.agl10`'s); they do their own authentication. Call before :meth:`serve`."""
        self._starlette.router.routes.extend(routes)

    @property
    def url(self) -> str:
        """``http://host:port`` once serving."""
        if self._url is None:
            raise RuntimeError("the task server is not serving yet")
        return self._url

    # ------------------------------------------------------------------ serving
    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen and serve until cancelled; ``task_status.started()`` once connections are accepted.

        Shutdown (on cancellation, shielded): stop accepting, close idle connections, wake parked long-polls,
        let in-flight requests finish for up to ``SHUTDOWN_GRACE_SECONDS``, then close what is left.
        """
        sock = bind_listener(self.host, self.port)
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            http="httptools",
            ws="none",
            log_level="warning",
            access_log=False,
            timeout_keep_alive=KEEP_ALIVE_SECONDS,
            date_header=False,
            server_header=False,
            headers=[(INSTANCE_HEADER, self.instance_id)],
        )
        config.load()
        config.http_protocol_class = _HttpProtocol
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)  # "off": no ASGI lifespan, nothing to wait for
        try:
            await server.startup(sockets=[sock])
            await server.on_tick(
                0
            )  # computes the default headers once; we never run uvicorn's 0.1 s tick loop
            self._url = url_of(sock)
            logger.info("task server listening on %s", self._url)
            task_status.started()
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                await self._shutdown(server)
                sock.close()

    async def _shutdown(self, server: uvicorn.Server) -> None:
        for listener in getattr(server, "servers", []):
            listener.close()
        for conn in list(server.server_state.connections):
            conn.shutdown()  # idle connections close now, busy ones after their response
        self.store.close()  # parked long-polls answer "no task"
        with anyio.move_on_after(SHUTDOWN_GRACE_SECONDS):
            await self._inflight.wait_idle()
        for conn in list(server.server_state.connections):
            transport = getattr(conn, "transport", None)
            if transport is not None:
                transport.close()
        for task in list(server.server_state.tasks):
            task.cancel()
        for listener in getattr(server, "servers", []):
            await listener.wait_closed()

    # ------------------------------------------------------------------ plumbing
    def _guard(
        self, route: str, handler: Callable[[Request], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        """Token check, uniform error mapping and a per-route request counter around a handler."""

        async def endpoint(request: Request) -> Response:
            try:
                self._check_token(request)
                response = await handler(request)
            except _HttpError as exc:
                response = _error(exc.status, exc.detail)
            except StoreError as exc:
                response = _error(exc.status, str(exc))
            self._requests.inc(1, route, str(response.status_code))
            return response

        return endpoint

    def _check_token(self, request: Request) -> None:
        if self._token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._token):
            raise _HttpError(401, "missing or wrong bearer token (send 'Authorization: Bearer <token>')")

    async def _read_json(self, request: Request) -> Any:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise _HttpError(
                413, f"request body of {length} bytes exceeds the limit of {self.max_body_bytes}"
            )
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _HttpError(413, f"request body exceeds the limit of {self.max_body_bytes} bytes")
            chunks.append(chunk)
        body = b"".join(chunks)
        if not body:
            raise _HttpError(400, "request body is empty; expected a JSON object")
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise _HttpError(400, f"request body is not valid JSON: {exc}") from None

    # ------------------------------------------------------------------ routes
    async def get_task(self, request: Request) -> Response:
        raw = request.query_params.get("wait", "0")
        try:
            wait = float(raw)
        except ValueError:
            raise _HttpError(
                400, f"query parameter 'wait' must be a number of seconds, got {raw!r}"
            ) from None
        if not math.isfinite(wait) or wait < 0:
            raise _HttpError(400, f"query parameter 'wait' must be a finite number >= 0, got {raw!r}")
        wait = min(wait, MAX_WAIT_SECONDS)
        task = await self.store.claim()  # with proxy shards: once the attempt's shard admits it
        if task is None and wait > 0:
            task = await self._long_poll(request, wait)
        return _json(TaskIfAny(is_available=task is not None, task=task))

    async def _long_poll(self, request: Request, wait: float) -> Any:
        """Wait for a task while watching for the agent's disconnect; a vanished agent's claim is released."""
        gone = False
        task = None
        try:
            async with anyio.create_task_group() as tg:

                async def watch_disconnect() -> None:
                    nonlocal gone
                    while (await request.receive())["type"] != "http.disconnect":
                        pass
                    gone = True
                    tg.cancel_scope.cancel()

                tg.start_soon(watch_disconnect)
                task = await self.store.claim(wait)
                tg.cancel_scope.cancel()
        except BaseException:
            gone = True  # cancelled from outside (shutdown): the answer will never be sent
            raise
        finally:
            if gone and task is not None:
                self.store.release(task.rollout_id, task.attempt_id or "")
        return None if gone else task

    async def get_latest_resources(self, request: Request) -> Response:
        update = self.store.resources()
        if update is None:
            raise _HttpError(404, "no resources have been published yet")
        return _json(update)

    async def get_resources(self, request: Request) -> Response:
        resources_id = request.path_params["resources_id"]
        update = self.store.resources(resources_id)
        if update is None:
            raise _HttpError(404, f"unknown resources id {resources_id!r}")
        return _json(update)

    async def post_rollout(self, request: Request) -> Response:
        started = anyio.current_time()
        data = await self._read_json(request)
        try:
            rollout = Rollout.model_validate(data)
        except ValidationError as exc:
            raise _HttpError(422, f"invalid rollout: {validation_message(exc)}") from None
        # with proxy shards, the attempt's recorded calls are taken from its shard first
        message = await self.store.accept_result(rollout)
        await self.store.commit()  # durable (by the journal's policy) before the agent hears "ok"
        self._post_latency.observe(anyio.current_time() - started)
        return _json(GenericResponse(status="ok", message=message))

    async def post_heartbeat(self, request: Request) -> Response:
        rollout_id = request.path_params["rollout_id"]
        attempt_id = None
        if request.headers.get("content-length", "0") != "0":
            data = await self._read_json(request)
            if not isinstance(data, dict) or not isinstance(data.get("attempt_id", ""), str):
                raise _HttpError(422, "heartbeat body must be a JSON object with a string field 'attempt_id'")
            attempt_id = data.get("attempt_id")
        lease = self.store.heartbeat(rollout_id, attempt_id)
        return _json({"status": "ok", "message": f"lease of {rollout_id} extended", "lease_seconds": lease})

    async def post_tasks(self, request: Request) -> Response:
        if not self.accept_tasks:
            raise _HttpError(
                403,
                "this task server does not take tasks over HTTP: its trainer queues them (`aglverl serve` does)",
            )
        data = await self._read_json(request)
        try:
            batch = TaskBatch.model_validate(data)
        except ValidationError as exc:
            raise _HttpError(422, f"invalid tasks: {validation_message(exc)}") from None
        resources_id = self.store.latest_resources_id
        ids = [
            self.store.enqueue(value, mode=batch.mode, resources_id=resources_id, metadata=batch.metadata)
            for value in batch.inputs
        ]
        await self.store.commit()  # durable (by the journal's policy) before the caller hears "ok"
        for callback in self.on_tasks_queued:
            callback(ids, batch.inputs)
        return _json({"status": "ok", "rollout_ids": ids})

    async def healthz(self, request: Request) -> Response:
        return _json({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        text = self.store.registry.render()
        for source in self.metrics_sources:
            text += await source()
        return Response(text, media_type="text/plain; version=0.0.4")
