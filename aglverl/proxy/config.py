"""The proxy's settings as one frozen value every part holds, and the retry policy.

:class:`ProxyConfig` holds what :class:`~aglverl.proxy.LLMProxy` is configured with (timeouts, limits, the
agents' token, the backends' key, the sampling rule, token-in chat); the proxy hands the same value to each part
that uses it (the gate, the pool, the relay, the resumer, token-in, the admission), as ``uvicorn.Config`` is
handed to its ``Server``, and a proxy shard gets it whole in its Ray actor. It never changes: a proxy that must
run on other settings gets a new value (:meth:`LLMProxy.reconfigure <aglverl.proxy.LLMProxy.reconfigure>`), which
it hands to every part. Nothing here awaits anything or does I/O; a ``sampling_mismatch`` other than
``"refuse"`` or ``"mask"`` raises ``ValueError`` at construction.

:class:`RetryPolicy` is data kept apart from the code that retries (:class:`~aglverl.proxy.relay.Relay` and the
resumption of aborted generations read it).
"""

from __future__ import annotations

import difflib
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Generic, Literal, Protocol, TypedDict, TypeVar, Unpack, overload

from .http import Limits
from .overload import OverloadPolicy

__all__ = [
    "ALIASES",
    "POLICY_FIELDS",
    "PROXY_FIELDS",
    "UPSTREAM_KEEPALIVE",
    "ProxyConfig",
    "ProxyPolicySettings",
    "ProxySettings",
    "RetryPolicy",
    "SamplingMismatch",
    "SamplingOf",
    "with_aliases",
]

#: Idle seconds a pooled upstream connection is kept: below uvicorn's (vLLM's) 5 s keep-alive, so the proxy
#: drops an idle connection before the server does and never sends a request into one being closed.
UPSTREAM_KEEPALIVE = 4.0

#: The default of ``pause_timeout`` and of ``hold_timeout`` (seconds).
PAUSE_TIMEOUT = 600.0

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


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxyConfig:
    """What the proxy is configured with (see :class:`~aglverl.proxy.LLMProxy` for each setting's meaning).

    The one place a proxy setting is declared: ``LLMProxy``'s keywords, ``AgentDaemon``'s and a run's
    ``aglverl.proxy:`` section (:meth:`from_mapping`) all take exactly these fields, by these names (a new
    setting is a field here and its line in :class:`ProxySettings`). ``token`` and ``backend_api_key`` are
    kept out of the value's ``repr``. Derived at construction: ``auth``, the header value agents must send
    (``Bearer <token>``, bytes, compared in constant time; ``None``: no token), and ``backend_auth``, the
    ``Authorization`` value sent to the backends (``None``: none). ``hold_timeout`` here is its own setting
    (default 600 s); the keywords of ``LLMProxy`` and ``AgentDaemon`` read a ``hold_timeout`` left out or
    ``None`` as ``pause_timeout`` (:meth:`from_settings`). ``max_body_bytes`` bounds a request's body (413
    beyond it; ``max_request_bytes`` is its old name, still taken as a keyword). ``max_header_lines``,
    ``max_line_bytes``, ``head_timeout``, ``idle_timeout``, ``max_connections`` (and ``max_body_bytes``) are the
    HTTP server's limits (:class:`~aglverl.proxy.http.Limits`, which checks them when the config is made:
    a value that is not one is a ``ValueError`` naming it).
    ``responses_per_attempt`` and ``response_bytes_per_attempt`` bound the Responses API's stored responses of
    each rollout attempt (:mod:`~aglverl.proxy.api.response_store`; the least recently used dropped past
    them; 0 responses: none kept), an integer >= 0 each (``ValueError`` otherwise).
    """

    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = field(default=None, repr=False)
    backend_api_key: str | None = field(default=None, repr=False)
    retry: RetryPolicy = RetryPolicy()  # frozen: one shared default instance is safe
    request_timeout: float = 600.0
    connect_timeout: float = 5.0
    max_body_bytes: int = 32 << 20
    max_response_bytes: int = 256 << 20
    eject_seconds: float = 5.0
    pause_timeout: float = PAUSE_TIMEOUT
    hold_timeout: float = PAUSE_TIMEOUT
    shutdown_grace: float = 5.0
    upstream_keepalive: float = UPSTREAM_KEEPALIVE
    request_logprobs: bool = False
    sampling_mismatch: SamplingMismatch = "refuse"
    token_in: bool = True
    max_header_lines: int = 128
    max_line_bytes: int = 8190
    head_timeout: float = 20.0
    idle_timeout: float = 75.0
    max_connections: int = 8192
    responses_per_attempt: int = 256
    response_bytes_per_attempt: int = 32 << 20
    overload: OverloadPolicy = field(default_factory=OverloadPolicy)
    auth: bytes | None = field(init=False, repr=False, compare=False)
    backend_auth: str | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.sampling_mismatch not in ("refuse", "mask"):
            raise ValueError(f"sampling_mismatch must be 'refuse' or 'mask', got {self.sampling_mismatch!r}")
        self.limits()  # the HTTP server's: a value that is not one is a ValueError naming it, now
        for name in ("responses_per_attempt", "response_bytes_per_attempt"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        object.__setattr__(self, "auth", None if self.token is None else f"Bearer {self.token}".encode())
        key = self.backend_api_key
        object.__setattr__(self, "backend_auth", None if key is None else f"Bearer {key}")

    def limits(self) -> Limits:
        """The HTTP server's limits these settings make (:class:`~aglverl.proxy.http.Limits`)."""
        return Limits(
            max_header_lines=self.max_header_lines,
            max_line_bytes=self.max_line_bytes,
            head_timeout=self.head_timeout,
            idle_timeout=self.idle_timeout,
            max_connections=self.max_connections,
            max_body_bytes=self.max_body_bytes,
        )

    @property
    def max_request_bytes(self) -> int:
        """The old name of :attr:`max_body_bytes`."""
        return self.max_body_bytes

    @classmethod
    def from_settings(cls, **settings: Unpack[ProxySettings]) -> ProxyConfig:
        """The config the keywords of :class:`~aglverl.proxy.LLMProxy` (and ``AgentDaemon``'s proxy keywords)
        describe: as the constructor, except that a ``hold_timeout`` left out or ``None`` is ``pause_timeout``
        and ``max_request_bytes`` is taken for ``max_body_bytes``."""
        values: dict[str, Any] = with_aliases(settings)
        if values.get("hold_timeout") is None:
            values["hold_timeout"] = values.get("pause_timeout", PAUSE_TIMEOUT)
        return cls(**values)

    def settings(self) -> dict[str, Any]:
        """The config's settings by name (what :meth:`from_settings` takes back)."""
        return {name: getattr(self, name) for name in PROXY_FIELDS}

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None, **defaults: Any) -> ProxyConfig:
        """The config a section of plain data describes (a run's ``aglverl.proxy:``, YAML or a dict): its keys
        are the fields (``max_request_bytes`` taken for ``max_body_bytes``), ``retry`` and ``overload`` are
        mappings of :class:`RetryPolicy`'s and :class:`~aglverl.proxy.overload.OverloadPolicy`'s fields (or such
        values), ``defaults`` fill in what the section leaves out, and a ``hold_timeout`` still left out (or
        ``null``) is ``pause_timeout``, as for keywords. An unknown key is a ``ValueError`` naming it (and the
        field it is close to); a bad value raises what the classes raise."""
        merged: dict[str, Any] = {**defaults, **with_aliases(values or {})}
        if merged.get("hold_timeout") is None:
            merged["hold_timeout"] = merged.get("pause_timeout", PAUSE_TIMEOUT)
        _refuse_unknown(merged, PROXY_FIELDS, "")
        for name, policy in (("retry", RetryPolicy), ("overload", OverloadPolicy)):
            value = merged.get(name)
            if isinstance(value, Mapping):
                _refuse_unknown(value, {f.name for f in fields(policy)}, f"{name}.")
                merged[name] = policy(**value)
        return cls(**merged)


def with_aliases(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with the settings' old names (:data:`ALIASES`) under their names now; both given: an error."""
    out = dict(values)
    for old, new in ALIASES.items():
        if old in out:
            if new in out:
                raise ValueError(f"{old} is the old name of {new}: give one of them")
            out[new] = out.pop(old)
    return out


def _refuse_unknown(values: Mapping[str, Any], known: Iterable[str], prefix: str) -> None:
    known = sorted(known)
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown proxy setting {prefix + str(key)!r}{hint}")


class ProxyPolicySettings(TypedDict, total=False):
    """:class:`ProxyConfig`'s fields but where the proxy listens and its token, as keywords (``AgentDaemon``
    takes these as they are: its ``host``, ``port`` and ``token`` are the task server's too)."""

    backend_api_key: str | None
    retry: RetryPolicy
    request_timeout: float
    connect_timeout: float
    max_body_bytes: int
    max_request_bytes: int  # the old name of max_body_bytes
    max_response_bytes: int
    eject_seconds: float
    pause_timeout: float
    hold_timeout: float | None
    shutdown_grace: float
    upstream_keepalive: float
    request_logprobs: bool
    sampling_mismatch: SamplingMismatch
    token_in: bool
    max_header_lines: int
    max_line_bytes: int
    head_timeout: float
    idle_timeout: float
    max_connections: int
    responses_per_attempt: int
    response_bytes_per_attempt: int
    overload: OverloadPolicy


class ProxySettings(ProxyPolicySettings, total=False):
    """:class:`ProxyConfig`'s fields as keywords (``LLMProxy(store, pause_timeout=30)``).
    ``tests/test_proxy_parts.py`` checks that they are the config's fields, one for one."""

    host: str
    port: int
    token: str | None


#: The settings' old names, and the names they have now.
ALIASES: Mapping[str, str] = {"max_request_bytes": "max_body_bytes"}
#: The names of the proxy's settings (:class:`ProxyConfig`'s fields that are set, not derived).
PROXY_FIELDS: frozenset[str] = frozenset(f.name for f in fields(ProxyConfig) if f.init)
#: Of those, what ``AgentDaemon`` takes by the same name (its ``host``, ``port``, ``token`` are the task server's).
POLICY_FIELDS: frozenset[str] = PROXY_FIELDS - {"host", "port", "token"}


class _Configured(Protocol):
    @property
    def config(self) -> ProxyConfig: ...


T = TypeVar("T")


class _Setting(Generic[T]):
    """A setting of the :class:`ProxyConfig` an object holds (as ``config``), read as an attribute of the object
    (``proxy.pause_timeout``). Assigning one raises ``AttributeError`` naming the way to change it: the config
    is frozen, and a new one goes to every part at once (``proxy.reconfigure(pause_timeout=...)``)."""

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
        value: T = getattr(obj.config, self.name)
        return value

    def __set__(self, obj: _Configured, value: T) -> None:
        raise AttributeError(
            f"{self.name} is a setting of the proxy's frozen ProxyConfig: use "
            f"proxy.reconfigure({self.name}=...) to change it for every part at once"
        )
