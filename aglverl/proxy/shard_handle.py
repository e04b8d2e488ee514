"""The driver's handle on one proxy shard, and an attempt pinned to it: the data :class:`~aglverl.proxy.shards.
ProxyShards` and its parts (:mod:`~aglverl.proxy.shard_gate`, :mod:`~aglverl.proxy.shard_figures`,
:mod:`~aglverl.proxy.shard_copies`) share, on the daemon's loop. Pure data: nothing here awaits.

- :class:`ShardHandle` — one shard: its Ray actor and node, the URL and incarnation it serves as, ``epoch``
  (the deaths noticed so far: a pin made in epoch e belongs to the process that serves after the e-th death),
  whether it is up or gone for good, the attempts pinned to it, the table changes queued for it (``wake`` set
  when there are), and its last figures (counters, busy intervals, the offset of its monotonic clock).
- :class:`Pin` — an attempt pinned to a shard; ``ready`` is set once the shard admitted it, or it was lost
  (``lost``: its shard died first).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio

from .shard import TableOp

__all__ = ["Lost", "Pin", "ShardHandle"]


@dataclass(slots=True, eq=False)
class Pin:
    """An attempt pinned to a shard; ``ready`` is set once the shard admitted it (or it was lost)."""

    shard: ShardHandle
    epoch: int
    sampling: Mapping[str, Any] | None
    ready: anyio.Event = field(default_factory=anyio.Event)
    lost: bool = False


@dataclass(slots=True, eq=False)
class ShardHandle:
    """The driver's view of one shard (see the module docstring)."""

    index: int
    node: str
    actor: Any
    backends: list[str]
    url: str = ""
    incarnation: str = ""
    epoch: int = 0
    up: bool = False
    gone: bool = False
    pins: dict[tuple[str, str], Pin] = field(default_factory=dict)
    ops: list[TableOp] = field(default_factory=list)
    wake: anyio.Event = field(default_factory=anyio.Event)
    # figures: this incarnation's last counters, those of earlier incarnations summed, busy intervals
    offset: float = 0.0
    seen_incarnation: str = ""
    counters: dict[str, float] = field(default_factory=dict)
    retired: dict[str, float] = field(default_factory=dict)
    busy: deque[tuple[float, float]] = field(default_factory=deque)
    busy_since: float = 0.0


#: What a part calls when a call to a shard found its process gone: ``(shard, epoch the call was sent in,
#: the error)`` (:meth:`~aglverl.proxy.shards.ProxyShards.lost`: its attempts voided, the shard brought back).
Lost = Callable[[ShardHandle, int, BaseException], None]
