"""Proxy shards on Ray: several :class:`~aglverl.proxy.LLMProxy` processes beside the rollout replicas, driven
from the daemon's event loop (``AgentDaemon(proxy_shards=N | "per_node")``; design and costs in
``docs/scaling.md``).

Each shard is a Ray actor (:class:`aglverl.proxy.shard.ProxyShard`): its own process and event loop, pinned to a
node with a node-affinity strategy, serving on that node's address, fronting that node's replicas (all of them
when none is known to be there). :class:`ProxyShards` is the driver's side, on the daemon's loop:

- **Pinning.** When the store hands out an attempt (:meth:`ProxyShards.pin`) it goes to the shard with the
  fewest attempts in flight; the task's ``resources_id`` names that shard's copy of its resources
  (``<id>@shard<k>-<epoch>``, the ``main_llm`` endpoint rebased on the shard's URL), so an Agent Lightning client
  that fetches its task's resources by id calls its own shard. All the attempt's calls go there.
- **The table.** The attempt's admission ``(rollout_id, attempt_id, sampling parameters)`` and, when it ends,
  its revocation go to the shard in batches: one ``apply`` call in flight per shard, carrying everything queued
  since the last one (at least one loop iteration's worth). :meth:`TaskStore.claim` returns the task once its
  admission has arrived (:meth:`ProxyShards.admitted`), so an agent's first call never races it.
- **Records.** A shard keeps its calls' records; the store takes an attempt's (:meth:`ProxyShards.take`, one
  round trip) before it accepts the attempt's result, or before a failed rollout's waiters hear of it. A take
  is bounded (:attr:`ProxyShards.take_timeout`): a shard alive but hung voids the attempt as a dead one does,
  so neither ``POST /rollout`` nor a failed rollout's step waits for it for ever.
- **The gate.** :meth:`pause`, :meth:`hold`, :meth:`resume` and the weight version go to every shard that is not
  gone, in parallel, one being restarted included (Ray holds the call for its new process), each with a
  sequence number (Ray does not order an async actor's calls; a shard ignores an older one, the gate sent with
  its table included); ``pause`` returns when the slowest shard has drained. A shard that (re)starts gets the
  gate's state with its table.
- **Figures.** :meth:`refresh` fetches every serving shard's counters and busy intervals (one call each); then
  :meth:`counters`, :meth:`generated_tokens` and :attr:`activity` read the sums and the union.
  :meth:`metrics_text` renders every shard's registry, labelled ``shard="<k>"``, for ``/metrics``.
- **Death.** One ``wait_death`` call per shard stays pending; it fails when the process dies. Then every
  attempt pinned to that incarnation is void (:meth:`TaskStore.attempts_lost`: requeued, a new attempt on
  another shard; a late result refused), Ray restarts the actor (``max_restarts``), and once it serves again it
  gets its table (the attempts pinned to it since), the backends and the gate. Any call that finds the actor
  gone (a take, a push, a gate, a figures or metrics call) starts the same path for the process it was sent to
  (a call sent before a death whose error arrives after the restart voids nothing more); a take or push that
  reaches a restarted process the driver has not noticed yet is refused by it
  (:class:`~aglverl.proxy.shard.ShardRestarted`), never read as "no calls". A shard out of restarts stays gone;
  when every shard is gone the daemon stops with :class:`ShardsGone`.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import anyio.to_thread
from anyio.abc import TaskGroup, TaskStatus

from ..metrics import Registry
from ..models import LLM, ProxyLLM, ResourcesUpdate
from ..store import AttemptLost, LLMCall, TaskStore
from .config import ProxyConfig
from .control import GAUGES
from .shard import GateOp, ProxyShard, ShardRestarted, TableOp, boot_id

__all__ = [
    "SHARD_MAX_RESTARTS",
    "TAKE_TIMEOUT",
    "ProxyShards",
    "ShardCount",
    "ShardsGone",
    "check_shard_count",
    "place_shards",
]

logger = logging.getLogger(__name__)

#: How many times Ray restarts a shard's process before the shard is given up.
SHARD_MAX_RESTARTS = 8
#: Busy intervals kept per shard for the activity timeline (seconds), as :class:`~aglverl.metrics.ActivityTimeline`.
ACTIVITY_KEEP_SECONDS = 3600.0
#: Bound on one take of an attempt's records (seconds): one round trip, milliseconds when the shard answers.
TAKE_TIMEOUT = 30.0
#: Bound on stopping the shards' proxies (their in-flight calls' grace included) when the daemon stops.
_STOP_TIMEOUT = 10.0
#: The mark between a resources id and the shard it was copied for.
_COPY_MARK = "@shard"

ShardCount = int | Literal["per_node"]
#: The gate operation that puts a shard in the gate's state.
_REGATE: dict[str, GateOp] = {"open": "resume", "held": "hold", "paused": "pause"}


class ShardsGone(RuntimeError):
    """Every proxy shard died and ran out of restarts: no LLM call can be served."""


def check_shard_count(value: Any, name: str = "proxy_shards") -> ShardCount:
    """``value`` if it is an integer >= 1 or ``"per_node"``; else a ``ValueError`` naming ``name``."""
    if value == "per_node" or (type(value) is int and value >= 1):
        return value
    raise ValueError(f"{name} must be an integer >= 1 or 'per_node', got {value!r}")


def place_shards(count: ShardCount, backend_nodes: Mapping[str, str] | None = None) -> list[str]:
    """The Ray node id of each shard (blocking: asks Ray for its alive nodes).

    The nodes are those hosting the backends (``backend_nodes``: backend URL -> node id) that are alive, or,
    when none is known, every alive node. ``"per_node"``: one shard on each; ``N``: N shards round-robin over them.
    """
    import ray

    alive = [node["NodeID"] for node in ray.nodes() if node.get("Alive")]
    hosting = [node for node in dict.fromkeys((backend_nodes or {}).values()) if node in alive]
    nodes = hosting or alive
    if not nodes:
        raise RuntimeError("the Ray cluster has no alive node to place proxy shards on")
    if count == "per_node":
        return nodes
    return [nodes[i % len(nodes)] for i in range(count)]


@dataclass(slots=True, eq=False)
class _Pin:
    """An attempt pinned to a shard; ``ready`` is set once the shard admitted it (or it was lost)."""

    shard: _Shard
    epoch: int
    sampling: Mapping[str, Any] | None
    ready: anyio.Event = field(default_factory=anyio.Event)
    lost: bool = False


@dataclass(slots=True, eq=False)
class _Shard:
    """The driver's view of one shard. ``epoch`` counts the deaths noticed: a pin made in epoch e belongs to the
    process that serves after the e-th death."""

    index: int
    node: str
    actor: Any
    backends: list[str]
    url: str = ""
    incarnation: str = ""
    epoch: int = 0
    up: bool = False
    gone: bool = False
    pins: dict[tuple[str, str], _Pin] = field(default_factory=dict)
    ops: list[TableOp] = field(default_factory=list)
    wake: anyio.Event = field(default_factory=anyio.Event)
    # figures: this incarnation's last counters, those of earlier incarnations summed, busy intervals
    offset: float = 0.0
    seen_incarnation: str = ""
    counters: dict[str, float] = field(default_factory=dict)
    retired: dict[str, float] = field(default_factory=dict)
    busy: deque[tuple[float, float]] = field(default_factory=deque)
    busy_since: float = 0.0


def _add(into: dict[str, float], values: Mapping[str, float]) -> None:
    for key, value in values.items():
        into[key] = into.get(key, 0.0) + value


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


class _Activity:
    """The union of the shards' busy intervals, as :meth:`ActivityTimeline.busy_intervals` gives one process's
    (as of the last :meth:`ProxyShards.refresh`)."""

    def __init__(self, shards: Sequence[_Shard]) -> None:
        self._shards = shards

    def busy_intervals(self, start: float, stop: float) -> list[tuple[float, float]]:
        spans = (span for shard in self._shards for span in shard.busy)
        return [(max(a, start), min(b, stop)) for a, b in _union(spans) if b > start and a < stop]


def _labelled(text: str, shard: int) -> dict[str, tuple[list[str], list[str]]]:
    """A Prometheus text's families by name: (HELP/TYPE lines, samples with ``shard="<k>"`` added)."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    current: tuple[list[str], list[str]] = ([], [])
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                current = families.setdefault(parts[2], ([], []))
                if len(current[0]) < 2:
                    current[0].append(line)
            continue
        head, _, value = line.rpartition(" ")
        if head.endswith("}"):
            name, _, labels = head.partition("{")
            current[1].append(f'{name}{{shard="{shard}",{labels} {value}')
        else:
            current[1].append(f'{head}{{shard="{shard}"}} {value}')
    return families


class ProxyShards:
    """The LLM proxy as ``count`` shards on Ray (see the module docstring); the store's
    :class:`~aglverl.store.AttemptPinning`. Serve it with ``await tg.start(shards.serve)`` on the store's loop,
    with Ray initialised in this process.

    ``config``: the shards' settings (:class:`~aglverl.proxy.config.ProxyConfig`: policy, token, timeouts...;
    each shard serves on its node's address and a port of its own), handed whole to every shard.
    ``backends``: every inference server; ``backend_nodes`` (backend URL -> Ray node id) places the shards
    beside them and gives each the backends of its node. ``sampling_of(rollout_id)``: the sampling parameters
    sent with each admission. ``registry``: where the driver's own figures go (restarts, round trips).
    :attr:`take_timeout` bounds a take of an attempt's records (:meth:`take`); set it on the instance.
    Implements :class:`~aglverl.proxy.control.ProxyControl`, as the proxy in this process does.
    """

    #: Seconds a take of an attempt's records may take before the attempt is void (:meth:`take`).
    take_timeout: float = TAKE_TIMEOUT

    def __init__(
        self,
        store: TaskStore,
        config: ProxyConfig | None = None,
        *,
        count: ShardCount,
        backends: Sequence[str] = (),
        backend_nodes: Mapping[str, str] | None = None,
        sampling_of: Callable[[str], Mapping[str, Any] | None] | None = None,
        registry: Registry | None = None,
        freeze_gc: bool = True,
        max_restarts: int = SHARD_MAX_RESTARTS,
    ) -> None:
        self.store = store
        self.count = check_shard_count(count)
        self.backend_list = list(backends)
        self.backend_nodes = dict(backend_nodes or {})
        self.config = config or ProxyConfig()
        self.sampling_of = sampling_of
        self.freeze_gc = freeze_gc
        self.max_restarts = max_restarts
        self.shards: list[_Shard] = []
        self._pins: dict[tuple[str, str], _Pin] = {}
        self._urls: set[str] = set()  # every URL a shard ever served on (resources name them)
        self._copies: dict[str, tuple[ResourcesUpdate, ResourcesUpdate]] = {}
        self._gate_seq = itertools.count()
        self._gate_issued = -1  # the last broadcast's sequence number
        self._gate_state: Literal["open", "paused", "held"] = "open"
        self._version = 0
        self._tg: TaskGroup | None = None
        self._boot = boot_id()
        self.activity = _Activity(self.shards)
        self._all_up: anyio.Event | None = None  # exists while someone waits in wait_up()
        self._register_metrics(registry or Registry())

    def _register_metrics(self, r: Registry) -> None:
        r.gauge(
            "aglverl_proxy_shards_up", "Proxy shards serving now.", lambda: sum(s.up for s in self.shards)
        )
        self.m_restarts = r.counter(
            "aglverl_proxy_shard_restarts_total", "Proxy shard processes that died and served again."
        )
        self.m_start = r.histogram("aglverl_proxy_shard_start_seconds", "A shard's actor start to serving.")
        self.m_push = r.histogram(
            "aglverl_proxy_shard_push_seconds", "Round trip of one batch of table changes to a shard."
        )
        self.m_ops = r.counter("aglverl_proxy_shard_table_ops_total", "Table changes sent to the shards.")
        self.m_take = r.histogram(
            "aglverl_proxy_shard_take_seconds",
            "Round trip of one take of an attempt's records from its shard.",
        )
        self.m_taken = r.counter(
            "aglverl_proxy_shard_records_taken_total", "Call records taken from the shards."
        )
        self.m_take_timeouts = r.counter(
            "aglverl_proxy_shard_take_timeouts_total",
            "Takes of an attempt's records that a shard did not answer within take_timeout (the attempt voided).",
        )
        self.m_gate = r.histogram(
            "aglverl_proxy_shard_gate_seconds",
            "A gate operation's broadcast to every shard (pause: to drained).",
        )

    # ------------------------------------------------------------------ life cycle
    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start the shards (in parallel; each serving once ``started``), keep them, stop them on cancellation.

        Raises ``RuntimeError`` when Ray is not initialised in this process, and what a shard's start raises
        (e.g. its port could not be bound). On cancellation (shielded, bounded): each shard's proxy stops as
        :meth:`LLMProxy.serve` does, then its process is ended.
        """
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if not ray.is_initialized():
            raise RuntimeError(
                "proxy_shards > 1 runs the LLM proxy as Ray actors: call ray.init() (or run under AsyncVERL) first"
            )
        nodes = await anyio.to_thread.run_sync(place_shards, self.count, self.backend_nodes)
        remote = ray.remote(ProxyShard)
        try:
            for index, node in enumerate(nodes):
                actor = remote.options(
                    num_cpus=0,
                    max_restarts=self.max_restarts,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                ).remote(
                    index, vocab_size=self.store.vocab_size, config=self.config, freeze_gc=self.freeze_gc
                )
                self.shards.append(_Shard(index, node, actor, self._backends_of(node)))
            async with anyio.create_task_group() as tg:
                self._tg = tg
                async with anyio.create_task_group() as starting:
                    for shard in self.shards:
                        starting.start_soon(self._start, shard)
                for shard in self.shards:
                    tg.start_soon(self._push, shard)
                logger.info("LLM proxy shards serving: %s", ", ".join(s.url for s in self.shards))
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._tg = None
            with anyio.CancelScope(shield=True):
                await self._stop()

    async def _start(self, shard: _Shard) -> None:
        started = time.monotonic()
        shard.url, shard.incarnation, boot = await shard.actor.start.remote()
        gate = self._gate()
        await shard.actor.sync.remote(shard.incarnation, [], shard.backends, gate)
        self.m_start.observe(time.monotonic() - started)
        await self._serving(shard, boot, gate[0])

    async def _serving(self, shard: _Shard, boot: str, synced: int) -> None:
        """The shard serves with the table and gate it was sent (gate operation ``synced``): watch it, and send
        it the gate again if it changed meanwhile (a broadcast skips a shard that is not up yet)."""
        shard.offset = 0.0 if boot == self._boot else math.nan  # estimated at the first refresh
        self._urls.add(shard.url)
        shard.up = True
        assert self._tg is not None
        self._tg.start_soon(self._watch, shard, shard.epoch)
        if self._gate_issued > synced:
            await self._regate(shard)
        self._check_all_up()

    async def _regate(self, shard: _Shard) -> None:
        import ray

        seq, state, version = self._gate()
        op = _REGATE[state]
        epoch = shard.epoch
        try:
            await shard.actor.gate.remote(seq, op, version)
        except ray.exceptions.RayActorError as exc:
            self._lost(shard, epoch, exc)

    def _check_all_up(self) -> None:
        if self._all_up is not None and all(s.up or s.gone for s in self.shards):
            self._all_up.set()
            self._all_up = None

    async def wait_up(self) -> None:
        """Return once every shard that is not gone serves (at once when none is restarting); an event, set
        when the last one comes back. Bound the wait on the caller's side."""
        while not all(s.up or s.gone for s in self.shards):
            if self._all_up is None:
                self._all_up = anyio.Event()
            await self._all_up.wait()

    async def _stop(self) -> None:
        import ray

        with anyio.move_on_after(_STOP_TIMEOUT):
            async with anyio.create_task_group() as tg:
                for shard in self.shards:
                    if shard.up:
                        tg.start_soon(self._stop_one, shard)
        for shard in self.shards:
            ray.kill(shard.actor, no_restart=True)
            shard.up = False

    @staticmethod
    async def _stop_one(shard: _Shard) -> None:
        try:
            await shard.actor.stop.remote()
        except Exception:  # a shard that died meanwhile needs no stopping
            logger.debug("proxy shard %d was gone before it could stop", shard.index)

    def _backends_of(self, node: str) -> list[str]:
        here = [url for url in self.backend_list if self.backend_nodes.get(url) == node]
        return here or list(self.backend_list)

    @property
    def serving(self) -> bool:
        """Whether the shards have started (:attr:`url` is known)."""
        return bool(self.shards) and all(s.url for s in self.shards)

    @property
    def url(self) -> str:
        """The first shard's URL (``/resources/latest`` names it; a claimed task names its own shard's)."""
        if not self.serving:
            raise RuntimeError("the LLM proxy shards are not serving yet")
        return self.shards[0].url

    @property
    def urls(self) -> list[str]:
        """Every shard's URL now, by shard index."""
        return [s.url for s in self.shards]

    def llm_resource(self, model: str, sampling_parameters: Mapping[str, Any] | None = None) -> ProxyLLM:
        """The ``main_llm`` resource on the first shard; each claimed task gets its own shard's copy."""
        return ProxyLLM(
            endpoint=f"{self.url}/rollout/{{rollout_id}}/attempt/{{attempt_id}}/v1",
            model=model,
            sampling_parameters=dict(sampling_parameters or {}),
        )

    def set_backends(self, backends: Sequence[str]) -> None:
        """Replace the inference servers (each shard gets those of its node, or all of them)."""
        self.backend_list = list(backends)
        for shard in self.shards:
            shard.backends = self._backends_of(shard.node)
            self._queue(shard, ("b", shard.backends))

    def forget(self, rollout_ids: Sequence[str]) -> None:
        """Nothing to do: a shard drops a rollout's routing state when its last attempt there is revoked."""

    # ------------------------------------------------------------------ pinning (the store's side)
    def pin(self, rollout_id: str, attempt_id: str, resources_id: str | None) -> str | None:
        """Pin a new attempt to the shard with the fewest attempts in flight; its admission is queued."""
        live = [s for s in self.shards if s.up] or [s for s in self.shards if not s.gone] or self.shards
        shard = min(live, key=lambda s: (len(s.pins), s.index))
        sampling = self.sampling_of(rollout_id) if self.sampling_of is not None else None
        pin = _Pin(shard, shard.epoch, sampling)
        key = (rollout_id, attempt_id)
        self._pins[key] = pin
        shard.pins[key] = pin
        self._queue(shard, ("a", rollout_id, attempt_id, sampling))
        return f"{resources_id}{_COPY_MARK}{shard.index}-{shard.epoch}" if resources_id is not None else None

    async def admitted(self, rollout_id: str, attempt_id: str) -> bool:
        """Return once the attempt's shard has admitted it (``True``) or died first (``False``)."""
        pin = self._pins.get((rollout_id, attempt_id))
        if pin is None:
            return False
        await pin.ready.wait()
        return not pin.lost

    def unpin(self, rollout_id: str, attempt_ids: Iterable[str]) -> None:
        """Revoke ended attempts on their shards (their records not taken are dropped there)."""
        for attempt_id in attempt_ids:
            key = (rollout_id, attempt_id)
            pin = self._pins.pop(key, None)
            if pin is None:
                continue
            pin.ready.set()
            if pin.lost:
                continue
            shard = pin.shard
            shard.pins.pop(key, None)
            self._queue(shard, ("r", rollout_id, attempt_id))

    async def take(self, rollout_id: str, attempt_id: str) -> list[LLMCall] | None:
        """The attempt's records from its shard (one round trip); ``None`` for an attempt not pinned here.

        Raises :class:`~aglverl.store.AttemptLost` when its shard died, or did not answer within
        :attr:`take_timeout` (alive but hung: its loop blocked, its process stopped): the attempt is void then,
        voided in the store here for a shard that did not answer (its revocation queued for when it does). So
        an agent's ``POST /rollout`` gets its 409 ("... is void") after that bound at the latest and its
        rollout is handed out again (or failed after ``max_attempts``), and a failed rollout whose records are
        on that shard settles without them: its step ends.
        """
        pin = self._pins.get((rollout_id, attempt_id))
        if pin is None:
            return None
        await pin.ready.wait()
        shard, epoch = pin.shard, pin.epoch
        if not pin.lost and epoch == shard.epoch:
            import ray

            started = time.monotonic()
            try:
                with anyio.fail_after(self.take_timeout):
                    calls: list[LLMCall] = await shard.actor.take.remote(
                        shard.incarnation, rollout_id, attempt_id
                    )
            except (ray.exceptions.RayActorError, ShardRestarted) as exc:
                self._lost(shard, epoch, exc)
            except TimeoutError:
                self.m_take_timeouts.inc()
                why = (
                    f"proxy shard {shard.index} did not hand over its LLM calls within {self.take_timeout:g}s"
                )
                logger.warning(
                    "%s (attempt %s of rollout %s): the attempt is void", why, attempt_id, rollout_id
                )
                self.unpin(rollout_id, [attempt_id])
                self.store.attempts_lost([(rollout_id, attempt_id)], why)
                raise AttemptLost(
                    f"attempt {attempt_id!r} of rollout {rollout_id!r} is void: {why}; the rollout goes on "
                    "without it (handed out again, or failed after its last attempt)"
                ) from None
            else:
                self.m_take.observe(time.monotonic() - started)
                self.m_taken.inc(len(calls))
                return calls
        raise AttemptLost(
            f"attempt {attempt_id!r} of rollout {rollout_id!r} is void: proxy shard {shard.index}, which recorded "
            "its LLM calls, died; the rollout is handed out again"
        )

    def resources(self, resources_id: str) -> ResourcesUpdate | None:
        """A shard's copy of a resources version (the id :meth:`pin` gave), its LLM endpoints on that shard."""
        base_id, mark, tail = resources_id.rpartition(_COPY_MARK)
        index, _, _ = tail.partition("-")
        if not mark or not index.isdigit() or int(index) >= len(self.shards):
            return None
        base = self.store.resources(base_id)
        if base is None:
            return None
        shard = self.shards[int(index)]
        cached = self._copies.get(resources_id)
        if cached is not None and cached[0] is base and self._endpoint_of(cached[1]) in ("", shard.url):
            return cached[1]
        copy = ResourcesUpdate(
            resources_id=resources_id,
            resources={name: self._rebased(resource, shard.url) for name, resource in base.resources.items()},
        )
        self._copies[resources_id] = (base, copy)
        return copy

    def _rebased(self, resource: Any, url: str) -> Any:
        if not isinstance(resource, LLM):
            return resource
        for old in self._urls:
            if resource.endpoint == old or resource.endpoint.startswith(old + "/"):
                return resource.model_copy(update={"endpoint": url + resource.endpoint[len(old) :]})
        return resource

    def _endpoint_of(self, update: ResourcesUpdate) -> str:
        for resource in update.resources.values():
            if isinstance(resource, LLM):
                for old in self._urls:
                    if resource.endpoint.startswith(old + "/"):
                        return old
        return ""

    # ------------------------------------------------------------------ the table, pushed
    def _queue(self, shard: _Shard, op: TableOp) -> None:
        shard.ops.append(op)
        shard.wake.set()

    async def _push(self, shard: _Shard) -> None:
        """Send the shard's queued table changes, one batch in flight at a time (so they arrive in order)."""
        import ray

        while True:
            await shard.wake.wait()
            shard.wake = anyio.Event()
            if not shard.up or not shard.ops:
                continue
            ops, shard.ops = shard.ops, []
            epoch = shard.epoch
            started = time.monotonic()
            try:
                await shard.actor.apply.remote(shard.incarnation, ops)
            except (ray.exceptions.RayActorError, ShardRestarted) as exc:
                self._lost(shard, epoch, exc)
                continue
            self.m_push.observe(time.monotonic() - started)
            self.m_ops.inc(len(ops))
            for op in ops:
                if (
                    op[0] == "a"
                    and (pin := self._pins.get((op[1], op[2]))) is not None
                    and pin.epoch == epoch
                ):
                    pin.ready.set()

    # ------------------------------------------------------------------ death
    async def _watch(self, shard: _Shard, epoch: int) -> None:
        """Wait, without polling, for the shard's process to die (its pending ``wait_death`` call fails)."""
        import ray

        try:
            await shard.actor.wait_death.remote()
        except ray.exceptions.RayActorError as exc:
            self._lost(shard, epoch, exc)

    def _lost(self, shard: _Shard, epoch: int, cause: BaseException) -> None:
        """The shard's process of ``epoch`` is gone: void its attempts, then bring it back (once per death)."""
        if epoch != shard.epoch or shard.gone:
            return
        shard.epoch += 1
        shard.up = False
        shard.ops.clear()
        lost = [key for key, pin in shard.pins.items() if pin.epoch == epoch]
        for key in lost:
            pin = shard.pins.pop(key)
            pin.lost = True
            pin.ready.set()
        reason = f"proxy shard {shard.index} at {shard.url} died ({type(cause).__name__})"
        logger.warning("%s: %d attempts pinned to it are void and handed out again", reason, len(lost))
        self.store.attempts_lost(lost, reason)
        if self._tg is not None:
            self._tg.start_soon(self._recover, shard)

    async def _recover(self, shard: _Shard) -> None:
        """Wait for Ray to restart the shard, then give it its table, backends and gate, and watch it again."""
        import ray

        epoch = shard.epoch
        started = time.monotonic()
        try:
            url, incarnation, boot = await shard.actor.start.options(max_task_retries=-1).remote()
        except ray.exceptions.RayActorError:
            self._gone(shard)
            return
        except Exception:  # restarted, but its proxy cannot serve (e.g. no port): give it up
            logger.exception("proxy shard %d was restarted but could not serve", shard.index)
            ray.kill(shard.actor, no_restart=True)
            self._gone(shard)
            return
        if epoch != shard.epoch:
            return  # it died again meanwhile; that death brings it back
        shard.url, shard.incarnation = url, incarnation
        admitted = list(shard.pins.items())
        shard.ops.clear()  # the table sent now covers them
        gate = self._gate()
        try:
            await shard.actor.sync.remote(
                incarnation, [(rid, aid, pin.sampling) for (rid, aid), pin in admitted], shard.backends, gate
            )
        except (ray.exceptions.RayActorError, ShardRestarted) as exc:
            self._lost(shard, epoch, exc)
            return
        if epoch != shard.epoch:
            return
        for _, pin in admitted:
            pin.ready.set()
        self.m_restarts.inc()
        self.m_start.observe(time.monotonic() - started)
        logger.warning(
            "proxy shard %d serves again at %s (%d attempts pinned to it)", shard.index, url, len(admitted)
        )
        shard.wake.set()  # table changes queued since the snapshot
        await self._serving(shard, boot, gate[0])

    def _gone(self, shard: _Shard) -> None:
        """The shard ran out of restarts: its attempts are void; with no shard left, the daemon stops."""
        if shard.gone:
            return  # a gate sent to the restarting shard failed as its restart did
        shard.gone, shard.up = True, False
        lost = list(shard.pins)
        for pin in shard.pins.values():
            pin.lost = True
            pin.ready.set()
        shard.pins.clear()
        self.store.attempts_lost(lost, f"proxy shard {shard.index} is gone (out of restarts)")
        logger.error("proxy shard %d is gone: Ray will not restart it again", shard.index)
        self._check_all_up()
        if all(s.gone for s in self.shards):
            raise ShardsGone(
                f"every proxy shard died {self.max_restarts + 1} times; no LLM call can be served"
            )

    # ------------------------------------------------------------------ the gate
    def _gate(self) -> tuple[int, str, int]:
        """The gate's state with a new sequence number, for a shard that (re)starts."""
        return next(self._gate_seq), self._gate_state, self._version

    async def _broadcast(self, op: GateOp, version: int | None = None) -> None:
        import ray

        seq = self._gate_issued = next(self._gate_seq)
        started = time.monotonic()

        async def one(shard: _Shard) -> None:
            epoch = shard.epoch
            try:
                await shard.actor.gate.remote(seq, op, version)
            except ray.exceptions.RayActorError as exc:
                self._lost(shard, epoch, exc)

        async with anyio.create_task_group() as tg:
            for shard in self.shards:
                if not shard.gone:  # a shard being restarted too: its new process may serve any moment
                    tg.start_soon(one, shard)
        self.m_gate.observe(time.monotonic() - started)

    async def pause(self) -> None:
        """Hold new calls on every shard and return once every shard's calls in flight have finished.

        Every shard that is not gone is paused, one being restarted included: the operation waits in Ray for
        its new process (Ray's restart, ~1.3 s after a SIGKILL here), which applies it before or after the table and gate
        the driver sends it, whichever comes first (the older gate is ignored). So no shard admits a call under
        the open gate once this returned, until :meth:`resume`.
        """
        self._gate_state = "paused"
        await self._broadcast("pause")

    async def hold(self) -> None:
        """Hold new calls on every shard without draining (see :meth:`LLMProxy.hold`); returns once all hold."""
        self._gate_state = "held"
        await self._broadcast("hold")

    async def resume(self, weight_version: int | None = None) -> None:
        """End a pause or hold on every shard, under ``weight_version`` (default: the current one + 1)."""
        self._version = self._version + 1 if weight_version is None else weight_version
        self._gate_state = "open"
        await self._broadcast("resume", self._version)

    @property
    def weight_version(self) -> int:
        """The weight version the shards record on calls whose backend reports none."""
        return self._version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self._version = version
        if self._tg is not None:
            self._tg.start_soon(self._broadcast, "version", version)

    # ------------------------------------------------------------------ figures
    async def refresh(self) -> None:
        """Fetch every serving shard's counters and busy intervals (one call each, in parallel)."""
        async with anyio.create_task_group() as tg:
            for shard in self.shards:
                if shard.up:
                    tg.start_soon(self._refresh_one, shard)

    async def _refresh_one(self, shard: _Shard) -> None:
        import ray

        sent, epoch = time.monotonic(), shard.epoch
        try:
            figures = await shard.actor.figures.remote(shard.busy_since)
        except ray.exceptions.RayActorError as exc:
            self._lost(shard, epoch, exc)  # the process asked, not whichever serves when the error arrives
            return
        except ray.exceptions.RayError:  # the figures are reports: a shard that cannot give them is skipped
            logger.warning("proxy shard %d could not report its figures", shard.index, exc_info=True)
            return
        received = time.monotonic()
        if figures["incarnation"] != shard.seen_incarnation:
            if shard.seen_incarnation:
                _add(shard.retired, {k: v for k, v in shard.counters.items() if k not in GAUGES})
            shard.seen_incarnation = figures["incarnation"]
            shard.busy_since = 0.0
            if not math.isfinite(shard.offset) or shard.offset:
                shard.offset = (sent + received) / 2 - figures["now"]  # another machine's monotonic clock
        shard.counters = dict(figures["counters"])
        shard.counters["_generated"] = figures["generated"]
        offset = shard.offset
        shard.busy.extend((a + offset, b + offset) for a, b in figures["busy"])
        shard.busy_since = figures["now"]
        while shard.busy and shard.busy[0][1] < received - ACTIVITY_KEEP_SECONDS:
            shard.busy.popleft()

    def counters(self) -> dict[str, float]:
        """Every shard's ``proxy/*`` counters summed (earlier incarnations included), as of :meth:`refresh`; a
        reading (the loop's lag, :data:`~aglverl.proxy.control.GAUGES`) is the largest shard's."""
        total: dict[str, float] = {}
        for shard in self.shards:
            _add(total, shard.retired)
            _add(total, {k: v for k, v in shard.counters.items() if k not in GAUGES})
        for key in GAUGES:
            total[key] = max((s.counters.get(key, 0.0) for s in self.shards if s.up), default=0.0)
        total.pop("_generated", None)
        return total

    def generated_tokens(self) -> float:
        """Response ids recorded by every shard, as of :meth:`refresh`."""
        return sum(s.retired.get("_generated", 0.0) + s.counters.get("_generated", 0.0) for s in self.shards)

    async def metrics_text(self) -> str:
        """Every serving shard's Prometheus text, one family at a time, each sample labelled ``shard="<k>"``."""
        import ray

        texts: dict[int, str] = {}

        async def one(shard: _Shard) -> None:
            epoch = shard.epoch
            try:
                texts[shard.index] = await shard.actor.metrics_text.remote()
            except ray.exceptions.RayActorError as exc:
                self._lost(shard, epoch, exc)
            except ray.exceptions.RayError:
                logger.warning("proxy shard %d could not render its metrics", shard.index, exc_info=True)

        async with anyio.create_task_group() as tg:
            for shard in self.shards:
                if shard.up:
                    tg.start_soon(one, shard)
        families: dict[str, tuple[list[str], list[str]]] = {}
        for index in sorted(texts):
            for name, (header, samples) in _labelled(texts[index], index).items():
                family = families.setdefault(name, (header, []))
                family[1].extend(samples)
        lines = [line for header, samples in families.values() for line in (*header, *samples)]
        return "\n".join(lines) + "\n" if lines else ""
