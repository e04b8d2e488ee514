"""The gate of proxy shards: pause, hold, resume and the weight version, sent to every shard that is not gone.

:class:`ShardGate` is :class:`~aglverl.proxy.shards.ProxyShards`' part for the gate (the driver's side of
:class:`~aglverl.proxy.gate.Gate` in each shard). Its interface, on the daemon's loop:

- :meth:`ShardGate.pause` / :meth:`ShardGate.hold` / :meth:`ShardGate.resume` — the operation to every shard that
  is not gone, in parallel, one being restarted included (Ray holds the call for its new process), each with a
  sequence number (Ray does not order an async actor's calls; a shard ignores an older one); each returns once
  every shard applied it (``pause``: once the slowest drained). A shard whose process is found gone is reported
  to ``lost``.
- :meth:`ShardGate.snapshot` — the gate's state with a new sequence number, for a shard that (re)starts (sent
  with its table); :attr:`ShardGate.issued` the last broadcast's number: a shard synced with an older snapshot
  gets the gate again (:meth:`ShardGate.regate`).
- :attr:`ShardGate.version` — the weight version the shards record on calls whose backend reports none
  (:meth:`ShardGate.broadcast` ``"version"`` sends a new one).

Cancellation: a broadcast cancelled midway leaves the shards it reached in the new state; the next broadcast or
a shard's restart brings every shard to the gate's state.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Literal

import anyio

from ..metrics import Histogram
from .shard import GateOp
from .shard_handle import Lost, ShardHandle

__all__ = ["ShardGate"]

GateState = Literal["open", "paused", "held"]
#: The gate operation that puts a shard in the gate's state.
_REGATE: dict[GateState, GateOp] = {"open": "resume", "held": "hold", "paused": "pause"}


class ShardGate:
    """The shards' gate (see the module docstring): ``shards`` (the component's list, read at each broadcast),
    ``lost`` (called for a shard whose process was found gone), ``timing`` (each broadcast's duration)."""

    def __init__(self, shards: Sequence[ShardHandle], lost: Lost, timing: Histogram) -> None:
        self._shards = shards
        self._lost = lost
        self._timing = timing
        self._seq = itertools.count()
        #: The last broadcast's sequence number.
        self.issued = -1
        self.state: GateState = "open"
        #: The weight version the shards record on calls whose backend reports none.
        self.version = 0

    def snapshot(self) -> tuple[int, GateState, int]:
        """The gate's state with a new sequence number, for a shard that (re)starts."""
        return next(self._seq), self.state, self.version

    async def regate(self, shard: ShardHandle) -> None:
        """Send ``shard`` the gate's state (a broadcast skipped it while it was not up)."""
        import ray

        seq, state, version = self.snapshot()
        epoch = shard.epoch
        try:
            await shard.actor.gate.remote(seq, _REGATE[state], version)
        except ray.exceptions.RayActorError as exc:
            self._lost(shard, epoch, exc)

    async def broadcast(self, op: GateOp, version: int | None = None) -> None:
        """``op`` to every shard that is not gone, in parallel; returns once all applied it."""
        import ray

        seq = self.issued = next(self._seq)
        started = time.monotonic()

        async def one(shard: ShardHandle) -> None:
            epoch = shard.epoch
            try:
                await shard.actor.gate.remote(seq, op, version)
            except ray.exceptions.RayActorError as exc:
                self._lost(shard, epoch, exc)

        async with anyio.create_task_group() as tg:
            for shard in self._shards:
                if not shard.gone:  # a shard being restarted too: its new process may serve any moment
                    tg.start_soon(one, shard)
        self._timing.observe(time.monotonic() - started)

    async def pause(self) -> None:
        """Hold new calls on every shard and return once every shard's calls in flight have finished.

        Every shard that is not gone is paused, one being restarted included: the operation waits in Ray for
        its new process (Ray's restart, ~1.3 s after a SIGKILL here), which applies it before or after the table
        and gate the driver sends it, whichever comes first (the older gate is ignored). So no shard admits a
        call under the open gate once this returned, until :meth:`resume`.
        """
        self.state = "paused"
        await self.broadcast("pause")

    async def hold(self) -> None:
        """Hold new calls on every shard without draining (see :meth:`LLMProxy.hold`); returns once all hold."""
        self.state = "held"
        await self.broadcast("hold")

    async def resume(self, weight_version: int | None = None) -> None:
        """End a pause or hold on every shard, under ``weight_version`` (default: the current one + 1)."""
        self.version = self.version + 1 if weight_version is None else weight_version
        self.state = "open"
        await self.broadcast("resume", self.version)
