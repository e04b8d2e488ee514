"""The gate: pause, hold and resume around a weight update, the calls in flight, and every wait on the gate.

:class:`Gate` is what a trainer closes: :meth:`Gate.pause` (hold new calls and wait for the calls in flight to
drain: lockstep training) or :meth:`Gate.hold` (hold new calls, let those in flight go on: the asynchronous
modes, whose engines abort generations to swap weights), and :meth:`Gate.resume` opens, setting the weight
version recorded on calls whose backend reports none. It keeps the calls in flight (:meth:`Gate.enter` /
:meth:`Gate.leave`, and :attr:`Gate.activity`, when at least one was: the backends' busy time) and the calls
waiting at it (two gauges in the registry).

What it awaits, and cancellation:

- :meth:`Gate.admit` — a new call while the gate is closed: up to the longer of ``pause_timeout`` and
  ``hold_timeout`` (a trainer's update may take hours), then :class:`~aglverl.proxy.call.ProxyError` 503
  naming that bound. Cancelled (the agent left), the call simply stops waiting.
- :meth:`Gate.released` / :meth:`Gate.held_back` — a call in flight whose aborted generation waits to continue
  (``held_back`` keeps no backend busy in :attr:`activity` meanwhile, and moves the call's budget on by the
  time held, so that a hold spends none of it). :meth:`Gate.clear_to_retry` adds the retry policy's backoff
  after refusals, and raises a 503 once the budget is spent.
- :meth:`Gate.pause` — the drain: returns when no call is in flight; cancelled, it stops waiting and leaves
  the gate closed (call :meth:`Gate.resume`).

Every wait is an :class:`anyio.Event` under a deadline; nothing polls. Holds the config (the timeouts, read at
each wait) and the meters (``held``, ``resume_failed``).
"""

from __future__ import annotations

import time

import anyio

from ..metrics import ActivityTimeline
from .call import ProxyError
from .config import ProxyConfig
from .meters import Meters

__all__ = ["Gate"]


class Gate:
    """The proxy's gate and its calls in flight (see the module docstring)."""

    def __init__(self, config: ProxyConfig, meters: Meters) -> None:
        self.config = config
        self.meters = meters
        #: When calls were in flight: the backends' busy time as the proxy sees it.
        self.activity = ActivityTimeline()
        #: Model weights version recorded on every call; set or incremented by :meth:`resume`.
        self.weight_version = 0
        self.paused = False
        self.held = False
        self.in_flight = 0
        self.waiting = 0  # calls at the gate now (new ones, and aborted generations waiting to continue)
        self._closed: anyio.Event | None = None  # exists while paused or held; set by resume()
        self._drained: anyio.Event | None = None  # created by a pause() waiting for in-flight calls
        meters.registry.gauge("aglverl_proxy_in_flight", "Calls being forwarded now.", lambda: self.in_flight)
        meters.registry.gauge(
            "aglverl_proxy_waiting_calls",
            "Calls waiting now for a pause or hold to end (new calls, and aborted generations to continue).",
            lambda: self.waiting,
        )

    @property
    def closed(self) -> bool:
        """Whether the gate is closed (paused or held)."""
        return self._closed is not None

    # ------------------------------------------------------------------ the trainer's side
    async def pause(self) -> None:
        """Close the gate and return once no call is in flight (see :meth:`~aglverl.proxy.LLMProxy.pause`)."""
        if not self.paused:
            self.paused = True
            self._close()
        while self.in_flight:
            if self._drained is None:
                self._drained = anyio.Event()
            await self._drained.wait()

    def hold(self) -> None:
        """Close the gate; the calls in flight go on. Idempotent; returns at once."""
        self.held = True
        self._close()

    def resume(self, weight_version: int | None = None) -> None:
        """Open the gate; ``weight_version`` (default: the current one + 1) becomes the proxy's version."""
        self.weight_version = self.weight_version + 1 if weight_version is None else weight_version
        self.paused = self.held = False
        if self._closed is not None:
            self._closed.set()
            self._closed = None

    def _close(self) -> None:
        if self._closed is None:
            self._closed = anyio.Event()

    # ------------------------------------------------------------------ calls in flight
    def enter(self) -> None:
        self.in_flight += 1
        self.activity.begin()

    def leave(self) -> None:
        self.in_flight -= 1
        self.activity.end()
        if self.in_flight == 0 and self._drained is not None:
            self._drained.set()
            self._drained = None

    # ------------------------------------------------------------------ waits
    async def admit(self) -> None:
        """Wait at the closed gate as a new call; :class:`ProxyError` (503) when the wait outlasts its bound."""
        if self._closed is None:
            return
        self.meters.held.inc()
        if not await self.released(time.monotonic() + self.config.pause_timeout):
            waited = max(self.config.pause_timeout, self.config.hold_timeout)  # as released() bounds it
            raise ProxyError(
                503,
                f"the proxy is paused for a weight update for over {waited:g}s (the longer of the proxy's "
                "pause_timeout and hold_timeout)",
            )

    async def released(self, deadline: float) -> bool:
        """Wait until the gate is open; ``False`` if ``deadline`` (monotonic) came first.

        The trainer holds the proxy for as long as its update takes: while closed, the wait lasts up to
        ``hold_timeout`` from now even when ``deadline`` (a ``pause_timeout`` bound) comes earlier."""
        self.waiting += 1
        if self._closed is not None:
            deadline = max(deadline, time.monotonic() + self.config.hold_timeout)
        try:
            with anyio.move_on_after(deadline - time.monotonic()):
                while self._closed is not None:  # a new hold may close a new gate before this task runs again
                    await self._closed.wait()
        finally:
            self.waiting -= 1
        return self._closed is None

    async def held_back(self, deadline: float) -> float | None:
        """:meth:`released` for a call in flight: while it waits, it keeps no backend busy (``activity``).

        Returns ``deadline`` (the call's budget for refusals, monotonic) moved on by the time spent waiting:
        however long a hold lasts (an update longer than ``pause_timeout``), the budget is left whole for
        after it. ``None`` when the wait ended at its own limit, the gate still closed."""
        if self._closed is None:
            return deadline
        self.activity.end()
        since = time.monotonic()
        try:
            if not await self.released(deadline):
                return None
            return deadline + (time.monotonic() - since)
        finally:
            self.activity.begin()

    async def clear_to_retry(self, deadline: float, refusals: int, held_too_long: str, refused: str) -> float:
        """Wait until an aborted generation may be tried again: the gate open (:meth:`held_back`), then, after
        ``refusals`` tries in a row that brought nothing, the retry policy's backoff (bounded by ``deadline``).

        Returns ``deadline`` moved on by the time held. Raises :class:`ProxyError` 503 with the message
        ``held_too_long`` when the gate stayed closed past its bound, ``refused`` when ``deadline`` passed
        (both counted as ``refused`` in ``resume_failed``)."""
        while True:
            moved = await self.held_back(deadline)
            if moved is None:
                self.meters.resume_failed.inc(1, "refused")
                raise ProxyError(503, held_too_long)
            deadline = moved  # a wait for the hold spends none of the budget for refusals
            if not refusals:
                return deadline
            await anyio.sleep(min(self.config.retry.backoff(refusals), max(0.0, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                self.meters.resume_failed.inc(1, "refused")
                raise ProxyError(503, refused)
            if self._closed is None:
                return deadline
