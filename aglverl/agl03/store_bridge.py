"""aglverl's rollout attempts as rollouts of Agent Lightning 0.2/0.3's ``LightningStore`` (what ``Trainer.fit``'s
runners work from).

:class:`LightningStoreBridge` claims each rollout attempt from aglverl's store the moment it is queued (it waits
in the store's claim, an event: no polling), and for each one:

1. adds resources to Agent Lightning's store whose ``main_llm`` is an ``agl.LLM`` at aglverl's proxy URL of that
   rollout and attempt (``.../rollout/{id}/attempt/{id}/v1``), with the model name, the trainer's sampling
   parameters (the rollout temperature for training, ``val_kwargs`` for validation) and aglverl's token as
   ``api_key``. Every way an agent reaches it lands on the attempt: an ``@rollout`` function's ``llm``, a
   ``LitAgent``'s ``llm.get_base_url(rollout_id, attempt_id)`` (an ``LLM`` answers its own endpoint), and
   ``llm.endpoint`` read directly; aglverl's proxy records every call's token ids there, so nothing depends on
   spans or on Agent Lightning's LiteLLM proxy;
2. enqueues one Agent Lightning rollout: the task input with its ``data_id`` (the GRPO group's id, as
   ``agl.VERL`` adds one to every dataset row), mode ``train`` or ``val``, ``RolloutConfig(timeout_seconds=
   aglverl.lease_seconds, max_attempts=1)`` (retries are aglverl's: a new attempt is a new Agent Lightning
   rollout), and metadata ``{"data_id", "is_train", "aglverl_rollout_id", "aglverl_attempt_id"}``;
3. waits for it to end (Agent Lightning's in-memory store wakes the wait with an event), then posts the result
   to aglverl's store: succeeded, with the last reward span of its latest attempt (what the agent returned,
   else its last ``emit_reward``; none: ``reward_fillna_value``, 0.0 as in ``agl.VERL``); or failed, naming
   the attempt's status (``failed``: the agent raised; ``timeout``: it ran past the lease), so aglverl retries
   it while ``aglverl.max_attempts`` allows. With the Trainer's adapter choosing agents (``agent_match``,
   :mod:`.adapter`), a result that succeeded names the calls that train: those whose LLM spans the adapter
   kept, tied by response id.

While an attempt is bridged, aglverl's lease is held (the queue wait in Agent Lightning's store is not the agent's
time). Its deadline is Agent Lightning's: ``lease_seconds`` after a runner started it. The bridge keeps that
deadline itself (a timer armed on the attempt's start, read from the store): a runner killed mid-rollout, or
stuck in its agent, has its attempt ended ``timeout`` at the deadline (``update_attempt``, what Agent
Lightning's own health check writes), whatever else the store is doing; that health check runs only inside
other store calls (at most every 10 s), so with every runner dead or stuck it would never run. The attempt's
resources entry is removed from the store when it ends (a collection-based store, 0.3's in-memory one
included: its ``collections``), so the store holds one per attempt in flight, not one per attempt ever run.

:class:`DequeueBell` removes the runners' idle sleep: Agent Lightning's ``LitAgentRunner`` asks the store for a
rollout and, when there is none, sleeps ``poll_interval`` (5 s) before asking again, so the first rollouts of a
step (queued while the trainer updated) waited up to 5 s. The bell makes the store's ``dequeue_rollout`` a
long-poll: a request that finds the queue empty waits up to ``LONG_POLL_SECONDS`` and takes a rollout the moment
the bridge enqueues one (the runner's HTTP client allows 30 s a request). Closing the bell answers every waiting
dequeue at once, so runners see their stop event as before.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import agentlightning as agl
import anyio
import anyio.to_thread
from agentlightning.emitter.reward import find_final_reward

from ..models import TRAINED_CALLS_KEY, ProxyLLM, Rollout, Task, check_reward
from ..store import StoreError
from .adapter import CallSelector

__all__ = ["LONG_POLL_SECONDS", "DequeueBell", "LightningStoreBridge"]

logger = logging.getLogger(__name__)

#: How long a runner's empty dequeue waits for a rollout before it is answered "none" (the runner then sleeps
#: its poll interval and asks again); below the runner's HTTP client's 30 s request timeout.
LONG_POLL_SECONDS = 10.0
#: aglverl's lease on an attempt while Agent Lightning's store holds it (queued behind other rollouts, then run
#: with Agent Lightning's own timeout, which the bridge keeps): a week.
_BRIDGED_LEASE_SECONDS = 7 * 24 * 3600.0


class DequeueBell:
    """Turns a ``LightningStore``'s ``dequeue_rollout`` into a long-poll that :meth:`ring` wakes.

    :meth:`install` replaces the store object's ``dequeue_rollout`` (its store server's route calls it on the
    server's thread, and in-process runners call it directly); :meth:`ring` (any thread) wakes every waiting
    dequeue to look at the queue again; :meth:`close` answers them all and stops the waiting. Cross-thread: the
    waiters' loops are woken with ``call_soon_threadsafe``.
    """

    def __init__(self, long_poll_seconds: float = LONG_POLL_SECONDS) -> None:
        self.long_poll_seconds = long_poll_seconds
        self._lock = threading.Lock()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = set()
        self._closed = False
        self._restore: Callable[[], None] | None = None
        #: Dequeues that found the queue empty and then got a rollout while waiting (each one a sleep saved).
        self.woken = 0

    def install(self, store: Any) -> None:
        """Make ``store.dequeue_rollout`` wait for a rollout (undone by :meth:`close`)."""
        original: Callable[..., Awaitable[Any]] = store.dequeue_rollout

        async def dequeue_rollout(worker_id: str | None = None) -> Any:
            return await self._dequeue(original, worker_id)

        store.dequeue_rollout = dequeue_rollout
        self._restore = lambda: store.__dict__.pop("dequeue_rollout", None)

    def ring(self) -> None:
        """Wake every waiting dequeue: a rollout was queued."""
        with self._lock:
            waiters, self._waiters = self._waiters, set()
        for loop, future in waiters:
            loop.call_soon_threadsafe(_resolve, future)

    def close(self) -> None:
        """Answer every waiting dequeue now and stop waiting; the store's own ``dequeue_rollout`` is back."""
        with self._lock:
            self._closed = True
        if self._restore is not None:
            self._restore()
        self.ring()

    async def _dequeue(self, original: Callable[..., Awaitable[Any]], worker_id: str | None) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.long_poll_seconds
        waited = False
        while True:
            future: asyncio.Future[None] = loop.create_future()
            with self._lock:
                closed = self._closed
                if not closed:
                    self._waiters.add((loop, future))
            # registered before looking: a rollout queued after this look rings this future
            rollout = await original(worker_id=worker_id)
            remaining = deadline - loop.time()
            if rollout is not None or closed or remaining <= 0:
                with self._lock:
                    self._waiters.discard((loop, future))
                if rollout is not None and waited:
                    self.woken += 1
                return rollout
            try:
                await asyncio.wait_for(future, remaining)
            except TimeoutError:
                pass
            finally:
                with self._lock:
                    self._waiters.discard((loop, future))
            waited = True


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class LightningStoreBridge:
    """Runs aglverl's rollout attempts as Agent Lightning rollouts (see the module docstring).

    ``daemon``: the running :class:`~aglverl.daemon.AgentDaemon`; ``store``: Agent Lightning's store (the one
    ``Trainer.fit`` hands the algorithm); ``concurrency``: attempts bridged at once (a step's rollouts, so every
    one is in Agent Lightning's queue before a runner could go idle); ``reward_fillna_value``: the reward of a
    rollout that reported none; ``bell``: the long-poll to ring when a rollout is queued; ``selector``: the
    Trainer's adapter's choice of calls (:mod:`.adapter`), named in each result that succeeded.
    Serve it with ``await tg.start(bridge.serve)``; cancelling it leaves bridged rollouts to Agent Lightning.
    """

    def __init__(
        self,
        daemon: Any,
        store: agl.LightningStore,
        *,
        concurrency: int,
        reward_fillna_value: float | None = 0.0,
        bell: DequeueBell | None = None,
        selector: CallSelector | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.daemon = daemon
        self.store = store
        self.concurrency = concurrency
        self.reward_fillna_value = reward_fillna_value
        self.bell = bell
        #: The Trainer's adapter's choice of calls (``agent_match``); ``None``: every recorded call trains.
        self.selector = selector
        #: Calls the adapter kept (by their response ids), kept LLM spans without one, and rollouts that left no
        #: span (so, with a selector, trained nothing).
        self.calls_selected = self.spans_untied = self.rollouts_untraced = 0
        self._warned: set[str] = set()
        #: Agent Lightning rollout id -> the aglverl (rollout id, attempt id) it runs.
        self.attempts: dict[str, tuple[str, str]] = {}
        self.finished = 0

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Bridge attempts until cancelled (or until aglverl's store closes)."""
        async with anyio.create_task_group() as tg:
            for n in range(self.concurrency):
                tg.start_soon(self._worker, name=f"aglverl Agent Lightning bridge {n}")
            task_status.started()

    async def _worker(self) -> None:
        await self.daemon.store.work(self._attempt)  # until the store closes

    async def _attempt(self, task: Task) -> None:
        assert task.attempt_id is not None
        try:
            self.daemon.store.heartbeat(task.rollout_id, task.attempt_id, seconds=_BRIDGED_LEASE_SECONDS)
            result = await self._run(task)
        except StoreError as exc:  # the attempt ended meanwhile (a step's deadline): nothing to report
            logger.info(
                "attempt %s of %s ended before its Agent Lightning rollout: %s",
                task.attempt_id,
                task.rollout_id,
                exc,
            )
            return
        except Exception as exc:  # Agent Lightning's store refused it: the attempt fails, training goes on
            logger.warning(
                "attempt %s of %s could not run in Agent Lightning's store: %r",
                task.attempt_id,
                task.rollout_id,
                exc,
            )
            error = f"Agent Lightning's store could not run the attempt: {exc!r}"
            result = Rollout(
                rollout_id=task.rollout_id,
                attempt_id=task.attempt_id,
                status="failed",
                metadata={"error": error},
            )
        try:
            await self.daemon.store.accept_result(result)
        except StoreError as exc:
            logger.info(
                "the result of %s (attempt %s) was not taken: %s", task.rollout_id, task.attempt_id, exc
            )
        finally:
            self.finished += 1

    async def _run(self, task: Task) -> Rollout:
        resources = await self.store.add_resources({"main_llm": self._llm(task)})
        try:
            return await self._run_with(task, resources.resources_id)
        finally:
            with anyio.CancelScope(shield=True):  # the entry goes with its attempt, however that ended
                await _drop_resources(self.store, resources)

    async def _run_with(self, task: Task, resources_id: str) -> Rollout:
        assert task.attempt_id is not None
        is_train = (task.mode or "train") == "train"
        metadata = {
            "data_id": task.metadata.get("data_id", task.rollout_id),
            "is_train": is_train,
            "aglverl_rollout_id": task.rollout_id,
            "aglverl_attempt_id": task.attempt_id,
        }
        queued = await self.store.enqueue_rollout(
            input=_with_data_id(task.input, metadata["data_id"]),
            mode="train" if is_train else "val",
            resources_id=resources_id,
            config=agl.RolloutConfig(timeout_seconds=self.daemon.store.lease_seconds, max_attempts=1),
            metadata=metadata,
        )
        agl_id = queued.rollout_id
        self.attempts[agl_id] = (task.rollout_id, task.attempt_id)
        if self.bell is not None:
            self.bell.ring()
        try:
            ended = await self._wait(agl_id)
            return await self._result(task, ended)
        finally:
            self.attempts.pop(agl_id, None)

    def _llm(self, task: Task) -> agl.LLM:
        assert task.attempt_id is not None
        update = self.daemon.store.resources(task.resources_id)
        llm = update.resources.get("main_llm") if update is not None else None
        if not isinstance(llm, ProxyLLM):
            raise StoreError(
                f"rollout {task.rollout_id} has no proxy main_llm to point Agent Lightning's runners at"
            )
        resolved = llm.resolve(task.rollout_id, task.attempt_id)
        return agl.LLM(
            endpoint=resolved.endpoint,
            model=resolved.model,
            api_key=self.daemon.config.token,
            sampling_parameters=dict(resolved.sampling_parameters),
        )

    async def _wait(self, agl_id: str) -> agl.Rollout:
        """The Agent Lightning rollout once it ended, its deadline kept meanwhile (:meth:`_keep_deadline`).

        Woken by the in-memory store's completion event, which it sets whichever thread ends the rollout (a
        runner's update through its server, a timeout). Agent Lightning's own ``wait_for_rollouts`` waits each
        rollout in a thread of the loop's default executor, 10 s at a time (6 threads on 2 cores for a step's
        dozens of rollouts, and up to 10 s more at shutdown); it is the fallback for other stores.
        Cancellation leaves the rollout to Agent Lightning."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._keep_deadline, agl_id)
            ended = await self._ended(agl_id)
            tg.cancel_scope.cancel()
        return ended

    async def _ended(self, agl_id: str) -> agl.Rollout:
        ended = _completion_event(self.store, agl_id)
        while True:
            if ended is not None:
                await ended
                rollout = await self.store.get_rollout_by_id(agl_id)
                if rollout is not None:
                    return rollout
            done = await self.store.wait_for_rollouts(rollout_ids=[agl_id], timeout=None)
            if done:
                return done[0]
            # a store whose wait gave up early (a remote store's request timeout): wait again

    async def _keep_deadline(self, agl_id: str) -> None:
        """End the rollout's attempt ``timeout`` once it has run ``lease_seconds`` (its ``RolloutConfig``'s
        timeout) and still has not ended, as Agent Lightning's health check would if anything ran it.

        A timer, never a poll: armed ``lease_seconds`` ahead while the rollout is queued (an attempt that starts
        meanwhile cannot be due before it fires), then at the running attempt's own deadline (its start, in the
        store's wall-clock time, plus the timeout). Returns once the attempt ended (the completion event wakes
        :meth:`_ended`) or was ended here; cancelled when the rollout ends first."""
        timeout = self.daemon.store.lease_seconds
        due = time.time() + timeout
        while True:
            await anyio.sleep(max(0.0, due - time.time()))
            attempt = await self.store.get_latest_attempt(agl_id)
            if attempt is None:  # still queued: the agent's time has not started
                due = time.time() + timeout
                continue
            if attempt.status not in _UNDECIDED:
                return
            due = attempt.start_time + timeout
            if time.time() < due:
                continue
            logger.warning(
                "Agent Lightning rollout %s (attempt %s on worker %s) ran past its %.0f s timeout with no word "
                "from its runner: ended as timed out",
                agl_id,
                attempt.attempt_id,
                attempt.worker_id,
                timeout,
            )
            await self.store.update_attempt(agl_id, attempt.attempt_id, status="timeout")
            return

    async def _trained_calls(self, agl_id: str, spans: Sequence[Any]) -> dict[str, Any]:
        """The result's metadata naming the calls that train (:data:`~aglverl.models.TRAINED_CALLS_KEY`), when
        the Trainer's adapter chooses them (``agent_match``); empty when every call trains."""
        if self.selector is None:
            return {}
        selection = await anyio.to_thread.run_sync(self.selector.select, spans)
        self.calls_selected += len(selection.trained)
        self.spans_untied += selection.untied
        if not spans:
            self.rollouts_untraced += 1
            self._warn_once(
                "untraced",
                "Agent Lightning rollout %s left no spans in the store: with %s none of its calls trains (is "
                "the tracer running? an opentelemetry exporter that loses spans? counted in the bridge's "
                "rollouts_untraced)",
                agl_id,
                self.selector.describe(),
            )
        if selection.untied:
            self._warn_once(
                "untied",
                "Agent Lightning rollout %s: %d LLM call spans the adapter kept name no response id "
                "(gen_ai.response.id), so no recorded call can be tied to them and they train nothing (counted "
                "in the bridge's spans_untied)",
                agl_id,
                selection.untied,
            )
        return {TRAINED_CALLS_KEY: sorted(selection.trained)}

    def _warn_once(self, kind: str, message: str, *args: Any) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(message, *args)

    async def _result(self, task: Task, ended: agl.Rollout) -> Rollout:
        if ended.status == "succeeded":
            spans = await self.store.query_spans(ended.rollout_id, attempt_id="latest")
            reward = find_final_reward(spans)
            if reward is None:
                reward = self.reward_fillna_value
            error = f"Agent Lightning rollout {ended.rollout_id} reported no reward"
            if reward is not None:
                try:  # a reward emitted or returned: finite as float32, else the attempt fails naming it
                    final = check_reward(
                        float(reward), f"Agent Lightning rollout {ended.rollout_id}'s reward"
                    )
                except ValueError as exc:
                    error = str(exc)
                else:
                    return Rollout(
                        rollout_id=task.rollout_id,
                        attempt_id=task.attempt_id,
                        final_reward=final,
                        metadata=await self._trained_calls(ended.rollout_id, spans),
                    )
        else:
            attempt = await self.store.get_latest_attempt(ended.rollout_id)
            how = attempt.status if attempt is not None else ended.status
            error = f"Agent Lightning rollout {ended.rollout_id} ended {ended.status} (its attempt: {how}){_WHY.get(how, '')}"
        return Rollout(
            rollout_id=task.rollout_id, attempt_id=task.attempt_id, status="failed", metadata={"error": error}
        )


#: Attempt statuses whose attempt may still end well (a runner that stops reporting is ``unresponsive``, and
#: ``running`` again when it reports).
_UNDECIDED = frozenset({"preparing", "running", "unresponsive"})

#: What an Agent Lightning attempt's status says about the agent.
_WHY: Mapping[str, str] = {
    "failed": ": the agent raised (its runner logged the traceback)",
    "timeout": ": it ran past aglverl.lease_seconds",
    "unresponsive": ": its runner stopped reporting",
}


async def _drop_resources(store: Any, resources: Any) -> None:
    """Remove a resources entry from a collection-based store (0.3's in-memory and MongoDB stores: their
    ``collections``); a store without collections keeps it. A runner that reads it afterwards finds no
    resources: its rollout has ended already."""
    inner = getattr(store, "store", None) or store
    collections = getattr(inner, "collections", None)
    if collections is None or not hasattr(collections, "atomic"):
        return
    try:
        async with collections.atomic(mode="rw", labels=["resources"]) as locked:
            await locked.resources.delete([resources])
    except Exception as exc:  # gone already, or a store that refuses: the entry stays, nothing else changes
        logger.debug("resources %s not removed from the store: %r", resources.resources_id, exc)


def _completion_event(store: Any, rollout_id: str) -> Any:
    """The in-memory store's completion event of a rollout (an ``aiologic.Event``: awaitable from any thread's
    loop), behind the store server that wraps it; ``None`` for a store that has none."""
    inner = getattr(store, "store", None) or store
    events = getattr(inner, "_completion_events", None)
    event = events.get(rollout_id) if isinstance(events, dict) else None
    return event if event is not None and hasattr(event, "__await__") else None


def _with_data_id(task_input: Any, data_id: Any) -> Any:
    """The task input as ``agl.VERL`` hands it to agents: a dict row carries its sample's ``data_id``."""
    if isinstance(task_input, Mapping) and "data_id" not in task_input:
        return {**task_input, "data_id": data_id}
    return task_input
