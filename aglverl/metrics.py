"""A small Prometheus text-format registry (counters, gauges, histograms) and activity timelines; single loop.

The daemon owns one :class:`Registry`; the store, the task server and the proxy register their series in it
and ``GET /metrics`` renders it. Series names and help strings are fixed at registration; label values are
never request contents (no task inputs, no prompts), so ``/metrics`` reveals nothing about the work.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

__all__ = [
    "LATENCY_BUCKETS",
    "ActivityTimeline",
    "Counter",
    "Gauge",
    "Histogram",
    "Registry",
    "overlap_shares",
]

#: Seconds; spans a sub-millisecond proxy hop to a multi-minute agent rollout.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)


def _fmt(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    if float(v).is_integer():
        return str(int(v))
    return repr(float(v))


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{v}"' for n, v in zip(names, values, strict=False)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help
        self.labelnames = tuple(labelnames)

    def _header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def render(self) -> list[str]:  # pragma: no cover - overridden
        raise NotImplementedError


class Counter(_Metric):
    """A monotonically increasing count, optionally split by labels."""

    kind = "counter"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help, labelnames)
        self._values: dict[tuple[str, ...], float] = {}

    def inc(self, amount: float = 1.0, *labels: str) -> None:
        self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, *labels: str) -> float:
        return self._values.get(labels, 0.0)

    def render(self) -> list[str]:
        lines = self._header()
        values = self._values or ({(): 0.0} if not self.labelnames else {})
        for labels, v in values.items():
            lines.append(f"{self.name}{_labels(self.labelnames, labels)} {_fmt(v)}")
        return lines


class Gauge(_Metric):
    """A value read at render time from a callback (queue depth, agents waiting, ...)."""

    kind = "gauge"

    def __init__(self, name: str, help: str, read: Callable[[], float]) -> None:
        super().__init__(name, help)
        self._read = read

    def render(self) -> list[str]:
        return [*self._header(), f"{self.name} {_fmt(self._read())}"]


class Histogram(_Metric):
    """Cumulative-bucket histogram of observations (seconds by default)."""

    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: Iterable[float] = LATENCY_BUCKETS) -> None:
        super().__init__(name, help)
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * (len(self.buckets) + 1)
        self._sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.buckets, value)] += 1
        self._sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = self._header()
        cumulative = 0
        for bound, n in zip((*self.buckets, float("inf")), self._counts, strict=False):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{_fmt(bound)}"}} {cumulative}')
        lines.append(f"{self.name}_sum {_fmt(self._sum)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


class Registry:
    """Named metrics rendered together; registering a name twice returns the existing metric."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}

    def _add(self, metric: _Metric) -> _Metric:
        return self._metrics.setdefault(metric.name, metric)

    def counter(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Counter:
        m = self._add(Counter(name, help, labelnames))
        assert isinstance(m, Counter)
        return m

    def gauge(self, name: str, help: str, read: Callable[[], float]) -> Gauge:
        m = self._add(Gauge(name, help, read))
        assert isinstance(m, Gauge)
        return m

    def histogram(self, name: str, help: str, buckets: Iterable[float] = LATENCY_BUCKETS) -> Histogram:
        m = self._add(Histogram(name, help, buckets))
        assert isinstance(m, Histogram)
        return m

    def render(self) -> str:
        lines: list[str] = []
        for metric in self._metrics.values():
            lines.extend(metric.render())
        return "\n".join(lines) + "\n"


class ActivityTimeline:
    """When something was active, as wall-clock intervals (``time.monotonic``), for busy-share metrics.

    :meth:`begin` / :meth:`end` mark one more / one fewer concurrent activity; the timeline is busy while at
    least one is running. :meth:`busy_intervals` clips the intervals to a window; intervals that ended before
    ``keep_seconds`` ago are dropped, so memory stays bounded over a long run. Single thread (the event loop).
    """

    def __init__(self, keep_seconds: float = 3600.0) -> None:
        self.keep_seconds = keep_seconds
        self._active = 0
        self._since = 0.0
        self._intervals: deque[tuple[float, float]] = deque()

    @property
    def active(self) -> int:
        return self._active

    def begin(self, now: float | None = None) -> None:
        if self._active == 0:
            self._since = time.monotonic() if now is None else now
        self._active += 1

    def end(self, now: float | None = None) -> None:
        if self._active <= 0:
            raise RuntimeError("ActivityTimeline.end() without a matching begin()")
        self._active -= 1
        if self._active == 0:
            now = time.monotonic() if now is None else now
            self._intervals.append((self._since, now))
            while self._intervals and self._intervals[0][1] < now - self.keep_seconds:
                self._intervals.popleft()

    def busy_intervals(self, start: float, stop: float) -> list[tuple[float, float]]:
        """The busy intervals inside ``[start, stop]`` (an activity still running counts up to ``stop``)."""
        spans = list(self._intervals)
        if self._active:
            spans.append((self._since, stop))
        return [(max(a, start), min(b, stop)) for a, b in spans if b > start and a < stop]


def overlap_shares(
    start: float, stop: float, first: Sequence[tuple[float, float]], second: Sequence[tuple[float, float]]
) -> dict[str, float]:
    """How the window ``[start, stop]`` splits between two activities given as disjoint, sorted intervals:
    the shares of time in which only ``first`` ran, only ``second``, both, or neither (they sum to 1)."""
    length = stop - start
    if length <= 0:
        return {"first_only": 0.0, "second_only": 0.0, "both": 0.0, "neither": 0.0}
    a, b = _total(first), _total(second)
    both = _total(_intersect(first, second))
    return {
        "first_only": (a - both) / length,
        "second_only": (b - both) / length,
        "both": both / length,
        "neither": max(0.0, length - a - b + both) / length,
    }


def _total(intervals: Iterable[tuple[float, float]]) -> float:
    return sum(max(0.0, b - a) for a, b in intervals)


def _intersect(
    first: Sequence[tuple[float, float]], second: Sequence[tuple[float, float]]
) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(first) and j < len(second):
        lo, hi = max(first[i][0], second[j][0]), min(first[i][1], second[j][1])
        if hi > lo:
            out.append((lo, hi))
        if first[i][1] < second[j][1]:
            i += 1
        else:
            j += 1
    return out
