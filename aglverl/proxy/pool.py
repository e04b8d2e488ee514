"""The backend pool: which backend a call goes to, how a try is sent, and when a backend is left alone.

:class:`Pool` holds the backends, the rollouts' sticky backends, the upstream connections (one
:class:`~aglverl.proxy.upstream.Upstream` while serving) and the probes of ejected backends. Its interface:

- :meth:`Pool.pick` — every call of a rollout goes to the backend its first call went to while that backend is
  healthy (vLLM's prefix cache then holds the conversation; the last ``STICKY_ROLLOUTS`` rollouts are
  remembered, LRU); a new rollout, a retry, or a rollout whose backend is ejected, removed or asked to wait by a
  429 goes to the healthy backend with the fewest calls in flight (then the fewest picks). Synchronous.
- :meth:`Pool.send` — one upstream try, awaiting the response head. No response at all (the upstream client's
  :class:`~aglverl.proxy.upstream.ConnectError` or :class:`~aglverl.proxy.upstream.ReadError`) is
  :class:`~aglverl.proxy.call.Unreachable` (safe to retry: nothing reached the agent); a refused connection
  also ejects the backend. ``request_timeout`` before the head is a 504
  (:class:`~aglverl.proxy.call.ProxyError`), and a backend that outlives it ``EJECT_AFTER_TIMEOUTS`` calls in
  a row is ejected too (:meth:`Pool.timed_out` moves the rollout off it at once); an answer that is not
  well-formed HTTP (:class:`~aglverl.proxy.upstream.RemoteProtocolError`) a 502. Cancelled, the request is
  dropped with its connection.
- :meth:`Pool.keep` keeps a retryable 5xx/429 answer (bounded) in case no retry does better and notes a 429's
  ``Retry-After``; :func:`read_bounded` reads a whole body under ``max_response_bytes``. The retry loop
  itself is the relay's (:meth:`~aglverl.proxy.relay.Relay.attempts`); its policy is
  :class:`~aglverl.proxy.config.RetryPolicy`.
- What a backend is: each speaks a :class:`~aglverl.proxy.dialect.Dialect` (``Backend.dialect``,
  :data:`~aglverl.proxy.dialect.DEFAULT` until known). :meth:`Pool.facts` reads its model listing once, at the
  first contact that needs it (the token-in part's first call there, a continuation's context window): the
  cards, and the dialect they name (:func:`~aglverl.proxy.dialect.detect`); :meth:`Pool.context_window` is the
  model's ``max_model_len`` from them.
- Ejection and probes: an ejected backend takes no traffic for ``eject_seconds``; one task per ejected backend
  (in :attr:`Pool.probes`, the serving task group) sleeps until that deadline and probes its dialect's health
  route (``GET /health``); a 200 puts it back, anything else renews the ejection; a removed backend's probe
  stops.
- Life cycle: :meth:`Pool.open` makes the upstream client (idle keep-alive below the backends' own),
  :meth:`Pool.close` closes it with its connections.

Holds the config (timeouts, keep-alive, ``eject_seconds``, read at each use) and the meters (``ejections``).
"""

from __future__ import annotations

import email.utils
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import orjson
from anyio.abc import TaskGroup
from multidict import CIMultiDict
from yarl import URL

from .call import (
    ERROR_BODY_LIMIT,
    JSON,
    Call,
    ProxyError,
    Unreachable,
    error_body,
    forward_headers,
)
from .config import ProxyConfig
from .dialect import DEFAULT, Dialect, detect
from .headers import RESPONSE_DROP
from .meters import Meters
from .sse import EventCut, payloads
from .upstream import ConnectError, ReadError, RemoteProtocolError, Response, Upstream, UpstreamError

logger = logging.getLogger(__name__)

#: Upstream statuses retried on another backend while no byte has reached the agent.
RETRY_STATUSES: frozenset[int] = frozenset({429, 500, 502, 503, 504})

#: Rollouts whose backend is remembered (LRU); far more than can be in flight at once.
STICKY_ROLLOUTS = 100_000
#: Consecutive calls that outlive ``request_timeout`` after which a backend is ejected (and probed).
EJECT_AFTER_TIMEOUTS = 3
#: Seconds a probe may take on top of ``connect_timeout``.
PROBE_READ_TIMEOUT = 2.0


class Backend:
    """One inference server and what routing needs to know about it."""

    __slots__ = (
        "dialect",
        "ejected",
        "ejected_until",
        "facts",
        "facts_retry",
        "in_flight",
        "not_before",
        "picks",
        "probing",
        "reading",
        "removed",
        "timeouts",
        "url",
    )

    def __init__(self, url: str) -> None:
        self.url = url
        self.in_flight = 0
        self.picks = 0
        self.ejected = False
        self.ejected_until = 0.0
        self.not_before = 0.0  # a 429's Retry-After: do not send before this (monotonic seconds)
        self.probing = False
        self.removed = False
        self.timeouts = 0  # calls in a row that outlived request_timeout
        self.dialect: Dialect = DEFAULT  # what it speaks; detected from its model listing (Pool.facts)
        self.facts: Facts | None = None  # its model listing, once read
        self.facts_retry = 0.0  # a listing that did not answer is not asked for again before this (monotonic)
        self.reading: anyio.Event | None = None  # set when the listing being read has answered (or not)


@dataclass(frozen=True, slots=True)
class Facts:
    """What a backend's model listing said: its cards (OpenAI's ``data``) and the dialect they name."""

    dialect: Dialect
    cards: list[Any]


@dataclass(frozen=True, slots=True)
class Held:
    """A retryable upstream answer kept in case no retry does better."""

    status: int
    reason: str | None
    headers: CIMultiDict[str]
    body: bytes


def _retry_after(value: str | None) -> float:
    """Seconds asked by a ``Retry-After`` header (delta-seconds or HTTP date); 0 when absent or unreadable."""
    if not value:
        return 0.0
    try:
        seconds = float(value)
        return seconds if math.isfinite(seconds) and seconds > 0 else 0.0
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, IndexError, OverflowError):
        return 0.0


async def read_bounded(upstream: Response, limit: int, what: str) -> bytes:
    """The whole body of ``upstream``, refused with a 502 naming ``what`` once it passes ``limit`` bytes,
    whether the backend declared its length or sent it in chunks (``read()`` would take any size)."""
    if (upstream.content_length or 0) > limit:
        raise ProxyError(502, f"{what} exceeds max_response_bytes={limit}")
    parts, size = [], 0
    while chunk := await upstream.readany():
        size += len(chunk)
        if size > limit:
            raise ProxyError(502, f"{what} exceeds max_response_bytes={limit}")
        parts.append(chunk)
    return b"".join(parts)


class BoundedEvents:
    """A backend's SSE body read a chunk at a time, bounded like :func:`read_bounded`: :meth:`next` returns
    the payloads of the complete events of the next read (a last event with no blank line after it included)
    and ``None`` once the body ended. A timeout is a 504 with ``timed_out()``'s message; a broken connection
    or a body past ``limit`` bytes is a 502 naming the backend and ``what`` it was sending."""

    def __init__(
        self,
        upstream: Response,
        backend: str,
        what: str,
        limit: int,
        timed_out: Callable[[], str],
    ) -> None:
        self.upstream = upstream
        self.backend, self.what, self.limit, self.timed_out = backend, what, limit, timed_out
        self._cut = EventCut()
        self._size = 0

    async def next(self) -> list[bytes] | None:
        try:
            chunk = await self.upstream.readany()
        except TimeoutError:
            raise ProxyError(504, self.timed_out()) from None
        except (UpstreamError, OSError) as exc:
            raise ProxyError(502, f"backend {self.backend} broke off the {self.what}: {exc!r}") from exc
        if not chunk:
            rest = self._cut.rest()
            if not rest.strip():
                return None
            chunk = rest + b"\n\n"  # a last event with no blank line after it
        self._size += len(chunk)
        if self._size > self.limit:
            raise ProxyError(502, f"backend {self.what} exceeds max_response_bytes={self.limit}")
        return payloads(self._cut.feed(chunk))


def _normalise_backend(url: str) -> str:
    parsed = URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"backend {url!r} must be an absolute http(s) URL such as 'http://host:8000'")
    if parsed.path not in ("", "/") or parsed.query_string or parsed.fragment:
        raise ValueError(
            f"backend {url!r} must be 'http://host:port' with no path (no '/v1'), query or fragment"
        )
    return url.rstrip("/")


class Pool:
    """The backends and how calls are sent to them (see the module docstring)."""

    def __init__(self, config: ProxyConfig, meters: Meters, backends: Sequence[str] = ()) -> None:
        self.config = config
        self.meters = meters
        #: The task group the probes of ejected backends run in (the proxy's, while it serves).
        self.probes: TaskGroup | None = None
        self._backends: list[Backend] = []
        self._sticky: OrderedDict[str, Backend] = OrderedDict()
        self._upstream: Upstream | None = None
        self.set_backends(backends)

    @property
    def backends(self) -> list[str]:
        """The configured backend URLs, in order."""
        return [b.url for b in self._backends]

    @property
    def healthy_backends(self) -> list[str]:
        """The backends currently taking traffic (not ejected)."""
        return [b.url for b in self._backends if not b.ejected]

    def set_backends(self, urls: Sequence[str]) -> None:
        """Replace the backends (``http://host:port``, no ``/v1``); raises ``ValueError`` for anything else.

        A backend kept from the previous list keeps its health and load; calls already running on a removed
        backend finish there, and rollouts pinned to it move on their next call.
        """
        wanted = list(dict.fromkeys(_normalise_backend(u) for u in urls))
        old: dict[str, Backend | None] = {b.url: b for b in self._backends}
        self._backends = [old.pop(url, None) or Backend(url) for url in wanted]
        for gone in old.values():
            if gone is not None:
                gone.removed = True

    def forget(self, rollout_ids: Sequence[str]) -> None:
        """Drop the routing state of rollouts that are over (the store calls this when it forgets them)."""
        for rollout_id in rollout_ids:
            self._sticky.pop(rollout_id, None)

    # ------------------------------------------------------------------ life cycle
    @property
    def is_open(self) -> bool:
        """Whether the upstream client exists (between :meth:`open` and :meth:`close`)."""
        return self._upstream is not None

    @property
    def upstream(self) -> Upstream:
        """The upstream client (the pool must be open)."""
        assert self._upstream is not None, "the pool is not open"
        return self._upstream

    def open(self) -> None:
        """Make the upstream client: connections kept per backend, idle ones ``upstream_keepalive``; no cap on
        them (concurrency is bounded by the agents, and a cap would queue calls invisibly); bodies relayed byte
        for byte (captured calls ask for identity), no cookie kept, nothing but the backends contacted."""
        config = self.config
        self._upstream = Upstream(
            keepalive=config.upstream_keepalive,
            connect_timeout=config.connect_timeout,
            request_timeout=config.request_timeout,  # each try, body included
        )

    async def close(self) -> None:
        """Close the upstream client and its connections (idempotent)."""
        upstream, self._upstream = self._upstream, None
        if upstream is not None:
            await upstream.close()

    def timed_out(self, call: Call) -> str:
        """Note a call that outlived ``request_timeout`` and describe it.

        The rollout is moved off that backend at once (its next call or attempt goes elsewhere), and a backend
        that times out ``EJECT_AFTER_TIMEOUTS`` calls in a row is ejected like one that refuses connections:
        a hung server must not hold on to the rollouts pinned to it while a healthy one idles.
        """
        backend = next((b for b in self._backends if b.url == call.backend), None)
        if backend is not None:
            backend.timeouts += 1
            if backend.timeouts >= EJECT_AFTER_TIMEOUTS:
                self._eject(backend, TimeoutError(f"{backend.timeouts} calls in a row timed out"))
            if call.rollout_id is not None and self._sticky.get(call.rollout_id) is backend:
                others = [b for b in self._backends if b is not backend and not (b.ejected or b.removed)]
                if others:
                    self._sticky[call.rollout_id] = min(others, key=lambda b: (b.in_flight, b.picks))
                else:
                    del self._sticky[call.rollout_id]
        return (
            f"backend {call.backend} did not finish within request_timeout={self.config.request_timeout:g}s"
        )

    def pick(self, rollout_id: str | None, tried: Sequence[Backend]) -> Backend | None:
        """The backend for the next try: the rollout's own while healthy, else the least loaded healthy one."""
        if not self._backends:
            return None
        first = not tried and rollout_id is not None
        if first:
            sticky = self._sticky.get(rollout_id)  # type: ignore[arg-type]
            if sticky is not None and not (
                sticky.ejected or sticky.removed or sticky.not_before > time.monotonic()
            ):
                self._sticky.move_to_end(rollout_id)  # type: ignore[arg-type]
                return sticky
        now = time.monotonic()
        best = min(
            self._backends,
            key=lambda b: (b.ejected, b in tried, b.not_before > now, b.in_flight, b.picks),
        )
        best.picks += 1
        if first:
            self._sticky[rollout_id] = best  # type: ignore[index]
            self._sticky.move_to_end(rollout_id)  # type: ignore[arg-type]
            if len(self._sticky) > STICKY_ROLLOUTS:
                self._sticky.popitem(last=False)
        return best

    async def send(self, backend: Backend, call: Call, continuation: bytes | None = None) -> Response:
        """Send the request to ``backend`` and return its response head; :class:`Unreachable` if none came.

        ``continuation``: send this body to the backend dialect's continuation route instead (an aborted
        generation's continuation).
        """
        assert self._upstream is not None
        call.backend = backend.url
        call.dialect = backend.dialect
        if continuation is None:
            call.upstream_start = time.monotonic()
            method, target, body = call.method, call.target, call.body or None
        else:
            method, target, body = "POST", backend.dialect.continuation_target, continuation
        try:
            upstream = await self._upstream.request(method, backend.url, target, call.headers.items(), body)
        except TimeoutError:  # request_timeout before the response head (an OSError too: caught first)
            raise ProxyError(504, self.timed_out(call)) from None
        except ConnectError as exc:
            self._eject(backend, exc)
            raise Unreachable(f"backend {backend.url} is unreachable: {exc}") from exc
        except RemoteProtocolError as exc:  # the backend is not speaking HTTP as it must
            raise ProxyError(502, f"backend {backend.url} sent no valid HTTP response: {exc}") from exc
        except (ReadError, OSError) as exc:
            # Typically a kept connection the server closed just as it was reused: worth another try (nothing
            # of the answer reached the agent). A body broken before the head was returned is one too.
            raise Unreachable(
                f"backend {backend.url} closed the connection without answering: {exc}"
            ) from exc
        backend.timeouts = 0
        if backend.ejected:
            self._restore(backend)
        return upstream

    async def keep(self, backend: Backend, upstream: Response) -> Held:
        """Keep a retryable answer (bounded) and free its connection; note a 429's ``Retry-After``."""
        try:
            if upstream.status == 429:
                backend.not_before = time.monotonic() + _retry_after(upstream.headers.get("Retry-After"))
            length = upstream.content_length
            body = b""
            if length is not None and length <= ERROR_BODY_LIMIT:
                try:
                    body = await upstream.read()
                except (UpstreamError, OSError, TimeoutError):
                    body = b""
            headers = forward_headers(upstream.headers, RESPONSE_DROP)
            if not body:
                body = error_body(upstream.status, f"backend {backend.url} answered {upstream.status}")
                headers["Content-Type"] = JSON
            logger.debug("backend %s answered %d; retrying", backend.url, upstream.status)
            return Held(upstream.status, upstream.reason, headers, body)
        finally:
            upstream.close()

    async def dialect(self, backend: Backend) -> Dialect:
        """What ``backend`` speaks: detected from its model listing at the first contact that needs it (a
        recorded call's first try there), once; a listing that does not answer leaves :data:`DEFAULT` (logged),
        asked for again after ``eject_seconds``."""
        if backend.facts is not None or time.monotonic() < backend.facts_retry:
            return backend.dialect
        try:
            await self.facts(backend)
        except Unreachable as exc:
            backend.facts_retry = time.monotonic() + self.config.eject_seconds
            logger.warning(
                "backend %s did not answer its model listing (%s): taken to speak %s until it does",
                backend.url,
                exc,
                backend.dialect.name,
            )
        return backend.dialect

    async def facts(self, backend: Backend) -> Facts:
        """``backend``'s model listing (its dialect's ``models_path``), read once (concurrent callers share the
        read): the cards and the dialect they name, which becomes the backend's. :class:`Unreachable` when it
        did not answer (its message is the error's ``repr``; asked again next time); a listing that is not
        OpenAI-shaped counts as no cards."""
        while backend.facts is None and backend.reading is not None:
            await backend.reading.wait()
        if backend.facts is not None:
            return backend.facts
        reading = backend.reading = anyio.Event()
        target = backend.dialect.models_path
        try:
            auth = self.config.backend_auth  # a backend with a key asks it for its listing too (vLLM's /v1/*)
            headers = {"Authorization": auth} if auth is not None else None
            _, raw = await self.upstream.get(backend.url, target, headers.items() if headers else None)
            listing = orjson.loads(raw)
        except (UpstreamError, OSError, TimeoutError, ValueError) as exc:
            raise Unreachable(repr(exc)) from exc
        finally:
            backend.reading = None
            reading.set()
        cards = listing.get("data") if isinstance(listing, dict) else None
        cards = cards if isinstance(cards, list) else []
        backend.dialect = detect(cards)
        backend.facts = Facts(backend.dialect, cards)
        return backend.facts

    async def context_window(self, backend: Backend, model: str | None) -> int | None:
        """``backend``'s context window for ``model`` (``None`` when its listing does not say);
        :class:`Unreachable` when it did not answer."""
        facts = await self.facts(backend)
        return facts.dialect.context_window(facts.cards, model)

    def _eject(self, backend: Backend, exc: BaseException) -> None:
        if backend.ejected or backend.removed:
            return
        backend.ejected = True
        backend.ejected_until = time.monotonic() + self.config.eject_seconds
        self.meters.ejections.inc()
        logger.warning("backend %s ejected for %gs: %s", backend.url, self.config.eject_seconds, exc)
        if self.probes is not None and not backend.probing:
            backend.probing = True
            self.probes.start_soon(self._probe, backend)

    def _restore(self, backend: Backend) -> None:
        if backend.ejected:
            backend.ejected = False
            logger.info("backend %s is back in rotation", backend.url)

    async def _probe(self, backend: Backend) -> None:
        """Sleep until the ejection ends, probe; repeat until a probe passes or the backend is removed."""
        try:
            while backend.ejected and not backend.removed:
                await anyio.sleep(max(0.0, backend.ejected_until - time.monotonic()))
                if not backend.ejected or backend.removed:
                    break
                if await self._probe_once(backend):
                    self._restore(backend)
                else:
                    backend.ejected_until = time.monotonic() + self.config.eject_seconds
        finally:
            backend.probing = False

    async def _probe_once(self, backend: Backend) -> bool:
        upstream = self._upstream
        if upstream is None:
            return False
        try:
            with anyio.fail_after(self.config.connect_timeout + PROBE_READ_TIMEOUT):
                status, _ = await upstream.get(backend.url, backend.dialect.health_path)
                return status == 200
        except (UpstreamError, OSError, TimeoutError, ValueError):
            return False
