"""Agent side: a small async client for the task server, and :func:`run_agents` for the common case.

::

    async def solve(task_input, llm: LLM) -> float:
        client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key="-")
        ...
        return reward

    await run_agents(daemon.server_url, solve, concurrency=32)

:func:`run_agents` long-polls for tasks, resolves the task's ``main_llm`` into a plain :class:`LLM` whose
``endpoint`` is the per-rollout proxy URL (user code never formats URLs), awaits ``fn(task_input, llm)`` and
posts its result. An exception in ``fn`` is posted as a failed rollout with the error in its metadata (the
task is retried while attempts remain), never silently dropped.
"""

from __future__ import annotations

import functools
import inspect
import logging
import random
import re
import traceback
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

import aiohttp
import anyio
import orjson
from pydantic import ValidationError

from .models import (
    INSTANCE_HEADER,
    LLM,
    ProxyLLM,
    ResourcesUpdate,
    Rollout,
    Task,
    TaskIfAny,
    check_reward,
    dumps,
)

__all__ = ["AgentClient", "AgentFn", "AgentResultError", "TaskServerError", "check_agent", "run_agents"]

logger = logging.getLogger(__name__)

#: What an agent function may return, said once (:func:`run_agents`, :class:`~aglverl.algorithm.AsyncVERL`):
#: a reward, that is a real number given as anything ``float()`` takes through ``__float__`` (``float``,
#: ``int``, ``bool`` as 1.0 / 0.0, numpy and torch scalars, ``Fraction``, ``Decimal``) whose value is finite as
#: float32 (:func:`~aglverl.models.check_reward`: 1e39 is not);
#: or a :class:`~aglverl.models.Rollout`, posted as it is with the task's ids. Anything else (``None``, a
#: string, NaN) fails the rollout with :class:`AgentResultError` saying what came back.
AgentResult = float | int | bool | Rollout | None
AgentFn = Callable[[Any, LLM], Awaitable[AgentResult]]

#: Long-poll length per GET /task; the server answers the moment a task is queued.
LONG_POLL_SECONDS = 30.0
#: Backoff (seconds) while the task server cannot be reached: first wait, and the cap it doubles up to.
RECONNECT_INITIAL = 0.05
RECONNECT_MAX = 1.0


class TaskServerError(Exception):
    """The task server answered with an error status; ``status`` and the server's ``detail`` are kept."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"task server answered {status}: {detail}")
        self.status = status
        self.detail = detail


class AgentClient:
    """Async client for the task server routes (``GET /task``, resources, ``POST /rollout``, heartbeats)."""

    def __init__(self, server_url: str, *, token: str | None = None, connections: int = 100) -> None:
        self.server_url = server_url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._session = aiohttp.ClientSession(
            headers=headers,
            connector=aiohttp.TCPConnector(limit=connections, keepalive_timeout=15),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        )
        self._resources: dict[str, ResourcesUpdate] = {}
        self._server_instance: str | None = None

    async def __aenter__(self) -> AgentClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._session.close()

    async def _request(self, method: str, path: str, body: bytes | None = None) -> Any:
        headers = {"Content-Type": "application/json"} if body is not None else None
        async with self._session.request(method, self.server_url + path, data=body, headers=headers) as resp:
            payload = await resp.read()
            instance = resp.headers.get(INSTANCE_HEADER)
            if instance is not None and instance != self._server_instance:
                # A restarted daemon rebinds recovered resources (same ids) to its new proxy: forget them all.
                self._resources.clear()
                self._server_instance = instance
            if resp.status >= 400:
                try:
                    detail = str(orjson.loads(payload).get("detail", payload[:500]))
                except (orjson.JSONDecodeError, AttributeError):
                    detail = payload[:500].decode(errors="replace")
                raise TaskServerError(resp.status, detail)
            return orjson.loads(payload)

    async def next_task(self, wait: float = LONG_POLL_SECONDS) -> Task | None:
        """The next task, long-polling up to ``wait`` seconds; ``None`` if none was queued meanwhile."""
        data = await self._request("GET", f"/task?wait={wait:g}")
        return TaskIfAny.model_validate(data).task

    async def resources(self, resources_id: str | None = None) -> ResourcesUpdate | None:
        """A resources version, or the latest; ``None`` if there is none.

        Versions are cached for as long as the task server is the same instance: a daemon restarted on the
        same address (``X-Aglverl-Instance`` changed) may have pointed a version's LLM at its new proxy.
        """
        if resources_id is not None and resources_id in self._resources:
            return self._resources[resources_id]
        try:
            data = await self._request("GET", f"/resources/{resources_id or 'latest'}")
        except TaskServerError as exc:
            if exc.status == 404:
                return None
            raise
        update = ResourcesUpdate.model_validate(data)
        self._resources[update.resources_id] = update
        return update

    async def post_rollout(self, rollout: Rollout) -> str:
        """Report a result; returns the server's message."""
        data = await self._request("POST", "/rollout", dumps(rollout))
        return str(data.get("message", ""))

    async def heartbeat(self, rollout_id: str, attempt_id: str | None = None) -> float:
        """Extend the claim's lease; returns the seconds until it expires."""
        body = orjson.dumps({"attempt_id": attempt_id}) if attempt_id else None
        data = await self._request("POST", f"/rollout/{rollout_id}/heartbeat", body)
        return float(data["lease_seconds"])

    async def llm_for(self, task: Task, name: str = "main_llm") -> LLM:
        """The task's LLM resource as a plain :class:`LLM` whose endpoint is this rollout attempt's URL."""
        update = await self.resources(task.resources_id)
        if update is None or name not in update.resources:
            raise LookupError(f"resources {task.resources_id!r} have no {name!r}")
        llm = update.resources[name]
        if isinstance(llm, ProxyLLM):
            if task.attempt_id is None:
                raise LookupError(f"task {task.rollout_id} carries no attempt id to build the proxy URL from")
            return llm.resolve(task.rollout_id, task.attempt_id)
        if not isinstance(llm, LLM):
            raise LookupError(f"resource {name!r} is a {llm.resource_type}, not an LLM")
        return llm


class AgentResultError(TypeError):
    """The agent function returned something that is not a result: ``None``, a string, a NaN..."""


def check_agent(fn: Any, *, name: str = "agent") -> None:
    """Raise ``TypeError`` unless ``fn`` can be an agent: callable with ``(task_input, llm)`` and asynchronous,
    i.e. ``async def fn(task_input, llm)``, an object whose ``__call__`` is one, a ``functools.partial`` of one,
    or a decorator's wrapper around one that shows it (``functools.wraps`` sets ``__wrapped__``).

    A function with no ``async def`` anywhere behind it is refused rather than run in a worker thread: agents
    are awaited concurrently on the event loop (one per rollout in flight), and a blocking function would
    either stall the loop (the task server and the LLM proxy run there) or take a thread each, silently capping
    the concurrency at the thread pool's size. What is awaited is decided by what calling ``fn`` returns
    (:func:`run_agents`), so a wrapper that returns the coroutine of the agent it wraps works either way.
    """
    if not callable(fn):
        raise TypeError(f"{name} must be an async function `async def {name}(task_input, llm)`, got {fn!r}")
    label = getattr(fn, "__name__", None) or type(fn).__name__
    chain = _call_chain(fn)
    if any(inspect.isasyncgenfunction(target) for target in chain):
        raise TypeError(
            f"{name} {label!r} is an async generator (it yields); it must return its reward: "
            f"`async def {label}(task_input, llm): ... return reward`"
        )
    if not any(inspect.iscoroutinefunction(target) for target in chain):
        raise TypeError(
            f"{name} {label!r} is a plain function, and no `async def` is behind it; agents are awaited for "
            f"every rollout: make it `async def {label}(task_input, llm)` (run blocking code in it with "
            f"`await anyio.to_thread.run_sync(...)`); a decorator's wrapper around an async agent shows the "
            f"agent with `@functools.wraps(agent)`"
        )
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise TypeError(
            f"{name} {label!r} must take two positional arguments (task_input, llm); its signature is "
            f"{label}{inspect.signature(fn)}"
        ) from None
    except ValueError:  # no signature to read (a builtin): it will say so itself when called
        return


def _call_chain(fn: Any) -> list[Any]:
    """What calling ``fn`` runs, outermost first: ``fn`` (or its class's ``__call__``), the function of a
    ``functools.partial``, and each function a decorator's wrapper names in ``__wrapped__``."""
    chain: list[Any] = []
    target = fn
    while len(chain) < 100:  # a __wrapped__ cycle ends here
        if isinstance(target, functools.partial):
            target = target.func
            continue
        if not (inspect.isfunction(target) or inspect.ismethod(target)):
            target = type(target).__call__
        chain.append(target)
        wrapped = getattr(target, "__wrapped__", None)
        if wrapped is None:
            break
        target = wrapped
    return chain


async def _call_agent(fn: AgentFn, task_input: Any, llm: LLM) -> AgentResult:
    """``fn(task_input, llm)``, awaited when calling it returned an awaitable (what :func:`check_agent` let
    through may still be a wrapper that does not return its agent's coroutine: named then)."""
    returned = fn(task_input, llm)
    if inspect.isawaitable(returned):
        return await returned
    label = getattr(fn, "__name__", None) or type(fn).__name__
    raise AgentResultError(
        f"calling the agent {label!r} returned {returned!r} ({type(returned).__name__}), not an awaitable: "
        "it ran as a plain function; a decorator's wrapper around an async agent must return the agent's "
        "coroutine (or be `async def` and await it)"
    )


def _to_rollout(task: Task, result: AgentResult) -> Rollout:
    """The agent's return value as the rollout to post (see :data:`AgentResult`): a :class:`Rollout` is posted as
    is (ids filled in), a reward becomes the rollout's final reward; anything else raises
    :class:`AgentResultError` (the rollout then fails with that reason, as if the agent had raised it)."""
    if isinstance(result, Rollout):
        if result.final_reward is not None:  # set after construction, it was never validated
            _checked(result.final_reward)
        # the agent function is never told its rollout's ids: they are the task's, whatever it put there
        return result.model_copy(update={"rollout_id": task.rollout_id, "attempt_id": task.attempt_id})
    if result is None:
        raise AgentResultError("the agent returned None: return a float reward or a Rollout")
    try:
        reward = float(result) if hasattr(result, "__float__") else None
    except (TypeError, ValueError):  # a __float__ that refuses (e.g. a numpy array of several values)
        reward = None
    if reward is None:
        raise AgentResultError(
            f"the agent returned {result!r} ({type(result).__name__}): return a float reward or a Rollout"
        )
    return Rollout(rollout_id=task.rollout_id, attempt_id=task.attempt_id, final_reward=_checked(reward))


def _checked(reward: float) -> float:
    try:
        return check_reward(reward, "the agent returned the reward")
    except ValueError as exc:
        raise AgentResultError(str(exc)) from None


def _failure(task: Task, exc: BaseException) -> Rollout:
    error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return Rollout(
        rollout_id=task.rollout_id,
        attempt_id=task.attempt_id,
        status="failed",
        metadata={"error": error, "traceback": traceback.format_exc(limit=20)},
    )


class _Reachability:
    """Whether the task server answers, shared by every agent loop: one line when it stops answering, one when
    it is back (not a line per retry of every loop), and the moment to give up."""

    def __init__(self, url: str, give_up_after: float | None) -> None:
        self.url = url
        self.give_up_after = give_up_after
        self.down_since: float | None = None

    def failed(self, problem: str) -> bool:
        """Note a failed call; ``True`` when the server has been unreachable longer than ``give_up_after``."""
        now = anyio.current_time()
        if self.down_since is None:
            self.down_since = now
            logger.warning(
                "task server %s unreachable (%s); agents retry with backoff%s",
                self.url,
                problem,
                f" for up to {self.give_up_after:g} s" if self.give_up_after is not None else "",
            )
            return False
        return self.give_up_after is not None and now - self.down_since > self.give_up_after

    def answered(self) -> None:
        if self.down_since is not None:
            logger.warning(
                "task server %s reachable again after %.1f s",
                self.url,
                anyio.current_time() - self.down_since,
            )
            self.down_since = None


class _FailureLog:
    """Agents' failures, logged once per distinct error (the first rollout it failed), counted after that."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def failed(self, rollout_id: str, exc: BaseException) -> None:
        error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        kind = re.sub(r"\d+(?:\.\d+)?", "N", error)  # one error whatever its numbers (ids, delays, sizes)
        seen = self.counts.get(kind, 0)
        self.counts[kind] = seen + 1
        if seen:
            logger.debug("agent failed on %s: %s", rollout_id, error)
        else:
            logger.warning(
                "agent failed on %s: %s (its rollout fails; this error is logged once, then only counted)",
                rollout_id,
                error,
            )


async def run_agents(
    server_url: str,
    fn: AgentFn,
    *,
    concurrency: int = 1,
    token: str | None = None,
    max_tasks: int | None = None,
    llm_name: str = "main_llm",
    heartbeat_seconds: float | None = None,
    give_up_after: float | None = None,
) -> int:
    """Run ``concurrency`` agent loops against the task server until cancelled (or ``max_tasks`` are done).

    ``fn`` must be ``async def fn(task_input, llm)`` (checked at once: :func:`check_agent` raises
    ``TypeError``). Each loop long-polls a task, resolves its LLM, calls ``fn(task.input, llm)``, awaits what
    that returns and posts the result (:data:`AgentResult`): a reward (a finite number: ``float``, ``int``,
    ``bool``, a numpy scalar...) is the final reward, a :class:`Rollout` is posted as is (ids filled in). If
    ``fn`` raises, returns something that is not awaitable, or its awaitable gives anything else (``None``:
    "the agent returned None: return a float reward or a Rollout"), a failed rollout carrying that error is
    posted instead (the task is retried while attempts remain); each
    distinct error is logged once. With ``heartbeat_seconds``, the claim's lease is extended that often while
    ``fn`` runs (for rollouts longer than the daemon's lease).

    While the task server is unreachable (a restart, or not started yet) the loops retry with capped backoff,
    logging one line when it stops answering and one when it is back; with ``give_up_after`` seconds of that,
    ``run_agents`` returns (one line says so). Returns how many tasks were done.
    Cancellation stops the loops; a task in progress is then left to its lease (or to the server noticing
    the dropped long-poll).
    """
    check_agent(fn)
    done = 0
    polling: set[anyio.CancelScope] = set()
    stopping = False
    rng = random.Random()
    reachability = _Reachability(server_url, give_up_after)
    stop = anyio.CancelScope()
    failures = _FailureLog()

    async def reach(call: Callable[[], Awaitable[Any]]) -> Any:
        """``call()``, retried with capped, jittered backoff while the task server is unreachable or 5xx.

        Agents outlive a daemon restart (the journal lets it resume its step): they wait and try again.
        """
        delay = RECONNECT_INITIAL
        while True:
            try:
                result = await call()
            except (aiohttp.ClientError, OSError) as exc:
                gone = reachability.failed(repr(exc))
            except TaskServerError as exc:
                if exc.status < 500:
                    raise
                gone = reachability.failed(str(exc))
            else:
                reachability.answered()
                return result
            if gone:
                stop.cancel()  # every loop: the task server is gone for good
            await anyio.sleep(delay * (0.5 + rng.random()))
            delay = min(delay * 2, RECONNECT_MAX)

    async def worker(client: AgentClient) -> None:
        nonlocal done, stopping
        while not stopping:
            task = None
            with anyio.CancelScope() as scope:
                polling.add(scope)
                task = await reach(client.next_task)
            polling.discard(scope)
            if task is None:
                continue
            try:
                rollout = await attempt(client, task)
            except (Exception, ValidationError) as exc:  # the agent's failure is data, not a crash
                failures.failed(task.rollout_id, exc)
                rollout = _failure(task, exc)
            try:
                await reach(functools.partial(client.post_rollout, rollout))
            except TaskServerError as exc:  # e.g. another attempt finished first; the loop goes on
                logger.warning("result for %s not taken: %s", task.rollout_id, exc.detail)
            done += 1
            if max_tasks is not None and done >= max_tasks:
                stopping = True  # tasks in progress are finished; parked long-polls are dropped
                for parked in list(polling):
                    parked.cancel()

    async def attempt(client: AgentClient, task: Task) -> Rollout:
        llm = await client.llm_for(task, llm_name)
        if not heartbeat_seconds:
            return _to_rollout(task, await _call_agent(fn, task.input, llm))
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(keep_alive, client, task)
                result = await _call_agent(fn, task.input, llm)
                tg.cancel_scope.cancel()
        except Exception as exc:  # report the agent's own error, not the task group wrapping it
            while len(getattr(exc, "exceptions", ())) == 1:
                exc = exc.exceptions[0]  # type: ignore[attr-defined]
            raise exc from None
        return _to_rollout(task, result)

    async def keep_alive(client: AgentClient, task: Task) -> None:
        assert heartbeat_seconds
        while True:
            await anyio.sleep(heartbeat_seconds)
            try:
                await client.heartbeat(task.rollout_id, task.attempt_id)
            except TaskServerError as exc:  # the attempt no longer holds the task: stop extending it
                logger.warning("heartbeat for %s refused: %s", task.rollout_id, exc.detail)
                return

    async with AgentClient(server_url, token=token, connections=max(concurrency, 1) + 4) as client:
        with stop:
            async with anyio.create_task_group() as tg:
                for _ in range(concurrency):
                    tg.start_soon(worker, client)
        if stop.cancel_called:
            logger.warning(
                "task server %s unreachable for more than %g s: agents stop (%d tasks done)",
                server_url,
                give_up_after,
                done,
            )
    return done
