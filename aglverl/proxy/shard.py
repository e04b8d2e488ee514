"""A proxy shard: one :class:`~aglverl.proxy.LLMProxy` in a process of its own (a Ray actor), admitting calls
from a table the store pushes and keeping their records until the store takes them.

The driver side is :class:`aglverl.proxy.shards.ProxyShards`; this module is what runs in the shard's process and
imports nothing of Ray (the driver wraps :class:`ProxyShard` with ``ray.remote``). Who sends what:

- :meth:`ProxyShard.start` (once per process; Ray re-runs the constructor after a restart, and the driver calls
  ``start`` again) binds the proxy on the node's address and returns ``(url, incarnation, boot_id)``.
- :meth:`ProxyShard.apply` takes a batch of table changes, in the order the driver made them: ``("a",
  rollout_id, attempt_id, sampling)`` admits an attempt pinned here, ``("r", rollout_id, attempt_id)`` revokes
  it (its rollout ended, or the claim was undone): its unshipped records are dropped, and once a rollout has no
  attempt left here its routing state and token-in sessions go too (``LLMProxy.forget``). ``("b", backends)``
  replaces the backends. The driver keeps one ``apply`` in flight per shard, so batches arrive in order.
- :meth:`ProxyShard.sync` replaces the whole table, the gate and the backends (a restarted shard starts empty);
  its gate is ignored when a newer gate operation came first.
- :meth:`ProxyShard.take` hands over the records of one attempt's calls and ends the attempt here (the store
  takes them when the attempt posts its result, or its rollout fails).
- :meth:`ProxyShard.gate` applies ``pause`` / ``hold`` / ``resume`` / ``version``; each carries a sequence
  number and one older than the last applied is ignored (Ray does not order an async actor's calls).
- :meth:`ProxyShard.figures` and :meth:`ProxyShard.metrics_text`: the shard's counters, busy timeline and
  Prometheus text, read by the driver on demand; :meth:`ProxyShard.wait_death` never returns: the driver keeps
  one pending, and its failure is how the driver learns that this process died.

Admission is a dict lookup in :class:`ShardTable`, which is the proxy's
:class:`~aglverl.proxy.store_view.ProxyStore`: an attempt the table admits goes on; one revoked because its
rollout ended is a 409; anything else a 404 (never forwarded).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import anyio

from ..metrics import Registry
from ..store import LLMCall, StepEnded, UnknownAttempt, UnknownRollout
from .app import LLMProxy
from .config import ProxyConfig

__all__ = ["GateOp", "ProxyShard", "ShardRestarted", "ShardTable", "boot_id"]

logger = logging.getLogger(__name__)

#: How many ended attempts a shard remembers, to answer their late calls with a 409 rather than a 404.
_ENDED = 100_000

GateOp = Literal["pause", "hold", "resume", "version"]
#: A table change: ``("a", rollout_id, attempt_id, sampling)``, ``("r", rollout_id, attempt_id)`` or
#: ``("b", backends)``.
TableOp = tuple[Any, ...]


class ShardRestarted(RuntimeError):
    """A table change or a take meant for an earlier incarnation of this shard (the process died and Ray
    restarted it before the driver noticed): refused, so that the driver voids that incarnation's attempts
    instead of reading an empty table as "no calls"."""


def boot_id() -> str:
    """This machine's boot id: two processes that report the same one share ``time.monotonic``'s clock."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return f"{os.uname().nodename}:{uuid.getnode()}"


class ShardTable:
    """The attempts pinned to one shard and their calls' records: the shard proxy's
    :class:`~aglverl.proxy.store_view.ProxyStore`. Single loop; every method returns at once.

    ``forget(rollout_ids)`` is called when the last attempt of a rollout here is revoked (the proxy's
    routing state and token-in sessions of that rollout go with it), ``ended(rollout_id, attempt_id)`` when
    any attempt is (it makes no more calls here: what the proxy keeps for it, its stored responses, goes).
    """

    def __init__(self, vocab_size: int | None, shard: int) -> None:
        self._vocab_size = vocab_size
        self.shard = shard
        self._attempts: dict[str, dict[str, list[LLMCall]]] = {}  # rollout -> attempt -> unshipped records
        self._sampling: dict[str, Mapping[str, Any] | None] = {}
        self._ended: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.forget: Any = None
        self.ended: Any = None
        #: Calls admitted so far (:meth:`ProxyShard.calls_admitted` waits for a count).
        self.calls = 0
        self._counted: anyio.Event | None = None

    # ------------------------------------------------------------------ ProxyStore
    @property
    def vocab_size(self) -> int | None:
        return self._vocab_size

    def check_attempt(self, rollout_id: str, attempt_id: str) -> None:
        attempts = self._attempts.get(rollout_id)
        if attempts is not None and attempt_id in attempts:
            self.calls += 1
            if self._counted is not None:
                self._counted.set()
                self._counted = None
            return
        if (rollout_id, attempt_id) in self._ended:
            raise StepEnded(f"attempt {attempt_id!r} of rollout {rollout_id!r} has ended")
        if attempts is not None:
            raise UnknownAttempt(
                f"attempt {attempt_id!r} of rollout {rollout_id!r} is not pinned to proxy shard {self.shard}"
            )
        raise UnknownRollout(f"rollout {rollout_id!r} has no attempt pinned to proxy shard {self.shard}")

    def record_calls(self, rollout_id: str, attempt_id: str, calls: Sequence[LLMCall]) -> bool:
        records = self._attempts.get(rollout_id, {}).get(attempt_id)
        if records is None:
            return False
        records.extend(calls)
        return True

    def sampling_of(self, rollout_id: str) -> Mapping[str, Any] | None:
        """The sampling parameters the rollout's trainer expects, as the store sent them with its attempt."""
        return self._sampling.get(rollout_id)

    async def wait_calls(self, at_least: int) -> int:
        """Return once ``at_least`` calls were admitted in all (an event per admission, no polling)."""
        while self.calls < at_least:
            if self._counted is None:
                self._counted = anyio.Event()
            await self._counted.wait()
        return self.calls

    # ------------------------------------------------------------------ the driver's side
    def __len__(self) -> int:
        return sum(map(len, self._attempts.values()))

    def admit(self, rollout_id: str, attempt_id: str, sampling: Mapping[str, Any] | None) -> None:
        self._attempts.setdefault(rollout_id, {}).setdefault(attempt_id, [])
        self._sampling[rollout_id] = sampling
        self._ended.pop((rollout_id, attempt_id), None)

    def revoke(self, rollout_id: str, attempt_id: str) -> None:
        attempts = self._attempts.get(rollout_id)
        if attempts is None or attempts.pop(attempt_id, None) is None:
            return
        self._ended[(rollout_id, attempt_id)] = None
        if len(self._ended) > _ENDED:
            self._ended.popitem(last=False)
        if self.ended is not None:
            self.ended(rollout_id, attempt_id)
        if not attempts:
            del self._attempts[rollout_id]
            del self._sampling[rollout_id]
            if self.forget is not None:
                self.forget([rollout_id])

    def take(self, rollout_id: str, attempt_id: str) -> list[LLMCall]:
        """The attempt's records, handed over; the attempt ends here (a later call of it is a 409, and a call
        still in flight finds its records refused, as the store refuses a finished rollout's)."""
        records = self._attempts.get(rollout_id, {}).get(attempt_id)
        if records is None:
            return []
        self.revoke(rollout_id, attempt_id)
        return records

    def replace(self, admitted: Iterable[tuple[str, str, Mapping[str, Any] | None]]) -> None:
        """The whole table at once (after a restart): everything not in ``admitted`` is revoked."""
        wanted = {(rid, aid): sampling for rid, aid, sampling in admitted}
        for rid, attempts in list(self._attempts.items()):
            for aid in list(attempts):
                if (rid, aid) not in wanted:
                    self.revoke(rid, aid)
        for (rid, aid), sampling in wanted.items():
            self.admit(rid, aid, sampling)


class ProxyShard:
    """One proxy shard's process (the driver makes it a Ray actor: ``ray.remote(ProxyShard)``).

    ``index``: the shard's number (labels, messages); ``vocab_size``: bound for recorded ids; ``config``: the
    proxy's settings (:class:`~aglverl.proxy.config.ProxyConfig`), but its address: the shard serves on ``host``
    (``None``: the node's address as Ray reports it) and a port of its own. ``freeze_gc``: as :class:`~aglverl.daemon.AgentDaemon`'s.
    Every method runs on the actor's event loop (uvloop in a Ray worker that has it).
    """

    def __init__(
        self,
        index: int,
        *,
        vocab_size: int | None = None,
        config: ProxyConfig | None = None,
        host: str | None = None,
        freeze_gc: bool = True,
    ) -> None:
        self.index = index
        self.incarnation = uuid.uuid4().hex
        if host is None:
            import ray

            host = ray.util.get_node_ip_address()
        self.freeze_gc = freeze_gc
        self.registry = Registry()
        self.table = ShardTable(vocab_size, index)
        self.proxy = LLMProxy(
            self.table,
            dataclasses.replace(config or ProxyConfig(), host=host, port=0),
            registry=self.registry,
            sampling_of=self.table.sampling_of,
        )
        self.table.forget = self.proxy.forget
        self.table.ended = self.proxy.attempt_ended
        self.registry.gauge(
            "aglverl_proxy_shard_attempts",
            "Attempts pinned to this proxy shard now.",
            lambda: len(self.table),
        )
        self._gate_seq = -1
        self._serving: asyncio.Task[None] | None = None
        self._started: asyncio.Future[str] | None = None

    # ------------------------------------------------------------------ life cycle
    async def start(self) -> tuple[str, str, str]:
        """Serve the proxy (once; later calls return at once): ``(url, incarnation, boot_id)``.

        The proxy binds ``host``, or the node's address as Ray reports it. The serving task lives as long as
        the process (or until :meth:`stop`).
        """
        if self._started is None:
            self._started = asyncio.get_running_loop().create_future()
            self._serving = asyncio.ensure_future(self._serve(self._started))
        url = await asyncio.shield(self._started)
        return url, self.incarnation, boot_id()

    async def _serve(self, started: asyncio.Future[str]) -> None:
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self.proxy.serve)
                if self.freeze_gc:
                    gc.collect()
                    gc.freeze()
                started.set_result(self.proxy.url)
        except BaseException as exc:
            if not started.done():
                started.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
            raise

    async def stop(self) -> None:
        """Stop serving: in-flight calls get the proxy's ``shutdown_grace``, then the listener closes."""
        if self._serving is not None:
            self._serving.cancel()
            await asyncio.gather(self._serving, return_exceptions=True)

    async def wait_death(self) -> None:
        """Never returns: the driver keeps one call pending and learns of this process's death by its error."""
        await asyncio.Event().wait()

    # ------------------------------------------------------------------ table
    def _check(self, incarnation: str) -> None:
        if incarnation != self.incarnation:
            raise ShardRestarted(
                f"proxy shard {self.index} was restarted (incarnation {self.incarnation}, not {incarnation})"
            )

    async def apply(self, incarnation: str, ops: Sequence[TableOp]) -> None:
        """Apply table changes in order (see the module docstring); :class:`ShardRestarted` if meant for an
        earlier incarnation."""
        self._check(incarnation)
        table = self.table
        for op in ops:
            kind = op[0]
            if kind == "a":
                table.admit(op[1], op[2], op[3])
            elif kind == "r":
                table.revoke(op[1], op[2])
            elif kind == "b":
                self.proxy.set_backends(op[1])
            else:  # pragma: no cover - the driver sends nothing else
                raise ValueError(f"unknown table op {kind!r}")

    async def sync(
        self,
        incarnation: str,
        admitted: Sequence[tuple[str, str, Mapping[str, Any] | None]],
        backends: Sequence[str],
        gate: tuple[int, str, int],
    ) -> None:
        """Replace the table, the backends and the gate (``(seq, "open" | "paused" | "held", version)``); the gate
        only if no newer gate operation was applied (one the driver broadcast meanwhile may come first)."""
        self._check(incarnation)
        self.table.replace(admitted)
        self.proxy.set_backends(backends)
        seq, state, version = gate
        if seq < self._gate_seq:
            return
        self._gate_seq = seq
        self.proxy.weight_version = version
        if state == "paused":
            await self.proxy.pause()
        elif state == "held":
            self.proxy.hold()

    async def take(self, incarnation: str, rollout_id: str, attempt_id: str) -> list[LLMCall]:
        """The records of the attempt's calls, handed over once; the attempt ends here. :class:`ShardRestarted`
        if meant for an earlier incarnation (its records died with it)."""
        self._check(incarnation)
        return self.table.take(rollout_id, attempt_id)

    # ------------------------------------------------------------------ gate
    async def gate(self, seq: int, op: GateOp, version: int | None = None) -> bool:
        """Apply a gate operation unless a newer one was applied already; ``pause`` returns once drained.

        Returns whether it was applied.
        """
        if seq < self._gate_seq:
            return False
        self._gate_seq = seq
        if op == "pause":
            await self.proxy.pause()
        elif op == "hold":
            self.proxy.hold()
        elif op == "resume":
            self.proxy.resume(version)
        elif op == "version":
            assert version is not None
            self.proxy.weight_version = version
        else:  # pragma: no cover - the driver sends nothing else
            raise ValueError(f"unknown gate op {op!r}")
        return True

    # ------------------------------------------------------------------ figures
    async def figures(self, since: float) -> dict[str, Any]:
        """Counters, generated tokens, and the busy intervals since ``since`` (this process's monotonic clock,
        clipped to now), with ``now`` on that clock; the calls in flight and the gate's state now."""
        now = time.monotonic()
        return {
            "incarnation": self.incarnation,
            "counters": self.proxy.counters(),
            "generated": self.proxy.m_generated.value(),
            "busy": self.proxy.activity.busy_intervals(since, now),
            "now": now,
            "in_flight": self.proxy.in_flight,
            "gate": "paused" if self.proxy.paused else "held" if self.proxy.held else "open",
        }

    async def metrics_text(self) -> str:
        """The shard's Prometheus text (its registry rendered)."""
        return self.registry.render()

    async def calls_admitted(self, at_least: int = 0) -> int:
        """How many calls the table admitted, once at least ``at_least`` were (to know calls reached this shard,
        e.g. before a gate is opened; bound the wait on the caller's side)."""
        return await self.table.wait_calls(at_least)

    async def pid(self) -> int:
        """This process's id."""
        return os.getpid()
