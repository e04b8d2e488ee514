"""Proxy shards on Ray: several :class:`~aglverl.proxy.LLMProxy` processes beside the rollout replicas, driven
from the daemon's event loop (``AgentDaemon(proxy_shards=N | "per_node")``; design and costs in
``docs/scaling.md``).

Each shard is a Ray actor (:class:`aglverl.proxy.shard.ProxyShard`): its own process and event loop, pinned to a
node with a node-affinity strategy, serving on that node's address, fronting that node's replicas (all of them
when none is known to be there). :class:`ProxyShards` is the driver's side, on the daemon's loop: it keeps a
:class:`~aglverl.proxy.shard_handle.ShardHandle` per shard (the pins and table changes of each) and holds three
parts, each handed the shards' list and told of a shard found dead: :class:`~aglverl.proxy.shard_gate.ShardGate`
(the gate), :class:`~aglverl.proxy.shard_figures.ShardFigures` (the figures) and
:class:`~aglverl.proxy.shard_copies.ResourceCopies` (each shard's copy of the resources):

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

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import anyio
import anyio.to_thread
from anyio.abc import TaskGroup, TaskStatus

from ..metrics import Registry
from ..models import ProxyLLM, ResourcesUpdate
from ..store import AttemptLost, LLMCall, TaskStore
from .config import ProxyConfig
from .control import BusyTimeline
from .shard import ProxyShard, ShardRestarted, TableOp, boot_id
from .shard_copies import ResourceCopies
from .shard_figures import ShardFigures
from .shard_gate import ShardGate
from .shard_handle import Pin, ShardHandle

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
#: Bound on one take of an attempt's records (seconds): one round trip, milliseconds when the shard answers.
TAKE_TIMEOUT = 30.0
#: Bound on stopping the shards' proxies (their in-flight calls' grace included) when the daemon stops.
_STOP_TIMEOUT = 10.0

ShardCount = int | Literal["per_node"]


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
        self.shards: list[ShardHandle] = []
        self._pins: dict[tuple[str, str], Pin] = {}
        self._tg: TaskGroup | None = None
        self._boot = boot_id()
        self._all_up: anyio.Event | None = None  # exists while someone waits in wait_up()
        self._register_metrics(registry or Registry())
        #: Its parts, each handed the shards' list and told of a shard found dead (:meth:`_lost`).
        self.gate = ShardGate(self.shards, self._lost, self.m_gate)
        self.figures = ShardFigures(self.shards, self._lost)
        self.copies = ResourceCopies(store, self.shards)

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
                self.shards.append(ShardHandle(index, node, actor, self._backends_of(node)))
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

    async def _start(self, shard: ShardHandle) -> None:
        started = time.monotonic()
        shard.url, shard.incarnation, boot = await shard.actor.start.remote()
        gate = self.gate.snapshot()
        await shard.actor.sync.remote(shard.incarnation, [], shard.backends, gate)
        self.m_start.observe(time.monotonic() - started)
        await self._serving(shard, boot, gate[0])

    async def _serving(self, shard: ShardHandle, boot: str, synced: int) -> None:
        """The shard serves with the table and gate it was sent (gate operation ``synced``): watch it, and send
        it the gate again if it changed meanwhile (a broadcast skips a shard that is not up yet)."""
        shard.offset = 0.0 if boot == self._boot else math.nan  # estimated at the first refresh
        self.copies.served_on(shard.url)
        shard.up = True
        assert self._tg is not None
        self._tg.start_soon(self._watch, shard, shard.epoch)
        if self.gate.issued > synced:
            await self.gate.regate(shard)
        self._check_all_up()

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
    async def _stop_one(shard: ShardHandle) -> None:
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
        pin = Pin(shard, shard.epoch, sampling)
        key = (rollout_id, attempt_id)
        self._pins[key] = pin
        shard.pins[key] = pin
        self._queue(shard, ("a", rollout_id, attempt_id, sampling))
        return self.copies.copy_id(resources_id, shard) if resources_id is not None else None

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
        return self.copies.get(resources_id)

    # ------------------------------------------------------------------ the table, pushed
    def _queue(self, shard: ShardHandle, op: TableOp) -> None:
        shard.ops.append(op)
        shard.wake.set()

    async def _push(self, shard: ShardHandle) -> None:
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
    async def _watch(self, shard: ShardHandle, epoch: int) -> None:
        """Wait, without polling, for the shard's process to die (its pending ``wait_death`` call fails)."""
        import ray

        try:
            await shard.actor.wait_death.remote()
        except ray.exceptions.RayActorError as exc:
            self._lost(shard, epoch, exc)

    def _lost(self, shard: ShardHandle, epoch: int, cause: BaseException) -> None:
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

    async def _recover(self, shard: ShardHandle) -> None:
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
        gate = self.gate.snapshot()
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

    def _gone(self, shard: ShardHandle) -> None:
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

    # ------------------------------------------------------------------ the gate and the figures (parts)
    async def pause(self) -> None:
        """Hold new calls on every shard and return once every shard's calls in flight have finished
        (:meth:`ShardGate.pause`)."""
        await self.gate.pause()

    async def hold(self) -> None:
        """Hold new calls on every shard without draining (see :meth:`LLMProxy.hold`); returns once all hold."""
        await self.gate.hold()

    async def resume(self, weight_version: int | None = None) -> None:
        """End a pause or hold on every shard, under ``weight_version`` (default: the current one + 1)."""
        await self.gate.resume(weight_version)

    @property
    def weight_version(self) -> int:
        """The weight version the shards record on calls whose backend reports none."""
        return self.gate.version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self.gate.version = version
        if self._tg is not None:
            self._tg.start_soon(self.gate.broadcast, "version", version)

    @property
    def activity(self) -> BusyTimeline:
        """The union of the shards' busy intervals, as of :meth:`refresh`."""
        return self.figures.activity

    async def refresh(self) -> None:
        """Fetch every serving shard's counters and busy intervals (one call each, in parallel)."""
        await self.figures.refresh()

    def counters(self) -> dict[str, float]:
        """Every shard's ``proxy/*`` counters summed (:meth:`ShardFigures.counters`), as of :meth:`refresh`."""
        return self.figures.counters()

    def generated_tokens(self) -> float:
        """Response ids recorded by every shard, as of :meth:`refresh`."""
        return self.figures.generated_tokens()

    async def metrics_text(self) -> str:
        """Every serving shard's Prometheus text, one family at a time, each sample labelled ``shard="<k>"``."""
        return await self.figures.metrics_text()
