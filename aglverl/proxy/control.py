"""What the daemon needs of the LLM proxy, whether it runs in this process or as shards on Ray.

:class:`ProxyControl` is implemented by :class:`~aglverl.proxy.LLMProxy` (one proxy on the daemon's loop) and
:class:`~aglverl.proxy.shards.ProxyShards` (the driver of N proxies in Ray actors): the daemon holds one and
never asks which. Every gate operation is awaited the same way: the shards' are broadcasts that return once
every shard applied them; the proxy in this process applies ``hold`` and ``resume`` when they are called and
returns :data:`APPLIED`, an awaitable that finishes at once (its own callers, a trainer driving one proxy, may
leave it unawaited).
"""

from __future__ import annotations

from collections.abc import Awaitable, Generator, Mapping, Sequence
from typing import Any, Protocol

import anyio
from anyio.abc import TaskStatus

from ..models import ProxyLLM

__all__ = ["APPLIED", "GAUGES", "Applied", "BusyTimeline", "ProxyControl"]

#: Of :meth:`ProxyControl.counters`' figures, those that are readings, not counts (the event loop's lag now):
#: shards report their largest, not a sum, and a step reports the reading, not a difference.
GAUGES = frozenset({"proxy/loop_lag_seconds"})


class Applied:
    """An operation that took effect when it was called, as an awaitable that finishes at once (no checkpoint:
    awaiting it cannot be cancelled half-way, there is nothing left to do)."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, None]:
        return
        yield  # a generator that yields nothing: ``await`` returns None at once

    def __repr__(self) -> str:
        return "APPLIED"


#: The one :class:`Applied` value.
APPLIED = Applied()


class BusyTimeline(Protocol):
    """When at least one LLM call was in flight: the proxy's own timeline, or the union of its shards'."""

    def busy_intervals(self, start: float, stop: float) -> list[tuple[float, float]]: ...


class ProxyControl(Protocol):
    """The LLM proxy as the daemon drives it (see the module docstring). All on the daemon's loop."""

    @property
    def url(self) -> str:
        """The base URL of the proxy (with shards: the first shard's); valid once serving."""
        ...

    @property
    def serving(self) -> bool:
        """Whether :attr:`url` is known."""
        ...

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; ``task_status.started()`` once calls are accepted."""
        ...

    def pause(self) -> Awaitable[None]:
        """Hold new calls and finish once the calls in flight have drained (a weight update that frees the
        engines)."""
        ...

    def hold(self) -> Awaitable[None]:
        """Hold new calls without draining those in flight (an update that aborts and resumes generations)."""
        ...

    def resume(self, weight_version: int | None = None) -> Awaitable[None]:
        """End a pause or hold under ``weight_version`` (default: the current one + 1)."""
        ...

    @property
    def weight_version(self) -> int:
        """The weight version recorded on calls whose backend reports none."""
        ...

    @weight_version.setter
    def weight_version(self, version: int) -> None: ...

    def refresh(self) -> Awaitable[None]:
        """Bring :meth:`counters`, :meth:`generated_tokens` and :attr:`activity` up to date (shards: one call
        each; in this process they always are)."""
        ...

    def counters(self) -> dict[str, float]:
        """The cumulative ``proxy/*`` counters since start (as of :meth:`refresh`)."""
        ...

    def generated_tokens(self) -> float:
        """Response token ids recorded since start (as of :meth:`refresh`)."""
        ...

    @property
    def activity(self) -> BusyTimeline:
        """When calls were in flight (as of :meth:`refresh`)."""
        ...

    def llm_resource(self, model: str, sampling_parameters: Mapping[str, Any] | None = None) -> ProxyLLM:
        """The ``main_llm`` resource agents get (per-attempt URLs on the proxy)."""
        ...

    def set_backends(self, backends: Sequence[str]) -> None:
        """Replace the inference servers calls go to."""
        ...

    def forget(self, rollout_ids: Sequence[str]) -> None:
        """Drop the per-rollout state of rollouts that are over."""
        ...
