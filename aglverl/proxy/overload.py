"""Overload: how late the proxy's event loop runs, and new calls turned away with a 429 while it runs too late.

One proxy process carries a few hundred calls a second (``benchmarks/RESULTS.md``); past that, every call it
admits makes every other one slower, its memory grows with the calls waiting, and nothing tells the agents to
back off. :class:`Overload` measures the loop's lag and, while the lag is over the policy's ``max_lag``, turns
NEW calls away (:meth:`Overload.check`, called by :class:`~aglverl.proxy.admission.Admission` before it reads
a body): a share of them that grows with the excess, ``(lag - max_lag) / max_lag``, all of them at twice the
limit, so that the calls admitted settle near what the loop can carry instead of swinging between all and
none. A call turned away gets a 429 with ``Retry-After`` in its agent's API (chat completions, Responses,
Messages; the openai and anthropic SDKs retry a 429 after the delay the headers give, ``retry-after-ms``
first, twice by default). Calls already admitted are never refused or dropped: they run to their end;
internal requests (continuations of aborted generations, token-in steps) are not calls and are not checked.
Nothing is turned away while fewer than ``min_in_flight`` calls are in flight: a loop made late by something
else (a stall of the process, other work on its loop, a machine short of CPU) with few calls has none to shed.

The measure (:meth:`Overload.start` / :meth:`Overload.stop`, by :meth:`LLMProxy.serve
<aglverl.proxy.LLMProxy.serve>`): a timer callback due every ``probe_interval`` seconds notes how late the loop
ran it (the time the loop spent on other callbacks past the due time; idle, the epoll timeout's millisecond
rounding). It is a measurement, not a wait: nothing waits on it. Its cost is one timer callback per probe:
on an idle loop, where each probe also wakes the loop, 62-78 µs of a slow shared VM's core a probe, so
0.12-0.16 % of a core at the default 20 probes a second (``benchmarks/proxy_overload.py``, ``probe_cost``); on
a busy loop a probe rides a loop turn that runs anyway. The lag is a time-weighted moving average of the probes
over ``window`` seconds: a stall moves it by its share of the window. With no call in flight the probe rests (an
idle proxy has nothing to shed, and a timer would wake its loop 20 times a second for nothing: 1.5-2.2 ms of
CPU a second, 15-22 µs a call at 100 calls/s): a probe that finds no call in flight schedules no next one, and
the next call's admission starts it again, the lag having decayed as if every probe in between had been on time
(an idle loop is not late). A stall while no call is in flight is therefore not measured.

Exposed: :attr:`Overload.lag` (seconds, the moving average) and :meth:`Overload.statistics`, the gauge
``aglverl_proxy_loop_lag_seconds``, the histogram ``aglverl_proxy_loop_lag_probe_seconds`` (each probe's
lateness), the counters ``aglverl_proxy_loop_overloaded_seconds_total`` (time the lag was over the limit,
refusing or not) and ``aglverl_proxy_calls_shed_total`` (calls answered 429); the trainer's step metrics get
them as ``proxy/loop_lag_seconds``, ``proxy/loop_overloaded_seconds`` and ``proxy/calls_shed``
(:meth:`LLMProxy.counters <aglverl.proxy.LLMProxy.counters>`).

The policy (:class:`OverloadPolicy`, frozen) is the proxy's ``overload`` setting (``LLMProxy(store,
overload=OverloadPolicy(max_lag=0.5))``, ``AgentDaemon(overload=...)``, or ``proxy.reconfigure(overload=...)``
while serving), read at each probe and check, so a new one holds from the next call on;
``OverloadPolicy(refuse=False)`` measures and reports but never refuses. Nothing here awaits anything; :meth:`Overload.check` raises
:class:`~aglverl.proxy.call.ProxyError` (429); a policy with a value that is not a positive number of seconds
is a ``ValueError`` naming it.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..metrics import Registry
from .call import ProxyError

__all__ = ["UNDER_WAY_KEPT", "LagStatistics", "Overload", "OverloadPolicy"]

#: Rollouts whose attempt under way is remembered at most (as the pool's sticky rollouts): far more than can be
#: in flight at once; the store forgets finished ones anyway.
UNDER_WAY_KEPT = 100_000


@dataclass(frozen=True, slots=True)
class LagStatistics:
    """:meth:`Overload.statistics`: the lag now (seconds, smoothed), the probes so far and their lateness summed
    (seconds), the seconds the lag was over ``max_lag``, the calls answered 429."""

    lag: float
    probes: int
    late_seconds: float
    overloaded_seconds: float
    shed: int


@dataclass(frozen=True, kw_only=True)
class OverloadPolicy:
    """When the proxy turns new calls away (see :mod:`aglverl.proxy.overload`).

    ``max_lag``: the loop's lag (seconds, averaged over ``window``) past which new calls are turned away, a
    share ``(lag - max_lag) / max_lag`` of them; the default, 0.1 s, is tens of times what the loop shows at
    loads the proxy keeps up with, and below where its calls wait on each other for seconds
    (``benchmarks/proxy_overload.py``). ``min_in_flight``: turn nothing away while fewer calls are in flight.
    ``refuse``: ``False`` measures and reports the lag only. ``retry_after``: the delay agents are asked to
    wait (``Retry-After``, whole seconds rounded up, and ``retry-after-ms`` spread by up to ±50 %, so that the
    agents turned away at once do not all come back at once). ``probe_interval``: seconds between two probes of
    the loop; ``window``: the seconds the lag is averaged over.
    """

    max_lag: float = 0.1
    min_in_flight: int = 8
    refuse: bool = True
    retry_after: float = 1.0
    probe_interval: float = 0.05
    window: float = 0.5

    def __post_init__(self) -> None:
        for name in ("max_lag", "retry_after", "probe_interval", "window"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"OverloadPolicy.{name} must be a positive number of seconds, got {value!r}")
        if type(self.min_in_flight) is not int or self.min_in_flight < 0:
            raise ValueError(
                f"OverloadPolicy.min_in_flight must be an integer >= 0, got {self.min_in_flight!r}"
            )


class Overload:
    """The loop's lag, measured while the proxy serves, and the 429 for new calls while it is over the limit
    (see the module docstring). Registers its series in ``registry``."""

    def __init__(
        self,
        registry: Registry,
        policy: OverloadPolicy | None = None,
        in_flight: Callable[[], int] | None = None,
    ) -> None:
        #: The calls in flight now (the probe rests while there are none); ``None``: it never rests.
        self._in_flight = in_flight
        self._rested_at: float | None = None  # when the probe found no call in flight and stopped
        #: The loop's lag, seconds: the probes' lateness, time-weighted average over ``policy.window``.
        self.lag = 0.0
        #: Read at each probe and decision; assign a new one to change it (it holds from the next call on).
        self.policy = policy or OverloadPolicy()
        # The rollouts with an attempt under way (a call of it admitted), and that attempt: its later calls are
        # never turned away. Dropped when the store forgets the rollout; bounded besides (ids nobody forgets,
        # such as unknown ones, age out).
        self._under_way: dict[str, str] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._late_total = 0.0
        registry.gauge(
            "aglverl_proxy_loop_lag_seconds",
            "How late the proxy's event loop runs a timer (seconds), averaged over the overload window.",
            lambda: self.lag,
        )
        self.m_probes = registry.histogram(
            "aglverl_proxy_loop_lag_probe_seconds", "How late the event loop ran each lag probe (seconds)."
        )
        self.m_overloaded = registry.counter(
            "aglverl_proxy_loop_overloaded_seconds_total",
            "Seconds the event loop's lag was over the overload limit (max_lag), new calls refused or not.",
        )
        self.m_shed = registry.counter(
            "aglverl_proxy_calls_shed_total",
            "New calls answered 429 (Retry-After) because the proxy's event loop was overloaded.",
        )

    @property
    def shedding(self) -> bool:
        """Whether new calls are being turned away (a share of them): refusing on and the lag over the limit."""
        policy = self.policy
        return policy.refuse and self.lag > policy.max_lag

    def statistics(self) -> LagStatistics:
        """The figures so far, as a small frozen record (a reader diffs two of them for a period)."""
        return LagStatistics(
            lag=self.lag,
            probes=self.m_probes.count,
            late_seconds=self._late_total,
            overloaded_seconds=self.m_overloaded.value(),
            shed=int(self.m_shed.value()),
        )

    @property
    def overloaded(self) -> bool:
        """Whether the lag is over the policy's limit now."""
        return self.lag > self.policy.max_lag

    # ------------------------------------------------------------------ the probe
    def start(self) -> None:
        """Start probing on the running loop (the proxy serves); the lag starts from 0."""
        self.stop()
        self._loop = asyncio.get_running_loop()
        self.lag = 0.0
        self._schedule(self._loop.time())

    def stop(self) -> None:
        """Stop probing; the lag keeps its last value."""
        self._rested_at = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wake(self) -> None:
        """A call arrives while the probe rests: the lag decays over the rest (the idle loop was on time) and
        the probe starts again."""
        assert self._loop is not None and self._rested_at is not None
        now = self._loop.time()
        self.lag *= math.exp(-(now - self._rested_at) / self.policy.window)
        self._rested_at = None
        self._schedule(now)

    def _schedule(self, now: float) -> None:
        assert self._loop is not None
        self._due = now + self.policy.probe_interval
        self._timer = self._loop.call_at(self._due, self._probe)

    def _probe(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        late = max(0.0, now - self._due)
        policy = self.policy
        elapsed = policy.probe_interval + late  # since the previous probe
        self.m_probes.observe(late)
        self._late_total += late
        if self.lag > policy.max_lag:
            self.m_overloaded.inc(elapsed)
        self.lag += (1.0 - math.exp(-elapsed / policy.window)) * (late - self.lag)
        if self._in_flight is not None and self._in_flight() == 0:
            self._timer, self._rested_at = None, now  # nothing to shed: the next call starts it again
            return
        self._schedule(now)

    # ------------------------------------------------------------------ admission
    def refuses(self, in_flight: int, rollout_id: str | None, attempt_id: str | None) -> bool:
        """Whether a call is to be turned away now: a call of a rollout attempt under way never is; a new one is
        while shedding with at least ``min_in_flight`` calls in flight, drawn in the share to turn away
        (counted); a new call let in puts its attempt under way. The one decision of every path that refuses
        (:meth:`admit`, at a request's head, and Agent Lightning's hop)."""
        if self._rested_at is not None:
            self._wake()
        if rollout_id is not None and self._under_way.get(rollout_id) == attempt_id:
            return False
        policy = self.policy
        if (
            self.shedding
            and in_flight >= policy.min_in_flight
            and random.random() < (self.lag - policy.max_lag) / policy.max_lag
        ):  # past the limit by a share of it, that share of new calls is turned away
            self.m_shed.inc()
            return True
        if rollout_id is not None and attempt_id is not None:
            under_way = self._under_way
            under_way[rollout_id] = attempt_id
            if len(under_way) > UNDER_WAY_KEPT:
                del under_way[next(iter(under_way))]
        return False

    def admit(self, in_flight: int, rollout_id: str | None = None, attempt_id: str | None = None) -> None:
        """:meth:`refuses` as a handler answers it: a 429 :class:`~aglverl.proxy.call.ProxyError` with
        ``Retry-After`` for a call turned away, nothing for a call let in."""
        if not self.refuses(in_flight, rollout_id, attempt_id):
            return
        policy = self.policy
        delay = policy.retry_after * random.uniform(0.5, 1.5)
        headers = {
            "Retry-After": str(math.ceil(policy.retry_after)),
            "retry-after-ms": str(round(delay * 1e3)),
        }
        raise ProxyError(
            429,
            f"the LLM proxy is overloaded: its event loop runs {self.lag * 1e3:.0f} ms late (limit "
            f"{policy.max_lag * 1e3:.0f} ms) with {in_flight} calls in flight; the call was not forwarded: retry "
            f"after {delay:.1f}s",
            headers=headers,
        )

    def check(self, in_flight: int) -> None:
        """:meth:`admit` for a call of no rollout (the name this had before rollouts under way were known)."""
        self.admit(in_flight)

    def under_way(self, rollout_id: str, attempt_id: str) -> bool:
        """Whether a call of this rollout attempt was let in (its later calls are never turned away)."""
        return self._under_way.get(rollout_id) == attempt_id

    def forget(self, rollout_ids: Iterable[str]) -> None:
        """Drop rollouts that are over from the attempts under way."""
        for rollout_id in rollout_ids:
            self._under_way.pop(rollout_id, None)
