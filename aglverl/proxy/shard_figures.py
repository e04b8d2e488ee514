"""The figures of proxy shards, summed on the driver: counters, generated tokens, busy intervals, metrics.

:class:`ShardFigures` is :class:`~aglverl.proxy.shards.ProxyShards`' part for what the shards report. Its
interface, on the daemon's loop:

- :meth:`ShardFigures.refresh` — every serving shard's counters and busy intervals, one call each, in parallel
  (a shard found dead is reported to ``lost``; one that cannot report is skipped, logged). Busy intervals are
  moved onto this process's monotonic clock (another machine's: the offset estimated at the first report of
  each incarnation) and kept ``ACTIVITY_KEEP_SECONDS``.
- :meth:`ShardFigures.counters` / :meth:`ShardFigures.generated_tokens` — the sums as of the last refresh, the
  counters of earlier incarnations included; a reading (the loop's lag, :data:`~aglverl.proxy.control.GAUGES`)
  is the largest shard's. :attr:`ShardFigures.activity` — the union of the busy intervals.
- :meth:`ShardFigures.metrics_text` — every serving shard's Prometheus text, family by family, each sample
  labelled ``shard="<k>"``.

Cancellation: a refresh or render cancelled midway keeps what arrived; nothing else changes.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence

import anyio

from .control import GAUGES
from .shard_handle import Lost, ShardHandle

__all__ = ["ACTIVITY_KEEP_SECONDS", "ShardFigures"]

logger = logging.getLogger(__name__)

#: Busy intervals kept per shard for the activity timeline (seconds), as :class:`~aglverl.metrics.ActivityTimeline`.
ACTIVITY_KEEP_SECONDS = 3600.0


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
    (as of the last refresh)."""

    def __init__(self, shards: Sequence[ShardHandle]) -> None:
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


class ShardFigures:
    """The shards' figures (see the module docstring): ``shards`` (the component's list, read at each call),
    ``lost`` (called for a shard whose process was found gone)."""

    def __init__(self, shards: Sequence[ShardHandle], lost: Lost) -> None:
        self._shards = shards
        self._lost = lost
        #: The union of the shards' busy intervals (as of the last refresh).
        self.activity = _Activity(shards)

    async def refresh(self) -> None:
        """Fetch every serving shard's counters and busy intervals (one call each, in parallel)."""
        async with anyio.create_task_group() as tg:
            for shard in self._shards:
                if shard.up:
                    tg.start_soon(self._refresh_one, shard)

    async def _refresh_one(self, shard: ShardHandle) -> None:
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
        for shard in self._shards:
            _add(total, shard.retired)
            _add(total, {k: v for k, v in shard.counters.items() if k not in GAUGES})
        for key in GAUGES:
            total[key] = max((s.counters.get(key, 0.0) for s in self._shards if s.up), default=0.0)
        total.pop("_generated", None)
        return total

    def generated_tokens(self) -> float:
        """Response ids recorded by every shard, as of :meth:`refresh`."""
        return sum(s.retired.get("_generated", 0.0) + s.counters.get("_generated", 0.0) for s in self._shards)

    async def metrics_text(self) -> str:
        """Every serving shard's Prometheus text, one family at a time, each sample labelled ``shard="<k>"``."""
        import ray

        texts: dict[int, str] = {}

        async def one(shard: ShardHandle) -> None:
            epoch = shard.epoch
            try:
                texts[shard.index] = await shard.actor.metrics_text.remote()
            except ray.exceptions.RayActorError as exc:
                self._lost(shard, epoch, exc)
            except ray.exceptions.RayError:
                logger.warning("proxy shard %d could not render its metrics", shard.index, exc_info=True)

        async with anyio.create_task_group() as tg:
            for shard in self._shards:
                if shard.up:
                    tg.start_soon(one, shard)
        families: dict[str, tuple[list[str], list[str]]] = {}
        for index in sorted(texts):
            for name, (header, samples) in _labelled(texts[index], index).items():
                family = families.setdefault(name, (header, []))
                family[1].extend(samples)
        lines = [line for header, samples in families.values() for line in (*header, *samples)]
        return "\n".join(lines) + "\n" if lines else ""
