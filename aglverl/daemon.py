"""``AgentDaemon``: the store, task server, LLM proxy, collector (and producer) in one task group on the caller's loop.

::

    async with AgentDaemon(backends=["http://127.0.0.1:8000"], model="my-model") as daemon:
        await daemon.submit(samples, n=4)            # agents at daemon.server_url pick the tasks up
        async for batch in daemon.batches:           # verl DataProto + metrics, one per training step
            ...                                      # train; daemon.update_resources(...) / set_backends(...)

A trainer needs nothing else: :meth:`AgentDaemon.submit`, :attr:`AgentDaemon.batches`, and the resource/
backend/weight-update calls. A trainer that samples finished groups from a store of its own (verl's V1
trainer) passes a ``trajectory_sink`` instead and dispatches prompts with :attr:`AgentDaemon.producer`. The daemon never owns the event loop; leaving the ``async with`` block (or
cancelling the task that runs :meth:`AgentDaemon.serve`) shuts every component down: listening ports released,
parked long-polls answered, upstream connections closed, no task or thread left.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import warnings
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from types import TracebackType
from typing import Any, Literal, Protocol

import anyio
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream

from .agent_lightning import AgentLightningAPI, AgentLightningSettings
from .metrics import Registry
from .models import LLM, Mode, NamedResources, Rollout
from .proxy import UPSTREAM_KEEPALIVE, LLMProxy, RetryPolicy, SamplingMismatch
from .proxy.shard import counters_of
from .proxy.shards import ProxyShards, ShardCount, check_shard_count
from .server import TaskServer
from .store.journal import Journal
from .store.tasks import TaskStore
from .trajectory.batch import BatchConfig
from .trajectory.groups import OWNER_PREFIX, GroupSink, TrajectoryProducer
from .trajectory.signals import SignalConfig
from .trajectory.steps import RolloutCollector, Step, TrainingBatch

__all__ = ["AgentDaemon"]

logger = logging.getLogger(__name__)


class _BusyTimeline(Protocol):
    """When at least one LLM call was in flight: the proxy's own timeline, or the union of its shards'."""

    def busy_intervals(self, start: float, stop: float) -> list[tuple[float, float]]: ...


class AgentDaemon:
    """The embeddable control plane. All arguments are keyword-only.

    - ``host``/``port``: the task server (Agent Lightning routes); ``proxy_port``: the LLM proxy. Both bind
      ``127.0.0.1`` unless told otherwise; port 0 picks a free port (see :attr:`server_url`, :attr:`proxy_url`).
    - ``backends``: OpenAI-compatible inference servers (``http://host:port``, no ``/v1``); ``model`` and
      ``sampling_parameters`` describe the ``main_llm`` resource published at start.
    - ``llm_resource``: ``"proxy"`` publishes ``main_llm`` as a :class:`ProxyLLM` (per-rollout URLs, token ids
      recorded by the proxy); ``"plain"`` as a plain :class:`LLM` on the proxy's unattributed ``/v1`` for
      Agent Lightning 0.1 clients, which cannot read ``proxy_llm`` resources and post their own triplets.
    - ``lease_seconds``/``max_attempts``: how long a claim lasts without a heartbeat, and how many claims a
      rollout gets. ``step_timeout``: default per-step deadline. ``vocab_size``: bound for posted token ids.
    - ``batch``: padding/truncation/reward fill for training batches. ``max_buffered_batches`` is accepted for
      compatibility and has no effect (a value other than 1 warns): :attr:`batches` is a rendezvous, each
      finished step's batch waits in its step until the trainer receives it, its rollouts stored and journaled
      until then (a kill while it waits loses nothing), however many steps have finished.
    - ``signal``: the training-signal controls (:class:`~aglverl.trajectory.signals.SignalConfig`: compact filtering by
      termination reason, rejection sampling, step-wise advantage, turn weighting, and whether the proxy
      asks the backends for behaviour logprobs); ``SignalConfig.from_dict`` reads an ``aglverl:`` section.
    - ``retry``, ``request_timeout``, ``connect_timeout``, ``eject_seconds``, ``pause_timeout``,
      ``hold_timeout``, ``backend_api_key``, ``upstream_keepalive``: the LLM proxy's policy (see
      :class:`~aglverl.proxy.LLMProxy`): retries before the first byte, the bound on one upstream try, how long
      a failing backend stays out, how long an aborted generation may go without a token, how long calls wait
      while a trainer holds the proxy for its update, the key the backends expect, and how long idle
      connections to them are kept (below the backends' own keep-alive).
    - ``token``: bearer token required by the task server and the proxy.
    - ``freeze_gc``: at start, move every object that exists (the imported libraries) out of the cyclic garbage
      collector's reach (``gc.freeze()``), so full collections no longer stall the loop for ~0.4 s; it affects
      the whole process, so an embedding application that manages the collector itself can turn it off.
    - ``journal_path``: a write-ahead journal; every accepted result is in it before the agent hears "ok", and
      a daemon started on the same file recovers the unfinished steps (only their unfinished rollouts are
      handed out again, with this daemon's resources: a recovered ``main_llm`` points at the live proxy) and
      the producer's groups in flight. ``journal_fsync``: also ``fsync`` before answering (survives power
      loss, not just a killed process).
    - ``sampling_mismatch``: what the proxy does with a call that sets other sampling parameters than its
      rollout's ``main_llm`` names: ``"refuse"`` (400 naming the parameter) or ``"mask"`` (kept, recorded
      ``off_policy``, its rows kept out of the loss). Parameters a call omits are filled in either way.
    - ``token_in``: token-in chat (default on): a chat call whose messages extend an earlier call's messages +
      answer is generated from that call's exact ids, so a conversation an agent re-sends as text trains as
      one row (see :mod:`aglverl.proxy.tokenin`); off, every call is relayed as text.
    - ``trajectory_sink``: where finished prompt groups go (:class:`~aglverl.trajectory.groups.GroupSink`); with it the
      daemon runs a :class:`~aglverl.trajectory.groups.TrajectoryProducer` (:attr:`producer`), and ``step_timeout``
      bounds each group.
    - ``agent_lightning``: what Agent Lightning v1.0's API on the task server (:attr:`agent_lightning`) should
      know of the run (:class:`~aglverl.agent_lightning.AgentLightningSettings`: the rollouts' controller config,
      the reward of an attempt without a reward event, whether a trainer owns the models and the gate).
    - ``proxy_shards``: ``1`` (default): one :class:`~aglverl.proxy.LLMProxy` in this process, on
      ``proxy_port``; ``N`` or ``"per_node"``: that many proxies as Ray actors (Ray initialised in this process
      first), each its own process beside the inference servers, serving on its node's address, every rollout
      attempt pinned to one of them (:mod:`aglverl.proxy.shards`, ``docs/scaling.md``); ``backend_nodes`` (backend URL
      -> Ray node id) says where the backends run, to place the shards beside them (``"per_node"``: one per
      such node; without it, one per alive node). :attr:`proxy` is then a :class:`~aglverl.proxy.shards.ProxyShards`.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        proxy_port: int = 0,
        backends: Sequence[str] = (),
        model: str = "default",
        sampling_parameters: Mapping[str, Any] | None = None,
        llm_resource: Literal["proxy", "plain"] = "proxy",
        lease_seconds: float = 600.0,
        max_attempts: int = 3,
        step_timeout: float | None = None,
        vocab_size: int | None = None,
        batch: BatchConfig | None = None,
        signal: SignalConfig | None = None,
        max_buffered_batches: int = 1,
        token: str | None = None,
        retry: RetryPolicy | None = None,
        request_timeout: float = 600.0,
        connect_timeout: float = 5.0,
        eject_seconds: float = 5.0,
        pause_timeout: float = 600.0,
        hold_timeout: float | None = None,
        backend_api_key: str | None = None,
        upstream_keepalive: float = UPSTREAM_KEEPALIVE,
        journal_path: str | os.PathLike[str] | None = None,
        journal_fsync: bool = False,
        freeze_gc: bool = True,
        sampling_mismatch: SamplingMismatch = "refuse",
        trajectory_sink: GroupSink | None = None,
        registry: Registry | None = None,
        token_in: bool = True,
        proxy_shards: ShardCount = 1,
        backend_nodes: Mapping[str, str] | None = None,
        agent_lightning: AgentLightningSettings | None = None,
    ) -> None:
        if max_buffered_batches != 1:
            warnings.warn(
                "AgentDaemon(max_buffered_batches=...) has no effect: a finished step's batch waits in its step "
                "until the trainer receives it from AgentDaemon.batches",
                DeprecationWarning,
                stacklevel=2,
            )
        self.registry = registry or Registry()
        self.model = model
        self.sampling_parameters = dict(sampling_parameters or {})
        self.llm_resource_kind = llm_resource
        signal = signal or SignalConfig()
        self.store = TaskStore(
            lease_seconds=lease_seconds,
            max_attempts=max_attempts,
            vocab_size=vocab_size,
            registry=self.registry,
        )
        self.server = TaskServer(self.store, host=host, port=port, token=token)
        proxy_options: dict[str, Any] = dict(
            retry=retry or RetryPolicy(),
            token=token,
            request_timeout=request_timeout,
            connect_timeout=connect_timeout,
            eject_seconds=eject_seconds,
            pause_timeout=pause_timeout,
            hold_timeout=hold_timeout,
            backend_api_key=backend_api_key,
            upstream_keepalive=upstream_keepalive,
            request_logprobs=signal.request_logprobs,
            sampling_mismatch=sampling_mismatch,
            token_in=token_in,
        )
        #: The LLM proxy: in this process, or its shards on Ray (``proxy_shards``).
        self.proxy: LLMProxy | ProxyShards
        if check_shard_count(proxy_shards) == 1:
            self.proxy = LLMProxy(
                self.store,
                backends=backends,
                host=host,
                port=proxy_port,
                registry=self.registry,
                sampling_of=self._sampling_of,
                **proxy_options,
            )
        else:
            self.proxy = ProxyShards(
                self.store,
                count=proxy_shards,
                backends=backends,
                backend_nodes=backend_nodes,
                proxy_options=proxy_options,
                sampling_of=self._sampling_of,
                registry=self.registry,
                freeze_gc=freeze_gc,
            )
            self.store.pinning = self.proxy
            self.server.metrics_sources.append(self.proxy.metrics_text)
        self.store.on_forget(self.proxy.forget)
        self._sampling_cache: dict[str, Mapping[str, Any] | None] = {}
        self._previous_proxy: str | None = None  # the proxy URL of the run whose journal this daemon replayed
        self.collector = RolloutCollector(
            self.store,
            batch=batch,
            signal=signal,
            max_buffered_batches=max_buffered_batches,
            step_timeout=step_timeout,
        )
        self.journal = Journal(journal_path, fsync=journal_fsync) if journal_path is not None else None
        #: The trajectory producer (with a ``trajectory_sink``): prompts in, finished groups to the sink.
        self.producer: TrajectoryProducer | None = None
        if trajectory_sink is not None:
            self.producer = TrajectoryProducer(
                self.store,
                trajectory_sink,
                batch=batch or BatchConfig(),
                signal=signal,
                group_timeout=step_timeout,
                weight_version=lambda: self.proxy.weight_version,
                journal=self.journal is not None,
                registry=self.registry,
            )
        self.freeze_gc = freeze_gc
        self._stack: AsyncExitStack | None = None
        #: Agent Lightning v1.0's routes on the task server (:mod:`aglverl.agent_lightning`).
        self.agent_lightning = AgentLightningAPI(
            self,
            token=token,
            settings=agent_lightning or AgentLightningSettings(trainer_owns_gate=trajectory_sink is not None),
            max_body_bytes=self.server.max_body_bytes,
        )
        self.server.add_routes(self.agent_lightning.routes())

    # ------------------------------------------------------------------ life cycle
    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run every component until cancelled; ``task_status.started()`` once all of them are serving."""
        try:
            async with anyio.create_task_group() as tg:
                await self._start(tg)
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._close_journal()

    def _open_journal(self) -> None:
        """Replay the journal (if any) into the store and collector, then start a compacted file."""
        journal = self.journal
        if journal is None:
            return
        records = journal.replay()
        self._previous_proxy = next((r["url"] for r in reversed(records) if r.get("kind") == "proxy"), None)
        if self.producer is not None:
            held = self.producer.restore(records)
        else:  # no producer to adopt them: a previous run's producer tasks are not handed out either
            held = {r["rollout_id"] for r in records if str(r.get("owner") or "").startswith(OWNER_PREFIX)}
        others = [r for r in records if r.get("rollout_id") not in held] if held else records
        self.store.restore(others)
        self.collector.restore(others)
        self.agent_lightning.rollouts.restore(records)  # the cursor's positions (aglverl.agent_lightning)
        producer = self.producer
        journal.live_records = lambda: itertools.chain(
            [{"kind": "proxy", "url": url}] if (url := self._proxy_url_for_journal()) else [],
            self.store.live_records(),
            self.collector.live_records(),
            producer.live_records() if producer is not None else (),
            self.agent_lightning.rollouts.live_records(),
        )
        journal.open(journal.live_records())
        self.store.journal = journal
        if records:
            logger.info(
                "journal %s replayed: %d open steps recovered",
                journal.path,
                len(self.collector.recovered_steps),
            )

    def _close_journal(self) -> None:
        if self.journal is not None:
            self.journal.close()
            self.store.journal = None

    async def _start(self, tg: TaskGroup) -> None:
        self._open_journal()
        if self.journal is not None:
            await tg.start(self.journal.serve)  # compactions in a worker thread
        await tg.start(self.store.serve)
        await tg.start(self.agent_lightning.serve)  # before the task server answers its routes
        await tg.start(self.server.serve)
        await tg.start(self.proxy.serve)  # shards: their actors started in parallel (~1-2 s), serving
        await tg.start(self.collector.serve)
        if self.producer is not None:
            await tg.start(self.producer.serve)
        self._rebind_recovered_resources()
        self.update_resources({"main_llm": self.main_llm()})
        if self.freeze_gc:
            # verl, torch and transformers leave ~1.6 M objects on the heap; every full collection scans them
            # all and stalls the event loop for ~0.4 s on this kind of machine. Moving what exists at start
            # (imports, the daemon's own long-lived state) out of the collector's reach makes those pauses
            # proportional to what the run itself allocates. Reference counting still frees them as usual.
            gc.collect()
            gc.freeze()
        logger.info("aglverl daemon: tasks at %s, LLM proxy at %s", self.server_url, self.proxy_url)

    async def __aenter__(self) -> AgentDaemon:
        if self._stack is not None:
            raise RuntimeError("this AgentDaemon is already running")
        stack = AsyncExitStack()
        stack.callback(self._close_journal)
        tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tg.cancel_scope.cancel)  # runs first on exit: leaving the block stops every component
        try:
            await self._start(tg)
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        stack, self._stack = self._stack, None
        assert stack is not None
        return await stack.__aexit__(exc_type, exc, tb)

    # ------------------------------------------------------------------ addresses and resources
    @property
    def server_url(self) -> str:
        """Base URL of the task server, e.g. ``http://127.0.0.1:41234``."""
        return self.server.url

    @property
    def proxy_url(self) -> str:
        """Base URL of the LLM proxy (``/v1`` and ``/rollout/{id}/attempt/{id}/v1`` live under it)."""
        return self.proxy.url

    def main_llm(self, sampling_parameters: Mapping[str, Any] | None = None) -> LLM:
        """The ``main_llm`` resource agents should use (see ``llm_resource``)."""
        params = dict(self.sampling_parameters if sampling_parameters is None else sampling_parameters)
        if self.llm_resource_kind == "plain":
            return LLM(endpoint=f"{self.proxy_url}/v1", model=self.model, sampling_parameters=params)
        return self.proxy.llm_resource(self.model, params)

    def _rebind_recovered_resources(self) -> None:
        """Point resources recovered from the journal at this daemon's proxy (the old one is gone).

        A requeued rollout of a previous run keeps its ``resources_id``; its ``main_llm`` named the dead
        proxy's address, so the agent's calls would fail and the rollout be lost.
        """
        live, old = self.proxy.url, self._previous_proxy
        self.store.journal_write({"kind": "proxy", "url": live})
        if old is None or old == live:
            return
        for update in self.store.all_resources():
            changed = {
                name: resource.model_copy(update={"endpoint": live + resource.endpoint[len(old) :]})
                for name, resource in update.resources.items()
                if isinstance(resource, LLM) and resource.endpoint.startswith(old + "/")
            }
            if changed:
                self.store.replace_resources(update.resources_id, {**update.resources, **changed})
                logger.info("resources %s recovered from the journal now use the proxy at %s", update.resources_id, live)

    def _proxy_url_for_journal(self) -> str | None:
        """The proxy URL resources recorded in the journal name: this one's once serving, else the last run's."""
        return self.proxy.url if self.proxy.serving else self._previous_proxy

    def _sampling_of(self, rollout_id: str) -> Mapping[str, Any] | None:
        """The sampling parameters the rollout's ``main_llm`` names (what the proxy fills in and checks)."""
        resources_id = self.store.resources_id_of(rollout_id)
        if resources_id is None:
            return None
        if resources_id not in self._sampling_cache:
            update = self.store.resources(resources_id)
            llm = update.resources.get("main_llm") if update is not None else None
            self._sampling_cache[resources_id] = (
                dict(llm.sampling_parameters) if isinstance(llm, LLM) and llm.sampling_parameters else None
            )
        return self._sampling_cache[resources_id]

    def update_resources(self, resources: NamedResources) -> str:
        """Publish a new resources version (agents fetch it by the task's ``resources_id``); returns its id."""
        return self.store.add_resources(resources).resources_id

    def set_backends(self, backends: Sequence[str]) -> None:
        """Replace the inference servers the proxy forwards to (between steps)."""
        self.proxy.set_backends(backends)

    @asynccontextmanager
    async def updating_weights(self, weight_version: int | None = None) -> AsyncIterator[None]:
        """Pause LLM calls around a weight update: new calls wait, in-flight ones drain, then the block runs.

        On exit (also on error or cancellation) calls resume under the new weight version.
        """
        await self.pause_calls()
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                await self.resume_calls(weight_version)

    @asynccontextmanager
    async def holding_calls(self, weight_version: int | None = None) -> AsyncIterator[None]:
        """Hold LLM calls around a weight update without draining them (the asynchronous trainer modes).

        New calls wait and calls in flight go on; a generation the trainer aborts in the block waits to
        continue, and on exit (also on error or cancellation) everything goes on under the new weight
        version: agents never see the abort (see :meth:`aglverl.proxy.LLMProxy.hold`).
        """
        await self.hold_calls()
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                await self.resume_calls(weight_version)

    # The gate, for the proxy in this process or every shard (each returns once every shard applied it).
    async def pause_calls(self) -> None:
        """Hold new LLM calls and return once the calls in flight have finished (:meth:`LLMProxy.pause`; with
        shards, on every shard at once, returning when the slowest has drained)."""
        await self.proxy.pause()

    async def hold_calls(self) -> None:
        """Hold new LLM calls without draining those in flight (:meth:`LLMProxy.hold`; with shards, returns
        once every shard holds)."""
        if isinstance(self.proxy, ProxyShards):
            await self.proxy.hold()
        else:
            self.proxy.hold()

    async def resume_calls(self, weight_version: int | None = None) -> None:
        """End a pause or hold under ``weight_version`` (default: the current one + 1) (:meth:`LLMProxy.resume`;
        with shards, returns once every shard has resumed)."""
        if isinstance(self.proxy, ProxyShards):
            await self.proxy.resume(weight_version)
        else:
            self.proxy.resume(weight_version)

    async def refresh_proxy_figures(self) -> None:
        """With shards: fetch every shard's counters and busy intervals (one call each, in parallel), which
        :meth:`proxy_counters`, :meth:`generated_tokens` and :attr:`proxy_activity` then read; with the proxy in
        this process they are always current and this returns at once."""
        if isinstance(self.proxy, ProxyShards):
            await self.proxy.refresh()

    def proxy_counters(self) -> dict[str, float]:
        """The LLM proxy's cumulative counters since start, under ``proxy/*`` names for a trainer's logs (with
        shards: their sum, as of :meth:`refresh_proxy_figures`)."""
        if isinstance(self.proxy, ProxyShards):
            return self.proxy.counters()
        return counters_of(self.proxy)

    def generated_tokens(self) -> float:
        """Response token ids the proxy recorded since start (with shards: as of :meth:`refresh_proxy_figures`)."""
        if isinstance(self.proxy, ProxyShards):
            return self.proxy.generated_tokens()
        return self.proxy.m_generated.value()

    @property
    def proxy_activity(self) -> _BusyTimeline:
        """When at least one LLM call was in flight (``busy_intervals(start, stop)``; with shards: the union of
        theirs, as of :meth:`refresh_proxy_figures`)."""
        return self.proxy.activity

    # ------------------------------------------------------------------ trainer API
    async def submit(
        self,
        samples: Sequence[Any],
        *,
        n: int = 1,
        mode: Mode = "train",
        resources_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        deadline: float | None = None,
    ) -> Step:
        """Queue a step (each sample ``n`` times); training batches arrive in :attr:`batches`.

        Returns the step's handle at once; ``await step.wait()`` gives its report (for ``mode="val"``, the
        validation metrics).
        """
        return await self.collector.submit(
            samples, n=n, mode=mode, resources_id=resources_id, metadata=metadata, deadline=deadline
        )

    async def validate(self, samples: Sequence[Any], *, n: int = 1) -> dict[str, float]:
        """Run a validation step and return its metrics (``val/reward``, response lengths, turn counts)."""
        step = await self.submit(samples, n=n, mode="val")
        return (await step.wait()).metrics

    def abandon(self, step: Step, reason: str) -> int:
        """End a step early: its unfinished rollouts fail (``step_timeout``) with ``reason``; returns how many.

        The step then completes as usual, with what had finished. For a step nobody will train on, such as
        one recovered from the journal that a resumed trainer no longer needs.
        """
        return self.store.fail(step.rollout_ids, reason)

    @property
    def recovered_steps(self) -> list[Step]:
        """Steps a previous run left unfinished, re-opened from the journal; their batches come as usual."""
        return self.collector.recovered_steps

    @property
    def batches(self) -> MemoryObjectReceiveStream[TrainingBatch]:
        """Training batches, in step completion order; the stream ends when the daemon stops."""
        return self.collector.batches

    # ------------------------------------------- Agent Lightning server verbs (for migrating callers)
    async def queue_task(
        self,
        sample: Any,
        mode: Mode | None = None,
        resources_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> str:
        """Queue one task outside any step; returns its rollout id (``AgentLightningServer.queue_task``)."""
        return self.store.enqueue(
            sample, mode=mode, resources_id=resources_id or self.store.latest_resources_id, metadata=metadata
        )

    async def get_completed_rollout(self, rollout_id: str) -> Rollout | None:
        """The finished rollout's result, removed from the daemon; ``None`` while it is unfinished."""
        return self.store.pop_finished(rollout_id)

    async def wait_for_rollout(self, rollout_id: str, timeout: float | None = None) -> Rollout | None:  # noqa: ASYNC109
        """Await a rollout's end (an event; the old ``poll_completed_rollout`` slept in a loop)."""
        return await self.store.wait_for_rollout(rollout_id, timeout)

    async def retrieve_completed_rollouts(self) -> list[Rollout]:
        """Every finished rollout queued with :meth:`queue_task`, removed from the daemon."""
        return self.store.pop_all_finished()

