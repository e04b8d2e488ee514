"""The store's series: registered once in a :class:`~aglverl.metrics.Registry`, counted into by the store.

:class:`StoreMeters` registers what :class:`~aglverl.store.tasks.TaskStore` reports (their names and help texts
are the list): counters and histograms as attributes the store counts into, and four gauges that read the
store's state through the callables it hands over (read when ``/metrics`` is rendered). Nothing here awaits
or fails; registering the same names twice in one registry is the registry's error.
"""

from __future__ import annotations

from collections.abc import Callable

from ..metrics import Counter, Histogram, Registry

__all__ = ["StoreMeters"]


class StoreMeters:
    """The store's series in ``registry``; the keywords read the gauges of the same names: tasks waiting for an
    agent, tasks claimed and unfinished, agents parked in a long-poll, rollouts held in memory."""

    __slots__ = (
        "claimed",
        "completed",
        "failed",
        "ignored",
        "lost",
        "queue_wait",
        "queued",
        "registry",
        "released",
        "requeued",
        "rollout_latency",
    )

    def __init__(
        self,
        registry: Registry,
        *,
        tasks_queued: Callable[[], float],
        tasks_claimed: Callable[[], float],
        agents_waiting: Callable[[], float],
        rollouts_held: Callable[[], float],
    ) -> None:
        r = self.registry = registry
        self.queued: Counter = r.counter("aglverl_tasks_queued_total", "Rollouts queued.")
        self.claimed: Counter = r.counter(
            "aglverl_tasks_claimed_total", "Claims handed to agents (attempts started)."
        )
        self.completed: Counter = r.counter(
            "aglverl_rollouts_completed_total", "Rollouts completed with a result."
        )
        self.failed: Counter = r.counter("aglverl_rollouts_failed_total", "Rollouts failed terminally.")
        self.requeued: Counter = r.counter(
            "aglverl_tasks_requeued_total", "Tasks requeued for a new attempt.", ["reason"]
        )
        self.released: Counter = r.counter(
            "aglverl_tasks_released_total", "Claims returned unused (agent gone)."
        )
        self.lost: Counter = r.counter(
            "aglverl_attempts_lost_total",
            "Attempts voided because the proxy shard recording their calls died.",
        )
        self.ignored: Counter = r.counter(
            "aglverl_results_ignored_total", "Results acknowledged and ignored.", ["reason"]
        )
        self.rollout_latency: Histogram = r.histogram(
            "aglverl_rollout_seconds", "Claim to accepted result, per rollout (seconds)."
        )
        self.queue_wait: Histogram = r.histogram(
            "aglverl_task_queue_seconds", "Enqueue to first claim (seconds)."
        )
        r.gauge("aglverl_tasks_queued", "Tasks waiting for an agent.", tasks_queued)
        r.gauge("aglverl_tasks_claimed", "Tasks claimed and not yet finished.", tasks_claimed)
        r.gauge("aglverl_agents_waiting", "Agents parked in a long-poll.", agents_waiting)
        r.gauge("aglverl_rollouts_held", "Rollouts held in memory.", rollouts_held)
