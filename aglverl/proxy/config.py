"""The proxy's settings, one object every part reads as it goes, and the retry policy.

:class:`ProxyConfig` holds what :class:`~aglverl.proxy.LLMProxy` was configured with (timeouts, limits, the
agents' token, the backends' key, the sampling rule). The parts hold the same instance and read a setting when
they use it, so a setting changed on the proxy (``proxy.pause_timeout = 1.0``, through :class:`_Setting`) holds
for every part from the next use on. Nothing here awaits anything or does I/O; constructing a config with a
``sampling_mismatch`` other than ``"refuse"`` or ``"mask"`` raises ``ValueError``.

:class:`RetryPolicy` is data kept apart from the code that retries (:class:`~aglverl.proxy.relay.Relay` and the
resumption of aborted generations read it).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar, overload

__all__ = ["UPSTREAM_KEEPALIVE", "ProxyConfig", "RetryPolicy", "SamplingMismatch", "SamplingOf"]

#: Idle seconds a pooled upstream connection is kept: below uvicorn's (vLLM's) 5 s keep-alive, so the proxy
#: drops an idle connection before the server does and never sends a request into one being closed.
UPSTREAM_KEEPALIVE = 4.0

SamplingMismatch = Literal["refuse", "mask"]
#: ``sampling_of(rollout_id)``: the sampling parameters a rollout's trainer expects (``None``: unchecked).
SamplingOf = Callable[[str], "Mapping[str, Any] | None"]


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How hard the proxy tries before the first byte reaches the agent.

    ``attempts`` upstream tries per call, across backends. ``total_timeout`` is the budget, from the call's
    arrival, within which a retry may still start (a backoff or ``Retry-After`` that would end past it is not
    waited for: the last failure is returned instead); a single try is bounded by the proxy's
    ``request_timeout``, since a non-streamed generation sends nothing until it is done. Retry ``k`` (1-based)
    waits ``min(backoff_max, backoff_initial * 2**(k-1))`` reduced by a random fraction up to ``jitter``.
    """

    attempts: int = 3
    total_timeout: float = 30.0
    backoff_initial: float = 0.05
    backoff_max: float = 2.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.total_timeout < 0 or self.backoff_initial < 0 or self.backoff_max < 0:
            raise ValueError("RetryPolicy needs attempts >= 1 and non-negative times")
        if not 0 <= self.jitter <= 1:
            raise ValueError("RetryPolicy.jitter is a fraction in [0, 1]")

    def backoff(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1-based)."""
        delay = min(self.backoff_max, self.backoff_initial * 2 ** (retry - 1))
        return delay * (1.0 - self.jitter * random.random())


@dataclass(slots=True, kw_only=True, eq=False)
class ProxyConfig:
    """What the proxy was configured with (see :class:`~aglverl.proxy.LLMProxy` for each setting's meaning).

    ``auth`` is the header value agents must send (``Bearer <token>``, bytes, compared in constant time; ``None``:
    no token); ``backend_auth`` the ``Authorization`` value sent to the backends (``None``: none).
    """

    host: str = "127.0.0.1"
    port: int = 0
    retry: RetryPolicy = RetryPolicy()  # frozen: one shared default instance is safe
    request_timeout: float = 600.0
    connect_timeout: float = 5.0
    max_request_bytes: int = 32 << 20
    max_response_bytes: int = 256 << 20
    eject_seconds: float = 5.0
    pause_timeout: float = 600.0
    hold_timeout: float = 600.0
    shutdown_grace: float = 5.0
    upstream_keepalive: float = UPSTREAM_KEEPALIVE
    request_logprobs: bool = False
    sampling_of: SamplingOf | None = None
    sampling_mismatch: SamplingMismatch = "refuse"
    auth: bytes | None = None
    backend_auth: str | None = None

    def __post_init__(self) -> None:
        if self.sampling_mismatch not in ("refuse", "mask"):
            raise ValueError(f"sampling_mismatch must be 'refuse' or 'mask', got {self.sampling_mismatch!r}")


class _Configured(Protocol):
    _config: ProxyConfig


T = TypeVar("T")


class _Setting(Generic[T]):
    """A setting of :class:`ProxyConfig` as an attribute of the object that holds the config (as ``_config``):
    reading and writing go to the config, so that every part holding it sees a change at once."""

    __slots__ = ("name",)

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> _Setting[T]: ...

    @overload
    def __get__(self, obj: _Configured, owner: type) -> T: ...

    def __get__(self, obj: _Configured | None, owner: type) -> T | _Setting[T]:
        if obj is None:
            return self
        value: T = getattr(obj._config, self.name)
        return value

    def __set__(self, obj: _Configured, value: T) -> None:
        setattr(obj._config, self.name, value)
