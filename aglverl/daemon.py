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

import dataclasses
import difflib
import gc
import itertools
import logging
import os
import warnings
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from types import MappingProxyType, TracebackType
from typing import Any, Literal, Unpack

import anyio
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream

from ._net import refuse_open_address
from .agl10.api import AgentLightningAPI
from .agl10.config import AgentLightningSettings
from .metrics import Registry
from .models import LLM, Mode, NamedResources, Rollout
from .proxy import LLMProxy, ProxyConfig
from .proxy.config import ALIASES, POLICY_FIELDS, ProxyPolicySettings, with_aliases
from .proxy.control import BusyTimeline, ProxyControl
from .proxy.shards import ProxyShards, ShardCount, check_shard_count
from .server import TaskServer
from .store import Journal, StoreConfig, TaskStore
from .trajectory.batch import BatchConfig
from .trajectory.groups import OWNER_PREFIX, GroupSink, TrajectoryProducer
from .trajectory.signals import SignalConfig
from .trajectory.steps import RolloutCollector, Step, TrainingBatch

__all__ = ["AgentDaemon", "DaemonConfig", "DaemonKeywords", "ProxyConfig", "StoreConfig"]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- settings
@dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    """Every setting of an :class:`AgentDaemon`, as one frozen value built once and handed on whole: each part
    gets its own value (``proxy``, ``store``, ``batch``, ``signal``) or the fields it uses, under their names.

    - ``host``/``port``: the task server (``127.0.0.1``, port 0: a free one); ``token``: the bearer token agents
      send, checked by the task server and the proxy (it is put into ``proxy.token``; a different
      ``proxy.token`` is a ``ValueError``).
    - ``backends``: the inference servers (``http://host:port``); ``backend_nodes`` (backend URL -> Ray node
      id): where they run, to place proxy shards beside them. ``model``/``sampling_parameters``: the
      ``main_llm`` resource published at start; ``llm_resource``: ``"proxy"`` (a
      :class:`~aglverl.models.ProxyLLM`, per-rollout URLs) or ``"plain"`` (an :class:`~aglverl.models.LLM` on
      the proxy's ``/v1``, for Agent Lightning 0.1 clients).
    - ``step_timeout``: the default bound on a step's (or a producer group's) rollouts; ``max_failed_groups``:
      the producer stops the run after this many training groups in a row whose every rollout failed (0: never).
    - ``journal_path``/``journal_fsync``: the write-ahead journal (``None``: none); ``freeze_gc``: move the
      objects that exist at start out of the cyclic collector's reach.
    - ``proxy_shards``: 1 (the proxy in this process) or N / ``"per_node"`` (proxy shards on Ray).
    - ``agent_lightning``: what Agent Lightning v1.0's API on the task server should know of the run
      (:class:`~aglverl.agl10.config.AgentLightningSettings`; ``None``: its defaults, the trainer owning the
      models and the gate, and refusing rollouts from outside, when the daemon has a producer).
    - ``allow_unauthenticated``: serve on a ``host`` that is not a loopback address without a ``token`` (else a
      ``ValueError``: anyone who reaches it could queue work, post rewards and read every rollout).
    - ``proxy`` (:class:`~aglverl.proxy.config.ProxyConfig`), ``store``
      (:class:`~aglverl.store.config.StoreConfig`), ``batch`` (:class:`~aglverl.trajectory.batch.BatchConfig`),
      ``signal`` (:class:`~aglverl.trajectory.signals.SignalConfig`; its ``request_logprobs`` turns on
      ``proxy.request_logprobs``).

    A bad value raises ``ValueError`` at construction, naming it. :meth:`from_keywords` builds one from
    :class:`AgentDaemon`'s keywords.
    """

    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = field(default=None, repr=False)
    backends: tuple[str, ...] = ()
    backend_nodes: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    model: str = "default"
    sampling_parameters: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    llm_resource: Literal["proxy", "plain"] = "proxy"
    step_timeout: float | None = None
    max_failed_groups: int = 0
    journal_path: str | os.PathLike[str] | None = None
    journal_fsync: bool = False
    freeze_gc: bool = True
    proxy_shards: ShardCount = 1
    agent_lightning: AgentLightningSettings | None = None
    allow_unauthenticated: bool = False
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    signal: SignalConfig = field(default_factory=SignalConfig)

    def __post_init__(self) -> None:
        check_shard_count(self.proxy_shards)
        if self.llm_resource not in ("proxy", "plain"):
            raise ValueError(f"llm_resource must be 'proxy' or 'plain', got {self.llm_resource!r}")
        if self.max_failed_groups < 0:
            raise ValueError(f"max_failed_groups must be >= 0, got {self.max_failed_groups!r}")
        refuse_open_address(
            self.host,
            self.token,
            allow_unauthenticated=self.allow_unauthenticated,
            keys="AgentDaemon(allow_unauthenticated=True), aglverl.allow_unauthenticated: true, or "
            "aglverl serve --allow-unauthenticated",
        )
        assign = object.__setattr__  # frozen: the normalised values, once, at construction
        assign(self, "backends", tuple(self.backends))
        assign(self, "backend_nodes", MappingProxyType(dict(self.backend_nodes)))
        assign(self, "sampling_parameters", MappingProxyType(dict(self.sampling_parameters)))
        proxy = self.proxy
        if self.token is not None and proxy.token not in (None, self.token):
            raise ValueError(
                "DaemonConfig.token and DaemonConfig.proxy.token differ: the daemon has one token"
            )
        if self.token is not None and proxy.token is None:
            proxy = dataclasses.replace(proxy, token=self.token)
        if self.signal.request_logprobs and not proxy.request_logprobs:
            proxy = dataclasses.replace(proxy, request_logprobs=True)  # the trainer needs behaviour log-probs
        assign(self, "proxy", proxy)

    @classmethod
    def from_keywords(cls, **keywords: Unpack[DaemonKeywords]) -> DaemonConfig:
        """The config :class:`AgentDaemon`'s keywords describe (see :class:`DaemonKeywords`); ``TypeError`` for
        a keyword it does not take. Every setting of the proxy (:class:`~aglverl.proxy.config.ProxyConfig`'s
        fields) is a keyword of the same name, or they come together as ``proxy`` (a ``ProxyConfig``, or a
        mapping of its fields as a run's ``aglverl.proxy:`` section has them), the keywords then changing
        what it says. ``host`` and ``token`` go to the task server and the proxy (unless ``proxy`` names its
        own host), ``proxy_port`` is the proxy's ``port``, a ``hold_timeout`` left out or ``None`` is
        ``pause_timeout``, and a ``retry``, ``batch`` or ``signal`` of ``None`` is the default."""
        values: dict[str, Any] = dict(keywords)
        known = DaemonKeywords.__optional_keys__
        unknown = sorted(set(values) - known)
        if unknown:
            close = difflib.get_close_matches(unknown[0], known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"AgentDaemon got an unexpected keyword argument {unknown[0]!r}{hint}")
        for name in ("retry", "batch", "signal", "sampling_parameters", "backend_nodes"):
            if name in values and values[name] is None:
                del values[name]
        given = with_aliases({name: values.pop(name) for name in list(values) if name in _PROXY_KEYWORDS})
        if "proxy_port" in values:
            given["port"] = values.pop("proxy_port")
        section = values.pop("proxy", None)
        base = section.settings() if isinstance(section, ProxyConfig) else dict(section or {})
        for shared in ("host", "token"):
            if shared in values and not (shared == "host" and "host" in base):
                given[shared] = values[shared]
        proxy = ProxyConfig.from_mapping({**base, **given})
        store = {name: values.pop(name) for name in _STORE_KEYWORDS if name in values}
        return cls(proxy=proxy, store=StoreConfig(**store), **values)


class DaemonKeywords(ProxyPolicySettings, total=False):
    """:class:`AgentDaemon`'s keywords (its documented options), each of which goes to one field of
    :class:`DaemonConfig` or of one of its parts (:meth:`DaemonConfig.from_keywords`): the proxy's settings
    (:class:`~aglverl.proxy.config.ProxyPolicySettings`, every field of its config but these three) by their
    own names, and these."""

    host: str
    port: int
    proxy_port: int
    token: str | None
    proxy: ProxyConfig | Mapping[str, Any] | None
    backends: Sequence[str]
    model: str
    sampling_parameters: Mapping[str, Any] | None
    llm_resource: Literal["proxy", "plain"]
    lease_seconds: float
    max_attempts: int
    step_timeout: float | None
    max_failed_groups: int
    vocab_size: int | None
    batch: BatchConfig | None
    signal: SignalConfig | None
    journal_path: str | os.PathLike[str] | None
    journal_fsync: bool
    freeze_gc: bool
    proxy_shards: ShardCount
    backend_nodes: Mapping[str, str] | None
    agent_lightning: AgentLightningSettings | None
    allow_unauthenticated: bool


#: The keywords that are settings of the proxy (:class:`ProxyConfig`'s fields, same names, and their old names).
_PROXY_KEYWORDS = POLICY_FIELDS | ALIASES.keys()
#: The keywords that are settings of the store (``StoreConfig``'s fields, same names).
_STORE_KEYWORDS = ("lease_seconds", "max_attempts", "vocab_size")


# ---------------------------------------------------------------------------------------------- the daemon
class AgentDaemon:
    """The embeddable control plane. All arguments are keyword-only.

    The settings come either as ``config`` (a :class:`DaemonConfig`) or as keywords (not both), each keyword
    one setting (:class:`DaemonKeywords`, :meth:`DaemonConfig.from_keywords`):

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
    - the LLM proxy's settings: every field of :class:`~aglverl.proxy.config.ProxyConfig` (its meaning in
      :class:`~aglverl.proxy.LLMProxy`) is a keyword of the same name (``retry``, ``request_timeout``,
      ``pause_timeout``, ``hold_timeout``, ``max_body_bytes``, ``sampling_mismatch``, ``token_in``, ``overload``,
      ...), or they come together as ``proxy`` (a ``ProxyConfig``, or a mapping of its fields such as a run's
      ``aglverl.proxy:`` section), the keywords then changing what it says; ``proxy_port`` is its ``port``.
      ``sampling_mismatch``: what the proxy does with a call that sets other sampling parameters than its
      rollout's ``main_llm`` names: ``"refuse"`` (400 naming the parameter) or ``"mask"`` (kept, recorded
      ``off_policy``, its rows kept out of the loss); parameters a call omits are filled in either way.
      ``token_in`` (default on): a chat call whose messages extend an earlier call's messages + answer is
      generated from that call's exact ids, so a conversation an agent re-sends as text trains as one row
      (:mod:`aglverl.proxy.tokenin`). ``overload``: when the proxy turns first calls away with a 429
      (:class:`~aglverl.proxy.overload.OverloadPolicy`).
    - ``token``: bearer token required by the task server and the proxy.
    - ``freeze_gc``: at start, move every object that exists (the imported libraries) out of the cyclic garbage
      collector's reach (``gc.freeze()``), so full collections no longer stall the loop for ~0.4 s; it affects
      the whole process, so an embedding application that manages the collector itself can turn it off.
    - ``journal_path``: a write-ahead journal; every accepted result is in it before the agent hears "ok", and
      a daemon started on the same file recovers the unfinished steps (only their unfinished rollouts are
      handed out again, with this daemon's resources: a recovered ``main_llm`` points at the live proxy) and
      the producer's groups in flight. ``journal_fsync``: also ``fsync`` before answering (survives power
      loss, not just a killed process).
    - ``max_failed_groups``: with a producer, stop after this many training groups in a row whose every
      rollout failed (default 0: never).
    - ``agent_lightning``: what Agent Lightning v1.0's API on the task server (:attr:`agent_lightning`) should
      know of the run (:class:`~aglverl.agl10.config.AgentLightningSettings`: the rollouts' controller config,
      the reward of an attempt without a reward event, whether a trainer owns the models and the gate, whether
      ``POST /api/rollouts`` queues work, the bounds on what the API keeps).
    - ``allow_unauthenticated``: serve on a ``host`` that is not loopback without a ``token`` (refused otherwise).
    - ``proxy_shards``: ``1`` (default): one :class:`~aglverl.proxy.LLMProxy` in this process, on
      ``proxy_port``; ``N`` or ``"per_node"``: that many proxies as Ray actors (Ray initialised in this process
      first), each its own process beside the inference servers, serving on its node's address, every rollout
      attempt pinned to one of them (:mod:`aglverl.proxy.shards`, ``docs/scaling.md``); ``backend_nodes`` (backend URL
      -> Ray node id) says where the backends run, to place the shards beside them (``"per_node"``: one per
      such node; without it, one per alive node). :attr:`proxy` is then a :class:`~aglverl.proxy.shards.ProxyShards`.

    Beside the settings: ``trajectory_sink``: where finished prompt groups go
    (:class:`~aglverl.trajectory.groups.GroupSink`); with it the daemon runs a
    :class:`~aglverl.trajectory.groups.TrajectoryProducer` (:attr:`producer`), and ``step_timeout`` bounds each
    group. ``registry``: where the metrics go (a new one by default).
    """

    def __init__(
        self,
        *,
        config: DaemonConfig | None = None,
        trajectory_sink: GroupSink | None = None,
        registry: Registry | None = None,
        max_buffered_batches: int = 1,
        **settings: Unpack[DaemonKeywords],
    ) -> None:
        if max_buffered_batches != 1:
            warnings.warn(
                "AgentDaemon(max_buffered_batches=...) has no effect: a finished step's batch waits in its step "
                "until the trainer receives it from AgentDaemon.batches",
                DeprecationWarning,
                stacklevel=2,
            )
        if config is not None and settings:
            raise TypeError(
                f"AgentDaemon takes config=DaemonConfig(...) or its settings as keywords, not both: "
                f"{', '.join(settings)}"
            )
        #: Every setting this daemon runs with.
        self.config = config = config if config is not None else DaemonConfig.from_keywords(**settings)
        self.registry = registry or Registry()
        self.store = TaskStore(config.store, registry=self.registry)
        self.server = TaskServer(self.store, host=config.host, port=config.port, token=config.token)
        #: The LLM proxy: in this process, or its shards on Ray (``proxy_shards``).
        self.proxy: ProxyControl
        if config.proxy_shards == 1:
            self.proxy = LLMProxy(
                self.store,
                config.proxy,
                backends=config.backends,
                registry=self.registry,
                sampling_of=self._sampling_of,
            )
            # what the proxy keeps per attempt (stored Responses) goes when the rollout finishes; a shard
            # learns it from the store's revocation of the attempt instead
            self.store.on_attempt(self.proxy.attempt_changed)
        else:
            shards = ProxyShards(
                self.store,
                config.proxy,
                count=config.proxy_shards,
                backends=config.backends,
                backend_nodes=config.backend_nodes,
                sampling_of=self._sampling_of,
                registry=self.registry,
                freeze_gc=config.freeze_gc,
            )
            self.store.pinning = shards
            self.server.metrics_sources.append(shards.metrics_text)
            self.proxy = shards
        self.store.on_forget(self.proxy.forget)
        self._sampling_cache: dict[str, Mapping[str, Any] | None] = {}
        self._previous_proxy: str | None = None  # the proxy URL of the run whose journal this daemon replayed
        self.collector = RolloutCollector(
            self.store, batch=config.batch, signal=config.signal, step_timeout=config.step_timeout
        )
        journal_path = config.journal_path
        self.journal = Journal(journal_path, fsync=config.journal_fsync) if journal_path is not None else None
        #: The trajectory producer (with a ``trajectory_sink``): prompts in, finished groups to the sink.
        self.producer: TrajectoryProducer | None = None
        if trajectory_sink is not None:
            self.producer = TrajectoryProducer(
                self.store,
                trajectory_sink,
                batch=config.batch,
                signal=config.signal,
                group_timeout=config.step_timeout,
                weight_version=lambda: self.proxy.weight_version,
                journal=self.journal is not None,
                registry=self.registry,
                max_failed_groups=config.max_failed_groups,
            )
        self._stack: AsyncExitStack | None = None
        #: Agent Lightning v1.0's routes on the task server (:mod:`aglverl.agl10`).
        self.agent_lightning = AgentLightningAPI(
            self,
            token=config.token,
            settings=config.agent_lightning
            or AgentLightningSettings(
                trainer_owns_gate=trajectory_sink is not None, accept_rollouts=trajectory_sink is None
            ),
            max_body_bytes=self.server.max_body_bytes,
        )
        self.server.add_routes(self.agent_lightning.routes())
        if isinstance(self.proxy, LLMProxy):
            # on this loop: the hop takes the proxy's overload decision first, the proxy the hop's rules
            self.agent_lightning.hop.attach(self.proxy)

    @property
    def model(self) -> str:
        """The model name the ``main_llm`` resource names."""
        return self.config.model

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
        if self.config.freeze_gc:
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
        params = dict(self.config.sampling_parameters if sampling_parameters is None else sampling_parameters)
        if self.config.llm_resource == "plain":
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
                logger.info(
                    "resources %s recovered from the journal now use the proxy at %s",
                    update.resources_id,
                    live,
                )

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

    # The gate and the figures, for the proxy in this process or every shard (the same calls either way).
    async def pause_calls(self) -> None:
        """Hold new LLM calls and return once the calls in flight have finished (:meth:`LLMProxy.pause`; with
        shards, on every shard at once, returning when the slowest has drained)."""
        await self.proxy.pause()

    async def hold_calls(self) -> None:
        """Hold new LLM calls without draining those in flight (:meth:`LLMProxy.hold`; with shards, returns
        once every shard holds)."""
        await self.proxy.hold()

    async def resume_calls(self, weight_version: int | None = None) -> None:
        """End a pause or hold under ``weight_version`` (default: the current one + 1) (:meth:`LLMProxy.resume`;
        with shards, returns once every shard has resumed)."""
        await self.proxy.resume(weight_version)

    async def hold_for_update(self, drain: bool) -> None:
        """Before a weight update: stop the store's lease clock, then hold the agents' LLM calls.

        An agent waiting in a held call keeps its task however long the update takes (its lease does not run).
        ``drain``: new calls wait and the calls in flight finish first (:meth:`pause_calls`: the update frees
        the engines, e.g. puts them to sleep); else new calls wait and those in flight go on
        (:meth:`hold_calls`: the update aborts their generations, and the proxy continues each one after it).
        Returns once the proxy (every shard) holds, and with ``drain`` once the calls in flight ended.
        Cancellation leaves the leases frozen and the calls held: :meth:`release_after_update` undoes both.
        """
        self.store.freeze_leases()
        if drain:
            await self.proxy.pause()
        else:
            await self.proxy.hold()

    async def release_after_update(self, weight_version: int | None = None) -> None:
        """After a weight update: the held calls go on under ``weight_version`` (default: the current one + 1),
        then the lease clock restarts (each lease keeps the time it had left when it stopped). Shielded from
        cancellation: once called, both happen."""
        with anyio.CancelScope(shield=True):
            await self.proxy.resume(weight_version)
            self.store.thaw_leases()

    async def commit_journal(self) -> None:
        """Return once everything accepted so far is durable by the journal's policy (at once without one)."""
        await self.store.commit()

    @property
    def weight_version(self) -> int:
        """The weight version the proxy records on calls whose backend reports none (:meth:`resume_calls`
        moves it on; a trainer that resumes at step k sets it to k)."""
        return self.proxy.weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self.proxy.weight_version = version

    async def refresh_proxy_figures(self) -> None:
        """With shards: fetch every shard's counters and busy intervals (one call each, in parallel), which
        :meth:`proxy_counters`, :meth:`generated_tokens` and :attr:`proxy_activity` then read; with the proxy in
        this process they are always current and this returns at once."""
        await self.proxy.refresh()

    def proxy_counters(self) -> dict[str, float]:
        """The LLM proxy's cumulative counters since start, under ``proxy/*`` names (with shards: their sum, as
        of :meth:`refresh_proxy_figures`)."""
        return self.proxy.counters()

    def generated_tokens(self) -> float:
        """Response token ids the proxy recorded since start (with shards: as of :meth:`refresh_proxy_figures`)."""
        return self.proxy.generated_tokens()

    @property
    def proxy_activity(self) -> BusyTimeline:
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
